//! `ib-port`: RDMA ports that are not ACTIVE.
//!
//! What it checks: every port of every HCA under `/sys/class/infiniband` (state, physical state).
//! Why it matters: NCCL skips ports that are not ACTIVE; with all down it falls back to TCP,
//! with some down it loses bandwidth on those rails.
//! How to fix: `ibstat` shows the port; check the cable and switch port, and the subnet
//! manager (`opensm`) for InfiniBand, or the netdev's link for RoCE (`ip link set <if> up`).

use crate::doctor::{Finding, Severity};
use crate::topology::{Host, NicKind};

/// Id of this check.
pub(crate) const ID: &str = "ib-port";

/// An error per HCA with a port that is not ACTIVE; one `ok` when all are.
pub(crate) fn check(host: &Host) -> Vec<Finding> {
    let hcas: Vec<_> = host
        .nics
        .iter()
        .filter(|n| matches!(n.kind, NicKind::Ib | NicKind::Roce) && !n.ports.is_empty())
        .collect();
    let mut findings = Vec::new();
    for hca in &hcas {
        for port in hca.ports.iter().filter(|p| p.state != "ACTIVE") {
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.hostname.clone()),
                message: format!("`{}` port {} is {} ({}), expected ACTIVE", hca.name, port.port, port.state, port.phys_state),
                evidence: vec![format!("/sys/class/infiniband/{}/ports/{}/state: {}", hca.name, port.port, port.state)],
                hint: format!(
                    "check `ibstat {}` and the cable/switch port; for InfiniBand make sure a subnet manager runs, for RoCE bring up `{}`",
                    hca.name,
                    hca.netdev.as_deref().unwrap_or("its netdev")
                ),
            });
        }
    }
    if findings.is_empty() && !hcas.is_empty() {
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: Some(host.hostname.clone()),
            message: format!("{} HCA(s), every port ACTIVE", hcas.len()),
            evidence: hcas
                .iter()
                .map(|h| {
                    format!(
                        "{}: {}",
                        h.name,
                        h.rate_gbps
                            .map_or("rate unknown".to_string(), |r| format!("{r} Gb/s"))
                    )
                })
                .collect(),
            hint: String::new(),
        });
    }
    findings
}
