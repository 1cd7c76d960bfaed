//! The scheduler over the real SmolLM2 engine in this process: chunked prefill under a
//! token budget and the prefix cache (adoption, eviction, preemption) give exactly the
//! tokens of whole, uncached prompts; every step is recorded to check what ran.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use infer::runtime::cpu::quant::Numerics;
use infer::runtime::exec::engine::{Engine, LocalExecutor};
use infer::runtime::exec::executor::{Executor, Sampled, StepEntry};
use infer::runtime::model::chat::ChatMessage;
use infer::runtime::model::kv::{BLOCK_TOKENS, KvPool};
use infer::runtime::model::sampling::SamplingParams;
use infer::runtime::model::tokenizer::Tokenizer;
use infer::serve::scheduler::{Event, Limits, Request, Scheduler};

use crate::support::model::{QUESTIONS, SYSTEM};

/// A fresh SmolLM2 engine (2 threads) with a KV pool of `capacity_tokens`, leaked so an
/// executor can borrow it for the scheduler thread's lifetime.
fn engine(capacity_tokens: Option<usize>) -> &'static Engine {
    let path = crate::support::model::smollm2();
    let mut engine = Engine::load(&path, 2, Numerics::Exact).expect("SmolLM2 loads");
    engine.model.set_kv_capacity(capacity_tokens);
    Box::leak(Box::new(engine))
}

/// One step as the executor saw it: `(seq, prefix tokens adopted, tokens computed,
/// sampled)` per entry, and the sequences released first.
#[derive(Clone, Debug)]
struct StepRecord {
    entries: Vec<(u64, usize, usize, bool)>,
    release: Vec<u64>,
}

/// The engine's executor, recording every step.
struct Recording {
    inner: LocalExecutor<'static>,
    steps: Arc<Mutex<Vec<StepRecord>>>,
}

impl Executor for Recording {
    fn step(
        &mut self,
        entries: &[StepEntry],
        release: &[u64],
    ) -> anyhow::Result<Vec<Option<Sampled>>> {
        self.steps.lock().expect("steps").push(StepRecord {
            entries: entries
                .iter()
                .map(|e| (e.seq, e.prefix_tokens.len(), e.tokens.len(), e.sample))
                .collect(),
            release: release.to_vec(),
        });
        self.inner.step(entries, release)
    }

    fn tokenizer(&self) -> &Tokenizer {
        self.inner.tokenizer()
    }

    fn max_context_tokens(&self) -> usize {
        self.inner.max_context_tokens()
    }

    fn kv_pool(&self) -> &Arc<KvPool> {
        self.inner.kv_pool()
    }
}

/// A scheduler over `engine` with `limits`, its executor recording every step into the
/// returned list.
fn start_recording(
    engine: &'static Engine,
    limits: Limits,
) -> (Scheduler, Arc<Mutex<Vec<StepRecord>>>) {
    let steps = Arc::new(Mutex::new(Vec::new()));
    let executor = Recording {
        inner: LocalExecutor::new(engine),
        steps: Arc::clone(&steps),
    };
    (Scheduler::start_with(Box::new(executor), limits), steps)
}

/// Greedy sampling of up to `max_tokens` tokens.
fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    }
}

/// What a request got back: its tokens and the prompt tokens the prefix cache supplied.
#[derive(Debug)]
struct Outcome {
    tokens: Vec<u32>,
    cached_tokens: usize,
}

type Pending = tokio::sync::mpsc::UnboundedReceiver<Event>;

/// Submits `prompt` to `scheduler`; returns the receiver of its events.
fn submit(scheduler: &Scheduler, prompt: &[u32], params: &SamplingParams) -> Pending {
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    scheduler
        .submit(Request {
            prompt_tokens: prompt.to_vec(),
            params: params.clone(),
            events,
            received_at: Instant::now(),
            pd: None,
        })
        .expect("the scheduler runs");
    receiver
}

/// Reads a request's events to its end: what it got back (panics on an error or a hand-off).
fn outcome_of(mut receiver: Pending) -> Outcome {
    let mut tokens = Vec::new();
    while let Some(event) = receiver.blocking_recv() {
        match event {
            Event::Token { id, .. } => tokens.push(id),
            Event::Done { cached_tokens, .. } => {
                return Outcome {
                    tokens,
                    cached_tokens,
                };
            }
            Event::Error(message) => panic!("request failed: {message}"),
            Event::HandedOff { .. } => panic!("a colocated request was handed off"),
        }
    }
    panic!("the scheduler stopped")
}

