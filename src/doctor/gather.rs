//! What `infer doctor` reads (NCCL logs, a recorded topology, a saved plan) and which checks
//! run on what it was given: offline evidence and this host, a planned layout, a cluster's
//! survey, one run's post-mortem. It gathers no evidence over SSH and loads no model or
//! inventory (`launch/` and the command do).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::checks::{self, nccl_output, run_outcome::RunEvidence};
use super::evidence::ClusterEvidence;
use super::nccl_log::{self, NcclLog};
use super::{Finding, Report, Severity};
use crate::plan::cluster::Cluster;
use crate::plan::{Outcome, Plan};
use crate::topology::Topology;

/// Offline evidence for `infer doctor` without `--cluster` or `--run`, already read.
pub(crate) struct Offline<'a> {
    /// Every `--nccl-log`, parsed.
    pub logs: &'a [NcclLog],
    /// `--topology`, imported.
    pub topology: Option<&'a Topology>,
    /// `--plan`, checked against its hosts and this one.
    pub plan: Option<&'a Plan>,
    /// Where this host's sysfs is (`--sysfs-root`), for the live checks and the plan's
    /// check of this host.
    pub sysfs_root: &'a Path,
}

/// The findings of offline evidence: the NCCL logs, the saved plan (against this host
/// too), the plan `planned` makes (`--model`; `None` without it), the topology; with none
/// of them, this host's live checks.
///
/// Errors: the probe of this host, or `planned`'s.
pub(crate) fn offline(
    offline: &Offline,
    planned: Option<impl FnOnce() -> Result<Vec<Finding>>>,
) -> Result<Vec<Finding>> {
    let mut findings = checks::nccl_logs(offline.logs, offline.topology);
    if let Some(plan) = offline.plan {
        let this_host =
            crate::topology::probe::probe_host(&crate::topology::probe::ProbeOptions {
                sysfs_root: offline.sysfs_root.to_path_buf(),
            })?;
        findings.extend(checks::plan(plan, offline.topology, Some(&this_host)));
    }
    let with_model = planned.is_some();
    if let Some(planned) = planned {
        findings.extend(planned()?);
    }
    if let Some(topology) = offline.topology {
        findings.extend(checks::topology(topology));
    }
    if offline.logs.is_empty()
        && offline.topology.is_none()
        && offline.plan.is_none()
        && !with_model
    {
        findings.extend(checks::live(offline.sysfs_root)?);
    }
    Ok(findings)
}

/// The findings of a plan made for `cluster` (`--model` with the planner flags): the plan
/// checks against the cluster's own topology and the planner's warnings, citing `command`
/// (the `infer plan` that reproduces it); an infeasible plan is an error finding.
pub(crate) fn planned(outcome: &Outcome, cluster: &Cluster, command: &str) -> Vec<Finding> {
    match outcome {
        Outcome::Feasible(plan) => {
            let cluster_topology = Topology {
                hosts: cluster.hosts.iter().map(|h| h.topology.clone()).collect(),
            };
            let mut findings = checks::plan(plan, Some(&cluster_topology), None);
            findings.extend(plan.warnings.iter().map(|warning| Finding {
                check: "plan",
                severity: Severity::Warn,
                host: None,
                message: warning.clone(),
                evidence: vec![format!("{command}: {}", plan.parallel)],
                hint: String::new(),
            }));
            findings
        }
        Outcome::Infeasible(infeasible) => vec![Finding {
            check: "plan",
            severity: Severity::Error,
            host: None,
            message: infeasible.message.clone(),
            evidence: Vec::new(),
            hint: infeasible.hint.clone(),
        }],
    }
}

/// The report of `--cluster hosts.toml`: the survey's checks, the NCCL logs' and the saved
/// plan's against the surveyed hosts, grouped by host in inventory order (cluster-wide
/// findings last), with the survey's matrix, all-reduce and engine.
pub(crate) fn cluster(evidence: ClusterEvidence, logs: &[NcclLog], plan: Option<&Plan>) -> Report {
    let mut findings = checks::cluster(&evidence);
    findings.extend(checks::nccl_logs(logs, None));
    if let Some(plan) = plan {
        findings.extend(checks::cluster_plan(plan, &evidence));
    }
    // Each host keeps its own findings' order.
    let order: Vec<&str> = evidence.hosts.iter().map(|h| h.name.as_str()).collect();
    findings.sort_by_key(|f| match f.host.as_deref() {
        Some(host) => order.iter().position(|h| *h == host).unwrap_or(order.len()),
        None => order.len() + 1,
    });
    let mut report = Report::new(findings);
    report.matrix = evidence.matrix;
    report.allreduce = evidence.allreduce;
    report.engine = evidence.engine;
    report
}

/// The report of `--run RUN`: the run's outcome, and the NCCL checks over the ranks' logs
/// that hold NCCL output.
pub(crate) fn postmortem(evidence: &RunEvidence) -> Report {
    let mut findings = checks::run_outcome::check(evidence);
    let logs: Vec<NcclLog> = evidence
        .ranks
        .iter()
        .map(|r| nccl_log::parse(&r.log, &r.log_path))
        .filter(|log| log.nccl_lines > 0)
        .collect();
    if !logs.is_empty() {
        findings.extend(checks::nccl_logs(&logs, None));
    }
    Report::new(findings)
}

/// Reads and parses every `--nccl-log` (decoded lossily), refusing a set of which none
/// holds NCCL output.
///
/// Errors: an unreadable file, no NCCL output in any of them.
pub(crate) fn read_logs(paths: &[PathBuf]) -> Result<Vec<NcclLog>> {
    let mut logs = Vec::with_capacity(paths.len());
    for path in paths {
        let bytes = std::fs::read(path)
            .with_context(|| format!("failed to read NCCL log `{}`", path.display()))?;
        logs.push(nccl_log::parse(
            &nccl_log::decode(&bytes),
            &path.display().to_string(),
        ));
    }
    if !logs.is_empty() && logs.iter().all(|log| log.nccl_lines == 0) {
        // Bad input: nothing could be checked.
        let names: Vec<String> = logs.iter().map(|l| format!("`{}`", l.origin)).collect();
        bail!(
            "no NCCL output in {}: nothing to check\nhint: {}",
            names.join(", "),
            nccl_output::HINT
        );
    }
    Ok(logs)
}

/// Reads a recorded topology (`--topology`), named by its file name.
///
/// Errors: an unreadable file, a malformed topology.
pub(crate) fn read_topology(path: &Path) -> Result<Topology> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read topology `{}`", path.display()))?;
    let origin = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Topology::import(&text, &origin)
}

/// Reads a saved plan (`--plan`, `infer plan --json`'s output).
///
/// Errors: an unreadable file, or one that is not a plan.
pub(crate) fn read_plan(path: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read plan `{}`", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not `infer plan --json` output", path.display()))
}
