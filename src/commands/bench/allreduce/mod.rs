//! `infer bench allreduce`: all-reduce bandwidth of worker processes on this host (TCP ring
//! and shared memory), or of ranks over an inventory's hosts ([`crate::launch::bench`]), as
//! nccl-tests' tables and as the JSON report `infer plan --calibration` reads ([`report`]).

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::BenchAllreduceArgs;
use crate::launch::bench::{allreduce_cluster, allreduce_local};
use crate::launch::hosts::ClusterOptions;
use crate::launch::ssh::SshOptions;
use crate::ui::Printer;

mod report;

/// `infer bench allreduce`: all-reduce bandwidth of `--world` processes on this host (TCP
/// ring and shared memory), or over an inventory's hosts with `--cluster`. Errors: a world
/// under 2, a worker that fails or prints no report.
pub(super) fn allreduce(args: &BenchAllreduceArgs, printer: &Printer) -> Result<ExitStatus> {
    if args.world < 2 {
        bail!("--world must be at least 2 (a one-process all-reduce moves no data)");
    }
    if let Some(inventory) = &args.cluster {
        let options = ClusterOptions {
            inventory: inventory.to_path_buf(),
            ssh: SshOptions {
                accept_new: args.ssh.ssh_accept_new,
            },
            push_model: args.ssh.push_model,
        };
        let progress = printer.progress(2 * args.world as u64);
        let (report, hosts) =
            allreduce_cluster(args.world, args.max_bytes, &options, &mut |event| {
                super::super::report_progress(&progress, event, false)
            })?;
        progress.finish();
        if args.json {
            let json = report::cluster_json(args.world, &report, hosts);
            return printer.json(&json).map(|()| ExitStatus::Success);
        }
        printer.data(&report::cluster_text(args.world, &report, &hosts));
        return Ok(ExitStatus::Success);
    }
    let report = allreduce_local(args.world, args.max_bytes)?;
    if args.json {
        let json = report::local_json(args.world, &report);
        return printer.json(&json).map(|()| ExitStatus::Success);
    }
    printer.data(&report::local_text(args.world, &report));
    Ok(ExitStatus::Success)
}
