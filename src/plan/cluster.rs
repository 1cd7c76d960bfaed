//! The cluster the planner places ranks on: hosts, their hardware figures and their
//! topology. Pure data; `crate::inventory` builds it from `local`, an inventory or a shorthand,
//! and [`calibrate`] puts a `--calibration` measurement in it.
//!
//! A host computes on its GPUs (one rank per GPU) or on its CPU. A CPU host is **one device
//! that its ranks share**: `r` ranks on it each get `1/r` of its cores (as `infer up` gives
//! each rank `cores / r` threads), of its memory, of its memory bandwidth and of its compute
//! rate, and talk through shared memory. Its rank slots are a choice, not a fixed count: at
//! most one per core (or the inventory's `cpu-ranks`), and the planner tries every count
//! ([`Cluster::with_cpu_ranks`] is the cluster as it looks with `r` ranks on each CPU host).

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::calibration::{Calibration, DecodeReport, MeasuredDecode, Measurement, Scope};
use super::cost::TCP_GB_PER_SEC;
use crate::topology::{CpuProfile, Host};

/// What a cluster's ranks compute on. `--json` `device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// One rank per GPU.
    #[default]
    Gpu,
    /// Rank processes on the hosts' CPUs, sharing each host's memory, bandwidth and cores.
    Cpu,
}

/// The hardware profile id of a CPU host (`hardware_id`): its figures are probed, not a
/// profile file's.
pub(crate) const CPU_HARDWARE_ID: &str = "cpu";

/// A host whose ranks run on its CPU: its probed (or calibrated) figures, the most ranks it
/// takes, and how many this view of the cluster puts on it.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuHost {
    /// The whole host's figures ([`crate::topology::cpu::probe_cpu`], or a calibration's).
    pub profile: CpuProfile,
    /// Most CPU ranks it takes: its cores, or the inventory's `cpu-ranks`. At least 1.
    pub max_ranks: u64,
    /// Ranks on it in this view of the cluster, 1 to `max_ranks`; the host's
    /// [`ClusterHost::hardware`] is one of them ([`cpu_rank_hardware`]).
    pub ranks: u64,
}

/// Bytes of memory traffic per byte a shared-memory all-reduce carries: each rank writes its
/// buffer into the segment, reads every member's, and writes and reads the sum back — four
/// passes, so the link's bus bandwidth is the memory bandwidth over 4. `infer bench allreduce
/// --world 2` on a 2-core Xeon VM that reads memory at 10–12 GB/s measured 2.0–2.4 GB/s.
pub(crate) const SHM_TRAFFIC_PER_BYTE: f64 = 4.0;

/// The figures of one of `ranks` CPU ranks of a host with `profile`: `1/ranks` of its memory;
/// of the rate its engine reads weights at in a decode step (`hbm_gb_per_sec`:
/// [`CpuProfile::weight_read_bytes_per_sec`]), of its attention's ([`CpuAttention`], on
/// `cores / ranks` threads) and of its compute rate (`bf16_tflops` and `fp8_tflops`: the CPU
/// engine computes quantized products in f32 whatever the dtype), up to one rank per core,
/// what its threads do ([`rank_rate`] with the profile's one-thread figures, the prompt
/// rates' from [`CpuProfile::prefill_one_thread_share`]; the weights within `1/ranks` of
/// the memory's bandwidth), and beyond, what one thread does for one of its `⌈ranks /
/// cores⌉` turns of the cores ([`rate_share`] without one-thread figures); how
/// much faster a rank works while its TP group waits on it ([`CpuRowChain`]); no NVLink; its
/// shared-memory link as `pcie_gb_per_sec` ([`SHM_TRAFFIC_PER_BYTE`]); TCP sockets between
/// hosts (the CPU ranks' collectives use no RDMA) as `nic_gb_per_sec`.
pub(crate) fn cpu_rank_hardware(profile: &CpuProfile, ranks: u64) -> HardwareSpec {
    let cores = profile.n_cores.max(1);
    let threads = (cores / ranks.max(1)).max(1);
    let ranks = ranks.max(1);
    let share = rate_share(ranks, cores);
    // A rate of the whole host (`all`; `alone` on one thread) as one rank gets it: what its
    // threads do, within `cap`, for one of its turns of the cores.
    let turns = ranks.div_ceil(cores) as f64;
    let rate =
        |all: f64, alone: Option<f64>, cap: f64| rank_rate(all, alone, threads, cores, cap) / turns;
    // A prompt rate of the whole host, as one rank computes it.
    let prompt_rate = |all: f64| {
        let alone = profile.prefill_one_thread_share.map(|part| part * all);
        rate(all, alone, f64::INFINITY)
    };
    HardwareSpec {
        name: profile.name.clone(),
        memory_bytes: (profile.memory_bytes as f64 / ranks as f64) as u64,
        hbm_gb_per_sec: rate(
            profile.weight_read_bytes_per_sec(),
            profile.decode_one_thread_bytes_per_sec,
            profile.memory_bytes_per_sec / ranks.min(cores) as f64,
        ) / 1e9,
        bf16_tflops: prompt_rate(profile.flops_per_sec) / 1e12,
        fp8_tflops: prompt_rate(profile.flops_per_sec) / 1e12,
        nvlink_gb_per_sec: 0.0,
        nvlink_domain_size: 1,
        bf16_weights_gb_per_sec: profile
            .decode_bf16_bytes_per_sec
            .map(|all| rate(all, None, f64::INFINITY) / 1e9),
        bf16_products_tflops: profile
            .prefill_bf16_flops_per_sec
            .map(|all| prompt_rate(all) / 1e12),
        cpu_layer_secs: profile
            .decode_layer_secs
            .map(|secs| rank_layer_secs(secs, ranks, cores)),
        cpu_attention: profile
            .decode_attention_flops_per_sec
            .map(|all| CpuAttention {
                flops_per_sec: rate(
                    all,
                    profile.decode_one_thread_attention_flops_per_sec,
                    f64::INFINITY,
                ),
                threads,
            }),
        cpu_prefill_attention_flops_per_sec: profile
            .prefill_attention_flops_per_sec
            .map(prompt_rate),
        cpu_row_chain: Some(CpuRowChain {
            alone_speedup: (threads as f64 * share / cores as f64).max(1.0),
            ranks_outnumber_cores: ranks > cores,
        }),
        pcie_gb_per_sec: profile.memory_bytes_per_sec / SHM_TRAFFIC_PER_BYTE / 1e9,
        nic_gb_per_sec: TCP_GB_PER_SEC,
        sources: vec![profile.source.clone()],
    }
}

/// A rank's rate of `threads` threads out of `cores`, from a rate measured on all cores
/// (`all`) and, where measured, on one thread alone (`alone`): `threads` times a per-thread
/// rate that runs linearly from `alone` at one thread to `all / cores` at all of them (a
/// team pays hand-offs between its threads that a thread alone does not), at most `cap` (the
/// rank's share of what the memory delivers to every core at once), never below the fair
/// share `all · threads / cores`, and never above `all` (a noisy one-thread figure cannot
/// make a part of the host faster than all of it). Without `alone`, the fair share.
pub(crate) fn rank_rate(all: f64, alone: Option<f64>, threads: u64, cores: u64, cap: f64) -> f64 {
    let cores = cores.max(1);
    let threads = threads.clamp(1, cores);
    let fair = all * threads as f64 / cores as f64;
    match alone {
        Some(alone) if cores > 1 => {
            let along = (threads - 1) as f64 / (cores - 1) as f64;
            let per_thread = alone + along * (all / cores as f64 - alone);
            (threads as f64 * per_thread).min(cap).max(fair).min(all)
        }
        _ => fair,
    }
}

/// A rank's fixed cost per decoder layer, seconds, from `host_layer_secs` measured on the
/// whole host: the same on however many threads (the layer probe's 32 tiny layers took
/// 13–15 µs each on 2 threads of a 2-core EPYC and 10–14 on one), and `⌈ranks / cores⌉`
/// times it when ranks outnumber cores and take turns of them ([`rate_share`]).
pub(crate) fn rank_layer_secs(host_layer_secs: f64, ranks: u64, cores: u64) -> f64 {
    host_layer_secs * ranks.max(1).div_ceil(cores.max(1)) as f64
}

/// What a CPU rank's rates are its host's divided by, with `ranks` ranks on `cores` cores:
/// `ranks`, or, when ranks outnumber cores, `⌈ranks / cores⌉ · cores`: each rank has one
/// thread, and a phase in which every rank computes (between two collectives, far shorter
/// than a scheduler time slice) runs the ranks to completion in `⌈ranks / cores⌉` turns of
/// the cores (3 ranks on 2 cores: two turns, each rank at a core's rate, 1/4 of the host's).
pub(crate) fn rate_share(ranks: u64, cores: u64) -> f64 {
    let (ranks, cores) = (ranks.max(1), cores.max(1));
    if ranks > cores {
        (ranks.div_ceil(cores) * cores) as f64
    } else {
        ranks as f64
    }
}

