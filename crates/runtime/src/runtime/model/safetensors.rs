//! Hugging Face checkpoints: `config.json` plus `*.safetensors` (f32, f16, bf16) for
//! Llama, Mistral, Qwen2 and Qwen3, loaded into the same [`Llama`] as GGUF files. Hugging
//! Face Q/K weights are unpermuted, so these models use NeoX-style (rotate-half) RoPE.

use crate::runtime::formats::ggml::GgmlType;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use crate::runtime::model::llama::{Layer, Llama, Llama3Scaling, LlamaConfig, RopeStyle};
use crate::runtime::model::weights::Weight;

/// A tensor the checkpoint does not hold: optional ones (biases, Q/K norms, `lm_head`) are
/// told apart from other errors by this type, not by their text.
#[derive(Debug)]
struct MissingTensor(String);

impl std::fmt::Display for MissingTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the checkpoint has no tensor `{}`", self.0)
    }
}

impl std::error::Error for MissingTensor {}

/// Loads the Llama-family checkpoint in `dir`.
///
/// Errors: missing or malformed `config.json`, an unsupported `model_type` (named), a
/// missing tensor, an unsupported dtype (naming the tensor), a shape that disagrees with
/// the config (naming both).
pub fn load_llama(dir: &Path) -> Result<Llama> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("failed to read `{}`", config_path.display()))?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not valid JSON", config_path.display()))?;
    let config = config_from_json(&json)?;
    let mut tensors = read_tensors(dir)?;
    let c = config.clone();
    let token_embedding = take(
        &mut tensors,
        "model.embed_tokens.weight",
        c.vocab_size,
        c.hidden_size,
    )?;
    let layers = (0..c.n_layers)
        .map(|i| take_layer(&mut tensors, &c, i))
        .collect::<Result<Vec<Layer>>>()?;
    let output_norm = take(&mut tensors, "model.norm.weight", 1, c.hidden_size)?.to_f32();
    let output = match take(&mut tensors, "lm_head.weight", c.vocab_size, c.hidden_size) {
        Ok(head) if !json["tie_word_embeddings"].as_bool().unwrap_or(false) => head,
        Ok(_) => token_embedding.clone(),
        Err(error) if error.is::<MissingTensor>() => token_embedding.clone(),
        Err(error) => return Err(error),
    };
    Ok(Llama::new(
        config,
        token_embedding,
        layers,
        output_norm,
        output,
        None,
    ))
}

/// A checkpoint's tensors by name: `(type, shape, bytes)`.
type Tensors = HashMap<String, (GgmlType, Vec<usize>, Vec<u8>)>;

/// Every tensor of every `*.safetensors` file in `dir` (mapped, then copied out).
///
/// Errors: no such files, a file that cannot be opened, mapped or parsed, a dtype other
/// than F32, F16 or BF16 (naming the tensor).
fn read_tensors(dir: &Path) -> Result<Tensors> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("failed to list `{}`", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("`{}` has no `*.safetensors` files", dir.display());
    }
    let mut tensors = Tensors::new();
    for file in &files {
        let handle = std::fs::File::open(file)
            .with_context(|| format!("failed to open `{}`", file.display()))?;
        // SAFETY: read-only map of a file we only read.
        let map = unsafe { memmap2::Mmap::map(&handle) }
            .with_context(|| format!("failed to map `{}`", file.display()))?;
        let parsed = SafeTensors::deserialize(&map).map_err(|e| {
            anyhow!(
                "`{}` is not a valid safetensors file: {e:?}",
                file.display()
            )
        })?;
        for (name, view) in parsed.tensors() {
            let ty = match view.dtype() {
                StDtype::F32 => GgmlType::F32,
                StDtype::F16 => GgmlType::F16,
                StDtype::BF16 => GgmlType::Bf16,
                other => bail!("tensor `{name}` has dtype {other:?}; supported: F32, F16, BF16"),
            };
            tensors.insert(
                name.clone(),
                (ty, view.shape().to_vec(), view.data().to_vec()),
            );
        }
    }
    Ok(tensors)
}

/// Removes tensor `name` from `tensors` as a `rows × cols` [`Weight`] (a vector is one row).
///
/// Errors: [`MissingTensor`]; a shape that is not a matrix or disagrees with
/// `config.json` (naming both).
fn take(tensors: &mut Tensors, name: &str, rows: usize, cols: usize) -> Result<Weight> {
    let (ty, shape, bytes) = tensors
        .remove(name)
        .ok_or_else(|| MissingTensor(name.to_string()))?;
    let (r, c) = match shape.as_slice() {
        [r, c] => (*r, *c),
        [c] => (1, *c),
        other => bail!("tensor `{name}` has shape {other:?}; a matrix was expected"),
    };
    if (r, c) != (rows, cols) {
        bail!("tensor `{name}` is {r}×{c} but `config.json` implies {rows}×{cols}");
    }
    Weight::from_bytes(ty, rows, cols, bytes)
}

