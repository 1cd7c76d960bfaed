//! `infer plan`'s (and `infer doctor`'s) planning flags checked once into
//! [`crate::plan::Settings`]: dtypes, context, GPU memory fraction, pinned degrees, the
//! workload and its latency targets.

use anyhow::{Result, anyhow, bail};

use crate::cli::{ObjectiveArg, PlanSettingsArgs};
use crate::plan::model::Dtype;
use crate::plan::{Objective, Settings};

/// Flags → validated settings. Errors: an unknown dtype, a utilization outside (0, 1], a
/// degree or length of 0.
pub(crate) fn settings(args: &PlanSettingsArgs) -> Result<Settings> {
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
    for (flag, value) in args.degrees.pins().named() {
        if value == Some(0) {
            bail!("{flag} must be at least 1");
        }
    }
    if args.max_model_len == Some(0) {
        bail!("--max-model-len must be at least 1");
    }
    if args.isl == 0 || args.osl == 0 {
        bail!(
            "--isl and --osl must be at least 1 token, got {} and {}",
            args.isl,
            args.osl
        );
    }
    let target = |flag: &str, ms: Option<f64>| -> Result<Option<f64>> {
        match ms {
            Some(ms) if !(ms.is_finite() && ms > 0.0) => {
                bail!("{flag} must be a positive number of milliseconds, got {ms}")
            }
            Some(ms) => Ok(Some(ms / 1e3)),
            None => Ok(None),
        }
    };
    Ok(Settings {
        objective: match args.objective {
            ObjectiveArg::Latency => Objective::Latency,
            ObjectiveArg::Throughput => Objective::Throughput,
            ObjectiveArg::Cost => Objective::Cost,
        },
        dtype: parse_dtype("--dtype", &args.dtype)?,
        kv_dtype,
        max_model_len_tokens: args.max_model_len,
        gpu_memory_utilization: args.gpu_memory_utilization,
        pins: args.degrees.pins(),
        workload: crate::plan::sla::Workload {
            isl_tokens: args.isl,
            osl_tokens: args.osl,
            ttft_target_secs: target("--ttft-ms", args.ttft_ms)?,
            tpot_target_secs: target("--tpot-ms", args.tpot_ms)?,
            requests_per_sec: match args.rps {
                Some(r) if !(r.is_finite() && r > 0.0) => {
                    bail!("--rps must be a positive number of requests per second, got {r}")
                }
                rps => rps,
            },
        },
        disaggregate: args.disaggregate,
    })
}