/// Per-GPU hardware figures from `profiles/hardware/<id>.toml`. Bandwidths are dense
/// datasheet figures; each profile file names its sources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct HardwareSpec {
    /// Marketing name.
    pub name: String,
    /// Device memory in bytes, as `nvidia-smi` reports `memory.total`.
    pub memory_bytes: u64,
    /// Peak HBM (or GDDR) bandwidth, GB/s (10⁹ bytes per second).
    pub hbm_gb_per_sec: f64,
    /// Dense bf16 tensor throughput, TFLOP/s.
    pub bf16_tflops: f64,
    /// Dense fp8 tensor throughput, TFLOP/s (the bf16 figure on GPUs without fp8 units).
    pub fp8_tflops: f64,
    /// The rate bf16 and fp16 weights are read at in a decode step, GB/s, where it is not
    /// `hbm_gb_per_sec`: a CPU rank's (the CPU engine's bf16 products are bound by compute,
    /// not memory); absent for GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_weights_gb_per_sec: Option<f64>,
    /// The rate bf16 and fp16 products compute at, TFLOP/s, where it is not `bf16_tflops`: a
    /// CPU rank's share of [`CpuProfile::prefill_bf16_flops_per_sec`] (the CPU engine
    /// converts each weight to f32); absent for GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_products_tflops: Option<f64>,
    /// Seconds each decoder layer of a one-sequence decode step costs a CPU rank beyond its
    /// weights' bytes ([`rank_layer_secs`] of [`CpuProfile::decode_layer_secs`]); absent
    /// for GPUs, and for CPU ranks after a calibration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_layer_secs: Option<f64>,
    /// How fast a CPU rank's decode attention goes through the KV cache; absent for GPUs,
    /// whose attention reads it at `hbm_gb_per_sec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_attention: Option<CpuAttention>,
    /// A CPU rank's prefill attention rate, flops/s: its share of
    /// [`CpuProfile::prefill_attention_flops_per_sec`], as of its compute rate; absent for
    /// GPUs, whose prompts attend at `bf16_tflops`, and where not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_prefill_attention_flops_per_sec: Option<f64>,
    /// How a CPU rank's tensor parallelism runs its row-parallel products; absent for GPUs,
    /// whose TP all-reduces partial sums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_row_chain: Option<CpuRowChain>,
    /// NVLink bandwidth per GPU, GB/s, both directions together; 0 when there is none.
    pub nvlink_gb_per_sec: f64,
    /// GPUs that share one NVLink domain in the standard server (8 on NVSwitch boards, 1 without NVLink).
    pub nvlink_domain_size: u64,
    /// PCIe bandwidth per GPU, one direction, GB/s.
    pub pcie_gb_per_sec: f64,
    /// Inter-node network bandwidth per GPU, one direction, GB/s (a 400 Gb/s NIC is 50).
    pub nic_gb_per_sec: f64,
    /// Where these figures come from.
    pub sources: Vec<String>,
}

/// A CPU rank's decode attention: the CPU engine scores and weighs each cached position
/// for each query head at a rate of its own ([`CpuProfile::decode_attention_flops_per_sec`]),
/// a small fraction of its matrix products', on the rank's threads.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct CpuAttention {
    /// Attention flops per second with all its threads busy
    /// ([`CpuProfile::decode_attention_flops_per_sec`] over the host's ranks).
    pub flops_per_sec: f64,
    /// The rank's threads: a layer's attention runs one task per (sequence, KV head) on them
    /// ([`crate::topology::cpu::attention_occupancy`]).
    pub threads: u64,
}

/// The CPU engine's exact-order tensor parallelism: with integer-kernel weights (`Q4_0`,
/// `Q4_1`, `Q8_0`), each row-parallel product (attention output, MLP down) runs on one TP
/// rank after another, each continuing the previous rank's dot products, so that TP
/// generates exactly the tokens of one process (`runtime::model::llama::row_parallel`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct CpuRowChain {
    /// How much faster a rank reads and computes while the rest of its TP group waits on it
    /// than while every rank of its host runs: its threads' share of the host's cores over
    /// its share of the ranks, `threads · ranks / cores` (1 unless ranks outnumber cores,
    /// when each rank has one thread and a waiting rank leaves its core to the one working).
    pub alone_speedup: f64,
    /// Whether the host's ranks outnumber its cores: its ranks' waits then sleep at once
    /// instead of spinning, and each hop of the chain costs a wake-up
    /// ([`SHM_SLEEPING_MESSAGE_SECS`](super::cost::SHM_SLEEPING_MESSAGE_SECS)).
    #[serde(default)]
    pub ranks_outnumber_cores: bool,
}

/// One host of a cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterHost {
    /// Host name as ranks and the NCCL env are keyed (`gpu-node-1`, `node0`).
    pub name: String,
    /// Address to reach it (SSH, `MASTER_ADDR`); `None` for synthetic shorthand hosts.
    pub address: Option<String>,
    /// Hardware profile id (`h100-sxm`).
    pub hardware_id: String,
    /// Figures of its GPUs.
    pub hardware: HardwareSpec,
    /// Its GPUs, link matrix, NVLink domains and NICs (probed, imported or synthesized).
    pub topology: Host,
    /// Its CPU, when its ranks run there (then `hardware` is one CPU rank's figures and
    /// `topology` has no GPUs); `None` for a GPU host.
    pub cpu: Option<CpuHost>,
}

impl ClusterHost {
    /// A CPU host: `max_ranks` rank slots on a CPU of `profile`, all of them in use, with
    /// `topology` for its name and NICs.
    pub fn cpu(
        name: String,
        address: Option<String>,
        profile: CpuProfile,
        max_ranks: u64,
        topology: Host,
    ) -> ClusterHost {
        let max_ranks = max_ranks.max(1);
        ClusterHost {
            name,
            address,
            hardware_id: CPU_HARDWARE_ID.to_string(),
            hardware: cpu_rank_hardware(&profile, max_ranks),
            topology,
            cpu: Some(CpuHost {
                profile,
                max_ranks,
                ranks: max_ranks,
            }),
        }
    }

    /// Rank slots: its GPUs, or the CPU ranks of this view.
    pub(crate) fn n_slots(&self) -> u64 {
        match &self.cpu {
            Some(cpu) => cpu.ranks,
            None => self.topology.gpus.len() as u64,
        }
    }
}

/// Every host the plan may use, in rank order.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// How the user named it (`2x8xh100-sxm`, `local`, a file path).
    pub description: String,
    pub hosts: Vec<ClusterHost>,
    /// Measured links that replace the datasheet figures (`--calibration`).
    pub measured: Calibration,
}

impl Cluster {
    /// GPUs across all hosts: the devices ranks are placed on (on CPU hosts, the CPU rank
    /// slots of this view).
    pub fn n_gpus(&self) -> u64 {
        self.hosts.iter().map(ClusterHost::n_slots).sum()
    }

    /// GPUs (or CPU rank slots) of the smallest host: the most a TP group can use without
    /// crossing hosts.
    pub fn min_gpus_per_host(&self) -> u64 {
        self.hosts
            .iter()
            .map(ClusterHost::n_slots)
            .min()
            .unwrap_or(0)
    }

    /// What the ranks compute on: the CPU when any host's ranks run there (an inventory does
    /// not mix CPU and GPU hosts).
    pub fn device(&self) -> Device {
        if self.hosts.iter().any(|h| h.cpu.is_some()) {
            Device::Cpu
        } else {
            Device::Gpu
        }
    }

    /// The most CPU ranks every CPU host takes (the smallest `max_ranks`); 0 without CPU hosts.
    pub fn max_cpu_ranks_per_host(&self) -> u64 {
        self.hosts
            .iter()
            .filter_map(|h| h.cpu.as_ref().map(|c| c.max_ranks))
            .min()
            .unwrap_or(0)
    }

    /// This cluster with `ranks` CPU ranks on every CPU host (capped at its `max_ranks`), each
    /// with `1/ranks` of the host ([`cpu_rank_hardware`]); GPU hosts unchanged.
    pub fn with_cpu_ranks(&self, ranks: u64) -> Cluster {
        let mut view = self.clone();
        for host in &mut view.hosts {
            if let Some(cpu) = &mut host.cpu {
                cpu.ranks = ranks.clamp(1, cpu.max_ranks);
                host.hardware = cpu_rank_hardware(&cpu.profile, cpu.ranks);
            }
        }
        view
    }

    /// The smallest GPU memory in the cluster, bytes: every rank must fit in it.
    pub fn min_memory_bytes(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| h.hardware.memory_bytes)
            .min()
            .unwrap_or(0)
    }

    /// The slowest hardware in the cluster (by HBM bandwidth): the cost model's pace.
    pub fn slowest_hardware(&self) -> &HardwareSpec {
        &self
            .hosts
            .iter()
            .min_by(|a, b| {
                a.hardware
                    .hbm_gb_per_sec
                    .total_cmp(&b.hardware.hbm_gb_per_sec)
            })
            .expect("a cluster has at least one host")
            .hardware
    }
}