/// The tokens `Engine::generate` gives for `prompt` (whole prefill, no prefix cache).
fn reference(engine: &Engine, prompt: &[u32], params: &SamplingParams) -> Vec<u32> {
    let cached = engine.model.kv_pool().prefix_cache();
    engine.model.kv_pool().set_prefix_cache(false);
    let tokens = engine
        .generate(prompt, params, &mut |_| {})
        .expect("generate")
        .tokens;
    engine.model.kv_pool().set_prefix_cache(cached);
    tokens
}

fn chat(engine: &Engine, messages: &[(&str, &str)]) -> Vec<u32> {
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|(role, content)| ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        })
        .collect();
    let text = engine.chat_prompt(&messages).expect("template");
    engine.tokenizer.encode(&text, false).expect("encode")
}

#[test]
fn chunked_prefill_gives_the_tokens_of_whole_prompts_with_decodes_first_and_steps_within_budget() {
    let engine = engine(None);
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| {
            let mut turns = vec![("system", SYSTEM), ("user", QUESTIONS[i])];
            if i % 2 == 1 {
                turns.remove(0);
            }
            chat(engine, &turns)
        })
        .collect();
    let params = greedy(10);
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference(engine, p, &params))
        .collect();
    let budget = 16;
    let (scheduler, steps) = start_recording(
        engine,
        Limits {
            max_batch: 4,
            max_batched_tokens: budget,
        },
    );
    let pending: Vec<Pending> = prompts
        .iter()
        .map(|p| submit(&scheduler, p, &params))
        .collect();
    for (index, (receiver, expected)) in pending.into_iter().zip(&expected).enumerate() {
        assert_eq!(&outcome_of(receiver).tokens, expected, "prompt {index}");
    }

    let steps = steps.lock().expect("steps").clone();
    let mut decoding: HashSet<u64> = HashSet::new();
    let mut chunks = 0;
    for (number, step) in steps.iter().enumerate() {
        for seq in &step.release {
            decoding.remove(seq);
        }
        let total: usize = step.entries.iter().map(|e| e.2).sum();
        assert!(
            total <= budget,
            "step {number} ran {total} tokens: {step:?}"
        );
        let present: HashSet<u64> = step.entries.iter().map(|e| e.0).collect();
        if !step.entries.is_empty() {
            assert!(
                decoding.is_subset(&present),
                "step {number} left out a decoding sequence: {step:?} (decoding {decoding:?})"
            );
        }
        for &(seq, _, tokens, sample) in &step.entries {
            if sample {
                decoding.insert(seq);
            } else {
                chunks += 1;
                assert_eq!(tokens, total.min(tokens), "step {number}");
            }
        }
    }
    // Every prompt is longer than the budget: each ran in several chunks.
    assert!(prompts.iter().all(|p| p.len() > budget));
    assert!(
        chunks >= prompts.len(),
        "only {chunks} unsampled prompt chunks"
    );
}

/// A short prompt that arrives with a long one is not held back for the long one's whole
/// prefill: while it waits, prompts in progress take at most half of the budget.
#[test]
fn a_short_prompt_gets_past_a_long_prompts_chunks() {
    let engine = engine(None);
    let long: Vec<u32> = std::iter::repeat_n(chat(engine, &[("system", SYSTEM)]), 5)
        .flatten()
        .collect();
    let short = chat(engine, &[("user", QUESTIONS[0])]);
    let params = greedy(4);
    let expected = [
        reference(engine, &long, &params),
        reference(engine, &short, &params),
    ];
    let (scheduler, steps) = start_recording(
        engine,
        Limits {
            max_batch: 4,
            max_batched_tokens: 32,
        },
    );
    let pending = [
        submit(&scheduler, &long, &params),
        submit(&scheduler, &short, &params),
    ];
    for (receiver, expected) in pending.into_iter().zip(&expected) {
        assert_eq!(&outcome_of(receiver).tokens, expected);
    }
    let steps = steps.lock().expect("steps").clone();
    let first_sample = |seq: u64| {
        steps
            .iter()
            .position(|s| s.entries.iter().any(|e| e.0 == seq && e.3))
            .expect("sampled")
    };
    let (long_first, short_first) = (first_sample(1), first_sample(2));
    assert!(long.len() > 10 * 32, "{} tokens", long.len());
    assert!(
        short_first <= 3 && short_first < long_first,
        "the short prompt sampled first at step {short_first}, the long one at {long_first}"
    );
}

