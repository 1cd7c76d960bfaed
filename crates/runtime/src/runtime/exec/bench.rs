//! What `infer bench decode` measures, without its report: the engine's prefill and decode
//! speed on this host's CPU or on a device. (`infer bench allreduce` measures with
//! [`crate::runtime::collectives::bench`].)

use std::time::Instant;

use anyhow::{Context, Result};

use super::engine::Engine;
use super::forward::{BackendModel, DecodeSpeed};
use super::kernel_executor::model_on;
use crate::runtime::backend::Backend;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::cuda::device::Gpu;
use crate::runtime::cuda::gpu::GpuRunner;
use crate::runtime::model::dummy::{DummyDtype, DummyModel};
use crate::runtime::model::kv::{KvCache, KvTransfer};
use crate::runtime::model::llama::{Llama, SequenceInput};
use crate::runtime::model::sampling::argmax;
use crate::runtime::model::source::ModelSource;

/// A prompt of ordinary text, `prompt_tokens` long (at least one token).
///
/// Errors: the tokenizer fails.
pub fn prompt(engine: &Engine, prompt_tokens: usize) -> Result<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog while the engine measures its speed. "
        .repeat(64);
    let mut prompt = engine.tokenizer.encode(&text, false)?;
    prompt.truncate(prompt_tokens.max(1));
    Ok(prompt)
}

/// The best prefill and decode speed of the CPU engine over the timed runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuDecodeSpeed {
    /// Prompt tokens per second of one sequence's prefill.
    pub prefill_tokens_per_sec: f64,
    /// Tokens per second over the whole batch.
    pub decode_tokens_per_sec: f64,
}

/// Prefills `prompt` and decodes `decode_tokens` at `batch` (at least 1) sequences, `runs`
/// times (at least once) after one untimed warm-up run (caches, page faults), on the
/// engine's own thread pool; the best of each figure.
///
/// Errors: a forward pass fails.
pub fn cpu_decode(
    engine: &Engine,
    prompt: &[u32],
    batch: usize,
    decode_tokens: usize,
    runs: usize,
) -> Result<CpuDecodeSpeed> {
    let mut best = CpuDecodeSpeed {
        prefill_tokens_per_sec: 0.0,
        decode_tokens_per_sec: 0.0,
    };
    for run in 0..=runs.max(1) {
        let speed =
            engine.install(|| cpu_decode_run(engine, prompt, batch.max(1), decode_tokens))?;
        if run > 0 {
            best.prefill_tokens_per_sec = best
                .prefill_tokens_per_sec
                .max(speed.prefill_tokens_per_sec);
            best.decode_tokens_per_sec =
                best.decode_tokens_per_sec.max(speed.decode_tokens_per_sec);
        }
    }
    Ok(best)
}

/// One timed CPU run: prefills `prompt`, then decodes `decode_tokens` at `batch`.
///
/// Errors: a forward pass fails.
fn cpu_decode_run(
    engine: &Engine,
    prompt: &[u32],
    batch: usize,
    decode_tokens: usize,
) -> Result<CpuDecodeSpeed> {
    let mut cache = engine.model.new_cache();
    let start = Instant::now();
    let logits = engine.model.forward(&mut [SequenceInput {
        tokens: prompt,
        cache: &mut cache,
        all_logits: false,
    }])?;
    let prefill_tokens_per_sec = prompt.len() as f64 / start.elapsed().as_secs_f64();
    // The other sequences of the batch are prefilled with the same prompt, untimed.
    let mut caches = vec![cache];
    for _ in 1..batch {
        let mut cache = engine.model.new_cache();
        engine.model.forward(&mut [SequenceInput {
            tokens: prompt,
            cache: &mut cache,
            all_logits: false,
        }])?;
        caches.push(cache);
    }
    let mut next = vec![argmax(&logits[0]); batch];
    let decode_secs = timed_decode_steps(engine, &mut caches, &mut next, decode_tokens)?;
    Ok(CpuDecodeSpeed {
        prefill_tokens_per_sec,
        decode_tokens_per_sec: (batch * decode_tokens) as f64 / decode_secs,
    })
}

