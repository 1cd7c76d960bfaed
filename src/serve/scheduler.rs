//! Continuous batching on one engine: a dedicated thread owns the model; every step it
//! admits waiting requests (up to `max_batch` running), runs one forward over the running
//! sequences within a token budget — one new token of each decoding sequence first, then
//! chunks of prompts (chunked prefill), new prompts starting after their longest cached
//! prefix — samples, and streams each sequence's new text to its requester. Finished or
//! abandoned sequences leave the batch at once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use super::health::{Progress, ProgressSnapshot};
use crate::runtime::exec::engine::LocalExecutor;
use crate::runtime::exec::engine::{Engine, FinishReason};
use crate::runtime::exec::executor::{Executor, Handoff, Sampled, StepEntry};
use crate::runtime::model::kv::{KvPool, blocks_for};
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::{TextStream, Tokenizer};

/// A generation request.
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// Where the events of this request go; dropping the receiver cancels it.
    pub events: UnboundedSender<Event>,
    pub received_at: Instant,
    /// Its stage under prefill/decode disaggregation (`None`: colocated, all here).
    pub pd: Option<PdStage>,
}

/// A request's stage under prefill/decode disaggregation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PdStage {
    /// Prefill here, sample the first token, send the KV to decode replica `replica` as
    /// transfer `transfer`, then answer [`Event::HandedOff`] instead of decoding.
    Prefill { replica: usize, transfer: u64 },
    /// Decode here from KV transfer `transfer`: the prompt's KV arrives from the prefill
    /// replica, which sampled `first_token` and whose prefix cache supplied
    /// `cached_tokens`.
    Decode {
        transfer: u64,
        first_token: u32,
        cached_tokens: usize,
    },
}

/// What a request hears back.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Event {
    /// One generated token: its id, the text it completed (possibly empty while a UTF-8
    /// character is incomplete), its log-probability and the step's most likely tokens
    /// (when asked).
    Token {
        id: u32,
        text: String,
        logprob: Option<f32>,
        #[serde(default)]
        top: Vec<(u32, f32)>,
    },
    /// Generation ended.
    Done {
        finish_reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose KV blocks came from the prefix cache (OpenAI's
        /// `usage.prompt_tokens_details.cached_tokens`).
        #[serde(default)]
        cached_tokens: usize,
    },
    /// The engine failed on this request.
    Error(String),
    /// A prefill replica is done with the request: its first token was sent, its KV is on
    /// the way to the decode replica, which continues from `first_token`.
    HandedOff {
        first_token: u32,
        cached_tokens: usize,
    },
}

/// Counters and histograms for `/metrics` (Prometheus text).
#[derive(Default)]
pub struct Metrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub requests_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generation_tokens_total: AtomicU64,
    pub kv_cache_bytes: AtomicU64,
    /// KV blocks held by live sequences, and the pool's capacity in blocks.
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Sequences preempted (their KV blocks freed, recomputed later) because blocks ran out.
    pub preemptions_total: AtomicU64,
    /// Requests whose requester went away (a client that left, a shutdown's cancel) while
    /// they waited, dropped from the queue and never computed; and those stopped early while
    /// running, their KV blocks freed.
    pub aborted_waiting_total: AtomicU64,
    pub aborted_running_total: AtomicU64,
    /// Tokens of admitted sequences looked up in the prefix cache, and those found there
    /// (vLLM's `prefix_cache_queries` and `prefix_cache_hits`).
    pub prefix_cache_queries_total: AtomicU64,
    pub prefix_cache_hits_total: AtomicU64,
    /// Cached blocks evicted to make room (the pool's count).
    pub prefix_cache_evictions_total: AtomicU64,
    /// Prefill/decode disaggregation: KV bytes sent to decode replicas and the seconds spent
    /// sending them (by the driver rank's shard), requests handed off, and prompt tokens a
    /// decode replica computed itself (recomputation after a preemption; 0 otherwise).
    pub pd_kv_bytes_sent_total: AtomicU64,
    pub pd_kv_send_micros_total: AtomicU64,
    /// KV parts sent (a chunk of a prompt's positions, every layer of the shard).
    pub pd_kv_parts_sent_total: AtomicU64,
    /// Of the KV bytes sent, those that went through shared memory (decode rank on the
    /// prefill rank's host).
    pub pd_kv_bytes_sent_shm_total: AtomicU64,
    pub pd_handoffs_total: AtomicU64,
    pub pd_decode_prefill_tokens_total: AtomicU64,
    /// Requests failed because their KV transfer failed (a send that could not reach the
    /// decode replica, or KV that never arrived there).
    pub pd_transfer_failures_total: AtomicU64,
    pub ttft: Histogram,
    pub tpot: Histogram,
    /// Seconds from a request's arrival to its end, per sequence (vLLM's
    /// `e2e_request_latency_seconds`).
    pub e2e: Histogram,
    /// The loop's forward progress (`/health`'s stall rule).
    pub progress: Progress,
}

/// A latency histogram with fixed buckets, seconds.
pub struct Histogram {
    counts: Mutex<(Vec<u64>, u64, f64)>,
}

/// Bucket upper bounds, seconds.
const BUCKETS_SECS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram {
            counts: Mutex::new((vec![0; BUCKETS_SECS.len()], 0, 0.0)),
        }
    }
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, secs: f64) {
        let mut guard = self.counts.lock().expect("histogram lock");
        for (i, bound) in BUCKETS_SECS.iter().enumerate() {
            if secs <= *bound {
                guard.0[i] += 1;
            }
        }
        guard.1 += 1;
        guard.2 += secs;
    }

    /// The counts so far.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let guard = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        HistogramSnapshot {
            buckets: guard.0.clone(),
            count: guard.1,
            sum_secs: guard.2,
        }
    }
}

/// A histogram's counts at one moment: cumulative bucket counts (upper bounds
/// `BUCKETS_SECS`), observations and their sum in seconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HistogramSnapshot {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_secs: f64,
}

