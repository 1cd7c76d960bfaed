//! Loading a [`ModelSpec`] from what `--model` names: a `.gguf` file, a Hugging Face
//! directory or `config.json`, or a profile in `profiles/models/` (embedded in the binary).
//! This is the I/O edge in front of the pure planner.

pub mod default;
pub mod gguf;
pub(crate) mod hf;

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::plan::model::ModelSpec;

/// The model profiles shipped in `profiles/models/`, by name.
pub const MODEL_PROFILES: &[(&str, &str)] = &[
    (
        "smollm2-135m",
        include_str!("../../profiles/models/smollm2-135m.toml"),
    ),
    (
        "llama-3.1-8b",
        include_str!("../../profiles/models/llama-3.1-8b.toml"),
    ),
    (
        "llama-3.1-70b",
        include_str!("../../profiles/models/llama-3.1-70b.toml"),
    ),
    (
        "llama-3.1-405b",
        include_str!("../../profiles/models/llama-3.1-405b.toml"),
    ),
    (
        "qwen2.5-7b",
        include_str!("../../profiles/models/qwen2.5-7b.toml"),
    ),
    (
        "qwen3-8b",
        include_str!("../../profiles/models/qwen3-8b.toml"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../../profiles/models/qwen3-235b-a22b.toml"),
    ),
    (
        "mixtral-8x7b",
        include_str!("../../profiles/models/mixtral-8x7b.toml"),
    ),
    (
        "deepseek-v3",
        include_str!("../../profiles/models/deepseek-v3.toml"),
    ),
    (
        "gpt-oss-120b",
        include_str!("../../profiles/models/gpt-oss-120b.toml"),
    ),
];

/// A model profile file: a real `config.json` under `[config]`, and where it came from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelProfile {
    /// Hugging Face repository id, used in the equivalent `vllm serve` command.
    pub hf_id: String,
    /// Where `config` was copied from.
    pub source: String,
    /// Parameter count the model's authors publish, checked against our formulas in tests.
    pub published_params: u64,
    /// The model's `config.json`, keys verbatim.
    pub config: toml::Table,
}

/// Parses the embedded profile `name`. Errors: unknown name (listing the known ones) or a
/// malformed profile.
pub fn profile(name: &str) -> Result<(ModelProfile, ModelSpec)> {
    let Some((_, text)) = MODEL_PROFILES.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = MODEL_PROFILES.iter().map(|(n, _)| *n).collect();
        bail!(
            "`{name}` is not a model file, a directory with `config.json`, or a model profile\n\
             hint: pass a `.gguf` file, a Hugging Face model directory, or one of: {}",
            known.join(", ")
        );
    };
    let profile: ModelProfile =
        toml::from_str(text).with_context(|| format!("model profile `{name}` is malformed"))?;
    let config = serde_json::to_value(&profile.config)
        .context("model profile config is not JSON-compatible")?;
    let spec = hf::spec_from_config(&config, name, &profile.hf_id)
        .with_context(|| format!("model profile `{name}`"))?;
    Ok((profile, spec))
}

/// Resolves `--model`: an existing `.gguf` file, an existing directory or `config.json`,
/// else a profile name.
pub fn load(model: &str) -> Result<ModelSpec> {
    let path = Path::new(model);
    if path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let header = crate::runtime::formats::gguf::Header::read_file(path)?;
        return gguf::spec_from_header(&header, path)
            .with_context(|| format!("failed to plan for `{}`", path.display()));
    }
    if path.is_dir() || (path.is_file() && path.file_name().is_some_and(|n| n == "config.json")) {
        return hf::load_dir(path);
    }
    if path.is_file() {
        bail!(
            "`{}` is neither a `.gguf` file nor a `config.json`\nhint: pass a GGUF file, a Hugging Face model directory, or a profile name",
            path.display()
        );
    }
    Ok(profile(model)?.1)
}