/// Decodes `steps` greedy tokens for every sequence of `caches`, starting from `next` (one
/// token per cache, the last token of each on return); the seconds it took.
///
/// Errors: a forward pass fails.
fn timed_decode_steps(
    engine: &Engine,
    caches: &mut [KvCache],
    next: &mut [u32],
    steps: usize,
) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..steps {
        let mut inputs: Vec<SequenceInput> = caches
            .iter_mut()
            .zip(next.iter())
            .map(|(cache, token)| SequenceInput {
                tokens: std::slice::from_ref(token),
                cache,
                all_logits: false,
            })
            .collect();
        let logits = engine.model.forward(&mut inputs)?;
        for (token, logits) in next.iter_mut().zip(&logits) {
            *token = argmax(logits);
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// The best timed run (by decode tokens/s) at each of `batches`, in their order: `runs`
/// timed runs (at least one) after one warm-up run (module loads, first allocations) of
/// [`super::forward::bench_decode`] on `device`.
///
/// Errors: a step fails on the device.
pub(crate) fn device_decode<B: Backend>(
    device: &mut BackendModel<B>,
    prompt: &[u32],
    batches: &[usize],
    decode_tokens: usize,
    runs: usize,
) -> Result<Vec<(usize, DecodeSpeed)>> {
    let mut rows = Vec::new();
    for &batch in batches {
        let mut best: Option<DecodeSpeed> = None;
        for run in 0..=runs.max(1) {
            let speed = super::forward::bench_decode(device, prompt, batch, decode_tokens)?;
            if run > 0 && best.is_none_or(|b| speed.decode_tokens_per_sec > b.decode_tokens_per_sec)
            {
                best = Some(speed);
            }
        }
        rows.push((batch, best.context("no timed run")?));
    }
    Ok(rows)
}

/// What [`cuda_decode`] measured on one GPU.
pub struct CudaDecode {
    /// The best timed run at each batch, smallest batch first.
    pub rows: Vec<(usize, DecodeSpeed)>,
    /// Weight bytes a decode step reads.
    pub weight_bytes: u64,
    /// GPU memory in use after the runs, bytes.
    pub memory_used_bytes: u64,
    /// GPU time per kernel over every run (name, launches, milliseconds), when
    /// [`crate::envvars::CUDA_PROFILE`] asked for it; `None` otherwise.
    pub kernel_profile: Option<Vec<(String, u64, f64)>>,
}

/// `infer bench decode --device cuda`'s measurement: `engine`'s model on the opened GPU
/// (`runner`, `gpu`), then [`device_decode`] at each of `batches` (smallest first).
/// `gemm_note` hears, before the runs, whether prefill's products run on cuBLAS.
///
/// Errors: the model does not fit on the GPU, a step fails, the memory in use or the
/// profile cannot be read.
pub fn cuda_decode(
    engine: &Engine,
    (runner, gpu): (GpuRunner, Gpu),
    prompt: &[u32],
    batches: &[usize],
    (decode_tokens, runs): (usize, usize),
    gemm_note: &mut dyn FnMut(&str),
) -> Result<CudaDecode> {
    let largest = batches.iter().copied().max().unwrap_or(1);
    let mut device = model_on(
        runner,
        &gpu,
        &engine.model,
        largest * (prompt.len() + decode_tokens + 16),
    )?;
    gemm_note(device.backend().device.gemm_line());
    let rows = device_decode(&mut device, prompt, batches, decode_tokens, runs)?;
    Ok(CudaDecode {
        rows,
        weight_bytes: engine.model.decode_weight_bytes() as u64,
        memory_used_bytes: device.backend().device.memory_used_bytes()?,
        kernel_profile: device.backend().device.profile()?,
    })
}

/// [`crate::envvars::CUDA_PROFILE`]'s table for stderr: GPU time per kernel (`rows`: name,
/// launches, milliseconds) over every run.
pub fn kernel_profile_table(rows: &[(String, u64, f64)]) -> String {
    let total_ms: f64 = rows.iter().map(|r| r.2).sum();
    let mut table = vec![format!(
        "GPU time per kernel ({}), every run: {total_ms:.1} ms",
        crate::envvars::CUDA_PROFILE
    )];
    for (name, calls, ms) in rows {
        table.push(format!(
            "  {name:<32} {calls:>8} launches {ms:>10.2} ms {:>9.1} µs each {:>5.1}%",
            1e3 * ms / (*calls).max(1) as f64,
            100.0 * ms / total_ms.max(1e-9)
        ));
    }
    table.join("\n")
}

/// The shape of the random model [`engine_decode_bytes_per_sec`] decodes in `dtype`:
/// Llama-family layers of a 1–3B model (hidden 2048, 16 query and 8 KV heads of 128, as
/// Llama 3 8B–405B, Mistral and Qwen2.5 have them): in Q4_0 three layers with an MLP of 8192
/// and an LM head over 8192 tokens (116 MB of weights per step), in bf16 one layer with an
/// MLP of 4096 and a head over 4096 tokens (92 MB) — more than the private caches of most
/// CPUs, few enough that generating them takes a fraction of a second. Q4_0 stands for the
/// GGUF types, which read at similar rates (Q8_0 models at 1.0–1.3× Q4_0's on a 2-core
/// AVX-512 Xeon); bf16 products convert every weight and read at a quarter of that there.
/// The Q4_0 model holds [`ATTENTION_PROBE_CONTEXT`] tokens of context for
/// [`engine_attention_flops_per_sec`].
fn engine_probe_model(dtype: DummyDtype) -> DummyModel {
    let quantized = dtype == DummyDtype::Q4_0;
    DummyModel {
        name: "the CPU engine probe".into(),
        hidden_size: 2048,
        intermediate_size: if quantized { 8192 } else { 4096 },
        n_layers: if quantized { 3 } else { 1 },
        n_heads: 16,
        n_kv_heads: 8,
        head_dim: 128,
        vocab_size: if quantized { 8192 } else { 4096 },
        max_context_tokens: if quantized {
            ATTENTION_PROBE_CONTEXT + 64
        } else {
            256
        },
        dtype,
        seed: 0,
    }
}

/// The Q4_0 model [`engine_decode_rates`] times a decoder layer's fixed cost on: 32 tiny
/// layers (hidden 128, 2 query and 1 KV head of 64, an MLP of 384; 3.6 MB in all, which any
/// CPU's caches hold), so that a step is almost all the layers' fixed work — norms, RoPE,
/// attention, the threads' hand-offs between operations — and its bytes, read from the
/// caches, add under a microsecond a layer. Timed directly rather than as the difference of two
/// memory-bound steps, whose noise the difference would multiply. The cost is what makes
/// SmolLM2's 30 layers of 576 read at three quarters of the rate of a few wide ones (2-core
/// EPYC: a 70-layer model of hidden 512 read at 23–24 GB/s, a 16-layer one of the same
/// bytes and hidden, with a wider MLP, at 28–32, as wide models do).
fn layer_probe_model() -> DummyModel {
    DummyModel {
        name: "the CPU engine's layer probe".into(),
        hidden_size: 128,
        intermediate_size: 384,
        n_layers: 32,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 64,
        vocab_size: 256,
        max_context_tokens: 256,
        dtype: DummyDtype::Q4_0,
        seed: 0,
    }
}

/// Decode steps and timed runs (after a warm-up run; the fastest counts) of
/// [`engine_decode_bytes_per_sec`]: 3 runs of 16 steps in Q4_0 (on a shared VM, one run in
/// three or four can be 30% slow), 2 of 4 in the slower unquantized types.
fn engine_probe_steps_and_runs(dtype: DummyDtype) -> (usize, usize) {
    if dtype == DummyDtype::Q4_0 {
        (16, 3)
    } else {
        (4, 2)
    }
}

/// The CPU engine's probe model in `dtype` ([`engine_probe_model`]) on one thread per core.
///
/// Errors: the threads or the model's memory cannot be had.
fn engine_probe(dtype: DummyDtype) -> Result<Engine> {
    Engine::from_source(
        &ModelSource::Dummy(engine_probe_model(dtype)),
        0,
        Numerics::default(),
    )
    .context("cannot build the CPU engine probe's random model")
}

/// The rate at which this host's CPU engine reads the weights of `engine` (an
/// [`engine_probe`]) in a decode step, bytes/s, and the step's time in seconds: one sequence
/// decoded after a 4-token prompt, its weight bytes per step over the best of a few timed
/// runs ([`engine_probe_steps_and_runs`]). This is what `infer bench decode --json`
/// reports as `weight_bytes_per_sec` for a real model, on a shape the engine always has:
/// the kernels' rate, not the memory's peak (a host whose kernels are compute-bound reads
/// well below it). Takes 0.3–1 s.
///
/// Errors: a step fails.
fn engine_decode_bytes_per_sec(engine: &Engine, dtype: DummyDtype) -> Result<(f64, f64)> {
    let (steps, runs) = engine_probe_steps_and_runs(dtype);
    let speed = cpu_decode(engine, &[1, 2, 3, 4], 1, steps, runs)?;
    let step_secs = 1.0 / speed.decode_tokens_per_sec;
    Ok((
        engine.model.decode_weight_bytes() as f64 / step_secs,
        step_secs,
    ))
}

/// Tokens of context [`engine_attention_flops_per_sec`] decodes after: 24 MiB of the probe
/// model's KV cache, 50 MFLOP of attention per step, enough to take milliseconds on any CPU.
const ATTENTION_PROBE_CONTEXT: usize = 2048;

/// What [`engine_attention_flops_per_sec`] measured: the rate, and the parallelism it had.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionRate {
    /// The decode attention's flops per second (`4 · n_heads · head_dim` per cached
    /// position and layer).
    pub flops_per_sec: f64,
    /// Attention tasks of each layer: one per (sequence, KV head), which is how
    /// `Llama::attend` splits its work.
    pub tasks: usize,
    /// Threads they ran on.
    pub threads: usize,
}

/// The arithmetic rate of this host's CPU engine's decode attention, flops/s: one sequence
/// of `engine`'s model decoded 8 steps after up to [`ATTENTION_PROBE_CONTEXT`] tokens of
/// random keys and values (imported, as a decode replica takes a prefill's, so that no
/// prompt is computed), best of 2 runs; its extra attention flops per step
/// (`Llama::attention_flops_per_token`) over its extra time per step against
/// `short_step_secs`, the step after a 4-token prompt ([`engine_decode_bytes_per_sec`]). The
/// weights stream through the caches between one layer's reads of its cache and the next
/// step's, as in a real model. Takes 0.1–0.3 s on the planner's probe model. `None` when the
/// long context's steps came out no slower (a host too busy to measure), or the model holds
/// fewer than 256 tokens of context beside the steps.
///
/// Errors: a step fails.
fn engine_attention_flops_per_sec(
    engine: &Engine,
    short_step_secs: f64,
) -> Result<Option<AttentionRate>> {
    let model = &engine.model;
    let steps = 8;
    let context_tokens =
        ATTENTION_PROBE_CONTEXT.min(model.config.max_context_tokens.saturating_sub(2 * steps));
    if context_tokens < 256 {
        return Ok(None);
    }
    let transfer = probe_context(model, context_tokens);
    let runs = 2;
    let mut long_step_secs = f64::INFINITY;
    for run in 0..=runs {
        let secs = engine.install(|| -> Result<f64> {
            let mut cache = model.new_cache();
            cache.import(&transfer)?;
            cache.finish_import();
            let mut caches = [cache];
            Ok(timed_decode_steps(engine, &mut caches, &mut [1], steps)? / steps as f64)
        })?;
        if run > 0 {
            long_step_secs = long_step_secs.min(secs);
        }
    }
    // The short step attended to ~12 positions, the long one to `context_tokens + 4`.
    let extra_flops = (context_tokens - 8) as f64 * model.attention_flops_per_token() as f64;
    let extra_secs = long_step_secs - short_step_secs;
    Ok((extra_secs > 0.0).then(|| AttentionRate {
        flops_per_sec: extra_flops / extra_secs,
        tasks: model.config.n_kv_heads,
        threads: engine.threads(),
    }))
}

/// [`engine_attention_flops_per_sec`] of `engine`'s own model, on its threads: what `infer
/// bench decode --json` reports for a calibration, since the rate depends on the shape
/// (2-core EPYC: SmolLM2's 3 query heads of 64 per KV head at 14–15 GFLOP/s on two
/// threads, whose 3 tasks keep them 3/4 busy, so 19–20 with every thread busy; the
/// planner's probe's 2 of 128 at 13–16 with every thread busy). Its short step is the best
/// of 3 runs of 16 steps after a 4-token prompt. Takes about 0.5 s for SmolLM2.
///
/// Errors: a step fails.
pub fn engine_decode_attention_rate(engine: &Engine) -> Result<Option<AttentionRate>> {
    let speed = cpu_decode(engine, &[1, 2, 3, 4], 1, 16, 3)?;
    engine_attention_flops_per_sec(engine, 1.0 / speed.decode_tokens_per_sec)
}

/// `context_tokens` tokens of random keys and values for every layer of `model` (±0.5 at
/// most: softmax stays finite whatever the query), as a decode replica imports a prefill's.
fn probe_context(model: &Llama, context_tokens: usize) -> KvTransfer {
    let c = &model.config;
    let (n_layers, n_kv_heads, head_dim) = (model.layers.len(), c.n_kv_heads, c.head_dim);
    let values: Vec<u16> = (0..n_layers * 2 * n_kv_heads * context_tokens * head_dim)
        .map(|i| {
            let unit = (i.wrapping_mul(2_654_435_761) % 2001) as f32 / 2000.0 - 0.5;
            half::f16::from_f32(unit).to_bits()
        })
        .collect();
    KvTransfer {
        tokens: (0..context_tokens as u32).map(|t| 1 + t % 1000).collect(),
        first_position: 0,
        prompt_tokens: context_tokens,
        layers: 0..n_layers,
        n_kv_heads,
        head_dim,
        values,
    }
}

/// Prompt tokens of the chunk [`engine_prefill_attention_flops_per_sec`] prefills.
const PREFILL_PROBE_CHUNK: usize = 16;

/// The arithmetic rate of this host's CPU engine's prefill attention on `engine`'s model,
/// flops/s of the planner's count: a chunk of [`PREFILL_PROBE_CHUNK`] prompt tokens
/// prefilled after up to [`ATTENTION_PROBE_CONTEXT`] imported tokens of random context,
/// against the same chunk as a whole prompt, best of 2 runs each; the extra attention flops
/// (each token attends to the context's positions, `Llama::attention_flops_per_token`
/// each) over the extra time. A prompt's tokens are one task per (token, KV head) and run
/// the prompt's kernels, not a decode step's (`Llama::attend`): the rate of a long prompt's
/// quadratic part, which a plan costs apart from its products. Its rate depends on the
/// shape (2-core EPYC: 38–46 GFLOP/s for SmolLM2's 3 query heads of 64 per KV head, 20–30
/// for the probe's 2 of 128). Takes 0.2–0.4 s on the planner's probe model. `None` when the
/// chunk came out no slower after the context (a host too busy to measure), or the model
/// holds fewer than 256 tokens of context beside the chunk.
///
/// Errors: a forward pass fails.
pub fn engine_prefill_attention_flops_per_sec(engine: &Engine) -> Result<Option<f64>> {
    let model = &engine.model;
    let context_tokens = ATTENTION_PROBE_CONTEXT.min(
        model
            .config
            .max_context_tokens
            .saturating_sub(PREFILL_PROBE_CHUNK),
    );
    if context_tokens < 256 {
        return Ok(None);
    }
    let transfer = probe_context(model, context_tokens);
    let chunk: Vec<u32> = (0..PREFILL_PROBE_CHUNK as u32).map(|t| 7 + t).collect();
    let runs = 2;
    let (mut alone_secs, mut after_secs) = (f64::INFINITY, f64::INFINITY);
    for run in 0..=runs {
        let (alone, after) = engine.install(|| -> Result<(f64, f64)> {
            // The chunk's prefill into `cache`, seconds.
            let prefill = |cache: &mut KvCache| -> Result<f64> {
                let start = Instant::now();
                model.forward(&mut [SequenceInput {
                    tokens: &chunk,
                    cache,
                    all_logits: false,
                }])?;
                Ok(start.elapsed().as_secs_f64())
            };
            let alone = prefill(&mut model.new_cache())?;
            let mut cache = model.new_cache();
            cache.import(&transfer)?;
            cache.finish_import();
            Ok((alone, prefill(&mut cache)?))
        })?;
        if run > 0 {
            alone_secs = alone_secs.min(alone);
            after_secs = after_secs.min(after);
        }
    }
    let extra_flops =
        (PREFILL_PROBE_CHUNK * context_tokens) as f64 * model.attention_flops_per_token() as f64;
    let extra_secs = after_secs - alone_secs;
    Ok((extra_secs > 0.0).then(|| extra_flops / extra_secs))
}

/// Prompt tokens of [`engine_bf16_prefill_flops_per_sec`]'s prompt.
const BF16_PROBE_PROMPT: usize = 8;

/// The rate of this host's CPU engine's bf16 products in a prompt, flops/s: a
/// [`BF16_PROBE_PROMPT`]-token prompt of the bf16 [`engine_probe`], best of 2 runs after a
/// warm-up, its products (`2 · layer weights` a token, the LM head once for the last
/// token's logits; its attention is negligible) over its time. The engine converts every
/// bf16 weight to f32 in its products, so that these run at a fraction of the FMA rate
/// (2-core EPYC: SmolLM2's shape at 3.7 GFLOP/s for 8 tokens, 5.4 for 128, both cores
/// shared with a build; its Q4_0 products near 270): a short prompt underrates a long one
/// by a third. Takes 0.2–0.3 s.
///
/// Errors: a forward pass fails.
fn engine_bf16_prefill_flops_per_sec(engine: &Engine) -> Result<f64> {
    let flops = prompt_products_flops(&engine.model, BF16_PROBE_PROMPT);
    let prompt: Vec<u32> = (0..BF16_PROBE_PROMPT as u32).map(|t| 1 + t).collect();
    let speed = cpu_decode(engine, &prompt, 1, 1, 2)?;
    Ok(flops * speed.prefill_tokens_per_sec / BF16_PROBE_PROMPT as f64)
}

/// The products of a prompt of `tokens` tokens of `model`, flops, as the planner counts
/// them: `2 · layer weights` a token (the attention's and the MLP's projections), and the LM
/// head once, for the last token's logits.
fn prompt_products_flops(model: &Llama, tokens: usize) -> f64 {
    let c = &model.config;
    let (hidden, q_dim, kv_dim) = (
        c.hidden_size,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
    );
    let layer_params =
        model.layers.len() * (hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * c.intermediate_size);
    2.0 * (layer_params * tokens + c.vocab_size * hidden) as f64
}

/// Prompt tokens of the planner's probe's [`engine_prompt_run`].
const SHARE_PROBE_PROMPT: usize = 32;

/// What [`engine_prompt_run`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PromptRun {
    /// The prompt's prefill on all of the engine's threads, best of 2, seconds.
    pub secs: f64,
    /// The share of that rate one thread computes while every one of them runs one, 0 to 1;
    /// `None` on one thread.
    pub one_thread_share: Option<f64>,
}