impl HistogramSnapshot {
    /// Adds `other`'s counts (another replica's).
    pub fn add(&mut self, other: &HistogramSnapshot) {
        self.buckets
            .resize(other.buckets.len().max(self.buckets.len()), 0);
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
        self.count += other.count;
        self.sum_secs += other.sum_secs;
    }

    /// Prometheus text lines for metric `name`.
    pub fn render(&self, name: &str, help: &str) -> String {
        format!(
            "# HELP {name} {help}\n# TYPE {name} histogram\n{}",
            self.render_labelled(name, "")
        )
    }

    /// The sample lines of metric `name` with `labels` (`role="decode"`, or none) on each,
    /// without the `# HELP`/`# TYPE` lines (one family, several label sets).
    pub fn render_labelled(&self, name: &str, labels: &str) -> String {
        let (bucket_prefix, braces) = if labels.is_empty() {
            (String::new(), String::new())
        } else {
            (format!("{labels},"), format!("{{{labels}}}"))
        };
        let mut out = String::new();
        for (i, bound) in BUCKETS_SECS.iter().enumerate() {
            // (An empty snapshot has no bucket counts: zeros.)
            let count = self.buckets.get(i).copied().unwrap_or(0);
            out.push_str(&format!(
                "{name}_bucket{{{bucket_prefix}le=\"{bound}\"}} {count}\n"
            ));
        }
        out.push_str(&format!(
            "{name}_bucket{{{bucket_prefix}le=\"+Inf\"}} {count}\n{name}_sum{braces} {}\n{name}_count{braces} {count}\n",
            self.sum_secs,
            count = self.count
        ));
        out
    }
}

/// Every counter and histogram of [`Metrics`] at one moment; remote DP replicas send theirs
/// to rank 0, which adds them up.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricsSnapshot {
    pub running: u64,
    pub waiting: u64,
    pub requests_total: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub kv_cache_bytes: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub preemptions_total: u64,
    #[serde(default)]
    pub aborted_waiting_total: u64,
    #[serde(default)]
    pub aborted_running_total: u64,
    #[serde(default)]
    pub prefix_cache_queries_total: u64,
    #[serde(default)]
    pub prefix_cache_hits_total: u64,
    #[serde(default)]
    pub prefix_cache_evictions_total: u64,
    #[serde(default)]
    pub pd_kv_bytes_sent_total: u64,
    #[serde(default)]
    pub pd_kv_send_micros_total: u64,
    #[serde(default)]
    pub pd_kv_parts_sent_total: u64,
    #[serde(default)]
    pub pd_kv_bytes_sent_shm_total: u64,
    #[serde(default)]
    pub pd_handoffs_total: u64,
    #[serde(default)]
    pub pd_decode_prefill_tokens_total: u64,
    #[serde(default)]
    pub pd_transfer_failures_total: u64,
    pub ttft: HistogramSnapshot,
    pub tpot: HistogramSnapshot,
    #[serde(default)]
    pub e2e: HistogramSnapshot,
    #[serde(default)]
    pub progress: ProgressSnapshot,
}

impl MetricsSnapshot {
    /// Adds `other` (another replica's metrics): counters, gauges and histograms sum.
    pub fn add(&mut self, other: &MetricsSnapshot) {
        self.running += other.running;
        self.waiting += other.waiting;
        self.requests_total += other.requests_total;
        self.prompt_tokens_total += other.prompt_tokens_total;
        self.generation_tokens_total += other.generation_tokens_total;
        self.kv_cache_bytes += other.kv_cache_bytes;
        self.kv_blocks_used += other.kv_blocks_used;
        self.kv_blocks_total += other.kv_blocks_total;
        self.preemptions_total += other.preemptions_total;
        self.aborted_waiting_total += other.aborted_waiting_total;
        self.aborted_running_total += other.aborted_running_total;
        self.prefix_cache_queries_total += other.prefix_cache_queries_total;
        self.prefix_cache_hits_total += other.prefix_cache_hits_total;
        self.prefix_cache_evictions_total += other.prefix_cache_evictions_total;
        self.pd_kv_bytes_sent_total += other.pd_kv_bytes_sent_total;
        self.pd_kv_send_micros_total += other.pd_kv_send_micros_total;
        self.pd_kv_parts_sent_total += other.pd_kv_parts_sent_total;
        self.pd_kv_bytes_sent_shm_total += other.pd_kv_bytes_sent_shm_total;
        self.pd_handoffs_total += other.pd_handoffs_total;
        self.pd_decode_prefill_tokens_total += other.pd_decode_prefill_tokens_total;
        self.pd_transfer_failures_total += other.pd_transfer_failures_total;
        self.ttft.add(&other.ttft);
        self.tpot.add(&other.tpot);
        self.e2e.add(&other.e2e);
        // Summed, progress is the least advanced replica's.
        let (mine, theirs) = (&mut self.progress, &other.progress);
        mine.steps_total += theirs.steps_total;
        mine.seconds_since_progress = mine
            .seconds_since_progress
            .max(theirs.seconds_since_progress);
        mine.has_work |= theirs.has_work;
        mine.recent_step_secs = mine.recent_step_secs.max(theirs.recent_step_secs);
    }
}

