//! Writes small synthetic Llama models with random weights in real formats: a Hugging Face
//! directory (`config.json` + `model.safetensors`, f32) and the same weights as GGUF (f32,
//! llama.cpp tensor names, Q/K rows permuted the way `convert_hf_to_gguf.py` permutes them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use infer_runtime::runtime::formats::gguf::{TensorInfo, Value, encode_header};

/// Shape of a synthetic model.
#[derive(Clone, Copy)]
pub struct Shape {
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab: usize,
    /// Qwen2-style: Q/K/V biases, NeoX RoPE in GGUF too (no permutation).
    pub qkv_bias: bool,
}

impl Shape {
    /// The small MoE shape the EP tests use (8 heads, 2 KV heads, vocabulary of 80).
    pub fn small_moe() -> Shape {
        Shape {
            hidden: 64,
            intermediate: 32,
            n_layers: 2,
            n_heads: 8,
            n_kv_heads: 2,
            vocab: 80,
            qkv_bias: false,
        }
    }

    /// A small dense shape that splits two ways under TP (4 heads, 2 KV heads) or PP (2
    /// layers), with a vocabulary of 60 single characters: the device-rank tests' model.
    pub fn tp2() -> Shape {
        Shape {
            hidden: 64,
            intermediate: 96,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            vocab: 60,
            qkv_bias: false,
        }
    }

    /// The width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }
}

/// Deterministic weights: `name → (shape, values)` in Hugging Face naming and layout.
pub fn weights(shape: &Shape, seed: u64) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut random = |n: usize, scale: f32, offset: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                offset + scale * ((state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
            })
            .collect()
    };
    let (h, i, d) = (shape.hidden, shape.intermediate, shape.head_dim());
    let (q_dim, kv_dim) = (shape.n_heads * d, shape.n_kv_heads * d);
    let mut w = BTreeMap::new();
    w.insert(
        "model.embed_tokens.weight".to_string(),
        (vec![shape.vocab, h], random(shape.vocab * h, 0.5, 0.0)),
    );
    for l in 0..shape.n_layers {
        let p = format!("model.layers.{l}");
        w.insert(
            format!("{p}.input_layernorm.weight"),
            (vec![h], random(h, 0.1, 1.0)),
        );
        w.insert(
            format!("{p}.post_attention_layernorm.weight"),
            (vec![h], random(h, 0.1, 1.0)),
        );
        w.insert(
            format!("{p}.self_attn.q_proj.weight"),
            (vec![q_dim, h], random(q_dim * h, 0.25, 0.0)),
        );
        w.insert(
            format!("{p}.self_attn.k_proj.weight"),
            (vec![kv_dim, h], random(kv_dim * h, 0.25, 0.0)),
        );
        w.insert(
            format!("{p}.self_attn.v_proj.weight"),
            (vec![kv_dim, h], random(kv_dim * h, 0.25, 0.0)),
        );
        w.insert(
            format!("{p}.self_attn.o_proj.weight"),
            (vec![h, q_dim], random(h * q_dim, 0.25, 0.0)),
        );
        if shape.qkv_bias {
            w.insert(
                format!("{p}.self_attn.q_proj.bias"),
                (vec![q_dim], random(q_dim, 0.1, 0.0)),
            );
            w.insert(
                format!("{p}.self_attn.k_proj.bias"),
                (vec![kv_dim], random(kv_dim, 0.1, 0.0)),
            );
            w.insert(
                format!("{p}.self_attn.v_proj.bias"),
                (vec![kv_dim], random(kv_dim, 0.1, 0.0)),
            );
        }
        w.insert(
            format!("{p}.mlp.gate_proj.weight"),
            (vec![i, h], random(i * h, 0.25, 0.0)),
        );
        w.insert(
            format!("{p}.mlp.up_proj.weight"),
            (vec![i, h], random(i * h, 0.25, 0.0)),
        );
        w.insert(
            format!("{p}.mlp.down_proj.weight"),
            (vec![h, i], random(h * i, 0.25, 0.0)),
        );
    }
    w.insert(
        "model.norm.weight".to_string(),
        (vec![h], random(h, 0.1, 1.0)),
    );
    w.insert(
        "lm_head.weight".to_string(),
        (vec![shape.vocab, h], random(shape.vocab * h, 0.5, 0.0)),
    );
    w
}

