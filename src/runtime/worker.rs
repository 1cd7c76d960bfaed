//! One rank of a distributed generation: loads its shard, joins its TP, PP and replica
//! groups through the rendezvous store, and runs steps. Only the driver (rank 0: tp 0,
//! pp 0) decides what runs: each step it broadcasts the tokens to process to the replica;
//! every rank runs its stage (PP stages pass hidden states with send/recv, TP ranks
//! all-reduce); the last stage's tp-rank-0 samples and sends the token to the driver.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use super::comm::{Comm, TcpComm};
use super::engine::{FinishReason, Generation, Timings};
use super::gguf::GgufFile;
use super::llama::{Llama, SequenceInput, StageOutput};
use super::sampling::{Sampler, SamplingParams};
use super::tokenizer::Tokenizer;
use crate::rendezvous::StoreClient;

/// What a rank is told by its environment (set explicitly by the launcher).
#[derive(Clone, Debug)]
pub struct RankConfig {
    pub rank: u64,
    pub world_size: u64,
    pub tp: usize,
    pub pp: usize,
    /// `MASTER_ADDR:MASTER_PORT`.
    pub store_address: String,
    pub token: String,
    pub model: PathBuf,
    pub threads: usize,
    /// Timeout of every collective and store wait.
    pub timeout: Duration,
}

/// The job the launcher publishes under `job`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub prompt_tokens: Vec<u32>,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
}

/// One step the driver broadcasts.
#[derive(Serialize, Deserialize)]
struct Step {
    tokens: Vec<u32>,
    done: bool,
}

/// The first layer and layer count of pipeline stage `stage` of `pp` over `n_layers`: an
/// even split, the first `n_layers % pp` stages one layer longer (as `infer plan` reports).
pub fn stage_layers(n_layers: usize, pp: usize, stage: usize) -> (usize, usize) {
    let (base, extra) = (n_layers / pp, n_layers % pp);
    let first = stage * base + stage.min(extra);
    (first, base + usize::from(stage < extra))
}

/// Runs one rank to completion. The driver writes the [`Generation`] as JSON under `result`.
///
/// Errors: a shard that cannot be built, a peer that disappears or times out (named by the
/// collectives), a store that cannot be reached.
pub fn run_rank(config: &RankConfig) -> Result<()> {
    let (tp, pp) = (config.tp, config.pp);
    let rank = config.rank as usize;
    if tp * pp != config.world_size as usize {
        bail!("WORLD_SIZE={} but tp×pp = {}", config.world_size, tp * pp);
    }
    let (tp_rank, pp_rank) = (rank % tp, rank / tp);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.threads)
        .build()
        .map_err(|e| anyhow!("thread pool: {e}"))?;
    let mut store = StoreClient::connect(
        &config.store_address,
        &config.token,
        Some(config.rank),
        config.timeout,
    )?;
    let _heartbeat = store.start_heartbeat(Duration::from_millis(500))?;

    let file = Arc::new(GgufFile::open(&config.model)?);
    let whole = Llama::from_gguf(&file)?;
    let (first_layer, n_layers) = stage_layers(whole.layers.len(), pp, pp_rank);
    let shard = whole
        .shard(tp_rank, tp, first_layer, n_layers)
        .with_context(|| format!("rank {rank}: building its shard"))?;
    drop(whole);

    let tp_members: Vec<u64> = (0..tp).map(|t| (pp_rank * tp + t) as u64).collect();
    let pp_members: Vec<u64> = (0..pp).map(|s| (s * tp + tp_rank) as u64).collect();
    let all: Vec<u64> = (0..config.world_size).collect();
    let host = "127.0.0.1";
    let mut tp_comm = TcpComm::connect(
        &mut store,
        &format!("tp/{pp_rank}"),
        &tp_members,
        config.rank,
        host,
        config.timeout,
    )?;
    let mut pp_comm = TcpComm::connect(
        &mut store,
        &format!("pp/{tp_rank}"),
        &pp_members,
        config.rank,
        host,
        config.timeout,
    )?;
    let mut replica = TcpComm::connect(
        &mut store,
        "replica",
        &all,
        config.rank,
        host,
        config.timeout,
    )?;
    store.barrier("loaded", config.world_size, config.timeout)?;

    let job: Job =
        serde_json::from_slice(&store.get("job", config.timeout)?).context("malformed job")?;
    let params = SamplingParams {
        temperature: job.temperature,
        top_k: job.top_k,
        top_p: job.top_p,
        seed: job.seed,
        max_tokens: job.max_tokens,
        stop: job.stop.clone(),
    };
    let is_sampler = pp_rank == pp - 1 && tp_rank == 0;
    let sampler_rank = (pp - 1) * tp;
    let mut sampler = Sampler::new(&params);
    let mut cache = shard.new_cache();
    let driver = rank == 0;
    let tokenizer = if driver {
        Some(Tokenizer::from_gguf(&file.header)?)
    } else {
        None
    };
    let mut driver_state = DriverState::new(&job);

    pool.install(|| -> Result<()> {
        loop {
            // The driver decides the step; everyone learns it.
            let mut message = if driver {
                serde_json::to_vec(&driver_state.next_step())?
            } else {
                Vec::new()
            };
            replica.broadcast(&mut message, 0)?;
            let step: Step = serde_json::from_slice(&message).context("malformed step")?;
            if step.done {
                break;
            }
            let hidden_in = if pp_rank > 0 {
                Some(bytes_to_f32(&pp_comm.recv(pp_rank - 1)?))
            } else {
                None
            };
            let mut batch = [SequenceInput {
                tokens: &step.tokens,
                cache: &mut cache,
                all_logits: false,
            }];
            let comm: Option<&mut dyn Comm> = if tp > 1 { Some(&mut tp_comm) } else { None };
            let output = shard.forward_stage(hidden_in.as_deref(), &mut batch, comm, None)?;
            match output {
                StageOutput::Hidden(hidden) => {
                    pp_comm.send(pp_rank + 1, bytemuck::cast_slice(&hidden))?
                }
                StageOutput::Logits(logits) if is_sampler => {
                    let token = sampler.sample(&logits[0]);
                    if driver {
                        driver_state.accept(
                            token,
                            tokenizer.as_ref().expect("the driver has a tokenizer"),
                        )?;
                    } else {
                        replica.send(0, &token.to_le_bytes())?;
                    }
                }
                StageOutput::Logits(_) => {}
            }
            if driver && !is_sampler {
                let bytes = replica.recv(sampler_rank)?;
                let token = u32::from_le_bytes(
                    bytes
                        .as_slice()
                        .try_into()
                        .map_err(|_| anyhow!("malformed token from rank {sampler_rank}"))?,
                );
                driver_state.accept(
                    token,
                    tokenizer.as_ref().expect("the driver has a tokenizer"),
                )?;
            }
        }
        Ok(())
    })?;
    if driver {
        store.set("result", &serde_json::to_vec(&driver_state.finish())?)?;
    }
    Ok(())
}