/// `prompt` prefilled on all of `engine`'s threads and, on more than one, on one-thread
/// engines, one per thread, side by side at once (as one-thread ranks of a host run;
/// [`Engine::side_by_side`]), best of 2 runs after a warm-up; the share is the team's time
/// over the one-thread engines' mean. Measured side by side, not alone: on a shared VM two
/// threads can share one physical core in some minutes and not in others, and a thread
/// alone does not see it (2-core EPYC: one thread alone prefilled SmolLM2 at 0.55 of both
/// threads' rate in some minutes and 0.78 in others). A team of threads pays hand-offs that
/// a thread alone does not, the more so the smaller the products, so the share is above
/// `1 / threads` and depends on the shape and the prompt (2-core EPYC: the planner's probe
/// model 0.50–0.51 at 32 tokens; SmolLM2 0.82 at 32, 0.55–0.57 at 128). Takes 0.3–0.5 s on
/// the probe model's 32 tokens.
///
/// Errors: a forward pass fails, or the one-thread engines cannot be started.
pub fn engine_prompt_run(engine: &Engine, prompt: &[u32]) -> Result<PromptRun> {
    let threads = engine.threads();
    // The prompt's prefill on `model` with the current thread's team, seconds.
    let prefill = |model: &Llama| -> Result<f64> {
        let mut cache = model.new_cache();
        let start = Instant::now();
        model.forward(&mut [SequenceInput {
            tokens: prompt,
            cache: &mut cache,
            all_logits: false,
        }])?;
        Ok(start.elapsed().as_secs_f64())
    };
    let (mut team_secs, mut side_secs) = (f64::INFINITY, f64::INFINITY);
    for run in 0..=2 {
        let team = engine.install(|| prefill(&engine.model))?;
        let side = if threads > 1 {
            let start = std::sync::Barrier::new(threads);
            let side = engine
                .side_by_side(threads, |model| {
                    start.wait();
                    prefill(model)
                })?
                .into_iter()
                .collect::<Result<Vec<f64>>>()?;
            side.iter().sum::<f64>() / threads as f64
        } else {
            f64::INFINITY
        };
        if run > 0 {
            team_secs = team_secs.min(team);
            side_secs = side_secs.min(side);
        }
    }
    Ok(PromptRun {
        secs: team_secs,
        one_thread_share: (threads > 1 && side_secs > 0.0)
            .then(|| (team_secs / side_secs).clamp(1.0 / threads as f64, 1.0)),
    })
}

