//! `--device cuda` rank processes, with the host harness standing in for the GPUs
//! (`INFER_CUDA_HOST_HARNESS=1`: each rank runs the same CUDA kernel sources on CPU threads):
//! real `infer rank` processes, each on the `CUDA_VISIBLE_DEVICES` its launcher gave it (read
//! back from its log), its TP shard on its device, the all-reduces through the fallback
//! collectives (with the reason said), giving the CPU engine's tokens.

use std::path::Path;

use serde_json::{Value, json};

use crate::support::process::{infer, run};
use crate::support::server::{Server, assert_every_replica_routed, metric};
use crate::support::synthetic::{Shape, write_gguf_moe, write_tp2_model};

/// `infer generate --json` of `model`, greedy, with `extra` flags: its JSON and stderr.
fn generate(model: &Path, extra: &[&str], harness: bool) -> (Value, String) {
    let mut command = infer();
    if harness {
        command.env("INFER_CUDA_HOST_HARNESS", "1");
    }
    let output = command
        .args([
            "generate",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "5",
        ])
        .args(["--prompt", "HELLO THERE", "--model"])
        .arg(model)
        .args(extra)
        .output()
        .expect("run infer generate");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{extra:?}:\n{stderr}");
    let json = serde_json::from_slice(&output.stdout).expect("generate JSON");
    (json, stderr)
}

fn rank_log(run_dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(run_dir.join(format!("rank{rank}.log")))
        .unwrap_or_else(|e| panic!("rank{rank}.log: {e}"))
}

/// `infer generate --device cuda --tp 2`: two rank processes, each on its own GPU slot
/// (`CUDA_VISIBLE_DEVICES` 0 and 1, as its log says), their shards' sums through host memory
/// (the harness has no NCCL, and the rank says so), the CPU engine's greedy tokens — and the
/// same as one process on the device.
#[test]
fn tp_2_device_ranks_give_the_cpu_engines_tokens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_tp2_model(dir.path());
    let (cpu, _) = generate(&model, &[], false);
    let (one, _) = generate(&model, &["--device", "cuda"], true);
    assert_eq!(one["tokens"], cpu["tokens"], "one device process");
    let run_dir = dir.path().join("run");
    let run = run_dir.to_str().expect("utf-8");
    let (ranks, stderr) = generate(
        &model,
        &["--device", "cuda", "--tp", "2", "--run-dir", run],
        true,
    );
    assert_eq!(ranks["tokens"], cpu["tokens"], "{stderr}");
    assert_eq!(ranks["text"], cpu["text"]);
    for rank in 0..2 {
        let log = rank_log(&run_dir, rank);
        assert!(
            log.contains(&format!("rank {rank} on the host harness"))
                && log.contains(&format!("CUDA_VISIBLE_DEVICES={rank}\n")),
            "rank {rank}:\n{log}"
        );
        assert!(
            log.contains("TP all-reduces go through host memory")
                && log.contains("the host harness has no NCCL"),
            "rank {rank}:\n{log}"
        );
    }
    // Every rank saw its own slot in its environment, as the manifest records.
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(run_dir.join("manifest.json")).expect("manifest.json"),
    )
    .expect("manifest JSON");
    let visible: Vec<String> = manifest["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            r["env"]["CUDA_VISIBLE_DEVICES"]
                .as_str()
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    assert_eq!(visible, ["0", "1"], "{manifest:#}");
    // Two pipeline stages: the first embeds and hands its hidden states to the second, which
    // samples; the same tokens again.
    let pp_dir = dir.path().join("pp");
    let pp_run = pp_dir.to_str().expect("utf-8");
    let (stages, stderr) = generate(
        &model,
        &["--device", "cuda", "--pp", "2", "--run-dir", pp_run],
        true,
    );
    assert_eq!(stages["tokens"], cpu["tokens"], "{stderr}");
    // The hand-offs between the stages go through host memory, and each stage says why.
    for rank in 0..2 {
        let log = rank_log(&pp_dir, rank);
        assert!(
            log.contains("pipeline hand-offs go through host memory")
                && log.contains("the host harness has no NCCL"),
            "stage {rank}:
{log}"
        );
    }
}

