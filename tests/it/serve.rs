//! `infer up` as a real process driven by a real HTTP client (ureq) and the official
//! `openai` Python client, mostly with `--tp 3` (three real `infer rank` processes whose
//! rank 0 serves): the OpenAI endpoints, SSE streaming, greedy results equal to
//! `infer generate`, 16 concurrent requests with correct usage, malformed requests answered
//! with 4xx JSON while the server keeps serving, the API key, a clean stop on SIGTERM, and
//! a killed rank taking `infer up` down with no rank process left.

use std::io::{BufRead, BufReader, Read};

use serde_json::{Value, json};

use crate::support::process::{alive, postmortem, run, run_dir_of, signal, transcript_of};
use crate::support::server::{
    Server, assert_every_replica_routed, bench_serve_stdout, bench_serve_tokens, generate_counting,
    metric, run_openai_client,
};

/// The tensor-parallel layout the issue names: three rank processes.
const TP3: &[&str] = &["--tp", "3"];

#[test]
fn completions_match_generate_and_report_usage_tp3() {
    completions_match_generate_and_report_usage(TP3);
}

#[test]
fn completions_match_generate_and_report_usage_one_process() {
    completions_match_generate_and_report_usage(&[]);
}

fn completions_match_generate_and_report_usage(layout: &[&str]) {
    let server = Server::start(layout);
    let health = ureq::get(&format!("{}/health", server.url))
        .call()
        .expect("health");
    assert_eq!(health.status().as_u16(), 200);
    let models: Value = ureq::get(&format!("{}/v1/models", server.url))
        .call()
        .expect("models")
        .into_body()
        .read_json()
        .expect("JSON");
    let model = models["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();

    let (status, body) = server.post("/v1/completions", &json!({"model": model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0, "logprobs": 1}));
    assert_eq!(status, 200, "{body}");
    let generate = generate_counting();
    assert_eq!(body["choices"][0]["text"], generate["text"]);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .expect("logprobs")
            .len(),
        16
    );

    // Token ids as the prompt give the same text.
    let (status, by_ids) = server.post("/v1/completions", &json!({"prompt": [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28], "max_tokens": 16, "temperature": 0}));
    assert_eq!(status, 200);
    assert_eq!(by_ids["choices"][0]["text"], generate["text"]);
}

/// `infer up --numerics fast` serves the fast order's greedy text, which is `infer generate
/// --numerics fast`'s (and, on this prompt, not the exact order's: they part at a near-tie
/// at position 13).
#[test]
fn fast_numerics_serve_what_generate_fast_gives() {
    let server = Server::start(&["--numerics", "fast"]);
    let text = |numerics: &str| -> Value {
        let output = run(&[
            "generate",
            "--json",
            "--max-tokens",
            "20",
            "--numerics",
            numerics,
            "--prompt",
            "def fibonacci(n):",
        ]);
        let json: Value = serde_json::from_slice(&output.stdout).expect("generate JSON");
        json["text"].clone()
    };
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "def fibonacci(n):", "max_tokens": 20, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], text("fast"));
    assert_ne!(body["choices"][0]["text"], text("exact"));
}

#[test]
fn chat_streams_server_sent_events() {
    let server = Server::start(TP3);
    let response = ureq::post(&format!("{}/v1/chat/completions", server.url))
        .send_json(json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 40, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}))
        .expect("stream");
    let mut text = String::new();
    response
        .into_body()
        .into_reader()
        .read_to_string(&mut text)
        .expect("read");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    // The role chunk, one per token, the finish chunk, then the usage alone (asked for
    // with `stream_options.include_usage`, as OpenAI sends it).
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(
        last["usage"]["completion_tokens"].as_u64().expect("usage") as usize + 3,
        chunks.len(),
        "one chunk per token"
    );
}

#[test]
fn sixteen_concurrent_requests_all_complete() {
    let server = Server::start(TP3);
    let bodies: Vec<Value> = (0..16)
        .map(|i| json!({"prompt": format!("Story number {i}:"), "max_tokens": 12, "temperature": 0.8, "seed": i}))
        .collect();
    let results = server.post_all("/v1/completions", &bodies);
    for (status, body) in results {
        assert_eq!(status, 200, "{body}");
        let usage = &body["usage"];
        let completion = usage["completion_tokens"].as_u64().expect("usage");
        assert!(
            (1..=12).contains(&completion),
            "completion_tokens {completion}"
        );
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(usage["prompt_tokens"].as_u64().expect("prompt") + completion)
        );
    }
    let metrics = server.metrics();
    assert!(metrics.contains("infer_requests_total 16"), "{metrics}");
    assert!(
        metrics.contains("infer_time_to_first_token_seconds_count 16"),
        "{metrics}"
    );
}