/// The CPU engine's rates in a decode step on this host: what the planner's CPU probe
/// (`inventory::probe_cpu_for_planning`) adds to the hardware's figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineRates {
    /// The rate of a Q4_0 decode step's weight bytes, bytes/s: the wide probe's step
    /// ([`engine_decode_bytes_per_sec`]) less its layers' `layer_secs`.
    pub weights_bytes_per_sec: f64,
    /// Seconds each decoder layer of a one-sequence decode step costs beyond its weights'
    /// bytes, on every core: its fixed work and the threads' hand-offs between its
    /// operations (2-core EPYC: 13–15 µs a layer on 2 threads, 10–14 on one);
    /// [`layer_probe_model`]'s step over its layers. `None` when it came out longer than the
    /// wide probe's whole step allows (a host too busy to measure).
    pub layer_secs: Option<f64>,
    /// The same rates on one thread alone; `None` on a host of one core.
    pub one_thread: Option<OneThreadRates>,
    /// [`engine_decode_bytes_per_sec`] of the bf16 probe model, bytes/s.
    pub bf16_weights_bytes_per_sec: f64,
    /// [`engine_bf16_prefill_flops_per_sec`], flops/s.
    pub bf16_prefill_flops_per_sec: f64,
    /// [`engine_attention_flops_per_sec`]; `None` on a host too busy to measure it.
    pub attention: Option<AttentionRate>,
    /// [`engine_prefill_attention_flops_per_sec`] on every core, flops/s; `None` on a host
    /// too busy to measure it.
    pub prefill_attention_flops_per_sec: Option<f64>,
    /// The products rate of the Q4_0 probe's 32-token prompt on every core, flops/s of the
    /// planner's count ([`engine_prompt_run`]): the engine's integer dot products, which
    /// outrun the f32 FMA peak (2-core EPYC: 250–260 GFLOP/s against 229).
    pub prefill_flops_per_sec: f64,
    /// [`engine_prompt_run`]'s one-thread share; `None` on a host of one core.
    pub prefill_one_thread_share: Option<f64>,
}

