//! `infer doctor`: read the evidence (NCCL logs, a topology), run the checks, print the
//! findings; exit 1 when any is an error.

use anyhow::{Context, Result, bail};

use crate::ExitStatus;
use crate::cli::DoctorArgs;
use crate::doctor::{Report, checks, nccl_log, render};
use crate::topology::Topology;
use crate::ui::Printer;

/// Runs `infer doctor`. Errors: an unreadable log or topology, a malformed topology.
pub(crate) fn run(args: &DoctorArgs, printer: &Printer) -> Result<ExitStatus> {
    if let Some(run) = &args.run {
        return postmortem(run, args, printer);
    }
    if args.engine == Some(crate::cli::EngineArg::Infer) {
        bail!(
            "--engine infer: `infer doctor --cluster hosts.toml` checks infer itself on every host already (an agent of \
             another build is reported); leave --engine out"
        );
    }
    if args.model.is_none() && crate::inventory::is_inventory(&args.settings.cluster) {
        return cluster(args, printer);
    }
    if let Some(engine) = args.engine {
        let engine: crate::engines::EngineKind = engine.into();
        bail!(
            "--engine {engine} checks the engine on an inventory's hosts: add `--cluster hosts.toml` (without `--model`)"
        );
    }
    let logs = read_logs(&args.nccl_logs)?;
    let topology = match &args.topology {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("failed to read topology `{}`", path.display()))?;
            let origin = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            Some(Topology::import(&text, &origin)?)
        }
        None => None,
    };
    let plan: Option<crate::plan::Plan> = match &args.plan {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("failed to read plan `{}`", path.display()))?;
            Some(serde_json::from_str(&text).with_context(|| {
                format!("`{}` is not `infer plan --json` output", path.display())
            })?)
        }
        None => None,
    };
    let mut findings = checks::nccl_logs(&logs, topology.as_ref());
    if let Some(plan) = &plan {
        let this_host =
            crate::topology::probe::probe_host(&crate::topology::probe::ProbeOptions {
                sysfs_root: args.sysfs_root.clone(),
            })?;
        findings.extend(checks::plan(plan, topology.as_ref(), Some(&this_host)));
    }
    if let Some(model) = &args.model {
        findings.extend(plan_from_flags(model, args)?);
    }
    if let Some(topology) = &topology {
        findings.extend(checks::topology(topology));
    }
    if args.nccl_logs.is_empty()
        && args.topology.is_none()
        && args.plan.is_none()
        && args.model.is_none()
    {
        findings.extend(checks::live(&args.sysfs_root)?);
    }
    let report = Report::new(findings);
    print_report(&report, args.json, printer)
}

/// `--cluster hosts.toml`: every host's own live checks (through its agent), then the
/// cross-host checks and the reachability matrix; with `--nccl-log`/`--plan`, those too.
fn cluster(args: &DoctorArgs, printer: &Printer) -> Result<ExitStatus> {
    let inventory = std::path::Path::new(&args.settings.cluster);
    let ssh = crate::launch::ssh::SshOptions {
        accept_new: args.ssh_accept_new,
    };
    // Local inputs first: a bad log fails before any host is contacted.
    let logs = read_logs(&args.nccl_logs)?;
    let engine = args.engine.map(|e| (e.into(), args.engine_bin.as_deref()));
    let evidence =
        crate::launch::survey::survey(inventory, ssh, args.bandwidth, engine, &mut |_| {})?;
    let mut findings = checks::cluster(&evidence);
    findings.extend(checks::nccl_logs(&logs, None));
    if let Some(path) = &args.plan {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("failed to read plan `{}`", path.display()))?;
        let plan: crate::plan::Plan = serde_json::from_str(&text)
            .with_context(|| format!("`{}` is not `infer plan --json` output", path.display()))?;
        findings.extend(checks::cluster_plan(&plan, &evidence));
    }
    // Group by host in inventory order (cluster-wide findings last), keeping each host's
    // own order.
    let order: Vec<&str> = evidence.hosts.iter().map(|h| h.name.as_str()).collect();
    findings.sort_by_key(|f| match f.host.as_deref() {
        Some(host) => order.iter().position(|h| *h == host).unwrap_or(order.len()),
        None => order.len() + 1,
    });
    let mut report = Report::new(findings);
    report.matrix = evidence.matrix;
    report.allreduce = evidence.allreduce;
    report.engine = evidence.engine;
    print_report(&report, args.json, printer)
}

