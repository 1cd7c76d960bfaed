//! NICs and RDMA HCAs from sysfs, and each one's PCIe distance to each GPU.
//!
//! Reads `<root>/class/net/*`, `<root>/class/infiniband/*/ports/*` and the PCI device tree
//! under `<root>/devices`; `root` is `/sys` on a live host and a directory built by the tests
//! otherwise. It reads files only: IP addresses come from the caller (sysfs does not hold
//! them), and it never touches NVML.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};

use super::{Gid, Gpu, IbPort, LinkCode, Nic, NicKind};

/// Interface-name prefixes of software interfaces that never carry inter-host GPU traffic:
/// loopback, container and VM bridges, veth pairs, VPNs, overlay networks and tunnels.
pub const VIRTUAL_PREFIXES: &[&str] = &[
    "lo",
    "docker",
    "veth",
    "virbr",
    "lxcbr",
    "lxdbr",
    "br-",
    "cni",
    "flannel",
    "cali",
    "cilium",
    "vxlan",
    "weave",
    "tailscale",
    "wg",
    "zt",
    "tun",
    "tap",
    "ip6tnl",
    "ip6gre",
    "tunl",
    "sit",
    "gre",
    "erspan",
    "ifb",
    "dummy",
    "kube",
];

/// Probes every network interface and RDMA device under `root` (normally `/sys`).
///
/// * `gpus`: the host's GPUs (their `pci_bus_id` and `numa_node` give NIC↔GPU distances;
///   GPUs without a bus id make every NIC's `gpu_links` empty).
/// * `addresses`: IP addresses by interface name, from `getifaddrs` on a live host.
///
/// HCAs come first (sorted by name), each carrying its netdev; then the interfaces that
/// belong to no HCA (sorted by name). Returns an empty list when `root/class/net` is absent.
///
/// Errors: a sysfs directory that exists but cannot be listed.
pub fn probe_nics(
    root: &Path,
    gpus: &[Gpu],
    addresses: &HashMap<String, Vec<String>>,
) -> Result<Vec<Nic>> {
    let distances = GpuDistances::of(root, gpus);
    let (mut nics, netdevs_of_hcas) = probe_hcas(root, &distances, addresses)?;
    nics.extend(probe_interfaces(
        root,
        &distances,
        addresses,
        &netdevs_of_hcas,
    )?);
    Ok(nics)
}

/// Where the host's GPUs sit on the PCI tree, to give each NIC its link to every GPU.
struct GpuDistances {
    /// Each GPU's PCI chain (root port first) and NUMA node; `None` when a GPU has no bus id
    /// or its device is not in sysfs.
    gpu_paths: Option<Vec<(Vec<String>, Option<u32>)>>,
    /// NUMA nodes on the host.
    n_numa_nodes: usize,
}

impl GpuDistances {
    /// The GPUs' places under `root` (normally `/sys`).
    fn of(root: &Path, gpus: &[Gpu]) -> Self {
        let n_numa_nodes = count_numa_nodes(root);
        let gpu_paths = gpus
            .iter()
            .map(|gpu| {
                let bus_id = gpu.pci_bus_id.as_deref()?;
                let path = fs::canonicalize(root.join("bus/pci/devices").join(bus_id)).ok()?;
                Some((pci_chain(&path), gpu.numa_node))
            })
            .collect();
        GpuDistances {
            gpu_paths,
            n_numa_nodes,
        }
    }

