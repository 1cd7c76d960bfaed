//! `infer bench`: measurements that print figures: `decode` ([`decode`]), `allreduce`
//! ([`allreduce`]) and its worker processes, `serve` ([`serve`]).

use anyhow::Result;

use crate::ExitStatus;
use crate::cli::{BenchAllreduceWorkerArgs, BenchCommand};
use crate::runtime::collectives::bench::local_worker;
use crate::ui::Printer;

mod allreduce;
mod decode;
mod serve;

/// Runs an `infer bench` subcommand.
pub(crate) fn run(command: &BenchCommand, printer: &Printer) -> Result<ExitStatus> {
    match command {
        BenchCommand::Decode(args) => decode::decode(args, printer),
        BenchCommand::Allreduce(args) => allreduce::allreduce(args, printer),
        BenchCommand::Serve(args) => serve::run(args, printer),
        BenchCommand::AllreduceWorker(args) => allreduce_worker(args, printer),
    }
}

/// `infer bench allreduce-worker`: one process of the local bench; rank 0 prints the
/// report as JSON. Errors: no run keys, the store or a peer unreachable, a collective fails.
fn allreduce_worker(args: &BenchAllreduceWorkerArgs, printer: &Printer) -> Result<ExitStatus> {
    let keys =
        crate::runtime::exec::rank_env::run_keys(&crate::runtime::exec::rank_env::process_env)?;
    crate::runtime::exec::rank_env::forget_secrets();
    let shm_disable = std::env::var(crate::envvars::SHM_DISABLE).is_ok_and(|v| v == "1");
    let report = local_worker(
        &args.store,
        &keys,
        args.rank,
        args.world,
        args.max_bytes,
        shm_disable,
    )?;
    if let Some(report) = report {
        printer.data(&serde_json::to_string(&report)?);
    }
    Ok(ExitStatus::Success)
}
