//! Building a [`Cluster`] from what `--cluster` names: `local` (probe this host), a TOML
//! inventory of hosts, or a shorthand `NODESxGPUSxHW` such as `2x8xh100-sxm`. GPU figures
//! come from `profiles/hardware/` (embedded); a host without GPUs (`local` here, an
//! inventory's `cpu-ranks` hosts) is its CPU, probed ([`probe_cpu`]). This is the I/O edge of
//! the planner.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::plan::cluster::{Cluster, ClusterHost, HardwareSpec};
use crate::topology::CpuProfile;
use crate::topology::cpu::{attention_occupancy, probe_cpu};
use crate::topology::probe::{ProbeOptions, probe_host};
use crate::topology::{Gpu, Host, LinkCode, Topology, nvlink_domains};

/// Hardware profiles shipped in `profiles/hardware/`, by id.
pub(crate) const HARDWARE_PROFILES: &[(&str, &str)] = &[
    (
        "h100-sxm",
        include_str!("../../profiles/hardware/h100-sxm.toml"),
    ),
    (
        "h100-pcie",
        include_str!("../../profiles/hardware/h100-pcie.toml"),
    ),
    (
        "h200-sxm",
        include_str!("../../profiles/hardware/h200-sxm.toml"),
    ),
    (
        "a100-sxm-80g",
        include_str!("../../profiles/hardware/a100-sxm-80g.toml"),
    ),
    (
        "a100-pcie-80g",
        include_str!("../../profiles/hardware/a100-pcie-80g.toml"),
    ),
    ("l40s", include_str!("../../profiles/hardware/l40s.toml")),
    ("l4", include_str!("../../profiles/hardware/l4.toml")),
    (
        "rtx-pro-6000",
        include_str!("../../profiles/hardware/rtx-pro-6000.toml"),
    ),
    ("b200", include_str!("../../profiles/hardware/b200.toml")),
];

/// The hardware profile `id`. Errors: unknown id (listing the known ones), malformed profile.
pub fn hardware(id: &str) -> Result<HardwareSpec> {
    let Some((_, text)) = HARDWARE_PROFILES.iter().find(|(n, _)| *n == id) else {
        let known: Vec<&str> = HARDWARE_PROFILES.iter().map(|(n, _)| *n).collect();
        bail!(
            "unknown hardware profile `{id}`; known: {}",
            known.join(", ")
        );
    };
    toml::from_str(text).with_context(|| format!("hardware profile `{id}` is malformed"))
}

/// The cluster `cluster` names ([`load`]), each CPU-rank host with its own CPU as
/// `probed` on it (`--probe-hosts`: host name and profile; empty: none), then every
/// calibration file's measurements (`--calibration`: `infer bench allreduce --json` or
/// `infer bench decode --json`) applied in order.
///
/// Errors: [`load`]'s, a CPU-rank host `probed` does not name, a calibration that cannot be
/// read or parsed or does not fit the cluster.
pub fn load_calibrated(
    cluster: &str,
    sysfs_root: &Path,
    probed: &[(String, crate::topology::CpuProfile)],
    calibrations: &[PathBuf],
) -> Result<Cluster> {
    let mut cluster = load(cluster, sysfs_root)?;
    if !probed.is_empty() {
        crate::plan::cluster::use_probed_cpus(&mut cluster, probed)?;
    }
    for path in calibrations {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the calibration `{}`", path.display()))?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let measured = crate::plan::calibration::parse(&name, &text)?;
        crate::plan::cluster::calibrate(&mut cluster, &name, measured)?;
    }
    Ok(cluster)
}

