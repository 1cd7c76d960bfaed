//! The forward pass over a `Backend`: a small synthetic Llama (and a Mixtral-style MoE) with
//! weights in every type the kernels read, run through the CUDA kernels on the host
//! harness (and through the CPU backend), step by step against the CPU engine.

use half::{bf16, f16};
use infer_runtime::runtime::backend::cpu::CpuBackend;
use infer_runtime::runtime::backend::{Backend, nmse};
use infer_runtime::runtime::cuda::backend::KernelBackend;
use infer_runtime::runtime::exec::forward::{BackendModel, DeviceSequence, compare_with_cpu};
use infer_runtime::runtime::formats::ggml::GgmlType;
use infer_runtime::runtime::model::config::{LlamaConfig, RopeStyle};
use infer_runtime::runtime::model::llama::{Layer, Llama, SequenceInput};
use infer_runtime::runtime::model::moe::{Expert, MoeFfn};
use infer_runtime::runtime::model::sampling::argmax;
use infer_runtime::runtime::model::weights::Weight;

use crate::support::runtime::{Transport, host, with_group};
use crate::support::synthetic::{Shape, tokenizer_metadata, weights, write_gguf_with};

/// Deterministic values in [−scale, scale) (xorshift; the seed names the tensor).
fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            scale * ((state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
        })
        .collect()
}

/// `values` (`n_rows × n_cols`) encoded as GGML `ty` blocks, rounded as ggml's reference
/// quantizers round (`quantize_row_q4_0_ref` and friends).
fn encode(ty: GgmlType, values: &[f32], n_rows: usize, n_cols: usize) -> Weight {
    let mut bytes = Vec::new();
    match ty {
        GgmlType::F32 => bytes.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => bytes.extend(values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        GgmlType::Bf16 => {
            bytes.extend(values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()))
        }
        GgmlType::Q8_0 => {
            for block in values.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                bytes.extend(f16::from_f32(d).to_le_bytes());
                bytes.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for block in values.chunks_exact(32) {
                let max = block
                    .iter()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = max / -8.0;
                let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                bytes.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * inv + 8.5) as i32).min(15) as u8;
                bytes.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        GgmlType::Q4_1 => {
            for block in values.chunks_exact(32) {
                let min = block.iter().fold(f32::MAX, |m, v| m.min(*v));
                let max = block.iter().fold(f32::MIN, |m, v| m.max(*v));
                let d = (max - min) / 15.0;
                let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                bytes.extend(f16::from_f32(d).to_le_bytes());
                bytes.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * inv + 0.5) as i32).min(15) as u8;
                bytes.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        other => panic!("no test encoder for {other:?}"),
    }
    Weight::from_bytes(ty, n_rows, n_cols, bytes).expect("sized")
}

