//! `infer doctor`: read the evidence (NCCL logs, a topology), run the checks, print the
//! findings; exit 1 when any is an error.

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::DoctorArgs;
use crate::doctor::{Report, gather, render};
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
        let engine: crate::serving_engines::EngineKind = engine.into();
        bail!(
            "--engine {engine} checks the engine on an inventory's hosts: add `--cluster hosts.toml` (without `--model`)"
        );
    }
    let logs = gather::read_logs(&args.nccl_logs)?;
    let topology = args
        .topology
        .as_deref()
        .map(gather::read_topology)
        .transpose()?;
    let plan = args.plan.as_deref().map(gather::read_plan).transpose()?;
    let offline = gather::Offline {
        logs: &logs,
        topology: topology.as_ref(),
        plan: plan.as_ref(),
        sysfs_root: &args.sysfs_root,
    };
    // `--model`: the plan made with the planner flags, checked too.
    let planned = args
        .model
        .as_deref()
        .map(|model| move || plan_from_flags(model, args));
    let findings = gather::offline(&offline, planned)?;
    print_report(&Report::new(findings), args.json, printer)
}

/// `--cluster hosts.toml`: every host's own live checks (through its agent), then the
/// cross-host checks and the reachability matrix; with `--nccl-log`/`--plan`, those too.
fn cluster(args: &DoctorArgs, printer: &Printer) -> Result<ExitStatus> {
    let inventory = std::path::Path::new(&args.settings.cluster);
    let ssh = crate::launch::ssh::SshOptions {
        accept_new: args.ssh_accept_new,
    };
    // Local inputs first: a bad log fails before any host is contacted.
    let logs = gather::read_logs(&args.nccl_logs)?;
    let engine = args.engine.map(|e| (e.into(), args.engine_bin.as_deref()));
    let evidence =
        crate::launch::survey::survey(inventory, ssh, args.bandwidth, engine, &mut |_| {})?;
    let plan = args.plan.as_deref().map(gather::read_plan).transpose()?;
    let report = gather::cluster(evidence, &logs, plan.as_ref());
    print_report(&report, args.json, printer)
}

/// `--run RUN`: the post-mortem of one run (its record, its ranks' logs with the NCCL checks
/// where they hold NCCL output, the kernel's log), with `--bundle` packed for a bug report.
///
/// Errors: no such run, an unreadable manifest, a bundle that cannot be written.
fn postmortem(run: &str, args: &DoctorArgs, printer: &Printer) -> Result<ExitStatus> {
    let dir = crate::launch::postmortem::run_dir(run)?;
    let evidence = crate::launch::postmortem::gather(&dir)?;
    let report = gather::postmortem(&evidence);
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

/// Plans `model` with the planner flags and checks the plan against the cluster's own
/// topology (or `--topology` when given). An infeasible plan is an error finding.
fn plan_from_flags(model: &str, args: &DoctorArgs) -> Result<Vec<crate::doctor::Finding>> {
    let settings = crate::commands::plan::settings(&args.settings)?;
    let spec = crate::model::load(model)?;
    let cluster = crate::inventory::load(&args.settings.cluster, &args.sysfs_root)?;
    let outcome = crate::plan::plan(&spec, &cluster, &settings);
    let command = format!(
        "infer plan --model {model} --cluster {}",
        args.settings.cluster
    );
    Ok(gather::planned(&outcome, &cluster, &command))
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
