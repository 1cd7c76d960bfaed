//! GPUs through NVML: identity, memory, PCI location, CPU/NUMA affinity, NVLink links,
//! PCIe common ancestors and P2P status. The only file in the crate that imports
//! `nvml-wrapper`.
//!
//! `libnvidia-ml.so` is loaded at run time, so the binary runs on hosts without the NVIDIA
//! driver; [`probe_gpus`] then answers [`GpuProbe::Unavailable`] with the reason.

use anyhow::{Context, Result};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{
    P2pCapabilitiesIndex, P2pStatus as NvmlP2p, TopologyLevel,
};
use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;

use super::sysfs::sysfs_bus_id;
use super::{Gpu, LinkCode, P2pStatus};

/// Most NVLink links one GPU can have (`NVML_NVLINK_MAX_LINKS` in `nvml.h`: 18 on Hopper/Blackwell).
const MAX_NVLINKS: u32 = 18;

/// Words of the CPU affinity bitmask to ask NVML for: 16 × 64 = 1024 CPUs.
const AFFINITY_WORDS: usize = 16;

/// What NVML said about this host's GPUs.
pub(crate) enum GpuProbe {
    /// NVML loaded and answered.
    Found(NvmlGpus),
    /// No usable NVIDIA driver; the string says why (for a note, not an error).
    Unavailable(String),
}

/// GPUs and the links between them, as NVML reports them.
pub(crate) struct NvmlGpus {
    /// Driver version (`550.54.15`).
    pub driver_version: Option<String>,
    /// CUDA version the driver supports (`12.4`).
    pub cuda_driver_version: Option<String>,
    /// One per GPU, NVML index order.
    pub gpus: Vec<Gpu>,
    /// `n_gpus × n_gpus` link codes.
    pub gpu_links: Vec<Vec<LinkCode>>,
    /// `n_gpus × n_gpus` P2P read/write status.
    pub p2p: Vec<Vec<P2pStatus>>,
}

/// Probes every GPU NVML can see.
///
/// Errors: NVML loaded but a query every GPU must answer (count, handle, common ancestor)
/// failed. A missing driver is not an error: it is [`GpuProbe::Unavailable`].
pub(crate) fn probe_gpus() -> Result<GpuProbe> {
    let nvml = match Nvml::init() {
        Ok(nvml) => nvml,
        Err(error) => {
            return Ok(GpuProbe::Unavailable(format!(
                "no NVIDIA driver found (NVML could not be initialised: {error})"
            )));
        }
    };
    let mut gpus = identify_gpus(&nvml)?;
    let (nvlinks, switch_links) = count_nvlinks(&nvml, &mut gpus)?;
    let (gpu_links, p2p) = links_and_p2p(&nvml, &nvlinks, &switch_links)?;
    Ok(GpuProbe::Found(NvmlGpus {
        driver_version: nvml.sys_driver_version().ok(),
        cuda_driver_version: nvml.sys_cuda_driver_version().ok().map(|v| {
            format!(
                "{}.{}",
                nvml_wrapper::cuda_driver_version_major(v),
                nvml_wrapper::cuda_driver_version_minor(v)
            )
        }),
        gpus,
        gpu_links,
        p2p,
    }))
}

/// Every GPU's identity, memory in bytes, PCI location and CPU/NUMA affinity (NVLink
/// counts not yet known). Errors: NVML cannot count the GPUs or open one.
fn identify_gpus(nvml: &Nvml) -> Result<Vec<Gpu>> {
    let n_gpus = nvml.device_count().context("NVML failed to count GPUs")? as usize;
    let mut gpus = Vec::with_capacity(n_gpus);
    for index in 0..n_gpus {
        let device = nvml
            .device_by_index(index as u32)
            .with_context(|| format!("NVML failed to open GPU {index}"))?;
        gpus.push(Gpu {
            index,
            name: device.name().ok(),
            uuid: device.uuid().ok(),
            memory_bytes: device.memory_info().ok().map(|m| m.total),
            pci_bus_id: device.pci_info().ok().map(|p| sysfs_bus_id(&p.bus_id)),
            numa_node: device.numa_node_id().ok(),
            cpu_affinity: device
                .cpu_affinity(AFFINITY_WORDS)
                .ok()
                .map(|mask| cpu_list(&mask)),
            nvlinks_active: None,
            nvlinks_inactive: None,
        });
    }
    Ok(gpus)
}

