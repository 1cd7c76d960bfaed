//! `p2p`: GPU pairs without peer-to-peer access.
//!
//! What it checks: the `nvidia-smi topo -p2p` matrix (probed or imported): pairs whose
//! status is not `OK`.
//! Why it matters: without P2P, NCCL moves TP traffic through host memory (SHM), a copy
//! each way over PCIe; consumer GPUs (`GNS`) and some chipsets (`CNS`) never allow it.
//! How to fix: nothing fixes `GNS`; keep TP small (or use PP) on such GPUs. `DR` means a
//! registry key or `NCCL_P2P_DISABLE` turned it off.

use crate::doctor::{Finding, Severity};
use crate::topology::Host;

/// Id of this check.
pub(crate) const ID: &str = "p2p";

/// A warning listing the pairs without P2P; nothing when the matrix is unknown.
pub(crate) fn check(host: &Host) -> Option<Finding> {
    let p2p = host.p2p.as_ref()?;
    let blocked: Vec<String> = (0..p2p.len())
        .flat_map(|i| (i + 1..p2p.len()).map(move |j| (i, j)))
        .filter(|&(i, j)| !p2p[i][j].is_ok())
        .map(|(i, j)| format!("GPU{i}–GPU{j}: {}", p2p[i][j]))
        .collect();
    if blocked.is_empty() {
        return Some(Finding {
            check: ID,
            severity: Severity::Ok,
            host: Some(host.hostname.clone()),
            message: "P2P read/write is supported between every GPU pair".to_string(),
            evidence: Vec::new(),
            hint: String::new(),
        });
    }
    let no_nvlink = host.nvlink_domains.iter().all(|d| d.len() < 2);
    Some(Finding {
        check: ID,
        severity: Severity::Warn,
        host: Some(host.hostname.clone()),
        message: format!(
            "{} GPU pair(s) have no P2P{}: NCCL uses SHM through host memory for TP, expect low all-reduce bandwidth",
            blocked.len(),
            if no_nvlink { " and no NVLink" } else { "" }
        ),
        evidence: blocked,
        hint:
            "keep TP small on these GPUs (or use PP); `GNS` (GPU not supported) cannot be enabled"
                .to_string(),
    })
}
