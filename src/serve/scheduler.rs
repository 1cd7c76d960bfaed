//! Continuous batching on one engine: a dedicated thread owns the model; every step it
//! admits waiting requests (up to `max_batch` running), runs one forward over all running
//! sequences — new prompts (prefill) and one new token of each running sequence (decode)
//! in the same batch — samples, and streams each sequence's new text to its requester.
//! Finished or abandoned sequences leave the batch at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use crate::runtime::exec::engine::LocalExecutor;
use crate::runtime::exec::engine::{Engine, FinishReason};
use crate::runtime::exec::executor::{Executor, StepEntry};
use crate::runtime::exec::kv::blocks_for;
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::TextStream;

/// A generation request.
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// Where the events of this request go; dropping the receiver cancels it.
    pub events: UnboundedSender<Event>,
    pub received_at: Instant,
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
    },
    /// The engine failed on this request.
    Error(String),
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
    pub ttft: Histogram,
    pub tpot: Histogram,
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
        let mut out = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
        for (bound, count) in BUCKETS_SECS.iter().zip(&self.buckets) {
            out.push_str(&format!("{name}_bucket{{le=\"{bound}\"}} {count}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n",
            self.count, self.sum_secs, self.count
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
    pub ttft: HistogramSnapshot,
    pub tpot: HistogramSnapshot,
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
        self.ttft.add(&other.ttft);
        self.tpot.add(&other.tpot);
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
            ttft: self.ttft.snapshot(),
            tpot: self.tpot.snapshot(),
        }
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

impl Scheduler {
    /// Starts the scheduling thread, which owns `engine`, with at most `max_batch`
    /// sequences running at once (others wait, in arrival order).
    pub fn start(engine: Engine, max_batch: usize) -> Scheduler {
        Scheduler::spawn(max_batch, move |run| run(&mut LocalExecutor::new(&engine)))
    }

    /// Starts the scheduling thread over `executor` (a replica's driver).
    pub fn start_with(executor: Box<dyn Executor + 'static>, max_batch: usize) -> Scheduler {
        let mut executor = executor;
        Scheduler::spawn(max_batch, move |run| run(executor.as_mut()))
    }

    /// Spawns the thread; `with_executor` makes the executor inside it and calls the loop.
    fn spawn(
        max_batch: usize,
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
                    run(executor, &receiver, max_batch.max(1), &thread_metrics)
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
        self.metrics.requests_total.fetch_add(1, Ordering::SeqCst);
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
    /// Tokens to feed at the next step (the prompt, then the last sampled token; after a
    /// preemption, the prompt and every token generated so far).
    pending: Vec<u32>,
    /// Positions the executor holds in this sequence's KV cache.
    cached_tokens: usize,
    generated: Vec<u32>,
    stream: TextStream,
    text: String,
    first_token_at: Option<Instant>,
    last_token_at: Instant,
}

impl Running {
    /// KV blocks this sequence holds now, and will hold after its next step.
    fn blocks(&self) -> (usize, usize) {
        (
            blocks_for(self.cached_tokens),
            blocks_for(self.cached_tokens + self.pending.len()),
        )
    }

    /// Drops the executor's state: the sequence will start over from its prompt and the
    /// tokens generated so far (recomputation, as vLLM preempts by default).
    fn preempt(&mut self) {
        self.new = true;
        self.cached_tokens = 0;
        self.pending = self.request.prompt_tokens.clone();
        self.pending.extend(&self.generated);
    }
}

/// The scheduling loop. Returns when every [`Scheduler`] handle is gone, or with the error
/// of an executor whose errors are fatal.
///
/// Each step it plans KV blocks from the executor's pool: the running sequences' growth
/// first, preempting the most recently admitted ones (their blocks freed, themselves put
/// back at the head of the queue) while that does not fit; then admits waiting sequences in
/// arrival order while their blocks fit and the batch has room. A request is never dropped;
/// only a sequence that cannot grow even alone finishes early with `length`.
fn run(
    executor: &mut dyn Executor,
    receiver: &mpsc::Receiver<Request>,
    max_batch: usize,
    metrics: &Metrics,
) -> Result<()> {
    let mut running: Vec<Running> = Vec::new();
    let mut waiting: VecDeque<Running> = VecDeque::new();
    // Sequences to drop at the next step, with the blocks they hold.
    let mut release: Vec<(u64, usize)> = Vec::new();
    let mut next_seq = 0u64;
    let max_context = executor.max_context_tokens();
    let pool = Arc::clone(executor.kv_pool());
    metrics
        .kv_blocks_total
        .store(pool.capacity_blocks() as u64, Ordering::SeqCst);
    let mut receive = |request: Request| {
        next_seq += 1;
        Running {
            seq: next_seq,
            new: true,
            pending: request.prompt_tokens.clone(),
            cached_tokens: 0,
            generated: Vec::new(),
            stream: TextStream::default(),
            text: String::new(),
            first_token_at: None,
            last_token_at: Instant::now(),
            request,
        }
    };
    loop {
        // Wait when idle (telling the executor we are alive), then take what has arrived.
        while running.is_empty() && waiting.is_empty() {
            if !release.is_empty() {
                let seqs: Vec<u64> = release.drain(..).map(|(seq, _)| seq).collect();
                executor.step(&[], &seqs)?;
                metrics
                    .kv_blocks_used
                    .store(pool.used_blocks() as u64, Ordering::SeqCst);
                metrics.kv_cache_bytes.store(
                    (pool.used_blocks() * pool.block_bytes()) as u64,
                    Ordering::SeqCst,
                );
            }
            match receiver.recv_timeout(Duration::from_secs(1)) {
                Ok(request) => waiting.push_back(receive(request)),
                Err(mpsc::RecvTimeoutError::Timeout) => executor.idle()?,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
        while let Ok(request) = receiver.try_recv() {
            waiting.push_back(receive(request));
        }

        // Plan the blocks of this step.
        let mut free = pool.free_blocks() + release.iter().map(|(_, b)| b).sum::<usize>();
        let growth = |r: &Running| {
            let (now, after) = r.blocks();
            after - now
        };
        let mut needed: usize = running.iter().map(growth).sum();
        while needed > free && running.len() > 1 {
            let mut victim = running.pop().expect("more than one running");
            needed -= growth(&victim);
            let held = victim.blocks().0;
            free += held;
            release.push((victim.seq, held));
            victim.preempt();
            metrics.preemptions_total.fetch_add(1, Ordering::SeqCst);
            metrics.waiting.fetch_add(1, Ordering::SeqCst);
            waiting.push_front(victim);
        }
        if needed > free {
            // One sequence alone has filled the pool: it cannot grow.
            let mut alone = running.pop().expect("one running");
            release.push((alone.seq, alone.blocks().0));
            finish(&mut alone, FinishReason::Length);
            continue;
        }
        free -= needed;
        while running.len() < max_batch {
            let Some(candidate) = waiting.front() else {
                break;
            };
            let blocks = candidate.blocks().1;
            if blocks > pool.capacity_blocks() {
                let hopeless = waiting.pop_front().expect("front exists");
                metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                let _ = hopeless.request.events.send(Event::Error(format!(
                    "the prompt needs {blocks} KV blocks; the cache holds {}",
                    pool.capacity_blocks()
                )));
                continue;
            }
            if blocks > free {
                break;
            }
            free -= blocks;
            let admitted = waiting.pop_front().expect("front exists");
            metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            if admitted.generated.is_empty() {
                metrics.prompt_tokens_total.fetch_add(
                    admitted.request.prompt_tokens.len() as u64,
                    Ordering::SeqCst,
                );
            }
            running.push(admitted);
        }
        metrics
            .running
            .store(running.len() as u64, Ordering::SeqCst);
        if running.is_empty() {
            // Nothing fits until released blocks come back.
            let seqs: Vec<u64> = release.drain(..).map(|(seq, _)| seq).collect();
            executor.step(&[], &seqs)?;
            continue;
        }

        let entries: Vec<StepEntry> = running
            .iter_mut()
            .map(|r| {
                r.cached_tokens += r.pending.len();
                StepEntry {
                    seq: r.seq,
                    tokens: std::mem::take(&mut r.pending),
                    params: std::mem::take(&mut r.new).then(|| r.request.params.clone()),
                    sampled_before: r.generated.len(),
                }
            })
            .collect();
        let seqs: Vec<u64> = release.drain(..).map(|(seq, _)| seq).collect();
        let sampled = match executor.step(&entries, &seqs) {
            Ok(sampled) => sampled,
            Err(error) => {
                for r in running.drain(..) {
                    let _ = r.request.events.send(Event::Error(format!("{error:#}")));
                    release.push((r.seq, 0));
                }
                if executor.errors_are_fatal() {
                    return Err(error);
                }
                continue;
            }
        };
        let now = Instant::now();
        let mut finished = Vec::new();
        for (index, (r, sampled)) in running.iter_mut().zip(&sampled).enumerate() {
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
            if executor.tokenizer().eos_ids.contains(&token) {
                finish(r, FinishReason::Stop);
                finished.push(index);
                continue;
            }
            r.generated.push(token);
            metrics
                .generation_tokens_total
                .fetch_add(1, Ordering::SeqCst);
            let piece = r
                .stream
                .push(executor.tokenizer(), token)
                .unwrap_or_default();
            r.text.push_str(&piece);
            let (piece, stopped) = match r
                .request
                .params
                .stop
                .iter()
                .filter_map(|s| r.text.find(s.as_str()))
                .min()
            {
                Some(cut) => {
                    let before = r.text.len() - piece.len();
                    (
                        if cut > before {
                            r.text[before..cut].to_string()
                        } else {
                            String::new()
                        },
                        true,
                    )
                }
                None => (piece, false),
            };
            let sent = r.request.events.send(Event::Token {
                id: token,
                text: piece,
                logprob: sampled.logprob,
                top: sampled.top.clone(),
            });
            if sent.is_err() {
                // The client went away.
                finished.push(index);
                continue;
            }
            if stopped {
                finish(r, FinishReason::Stop);
                finished.push(index);
            } else if r.generated.len() >= r.request.params.max_tokens
                || r.request.prompt_tokens.len() + r.generated.len() >= max_context
            {
                finish(r, FinishReason::Length);
                finished.push(index);
            } else {
                r.pending = vec![token];
            }
        }
        for index in finished.into_iter().rev() {
            let done = running.remove(index);
            release.push((done.seq, done.blocks().0));
        }
        let used = pool.used_blocks();
        metrics
            .kv_cache_bytes
            .store((used * pool.block_bytes()) as u64, Ordering::SeqCst);
        metrics.kv_blocks_used.store(used as u64, Ordering::SeqCst);
        metrics
            .running
            .store(running.len() as u64, Ordering::SeqCst);
    }
}

/// Tells the requester that `sequence` is done.
fn finish(sequence: &mut Running, reason: FinishReason) {
    let _ = sequence.request.events.send(Event::Done {
        finish_reason: reason,
        prompt_tokens: sequence.request.prompt_tokens.len(),
        completion_tokens: sequence.generated.len(),
    });
}

/// Requests served so far, for ids.
pub static REQUEST_COUNTER: AtomicU64 = AtomicU64::new(0);
