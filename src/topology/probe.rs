//! Probing the local host: NVML for GPUs, sysfs for NICs/HCAs, `getifaddrs` for addresses,
//! assembled into one [`Host`].

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::nvml::{GpuProbe, probe_gpus};
use super::{Host, nvlink_domains, sysfs};

/// Where to probe.
#[derive(Clone, Debug)]
pub(crate) struct ProbeOptions {
    /// Mount point of sysfs: `/sys` on a live host, a fake tree in tests. IP addresses are
    /// read from the kernel only when this is `/sys`.
    pub sysfs_root: PathBuf,
}

/// Probes this host.
///
/// A host without the NVIDIA driver is not an error: it has zero GPUs and a note saying so.
/// Errors: NVML loaded but failed mid-probe, or sysfs could not be listed.
pub(crate) fn probe_host(options: &ProbeOptions) -> Result<Host> {
    let mut notes = Vec::new();
    let (driver_version, cuda_driver_version, mut gpus, gpu_links, p2p) = match probe_gpus()? {
        GpuProbe::Found(found) => (
            found.driver_version,
            found.cuda_driver_version,
            found.gpus,
            found.gpu_links,
            Some(found.p2p),
        ),
        GpuProbe::Unavailable(reason) => {
            notes.push(reason);
            (None, None, Vec::new(), Vec::new(), None)
        }
    };
    // Older drivers do not report a GPU's NUMA node; sysfs does.
    for gpu in &mut gpus {
        if gpu.numa_node.is_none() {
            gpu.numa_node = gpu
                .pci_bus_id
                .as_deref()
                .and_then(|bus_id| sysfs::pci_numa_node(&options.sysfs_root, bus_id));
        }
    }
    let live = options.sysfs_root == Path::new("/sys");
    let addresses = if live {
        interface_addresses()
    } else {
        HashMap::new()
    };
    let nics = sysfs::probe_nics(&options.sysfs_root, &gpus, &addresses)?;
    if !gpus.is_empty() && nics.iter().all(|nic| nic.gpu_links.is_empty()) {
        notes.push("NIC↔GPU distances unknown: GPU PCI devices not found in sysfs".to_string());
    }
    Ok(Host {
        hostname: local_hostname(),
        source: "nvml+sysfs".to_string(),
        driver_version,
        cuda_driver_version,
        nvlink_domains: nvlink_domains(&gpu_links),
        gpus,
        gpu_links,
        p2p,
        nics,
        notes,
    })
}

/// IP addresses by interface name. IPv6 link-local addresses carry their `%scope`-less form.
fn interface_addresses() -> HashMap<String, Vec<String>> {
    let mut addresses: HashMap<String, Vec<String>> = HashMap::new();
    if let Ok(interfaces) = if_addrs::get_if_addrs() {
        for interface in interfaces {
            addresses
                .entry(interface.name.clone())
                .or_default()
                .push(interface.ip().to_string());
        }
    }
    addresses
}

/// This host's name (`/proc/sys/kernel/hostname`).
pub(crate) fn local_hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// IPv4 addresses with prefix length (`10.0.2.11/24`) by interface name, from the kernel
/// (`getifaddrs`). The launcher's agents report these so the data network can be chosen per
/// host.
pub(crate) fn ipv4_networks() -> HashMap<String, Vec<String>> {
    let mut networks: HashMap<String, Vec<String>> = HashMap::new();
    if let Ok(interfaces) = if_addrs::get_if_addrs() {
        for interface in interfaces {
            if let if_addrs::IfAddr::V4(v4) = &interface.addr {
                networks
                    .entry(interface.name.clone())
                    .or_default()
                    .push(format!("{}/{}", v4.ip, v4.prefixlen));
            }
        }
    }
    networks
}