/// What [`engine_decode_rates`] measures again on a one-thread engine, where the team's
/// hand-offs between threads cost nothing: a one-thread rank's rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OneThreadRates {
    /// The Q4_0 probe's weight bytes over its step less its layers' cost, bytes/s.
    pub weights_bytes_per_sec: f64,
    /// [`engine_attention_flops_per_sec`] on the one thread; `None` on a host too busy.
    pub attention: Option<AttentionRate>,
}

/// [`EngineRates`] of this host: 1.5–3 s of every core.
///
/// Errors: as [`engine_probe`], [`engine_decode_bytes_per_sec`] and
/// [`engine_attention_flops_per_sec`].
pub fn engine_decode_rates() -> Result<EngineRates> {
    let quantized = engine_probe(DummyDtype::Q4_0)?;
    let (plain_bytes_per_sec, short_step_secs) =
        engine_decode_bytes_per_sec(&quantized, DummyDtype::Q4_0)?;
    let attention = engine_attention_flops_per_sec(&quantized, short_step_secs)?;
    let prefill_attention_flops_per_sec = engine_prefill_attention_flops_per_sec(&quantized)?;
    let share_prompt: Vec<u32> = (1..=SHARE_PROBE_PROMPT as u32).collect();
    let prompt_run = engine_prompt_run(&quantized, &share_prompt)?;
    let prefill_flops_per_sec =
        prompt_products_flops(&quantized.model, SHARE_PROBE_PROMPT) / prompt_run.secs;
    let (wide_bytes, wide_layers) = (
        quantized.model.decode_weight_bytes() as f64,
        quantized.model.layers.len() as f64,
    );
    let layers = Engine::from_source(
        &ModelSource::Dummy(layer_probe_model()),
        0,
        Numerics::default(),
    )
    .context("cannot build the CPU engine's layer probe model")?;
    let (steps, runs) = engine_probe_steps_and_runs(DummyDtype::Q4_0);
    let speed = cpu_decode(&layers, &[1, 2, 3, 4], 1, steps, runs + 2)?;
    let layer_secs = 1.0 / speed.decode_tokens_per_sec / layers.model.layers.len() as f64;
    drop(layers);
    // The wide step less its layers' fixed cost read the bytes.
    let bytes_secs = short_step_secs - wide_layers * layer_secs;
    let (weights_bytes_per_sec, layer_secs) = if bytes_secs > 0.5 * short_step_secs {
        (wide_bytes / bytes_secs, Some(layer_secs))
    } else {
        (plain_bytes_per_sec, None)
    };
    // After the layer probe: run before it, the one-thread engine left the layer cost
    // measured at twice its figure.
    let one_thread = if quantized.threads() > 1 {
        let alone = quantized.with_threads(1)?;
        let step = engine_decode_bytes_per_sec(&alone, DummyDtype::Q4_0)?.1;
        Some(OneThreadRates {
            weights_bytes_per_sec: wide_bytes
                / (step - wide_layers * layer_secs.unwrap_or(0.0)).max(step / 2.0),
            attention: engine_attention_flops_per_sec(&alone, step)?,
        })
    } else {
        drop(quantized);
        None
    };
    let bf16 = engine_probe(DummyDtype::Bf16)?;
    let (bf16_weights_bytes_per_sec, _) = engine_decode_bytes_per_sec(&bf16, DummyDtype::Bf16)?;
    let bf16_prefill_flops_per_sec = engine_bf16_prefill_flops_per_sec(&bf16)?;
    Ok(EngineRates {
        weights_bytes_per_sec,
        layer_secs,
        one_thread,
        bf16_weights_bytes_per_sec,
        bf16_prefill_flops_per_sec,
        attention,
        prefill_attention_flops_per_sec,
        prefill_flops_per_sec,
        prefill_one_thread_share: prompt_run.one_thread_share,
    })
}

