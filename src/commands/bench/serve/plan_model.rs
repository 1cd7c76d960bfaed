//! The model `infer bench serve --plan` serves: the plan's own file, or random weights of its
//! shape in the type nearest its dtype.

use std::path::Path;

use crate::cli::BenchServeArgs;
use crate::plan::Plan;
use crate::plan::model::Dtype;
use crate::runtime::model::dummy::DummyDtype;
use crate::serve::bench::DummyLoad;
use anyhow::{Result, bail};

/// The model the bench serves for `plan` and how it loads: the plan's own file or
/// directory, or with `--load-format dummy` random weights of the plan's model (its file,
/// else its profile name) in `--dtype` or the weight type nearest the plan's dtype
/// ([`dummy_dtype_of`]), with every layer.
///
/// Errors: the plan's model is not a file here and no `--load-format dummy`; `--num-layers`
/// (the plan is for the whole model); a plan dtype without a random-weight type.
pub(super) fn plan_model(
    args: &BenchServeArgs,
    plan: &Plan,
    dummy: Option<DummyLoad>,
) -> Result<(String, Option<DummyLoad>)> {
    let on_disk = Path::new(&plan.serve_id).exists();
    let Some(dummy) = dummy else {
        if !on_disk {
            bail!(
                "the plan's model `{}` is not a file or directory here: the bench serves local \
                 GGUF files and model directories\nhint: add --load-format dummy to serve random \
                 weights of its shape",
                plan.serve_id
            );
        }
        return Ok((plan.serve_id.clone(), None));
    };
    if dummy.num_layers.is_some() {
        bail!(
            "--num-layers cuts the model the plan is for: leave it out with --plan (plan a \
             smaller model instead)"
        );
    }
    let dtype = match args.load.dtype {
        Some(dtype) => dtype.into(),
        None => dummy_dtype_of(plan.dtype)?,
    };
    let model = if on_disk {
        plan.serve_id.clone()
    } else {
        plan.model.clone()
    };
    Ok((
        model,
        Some(DummyLoad {
            dtype,
            num_layers: None,
        }),
    ))
}

/// The random-weight type nearest a plan's dtype: bf16, fp16, Q4_0 and Q8_0 as they are
/// (a plan for CPU ranks is in Q4_0 or Q8_0, as the CPU engine runs int4 and int8), int8
/// as Q8_0 and int4 as Q4_0 (GGUF's blocks of 32 carry 6% more bytes than a GPU plan's
/// count of int8, and of int4 with group-128 scales, and the LM head is in it too).
///
/// Errors: fp8, MXFP4 and GGUF plans (no such random type; `--dtype` chooses one).
fn dummy_dtype_of(dtype: Dtype) -> Result<DummyDtype> {
    Ok(match dtype {
        Dtype::Bf16 => DummyDtype::Bf16,
        Dtype::Fp16 => DummyDtype::F16,
        Dtype::Int8 | Dtype::Q8_0 => DummyDtype::Q8_0,
        Dtype::Int4 | Dtype::Q4_0 => DummyDtype::Q4_0,
        Dtype::Fp8 | Dtype::Mxfp4 | Dtype::Gguf => bail!(
            "the plan's dtype `{dtype}` has no random-weight type: give --dtype (q4_0, q8_0, q4_k, f16 or bf16)"
        ),
    })
}
