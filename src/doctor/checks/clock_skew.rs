//! `clock-skew`: the hosts' clocks agree within a second.
//!
//! What it checks: each host's clock against the launcher's when its agent said hello
//! (corrected by half the round trip).
//! Why it matters: logs from several hosts cannot be lined up when their clocks differ;
//! timeouts and certificates misbehave at larger skews.
//! How to fix: run NTP (`chronyd`, `systemd-timesyncd`) on every host.

use crate::doctor::cluster::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub const ID: &str = "clock-skew";

/// The skew above which a host is flagged, milliseconds.
pub const MAX_SKEW_MS: i64 = 1000;

/// A warning per host whose clock is more than [`MAX_SKEW_MS`] off the launcher's.
pub fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
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
