//! `infer bench serve --plan`: the plan's layout, model and traffic as the benchmark, and
//! its predictions next to the measurements ([`accuracy`]).

use std::path::Path;

use super::common_settings;
use super::plan_model::plan_model;
use super::report::{PlanCheck, table};
use crate::ExitStatus;
use crate::cli::BenchServeArgs;
use crate::degrees::Degrees;
use crate::plan::Plan;
use crate::plan::accuracy::{self, Measurement, Prediction, Row};
use crate::serve::bench::{self, ServeBench};
use crate::ui::Printer;
use anyhow::{Context, Result, bail};

/// `--plan`: benchmarks the plan's layout at each batch it predicts and prints predicted,
/// measured and the relative error of each metric. Errors: the plan cannot be read, its
/// layout cannot run here or conflicts with `--tp`/`--pp`, no batch is left to measure.
pub(super) fn check_plan(
    args: &BenchServeArgs,
    path: &Path,
    printer: &Printer,
) -> Result<ExitStatus> {
    let plan = read_plan(path)?;
    let (settings, predictions) = plan_settings(args, &plan)?;
    let report = bench::run(&settings)?;
    let rows: Vec<Row> = predictions
        .iter()
        .zip(&report.points)
        .flat_map(|(prediction, point)| {
            accuracy::compare(
                prediction,
                &Measurement {
                    ttft_p50_secs: point.ttft_p50_secs,
                    tpot_p50_secs: point.tpot_p50_secs,
                    tokens_per_sec: point.tokens_per_sec,
                },
            )
        })
        .collect();
    let check = PlanCheck {
        model: &plan.model,
        layout: plan.parallel,
        predicted_for: &plan.cluster,
        measured_on: format!(
            "this host: {} CPU rank process{} ({} cores)",
            plan.parallel.world_size(),
            if plan.parallel.world_size() == 1 {
                ""
            } else {
                "es"
            },
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        isl_tokens: plan.workload.isl_tokens,
        osl_tokens: plan.workload.osl_tokens,
        rows,
    };
    if args.json {
        printer.json(&check)?;
    } else {
        printer.data(&report.rows.join("\n"));
        printer.data(&table(&check));
    }
    Ok(ExitStatus::Success)
}

/// Reads `infer plan --json`'s output. Errors: the file cannot be read, or is not a plan
/// (an infeasible plan's JSON is not).
fn read_plan(path: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read the plan `{}`", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "`{}` is not a plan written by `infer plan --json`",
            path.display()
        )
    })
}

/// The benchmark of `plan`: its model, its layout, its traffic (`isl`-token prompts,
/// `osl` tokens each with `ignore_eos`, prefix cache off since the planner does not model
/// one) at the concurrencies of [`accuracy::predictions`], with those predictions in the
/// same order. Errors: the layout cannot run here, `--tp`/`--pp` differ from the plan's,
/// the model is not a file here, `--concurrency` keeps none of the plan's batches.
fn plan_settings(args: &BenchServeArgs, plan: &Plan) -> Result<(ServeBench, Vec<Prediction>)> {
    if let Some(reason) = accuracy::unrunnable_here(plan) {
        bail!(
            "cannot measure the plan's layout {} here: {reason}",
            plan.parallel
        );
    }
    let degrees = plan.parallel;
    for (flag, given, planned) in [
        ("--tp", args.stages.tp, degrees.tp),
        ("--pp", args.stages.pp, degrees.pp),
    ] {
        if given.is_some_and(|given| given != planned) {
            bail!(
                "{flag} {} conflicts with the plan's layout {}: leave {flag} out with --plan",
                given.unwrap_or_default(),
                plan.parallel
            );
        }
    }
    let common = common_settings(args)?;
    let (model, dummy) = plan_model(args, plan, common.dummy)?;
    let mut predictions = accuracy::predictions(plan);
    if predictions.is_empty() {
        bail!(
            "the plan predicts no batch for its own layout {} (none of its `pareto` points has it)",
            plan.parallel
        );
    }
    let planned: Vec<u64> = predictions.iter().map(|p| p.concurrency).collect();
    if let Some(kept) = &args.concurrency {
        predictions.retain(|p| kept.contains(&(p.concurrency as usize)));
        if predictions.is_empty() {
            bail!(
                "--concurrency keeps none of the plan's concurrencies ({})",
                planned
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let isl_tokens = plan.workload.isl_tokens.max(1) as usize;
    let settings = ServeBench {
        model: Some(model),
        dummy,
        concurrency: predictions.iter().map(|p| p.concurrency as usize).collect(),
        max_tokens: plan.workload.osl_tokens.max(1) as usize,
        workload: bench::Workload::Tokens(isl_tokens),
        no_prefix_cache: true,
        prefill_decode: None,
        ignore_eos: true,
        degrees: Degrees { ep: 1, ..degrees },
        // The plan predicts a steady state: each request arriving while the others decode.
        request_secs: predictions
            .iter()
            .map(|p| {
                let osl = plan.workload.osl_tokens.max(1) as f64;
                p.ttft_secs + (osl - 1.0) * p.tpot_secs
            })
            .collect(),
        ..common
    };
    Ok((settings, predictions))
}