/// A 2-layer Llama (hidden 64, 4 heads of 16 on 2 KV heads, vocabulary 80) whose matrices
/// use every type the CUDA products read: Q8_0 embedding (the Q8_0 lookup), Q8_0/Q4_0/Q4_1
/// projections, BF16 output projection, F16 LM head. With `moe`, each layer's MLP is a
/// router over `(n_experts, top_k)` experts of width 64 (Q8_0 gate/up, Q4_0 down). NeoX
/// RoPE comes Qwen-style: Q/K/V biases and per-head Q/K norms.
fn synthetic(moe: Option<(usize, usize)>, rope_style: RopeStyle) -> Llama {
    let qwen = rope_style == RopeStyle::Neox;
    let (hidden, intermediate, n_heads, n_kv_heads, vocab, n_layers) = (64, 128, 4, 2, 80, 2);
    let head_dim = hidden / n_heads;
    let config = LlamaConfig {
        hidden_size: hidden,
        intermediate_size: intermediate,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size: vocab,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_style,
        rope_scaling: None,
        max_context_tokens: 256,
        n_experts: moe.map_or(0, |m| m.0),
        n_experts_used: moe.map_or(0, |m| m.1),
    };
    let mut seed = 100;
    let mut matrix = |ty: GgmlType, rows: usize, cols: usize, scale: f32| {
        seed += 1;
        encode(ty, &random(seed, rows * cols, scale), rows, cols)
    };
    let embedding = matrix(GgmlType::Q8_0, vocab, hidden, 1.0);
    let kv_dim = n_kv_heads * head_dim;
    let layers = (0..n_layers)
        .map(|l| {
            let norm =
                |s: u64| -> Vec<f32> { random(s, hidden, 0.2).iter().map(|v| 1.0 + v).collect() };
            let moe_block = moe.map(|(n_experts, top_k)| MoeFfn {
                router: matrix(GgmlType::Q8_0, n_experts, hidden, 0.5),
                experts: (0..n_experts)
                    .map(|_| {
                        Some(Expert {
                            gate: matrix(GgmlType::Q8_0, 64, hidden, 0.3),
                            up: matrix(GgmlType::Q8_0, 64, hidden, 0.3),
                            down: matrix(GgmlType::Q4_0, hidden, 64, 0.3),
                        })
                    })
                    .collect(),
                top_k,
            });
            let dense = moe_block.is_none();
            let (gate, up, down) = if dense {
                (
                    matrix(GgmlType::Q4_0, intermediate, hidden, 0.3),
                    matrix(GgmlType::Q8_0, intermediate, hidden, 0.3),
                    matrix(GgmlType::Q4_1, hidden, intermediate, 0.3),
                )
            } else {
                let empty = || Weight::from_f32(0, hidden, &[]).expect("empty");
                (empty(), empty(), empty())
            };
            let bias = |s: u64, n: usize| qwen.then(|| random(s, n, 0.3));
            let head_norm =
                |s: u64| qwen.then(|| random(s, head_dim, 0.2).iter().map(|v| 1.0 + v).collect());
            Layer {
                attn_norm: norm(200 + l as u64),
                wq: matrix(GgmlType::Q8_0, n_heads * head_dim, hidden, 0.4),
                wk: matrix(GgmlType::Q4_0, kv_dim, hidden, 0.4),
                wv: matrix(GgmlType::Q4_1, kv_dim, hidden, 0.4),
                wo: matrix(GgmlType::Bf16, hidden, n_heads * head_dim, 0.3),
                bias_q: bias(500 + l as u64, n_heads * head_dim),
                bias_k: bias(510 + l as u64, kv_dim),
                bias_v: bias(520 + l as u64, kv_dim),
                q_norm: head_norm(530 + l as u64),
                k_norm: head_norm(540 + l as u64),
                ffn_norm: norm(300 + l as u64),
                w_gate: gate,
                w_up: up,
                w_down: down,
                moe: moe_block,
            }
        })
        .collect();
    let output = matrix(GgmlType::F16, vocab, hidden, 1.5);
    let output_norm = random(400, hidden, 0.2).iter().map(|v| 1.0 + v).collect();
    Llama::new(config, embedding, layers, output_norm, output, None)
}

/// One CPU engine step of `tokens` after what `cache` holds: the last token's logits.
fn cpu_step(
    model: &Llama,
    tokens: &[u32],
    cache: &mut infer_runtime::runtime::model::kv::KvCache,
) -> Vec<f32> {
    model
        .forward(&mut [SequenceInput {
            tokens,
            cache,
            all_logits: false,
        }])
        .expect("cpu step")
        .remove(0)
}

/// The top logit's lead over the second.
fn margin(logits: &[f32]) -> f32 {
    let best = argmax(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best)
        .fold(f32::MIN, |m, (_, v)| m.max(*v));
    logits[best] - second
}

/// Steps `model` on `backend` and on the CPU engine side by side, teacher-forced with the
/// CPU's greedy tokens: an 11-token prompt, then `decode_steps` decode steps, then a batch mixing a decode
/// step of the first sequence with a second sequence's prompt. Every step's logits are
/// close (NMSE ≤ `limit`) and the top token agrees wherever the CPU's margin exceeds 0.1
/// (`infer smoke`'s rule); most steps must have such a margin, so the test cannot pass on
/// ties. Then device-side greedy generation equals the CPU engine's tokens up to the
/// first step whose margin is below 0.1. Returns the largest NMSE seen.
fn agree_with_cpu<B: Backend>(backend: B, model: &Llama, decode_steps: usize, limit: f64) -> f64 {
    // 11 prompt tokens, and a batch of 11 below: over `MAX_MATVEC_TOKENS`, so the kernel
    // backend runs those products as GEMMs (decode steps stay on the matrix-vector kernels).
    agree_with_cpu_on(
        backend,
        model,
        &[3, 17, 42, 5, 79, 0, 23, 61, 8, 14, 70],
        &[60, 2, 2, 31, 8, 44, 9, 52, 1, 27],
        decode_steps,
        limit,
    )
}

