//! `nvml`: whether this host has the NVIDIA driver and GPUs, and whether a plan needs them.
//!
//! What it checks: NVML's answer on this host (GPU count, name, driver), against the ranks
//! a plan places on this host.
//! Why it matters: a host without the driver can only run CPU ranks; a plan that puts GPU
//! ranks on it fails at launch.
//! How to fix: install the NVIDIA driver (`nvidia-smi` must work), or plan for the hosts
//! that have GPUs.

use crate::doctor::{Finding, Severity};
use crate::plan::Plan;
use crate::topology::Host;

/// Id of this check.
pub(crate) const ID: &str = "nvml";

/// A note of what NVML found; an error when `plan` places ranks on this host (by host
/// name) and the host has fewer GPUs than the ranks need.
pub(crate) fn check(host: &Host, plan: Option<&Plan>) -> Finding {
    let ranks_here = plan.map_or(0, |plan| {
        plan.ranks
            .iter()
            .filter(|r| r.host == host.hostname)
            .count()
    });
    if ranks_here > host.gpus.len() {
        return Finding {
            check: ID,
            severity: Severity::Error,
            host: Some(host.hostname.clone()),
            message: format!(
                "the plan places {ranks_here} GPU rank(s) on this host but NVML finds {} GPU(s){}",
                host.gpus.len(),
                if host.notes.is_empty() { String::new() } else { format!(" ({})", host.notes.join("; ")) }
            ),
            evidence: Vec::new(),
            hint: "install the NVIDIA driver so `nvidia-smi` works, or re-plan for the hosts that have the GPUs".to_string(),
        };
    }
    Finding {
        check: ID,
        severity: Severity::Ok,
        host: Some(host.hostname.clone()),
        message: if host.gpus.is_empty() {
            format!("no NVIDIA GPUs: {}; CPU ranks only", host.notes.join("; "))
        } else {
            format!(
                "{} × {}, driver {}",
                host.gpus.len(),
                host.gpus[0].name.as_deref().unwrap_or("GPU"),
                host.driver_version.as_deref().unwrap_or("unknown")
            )
        },
        evidence: Vec::new(),
        hint: String::new(),
    }
}