impl Metrics {
    /// Every counter and histogram now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |v: &AtomicU64| v.load(Ordering::SeqCst);
        MetricsSnapshot {
            running: load(&self.running),
            waiting: load(&self.waiting),
            requests_total: load(&self.requests_total),
            prompt_tokens_total: load(&self.prompt_tokens_total),
            generation_tokens_total: load(&self.generation_tokens_total),
            kv_cache_bytes: load(&self.kv_cache_bytes),
            kv_blocks_used: load(&self.kv_blocks_used),
            kv_blocks_total: load(&self.kv_blocks_total),
            preemptions_total: load(&self.preemptions_total),
            aborted_waiting_total: load(&self.aborted_waiting_total),
            aborted_running_total: load(&self.aborted_running_total),
            prefix_cache_queries_total: load(&self.prefix_cache_queries_total),
            prefix_cache_hits_total: load(&self.prefix_cache_hits_total),
            prefix_cache_evictions_total: load(&self.prefix_cache_evictions_total),
            pd_kv_bytes_sent_total: load(&self.pd_kv_bytes_sent_total),
            pd_kv_send_micros_total: load(&self.pd_kv_send_micros_total),
            pd_kv_parts_sent_total: load(&self.pd_kv_parts_sent_total),
            pd_kv_bytes_sent_shm_total: load(&self.pd_kv_bytes_sent_shm_total),
            pd_handoffs_total: load(&self.pd_handoffs_total),
            pd_decode_prefill_tokens_total: load(&self.pd_decode_prefill_tokens_total),
            pd_transfer_failures_total: load(&self.pd_transfer_failures_total),
            ttft: self.ttft.snapshot(),
            tpot: self.tpot.snapshot(),
            e2e: self.e2e.snapshot(),
            progress: self.progress_now(),
        }
    }

    /// The loop's forward progress now, with the requests running and waiting as its work.
    pub fn progress_now(&self) -> ProgressSnapshot {
        let queued = self.running.load(Ordering::SeqCst) + self.waiting.load(Ordering::SeqCst);
        self.progress.snapshot(queued)
    }
}

/// The handle the HTTP side uses.
#[derive(Clone)]
pub struct Scheduler {
    sender: mpsc::Sender<Request>,
    pub metrics: Arc<Metrics>,
    /// Becomes `Some(error)` when the executor failed for good (a replica lost a rank).
    pub failure: tokio::sync::watch::Receiver<Option<String>>,
}

/// How much one step may run (vLLM's `--max-num-seqs` and `--max-num-batched-tokens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most sequences running at once; later requests wait, in arrival order.
    pub max_batch: usize,
    /// Most tokens one step computes: one per decoding sequence plus chunks of prompts.
    /// A longer prompt is prefilled over several steps, so it never stalls the decodes
    /// for long. At least `max_batch` (raised to it).
    pub max_batched_tokens: usize,
}

/// `--max-num-batched-tokens`' default per core of the serving host: 32 tokens, so a
/// 2-core host steps 64 tokens at a time. Measured with `infer bench serve` on 2 cores
/// (SmolLM2, 16 streams): a 64-token chunk costs about as much as 6 decode steps of 16
/// sequences, so decodes keep a TPOT p99 of ~130 ms while 2k-token prompts arrive (435 ms
/// with whole prompts), short prompts' TTFT p99 stays ~0.4 s (29 s behind whole 2k-token
/// prefills), and tokens/s is unchanged. Larger CPUs (and GPUs, where vLLM uses 2048 and
/// more) amortise bigger chunks.
pub(crate) const MAX_BATCHED_TOKENS_PER_CORE: usize = 32;

impl Limits {
    /// `max_batch` sequences and the default token budget for a host with `cores` cores:
    /// [`MAX_BATCHED_TOKENS_PER_CORE`] each, 64 to 4096 in all, never below `max_batch`.
    pub fn with_max_batch(max_batch: usize, cores: usize) -> Limits {
        Limits {
            max_batch,
            max_batched_tokens: (cores * MAX_BATCHED_TOKENS_PER_CORE)
                .clamp(64, 4096)
                .max(max_batch),
        }
    }

    /// [`Limits::with_max_batch`] for this host's cores.
    pub fn for_this_host(max_batch: usize) -> Limits {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Limits::with_max_batch(max_batch, cores)
    }
}

impl Scheduler {
    /// Starts the scheduling thread, which owns `engine`, within `limits`.
    pub fn start(engine: Engine, limits: Limits) -> Scheduler {
        Scheduler::spawn(limits, move |run| run(&mut LocalExecutor::new(&engine)))
    }

    /// Starts the scheduling thread over `executor` (a replica's driver).
    pub fn start_with(executor: Box<dyn Executor + 'static>, limits: Limits) -> Scheduler {
        let mut executor = executor;
        Scheduler::spawn(limits, move |run| run(executor.as_mut()))
    }

    /// Spawns the thread; `with_executor` makes the executor inside it and calls the loop.
    fn spawn(
        limits: Limits,
        with_executor: impl FnOnce(&mut dyn FnMut(&mut dyn Executor) -> Result<()>) -> Result<()>
        + Send
        + 'static,
    ) -> Scheduler {
        let (sender, receiver) = mpsc::channel::<Request>();
        let metrics = Arc::new(Metrics::default());
        let (failed, failure) = tokio::sync::watch::channel(None);
        let thread_metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || {
                let result = with_executor(&mut |executor| {
                    run(executor, &receiver, limits, &thread_metrics)
                });
                if let Err(error) = result {
                    let _ = failed.send(Some(format!("{error:#}")));
                }
            })
            .expect("the scheduler thread starts");
        Scheduler {
            sender,
            metrics,
            failure,
        }
    }

    /// Queues a request. Errors: the scheduler has stopped.
    pub fn submit(&self, request: Request) -> Result<(), String> {
        if let Some(error) = self.failure.borrow().as_ref() {
            return Err(format!("the engine has failed: {error}"));
        }
        self.metrics.waiting.fetch_add(1, Ordering::SeqCst);
        // A decode replica continues a request its prefill replica already counted.
        if !matches!(request.pd, Some(PdStage::Decode { .. })) {
            self.metrics.requests_total.fetch_add(1, Ordering::SeqCst);
        }
        self.sender
            .send(request)
            .map_err(|_| "the engine has stopped".to_string())
    }
}