/// Writes `config.json` and `model.safetensors` into `dir`.
pub fn write_hf(dir: &Path, shape: &Shape, weights: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) {
    let config = serde_json::json!({
        "model_type": if shape.qkv_bias { "qwen2" } else { "llama" },
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.n_layers, "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads, "vocab_size": shape.vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "float32"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(name, (shape, values))| {
            (
                name.clone(),
                shape.clone(),
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(name, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .expect("view"),
            )
        })
        .collect();
    let serialized = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(dir.join("model.safetensors"), serialized).expect("write safetensors");
}

/// llama.cpp's converter permutation of Q/K rows, per head: new row `2i + j` is old row `j·d/2 + i`.
fn permute_rows(values: &[f32], n_heads: usize, n_cols: usize) -> Vec<f32> {
    let n_rows = values.len() / n_cols;
    let d = n_rows / n_heads;
    let mut out = vec![0f32; values.len()];
    for head in 0..n_heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let new_row = head * d + 2 * i + j;
                let old_row = head * d + j * (d / 2) + i;
                out[new_row * n_cols..(new_row + 1) * n_cols]
                    .copy_from_slice(&values[old_row * n_cols..(old_row + 1) * n_cols]);
            }
        }
    }
    out
}

/// Writes the same model as a GGUF v3 file at `path` (f32 tensors, 32-byte alignment).
pub fn write_gguf(path: &Path, shape: &Shape, weights: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) {
    write_gguf_with(path, shape, weights, &[]);
}

/// [`write_gguf`] with extra metadata entries (a tokenizer: [`tokenizer_metadata`]).
pub fn write_gguf_with(
    path: &Path,
    shape: &Shape,
    weights: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    extra: &[(String, Value)],
) {
    let arch = if shape.qkv_bias { "qwen2" } else { "llama" };
    let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    let mut add = |gguf_name: String, hf_name: &str, permute_heads: Option<usize>| {
        let (dims, values) = &weights[hf_name];
        let values = match permute_heads {
            Some(n_heads) if !shape.qkv_bias && dims.len() == 2 => {
                permute_rows(values, n_heads, dims[1])
            }
            _ => values.clone(),
        };
        // GGUF lists dimensions innermost first.
        tensors.push((
            gguf_name,
            dims.iter().rev().map(|&d| d as u64).collect(),
            values,
        ));
    };
    add(
        "token_embd.weight".into(),
        "model.embed_tokens.weight",
        None,
    );
    for l in 0..shape.n_layers {
        let p = format!("model.layers.{l}");
        add(
            format!("blk.{l}.attn_norm.weight"),
            &format!("{p}.input_layernorm.weight"),
            None,
        );
        add(
            format!("blk.{l}.ffn_norm.weight"),
            &format!("{p}.post_attention_layernorm.weight"),
            None,
        );
        add(
            format!("blk.{l}.attn_q.weight"),
            &format!("{p}.self_attn.q_proj.weight"),
            Some(shape.n_heads),
        );
        add(
            format!("blk.{l}.attn_k.weight"),
            &format!("{p}.self_attn.k_proj.weight"),
            Some(shape.n_kv_heads),
        );
        add(
            format!("blk.{l}.attn_v.weight"),
            &format!("{p}.self_attn.v_proj.weight"),
            None,
        );
        add(
            format!("blk.{l}.attn_output.weight"),
            &format!("{p}.self_attn.o_proj.weight"),
            None,
        );
        if shape.qkv_bias {
            add(
                format!("blk.{l}.attn_q.bias"),
                &format!("{p}.self_attn.q_proj.bias"),
                None,
            );
            add(
                format!("blk.{l}.attn_k.bias"),
                &format!("{p}.self_attn.k_proj.bias"),
                None,
            );
            add(
                format!("blk.{l}.attn_v.bias"),
                &format!("{p}.self_attn.v_proj.bias"),
                None,
            );
        }
        add(
            format!("blk.{l}.ffn_gate.weight"),
            &format!("{p}.mlp.gate_proj.weight"),
            None,
        );
        add(
            format!("blk.{l}.ffn_up.weight"),
            &format!("{p}.mlp.up_proj.weight"),
            None,
        );
        add(
            format!("blk.{l}.ffn_down.weight"),
            &format!("{p}.mlp.down_proj.weight"),
            None,
        );
    }
    add("output_norm.weight".into(), "model.norm.weight", None);
    add("output.weight".into(), "lm_head.weight", None);
    write_gguf_tensors_with(path, arch, shape, &tensors, extra);
}

