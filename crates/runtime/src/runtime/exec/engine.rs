//! One engine on one process: a model, its tokenizer and a thread pool, and the generation
//! loop (prefill, then decode token by token with sampling, streaming and stop conditions).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};

use crate::runtime::cpu::quant::Numerics;
use crate::runtime::cpu::team::Team;
use std::collections::HashMap;

use crate::runtime::exec::executor::{Executor, Sampled, StepEntry, first_step_cache, sample};
pub use crate::runtime::exec::executor::{FinishReason, Generation, Timings};
use crate::runtime::model::chat::{ChatMessage, render_for};
use crate::runtime::model::kv::KvCache;
use crate::runtime::model::kv::KvPool;
use crate::runtime::model::llama::Llama;
use crate::runtime::model::llama::SequenceInput;
use crate::runtime::model::sampling::Sampler;
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::Tokenizer;

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

/// A rayon pool and a forward-pass team of `threads` threads each (0: one per core).
///
/// Errors: the threads cannot be started.
fn threads_of(threads: usize) -> Result<(rayon::ThreadPool, Team)> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("infer-worker-{i}"))
        .build()
        .map_err(|e| anyhow!("failed to start the thread pool: {e}"))?;
    let team = Team::new(pool.current_num_threads())
        .map_err(|e| anyhow!("failed to start the thread team: {e}"))?;
    Ok((pool, team))
}

impl Engine {
    /// Loads a `.gguf` file or a Hugging Face directory and builds a pool of `threads`
    /// threads (0: one per available core); the matrix products round as `numerics` says.
    ///
    /// Errors: any load error of the model or tokenizer, naming the file.
    pub fn load(path: &Path, threads: usize, numerics: Numerics) -> Result<Engine> {
        Engine::from_source(
            &crate::runtime::model::source::ModelSource::File(path.to_path_buf()),
            threads,
            numerics,
        )
    }

    /// [`Engine::load`] of any [`ModelSource`](crate::runtime::model::source::ModelSource):
    /// random weights are generated on the engine's threads.
    ///
    /// Errors: as [`Engine::load`]; a dummy shape the weight type cannot hold.
    pub fn from_source(
        source: &crate::runtime::model::source::ModelSource,
        threads: usize,
        numerics: Numerics,
    ) -> Result<Engine> {
        let (pool, team) = threads_of(threads)?;
        let (mut model, tokenizer) = pool.install(|| source.load())?;
        model.set_numerics(numerics);
        pool.install(|| model.pack_weights());
        Ok(Engine {
            model,
            tokenizer,
            name: source.name(),
            pool,
            team,
        })
    }

    /// The same model on a new pool and team of `threads` threads (0: one per core).
    ///
    /// Errors: the threads cannot be started.
    pub(crate) fn with_threads(self, threads: usize) -> Result<Engine> {
        let (pool, team) = threads_of(threads)?;
        Ok(Engine { pool, team, ..self })
    }

    /// Runs `f` on `n` one-thread pools and teams at once, one OS thread each, all on this
    /// engine's model (as `n` one-thread ranks of a host run side by side); each call's
    /// result, in order.
    ///
    /// Errors: the threads cannot be started, or one of them panicked.
    pub(crate) fn side_by_side<T: Send>(
        &self,
        n: usize,
        f: impl Fn(&Llama) -> T + Sync,
    ) -> Result<Vec<T>> {
        let lanes = (0..n).map(|_| threads_of(1)).collect::<Result<Vec<_>>>()?;
        let (model, f) = (&self.model, &f);
        std::thread::scope(|scope| {
            let running: Vec<_> = lanes
                .iter()
                .map(|(pool, team)| scope.spawn(move || pool.install(|| team.enter(|| f(model)))))
                .collect();
            running
                .into_iter()
                .map(|lane| {
                    lane.join()
                        .map_err(|_| anyhow!("a one-thread run beside the others panicked"))
                })
                .collect()
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
        render_for(&self.tokenizer, messages)?
            .ok_or_else(|| anyhow!("the model has no chat template; send a plain prompt instead"))
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

/// An [`Executor`] over one [`Engine`] in this process.
pub struct LocalExecutor<'e> {
    engine: &'e Engine,
    sequences: HashMap<u64, (KvCache, Sampler)>,
}

impl<'e> LocalExecutor<'e> {
    /// An executor with no sequences.
    pub fn new(engine: &'e Engine) -> LocalExecutor<'e> {
        LocalExecutor {
            engine,
            sequences: HashMap::new(),
        }
    }
}

impl Executor for LocalExecutor<'_> {
    fn step(&mut self, entries: &[StepEntry], release: &[u64]) -> Result<Vec<Option<Sampled>>> {
        for seq in release {
            self.sequences.remove(seq);
        }
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let engine = self.engine;
        let sequences = &mut self.sequences;
        for entry in entries {
            if entry.handoff.is_some() || entry.import.is_some() {
                bail!(
                    "prefill/decode disaggregation runs on rank processes (infer up --prefill N --decode M)"
                );
            }
            if let Some(params) = &entry.params {
                let sampler = entry.new_sampler(params);
                let cache = first_step_cache(engine.model.kv_pool(), entry)?;
                sequences.insert(entry.seq, (cache, sampler));
            } else if !sequences.contains_key(&entry.seq) {
                bail!("sequence {} is unknown to the engine", entry.seq);
            }
        }
        engine.install(|| {
            // Take each entry's state out so the batch can borrow them all mutably.
            let mut states: Vec<(KvCache, Sampler)> = entries
                .iter()
                .map(|e| sequences.remove(&e.seq).expect("checked above"))
                .collect();
            let result = {
                let mut batch: Vec<SequenceInput<'_>> = entries
                    .iter()
                    .zip(states.iter_mut())
                    .map(|(entry, (cache, _))| SequenceInput {
                        tokens: &entry.tokens,
                        cache,
                        all_logits: false,
                    })
                    .collect();
                engine.model.forward(&mut batch)
            };
            let sampled = result.map(|logits| {
                states
                    .iter_mut()
                    .zip(&logits)
                    .zip(entries)
                    .map(|(((_, sampler), logits), entry)| {
                        entry.sample.then(|| sample(sampler, logits))
                    })
                    .collect()
            });
            for (entry, state) in entries.iter().zip(states) {
                sequences.insert(entry.seq, state);
            }
            sampled
        })
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.engine.tokenizer
    }

    fn max_context_tokens(&self) -> usize {
        self.engine.model.config.max_context_tokens
    }

    fn kv_pool(&self) -> &Arc<KvPool> {
        self.engine.model.kv_pool()
    }
}
