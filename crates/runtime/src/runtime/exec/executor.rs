//! The step interface between a scheduler and whatever runs the model: one engine in this
//! process (`LocalExecutor`, beside the engine) or a replica of rank processes driven by its rank 0
//! ([`crate::runtime::exec::worker::ReplicaDriver`]). A step is a batch of sequences, each with
//! the new tokens to append (a prompt, or the last sampled token); the executor keeps each
//! sequence's KV cache and sampler between steps and returns one sampled token per
//! sequence. Generation bookkeeping (text, stop strings, limits) stays with the caller.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use crate::runtime::model::kv::{KvCache, KvPool, KvTransfer};
use crate::runtime::model::sampling::{Sampler, SamplingParams, logprob};
use crate::runtime::model::tokenizer::{TextStream, Tokenizer};

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

/// One sequence of a step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepEntry {
    /// The sequence's id, unique while it is alive.
    pub seq: u64,
    /// New tokens appended after the positions already cached: a prompt or a chunk of it,
    /// or the last sampled token.
    pub tokens: Vec<u32>,
    /// Set on the sequence's first step: a fresh KV cache and sampler are made for it.
    pub params: Option<SamplingParams>,
    /// With `params`: tokens this sequence sampled before it was preempted (its prompt and
    /// those tokens are `prefix_tokens` and `tokens` now). The new sampler skips their
    /// random draws, so seeded sampling continues exactly as if the sequence had never been
    /// preempted.
    #[serde(default)]
    pub sampled_before: usize,
    /// With `params`: the length of the sequence's prompt, tokens (positions past it were
    /// generated). It decides the order each position's attention sums in, so a prompt run
    /// in chunks, partly from the prefix cache or recomputed after preemption gives the
    /// bits of one whole prefill ([`crate::runtime::model::kv::KvCache::prompt_tokens`]).
    pub prompt_tokens: usize,
    /// With `params`: the sequence's first tokens, whose KV blocks come from the pool's
    /// prefix cache instead of being computed (whole blocks; `tokens` follow them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefix_tokens: Vec<u32>,
    /// Whether to sample a token after this step. `false` for a chunk of a prompt that
    /// continues next step: no token, and the sampler's random stream is untouched.
    pub sample: bool,
    /// On a prefill replica, with every chunk of the prompt: every rank queues its shard's
    /// keys and values of the positions it just computed for the same rank of the decode
    /// replica (sent while the next chunk computes); with the chunk that samples the first
    /// token it waits until all of them went (prefill/decode disaggregation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<Handoff>,
    /// With `params`, on a decode replica: the id of the KV transfer that holds the
    /// sequence's prompt (every rank takes its shard's part from its inbox instead of
    /// computing it); `tokens` is then the first token, sampled by the prefill replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import: Option<u64>,
    /// With `import`: the request's prompt, which the imported KV must be of (every rank
    /// checks its parts' tokens against it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub import_prompt: Vec<u32>,
    /// With `params` when a penalty is on ([`SamplingParams::penalized`]): the sequence's
    /// tokens so far, `prompt_tokens` of prompt then its earlier output (after a preemption,
    /// or from the prefill replica), for the sampler's penalties. Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<u32>,
}

/// Where a prefill replica sends a sequence's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// The decode replica's data-parallel rank.
    pub replica: usize,
    /// The transfer's id, unique in the run (the router's request id).
    pub transfer: u64,
}

impl StepEntry {
    /// A sequence's first step: its whole `prompt` at once, sampled after.
    pub fn prompt(seq: u64, prompt: &[u32], params: &SamplingParams) -> StepEntry {
        StepEntry {
            seq,
            tokens: prompt.to_vec(),
            params: Some(params.clone()),
            sampled_before: 0,
            prompt_tokens: prompt.len(),
            prefix_tokens: Vec::new(),
            sample: true,
            handoff: None,
            import: None,
            import_prompt: Vec::new(),
            history: if params.penalized() {
                prompt.to_vec()
            } else {
                Vec::new()
            },
        }
    }

