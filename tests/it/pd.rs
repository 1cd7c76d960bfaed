//! Prefill/decode disaggregation through `infer up --prefill N --decode M` (real rank
//! processes, real HTTP, the official `openai` client): prompts run on prefill replicas,
//! whose ranks send their shard's KV straight to the same rank of a decode replica, which
//! generates the rest — the tokens colocated serving gives, greedy and seeded, streaming
//! and not; the KV bytes are exactly the prompts' KV size and decode replicas compute no
//! prompt.

use serde_json::{Value, json};

use crate::support::model::{KV_BYTES_PER_TOKEN, QUESTIONS, SMOLLM2_LAYERS, SYSTEM};
use crate::support::process::{free_port, infer, join_later, nnodes_up, run, signal};
use crate::support::server::{
    Server, bench_serve_stdout, bench_serve_tokens, generate_counting, metric, run_openai_client,
};

/// One request went through a decode replica, which computed none of its prompt.
fn handed_off_once(metrics: &str) {
    assert_eq!(metric(metrics, "infer_pd_handoffs_total"), 1.0, "{metrics}");
    assert_eq!(
        metric(metrics, "infer_pd_decode_prefill_tokens_total"),
        0.0,
        "{metrics}"
    );
}

/// The requests every layout answers: completions and chat, greedy and seeded.
fn bodies() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/completions",
            json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 7}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
                   "max_tokens": 12, "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 10, "temperature": 0.8, "seed": 3}),
        ),
    ]
}

/// What a reply says: its text and usage.
fn answer(reply: &Value) -> (Value, Value) {
    let choice = &reply["choices"][0];
    let text = if choice["text"].is_null() {
        choice["message"]["content"].clone()
    } else {
        choice["text"].clone()
    };
    (text, reply["usage"].clone())
}

/// The text of a streamed request, joined from its chunks.
fn streamed(server: &Server, path: &str, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = ureq::post(&format!("{}{path}", server.url))
        .send_json(&body)
        .expect("stream");
    let text = response.into_body().read_to_string().expect("SSE");
    let mut out = String::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk JSON");
        assert!(chunk.get("error").is_none(), "{chunk}");
        let choice = &chunk["choices"][0];
        if let Some(piece) = choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str())
        {
            out.push_str(piece);
        }
    }
    out
}

fn colocated_answers() -> Vec<(Value, Value)> {
    let server = Server::start(&[]);
    bodies()
        .iter()
        .map(|(path, body)| {
            let (status, reply) = server.post(path, body);
            assert_eq!(status, 200, "{reply}");
            answer(&reply)
        })
        .collect()
}