/// A sequence the scheduler tracks, running or waiting (new, or preempted).
struct Running {
    seq: u64,
    request: Request,
    /// Whether the executor has no state for this sequence (new, or preempted since).
    new: bool,
    /// Tokens not yet run: the prompt (or what is left of it after the chunks run so far),
    /// then the last sampled token; after a preemption, the prompt and every token
    /// generated so far.
    pending: Vec<u32>,
    /// Positions the executor holds in this sequence's KV cache.
    cached_tokens: usize,
    /// Prompt tokens the prefix cache supplied on the sequence's first admission.
    prefix_hit_tokens: Option<usize>,
    /// A decode replica's sequence whose prompt KV comes as this transfer (until its first
    /// step takes it).
    import: Option<u64>,
    generated: Vec<u32>,
    stream: TextStream,
    text: String,
    first_token_at: Option<Instant>,
    last_token_at: Instant,
    /// The event that ends the request (done, handed off, failed), kept until the
    /// sequence has left the batch and the gauges count it out: a client that hears the
    /// end and then scrapes `/metrics` never sees its request still running.
    ending: Option<Event>,
}

impl Running {
    /// Drops the executor's state: the sequence will start over from its prompt and the
    /// tokens generated so far (recomputation, as vLLM preempts by default; blocks still in
    /// the prefix cache are adopted, not recomputed).
    fn preempt(&mut self) {
        self.new = true;
        self.cached_tokens = 0;
        self.pending = self.request.prompt_tokens.clone();
        self.pending.extend(&self.generated);
    }

    /// KV blocks the next `chunk` pending tokens add to what the sequence holds.
    fn growth(&self, chunk: usize) -> usize {
        blocks_for(self.cached_tokens + chunk) - blocks_for(self.cached_tokens)
    }
}

/// What one sequence runs in a step.
struct Planned {
    /// Index into the running sequences.
    index: usize,
    /// Leading pending tokens adopted from the prefix cache (first step only).
    prefix: usize,
    /// Pending tokens computed after the prefix.
    chunk: usize,
}

/// The scheduling loop. Returns when every [`Scheduler`] handle is gone, or with the error
/// of an executor whose errors are fatal.
///
/// Each step spends a budget of `limits.max_batched_tokens` tokens as vLLM's chunked
/// prefill does: first one token per decoding sequence, then chunks of the prompts in
/// progress (fewest tokens left first; at most half of what is left while requests wait for
/// a slot, as vLLM's partial-prefill limits let short prompts past a long one), then new sequences in
/// arrival order while blocks, batch room and budget last — a new sequence's prompt starts
/// after the longest prefix the pool's prefix cache holds, and only its last chunk samples
/// a token. KV blocks are planned from
/// the executor's pool: the running sequences' growth first, preempting the most recently
/// admitted ones (their blocks released at once, themselves put back at the head of the
/// queue) while that does not fit. A request is dropped only when its requester went away
/// (its receiver closed: from the queue before it is computed, from the batch after the
/// step that noticed, its KV blocks freed); only a sequence that cannot grow even alone
/// finishes early with `length`.
fn run(
    executor: &mut dyn Executor,
    receiver: &mpsc::Receiver<Request>,
    limits: Limits,
    metrics: &Metrics,
) -> Result<()> {
    let mut batch = Batch::new(executor, limits, metrics);
    loop {
        // Every way through the loop comes back here, before waiting for arrivals.
        batch.send_endings();
        if !batch.take_arrivals(executor, receiver)? {
            return Ok(());
        }
        let (mut chunks, mut left_tokens) = batch.share_budget();
        let Some(mut free_blocks) =
            batch.reserve_blocks(executor, &mut chunks, &mut left_tokens)?
        else {
            continue;
        };
        let mut plan: Vec<Planned> = chunks
            .iter()
            .enumerate()
            .filter(|(_, chunk)| **chunk > 0)
            .map(|(index, &chunk)| Planned {
                index,
                prefix: 0,
                chunk,
            })
            .collect();
        batch.admit(&mut plan, &mut free_blocks, &mut left_tokens);
        metrics
            .running
            .store(batch.running.len() as u64, Ordering::SeqCst);
        if plan.is_empty() {
            // Nothing fits: every running sequence was preempted or finished.
            continue;
        }

        let entries = batch.step_entries(&plan);
        metrics.progress.call_begins();
        let sampled = executor.step(&entries, &[]);
        metrics.progress.call_ends(true);
        let sampled = match sampled {
            Ok(sampled) => sampled,
            Err(error) => {
                batch.fail_running(&error);
                if executor.errors_are_fatal() {
                    batch.send_endings();
                    return Err(error);
                }
                continue;
            }
        };
        let finished = batch.deliver_sampled(executor, &plan, &sampled);
        batch.remove_finished(finished);
        batch.store_step_metrics(executor);
    }
}

/// The scheduling loop's state between steps: the sequences running and waiting, those to
/// release at the next step, and what the loop reads from the executor once.
struct Batch<'a> {
    running: Vec<Running>,
    waiting: VecDeque<Running>,
    /// Sequences to drop at the next step.
    release: Vec<u64>,
    /// The ending events of sequences that left the running batch, to send once the
    /// running gauge counts them out ([`Batch::send_endings`]).
    endings: Vec<(UnboundedSender<Event>, Event)>,
    /// The last sequence number given out.
    next_seq: u64,
    /// The executor's context, tokens.
    max_context_tokens: usize,
    pool: Arc<KvPool>,
    /// Most sequences running at once (at least 1).
    max_batch: usize,
    /// Most tokens one step computes (at least `max_batch`, and 1).
    budget_tokens: usize,
    /// The executor's tokenizer, for a decode replica's first token.
    tokenizer: Tokenizer,
    metrics: &'a Metrics,
}