/// Decoder layer `i` (`model.layers.{i}.*`): norms, attention and MLP weights, and the
/// optional Q/K/V biases (Qwen2) and Q/K norms (Qwen3).
///
/// Errors: those of [`take`] for a required tensor.
fn take_layer(tensors: &mut Tensors, c: &LlamaConfig, i: usize) -> Result<Layer> {
    let (q_dim, kv_dim, hidden) = (
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.hidden_size,
    );
    let p = format!("model.layers.{i}");
    let mut matrix = |suffix: &str, rows: usize, cols: usize| {
        take(tensors, &format!("{p}.{suffix}"), rows, cols)
    };
    let attn_norm = matrix("input_layernorm.weight", 1, hidden)?.to_f32();
    let ffn_norm = matrix("post_attention_layernorm.weight", 1, hidden)?.to_f32();
    let mut optional = |suffix: &str, len: usize| -> Result<Option<Vec<f32>>> {
        match take(tensors, &format!("{p}.{suffix}"), 1, len) {
            Ok(weight) => Ok(Some(weight.to_f32())),
            Err(error) if error.is::<MissingTensor>() => Ok(None),
            Err(error) => Err(error),
        }
    };
    let bias_q = optional("self_attn.q_proj.bias", q_dim)?;
    let bias_k = optional("self_attn.k_proj.bias", kv_dim)?;
    let bias_v = optional("self_attn.v_proj.bias", kv_dim)?;
    let q_norm = optional("self_attn.q_norm.weight", c.head_dim)?;
    let k_norm = optional("self_attn.k_norm.weight", c.head_dim)?;
    let mut matrix = |suffix: &str, rows: usize, cols: usize| {
        take(tensors, &format!("{p}.{suffix}"), rows, cols)
    };
    Ok(Layer {
        attn_norm,
        wq: matrix("self_attn.q_proj.weight", q_dim, hidden)?,
        wk: matrix("self_attn.k_proj.weight", kv_dim, hidden)?,
        wv: matrix("self_attn.v_proj.weight", kv_dim, hidden)?,
        wo: matrix("self_attn.o_proj.weight", hidden, q_dim)?,
        bias_q,
        bias_k,
        bias_v,
        q_norm,
        k_norm,
        ffn_norm,
        w_gate: matrix("mlp.gate_proj.weight", c.intermediate_size, hidden)?,
        w_up: matrix("mlp.up_proj.weight", c.intermediate_size, hidden)?,
        w_down: matrix("mlp.down_proj.weight", hidden, c.intermediate_size)?,
        moe: None,
    })
}

/// `config.json` → [`LlamaConfig`] (NeoX RoPE; Llama 3 `rope_scaling` when present).
pub(crate) fn config_from_json(json: &Value) -> Result<LlamaConfig> {
    let model_type = json["model_type"].as_str().unwrap_or("");
    if !matches!(model_type, "llama" | "mistral" | "qwen2" | "qwen3") {
        bail!(
            "unsupported architecture `{model_type}`: the engine runs llama, mistral, qwen2 and qwen3 checkpoints"
        );
    }
    let int = |key: &str| -> Result<usize> {
        json[key]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("`config.json` key `{key}` is missing or not an integer"))
    };
    let hidden_size = int("hidden_size")?;
    let n_heads = int("num_attention_heads")?;
    let rope_scaling = match &json["rope_scaling"] {
        Value::Object(s) if s.get("rope_type").and_then(Value::as_str) == Some("llama3") => {
            Some(Llama3Scaling {
                factor: s.get("factor").and_then(Value::as_f64).unwrap_or(8.0) as f32,
                low_freq_factor: s
                    .get("low_freq_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(1.0) as f32,
                high_freq_factor: s
                    .get("high_freq_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(4.0) as f32,
                original_max_position_embeddings: s
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_f64)
                    .unwrap_or(8192.0) as f32,
            })
        }
        _ => None,
    };
    Ok(LlamaConfig {
        hidden_size,
        intermediate_size: int("intermediate_size")?,
        n_layers: int("num_hidden_layers")?,
        n_heads,
        n_kv_heads: int("num_key_value_heads").unwrap_or(n_heads),
        head_dim: int("head_dim").unwrap_or(hidden_size / n_heads.max(1)),
        vocab_size: int("vocab_size")?,
        rms_norm_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32,
        rope_theta: json["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
        rope_style: RopeStyle::Neox,
        rope_scaling,
        max_context_tokens: int("max_position_embeddings").unwrap_or(4096),
        n_experts: 0,
        n_experts_used: 0,
    })
}