/// Serves `layout` (on this host; with `INFER_SHM_DISABLE=1` unless `shm`) and checks the
/// answers, the hand-offs, the KV bytes and how they went (a shared ring on this host, or
/// TCP when shared memory is off).
fn disaggregated_serving_gives_the_colocated_tokens(layout: &[&str], shm: bool) {
    let reference = colocated_answers();
    let mut command = infer();
    command
        .args(["up", "--port", "0", "--threads", "2"])
        .args(layout);
    if !shm {
        command.env("INFER_SHM_DISABLE", "1");
    }
    let server = Server::start_command(command);
    let mut prompt_tokens = 0;
    for ((path, body), expected) in bodies().iter().zip(&reference) {
        let (status, reply) = server.post(path, body);
        assert_eq!(status, 200, "{reply}");
        let got = answer(&reply);
        assert_eq!(got.0, expected.0, "{path} {body}");
        assert_eq!(
            got.1["completion_tokens"], expected.1["completion_tokens"],
            "{body}"
        );
        assert_eq!(
            got.1["prompt_tokens"], expected.1["prompt_tokens"],
            "{body}"
        );
        prompt_tokens += got.1["prompt_tokens"].as_u64().expect("prompt_tokens");
        assert_eq!(
            streamed(&server, path, body),
            expected.0.as_str().expect("text"),
            "streamed {body}"
        );
    }
    let metrics = server.metrics();
    // Every request was handed off twice (plain and streamed), each with its prompt's KV.
    let requests = (2 * bodies().len()) as f64;
    assert_eq!(
        metric(&metrics, "infer_pd_handoffs_total"),
        requests,
        "{metrics}"
    );
    let degree = |flag: &str| -> u64 {
        layout
            .windows(2)
            .find(|w| w[0] == flag)
            .map_or(1, |w| w[1].parse().expect("degree"))
    };
    // The counter is the driver ranks' shards: 1/tp of the heads under TP, 1/pp of the
    // layers under PP.
    let kv_bytes =
        (2 * prompt_tokens * KV_BYTES_PER_TOKEN / degree("--tp") / degree("--pp")) as f64;
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_total"),
        kv_bytes,
        "{metrics}"
    );
    // Both roles run on this host: every byte went through a shared ring, unless shared
    // memory is off.
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_shm_total"),
        if shm { kv_bytes } else { 0.0 },
        "{metrics}"
    );
    let route = if shm {
        "KV to decode replicas 1 through shared memory"
    } else {
        "KV to decode replicas 1 over TCP to 127.0.0.1:"
    };
    let logs = server.rank_logs();
    assert!(logs[0].contains(route), "rank 0's log:\n{}", logs[0]);
    assert_eq!(
        metric(&metrics, "infer_pd_decode_prefill_tokens_total"),
        0.0,
        "{metrics}"
    );
    // A request that ends at its first token is answered by the prefill replica alone: no
    // KV crosses to a decode replica for it.
    let (status, reply) = server.post(
        "/v1/completions",
        &serde_json::json!({"prompt": "The capital of France is", "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 1, "{reply}");
    let after = server.metrics();
    for name in ["infer_pd_kv_bytes_sent_total", "infer_pd_handoffs_total"] {
        assert_eq!(
            metric(&after, name),
            metric(&metrics, name),
            "{name}: {after}"
        );
    }
}

#[test]
fn one_prefill_and_one_decode_replica_give_the_colocated_tokens() {
    disaggregated_serving_gives_the_colocated_tokens(&["--prefill", "1", "--decode", "1"], true);
}

/// With two decode replicas, concurrent requests are spread over both (least loaded), and
/// every answer is still the colocated one.
#[test]
fn two_decode_replicas_give_the_colocated_tokens() {
    let layout = ["--prefill", "1", "--decode", "2"];
    disaggregated_serving_gives_the_colocated_tokens(&layout, true);
    let reference = colocated_answers();
    let server = Server::start(&layout);
    let bodies = bodies();
    let greedy: Vec<Value> = [0, 2, 0, 2, 0, 2]
        .iter()
        .map(|&i| bodies[i].1.clone())
        .collect();
    let paths = ["/v1/completions", "/v1/chat/completions"];
    for (path, index) in paths.iter().zip([0, 2]) {
        let same: Vec<Value> = greedy
            .iter()
            .filter(|b| *b == &bodies[index].1)
            .cloned()
            .collect();
        for (status, reply) in server.post_all(path, &same) {
            assert_eq!(status, 200, "{reply}");
            assert_eq!(answer(&reply).0, reference[index].0, "{reply}");
        }
    }
    let metrics = server.metrics();
    for replica in [1, 2] {
        let routed = metric(
            &metrics,
            &format!("infer_dp_requests_routed_total{{replica=\"{replica}\"}}"),
        );
        assert!(
            routed > 0.0,
            "decode replica {replica} got nothing:\n{metrics}"
        );
    }
}

/// TP 3 on both roles, with shared memory off (`INFER_SHM_DISABLE=1`): the KV goes over
/// loopback TCP, shard to shard.
#[test]
fn tp3_on_both_roles_gives_the_colocated_tokens() {
    disaggregated_serving_gives_the_colocated_tokens(
        &["--prefill", "1", "--decode", "1", "--tp", "3"],
        false,
    );
}

/// PP 2 on both roles: each stage streams its own layers to the same stage of the decode
/// replica.
#[test]
fn pp2_on_both_roles_gives_the_colocated_tokens() {
    disaggregated_serving_gives_the_colocated_tokens(
        &["--prefill", "1", "--decode", "1", "--pp", "2"],
        true,
    );
}

#[test]
fn the_official_openai_client_works_against_a_disaggregated_deployment() {
    let server = Server::start(&["--prefill", "1", "--decode", "1"]);
    let got = run_openai_client(&server.url);
    let generate = generate_counting();
    assert_eq!(got["completion_text"], generate["text"], "{got}");
    assert_eq!(got["streamed_text"], generate["text"], "{got}");
    assert_eq!(got["stream_usage"]["completion_tokens"], 16, "{got}");
    assert!(got["chat_chunks"].as_u64().unwrap_or(0) > 2, "{got}");
}

#[test]
fn bad_disaggregation_flags_exit_2() {
    for (args, expected) in [
        (&["--prefill", "1"][..], "--decode"),
        (&["--prefill", "0", "--decode", "1"][..], "at least 1"),
        (
            &["--prefill", "1", "--decode", "1", "--dp", "2"][..],
            "--dp",
        ),
        (
            &["--prefill", "1", "--decode", "1", "--plan", "plan.json"][..],
            "drop --plan",
        ),
        (
            &[
                "--prefill",
                "1",
                "--decode",
                "1",
                "--cluster",
                "2x8xh100-sxm",
            ][..],
            "inventory",
        ),
    ] {
        let output = run(&[&["up", "--port", "0"][..], args].concat());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// `infer bench serve --prefill 1 --decode 1` measures a disaggregated server and says so.
#[test]
fn bench_serve_measures_a_disaggregated_server() {
    let output = run(&[
        "bench",
        "serve",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--concurrency",
        "2",
        "--max-tokens",
        "3",
        "--rounds",
        "1",
        "--threads",
        "2",
    ]);
    let stdout = bench_serve_stdout(&output);
    assert!(
        stdout.contains("disaggregated: 1 prefill + 1 decode replicas"),
        "{stdout}"
    );
    let tokens = bench_serve_tokens(&stdout, 2);
    assert!((2..=6).contains(&tokens), "{stdout}");
}

/// `--nnodes 2` with `--prefill 1 --decode 1` (torchrun's model; both nodes on this host):
/// node 0 runs the prefill replica and serves, node 1 the decode replica; the answer is
/// `infer generate`'s, handed off once, and Ctrl-C on node 0 stops both nodes with exit 0.
#[test]
fn two_nodes_started_with_nnodes_disaggregate_prefill_and_decode() {
    use std::process::Stdio;
    crate::support::model::smollm2();
    let store_port = free_port().to_string();
    let node = |rank: &str| nnodes_up(rank, &store_port, &["--prefill", "1", "--decode", "1"]);
    // Node 0 first (it hosts the store); node 1 joins half a second later.
    let joining = join_later(node("1"), Stdio::null());
    let mut head = Server::start_command(node("0"));
    let mut other = joining.join().expect("node 1 started");
    let reference = generate_counting();
    let body = json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0});
    let (status, reply) = head.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    handed_off_once(&head.metrics());
    let ranks = head.rank_pids();
    signal(head.child.id(), rustix::process::Signal::INT);
    let (status, rest) = head.wait_for_gang_exit(&ranks);
    assert_eq!(status.code(), Some(0), "{}{rest}", head.startup);
    assert_eq!(other.wait().expect("node 1 exits").code(), Some(0));
}

/// A long prompt prefilled in chunks streams its KV chunk by chunk and layer by layer
/// (each part sent while the next layers and the next chunk compute): with 16-token steps
/// the hand-off is one part per 8 layers of each chunk, the bytes are still exactly the
/// prompt's KV (nothing sent twice), and the answer is colocated serving's.
#[test]
fn a_chunked_prompt_streams_its_kv_chunk_by_chunk() {
    let steps = ["--max-num-batched-tokens", "16", "--max-batch", "4"];
    let body = json!({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}],
                      "max_tokens": 8, "temperature": 0});
    let colocated = Server::start(&steps);
    let (status, expected) = colocated.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{expected}");
    drop(colocated);
    let server = Server::start(&[&steps[..], &["--prefill", "1", "--decode", "1"]].concat());
    let (status, reply) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(answer(&reply).0, answer(&expected).0, "{reply}");
    let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(
        prompt_tokens > 64,
        "a prompt of several chunks: {prompt_tokens}"
    );
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_pd_kv_parts_sent_total"),
        (prompt_tokens.div_ceil(16) * SMOLLM2_LAYERS.div_ceil(8)) as f64,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_total"),
        (prompt_tokens * KV_BYTES_PER_TOKEN) as f64,
        "{metrics}"
    );
}