    /// The link code from a device at PCI `chain` on NUMA node `numa` to every GPU; empty
    /// when the device or a GPU has no place on the PCI tree.
    fn links(&self, chain: &[String], numa: Option<u32>) -> Vec<LinkCode> {
        match (&self.gpu_paths, chain.is_empty()) {
            (Some(gpu_paths), false) => gpu_paths
                .iter()
                .map(|(gpu_chain, gpu_numa)| {
                    pci_link_code(chain, gpu_chain, numa, *gpu_numa, self.n_numa_nodes)
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// Every RDMA device under `root/class/infiniband` (sorted by name) as a NIC carrying its
/// netdev, and the netdevs those devices own. Errors: a sysfs directory that exists but
/// cannot be listed.
fn probe_hcas(
    root: &Path,
    distances: &GpuDistances,
    addresses: &HashMap<String, Vec<String>>,
) -> Result<(Vec<Nic>, Vec<String>)> {
    let mut nics = Vec::new();
    let mut netdevs_of_hcas = Vec::new();
    for hca in list_dir(&root.join("class/infiniband"))? {
        let hca_dir = root.join("class/infiniband").join(&hca);
        let device = fs::canonicalize(hca_dir.join("device")).ok();
        let chain = device.as_deref().map(pci_chain).unwrap_or_default();
        let numa_node = device.as_deref().and_then(read_numa_node);
        let ports = read_ports(&hca_dir.join("ports"))?;
        let mut netdevs = list_dir(&hca_dir.join("device/net")).unwrap_or_default();
        if netdevs.is_empty() {
            // Soft-RoCE (rxe) and some drivers only name the netdev in the GID attributes.
            if let Some(ndev) = read_trimmed(&hca_dir.join("ports/1/gid_attrs/ndevs/0")) {
                netdevs.push(ndev);
            }
        }
        let netdev = netdevs.first().cloned();
        netdevs_of_hcas.extend(netdevs);
        let first_port = ports.first();
        let kind = match first_port.map(|p| p.link_layer.as_str()) {
            Some("Ethernet") => NicKind::Roce,
            _ => NicKind::Ib,
        };
        let net_dir = netdev.as_ref().map(|n| root.join("class/net").join(n));
        nics.push(Nic {
            name: hca.clone(),
            kind,
            state: first_port.map(|p| p.state.clone()),
            rate_gbps: first_port.and_then(|p| p.rate_gbps),
            mtu_bytes: net_dir
                .as_ref()
                .and_then(|d| read_trimmed(&d.join("mtu"))?.parse().ok()),
            mac: net_dir
                .as_ref()
                .and_then(|d| read_trimmed(&d.join("address"))),
            addresses: netdev
                .as_ref()
                .and_then(|n| addresses.get(n).cloned())
                .unwrap_or_default(),
            netdev,
            is_virtual: device.is_none(),
            pci_bus_id: chain.last().cloned(),
            numa_node,
            ports,
            gpu_links: distances.links(&chain, numa_node),
        });
    }
    Ok((nics, netdevs_of_hcas))
}

/// The interfaces under `root/class/net` (sorted by name) that belong to none of the
/// RDMA devices (`netdevs_of_hcas`). Errors: a sysfs directory that exists but cannot be
/// listed.
fn probe_interfaces(
    root: &Path,
    distances: &GpuDistances,
    addresses: &HashMap<String, Vec<String>>,
    netdevs_of_hcas: &[String],
) -> Result<Vec<Nic>> {
    let mut nics = Vec::new();
    for name in list_dir(&root.join("class/net"))? {
        if netdevs_of_hcas.contains(&name) {
            continue;
        }
        let dir = root.join("class/net").join(&name);
        let device = fs::canonicalize(dir.join("device")).ok();
        let chain = device.as_deref().map(pci_chain).unwrap_or_default();
        let numa_node = device.as_deref().and_then(read_numa_node);
        let speed_mbps: Option<i64> = read_trimmed(&dir.join("speed")).and_then(|s| s.parse().ok());
        let kind = match read_trimmed(&dir.join("type")).as_deref() {
            // ARPHRD_INFINIBAND: an IPoIB interface whose HCA was not found above.
            Some("32") => NicKind::Ib,
            _ => NicKind::Eth,
        };
        nics.push(Nic {
            kind,
            state: read_trimmed(&dir.join("operstate")),
            rate_gbps: speed_mbps.filter(|&s| s > 0).map(|s| s as f64 / 1000.0),
            netdev: Some(name.clone()),
            is_virtual: is_virtual_interface(&dir, &name, device.is_some()),
            mtu_bytes: read_trimmed(&dir.join("mtu")).and_then(|s| s.parse().ok()),
            mac: read_trimmed(&dir.join("address")),
            addresses: addresses.get(&name).cloned().unwrap_or_default(),
            pci_bus_id: chain.last().cloned(),
            numa_node,
            ports: Vec::new(),
            gpu_links: distances.links(&chain, numa_node),
            name,
        });
    }
    Ok(nics)
}

/// Converts NVML's bus id (`00000000:3B:00.0`, 8-digit domain, upper case) to the sysfs
/// form (`0000:3b:00.0`).
pub fn sysfs_bus_id(nvml_bus_id: &str) -> String {
    let lower = nvml_bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// The nvidia-smi code for the PCIe path between two devices, from their PCI chains
/// (`[pci0000:3a, 0000:3a:00.0, …, device]`, see [`pci_chain`]).
///
/// Following nvidia-smi's legend: different root complexes are `NODE` on one NUMA node and
/// `SYS` across nodes (an unknown node counts as `NODE` on a host with one NUMA node, `SYS`
/// otherwise); sharing only the root complex is `PHB`; sharing bridges with each device at
/// most two levels below the shared one (device → downstream port → switch) is `PIX`, one
/// PCIe switch; deeper is `PXB`.
pub(crate) fn pci_link_code(
    a: &[String],
    b: &[String],
    numa_a: Option<u32>,
    numa_b: Option<u32>,
    n_numa_nodes: usize,
) -> LinkCode {
    if a.first() != b.first() {
        return match (numa_a, numa_b) {
            (Some(x), Some(y)) if x == y => LinkCode::Node,
            (Some(_), Some(_)) => LinkCode::Sys,
            _ if n_numa_nodes <= 1 => LinkCode::Node,
            _ => LinkCode::Sys,
        };
    }
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if common <= 1 {
        return LinkCode::Phb;
    }
    let depth_a = a.len() - common;
    let depth_b = b.len() - common;
    if depth_a.max(depth_b) <= 2 {
        LinkCode::Pix
    } else {
        LinkCode::Pxb
    }
}

/// The PCI part of a canonical sysfs device path: the root complex (`pci0000:3a`) followed by
/// every bus/device/function (`0000:3b:00.0`) down to the device. Empty for virtual devices.
pub(crate) fn pci_chain(path: &Path) -> Vec<String> {
    let mut chain = Vec::new();
    for component in path.components() {
        let part = component.as_os_str().to_string_lossy();
        if part.starts_with("pci") && part.contains(':') {
            chain.clear();
            chain.push(part.to_string());
        } else if !chain.is_empty() && is_bdf(&part) {
            chain.push(part.to_string());
        }
    }
    chain
}

/// `0000:3b:00.0`.
fn is_bdf(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 12
        && bytes[4] == b':'
        && bytes[7] == b':'
        && bytes[10] == b'.'
        && text
            .chars()
            .enumerate()
            .all(|(i, c)| [4, 7, 10].contains(&i) || c.is_ascii_hexdigit())
}

/// Software interfaces: by name, bridges, and interfaces without a device unless they are
/// bonds or VLANs over a physical interface (those carry real traffic).
fn is_virtual_interface(dir: &Path, name: &str, has_device: bool) -> bool {
    if VIRTUAL_PREFIXES
        .iter()
        .any(|prefix| name.starts_with(prefix))
    {
        return true;
    }
    if dir.join("bridge").is_dir() {
        return true;
    }
    if has_device {
        return false;
    }
    // A bond or VLAN lists the interfaces it sits on as `lower_<name>` links.
    let lowers = list_dir(dir).unwrap_or_default();
    !lowers
        .iter()
        .filter_map(|entry| entry.strip_prefix("lower_"))
        .any(|lower| dir.join(format!("lower_{lower}/device")).exists())
}

fn read_ports(ports_dir: &Path) -> Result<Vec<IbPort>> {
    let mut ports = Vec::new();
    for entry in list_dir(ports_dir)? {
        let Ok(port) = entry.parse::<u32>() else {
            continue;
        };
        let dir = ports_dir.join(&entry);
        ports.push(IbPort {
            port,
            state: read_trimmed(&dir.join("state"))
                .map(strip_numeric_prefix)
                .unwrap_or_default(),
            phys_state: read_trimmed(&dir.join("phys_state"))
                .map(strip_numeric_prefix)
                .unwrap_or_default(),
            rate_gbps: read_trimmed(&dir.join("rate")).and_then(|r| parse_rate_gbps(&r)),
            link_layer: read_trimmed(&dir.join("link_layer"))
                .unwrap_or_else(|| "InfiniBand".to_string()),
            gids: read_gids(&dir),
        });
    }
    ports.sort_by_key(|p| p.port);
    Ok(ports)
}

fn read_gids(port_dir: &Path) -> Vec<Gid> {
    let mut gids: BTreeMap<u32, Gid> = BTreeMap::new();
    for entry in list_dir(&port_dir.join("gids")).unwrap_or_default() {
        let Ok(index) = entry.parse::<u32>() else {
            continue;
        };
        let Some(gid) = read_trimmed(&port_dir.join("gids").join(&entry)) else {
            continue;
        };
        if gid.chars().all(|c| c == '0' || c == ':') {
            continue;
        }
        let gid_type = read_trimmed(&port_dir.join("gid_attrs/types").join(&entry));
        gids.insert(
            index,
            Gid {
                index,
                gid,
                gid_type,
            },
        );
    }
    gids.into_values().collect()
}

/// `4: ACTIVE` → `ACTIVE`.
fn strip_numeric_prefix(text: String) -> String {
    match text.split_once(':') {
        Some((number, rest)) if number.trim().parse::<u32>().is_ok() => rest.trim().to_string(),
        _ => text,
    }
}

/// `200 Gb/sec (4X HDR)` → 200.0.
fn parse_rate_gbps(text: &str) -> Option<f64> {
    let (number, unit) = text.split_once(' ')?;
    let value: f64 = number.parse().ok()?;
    unit.starts_with("Gb/sec").then_some(value)
}

/// NUMA node of the PCI device `bus_id` (sysfs form) under `root`; `None` when unknown.
pub fn pci_numa_node(root: &Path, bus_id: &str) -> Option<u32> {
    read_numa_node(&root.join("bus/pci/devices").join(bus_id))
}

fn read_numa_node(device: &Path) -> Option<u32> {
    read_trimmed(&device.join("numa_node"))?
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

fn count_numa_nodes(root: &Path) -> usize {
    list_dir(&root.join("devices/system/node"))
        .unwrap_or_default()
        .iter()
        .filter(|n| {
            n.strip_prefix("node")
                .is_some_and(|i| i.parse::<u32>().is_ok())
        })
        .count()
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Sorted entry names of `dir`; empty when it does not exist.
fn list_dir(dir: &Path) -> Result<Vec<String>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut names: Vec<String> = fs::read_dir(dir)
        .with_context(|| format!("failed to list `{}`", dir.display()))?
        .filter_map(|entry| {
            entry
                .ok()
                .map(|e| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn pci_chains_keep_root_complex_and_bdfs() {
        let path = Path::new("/sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0");
        assert_eq!(pci_chain(path), chain(&["pci0000:00", "0000:00:03.0"]));
        assert!(pci_chain(Path::new("/sys/devices/virtual/net/lo")).is_empty());
    }

    #[test]
    fn link_codes_from_pci_paths() {
        let root = "pci0000:3a";
        let gpu = chain(&[
            root,
            "0000:3a:00.0",
            "0000:3b:00.0",
            "0000:3c:00.0",
            "0000:3d:00.0",
        ]);
        let nic_same_switch = chain(&[
            root,
            "0000:3a:00.0",
            "0000:3b:00.0",
            "0000:3c:04.0",
            "0000:3e:00.0",
        ]);
        let nic_other_port = chain(&[root, "0000:3a:02.0", "0000:40:00.0"]);
        let nic_nested = chain(&[
            root,
            "0000:3a:00.0",
            "0000:3b:00.0",
            "0000:3c:08.0",
            "0000:45:00.0",
            "0000:46:00.0",
            "0000:47:00.0",
        ]);
        let other_root = chain(&["pci0000:80", "0000:80:00.0", "0000:81:00.0"]);
        assert_eq!(
            pci_link_code(&gpu, &nic_same_switch, Some(0), Some(0), 2),
            LinkCode::Pix
        );
        assert_eq!(
            pci_link_code(&gpu, &nic_other_port, Some(0), Some(0), 2),
            LinkCode::Phb
        );
        assert_eq!(
            pci_link_code(&gpu, &nic_nested, Some(0), Some(0), 2),
            LinkCode::Pxb
        );
        assert_eq!(
            pci_link_code(&gpu, &other_root, Some(0), Some(0), 2),
            LinkCode::Node
        );
        assert_eq!(
            pci_link_code(&gpu, &other_root, Some(0), Some(1), 2),
            LinkCode::Sys
        );
        assert_eq!(
            pci_link_code(&gpu, &other_root, None, None, 1),
            LinkCode::Node
        );
        assert_eq!(
            pci_link_code(&gpu, &other_root, None, Some(1), 2),
            LinkCode::Sys
        );
        // Two functions of one dual-port adapter.
        let port0 = chain(&[root, "0000:3a:00.0", "0000:3b:00.0"]);
        let port1 = chain(&[root, "0000:3a:00.0", "0000:3b:00.1"]);
        assert_eq!(pci_link_code(&port0, &port1, None, None, 1), LinkCode::Pix);
    }

    #[test]
    fn nvml_bus_ids_become_sysfs_bus_ids() {
        assert_eq!(sysfs_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(sysfs_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn sysfs_value_parsing() {
        assert_eq!(strip_numeric_prefix("4: ACTIVE".into()), "ACTIVE");
        assert_eq!(strip_numeric_prefix("5: LinkUp".into()), "LinkUp");
        assert_eq!(parse_rate_gbps("200 Gb/sec (4X HDR)"), Some(200.0));
        assert_eq!(parse_rate_gbps("2.5 Gb/sec (1X SDR)"), Some(2.5));
        assert_eq!(parse_rate_gbps("garbage"), None);
        assert!(is_bdf("0000:3b:00.0"));
        assert!(!is_bdf("virtio2"));
    }
}
