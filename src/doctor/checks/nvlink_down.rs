//! `nvlink-down`: GPUs with fewer active NVLinks than their peers.
//!
//! What it checks: each GPU's active NVLink count (NVML) against the most any GPU of the
//! same host has. Comparing with peers, not with the link slots a GPU has, avoids flagging
//! PCIe cards whose NVLink bridges are simply not fitted.
//! Why it matters: a GPU with links down drags every all-reduce of its TP group to its
//! reduced bandwidth; with all its links down NCCL falls back to PCIe for it alone.
//! How to fix: `nvidia-smi nvlink -s` shows the links; reset the GPU or reboot (links
//! retrain at boot), check the fabric manager on NVSwitch systems
//! (`systemctl status nvidia-fabricmanager`), and replace the GPU/baseboard if it persists.

use crate::doctor::{Finding, Severity};
use crate::topology::Host;

/// Id of this check.
pub(crate) const ID: &str = "nvlink-down";

/// An error per GPU below its peers' NVLink count; nothing when counts are unknown or
/// no GPU has NVLink.
pub(crate) fn check(host: &Host) -> Vec<Finding> {
    let best = host
        .gpus
        .iter()
        .filter_map(|g| g.nvlinks_active)
        .max()
        .unwrap_or(0);
    if best == 0 {
        return Vec::new();
    }
    let degraded: Vec<Finding> = host
        .gpus
        .iter()
        .filter_map(|gpu| {
            let active = gpu.nvlinks_active?;
            (active < best).then(|| Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.hostname.clone()),
                message: format!(
                    "GPU{} has {active} active NVLinks, its peers have {best}: {} link(s) down",
                    gpu.index,
                    best - active
                ),
                evidence: vec![format!(
                    "GPU{}: {active} active, {} inactive (NVML)",
                    gpu.index,
                    gpu.nvlinks_inactive.unwrap_or(0)
                )],
                hint: format!(
                    "inspect with `nvidia-smi nvlink -s -i {}`; reset the GPU or reboot, and check `nvidia-fabricmanager` on NVSwitch systems",
                    gpu.index
                ),
            })
        })
        .collect();
    if degraded.is_empty() {
        return vec![Finding {
            check: ID,
            severity: Severity::Ok,
            host: Some(host.hostname.clone()),
            message: format!("every GPU has {best} active NVLinks"),
            evidence: Vec::new(),
            hint: String::new(),
        }];
    }
    degraded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Gpu, Host};

    fn host(active: &[Option<u32>]) -> Host {
        let gpus = active
            .iter()
            .enumerate()
            .map(|(index, &links)| Gpu {
                index,
                name: None,
                uuid: None,
                memory_bytes: None,
                pci_bus_id: None,
                numa_node: None,
                cpu_affinity: None,
                nvlinks_active: links,
                nvlinks_inactive: links.map(|l| 18 - l),
            })
            .collect();
        Host {
            gpus,
            ..Host::named("gpu-node-1".into(), "test")
        }
    }

    #[test]
    fn a_gpu_below_its_peers_is_an_error() {
        let findings = check(&host(&[Some(18), Some(18), Some(16), Some(18)]));
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].severity, Severity::Error);
        assert!(
            findings[0]
                .message
                .starts_with("GPU2 has 16 active NVLinks, its peers have 18: 2 link(s) down")
        );
    }

    #[test]
    fn uniform_or_absent_nvlink_is_fine() {
        assert_eq!(
            check(&host(&[Some(18), Some(18)]))[0].severity,
            Severity::Ok
        );
        // PCIe cards without bridges: no GPU has an active link, nothing to compare.
        assert!(check(&host(&[Some(0), Some(0)])).is_empty());
        assert!(check(&host(&[None, None])).is_empty());
    }
}
