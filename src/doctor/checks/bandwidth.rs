//! `bandwidth` (with `--bandwidth`): each pair of hosts moves data over the data network at
//! a fair share of its link rate.
//!
//! What it checks: one 64 MiB TCP stream per pair of hosts, from one data address to the
//! other, against the slower of the two data NICs' link rates (sysfs `speed`).
//! Why it matters: one NIC negotiated at a tenth of its speed, a bad cable or a congested
//! uplink caps every ring through that host; it looks like "NCCL is slow" everywhere.
//! How to fix: check the slow pair's link speed and errors (`ethtool`, `ip -s link`), its
//! cables and switch ports, and any traffic shaping on it (`tc qdisc`).

use crate::doctor::cluster::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub const ID: &str = "bandwidth";

/// Below this share of the expected link rate a pair warns.
pub const MIN_SHARE: f64 = 0.5;

/// A warning per slow or failed pair; one `ok` with every pair's figure otherwise.
pub fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let Some(pairs) = &evidence.bandwidth else {
        return Vec::new();
    };
    let figures: Vec<String> = pairs
        .iter()
        .map(|p| {
            format!(
                "{} -> {}: {} (link {})",
                p.from,
                p.to,
                p.gbps.map_or("failed".into(), |g| format!("{g:.2} Gbit/s")),
                p.expected_gbps
                    .map_or("unknown".into(), |g| format!("{g:.0} Gbit/s"))
            )
        })
        .collect();
    let mut findings = Vec::new();
    for pair in pairs {
        match (pair.gbps, pair.expected_gbps) {
            (None, _) => findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(pair.from.clone()),
                message: format!(
                    "the bandwidth probe from `{}` to `{}` failed: {}",
                    pair.from,
                    pair.to,
                    pair.error.as_deref().unwrap_or("no result")
                ),
                evidence: Vec::new(),
                hint: "see the `reachability` findings for this pair".into(),
            }),
            (Some(gbps), Some(expected)) if gbps < MIN_SHARE * expected => findings.push(Finding {
                check: ID,
                severity: Severity::Warn,
                host: Some(pair.from.clone()),
                message: format!(
                    "`{}` -> `{}` moves {gbps:.2} Gbit/s, under {:.0}% of the {expected:.0} Gbit/s link",
                    pair.from,
                    pair.to,
                    MIN_SHARE * 100.0
                ),
                evidence: figures.clone(),
                hint: format!(
                    "check the data links of `{}` and `{}`: negotiated speed and errors (`ethtool`, `ip -s link`), cables, switch ports, shaping (`tc qdisc`)",
                    pair.from, pair.to
                ),
            }),
            _ => {}
        }
    }
    if findings.is_empty() {
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "every pair moves at least {:.0}% of its link rate over the data network",
                MIN_SHARE * 100.0
            ),
            evidence: figures,
            hint: String::new(),
        });
    }
    findings
}