    /// A decode step: the token sampled last, sampled after.
    pub fn decode(seq: u64, token: u32) -> StepEntry {
        StepEntry {
            seq,
            tokens: vec![token],
            params: None,
            sampled_before: 0,
            prompt_tokens: 0,
            prefix_tokens: Vec::new(),
            sample: true,
            handoff: None,
            import: None,
            import_prompt: Vec::new(),
            history: Vec::new(),
        }
    }

    /// The sampler of this entry's sequence (its first step: `params` given): seeded as
    /// asked, past the draws of the tokens sampled before, and aware of the history the
    /// penalties need.
    pub fn new_sampler(&self, params: &SamplingParams) -> Sampler {
        let mut sampler = Sampler::new(params);
        sampler.skip(self.sampled_before);
        sampler.observe_history(&self.history, self.prompt_tokens);
        sampler
    }
}

/// KV a prefill replica's driver rank sent to decode replicas: bytes, parts (a chunk of a
/// prompt's positions for every layer of the shard) and the seconds spent sending them
/// (on the sending thread, overlapping the prefill).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvSent {
    pub bytes: u64,
    /// Of `bytes`, those that went through a shared ring (the decode rank on this host).
    pub shm_bytes: u64,
    pub parts: u64,
    pub secs: f64,
}

/// The token sampled for one sequence, with its log-probability (nats).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampled {
    pub token: u32,
    /// Its log-probability (nats), when the sequence's parameters ask for it.
    pub logprob: Option<f32>,
    /// The most likely tokens at this step with their log-probabilities, when asked
    /// (`top_logprobs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(u32, f32)>,
}

/// Runs steps of a batch of sequences.
pub trait Executor: Send {
    /// Drops the state of the sequences in `release`, then runs `entries` (prefills, chunks
    /// of prompts and decodes together) and returns, per entry in order, the token sampled
    /// after it (`None` where the entry's `sample` is false).
    ///
    /// Errors: an entry for an unknown sequence without `params`, a sequence past the
    /// context, a prefix the pool does not cache, a failed forward pass or collective.
    fn step(&mut self, entries: &[StepEntry], release: &[u64]) -> Result<Vec<Option<Sampled>>>;

    /// Called while there is nothing to run (at least once a second), so that a replica's
    /// other ranks know the driver is alive. Errors: a lost peer.
    fn idle(&mut self) -> Result<()> {
        Ok(())
    }

    /// Whether a step error leaves the executor unusable (a replica that lost a rank) rather
    /// than failing only that step's requests.
    fn errors_are_fatal(&self) -> bool {
        false
    }

    /// The model's tokenizer (EOS ids, detokenization).
    fn tokenizer(&self) -> &Tokenizer;

    /// What this executor's driver rank sent to decode replicas so far (prefill/decode
    /// disaggregation; nothing elsewhere).
    fn kv_sent(&self) -> KvSent {
        KvSent::default()
    }

    /// The sequences of the last [`Executor::step`] whose KV transfer failed, with why:
    /// a hand-off a prefill replica could not send (the sequence's token was sampled, but
    /// no decode replica can go on with it), or an import whose KV never arrived (the
    /// entry did not run; its token is `None`). Every rank of the replica agrees on the
    /// set. Taking empties it. Only prefill/decode disaggregation fails a transfer.
    fn take_transfer_failures(&mut self) -> Vec<(u64, String)> {
        Vec::new()
    }