impl<'a> Batch<'a> {
    /// An empty batch over `executor`'s pool within `limits`; records the pool's capacity
    /// in `metrics`.
    fn new(executor: &dyn Executor, limits: Limits, metrics: &'a Metrics) -> Batch<'a> {
        let pool = Arc::clone(executor.kv_pool());
        metrics
            .kv_blocks_total
            .store(pool.capacity_blocks() as u64, Ordering::SeqCst);
        Batch {
            running: Vec::new(),
            waiting: VecDeque::new(),
            release: Vec::new(),
            endings: Vec::new(),
            next_seq: 0,
            max_context_tokens: executor.max_context_tokens(),
            pool,
            max_batch: limits.max_batch.max(1),
            budget_tokens: limits.max_batched_tokens.max(limits.max_batch).max(1),
            tokenizer: executor.tokenizer().clone(),
            metrics,
        }
    }

    /// A new sequence for `request`; a decode replica's continues after the first token
    /// its prefill replica sampled.
    fn receive(&mut self, request: Request) -> Running {
        self.next_seq += 1;
        let mut running = Running {
            seq: self.next_seq,
            new: true,
            pending: request.prompt_tokens.clone(),
            cached_tokens: 0,
            prefix_hit_tokens: None,
            import: None,
            generated: Vec::new(),
            stream: TextStream::new(request.params.skip_special_tokens),
            text: String::new(),
            first_token_at: None,
            last_token_at: Instant::now(),
            ending: None,
            request,
        };
        if let Some(PdStage::Decode {
            transfer,
            first_token,
            cached_tokens,
        }) = running.request.pd
        {
            // The prefill replica sent the first token (and observed the TTFT): continue
            // after it, its text already counted for stop strings.
            running.import = Some(transfer);
            running.pending = vec![first_token];
            running.generated = vec![first_token];
            running.text = running
                .stream
                .push(&self.tokenizer, first_token)
                .unwrap_or_default();
            running.prefix_hit_tokens = Some(cached_tokens);
            running.first_token_at = Some(running.request.received_at);
        }
        running
    }

    /// Stores the pool's KV gauges (bytes and blocks used) and its eviction count.
    fn store_kv_metrics(&self) {
        let used = self.pool.used_blocks();
        self.metrics
            .kv_cache_bytes
            .store((used * self.pool.block_bytes()) as u64, Ordering::SeqCst);
        self.metrics
            .kv_blocks_used
            .store(used as u64, Ordering::SeqCst);
        self.metrics
            .prefix_cache_evictions_total
            .store(self.pool.evictions(), Ordering::SeqCst);
    }

    /// Waits while nothing runs or waits (releasing what finished, and telling the executor
    /// every second that we are alive), then queues every request that has arrived.
    /// Returns false when every [`Scheduler`] handle is gone. Errors: the executor's.
    fn take_arrivals(
        &mut self,
        executor: &mut dyn Executor,
        receiver: &mpsc::Receiver<Request>,
    ) -> Result<bool> {
        while self.running.is_empty() && self.waiting.is_empty() {
            let progress = &self.metrics.progress;
            if !self.release.is_empty() {
                progress.call_begins();
                let released = executor.step(&[], &std::mem::take(&mut self.release));
                progress.call_ends(true);
                released?;
                self.store_kv_metrics();
            }
            match receiver.recv_timeout(Duration::from_secs(1)) {
                Ok(request) => {
                    // Idle until now: the wait for the first step starts here.
                    progress.mark();
                    let running = self.receive(request);
                    self.waiting.push_back(running);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    progress.call_begins();
                    let alive = executor.idle();
                    progress.call_ends(false);
                    alive?;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(false),
            }
        }
        while let Ok(request) = receiver.try_recv() {
            let running = self.receive(request);
            self.waiting.push_back(running);
        }
        self.drop_abandoned();
        Ok(true)
    }

    /// Drops the waiting requests whose requester went away (their receiver closed): they
    /// are never computed. A preempted one holds no KV blocks (its blocks went at the
    /// preemption).
    fn drop_abandoned(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.request.events.is_closed());
        let dropped = (before - self.waiting.len()) as u64;
        if dropped > 0 {
            // Counted first: a scrape that sees the queue empty sees them aborted.
            self.metrics
                .aborted_waiting_total
                .fetch_add(dropped, Ordering::SeqCst);
            self.metrics.waiting.fetch_sub(dropped, Ordering::SeqCst);
        }
    }

    /// The running sequences' share of the step's token budget: one token per decoding
    /// sequence, then prompt chunks. Returns each running sequence's chunk (tokens) and the
    /// budget's tokens left.
    fn share_budget(&self) -> (Vec<usize>, usize) {
        let running = &self.running;
        let mut chunks: Vec<usize> = running
            .iter()
            .map(|r| usize::from(r.pending.len() == 1))
            .collect();
        let mut left = self.budget_tokens - chunks.iter().sum::<usize>();
        // Prompts in progress take at most half of the rest while new requests wait for a
        // slot, so a long prompt never holds a short one back for its whole prefill.
        let admitting = !self.waiting.is_empty() && running.len() < self.max_batch;
        // The nearest to done go first, so a short prompt cut by the budget finishes next
        // step instead of waiting out a long one.
        let mut for_partial = if admitting { left.div_ceil(2) } else { left };
        let mut partial: Vec<usize> = (0..running.len())
            .filter(|&i| running[i].pending.len() > 1)
            .collect();
        partial.sort_by_key(|&i| running[i].pending.len());
        for i in partial {
            chunks[i] = running[i].pending.len().min(for_partial);
            for_partial -= chunks[i];
            left -= chunks[i];
        }
        (chunks, left)
    }

    /// The running sequences' KV blocks for their `chunks`, preempting the most recently
    /// admitted while short (their chunks go back to `left_tokens`). The pool's counts are
    /// exact once the finished sequences' blocks are back (shared prefix blocks stay with
    /// their users). Returns the free blocks left, or `None` when one sequence alone has
    /// filled the pool (it finishes with `length`). Errors: the executor's.
    fn reserve_blocks(
        &mut self,
        executor: &mut dyn Executor,
        chunks: &mut Vec<usize>,
        left_tokens: &mut usize,
    ) -> Result<Option<usize>> {
        if !self.release.is_empty() {
            executor.step(&[], &std::mem::take(&mut self.release))?;
        }
        let mut needed: usize = self
            .running
            .iter()
            .zip(chunks.iter())
            .map(|(r, &c)| r.growth(c))
            .sum();
        let mut free = self.pool.free_blocks();
        while needed > free && self.running.len() > 1 {
            let mut victim = self.running.pop().expect("more than one running");
            let chunk = chunks.pop().expect("one chunk per running sequence");
            needed -= victim.growth(chunk);
            *left_tokens += chunk;
            executor.step(&[], &[victim.seq])?;
            free = self.pool.free_blocks();
            victim.preempt();
            self.metrics
                .preemptions_total
                .fetch_add(1, Ordering::SeqCst);
            self.metrics.waiting.fetch_add(1, Ordering::SeqCst);
            self.waiting.push_front(victim);
        }
        if needed > free {
            // One sequence alone has filled the pool: it cannot grow.
            let mut alone = self.running.pop().expect("one running");
            self.release.push(alone.seq);
            finish(&mut alone, FinishReason::Length, self.metrics);
            self.end(alone);
            return Ok(None);
        }
        Ok(Some(free - needed))
    }

    /// Admits waiting sequences into `plan` while batch room, `left_tokens` and
    /// `free_blocks` last; a request whose prompt needs more blocks than the pool holds
    /// hears an error instead.
    fn admit(&mut self, plan: &mut Vec<Planned>, free_blocks: &mut usize, left_tokens: &mut usize) {
        let (pool, metrics) = (&self.pool, self.metrics);
        while self.running.len() < self.max_batch && *left_tokens > 0 {
            let Some(candidate) = self.waiting.front() else {
                break;
            };
            // An imported sequence holds its prompt's positions and computes one token.
            let imported = candidate
                .import
                .map(|_| candidate.request.prompt_tokens.len());
            let total = candidate.pending.len() + imported.unwrap_or(0);
            if blocks_for(total) > pool.capacity_blocks() {
                let hopeless = self.waiting.pop_front().expect("front exists");
                metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                let _ = hopeless.request.events.send(Event::Error(format!(
                    "the prompt needs {} KV blocks; the cache holds {}",
                    blocks_for(total),
                    pool.capacity_blocks()
                )));
                continue;
            }
            // The last pending token is always computed: its logits give the next token.
            let hit = match imported {
                Some(_) => Default::default(),
                None => pool.cached_prefix(
                    &candidate.pending[..total - 1],
                    candidate.request.prompt_tokens.len(),
                ),
            };
            let chunk = (candidate.pending.len() - hit.tokens).min(*left_tokens);
            let blocks = blocks_for(imported.unwrap_or(hit.tokens) + chunk) - hit.held_blocks;
            if blocks > *free_blocks {
                break;
            }
            *free_blocks -= blocks;
            *left_tokens -= chunk;
            let mut admitted = self.waiting.pop_front().expect("front exists");
            metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            // (An imported sequence looked nothing up: its prefill replica did.)
            if pool.prefix_cache() && imported.is_none() {
                metrics
                    .prefix_cache_queries_total
                    .fetch_add(total as u64, Ordering::SeqCst);
                metrics
                    .prefix_cache_hits_total
                    .fetch_add(hit.tokens as u64, Ordering::SeqCst);
            }
            if admitted.prefix_hit_tokens.is_none() {
                admitted.prefix_hit_tokens = Some(hit.tokens);
                metrics.prompt_tokens_total.fetch_add(
                    admitted.request.prompt_tokens.len() as u64,
                    Ordering::SeqCst,
                );
            }
            plan.push(Planned {
                index: self.running.len(),
                prefix: hit.tokens,
                chunk,
            });
            self.running.push(admitted);
        }
    }

    /// The executor's entries for `plan`, taking each sequence's prefix and chunk from its
    /// pending tokens.
    fn step_entries(&mut self, plan: &[Planned]) -> Vec<StepEntry> {
        let metrics = self.metrics;
        plan.iter()
            .map(|p| {
                let r = &mut self.running[p.index];
                let prefix_tokens: Vec<u32> = r.pending.drain(..p.prefix).collect();
                let tokens: Vec<u32> = r.pending.drain(..p.chunk).collect();
                let import = r.import.take();
                r.cached_tokens +=
                    p.prefix + p.chunk + import.map_or(0, |_| r.request.prompt_tokens.len());
                let sample = r.pending.is_empty();
                // Every chunk of a prefill replica's prompt streams its KV to the decode
                // replica; the sampling one finishes the transfer. A request that ends at
                // its first token (`max_tokens` 1) has nothing to decode: its KV stays.
                let handoff = match r.request.pd {
                    Some(PdStage::Prefill { replica, transfer })
                        if r.generated.is_empty() && r.request.params.max_tokens > 1 =>
                    {
                        Some(Handoff { replica, transfer })
                    }
                    _ => None,
                };
                // A decode replica's sequence that starts without its KV: recomputation.
                if r.new && import.is_none() && matches!(r.request.pd, Some(PdStage::Decode { .. }))
                {
                    metrics
                        .pd_decode_prefill_tokens_total
                        .fetch_add(tokens.len() as u64, Ordering::SeqCst);
                }
                let params = std::mem::take(&mut r.new).then(|| r.request.params.clone());
                // An imported prompt's KV is checked against the prompt on every rank.
                let import_prompt = if import.is_some() && params.is_some() {
                    r.request.prompt_tokens.clone()
                } else {
                    Vec::new()
                };
                // The penalties count the prompt's and the output's tokens so far.
                let history = if params.as_ref().is_some_and(|p| p.penalized()) {
                    let mut history = r.request.prompt_tokens.clone();
                    history.extend(&r.generated);
                    history
                } else {
                    Vec::new()
                };
                StepEntry {
                    seq: r.seq,
                    tokens,
                    params,
                    sampled_before: r.generated.len(),
                    prompt_tokens: r.request.prompt_tokens.len(),
                    prefix_tokens,
                    sample,
                    handoff,
                    import_prompt,
                    import,
                    history,
                }
            })
            .collect()
    }

    /// Fails every running sequence with the step's `error`, releasing them at the next
    /// step.
    fn fail_running(&mut self, error: &anyhow::Error) {
        for mut r in std::mem::take(&mut self.running) {
            r.ending = Some(Event::Error(format!("{error:#}")));
            self.release.push(r.seq);
            self.end(r);
        }
    }

    /// Queues the ending event of `sequence`, which has left the running batch.
    fn end(&mut self, sequence: Running) {
        if let Some(ending) = sequence.ending {
            self.endings.push((sequence.request.events, ending));
        }
    }

    /// Stores the running gauge, then sends the queued ending events.
    fn send_endings(&mut self) {
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::SeqCst);
        for (events, ending) in self.endings.drain(..) {
            let _ = events.send(ending);
        }
    }