/// The driver's view of the generation: what to run next, when to stop.
struct DriverState {
    job: Job,
    tokens: Vec<u32>,
    text: String,
    finish_reason: Option<FinishReason>,
    started: Instant,
    first_token_at: Option<Instant>,
    pending_prompt: bool,
    decoded: Vec<u32>,
}

impl DriverState {
    fn new(job: &Job) -> DriverState {
        DriverState {
            job: job.clone(),
            tokens: Vec::new(),
            text: String::new(),
            finish_reason: None,
            started: Instant::now(),
            first_token_at: None,
            pending_prompt: true,
            decoded: Vec::new(),
        }
    }

    fn next_step(&mut self) -> Step {
        if self.pending_prompt {
            self.pending_prompt = false;
            self.started = Instant::now();
            return Step {
                tokens: self.job.prompt_tokens.clone(),
                done: false,
            };
        }
        match (self.finish_reason, self.tokens.last()) {
            (None, Some(&last)) => Step {
                tokens: vec![last],
                done: false,
            },
            _ => Step {
                tokens: Vec::new(),
                done: true,
            },
        }
    }

    fn accept(&mut self, token: u32, tokenizer: &Tokenizer) -> Result<()> {
        self.first_token_at.get_or_insert_with(Instant::now);
        if tokenizer.eos_ids.contains(&token) {
            self.finish_reason = Some(FinishReason::Stop);
            return Ok(());
        }
        self.tokens.push(token);
        self.decoded.push(token);
        self.text = tokenizer.decode(&self.decoded, true)?;
        if let Some(cut) = self
            .job
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            self.text.truncate(cut);
            self.finish_reason = Some(FinishReason::Stop);
        } else if self.tokens.len() >= self.job.max_tokens {
            self.finish_reason = Some(FinishReason::Length);
        }
        Ok(())
    }

    fn finish(self) -> Generation {
        let end = Instant::now();
        let first = self.first_token_at.unwrap_or(end);
        let prefill_secs = (first - self.started).as_secs_f64();
        let decode_secs = (end - first).as_secs_f64();
        let steps = self.tokens.len().saturating_sub(1) as f64;
        Generation {
            prompt_tokens: self.job.prompt_tokens.clone(),
            tokens: self.tokens,
            text: self.text,
            finish_reason: self.finish_reason.unwrap_or(FinishReason::Length),
            timings: Timings {
                prefill_secs,
                decode_secs,
                prefill_tokens_per_sec: self.job.prompt_tokens.len() as f64
                    / prefill_secs.max(1e-9),
                decode_tokens_per_sec: if steps > 0.0 {
                    steps / decode_secs.max(1e-9)
                } else {
                    0.0
                },
            },
        }
    }
}

fn bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
