//! Rank layout in vLLM order — `ranks = arange(world).reshape(DP, PP, TP)`, TP fastest —
//! its process groups, and the placement of every rank on a host and GPU that keeps TP
//! groups inside NVLink domains. On a CPU host every rank slot is the same device (its
//! link code to another is `X`) and ranks talk through shared memory.

use serde::{Deserialize, Serialize};

use super::cluster::{Cluster, Device};
use super::cost::{
    Link, Links, NETWORK_LATENCY_SECS, NVLINK_LATENCY_SECS, PCIE_LATENCY_SECS, SHM_LATENCY_SECS,
    SHM_SLEEPING_MESSAGE_SECS, SHM_SPINNING_MESSAGE_SECS, TCP_GB_PER_SEC, TCP_LATENCY_SECS,
};
use crate::degrees::Degrees;
use crate::topology::LinkCode;

/// One rank: where it runs and its coordinates in every group. `--json` `ranks[]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankPlacement {
    /// Global rank, `RANK`.
    pub rank: u64,
    /// Host name from the cluster.
    pub host: String,
    /// GPU index on that host (NVML order), also its `CUDA_VISIBLE_DEVICES`; on a CPU host,
    /// the rank's slot (its local rank).
    pub gpu: usize,
    /// Rank among the ranks of its host, `LOCAL_RANK`.
    pub local_rank: u64,
    pub tp_rank: u64,
    pub pp_rank: u64,
    pub dp_rank: u64,
    pub ep_rank: u64,
    /// `CUDA_VISIBLE_DEVICES` of the rank's process: its one GPU, by NVML index (with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, CUDA numbers GPUs the same way); empty for a CPU rank.
    pub cuda_visible_devices: String,
}

/// Process groups as lists of global ranks. `--json` `groups`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Groups {
    pub tp: Vec<Vec<u64>>,
    pub pp: Vec<Vec<u64>>,
    pub dp: Vec<Vec<u64>>,
    pub ep: Vec<Vec<u64>>,
}

/// A placed layout: ranks, groups, and how the TP groups are connected.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Layout {
    pub ranks: Vec<RankPlacement>,
    pub groups: Groups,
    /// Worst link inside any TP group (`X` when TP is 1); `None` when a group spans hosts.
    pub tp_worst_link: Option<LinkCode>,
    /// Whether some EP group spans hosts.
    pub ep_crosses_hosts: bool,
    /// Whether consecutive PP stages sit on different hosts.
    pub pp_crosses_hosts: bool,
    pub links: Links,
}

/// The global rank of coordinates `(dp, pp, tp)`.
fn rank_of(parallel: &Degrees, dp_rank: usize, pp_rank: usize, tp_rank: usize) -> u64 {
    ((dp_rank * parallel.pp + pp_rank) * parallel.tp + tp_rank) as u64
}

/// GPU slots in placement order: hosts in cluster order; inside a host, NVLink domains
/// (largest first) and the GPUs of each in index order, so consecutive ranks share a domain.
/// A CPU host's slots are its ranks of this view, in order.
fn gpu_slots(cluster: &Cluster) -> Vec<(usize, usize)> {
    let mut slots = Vec::new();
    for (host_idx, host) in cluster.hosts.iter().enumerate() {
        if let Some(cpu) = &host.cpu {
            slots.extend((0..cpu.ranks as usize).map(|slot| (host_idx, slot)));
            continue;
        }
        let mut domains = host.topology.nvlink_domains.clone();
        domains.sort_by_key(|d| (std::cmp::Reverse(d.len()), d.first().copied()));
        if domains.iter().all(|d| d.len() == 1) {
            // No NVLink: keep GPUs in index order (NUMA neighbours are adjacent in NVML order).
            domains.sort();
        }
        slots.extend(domains.into_iter().flatten().map(|gpu| (host_idx, gpu)));
    }
    slots
}