#[test]
fn bad_requests_get_4xx_json_and_the_server_keeps_serving() {
    let server = Server::start(TP3);
    let (status, reply) = server.post("/v1/completions", &json!({"prompt": "x", "model": "gpt-9"}));
    assert_eq!(status, 404, "{reply}");
    assert_eq!(reply["error"]["code"], "model_not_found", "{reply}");
    let long_prompt: Vec<u32> = (100..200).collect();
    // (endpoint, body, the field at fault, words of the message)
    let chat = "/v1/chat/completions";
    let hello = json!([{"role": "user", "content": "Say hello."}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": 12}),
            "prompt",
            "`prompt` must be",
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 2}),
            "prompt",
            "`prompt` is missing",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 100000}),
            "max_tokens",
            "more than this model's context of 8192 tokens",
        ),
        // Would wrap `prompt + max_tokens` without checked arithmetic.
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 18446744073709551615u64}),
            "max_tokens",
            "more than this model's context",
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt, "max_tokens": 8192}),
            "max_tokens",
            "maximum context length is 8192 tokens; the prompt has 100",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -1}),
            "max_tokens",
            "invalid value",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "ten"}),
            "max_tokens",
            "invalid type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
            "at least 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}),
            "top_p",
            "`top_p`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}),
            "temperature",
            "[0, 2]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}),
            "n",
            "`n` must be 1 to 16",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 1000}),
            "n",
            "`n` must be 1 to 16",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": 1.5}),
            "seed",
            "invalid type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [1, 2]}),
            "stop",
            "did not match",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 9}),
            "logprobs",
            "0 to 5",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "frobnicate": 1}),
            ".",
            "unknown field `frobnicate`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "presence_penalty": 2.5}),
            "presence_penalty",
            "must be in [-2, 2]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_json": {}, "typo_field": 1}),
            "guided_json",
            "vLLM accepts `guided_json` but this server does not support it yet",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}),
            "echo",
            "not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "response_format": {"type": "json_object"}}),
            "response_format",
            "`response_format` `json_object` is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            "stream_options",
            "only allowed with `stream: true`",
        ),
        (
            chat,
            json!({"messages": []}),
            "messages",
            "`messages` is empty",
        ),
        (
            chat,
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
            "`messages[0].role` is `wizard`",
        ),
        (
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
            "messages[0].content[0]",
            "is a `image_url` part: this model takes text only",
        ),
        (
            chat,
            json!({"messages": hello, "tools": []}),
            "tools",
            "does not call tools",
        ),
        (
            chat,
            json!({"messages": hello, "top_logprobs": 3}),
            "top_logprobs",
            "needs `logprobs: true`",
        ),
        (
            chat,
            json!({"messages": hello, "prompt": "x"}),
            "prompt",
            "belongs to /v1/completions",
        ),
    ];
    for (path, body, param, expected) in cases {
        let (status, reply) = server.post(path, &body);
        assert_eq!(status, 400, "{body}: {reply}");
        let message = reply["error"]["message"].as_str().expect("message");
        assert!(message.contains(expected), "{body}: {reply}");
        if param != "." {
            assert_eq!(reply["error"]["param"], param, "{body}: {reply}");
        }
    }
    let malformed = ureq::post(&format!("{}/v1/chat/completions", server.url))
        .config()
        .http_status_as_error(false)
        .build()
        .header("Content-Type", "application/json")
        .send("{not json")
        .expect("request");
    assert_eq!(malformed.status().as_u16(), 400);
    // JSON as `text/plain` (what a web page may post across sites without a preflight): 415.
    let mut plain = ureq::post(&format!("{}/v1/completions", server.url))
        .config()
        .http_status_as_error(false)
        .build()
        .header("Content-Type", "text/plain")
        .send(r#"{"prompt": "x", "max_tokens": 1}"#)
        .expect("request");
    assert_eq!(plain.status().as_u16(), 415);
    let reply: serde_json::Value = plain.body_mut().read_json().expect("JSON");
    assert!(
        reply["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("Content-Type: application/json")),
        "{reply}"
    );
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": "still up?", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
}

#[test]
fn api_key_is_required_when_set() {
    // From a file, over three ranks: the key reaches rank 0, which serves, and no other.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("key");
    std::fs::write(&file, "s3cret\n").expect("key file");
    let file = file.display().to_string();
    let server = Server::start(&["--api-key-file", &file, "--tp", "3"]);
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(status, 401, "{body}");
    let ok = ureq::post(&format!("{}/v1/completions", server.url))
        .header("Authorization", "Bearer s3cret")
        .send_json(json!({"prompt": "x", "max_tokens": 1}))
        .expect("authorized");
    assert_eq!(ok.status().as_u16(), 200);
    // The key never reaches the manifest; the KV-cache size (a `TOKENS` name) does.
    let manifest = server.manifest();
    assert!(!manifest.to_string().contains("s3cret"), "{manifest}");
    let env = &manifest["ranks"][0]["env"];
    assert_eq!(env["INFER_API_KEY"], "<redacted>", "{env}");
    assert!(
        env["INFER_KV_CACHE_TOKENS"]
            .as_str()
            .is_some_and(|v| v.parse::<u64>().is_ok()),
        "{env}"
    );
    for rank in [1, 2] {
        assert!(
            manifest["ranks"][rank]["env"]["INFER_API_KEY"].is_null(),
            "rank {rank} got the key: {manifest}"
        );
    }
    // As vLLM, the key guards the API, not `/metrics`.
    assert_eq!(server.get("/metrics").0, 200);
    drop(server);
    // With --protect-metrics it guards `/metrics` too: on the supervised front (its own
    // counters) and on rank 0 behind it.
    let server = Server::start(&[
        "--api-key-file",
        &file,
        "--protect-metrics",
        "--max-restarts",
        "1",
    ]);
    let (status, body) = server.get("/metrics");
    assert_eq!(status, 401, "{body}");
    assert!(!body.contains("infer_restarts_total"), "{body}");
    let metrics = ureq::get(&format!("{}/metrics", server.url))
        .header("Authorization", "Bearer s3cret")
        .call()
        .expect("authorized")
        .into_body()
        .read_to_string()
        .expect("text");
    assert!(
        metrics.contains("infer_restarts_total") && metrics.contains("vllm:num_requests_running"),
        "{metrics}"
    );
    // A key file that is not there is bad input, and so is --protect-metrics without a key
    // or with an engine that would not check it.
    let output = run(&["up", "--port", "0", "--api-key-file", "/nonexistent/key"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("cannot read --api-key-file `/nonexistent/key`")
    );
    for args in [
        &["up", "--port", "0", "--protect-metrics"][..],
        &[
            "up",
            "--port",
            "0",
            "--engine",
            "vllm",
            "--api-key",
            "k",
            "--protect-metrics",
        ][..],
    ] {
        let output = run(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("--protect-metrics"),
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// `infer bench serve` starts its own server, drives it with streaming clients and prints
/// one row per concurrency with the tokens each row generated (`max_tokens` per request at
/// most, at least one, two requests per stream, two sweeps), and the ratio to one stream
/// with its range over the sweeps.
#[test]
fn bench_serve_prints_a_row_per_concurrency() {
    crate::support::model::smollm2();
    let output = run(&[
        "bench",
        "serve",
        "--concurrency",
        "1,3",
        "--max-tokens",
        "4",
        "--rounds",
        "2",
        "--repeat",
        "2",
        "--threads",
        "2",
    ]);
    let stdout = bench_serve_stdout(&output);
    assert!(stdout.contains("time to ready"), "{stdout}");
    for streams in [1, 3] {
        let tokens = bench_serve_tokens(&stdout, streams);
        assert!(
            (2 * 2 * streams..=2 * 2 * 4 * streams).contains(&tokens),
            "{stdout}"
        );
    }
    assert!(stdout.contains("x of one stream (sweeps: "), "{stdout}");
    assert!(stdout.contains("median of 2 sweeps"), "{stdout}");

    // The shared-prefix workload is served from the prefix cache after the first request;
    // with `--no-prefix-cache` nothing is.
    let hit_rate = |extra: &[&str]| -> f64 {
        let args = [
            &[
                "bench",
                "serve",
                "--workload",
                "shared-prefix",
                "--concurrency",
                "2",
            ][..],
            &["--max-tokens", "2", "--rounds", "2", "--threads", "2"],
            extra,
        ]
        .concat();
        let output = run(&args);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        let row = stdout
            .lines()
            .find(|l| l.starts_with("prefix cache"))
            .unwrap_or_else(|| panic!("no prefix cache row:\n{stdout}"));
        row.split('(')
            .nth(1)
            .and_then(|r| r.split('%').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no hit rate in {row}"))
    };
    assert!(hit_rate(&[]) > 50.0);
    assert_eq!(hit_rate(&["--no-prefix-cache"]), 0.0);
}

/// SIGTERM stops the server cleanly: exit 0, the port closed, no rank process left.
#[test]
fn sigterm_stops_the_server_with_exit_0_one_process() {
    sigterm_stops_the_server_with_exit_0(&[]);
}

#[test]
fn sigterm_stops_the_server_with_exit_0_tp3() {
    sigterm_stops_the_server_with_exit_0(TP3);
}

fn sigterm_stops_the_server_with_exit_0(layout: &[&str]) {
    let mut server = Server::start(layout);
    let address = server.url.trim_start_matches("http://").to_string();
    let ranks = if layout.is_empty() {
        Vec::new()
    } else {
        server.rank_pids()
    };
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(status, 200);
    signal(server.child.id(), rustix::process::Signal::TERM);
    let exit = server.child.wait().expect("wait");
    assert!(exit.success(), "{exit}");
    assert!(
        std::net::TcpStream::connect(&address).is_err(),
        "{address} still accepts connections"
    );
    for pid in ranks {
        assert!(!alive(pid), "rank pid {pid} is still running");
    }
}

/// Killing one rank of a serving gang makes `infer up` exit non-zero within 5 s, naming
/// that rank, with no rank process left; a request in flight gets an error, not a hang.
#[test]
fn a_killed_rank_takes_infer_up_down_within_5_seconds() {
    let mut server = Server::start(TP3);
    let ranks = server.rank_pids();
    assert_eq!(ranks.len(), 3, "{}", server.startup);
    let url = server.url.clone();
    let in_flight = std::thread::spawn(move || {
        ureq::post(&format!("{url}/v1/completions"))
            .config()
            .http_status_as_error(false)
            .build()
            // Greedy: "1, 2, 3," counts on for hundreds of tokens (sampled at the default
            // temperature 1 it can stop within the 0.8 s before the kill).
            .send_json(
                json!({"prompt": "1, 2, 3,", "max_tokens": 4000, "temperature": 0, "stream": true}),
            )
            .and_then(|response| response.into_body().read_to_string())
    });
    std::thread::sleep(std::time::Duration::from_millis(800));
    let killed_at = std::time::Instant::now();
    signal(ranks[2], rustix::process::Signal::KILL);
    let (status, rest) = server.wait_for_gang_exit(&ranks);
    // (Measured after the checks that no rank is left, so it bounds them too.)
    let elapsed = killed_at.elapsed();
    assert!(!status.success(), "{status}\n{rest}");
    assert!(
        elapsed < std::time::Duration::from_secs(5),
        "took {elapsed:?}"
    );
    assert!(rest.contains("rank 2 exited with signal: 9"), "{rest}");
    // The post-mortem says so first; `--bundle` packs the run and the report.
    let run_dir = run_dir_of(&server.startup);
    let (code, report) = postmortem(&run_dir);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["findings"][0]["message"],
        "rank 2 on `localhost` was killed by signal 9 (SIGKILL); the others stopped with it (a gang stops as one)",
        "{report}"
    );
    let bundle = tempfile::tempdir().expect("tempdir");
    let file = bundle.path().join("run.tar.gz");
    let file_arg = file.display().to_string();
    let output = run(&["doctor", "--run", &run_dir, "--bundle", &file_arg]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let listing = std::process::Command::new("tar")
        .arg("-tzf")
        .arg(&file)
        .output()
        .expect("tar");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for name in ["manifest.json", "outcome.json", "postmortem.json"] {
        assert!(listing.contains(name), "{name}: {listing}");
    }
    // A run that does not exist is bad input: exit 2, saying where runs are.
    let output = run(&["doctor", "--run", "run-nosuch"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no run `run-nosuch`"), "{stderr}");
    // The streaming client is not left waiting: it gets an error event naming the lost
    // peer (or, if the server went first, a closed connection), never a normal finish.
    let reply = in_flight.join().expect("client thread");
    if let Ok(text) = &reply {
        assert!(
            text.contains("\"error\"") && text.contains("rank 2"),
            "{text}"
        );
        assert!(!text.contains("\"finish_reason\":\"length\""), "{text}");
    }
}

/// The official `openai` Python client: a greedy completion equal to `infer generate`'s,
/// a streamed completion with the same text and usage, and a streamed chat.
#[test]
fn the_official_openai_python_client_works() {
    let server = Server::start(TP3);
    let got = run_openai_client(&server.url);
    let generate = generate_counting();
    assert_eq!(got["completion_text"], generate["text"], "{got}");
    assert_eq!(got["streamed_text"], generate["text"], "{got}");
    let usage = json!({"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30});
    assert_eq!(
        got["completion_usage"]["total_tokens"],
        usage["total_tokens"]
    );
    assert_eq!(
        got["completion_usage"]["prompt_tokens"],
        usage["prompt_tokens"]
    );
    assert_eq!(
        got["stream_usage"]["completion_tokens"],
        usage["completion_tokens"]
    );
    assert!(!got["chat_text"].as_str().unwrap_or("").is_empty(), "{got}");
    assert!(got["chat_chunks"].as_u64().unwrap_or(0) > 2, "{got}");
    assert!(
        ["stop", "length"].contains(&got["chat_finish_reason"].as_str().unwrap_or("")),
        "{got}"
    );
}

/// A port already in use and a missing model file are bad input: exit 2, a clear message.
#[test]
fn bad_up_arguments_exit_2_with_a_clear_error() {
    crate::support::model::smollm2();
    // Every error's whole text, in the snapshot (the taken port redacted), but the name
    // that does not resolve: the resolver's own words differ between machines.
    let mut transcript = String::new();
    let mut record = |args: &[&str], output: &std::process::Output, redact: &[(&str, &str)]| {
        transcript.push_str(&transcript_of(args, output, redact));
        transcript.push('\n');
    };
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let args = ["up", "--port", &port];
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    let (in_args, in_text) = (format!("--port {port}"), format!(":{port}"));
    record(
        &args,
        &output,
        &[(&in_args, "--port [PORT]"), (&in_text, ":[PORT]")],
    );
    // Not an address of this host, not an address at all: said as such, before any rank.
    for layout in [&[][..], &["--tp", "3"][..]] {
        let args = [
            &["up", "--host", "10.99.99.99", "--port", "8123"][..],
            layout,
        ]
        .concat();
        let output = run(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(!stderr.contains("started"), "{stderr}");
        record(&args, &output, &[]);
        let output = run(&[&["up", "--host", "notanip", "--port", "8123"][..], layout].concat());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("`notanip` is not an IP address or a name that resolves"),
            "notanip {layout:?}: {stderr}"
        );
        assert!(!stderr.contains("started"), "{stderr}");
    }

    // A plan over two hosts cannot be launched here yet; a layout given twice is refused; a
    // plan or a model that is not there is named.
    for args in [
        &["up", "--cluster", "2x8xh100-sxm", "--port", "0"][..],
        &["up", "--cluster", "1x2xh100-sxm", "--tp", "2"],
        &["up", "--plan", "/nonexistent/plan.json"],
        &["up", "--model", "/nonexistent/model.gguf"],
    ] {
        let output = run(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(output.stdout.is_empty());
        record(args, &output, &[]);
    }

    // A layout the model cannot take is refused from its header before any rank starts,
    // naming the degrees that work (SmolLM2: 9 heads, 3 KV heads, 30 layers).
    for layout in [
        &["--tp", "2"][..],
        &["--tp", "1000"],
        &["--pp", "31"],
        &["--tp", "3", "--ep", "3"],
    ] {
        let args = [&["up", "--port", "0"][..], layout].concat();
        let output = run(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("started"), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        record(&args, &output, &[]);
    }
    let args = ["generate", "--tp", "2", "--prompt", "hi"];
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    record(&args, &output, &[]);
    insta::assert_snapshot!(transcript);
}

/// With a KV cache of 4 blocks (64 positions), four concurrent 44-token sequences cannot
/// all fit: the newest are preempted and recomputed later. Every request still completes
/// with exactly the usage and the text it gets alone — greedy, and seeded sampling too (a
/// resumed sampler skips the draws it already made; a recomputed prefill gives the very
/// logits the decode steps gave, in one process and over TP ranks alike) — and all blocks
/// come back.
#[test]
fn preempted_requests_resume_with_the_same_output_one_process() {
    preempted_requests_resume_with_the_same_output(&[]);
}

#[test]
fn preempted_requests_resume_with_the_same_output_tp3() {
    preempted_requests_resume_with_the_same_output(TP3);
}

fn preempted_requests_resume_with_the_same_output(layout: &[&str]) {
    let mut args = vec!["--kv-cache-tokens", "64"];
    args.extend_from_slice(layout);
    let server = Server::start(&args);
    let bodies = [
        json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0}),
        json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0.9, "seed": 7}),
        json!({"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0}),
        json!({"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.9, "seed": 11}),
    ];
    let alone: Vec<Value> = bodies
        .iter()
        .map(|body| server.post("/v1/completions", body).1)
        .collect();
    let metrics = || server.metrics();
    assert_eq!(metric(&metrics(), "infer_preemptions_total"), 0.0);
    let together = server.post_all("/v1/completions", &bodies);
    for (((status, body), reference), request) in together.iter().zip(&alone).zip(&bodies) {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(
            body["choices"][0]["text"], reference["choices"][0]["text"],
            "{request}"
        );
        assert_eq!(body["usage"], reference["usage"], "{request}");
    }
    let after = metrics();
    assert!(metric(&after, "infer_preemptions_total") > 0.0, "{after}");
    assert_eq!(metric(&after, "infer_kv_cache_blocks_total"), 4.0);
    // The blocks of finished sequences go back to the pool once the scheduler is idle.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while metric(&metrics(), "infer_kv_cache_blocks_used") > 0.0 {
        assert!(std::time::Instant::now() < deadline, "{}", metrics());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `--dp 2`: two replicas (one rank each) behind rank 0's router. Concurrent requests are
/// spread over both, every greedy result equals `infer generate`'s, and killing replica 1's
/// rank takes `infer up` down naming it, with no rank left.
#[test]
fn data_parallel_replicas_share_the_load() {
    let mut server = Server::start(&["--dp", "2"]);
    let ranks = server.rank_pids();
    assert_eq!(ranks.len(), 2, "{}", server.startup);
    let reference = generate_counting();
    let prompts = [
        "1, 2, 3, 4, 5,",
        "Once upon a time",
        "1, 2, 3, 4, 5,",
        "The capital of France is",
        "1, 2, 3, 4, 5,",
        "def fibonacci(n):",
        "1, 2, 3, 4, 5,",
        "Rust is",
    ];
    let bodies: Vec<Value> = prompts
        .iter()
        .map(|prompt| json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}))
        .collect();
    let results = server.post_all("/v1/completions", &bodies);
    for ((status, body), prompt) in results.iter().zip(prompts) {
        assert_eq!(*status, 200, "{body}");
        if prompt == "1, 2, 3, 4, 5," {
            assert_eq!(body["choices"][0]["text"], reference["text"], "{body}");
        }
        assert_eq!(body["usage"]["completion_tokens"], 16, "{body}");
    }
    // /metrics adds up both replicas, current the moment the requests are answered (the
    // remote replica is asked at the scrape, not read from its last report).
    let metrics = server.metrics();
    for expected in [
        "infer_requests_total 8\n",
        "infer_generation_tokens_total 128\n",
        "infer_time_to_first_token_seconds_count 8\n",
        "infer_requests_running 0\n",
        "infer_requests_waiting 0\n",
    ] {
        assert!(metrics.contains(expected), "{expected}{metrics}");
    }
    assert_every_replica_routed(&metrics, 2);
    signal(ranks[1], rustix::process::Signal::KILL);
    let (status, rest) = server.wait_for_gang_exit(&ranks);
    assert!(!status.success(), "{rest}");
    assert!(rest.contains("rank 1 exited with signal: 9"), "{rest}");
}

/// `infer plan --json` for one node of two GPUs picks DP 2 for SmolLM2; `infer up --plan`
/// launches exactly that layout (two replicas, as CPU ranks here) and serves.
#[test]
fn up_launches_the_layout_of_a_saved_plan() {
    crate::support::model::smollm2();
    let output = run(&["plan", "--cluster", "1x2xh100-sxm", "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    let parallel = &plan["parallel"];
    let world = ["tp", "pp", "dp"]
        .iter()
        .map(|k| parallel[k].as_u64().expect("degree"))
        .product::<u64>();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("plan.json");
    std::fs::write(&file, &output.stdout).expect("write plan");
    let server = Server::start(&["--plan", file.to_str().expect("utf-8 path")]);
    assert_eq!(server.rank_pids().len() as u64, world, "{}", server.startup);
    assert!(
        server.startup.contains(&format!(
            "(dp {} × pp {} × tp {})",
            parallel["dp"], parallel["pp"], parallel["tp"]
        )),
        "{}",
        server.startup
    );
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], generate_counting()["text"]);

    // The run directory's manifest: where the layout came from, every rank's pid and
    // environment (the run token left out), and the serving address.
    let manifest = server.manifest();
    assert!(
        manifest["layout_from"]
            .as_str()
            .is_some_and(|from| from.contains("plan.json")),
        "{manifest}"
    );
    assert_eq!(manifest["serving"], json!(server.url));
    let pids: Vec<u64> = manifest["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid"))
        .collect();
    let expected: Vec<u64> = server.rank_pids().iter().map(|&p| p as u64).collect();
    assert_eq!(pids, expected);
    let env = &manifest["ranks"][1]["env"];
    assert_eq!(env["RANK"], "1");
    assert_eq!(env["WORLD_SIZE"], world.to_string());
    assert!(env.get("INFER_RUN_TOKEN").is_none(), "{env}");
    assert!(env.get("INFER_RUN_KEYS").is_none(), "{env}");
}

/// `infer plan --cluster local --json` on this host without GPUs plans its CPU ranks, and
/// `infer up --plan` serves that layout and answers as `infer generate` does; a plan pinned
/// to two replicas on the host runs them as two rank processes. See: #40
#[test]
fn up_serves_the_plan_for_this_hosts_cpu() {
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        return;
    }
    crate::support::model::smollm2();
    let dir = tempfile::tempdir().expect("tempdir");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Two ranks need two cores: at most one rank per core.
    let plans: &[(&str, &[&str])] = if cores >= 2 {
        &[("plan.json", &[]), ("dp2.json", &["--dp", "2"])]
    } else {
        &[("plan.json", &[])]
    };
    for (name, pins) in plans {
        let output = run(&[&["plan", "--cluster", "local", "--json"][..], *pins].concat());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
        assert_eq!(plan["device"], "cpu", "{plan}");
        let parallel = &plan["parallel"];
        let world = plan["world_size"].as_u64().expect("world");
        let file = dir.path().join(name);
        std::fs::write(&file, &output.stdout).expect("write plan");
        let server = Server::start(&["--plan", file.to_str().expect("utf-8 path")]);
        assert!(
            server.startup.contains(&format!(
                "tp {} × pp {} × dp {} (ep {}), {world} ranks",
                parallel["tp"], parallel["pp"], parallel["dp"], parallel["ep"]
            )),
            "{}",
            server.startup
        );
        if world > 1 {
            assert_eq!(server.rank_pids().len() as u64, world, "{}", server.startup);
        }
        let (status, body) = server.post(
            "/v1/completions",
            &json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0}),
        );
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["text"], generate_counting()["text"]);
    }
}

/// A Mixtral-style MoE model (synthetic, 8 experts, top-2, written as GGUF with a small
/// tokenizer) served with `--tp 2 --ep 2`: each rank holds 4 experts and tokens move with
/// all-to-all. Greedy completions equal `infer generate`'s in one process, as they do with
/// `--tp 2` alone (experts replicated).
#[test]
fn moe_model_served_with_expert_parallelism_matches_one_process() {
    use crate::support::synthetic::{Shape, write_gguf_moe};
    let shape = Shape::small_moe();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("moe.gguf");
    write_gguf_moe(&path, &shape, 8, 2, 33);
    let model = path.to_str().expect("utf-8 path");
    let output = run(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "Mixtral",
        "--max-tokens",
        "12",
        "--json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reference: Value = serde_json::from_slice(&output.stdout).expect("generate JSON");
    assert_eq!(reference["tokens"].as_array().map(Vec::len), Some(12));
    for layout in [["--tp", "2", "--ep", "2"], ["--tp", "2", "--ep", "1"]] {
        let mut args = vec!["--model", model];
        args.extend_from_slice(&layout);
        let server = Server::start(&args);
        let (status, body) = server.post(
            "/v1/completions",
            &json!({"prompt": "Mixtral", "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(status, 200, "{layout:?}: {body}");
        assert_eq!(body["choices"][0]["text"], reference["text"], "{layout:?}");
    }
    let output = run(&["up", "--model", model, "--tp", "2", "--ep", "4"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("must be 1 or equal --tp"), "{stderr}");
}

/// The server listens before the model is loaded and answers every endpoint with a 503 in
/// OpenAI's error JSON until it is ready (here: never opened).
#[test]
fn endpoints_answer_503_until_the_engine_is_ready() {
    let server = infer::serve::http::HttpServer::bind("127.0.0.1", 0).expect("bind");
    let url = format!("http://{}", server.address());
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let health = agent.get(&format!("{url}/health")).call().expect("health");
    assert_eq!(health.status().as_u16(), 503);
    let response = agent
        .post(&format!("{url}/v1/completions"))
        .send_json(json!({"prompt": "Hi", "max_tokens": 2}))
        .expect("completion");
    assert_eq!(response.status().as_u16(), 503);
    let body: Value = response.into_body().read_json().expect("error JSON");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("still loading")),
        "{body}"
    );
}

/// A client that goes away stops its sequence on whichever replica runs it: with `--dp 2`,
/// four streaming requests for 4000 tokens are dropped after their first tokens, and every
/// replica's running count falls to 0 while generation stops.
#[test]
fn dropped_streams_stop_their_sequences_on_every_replica() {
    let server = Server::start(&["--dp", "2"]);
    std::thread::scope(|scope| {
        for i in 0..4 {
            let url = server.url.clone();
            scope.spawn(move || {
                let response = ureq::post(&format!("{url}/v1/completions"))
                    .send_json(json!({"prompt": format!("Story {i}:"), "max_tokens": 4000, "stream": true}))
                    .expect("stream");
                let mut reader = BufReader::new(response.into_body().into_reader());
                let mut line = String::new();
                // Read until the first token arrives, then hang up.
                while reader.read_line(&mut line).expect("read") > 0 && !line.contains("\"text\"") {
                    line.clear();
                }
            });
        }
    });
    let value = |text: &str, name: &str| metric(text, name) as u64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        if value(&metrics, "infer_requests_running") == 0
            && value(&metrics, "infer_requests_total") == 4
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{metrics}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Let the remote replica's next report (twice a second) come in, then watch for more.
    std::thread::sleep(std::time::Duration::from_millis(700));
    let generated = value(&server.metrics(), "infer_generation_tokens_total");
    assert!(generated < 4 * 4000, "{generated}");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    assert_eq!(
        value(&server.metrics(), "infer_generation_tokens_total"),
        generated,
        "sequences kept generating after their clients left"
    );
}

/// What OpenAI clients send and expect beyond the basics: content as a list of text parts,
/// `n` choices (seeded: different and reproducible), chat `logprobs` with `top_logprobs`,
/// completions `logprobs` with tokens as text, `max_completion_tokens`, and `n` streamed.
#[test]
fn openai_request_shapes_clients_send() {
    let server = Server::start(&[]);
    let chat = "/v1/chat/completions";
    // Text parts are the message's text: the same answer as the plain string.
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}], "max_tokens": 8, "temperature": 0});
    let plain = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_completion_tokens": 8, "temperature": 0});
    let (status, by_parts) = server.post(chat, &parts);
    assert_eq!(status, 200, "{by_parts}");
    let (status, by_string) = server.post(chat, &plain);
    assert_eq!(status, 200, "{by_string}");
    assert_eq!(
        by_parts["choices"][0]["message"]["content"],
        by_string["choices"][0]["message"]["content"]
    );

    // n = 3 seeded choices: three, indexed, usage summed; the same again with the seed.
    let sampled = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7});
    let (status, first) = server.post("/v1/completions", &sampled);
    assert_eq!(status, 200, "{first}");
    let choices = first["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{first}");
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().expect("text"))
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
    }
    let completion: u64 = first["usage"]["completion_tokens"].as_u64().expect("usage");
    assert_eq!(completion, 36, "{first}");
    let (_, again) = server.post("/v1/completions", &sampled);
    assert_eq!(again["choices"], first["choices"]);

    // Chat logprobs: each token's text (not the vocabulary's `Ġ` spelling), logprob, bytes,
    // and its 3 most likely alternatives, the greedy choice first.
    let (status, reply) = server.post(
        chat,
        &json!({"messages": [{"role": "user", "content": "Count: 1, 2, 3,"}], "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
    );
    assert_eq!(status, 200, "{reply}");
    let content = reply["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    assert_eq!(content.len(), 4, "{reply}");
    let mut text = String::new();
    for entry in content {
        let token = entry["token"].as_str().expect("token");
        assert!(!token.contains('Ġ'), "{entry}");
        text.push_str(token);
        let logprob = entry["logprob"].as_f64().expect("logprob");
        assert!(logprob <= 0.0, "{entry}");
        let top = entry["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 3, "{entry}");
        assert_eq!(
            top[0]["token"], entry["token"],
            "greedy picks the most likely"
        );
        assert!((top[0]["logprob"].as_f64().expect("lp") - logprob).abs() < 1e-5);
        assert!(top[1]["logprob"].as_f64() <= top[0]["logprob"].as_f64());
        assert_eq!(
            entry["bytes"],
            json!(token.as_bytes()),
            "bytes are the token's UTF-8"
        );
    }
    assert_eq!(
        text,
        reply["choices"][0]["message"]["content"]
            .as_str()
            .expect("text")
    );

    // Completions logprobs: tokens as text, offsets into the text, top alternatives.
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(status, 200, "{reply}");
    let logprobs = &reply["choices"][0]["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_str().expect("token"))
        .collect();
    assert_eq!(
        tokens.concat(),
        reply["choices"][0]["text"].as_str().expect("text")
    );
    assert_eq!(logprobs["text_offset"][1], tokens[0].len());
    assert_eq!(
        logprobs["top_logprobs"][0].as_object().expect("top").len(),
        2
    );

    // n = 2 streamed: chunks of both choices, each finished once, then the usage alone.
    let response = ureq::post(&format!("{}{chat}", server.url))
        .send_json(json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0, "n": 2, "stream": true, "stream_options": {"include_usage": true}}))
        .expect("stream");
    let mut body = String::new();
    response
        .into_body()
        .into_reader()
        .read_to_string(&mut body)
        .expect("read");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk"))
        .collect();
    for index in 0..2 {
        let finished = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["index"] == index && !c["choices"][0]["finish_reason"].is_null()
            })
            .count();
        assert_eq!(finished, 1, "{body}");
    }
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["choices"], json!([]), "{body}");
    assert_eq!(last["usage"]["completion_tokens"], 12, "{body}");

    // One access-log line per request, as vLLM writes them.
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 0}));
    assert_eq!(status, 400);
    let expected = [
        "POST /v1/completions 200 cmpl-",
        "prompt + 36 generated tokens (n 3), TTFT ",
        "POST /v1/chat/completions 200 chatcmpl-",
        "prompt + 12 generated tokens (n 2, stream), TTFT ",
        "POST /v1/completions 400: `max_tokens` must be at least 1",
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        let log = server.stderr_so_far();
        if expected.iter().all(|e| log.contains(e)) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{log}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// vLLM's flag names work on `up` (and the short flags on `generate`): the degrees, the
/// batch, the served name and the context cap take effect.
#[test]
fn vllm_flag_names_take_effect() {
    let model = crate::support::model::smollm2();
    let model = model.to_str().expect("utf-8 path");
    let server = Server::start(&[
        "-m",
        model,
        "--tensor-parallel-size",
        "3",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "smol",
        "--max-model-len",
        "256",
    ]);
    assert_eq!(server.rank_pids().len(), 3, "{}", server.startup);
    let models: Value = ureq::get(&format!("{}/v1/models", server.url))
        .call()
        .expect("models")
        .into_body()
        .read_json()
        .expect("JSON");
    assert_eq!(models["data"][0]["id"], "smol");
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "1, 2, 3,", "max_tokens": 300}),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("context of 256 tokens")),
        "{reply}"
    );
    let env = &server.manifest()["ranks"][0]["env"];
    assert_eq!(env["INFER_MAX_BATCH"], "4", "{env}");

    let output = run(&[
        "generate",
        "-m",
        model,
        "-p",
        "1, 2, 3, 4, 5,",
        "-n",
        "16",
        "-t",
        "0",
        "--tensor-parallel-size",
        "3",
        "--json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let generated: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(generated["text"], generate_counting()["text"]);
    let output = run(&["up", "--max-model-len", "100000"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--max-model-len must be 1 to the model's context of 8192"),
        "{stderr}"
    );
}

#[test]
fn ctrl_c_drains_then_cancels_one_process() {
    ctrl_c_drains_then_cancels(&[]);
}

#[test]
fn ctrl_c_drains_then_cancels_tp3() {
    ctrl_c_drains_then_cancels(TP3);
}

/// Ctrl-C with a long request in flight: new requests are refused at once, the request
/// gets `--shutdown-timeout` (1 s here) and is then cancelled — its stream ends with an
/// error chunk — and `infer up` exits 0 with no rank left. A second Ctrl-C stops at once.
fn ctrl_c_drains_then_cancels(layout: &[&str]) {
    use std::io::BufRead;
    use std::time::Duration;
    for twice in [false, true] {
        let mut server = Server::start(&[layout, &["--shutdown-timeout", "1"]].concat());
        let ranks = if layout.is_empty() {
            Vec::new()
        } else {
            server.rank_pids()
        };
        // A greedy count runs to max_tokens.
        let response = ureq::post(&format!("{}/v1/completions", server.url))
            .send_json(
                json!({"prompt": "1, 2, 3,", "max_tokens": 4000, "temperature": 0, "stream": true}),
            )
            .expect("stream");
        let mut reader = std::io::BufReader::new(response.into_body().into_reader());
        let mut first = String::new();
        while !first.starts_with("data: ") {
            first.clear();
            assert!(
                reader.read_line(&mut first).expect("read") > 0,
                "no first chunk"
            );
        }
        let pid = server.child.id();
        signal(pid, rustix::process::Signal::INT);
        let signalled = std::time::Instant::now();
        if twice {
            std::thread::sleep(Duration::from_millis(300));
            signal(pid, rustix::process::Signal::INT);
        }
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut reader, &mut rest);
        let exit = server.child.wait().expect("wait");
        let elapsed = signalled.elapsed();
        let stderr = server.rest_of_stderr();
        assert!(exit.success(), "{exit}: {stderr}");
        if twice {
            assert!(
                elapsed < Duration::from_millis(2500),
                "took {elapsed:?}: {stderr}"
            );
        } else {
            // 1 s of grace, then the cancellation: well before the 4000 tokens.
            assert!(
                elapsed >= Duration::from_millis(900),
                "took {elapsed:?}: {stderr}"
            );
            assert!(
                elapsed < Duration::from_secs(6),
                "took {elapsed:?}: {stderr}"
            );
            assert!(
                rest.contains("the server is shutting down; the request was cancelled"),
                "{rest}"
            );
            assert!(stderr.contains("stopping:"), "{stderr}");
        }
        for pid in ranks {
            assert!(!alive(pid), "rank pid {pid} is still running");
        }
    }
}

/// Property test over request bodies (proptest): random JSON — known and unknown fields,
/// numbers at the edges (negative, zero, 2³², 2⁶⁴−1, fractions), wrong types, nested
/// shapes, text parts and roles — posted to both endpoints. The server never panics or
/// hangs: every answer is a 2xx or a 4xx with OpenAI's error JSON, and it keeps serving.
#[test]
fn random_request_bodies_get_2xx_or_4xx_and_the_server_keeps_serving() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let server = Server::start(&[]);
    let number = prop_oneof![
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(2)),
        Just(json!(4294967296u64)),
        Just(json!(18446744073709551615u64)),
        Just(json!(-9223372036854775808i64)),
        Just(json!(0.5)),
        Just(json!(1e300)),
        Just(json!(-0.0)),
    ];
    let scalar = prop_oneof![
        number.clone(),
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        "[a-z ,0-9]{0,12}".prop_map(Value::String),
    ];
    let value = scalar.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    });
    let field = prop_oneof![
        Just("model"),
        Just("prompt"),
        Just("messages"),
        Just("max_tokens"),
        Just("max_completion_tokens"),
        Just("temperature"),
        Just("top_p"),
        Just("top_k"),
        Just("seed"),
        Just("stop"),
        Just("n"),
        Just("stream"),
        Just("stream_options"),
        Just("logprobs"),
        Just("top_logprobs"),
        Just("response_format"),
        Just("echo"),
        Just("best_of"),
        Just("logit_bias"),
        Just("user"),
        Just("frobnicate"),
    ];
    let message = (
        prop_oneof![
            Just("system"),
            Just("user"),
            Just("assistant"),
            Just("tool"),
            Just("")
        ],
        prop_oneof![
            "[a-z ]{0,12}".prop_map(Value::String),
            Just(json!([{"type": "text", "text": "hi"}, {"type": "image_url"}])),
            Just(json!([{"type": "text", "text": "hi"}])),
            value.clone(),
        ],
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let body = (
        prop::collection::vec((field, value.clone()), 0..6),
        prop::option::of(prop::collection::vec(message, 0..3)),
        prop::option::of("[a-z ,0-9]{0,16}"),
    )
        .prop_map(|(fields, messages, prompt)| {
            let mut object = serde_json::Map::new();
            if let Some(messages) = messages {
                object.insert("messages".into(), Value::Array(messages));
            }
            if let Some(prompt) = prompt {
                object.insert("prompt".into(), Value::String(prompt));
            }
            for (name, value) in fields {
                object.insert(name.into(), value);
            }
            // Valid requests stay short (at most 2 tokens per choice); invalid counts
            // (negative, 2⁶⁴−1, strings) stay as drawn.
            let long = match object.get("max_tokens") {
                None => true,
                Some(v) => v.as_u64().is_some_and(|n| (3..=8192).contains(&n)),
            };
            if long {
                object.insert("max_tokens".into(), json!(2));
            }
            object.remove("max_completion_tokens");
            Value::Object(object)
        });
    // A fixed seed: the same 150 bodies every run (reproducible; a failure names its body).
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 150,
            failure_persistence: None,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let agent = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(std::time::Duration::from_secs(30)))
            .build(),
    );
    runner
        .run(&(body, any::<bool>()), |(body, chat)| {
            let path = if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let response = agent
                .post(&format!("{}{path}", server.url))
                .send_json(&body)
                .map_err(|e| TestCaseError::fail(format!("{body}: {e}")))?;
            let status = response.status().as_u16();
            let text = response
                .into_body()
                .read_to_string()
                .map_err(|e| TestCaseError::fail(format!("{body}: {e}")))?;
            prop_assert!(
                (200..300).contains(&status) || (400..500).contains(&status),
                "{} {path} {body}: {text}",
                status
            );
            if status >= 400 {
                let error: Value = serde_json::from_str(&text)
                    .map_err(|e| TestCaseError::fail(format!("{body}: {e}: {text}")))?;
                prop_assert!(error["error"]["message"].is_string(), "{text}");
            }
            Ok(())
        })
        .expect("every random body answered 2xx or 4xx");
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": "still up?", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    assert!(alive(server.child.id()));
    // Some random bodies were valid and generated (the search is not all rejections).
    let metrics = server.metrics();
    let generated: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("infer_requests_total "))
        .and_then(|v| v.parse().ok())
        .expect("requests_total");
    assert!(generated > 5, "{metrics}");
}