/// `infer up --device cuda --plan plan.json`: the plan's `cuda_visible_devices` per rank
/// reaches the ranks (swapped in the file here, so that only the plan can explain it), the
/// TP 2 replica serves the CPU engine's completion.
#[test]
fn a_plans_gpus_reach_the_device_ranks_that_serve() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_tp2_model(dir.path());
    let (cpu, _) = generate(&model, &[], false);
    let output = run(&[
        "plan",
        "--json",
        "--model",
        model.to_str().expect("utf-8"),
        "--cluster",
        "1x2xh100-sxm",
        "--tp",
        "2",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    let ranks = plan["ranks"].as_array_mut().expect("ranks");
    assert_eq!(ranks.len(), 2, "a TP 2 plan");
    for rank in ranks.iter_mut() {
        let gpu = rank["cuda_visible_devices"].as_str().expect("a GPU");
        let swapped = if gpu == "0" { "1" } else { "0" };
        rank["cuda_visible_devices"] = json!(swapped);
    }
    let plan_file = dir.path().join("plan.json");
    std::fs::write(&plan_file, serde_json::to_vec(&plan).expect("JSON")).expect("write");
    let run_dir = dir.path().join("run");
    let mut command = infer();
    command
        .env("INFER_CUDA_HOST_HARNESS", "1")
        .args(["up", "--port", "0", "--device", "cuda", "--model"])
        .arg(&model)
        .arg("--plan")
        .arg(&plan_file)
        .arg("--run-dir")
        .arg(&run_dir);
    let server = Server::start_command(command);
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "HELLO THERE", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], cpu["text"], "{reply}");
    for (rank, gpu) in [(0, 1), (1, 0)] {
        let log = rank_log(&run_dir, rank);
        assert!(
            log.contains(&format!("CUDA_VISIBLE_DEVICES={gpu}\n")),
            "rank {rank} should be on the plan's GPU {gpu}:\n{log}"
        );
    }
}

/// `infer up --device cuda --prefill 1 --decode 1`, then with `--tp 2` and `--pp 2` on both
/// roles: the
/// prompts run on the prefill replica's device in chunks of 16 tokens; after each chunk's
/// step every rank copies its shard's new KV blocks out of the device cache and sends them
/// to the same rank of the decode replica, which writes them into its own device cache and
/// generates the rest. The completions (greedy and seeded, prompts of one to three chunks)
/// are one device process's; the decode replica computes no prompt, and the KV bytes and
/// parts are the prompts' (one part per chunk: every layer at once).
#[test]
fn prefill_and_decode_device_replicas_give_one_device_process_completions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_tp2_model(dir.path());
    let serve = |layout: &[&str]| {
        let mut command = infer();
        command
            .env("INFER_CUDA_HOST_HARNESS", "1")
            .args(["up", "--port", "0", "--device", "cuda"])
            .args(["--max-num-batched-tokens", "16", "--model"])
            .arg(&model)
            .args(layout);
        Server::start_command(command)
    };
    let bodies = [
        json!({"prompt": "HELLO THERE", "max_tokens": 5, "temperature": 0}),
        json!({"prompt": "THEQUICKBROWNFOXJUMPSOVERTHELAZYDOG0123456789", "max_tokens": 6, "temperature": 0}),
        json!({"prompt": "ONCEUPONATIME", "max_tokens": 6, "temperature": 0.9, "seed": 7}),
    ];
    let answers = |server: &Server| -> Vec<(Value, u64)> {
        bodies
            .iter()
            .map(|body| {
                let (status, reply) = server.post("/v1/completions", body);
                assert_eq!(status, 200, "{reply}");
                let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().expect("usage");
                (reply["choices"][0]["text"].clone(), prompt_tokens)
            })
            .collect()
    };
    let one = serve(&[]);
    let expected = answers(&one);
    drop(one);
    assert!(
        expected.iter().any(|(_, p)| *p > 32),
        "a prompt of three chunks: {expected:?}"
    );
    // The synthetic model's KV bytes per position: 2 layers × (keys, values) × 2 KV heads ×
    // 16 dims × f16.
    let kv_bytes_per_token = 2 * 2 * 2 * 16 * 2;
    for (tp, pp, layout) in [
        (1, 1, &["--prefill", "1", "--decode", "1"][..]),
        (2, 1, &["--prefill", "1", "--decode", "1", "--tp", "2"][..]),
        (1, 2, &["--prefill", "1", "--decode", "1", "--pp", "2"][..]),
    ] {
        let server = serve(layout);
        let got = answers(&server);
        assert_eq!(got, expected, "{layout:?}");
        let metrics = server.metrics();
        let metric = |name: &str| metric(&metrics, name);
        let prompt_tokens: u64 = got.iter().map(|(_, p)| p).sum();
        let chunks: u64 = got.iter().map(|(_, p)| p.div_ceil(16)).sum();
        assert_eq!(metric("infer_pd_handoffs_total"), 3.0, "{metrics}");
        assert_eq!(
            metric("infer_pd_decode_prefill_tokens_total"),
            0.0,
            "{metrics}"
        );
        // The counters are the driver rank's shard: half the KV heads under TP 2, half the
        // layers under PP 2.
        assert_eq!(
            metric("infer_pd_kv_bytes_sent_total"),
            (prompt_tokens * kv_bytes_per_token / tp / pp) as f64,
            "{layout:?}: {metrics}"
        );
        assert_eq!(
            metric("infer_pd_kv_parts_sent_total"),
            chunks as f64,
            "{layout:?}: {metrics}"
        );
        let logs = server.rank_logs();
        let replica = (tp * pp) as usize;
        assert_eq!(logs.len(), 2 * replica, "{layout:?}");
        for (rank, log) in logs.iter().enumerate() {
            assert!(
                log.contains(&format!("rank {rank} on the host harness")),
                "rank {rank}:\n{log}"
            );
        }
        assert!(
            logs[2 * replica - 1].contains("decode replica, KV inbox on"),
            "{}",
            logs[2 * replica - 1]
        );
    }
}

