//! A GGUF model's tokenizer as a Hugging Face tokenizer directory: what
//! `transformers.AutoTokenizer.from_pretrained(DIR)` loads without the hub, so that a load
//! generator counts tokens as the engine does. It reads the header only, never the weights.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value as Json, json};

use super::tokenizer::Tokenizer;
use crate::runtime::formats::gguf::{Header, Value};

/// One file of a tokenizer directory: its name in the directory and its text (JSON).
#[derive(Clone, Debug)]
pub(crate) struct DirFile {
    pub name: &'static str,
    pub text: String,
}

/// Writes the tokenizer of the GGUF file `model` into `dir` (created when missing) as the
/// files of [`tokenizer_files`], and returns their paths.
///
/// A file of the same name already in `dir` is refused unless `overwrite` (all are checked
/// before anything is written); other files in `dir` are left alone. Each file appears
/// whole: it is written beside its place and renamed there.
///
/// Errors: `model` is not a GGUF file, or its tokenizer or architecture is not supported
/// (named); files in the way (named, with the fix); I/O (naming the path).
pub fn export_tokenizer(model: &Path, dir: &Path, overwrite: bool) -> Result<Vec<PathBuf>> {
    let header = Header::read_file(model)?;
    let tokenizer = Tokenizer::from_gguf(&header)
        .with_context(|| format!("failed to read the tokenizer of `{}`", model.display()))?;
    let files = tokenizer_files(&header, &tokenizer)
        .with_context(|| format!("failed to describe `{}` for Hugging Face", model.display()))?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("failed to create the directory `{}`", dir.display()))?;
    if !overwrite {
        let in_the_way: Vec<String> = files
            .iter()
            .map(|file| dir.join(file.name))
            .filter(|path| path.symlink_metadata().is_ok())
            .map(|path| format!("`{}`", path.display()))
            .collect();
        if !in_the_way.is_empty() {
            bail!(
                "{} already {}; nothing was written\nhint: pass --force to overwrite {}, or choose another directory",
                in_the_way.join(", "),
                if in_the_way.len() == 1 {
                    "exists"
                } else {
                    "exist"
                },
                if in_the_way.len() == 1 { "it" } else { "them" },
            );
        }
    }
    let mut written = Vec::with_capacity(files.len());
    for file in &files {
        let path = dir.join(file.name);
        write_whole(&path, &file.text)?;
        written.push(path);
    }
    Ok(written)
}

/// The files of a Hugging Face tokenizer directory for the GGUF `header` and its
/// `tokenizer` ([`Tokenizer::from_gguf`]), in the order they are written:
///
/// - `tokenizer.json`: [`Tokenizer::hf_json`] (encoding with special tokens gives
///   [`Tokenizer::encode`]`(text, true)`'s ids, BOS included when the model adds one);
/// - `tokenizer_config.json`: the class (`PreTrainedTokenizerFast`), the special tokens,
///   `add_bos_token`, the chat template, `model_max_length` (the model's context) and
///   `added_tokens_decoder`, as `transformers` writes them;
/// - `special_tokens_map.json`: the special tokens by role;
/// - `config.json`: the model's architecture and shape, enough for `AutoConfig`;
/// - `generation_config.json`: BOS and the ids that end a generation
///   ([`Tokenizer::eos_ids`]).
///
/// Errors: an architecture other than llama, mistral, qwen2, qwen3 (named), missing shape
/// keys, a special-token id outside the vocabulary.
pub(crate) fn tokenizer_files(header: &Header, tokenizer: &Tokenizer) -> Result<Vec<DirFile>> {
    let specials = SpecialTokens::of(header, tokenizer)?;
    let context_tokens = context_tokens(header)?;
    let mut tokenizer_config = specials.by_role();
    tokenizer_config.insert("add_bos_token".into(), json!(tokenizer.add_bos));
    tokenizer_config.insert("add_eos_token".into(), json!(false));
    tokenizer_config.insert(
        "added_tokens_decoder".into(),
        added_tokens_decoder(tokenizer),
    );
    if let Some(template) = &tokenizer.chat_template {
        tokenizer_config.insert("chat_template".into(), json!(template));
    }
    tokenizer_config.insert("clean_up_tokenization_spaces".into(), json!(false));
    tokenizer_config.insert("model_max_length".into(), json!(context_tokens));
    tokenizer_config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    let mut generation_config = Map::new();
    if let Some((_, id)) = &specials.bos {
        generation_config.insert("bos_token_id".into(), json!(id));
    }
    match tokenizer.eos_ids.as_slice() {
        [] => {}
        [id] => {
            generation_config.insert("eos_token_id".into(), json!(id));
        }
        ids => {
            generation_config.insert("eos_token_id".into(), json!(ids));
        }
    }
    let pretty = |value: Json| -> Result<String> {
        serde_json::to_string_pretty(&value).context("failed to serialize JSON")
    };
    Ok(vec![
        DirFile {
            name: "tokenizer.json",
            text: tokenizer.hf_json()?,
        },
        DirFile {
            name: "tokenizer_config.json",
            text: pretty(Json::Object(tokenizer_config))?,
        },
        DirFile {
            name: "special_tokens_map.json",
            text: pretty(Json::Object(specials.by_role()))?,
        },
        DirFile {
            name: "config.json",
            text: pretty(model_config(header, &specials, context_tokens)?)?,
        },
        DirFile {
            name: "generation_config.json",
            text: pretty(Json::Object(generation_config))?,
        },
    ])
}