/// Counts active NVLinks per GPU pair (`[i][j]`: links from GPU `i` to GPU `j`) and links
/// into NVSwitches per GPU, and records each GPU's active and inactive links. Errors: NVML
/// cannot open a GPU.
fn count_nvlinks(nvml: &Nvml, gpus: &mut [Gpu]) -> Result<(Vec<Vec<u32>>, Vec<u32>)> {
    let n_gpus = gpus.len();
    // Count active NVLinks per GPU pair, and links into NVSwitches per GPU.
    let mut nvlinks = vec![vec![0u32; n_gpus]; n_gpus];
    let mut switch_links = vec![0u32; n_gpus];
    for (index, row) in nvlinks.iter_mut().enumerate() {
        let device = nvml.device_by_index(index as u32)?;
        let (mut active, mut inactive) = (0u32, 0u32);
        for link in 0..MAX_NVLINKS {
            let wrapper = device.link_wrapper_for(link);
            // `Ok(false)`: the link exists but is down; an error: the link does not exist.
            match wrapper.is_active() {
                Ok(true) => active += 1,
                Ok(false) => {
                    inactive += 1;
                    continue;
                }
                Err(_) => continue,
            }
            match wrapper.remote_device_type(link) {
                Ok(IntDeviceType::Switch) => switch_links[index] += 1,
                _ => {
                    let Ok(remote) = wrapper.remote_pci_info() else {
                        continue;
                    };
                    let remote_bus_id = sysfs_bus_id(&remote.bus_id);
                    if let Some(peer) = gpus
                        .iter()
                        .position(|g| g.pci_bus_id.as_deref() == Some(&remote_bus_id))
                    {
                        row[peer] += 1;
                    }
                }
            }
        }
        gpus[index].nvlinks_active = Some(active);
        gpus[index].nvlinks_inactive = Some(inactive);
    }
    Ok((nvlinks, switch_links))
}

/// One value per ordered GPU pair: `[i][j]` from GPU `i` to GPU `j`.
type GpuMatrix<T> = Vec<Vec<T>>;

/// The link code and P2P status of every GPU pair: NVLink (direct, else through the
/// NVSwitch fabric) or the PCIe common ancestor. Errors: NVML cannot open a GPU or find a
/// pair's common ancestor.
fn links_and_p2p(
    nvml: &Nvml,
    nvlinks: &[Vec<u32>],
    switch_links: &[u32],
) -> Result<(GpuMatrix<LinkCode>, GpuMatrix<P2pStatus>)> {
    let n_gpus = switch_links.len();
    let mut gpu_links = vec![vec![LinkCode::SelfLink; n_gpus]; n_gpus];
    let mut p2p = vec![vec![P2pStatus::SelfLink; n_gpus]; n_gpus];
    for i in 0..n_gpus {
        for j in 0..n_gpus {
            if i == j {
                continue;
            }
            let direct = nvlinks[i][j].max(nvlinks[j][i]);
            gpu_links[i][j] = if direct > 0 {
                LinkCode::NvLink(direct)
            } else if switch_links[i] > 0 && switch_links[j] > 0 {
                // Through the NVSwitch fabric, as `nvidia-smi topo -m` reports (NV18 on HGX H100).
                LinkCode::NvLink(switch_links[i].min(switch_links[j]))
            } else {
                let a = nvml.device_by_index(i as u32)?;
                let b = nvml.device_by_index(j as u32)?;
                let level = a.topology_common_ancestor(b).with_context(|| {
                    format!("NVML failed to find the common PCIe ancestor of GPU {i} and GPU {j}")
                })?;
                pcie_code(level)
            };
            p2p[i][j] = p2p_status(nvml, i, j)?;
        }
    }
    Ok((gpu_links, p2p))
}