/// [`agree_with_cpu`] from `prompt`, with `second_prompt` in the mixed batch.
fn agree_with_cpu_on<B: Backend>(
    backend: B,
    model: &Llama,
    prompt: &[u32],
    second_prompt: &[u32],
    decode_steps: usize,
    limit: f64,
) -> f64 {
    let name = backend.name();
    let mut device = BackendModel::new(backend, model, 128).unwrap_or_else(|e| panic!("{e:#}"));
    let prompt = prompt.to_vec();
    let mut cpu_cache = model.new_cache();
    let mut sequence = DeviceSequence::default();
    let (mut input, mut worst, mut decided, mut steps) = (prompt.clone(), 0f64, 0, 0);
    let mut cpu_tokens = Vec::new();
    let mut compare = |cpu: &[f32], dev: &[f32], what: &str| {
        let error = nmse(dev, cpu);
        assert!(
            error <= limit,
            "{name}, {what}: NMSE {error:.2e} > {limit:.0e}"
        );
        worst = worst.max(error);
        steps += 1;
        if margin(cpu) > 0.1 {
            decided += 1;
            assert_eq!(
                argmax(dev),
                argmax(cpu),
                "{name}, {what}: the top token differs"
            );
        }
    };
    for step in 0..=decode_steps {
        let cpu = cpu_step(model, &input, &mut cpu_cache);
        let dev = device
            .forward(&mut [(&mut sequence, &input)])
            .unwrap_or_else(|e| panic!("{e:#}"))
            .remove(0);
        compare(&cpu, &dev, &format!("step {step}"));
        cpu_tokens.push(argmax(&cpu));
        input = vec![argmax(&cpu)];
    }
    // One batch: the first sequence's next decode step beside a new prompt.
    let second_prompt = second_prompt.to_vec();
    let mut cpu_second = model.new_cache();
    let cpu = model
        .forward(&mut [
            SequenceInput {
                tokens: &input,
                cache: &mut cpu_cache,
                all_logits: false,
            },
            SequenceInput {
                tokens: &second_prompt,
                cache: &mut cpu_second,
                all_logits: false,
            },
        ])
        .expect("cpu batch");
    let mut second = DeviceSequence::default();
    let dev = device
        .forward(&mut [(&mut sequence, &input), (&mut second, &second_prompt)])
        .unwrap_or_else(|e| panic!("{e:#}"));
    compare(&cpu[0], &dev[0], "batch, decode row");
    compare(&cpu[1], &dev[1], "batch, prompt row");
    assert!(
        decided * 4 >= steps * 3,
        "{name}: only {decided} of {steps} steps had a top-1 margin above 0.1"
    );
    device.release(&mut sequence);
    device.release(&mut second);
    // Greedy on the device (argmax kernel, only ids come back), from a fresh sequence.
    let mut cpu_cache = model.new_cache();
    let (mut input, mut expected) = (prompt.clone(), Vec::new());
    for _ in 0..decode_steps {
        let logits = cpu_step(model, &input, &mut cpu_cache);
        expected.push((argmax(&logits), margin(&logits)));
        input = vec![argmax(&logits)];
    }
    let generated = device
        .generate_greedy(&prompt, expected.len())
        .unwrap_or_else(|e| panic!("{e:#}"));
    for (i, (token, margin)) in expected.iter().enumerate() {
        if *margin <= 0.1 {
            break;
        }
        assert_eq!(
            generated[i], *token,
            "{name}: greedy token {i} differs: {generated:?}"
        );
    }
    worst
}

