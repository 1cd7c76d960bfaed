//! `bandwidth` (with `--bandwidth`): each pair of hosts moves data over the data network at
//! a fair share of its link rate, and so does an all-reduce over all of them.
//!
//! What it checks: one 64 MiB TCP stream per pair of hosts, from one data address to the
//! other, against the slower of the two data NICs' link rates (sysfs `speed`); then an
//! all-reduce with our own collectives (one rank per host, TCP over the data interfaces,
//! 8 B to 64 MiB as nccl-tests sweeps), whose peak bus bandwidth is held against the
//! slowest data link of the group (a ring all-reduce's busbw is what each link carries).
//! Why it matters: one NIC negotiated at a tenth of its speed, a bad cable or a congested
//! uplink caps every ring through that host; it looks like "NCCL is slow" everywhere.
//! How to fix: check the slow pair's link speed and errors (`ethtool`, `ip -s link`), its
//! cables and switch ports, and any traffic shaping on it (`tc qdisc`).

use crate::doctor::evidence::{AllreduceProbe, ClusterEvidence, PairBandwidth};
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "bandwidth";

/// Below this share of the expected link rate a pair warns.
pub(crate) const MIN_SHARE: f64 = 0.5;

/// A warning per slow pair, an error per failed one; one `ok` with every pair's figure
/// otherwise; then the all-reduce's finding.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let Some(pairs) = &evidence.bandwidth else {
        return Vec::new();
    };
    let mut findings = pair_findings(pairs);
    findings.extend(evidence.allreduce.as_ref().map(allreduce_finding));
    findings
}

/// The all-reduce probe: an error when it failed, a warning when it did not run or its peak
/// busbw is under [`MIN_SHARE`] of the slowest data link, `ok` with the figure otherwise.
fn allreduce_finding(probe: &AllreduceProbe) -> Finding {
    let group = probe.hosts.join(", ");
    let link = probe.slowest_link.as_ref().map(|l| {
        format!(
            "the slowest data link is `{}` on `{}`, {:.0} Gbit/s",
            l.interface, l.host, l.gbps
        )
    });
    let finding = |severity, message: String, hint: &str| Finding {
        check: ID,
        severity,
        host: None,
        message,
        evidence: link.iter().cloned().collect(),
        hint: hint.into(),
    };
    if let Some(error) = &probe.error {
        let severity = if error.starts_with("not run") {
            Severity::Warn
        } else {
            Severity::Error
        };
        return finding(
            severity,
            format!("the all-reduce over {group} did not complete: {error}"),
            "see the `reachability` and `versions` findings; the ranks' logs are in the newest run directory under ~/.cache/infer/runs/",
        );
    }
    let Some(peak) = probe.peak_busbw_bytes_per_sec() else {
        return finding(
            Severity::Error,
            format!("the all-reduce over {group} measured nothing"),
            "",
        );
    };
    let peak_gbps = peak * 8.0 / 1e9;
    let figure = format!(
        "all-reduce over {group} ({}): peak busbw {:.3} GB/s ({peak_gbps:.2} Gbit/s)",
        probe.transport,
        peak / 1e9
    );
    match &probe.slowest_link {
        Some(slowest) if peak_gbps < MIN_SHARE * slowest.gbps => finding(
            Severity::Warn,
            format!(
                "{figure}, under {:.0}% of the slowest data link ({:.0} Gbit/s on `{}`)",
                MIN_SHARE * 100.0,
                slowest.gbps,
                slowest.host
            ),
            "when every pair above streams at its rate, the all-reduce itself is slow: busy CPUs on a host (the ranks reduce on the CPU), a host whose NIC interrupts land on one core, or a switch that drops under many-to-many load",
        ),
        Some(slowest) => finding(
            Severity::Ok,
            format!(
                "{figure}, {:.0}% of the slowest data link",
                100.0 * peak_gbps / slowest.gbps
            ),
            "",
        ),
        None => finding(
            Severity::Ok,
            format!("{figure}; no link rate known to compare with"),
            "",
        ),
    }
}

/// The pairwise streams' findings.
fn pair_findings(pairs: &[PairBandwidth]) -> Vec<Finding> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::evidence::LinkRate;
    use crate::runtime::collectives::AllreduceRow;

    /// A 3-host probe whose 64 MiB all-reduce took `secs`, the slowest link 10 Gbit/s.
    fn probe(secs: f64) -> AllreduceProbe {
        AllreduceProbe {
            hosts: vec!["a".into(), "b".into(), "c".into()],
            transport: "TCP".into(),
            rows: vec![
                AllreduceRow {
                    bytes: 8,
                    time_secs: 40e-6,
                },
                AllreduceRow {
                    bytes: 64 << 20,
                    time_secs: secs,
                },
            ],
            slowest_link: Some(LinkRate {
                host: "b".into(),
                interface: "ens5".into(),
                gbps: 10.0,
            }),
            error: None,
        }
    }

    #[test]
    fn busbw_is_held_against_the_slowest_link() {
        // 64 MiB in 0.1 s over 3 ranks: algbw 0.671 GB/s, busbw × 4/3 = 0.895 GB/s,
        // 7.16 Gbit/s of 10.
        let fast = allreduce_finding(&probe(0.1));
        assert_eq!(fast.severity, Severity::Ok, "{}", fast.message);
        assert!(fast.message.contains("0.895 GB/s"), "{}", fast.message);
        assert!(fast.message.contains("72%"), "{}", fast.message);
        // Four times slower: 1.79 Gbit/s, under half of 10.
        let slow = allreduce_finding(&probe(0.4));
        assert_eq!(slow.severity, Severity::Warn);
        assert!(slow.message.contains("`b`"), "{}", slow.message);
    }

    #[test]
    fn a_failed_probe_is_an_error_and_a_skipped_one_a_warning() {
        let mut failed = probe(0.1);
        failed.rows.clear();
        failed.error = Some("rank 1 failed: connection refused".into());
        assert_eq!(allreduce_finding(&failed).severity, Severity::Error);
        failed.error = Some("not run: the hosts run different `infer` builds".into());
        assert_eq!(allreduce_finding(&failed).severity, Severity::Warn);
    }
}
