//! Host topology: GPUs, the links between them, NICs/HCAs and their distance to each GPU.
//!
//! This module owns the plain [`Topology`] value that `plan/` and `doctor/` consume, and is
//! the only module that calls NVML ([`nvml`]) or reads sysfs ([`sysfs`]). Importers turn
//! recorded topologies (`nvidia-smi topo -m` text in [`smi_text`], our own JSON) into the
//! same value, so everything downstream runs on any laptop. A host without GPUs is hardware
//! too: [`cpu`] probes its CPU (cores, memory, memory bandwidth, compute rate) as the one
//! device its CPU ranks share.
//!
//! It must not plan, launch or print: rendering to text lives in [`render`] and returns
//! strings for `ui` to write.

pub mod cpu;
mod domains;
mod link;
pub(crate) mod nccl;
pub(crate) mod nvml;
pub(crate) mod probe;
pub(crate) mod render;
pub(crate) mod smi_text;
pub mod sysfs;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

pub use cpu::CpuProfile;
pub use domains::nvlink_domains;
pub use link::{LinkCode, P2pStatus};

/// Every host of a cluster as probed or imported. The `--json` output of `infer topo`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// One entry per host; `infer topo` on one machine still writes a list of one.
    pub hosts: Vec<Host>,
}

/// One machine: its GPUs, the GPU↔GPU link matrix, NVLink domains and NICs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Host {
    /// Host name as probed (`/proc/sys/kernel/hostname`) or as named on import.
    pub hostname: String,
    /// Where this description came from: `nvml+sysfs`, `nvidia-smi topo -m`, or `json`.
    pub source: String,
    /// NVIDIA driver version (`550.54.15`); `None` when unknown or no driver is loaded.
    #[serde(default)]
    pub driver_version: Option<String>,
    /// Highest CUDA version the driver supports (`12.4`); `None` when unknown.
    #[serde(default)]
    pub cuda_driver_version: Option<String>,
    /// GPUs in NVML index order (`GPU0`, `GPU1`, …); empty on a host without GPUs.
    pub gpus: Vec<Gpu>,
    /// `n_gpus × n_gpus` link codes: `gpu_links[i][j]` is how GPU `i` reaches GPU `j`
    /// (`X` on the diagonal), in `nvidia-smi topo -m` codes.
    pub gpu_links: Vec<Vec<LinkCode>>,
    /// `n_gpus × n_gpus` peer-to-peer read/write status (`nvidia-smi topo -p2p rw`);
    /// `None` when not probed or not part of an imported paste.
    #[serde(default)]
    pub p2p: Option<Vec<Vec<P2pStatus>>>,
    /// GPUs partitioned into NVLink domains: every pair inside one domain is NVLinked.
    /// Every GPU is in exactly one domain; a GPU without NVLink is a domain of one.
    pub nvlink_domains: Vec<Vec<usize>>,
    /// Network adapters: RDMA HCAs (with their netdev) and plain network interfaces.
    pub nics: Vec<Nic>,
    /// Facts worth a line that are not errors ("no NVIDIA driver found", "NIC legend missing").
    #[serde(default)]
    pub notes: Vec<String>,
}