#[test]
fn a_synthetic_llama_through_the_host_harness_kernels_gives_the_cpu_engines_tokens() {
    // The CUDA kernels on the host harness: 8-bit activations (Q8_1) in the products, the
    // cache in f16 — NMSE well under 1e-3 against the CPU engine's llama.cpp numerics.
    let harness = host();
    let model = synthetic(None, RopeStyle::Interleaved);
    let error = agree_with_cpu(KernelBackend::new(harness), &model, 4, 1e-3);
    assert!(error > 0.0, "the NMSE is measured, not assumed");
    // `infer smoke`'s model checks, as they run on a GPU: greedy steps teacher-forced on
    // both sides agree where decided, and two runs give the same logits bit for bit.
    let mut device =
        BackendModel::new(KernelBackend::new(harness), &model, 64).expect("the model uploads");
    let prompt = [3, 17, 42, 5];
    let first = compare_with_cpu(&mut device, &model, &prompt, 3).expect("compared");
    let second = compare_with_cpu(&mut device, &model, &prompt, 3).expect("compared");
    assert!(
        first.decided >= 3 && first.disagreements.is_empty(),
        "{first:?}"
    );
    assert_eq!(first.device_logits, second.device_logits);
    // NeoX RoPE with Qwen's Q/K/V biases and per-head Q/K norms.
    let neox = synthetic(None, RopeStyle::Neox);
    agree_with_cpu(KernelBackend::new(harness), &neox, 2, 1e-3);
    // The CPU backend (the engine's own products, f32 elsewhere) on both.
    agree_with_cpu(CpuBackend, &model, 4, 1e-3);
    agree_with_cpu(CpuBackend, &neox, 4, 1e-3);
}

#[test]
fn a_synthetic_moe_through_the_host_harness_kernels_gives_the_cpu_engines_tokens() {
    let model = synthetic(Some((4, 2)), RopeStyle::Interleaved);
    // Batches the matrix-vector kernels run (7 and 1 + 5 tokens), 8-bit activations as on
    // the CPU. Through the GEMM path (f16 activations) the top-2 routing turns the small
    // difference from the CPU's 8-bit activations into a different expert for a token now
    // and then: over six 11-token prompts the prompt step's NMSE ran from 1.6e-4 to
    // 2.8e-3, about the same with the experts' own products kept off the GEMM, so it is
    // the routing, not the experts' GEMMs (which `cuda::batches_over_…` checks).
    agree_with_cpu_on(
        KernelBackend::new(host()),
        &model,
        &[3, 17, 42, 5, 79, 0, 23],
        &[60, 2, 2, 31, 8],
        3,
        1e-3,
    );
    agree_with_cpu(CpuBackend, &model, 4, 1e-3);
}

#[test]
fn the_device_model_refuses_what_it_does_not_run_and_a_full_cache_takes_nothing() {
    let model = synthetic(None, RopeStyle::Interleaved);
    let mut device = BackendModel::new(CpuBackend, &model, 32).expect("model");
    let mut long = DeviceSequence::default();
    let prompt: Vec<u32> = (0..40).map(|i| i % 80).collect();
    let error = device
        .forward(&mut [(&mut long, &prompt)])
        .expect_err("40 tokens do not fit 2 blocks");
    assert!(error.to_string().contains("KV cache is full"), "{error}");
    assert_eq!(long.n_tokens, 0);
    // Nothing was taken: the 32 positions still hold a 32-token prompt.
    device
        .forward(&mut [(&mut long, &prompt[..32])])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let error = device
        .forward(&mut [(&mut DeviceSequence::default(), &[80])])
        .expect_err("outside the vocabulary");
    assert!(error.to_string().contains("token id 80"), "{error}");
}

