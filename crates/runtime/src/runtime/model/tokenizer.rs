//! Tokenizers from GGUF metadata (`tokenizer.ggml.*`, byte-level BPE with the model's
//! pre-tokenizer) or from a Hugging Face `tokenizer.json`, both as a `tokenizers::Tokenizer`,
//! plus the model's special tokens and chat template; and back to a `tokenizer.json` that
//! encodes as the engine does.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::runtime::formats::gguf::{Header, Value};

/// Llama 3's pre-tokenizer regex (`llama-bpe` in llama.cpp; `tokenizer.json` of Llama 3).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer regex (`qwen2` in llama.cpp).
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the model's special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner.get_vocab_size(true)`, counted once: the `tokenizers` crate builds (clones)
    /// the whole vocabulary map to count it.
    vocab_size: usize,
    /// Beginning-of-sequence token, when the model has one.
    pub bos_id: Option<u32>,
    /// Tokens that end generation (`eos`, and `<|im_end|>`/`<|eot_id|>` style end-of-turn).
    pub eos_ids: Vec<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The Jinja chat template, when the model ships one.
    pub chat_template: Option<String>,
}

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` name stands for (each the one its
/// model's `tokenizer.json` spells).
///
/// Errors: a name not supported (listed), a bad regex.
fn pre_tokenizer_for(pre: &str) -> Result<Sequence> {
    let byte_level =
        |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerWrapper::Split(
            Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| anyhow!("bad pre-tokenizer regex: {e}"))?,
        ))
    };
    Ok(match pre {
        // SmolLM: digits one by one, then GPT-2's byte-level regex (its tokenizer.json).
        "smollm" => Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ]),
        "gpt2" | "default" | "gpt-2" => Sequence::new(vec![byte_level(true)]),
        "llama-bpe" | "llama3" | "llama-v3" => {
            Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)])
        }
        "qwen2" => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]),
        other => bail!(
            "pre-tokenizer `{other}` is not supported; supported: smollm, gpt2, llama-bpe, qwen2"
        ),
    })
}

/// A post-processor that puts `bos` (id `bos_id`) before each sequence: `<bos> A` alone,
/// `<bos> A <bos> B` for a pair (the second part of type 1), as Llama 3's `tokenizer.json`
/// does. Built from its JSON form, which takes any token text (the template strings of the
/// builder cannot hold a `:`).
///
/// Errors: the `tokenizers` crate rejects the template (it is built for its JSON form).
fn bos_template(bos: &str, bos_id: u32) -> Result<TemplateProcessing> {
    let special =
        |type_id: u32| serde_json::json!({"SpecialToken": {"id": bos, "type_id": type_id}});
    let sequence =
        |id: &str, type_id: u32| serde_json::json!({"Sequence": {"id": id, "type_id": type_id}});
    serde_json::from_value(serde_json::json!({
        "type": "TemplateProcessing",
        "single": [special(0), sequence("A", 0)],
        "pair": [special(0), sequence("A", 0), special(1), sequence("B", 1)],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }))
    .context("failed to build the BOS post-processor")
}

/// The ids that end a generation: the header's EOS and EOT ids, and the usual end-of-turn
/// tokens when the vocabulary (`tokens`) has them; sorted, without repeats.
fn eos_ids_of(header: &Header, tokens: &[String]) -> Vec<u32> {
    let id = |key: &str| {
        header
            .metadata
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as u32)
    };
    let mut eos_ids: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
    if let Some(eot) = id("tokenizer.ggml.eot_token_id") {
        eos_ids.push(eot);
    }
    for end_of_turn in ["<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"] {
        if let Some(position) = tokens.iter().position(|t| t == end_of_turn) {
            eos_ids.push(position as u32);
        }
    }
    eos_ids.sort_unstable();
    eos_ids.dedup();
    eos_ids
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    ///
    /// Errors: a tokenizer model other than `gpt2` (byte-level BPE), an unknown pre-tokenizer
    /// (named), or missing `tokens`/`merges`.
    pub fn from_gguf(header: &Header) -> Result<Tokenizer> {
        let model = header.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            bail!(
                "tokenizer model `{model}` is not supported yet: the engine reads byte-level BPE (`gpt2`) GGUF tokenizers"
            );
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            match header.metadata.get(key) {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| anyhow!("`{key}` holds a non-string"))
                    })
                    .collect(),
                _ => bail!("GGUF metadata `{key}` is missing or not an array"),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| anyhow!("malformed merge `{m}`"))
            })
            .collect::<Result<_>>()?;
        let token_types: Vec<i64> = match header.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| if let Value::I32(t) = v { *t as i64 } else { 1 })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let vocab: ahash::AHashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| anyhow!("failed to build the BPE tokenizer: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = header
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let pre_tokenizer = pre_tokenizer_for(pre)?;
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) and user-defined (4) tokens match as whole strings before BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(token, t)| AddedToken::from(token.clone(), *t == 3))
            .collect();
        inner.add_special_tokens(&specials);

        let id = |key: &str| {
            header
                .metadata
                .get(key)
                .and_then(Value::as_u64)
                .map(|v| v as u32)
        };
        let eos_ids = eos_ids_of(header, &tokens);
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_ids,
            add_bos: matches!(
                header.metadata.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            chat_template: header
                .metadata
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    /// A byte-level tokenizer of `vocab_size` ids with no merges, for models without one
    /// (random weights, [`super::dummy`]): ids 0..256 are the 256 bytes in GPT-2's
    /// byte-level alphabet (so any text encodes, one id per byte, and decodes back), and
    /// every other id is the text `<|dummy_N|>`. No BOS, no end-of-sequence token, no chat
    /// template.
    ///
    /// Errors: `vocab_size` under 256.
    pub fn byte_level(vocab_size: usize) -> Result<Tokenizer> {
        if vocab_size < 256 {
            bail!("a byte-level tokenizer needs at least 256 ids, not {vocab_size}");
        }
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let mut vocab: ahash::AHashMap<String, u32> = alphabet
            .iter()
            .enumerate()
            .map(|(id, c)| (c.to_string(), id as u32))
            .collect();
        for id in alphabet.len()..vocab_size {
            vocab.insert(format!("<|dummy_{id}|>"), id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .map_err(|e| anyhow!("failed to build the byte-level tokenizer: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(vec![PreTokenizerWrapper::ByteLevel(
            ByteLevel::new(false, true, false),
        )])));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id: None,
            eos_ids: Vec::new(),
            add_bos: false,
            chat_template: None,
        })
    }

    /// Loads `tokenizer.json` (and `tokenizer_config.json` for the chat template and BOS) from
    /// a Hugging Face model directory. Errors: missing or malformed files.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("failed to load `{}`: {e}", path.display()))?;
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(text) => serde_json::from_str(&text)
                    .context("`tokenizer_config.json` is not valid JSON")?,
                Err(_) => serde_json::Value::Null,
            };
        let token_text = |key: &str| -> Option<String> {
            match &config[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string),
                _ => None,
            }
        };
        let mut eos_ids: Vec<u32> = token_text("eos_token")
            .and_then(|t| inner.token_to_id(&t))
            .into_iter()
            .collect();
        for end_of_turn in ["<|im_end|>", "<|eot_id|>", "<|end|>"] {
            eos_ids.extend(inner.token_to_id(end_of_turn));
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Ok(Tokenizer {
            bos_id: token_text("bos_token").and_then(|t| inner.token_to_id(&t)),
            eos_ids,
            add_bos: config["add_bos_token"].as_bool().unwrap_or(false),
            chat_template: config["chat_template"].as_str().map(str::to_string),
            vocab_size: inner.get_vocab_size(true),
            inner,
        })
    }

    /// Token ids of `text`; special-token strings (`<|im_start|>`) map to their ids. Adds
    /// BOS when the model asks for it and `add_bos` is set.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_bos
            && self.add_bos
            && let Some(bos) = self.bos_id
        {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, special tokens included unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    /// The string of one token id, as the vocabulary spells it.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary string.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json` ([`Tokenizer::hf_json`]).
    /// Errors: I/O or serialization.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.hf_json()?)
            .with_context(|| format!("failed to write `{}`", path.display()))
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` (pretty JSON): vocabulary, merges,
    /// added tokens, pre-tokenizer and decoder, and a post-processor that adds BOS exactly
    /// when [`Tokenizer::encode`] does, so that `encode(text, add_special_tokens)` there
    /// gives `encode(text, add_special_tokens)`'s ids here.
    ///
    /// Errors: serialization, or a BOS id outside the vocabulary.
    pub fn hf_json(&self) -> Result<String> {
        let mut hf = self.inner.clone();
        match self.bos_id.filter(|_| self.add_bos) {
            Some(bos_id) => {
                let bos = self
                    .token(bos_id)
                    .ok_or_else(|| anyhow!("the BOS id {bos_id} is not in the vocabulary"))?;
                hf.with_post_processor(Some(bos_template(&bos, bos_id)?));
            }
            None => {
                hf.with_post_processor(None::<TemplateProcessing>);
            }
        }
        hf.to_string(true)
            .map_err(|e| anyhow!("failed to serialize the tokenizer: {e}"))
    }

    /// The added tokens (special and user-defined ones, matched whole before BPE) with their
    /// ids, in id order.
    pub fn added_tokens(&self) -> Vec<(u32, AddedToken)> {
        let mut added: Vec<(u32, AddedToken)> =
            self.inner.get_added_tokens_decoder().into_iter().collect();
        added.sort_unstable_by_key(|(id, _)| *id);
        added
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A streaming decoder that never splits a UTF-8 character: each step yields the new text,
    /// or nothing while a character is incomplete.
    pub fn stream(&self) -> TextStream {
        TextStream::default()
    }
}

/// Incremental detokenization (see [`Tokenizer::stream`]). It holds no reference to the
/// tokenizer, so it can live beside the owner of one.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted_bytes: usize,
    /// Whether special tokens are part of the text (vLLM's `skip_special_tokens: false`).
    keep_special: bool,
}

impl TextStream {
    /// A stream that leaves special tokens out of the text when `skip_special` (the
    /// default), or spells them.
    pub fn new(skip_special: bool) -> TextStream {
        TextStream {
            keep_special: !skip_special,
            ..TextStream::default()
        }
    }

    /// Adds `id` and returns the text that became complete (possibly empty). A trailing
    /// U+FFFD means a character is still incomplete, so it is held back.
    ///
    /// Errors: `tokenizer` cannot decode the ids.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids, !self.keep_special)?;
        if text.ends_with('\u{FFFD}')
            || text.len() < self.emitted_bytes
            || !text.is_char_boundary(self.emitted_bytes)
        {
            return Ok(String::new());
        }
        let new = text[self.emitted_bytes..].to_string();
        self.emitted_bytes = text.len();
        Ok(new)
    }
}