/// Resolves `--cluster`.
///
/// Errors: a shorthand with an unknown profile or zero counts, an unreadable or malformed
/// inventory, a host whose CPU cannot be probed.
pub fn load(cluster: &str, sysfs_root: &Path) -> Result<Cluster> {
    if cluster == "local" {
        return local(sysfs_root);
    }
    let path = Path::new(cluster);
    if path.is_file() {
        return inventory(path);
    }
    if let Some(parsed) = shorthand(cluster)? {
        return Ok(parsed);
    }
    bail!(
        "`{cluster}` is not `local`, an inventory file, or a shorthand like `2x8xh100-sxm`\n\
         hint: shorthands are NODESxGPUSxHARDWARE with HARDWARE one of: {}",
        HARDWARE_PROFILES
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `2x8xh100-sxm` → 2 synthetic hosts of 8 GPUs. `None` when `text` is not of that shape.
fn shorthand(text: &str) -> Result<Option<Cluster>> {
    let mut parts = text.splitn(3, 'x');
    let (Some(nodes), Some(gpus), Some(hw)) = (parts.next(), parts.next(), parts.next()) else {
        return Ok(None);
    };
    let (Ok(n_nodes), Ok(n_gpus)) = (nodes.parse::<usize>(), gpus.parse::<usize>()) else {
        return Ok(None);
    };
    if n_nodes == 0 || n_gpus == 0 {
        bail!("`{text}`: node and GPU counts must be at least 1");
    }
    let spec = hardware(hw).with_context(|| format!("in cluster shorthand `{text}`"))?;
    let hosts = (0..n_nodes)
        .map(|i| {
            let name = format!("node{i}");
            ClusterHost {
                topology: synthetic_topology(&name, n_gpus, &spec),
                name,
                address: None,
                hardware_id: hw.to_string(),
                hardware: spec.clone(),
                cpu: None,
            }
        })
        .collect();
    Ok(Some(Cluster {
        description: text.to_string(),
        hosts,
        measured: Default::default(),
    }))
}

/// The standard server of a hardware profile: NVSwitch boards are one NVLink domain
/// (`NV<links>`, 18 links on Hopper/Blackwell, 12 on A100); PCIe servers put half the GPUs
/// on each socket (`NODE` within, `SYS` across).
pub(crate) fn synthetic_topology(hostname: &str, n_gpus: usize, spec: &HardwareSpec) -> Host {
    let domain = (spec.nvlink_domain_size as usize).max(1);
    let links = ((spec.nvlink_gb_per_sec / 50.0) as u32).clamp(1, 18);
    let half = n_gpus.div_ceil(2).max(1);
    let gpu_links: Vec<Vec<LinkCode>> = (0..n_gpus)
        .map(|i| {
            (0..n_gpus)
                .map(|j| {
                    if i == j {
                        LinkCode::SelfLink
                    } else if domain > 1 && i / domain == j / domain {
                        LinkCode::NvLink(links)
                    } else if i / half == j / half {
                        LinkCode::Node
                    } else {
                        LinkCode::Sys
                    }
                })
                .collect()
        })
        .collect();
    let gpus = (0..n_gpus)
        .map(|index| Gpu {
            index,
            name: Some(spec.name.clone()),
            uuid: None,
            memory_bytes: Some(spec.memory_bytes),
            pci_bus_id: None,
            numa_node: Some((index / half) as u32),
            cpu_affinity: None,
            nvlinks_active: None,
            nvlinks_inactive: None,
        })
        .collect();
    Host {
        hostname: hostname.to_string(),
        source: "hardware profile".to_string(),
        driver_version: None,
        cuda_driver_version: None,
        gpus,
        nvlink_domains: nvlink_domains(&gpu_links),
        gpu_links,
        p2p: None,
        nics: Vec::new(),
        notes: Vec::new(),
    }
}

/// This host's CPU as the planner needs it: [`probe_cpu`]'s figures, and the rates at which
/// the CPU engine reads quantized and bf16 weights and attends over cached positions in a
/// decode step ([`crate::runtime::exec::bench::engine_decode_rates`]), which bound the steps
/// the planner predicts. The attention's rate is scaled to every thread busy
/// ([`attention_occupancy`] of the probe's tasks), and the same on one thread alone. About two
/// seconds of the host in all.
///
/// Errors: as [`probe_cpu`]; the engine probe cannot allocate its model or fails a step.
pub fn probe_cpu_for_planning() -> Result<CpuProfile> {
    let started = std::time::Instant::now();
    let mut profile = probe_cpu()?;
    let rates = crate::runtime::exec::bench::engine_decode_rates()
        .context("cannot measure the CPU engine's decode step")?;
    profile.decode_bytes_per_sec = Some(rates.weights_bytes_per_sec);
    profile.decode_bf16_bytes_per_sec = Some(rates.bf16_weights_bytes_per_sec);
    profile.prefill_bf16_flops_per_sec = Some(rates.bf16_prefill_flops_per_sec);
    profile.decode_layer_secs = rates.layer_secs;
    profile.prefill_attention_flops_per_sec = rates.prefill_attention_flops_per_sec;
    profile.prefill_one_thread_share = rates.prefill_one_thread_share;
    // The engine's quantized products outrun the f32 FMA peak: its own rate.
    if rates.prefill_flops_per_sec.is_finite() && rates.prefill_flops_per_sec > 0.0 {
        profile.flops_per_sec = rates.prefill_flops_per_sec;
    }
    if let Some(alone) = rates.one_thread {
        profile.decode_one_thread_bytes_per_sec = Some(alone.weights_bytes_per_sec);
        profile.decode_one_thread_attention_flops_per_sec =
            alone.attention.map(|attention| attention.flops_per_sec);
    }
    profile.decode_attention_flops_per_sec = rates.attention.map(|attention| {
        attention.flops_per_sec
            / attention_occupancy(attention.tasks as u64, attention.threads as u64)
    });
    profile.source = format!(
        "probed on this host in {:.2} s{}{}",
        started.elapsed().as_secs_f64(),
        if rates.attention.is_none() {
            "; its attention not measured (the host was too busy): the KV cache read at the weights' rate"
        } else {
            ""
        },
        if rates.prefill_attention_flops_per_sec.is_none() {
            "; a prompt's attention not measured (the host was too busy): computed at the products' rate"
        } else {
            ""
        }
    );
    Ok(profile)
}

/// This host, probed. The hardware profile is matched from the GPU name; a host without
/// GPUs is planned on its CPU: one rank per core at most, its figures probed.
fn local(sysfs_root: &Path) -> Result<Cluster> {
    let host = probe_host(&ProbeOptions {
        sysfs_root: sysfs_root.to_path_buf(),
    })?;
    let Some(gpu_name) = host.gpus.first().and_then(|g| g.name.clone()) else {
        let profile = probe_cpu_for_planning()
            .context("this host has no NVIDIA GPUs, and its CPU could not be probed")?;
        let max_ranks = profile.n_cores;
        return Ok(Cluster {
            description: "local".to_string(),
            hosts: vec![ClusterHost::cpu(
                host.hostname.clone(),
                None,
                profile,
                max_ranks,
                host,
            )],
            measured: Default::default(),
        });
    };
    let hardware_id = hardware_for_gpu_name(&gpu_name)
        .with_context(|| format!("no hardware profile matches GPU `{gpu_name}`; use a cluster inventory that names `hardware`"))?;
    let mut hardware = hardware(hardware_id)?;
    if let Some(memory_bytes) = host.gpus.iter().filter_map(|g| g.memory_bytes).min() {
        hardware.memory_bytes = memory_bytes;
    }
    Ok(Cluster {
        description: "local".to_string(),
        hosts: vec![ClusterHost {
            name: host.hostname.clone(),
            address: None,
            hardware_id: hardware_id.to_string(),
            hardware,
            topology: host,
            cpu: None,
        }],
        measured: Default::default(),
    })
}

pub use crate::plan::cluster::hardware_for_gpu_name;

/// A cluster inventory file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Inventory {
    /// Values every host takes unless it sets its own.
    #[serde(default)]
    defaults: InventoryHost,
    hosts: Vec<InventoryHost>,
}

/// One `[[hosts]]` entry (or `[defaults]`: any key but `name` and `address`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct InventoryHost {
    /// Name used in rank tables, logs and env (defaults to `address`).
    name: Option<String>,
    /// What SSH connects to (management network): an address, a hostname, or a `Host`
    /// alias of `~/.ssh/config`.
    address: Option<String>,
    #[serde(alias = "ssh-port")]
    port: Option<u16>,
    #[serde(alias = "ssh-user")]
    user: Option<String>,
    /// An SSH private key, tried after ssh-agent's keys (`~/` expanded).
    identity_file: Option<String>,
    /// A `known_hosts` file searched before `~/.ssh/known_hosts` (relative to the inventory).
    known_hosts: Option<String>,
    /// GPUs to use on it.
    gpus: Option<usize>,
    /// CPU ranks to run on it (the engine's CPU backend), instead of GPUs.
    cpu_ranks: Option<usize>,
    /// Hardware profile id (needed for GPUs).
    hardware: Option<String>,
    /// `infer topo --json` output or `nvidia-smi topo -m` text, relative to the inventory.
    topology: Option<String>,
    /// The data interface NCCL/GLOO and our collectives use on this host; chosen from the
    /// host's probed interfaces when unset.
    nccl_socket_ifname: Option<String>,
    /// Where `infer` is on the host; default: the launcher's own path, then the copy the
    /// launcher stages into `~/.cache/infer/bin/`.
    infer_path: Option<String>,
}