/// Two pipeline stages of the device model (on the CPU backend and on the harness kernels):
/// the first embeds and gives its hidden states, the second starts from them and gives the
/// whole model's logits, bit for bit, prompt and decode steps alike; a stage asked for what
/// it does not do says so.
#[test]
fn two_device_pipeline_stages_give_the_whole_models_logits() {
    use infer_runtime::runtime::exec::forward::StageOut;
    fn check<B: Backend>(make: &dyn Fn() -> B) {
        let model = synthetic(None, RopeStyle::Interleaved);
        let mut whole = BackendModel::new(make(), &model, 64).expect("whole");
        let first = model.shard(0, 1, 0, 1).expect("stage 0 of PP 2");
        let last = model.shard(0, 1, 1, 1).expect("stage 1 of PP 2");
        let mut first = BackendModel::new(make(), &first, 64).expect("stage 0");
        let mut last = BackendModel::new(make(), &last, 64).expect("stage 1");
        let (mut a, mut b, mut c) = Default::default();
        for input in [vec![3u32, 17, 42, 5, 79], vec![23], vec![8]] {
            let (logits, _) = whole.step(&mut [(&mut a, &input)], None).expect("whole");
            let want = whole.backend().download(&logits, 80 * 4).expect("download");
            let (hidden, n) = match first
                .step_stage(&mut [(&mut b, &input)], None, None)
                .expect("stage 0")
            {
                StageOut::Hidden(hidden, n) => (hidden, n),
                StageOut::Logits(..) => panic!("stage 0 gave logits"),
            };
            assert_eq!(n, input.len());
            // Through host memory, as between two hosts' stages without NCCL.
            let bytes = first
                .backend()
                .download(&hidden, n * 64 * 4)
                .expect("download");
            let hidden = last.backend().upload(&bytes).expect("upload");
            let got = match last
                .step_stage(&mut [(&mut c, &input)], None, Some((hidden, n)))
                .expect("stage 1")
            {
                StageOut::Logits(logits, 1) => {
                    last.backend().download(&logits, 80 * 4).expect("download")
                }
                _ => panic!("stage 1 gave no logits row"),
            };
            assert_eq!(got, want, "input {input:?}");
        }
        let error = first
            .step(&mut [(&mut DeviceSequence::default(), &[1])], None)
            .err()
            .expect("no logits before the last stage");
        assert!(error.to_string().contains("before the last"), "{error}");
        let error = last
            .step_stage(&mut [(&mut DeviceSequence::default(), &[1])], None, None)
            .err()
            .expect("a later stage needs hidden states");
        assert!(error.to_string().contains("hidden states"), "{error}");
        // Hidden states of another number of tokens than the batch's.
        let mut fresh = DeviceSequence::default();
        let wrong = last.backend().zeros(2 * 64 * 4).expect("zeros");
        let error = last
            .step_stage(&mut [(&mut fresh, &[1])], None, Some((wrong, 2)))
            .err()
            .expect("hidden states of another batch");
        assert!(
            error
                .to_string()
                .contains("hidden states of 2 tokens for a batch of 1"),
            "{error}"
        );
        last.release(&mut fresh);
    }
    check(&|| CpuBackend);
    check(&|| KernelBackend::new(host()));
}

#[test]
fn the_cpu_engines_decode_step_equals_the_prompt_run_whole_with_16_dimension_heads() {
    // Heads of 16 are not a multiple of ggml's 32 lanes: the decode scores take the
    // leftover loop (they were zero before it existed, and attention a plain average).
    let model = synthetic(None, RopeStyle::Interleaved);
    let forward = |tokens: &[u32], cache: &mut _| {
        model
            .forward(&mut [SequenceInput {
                tokens,
                cache,
                all_logits: false,
            }])
            .expect("forward")
            .remove(0)
    };
    let prompt: Vec<u32> = vec![3, 17, 42, 5, 79, 0, 23, 9];
    let mut cache = model.new_cache();
    forward(&prompt[..7], &mut cache);
    let decoded = forward(&prompt[7..], &mut cache);
    let whole = forward(&prompt, &mut model.new_cache());
    let error = nmse(&decoded, &whole);
    assert!(error < 1e-9, "decode vs whole prompt: NMSE {error:e}");
}