/// Writes a GGUF file with Llama metadata for `shape` and the given f32 tensors.
pub fn write_gguf_tensors(
    path: &Path,
    arch: &str,
    shape: &Shape,
    tensors: &[(String, Vec<u64>, Vec<f32>)],
) {
    write_gguf_tensors_with(path, arch, shape, tensors, &[]);
}

/// [`write_gguf_tensors`] with extra metadata entries.
pub fn write_gguf_tensors_with(
    path: &Path,
    arch: &str,
    shape: &Shape,
    tensors: &[(String, Vec<u64>, Vec<f32>)],
    extra: &[(String, Value)],
) {
    let key = |k: &str| format!("{arch}.{k}");
    let mut metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (
            "general.name".to_string(),
            Value::String("synthetic".into()),
        ),
        (key("embedding_length"), Value::U32(shape.hidden as u32)),
        (
            key("feed_forward_length"),
            Value::U32(shape.intermediate as u32),
        ),
        (key("block_count"), Value::U32(shape.n_layers as u32)),
        (
            key("attention.head_count"),
            Value::U32(shape.n_heads as u32),
        ),
        (
            key("attention.head_count_kv"),
            Value::U32(shape.n_kv_heads as u32),
        ),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (key("rope.freq_base"), Value::F32(10000.0)),
        (key("context_length"), Value::U32(256)),
    ];
    metadata.extend(extra.iter().cloned());
    let mut infos = Vec::new();
    let mut offset = 0u64;
    for (name, dims, values) in tensors {
        infos.push(TensorInfo {
            name: name.clone(),
            dims: dims.clone(),
            type_id: 0,
            offset_bytes: offset,
        });
        offset += (values.len() as u64 * 4).div_ceil(32) * 32;
    }
    let metadata_refs: Vec<(&str, Value)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let mut bytes = encode_header(&metadata_refs, &infos);
    bytes.resize(bytes.len().div_ceil(32) * 32, 0);
    for (_, _, values) in tensors {
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        bytes.resize(bytes.len().div_ceil(32) * 32, 0);
    }
    std::fs::write(path, bytes).expect("write gguf");
}

