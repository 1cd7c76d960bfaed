//! Prefix caching and chunked prefill through `infer up` (real processes, real HTTP): the
//! same long system prompt with eight questions is served from the cache from the second
//! request on (`usage.prompt_tokens_details.cached_tokens`, `/metrics`), with exactly the
//! answers of `--no-prefix-cache` — in one process, over TP 3 and PP 2 ranks, and with a
//! KV cache so small that blocks are evicted and sequences preempted.

use serde_json::{Value, json};

use crate::support::model::{QUESTIONS, SYSTEM};
use crate::support::process::run;
use crate::support::server::{Server, metric};

fn bodies() -> Vec<Value> {
    QUESTIONS
        .iter()
        .map(|q| {
            json!({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                   "max_tokens": 12, "temperature": 0})
        })
        .collect()
}

/// Each question alone, in turn: `(answer, prompt tokens, cached tokens)`.
fn ask_in_turn(server: &Server) -> Vec<(String, u64, u64)> {
    bodies()
        .iter()
        .map(|body| {
            let (status, reply) = server.post("/v1/chat/completions", body);
            assert_eq!(status, 200, "{reply}");
            let usage = &reply["usage"];
            (
                reply["choices"][0]["message"]["content"]
                    .as_str()
                    .expect("content")
                    .to_string(),
                usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
                usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .expect("cached_tokens"),
            )
        })
        .collect()
}

/// The answers of a server with the prefix cache off (one process): the reference.
fn uncached_answers() -> Vec<String> {
    let server = Server::start(&["--no-prefix-cache"]);
    let answers = ask_in_turn(&server);
    assert!(answers.iter().all(|(_, _, cached)| *cached == 0));
    let metrics = server.metrics();
    assert_eq!(metric(&metrics, "infer_prefix_cache_hits_total"), 0.0);
    answers.into_iter().map(|(answer, _, _)| answer).collect()
}

fn shared_system_prompt_is_served_from_the_cache(layout: &[&str]) {
    let reference = uncached_answers();
    let server = Server::start(layout);
    let answers = ask_in_turn(&server);
    // SmolLM2's template makes the system turn 60+ tokens: at least 3 whole blocks.
    assert_eq!(
        answers[0].2, 0,
        "nothing is cached before the first request"
    );
    for (index, ((answer, prompt, cached), expected)) in answers.iter().zip(&reference).enumerate()
    {
        assert_eq!(answer, expected, "question {index}");
        if index > 0 {
            assert!(
                *cached >= 48 && cached % 16 == 0 && cached < prompt,
                "question {index}: {cached} of {prompt} prompt tokens cached"
            );
        }
    }
    let metrics = server.metrics();
    let hits: u64 = answers.iter().map(|a| a.2).sum();
    let prompts: u64 = answers.iter().map(|a| a.1).sum();
    assert_eq!(
        metric(&metrics, "infer_prefix_cache_hits_total"),
        hits as f64
    );
    assert_eq!(
        metric(&metrics, "infer_prefix_cache_queries_total"),
        prompts as f64
    );
    let rate = metric(&metrics, "infer_prefix_cache_hit_rate");
    assert!((rate - hits as f64 / prompts as f64).abs() < 1e-9, "{rate}");
}

#[test]
fn a_shared_system_prompt_is_served_from_the_prefix_cache_one_process() {
    shared_system_prompt_is_served_from_the_cache(&[]);
}

#[test]
fn a_shared_system_prompt_is_served_from_the_prefix_cache_tp3() {
    shared_system_prompt_is_served_from_the_cache(&["--tp", "3"]);
}

#[test]
fn a_shared_system_prompt_is_served_from_the_prefix_cache_pp2() {
    shared_system_prompt_is_served_from_the_cache(&["--pp", "2"]);
}

/// Eight concurrent requests in a cache of 12 blocks with steps of 32 tokens: prompts run
/// in chunks, cached blocks are evicted, sequences are preempted and recomputed — and every
/// answer is the uncached one-by-one answer.
#[test]
fn a_small_cache_evicts_and_preempts_and_changes_no_answer() {
    let reference = uncached_answers();
    let server = Server::start(&[
        "--kv-cache-tokens",
        "192",
        "--max-batch",
        "4",
        "--max-num-batched-tokens",
        "32",
    ]);
    let replies = server.post_all("/v1/chat/completions", &bodies());
    for (index, ((status, reply), expected)) in replies.iter().zip(&reference).enumerate() {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(
            reply["choices"][0]["message"]["content"], *expected,
            "question {index}"
        );
    }
    let metrics = server.metrics();
    assert!(
        metric(&metrics, "infer_preemptions_total") > 0.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "infer_prefix_cache_hits_total") > 0.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "infer_prefix_cache_evictions_total") > 0.0,
        "{metrics}"
    );
    // Asked again one by one, the answers are the same.
    for (index, ((answer, _, _), expected)) in
        ask_in_turn(&server).iter().zip(&reference).enumerate()
    {
        assert_eq!(answer, expected, "question {index}, again");
    }
}

