//! The environment each host's ranks need for NCCL: `CUDA_DEVICE_ORDER`, and on multi-host
//! plans `NCCL_SOCKET_IFNAME` (the physical interface that reaches the other hosts) and
//! `NCCL_IB_HCA` (the active HCAs nearest the GPUs in use).

use std::collections::BTreeMap;

use super::cluster::ClusterHost;
use crate::topology::{Nic, NicKind};

/// Environment for the ranks on `host`, which use its GPUs `gpus` (NVML indices), and
/// warnings about what could not be chosen. CPU ranks need none: no GPU to order, no NCCL
/// (`infer up` picks each host's data interface for their collectives, or takes the
/// inventory's `nccl-socket-ifname`).
pub(crate) fn host_env(
    host: &ClusterHost,
    gpus: &[usize],
    multi_host: bool,
    warnings: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    if host.cpu.is_some() {
        return env;
    }
    // NVML and nvidia-smi number GPUs in PCI bus order; CUDA's default is "fastest first".
    env.insert("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string());
    if !multi_host {
        return env;
    }
    // A shorthand host has no NICs to choose from: the plan says so once, as a note.
    let synthetic = is_synthetic(host);
    match socket_interface(host) {
        Some(name) => {
            env.insert("NCCL_SOCKET_IFNAME".to_string(), format!("={name}"));
        }
        None if synthetic => {}
        None => warnings.push(format!(
            "no physical interface known for host `{}`: set `NCCL_SOCKET_IFNAME` by hand, or give the host a `topology` \
             (`infer topo --json` output) in the cluster inventory",
            host.name
        )),
    }
    let hcas = nearest_active_hcas(&host.topology.nics, gpus);
    if hcas.is_empty() && !synthetic {
        warnings.push(format!(
            "no active InfiniBand/RoCE HCA known on host `{}`: inter-node NCCL traffic will use TCP sockets (NET/Socket), \
             an order of magnitude slower than RDMA",
            host.name
        ));
    } else if !hcas.is_empty() {
        // `=` makes NCCL match names exactly: a bare `mlx5_1` would also select `mlx5_10`.
        env.insert("NCCL_IB_HCA".to_string(), format!("={}", hcas.join(",")));
    }
    env
}

/// Whether `host` comes from a shorthand (`2x8xh100-sxm`): no address, no NICs known.
pub(crate) fn is_synthetic(host: &ClusterHost) -> bool {
    host.address.is_none() && host.topology.nics.is_empty()
}

/// The interface NCCL's bootstrap and socket transport should use: a physical, up, non-HCA
/// (or IPoIB) interface, preferring the one carrying the host's address, then one with an
/// IPv4 address. Never `lo`, bridges, veth, docker, VPNs or tunnels.
fn socket_interface(host: &ClusterHost) -> Option<String> {
    let candidates: Vec<&Nic> = host
        .topology
        .nics
        .iter()
        .filter(|nic| !nic.is_virtual && nic.netdev.is_some())
        .filter(|nic| {
            nic.state
                .as_deref()
                .is_none_or(|s| s == "up" || s == "ACTIVE")
        })
        .filter(|nic| nic.kind != NicKind::Unknown)
        .collect();
    let has_ipv4 = |nic: &&&Nic| {
        nic.addresses
            .iter()
            .any(|a| a.contains('.') && !a.starts_with("169.254."))
    };
    let by_address = host.address.as_ref().and_then(|address| {
        candidates
            .iter()
            .find(|nic| nic.addresses.iter().any(|a| a == address))
    });
    by_address
        .or_else(|| candidates.iter().find(has_ipv4))
        .or_else(|| candidates.iter().find(|nic| nic.kind == NicKind::Eth))
        .and_then(|nic| nic.netdev.clone())
}

/// Active RDMA HCAs within `PIX`/`PXB` of a GPU in `gpus` (GPUDirect RDMA distance); when no
/// HCA is that close (or `gpus` is empty: CPU ranks), every active HCA. HCAs of unknown state
/// (imported pastes) count as active.
pub(crate) fn nearest_active_hcas(nics: &[Nic], gpus: &[usize]) -> Vec<String> {
    let active: Vec<&Nic> = nics
        .iter()
        .filter(|nic| matches!(nic.kind, NicKind::Ib | NicKind::Roce | NicKind::Unknown))
        .filter(|nic| nic.state.as_deref().is_none_or(|s| s == "ACTIVE"))
        .collect();
    let near: Vec<String> = active
        .iter()
        .filter(|nic| {
            gpus.iter()
                .any(|&g| nic.gpu_links.get(g).is_some_and(|c| c.allows_gdr()))
        })
        .map(|nic| nic.name.clone())
        .collect();
    if near.is_empty() {
        active.iter().map(|nic| nic.name.clone()).collect()
    } else {
        near
    }
}