/// Places `parallel` on the first `world_size` GPU slots of `cluster` and builds its groups.
pub(crate) fn place(parallel: &Degrees, cluster: &Cluster) -> Layout {
    let ranks = place_ranks(parallel, cluster);
    let groups = groups(parallel);
    let worst = |group: &[u64]| worst_link(cluster, &ranks, group);
    let tp_worst_link = groups
        .tp
        .iter()
        .map(|g| worst(g))
        .try_fold(LinkCode::SelfLink, |acc, w| w.map(|w| acc.max(w)));
    let ep_crosses_hosts = groups.ep.iter().any(|g| worst(g).is_none());
    let pp_crosses_hosts = pp_groups_cross(&groups.pp, &ranks);
    let ep_worst_link = if ep_crosses_hosts {
        None
    } else {
        groups.ep.iter().filter_map(|g| worst(g)).max()
    };
    let links = group_links(cluster, tp_worst_link, ep_worst_link, pp_crosses_hosts);
    Layout {
        ranks,
        groups,
        tp_worst_link,
        ep_crosses_hosts,
        pp_crosses_hosts,
        links,
    }
}

/// Every rank of `parallel` on the GPU slots of `cluster` in order, with its coordinates.
fn place_ranks(parallel: &Degrees, cluster: &Cluster) -> Vec<RankPlacement> {
    let slots = gpu_slots(cluster);
    let (tp, pp, ep) = (parallel.tp as u64, parallel.pp as u64, parallel.ep as u64);
    let world = parallel.world_size() as u64;
    let mut ranks = Vec::with_capacity(world as usize);
    let mut per_host = vec![0u64; cluster.hosts.len()];
    for rank in 0..world {
        let (host_idx, gpu) = slots[rank as usize];
        let tp_rank = rank % tp;
        let pp_rank = rank / tp % pp;
        let dp_rank = rank / (tp * pp);
        // EP groups cut the stage's ranks, ordered (dp, tp), into chunks of `ep`.
        let index_in_stage = dp_rank * tp + tp_rank;
        ranks.push(RankPlacement {
            rank,
            host: cluster.hosts[host_idx].name.clone(),
            gpu,
            local_rank: per_host[host_idx],
            tp_rank,
            pp_rank,
            dp_rank,
            ep_rank: index_in_stage % ep,
            cuda_visible_devices: match cluster.hosts[host_idx].cpu {
                Some(_) => String::new(),
                None => gpu.to_string(),
            },
        });
        per_host[host_idx] += 1;
    }
    ranks
}

/// The TP, PP, DP and EP process groups of `p`, as lists of global ranks.
fn groups(p: &Degrees) -> Groups {
    let tp_groups: Vec<Vec<u64>> = (0..p.dp)
        .flat_map(|d| (0..p.pp).map(move |s| (0..p.tp).map(|t| rank_of(p, d, s, t)).collect()))
        .collect();
    let pp_groups: Vec<Vec<u64>> = (0..p.dp)
        .flat_map(|d| (0..p.tp).map(move |t| (0..p.pp).map(|s| rank_of(p, d, s, t)).collect()))
        .collect();
    let dp_groups: Vec<Vec<u64>> = (0..p.pp)
        .flat_map(|s| (0..p.tp).map(move |t| (0..p.dp).map(|d| rank_of(p, d, s, t)).collect()))
        .collect();
    let ep_groups: Vec<Vec<u64>> = (0..p.pp)
        .flat_map(|s| {
            let stage: Vec<u64> = (0..p.dp)
                .flat_map(|d| (0..p.tp).map(move |t| rank_of(p, d, s, t)))
                .collect();
            stage.chunks(p.ep).map(<[u64]>::to_vec).collect::<Vec<_>>()
        })
        .collect();
    Groups {
        tp: tp_groups,
        pp: pp_groups,
        dp: dp_groups,
        ep: ep_groups,
    }
}

/// The worst link between two GPUs of `group` (global ranks placed as `ranks`); `None` when
/// the group spans hosts.
fn worst_link(cluster: &Cluster, ranks: &[RankPlacement], group: &[u64]) -> Option<LinkCode> {
    let host_of = |rank: u64| &ranks[rank as usize].host;
    let first_host = host_of(group[0]);
    if group.iter().any(|&r| host_of(r) != first_host) {
        return None;
    }
    let host = cluster
        .hosts
        .iter()
        .find(|h| &h.name == first_host)
        .expect("rank hosts come from the cluster");
    if host.cpu.is_some() {
        // Every rank of a CPU host computes on the same device.
        return Some(LinkCode::SelfLink);
    }
    let mut worst = LinkCode::SelfLink;
    for &a in group {
        for &b in group {
            worst =
                worst.max(host.topology.gpu_links[ranks[a as usize].gpu][ranks[b as usize].gpu]);
        }
    }
    Some(worst)
}

