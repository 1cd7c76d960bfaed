//! `infer bench serve`: the flags checked once into a [`ServeBench`], the load generator
//! run, its report printed.

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::{BenchServeArgs, Workload};
use crate::degrees::Degrees;
use crate::serve::bench::{self, ServeBench};
use crate::ui::Printer;

/// Runs `infer bench serve`. Errors: a value of 0 where at least 1 is needed (named), the
/// server does not start, a request fails.
pub(crate) fn run(args: &BenchServeArgs, printer: &Printer) -> Result<ExitStatus> {
    let rows = bench::run(&settings(args)?)?;
    printer.data(&rows.join("\n"));
    Ok(ExitStatus::Success)
}

/// The benchmark the flags ask for. Errors: a concurrency, `--rounds`, `--repeat`, `--tp`
/// or `--pp` of 0.
fn settings(args: &BenchServeArgs) -> Result<ServeBench> {
    if args.concurrency.contains(&0) {
        bail!("--concurrency values must be at least 1");
    }
    for (flag, value) in [
        ("--rounds", args.rounds),
        ("--repeat", args.repeat),
        ("--tp", args.tp),
        ("--pp", args.pp),
    ] {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    Ok(ServeBench {
        model: args.model.clone(),
        concurrency: args.concurrency.clone(),
        max_tokens: args.max_tokens,
        rounds: args.rounds,
        repeat: args.repeat,
        threads: args.threads,
        numerics: args.numerics.into(),
        degrees: Degrees {
            tp: args.tp,
            pp: args.pp,
            ..Degrees::ONE
        },
        workload: match args.workload {
            Workload::Chat => bench::Workload::Chat,
            Workload::Mixed => bench::Workload::Mixed,
            Workload::SharedPrefix => bench::Workload::SharedPrefix,
        },
        max_num_batched_tokens: args.max_num_batched_tokens,
        no_prefix_cache: args.no_prefix_cache,
        prefill_decode: args.prefill.zip(args.decode),
    })
}
