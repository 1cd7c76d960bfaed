//! `cross-node-tp`: a tensor-parallel group whose ranks sit on different hosts.
//!
//! What it checks: every TP group of a plan, by the host of each rank.
//! Why it matters: TP all-reduces twice per layer per token; across hosts that traffic
//! leaves NVLink (~900 GB/s) for the network (~50 GB/s) and dominates every step.
//! How to fix: keep TP inside a node and go across nodes with PP: `--tp <GPUs per node>
//! --pp <nodes>` (what `infer plan` chooses unless TP is pinned).

use crate::doctor::{Finding, Severity};
use crate::plan::Plan;

/// Id of this check.
pub(crate) const ID: &str = "cross-node-tp";

/// An error per TP group spanning hosts; one `ok` when none does.
pub(crate) fn check(plan: &Plan) -> Vec<Finding> {
    let spans: Vec<(usize, Vec<String>)> = plan
        .groups
        .tp
        .iter()
        .enumerate()
        .filter_map(|(index, group)| {
            let mut hosts: Vec<String> = group
                .iter()
                .filter_map(|&r| plan.ranks.get(r as usize))
                .map(|r| r.host.clone())
                .collect();
            hosts.dedup();
            (hosts.len() > 1).then_some((index, hosts))
        })
        .collect();
    if spans.is_empty() {
        return vec![Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "all {} TP group(s) stay inside one host",
                plan.groups.tp.len()
            ),
            evidence: Vec::new(),
            hint: String::new(),
        }];
    }
    let hosts_per_group = spans[0].1.len();
    vec![Finding {
        check: ID,
        severity: Severity::Error,
        host: None,
        message: format!(
            "{} TP group(s) span hosts: every layer's all-reduce crosses the network",
            spans.len()
        ),
        evidence: spans
            .iter()
            .take(4)
            .map(|(index, hosts)| {
                format!(
                    "tp group {index} {:?} on hosts {}",
                    plan.groups.tp[*index],
                    hosts.join(", ")
                )
            })
            .collect(),
        hint: format!(
            "keep TP inside a node and use PP across nodes: `--tp {} --pp {}`",
            plan.parallel.tp / hosts_per_group.max(1),
            plan.parallel.pp * hosts_per_group
        ),
    }]
}