/// The spec `--model` names for planning: [`load`]'s, or with no `--model` (or
/// [`DEFAULT_ALIAS`]) the embedded default's GGUF header, fetched on first use.
///
/// Errors: as [`load`] and [`default::ensure`].
pub fn spec(model: Option<&str>, progress: &mut dyn FnMut(&str)) -> Result<ModelSpec> {
    match model {
        Some(name) if name != DEFAULT_ALIAS || Path::new(name).exists() => load(name),
        _ => load(&default::ensure(progress)?.display().to_string()),
    }
}

/// The name that means the embedded default model wherever a model is asked for
/// (`--model smollm2`), so examples run as written without a path into the cache.
pub const DEFAULT_ALIAS: &str = "smollm2";

/// The weights `--model` names for the engine: an existing `.gguf` file or model directory,
/// or (with no `--model`, or [`DEFAULT_ALIAS`]) the embedded default, fetched on first use.
/// Errors: a profile name (profiles have no weights) or a path that does not exist.
pub fn weights_path(
    model: Option<&str>,
    progress: &mut dyn FnMut(&str),
) -> Result<std::path::PathBuf> {
    let Some(model) = model else {
        return default::ensure(progress);
    };
    let path = Path::new(model);
    if path.is_file() || path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if model == DEFAULT_ALIAS {
        return default::ensure(progress);
    }
    if MODEL_PROFILES.iter().any(|(name, _)| *name == model) {
        bail!(
            "`{model}` is a planning profile without weights\nhint: pass a `.gguf` file or a model directory, or `--model smollm2` (or none) for the embedded SmolLM2"
        );
    }
    bail!(
        "`{model}` does not exist\nhint: pass a `.gguf` file or a Hugging Face model directory, or `--model smollm2` (or none) for the embedded SmolLM2"
    )
}

/// Random weights of `--model`'s shape (`--load-format dummy`): a profile name, a model
/// directory or `config.json`, or a GGUF file (its header), in `dtype`, with `num_layers`
/// layers when given (else the model's own), seed 0 (vLLM's default seed).
///
/// Errors: no `--model`, a model that does not resolve ([`load`]), a MoE or MLA model (random
/// weights cover dense Llama-family models), `num_layers` 0.
pub fn dummy(
    model: Option<&str>,
    dtype: crate::runtime::model::dummy::DummyDtype,
    num_layers: Option<usize>,
) -> Result<crate::runtime::model::dummy::DummyModel> {
    let Some(model) = model else {
        bail!(
            "--load-format dummy needs --model: a profile name (`llama-3.1-8b`), a `config.json` directory or a GGUF file, whose shape the random weights take"
        );
    };
    let spec = load(model)?;
    if spec.moe.is_some() || spec.mla.is_some() {
        bail!(
            "`{}` is a {} model: --load-format dummy builds dense Llama-family models (try llama-3.1-8b, qwen3-8b)",
            spec.name,
            if spec.mla.is_some() { "MLA" } else { "MoE" }
        );
    }
    if num_layers == Some(0) {
        bail!("--num-layers must be at least 1");
    }
    let size = |n: u64| n as usize;
    Ok(crate::runtime::model::dummy::DummyModel {
        // As given, so that the planner can read the same shape again (`spec_of`).
        name: model.to_string(),
        hidden_size: size(spec.hidden_size),
        intermediate_size: size(spec.intermediate_size),
        n_layers: num_layers.unwrap_or(size(spec.n_layers)),
        n_heads: size(spec.n_heads),
        n_kv_heads: size(spec.n_kv_heads),
        head_dim: size(spec.head_dim),
        vocab_size: size(spec.vocab_size),
        max_context_tokens: size(spec.max_position_embeddings),
        dtype,
        seed: 0,
    })
}

/// The planner's spec of the weights a launch runs: the file's, or the dummy model's shape
/// (its `--model` read again, with its layer count).
///
/// Errors: as [`load`].
pub fn spec_of(source: &crate::runtime::model::source::ModelSource) -> Result<ModelSpec> {
    use crate::runtime::model::source::ModelSource;
    match source {
        ModelSource::File(path) => load(&path.display().to_string()),
        ModelSource::Dummy(dummy) => {
            let mut spec = load(&dummy.name)?;
            spec.n_layers = dummy.n_layers as u64;
            spec.file_weight_bytes = None;
            Ok(spec)
        }
    }
}