    /// Hands each planned sequence its `sampled` token (or its KV transfer's failure).
    /// Returns the indices of the running sequences that are done, the abandoned ones
    /// included.
    fn deliver_sampled(
        &mut self,
        executor: &mut dyn Executor,
        plan: &[Planned],
        sampled: &[Option<Sampled>],
    ) -> Vec<usize> {
        let now = Instant::now();
        let mut finished = Vec::new();
        // A failed KV transfer fails its request with an error, never a hang.
        let failures: HashMap<u64, String> =
            executor.take_transfer_failures().into_iter().collect();
        let tokenizer = executor.tokenizer();
        for (p, sampled) in plan.iter().zip(sampled) {
            let (index, r) = (p.index, &mut self.running[p.index]);
            if let Some(why) = failures.get(&r.seq) {
                // (A prefill whose first token ends the request needs no transfer.)
                let ends_here = sampled.as_ref().is_some_and(|s| {
                    let params = &r.request.params;
                    params.is_stop_token(s.token, &tokenizer.eos_ids, r.generated.len())
                        || params.max_tokens <= 1
                });
                if !ends_here {
                    // Counted before the client hears of it, so a scrape after the error
                    // sees it.
                    self.metrics
                        .pd_transfer_failures_total
                        .fetch_add(1, Ordering::SeqCst);
                    r.ending = Some(Event::Error(why.clone()));
                    finished.push(index);
                    continue;
                }
            }
            let Some(sampled) = sampled else {
                continue;
            };
            let token_ctx = TokenContext {
                tokenizer,
                metrics: self.metrics,
                now,
                max_context_tokens: self.max_context_tokens,
            };
            if deliver_token(r, sampled, &token_ctx) {
                finished.push(index);
            }
        }
        // A request whose client went away while its prompt was still running goes too.
        for (index, r) in self.running.iter().enumerate() {
            if r.request.events.is_closed() && !finished.contains(&index) {
                self.metrics
                    .aborted_running_total
                    .fetch_add(1, Ordering::SeqCst);
                finished.push(index);
            }
        }
        finished
    }

