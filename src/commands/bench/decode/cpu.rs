//! `infer bench decode`'s reports of a CPU run: the text lines, or the JSON report
//! `infer plan --calibration` reads.

use crate::cli::BenchDecodeArgs;
use crate::plan::calibration::DecodeReport;
use crate::plan::cost::{prefill_attention_flops, prefill_flops};
use crate::plan::model::ModelSpec;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::bench::{self, CpuDecodeSpeed};
use crate::runtime::exec::engine::Engine;

/// The text report: model, threads, numerics, the best prefill and decode tokens/s, and
/// the peak RSS (`peak_rss_bytes`, shown in MB).
pub(super) fn text(
    args: &BenchDecodeArgs,
    engine: &Engine,
    prompt_tokens: usize,
    speed: CpuDecodeSpeed,
    peak_rss_bytes: u64,
) -> String {
    let (best_prefill, best_decode) = (speed.prefill_tokens_per_sec, speed.decode_tokens_per_sec);
    format!(
        "model       {}\nthreads     {}\nnumerics    {}\nprefill     {best_prefill:.1} tok/s ({} prompt tokens, best of {})\ndecode      {best_decode:.1} tok/s (batch {}, {} tokens each after the prompt, best of {})\npeak RSS    {:.1} MB",
        engine.name,
        engine.threads(),
        Numerics::from(args.numerics).name(),
        prompt_tokens,
        args.runs.max(1),
        args.batch.max(1),
        args.decode_tokens,
        args.runs.max(1),
        peak_rss_bytes as f64 / 1e6
    )
}

/// The model's own attention rates on this CPU, flops/s, where measured: a prompt's
/// (`runtime::exec::bench::engine_prefill_attention_flops_per_sec`) and a decode step's
/// (`runtime::exec::bench::engine_decode_attention_rate`, one sequence).
pub(super) struct AttentionRates {
    pub prefill_flops_per_sec: Option<f64>,
    pub decode_flops_per_sec: Option<f64>,
    /// The prompt rate's share one thread computes while every thread runs one
    /// (`runtime::exec::bench::engine_prompt_run`).
    pub one_thread_share: Option<f64>,
}

/// The JSON report from the best tokens/s, the model's `attention` rates and the peak RSS
/// in bytes; with the model's `spec`, the prefill's compute rate and its attention's
/// arithmetic by the planner's count.
pub(super) fn json(
    args: &BenchDecodeArgs,
    engine: &Engine,
    spec: Option<ModelSpec>,
    prompt_tokens: usize,
    speed: CpuDecodeSpeed,
    attention: AttentionRates,
    peak_rss_bytes: u64,
) -> DecodeReport {
    let (best_prefill, best_decode) = (speed.prefill_tokens_per_sec, speed.decode_tokens_per_sec);
    let batch = args.batch.max(1);
    let decode_step_secs = batch as f64 / best_decode;
    let decode_weight_bytes = engine.model.decode_weight_bytes() as u64;
    let prefill_flops_per_sec = spec.as_ref().map(|spec| {
        prefill_flops(spec, prompt_tokens as u64) * best_prefill / prompt_tokens.max(1) as f64
    });
    let prefill_attention_flops = spec
        .as_ref()
        .map(|spec| prefill_attention_flops(spec, prompt_tokens as u64));
    DecodeReport {
        bench: "decode".into(),
        model: model_file_name(engine),
        device: "cpu".into(),
        device_name: bench::cpu_name(),
        threads: engine.threads(),
        numerics: Numerics::from(args.numerics).name().into(),
        batch,
        prompt_tokens,
        decode_tokens: args.decode_tokens,
        prefill_tokens_per_sec: best_prefill,
        prefill_flops_per_sec,
        prefill_attention_flops,
        prefill_attention_flops_per_sec: attention.prefill_flops_per_sec,
        decode_tokens_per_sec: best_decode,
        decode_step_secs,
        decode_weight_bytes,
        weight_bytes_per_sec: decode_weight_bytes as f64 / decode_step_secs,
        decode_attention_flops: Some(
            (batch
                * (prompt_tokens + args.decode_tokens / 2)
                * engine.model.attention_flops_per_token()) as u64,
        ),
        kv_heads: Some(engine.model.config.n_kv_heads),
        decode_attention_flops_per_sec: attention.decode_flops_per_sec,
        prefill_one_thread_share: attention.one_thread_share,
        peak_rss_bytes,
        gpu_memory_used_bytes: None,
        hbm_bytes_per_sec: None,
        batches: Vec::new(),
    }
}

/// The model file's name (what a decode report names), else the engine's name.
pub(super) fn model_file_name(engine: &Engine) -> String {
    std::path::Path::new(&engine.name)
        .file_name()
        .map_or_else(|| engine.name.clone(), |n| n.to_string_lossy().into_owned())
}
