//! The clients people point at a vLLM server: the request bodies five load generators
//! sent (captured from their real runs: AIPerf, GuideLLM, inference-perf, `vllm bench
//! serve`, SGLang's `bench_serving`; `tests/fixtures/client-requests.jsonl`) replayed
//! against `infer up`, and vLLM's sampling extensions, model list, tokenizer endpoints and
//! metric names checked for their effect on the real model.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::support::cache::pip_venv;
use crate::support::process::infer;
use crate::support::server::{Server, metric};

/// The served name the captured bodies use.
const MODEL: &str = "smollm2";

/// The captured requests: `{client, method, path, body?}` per line.
fn captured_requests() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/client-requests.jsonl"
    );
    std::fs::read_to_string(path)
        .expect("the captured requests")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

/// Posts `body` to `path` and reads the whole answer: the status and, for a stream, every
/// `data:` chunk before `[DONE]` (a plain answer is one chunk).
fn post_reading_stream(server: &Server, path: &str, body: &Value) -> (u16, Vec<Value>) {
    let response = ureq::post(&format!("{}{path}", server.url))
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(body)
        .expect("the server answers");
    let status = response.status().as_u16();
    let text = response.into_body().read_to_string().expect("the body");
    if body["stream"] != json!(true) || status != 200 {
        return (status, vec![serde_json::from_str(&text).expect("JSON")]);
    }
    let mut chunks = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        assert!(!done, "a chunk after [DONE]: {text}");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("a JSON chunk"));
        }
    }
    assert!(done, "no [DONE]: {text}");
    (status, chunks)
}

/// The generated text of an answer's chunks (completions' `text`, chat's `delta.content`
/// or `message.content`).
fn text_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|choice| {
            choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .or_else(|| choice["message"]["content"].as_str())
        })
        .collect()
}

#[test]
fn the_requests_of_five_load_generators_are_served_as_vllm_serves_them() {
    let server = Server::start(&["--served-model-name", MODEL]);
    let requests = captured_requests();
    assert!(requests.len() >= 20, "{} requests", requests.len());
    for request in &requests {
        let client = request["client"].as_str().expect("client");
        let path = request["path"].as_str().expect("path");
        if request["method"] == "GET" {
            let (status, reply) = server.get(path);
            // SGLang's bench asks for its own `/server_info` and takes a 404.
            let expected = if path == "/server_info" { 404 } else { 200 };
            assert_eq!(status, expected, "{client}: GET {path}: {reply}");
            continue;
        }
        let body = &request["body"];
        let (status, chunks) = post_reading_stream(&server, path, body);
        assert_eq!(status, 200, "{client}: {body}: {chunks:?}");
        let options = &body["stream_options"];
        let max_tokens = body["max_tokens"]
            .as_u64()
            .or_else(|| body["max_completion_tokens"].as_u64())
            .expect("a length");
        let finish = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .find_map(|choice| choice["finish_reason"].as_str())
            .unwrap_or_else(|| panic!("{client}: no finish_reason in {chunks:?}"));
        let with_choices: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
            .collect();
        if body["stream"] == json!(true) {
            // The usage chunk (no choices) comes only when asked: SGLang's bench reads
            // `choices[0]` of every chunk.
            let usage_chunks = chunks.len() - with_choices.len();
            let asked = options["include_usage"] == json!(true);
            assert_eq!(usage_chunks, usize::from(asked), "{client}: {chunks:?}");
            if options["continuous_usage_stats"] == json!(true) {
                // GuideLLM: the usage so far on every chunk, counting up.
                let mut last = 0;
                for chunk in &with_choices {
                    let so_far = chunk["usage"]["completion_tokens"]
                        .as_u64()
                        .unwrap_or_else(|| panic!("{client}: no usage in {chunk}"));
                    assert!(so_far >= last, "{client}: {chunks:?}");
                    assert_eq!(
                        chunk["usage"]["total_tokens"].as_u64(),
                        Some(so_far + chunk["usage"]["prompt_tokens"].as_u64().expect("p")),
                        "{chunk}"
                    );
                    last = so_far;
                }
            }
        }
        // `ignore_eos` (every tool's default for fixed output lengths): exactly the length
        // asked for, whatever the model wanted.
        let completion_tokens = chunks
            .iter()
            .rev()
            .find_map(|c| c["usage"]["completion_tokens"].as_u64());
        if body["ignore_eos"] == json!(true) {
            assert_eq!(finish, "length", "{client}: {body}");
            if let Some(tokens) = completion_tokens {
                assert_eq!(tokens, max_tokens, "{client}: {chunks:?}");
            }
        } else if let Some(tokens) = completion_tokens {
            assert!(tokens <= max_tokens, "{client}: {chunks:?}");
        }
    }
    // Every request was counted under vLLM's metric names too.
    let metrics = server.metrics();
    let posts = requests.iter().filter(|r| r["method"] == "POST").count();
    assert!(
        metrics.contains(&format!(
            "vllm:e2e_request_latency_seconds_count{{model_name=\"{MODEL}\"}} {posts}\n"
        )),
        "{metrics}"
    );
}