/// Writes a Mixtral-style MoE model (every layer's MLP replaced by `n_experts` experts of
/// width `shape.intermediate`, `top_k` used per token) as GGUF, with random weights.
pub fn write_gguf_moe(path: &Path, shape: &Shape, n_experts: usize, top_k: usize, seed: u64) {
    let dense = weights(shape, seed);
    let mut state = seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    let mut random = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                0.25 * ((state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
            })
            .collect()
    };
    let (h, w) = (shape.hidden, shape.intermediate);
    let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    let copy = |tensors: &mut Vec<(String, Vec<u64>, Vec<f32>)>,
                gguf: String,
                hf: &str,
                heads: Option<usize>| {
        let (dims, values) = &dense[hf];
        let values = match heads {
            Some(n) => permute_rows(values, n, dims[1]),
            None => values.clone(),
        };
        tensors.push((gguf, dims.iter().rev().map(|&d| d as u64).collect(), values));
    };
    copy(
        &mut tensors,
        "token_embd.weight".into(),
        "model.embed_tokens.weight",
        None,
    );
    for l in 0..shape.n_layers {
        let p = format!("model.layers.{l}");
        copy(
            &mut tensors,
            format!("blk.{l}.attn_norm.weight"),
            &format!("{p}.input_layernorm.weight"),
            None,
        );
        copy(
            &mut tensors,
            format!("blk.{l}.ffn_norm.weight"),
            &format!("{p}.post_attention_layernorm.weight"),
            None,
        );
        copy(
            &mut tensors,
            format!("blk.{l}.attn_q.weight"),
            &format!("{p}.self_attn.q_proj.weight"),
            Some(shape.n_heads),
        );
        copy(
            &mut tensors,
            format!("blk.{l}.attn_k.weight"),
            &format!("{p}.self_attn.k_proj.weight"),
            Some(shape.n_kv_heads),
        );
        copy(
            &mut tensors,
            format!("blk.{l}.attn_v.weight"),
            &format!("{p}.self_attn.v_proj.weight"),
            None,
        );
        copy(
            &mut tensors,
            format!("blk.{l}.attn_output.weight"),
            &format!("{p}.self_attn.o_proj.weight"),
            None,
        );
        tensors.push((
            format!("blk.{l}.ffn_gate_inp.weight"),
            vec![h as u64, n_experts as u64],
            random(n_experts * h),
        ));
        tensors.push((
            format!("blk.{l}.ffn_gate_exps.weight"),
            vec![h as u64, w as u64, n_experts as u64],
            random(n_experts * w * h),
        ));
        tensors.push((
            format!("blk.{l}.ffn_up_exps.weight"),
            vec![h as u64, w as u64, n_experts as u64],
            random(n_experts * w * h),
        ));
        tensors.push((
            format!("blk.{l}.ffn_down_exps.weight"),
            vec![w as u64, h as u64, n_experts as u64],
            random(n_experts * h * w),
        ));
    }
    copy(
        &mut tensors,
        "output_norm.weight".into(),
        "model.norm.weight",
        None,
    );
    copy(&mut tensors, "output.weight".into(), "lm_head.weight", None);
    let extra = [
        (
            "llama.expert_count".to_string(),
            Value::U32(n_experts as u32),
        ),
        (
            "llama.expert_used_count".to_string(),
            Value::U32(top_k as u32),
        ),
    ];
    let mut extra = extra.to_vec();
    extra.extend(tokenizer_metadata(shape.vocab));
    write_gguf_tensors_with(path, "llama", shape, &tensors, &extra);
}

/// A byte-level BPE tokenizer of `vocab` single printable characters (`!` = id 0, `"` = 1,
/// …; at most 94), no merges and no end-of-sequence token, so a synthetic model can be
/// served: prompts of those characters encode one token per character.
pub fn tokenizer_metadata(vocab: usize) -> Vec<(String, Value)> {
    assert!(vocab <= 94, "only 94 printable ASCII characters");
    let tokens = (0..vocab)
        .map(|i| Value::String(char::from(b'!' + i as u8).to_string()))
        .collect();
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
    ]
}

/// A small Llama of [`Shape::tp2`] (seed 11), with a tokenizer of single characters, written
/// into `dir` as `tp2.gguf`; returns its path.
pub fn write_tp2_model(dir: &Path) -> PathBuf {
    let shape = Shape::tp2();
    let path = dir.join("tp2.gguf");
    write_gguf_with(
        &path,
        &shape,
        &weights(&shape, 11),
        &tokenizer_metadata(shape.vocab),
    );
    path
}