/// Gives each CPU-rank host of `cluster` its own CPU, as probed on it (`probed`: host name
/// and profile, e.g. by `infer plan --probe-hosts`), instead of the one it was read with.
///
/// Errors: a CPU-rank host that `probed` does not name.
pub(crate) fn use_probed_cpus(
    cluster: &mut Cluster,
    probed: &[(String, CpuProfile)],
) -> Result<()> {
    for host in &mut cluster.hosts {
        let Some(cpu) = &host.cpu else { continue };
        let Some((_, profile)) = probed.iter().find(|(name, _)| *name == host.name) else {
            bail!("host `{}` runs CPU ranks and was not probed", host.name);
        };
        *host = ClusterHost::cpu(
            host.name.clone(),
            host.address.clone(),
            profile.clone(),
            cpu.max_ranks,
            host.topology.clone(),
        );
    }
    Ok(())
}

/// Adds `measurement` (read from the file `name`) to `cluster`: a link fills its scope's slot; a
/// decode measurement replaces the HBM bandwidth of every host with the measured GPU model, or
/// on a CPU cluster the memory bandwidth (and, when the report has it, the compute rate) of
/// every host with the measured CPU ([`calibrate_cpu`]).
///
/// Errors: two links of one scope, two decode measurements of one GPU model or CPU, a decode
/// measured on a device the cluster does not have (a CPU for GPU hosts, a GPU for CPU hosts,
/// another GPU model or CPU).
pub(crate) fn calibrate(cluster: &mut Cluster, name: &str, measurement: Measurement) -> Result<()> {
    match measurement {
        Measurement::Link(measured) => {
            let (slot, what) = match measured.scope {
                Scope::IntraHost => (&mut cluster.measured.intra_host, "inside a host"),
                Scope::InterHost => (&mut cluster.measured.inter_host, "between hosts"),
            };
            if let Some(earlier) = slot {
                bail!(
                    "{} and {} both measured links {what}: give one table per kind of link",
                    earlier.source,
                    measured.source
                );
            }
            *slot = Some(measured);
        }
        Measurement::Decode(report) if cluster.device() == Device::Cpu => {
            calibrate_cpu(cluster, name, &report)?;
        }
        Measurement::Decode(report) => {
            let gpus: Vec<&str> = {
                let mut names: Vec<&str> = cluster
                    .hosts
                    .iter()
                    .map(|h| h.hardware.name.as_str())
                    .collect();
                names.dedup();
                names
            };
            let hardware_id = match report.device.as_str() {
                "cuda" => hardware_for_gpu_name(&report.device_name),
                _ => None,
            };
            let Some(hardware_id) =
                hardware_id.filter(|id| cluster.hosts.iter().any(|h| h.hardware_id == *id))
            else {
                bail!(
                    "the decode measurement ran on {} `{}`, not on this cluster's GPUs ({}): run `infer bench decode --json` \
                     on one of them",
                    if report.device == "cuda" {
                        "the GPU"
                    } else {
                        "the CPU"
                    },
                    report.device_name,
                    gpus.join(", ")
                );
            };
            if cluster
                .measured
                .decode
                .iter()
                .any(|d| d.hardware_id == hardware_id)
            {
                bail!("two decode measurements of {hardware_id}: give one per GPU model");
            }
            let mut datasheet = 0.0;
            for host in cluster
                .hosts
                .iter_mut()
                .filter(|h| h.hardware_id == hardware_id)
            {
                datasheet = host.hardware.hbm_gb_per_sec * 1e9;
                host.hardware.hbm_gb_per_sec = report.weight_bytes_per_sec / 1e9;
            }
            cluster.measured.decode.push(MeasuredDecode {
                hardware_id: hardware_id.to_string(),
                device_name: report.device_name.clone(),
                bytes_per_sec: report.weight_bytes_per_sec,
                datasheet_bytes_per_sec: datasheet,
                flops_per_sec: None,
                probed_flops_per_sec: None,
                source: format!("`{name}`, {} at batch {}", report.model, report.batch),
            });
        }
    }
    Ok(())
}

/// A decode measured on a CPU, on a cluster of CPU hosts: every host with that CPU (by its
/// `/proc/cpuinfo` name) reads weights at the rate the engine achieved on the real model,
/// whatever their type (calibrate with the model you plan; its shared-memory links keep the
/// probed memory bandwidth), and
/// computes at the rate its prefill achieved (`prefill_flops_per_sec`, when the report has
/// it), in place of the probe's peaks. The report stands for the whole host: `infer bench
/// decode` runs one thread per core unless `--threads` says otherwise.
///
/// Errors: a report from a GPU, from another CPU, or a second report of one CPU.
fn calibrate_cpu(cluster: &mut Cluster, name: &str, report: &DecodeReport) -> Result<()> {
    let cpus: Vec<String> = {
        let mut names: Vec<String> = cluster
            .hosts
            .iter()
            .filter_map(|h| h.cpu.as_ref().map(|c| format!("`{}`", c.profile.name)))
            .collect();
        names.dedup();
        names
    };
    let measured_here = |h: &ClusterHost| {
        h.cpu
            .as_ref()
            .is_some_and(|c| c.profile.name == report.device_name)
    };
    if report.device != "cpu" || !cluster.hosts.iter().any(measured_here) {
        bail!(
            "the decode measurement ran on {} `{}`, not on this cluster's CPUs ({}): run `infer bench decode --json` \
             on one of its hosts",
            if report.device == "cpu" {
                "the CPU"
            } else {
                "the GPU"
            },
            report.device_name,
            cpus.join(", ")
        );
    }
    if cluster
        .measured
        .decode
        .iter()
        .any(|d| d.hardware_id == CPU_HARDWARE_ID && d.device_name == report.device_name)
    {
        bail!(
            "two decode measurements of the CPU `{}`: give one per CPU model",
            report.device_name
        );
    }
    let flops_per_sec = report
        .prefill_flops_per_sec
        .filter(|f| f.is_finite() && *f > 0.0);
    let (mut probed_bytes_per_sec, mut probed_flops_per_sec) = (0.0, 0.0);
    let (mut weights_bytes_per_sec, mut kv_secs) = (report.weight_bytes_per_sec, 0.0);
    for host in cluster.hosts.iter_mut().filter(|h| measured_here(h)) {
        let cpu = host
            .cpu
            .as_mut()
            .expect("measured_here holds for CPU hosts");
        probed_bytes_per_sec = cpu.profile.weight_read_bytes_per_sec();
        probed_flops_per_sec = cpu.profile.flops_per_sec;
        calibrate_attention(&mut cpu.profile, report);
        (weights_bytes_per_sec, kv_secs) = weight_read_of(report, &cpu.profile);
        // A thread alone keeps its probed advantage over the all-core rate.
        cpu.profile.decode_one_thread_bytes_per_sec = cpu
            .profile
            .decode_one_thread_bytes_per_sec
            .map(|alone| alone * weights_bytes_per_sec / probed_bytes_per_sec);
        cpu.profile.decode_bytes_per_sec = Some(weights_bytes_per_sec);
        cpu.profile.decode_bf16_bytes_per_sec = Some(weights_bytes_per_sec);
        // The measured step's rate counts its model's layers already.
        cpu.profile.decode_layer_secs = None;
        // The model's own share: it depends on the shape and the prompt.
        if let Some(part) = report
            .prefill_one_thread_share
            .filter(|part| *part > 0.0 && *part <= 1.0)
        {
            cpu.profile.prefill_one_thread_share = Some(part);
        }
        if let Some(flops) = flops_per_sec {
            let (products, attention) = prefill_rates_of(report, flops);
            cpu.profile.flops_per_sec = products;
            // The measured model stands for every weight type, as its decode does.
            cpu.profile.prefill_bf16_flops_per_sec = Some(products);
            cpu.profile.prefill_attention_flops_per_sec =
                attention.or(cpu.profile.prefill_attention_flops_per_sec);
        }
        host.hardware = cpu_rank_hardware(&cpu.profile, cpu.ranks);
    }
    cluster.measured.decode.push(MeasuredDecode {
        hardware_id: CPU_HARDWARE_ID.to_string(),
        device_name: report.device_name.clone(),
        bytes_per_sec: weights_bytes_per_sec,
        datasheet_bytes_per_sec: probed_bytes_per_sec,
        flops_per_sec,
        probed_flops_per_sec: flops_per_sec.map(|_| probed_flops_per_sec),
        source: format!(
            "`{name}`, {} at batch {} on {} threads{}",
            report.model,
            report.batch,
            report.threads,
            if kv_secs > 0.0 {
                format!(
                    ", its {:.2} ms step less {:.2} ms of attention",
                    report.decode_step_secs * 1e3,
                    kv_secs * 1e3
                )
            } else {
                String::new()
            }
        ),
    });
    Ok(())
}