/// The processor's name (`/proc/cpuinfo`'s first `model name`), `unknown CPU` without one.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Peak resident set size of this process (`VmHWM` in `/proc/self/status`), bytes.
///
/// Errors: the file cannot be read or has no well-formed `VmHWM`.
pub fn peak_rss_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("failed to read `/proc/self/status`")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("`/proc/self/status` has no `VmHWM`")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .context("malformed `VmHWM`")?;
    Ok(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompts_attention_is_timed_after_the_context_the_model_holds() {
        let model = |max_context_tokens| DummyModel {
            name: "prefill attention".into(),
            max_context_tokens,
            n_layers: 2,
            ..layer_probe_model()
        };
        let engine = |max_context_tokens| {
            Engine::from_source(
                &ModelSource::Dummy(model(max_context_tokens)),
                1,
                Numerics::default(),
            )
            .expect("builds")
        };
        // No room for 256 tokens of context beside the chunk: nothing to time.
        let short = engine(256 + PREFILL_PROBE_CHUNK - 1);
        assert_eq!(
            engine_prefill_attention_flops_per_sec(&short).expect("runs"),
            None
        );
        // Room for 1024: 16 tokens attending to 1024 more positions each take longer (a
        // busy host may hide it once; not three times).
        let long = engine(1024 + PREFILL_PROBE_CHUNK);
        let rate = (0..3)
            .find_map(|_| engine_prefill_attention_flops_per_sec(&long).expect("runs"))
            .expect("measured in one of three tries");
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }

    #[test]
    fn a_models_decode_attention_is_timed_after_the_context_it_holds() {
        let engine = |max_context_tokens, threads| {
            let model = DummyModel {
                name: "decode attention".into(),
                max_context_tokens,
                n_layers: 2,
                n_kv_heads: 2,
                n_heads: 4,
                ..layer_probe_model()
            };
            Engine::from_source(&ModelSource::Dummy(model), threads, Numerics::default())
                .expect("builds")
        };
        // No room for 256 tokens of context beside the 8 steps and the short run's 20.
        let short = engine(256 + 15, 1);
        assert_eq!(engine_decode_attention_rate(&short).expect("runs"), None);
        // Room for 1024: steps attending to 1000 more positions each take longer (a busy
        // host may hide it once; not three times); the rate says its tasks and threads.
        let long = engine(1024 + 16, 2);
        let rate = (0..3)
            .find_map(|_| engine_decode_attention_rate(&long).expect("runs"))
            .expect("measured in one of three tries");
        assert!(
            rate.flops_per_sec.is_finite() && rate.flops_per_sec > 0.0,
            "{rate:?}"
        );
        assert_eq!((rate.tasks, rate.threads), (2, 2));
    }

    #[test]
    fn one_threads_share_of_a_prompt_is_timed_beside_the_others() {
        let engine = |threads| {
            let model = DummyModel {
                name: "one thread's share".into(),
                n_layers: 2,
                ..layer_probe_model()
            };
            Engine::from_source(&ModelSource::Dummy(model), threads, Numerics::default())
                .expect("builds")
        };
        let prompt: Vec<u32> = (1..=16).collect();
        // One thread has no others to share with.
        let one = engine_prompt_run(&engine(1), &prompt).expect("runs");
        assert_eq!(one.one_thread_share, None);
        assert!(one.secs > 0.0 && one.secs.is_finite(), "{one:?}");
        // Two: each one-thread engine runs the prompt on its own thread at once, and the
        // same model's logits come out of each.
        let two = engine(2);
        let logits = two
            .side_by_side(2, |model| {
                let mut cache = model.new_cache();
                model.forward(&mut [SequenceInput {
                    tokens: &prompt,
                    cache: &mut cache,
                    all_logits: false,
                }])
            })
            .expect("runs");
        let logits: Vec<_> = logits.into_iter().map(|l| l.expect("forward")).collect();
        assert_eq!(logits[0], logits[1]);
        let share = engine_prompt_run(&two, &prompt)
            .expect("runs")
            .one_thread_share
            .expect("two threads");
        assert!((0.5..=1.0).contains(&share), "{share}");
    }

    #[test]
    fn the_layer_probe_is_layers_and_next_to_no_bytes() {
        let engine = Engine::from_source(
            &ModelSource::Dummy(layer_probe_model()),
            1,
            Numerics::default(),
        )
        .expect("builds");
        // Small enough for any CPU's caches, many layers for its fixed costs.
        assert!(engine.model.decode_weight_bytes() < 4 << 20);
        assert_eq!(engine.model.layers.len(), 32);
        // Its step is timed like the wide probe's.
        let speed = cpu_decode(&engine, &[1, 2, 3, 4], 1, 4, 1).expect("decodes");
        assert!(speed.decode_tokens_per_sec.is_finite() && speed.decode_tokens_per_sec > 0.0);
    }
}
