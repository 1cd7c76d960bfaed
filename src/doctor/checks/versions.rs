//! `versions`: every host runs the same `infer` build, NVIDIA and CUDA driver, and NCCL.
//!
//! What it checks: the `infer` version and sha256 each host would run, the driver and
//! CUDA driver versions NVML reports there, and the NCCL library its processes would load
//! (found as the dynamic loader finds `libnccl.so.2`, version from `ncclGetVersion`).
//! Why it matters: ranks of different builds disagree on wire formats and numerics; NCCL
//! and driver mismatches across hosts are a classic cause of garbage in `ncclSocketInit`
//! and of hangs.
//! How to fix: install one build everywhere (or let `infer` stage its own: remove the
//! host's `infer-path`), and one driver version on every host.

use crate::doctor::evidence::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "versions";

/// Reads one kind of version off a host.
type VersionOf = fn(&crate::doctor::evidence::HostEvidence) -> Option<String>;

/// One finding per kind of version that differs across hosts, naming each host's value.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let mut findings = Vec::new();
    let kinds: [(&str, VersionOf); 4] = [
        ("`infer` build", |h| {
            Some(format!(
                "{} (sha256 {}) at `{}`",
                h.infer_version,
                &h.infer_sha256[..12.min(h.infer_sha256.len())],
                h.infer_path
            ))
        }),
        ("NVIDIA driver", |h| h.topology.driver_version.clone()),
        ("CUDA driver", |h| h.topology.cuda_driver_version.clone()),
        ("NCCL library", |h| {
            h.nccl.as_ref().map(|n| match (&n.version, &n.error) {
                (Some(version), _) => format!("{version} at `{}`", n.path),
                (None, error) => format!(
                    "unreadable ({}) at `{}`",
                    error.as_deref().unwrap_or("?"),
                    n.path
                ),
            })
        }),
    ];
    for (kind, value) in &kinds {
        let values: Vec<(String, Option<String>)> = evidence
            .hosts
            .iter()
            .map(|h| (h.name.clone(), value(h)))
            .collect();
        let key = |v: &Option<String>| {
            v.as_ref()
                .map(|s| s.split(" at ").next().unwrap_or(s).to_string())
        };
        let mut distinct: Vec<Option<String>> = values.iter().map(|(_, v)| key(v)).collect();
        distinct.sort();
        distinct.dedup();
        if distinct.len() > 1 {
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: None,
                message: format!("the hosts run different {kind}s"),
                evidence: values
                    .iter()
                    .map(|(h, v)| format!("{h}: {}", v.as_deref().unwrap_or("none")))
                    .collect(),
                hint: format!("install one {kind} on every host"),
            });
        }
    }
    if findings.is_empty() && !evidence.hosts.is_empty() {
        let first = &evidence.hosts[0];
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "every host runs `infer` {} (sha256 {}), driver {}, NCCL {}",
                first.infer_version,
                &first.infer_sha256[..12.min(first.infer_sha256.len())],
                first
                    .topology
                    .driver_version
                    .as_deref()
                    .unwrap_or("none (no NVIDIA driver)"),
                first
                    .nccl
                    .as_ref()
                    .and_then(|n| n.version.as_deref())
                    .unwrap_or("none found")
            ),
            evidence: Vec::new(),
            hint: String::new(),
        });
    }
    findings
}
