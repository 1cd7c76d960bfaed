//! Continuous batching on one engine: a dedicated thread owns the model; every step it
//! admits waiting requests (up to `max_batch` running), runs one forward over all running
//! sequences — new prompts (prefill) and one new token of each running sequence (decode)
//! in the same batch — samples, and streams each sequence's new text to its requester.
//! Finished or abandoned sequences leave the batch at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::runtime::engine::{Engine, FinishReason};
use crate::runtime::llama::{KvCache, SequenceInput};
use crate::runtime::sampling::{Sampler, SamplingParams, logprob};

/// A generation request.
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// Where the events of this request go; dropping the receiver cancels it.
    pub events: UnboundedSender<Event>,
    pub received_at: Instant,
}

/// What a request hears back.
#[derive(Debug, Clone)]
pub enum Event {
    /// One generated token: its id, the text it completed (possibly empty while a UTF-8
    /// character is incomplete) and its log-probability.
    Token { id: u32, text: String, logprob: f32 },
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

    /// Prometheus text lines for metric `name`.
    pub fn render(&self, name: &str, help: &str) -> String {
        let guard = self.counts.lock().expect("histogram lock");
        let mut out = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
        for (bound, count) in BUCKETS_SECS.iter().zip(&guard.0) {
            out.push_str(&format!("{name}_bucket{{le=\"{bound}\"}} {count}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n",
            guard.1, guard.2, guard.1
        ));
        out
    }
}

/// The handle the HTTP side uses.
#[derive(Clone)]
pub struct Scheduler {
    sender: mpsc::Sender<Request>,
    pub metrics: Arc<Metrics>,
}

impl Scheduler {
    /// Starts the scheduling thread, which owns `engine`, with at most `max_batch`
    /// sequences running at once (others wait, in arrival order).
    pub fn start(engine: Engine, max_batch: usize) -> Scheduler {
        let (sender, receiver) = mpsc::channel::<Request>();
        let metrics = Arc::new(Metrics::default());
        let thread_metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || run(engine, receiver, max_batch.max(1), &thread_metrics))
            .expect("the scheduler thread starts");
        Scheduler { sender, metrics }
    }

    /// Queues a request. Errors: the scheduler has stopped.
    pub fn submit(&self, request: Request) -> Result<(), String> {
        self.metrics.waiting.fetch_add(1, Ordering::SeqCst);
        self.metrics.requests_total.fetch_add(1, Ordering::SeqCst);
        self.sender
            .send(request)
            .map_err(|_| "the engine has stopped".to_string())
    }
}

/// A running sequence.
struct Running {
    request: Request,
    cache: KvCache,
    sampler: Sampler,
    /// Tokens to feed at the next step (the prompt, then the last sampled token).
    pending: Vec<u32>,
    generated: Vec<u32>,
    emitted_bytes: usize,
    text: String,
    first_token_at: Option<Instant>,
    last_token_at: Instant,
}

fn run(engine: Engine, receiver: mpsc::Receiver<Request>, max_batch: usize, metrics: &Metrics) {
    let mut running: Vec<Running> = Vec::new();
    let max_context = engine.model.config.max_context_tokens;
    loop {
        // Admit: block when idle, otherwise take what is waiting.
        if running.is_empty() {
            match receiver.recv() {
                Ok(request) => running.push(admit(&engine, request, metrics)),
                Err(_) => return,
            }
        }
        while running.len() < max_batch {
            match receiver.try_recv() {
                Ok(request) => running.push(admit(&engine, request, metrics)),
                Err(_) => break,
            }
        }
        metrics
            .running
            .store(running.len() as u64, Ordering::SeqCst);

        let result = engine.install(|| {
            let mut batch: Vec<SequenceInput<'_>> = running
                .iter_mut()
                .map(|r| SequenceInput {
                    tokens: &r.pending,
                    cache: &mut r.cache,
                    all_logits: false,
                })
                .collect();
            engine.model.forward(&mut batch)
        });
        let logits = match result {
            Ok(logits) => logits,
            Err(error) => {
                for r in running.drain(..) {
                    let _ = r.request.events.send(Event::Error(format!("{error:#}")));
                }
                continue;
            }
        };
        let now = Instant::now();
        let mut finished = Vec::new();
        for (index, (r, logits)) in running.iter_mut().zip(&logits).enumerate() {
            let token = r.sampler.sample(logits);
            if r.first_token_at.is_none() {
                r.first_token_at = Some(now);
                metrics
                    .ttft
                    .observe((now - r.request.received_at).as_secs_f64());
            } else {
                metrics.tpot.observe((now - r.last_token_at).as_secs_f64());
            }
            r.last_token_at = now;
            let eos = engine.tokenizer.eos_ids.contains(&token);
            let mut finish = None;
            if eos {
                finish = Some(FinishReason::Stop);
            } else {
                r.generated.push(token);
                metrics
                    .generation_tokens_total
                    .fetch_add(1, Ordering::SeqCst);
                let piece = match engine.tokenizer.decode(&r.generated, true) {
                    Ok(text)
                        if !text.ends_with('\u{FFFD}')
                            && text.is_char_boundary(r.emitted_bytes.min(text.len()))
                            && text.len() >= r.emitted_bytes =>
                    {
                        let piece = text[r.emitted_bytes..].to_string();
                        r.emitted_bytes = text.len();
                        r.text = text;
                        piece
                    }
                    _ => String::new(),
                };
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
                    logprob: logprob(logits, token),
                });
                if sent.is_err() {
                    finished.push(index);
                    continue;
                }
                if stopped {
                    finish = Some(FinishReason::Stop);
                } else if r.generated.len() >= r.request.params.max_tokens
                    || r.request.prompt_tokens.len() + r.generated.len() >= max_context
                {
                    finish = Some(FinishReason::Length);
                }
            }
            match finish {
                Some(reason) => {
                    let _ = r.request.events.send(Event::Done {
                        finish_reason: reason,
                        prompt_tokens: r.request.prompt_tokens.len(),
                        completion_tokens: r.generated.len(),
                    });
                    finished.push(index);
                }
                None => r.pending = vec![token],
            }
        }
        for index in finished.into_iter().rev() {
            running.swap_remove(index);
        }
        let kv_bytes: usize = running.iter().map(|r| r.cache.bytes()).sum();
        metrics
            .kv_cache_bytes
            .store(kv_bytes as u64, Ordering::SeqCst);
        metrics
            .running
            .store(running.len() as u64, Ordering::SeqCst);
    }
}

fn admit(engine: &Engine, request: Request, metrics: &Metrics) -> Running {
    metrics.waiting.fetch_sub(1, Ordering::SeqCst);
    metrics
        .prompt_tokens_total
        .fetch_add(request.prompt_tokens.len() as u64, Ordering::SeqCst);
    Running {
        cache: engine.model.new_cache(),
        sampler: Sampler::new(&request.params),
        pending: request.prompt_tokens.clone(),
        generated: Vec::new(),
        emitted_bytes: 0,
        text: String::new(),
        first_token_at: None,
        last_token_at: Instant::now(),
        request,
    }
}

/// Requests served so far, for ids.
pub static REQUEST_COUNTER: AtomicU64 = AtomicU64::new(0);
