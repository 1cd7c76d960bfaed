//! One engine on one process: a model, its tokenizer and a thread pool, and the generation
//! loop (prefill, then decode token by token with sampling, streaming and stop conditions).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

use crate::runtime::cpu::quant::Numerics;
use crate::runtime::cpu::team::Team;
use crate::runtime::exec::executor::LocalExecutor;
use crate::runtime::formats::gguf::GgufFile;
use crate::runtime::model::chat::{ChatMessage, render};
use crate::runtime::model::llama::Llama;
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::Tokenizer;

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
    /// The forward pass's parallel loops ([`crate::runtime::cpu::team`]), as many threads as `pool`.
    team: Team,
}

impl Engine {
    /// Loads a `.gguf` file or a Hugging Face directory and builds a pool of `threads`
    /// threads (0: one per available core); the matrix products round as `numerics` says.
    ///
    /// Errors: any load error of the model or tokenizer, naming the file.
    pub fn load(path: &Path, threads: usize, numerics: Numerics) -> Result<Engine> {
        let (mut model, tokenizer) = if path.is_dir() {
            (
                crate::runtime::formats::safetensors::load_llama(path)?,
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
        let team = Team::new(pool.current_num_threads())
            .map_err(|e| anyhow!("failed to start the thread team: {e}"))?;
        model.set_numerics(numerics);
        pool.install(|| model.pack_weights());
        Ok(Engine {
            model,
            tokenizer,
            name: path.display().to_string(),
            pool,
            team,
        })
    }

    /// Threads of the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on the engine's threads (every kernel inside uses them: the forward pass's
    /// loops on its spinning team, anything else on its rayon pool).
    pub fn install<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.pool.install(|| self.team.enter(f))
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
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        crate::runtime::exec::executor::generate(
            &mut LocalExecutor::new(self),
            prompt_tokens,
            params,
            on_text,
        )
    }
}