/// The cost model's link of each group kind: the network for groups that span hosts, else a
/// measured link inside a host (`--calibration`), else NVLink, PCIe or the CPU interconnect
/// by the worst GPU pair (on CPU hosts, shared memory). A worst link of `None` (groups that
/// span hosts) is the network.
fn group_links(
    cluster: &Cluster,
    tp_worst_link: Option<LinkCode>,
    ep_worst_link: Option<LinkCode>,
    pp_crosses_hosts: bool,
) -> Links {
    let hardware = &cluster.slowest_hardware();
    let nvlink = Link {
        bytes_per_sec: hardware.nvlink_gb_per_sec / 2.0 * 1e9,
        latency_secs: NVLINK_LATENCY_SECS,
        message_latency_secs: NVLINK_LATENCY_SECS,
    };
    let pcie = Link {
        bytes_per_sec: hardware.pcie_gb_per_sec * 1e9,
        latency_secs: PCIE_LATENCY_SECS,
        message_latency_secs: PCIE_LATENCY_SECS,
    };
    let sys = Link {
        bytes_per_sec: hardware.pcie_gb_per_sec / 2.0 * 1e9,
        latency_secs: PCIE_LATENCY_SECS,
        message_latency_secs: PCIE_LATENCY_SECS,
    };
    // A waiting rank spins only when every rank of its host has a core (`shm.rs`).
    let outnumbered = hardware
        .cpu_row_chain
        .is_some_and(|chain| chain.ranks_outnumber_cores);
    let shared_memory = Link {
        bytes_per_sec: hardware.pcie_gb_per_sec * 1e9,
        latency_secs: SHM_LATENCY_SECS,
        message_latency_secs: if outnumbered {
            SHM_SLEEPING_MESSAGE_SECS
        } else {
            SHM_SPINNING_MESSAGE_SECS
        },
    };
    let network = network_link(cluster);
    let measured_intra = cluster.measured.intra_host.as_ref().map(|m| m.link());
    let cpu = cluster.device() == Device::Cpu;
    let link_for = |code: Option<LinkCode>| match (code, measured_intra) {
        (None, _) => network,
        // A measured all-reduce inside a host replaces the datasheet's link.
        (Some(_), Some(measured)) => measured,
        (Some(_), None) if cpu => shared_memory,
        (Some(LinkCode::SelfLink | LinkCode::NvLink(_)), None)
            if hardware.nvlink_gb_per_sec > 0.0 =>
        {
            nvlink
        }
        (Some(LinkCode::Sys), None) => sys,
        (Some(_), None) => pcie,
    };
    Links {
        tp: link_for(tp_worst_link),
        ep: link_for(ep_worst_link),
        pp: if pp_crosses_hosts {
            network
        } else {
            link_for(tp_worst_link)
        },
    }
}

/// Whether consecutive stages of some PP group sit on different hosts.
fn pp_groups_cross(pp_groups: &[Vec<u64>], ranks: &[RankPlacement]) -> bool {
    pp_groups.iter().any(|g| {
        g.windows(2)
            .any(|w| ranks[w[0] as usize].host != ranks[w[1] as usize].host)
    })
}

/// The link between hosts: a measured one (`--calibration`), else the NIC's RDMA rate where
/// every host's HCAs are known (a probed or imported topology); without them NCCL falls back
/// to TCP sockets, and so does the cost. CPU ranks' collectives always use TCP sockets.
pub(crate) fn network_link(cluster: &Cluster) -> Link {
    if let Some(measured) = &cluster.measured.inter_host {
        return measured.link();
    }
    let hardware = cluster.slowest_hardware();
    let rdma = cluster.device() == Device::Gpu
        && cluster
            .hosts
            .iter()
            .all(|h| !super::env::nearest_active_hcas(&h.topology.nics, &[]).is_empty());
    if rdma {
        Link {
            bytes_per_sec: hardware.nic_gb_per_sec * 1e9,
            latency_secs: NETWORK_LATENCY_SECS,
            message_latency_secs: NETWORK_LATENCY_SECS,
        }
    } else {
        Link {
            bytes_per_sec: hardware.nic_gb_per_sec.min(TCP_GB_PER_SEC) * 1e9,
            latency_secs: TCP_LATENCY_SECS,
            message_latency_secs: TCP_LATENCY_SECS,
        }
    }
}