/// A servable synthetic model (f32 weights, a tokenizer of single characters) written into
/// `dir` and loaded: what `infer generate --device cuda` and `infer up --device cuda` run.
fn servable_engine(dir: &std::path::Path) -> infer_runtime::runtime::exec::engine::Engine {
    let shape = Shape {
        hidden: 64,
        intermediate: 96,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        vocab: 60,
        qkv_bias: false,
    };
    let path = dir.join("servable.gguf");
    let weights = weights(&shape, 7);
    write_gguf_with(&path, &shape, &weights, &tokenizer_metadata(shape.vocab));
    infer_runtime::runtime::exec::engine::Engine::load(&path, 1, Default::default())
        .unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn generation_through_the_backend_executor_on_the_harness_equals_the_cpu_engines() {
    use infer_runtime::runtime::exec::forward::BackendExecutor;
    use infer_runtime::runtime::model::sampling::SamplingParams;
    // What `infer generate --device cuda` runs, with the harness standing in for the GPU.
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = servable_engine(dir.path());
    let prompt = engine.tokenizer.encode("HELLO", false).expect("encodes");
    let params = SamplingParams {
        max_tokens: 6,
        ..SamplingParams::default()
    };
    let cpu = engine.generate(&prompt, &params, &mut |_| {}).expect("cpu");
    let model = BackendModel::new(KernelBackend::new(host()), &engine.model, 64)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut executor = BackendExecutor::new(model, engine.tokenizer.clone());
    let mut streamed = String::new();
    let device = infer_runtime::runtime::exec::executor::generate(
        &mut executor,
        &prompt,
        &params,
        &mut |t| streamed.push_str(t),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(device.tokens, cpu.tokens, "{} vs {}", device.text, cpu.text);
    assert_eq!(device.text, cpu.text);
    assert_eq!(streamed, cpu.text);
    assert_eq!(device.tokens.len(), 6);
    // The sequence's blocks went back: the ledger the scheduler reads is empty again.
    use infer_runtime::runtime::exec::executor::Executor;
    assert_eq!(executor.kv_pool().used_blocks(), 0);
}

/// Prefix caching on the device path (`infer up --device cuda`), with the harness standing
/// in for the GPU: the second of two prompts sharing a 32-token prefix adopts its two full
/// blocks from the ledger's prefix cache (the device slots the first prompt wrote) and
/// computes only the rest, and its greedy tokens equal those of the same prompt run whole
/// with the prefix cache off, and the CPU engine's. A small cache evicts and stays correct.
#[test]
fn the_device_prefix_cache_reuses_blocks_and_gives_the_uncached_tokens() {
    use infer_runtime::runtime::exec::executor::{Executor, StepEntry};
    use infer_runtime::runtime::exec::forward::BackendExecutor;
    use infer_runtime::runtime::model::sampling::SamplingParams;
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = servable_engine(dir.path());
    let system = "THE SHARED SYSTEM TEXT OF THIRTY TWO CHARS!";
    let encode = |question: &str| {
        engine
            .tokenizer
            .encode(&format!("{system}{question}"), false)
            .expect("encodes")
    };
    let params = SamplingParams {
        max_tokens: 4,
        ..SamplingParams::default()
    };
    let executor = |kv_tokens: usize, cached: bool| {
        let model = BackendModel::new(KernelBackend::new(host()), &engine.model, kv_tokens)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let executor = BackendExecutor::new(model, engine.tokenizer.clone());
        executor.kv_pool().set_prefix_cache(cached);
        executor
    };
    // Runs `prompt` greedily as sequence `seq`, adopting the cached prefix the ledger
    // offers (as the scheduler does); returns the tokens and the prefix's length.
    let run = |executor: &mut BackendExecutor<_>, seq: u64, prompt: &[u32]| {
        let hit = executor
            .kv_pool()
            .cached_prefix(&prompt[..prompt.len() - 1], prompt.len());
        let mut entry = StepEntry::prompt(seq, &prompt[hit.tokens..], &params);
        entry.prefix_tokens = prompt[..hit.tokens].to_vec();
        entry.prompt_tokens = prompt.len();
        let mut tokens = Vec::new();
        for _ in 0..params.max_tokens {
            let sampled = executor
                .step(std::slice::from_ref(&entry), &[])
                .unwrap_or_else(|e| panic!("{e:#}"));
            let token = sampled[0].as_ref().expect("a token").token;
            tokens.push(token);
            entry = StepEntry::decode(seq, token);
        }
        (tokens, hit.tokens)
    };
    let (first, second) = (encode("WHO?"), encode("WHERE NOW?"));
    assert!(first.len() > 32 && second.len() > 32);
    let cpu = |prompt: &[u32]| {
        engine
            .generate(prompt, &params, &mut |_| {})
            .expect("cpu")
            .tokens
    };
    let (want_first, want_second) = (cpu(&first), cpu(&second));
    // The second prompt run whole on the device with the cache off: the CPU engine's.
    let mut plain = executor(256, false);
    let (tokens, hit) = run(&mut plain, 1, &second);
    assert_eq!((&tokens, hit), (&want_second, 0));

    let mut cached = executor(256, true);
    let (tokens, hit) = run(&mut cached, 1, &first);
    assert_eq!((tokens, hit), (want_first.clone(), 0));
    cached.step(&[], &[1]).expect("release");
    let used = cached.kv_pool().used_blocks();
    assert_eq!(used, 0, "released");
    assert!(cached.kv_pool().cached_blocks() >= 2);
    let (tokens, hit) = run(&mut cached, 2, &second);
    assert_eq!(
        hit, 32,
        "two full blocks of the shared text come from the cache"
    );
    assert_eq!(tokens, want_second, "cached prefix, same tokens");
    cached.step(&[], &[2]).expect("release");

    // Three blocks of room, each prompt needs three: the second prompt's own third block,
    // cached, is evicted for the first's, and both answers stay right.
    let mut small = executor(48, true);
    for (seq, (prompt, want)) in [(&second, &want_second), (&first, &want_first)]
        .into_iter()
        .enumerate()
    {
        let (tokens, _) = run(&mut small, seq as u64, prompt);
        assert_eq!(&tokens, want, "sequence {seq}");
        small.step(&[], &[seq as u64]).expect("release");
    }
    assert!(
        small.kv_pool().evictions() > 0,
        "the small cache evicted: prompts of {} and {} tokens, {:?}, {} cached",
        first.len(),
        second.len(),
        small.kv_pool(),
        small.kv_pool().cached_blocks()
    );
}

/// Prefill/decode disaggregation between two device executors (the harness standing in for
/// the GPUs): a prompt prefilled in two chunks on one, its KV exported after each chunk, is
/// imported by the other (the parts in reverse order), which then decodes the tokens the
/// first would have; an import of another geometry fails and holds no block, and a step of
/// an import that never came is refused.
#[test]
fn kv_exported_by_one_device_executor_lets_another_decode_the_same_tokens() {
    use infer_runtime::runtime::exec::executor::{Executor, StepEntry};
    use infer_runtime::runtime::exec::forward::BackendExecutor;
    use infer_runtime::runtime::model::sampling::SamplingParams;
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = servable_engine(dir.path());
    let prompt = engine
        .tokenizer
        .encode("THE SHARED SYSTEM TEXT OF THIRTY TWO CHARS!WHO?", false)
        .expect("encodes");
    assert!(
        prompt.len() > 32 && !prompt.len().is_multiple_of(16),
        "{}",
        prompt.len()
    );
    let params = SamplingParams {
        max_tokens: 4,
        ..SamplingParams::default()
    };
    let executor = || {
        let model = BackendModel::new(KernelBackend::new(host()), &engine.model, 256)
            .unwrap_or_else(|e| panic!("{e:#}"));
        BackendExecutor::new(model, engine.tokenizer.clone())
    };
    let step = |executor: &mut BackendExecutor<_>, entry: &StepEntry| {
        executor
            .step(std::slice::from_ref(entry), &[])
            .unwrap_or_else(|e| panic!("{e:#}"))[0]
            .as_ref()
            .map(|s| s.token)
    };
    // The prefill side: two chunks, the KV of each exported after its step.
    let mut prefill = executor();
    let split = 20;
    let mut first = StepEntry::prompt(1, &prompt[..split], &params);
    first.prompt_tokens = prompt.len();
    first.sample = false;
    assert_eq!(step(&mut prefill, &first), None);
    let part_1 = prefill
        .export_kv(1, 0)
        .expect("export")
        .expect("20 positions");
    let mut rest = StepEntry::decode(1, 0);
    rest.tokens = prompt[split..].to_vec();
    let token = step(&mut prefill, &rest).expect("the first token");
    let part_2 = prefill
        .export_kv(1, split)
        .expect("export")
        .expect("the rest");
    assert!(
        prefill
            .export_kv(1, prompt.len())
            .expect("export")
            .is_none()
    );
    assert_eq!(
        (
            part_1.first_position,
            part_1.tokens.len(),
            part_2.first_position
        ),
        (0, split, split)
    );
    assert_eq!(part_2.tokens.len(), prompt.len() - split);
    let mut want = vec![token];
    for _ in 1..params.max_tokens {
        let next = step(
            &mut prefill,
            &StepEntry::decode(1, *want.last().expect("a token")),
        );
        want.push(next.expect("a token"));
    }
    // The decode side: the parts in reverse order, then the first token on.
    let mut decode = executor();
    let mut imported = StepEntry::prompt(7, &[token], &params);
    imported.prompt_tokens = prompt.len();
    imported.sampled_before = 1;
    imported.import = Some(99);
    let mut never = imported.clone();
    decode
        .import_kv(&imported, &[part_2.clone(), part_1.clone()])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut got = vec![token];
    got.push(step(&mut decode, &imported).expect("a token"));
    while got.len() < want.len() {
        let next = step(
            &mut decode,
            &StepEntry::decode(7, *got.last().expect("a token")),
        );
        got.push(next.expect("a token"));
    }
    assert_eq!(
        got, want,
        "the decode executor continues the prefill's tokens"
    );
    assert!(
        engine
            .generate(&prompt, &params, &mut |_| {})
            .expect("cpu")
            .tokens
            == want,
        "and they are the CPU engine's"
    );
    // Parts of another geometry: refused, nothing held; an import that never came: refused.
    let mut other = executor();
    let mut wrong = part_1.clone();
    wrong.n_kv_heads = 2;
    wrong.values.extend(part_1.values.iter());
    let error = other
        .import_kv(&imported, &[wrong, part_2])
        .expect_err("another geometry");
    assert!(
        format!("{error:#}").contains("must shard the model alike"),
        "{error:#}"
    );
    assert_eq!(other.kv_pool().used_blocks(), 0);
    never.seq = 8;
    let error = other
        .step(std::slice::from_ref(&never), &[])
        .expect_err("not imported");
    assert!(
        format!("{error:#}").contains("was not imported"),
        "{error:#}"
    );
    assert!(other.export_kv(3, 0).is_err(), "an unknown sequence");
}

#[test]
fn the_decode_benchmark_on_the_harness_measures_and_gives_every_block_back() {
    use infer_runtime::runtime::exec::forward::bench_decode;
    let model = synthetic(None, RopeStyle::Interleaved);
    let mut device = BackendModel::new(KernelBackend::new(host()), &model, 64)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let speed =
        bench_decode(&mut device, &[3, 17, 42, 5, 79], 3, 2).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(speed.prefill_tokens_per_sec > 0.0 && speed.decode_tokens_per_sec > 0.0);
    let per_step = 3.0 / speed.decode_tokens_per_sec;
    assert!(
        (per_step - speed.decode_step_secs).abs() < 1e-9 * per_step.max(1.0),
        "{speed:?}"
    );
    // Every block came back (64 positions: 4 blocks).
    assert_eq!(device.free_blocks(), 4);
    // A batch the cache cannot hold (5 sequences, 4 blocks) is an error, not a hang or a
    // partial run, and gives its blocks back too.
    let error = bench_decode(&mut device, &[1, 2], 5, 1).expect_err("the cache is full");
    assert!(error.to_string().contains("KV cache is full"), "{error}");
    assert_eq!(device.free_blocks(), 4);
}

#[test]
fn tp_2_shards_on_the_harness_sum_over_the_fallback_collectives_to_the_cpu_engines_logits() {
    // `infer smoke`'s "TP 2 on one GPU through the fallback collectives", with the harness
    // standing in for the GPU: each rank a Megatron shard (half the heads, half the MLP),
    // its output and down projections summed over real TCP sockets and shared memory.
    let model = synthetic(None, RopeStyle::Interleaved);
    let prompt: Vec<u32> = vec![3, 17, 42, 5, 79, 0, 23];
    let mut cache = model.new_cache();
    let (mut inputs, mut expected) = (vec![prompt.clone()], Vec::new());
    for _ in 0..3 {
        let logits = model
            .forward(&mut [SequenceInput {
                tokens: inputs.last().expect("an input"),
                cache: &mut cache,
                all_logits: false,
            }])
            .expect("cpu step")
            .remove(0);
        inputs.push(vec![argmax(&logits)]);
        expected.push(logits);
    }
    inputs.pop();
    for transport in [Transport::Tcp, Transport::Shm] {
        let per_rank = with_group(2, transport, |comm| {
            let shard = model.shard(comm.rank(), 2, 0, 2).expect("a TP 2 shard");
            let mut device = BackendModel::new(KernelBackend::new(host()), &shard, 64)
                .unwrap_or_else(|e| panic!("{e:#}"));
            // Without its group the shard refuses to run (it would give half sums).
            let error = device
                .forward(&mut [(&mut DeviceSequence::default(), &[1])])
                .expect_err("no group");
            assert!(error.to_string().contains("needs its TP group"), "{error}");
            let mut sequence = DeviceSequence::default();
            inputs
                .iter()
                .map(|input| {
                    device
                        .forward_tp(&mut [(&mut sequence, input)], Some(&mut *comm))
                        .unwrap_or_else(|e| panic!("{e:#}"))
                        .remove(0)
                })
                .collect::<Vec<_>>()
        });
        assert_eq!(
            per_rank[0], per_rank[1],
            "{transport:?}: the ranks' logits differ"
        );
        for (step, (got, want)) in per_rank[0].iter().zip(&expected).enumerate() {
            let error = nmse(got, want);
            assert!(error <= 1e-3, "{transport:?} step {step}: NMSE {error:.2e}");
            if margin(want) > 0.1 {
                assert_eq!(argmax(got), argmax(want), "{transport:?} step {step}");
            }
        }
    }
}