/// `infer up --device cuda --dp 2`: two replicas, each one rank on its own GPU slot (0 and
/// 1, as their logs say), both behind rank 0's router; concurrent requests reach both, and
/// every answer is the CPU engine's completion.
#[test]
fn dp_2_device_replicas_serve_the_cpu_engines_completions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_tp2_model(dir.path());
    let (cpu, _) = generate(&model, &[], false);
    let run_dir = dir.path().join("run");
    let mut command = infer();
    command
        .env("INFER_CUDA_HOST_HARNESS", "1")
        .args([
            "up", "--port", "0", "--device", "cuda", "--dp", "2", "--model",
        ])
        .arg(&model)
        .arg("--run-dir")
        .arg(&run_dir);
    let server = Server::start_command(command);
    let body = json!({"prompt": "HELLO THERE", "max_tokens": 5, "temperature": 0});
    let bodies = vec![body; 4];
    for (status, reply) in server.post_all("/v1/completions", &bodies) {
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["text"], cpu["text"], "{reply}");
    }
    let metrics = server.metrics();
    assert_every_replica_routed(&metrics, 2);
    for rank in 0..2 {
        let log = rank_log(&run_dir, rank);
        assert!(
            log.contains(&format!("rank {rank} on the host harness"))
                && log.contains(&format!("CUDA_VISIBLE_DEVICES={rank}\n")),
            "rank {rank}:\n{log}"
        );
    }
}

/// `infer up --device cuda --tp 2 --ep 2` on a Mixtral-style MoE: each rank holds half the
/// experts (its log says which), runs its own on the tokens routed to them, and the TP
/// group sums the outputs; the completion is the one device process's, which holds them
/// all, and that gives the CPU engine's tokens. (Without the sum the completion differs.)
#[test]
fn ep_2_device_ranks_hold_half_the_experts_each_and_serve_the_whole_models_completion() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("moe.gguf");
    write_gguf_moe(&model, &Shape::tp2(), 4, 2, 13);
    let (one, _) = generate(&model, &["--device", "cuda"], true);
    let (cpu, _) = generate(&model, &[], false);
    assert_eq!(one["tokens"], cpu["tokens"], "one device process");
    let run_dir = dir.path().join("run");
    let mut command = infer();
    command
        .env("INFER_CUDA_HOST_HARNESS", "1")
        .args([
            "up", "--port", "0", "--device", "cuda", "--tp", "2", "--ep", "2",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--run-dir")
        .arg(&run_dir);
    let server = Server::start_command(command);
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "HELLO THERE", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], one["text"], "{reply}");
    for (rank, experts) in [(0, "experts 0-1 of 4"), (1, "experts 2-3 of 4")] {
        let log = rank_log(&run_dir, rank);
        assert!(
            log.contains(&format!("{experts} on this rank")),
            "rank {rank}:\n{log}"
        );
    }
}
