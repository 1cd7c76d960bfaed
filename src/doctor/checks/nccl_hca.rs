//! `nccl-hca`: every host's NCCL uses the same set of HCAs.
//!
//! What it checks: the `NET/IB : Using [0]mlx5_0:1/IB …` lists of several logs (one per
//! host), compared.
//! Why it matters: a host whose NCCL picked fewer or other HCAs (a port down, a different
//! `NCCL_IB_HCA`, an adapter missing in the container) caps every ring through it at its
//! bandwidth, and mismatched rail assignments cross the fabric's spine.
//! How to fix: give every host the same `NCCL_IB_HCA` (with `=` for exact names), and bring
//! the missing ports up (`ibstat`).

use std::collections::BTreeSet;

use crate::doctor::nccl_log::NcclLog;
use crate::doctor::{Finding, Severity, cite};

pub(crate) const ID: &str = "nccl-hca";

/// A warning naming the hosts (logs) whose HCA sets differ from the most common one.
pub(crate) fn check(logs: &[NcclLog]) -> Vec<Finding> {
    let sets: Vec<(&NcclLog, BTreeSet<String>)> = logs
        .iter()
        .filter(|log| !log.ib_devices.is_empty())
        .map(|log| {
            let devices = log
                .ib_devices
                .iter()
                .map(|(device, _)| device.split(':').next().unwrap_or(device).to_string())
                .collect();
            (log, devices)
        })
        .collect();
    if sets.len() < 2 {
        return Vec::new();
    }
    // The set most logs agree on is the reference.
    let mut counts: Vec<(&BTreeSet<String>, usize)> = Vec::new();
    for (_, set) in &sets {
        match counts.iter_mut().find(|(s, _)| *s == set) {
            Some((_, n)) => *n += 1,
            None => counts.push((set, 1)),
        }
    }
    let (reference, _) = counts
        .iter()
        .max_by_key(|(_, n)| *n)
        .copied()
        .expect("at least two logs");
    let name = |log: &NcclLog| {
        log.ib_devices
            .first()
            .and_then(|(_, e)| e.host.clone())
            .unwrap_or_else(|| log.origin.clone())
    };
    let agreeing: Vec<String> = sets
        .iter()
        .filter(|(_, s)| s == reference)
        .map(|(log, _)| name(log))
        .collect();
    sets.iter()
        .filter(|(_, set)| set != reference)
        .map(|(log, set)| Finding {
            check: ID,
            severity: Severity::Warn,
            host: Some(name(log)),
            message: format!(
                "NCCL uses HCAs {{{}}} here but {{{}}} on {}",
                set.iter().cloned().collect::<Vec<_>>().join(", "),
                reference.iter().cloned().collect::<Vec<_>>().join(", "),
                agreeing.join(", ")
            ),
            evidence: log.ib_devices.iter().take(1).map(|(_, e)| cite(&log.origin, e)).collect(),
            hint: "set the same `NCCL_IB_HCA` (e.g. `=mlx5_0,mlx5_1`) on every host and check its ports with `ibstat`".into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::nccl_log::parse;

    /// See: #19. Different HCAs chosen on different hosts are flagged with both named.
    #[test]
    fn a_host_with_other_hcas_is_named() {
        let using = |host: &str, hcas: &str| {
            parse(
                &format!("{host}:1:1 [0] NCCL INFO NET/IB : Using {hcas} ; OOB eth0:10.0.0.1<0>\n"),
                &format!("{host}.log"),
            )
        };
        let logs = [
            using("gpu1", "[0]mlx5_0:1/IB [1]mlx5_1:1/IB"),
            using("gpu2", "[0]mlx5_0:1/IB [1]mlx5_1:1/IB"),
            using("gpu3", "[0]mlx5_0:1/IB"),
        ];
        let findings = check(&logs);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].host.as_deref(), Some("gpu3"));
        assert!(
            findings[0].message.contains("{mlx5_0}") && findings[0].message.contains("gpu1, gpu2"),
            "{}",
            findings[0].message
        );
        assert!(check(&logs[..2]).is_empty());
    }
}
