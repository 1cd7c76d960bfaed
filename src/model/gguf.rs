//! Planning specs from GGUF files: the shape from `<arch>.*` metadata and the exact weight
//! bytes from the tensor infos. The format itself lives in [`crate::runtime::formats::gguf`].

use std::path::Path;

use anyhow::{Result, bail};

use crate::plan::model::{Architecture, Dtype, ModelSpec, MoeSpec};
use crate::runtime::formats::gguf::{Header, Value};

/// Builds a planning spec from a GGUF file's header: shape from `<arch>.*` metadata, exact
/// weight bytes from the tensor infos.
///
/// Errors: an architecture other than `llama`, `mistral`, `qwen2`, `qwen3` (named), missing
/// keys, or an unsupported tensor type (naming the tensor).
pub fn spec_from_header(header: &Header, path: &Path) -> Result<ModelSpec> {
    let arch = header.str("general.architecture")?;
    let architecture = match arch {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        other => bail!(
            "unsupported GGUF architecture `{other}`; supported: llama, mistral, qwen2, qwen3"
        ),
    };
    let key = |name: &str| format!("{arch}.{name}");
    let hidden_size = header.u64(&key("embedding_length"))?;
    let n_heads = header.u64(&key("attention.head_count"))?;
    let n_kv_heads = header
        .u64(&key("attention.head_count_kv"))
        .unwrap_or(n_heads);
    let head_dim = header
        .u64(&key("attention.key_length"))
        .unwrap_or(hidden_size / n_heads.max(1));
    let vocab_size = match header.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens.len() as u64,
        _ => header.u64(&key("vocab_size"))?,
    };
    let n_experts = header.u64(&key("expert_count")).unwrap_or(0);
    let moe = (n_experts > 0)
        .then(|| -> Result<MoeSpec> {
            Ok(MoeSpec {
                n_experts,
                n_experts_per_token: header.u64(&key("expert_used_count"))?,
                expert_intermediate_size: header.u64(&key("feed_forward_length"))?,
                n_shared_experts: 0,
                n_dense_layers: 0,
                expert_bias: false,
            })
        })
        .transpose()?;
    let mut weight_bytes = 0u64;
    for tensor in &header.tensors {
        weight_bytes += tensor.n_bytes()?;
    }
    let name = header
        .metadata
        .get("general.name")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| {
            path.file_stem()
                .map_or("model".into(), |s| s.to_string_lossy().into_owned())
        });
    Ok(ModelSpec {
        name,
        serve_id: path.display().to_string(),
        architecture,
        hidden_size,
        intermediate_size: header.u64(&key("feed_forward_length"))?,
        n_layers: header.u64(&key("block_count"))?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        tie_word_embeddings: !header.tensors.iter().any(|t| t.name == "output.weight"),
        qkv_bias: header
            .tensors
            .iter()
            .any(|t| t.name.ends_with("attn_q.bias")),
        o_bias: false,
        qk_norm: header
            .tensors
            .iter()
            .any(|t| t.name.ends_with("attn_q_norm.weight")),
        max_position_embeddings: header.u64(&key("context_length")).unwrap_or(4096),
        moe,
        mla: None,
        native_dtype: Dtype::Gguf,
        expert_dtype: None,
        file_weight_bytes: Some(weight_bytes),
    })
}
