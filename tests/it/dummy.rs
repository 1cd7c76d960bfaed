//! `--load-format dummy` (vLLM's name): random weights of a model profile's shape, generated
//! on the fly. A Llama-3.1-8B-shaped model (8 KV heads, which split 2 ways; SmolLM2's 3 do
//! not) on real TP 2 × PP 2 rank processes gives one process's greedy tokens; the flags that
//! shape it are refused without it; the benchmark reads the weight bytes the shape implies.

use serde_json::Value;

use crate::support::process::run;
use crate::support::server::Server;

/// `infer generate --json` with `args`: the generated ids.
fn generated(args: &[&str]) -> Vec<u64> {
    let mut full = vec![
        "generate",
        "--json",
        "--max-tokens",
        "6",
        "--prompt",
        "Hello, world",
    ];
    full.extend_from_slice(args);
    let output = run(&full);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert!(
        json["model"]
            .as_str()
            .is_some_and(|m| m.starts_with("dummy:llama-3.1-8b:")),
        "{json}"
    );
    json["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect()
}

#[test]
fn dummy_llama_8b_on_tp2_pp2_ranks_gives_the_single_process_tokens() {
    let shape = [
        "--load-format",
        "dummy",
        "--model",
        "llama-3.1-8b",
        "--dtype",
        "q8_0",
        "--num-layers",
        "2",
    ];
    let single = generated(&shape);
    assert_eq!(single.len(), 6);
    // Random weights of one seed: not one token repeated throughout.
    assert!(single.iter().any(|&t| t != single[0]), "{single:?}");
    let mut layout = shape.to_vec();
    layout.extend(["--tp", "2", "--pp", "2"]);
    assert_eq!(generated(&layout), single, "tp 2 × pp 2");
    // Another weight type is another model.
    let mut other = shape.to_vec();
    other[5] = "q4_0";
    assert_ne!(generated(&other), single);
}

#[test]
fn dummy_flags_are_refused_where_they_mean_nothing() {
    for (args, says) in [
        (
            &["generate", "--prompt", "hi", "--dtype", "q4_0"][..],
            "add --load-format dummy",
        ),
        (
            &["generate", "--prompt", "hi", "--load-format", "dummy"],
            "--load-format dummy needs --model",
        ),
        (
            &[
                "bench",
                "decode",
                "--load-format",
                "dummy",
                "--model",
                "mixtral-8x7b",
            ],
            "is a MoE model",
        ),
        (
            &[
                "generate",
                "--prompt",
                "hi",
                "--load-format",
                "dummy",
                "--model",
                "llama-3.1-8b",
                "--num-layers",
                "0",
            ],
            "--num-layers must be at least 1",
        ),
    ] {
        let output = run(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// The benchmark's figures on CPU for a one-layer Llama-3.1-8B shape in Q4_0: the weight
/// bytes a decode step reads are the layer's seven projections and the LM head in Q4_0's
/// 18 bytes per 32 values (the embedding only looks rows up).
#[test]
fn bench_decode_of_a_dummy_model_reads_the_bytes_its_shape_implies() {
    let output = run(&[
        "bench",
        "decode",
        "--load-format",
        "dummy",
        "--model",
        "llama-3.1-8b",
        "--dtype",
        "q4_0",
        "--num-layers",
        "1",
        "--runs",
        "1",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--json",
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let (hidden, intermediate, kv, vocab) = (4096u64, 14336u64, 1024u64, 128_256u64);
    let values = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * intermediate + vocab * hidden;
    assert_eq!(report["decode_weight_bytes"], values / 32 * 18, "{report}");
    assert_eq!(report["model"], "dummy:llama-3.1-8b:q4_0");
    assert!(
        report["decode_tokens_per_sec"]
            .as_f64()
            .is_some_and(|t| t > 0.0)
    );
}

/// `infer up --load-format dummy` serves the random model through the OpenAI API, in one
/// process and as TP 2 rank processes (8 KV heads split two ways), with the same greedy
/// completion and the profile's name as the model id.
#[test]
fn up_serves_a_dummy_model_alike_in_one_process_and_on_tp2_ranks() {
    let shape = [
        "--load-format",
        "dummy",
        "--model",
        "llama-3.1-8b",
        "--dtype",
        "q8_0",
        "--num-layers",
        "1",
    ];
    let mut completions = Vec::new();
    for layout in [&[][..], &["--tp", "2"]] {
        let mut args = shape.to_vec();
        args.extend_from_slice(layout);
        let server = Server::start(&args);
        let (status, body) = server.post(
            "/v1/completions",
            &serde_json::json!({"model": "llama-3.1-8b", "prompt": "Hello", "max_tokens": 4, "temperature": 0}),
        );
        assert_eq!(status, 200, "{layout:?}: {body}");
        assert_eq!(body["model"], "llama-3.1-8b", "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
        completions.push(body["choices"][0]["text"].clone());
    }
    assert_eq!(completions[0], completions[1]);
}
