//! `infer plan`: load the model spec and the cluster (the I/O edge), run the pure planner,
//! print the plan or the reason it is infeasible.

use anyhow::{Result, anyhow, bail};

use crate::cli::{ObjectiveArg, PlanArgs, PlanSettingsArgs};
use crate::plan::model::Dtype;
use crate::plan::{Objective, Outcome, Settings, plan, render};
use crate::ui::Printer;
use crate::{ExitStatus, cluster, model};

/// Runs `infer plan`. Exit status `No` when no layout is feasible. Errors: bad flags, an
/// unreadable model or cluster.
pub fn run(args: &PlanArgs, printer: &Printer) -> Result<ExitStatus> {
    let settings = settings(&args.settings)?;
    // Every argument is checked before the default model is fetched (93 MB on first use).
    let cluster = cluster::load(&args.settings.cluster, &args.sysfs_root)?;
    let spec = model::spec(args.model.as_deref(), &mut |line| printer.note(line))?;
    match plan(&spec, &cluster, &settings) {
        Outcome::Feasible(plan) => {
            if args.json {
                printer.json(&plan)?;
            } else {
                printer.data(&render::render(&plan, args.explain));
            }
            Ok(ExitStatus::Success)
        }
        Outcome::Infeasible(infeasible) => {
            if args.json {
                printer.json(&infeasible)?;
            } else {
                printer.data(&render::render_infeasible(&infeasible, args.explain));
            }
            Ok(ExitStatus::No)
        }
    }
}

/// Flags → validated settings. Errors: an unknown dtype, a utilization outside (0, 1], a
/// degree or length of 0.
pub fn settings(args: &PlanSettingsArgs) -> Result<Settings> {
    let parse_dtype = |flag: &str, value: &Option<String>| -> Result<Option<Dtype>> {
        value
            .as_deref()
            .map(|v| v.parse::<Dtype>().map_err(|e| anyhow!("{flag}: {e}")))
            .transpose()
    };
    if !(args.gpu_memory_utilization > 0.0 && args.gpu_memory_utilization <= 1.0) {
        bail!(
            "--gpu-memory-utilization must be in (0, 1], got {}",
            args.gpu_memory_utilization
        );
    }
    let kv_dtype = parse_dtype("--kv-dtype", &args.kv_dtype)?;
    if let Some(kv) = kv_dtype
        && !matches!(kv, Dtype::Bf16 | Dtype::Fp16 | Dtype::Fp8)
    {
        bail!("--kv-dtype must be bf16, fp16 or fp8, got `{kv}`");
    }
    for (flag, value) in [
        ("--tp", args.tp),
        ("--pp", args.pp),
        ("--ep", args.ep),
        ("--dp", args.dp),
    ] {
        if value == Some(0) {
            bail!("{flag} must be at least 1");
        }
    }
    if args.max_model_len == Some(0) {
        bail!("--max-model-len must be at least 1");
    }
    Ok(Settings {
        objective: match args.objective {
            ObjectiveArg::Latency => Objective::Latency,
            ObjectiveArg::Throughput => Objective::Throughput,
        },
        dtype: parse_dtype("--dtype", &args.dtype)?,
        kv_dtype,
        max_model_len_tokens: args.max_model_len,
        gpu_memory_utilization: args.gpu_memory_utilization,
        tp: args.tp,
        pp: args.pp,
        ep: args.ep,
        dp: args.dp,
    })
}