/// Puts a CPU decode report's decode attention rate, measured on its model
/// ([`DecodeReport::decode_attention_flops_per_sec`]: one sequence, `kv_heads` tasks on
/// `threads`), in `profile` in place of the probe's, whose shape differs (2-core EPYC:
/// SmolLM2's at 19–20 GFLOP/s with every thread busy, the probe's 13–16): scaled to every
/// thread busy ([`attention_occupancy`](crate::topology::cpu::attention_occupancy)), and the
/// one-thread rate by the same factor (a thread alone keeps its probed advantage). Nothing
/// where the report lacks the figure.
fn calibrate_attention(profile: &mut CpuProfile, report: &DecodeReport) {
    let (Some(measured), Some(kv_heads)) = (
        report
            .decode_attention_flops_per_sec
            .filter(|rate| rate.is_finite() && *rate > 0.0),
        report.kv_heads,
    ) else {
        return;
    };
    let busy = measured
        / crate::topology::cpu::attention_occupancy(kv_heads as u64, report.threads as u64);
    if let Some(probed) = profile.decode_attention_flops_per_sec {
        profile.decode_one_thread_attention_flops_per_sec = profile
            .decode_one_thread_attention_flops_per_sec
            .map(|alone| alone * busy / probed);
    }
    profile.decode_attention_flops_per_sec = Some(busy);
}

/// The rates of a CPU decode report's prefill, flops/s: of its products, and of its
/// attention where the report measured it on its model. Its prompt took `prompt_tokens /
/// prefill_tokens_per_sec` seconds for `flops` flops a second of the planner's count; its
/// `prefill_attention_flops` at the measured `prefill_attention_flops_per_sec` took their
/// part, and the rest of the arithmetic the rest of the time, so that a plan's prompt of
/// another length costs each part at its own rate. `(flops, None)` where the report lacks
/// those figures or its attention would take more than half of the prompt's time (a
/// measurement too noisy to split).
fn prefill_rates_of(report: &DecodeReport, flops: f64) -> (f64, Option<f64>) {
    let whole = (flops, None);
    let (Some(attention_flops), Some(rate)) = (
        report.prefill_attention_flops,
        report.prefill_attention_flops_per_sec,
    ) else {
        return whole;
    };
    let prompt_secs = report.prompt_tokens.max(1) as f64 / report.prefill_tokens_per_sec;
    let attention_secs = attention_flops / rate;
    let products_flops = flops * prompt_secs - attention_flops;
    if !(rate > 0.0 && prompt_secs.is_finite() && attention_secs < prompt_secs / 2.0)
        || products_flops <= 0.0
    {
        return whole;
    }
    (products_flops / (prompt_secs - attention_secs), Some(rate))
}

/// The rate at which a CPU decode report's step read its weights, bytes/s, and the seconds of
/// the step it counts as attention: the step less its `decode_attention_flops` at the host's
/// attention rate ([`CpuProfile::decode_attention_flops_per_sec`] times the
/// [`attention_occupancy`](crate::topology::cpu::attention_occupancy) of `batch · kv_heads`
/// tasks on its `threads`), so that the planner, which adds the attention of its own
/// context, does not count it twice. The report's `weight_bytes_per_sec` and 0 where the
/// report or the profile lacks those figures, or they would take the whole step.
fn weight_read_of(report: &DecodeReport, profile: &CpuProfile) -> (f64, f64) {
    let whole_step = (report.weight_bytes_per_sec, 0.0);
    let (Some(flops), Some(kv_heads), Some(rate)) = (
        report.decode_attention_flops,
        report.kv_heads,
        profile.decode_attention_flops_per_sec,
    ) else {
        return whole_step;
    };
    let kv_secs = crate::topology::cpu::attention_secs(
        flops as f64,
        rate,
        (report.batch * kv_heads) as u64,
        report.threads as u64,
    );
    let weights_secs = report.decode_step_secs - kv_secs;
    if rate > 0.0 && weights_secs > 0.0 && weights_secs.is_finite() {
        (report.decode_weight_bytes as f64 / weights_secs, kv_secs)
    } else {
        whole_step
    }
}

