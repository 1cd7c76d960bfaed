//! `nccl-version`: NCCL and CUDA driver versions, within and across logs.
//!
//! What it checks: `NCCL version X+cudaY` and `cudaDriverVersion N` of each log.
//! Why it matters: ranks with different NCCL versions may disagree on protocols and hang or
//! fail at init; an NCCL built for a newer CUDA than the driver supports runs through CUDA
//! minor-version compatibility (fine within a major version, but some features are off).
//! How to fix: install one NCCL on every host (the same `nvidia-nccl-cu12` wheel or
//! container image), and a driver that supports the CUDA version NCCL was built for.

use crate::doctor::nccl_log::NcclLog;
use crate::doctor::{Finding, Severity, cite};

/// Id of this check.
pub(crate) const ID: &str = "nccl-version";

/// An `ok` finding per log with its versions (noting minor-version compatibility), and an
/// error when logs show different NCCL versions.
pub(crate) fn check(logs: &[NcclLog]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for log in logs {
        let Some((version, cuda_build, evidence)) = &log.version else {
            continue;
        };
        let mut message = format!("NCCL {version}");
        let mut cited = vec![cite(&log.origin, evidence)];
        if let Some(cuda) = cuda_build {
            message.push_str(&format!(" built for CUDA {cuda}"));
        }
        if let Some((driver, driver_evidence)) = &log.cuda_driver_version {
            let (major, minor) = (driver / 1000, driver % 1000 / 10);
            message.push_str(&format!(", driver supports CUDA {major}.{minor}"));
            cited.push(cite(&log.origin, driver_evidence));
            if let Some((build_major, build_minor)) =
                cuda_build.as_deref().and_then(parse_major_minor)
                && (build_major, build_minor) > (major, minor)
            {
                message.push_str(if build_major == major {
                    ": runs through CUDA minor-version compatibility"
                } else {
                    ": the driver is too old for this NCCL's CUDA major version"
                });
                if build_major != major {
                    findings.push(Finding {
                        check: ID,
                        severity: Severity::Error,
                        host: evidence.host.clone(),
                        message: message.clone(),
                        evidence: cited.clone(),
                        hint: format!("install a driver supporting CUDA {build_major}.{build_minor}, or an NCCL built for CUDA {major}"),
                    });
                    continue;
                }
            }
        }
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: evidence.host.clone(),
            message,
            evidence: cited,
            hint: String::new(),
        });
    }
    let mut versions: Vec<(&str, &str)> = logs
        .iter()
        .filter_map(|l| {
            l.version
                .as_ref()
                .map(|(v, _, _)| (v.as_str(), l.origin.as_str()))
        })
        .collect();
    versions.sort();
    let mut distinct: Vec<&str> = versions.iter().map(|(v, _)| *v).collect();
    distinct.dedup();
    if distinct.len() > 1 {
        findings.push(Finding {
            check: ID,
            severity: Severity::Error,
            host: None,
            message: format!("NCCL versions differ across logs: {}", versions.iter().map(|(v, o)| format!("{v} in `{o}`")).collect::<Vec<_>>().join(", ")),
            evidence: logs.iter().filter_map(|l| l.version.as_ref().map(|(_, _, e)| cite(&l.origin, e))).collect(),
            hint: "install the same NCCL on every host (one container image, or the same `nvidia-nccl-cu12` wheel)".to_string(),
        });
    }
    findings
}

/// `12.3` → (12, 3).
fn parse_major_minor(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.split_once('.')?;
    Some((major.parse().ok()?, minor.split('.').next()?.parse().ok()?))
}