impl InventoryHost {
    /// This entry with every unset key taken from `defaults`.
    fn with_defaults(self, defaults: &InventoryHost) -> InventoryHost {
        let d = defaults.clone();
        InventoryHost {
            name: self.name,
            address: self.address,
            port: self.port.or(d.port),
            user: self.user.or(d.user),
            identity_file: self.identity_file.or(d.identity_file),
            known_hosts: self.known_hosts.or(d.known_hosts),
            gpus: self.gpus.or(d.gpus),
            cpu_ranks: self.cpu_ranks.or(d.cpu_ranks),
            hardware: self.hardware.or(d.hardware),
            topology: self.topology.or(d.topology),
            nccl_socket_ifname: self.nccl_socket_ifname.or(d.nccl_socket_ifname),
            infer_path: self.infer_path.or(d.infer_path),
        }
    }
}

/// One host of an inventory as the launcher needs it: where SSH goes and what runs there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InventoryEntry {
    pub name: String,
    pub address: String,
    /// `None`: from `~/.ssh/config`, else 22.
    pub port: Option<u16>,
    /// `None`: from `~/.ssh/config`, else the local user.
    pub user: Option<String>,
    pub identity_file: Option<PathBuf>,
    /// Resolved against the inventory's folder.
    pub known_hosts: Option<PathBuf>,
    /// Rank slots: its `cpu-ranks`, else its `gpus`.
    pub slots: usize,
    /// Whether the slots are CPU ranks.
    pub cpu: bool,
    pub nccl_socket_ifname: Option<String>,
    pub infer_path: Option<String>,
}