#[test]
fn the_prefix_cache_serves_a_shared_system_prompt_and_changes_no_token() {
    let engine = engine(Some(8192));
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| chat(engine, &[("system", SYSTEM), ("user", q)]))
        .collect();
    let shared = prompts[0]
        .iter()
        .zip(&prompts[1])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        shared >= 4 * BLOCK_TOKENS,
        "the system prompt spans {shared} tokens"
    );
    let params = greedy(8);
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference(engine, p, &params))
        .collect();
    assert!(engine.model.kv_pool().set_prefix_cache(true));
    let (scheduler, steps) = start_recording(engine, Limits::with_max_batch(4, 2));
    let mut cached = Vec::new();
    for (index, (prompt, expected)) in prompts.iter().zip(&expected).enumerate() {
        let outcome = outcome_of(submit(&scheduler, prompt, &params));
        assert_eq!(&outcome.tokens, expected, "question {index}");
        cached.push(outcome.cached_tokens);
    }
    assert_eq!(cached[0], 0, "nothing is cached before the first request");
    for (index, &hit) in cached.iter().enumerate().skip(1) {
        assert!(
            hit >= shared / BLOCK_TOKENS * BLOCK_TOKENS && hit % BLOCK_TOKENS == 0,
            "question {index}: {hit} cached tokens of a {shared}-token shared prefix"
        );
        assert!(
            hit < prompts[index].len(),
            "question {index}: the last token is computed"
        );
    }
    // The executor adopted exactly what the requests report, and computed only the rest.
    let steps = steps.lock().expect("steps").clone();
    let adopted: Vec<usize> = steps
        .iter()
        .flat_map(|s| s.entries.iter().filter(|e| e.1 > 0).map(|e| e.1))
        .collect();
    assert_eq!(adopted, cached[1..].to_vec());
    let metrics = scheduler.metrics.snapshot();
    assert_eq!(
        metrics.prefix_cache_hits_total,
        cached.iter().sum::<usize>() as u64
    );
    assert_eq!(
        metrics.prefix_cache_queries_total,
        prompts.iter().map(Vec::len).sum::<usize>() as u64
    );

    // A follow-up turn: the first conversation's prompt, its answer, a new question. The
    // answer's positions were decode steps, which a whole prefill computes in another
    // order: only the blocks of the first prompt are reused, and the tokens stay exact.
    let answer = engine.tokenizer.decode(&expected[0], true).expect("decode");
    let follow_up = chat(
        engine,
        &[
            ("system", SYSTEM),
            ("user", QUESTIONS[0]),
            ("assistant", answer.as_str()),
            ("user", "And where does it live?"),
        ],
    );
    let expected_follow_up = reference(engine, &follow_up, &params);
    let outcome = outcome_of(submit(&scheduler, &follow_up, &params));
    assert_eq!(outcome.tokens, expected_follow_up);
    assert!(
        outcome.cached_tokens >= shared / BLOCK_TOKENS * BLOCK_TOKENS
            && outcome.cached_tokens <= prompts[0].len(),
        "{} cached tokens (first prompt {})",
        outcome.cached_tokens,
        prompts[0].len()
    );
}