/// Maps an NVML GPU name to a hardware profile id.
pub fn hardware_for_gpu_name(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_uppercase();
    let table: &[(&[&str], &str)] = &[
        (&["H200"], "h200-sxm"),
        (&["H100", "PCIE"], "h100-pcie"),
        (&["H100"], "h100-sxm"),
        (&["A100", "PCIE"], "a100-pcie-80g"),
        (&["A100"], "a100-sxm-80g"),
        (&["L40S"], "l40s"),
        (&["L4"], "l4"),
        (&["RTX PRO 6000"], "rtx-pro-6000"),
        (&["B200"], "b200"),
    ];
    table
        .iter()
        .find(|(words, _)| words.iter().all(|w| name.contains(w)))
        .map(|(_, id)| *id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::degrees::{DegreePins, Degrees};
    use crate::plan::calibration::DecodeReport;
    use crate::plan::memory::{
        CPU_MAX_NUM_SEQS, CPU_PROCESS_BYTES, CPU_STEP_TOKENS, reserve_bytes, stage_memory,
    };
    use crate::plan::model::{Dtype, ModelSpec};
    use crate::plan::{Objective, Outcome, Plan, Settings, plan};

    /// A host of 8 cores and 32 GiB reading memory at 20 GB/s, whose engine reads weights
    /// at 12 GB/s and attends at 20 GFLOP/s in a decode step. Its compute rate, 10¹⁵ flops/s, keeps a small model's
    /// decode bound by memory.
    fn profile() -> CpuProfile {
        CpuProfile {
            name: "Test CPU".into(),
            n_cores: 8,
            memory_bytes: 32 << 30,
            memory_bytes_per_sec: 20e9,
            flops_per_sec: 1e15,
            decode_bytes_per_sec: Some(12e9),
            decode_bf16_bytes_per_sec: Some(3e9),
            decode_layer_secs: Some(20e-6),
            decode_one_thread_bytes_per_sec: None,
            decode_one_thread_attention_flops_per_sec: None,
            prefill_attention_flops_per_sec: None,
            prefill_bf16_flops_per_sec: None,
            prefill_one_thread_share: None,
            decode_attention_flops_per_sec: Some(2e10),
            source: "made up".into(),
        }
    }

    /// Links of 2 GB/s, 50 µs a collective and 20 µs a message for every group.
    fn shm_links() -> crate::plan::cost::Links {
        let link = crate::plan::cost::Link {
            bytes_per_sec: 2e9,
            latency_secs: 50e-6,
            message_latency_secs: 20e-6,
        };
        crate::plan::cost::Links {
            tp: link,
            ep: link,
            pp: link,
        }
    }

    /// `infer bench decode --json` on `device_name`: a 128-token prompt at 100 tokens/s
    /// (300 GFLOP/s), a 0.1 s step of one sequence reading 500 MB, with 160 MFLOP of
    /// attention over 3 KV heads.
    fn cpu_report(device_name: &str) -> DecodeReport {
        DecodeReport {
            bench: "decode".into(),
            model: "m.gguf".into(),
            device: "cpu".into(),
            device_name: device_name.into(),
            threads: 8,
            numerics: "exact".into(),
            batch: 1,
            prompt_tokens: 128,
            decode_tokens: 128,
            prefill_tokens_per_sec: 100.0,
            prefill_flops_per_sec: Some(3e11),
            prefill_attention_flops: None,
            prefill_attention_flops_per_sec: None,
            decode_tokens_per_sec: 10.0,
            decode_step_secs: 0.1,
            decode_weight_bytes: 500_000_000,
            weight_bytes_per_sec: 5e9,
            // 160 MFLOP of attention over 3 KV heads: 3 tasks on 8 threads.
            decode_attention_flops: Some(160_000_000),
            kv_heads: Some(3),
            decode_attention_flops_per_sec: None,
            prefill_one_thread_share: None,
            peak_rss_bytes: 0,
            gpu_memory_used_bytes: None,
            hbm_bytes_per_sec: None,
            batches: Vec::new(),
        }
    }

    fn cpu_cluster(n_hosts: usize, max_ranks: u64, profile: &CpuProfile) -> Cluster {
        let hosts = (0..n_hosts)
            .map(|i| {
                let name = format!("h{i}");
                let topology = Host::named(name.clone(), "test");
                ClusterHost::cpu(
                    name,
                    Some(format!("10.0.0.{i}")),
                    profile.clone(),
                    max_ranks,
                    topology,
                )
            })
            .collect();
        Cluster {
            description: "test".into(),
            hosts,
            measured: Calibration::default(),
        }
    }

    fn smollm2() -> ModelSpec {
        crate::model::load("smollm2-135m").expect("a shipped profile")
    }

    /// The plan of `spec` on `cluster` with `pins` for latency, which must be feasible.
    fn feasible(spec: &ModelSpec, cluster: &Cluster, pins: DegreePins) -> Box<Plan> {
        let settings = Settings {
            objective: Objective::Latency,
            max_model_len_tokens: Some(4096),
            pins,
            ..Settings::default()
        };
        match plan(spec, cluster, &settings) {
            Outcome::Feasible(plan) => plan,
            Outcome::Infeasible(infeasible) => panic!("{}", infeasible.message),
        }
    }

    fn dp(n: usize) -> DegreePins {
        DegreePins {
            tp: Some(1),
            pp: Some(1),
            dp: Some(n),
            ep: None,
        }
    }

    #[test]
    fn ranks_share_their_host_evenly() {
        let profile = profile();
        for ranks in [1, 2, 8] {
            let rank = cpu_rank_hardware(&profile, ranks);
            let r = ranks as f64;
            assert_eq!(rank.memory_bytes, profile.memory_bytes / ranks);
            // Weights are read at the engine's measured rate, not the memory's peak.
            assert!((rank.hbm_gb_per_sec * 1e9 * r - 12e9).abs() < 1.0);
            assert!((rank.bf16_tflops * 1e12 * r - profile.flops_per_sec).abs() < 1e3);
            assert_eq!(rank.fp8_tflops, rank.bf16_tflops);
            // Shared memory between ranks is the host's memory, whatever their count.
            assert_eq!(
                rank.pcie_gb_per_sec * 1e9,
                profile.memory_bytes_per_sec / SHM_TRAFFIC_PER_BYTE
            );
            assert_eq!(rank.nvlink_gb_per_sec, 0.0);
            // Attention at the engine's rate, on the rank's share of the cores.
            let attention = rank.cpu_attention.expect("a measured attention rate");
            assert!((attention.flops_per_sec * r - 2e10).abs() < 1e-3);
            assert_eq!(attention.threads, (8 / ranks).max(1));
            // A layer's fixed cost: the host's 20 µs on however many threads.
            assert_eq!(rank.cpu_layer_secs, Some(20e-6));
        }
        // 20 ranks on 8 cores take 3 turns of them.
        let crowded = cpu_rank_hardware(&profile, 20);
        assert!((crowded.cpu_layer_secs.expect("a layer cost") - 60e-6).abs() < 1e-15);
        let cluster = cpu_cluster(2, 8, &profile);
        assert_eq!(cluster.device(), Device::Cpu);
        assert_eq!(cluster.n_gpus(), 16);
        let view = cluster.with_cpu_ranks(3);
        assert_eq!((view.n_gpus(), view.min_gpus_per_host()), (6, 3));
        assert_eq!(view.slowest_hardware(), &cpu_rank_hardware(&profile, 3));
        assert_eq!(cluster.with_cpu_ranks(20).min_gpus_per_host(), 8);
        // A profile of the hardware alone (no engine rate) reads weights at the memory's.
        let rank = cpu_rank_hardware(&profile, 2);
        assert_eq!(rank.bf16_weights_gb_per_sec, Some(1.5));
        let hardware_only = CpuProfile {
            decode_bytes_per_sec: None,
            decode_bf16_bytes_per_sec: None,
            decode_layer_secs: None,
            decode_one_thread_bytes_per_sec: None,
            decode_one_thread_attention_flops_per_sec: None,
            prefill_attention_flops_per_sec: None,
            decode_attention_flops_per_sec: None,
            ..profile
        };
        let rank = cpu_rank_hardware(&hardware_only, 2);
        assert!((rank.hbm_gb_per_sec * 1e9 * 2.0 - 20e9).abs() < 1.0);
        assert_eq!(rank.bf16_weights_gb_per_sec, None);
        assert_eq!(rank.cpu_attention, None);
        assert_eq!(rank.cpu_layer_secs, None);
    }

    #[test]
    fn a_cpu_rank_reserves_its_process_and_shared_memory_not_cuda() {
        let spec = smollm2();
        let one = Degrees {
            tp: 1,
            pp: 1,
            ep: 1,
            dp: 1,
        };
        let activations = CPU_STEP_TOKENS * (4 * spec.hidden_size + 2 * spec.intermediate_size) * 4;
        let logits = CPU_MAX_NUM_SEQS * spec.vocab_size * 4;
        assert_eq!(
            reserve_bytes(&spec, &one, true, Device::Cpu),
            CPU_PROCESS_BYTES + activations + logits
        );
        assert_eq!(
            reserve_bytes(&spec, &one, false, Device::Cpu),
            CPU_PROCESS_BYTES + activations
        );
        // Two replicas: one shared-memory segment of (2·2 + 2) 1-MiB slots.
        let two = Degrees { dp: 2, ..one };
        assert_eq!(
            reserve_bytes(&spec, &two, true, Device::Cpu),
            CPU_PROCESS_BYTES + activations + logits + (6 << 20)
        );
        // The KV cache is what a rank's share of the host leaves.
        let rank = cpu_rank_hardware(&profile(), 2);
        let stages = stage_memory(
            &spec,
            &two,
            Dtype::Bf16,
            Dtype::Bf16,
            rank.memory_bytes,
            0.9,
            Device::Cpu,
        );
        let stage = &stages[0];
        assert_eq!(stage.usable_bytes, (rank.memory_bytes as f64 * 0.9) as u64);
        assert_eq!(
            stage.kv_cache_bytes,
            stage.usable_bytes - stage.weights_bytes - stage.reserve_bytes
        );
        assert_eq!(
            stage.kv_tokens,
            stage.kv_cache_bytes / spec.kv_bytes_per_token(spec.n_layers, 1, Dtype::Bf16)
        );
    }

    #[test]
    fn a_memory_bound_decode_reads_weights_and_kv_at_the_ranks_share_of_bandwidth() {
        let spec = smollm2();
        let profile = profile();
        let cluster = cpu_cluster(1, 8, &profile);
        let one = feasible(&spec, &cluster, dp(1));
        assert_eq!(one.device, Device::Cpu);
        let stage = &one.memory[0];
        // Batch 1 at the typical context (2048 of 4096 tokens), all of the host's bandwidth:
        // the profile's bf16 weights at the engine's bf16 rate, and attention over 2048
        // positions (4 · n_heads · head_dim flops each per layer) at the engine's rate, with
        // SmolLM2's 3 KV heads keeping 3 of the 8 threads busy; and each of its 30 layers'
        // fixed 20 µs.
        let flops = (4 * 2048 * spec.n_heads * spec.head_dim * spec.n_layers) as f64;
        let layers = spec.n_layers as f64;
        let expected =
            stage.weights_bytes as f64 / 3e9 + flops / (2e10 * 3.0 / 8.0) + layers * 20e-6;
        assert!(
            (one.estimate.tpot_secs - expected).abs() < 1e-9 * expected,
            "{} vs {expected}",
            one.estimate.tpot_secs
        );
        // Two replicas on the host: each reads the same weights at half the bandwidth,
        // attends at half the rate with 3 of its 4 threads busy, and pays each layer's
        // fixed cost on its own cores.
        let two = feasible(&spec, &cluster, dp(2));
        assert_eq!(two.memory[0].weights_bytes, stage.weights_bytes);
        let expected =
            stage.weights_bytes as f64 / 1.5e9 + flops / (1e10 * 3.0 / 4.0) + layers * 20e-6;
        let tpot = two.estimate.tpot_secs;
        assert!(
            (tpot - expected).abs() < 1e-9 * expected,
            "{tpot} vs {expected}"
        );
        assert_eq!(two.memory[0].gpu_memory_bytes, profile.memory_bytes / 2);
        for rank in &two.ranks {
            assert_eq!(rank.host, "h0");
            assert_eq!(rank.cuda_visible_devices, "");
            assert_eq!(rank.gpu as u64, rank.local_rank);
        }
        assert!(two.env.values().all(|env| env.is_empty()), "{:?}", two.env);
    }

    #[test]
    fn the_rank_count_is_searched_up_to_the_host_and_no_further() {
        let spec = smollm2();
        let cluster = cpu_cluster(2, 4, &profile());
        let settings = Settings {
            max_model_len_tokens: Some(4096),
            ..Settings::default()
        };
        let Outcome::Feasible(plan) = plan(&spec, &cluster, &settings) else {
            panic!("smollm2 fits");
        };
        // Every layout spreads evenly over the 2 hosts, 1 to 4 ranks on each.
        let mut worlds: Vec<u64> = plan
            .alternatives
            .iter()
            .map(|a| a.parallel.world_size() as u64)
            .chain([plan.world_size])
            .collect();
        worlds.sort_unstable();
        worlds.dedup();
        assert_eq!(worlds, [2, 4, 6, 8]);
        for host in ["h0", "h1"] {
            let on_host = plan.ranks.iter().filter(|r| r.host == host).count() as u64;
            assert_eq!(on_host, plan.world_size / 2);
        }
        let Outcome::Infeasible(too_many) = crate::plan::plan(
            &spec,
            &cluster,
            &Settings {
                pins: dp(10),
                ..settings.clone()
            },
        ) else {
            panic!("10 ranks on 2 hosts of 4")
        };
        assert!(
            too_many
                .message
                .contains("needs 5 CPU ranks per host; the hosts take at most 4"),
            "{}",
            too_many.message
        );
    }

    #[test]
    fn a_cpu_decode_reports_own_attention_rate_replaces_the_probes() {
        let mut profile = profile();
        profile.decode_one_thread_attention_flops_per_sec = Some(4e9);
        let mut cluster = cpu_cluster(1, 8, &profile);
        let mut report = cpu_report(&profile.name);
        // SmolLM2's shape measured 15 GFLOP/s with its 3 KV heads' tasks on the 8 threads.
        report.decode_attention_flops_per_sec = Some(1.5e10);
        calibrate(
            &mut cluster,
            "cpu.json",
            Measurement::Decode(Box::new(report)),
        )
        .expect("this cluster's CPU");
        let calibrated = &cluster.hosts[0].cpu.as_ref().expect("a CPU host").profile;
        // 3 of 8 threads busy: 40 GFLOP/s with every thread busy, against the probe's 20;
        // a thread alone keeps its advantage: twice its probed 4.
        let busy = 1.5e10 / (3.0 / 8.0);
        assert_eq!(calibrated.decode_attention_flops_per_sec, Some(busy));
        assert_eq!(
            calibrated.decode_one_thread_attention_flops_per_sec,
            Some(4e9 * busy / 2e10)
        );
        // The step less its attention at the model's own rate read the weights.
        let kv_secs = 1.6e8 / (busy * 3.0 / 8.0);
        let rate = 500e6 / (0.1 - kv_secs);
        let measured = calibrated.decode_bytes_per_sec.expect("calibrated");
        assert!(
            (measured - rate).abs() < 1e-6 * rate,
            "{measured} vs {rate}"
        );
        // One rank on the host attends at that rate, one of 8 at its thread's.
        let attention = |ranks| {
            let rank = cpu_rank_hardware(calibrated, ranks).cpu_attention;
            let attention = rank.expect("a CPU rank's attention");
            (attention.flops_per_sec, attention.threads)
        };
        assert_eq!(attention(1), (busy, 8));
        assert_eq!(attention(8), (4e9 * busy / 2e10, 1));
        // A report of a GPU's run, or one without the figure, leaves the probe's rate.
        let mut unmeasured = profile.clone();
        let mut without = cpu_report(&profile.name);
        without.decode_attention_flops_per_sec = None;
        calibrate_attention(&mut unmeasured, &without);
        assert_eq!(unmeasured, profile);
    }

    #[test]
    fn a_cpu_decode_report_replaces_the_probed_bandwidth_and_compute() {
        let spec = smollm2();
        let profile = profile();
        let mut cluster = cpu_cluster(1, 8, &profile);
        let report = cpu_report(&profile.name);
        let mut gpu_report = report.clone();
        gpu_report.device = "cuda".into();
        gpu_report.device_name = "NVIDIA L4".into();
        let error = calibrate(
            &mut cluster.clone(),
            "l4.json",
            Measurement::Decode(Box::new(gpu_report)),
        )
        .expect_err("not this cluster's CPU");
        assert!(error.to_string().contains("`Test CPU`"), "{error}");
        calibrate(
            &mut cluster,
            "cpu.json",
            Measurement::Decode(Box::new(report.clone())),
        )
        .expect("this cluster's CPU");
        let cpu = cluster.hosts[0].cpu.as_ref().expect("a CPU host");
        // The step less its attention at the probed rate (20 GFLOP/s with every thread
        // busy, 3/8 of them here) read the weights.
        let kv_secs = 1.6e8 / (2e10 * 3.0 / 8.0);
        let rate = 500e6 / (0.1 - kv_secs);
        let measured = cpu.profile.decode_bytes_per_sec.expect("calibrated");
        assert!(
            (measured - rate).abs() < 1e-6 * rate,
            "{measured} vs {rate}"
        );
        // The measured model stands for every weight type: bf16 too. Its step counted its
        // layers' fixed cost already: no probed layer cost is added to it.
        assert_eq!(cpu.profile.decode_bf16_bytes_per_sec, Some(measured));
        assert_eq!(profile.decode_layer_secs, Some(20e-6));
        assert_eq!(cpu.profile.decode_layer_secs, None);
        assert_eq!(cluster.hosts[0].hardware.cpu_layer_secs, None);
        // A thread alone keeps its probed advantage over the all-core rate: 1.5 of the
        // probed 8 cores' 12 GB/s.
        let mut advantaged = profile.clone();
        advantaged.decode_one_thread_bytes_per_sec = Some(1.5 * 12e9 / 8.0);
        let mut with_alone = cpu_cluster(1, 8, &advantaged);
        calibrate(
            &mut with_alone,
            "cpu.json",
            Measurement::Decode(Box::new(report.clone())),
        )
        .expect("this cluster's CPU");
        let calibrated = &with_alone.hosts[0].cpu.as_ref().expect("CPU").profile;
        let alone = calibrated.decode_one_thread_bytes_per_sec.expect("kept");
        assert!(
            (alone - 1.5 * measured / 8.0).abs() < 1e-6 * alone,
            "{alone}"
        );
        assert!(
            cluster.measured.decode[0]
                .source
                .contains("its 100.00 ms step less 21.33 ms of attention"),
            "{}",
            cluster.measured.decode[0].source
        );
        // A report without its KV bytes counts its whole step as weight reads.
        let mut whole_step = report.clone();
        whole_step.decode_attention_flops = None;
        assert_eq!(weight_read_of(&whole_step, &profile), (5e9, 0.0));
        // The shared-memory links keep the memory's probed bandwidth.
        assert_eq!(cpu.profile.memory_bytes_per_sec, 20e9);
        assert_eq!(cpu.profile.flops_per_sec, 3e11);
        assert_eq!(cluster.measured.decode[0].datasheet_bytes_per_sec, 12e9);
        // Is the decode still bound by memory at the measured compute rate? Then it reads
        // weights at the measured rate, and the KV cache at the attention's with 3 of the 8
        // threads busy.
        let calibrated = feasible(&spec, &cluster, dp(1));
        let stage = &calibrated.memory[0];
        let flops = 2.0 * spec.active_params() as f64
            + 4.0 * 2048.0 * (spec.n_heads * spec.head_dim * spec.n_layers) as f64;
        let read_secs = stage.read_per_step_bytes as f64 / measured
            + (4 * 2048 * spec.n_heads * spec.head_dim * spec.n_layers) as f64 / (2e10 * 3.0 / 8.0);
        assert!(read_secs > flops / 3e11);
        let tpot = calibrated.estimate.tpot_secs;
        assert!(
            (tpot - read_secs).abs() < 1e-9 * tpot,
            "{tpot} vs {read_secs}"
        );
        assert!(
            calibrated
                .explain
                .iter()
                .any(|l| l.contains("measured, not probed") && l.contains("`cpu.json`")),
            "{:#?}",
            calibrated.explain
        );
        let again = calibrate(
            &mut cluster,
            "cpu.json",
            Measurement::Decode(Box::new(report)),
        );
        assert!(again.is_err());
    }

    #[test]
    fn a_model_larger_than_the_hosts_says_how_many_it_needs() {
        let spec = crate::model::load("llama-3.1-70b").expect("a shipped profile");
        let profile = profile();
        let cluster = cpu_cluster(1, 8, &profile);
        let settings = Settings {
            max_model_len_tokens: Some(8192),
            ..Settings::default()
        };
        let Outcome::Infeasible(infeasible) = plan(&spec, &cluster, &settings) else {
            panic!("141 GB of weights in 32 GiB");
        };
        let one = Degrees {
            tp: 1,
            pp: 1,
            ep: 1,
            dp: 1,
        };
        let usable = (profile.memory_bytes as f64 * 0.9) as u64;
        let reserve = reserve_bytes(&spec, &one, true, Device::Cpu);
        let weights = spec.weight_bytes(Dtype::Bf16);
        let kv = spec.kv_bytes_per_token(spec.n_layers, 1, Dtype::Bf16) * 8192;
        let hosts = (1..)
            .find(|n| weights / n + reserve + kv / n <= usable)
            .expect("some count");
        assert!(hosts > 1);
        assert!(
            infeasible
                .message
                .contains(&format!("it needs at least {hosts} hosts of Test CPU")),
            "{}",
            infeasible.message
        );
    }

    #[test]
    fn a_rank_of_few_threads_gets_what_they_do_alone_within_the_memorys_share() {
        // 8 cores read 12 GB/s together, one thread alone 3 GB/s (twice its 1.5 share).
        let (all, alone) = (12e9, Some(3e9));
        // Without a one-thread figure: the threads' share.
        assert_eq!(rank_rate(all, None, 2, 8, f64::INFINITY), 3e9);
        // One thread: what it does alone; all 8: the all-core rate itself.
        assert_eq!(rank_rate(all, alone, 1, 8, f64::INFINITY), 3e9);
        assert_eq!(rank_rate(all, alone, 8, 8, f64::INFINITY), all);
        // 4 threads: per thread 3 GB/s less 3/7 of the way down to 1.5.
        let four = 4.0 * (3e9 + 3.0 / 7.0 * (1.5e9 - 3e9));
        assert!((rank_rate(all, alone, 4, 8, f64::INFINITY) - four).abs() < 1.0);
        // At most the rank's share of what the memory delivers, never below the fair share.
        assert_eq!(rank_rate(all, alone, 1, 8, 2e9), 2e9);
        assert_eq!(rank_rate(all, alone, 1, 8, 1e9), 1.5e9);
        assert_eq!(rank_rate(all, Some(0.5e9), 1, 8, f64::INFINITY), 1.5e9);
        // A one-thread figure above the all-core rate (a noisy probe) gives the all-core rate.
        assert_eq!(rank_rate(all, Some(20e9), 1, 8, f64::INFINITY), all);
        // One core: nothing to interpolate.
        assert_eq!(rank_rate(all, alone, 1, 1, f64::INFINITY), all);
        // Through a host's profile: 8 ranks of one thread, 4 of two, 12 taking turns.
        let mut profile = profile();
        profile.decode_one_thread_bytes_per_sec = Some(3e9);
        profile.decode_one_thread_attention_flops_per_sec = Some(5e9);
        let one = cpu_rank_hardware(&profile, 8);
        // 20 GB/s of memory over 8 ranks caps the 3 GB/s at 2.5.
        assert!(
            (one.hbm_gb_per_sec - 2.5).abs() < 1e-9,
            "{}",
            one.hbm_gb_per_sec
        );
        // Compute stays the threads' share without a measured one-thread share of it.
        assert!(
            (one.bf16_tflops - 125.0).abs() < 1e-9,
            "{}",
            one.bf16_tflops
        );
        let attention = one.cpu_attention.expect("attention");
        assert!((attention.flops_per_sec - 5e9).abs() < 1e-3);
        // Two threads would read 2 · (3 − 1.5/7) = 5.57 GB/s; 20 GB/s over 4 ranks caps it.
        assert!((cpu_rank_hardware(&profile, 4).hbm_gb_per_sec - 5.0).abs() < 1e-9);
        profile.memory_bytes_per_sec = 40e9;
        let two = cpu_rank_hardware(&profile, 4);
        let expected = 2.0 * (3e9 + (1.5e9 - 3e9) / 7.0) / 1e9;
        assert!(
            (two.hbm_gb_per_sec - expected).abs() < 1e-9,
            "{}",
            two.hbm_gb_per_sec
        );
        // Ranks beyond the cores take turns: one thread's 3 GB/s (within 40 GB/s over the 8
        // ranks running at once) for one of 2 turns; its share without the figure.
        assert!((cpu_rank_hardware(&profile, 12).hbm_gb_per_sec - 1.5).abs() < 1e-9);
        profile.decode_one_thread_bytes_per_sec = None;
        assert_eq!(cpu_rank_hardware(&profile, 12).hbm_gb_per_sec * 16.0, 12.0);
    }

    #[test]
    fn ranks_beyond_the_cores_take_turns_and_work_faster_alone() {
        let profile = profile();
        assert_eq!(rate_share(3, 8), 3.0);
        assert_eq!(rate_share(8, 8), 8.0);
        // 12 ranks on 8 cores: two turns of the 8 cores, each rank at a core's rate.
        assert_eq!(rate_share(12, 8), 16.0);
        assert_eq!(rate_share(3, 2), 4.0);
        let rank = cpu_rank_hardware(&profile, 12);
        assert!((rank.hbm_gb_per_sec * 1e9 * 16.0 - 12e9).abs() < 1.0);
        assert!((rank.bf16_tflops * 1e12 * 16.0 - profile.flops_per_sec).abs() < 1e3);
        let attention = rank.cpu_attention.expect("a measured attention rate");
        assert!((attention.flops_per_sec * 16.0 - 2e10).abs() < 1e-3);
        assert_eq!(attention.threads, 1);
        // Memory is still split by ranks.
        assert_eq!(rank.memory_bytes, profile.memory_bytes / 12);
        // A rank whose TP group waits on it has a whole core: twice its share.
        // Its waits sleep: the ranks outnumber the cores.
        let chain = |ranks| cpu_rank_hardware(&profile, ranks).cpu_row_chain;
        assert_eq!(
            chain(12),
            Some(CpuRowChain {
                alone_speedup: 2.0,
                ranks_outnumber_cores: true
            })
        );
        // With cores to spare, a rank keeps its own threads whether the others work or wait,
        // and waits spin.
        for ranks in [2, 8] {
            assert_eq!(
                chain(ranks),
                Some(CpuRowChain {
                    alone_speedup: 1.0,
                    ranks_outnumber_cores: false
                })
            );
        }
    }

    #[test]
    fn cpu_ranks_plan_int4_and_int8_as_the_engines_q4_0_and_q8_0() {
        assert_eq!(Dtype::Int4.on_cpu(), Dtype::Q4_0);
        assert_eq!(Dtype::Int8.on_cpu(), Dtype::Q8_0);
        assert_eq!(Dtype::Bf16.on_cpu(), Dtype::Bf16);
        // Llama-3.1-8B: its 128256 × 4096 embedding and LM head in 18 bytes per 32 weights
        // (Q4_0), as every matrix; in int4 (AWQ) they stay bf16 and the matrices take 4 bits
        // and a 32-bit scale and zero per 128.
        let spec = crate::model::load("llama-3.1-8b").expect("a shipped profile");
        let params = spec.param_counts();
        let table = 128_256 * 4096;
        let q4_0 = spec.weight_bytes_by_part(Dtype::Q4_0);
        assert_eq!(q4_0.embedding, table * 18 / 32);
        assert_eq!(q4_0.lm_head, table * 18 / 32);
        assert_eq!(q4_0.attention, params.attention * 18 / 32);
        assert_eq!(q4_0.dense_mlp, params.dense_mlp * 18 / 32);
        let awq = spec.weight_bytes_by_part(Dtype::Int4);
        assert_eq!(awq.lm_head, table * 2);
        assert_eq!(awq.attention, params.attention * 17 / 32);
        assert_eq!(
            spec.weight_bytes_by_part(Dtype::Q8_0).lm_head,
            table * 34 / 32
        );
        // On CPU ranks `--dtype int4` plans Q4_0, and says so.
        let cluster = cpu_cluster(1, 8, &profile());
        let settings = Settings {
            objective: Objective::Latency,
            max_model_len_tokens: Some(4096),
            dtype: Some(Dtype::Int4),
            pins: dp(1),
            ..Settings::default()
        };
        let Outcome::Feasible(plan) = plan(&spec, &cluster, &settings) else {
            panic!("8B in Q4_0 fits 32 GiB");
        };
        assert_eq!(plan.dtype, Dtype::Q4_0);
        assert_eq!(plan.memory[0].read_per_step_bytes, {
            let q4_0 = spec.weight_bytes_by_part(Dtype::Q4_0);
            q4_0.total() - q4_0.embedding
        });
        assert!(
            plan.explain
                .iter()
                .any(|l| l.starts_with("--dtype int4 on CPU ranks is planned as q4_0")),
            "{:#?}",
            plan.explain
        );
    }

    #[test]
    fn a_prompts_attention_costs_its_own_rate_and_a_calibration_splits_it_off() {
        use crate::plan::cost::{prefill_attention_flops, prefill_flops, prefill_secs};
        let spec = smollm2();
        // 200 GFLOP/s of products keep the prompt bound by compute (its ~100 MB of weights
        // take 8 ms at 12 GB/s); its attention runs at 40 GFLOP/s.
        let probed = CpuProfile {
            flops_per_sec: 2e11,
            prefill_attention_flops_per_sec: Some(4e10),
            ..profile()
        };
        let one = Degrees {
            tp: 1,
            pp: 1,
            ep: 1,
            dp: 1,
        };
        let links = shm_links();
        let stages = stage_memory(
            &spec,
            &one,
            Dtype::Int4,
            Dtype::Bf16,
            1 << 30,
            0.9,
            Device::Cpu,
        );
        let prefill = |profile: &CpuProfile, ranks: u64, tokens: u64| {
            let hardware = cpu_rank_hardware(profile, ranks);
            prefill_secs(&spec, &one, &stages, Dtype::Int4, &hardware, &links, tokens)
        };
        // By hand: the products at 200 GFLOP/s, the causal attention (2 · 1024² · 9 · 64 ·
        // 30 flops) at 40; a rank of 2 on the host gets half of each rate.
        let attention = 2.0 * 1024.0 * 1024.0 * 576.0 * 30.0;
        assert_eq!(prefill_attention_flops(&spec, 1024), attention);
        let by_hand = (prefill_flops(&spec, 1024) - attention) / 2e11 + attention / 4e10;
        let alone = prefill(&probed, 1, 1024);
        assert!(
            (alone - by_hand).abs() < 1e-9 * by_hand,
            "{alone} vs {by_hand}"
        );
        let half = prefill(&probed, 2, 1024);
        assert!((half - 2.0 * by_hand).abs() < 1e-9 * by_hand, "{half}");
        // A bf16 prompt's products run at the engine's bf16 rate (each weight converted to
        // f32): 10 GFLOP/s here; a quantized one's are unchanged.
        let bf16 = CpuProfile {
            prefill_bf16_flops_per_sec: Some(1e10),
            ..probed.clone()
        };
        let bf16_stages = stage_memory(
            &spec,
            &one,
            Dtype::Bf16,
            Dtype::Bf16,
            1 << 30,
            0.9,
            Device::Cpu,
        );
        let hardware = cpu_rank_hardware(&bf16, 1);
        let secs = prefill_secs(
            &spec,
            &one,
            &bf16_stages,
            Dtype::Bf16,
            &hardware,
            &links,
            1024,
        );
        let by_hand = (prefill_flops(&spec, 1024) - attention) / 1e10 + attention / 4e10;
        assert!(
            (secs - by_hand).abs() < 1e-9 * by_hand,
            "{secs} vs {by_hand}"
        );
        assert_eq!(prefill(&bf16, 1, 1024), alone);
        // Without the rate, the attention runs at the products' rate: less time.
        let unmeasured = CpuProfile {
            prefill_attention_flops_per_sec: None,
            ..probed.clone()
        };
        let lumped = prefill_flops(&spec, 1024) / 2e11;
        let secs = prefill(&unmeasured, 1, 1024);
        assert!(
            (secs - lumped).abs() < 1e-9 * lumped && secs < alone,
            "{secs}"
        );

        // A report of a 128-token prompt of the model in 0.128 s (its flops by the
        // planner's count over that time), whose attention (2 · 128² · 576 · 30 flops) ran
        // at 35 GFLOP/s on the model: the products take the rest of the time.
        let measured_flops = prefill_flops(&spec, 128) / 0.128;
        let report = DecodeReport {
            prefill_tokens_per_sec: 1000.0,
            prefill_flops_per_sec: Some(measured_flops),
            prefill_attention_flops: Some(prefill_attention_flops(&spec, 128)),
            prefill_attention_flops_per_sec: Some(3.5e10),
            ..cpu_report(&probed.name)
        };
        let calibrated = |report: &DecodeReport| {
            let mut cluster = cpu_cluster(1, 8, &probed);
            calibrate(
                &mut cluster,
                "cpu.json",
                Measurement::Decode(Box::new(report.clone())),
            )
            .expect("this cluster's CPU");
            cluster.hosts[0].cpu.clone().expect("a CPU host").profile
        };
        let split = calibrated(&report);
        let attention_128 = 2.0 * 128.0 * 128.0 * 576.0 * 30.0;
        let products = (measured_flops * 0.128 - attention_128) / (0.128 - attention_128 / 3.5e10);
        assert!(
            (split.flops_per_sec - products).abs() < 1e-6 * products,
            "{} vs {products}",
            split.flops_per_sec
        );
        assert_eq!(split.prefill_attention_flops_per_sec, Some(3.5e10));
        // The measured model stands for every weight type: bf16 prompts too.
        assert_eq!(split.prefill_bf16_flops_per_sec, Some(split.flops_per_sec));
        // So the same prompt costs what it measured: 0.128 s.
        let again = prefill(&split, 1, 128);
        assert!((again - 0.128).abs() < 1e-9, "{again}");
        // An attention that would take more than half of the prompt's time is not split
        // off (a measurement too noisy for it): the lumped rate, the probed attention rate.
        let noisy = DecodeReport {
            prefill_attention_flops_per_sec: Some(1e9),
            ..report.clone()
        };
        let lumped = calibrated(&noisy);
        assert_eq!(lumped.flops_per_sec, measured_flops);
        assert_eq!(lumped.prefill_attention_flops_per_sec, Some(4e10));
        // A report from before the split: the same.
        let older = DecodeReport {
            prefill_attention_flops: None,
            prefill_attention_flops_per_sec: None,
            ..report.clone()
        };
        assert_eq!(calibrated(&older).flops_per_sec, measured_flops);

        // A thread computing 0.2 of the host's prompt rates while each of the 8 cores runs
        // one: a one-thread rank (8 ranks) gets 0.2 of every rate, not 1/8; a rank of 4
        // threads (2 ranks) 4 times a per-thread share that runs from 0.2 at one thread to
        // 1/8 at 8 (3/7 of the way at 4): 4 · (0.2 − 3/7 · 0.075) of them.
        let shared = CpuProfile {
            prefill_one_thread_share: Some(0.2),
            ..probed.clone()
        };
        for (ranks, part) in [(8, 0.2), (2, 4.0 * (0.2 - 3.0 / 7.0 * 0.075)), (1, 1.0)] {
            let secs = prefill(&shared, ranks, 1024);
            let by_hand = alone / part;
            assert!(
                (secs - by_hand).abs() < 1e-9 * by_hand,
                "{ranks} ranks: {secs} vs {by_hand}"
            );
            let bf16 = cpu_rank_hardware(
                &CpuProfile {
                    prefill_bf16_flops_per_sec: Some(1e10),
                    ..shared.clone()
                },
                ranks,
            );
            let products = bf16.bf16_products_tflops.expect("measured") * 1e12;
            assert!((products - 1e10 * part).abs() < 1e-3, "{products}");
        }
        // Ranks beyond one per core take turns: 16 ranks on 8 cores each compute at one
        // thread's 0.2 for one of 2 turns.
        let turns = prefill(&shared, 16, 1024);
        assert!((turns - alone / 0.1).abs() < 1e-9 * turns, "{turns}");
        // A calibration takes the measured model's own share.
        let with_share = DecodeReport {
            prefill_one_thread_share: Some(0.3),
            ..report.clone()
        };
        assert_eq!(calibrated(&with_share).prefill_one_thread_share, Some(0.3));
        assert_eq!(calibrated(&report).prefill_one_thread_share, None);
    }

    #[test]
    fn exact_order_tp_on_cpu_ranks_costs_its_turns_and_hops() {
        use crate::plan::cost::{chain_call_secs, chain_wait_secs, decode_step_secs, row_chain};
        let spec = smollm2();
        // SmolLM2: 30 layers of a 576 × 576 output projection and a 1536 → 576 down
        // projection, counted by hand.
        assert_eq!(spec.row_parallel_params(), 30 * (576 * 576 + 1536 * 576));
        let tp2 = Degrees {
            tp: 2,
            pp: 1,
            ep: 1,
            dp: 1,
        };
        let rank = cpu_rank_hardware(&profile(), 2);
        let links = shm_links();
        let step = |dtype: Dtype, hardware: &HardwareSpec| {
            let stages = stage_memory(&spec, &tp2, dtype, dtype, 1 << 30, 0.9, Device::Cpu);
            decode_step_secs(&spec, &tp2, &stages, dtype, hardware, &links, 1, 1024)
        };
        let all_reducing = HardwareSpec {
            cpu_row_chain: None,
            ..rank.clone()
        };
        // bf16 products are summed by an all-reduce: no chain.
        assert_eq!(row_chain(&rank, Dtype::Bf16, 2), None);
        assert_eq!(step(Dtype::Bf16, &rank), step(Dtype::Bf16, &all_reducing));
        assert_eq!(row_chain(&rank, Dtype::Int8, 1), None);
        // int8 runs as Q8_0 in exact order: one more turn of the row-parallel weights (the
        // second rank's, at the same rate: 2 ranks on 8 cores), and each of the 60 sums is
        // 2 messages of 36- then 4-byte outputs instead of one all-reduce of bf16.
        let chain = row_chain(&rank, Dtype::Int8, 2).expect("a chain");
        let turn_secs = spec.row_parallel_bytes(Dtype::Int8) / 2.0 / (rank.hbm_gb_per_sec * 1e9);
        let stages = stage_memory(
            &spec,
            &tp2,
            Dtype::Int8,
            Dtype::Int8,
            1 << 30,
            0.9,
            Device::Cpu,
        );
        let wait = chain_wait_secs(
            &spec,
            2,
            &stages[0],
            Dtype::Int8,
            chain,
            rank.hbm_gb_per_sec,
            rank.bf16_tflops,
            1,
        );
        assert!((wait - turn_secs).abs() < 1e-12, "{wait} vs {turn_secs}");
        // Each of the 2 messages pays the link's message latency, not an all-reduce's.
        let hand_call = 576.0 * 40.0 / 2e9 + 2.0 * 20e-6;
        assert!((chain_call_secs(&spec, 2, &links, 1) - hand_call).abs() < 1e-15);
        let all_reduce_call = 576.0 * 2.0 / 2e9 + 50e-6;
        let extra = step(Dtype::Int8, &rank) - step(Dtype::Int8, &all_reducing);
        let expected = turn_secs + 60.0 * (hand_call - all_reduce_call);
        assert!((extra - expected).abs() < 1e-9, "{extra} vs {expected}");
    }
}