/// The special tokens GGUF metadata names, each as (text, id) when the model has one.
struct SpecialTokens {
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
    unk: Option<(String, u32)>,
    pad: Option<(String, u32)>,
}

impl SpecialTokens {
    /// Reads `tokenizer.ggml.{bos,eos,unknown,padding}_token_id`.
    ///
    /// Errors: an id outside `tokenizer`'s vocabulary (naming the key).
    fn of(header: &Header, tokenizer: &Tokenizer) -> Result<SpecialTokens> {
        let token = |role: &str| -> Result<Option<(String, u32)>> {
            let key = format!("tokenizer.ggml.{role}_token_id");
            let Some(id) = header.metadata.get(&key).and_then(Value::as_u64) else {
                return Ok(None);
            };
            let id = u32::try_from(id).ok();
            let text = id.and_then(|id| tokenizer.token(id));
            match (text, id) {
                (Some(text), Some(id)) => Ok(Some((text, id))),
                _ => bail!("`{key}` is not an id of the vocabulary"),
            }
        };
        Ok(SpecialTokens {
            bos: token("bos")?,
            eos: token("eos")?,
            unk: token("unknown")?,
            pad: token("padding")?,
        })
    }

    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` (those the model has) as text.
    fn by_role(&self) -> Map<String, Json> {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("pad_token", &self.pad),
        ]
        .into_iter()
        .filter_map(|(role, token)| token.as_ref().map(|(text, _)| (role.into(), json!(text))))
        .collect()
    }
}

/// `added_tokens_decoder` as `transformers` writes it: each added token by its id (a
/// string), with its matching flags.
fn added_tokens_decoder(tokenizer: &Tokenizer) -> Json {
    let decoder: Map<String, Json> = tokenizer
        .added_tokens()
        .into_iter()
        .map(|(id, token)| {
            (
                id.to_string(),
                json!({
                    "content": token.content,
                    "lstrip": token.lstrip,
                    "normalized": token.normalized,
                    "rstrip": token.rstrip,
                    "single_word": token.single_word,
                    "special": token.special,
                }),
            )
        })
        .collect();
    Json::Object(decoder)
}

/// The longest context the engine gives the model, tokens: `{arch}.context_length`, else
/// 4096 (as [`super::llama::Llama`] reads it).
///
/// Errors: no `general.architecture`.
fn context_tokens(header: &Header) -> Result<u64> {
    let arch = header.str("general.architecture")?;
    Ok(header
        .u64(&format!("{arch}.context_length"))
        .unwrap_or(4096))
}

/// `config.json`: the architecture as `transformers` names it and the model's shape from
/// `{arch}.*` metadata; `vocab_size` is the embedding's rows (`{arch}.vocab_size`, else the
/// token count).
///
/// Errors: an architecture other than llama (Mixtral when it has experts), mistral, qwen2,
/// qwen3 (named), a missing shape key (named).
fn model_config(header: &Header, specials: &SpecialTokens, context_tokens: u64) -> Result<Json> {
    let arch = header.str("general.architecture")?;
    let key = |name: &str| format!("{arch}.{name}");
    let int = |name: &str| header.u64(&key(name));
    let n_experts = int("expert_count").unwrap_or(0);
    let (class, model_type) = match (arch, n_experts > 0) {
        ("llama", false) => ("LlamaForCausalLM", "llama"),
        ("llama", true) => ("MixtralForCausalLM", "mixtral"),
        ("mistral", _) => ("MistralForCausalLM", "mistral"),
        ("qwen2", _) => ("Qwen2ForCausalLM", "qwen2"),
        ("qwen3", _) => ("Qwen3ForCausalLM", "qwen3"),
        (other, _) => bail!(
            "architecture `{other}` has no Hugging Face config here; supported: llama, mistral, qwen2, qwen3"
        ),
    };
    let hidden_size = int("embedding_length")?;
    let n_heads = int("attention.head_count")?;
    let vocab_size = match (
        int("vocab_size"),
        header.metadata.get("tokenizer.ggml.tokens"),
    ) {
        (Ok(n), _) => n,
        (Err(_), Some(Value::Array(tokens))) => tokens.len() as u64,
        (Err(error), _) => return Err(error),
    };
    let mut config = Map::new();
    config.insert("architectures".into(), json!([class]));
    config.insert("model_type".into(), json!(model_type));
    config.insert("vocab_size".into(), json!(vocab_size));
    config.insert("max_position_embeddings".into(), json!(context_tokens));
    config.insert("hidden_size".into(), json!(hidden_size));
    config.insert(
        "intermediate_size".into(),
        json!(int("feed_forward_length")?),
    );
    config.insert("num_hidden_layers".into(), json!(int("block_count")?));
    config.insert("num_attention_heads".into(), json!(n_heads));
    config.insert(
        "num_key_value_heads".into(),
        json!(int("attention.head_count_kv").unwrap_or(n_heads)),
    );
    config.insert(
        "head_dim".into(),
        json!(int("attention.key_length").unwrap_or(hidden_size / n_heads.max(1))),
    );
    if n_experts > 0 {
        config.insert("num_local_experts".into(), json!(n_experts));
        config.insert(
            "num_experts_per_tok".into(),
            json!(int("expert_used_count")?),
        );
    }
    for (name, gguf_name) in [
        ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
        ("rope_theta", "rope.freq_base"),
    ] {
        if let Some(value) = float(header, &key(gguf_name)) {
            config.insert(name.into(), json!(value));
        }
    }
    config.insert(
        "tie_word_embeddings".into(),
        json!(!header.tensors.iter().any(|t| t.name == "output.weight")),
    );
    for (name, token) in [
        ("bos_token_id", &specials.bos),
        ("eos_token_id", &specials.eos),
    ] {
        if let Some((_, id)) = token {
            config.insert(name.into(), json!(id));
        }
    }
    Ok(Json::Object(config))
}

/// A float of the metadata as the decimal its file stored: an `f32` is printed as an `f32`
/// (`1e-5`, not `9.999999747378752e-6`).
fn float(header: &Header, key: &str) -> Option<f64> {
    match header.metadata.get(key)? {
        Value::F32(v) => v.to_string().parse().ok(),
        Value::F64(v) => Some(*v),
        _ => None,
    }
}

/// Writes `text` to `path` whole: into a hidden file beside it, renamed into place (a
/// symbolic link at `path` is replaced, not followed).
///
/// Errors: I/O, naming the path.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let staging = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let result = std::fs::write(&staging, text)
        .and_then(|()| std::fs::rename(&staging, path))
        .with_context(|| format!("failed to write `{}`", path.display()));
    if result.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A header with a tokenizer of single letters, `Ġ` and one merge (`Ġa`), `<s>` (id 0)
    /// as BOS and `</s>` (id 1) as EOS, and a small Llama shape.
    fn header(add_bos: bool) -> Header {
        let mut tokens = vec!["<s>".to_string(), "</s>".to_string()];
        tokens.extend(('a'..='z').map(String::from));
        tokens.extend(["Ġ".to_string(), "Ġa".to_string()]);
        let mut types = vec![Value::I32(3), Value::I32(3)];
        types.extend((2..tokens.len()).map(|_| Value::I32(1)));
        let metadata: BTreeMap<String, Value> = [
            ("general.architecture", Value::String("llama".into())),
            ("llama.context_length", Value::U32(2048)),
            ("llama.embedding_length", Value::U32(64)),
            ("llama.feed_forward_length", Value::U32(128)),
            ("llama.block_count", Value::U32(2)),
            ("llama.attention.head_count", Value::U32(4)),
            ("llama.attention.head_count_kv", Value::U32(2)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("gpt2".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            ("tokenizer.ggml.token_type", Value::Array(types)),
            (
                "tokenizer.ggml.merges",
                Value::Array(vec![Value::String("Ġ a".into())]),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(0)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(add_bos)),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect();
        Header {
            version: 3,
            metadata,
            tensors: Vec::new(),
            alignment_bytes: 32,
            data_offset_bytes: 0,
        }
    }

    fn file<'a>(files: &'a [DirFile], name: &str) -> &'a str {
        &files
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("no `{name}`"))
            .text
    }

    /// The written `tokenizer.json` adds BOS exactly when ours does: with and without
    /// `add_bos_token`, with and without special tokens asked for.
    #[test]
    fn tokenizer_json_adds_bos_as_we_do() {
        for add_bos in [true, false] {
            let header = header(add_bos);
            let ours = Tokenizer::from_gguf(&header).expect("tokenizer");
            let files = tokenizer_files(&header, &ours).expect("files");
            let hf = tokenizers::Tokenizer::from_bytes(file(&files, "tokenizer.json"))
                .expect("tokenizer.json loads");
            for text in ["a cab a", "<s>ab</s> a", ""] {
                for add_special in [true, false] {
                    let theirs = hf.encode(text, add_special).expect("encode");
                    assert_eq!(
                        theirs.get_ids(),
                        ours.encode(text, add_special).expect("encode"),
                        "{text:?}, add_bos_token {add_bos}, add_special_tokens {add_special}"
                    );
                }
            }
            let config: Json =
                serde_json::from_str(file(&files, "tokenizer_config.json")).expect("JSON");
            assert_eq!(config["add_bos_token"], json!(add_bos));
            assert_eq!(
                (&config["bos_token"], &config["eos_token"]),
                (&json!("<s>"), &json!("</s>"))
            );
            assert_eq!(config["added_tokens_decoder"]["1"]["content"], "</s>");
            assert_eq!(config["added_tokens_decoder"]["1"]["special"], true);
            assert_eq!(config["model_max_length"], 2048);
        }
    }

    #[test]
    fn config_json_has_the_shape_and_the_special_ids() {
        let header = header(true);
        let tokenizer = Tokenizer::from_gguf(&header).expect("tokenizer");
        let files = tokenizer_files(&header, &tokenizer).expect("files");
        let config: Json = serde_json::from_str(file(&files, "config.json")).expect("JSON");
        assert_eq!(
            config,
            json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 30,
                "max_position_embeddings": 2048,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": true,
                "bos_token_id": 0,
                "eos_token_id": 1,
            })
        );
    }

    #[test]
    fn unsupported_architectures_and_bad_ids_are_named() {
        let mut other = header(false);
        other
            .metadata
            .insert("general.architecture".into(), Value::String("phi3".into()));
        let tokenizer = Tokenizer::from_gguf(&other).expect("tokenizer");
        let error = tokenizer_files(&other, &tokenizer).expect_err("phi3");
        assert!(error.to_string().contains("`phi3`"), "{error}");
        let mut bad_id = header(false);
        bad_id
            .metadata
            .insert("tokenizer.ggml.eos_token_id".into(), Value::U32(1000));
        let tokenizer = Tokenizer::from_gguf(&bad_id).expect("tokenizer");
        let error = tokenizer_files(&bad_id, &tokenizer).expect_err("id 1000");
        assert!(
            error.to_string().contains("tokenizer.ggml.eos_token_id"),
            "{error}"
        );
    }
}
