//! The cluster the planner places ranks on: hosts, their GPU hardware figures and their
//! topology. Pure data; `crate::inventory` builds it from `local`, an inventory or a shorthand,
//! and [`calibrate`] puts a `--calibration` measurement in it.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::calibration::{Calibration, MeasuredDecode, Measurement, Scope};
use crate::topology::Host;

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
    /// GPUs across all hosts.
    pub fn n_gpus(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| h.topology.gpus.len() as u64)
            .sum()
    }

    /// GPUs of the smallest host (the most a TP group can use without crossing hosts).
    pub fn min_gpus_per_host(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| h.topology.gpus.len() as u64)
            .min()
            .unwrap_or(0)
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

/// Adds `measurement` (read from the file `name`) to `cluster`: a link fills its scope's slot; a
/// decode measurement replaces the HBM bandwidth of every host with the measured GPU model.
///
/// Errors: two links of one scope, two decode measurements of one GPU model, a decode
/// measured on a CPU or on a GPU model the cluster does not have.
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
                source: format!("`{name}`, {} at batch {}", report.model, report.batch),
            });
        }
    }
    Ok(())
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