/// GPU `i`'s P2P status towards GPU `j`: `OK` only when both reads and writes are, else
/// the first that is not (`Unknown` when NVML cannot say). Errors: NVML cannot open either.
fn p2p_status(nvml: &Nvml, i: usize, j: usize) -> Result<P2pStatus> {
    let a = nvml.device_by_index(i as u32)?;
    let b = nvml.device_by_index(j as u32)?;
    let read = a.p2p_status(&b, P2pCapabilitiesIndex::Read).ok();
    let write = a.p2p_status(&b, P2pCapabilitiesIndex::Write).ok();
    Ok(match (read.map(from_nvml_p2p), write.map(from_nvml_p2p)) {
        (Some(P2pStatus::Ok), Some(P2pStatus::Ok)) => P2pStatus::Ok,
        (Some(P2pStatus::Ok), Some(other)) | (Some(other), _) => other,
        (None, _) => P2pStatus::Unknown,
    })
}

/// NVML's common-ancestor level in nvidia-smi's codes.
fn pcie_code(level: TopologyLevel) -> LinkCode {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single => LinkCode::Pix,
        TopologyLevel::Multiple => LinkCode::Pxb,
        TopologyLevel::HostBridge => LinkCode::Phb,
        TopologyLevel::Node => LinkCode::Node,
        TopologyLevel::System => LinkCode::Sys,
    }
}

fn from_nvml_p2p(status: NvmlP2p) -> P2pStatus {
    match status {
        NvmlP2p::Ok => P2pStatus::Ok,
        NvmlP2p::ChipsetNotSupported => P2pStatus::ChipsetNotSupported,
        NvmlP2p::GpuNotSupported => P2pStatus::GpuNotSupported,
        NvmlP2p::IohTopologyNotSupported => P2pStatus::TopologyNotSupported,
        NvmlP2p::DisabledByRegkey => P2pStatus::DisabledByRegkey,
        NvmlP2p::NotSupported => P2pStatus::NotSupported,
        NvmlP2p::Unknown => P2pStatus::Unknown,
    }
}

/// A CPU bitmask (64 CPUs per word, CPU 0 in bit 0 of word 0) as a list: `0-47,96-143`.
pub(crate) fn cpu_list(mask: &[std::os::raw::c_ulong]) -> String {
    let bits_per_word = 8 * std::mem::size_of::<std::os::raw::c_ulong>();
    let cpus: Vec<usize> = mask
        .iter()
        .enumerate()
        .flat_map(|(w, &word)| {
            (0..bits_per_word)
                .filter(move |b| word >> b & 1 == 1)
                .map(move |b| w * bits_per_word + b)
        })
        .collect();
    let mut ranges: Vec<String> = Vec::new();
    let mut start = 0;
    while start < cpus.len() {
        let mut end = start;
        while end + 1 < cpus.len() && cpus[end + 1] == cpus[end] + 1 {
            end += 1;
        }
        ranges.push(if end == start {
            cpus[start].to_string()
        } else {
            format!("{}-{}", cpus[start], cpus[end])
        });
        start = end + 1;
    }
    ranges.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_masks_become_lists() {
        // CPUs 0-47 and 96-143 (a two-socket H20 node's socket 0 with SMT siblings).
        let mut mask = vec![0 as std::os::raw::c_ulong; 4];
        for cpu in (0..48).chain(96..144) {
            mask[cpu / 64] |= 1 << (cpu % 64);
        }
        assert_eq!(cpu_list(&mask), "0-47,96-143");
        assert_eq!(cpu_list(&[0b1011]), "0-1,3");
        assert_eq!(cpu_list(&[0]), "");
    }
}
