//! `clock-skew`: the hosts' clocks agree within a second.
//!
//! What it checks: each host's clock against the launcher's when its agent said hello
//! (corrected by half the round trip).
//! Why it matters: logs from several hosts cannot be lined up when their clocks differ;
//! timeouts and certificates misbehave at larger skews.
//! How to fix: run NTP (`chronyd`, `systemd-timesyncd`) on every host.

use crate::doctor::evidence::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "clock-skew";

/// The skew above which a host is flagged, milliseconds.
pub(crate) const MAX_SKEW_MS: i64 = 1000;

/// A warning per host whose clock is more than [`MAX_SKEW_MS`] off the launcher's.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    evidence
        .hosts
        .iter()
        .filter(|h| h.clock_offset_ms.abs() > MAX_SKEW_MS)
        .map(|h| Finding {
            check: ID,
            severity: Severity::Warn,
            host: Some(h.name.clone()),
            message: format!(
                "its clock is {:+.1} s off this machine's (more than {} s): logs across hosts will not line up",
                h.clock_offset_ms as f64 / 1000.0,
                MAX_SKEW_MS / 1000
            ),
            evidence: Vec::new(),
            hint: format!("run NTP on `{}` (`chronyc tracking` shows its state)", h.name),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::evidence::HostEvidence;

    fn host(name: &str, clock_offset_ms: i64) -> HostEvidence {
        let spec = crate::inventory::hardware("l4").expect("profile");
        HostEvidence {
            name: name.into(),
            infer_version: "0.1.0".into(),
            infer_sha256: "00".repeat(32),
            infer_path: "/usr/bin/infer".into(),
            wanted_interface: None,
            ssh_address: "10.0.0.1".into(),
            nccl: None,
            interfaces: Vec::new(),
            topology: crate::inventory::synthetic_topology(name, 1, &spec),
            clock_offset_ms,
            live: Vec::new(),
        }
    }

    #[test]
    fn only_hosts_more_than_a_second_off_are_flagged() {
        let evidence = ClusterEvidence {
            hosts: vec![
                host("a", 250),
                host("b", -1500),
                host("c", 1000),
                host("d", 4200),
            ],
            unreachable: Vec::new(),
            data: Err("unused".into()),
            matrix: None,
            bandwidth: None,
            allreduce: None,
            engine: None,
        };
        let findings = check(&evidence);
        let flagged: Vec<&str> = findings.iter().filter_map(|f| f.host.as_deref()).collect();
        assert_eq!(flagged, ["b", "d"]);
        assert!(
            findings[0].message.contains("-1.5 s"),
            "{}",
            findings[0].message
        );
        assert!(findings.iter().all(|f| f.severity == Severity::Warn));
    }
}
