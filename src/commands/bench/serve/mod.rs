//! `infer bench serve`: the flags checked once into a [`ServeBench`], the load generator
//! ([`crate::serve::bench`]) run, its report printed. With `--plan`: the plan's layout,
//! model and traffic as the benchmark, and its predictions next to the measurements
//! ([`plan`]).

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::{BenchServeArgs, Workload};
use crate::degrees::Degrees;
use crate::serve::bench::{self, DummyLoad, ServeBench};
use crate::ui::Printer;

mod plan;
mod plan_model;
mod report;

/// Concurrencies measured without `--concurrency` or `--plan`.
const DEFAULT_CONCURRENCY: [usize; 3] = [1, 4, 16];

/// Runs `infer bench serve`. Errors: a value of 0 where at least 1 is needed (named), a plan
/// that cannot be read or run here, the server does not start, a request fails.
pub(crate) fn run(args: &BenchServeArgs, printer: &Printer) -> Result<ExitStatus> {
    if let Some(path) = &args.plan {
        return plan::check_plan(args, path, printer);
    }
    let report = bench::run(&settings(args)?)?;
    printer.data(&report.rows.join("\n"));
    Ok(ExitStatus::Success)
}

/// The benchmark the flags ask for. Errors: a concurrency, `--rounds`, `--repeat`, `--tp`
/// or `--pp` of 0.
fn settings(args: &BenchServeArgs) -> Result<ServeBench> {
    let concurrency = args
        .concurrency
        .clone()
        .unwrap_or_else(|| DEFAULT_CONCURRENCY.to_vec());
    if concurrency.contains(&0) {
        bail!("--concurrency values must be at least 1");
    }
    Ok(ServeBench {
        concurrency,
        degrees: args.stages.degrees()?,
        ..common_settings(args)?
    })
}

/// The settings `--plan` does not change, with 1 concurrency and the degrees 1. Errors: a
/// `--rounds`, `--repeat`, `--tp` or `--pp` of 0.
pub(super) fn common_settings(args: &BenchServeArgs) -> Result<ServeBench> {
    for (flag, value) in [
        ("--rounds", Some(args.rounds)),
        ("--repeat", Some(args.repeat)),
        ("--tp", args.stages.tp),
        ("--pp", args.stages.pp),
    ] {
        if value == Some(0) {
            bail!("{flag} must be at least 1");
        }
    }
    let dummy = args
        .load
        .dummy()?
        .map(|(dtype, num_layers)| DummyLoad { dtype, num_layers });
    if dummy.is_some() && args.model.is_none() && args.plan.is_none() {
        bail!(
            "--load-format dummy needs --model (a profile name such as `llama-3.1-8b`, a `config.json` directory or a GGUF file) or --plan, whose shape the random weights take"
        );
    }
    Ok(ServeBench {
        model: args.model.clone(),
        concurrency: vec![1],
        max_tokens: args.max_tokens,
        rounds: args.rounds,
        repeat: args.repeat,
        threads: args.threads,
        numerics: args.numerics.into(),
        degrees: Degrees::ONE,
        workload: match args.workload {
            Workload::Chat => bench::Workload::Chat,
            Workload::Mixed => bench::Workload::Mixed,
            Workload::SharedPrefix => bench::Workload::SharedPrefix,
        },
        max_num_batched_tokens: args.max_num_batched_tokens,
        no_prefix_cache: args.no_prefix_cache,
        prefill_decode: args.prefill.zip(args.decode),
        ignore_eos: false,
        dummy,
        request_secs: Vec::new(),
    })
}