#[test]
fn vllms_sampling_extensions_take_effect_on_the_real_model() {
    let server = Server::start(&["--served-model-name", MODEL]);
    let completions = "/v1/completions";
    let chat = "/v1/chat/completions";
    let post = |path: &str, body: Value| {
        let (status, reply) = server.post(path, &body);
        assert_eq!(status, 200, "{body}: {reply}");
        reply
    };
    let text = |reply: &Value| text_of(std::slice::from_ref(reply));
    let usage = |reply: &Value| reply["usage"]["completion_tokens"].as_u64().expect("usage");
    let finish = |reply: &Value| reply["choices"][0]["finish_reason"].clone();

    // Neutral values leave greedy output unchanged, bit for bit.
    let prompt = "The capital of France is Paris. The capital of Germany is";
    let plain = post(
        completions,
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
    );
    let neutral = post(
        completions,
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "repetition_penalty": 1.0,
               "presence_penalty": 0, "frequency_penalty": 0, "min_p": 0, "min_tokens": 0,
               "ignore_eos": false, "logit_bias": {}, "stop_token_ids": [],
               "skip_special_tokens": true, "include_stop_str_in_output": false,
               "use_beam_search": false, "length_penalty": 1}),
    );
    assert_eq!(text(&neutral), text(&plain));

    // A chat the model ends early: `ignore_eos` runs it to the length, `min_tokens` to at
    // least its count, and `skip_special_tokens: false` shows the end-of-turn tokens.
    let hello = json!([{"role": "user", "content": "Say hi."}]);
    let short = post(
        chat,
        json!({"messages": hello, "max_tokens": 48, "temperature": 0}),
    );
    let short_tokens = usage(&short);
    assert!(short_tokens < 40, "the model ends early: {short}");
    assert_eq!(finish(&short), "stop");
    let long = post(
        chat,
        json!({"messages": hello, "max_tokens": 48, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(
        (usage(&long), finish(&long)),
        (48, json!("length")),
        "{long}"
    );
    assert!(text(&long).starts_with(&text(&short)), "{long} vs {short}");
    assert!(!text(&long).contains("<|im_end|>"), "{long}");
    let special = post(
        chat,
        json!({"messages": hello, "max_tokens": 48, "temperature": 0, "ignore_eos": true,
               "skip_special_tokens": false}),
    );
    assert!(text(&special).contains("<|im_end|>"), "{special}");
    let at_least = post(
        chat,
        json!({"messages": hello, "max_tokens": 48, "temperature": 0, "min_tokens": 40}),
    );
    assert!(usage(&at_least) >= 40, "{at_least}");

    // `logit_bias` +100 on one token makes greedy pick it every time; as a stop token it
    // then ends the generation at once, or after `min_tokens` tokens.
    let (status, tokenized) = server.post(
        "/tokenize",
        &json!({"prompt": " the", "add_special_tokens": false}),
    );
    assert_eq!(status, 200, "{tokenized}");
    let the = tokenized["tokens"][0].as_u64().expect("a token id");
    let forced = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "logit_bias": {the.to_string(): 100}});
    let reply = post(completions, forced.clone());
    assert_eq!(text(&reply), " the".repeat(6), "{reply}");
    let mut stopped = forced.clone();
    stopped["stop_token_ids"] = json!([the]);
    let reply = post(completions, stopped.clone());
    assert_eq!(
        (usage(&reply), finish(&reply)),
        (0, json!("stop")),
        "{reply}"
    );
    stopped["min_tokens"] = json!(3);
    let reply = post(completions, stopped);
    // Barred for three tokens, then sampled and stopping.
    assert_eq!(
        (usage(&reply), finish(&reply)),
        (3, json!("stop")),
        "{reply}"
    );
    assert!(!text(&reply).contains(" the"), "{reply}");

    // `include_stop_str_in_output` keeps the stop string that ended the text.
    let full = text(&plain);
    let stop: String = full.chars().skip(3).take(4).collect();
    let cut = post(
        completions,
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop]}),
    );
    let kept = post(
        completions,
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop],
               "include_stop_str_in_output": true}),
    );
    assert!(!text(&cut).contains(&stop), "{cut}");
    assert_eq!(text(&kept), format!("{}{stop}", text(&cut)), "{kept}");

    // The frequency penalty thins out repeats of a repetitive prompt (a presence penalty
    // of 2 cannot: "1" leads by more); the repetition and presence penalties change greedy
    // output.
    let counting = "1, 1, 1, 1, 1, 1, 1, 1,";
    let repeats = |reply: &Value| {
        let tokens = reply["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .expect("tokens")
            .clone();
        let mut counts = std::collections::HashMap::new();
        for token in &tokens {
            *counts.entry(token.to_string()).or_insert(0) += 1;
        }
        counts.into_values().max().unwrap_or(0)
    };
    let base = json!({"prompt": counting, "max_tokens": 24, "temperature": 0, "logprobs": 0});
    let unpenalized = post(completions, base.clone());
    let mut frequency = base.clone();
    frequency["frequency_penalty"] = json!(2.0);
    let penalized = post(completions, frequency);
    assert!(
        repeats(&penalized) < repeats(&unpenalized),
        "{penalized} vs {unpenalized}"
    );
    let mut repetition = base.clone();
    repetition["repetition_penalty"] = json!(1.5);
    let reply = post(completions, repetition);
    assert_ne!(text(&reply), text(&unpenalized), "{reply}");
    // Unpenalized, this prompt loops on "I'm not sure what to do with it.".
    let eat = json!({"prompt": "I like to eat", "max_tokens": 32, "temperature": 0});
    let looping = post(completions, eat.clone());
    let mut presence = eat;
    presence["presence_penalty"] = json!(2.0);
    let reply = post(completions, presence);
    assert_ne!(text(&reply), text(&looping), "{reply}");
}