    /// Removes the `finished` running sequences (indices, any order), releasing them at
    /// the next step.
    fn remove_finished(&mut self, mut finished: Vec<usize>) {
        finished.sort_unstable();
        for index in finished.into_iter().rev() {
            let done = self.running.remove(index);
            self.release.push(done.seq);
            self.end(done);
        }
    }

    /// Stores the step's gauges and counters: the pool's KV, the KV bytes, parts and
    /// seconds `executor` has sent to decode replicas, and the sequences running.
    fn store_step_metrics(&self, executor: &dyn Executor) {
        let metrics = self.metrics;
        self.store_kv_metrics();
        let sent = executor.kv_sent();
        metrics
            .pd_kv_bytes_sent_total
            .store(sent.bytes, Ordering::SeqCst);
        metrics
            .pd_kv_parts_sent_total
            .store(sent.parts, Ordering::SeqCst);
        metrics
            .pd_kv_bytes_sent_shm_total
            .store(sent.shm_bytes, Ordering::SeqCst);
        metrics
            .pd_kv_send_micros_total
            .store((sent.secs * 1e6) as u64, Ordering::SeqCst);
        metrics
            .running
            .store(self.running.len() as u64, Ordering::SeqCst);
    }
}

/// What [`deliver_token`] reads besides the sequence and its token.
struct TokenContext<'a> {
    tokenizer: &'a Tokenizer,
    metrics: &'a Metrics,
    /// When the step's tokens arrived.
    now: Instant,
    /// The executor's context, tokens.
    max_context_tokens: usize,
}

