//! One engine on one process: a model, its tokenizer and a thread pool, and the generation
//! loop (prefill, then decode token by token with sampling, streaming and stop conditions).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

use super::chat::{ChatMessage, render};
use super::gguf::GgufFile;
use super::llama::{Llama, SequenceInput};
use super::sampling::{Sampler, SamplingParams};
use super::tokenizer::Tokenizer;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached (or the context is full).
    Length,
}

/// The result of one generation, with timings. `infer generate --json` output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    /// Generated token ids (the stop token excluded).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

/// Wall-clock timings of a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Time to process the prompt and produce the first token (TTFT), seconds.
    pub prefill_secs: f64,
    /// Time of the remaining decode steps, seconds.
    pub decode_secs: f64,
    /// Prompt tokens per second of the prefill.
    pub prefill_tokens_per_sec: f64,
    /// Generated tokens per second after the first (1 / TPOT).
    pub decode_tokens_per_sec: f64,
}

/// A loaded model ready to generate.
pub struct Engine {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    /// How the model was named (a path).
    pub name: String,
    pool: rayon::ThreadPool,
}

impl Engine {
    /// Loads a `.gguf` file or a Hugging Face directory and builds a pool of `threads`
    /// threads (0: one per available core).
    ///
    /// Errors: any load error of the model or tokenizer, naming the file.
    pub fn load(path: &Path, threads: usize) -> Result<Engine> {
        let (model, tokenizer) = if path.is_dir() {
            (
                super::safetensors::load_llama(path)?,
                Tokenizer::from_dir(path)?,
            )
        } else {
            let file = Arc::new(GgufFile::open(path)?);
            let model = Llama::from_gguf(&file)
                .with_context(|| format!("failed to load `{}`", path.display()))?;
            let tokenizer = Tokenizer::from_gguf(&file.header)
                .with_context(|| format!("failed to read the tokenizer of `{}`", path.display()))?;
            (model, tokenizer)
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("infer-worker-{i}"))
            .build()
            .map_err(|e| anyhow!("failed to start the thread pool: {e}"))?;
        Ok(Engine {
            model,
            tokenizer,
            name: path.display().to_string(),
            pool,
        })
    }

    /// Threads of the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on the engine's thread pool (every kernel inside uses it).
    pub fn install<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.pool.install(f)
    }

    /// The prompt for `messages` through the model's chat template. Errors: no template, or
    /// the template failed.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.tokenizer.chat_template.as_deref().ok_or_else(|| {
            anyhow!("the model has no chat template; send a plain prompt instead")
        })?;
        let token_text =
            |id: Option<u32>| id.and_then(|i| self.tokenizer.token(i)).unwrap_or_default();
        render(
            template,
            messages,
            true,
            &token_text(self.tokenizer.bos_id),
            &token_text(self.tokenizer.eos_ids.first().copied()),
        )
    }

    /// Generates from `prompt_tokens`, calling `on_text` with each newly complete piece of text.
    ///
    /// Errors: an empty prompt, a prompt longer than the context, a forward-pass error.
    pub fn generate(
        &self,
        prompt_tokens: &[u32],
        params: &SamplingParams,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Generation> {
        if prompt_tokens.is_empty() {
            return Err(anyhow!("the prompt is empty"));
        }
        let max_context = self.model.config.max_context_tokens;
        if prompt_tokens.len() >= max_context {
            return Err(anyhow!(
                "the prompt has {} tokens; the model's context is {max_context}",
                prompt_tokens.len()
            ));
        }
        self.install(|| {
            let mut sampler = Sampler::new(params);
            let mut cache = self.model.new_cache();
            let mut stream = self.tokenizer.stream();
            let mut text = String::new();
            let mut tokens = Vec::new();
            let start = Instant::now();
            let mut logits = self.model.forward(&mut [SequenceInput {
                tokens: prompt_tokens,
                cache: &mut cache,
                all_logits: false,
            }])?;
            let mut first_token_at = None;
            let mut finish_reason = FinishReason::Length;
            while tokens.len() < params.max_tokens {
                let next = sampler.sample(&logits[0]);
                first_token_at.get_or_insert_with(Instant::now);
                if self.tokenizer.eos_ids.contains(&next) {
                    finish_reason = FinishReason::Stop;
                    break;
                }
                tokens.push(next);
                let piece = stream.push(next)?;
                text.push_str(&piece);
                if let Some(cut) = params
                    .stop
                    .iter()
                    .filter_map(|s| text.find(s.as_str()))
                    .min()
                {
                    // Emit only what precedes the stop string.
                    let emitted_before = text.len() - piece.len();
                    if cut > emitted_before {
                        on_text(&text[emitted_before..cut]);
                    }
                    text.truncate(cut);
                    finish_reason = FinishReason::Stop;
                    break;
                }
                on_text(&piece);
                if tokens.len() >= params.max_tokens
                    || prompt_tokens.len() + tokens.len() >= max_context
                {
                    break;
                }
                logits = self.model.forward(&mut [SequenceInput {
                    tokens: &[next],
                    cache: &mut cache,
                    all_logits: false,
                }])?;
            }
            let end = Instant::now();
            let first = first_token_at.unwrap_or(end);
            let prefill_secs = (first - start).as_secs_f64();
            let decode_secs = (end - first).as_secs_f64();
            let decode_steps = tokens.len().saturating_sub(1) as f64;
            Ok(Generation {
                prompt_tokens: prompt_tokens.to_vec(),
                tokens,
                text,
                finish_reason,
                timings: Timings {
                    prefill_secs,
                    decode_secs,
                    prefill_tokens_per_sec: prompt_tokens.len() as f64 / prefill_secs.max(1e-9),
                    decode_tokens_per_sec: if decode_steps > 0.0 {
                        decode_steps / decode_secs.max(1e-9)
                    } else {
                        0.0
                    },
                },
            })
        })
    }
}