impl Host {
    /// A host named `hostname` known only by name (`source` says where from): no GPU, link,
    /// NIC or driver, as an inventory's CPU host is before anything is probed.
    pub fn named(hostname: String, source: &str) -> Host {
        Host {
            hostname,
            source: source.to_string(),
            driver_version: None,
            cuda_driver_version: None,
            gpus: Vec::new(),
            gpu_links: Vec::new(),
            p2p: None,
            nvlink_domains: Vec::new(),
            nics: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// One GPU as NVML (or `nvidia-smi`) reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML index, as in `GPU<index>` and `CUDA_VISIBLE_DEVICES` with `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
    pub index: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`); `None` when the source did not say.
    #[serde(default)]
    pub name: Option<String>,
    /// `GPU-…` UUID; `None` when unknown.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Total device memory in bytes; `None` when unknown.
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// PCI bus id in sysfs form (`0000:3b:00.0`); `None` when unknown.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    /// NUMA node the GPU is attached to; `None` when unknown or the platform has one node.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// CPUs with affinity to this GPU as a list (`0-47,96-143`); `None` when unknown.
    #[serde(default)]
    pub cpu_affinity: Option<String>,
    /// NVLinks NVML reports as active; `None` when not probed (imports).
    #[serde(default)]
    pub nvlinks_active: Option<u32>,
    /// NVLinks that exist on the GPU but are not active (down, or no bridge fitted);
    /// `None` when not probed.
    #[serde(default)]
    pub nvlinks_inactive: Option<u32>,
}

/// Kind of network adapter, by link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicKind {
    /// InfiniBand HCA (link layer `InfiniBand`), or an IPoIB netdev.
    Ib,
    /// RDMA over Converged Ethernet HCA (link layer `Ethernet`).
    Roce,
    /// Plain Ethernet interface (no RDMA device behind it).
    Eth,
    /// Named in an import without saying its link layer (an `mlx5_*` column).
    Unknown,
}

/// A network adapter: an RDMA device (`mlx5_0`) with its netdev, or a plain interface (`eth0`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    /// RDMA device name for HCAs (`mlx5_0`), interface name otherwise (`eth0`).
    pub name: String,
    /// Link layer.
    pub kind: NicKind,
    /// `ACTIVE`/`DOWN`/`INIT`… (first port) for HCAs, operstate (`up`/`down`) for interfaces.
    #[serde(default)]
    pub state: Option<String>,
    /// Link rate in Gbit/s; `None` when the driver does not report it (virtual NICs).
    #[serde(default)]
    pub rate_gbps: Option<f64>,
    /// Network interface of this adapter (`ib0`, `ens1f0np0`, or the name itself for Ethernet).
    #[serde(default)]
    pub netdev: Option<String>,
    /// True for software interfaces (loopback, bridges, veth, docker, VPNs, tunnels).
    #[serde(default)]
    pub is_virtual: bool,
    /// MTU in bytes.
    #[serde(default)]
    pub mtu_bytes: Option<u32>,
    /// Hardware address.
    #[serde(default)]
    pub mac: Option<String>,
    /// IPv4/IPv6 addresses of `netdev` (probed hosts only).
    #[serde(default)]
    pub addresses: Vec<String>,
    /// PCI bus id of the adapter (`0000:3b:00.0`); `None` for virtual interfaces.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    /// NUMA node of the adapter; `None` when unknown.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// RDMA ports (HCAs only).
    #[serde(default)]
    pub ports: Vec<IbPort>,
    /// Distance to each GPU in `nvidia-smi topo -m` codes, indexed like `Host::gpus`;
    /// empty when it cannot be known (a virtual NIC, or no GPUs).
    #[serde(default)]
    pub gpu_links: Vec<LinkCode>,
}

/// One port of an RDMA device, from `/sys/class/infiniband/<hca>/ports/<n>/`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IbPort {
    /// Port number (1-based, as in `mlx5_0:1`).
    pub port: u32,
    /// Logical state: `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    pub state: String,
    /// Physical state: `LinkUp`, `Disabled`, `Polling`…
    pub phys_state: String,
    /// Rate in Gbit/s; `None` when unreadable.
    pub rate_gbps: Option<f64>,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Non-zero GID table entries.
    #[serde(default)]
    pub gids: Vec<Gid>,
}

/// One non-zero GID table entry of an RDMA port.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gid {
    /// Index in the GID table (what `NCCL_IB_GID_INDEX` selects).
    pub index: u32,
    /// The GID as sysfs prints it (`fe80:0000:…`).
    pub gid: String,
    /// `IB/RoCE v1` or `RoCE v2` when the kernel says; `None` otherwise.
    #[serde(default)]
    pub gid_type: Option<String>,
}

impl Host {
    /// Checks the shape invariants of a host description: a square `gpu_links` of `n_gpus`,
    /// `X` exactly on its diagonal, symmetric codes, NIC `gpu_links` of length 0 or `n_gpus`.
    ///
    /// Errors name the host and the offending cell, for imported JSON that was edited by hand.
    pub(crate) fn validate(&self) -> Result<()> {
        let n_gpus = self.gpus.len();
        let host = &self.hostname;
        if self.gpu_links.len() != n_gpus {
            bail!(
                "host `{host}` has {n_gpus} GPUs but {} rows in `gpu_links`",
                self.gpu_links.len()
            );
        }
        for (i, row) in self.gpu_links.iter().enumerate() {
            if row.len() != n_gpus {
                bail!(
                    "host `{host}`: `gpu_links[{i}]` has {} entries, expected {n_gpus}",
                    row.len()
                );
            }
            for (j, code) in row.iter().enumerate() {
                if (i == j) != (*code == LinkCode::SelfLink) {
                    bail!(
                        "host `{host}`: `gpu_links[{i}][{j}]` is `{code}`; `X` belongs exactly on the diagonal"
                    );
                }
                if self.gpu_links[j].get(i) != Some(code) {
                    bail!("host `{host}`: `gpu_links` is not symmetric at GPU{i}/GPU{j}");
                }
            }
        }
        for (i, gpu) in self.gpus.iter().enumerate() {
            if gpu.index != i {
                bail!("host `{host}`: GPU at position {i} has index {}", gpu.index);
            }
        }
        for nic in &self.nics {
            if !nic.gpu_links.is_empty() && nic.gpu_links.len() != n_gpus {
                bail!(
                    "host `{host}`: NIC `{}` has {} `gpu_links`, expected {n_gpus}",
                    nic.name,
                    nic.gpu_links.len()
                );
            }
        }
        Ok(())
    }

    /// The GPUs closest to `nic`: those at its smallest link code. Empty when unknown.
    pub fn nearest_gpus(&self, nic: &Nic) -> Vec<usize> {
        let Some(best) = nic.gpu_links.iter().min() else {
            return Vec::new();
        };
        (0..nic.gpu_links.len())
            .filter(|&i| nic.gpu_links[i] == *best)
            .collect()
    }
}

impl Topology {
    /// Parses `text` as `infer topo --json` output (when it starts with `{`) or as
    /// `nvidia-smi topo -m` text; `origin` names the input in errors and becomes the host
    /// name of a text import.
    ///
    /// Errors: malformed JSON, a JSON host failing [`Host::validate`], or any error of
    /// [`smi_text::parse`].
    pub fn import(text: &str, origin: &str) -> Result<Topology> {
        if text.trim_start().starts_with('{') {
            let topology: Topology = serde_json::from_str(text).with_context(|| {
                format!("`{origin}` looks like JSON but is not `infer topo --json` output")
            })?;
            for host in &topology.hosts {
                host.validate()
                    .with_context(|| format!("`{origin}` is not a consistent topology"))?;
            }
            return Ok(topology);
        }
        let host = smi_text::parse(text, origin)?;
        Ok(Topology { hosts: vec![host] })
    }
}

/// A network interface with its IPv4 addresses, as a host's agent reports it (`ip -4 addr`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interface {
    /// Interface name (`ens5`).
    pub name: String,
    /// IPv4 addresses with their prefix length (`10.0.2.11/24`).
    pub ipv4: Vec<String>,
    /// Operationally up.
    pub up: bool,
    /// Loopback, bridge, veth, VPN, tunnel… (see [`sysfs`]).
    pub is_virtual: bool,
    pub mtu_bytes: Option<u32>,
}