#[test]
fn models_tokenize_detokenize_and_metrics_answer_as_vllms() {
    let server = Server::start(&["--served-model-name", MODEL, "--max-model-len", "2048"]);
    // `/v1/models` as vLLM fills it; `vllm bench serve` reads `root`.
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200, "{models}");
    let models: Value = serde_json::from_str(&models).expect("JSON");
    let model = &models["data"][0];
    for field in [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ] {
        assert!(model.get(field).is_some(), "no `{field}`: {model}");
    }
    assert_eq!(
        (model["id"].clone(), model["root"].clone()),
        (json!(MODEL), json!(MODEL))
    );
    assert_eq!(model["max_model_len"], 2048);
    let (status, one) = server.get(&format!("/v1/models/{MODEL}"));
    assert_eq!(status, 200, "{one}");
    assert_eq!(serde_json::from_str::<Value>(&one).expect("JSON"), {
        let mut expected = model.clone();
        // `created` is the second of the answer.
        expected["created"] = serde_json::from_str::<Value>(&one).expect("JSON")["created"].clone();
        expected["permission"][0]["created"] = expected["created"].clone();
        expected
    });
    let (status, missing) = server.get("/v1/models/gpt-4");
    assert_eq!(status, 404, "{missing}");
    assert!(missing.contains("model_not_found"), "{missing}");

    // `/tokenize` and `/detokenize` round-trip; a chat counts the tokens the chat endpoint
    // runs (its `prompt_tokens`).
    let (status, tokens) = server.post(
        "/tokenize",
        &json!({"model": MODEL, "prompt": "Hello, world!", "return_token_strs": true}),
    );
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["max_model_len"], 2048);
    let ids = tokens["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tokens["count"], ids.len());
    assert_eq!(
        tokens["token_strs"].as_array().map(Vec::len),
        Some(ids.len())
    );
    let (status, text) = server.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(
        (status, text["prompt"].clone()),
        (200, json!("Hello, world!")),
        "{text}"
    );
    let messages = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    let (_, counted) = server.post("/tokenize", &json!({"messages": messages}));
    let (status, reply) = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        counted["count"], reply["usage"]["prompt_tokens"],
        "{counted}"
    );
    let (status, bad) = server.post("/detokenize", &json!({"tokens": [1_000_000]}));
    assert_eq!(status, 400, "{bad}");
    assert_eq!(bad["error"]["param"], "tokens");
    let (status, bad) = server.post("/tokenize", &json!({"prompt": "x", "messages": messages}));
    assert_eq!(status, 400, "{bad}");

    // Unknown fields: every one named, vLLM's told apart from typos.
    let (status, bad) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "guided_regex": "a+", "bad_words": ["x"], "temprature": 0}),
    );
    assert_eq!(status, 400, "{bad}");
    let message = bad["error"]["message"].as_str().expect("message");
    for expected in [
        "unknown fields `bad_words`, `guided_regex`, `temprature`",
        "vLLM accepts `bad_words`, `guided_regex`",
        "`temprature` is a field of neither the OpenAI nor the vLLM API",
    ] {
        assert!(message.contains(expected), "{message}");
    }

    // vLLM's metric names, labelled with the served name, agree with ours.
    let metrics = server.metrics();
    let label = format!("{{model_name=\"{MODEL}\"}}");
    for (vllm, ours) in [
        (
            "vllm:generation_tokens_total",
            "infer_generation_tokens_total",
        ),
        ("vllm:prompt_tokens_total", "infer_prompt_tokens_total"),
        ("vllm:num_requests_running", "infer_requests_running"),
        ("vllm:num_requests_waiting", "infer_requests_waiting"),
        (
            "vllm:prefix_cache_queries_total",
            "infer_prefix_cache_queries_total",
        ),
        (
            "vllm:prefix_cache_hits_total",
            "infer_prefix_cache_hits_total",
        ),
        ("vllm:kv_cache_usage_perc", "infer_kv_cache_usage_ratio"),
    ] {
        assert_eq!(
            metric(&metrics, &format!("{vllm}{label}")),
            metric(&metrics, ours),
            "{vllm}: {metrics}"
        );
    }
    assert_eq!(
        metric(
            &metrics,
            "vllm:generation_tokens_total{model_name=\"smollm2\"}"
        ),
        2.0
    );
    for histogram in [
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ] {
        assert!(
            metrics.contains(&format!("{histogram}_count{label} ")),
            "{histogram}: {metrics}"
        );
    }
    assert_eq!(
        metric(
            &metrics,
            &format!("vllm:e2e_request_latency_seconds_count{label}")
        ),
        1.0
    );
}