/// Reads an inventory for launching (`infer up/generate --cluster hosts.toml`):
///
/// ```toml
/// [defaults]
/// user = "root"
/// identity-file = "~/.ssh/id_ed25519"
///
/// [[hosts]]
/// name = "node0"
/// address = "10.0.0.11"
/// cpu-ranks = 2                # or: gpus = 8 (with hardware = "h100-sxm")
/// nccl-socket-ifname = "ens5"  # optional
/// ```
///
/// Errors: an unreadable file, unknown keys (naming the line), a host without `address`, a
/// host string starting with `-`, neither or both of `gpus` and `cpu-ranks`, repeated names.
pub fn launch_inventory(path: &Path) -> Result<Vec<InventoryEntry>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read `{}`", path.display()))?;
    parse_launch_inventory(&text, path)
}

/// [`launch_inventory`] of `text`, as if read from `path` (which names it in messages and
/// anchors its relative paths).
///
/// Errors: as [`launch_inventory`], but for reading the file.
pub fn parse_launch_inventory(text: &str, path: &Path) -> Result<Vec<InventoryEntry>> {
    let (inventory, places) = parse_inventory(text, path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let mut entries: Vec<InventoryEntry> = Vec::new();
    for (host, place) in inventory.hosts.into_iter().zip(&places) {
        let host = host.with_defaults(&inventory.defaults);
        let Some(address) = host.address.clone() else {
            bail!("the host at {place} has no `address`");
        };
        let name = host.name.clone().unwrap_or_else(|| address.clone());
        for (what, value) in [
            ("address", Some(&address)),
            ("user", host.user.as_ref()),
            ("name", Some(&name)),
        ] {
            if let Some(value) = value
                && (value.starts_with('-') || value.is_empty())
            {
                bail!("host `{name}` at {place}: {what} `{value}` is empty or starts with `-`");
            }
        }
        let (slots, cpu) = match (host.cpu_ranks, host.gpus) {
            (Some(n), None) => (n, true),
            (None, Some(n)) => (n, false),
            _ => bail!("host `{name}` at {place}: give exactly one of `gpus` and `cpu-ranks`"),
        };
        if slots == 0 {
            bail!("host `{name}` at {place}: `gpus`/`cpu-ranks` must be at least 1");
        }
        if let Some(first) = entries.iter().position(|e| e.name == name) {
            bail!(
                "host `{name}` at {place} is already listed at {}: host names must be unique (two entries would put two ranks on one device)",
                places[first]
            );
        }
        let expand = |p: &str| match p.strip_prefix("~/") {
            Some(rest) => home.join(rest),
            None => base.join(p),
        };
        entries.push(InventoryEntry {
            name,
            address,
            port: host.port,
            user: host.user,
            identity_file: host.identity_file.as_deref().map(expand),
            known_hosts: host.known_hosts.as_deref().map(expand),
            slots,
            cpu,
            nccl_socket_ifname: host.nccl_socket_ifname,
            infer_path: host.infer_path,
        });
    }
    if entries.is_empty() {
        bail!("`{}` lists no `[[hosts]]`", path.display());
    }
    Ok(entries)
}

/// Whether `cluster` names an inventory file (rather than `local` or a shorthand).
pub fn is_inventory(cluster: &str) -> bool {
    cluster != "local" && Path::new(cluster).is_file()
}

/// Reads and parses an inventory; also returns, for each `[[hosts]]` entry in order, where
/// it is (`` `hosts.toml` line 12 ``) for messages.
fn read_inventory(path: &Path) -> Result<(Inventory, Vec<String>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read `{}`", path.display()))?;
    parse_inventory(&text, path)
}

/// Parses an inventory's text (named `path` in messages); see [`read_inventory`].
fn parse_inventory(text: &str, path: &Path) -> Result<(Inventory, Vec<String>)> {
    let inventory: Inventory = toml::from_str(text)
        .with_context(|| format!("`{}` is not a valid cluster inventory", path.display()))?;
    let mut places: Vec<String> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| line.trim_start().starts_with("[[hosts]]"))
        .map(|(number, _)| format!("`{}` line {}", path.display(), number + 1))
        .collect();
    // Inline tables (`hosts = [{…}]`) have no `[[hosts]]` headers: name them by position.
    if places.len() != inventory.hosts.len() {
        places = (1..=inventory.hosts.len())
            .map(|i| format!("`{}` host {i}", path.display()))
            .collect();
    }
    Ok((inventory, places))
}