#[test]
fn evicted_and_preempted_prefixes_are_recomputed_exactly() {
    // 10 blocks: two sequences' worth; the cache must evict to admit new prompts and
    // preempt when concurrent sequences grow.
    let engine = engine(Some(10 * BLOCK_TOKENS));
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| chat(engine, &[("system", SYSTEM), ("user", q)]))
        .collect();
    assert!(prompts.iter().all(|p| p.len() < 6 * BLOCK_TOKENS));
    let params = greedy(20);
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference(engine, p, &params))
        .collect();
    assert!(engine.model.kv_pool().set_prefix_cache(true));
    let (scheduler, _steps) = start_recording(engine, Limits::with_max_batch(4, 2));
    // Four at once, twice: preemption; then one by one: eviction.
    for (round, prompts) in prompts.chunks(4).enumerate() {
        let pending: Vec<Pending> = prompts
            .iter()
            .map(|p| submit(&scheduler, p, &params))
            .collect();
        for (index, receiver) in pending.into_iter().enumerate() {
            let question = round * 4 + index;
            assert_eq!(
                outcome_of(receiver).tokens,
                expected[question],
                "question {question}, concurrent"
            );
        }
    }
    for (index, (prompt, expected)) in prompts.iter().zip(&expected).enumerate() {
        let outcome = outcome_of(submit(&scheduler, prompt, &params));
        assert_eq!(&outcome.tokens, expected, "question {index}, alone");
    }
    let metrics = scheduler.metrics.snapshot();
    assert!(metrics.preemptions_total > 0, "{metrics:?}");
    assert!(engine.model.kv_pool().evictions() > 0);
    assert!(metrics.prefix_cache_hits_total > 0, "{metrics:?}");
}

/// The KV hand-off of prefill/decode disaggregation: a prompt prefilled against one pool,
/// its keys and values exported in two layer ranges (as a prefill would stream them) and
/// imported into another pool, decodes there bit for bit as it would have where it was
/// prefilled; the bytes are exactly the prompt's KV size, and the receiving pool caches
/// the imported blocks for later prompts.
#[test]
fn a_prompts_kv_moved_to_another_pool_decodes_bit_for_bit() {
    use infer::runtime::model::llama::SequenceInput;
    use infer::runtime::model::sampling::argmax;
    let engine = engine(None);
    let model = &engine.model;
    let c = &model.config;
    let prompt = chat(engine, &[("system", SYSTEM), ("user", QUESTIONS[3])]);
    let step = |cache: &mut infer::runtime::model::kv::KvCache, tokens: &[u32]| {
        let mut batch = [SequenceInput {
            tokens,
            cache,
            all_logits: false,
        }];
        engine
            .install(|| model.forward(&mut batch))
            .expect("forward")
            .remove(0)
    };
    let mut here = model.new_cache();
    let logits = step(&mut here, &prompt);
    let first = argmax(&logits);

    let layers = model.layers.len();
    // In four parts (two layer ranges × two position ranges), imported out of order, one
    // of them twice (a recomputed chunk sends identical values again).
    let (halves, cut) = ([0..layers / 2, layers / 2..layers], prompt.len() / 3);
    let mut transfers: Vec<_> = halves
        .iter()
        .flat_map(|range| [(range.clone(), 0..cut), (range.clone(), cut..prompt.len())])
        .map(|(layers, positions)| here.export(layers, positions).expect("export"))
        .collect();
    transfers.reverse();
    let kv_bytes: usize = transfers.iter().map(|t| t.kv_bytes()).sum();
    assert_eq!(
        kv_bytes,
        prompt.len() * layers * 2 * c.n_kv_heads * c.head_dim * 2
    );
    let decode_pool = KvPool::new(layers, c.n_kv_heads, c.head_dim, Some(4096));
    assert!(decode_pool.set_prefix_cache(true));
    let mut there = decode_pool.new_cache();
    for transfer in transfers.iter().chain(&transfers[1..2]) {
        there.import(transfer).expect("import");
    }
    there.finish_import();
    assert_eq!(there.n_tokens, prompt.len());
    assert_eq!(
        decode_pool.cached_prefix(&prompt, prompt.len()).tokens,
        prompt.len() / BLOCK_TOKENS * BLOCK_TOKENS
    );

    let (mut a, mut b) = (first, first);
    for i in 0..12 {
        let (la, lb) = (step(&mut here, &[a]), step(&mut there, &[b]));
        assert!(
            la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()),
            "decode step {i}: the logits differ"
        );
        (a, b) = (argmax(&la), argmax(&lb));
    }

    // Another geometry refuses the transfer, saying why.
    let other = KvPool::new(layers, c.n_kv_heads + 1, c.head_dim, None);
    let error = other
        .new_cache()
        .import(&transfers[0])
        .expect_err("another geometry");
    assert!(
        error.to_string().contains("must shard the model alike"),
        "{error}"
    );
}