/// AIPerf (NVIDIA's load generator) from PyPI, wheels only (~1.2 GB, no torch), in a
/// venv cached outside the repository.
fn aiperf_venv() -> PathBuf {
    pip_venv(
        "aiperf-0.13.0",
        &["--only-binary", ":all:", "aiperf==0.13.0"].map(OsStr::new),
    )
}

/// The SmolLM2 tokenizer as `infer model export-tokenizer` writes it, in `scratch`.
fn exported_tokenizer(scratch: &Path) -> PathBuf {
    let tokenizer = scratch.join("tokenizer");
    let export = infer()
        .args(["model", "export-tokenizer", "smollm2"])
        .arg(&tokenizer)
        .output()
        .expect("run infer model export-tokenizer");
    assert!(
        export.status.success(),
        "{}",
        String::from_utf8_lossy(&export.stderr)
    );
    tokenizer
}

/// Runs `aiperf profile` against `url` on `endpoint` (`completions` or `chat`): 8 streamed
/// requests, 2 at a time, 32 prompt tokens and 16 generated (AIPerf's recommended
/// `ignore_eos` and `min_tokens`), counting tokens with `tokenizer`; returns its summary
/// (`profile_export_aiperf.json`).
fn run_aiperf(venv: &Path, url: &str, endpoint: &str, tokenizer: &Path, out: &Path) -> Value {
    let output = Command::new(venv.join("bin/python"))
        .args(["-m", "aiperf", "profile", "--model", MODEL, "--url", url])
        .args(["--endpoint-type", endpoint, "--streaming", "--tokenizer"])
        .arg(tokenizer)
        .args([
            "--request-count",
            "8",
            "--concurrency",
            "2",
            "--random-seed",
            "1",
        ])
        .args([
            "--synthetic-input-tokens-mean",
            "32",
            "--synthetic-input-tokens-stddev",
            "0",
        ])
        .args(["--output-tokens-mean", "16", "--output-tokens-stddev", "0"])
        .args([
            "--extra-inputs",
            "ignore_eos:true",
            "--extra-inputs",
            "min_tokens:16",
        ])
        .args([
            "--ui-type",
            "none",
            "--no-server-metrics",
            "--no-gpu-telemetry",
        ])
        .arg("--artifact-dir")
        .arg(out)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("DO_NOT_TRACK", "1")
        .output()
        .expect("run aiperf");
    let summary = out.join("profile_export_aiperf.json");
    assert!(
        output.status.success() && summary.exists(),
        "aiperf {endpoint} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(summary).expect("read the summary"))
        .expect("the summary is JSON")
}

#[test]
fn aiperf_from_pypi_benchmarks_infer_up_with_the_exported_tokenizer() {
    let venv = aiperf_venv();
    let scratch = tempfile::tempdir().expect("tempdir");
    let tokenizer = exported_tokenizer(scratch.path());
    let server = Server::start(&["--served-model-name", MODEL]);
    let mut generated = 0.0;
    for endpoint in ["completions", "chat"] {
        let summary = run_aiperf(
            &venv,
            &server.url,
            endpoint,
            &tokenizer,
            &scratch.path().join(endpoint),
        );
        let avg = |field: &str| summary[field]["avg"].as_f64();
        // Every request succeeded (AIPerf exits 0 whatever failed: its counts tell).
        assert_eq!(avg("request_count"), Some(8.0), "{endpoint}: {summary}");
        assert_eq!(
            avg("error_request_count").unwrap_or(0.0),
            0.0,
            "{endpoint}: {summary}"
        );
        // `ignore_eos` and `min_tokens`: 16 tokens each, by our usage.
        assert_eq!(
            avg("total_usage_completion_tokens"),
            Some(128.0),
            "{endpoint}: {summary}"
        );
        generated += 128.0;
        if endpoint == "completions" {
            // The exported tokenizer, loaded by transformers, counts prompts as we do.
            assert_eq!(
                avg("total_isl"),
                avg("total_usage_prompt_tokens"),
                "{summary}"
            );
        }
    }
    // Token counts equal the server's own.
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_generation_tokens_total"),
        generated,
        "{metrics}"
    );
}