/// A plan whose disaggregated deployment `infer plan --disaggregate` chose (one prefill and
/// one decode worker on two H100s): `infer plan --engine infer --emit` writes it as `infer
/// up --prefill 1 --decode 1`, and `infer up --plan plan.json` runs it as prefill and decode
/// replicas of CPU ranks here — the colocated answer, handed off once. A plan whose roles
/// differ in shape is refused with the reason.
#[test]
fn a_disaggregated_plan_runs_as_prefill_and_decode_replicas() {
    let model = crate::support::model::smollm2();
    let model = model.display().to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    let plan_args = [
        "plan",
        "--model",
        &model,
        "--cluster",
        "1x2xh100-sxm",
        "--disaggregate",
    ];
    let output = run(&[&plan_args[..], &["--json"]].concat());
    assert!(output.status.success(), "{output:?}");
    let mut plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    assert_eq!(plan["disaggregated"]["prefill_workers"], 1, "{plan}");
    assert_eq!(plan["disaggregated"]["decode_workers"], 1, "{plan}");
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan).expect("JSON")).expect("write");

    let emit = dir.path().join("emit");
    let emit_str = emit.display().to_string();
    let output = run(&[&plan_args[..], &["--engine", "infer", "--emit", &emit_str]].concat());
    assert!(output.status.success(), "{output:?}");
    let launch: Value =
        serde_json::from_slice(&std::fs::read(emit.join("launch.json")).expect("launch.json"))
            .expect("launch JSON");
    let argv: Vec<&str> = launch["nodes"][0]["argv"]
        .as_array()
        .expect("argv")
        .iter()
        .map(|a| a.as_str().expect("string"))
        .collect();
    let roles = argv
        .windows(4)
        .any(|w| w == ["--prefill", "1", "--decode", "1"]);
    assert!(roles && !argv.contains(&"--dp"), "{argv:?}");

    let reference = generate_counting();
    let plan_str = plan_path.display().to_string();
    let server = Server::start(&["--plan", &plan_str]);
    assert!(
        server
            .startup
            .contains("disaggregated, 1 prefill + 1 decode replicas of tp 1 × pp 1"),
        "{}",
        server.startup
    );
    let body = json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    handed_off_once(&server.metrics());
    drop(server);

    // Decode workers of TP 2 against prefill workers of TP 1: not one shape.
    plan["disaggregated"]["decode"]["tp"] = Value::from(2);
    std::fs::write(&plan_path, serde_json::to_vec(&plan).expect("JSON")).expect("write");
    let output = run(&["up", "--port", "0", "--plan", &plan_str]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("need one TP × PP on both roles") && stderr.contains("hint:"),
        "{stderr}"
    );
}