/// `--run RUN`: the post-mortem of one run (its record, its ranks' logs with the NCCL checks
/// where they hold NCCL output, the kernel's log), with `--bundle` packed for a bug report.
///
/// Errors: no such run, an unreadable manifest, a bundle that cannot be written.
fn postmortem(run: &str, args: &DoctorArgs, printer: &Printer) -> Result<ExitStatus> {
    let dir = crate::launch::postmortem::run_dir(run)?;
    let evidence = crate::launch::postmortem::gather(&dir)?;
    let mut findings = checks::run_outcome::check(&evidence);
    let logs: Vec<nccl_log::NcclLog> = evidence
        .ranks
        .iter()
        .map(|r| nccl_log::parse(&r.log, &r.log_path))
        .filter(|log| log.nccl_lines > 0)
        .collect();
    if !logs.is_empty() {
        findings.extend(checks::nccl_logs(&logs, None));
    }
    let report = Report::new(findings);
    if let Some(bundle) = &args.bundle {
        crate::launch::postmortem::bundle(&dir, &serde_json::to_value(&report)?, bundle)?;
        printer.note(&format!(
            "packed `{}` and its report into `{}`",
            dir.display(),
            bundle.display()
        ));
    }
    print_report(&report, args.json, printer)
}

/// Reads and parses every `--nccl-log` (decoded lossily), refusing a set of which none
/// holds NCCL output.
///
/// Errors: an unreadable file, no NCCL output in any of them.
fn read_logs(paths: &[std::path::PathBuf]) -> Result<Vec<nccl_log::NcclLog>> {
    let mut logs = Vec::with_capacity(paths.len());
    for path in paths {
        let bytes = std::fs::read(path)
            .with_context(|| format!("failed to read NCCL log `{}`", path.display()))?;
        logs.push(nccl_log::parse(
            &nccl_log::decode(&bytes),
            &path.display().to_string(),
        ));
    }
    no_nccl_output(&logs)?;
    Ok(logs)
}

/// Refuses logs of which none holds NCCL output (bad input: nothing could be checked).
///
/// Errors: every log given is without a line NCCL wrote.
fn no_nccl_output(logs: &[nccl_log::NcclLog]) -> Result<()> {
    if !logs.is_empty() && logs.iter().all(|log| log.nccl_lines == 0) {
        let names: Vec<String> = logs.iter().map(|l| format!("`{}`", l.origin)).collect();
        anyhow::bail!(
            "no NCCL output in {}: nothing to check\nhint: {}",
            names.join(", "),
            checks::nccl_output::HINT
        );
    }
    Ok(())
}

/// Plans `model` with the planner flags and checks the plan against the cluster's own
/// topology (or `--topology` when given). An infeasible plan is an error finding.
fn plan_from_flags(model: &str, args: &DoctorArgs) -> Result<Vec<crate::doctor::Finding>> {
    let settings = crate::commands::plan::settings(&args.settings)?;
    let spec = crate::model::load(model)?;
    let cluster = crate::inventory::load(&args.settings.cluster, &args.sysfs_root)?;
    Ok(match crate::plan::plan(&spec, &cluster, &settings) {
        crate::plan::Outcome::Feasible(plan) => {
            let cluster_topology = Topology {
                hosts: cluster.hosts.iter().map(|h| h.topology.clone()).collect(),
            };
            let mut findings = checks::plan(&plan, Some(&cluster_topology), None);
            findings.extend(plan.warnings.iter().map(|warning| crate::doctor::Finding {
                check: "plan",
                severity: crate::doctor::Severity::Warn,
                host: None,
                message: warning.clone(),
                evidence: vec![format!(
                    "infer plan --model {model} --cluster {}: {}",
                    args.settings.cluster, plan.parallel
                )],
                hint: String::new(),
            }));
            findings
        }
        crate::plan::Outcome::Infeasible(infeasible) => vec![crate::doctor::Finding {
            check: "plan",
            severity: crate::doctor::Severity::Error,
            host: None,
            message: infeasible.message.clone(),
            evidence: Vec::new(),
            hint: infeasible.hint.clone(),
        }],
    })
}

/// Prints the report (table or `--json`); exit 1 when any finding is an error.
fn print_report(report: &Report, json: bool, printer: &Printer) -> Result<ExitStatus> {
    if json {
        printer.json(report)?;
    } else {
        printer.data(&render(report));
    }
    Ok(if report.errors > 0 {
        ExitStatus::No
    } else {
        ExitStatus::Success
    })
}
