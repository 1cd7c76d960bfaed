//! `ep-cross-node`: an expert-parallel group whose ranks sit on different hosts.
//!
//! What it checks: every EP group of a plan (MoE models with EP > 1).
//! Why it matters: each MoE layer dispatches and combines tokens with all-to-all; across
//! hosts that runs at network speed, and all-to-all is the pattern networks handle worst.
//! How to fix: keep EP inside a node where the experts fit (EP ≤ GPUs per node), or make
//! sure the hosts have RDMA (NET/IB with GPUDirect) so the all-to-all is not over TCP.

use crate::doctor::{Finding, Severity};
use crate::plan::Plan;

/// Id of this check.
pub(crate) const ID: &str = "ep-cross-node";

/// A warning when some EP group spans hosts; nothing for dense plans (EP = 1).
pub(crate) fn check(plan: &Plan) -> Option<Finding> {
    if plan.parallel.ep <= 1 {
        return None;
    }
    let spanning: Vec<&Vec<u64>> = plan
        .groups
        .ep
        .iter()
        .filter(|group| {
            let first = group
                .first()
                .and_then(|&r| plan.ranks.get(r as usize))
                .map(|r| &r.host);
            group
                .iter()
                .any(|&r| plan.ranks.get(r as usize).map(|p| &p.host) != first)
        })
        .collect();
    Some(if spanning.is_empty() {
        Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!("EP{} groups stay inside one host", plan.parallel.ep),
            evidence: Vec::new(),
            hint: String::new(),
        }
    } else {
        Finding {
            check: ID,
            severity: Severity::Warn,
            host: None,
            message: format!("{} EP{} group(s) span hosts: every MoE layer's all-to-all crosses the network", spanning.len(), plan.parallel.ep),
            evidence: spanning.iter().take(2).map(|g| format!("ep group {g:?}")).collect(),
            hint: "keep EP within a node if the experts fit, and make sure inter-node traffic uses RDMA (`infer doctor --nccl-log`)".to_string(),
        }
    })
}
