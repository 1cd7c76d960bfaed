//! Hugging Face `config.json` → [`ModelSpec`], for real checkpoint directories and for the
//! `[config]` table of `profiles/models/*.toml` (which copies a real `config.json` verbatim).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::plan::model::{Architecture, Dtype, MlaSpec, ModelSpec, MoeSpec};

/// Builds a spec from a parsed `config.json`. `name` and `serve_id` label it.
///
/// Errors: an unsupported `model_type` (named), or a required key missing or not a number.
pub(crate) fn spec_from_config(config: &Value, name: &str, serve_id: &str) -> Result<ModelSpec> {
    let architecture = architecture_of(config)?;
    let int = |key: &str| required_int(config, key);
    let opt_int = |key: &str| config.get(key).and_then(Value::as_u64);
    let flag = |key: &str| config.get(key).and_then(Value::as_bool);

    let hidden_size = int("hidden_size")?;
    let n_heads = int("num_attention_heads")?;
    let n_kv_heads = opt_int("num_key_value_heads").unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        bail!(
            "`config.json`: `num_attention_heads` ({n_heads}) must be a positive multiple of `num_key_value_heads` ({n_kv_heads})"
        );
    }
    let head_dim = opt_int("head_dim").unwrap_or(hidden_size / n_heads);
    let intermediate_size = int("intermediate_size")?;
    let moe = moe_spec(config, architecture, intermediate_size)?;
    let mla = mla_spec(config)?;
    let (native_dtype, expert_dtype) = dtypes(config)?;
    let qkv_bias = match architecture {
        Architecture::Qwen2 => true,
        _ => flag("attention_bias").unwrap_or(false),
    };
    Ok(ModelSpec {
        name: name.to_string(),
        serve_id: serve_id.to_string(),
        architecture,
        hidden_size,
        intermediate_size,
        n_layers: int("num_hidden_layers")?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size: int("vocab_size")?,
        tie_word_embeddings: flag("tie_word_embeddings").unwrap_or(false),
        qkv_bias,
        o_bias: architecture == Architecture::GptOss,
        qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe),
        max_position_embeddings: opt_int("max_position_embeddings").unwrap_or(4096),
        moe,
        mla,
        native_dtype,
        expert_dtype,
        file_weight_bytes: None,
    })
}

/// The architecture `model_type` names. Errors: no `model_type`, or one not supported
/// (named, with the supported list).
fn architecture_of(config: &Value) -> Result<Architecture> {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .context("`config.json` has no `model_type`")?;
    Ok(match model_type {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "mixtral" => Architecture::Mixtral,
        "qwen3_moe" => Architecture::Qwen3Moe,
        "deepseek_v3" => Architecture::DeepseekV3,
        "gpt_oss" => Architecture::GptOss,
        other => bail!(
            "unsupported architecture `{other}`; supported: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt_oss"
        ),
    })
}

/// The non-negative integer at `key`. Errors: the key is missing or not one.
fn required_int(config: &Value, key: &str) -> Result<u64> {
    config.get(key).and_then(Value::as_u64).with_context(|| {
        format!("`config.json` key `{key}` is missing or not a non-negative integer")
    })
}

/// The mixture of experts, when the config has experts (`num_local_experts`,
/// `num_experts` or `n_routed_experts` above 0); expert sizes default to
/// `intermediate_size`. Errors: experts without `num_experts_per_tok`.
fn moe_spec(
    config: &Value,
    architecture: Architecture,
    intermediate_size: u64,
) -> Result<Option<MoeSpec>> {
    let int = |key: &str| required_int(config, key);
    let opt_int = |key: &str| config.get(key).and_then(Value::as_u64);
    let n_experts = opt_int("num_local_experts")
        .or(opt_int("num_experts"))
        .or(opt_int("n_routed_experts"));
    Ok(match n_experts {
        Some(n_experts) if n_experts > 0 => Some(MoeSpec {
            n_experts,
            n_experts_per_token: int("num_experts_per_tok")?,
            expert_intermediate_size: opt_int("moe_intermediate_size").unwrap_or(intermediate_size),
            n_shared_experts: opt_int("n_shared_experts").unwrap_or(0),
            n_dense_layers: opt_int("first_k_dense_replace").unwrap_or(0),
            expert_bias: architecture == Architecture::GptOss,
        }),
        _ => None,
    })
}