#[test]
fn bad_scheduling_flags_exit_2() {
    let output = run(&["up", "--max-batch", "8", "--max-num-batched-tokens", "4"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--max-num-batched-tokens (4) must be at least --max-batch (8)"),
        "{stderr}"
    );
}

/// `(replica, count)` of `infer_dp_requests_routed_total` and the `reason`'s
/// `infer_router_decisions_total` per replica.
fn routed(metrics: &str, replicas: usize) -> Vec<f64> {
    (0..replicas)
        .map(|r| {
            metric(
                metrics,
                &format!("infer_dp_requests_routed_total{{replica=\"{r}\"}}"),
            )
        })
        .collect()
}

/// `--dp 2`: two conversations, turns interleaved, each stick to one replica while the load
/// is balanced — and that replica's prefix cache serves their earlier turns — while a flood
/// of one conversation spills to the other replica.
#[test]
fn cache_aware_routing_keeps_conversations_on_their_replica_and_spills_a_flood() {
    let server = Server::start(&["--dp", "2"]);
    let systems = [
        SYSTEM.to_string(),
        "You are a terse librarian who answers questions about books, authors and reading \
         habits. Keep every answer under twenty words and never recommend more than one book."
            .to_string(),
    ];
    let mut conversations: Vec<Vec<Value>> = systems
        .iter()
        .map(|s| vec![json!({"role": "system", "content": s})])
        .collect();
    let questions = [
        ["What is a KV cache?", "Who wrote Dune?"],
        ["Where does it live?", "When was it published?"],
        ["How big is it?", "Is there a sequel?"],
    ];
    let mut homes: [Option<usize>; 2] = [None, None];
    for (turn, pair) in questions.iter().enumerate() {
        for (c, question) in pair.iter().enumerate() {
            conversations[c].push(json!({"role": "user", "content": question}));
            let before = routed(&server.metrics(), 2);
            let (status, reply) = server.post(
                "/v1/chat/completions",
                &json!({"messages": conversations[c], "max_tokens": 8, "temperature": 0}),
            );
            assert_eq!(status, 200, "{reply}");
            let after = routed(&server.metrics(), 2);
            let replica = (0..2)
                .find(|&r| after[r] > before[r])
                .expect("routed somewhere");
            assert_eq!(
                *homes[c].get_or_insert(replica),
                replica,
                "conversation {c}, turn {turn}"
            );
            let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens");
            if turn > 0 {
                assert!(
                    cached >= 48,
                    "conversation {c}, turn {turn}: {cached} cached"
                );
            }
            let answer = reply["choices"][0]["message"]["content"].clone();
            conversations[c].push(json!({"role": "assistant", "content": answer}));
        }
    }
    assert_ne!(homes[0], homes[1], "the two conversations share a replica");
    let metrics = server.metrics();
    let prefix_matches: f64 = (0..2)
        .map(|r| {
            metric(
                &metrics,
                &format!("infer_router_decisions_total{{replica=\"{r}\",reason=\"prefix_match\"}}"),
            )
        })
        .sum();
    assert_eq!(prefix_matches, 4.0, "{metrics}");

    // A flood of conversation 0's next turn: the load tips, and the rest spills over.
    conversations[0].push(json!({"role": "user", "content": "Summarise our chat."}));
    let body = json!({"messages": conversations[0], "max_tokens": 16, "temperature": 0});
    let bodies = vec![body; 12];
    for (status, reply) in server.post_all("/v1/chat/completions", &bodies) {
        assert_eq!(status, 200, "{reply}");
    }
    let other = 1 - homes[0].expect("home");
    let metrics = server.metrics();
    let spilled = metric(
        &metrics,
        &format!("infer_router_decisions_total{{replica=\"{other}\",reason=\"imbalanced\"}}"),
    );
    assert!(spilled > 0.0, "{metrics}");
}
