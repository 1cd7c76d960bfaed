//! `rdma`: InfiniBand/RoCE adapters are present on every host or on none.
//!
//! What it checks: which hosts have RDMA HCAs (their port states are checked on each host
//! by `ib-port`).
//! Why it matters: NCCL picks one transport per communicator: a host without HCAs (or
//! without the RDMA user-space stack) drags every collective it joins down to TCP sockets.
//! How to fix: install the HCA driver and `rdma-core` on the hosts that lack them, or
//! leave those hosts out of the inventory.

use crate::doctor::evidence::ClusterEvidence;
use crate::doctor::{Finding, Severity};
use crate::topology::NicKind;

pub(crate) const ID: &str = "rdma";

/// An error when some hosts have HCAs and others do not.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let hcas: Vec<(String, Vec<String>)> = evidence
        .hosts
        .iter()
        .map(|h| {
            let names = h
                .topology
                .nics
                .iter()
                .filter(|n| matches!(n.kind, NicKind::Ib | NicKind::Roce))
                .map(|n| n.name.clone())
                .collect();
            (h.name.clone(), names)
        })
        .collect();
    let with = hcas.iter().filter(|(_, n)| !n.is_empty()).count();
    if with == 0 || with == hcas.len() {
        return Vec::new();
    }
    vec![Finding {
        check: ID,
        severity: Severity::Error,
        host: None,
        message: format!(
            "{with} of {} hosts have InfiniBand/RoCE HCAs: collectives with the others fall back to TCP sockets",
            hcas.len()
        ),
        evidence: hcas
            .iter()
            .map(|(h, n)| {
                format!(
                    "{h}: {}",
                    if n.is_empty() {
                        "no HCA".into()
                    } else {
                        n.join(", ")
                    }
                )
            })
            .collect(),
        hint: "install the HCA driver and `rdma-core` where they are missing".into(),
    }]
}