/// Reads a TOML inventory for planning (see [`launch_inventory`] for the launch keys):
///
/// ```toml
/// [[hosts]]
/// name = "gpu-node-1"
/// address = "10.0.0.11"
/// ssh-user = "ubuntu"
/// gpus = 8
/// hardware = "h100-sxm"
/// topology = "gpu-node-1.json"   # optional
/// ```
///
/// A host with `cpu-ranks = N` instead runs up to `N` CPU ranks; planning cannot reach the
/// hosts, so its CPU is taken to be this host's (probed here once, and said so in the plan).
/// An inventory does not mix GPU and CPU-rank hosts.
fn inventory(path: &Path) -> Result<Cluster> {
    let (inventory, places) = read_inventory(path)?;
    if inventory.hosts.is_empty() {
        bail!("`{}` lists no `[[hosts]]`", path.display());
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let mut hosts: Vec<ClusterHost> = Vec::new();
    let mut cpu_profile: Option<crate::topology::CpuProfile> = None;
    for (entry, place) in inventory.hosts.into_iter().zip(&places) {
        let entry = entry.with_defaults(&inventory.defaults);
        let address = entry
            .address
            .clone()
            .with_context(|| format!("the host at {place} has no `address`"))?;
        let name = entry.name.clone().unwrap_or_else(|| address.clone());
        if let Some(first) = hosts.iter().position(|h| h.name == name) {
            bail!(
                "host `{name}` at {place} is already listed at {}: host names must be unique (two entries would put two ranks on one GPU)",
                places[first]
            );
        }
        if let Some(ranks) = entry.cpu_ranks {
            if entry.gpus.is_some() || entry.hardware.is_some() {
                bail!(
                    "host `{name}` at {place}: give `cpu-ranks` (its CPU, probed) or `gpus` with `hardware`, not both"
                );
            }
            if ranks == 0 {
                bail!("host `{name}` at {place}: `cpu-ranks = 0`; give at least 1");
            }
            if hosts.iter().any(|h| h.cpu.is_none()) {
                bail!(
                    "host `{name}` at {place} runs CPU ranks and an earlier host GPUs: plan GPU hosts and CPU-rank hosts in separate inventories"
                );
            }
            let profile = match &cpu_profile {
                Some(profile) => profile.clone(),
                None => {
                    let mut probed = probe_cpu_for_planning().context(
                        "cannot probe this host's CPU, which stands for the inventory's CPU-rank hosts",
                    )?;
                    probed.source = format!(
                        "this host's CPU, {}; `{}` does not say its hosts' own",
                        probed.source,
                        path.display()
                    );
                    cpu_profile = Some(probed.clone());
                    probed
                }
            };
            let topology = match &entry.topology {
                Some(file) => imported_topology(&base.join(file), &name, 0)?,
                None => Host::named(name.clone(), "inventory"),
            };
            hosts.push(ClusterHost::cpu(
                name,
                Some(address),
                profile,
                ranks as u64,
                topology,
            ));
            continue;
        }
        if hosts.iter().any(|h| h.cpu.is_some()) {
            bail!(
                "host `{name}` at {place} has GPUs and an earlier host runs CPU ranks: plan GPU hosts and CPU-rank hosts in separate inventories"
            );
        }
        let (Some(gpus), Some(hardware_id)) = (entry.gpus, entry.hardware.clone()) else {
            bail!(
                "host `{name}` at {place} has no `gpus` and `hardware`, nor `cpu-ranks`: give its GPUs and their hardware profile, or the CPU ranks it runs"
            );
        };
        if gpus == 0 {
            bail!(
                "host `{name}` at {place}: `gpus = 0`; give its GPU count (at least 1), or leave a host without GPUs out"
            );
        }
        let hardware =
            hardware(&hardware_id).with_context(|| format!("host `{name}` at {place}"))?;
        let topology = match &entry.topology {
            Some(file) => imported_topology(&base.join(file), &name, gpus)?,
            None => synthetic_topology(&name, gpus, &hardware),
        };
        hosts.push(ClusterHost {
            name,
            address: Some(address),
            hardware_id,
            hardware,
            topology,
            cpu: None,
        });
    }
    Ok(Cluster {
        description: path.display().to_string(),
        hosts,
        measured: Default::default(),
    })
}

/// The first host of the topology `file` (`infer topo --json` or `nvidia-smi topo -m`),
/// renamed `name`. Errors: the file cannot be read or parsed, or has another GPU count than
/// the inventory's `gpus` (0 for a CPU-rank host).
fn imported_topology(file: &Path, name: &str, gpus: usize) -> Result<Host> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("failed to read `{}`", file.display()))?;
    let mut imported = Topology::import(&text, name)?;
    if imported.hosts.is_empty() {
        bail!("`{}` describes no host", file.display());
    }
    let mut host = imported.hosts.remove(0);
    if host.gpus.len() != gpus {
        bail!(
            "host `{name}`: inventory says {} GPUs but `{}` has {}",
            gpus,
            file.display(),
            host.gpus.len()
        );
    }
    host.hostname = name.to_string();
    Ok(host)
}