    /// Starts sequence `entry.seq` (its first step: `params` and `import` set) from the KV
    /// of its prompt that another replica computed, `parts` covering this shard's layers at
    /// every prompt position (prefill/decode disaggregation on a device, whose cache the
    /// executor keeps; a CPU rank imports into its own caches instead). The next
    /// [`Executor::step`] with the entry then runs only its `tokens`.
    ///
    /// Errors: this executor does not import (the default), parts of another geometry or
    /// prompt, a full cache.
    fn import_kv(&mut self, entry: &StepEntry, parts: &[KvTransfer]) -> Result<()> {
        let _ = parts;
        bail!(
            "sequence {}: this executor does not import KV (prefill/decode disaggregation runs on rank processes: infer up --prefill N --decode M)",
            entry.seq
        )
    }

    /// The keys and values sequence `seq` stored from position `from` on, every layer of this
    /// shard, as a hand-off to a decode replica; `None` when nothing is stored past `from`.
    ///
    /// Errors: this executor does not export (the default), an unknown sequence, the
    /// device's.
    fn export_kv(&mut self, seq: u64, from: usize) -> Result<Option<KvTransfer>> {
        let _ = from;
        bail!("sequence {seq}: this executor does not export KV")
    }

    /// The model's context length, tokens.
    fn max_context_tokens(&self) -> usize;

    /// The KV block pool of the driver's own shard. Every rank of a replica has one of the
    /// same capacity holding the same sequences, so its counts speak for the replica.
    fn kv_pool(&self) -> &Arc<KvPool>;
}

/// The KV cache of a sequence's first step (`entry.params` set), drawing from `pool`: its
/// prompt length fixed and its cached prefix adopted.
///
/// Errors: a prefix the pool does not cache (see [`KvCache::adopt_prefix`]).
pub fn first_step_cache(pool: &Arc<KvPool>, entry: &StepEntry) -> Result<KvCache> {
    let mut cache = pool.new_cache();
    cache.prompt_tokens = Some(entry.prompt_tokens);
    cache.adopt_prefix(&entry.prefix_tokens)?;
    Ok(cache)
}

/// Samples the next token from `logits` (`(vocab_size)`) with its log-probability.
pub fn sample(sampler: &mut Sampler, logits: &[f32]) -> Sampled {
    let token = sampler.sample(logits);
    let params = sampler.params();
    Sampled {
        token,
        logprob: params.logprobs.then(|| logprob(logits, token)),
        top: if params.logprobs {
            crate::runtime::model::sampling::top_logprobs(logits, params.top_logprobs)
        } else {
            Vec::new()
        },
    }
}

/// Generates one sequence from `prompt_tokens` on `executor`, calling `on_text` with each
/// newly complete piece of text (never a split UTF-8 character, never text of a stop string).
///
/// Errors: an empty prompt, a prompt that fills the context, an executor error.
pub fn generate(
    executor: &mut dyn Executor,
    prompt_tokens: &[u32],
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    if prompt_tokens.is_empty() {
        return Err(anyhow!("the prompt is empty"));
    }
    let max_context = executor.max_context_tokens();
    if prompt_tokens.len() >= max_context {
        return Err(anyhow!(
            "the prompt has {} tokens; the model's context is {max_context}",
            prompt_tokens.len()
        ));
    }
    const SEQ: u64 = 0;
    let start = Instant::now();
    let mut first_token_at = None;
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut finish_reason = FinishReason::Length;
    let mut entry = StepEntry::prompt(SEQ, prompt_tokens, params);
    let mut stream = TextStream::new(params.skip_special_tokens);
    while tokens.len() < params.max_tokens {
        let sampled = executor.step(std::slice::from_ref(&entry), &[])?;
        let next = sampled
            .first()
            .and_then(Option::as_ref)
            .ok_or_else(|| anyhow!("the executor returned no token"))?
            .token;
        first_token_at.get_or_insert_with(Instant::now);
        if params.is_stop_token(next, &executor.tokenizer().eos_ids, tokens.len()) {
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        let piece = stream.push(executor.tokenizer(), next)?;
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
        if prompt_tokens.len() + tokens.len() >= max_context {
            break;
        }
        entry = StepEntry::decode(SEQ, next);
    }
    executor.step(&[], &[SEQ])?;
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
}