/// Multi-head latent attention, when the config has `kv_lora_rank`. Errors: MLA without
/// its head dimensions.
fn mla_spec(config: &Value) -> Result<Option<MlaSpec>> {
    let int = |key: &str| required_int(config, key);
    let opt_int = |key: &str| config.get(key).and_then(Value::as_u64);
    Ok(match opt_int("kv_lora_rank") {
        Some(kv_lora_rank) => Some(MlaSpec {
            q_lora_rank: opt_int("q_lora_rank"),
            kv_lora_rank,
            qk_nope_head_dim: int("qk_nope_head_dim")?,
            qk_rope_head_dim: int("qk_rope_head_dim")?,
            v_head_dim: int("v_head_dim")?,
        }),
        None => None,
    })
}

/// The weights' dtype and the experts' (when they differ), from
/// `quantization_config.quant_method` and `torch_dtype` (bf16 when absent or unknown).
/// Errors: a quantization method not supported (named).
fn dtypes(config: &Value) -> Result<(Dtype, Option<Dtype>)> {
    let quant_method = config
        .pointer("/quantization_config/quant_method")
        .and_then(Value::as_str);
    let torch_dtype = config
        .get("torch_dtype")
        .and_then(Value::as_str)
        .unwrap_or("bfloat16");
    Ok(match quant_method {
        Some("fp8") => (Dtype::Fp8, None),
        Some("mxfp4") => (
            torch_dtype.parse().unwrap_or(Dtype::Bf16),
            Some(Dtype::Mxfp4),
        ),
        Some("awq" | "gptq") => (Dtype::Int4, None),
        Some(other) => bail!(
            "unsupported `quantization_config.quant_method` `{other}`; supported: fp8, mxfp4, awq, gptq"
        ),
        None => (torch_dtype.parse().unwrap_or(Dtype::Bf16), None),
    })
}

/// Loads a checkpoint directory (or its `config.json`): the spec from `config.json`, and the
/// exact weight bytes from the headers of its `*.safetensors` files when there are any.
///
/// Errors: unreadable or malformed `config.json`, a malformed safetensors header.
pub(crate) fn load_dir(path: &Path) -> Result<ModelSpec> {
    let (dir, config_path) = if path.is_dir() {
        (path.to_path_buf(), path.join("config.json"))
    } else {
        (
            path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            path.to_path_buf(),
        )
    };
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("failed to read `{}`", config_path.display()))?;
    let config: Value = serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not valid JSON", config_path.display()))?;
    let name = dir
        .file_name()
        .map_or("model".to_string(), |n| n.to_string_lossy().into_owned());
    let mut spec = spec_from_config(&config, &name, &dir.display().to_string())
        .with_context(|| format!("failed to read the model in `{}`", dir.display()))?;
    spec.file_weight_bytes = safetensors_bytes(&dir)?;
    Ok(spec)
}

/// Sum of tensor bytes over every `*.safetensors` file in `dir`, from their headers only
/// (memory-mapped; the tensor data is not read). `None` when there are no such files.
fn safetensors_bytes(dir: &Path) -> Result<Option<u64>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("failed to list `{}`", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if files.is_empty() {
        return Ok(None);
    }
    files.sort();
    let mut total = 0u64;
    for file in files {
        let handle = std::fs::File::open(&file)
            .with_context(|| format!("failed to open `{}`", file.display()))?;
        // SAFETY: the file is opened read-only and only read while mapped; a concurrent
        // writer could change the bytes, which at worst makes the header invalid (an error).
        let map = unsafe { memmap2::Mmap::map(&handle) }
            .with_context(|| format!("failed to map `{}`", file.display()))?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
            anyhow::anyhow!(
                "`{}` is not a valid safetensors file: {e:?}",
                file.display()
            )
        })?;
        total += metadata
            .tensors()
            .values()
            .map(|info| (info.data_offsets.1 - info.data_offsets.0) as u64)
            .sum::<u64>();
    }
    Ok(Some(total))
}