/// inference-perf (the Kubernetes serving working group's load generator) from PyPI, wheels
/// only, in a venv cached outside the repository. It declares Python ≥ 3.12 but its code
/// compiles and runs on this machine's 3.11 (checked: every module compiles, both runs
/// below pass), so pip is told to install it there.
fn inference_perf_venv() -> PathBuf {
    pip_venv(
        "inference-perf-0.7.0",
        &[
            "--only-binary",
            ":all:",
            "--ignore-requires-python",
            "inference-perf==0.7.0",
        ]
        .map(OsStr::new),
    )
}

#[test]
fn inference_perf_from_pypi_benchmarks_infer_up_with_the_exported_tokenizer() {
    let venv = inference_perf_venv();
    let scratch = tempfile::tempdir().expect("tempdir");
    let tokenizer = exported_tokenizer(scratch.path());
    let server = Server::start(&["--served-model-name", MODEL]);
    // Completions with random prompts of 32 tokens and 16 out; chat with its fixed mock
    // prompts and its default of 30 out (its random data has no chat form). Both always
    // send `ignore_eos`.
    let data = [
        (
            "completion",
            "{type: random, input_distribution: {min: 32, max: 32, mean: 32, std_dev: 0}, output_distribution: {min: 16, max: 16, mean: 16, std_dev: 0}}",
            16.0,
        ),
        ("chat", "{type: mock}", 30.0),
    ];
    let (mut prompt_tokens, mut generated) = (0.0, 0.0);
    for (api, data, output_tokens) in data {
        let out = scratch.path().join(api);
        let config = scratch.path().join(format!("{api}.yaml"));
        std::fs::write(
            &config,
            format!(
                "api: {{type: {api}, streaming: true}}\n\
                 data: {data}\n\
                 load: {{type: concurrent, num_workers: 1, stages: [{{num_requests: 8, concurrency_level: 2}}]}}\n\
                 server: {{type: vllm, model_name: {MODEL}, base_url: '{url}', ignore_eos: true}}\n\
                 tokenizer: {{pretrained_model_name_or_path: '{tokenizer}'}}\n\
                 report: {{request_lifecycle: {{summary: true, per_stage: false, per_request: false}}}}\n\
                 storage: {{local_storage: {{path: '{out}'}}}}\n",
                url = server.url,
                tokenizer = tokenizer.display(),
                out = out.display(),
            ),
        )
        .expect("write the config");
        let output = Command::new(venv.join("bin/python"))
            .args(["-m", "inference_perf.main", "--config_file"])
            .arg(&config)
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_HUB_DISABLE_TELEMETRY", "1")
            .output()
            .expect("run inference-perf");
        let summary = out.join("summary_lifecycle_metrics.json");
        assert!(
            output.status.success() && summary.exists(),
            "inference-perf {api} failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(summary).expect("read the summary"))
                .expect("the summary is JSON");
        // Every request succeeded (it exits 0 whatever failed: its counts tell), each
        // with the length asked for.
        let successes = &summary["successes"];
        assert_eq!(successes["count"], 8, "{api}: {summary}");
        assert_eq!(summary["failures"]["count"], 0, "{api}: {summary}");
        assert_eq!(
            successes["output_tokens"]["total"].as_f64(),
            Some(8.0 * output_tokens),
            "{api}: {summary}"
        );
        prompt_tokens += successes["prompt_tokens"]["total"]
            .as_f64()
            .expect("prompt tokens");
        generated += 8.0 * output_tokens;
    }
    // Token counts equal the server's own.
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_generation_tokens_total"),
        generated,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_prompt_tokens_total"),
        prompt_tokens,
        "{metrics}"
    );
}
