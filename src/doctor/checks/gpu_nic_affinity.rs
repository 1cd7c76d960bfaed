//! `gpu-nic-affinity`: GPUs with no NIC close enough for GPUDirect RDMA.
//!
//! What it checks: each GPU's distance to the nearest NIC/HCA of its host (`PIX`/`PXB`
//! allow GPUDirect RDMA under NCCL's default `NCCL_NET_GDR_LEVEL`).
//! Why it matters: without GDR, inter-node traffic of that GPU is staged through host
//! memory, costing bandwidth and latency on every PP hop or cross-node collective.
//! How to fix: give the GPUs that talk across nodes a NIC on their PCIe switch (rail
//! design), place cross-node ranks on GPUs near a NIC, or raise `NCCL_NET_GDR_LEVEL` where
//! the platform allows it (`PHB`).

use crate::doctor::{Finding, Severity};
use crate::topology::Host;
use crate::topology::render::gpu_set;

/// Id of this check.
pub(crate) const ID: &str = "gpu-nic-affinity";

/// A warning naming the GPUs without a NIC within `PIX`/`PXB`; nothing when the host has no
/// NIC with a known PCIe position.
pub(crate) fn check(host: &Host) -> Option<Finding> {
    let nics: Vec<_> = host
        .nics
        .iter()
        .filter(|n| !n.gpu_links.is_empty() && !n.is_virtual)
        .collect();
    if nics.is_empty() || host.gpus.is_empty() {
        return None;
    }
    let far: Vec<usize> = (0..host.gpus.len())
        .filter(|&g| !nics.iter().any(|n| n.gpu_links[g].allows_gdr()))
        .collect();
    let nearest: Vec<String> = nics
        .iter()
        .map(|n| {
            let gpus = host.nearest_gpus(n);
            format!(
                "{}: nearest GPU {} ({})",
                n.name,
                gpu_set(&gpus),
                gpus.first()
                    .map_or("?".to_string(), |&g| n.gpu_links[g].to_string())
            )
        })
        .collect();
    if far.is_empty() {
        return Some(Finding {
            check: ID,
            severity: Severity::Ok,
            host: Some(host.hostname.clone()),
            message: "every GPU has a NIC within PIX/PXB: GPUDirect RDMA is possible".to_string(),
            evidence: nearest,
            hint: String::new(),
        });
    }
    Some(Finding {
        check: ID,
        severity: Severity::Warn,
        host: Some(host.hostname.clone()),
        message: format!(
            "GPU {} ha{} no NIC within PIX/PXB: no GPUDirect RDMA, inter-node traffic is staged through host memory",
            gpu_set(&far),
            if far.len() == 1 { "s" } else { "ve" }
        ),
        evidence: nearest,
        hint: "put cross-node ranks (PP stage boundaries) on GPUs near a NIC, or add NICs on the GPUs' PCIe switches".to_string(),
    })
}