/// `--max-num-seqs 1 --max-queued-requests 1`: of six requests at once, one runs and one
/// waits; the other four get 503 with `Retry-After` at once (before the first finishes),
/// and `/health` answers meanwhile.
#[test]
fn a_flood_past_the_queue_bound_is_refused_at_once_with_retry_after() {
    let server = Server::start(&["--max-num-seqs", "1", "--max-queued-requests", "1"]);
    let url = format!("{}/v1/completions", server.url);
    let started = std::time::Instant::now();
    let answers: Vec<(u16, Option<String>, String, std::time::Duration)> = std::thread::scope(
        |scope| {
            let handles: Vec<_> = (0..6)
                .map(|_| {
                    let url = url.clone();
                    scope.spawn(move || {
                        let mut response = ureq::post(&url)
                            .config()
                            .http_status_as_error(false)
                            .build()
                            .send_json(json!({"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}))
                            .expect("request");
                        let retry_after = crate::support::server::retry_after(&response);
                        let status = response.status().as_u16();
                        let body = response.body_mut().read_to_string().unwrap_or_default();
                        (status, retry_after, body, started.elapsed())
                    })
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(100));
            let (status, _) = server.get("/health");
            assert_eq!(status, 200);
            handles
                .into_iter()
                .map(|h| h.join().expect("request"))
                .collect()
        },
    );
    let served: Vec<_> = answers.iter().filter(|a| a.0 == 200).collect();
    let refused: Vec<_> = answers.iter().filter(|a| a.0 == 503).collect();
    assert_eq!((served.len(), refused.len()), (2, 4), "{answers:?}");
    let first_done = served.iter().map(|a| a.3).min().expect("served");
    for (_, retry_after, body, at) in &refused {
        assert_eq!(retry_after.as_deref(), Some("1"), "{body}");
        assert!(
            body.contains("\"queue_full\"") && body.contains("--max-queued-requests"),
            "{body}"
        );
        assert!(
            *at < first_done,
            "refused at {at:?}, after a request finished at {first_done:?}"
        );
    }
}

/// Three prompts of ~1.8 MB each (more than the HTTP runtime's two workers) are tokenized
/// off them: a `/health` sent while they are tokenized answers before any of them (each
/// then gets its 400: far past the context).
#[test]
fn long_prompts_are_tokenized_off_the_http_workers() {
    let server = Server::start(&[]);
    let url = format!("{}/v1/completions", server.url);
    let prompt = "hello ".repeat(300_000);
    let started = std::time::Instant::now();
    let (health_at, answered_at) = std::thread::scope(|scope| {
        let posts: Vec<_> = (0..3)
            .map(|_| {
                let (url, prompt) = (url.clone(), prompt.clone());
                scope.spawn(move || {
                    let response = ureq::post(&url)
                        .config()
                        .http_status_as_error(false)
                        .build()
                        .send_json(json!({"prompt": prompt, "max_tokens": 1}))
                        .expect("request");
                    assert_eq!(response.status().as_u16(), 400);
                    started.elapsed()
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let (status, _) = server.get("/health");
        assert_eq!(status, 200);
        let health_at = started.elapsed();
        let answered: Vec<_> = posts.into_iter().map(|p| p.join().expect("post")).collect();
        (health_at, answered.into_iter().min().expect("answers"))
    });
    assert!(
        health_at < answered_at,
        "/health answered at {health_at:?}, after a prompt was tokenized at {answered_at:?}"
    );
}

/// On loopback, only requests naming a loopback host are answered (DNS rebinding).
#[test]
fn a_server_on_loopback_answers_only_loopback_host_names() {
    use std::io::{Read, Write};
    let server = Server::start(&[]);
    let address = server.url.trim_start_matches("http://").to_string();
    let port = address.rsplit_once(':').expect("a port").1.to_string();
    let get = |host: &str| {
        let mut stream = std::net::TcpStream::connect(&address).expect("connect");
        write!(
            stream,
            "GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("read");
        reply
    };
    // A page whose name an attacker points at 127.0.0.1 (DNS rebinding) is refused.
    for host in [format!("evil.example:{port}"), "10.1.2.3".to_string()] {
        let reply = get(&host);
        assert!(reply.starts_with("HTTP/1.1 403"), "{host}: {reply}");
        assert!(reply.contains("does not name this server"), "{reply}");
    }
    for host in [
        format!("localhost:{port}"),
        address.clone(),
        format!("[::1]:{port}"),
    ] {
        let reply = get(&host);
        assert!(reply.starts_with("HTTP/1.1 200"), "{host}: {reply}");
    }
}

/// Listening beyond loopback without an API key is allowed, with a warning once bound.
#[test]
fn serving_beyond_loopback_without_a_key_warns() {
    let server = Server::start(&["--host", "0.0.0.0"]);
    assert!(
        server
            .startup
            .contains("warning: serving on 0.0.0.0 without an API key"),
        "{}",
        server.startup
    );
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
}

/// A client that sends half a request head is closed once the head timeout (10 s) passes,
/// instead of holding its connection for good; the server answers others meanwhile.
#[test]
fn a_half_sent_request_head_is_closed_by_the_timeout() {
    use std::io::{Read, Write};
    let server = Server::start(&[]);
    let address = server.url.trim_start_matches("http://").to_string();
    let mut slow = std::net::TcpStream::connect(&address).expect("connect");
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .expect("half a head");
    let sent = std::time::Instant::now();
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
    slow.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    let mut answer = Vec::new();
    let read = slow.read_to_end(&mut answer);
    let waited = sent.elapsed();
    assert!(
        read.is_ok() || answer.is_empty(),
        "the connection was not closed: {read:?}"
    );
    assert!(
        waited >= std::time::Duration::from_secs(9) && waited < std::time::Duration::from_secs(20),
        "closed after {waited:?}"
    );
}

/// Requests whose clients disconnect while they wait for a slot are never computed, in one
/// process.
#[test]
fn waiting_requests_whose_clients_leave_are_never_computed_one_process() {
    waiting_requests_whose_clients_leave_are_never_computed(&[], 1);
}

/// The same through a supervised run's front (`--max-restarts`): a client that leaves the
/// front closes the front's connection to rank 0 too.
#[test]
fn waiting_requests_whose_clients_leave_are_never_computed_through_the_front() {
    waiting_requests_whose_clients_leave_are_never_computed(&["--max-restarts", "1"], 1);
}

/// The same with `--dp 2`: a request waiting on the remote replica is cancelled there.
#[test]
fn waiting_requests_whose_clients_leave_are_never_computed_on_every_replica() {
    waiting_requests_whose_clients_leave_are_never_computed(&["--dp", "2"], 2);
}

/// `--max-num-seqs 1`: a long stream per replica holds its only slot while four requests
/// sent on raw connections (two completions and a chat answered whole, a streamed
/// completion) wait; their connections close. The queue empties while the long streams
/// still run, `/metrics` counts them aborted while waiting, and once the long streams are
/// dropped a probe is the only other prompt ever processed.
fn waiting_requests_whose_clients_leave_are_never_computed(extra: &[&str], replicas: u64) {
    use std::io::Write;
    let server = Server::start(&[&["--max-num-seqs", "1"], extra].concat());
    let value = |text: &str, name: &str| metric(text, name) as u64;
    let wait_for = |what: &str, done: &dyn Fn(&str) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let metrics = server.metrics();
            if done(&metrics) {
                return metrics;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what} never happened:\n{metrics}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    // The long streams: each under way once its first token has arrived.
    let prompts = ["Once upon a time", "The history of the Roman empire"];
    let long: Vec<_> = prompts[..replicas as usize]
        .iter()
        .map(|prompt| {
            let long = ureq::post(&format!("{}/v1/completions", server.url))
                .send_json(json!({"prompt": prompt, "max_tokens": 4000, "ignore_eos": true, "stream": true}))
                .expect("stream");
            let mut long = BufReader::new(long.into_body().into_reader());
            let mut line = String::new();
            while long.read_line(&mut line).expect("read") > 0 && !line.contains("\"text\"") {
                line.clear();
            }
            long
        })
        .collect();
    let started = wait_for("every slot taken", &|m| {
        value(m, "infer_requests_running") == replicas
    });
    let long_prompt_tokens = value(&started, "infer_prompt_tokens_total");

    let address = server.url.trim_start_matches("http://").to_string();
    let requests = [
        (
            "/v1/completions",
            json!({"prompt": "The first abandoned prompt", "max_tokens": 8}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "The second abandoned prompt", "max_tokens": 8}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "An abandoned chat"}], "max_tokens": 8}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "An abandoned stream", "max_tokens": 8, "stream": true}),
        ),
    ];
    let clients: Vec<std::net::TcpStream> = requests
        .iter()
        .map(|(path, body)| {
            let body = body.to_string();
            let mut stream = std::net::TcpStream::connect(&address).expect("connect");
            write!(
                stream,
                "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .expect("send");
            stream
        })
        .collect();
    wait_for("four requests waiting", &|m| {
        value(m, "infer_requests_waiting") == 4
    });
    drop(clients);
    let after = wait_for("the queue emptied", &|m| {
        value(m, "infer_requests_waiting") == 0
    });
    // Dropped from the queue, not admitted: the long streams still hold the slots.
    assert_eq!(value(&after, "infer_requests_running"), replicas, "{after}");
    assert_eq!(
        value(&after, "infer_requests_aborted_total{stage=\"waiting\"}"),
        4,
        "{after}"
    );

    drop(long);
    wait_for("the long streams stopped", &|m| {
        value(m, "infer_requests_running") == 0
    });
    let (status, probe) = server.post(
        "/v1/completions",
        &json!({"prompt": "A probe after them", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{probe}");
    let metrics = server.metrics();
    assert_eq!(
        value(&metrics, "infer_prompt_tokens_total"),
        long_prompt_tokens + probe["usage"]["prompt_tokens"].as_u64().expect("usage"),
        "an abandoned request was computed:\n{metrics}"
    );
    assert_eq!(
        value(&metrics, "infer_requests_aborted_total{stage=\"running\"}"),
        replicas,
        "{metrics}"
    );
}