/// Records `sampled` for sequence `r` (TTFT or TPOT, its text cut at a stop string) and
/// sends it to the requester, finishing the sequence on an end-of-sequence token, a stop
/// string, its `max_tokens` or the context, or handing a prefill replica's sequence off.
/// Returns whether the sequence is done (the client going away included).
fn deliver_token(r: &mut Running, sampled: &Sampled, ctx: &TokenContext) -> bool {
    let (metrics, now) = (ctx.metrics, ctx.now);
    let token = sampled.token;
    if r.first_token_at.is_none() {
        r.first_token_at = Some(now);
        metrics
            .ttft
            .observe((now - r.request.received_at).as_secs_f64());
    } else {
        metrics.tpot.observe((now - r.last_token_at).as_secs_f64());
    }
    r.last_token_at = now;
    let params = &r.request.params;
    if params.is_stop_token(token, &ctx.tokenizer.eos_ids, r.generated.len()) {
        finish(r, FinishReason::Stop, metrics);
        return true;
    }
    r.generated.push(token);
    metrics
        .generation_tokens_total
        .fetch_add(1, Ordering::SeqCst);
    let piece = r.stream.push(ctx.tokenizer, token).unwrap_or_default();
    r.text.push_str(&piece);
    let (piece, stopped) = if params.checks_stop_strings(r.generated.len()) {
        cut_at_stop(
            &r.text,
            piece,
            &params.stop,
            params.include_stop_str_in_output,
        )
    } else {
        (piece, false)
    };
    let sent = r.request.events.send(Event::Token {
        id: token,
        text: piece,
        logprob: sampled.logprob,
        top: sampled.top.clone(),
    });
    if sent.is_err() {
        // The client went away.
        metrics.aborted_running_total.fetch_add(1, Ordering::SeqCst);
        return true;
    }
    if stopped {
        finish(r, FinishReason::Stop, metrics);
        true
    } else if r.generated.len() >= r.request.params.max_tokens
        || r.request.prompt_tokens.len() + r.generated.len() >= ctx.max_context_tokens
    {
        finish(r, FinishReason::Length, metrics);
        true
    } else if matches!(r.request.pd, Some(PdStage::Prefill { .. })) {
        // Its KV went to the decode replica with this step: that one goes on.
        metrics.pd_handoffs_total.fetch_add(1, Ordering::SeqCst);
        r.ending = Some(Event::HandedOff {
            first_token: token,
            cached_tokens: r.prefix_hit_tokens.unwrap_or(0),
        });
        true
    } else {
        r.pending = vec![token];
        false
    }
}

/// The part of `piece` (the newest text at the end of `text`) to send, cut before the
/// earliest of the `stop` strings that ends in it (or after it, `include_stop`), and
/// whether one was found. Only text that `piece` completes is searched, as vLLM's
/// detokenizer does: a stop string wholly in the earlier text (before `min_tokens`) does
/// not count, and each token costs the length of its piece, not of the whole text.
fn cut_at_stop(text: &str, piece: String, stop: &[String], include_stop: bool) -> (String, bool) {
    let before = text.len() - piece.len();
    let found = stop
        .iter()
        .filter_map(|s| {
            // Moved up to a character boundary: a match from there still ends in `piece`.
            let mut from = before.saturating_sub(s.len().saturating_sub(1));
            while !text.is_char_boundary(from) {
                from += 1;
            }
            text[from..]
                .find(s.as_str())
                .map(|at| (from + at, from + at + s.len()))
        })
        .min();
    match found {
        Some((start, end)) => {
            let cut = if include_stop { end } else { start };
            (
                if cut > before {
                    text[before..cut].to_string()
                } else {
                    String::new()
                },
                true,
            )
        }
        None => (piece, false),
    }
}

/// Ends `sequence` (its ending event is sent once it has left the batch), and observes its
/// end-to-end latency.
fn finish(sequence: &mut Running, reason: FinishReason, metrics: &Metrics) {
    metrics
        .e2e
        .observe(sequence.request.received_at.elapsed().as_secs_f64());
    sequence.ending = Some(Event::Done {
        finish_reason: reason,
        prompt_tokens: sequence.request.prompt_tokens.len(),
        completion_tokens: sequence.generated.len(),
        cached_tokens: sequence.prefix_hit_tokens.unwrap_or(0),
    });
}

/// Requests served so far, for ids.
pub static REQUEST_COUNTER: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_looked_for_only_where_the_new_piece_completes_them() {
        let stop = |text: &str, piece: &str, stops: &[&str], include: bool| {
            let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
            cut_at_stop(text, piece.to_string(), &stops, include)
        };
        // A stop string across the piece's start: cut before it, or kept.
        assert_eq!(stop("ab END", "ND", &["END"], false), (String::new(), true));
        assert_eq!(stop("ab END", "ND", &["END"], true), ("ND".into(), true));
        assert_eq!(stop("ab EN x", "N x", &["EN"], true), ("N".into(), true));
        // One wholly in the earlier text (before `min_tokens`) does not stop it, a
        // multi-byte one included.
        assert_eq!(stop("ENDx", "x", &["END"], false), ("x".into(), false));
        assert_eq!(stop("éx", "x", &["é"], false), ("x".into(), false));
        assert_eq!(stop("aéb", "éb", &["é", "b"], false), (String::new(), true));
    }

    #[test]
    fn histograms_render_prometheus_samples_with_and_without_labels() {
        let histogram = Histogram::default();
        histogram.observe(0.003);
        histogram.observe(0.2);
        let snapshot = histogram.snapshot();
        let plain = snapshot.render("t_seconds", "Help.");
        assert!(plain.starts_with("# HELP t_seconds Help.\n# TYPE t_seconds histogram\n"));
        assert!(
            plain.contains("t_seconds_bucket{le=\"0.0025\"} 0\n"),
            "{plain}"
        );
        assert!(
            plain.contains("t_seconds_bucket{le=\"0.005\"} 1\n"),
            "{plain}"
        );
        assert!(
            plain.contains("t_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{plain}"
        );
        assert!(plain.contains("\nt_seconds_sum 0.203"), "{plain}");
        assert!(plain.ends_with("\nt_seconds_count 2\n"), "{plain}");
        let labelled = snapshot.render_labelled("t_seconds", "role=\"decode\"");
        assert!(
            labelled.contains("t_seconds_bucket{role=\"decode\",le=\"0.25\"} 2\n"),
            "{labelled}"
        );
        assert!(
            labelled.ends_with("t_seconds_count{role=\"decode\"} 2\n"),
            "{labelled}"
        );
        // An empty snapshot (a role no replica has) renders zeros in every bucket.
        let empty = HistogramSnapshot::default().render_labelled("t_seconds", "role=\"x\"");
        assert_eq!(empty.lines().count(), BUCKETS_SECS.len() + 3, "{empty}");
        assert!(
            empty.contains("t_seconds_bucket{role=\"x\",le=\"10\"} 0\n"),
            "{empty}"
        );
    }
}
