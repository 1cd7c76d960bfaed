//! `infer plan`: the published recipes, the formulas, placement on real topologies, the NCCL
//! env of multi-host plans, the GGUF and Hugging Face loaders, and bad input.

use std::path::Path;

use infer::model::MODEL_PROFILES;
use infer::plan::model::Dtype;
use infer::topology::{LinkCode, Nic, NicKind, Topology};
use serde_json::Value;

use crate::support::fixtures::shared_fixture;
use crate::support::process::{infer, run, stdout_ok, transcript_of};

/// Runs `infer plan --json` with `args`; returns the exit code and the JSON.
fn plan_json(args: &[&str]) -> (i32, Value) {
    let mut full = vec!["plan", "--json"];
    full.extend_from_slice(args);
    let output = run(&full);
    let code = output.status.code().expect("exited");
    assert!(
        code == 0 || code == 1,
        "exit {code}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (
        code,
        serde_json::from_slice(&output.stdout).expect("stdout is JSON"),
    )
}

fn degrees(plan: &Value) -> (u64, u64, u64, u64) {
    let p = &plan["parallel"];
    let get = |k: &str| p[k].as_u64().expect("degree");
    (get("tp"), get("pp"), get("dp"), get("ep"))
}

#[test]
fn smollm2_on_8_h100_is_eight_replicas() {
    let (code, plan) = plan_json(&[
        "--model",
        "smollm2-135m",
        "--cluster",
        "1x8xh100-sxm",
        "--dtype",
        "bf16",
    ]);
    assert_eq!(code, 0);
    assert_eq!(degrees(&plan), (1, 1, 8, 1));
    // TP 2/4/8 are invalid with 9 heads.
    for alternative in plan["alternatives"].as_array().expect("list") {
        let tp = alternative["parallel"]["tp"].as_u64().expect("tp");
        if [2, 4, 8].contains(&tp) {
            assert_eq!(alternative["feasible"], false);
            assert!(
                alternative["reason"]
                    .as_str()
                    .expect("reason")
                    .contains("9 attention heads"),
                "{alternative}"
            );
        }
    }
}

#[test]
fn llama70b_fp8_on_two_h100_needs_tp2() {
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-70b",
        "--dtype",
        "fp8",
        "--cluster",
        "1x2xh100-sxm",
    ]);
    assert_eq!(code, 0);
    assert_eq!(degrees(&plan), (2, 1, 1, 1));
    let tp1 = plan["alternatives"]
        .as_array()
        .expect("list")
        .iter()
        .find(|a| a["parallel"]["tp"] == 1 && a["parallel"]["pp"] == 1)
        .expect("TP1 × DP2 was considered");
    assert_eq!(tp1["feasible"], false);
    assert!(
        tp1["reason"]
            .as_str()
            .expect("reason")
            .contains("no room for KV cache"),
        "{tp1}"
    );
    assert!(
        plan["vllm_command"]
            .as_str()
            .expect("command")
            .contains("--tensor-parallel-size 2 --quantization fp8")
    );
}

#[test]
fn llama405b_on_two_nodes_is_tp8_pp2_for_latency() {
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-405b",
        "--cluster",
        "2x8xh100-sxm",
        "--objective",
        "latency",
    ]);
    assert_eq!(code, 0);
    assert_eq!(degrees(&plan), (8, 2, 1, 1));
    // TP groups stay inside a node; the PP group crosses them.
    let ranks = plan["ranks"].as_array().expect("ranks");
    for group in plan["groups"]["tp"].as_array().expect("tp groups") {
        let hosts: Vec<&str> = group
            .as_array()
            .expect("group")
            .iter()
            .map(|r| {
                ranks[r.as_u64().expect("rank") as usize]["host"]
                    .as_str()
                    .expect("host")
            })
            .collect();
        assert!(hosts.iter().all(|h| *h == hosts[0]), "{hosts:?}");
    }
    assert_eq!(plan["groups"]["pp"][0], serde_json::json!([0, 8]));
    let tp16 = plan["alternatives"]
        .as_array()
        .expect("list")
        .iter()
        .find(|a| a["parallel"]["tp"] == 16)
        .expect("TP16 considered");
    assert!(
        tp16["reason"]
            .as_str()
            .expect("reason")
            .contains("span hosts"),
        "{tp16}"
    );
    // A shorthand has no NICs: said once as a note, not as warnings nobody can act on.
    assert_eq!(plan["warnings"], serde_json::json!([]), "{plan}");
    let notes = plan["notes"].as_array().expect("notes");
    assert_eq!(notes.len(), 1, "{plan}");
    assert!(
        notes[0]
            .as_str()
            .is_some_and(|n| n.contains("`2x8xh100-sxm` names no NICs"))
    );
}

#[test]
fn deepseek_v3_on_one_node_is_infeasible_and_says_how_many_gpus() {
    let output = run(&[
        "plan",
        "--model",
        "deepseek-v3",
        "--cluster",
        "1x8xh100-sxm",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("needs at least"), "{text}");
    assert!(text.contains("2x8xh100-sxm"), "{text}");
    assert!(!text.contains("--dtype fp8"), "already fp8: {text}");
    let (code, json) = plan_json(&["--model", "deepseek-v3", "--cluster", "1x8xh100-sxm"]);
    assert_eq!(code, 1);
    let needed = json["min_gpus_needed"].as_u64().expect("count");
    assert!((9..=16).contains(&needed), "{needed}");
}

#[test]
fn qwen25_7b_is_replicated_and_tp8_is_refused() {
    let (code, plan) = plan_json(&["--model", "qwen2.5-7b", "--cluster", "1x8xh100-sxm"]);
    assert_eq!(code, 0);
    assert_eq!(degrees(&plan), (1, 1, 8, 1));
    let output = run(&[
        "plan",
        "--model",
        "qwen2.5-7b",
        "--cluster",
        "1x8xh100-sxm",
        "--tp",
        "8",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("tp=8 does not divide 28 attention heads"),
        "{text}"
    );
}

#[test]
fn parameter_counts_match_published_figures() {
    for (name, _) in MODEL_PROFILES {
        let (profile, spec) = infer::model::profile(name).expect("profile parses");
        let computed = spec.param_counts().total() as f64;
        let published = profile.published_params as f64;
        let error = (computed - published).abs() / published;
        assert!(
            error < 0.01,
            "{name}: computed {computed}, published {published} ({:.2}% off)",
            error * 100.0
        );
    }
    for (name, exact) in [
        ("llama-3.1-8b", 8_030_261_248u64),
        ("llama-3.1-70b", 70_553_706_496),
        ("smollm2-135m", 134_515_008),
    ] {
        assert_eq!(
            infer::model::profile(name)
                .expect("profile")
                .1
                .param_counts()
                .total(),
            exact,
            "{name}"
        );
    }
}

#[test]
fn kv_bytes_per_token() {
    let llama = infer::model::profile("llama-3.1-8b").expect("profile").1;
    assert_eq!(llama.kv_bytes_per_token(32, 1, Dtype::Bf16), 131_072);
    // KV heads split over TP, replicated past 8.
    assert_eq!(llama.kv_bytes_per_token(32, 2, Dtype::Bf16), 65_536);
    assert_eq!(llama.kv_bytes_per_token(32, 16, Dtype::Bf16), 16_384);
    assert_eq!(llama.kv_bytes_per_token(32, 1, Dtype::Fp8), 65_536);
    let deepseek = infer::model::profile("deepseek-v3").expect("profile").1;
    assert_eq!(deepseek.kv_bytes_per_token(61, 1, Dtype::Bf16), 70_272);
    // MLA's latent is not divided by TP.
    assert_eq!(deepseek.kv_bytes_per_token(61, 8, Dtype::Bf16), 70_272);
}

fn write_inventory(dir: &Path, hosts: &[(&str, &str, usize, &str, Option<&Path>)]) -> String {
    let mut text = String::new();
    for (name, address, gpus, hardware, topology) in hosts {
        text.push_str(&format!("[[hosts]]\nname = \"{name}\"\naddress = \"{address}\"\ngpus = {gpus}\nhardware = \"{hardware}\"\n"));
        if let Some(topology) = topology {
            text.push_str(&format!("topology = \"{}\"\n", topology.display()));
        }
        text.push('\n');
    }
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).expect("write inventory");
    path.to_str().expect("UTF-8").to_string()
}

#[test]
fn dgx1_tp_groups_follow_the_nvlink_quads() {
    let dir = tempfile::tempdir().expect("temp dir");
    let topology = shared_fixture("topo/v100_dgx1_nv1nv2_mlx5x4_pytorch_ddp_benchmark_readme.txt");
    let inventory = write_inventory(
        dir.path(),
        &[("dgx1", "127.0.0.1", 8, "a100-sxm-80g", Some(&topology))],
    );
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-70b",
        "--cluster",
        &inventory,
        "--objective",
        "latency",
    ]);
    assert_eq!(code, 0);
    // TP8 would put SYS pairs in a TP group: refused, so TP4 inside each quad.
    assert_eq!(degrees(&plan).0, 4);
    let gpus = |group: &Value| -> Vec<u64> {
        let ranks = plan["ranks"].as_array().expect("ranks");
        let mut gpus: Vec<u64> = group
            .as_array()
            .expect("group")
            .iter()
            .map(|r| {
                ranks[r.as_u64().expect("rank") as usize]["gpu"]
                    .as_u64()
                    .expect("gpu")
            })
            .collect();
        gpus.sort();
        gpus
    };
    let groups = plan["groups"]["tp"].as_array().expect("groups");
    assert_eq!(gpus(&groups[0]), [0, 1, 2, 3]);
    assert_eq!(gpus(&groups[1]), [4, 5, 6, 7]);
    let tp8 = plan["alternatives"]
        .as_array()
        .expect("list")
        .iter()
        .find(|a| a["parallel"]["tp"] == 8)
        .expect("TP8 considered");
    assert!(
        tp8["reason"].as_str().expect("reason").contains("SYS"),
        "{tp8}"
    );
    // Pinned, TP8 is allowed with a warning.
    let (code, pinned) = plan_json(&[
        "--model",
        "llama-3.1-70b",
        "--cluster",
        &inventory,
        "--tp",
        "8",
    ]);
    assert_eq!(code, 0);
    let warnings = pinned["warnings"].to_string();
    assert!(warnings.contains("SYS"), "{warnings}");
}

#[test]
fn tp_pairs_follow_nvlink_bridges_not_gpu_numbers() {
    // Two NVLink bridges joining GPU0–GPU2 and GPU1–GPU3: TP2 must pair them that way.
    let dir = tempfile::tempdir().expect("temp dir");
    let topology = dir.path().join("bridged.txt");
    std::fs::write(&topology, "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tPHB\tNV4\tPHB\nGPU1\tPHB\t X \tPHB\tNV4\nGPU2\tNV4\tPHB\t X \tPHB\nGPU3\tPHB\tNV4\tPHB\t X \n")
        .expect("write");
    let inventory = write_inventory(
        dir.path(),
        &[("ws", "127.0.0.1", 4, "a100-pcie-80g", Some(&topology))],
    );
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-8b",
        "--cluster",
        &inventory,
        "--tp",
        "2",
    ]);
    assert_eq!(code, 0);
    let ranks = plan["ranks"].as_array().expect("ranks");
    let gpu = |rank: usize| ranks[rank]["gpu"].as_u64().expect("gpu");
    let mut first = [gpu(0), gpu(1)];
    first.sort();
    assert_eq!(first, [0, 2]);
    assert_eq!(ranks[0]["tp_rank"], 0);
    assert_eq!(ranks[1]["cuda_visible_devices"], gpu(1).to_string());
    assert_eq!(ranks[1]["tp_rank"], 1);
}

#[test]
fn l40s_tp4_crosses_sockets_and_is_refused_unless_pinned() {
    let dir = tempfile::tempdir().expect("temp dir");
    let topology = shared_fixture("topo/l40s_x4_node_sys_mlx5x2_missalignment_106.txt");
    let inventory = write_inventory(
        dir.path(),
        &[("l40s", "127.0.0.1", 4, "l40s", Some(&topology))],
    );
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-70b",
        "--dtype",
        "fp8",
        "--cluster",
        &inventory,
        "--max-model-len",
        "8192",
    ]);
    let tp4 = plan["alternatives"]
        .as_array()
        .expect("list")
        .iter()
        .find(|a| a["parallel"]["tp"] == 4)
        .expect("TP4 considered");
    assert!(
        tp4["reason"].as_str().expect("reason").contains("SYS"),
        "{tp4}"
    );
    if code == 0 {
        assert_ne!(degrees(&plan).0, 4);
    }
}

#[test]
fn multi_host_env_names_interfaces_and_hcas() {
    let dir = tempfile::tempdir().expect("temp dir");
    let h20 = shared_fixture("topo/h20_sxm8_nv18_mlx5x8_sglang_9696.txt");
    let mut topology =
        Topology::import(&std::fs::read_to_string(h20).expect("fixture"), "h20").expect("import");
    let host = &mut topology.hosts[0];
    for (i, nic) in host.nics.iter_mut().enumerate() {
        nic.kind = NicKind::Ib;
        nic.state = Some(if i == 7 { "DOWN" } else { "ACTIVE" }.to_string());
    }
    let ethernet = |name: &str, address: &str, is_virtual: bool| Nic {
        name: name.to_string(),
        kind: NicKind::Eth,
        state: Some("up".to_string()),
        rate_gbps: Some(100.0),
        netdev: Some(name.to_string()),
        is_virtual,
        mtu_bytes: Some(9000),
        mac: None,
        addresses: vec![address.to_string()],
        pci_bus_id: None,
        numa_node: None,
        ports: Vec::new(),
        gpu_links: vec![LinkCode::Sys; 8],
    };
    host.nics.push(ethernet("docker0", "172.17.0.1", true));
    host.nics.push(ethernet("bond0", "10.1.0.7", false));
    let path = dir.path().join("h20.json");
    std::fs::write(&path, serde_json::to_string(&topology).expect("JSON")).expect("write");
    let inventory = write_inventory(
        dir.path(),
        &[
            ("a", "10.1.0.7", 8, "h100-sxm", Some(&path)),
            ("b", "10.1.0.8", 8, "h100-sxm", Some(&path)),
        ],
    );
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-405b",
        "--cluster",
        &inventory,
        "--objective",
        "latency",
    ]);
    assert_eq!(code, 0);
    let env = &plan["env"]["a"];
    assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
    assert_eq!(env["NCCL_SOCKET_IFNAME"], "=bond0");
    // Each GPU's PIX rail, exact-matched; the DOWN port's HCA is left out.
    assert_eq!(
        env["NCCL_IB_HCA"],
        "=mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7"
    );
}

#[test]
fn single_host_plans_need_no_network_env() {
    let (_, plan) = plan_json(&["--model", "llama-3.1-8b", "--cluster", "1x8xh100-sxm"]);
    let env = plan["env"]["node0"].as_object().expect("env");
    assert_eq!(env.len(), 1);
    assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
}

#[test]
fn plan_json_has_the_contract_fields() {
    let (_, plan) = plan_json(&[
        "--model",
        "mixtral-8x7b",
        "--cluster",
        "1x8xh100-sxm",
        "--tp",
        "2",
        "--ep",
        "8",
    ]);
    assert_eq!(plan["world_size"], 8);
    for field in [
        "rank",
        "host",
        "gpu",
        "local_rank",
        "tp_rank",
        "pp_rank",
        "dp_rank",
        "ep_rank",
    ] {
        assert!(plan["ranks"][3].get(field).is_some(), "ranks[].{field}");
    }
    for field in [
        "weights_bytes",
        "kv_cache_bytes",
        "reserve_bytes",
        "kv_tokens",
    ] {
        assert!(
            plan["memory"][0][field].as_u64().is_some(),
            "memory[].{field}"
        );
    }
    for field in ["tp", "pp", "dp", "ep"] {
        assert!(plan["groups"][field].is_array(), "groups.{field}");
    }
    // EP8 = TP2 × DP4: one EP group of every rank of the stage.
    assert_eq!(
        plan["groups"]["ep"],
        serde_json::json!([[0, 1, 2, 3, 4, 5, 6, 7]])
    );
    assert_eq!(plan["groups"]["tp"][1], serde_json::json!([2, 3]));
    assert!(plan["explain"].as_array().expect("explain").len() >= 3);
    assert!(
        plan["vllm_command"]
            .as_str()
            .expect("cmd")
            .contains("--enable-expert-parallel")
    );
}

#[test]
fn plan_text_for_405b_on_two_nodes() {
    let stdout = stdout_ok(&run(&[
        "plan",
        "--model",
        "llama-3.1-405b",
        "--cluster",
        "2x8xh100-sxm",
        "--objective",
        "latency",
    ]));
    insta::assert_snapshot!(stdout);
}

#[test]
fn hugging_face_directory_with_safetensors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16"
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let data = vec![0u8; 256 * 64 * 2];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![256, 64], &data)
        .expect("view");
    let bytes =
        safetensors::serialize([("model.embed_tokens.weight", view)], None).expect("serialize");
    std::fs::write(dir.path().join("model.safetensors"), bytes).expect("write");
    let (code, plan) = plan_json(&[
        "--model",
        dir.path().to_str().expect("UTF-8"),
        "--cluster",
        "1x2xl4",
    ]);
    assert_eq!(code, 0);
    // The exact bytes of the file's tensors (one 256×64 bf16 matrix), not the formula's.
    assert_eq!(plan["weights_bytes"], 256 * 64 * 2);
    assert!(
        plan["vllm_command"]
            .as_str()
            .expect("cmd")
            .starts_with(&format!("vllm serve {}", dir.path().display()))
    );
}

#[test]
fn gguf_file_is_planned_from_its_header() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, tiny_gguf()).expect("write");
    let (code, plan) = plan_json(&[
        "--model",
        path.to_str().expect("UTF-8"),
        "--cluster",
        "1x1xl4",
    ]);
    assert_eq!(code, 0);
    assert_eq!(plan["model"], "tiny");
    assert_eq!(plan["dtype"], "gguf");
    // token_embd Q4_1 32×64 = 64 blocks × 20 bytes, output_norm F32 32 × 4 bytes.
    assert_eq!(plan["weights_bytes"], 64 * 20 + 32 * 4);
}

/// A GGUF v3 header for a 1-layer, 32-wide llama with two tensors.
fn tiny_gguf() -> Vec<u8> {
    use infer::runtime::formats::gguf::{TensorInfo, Value, encode_header};
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny".into())),
        ("llama.embedding_length", Value::U32(32)),
        ("llama.feed_forward_length", Value::U32(64)),
        ("llama.block_count", Value::U32(1)),
        ("llama.attention.head_count", Value::U32(4)),
        ("llama.attention.head_count_kv", Value::U32(2)),
        ("llama.context_length", Value::U32(256)),
        ("llama.vocab_size", Value::U32(64)),
    ];
    let tensor = |name: &str, dims: &[u64], type_id| TensorInfo {
        name: name.into(),
        dims: dims.to_vec(),
        type_id,
        offset_bytes: 0,
    };
    encode_header(
        &metadata,
        &[
            tensor("token_embd.weight", &[32, 64], 3),
            tensor("output_norm.weight", &[32], 0),
        ],
    )
}

#[test]
fn bad_plan_input_exits_2_with_a_clear_error() {
    // Every error's whole text, in the snapshot: what is wrong, with the choices or the fix.
    let mut transcript = String::new();
    let cases: [&[&str]; 5] = [
        &["plan", "--model", "llama-9000", "--cluster", "1x8xh100-sxm"],
        &["plan", "--model", "llama-3.1-8b", "--cluster", "2x8xh900"],
        &[
            "plan",
            "--model",
            "llama-3.1-8b",
            "--cluster",
            "1x8xh100-sxm",
            "--gpu-memory-utilization",
            "1.5",
        ],
        &[
            "plan",
            "--model",
            "llama-3.1-8b",
            "--cluster",
            "1x8xh100-sxm",
            "--dtype",
            "fp4x",
        ],
        &["plan", "--model", "llama-3.1-8b", "--cluster", "banana"],
    ];
    for args in cases {
        let output = run(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty());
        transcript.push_str(&transcript_of(args, &output, &[]));
        transcript.push('\n');
    }
    // A bad cluster fails before the default model is fetched into an empty cache.
    let cache = tempfile::tempdir().expect("tempdir");
    let args = ["plan", "--cluster", "nothere.toml"];
    let output = infer()
        .env("INFER_CACHE_DIR", cache.path())
        .args(args)
        .output()
        .expect("run infer");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(
        std::fs::read_dir(cache.path()).expect("cache").count(),
        0,
        "{stderr}"
    );
    transcript.push_str(&transcript_of(&args, &output, &[]));
    transcript.push('\n');

    // Inventories: a host listed twice, a host with `gpus = 0` — bad input naming the line
    // (each `[[hosts]]` block is 5 lines and a blank one).
    let dir = tempfile::tempdir().expect("tempdir");
    let dir_text = dir.path().to_str().expect("UTF-8");
    let twice = write_inventory(
        dir.path(),
        &[
            ("node-a", "10.0.0.1", 8, "h100-sxm", None),
            ("node-a", "10.0.0.2", 8, "h100-sxm", None),
        ],
    );
    let args = ["plan", "--model", "llama-3.1-8b", "--cluster", &twice];
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    transcript.push_str(&transcript_of(&args, &output, &[(dir_text, "[DIR]")]));
    transcript.push('\n');
    let zero = write_inventory(
        dir.path(),
        &[
            ("node-a", "10.0.0.1", 8, "h100-sxm", None),
            ("node-b", "10.0.0.2", 0, "h100-sxm", None),
        ],
    );
    let args = ["plan", "--model", "llama-3.1-8b", "--cluster", &zero];
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    transcript.push_str(&transcript_of(&args, &output, &[(dir_text, "[DIR]")]));
    insta::assert_snapshot!(transcript);
}

/// `MemTotal` of this host's `/proc/meminfo`, bytes.
fn mem_total_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("MemTotal in kB");
    kib * 1024
}

/// The alternative (or the chosen layout) of `plan` with `tp × pp × dp`: its TPOT at batch 1.
fn tpot_of(plan: &Value, (tp, pp, dp): (u64, u64, u64)) -> Option<f64> {
    let same = |p: &Value| p["tp"] == tp && p["pp"] == pp && p["dp"] == dp;
    if same(&plan["parallel"]) {
        return plan["estimate"]["tpot_secs"].as_f64();
    }
    plan["alternatives"]
        .as_array()
        .expect("alternatives")
        .iter()
        .find(|a| same(&a["parallel"]))
        .and_then(|a| a["tpot_secs"].as_f64())
}

/// `--cluster local` on a host without GPUs plans for its CPU: one device whose ranks share
/// it, one to a rank per core, each rank with its share of the host's memory and bandwidth;
/// `--explain` says what was probed; vLLM's lines are refused for it. See: #40
#[test]
fn local_cluster_without_gpus_plans_its_cpu_ranks() {
    if Path::new("/proc/driver/nvidia/version").exists() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let (code, plan) = plan_json(&["--cluster", "local"]);
    assert_eq!(code, 0, "{plan}");
    assert_eq!(plan["device"], "cpu");
    // vLLM does not run CPU ranks: no `vllm serve` line in the JSON or the text.
    assert!(plan.get("vllm_command").is_none(), "{plan}");
    let world = plan["world_size"].as_u64().expect("world");
    assert!(
        (1..=cores).contains(&world),
        "{world} ranks on {cores} cores"
    );
    let ranks = plan["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len() as u64, world);
    let host = ranks[0]["host"].as_str().expect("host");
    for rank in ranks {
        assert_eq!(rank["host"], host);
        assert_eq!(rank["cuda_visible_devices"], "");
    }
    assert_eq!(plan["env"][host], serde_json::json!({}));
    // Each rank holds its share of the host's memory.
    let per_rank = plan["memory"][0]["gpu_memory_bytes"]
        .as_u64()
        .expect("bytes");
    assert!(per_rank * world <= mem_total_bytes() && mem_total_bytes() - per_rank * world < world);
    // The rank counts searched: 1 to one per core, never more.
    for alternative in plan["alternatives"].as_array().expect("alternatives") {
        let p = &alternative["parallel"];
        let n = ["tp", "pp", "dp"]
            .iter()
            .map(|k| p[k].as_u64().expect("degree"))
            .product::<u64>();
        assert!(n <= cores, "{alternative}");
    }
    if cores >= 2 {
        // Two replicas split the host: each reads its weights and computes at least at half
        // the host's rates (more where a thread alone beats half a team of all cores; TP 1:
        // no collective), so a step takes at most twice as long; and no replica is faster
        // than the whole host, except in attention, where one sequence left threads idle
        // (SmolLM2's 3 KV heads on 2 threads: 3/4 busy), which the second replica puts to work.
        let one = tpot_of(&plan, (1, 1, 1)).expect("DP 1 considered");
        let two = tpot_of(&plan, (1, 1, 2)).expect("DP 2 considered");
        assert!(
            two >= 0.75 * one && two <= 2.0 * one * (1.0 + 1e-9),
            "{two} vs {one}"
        );
    }
    let text = stdout_ok(&run(&["plan", "--cluster", "local", "--explain"]));
    assert!(
        text.contains("each host's CPU is one device its ranks share")
            && text.contains("probed on this host")
            && text.contains("its engine's decode step reading weights at")
            && text.contains("its prompts' products at")
            && (text.contains("its attention over the KV cache at")
                || text.contains("its attention not measured (the host was too busy)"))
            && (text.contains("a prompt's attention at")
                || text.contains("a prompt's attention not measured (the host was too busy)"))
            && text.contains("memory per rank")
            && text.contains("infer up --tp")
            && !text.contains("vllm serve")
            && !text.contains("vllm equivalent"),
        "{text}"
    );
    let output = run(&["plan", "--cluster", "local", "--engine", "vllm"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("runs CPU ranks"), "{stderr}");
    // The doctor does not ask this host for GPUs the plan does not use.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("plan.json");
    std::fs::write(&file, plan.to_string()).expect("write");
    let output = run(&["doctor", "--plan", file.to_str().expect("UTF-8"), "--json"]);
    let report: Value = serde_json::from_slice(&output.stdout).expect("doctor JSON");
    let nvml: Vec<&Value> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["check"] == "nvml")
        .collect();
    assert!(
        !nvml.is_empty() && nvml.iter().all(|f| f["severity"] == "ok"),
        "{report}"
    );
}

/// An inventory of `cpu-ranks` hosts is planned on this host's probed CPU (and says so):
/// ranks spread evenly over the hosts, at most `cpu-ranks` on each; GPU and CPU-rank hosts do
/// not mix. See: #40
#[test]
fn cpu_rank_inventories_are_planned_on_the_probed_cpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hosts.toml");
    std::fs::write(
        &path,
        "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1\"\ncpu-ranks = 2\n\n\
         [[hosts]]\nname = \"b\"\naddress = \"10.0.0.2\"\ncpu-ranks = 2\n",
    )
    .expect("write");
    let inventory = path.to_str().expect("UTF-8");
    let (code, plan) = plan_json(&["--cluster", inventory, "--dp", "4"]);
    assert_eq!(code, 0, "{plan}");
    assert_eq!(plan["device"], "cpu");
    assert!(plan.get("vllm_command").is_none(), "{plan}");
    let text = stdout_ok(&run(&["plan", "--cluster", inventory, "--dp", "4"]));
    assert!(
        text.contains("infer up --tp") && !text.contains("vllm"),
        "{text}"
    );
    let hosts: Vec<&str> = plan["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["host"].as_str().expect("host"))
        .collect();
    assert_eq!(hosts, ["a", "a", "b", "b"]);
    assert!(
        plan["explain"]
            .as_array()
            .expect("explain")
            .iter()
            .any(|l| l.as_str().is_some_and(
                |l| l.contains("this host's CPU") && l.contains("does not say its hosts' own")
            )),
        "{}",
        plan["explain"]
    );
    let (code, refused) = plan_json(&["--cluster", inventory, "--dp", "6"]);
    assert_eq!(code, 1);
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("the hosts take at most 2")),
        "{refused}"
    );
    std::fs::write(
        &path,
        "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1\"\ncpu-ranks = 2\n\n\
         [[hosts]]\nname = \"b\"\naddress = \"10.0.0.2\"\ngpus = 8\nhardware = \"h100-sxm\"\n",
    )
    .expect("write");
    let output = run(&["plan", "--cluster", inventory]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("separate inventories"), "{stderr}");
}

/// Llama-3.1-70B in fp8 on two L40S: the weights fit (67.7 GiB of 81 GiB usable) but not
/// the KV cache for its 131072-token context. The plan uses the longest context that fits,
/// a multiple of the 16-token KV block, and says so; an explicit `--max-model-len` is
/// honoured when it fits and refused when it does not.
#[test]
fn context_that_fits_instead_of_a_refusal() {
    let args = [
        "--model",
        "llama-3.1-70b",
        "--dtype",
        "fp8",
        "--cluster",
        "1x2xl40s",
    ];
    let (code, plan) = plan_json(&args);
    assert_eq!(code, 0, "{plan}");
    let len = plan["max_model_len"].as_u64().expect("max_model_len");
    assert!((8192..131072).contains(&len), "{len}");
    assert_eq!(len % 16, 0);
    // Every stage's KV cache holds it; one more block would not fit on the smallest.
    let smallest = plan["memory"]
        .as_array()
        .expect("memory")
        .iter()
        .map(|s| s["kv_tokens"].as_u64().expect("kv_tokens"))
        .min()
        .expect("stages");
    assert!(
        smallest >= len && smallest < len + 16,
        "{smallest} vs {len}"
    );
    let warning = plan["warnings"][0].as_str().expect("warning");
    assert!(
        warning.contains(&format!("planned with --max-model-len {len}"))
            && warning.contains("131072"),
        "{warning}"
    );
    assert!(
        plan["vllm_command"]
            .as_str()
            .is_some_and(|c| c.contains(&format!("--max-model-len {len}"))),
        "{plan}"
    );
    // The reasons describe this one node: no stage crosses a network.
    let explain = plan["explain"].to_string();
    assert!(!explain.contains("across nodes"), "{explain}");
    assert!(explain.contains("TP × PP inside the node"), "{explain}");
    let explicit = len.to_string();
    let (code, pinned) = plan_json(&[&args[..], &["--max-model-len", &explicit]].concat());
    assert_eq!(code, 0);
    assert_eq!(pinned["max_model_len"], len);
    let (code, refused) = plan_json(&[&args[..], &["--max-model-len", "131072"]].concat());
    assert_eq!(code, 1, "{refused}");
    // Weights that do not fit are still refused.
    let (code, _) = plan_json(&["--model", "llama-3.1-405b", "--cluster", "1x2xl40s"]);
    assert_eq!(code, 1);
}

/// Qwen3-235B-A22B fp8 for latency on two HGX H100 nodes given as a shorthand (no RDMA
/// known): cross-host collectives cost what TCP sockets cost (12.5 GB/s, 50 µs per call,
/// 2 all-to-alls per MoE layer), so no TP or EP group of the chosen plan crosses hosts, and
/// the plan says why. The same EP16 layout on hosts whose HCAs are known (the inventory of
/// `examples/`) costs less: the network is RDMA there.
#[test]
fn cross_host_collectives_cost_tcp_without_rdma() {
    let args = [
        "--model",
        "qwen3-235b-a22b",
        "--dtype",
        "fp8",
        "--objective",
        "latency",
    ];
    let (code, tcp) = plan_json(&[&args[..], &["--cluster", "2x8xh100-sxm"]].concat());
    assert_eq!(code, 0, "{tcp}");
    let ranks = tcp["ranks"].as_array().expect("ranks");
    for kind in ["tp", "ep"] {
        for group in tcp["groups"][kind].as_array().expect("groups") {
            let hosts: Vec<&str> = group
                .as_array()
                .expect("group")
                .iter()
                .map(|r| {
                    ranks[r.as_u64().expect("rank") as usize]["host"]
                        .as_str()
                        .expect("host")
                })
                .collect();
            assert!(
                hosts.iter().all(|h| *h == hosts[0]),
                "{kind} group {hosts:?}"
            );
        }
    }
    assert!(
        tcp["notes"][0]
            .as_str()
            .is_some_and(|n| n.contains("TCP sockets (no RDMA known")),
        "{tcp}"
    );
    let ep16_tpot = |plan: &serde_json::Value| -> f64 {
        plan["alternatives"]
            .as_array()
            .expect("alternatives")
            .iter()
            .find(|a| a["parallel"]["ep"] == 16 && a["parallel"]["tp"] == 1)
            .and_then(|a| a["tpot_secs"].as_f64())
            .expect("an EP16 alternative")
    };
    let inventory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cluster.toml");
    let (code, rdma) = plan_json(
        &[
            &args[..],
            &["--cluster", inventory.to_str().expect("utf-8")],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{rdma}");
    assert!(
        ep16_tpot(&tcp) > 1.3 * ep16_tpot(&rdma),
        "TCP {} vs RDMA {}",
        ep16_tpot(&tcp),
        ep16_tpot(&rdma)
    );
}

/// Every number of the Pareto table for one case, recomputed here from the cost model's
/// formulas (`plan::sla`, `plan::cost`) with the arithmetic written out: Llama-3.1-8B bf16
/// on one H100 SXM (no TP/PP/EP: no collectives), 1000 prompt and 200 output tokens.
#[test]
fn pareto_numbers_follow_the_formulas_by_hand() {
    let (code, plan) = plan_json(&[
        "--model",
        "llama-3.1-8b",
        "--cluster",
        "1x1xh100-sxm",
        "--isl",
        "1000",
        "--osl",
        "200",
    ]);
    assert_eq!(code, 0);
    // The model (profiles/models/llama-3.1-8b.toml, its config.json): 32 layers of 32 heads
    // of 128; the planner's own parameter count and memory split are inputs.
    let (layers, heads, head_dim) = (32.0, 32.0, 128.0);
    let active = plan["active_params"].as_f64().expect("active_params");
    let held = plan["memory"][0]["weights_bytes"]
        .as_f64()
        .expect("weights");
    // A step reads every weight but the untied embedding table, whose rows it only looks
    // up: 128256 tokens × 4096 in bf16.
    let weights = plan["memory"][0]["read_per_step_bytes"]
        .as_f64()
        .expect("read per step");
    assert!(
        (held - weights - 128_256.0 * 4096.0 * 2.0).abs() <= 1.0,
        "{held} {weights}"
    );
    let kv_tokens = plan["memory"][0]["kv_tokens"].as_u64().expect("kv_tokens");
    let kv_per_token = plan["memory"][0]["kv_bytes_per_token"]
        .as_f64()
        .expect("kv/token");
    // H100 SXM (profiles/hardware/h100-sxm.toml): 3350 GB/s HBM, 989 dense bf16 TFLOPS.
    let (hbm, flops) = (3350e9, 989e12);
    let (isl, osl) = (1000.0, 200.0);
    let context = isl + 100.0; // isl + osl/2: the average context while decoding
    // One 1000-token prefill: the layers' projections 2·(active − embedding − head)·isl
    // (the untied 128256 × 4096 embedding and LM head), the last token's logits
    // 2·vocab·hidden, causal attention 2·isl²·heads·dim per layer; against reading the
    // weights once.
    let table = 128_256.0 * 4096.0;
    let prefill = ((2.0 * (active - 2.0 * table) * isl
        + 2.0 * table
        + 2.0 * isl * isl * heads * head_dim * layers)
        / flops)
        .max(weights / hbm);
    // 8B at ~15 GB: the prompt is compute-bound, ~14.2 TFLOP / 989 TFLOPS ≈ 14 ms.
    assert!((0.013..0.016).contains(&prefill), "{prefill}");
    let capacity = kv_tokens / 1200; // requests of isl + osl tokens the KV cache holds
    let rows = plan["pareto"].as_array().expect("pareto");
    assert!(rows.len() >= 5, "{rows:?}");
    for row in rows {
        let b = row["batch_per_replica"].as_f64().expect("batch");
        // A decode step: weights plus b·context KV bytes from HBM, or 2·active·b plus
        // 4·b·context·heads·dim·layers of attention, whichever takes longer.
        let step = ((weights + b * context * kv_per_token) / hbm)
            .max((2.0 * active * b + 4.0 * b * context * heads * head_dim * layers) / flops);
        let cycle = osl * step + b * prefill; // osl steps, and b prompts turned over
        // A request's osl steps are stalled by the b − 1 other slots' prefills, not by its
        // own (that one is in its TTFT).
        let tpot = (osl * step + (b - 1.0) * prefill) / osl;

        let ttft = prefill + step;
        let per_gpu = b * osl / cycle; // one GPU per replica
        let close = |field: &str, want: f64| {
            let got = row[field].as_f64().expect(field);
            assert!(
                (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                "batch {b}: {field} is {got}, the formula gives {want}"
            );
        };
        close("tpot_secs", tpot);
        close("ttft_secs", ttft);
        close("tokens_per_sec_per_user", 1.0 / tpot);
        close("tokens_per_sec_per_gpu", per_gpu);
        assert_eq!(row["kv_capacity_seqs"], capacity);
        assert_eq!(row["meets_sla"], true, "no targets: every point meets them");
    }
    // Along the frontier, more tokens/s per GPU costs tokens/s per user.
    for pair in rows.windows(2) {
        assert!(
            pair[0]["tokens_per_sec_per_gpu"].as_f64() > pair[1]["tokens_per_sec_per_gpu"].as_f64()
        );
        assert!(
            pair[0]["tokens_per_sec_per_user"].as_f64()
                < pair[1]["tokens_per_sec_per_user"].as_f64()
        );
    }
}

#[test]
fn latency_targets_choose_the_best_point_that_meets_them_or_say_how_close_it_gets() {
    let args = [
        "--model",
        "deepseek-v3",
        "--cluster",
        "2x8xh100-sxm",
        "--isl",
        "2048",
        "--osl",
        "512",
    ];
    let with = |extra: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(extra);
        plan_json(&all)
    };
    let (code, plan) = with(&["--tpot-ms", "50"]);
    assert_eq!(code, 0);
    let choice = &plan["sla_choice"];
    assert!(
        choice["tpot_secs"].as_f64().expect("tpot") <= 0.050,
        "{choice}"
    );
    assert_eq!(choice["meets_sla"], true);
    // The plan's layout is the chosen point's, and no point that meets the target does more
    // per GPU.
    assert_eq!(choice["parallel"], plan["parallel"]);
    let best = choice["tokens_per_sec_per_gpu"].as_f64().expect("per gpu");
    for row in plan["pareto"].as_array().expect("pareto") {
        if row["meets_sla"] == true {
            assert!(row["tokens_per_sec_per_gpu"].as_f64().expect("per gpu") <= best + 1e-9);
        } else {
            assert!(row["tpot_secs"].as_f64().expect("tpot") > 0.050, "{row}");
        }
    }
    // 627 GiB of weights do not "fit one GPU": the experts are sharded over EP16.
    let explain: Vec<&str> = plan["explain"]
        .as_array()
        .expect("explain")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        !explain.iter().any(|l| l.starts_with("fits one GPU")),
        "{explain:#?}"
    );
    assert!(
        explain
            .iter()
            .any(|l| l.contains("experts are sharded over EP16")),
        "{explain:#?}"
    );
    // A TTFT target tighter than any prefill: "no", with the closest figures.
    let (code, answer) = with(&["--ttft-ms", "1"]);
    assert_eq!(code, 1, "{answer}");
    let message = answer["message"].as_str().expect("message");
    assert!(
        message.contains("no layout serves 2048 prompt and 512 output tokens"),
        "{message}"
    );
    assert!(message.contains("the lowest TTFT"), "{message}");
    // Bad targets are bad input.
    let output = run(&["plan", "--model", "llama-3.1-8b", "--tpot-ms", "-5"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn disaggregated_prefill_share_grows_with_prompts_and_shrinks_with_outputs() {
    let split = |isl: &str, osl: &str| -> f64 {
        let (code, plan) = plan_json(&[
            "--model",
            "llama-3.1-8b",
            "--cluster",
            "4x8xh100-sxm",
            "--isl",
            isl,
            "--osl",
            osl,
            "--disaggregate",
        ]);
        assert_eq!(code, 0);
        let d = &plan["disaggregated"];
        let (x, y) = (
            d["prefill_workers"].as_u64().expect("x"),
            d["decode_workers"].as_u64().expect("y"),
        );
        let gpus = |p: &Value| p["tp"].as_u64().expect("tp") * p["pp"].as_u64().expect("pp");
        let used = x * gpus(&d["prefill"]) + y * gpus(&d["decode"]);
        assert_eq!(d["gpus"], used, "{d}");
        assert!(used <= 32, "{d}");
        // The comparison with aggregated serving is among the reasons, with both figures.
        assert!(
            plan["explain"]
                .as_array()
                .expect("explain")
                .iter()
                .any(
                    |l| l.as_str().is_some_and(|l| l.starts_with("disaggregated: ")
                        && l.contains("against aggregated serving's"))
                ),
            "{plan:#}"
        );
        d["prefill_to_decode_gpus"].as_f64().expect("ratio")
    };
    let short = split("500", "500");
    let medium = split("2000", "500");
    let long = split("8000", "500");
    assert!(short < medium && medium < long, "{short} {medium} {long}");
    let chatty = split("2000", "2000");
    assert!(chatty < medium, "{chatty} {medium}");
}

/// nccl-tests' `all_reduce_perf` output as users paste it (out-of-place and in-place
/// columns), ranks on `hosts`.
fn nccl_tests_table(hosts: [&str; 2], small_us: f64, peak_busbw: f64) -> String {
    format!(
        "\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41211 on {a:>8} device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  52001 on {b:>8} device  0 [0x18] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1 {small_us:>8.2}    0.00    0.00      0 {small_us:>8.2}    0.00    0.00      0
   134217728      33554432     float     sum      -1   9999.0   13.42 {peak_busbw:>7.2}      0   9999.0   13.42 {peak_busbw:>7.2}      0
# Out of bounds values : 0 OK
",
        a = hosts[0],
        b = hosts[1]
    )
}

#[test]
fn calibration_tables_replace_the_datasheet_links_and_the_plan_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let network = dir.path().join("two-hosts.txt");
    std::fs::write(
        &network,
        nccl_tests_table(["node-a", "node-b"], 31.5, 35.31),
    )
    .expect("write");
    let slow_node = dir.path().join("one-host.txt");
    std::fs::write(
        &slow_node,
        nccl_tests_table(["node-a", "node-a"], 120.0, 10.0),
    )
    .expect("write");
    let base = [
        "--model",
        "llama-3.1-405b",
        "--cluster",
        "2x8xh100-sxm",
        "--tp",
        "8",
        "--pp",
        "2",
    ];
    let tpot = |calibration: &[&std::path::Path]| -> (f64, Vec<String>) {
        let mut extra: Vec<String> = Vec::new();
        for path in calibration {
            extra.push("--calibration".into());
            extra.push(path.display().to_string());
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        tpot_and_reasons(&base, &extra)
    };
    let (datasheet, _) = tpot(&[]);
    // 35 GB/s RDMA between the hosts instead of TCP's 12.5 GB/s: the PP hop is cheaper.
    let (rdma, explain) = tpot(&[&network]);
    assert!(rdma < datasheet, "{rdma} vs {datasheet}");
    assert!(
        explain.iter().any(
            |l| l.contains("links between hosts cost 35.3 GB/s and 32 µs")
                && l.contains("`two-hosts.txt`, 2 ranks on 2 hosts")
        ),
        "{explain:#?}"
    );
    // A slow link inside the host (10 GB/s, 120 µs instead of NVLink): TP costs more.
    let (slow, explain) = tpot(&[&network, &slow_node]);
    assert!(slow > rdma, "{slow} vs {rdma}");
    assert!(
        explain
            .iter()
            .any(|l| l.contains("links inside a host cost 10.0 GB/s")),
        "{explain:#?}"
    );
    // Two tables for the same kind of link: bad input.
    let output = run(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--cluster",
        "1x8xh100-sxm",
        "--calibration",
        &network.display().to_string(),
        "--calibration",
        &network.display().to_string(),
    ]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("one table per kind of link"));
}

/// The number after `prefix` in `line` (up to the next space, `)`, `;` or `,`).
fn number_after(line: &str, prefix: &str) -> Option<f64> {
    let rest = &line[line.find(prefix)? + prefix.len()..];
    let text: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    text.parse().ok()
}

/// Every sentence of `--explain`'s reasons, for every model profile on several clusters
/// (and with latency targets), checked against the plan's own numbers: each claim is
/// computed from what it states.
#[test]
fn every_reason_is_true_of_the_plans_own_numbers() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cluster.toml");
    let examples = examples.display().to_string();
    let clusters = [
        "1x8xh100-sxm",
        "2x8xh100-sxm",
        "1x2xl40s",
        "4x8xh200-sxm",
        &examples,
    ];
    let mut checked = 0;
    for (profile, _) in MODEL_PROFILES {
        for cluster in clusters {
            for extra in [
                &[][..],
                &["--isl", "2048", "--osl", "512", "--tpot-ms", "60"][..],
                &[
                    "--isl",
                    "2048",
                    "--osl",
                    "512",
                    "--tpot-ms",
                    "60",
                    "--rps",
                    "10",
                    "--objective",
                    "cost",
                ][..],
            ] {
                let mut args = vec!["--model", profile, "--cluster", cluster];
                args.extend(extra);
                let (code, plan) = plan_json(&args);
                if code != 0 {
                    continue;
                }
                checked += 1;
                let case = format!("{profile} on {cluster} {extra:?}");
                let gib = |bytes: &Value| bytes.as_f64().expect("bytes") / (1u64 << 30) as f64;
                let estimate = &plan["estimate"];
                let lines: Vec<&str> = plan["explain"]
                    .as_array()
                    .expect("explain")
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                let usable = gib(&plan["memory"][0]["usable_bytes"]);
                let feasible = |pred: &dyn Fn(&Value) -> bool| {
                    let alternatives = plan["alternatives"].as_array().expect("alternatives");
                    pred(&plan["parallel"])
                        || alternatives
                            .iter()
                            .any(|a| a["feasible"] == true && pred(&a["parallel"]))
                };
                let degree = |p: &Value, k: &str| p[k].as_u64().expect("degree");
                for line in &lines {
                    if line.contains(" B parameters (") {
                        let params = number_after(line, ": ").expect("params");
                        assert!(
                            (params - plan["params"].as_f64().expect("p") / 1e9).abs() < 0.006,
                            "{case}: {line}"
                        );
                        let weights = number_after(line, "active per token), ").expect("weights");
                        assert!(
                            (weights - gib(&plan["weights_bytes"])).abs() < 0.06,
                            "{case}: {line}"
                        );
                    } else if line.starts_with("one ") && line.contains(" holds ") {
                        let holds = number_after(line, " holds ").expect("holds");
                        assert!((holds - usable).abs() < 0.06, "{case}: {line} vs {usable}");
                    } else if line.starts_with("fits one GPU") {
                        // The whole model (no sharding of any kind) fits one GPU's usable memory.
                        assert!(gib(&plan["weights_bytes"]) < usable, "{case}: {line}");
                        assert!(
                            feasible(&|p| degree(p, "tp") == 1
                                && degree(p, "pp") == 1
                                && degree(p, "ep") == 1),
                            "{case}: {line}"
                        );
                    } else if line.starts_with("does not fit one GPU") {
                        assert!(
                            !feasible(&|p| degree(p, "tp") == 1
                                && degree(p, "pp") == 1
                                && degree(p, "ep") == 1),
                            "{case}: {line}"
                        );
                        if let Some(ep) = number_after(line, "sharded over EP") {
                            assert!(
                                feasible(&|p| degree(p, "tp") == 1
                                    && degree(p, "pp") == 1
                                    && degree(p, "ep") == ep as u64),
                                "{case}: {line}"
                            );
                        }
                        if line.contains("fits with TP inside a node") {
                            assert!(
                                feasible(&|p| degree(p, "pp") == 1 && degree(p, "ep") == 1),
                                "{case}: {line}"
                            );
                        }
                        if line.contains("nor TP inside a node without EP") {
                            assert!(
                                !feasible(&|p| degree(p, "pp") == 1 && degree(p, "ep") == 1),
                                "{case}: {line}"
                            );
                            let ep = number_after(line, "sharded over EP").expect("ep") as u64;
                            let tp = number_after(line, " with TP").expect("tp") as u64;
                            assert!(
                                feasible(&|p| degree(p, "pp") == 1
                                    && degree(p, "ep") == ep
                                    && degree(p, "tp") == tp),
                                "{case}: {line}"
                            );
                        }
                    } else if line.starts_with("does not fit TP inside one node")
                        || line.starts_with("does not fit with TP alone")
                    {
                        assert!(!feasible(&|p| degree(p, "pp") == 1), "{case}: {line}");
                        assert!(degree(&plan["parallel"], "pp") > 1, "{case}: {line}");
                    } else if let Some(rest) = line.strip_prefix("chosen: ") {
                        let layout = rest.split(" for ").next().expect("layout");
                        let parallel = &plan["parallel"];
                        assert!(
                            layout.starts_with(&format!(
                                "TP{} × PP{} × DP{}",
                                degree(parallel, "tp"),
                                degree(parallel, "pp"),
                                degree(parallel, "dp")
                            )),
                            "{case}: {line}"
                        );
                        let tpot = number_after(line, "TPOT ").expect("tpot");
                        assert!(
                            (tpot - estimate["tpot_secs"].as_f64().expect("t") * 1e3).abs() < 0.006,
                            "{case}: {line}"
                        );
                        let tokens = number_after(line, "batch 1; ").expect("tokens/s");
                        assert!(
                            (tokens - estimate["tokens_per_sec"].as_f64().expect("t")).abs() < 0.51,
                            "{case}: {line}"
                        );
                        let batch = number_after(line, "tokens/s at ").expect("batch");
                        assert_eq!(
                            batch as u64, estimate["batch_per_replica"],
                            "{case}: {line}"
                        );
                    } else if let Some(rest) = line.strip_prefix("  not ") {
                        if let Some(less) =
                            number_after(rest, "(").filter(|_| rest.contains("% less)"))
                        {
                            let theirs = number_after(rest, ": ").expect("theirs");
                            let ours = number_after(rest, " vs ").expect("ours");
                            assert!(
                                theirs <= ours,
                                "{case}: a runner-up said to do less does more: {line}"
                            );
                            assert!(
                                (less - 100.0 * (1.0 - theirs / ours)).abs() < 1.0,
                                "{case}: {line}"
                            );
                        } else if rest.contains(" GPUs for the rate within the targets vs ") {
                            let theirs = number_after(rest, "needs at least ").expect("theirs");
                            let ours = number_after(rest, " vs ").expect("ours");
                            assert!(theirs >= ours, "{case}: {line}");
                        } else if rest.contains("within the targets vs ") {
                            let theirs = number_after(rest, "at most ").expect("theirs");
                            let ours = number_after(rest, " vs ").expect("ours");
                            assert!(theirs <= ours + 0.5, "{case}: {line}");
                        } else if rest.contains("× slower)") {
                            let theirs = number_after(rest, "TPOT ").expect("theirs");
                            let ours = number_after(rest, " vs ").expect("ours");
                            assert!(theirs >= ours - 0.005, "{case}: {line}");
                        }
                    } else if line.starts_with("EP vs MoE-TP: ") {
                        check_experts_line(&case, &plan, line);
                    } else if line.starts_with("KV cache must hold --max-model-len ") {
                        let len = number_after(line, "--max-model-len ").expect("len") as u64;
                        assert_eq!(len, plan["max_model_len"], "{case}: {line}");
                        for stage in plan["memory"].as_array().expect("memory") {
                            assert!(
                                stage["kv_tokens"].as_u64().expect("kv") >= len,
                                "{case}: {line}"
                            );
                        }
                    } else if let Some(rest) = line.strip_prefix("the plan uses ") {
                        // Right-sized for --rps: the plan's ranks are the GPUs the point
                        // needs, whole replicas of its layout.
                        let uses = number_after(rest, "").expect("uses");
                        assert_eq!(uses as u64, plan["world_size"], "{case}: {line}");
                        assert_eq!(
                            plan["ranks"].as_array().expect("ranks").len() as u64,
                            uses as u64,
                            "{case}: {line}"
                        );
                        let needs = plan["sla_choice"]["gpus_for_rps"].as_u64().expect("gpus");
                        let replica =
                            degree(&plan["parallel"], "tp") * degree(&plan["parallel"], "pp");
                        assert_eq!(uses as u64, needs / replica * replica, "{case}: {line}");
                        assert!(
                            uses < number_after(rest, "of the cluster's ").expect("of"),
                            "{case}: {line}"
                        );
                    } else if line.starts_with("for ") && line.contains(" prompt and ") {
                        let choice = &plan["sla_choice"];
                        let tpot = number_after(line, " ms, TPOT ").expect("tpot");
                        assert!(
                            (tpot - choice["tpot_secs"].as_f64().expect("t") * 1e3).abs() < 0.06,
                            "{case}: {line}"
                        );
                        assert!(tpot <= 60.05, "{case}: {line}");
                        if let Some(gpus) = number_after(line, "per GPU, and ") {
                            // The fewest GPUs: no point that meets the targets needs fewer.
                            assert_eq!(gpus as u64, choice["gpus_for_rps"], "{case}: {line}");
                            for row in plan["pareto"].as_array().expect("pareto") {
                                if row["meets_sla"] == true {
                                    assert!(
                                        row["gpus_for_rps"].as_u64().expect("gpus") >= gpus as u64,
                                        "{case}: {row}"
                                    );
                                }
                            }
                        }
                    }
                }
                check_every_layout_considered(&case, &plan);
            }
        }
    }
    assert!(checked >= 40, "only {checked} plans were feasible");
}

/// `TP1 × PP2 × DP8 (EP8)`: a layout as the reasons name it.
fn layout_name(parallel: &Value) -> String {
    let get = |k: &str| parallel[k].as_u64().expect("degree");
    let mut name = format!("TP{} × PP{} × DP{}", get("tp"), get("pp"), get("dp"));
    if get("ep") > 1 {
        name.push_str(&format!(" (EP{})", get("ep")));
    }
    name
}

/// Every line of `every layout considered` (each alternative's reason) is true of that
/// layout's own numbers: a costed layout states its figure against the chosen one's, a
/// refused one a reason computed for it (memory, degrees, hosts). See: #40
fn check_every_layout_considered(case: &str, plan: &Value) {
    let estimate = &plan["estimate"];
    let mut chosen_tokens = estimate["tokens_per_sec"].as_f64().expect("tokens/s");
    let mut chosen_tpot_ms = estimate["tpot_secs"].as_f64().expect("tpot") * 1e3;
    // Right-sized for `--rps` (`the plan uses N of the cluster's M GPUs`): the layouts were
    // compared with the chosen layout on the whole cluster, whose figures the plan no longer
    // carries; they are then taken from the first reason and held equal in all the others.
    let right_sized = plan["explain"]
        .as_array()
        .expect("explain")
        .iter()
        .any(|l| l.as_str().is_some_and(|l| l.starts_with("the plan uses ")));
    if right_sized {
        for a in plan["alternatives"].as_array().expect("alternatives") {
            let reason = a["reason"].as_str().expect("reason");
            if a["feasible"] == true {
                if let Some(ours) = number_after(reason, " tokens/s vs ") {
                    chosen_tokens = ours;
                } else if let Some(ours) = number_after(reason, " ms vs ") {
                    chosen_tpot_ms = ours;
                }
                break;
            }
        }
    }
    let (tokens_tolerance, tpot_tolerance) = if right_sized {
        (1.0, 0.011)
    } else {
        (0.51, 0.006)
    };
    let within_targets = plan.get("sla_choice").is_some();
    for alternative in plan["alternatives"].as_array().expect("alternatives") {
        let reason = alternative["reason"].as_str().expect("reason");
        let line = format!("{}: {reason}", layout_name(&alternative["parallel"]));
        let degree = |k: &str| alternative["parallel"][k].as_u64().expect("degree");
        assert!(!reason.contains("not needed"), "{case}: {line}");
        if alternative["feasible"] == true {
            let tokens = alternative["tokens_per_sec"].as_f64().expect("tokens/s");
            let tpot_ms = alternative["tpot_secs"].as_f64().expect("tpot") * 1e3;
            if reason.contains(" tokens/s vs ") {
                let theirs = number_after(reason, "").expect("theirs");
                let ours = number_after(reason, " vs ").expect("ours");
                let percent = number_after(reason, "(").expect("percent");
                assert!((theirs - tokens).abs() < 0.51, "{case}: {line}");
                assert!(
                    (ours - chosen_tokens).abs() < tokens_tolerance,
                    "{case}: {line}"
                );
                if reason.contains("% less)") {
                    assert!(tokens <= chosen_tokens + 0.5, "{case}: {line}");
                    let want = 100.0 * (1.0 - tokens / chosen_tokens);
                    assert!((percent - want).abs() < 0.51, "{case}: {line}");
                } else {
                    assert!(
                        reason.contains("% more at its full batch"),
                        "{case}: {line}"
                    );
                    assert!(tokens > chosen_tokens && within_targets, "{case}: {line}");
                    let want = 100.0 * (tokens / chosen_tokens - 1.0);
                    assert!((percent - want).abs() < 0.51, "{case}: {line}");
                }
            } else if reason.starts_with("TPOT ") {
                let theirs = number_after(reason, "TPOT ").expect("theirs");
                let ours = number_after(reason, " vs ").expect("ours");
                assert!((theirs - tpot_ms).abs() < 0.006, "{case}: {line}");
                assert!(
                    (ours - chosen_tpot_ms).abs() < tpot_tolerance,
                    "{case}: {line}"
                );
                if reason.contains("× faster") {
                    assert!(tpot_ms < chosen_tpot_ms && within_targets, "{case}: {line}");
                } else {
                    assert!(tpot_ms >= chosen_tpot_ms - 0.005, "{case}: {line}");
                }
            } else {
                panic!("{case}: a feasible layout without its numbers: {line}");
            }
        } else if reason.starts_with("weights ") {
            let weights = number_after(reason, "weights ").expect("weights");
            let reserve = number_after(reason, "+ reserve ").expect("reserve");
            let usable = number_after(reason, "exceed the ").expect("usable");
            let gib =
                plan["memory"][0]["usable_bytes"].as_f64().expect("usable") / (1u64 << 30) as f64;
            assert!((usable - gib).abs() < 0.06, "{case}: {line}");
            assert!(weights + reserve > usable - 0.1, "{case}: {line}");
        } else if reason.starts_with("no room for KV cache") {
            let holds = number_after(reason, " holds ").expect("holds");
            let len = number_after(reason, "--max-model-len ").expect("len");
            assert!(holds < len, "{case}: {line}");
        } else if let Some(rest) = reason.strip_prefix("tp=") {
            let tp = number_after(rest, "").expect("tp") as u64;
            assert_eq!(tp, degree("tp"), "{case}: {line}");
            if let Some(heads) = number_after(rest, "does not divide ") {
                assert!(!(heads as u64).is_multiple_of(tp), "{case}: {line}");
            } else {
                assert!(
                    rest.contains("neither divides nor is a multiple"),
                    "{case}: {line}"
                );
            }
        } else if let Some(rest) = reason.strip_prefix("ep=") {
            let ep = number_after(rest, "").expect("ep") as u64;
            assert_eq!(ep, degree("ep"), "{case}: {line}");
            if let Some(tp_dp) = number_after(rest, "tp·dp = ") {
                assert_eq!(tp_dp as u64, degree("tp") * degree("dp"), "{case}: {line}");
                assert!(!(tp_dp as u64).is_multiple_of(ep), "{case}: {line}");
            } else if let Some(experts) = number_after(rest, "does not divide ") {
                assert!(!(experts as u64).is_multiple_of(ep), "{case}: {line}");
            } else {
                assert!(
                    rest.contains("needs a mixture-of-experts model"),
                    "{case}: {line}"
                );
            }
        } else if let Some(rest) = reason.strip_prefix("TP") {
            let tp = number_after(rest, "").expect("tp") as u64;
            assert_eq!(tp, degree("tp"), "{case}: {line}");
            if let Some(per_host) = number_after(rest, "would span hosts (") {
                assert!(tp > per_host as u64, "{case}: {line}");
            } else {
                assert!(rest.contains("CPU interconnect (SYS"), "{case}: {line}");
            }
        } else if let Some(rest) = reason.strip_prefix("needs ") {
            let needs = number_after(rest, "").expect("needs");
            let has = number_after(rest, "the cluster has ").expect("has");
            assert!(needs > has, "{case}: {line}");
        } else if let Some(rest) = reason.strip_prefix("pp=") {
            let pp = number_after(rest, "").expect("pp");
            let layers = number_after(rest, "exceeds ").expect("layers");
            assert!(pp > layers, "{case}: {line}");
        } else {
            panic!("{case}: a refusal the test does not know how to check: {line}");
        }
    }
}

/// The `EP vs MoE-TP: ` line: the two layouts it names are the best feasible ones with and
/// without EP, its figures are theirs, the winner and the margin follow from them, and the
/// per-step figures are those of their `moe` costs. See: #40
fn check_experts_line(case: &str, plan: &Value, line: &str) {
    // A plan right-sized for `--rps` no longer carries the whole-cluster layout the line
    // compared; `ep_against_moe_tp_is_decided_by_cost_with_its_reasons` covers the line.
    if plan["explain"].to_string().contains("the plan uses ") {
        return;
    }
    let mut layouts: Vec<&Value> = vec![plan];
    layouts.extend(
        plan["alternatives"]
            .as_array()
            .expect("alternatives")
            .iter()
            .filter(|a| a["feasible"] == true),
    );
    fn figures(layout: &Value) -> (f64, f64, &Value) {
        match layout.get("estimate") {
            Some(estimate) => (
                estimate["tokens_per_sec"].as_f64().expect("tokens/s"),
                estimate["tpot_secs"].as_f64().expect("tpot"),
                &estimate["moe"],
            ),
            None => (
                layout["tokens_per_sec"].as_f64().expect("tokens/s"),
                layout["tpot_secs"].as_f64().expect("tpot"),
                &layout["moe"],
            ),
        }
    }
    let latency = plan["objective"] == "latency";
    // Better first on the objective.
    let score = |layout: &Value| {
        let (tokens, tpot, _) = figures(layout);
        if latency { -tpot } else { tokens }
    };
    let best = |with_ep: bool| {
        layouts
            .iter()
            .filter(|l| (l["parallel"]["ep"].as_u64().expect("ep") > 1) == with_ep)
            .max_by(|a, b| score(a).total_cmp(&score(b)))
            .copied()
            .expect("a layout of each kind")
    };
    let (ep, tp) = (best(true), best(false));
    let rest = line.strip_prefix("EP vs MoE-TP: ").expect("prefix");
    let ep_name = layout_name(&ep["parallel"]);
    let tp_name = layout_name(&tp["parallel"]);
    let after_ep = &rest[rest
        .find(&format!("{ep_name} "))
        .unwrap_or_else(|| panic!("{case}: {line} does not name {ep_name}"))
        + ep_name.len()..];
    let after_tp = &rest[rest
        .find(&format!(" vs {tp_name} "))
        .unwrap_or_else(|| panic!("{case}: {line} does not name {tp_name}"))
        + tp_name.len()
        + 4..];
    let ep_value = number_after(after_ep, " ").expect("EP figure");
    let tp_value = number_after(after_tp, " ").expect("MoE-TP figure");
    let value = |l: &Value| {
        let (tokens, tpot, _) = figures(l);
        if latency { tpot * 1e3 } else { tokens }
    };
    assert!((ep_value - value(ep)).abs() < 0.006, "{case}: {line}");
    assert!((tp_value - value(tp)).abs() < 0.006, "{case}: {line}");
    let ep_wins = score(ep) > score(tp);
    assert!(
        rest.starts_with(if ep_wins {
            "EP wins by "
        } else {
            "MoE-TP wins by "
        }),
        "{case}: {line}"
    );
    let margin = number_after(rest, "wins by ").expect("margin");
    // From the unrounded figures: the line prints them to two decimals.
    let (win, lose) = if ep_wins {
        (value(ep), value(tp))
    } else {
        (value(tp), value(ep))
    };
    let want = if latency {
        lose / win - 1.0
    } else {
        win / lose - 1.0
    };
    assert!((margin - 100.0 * want).abs() < 0.51, "{case}: {line}");
    // The per-step figures are the two layouts' own.
    let step = |layout: &Value| {
        let moe = figures(layout).2;
        moe[if latency { "at_batch_1" } else { "at_batch" }].clone()
    };
    let (ep_step, tp_step) = (step(ep), step(tp));
    let field = |step: &Value, k: &str| step[k].as_f64().expect(k);
    let batches = number_after(rest, "at batch ").expect("batch");
    assert_eq!(batches as u64, ep_step["batch"], "{case}: {line}");
    let per_expert_ep = number_after(rest, &format!(" vs {}: ", tp_step["batch"])).expect("rows");
    assert!(
        (per_expert_ep - field(&ep_step, "tokens_per_expert")).abs() < 0.006,
        "{case}: {line}"
    );
    let load = number_after(rest, "carries ").expect("load");
    assert!(
        (load - field(&ep_step, "busiest_gpu_load")).abs() < 0.006,
        "{case}: {line}"
    );
    let all_to_all = number_after(rest, "all-to-all ").expect("all-to-all");
    assert!(
        (all_to_all - field(&ep_step, "collective_secs") * 1e3).abs() < 0.0006,
        "{case}: {line}"
    );
    let all_reduce = number_after(rest, "all-reduce ").expect("all-reduce");
    assert!(
        (all_reduce - field(&tp_step, "collective_secs") * 1e3).abs() < 0.0006,
        "{case}: {line}"
    );
}

/// The batch-1 TPOT and the reasons of a feasible `infer plan base… extra… --json`.
fn tpot_and_reasons(base: &[&str], extra: &[&str]) -> (f64, Vec<String>) {
    let args = [base, extra].concat();
    let (code, plan) = plan_json(&args);
    assert_eq!(code, 0, "{plan}");
    let explain = plan["explain"]
        .as_array()
        .expect("explain")
        .iter()
        .filter_map(|l| l.as_str().map(str::to_string))
        .collect();
    (
        plan["estimate"]["tpot_secs"].as_f64().expect("tpot"),
        explain,
    )
}

/// `infer bench allreduce --json` and `infer bench decode --json`, run for real, read back
/// by `--calibration`: the measured shared-memory link replaces NVLink inside a host; a
/// decode measured on this CPU is refused for a GPU plan; the same report as an H100 would
/// print it (the device fields are the only change: the CPU engine cannot run on one)
/// replaces the H100's HBM bandwidth, and a decode-bound TPOT scales by exactly the ratio.
#[test]
fn bench_json_reports_calibrate_the_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let allreduce = dir.path().join("allreduce.json");
    let output = run(&[
        "bench",
        "allreduce",
        "--json",
        "--world",
        "2",
        "--max-bytes",
        "262144",
    ]);
    std::fs::write(&allreduce, stdout_ok(&output)).expect("write");
    let report: Value =
        serde_json::from_slice(&std::fs::read(&allreduce).expect("read")).expect("json");
    assert_eq!(report["bench"], "allreduce");
    // Each transport's table has its one-message latency (TCP and shared memory).
    for table in report["tables"].as_array().expect("tables") {
        let secs = table["message_secs"].as_f64().expect("message_secs");
        assert!(secs > 0.0 && secs < 0.1, "{table}");
    }
    let peak = report["tables"]
        .as_array()
        .expect("tables")
        .iter()
        .flat_map(|t| t["rows"].as_array().expect("rows"))
        .map(|r| r["busbw_bytes_per_sec"].as_f64().expect("busbw"))
        .fold(0.0, f64::max);
    let tp8 = [
        "--model",
        "llama-3.1-70b",
        "--cluster",
        "1x8xh100-sxm",
        "--tp",
        "8",
    ];
    let with = |extra: &[&str]| tpot_and_reasons(&tp8, extra);
    let (datasheet, _) = with(&[]);
    let (measured, explain) = with(&["--calibration", &allreduce.display().to_string()]);
    // Two CPU processes' link (microseconds per call, a few GB/s) replaces NVLink's
    // figures: TP 8's 160 all-reduces per step cost something else.
    assert!(
        (measured - datasheet).abs() > 1e-6,
        "{measured} vs {datasheet}"
    );
    let stated = format!("links inside a host cost {:.1} GB/s", peak / 1e9);
    assert!(
        explain
            .iter()
            .any(|l| l.contains(&stated) && l.contains("`allreduce.json`, 2 ranks on this host")),
        "{stated}: {explain:#?}"
    );

    let decode = dir.path().join("decode.json");
    let output = run(&[
        "bench",
        "decode",
        "--json",
        "--runs",
        "1",
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "8",
    ]);
    std::fs::write(&decode, stdout_ok(&output)).expect("write");
    let mut report: Value =
        serde_json::from_slice(&std::fs::read(&decode).expect("read")).expect("json");
    assert_eq!(report["device"], "cpu");
    let step = report["decode_step_secs"].as_f64().expect("step");
    let weights = report["decode_weight_bytes"].as_f64().expect("bytes");
    let rate = report["weight_bytes_per_sec"].as_f64().expect("rate");
    assert!((rate - weights / step).abs() / rate < 1e-9, "{report}");
    // SmolLM2-135M Q4_1: 30 layers of 576-wide attention and 1536-wide MLP plus the tied
    // 49152 × 576 head, ~5 bits a weight: 60–130 MB.
    assert!((60e6..130e6).contains(&weights), "{weights}");
    // The prompt's causal attention, 2 · 16² · (9 heads · 64) · 30 layers flops, and the
    // model's own rate for it, which a calibration splits the prefill's time by.
    assert_eq!(
        report["prefill_attention_flops"],
        2.0 * 256.0 * 576.0 * 30.0,
        "{report}"
    );
    // (Absent only when a busy host made the chunk no slower after its context.)
    if let Some(rate) = report.get("prefill_attention_flops_per_sec") {
        assert!(rate.as_f64().is_some_and(|r| r > 1e8), "{report}");
    }
    // And its decode attention's own rate, which a calibration costs a plan's KV reads at.
    if let Some(rate) = report.get("decode_attention_flops_per_sec") {
        assert!(rate.as_f64().is_some_and(|r| r > 1e8), "{report}");
    }
    // And the share of the prompt rate one thread computes beside the others: a one-thread
    // rank's (none on one thread).
    let threads = report["threads"].as_f64().expect("threads");
    match report.get("prefill_one_thread_share") {
        Some(share) => assert!(
            share
                .as_f64()
                .is_some_and(|s| s >= 1.0 / threads && s <= 1.0),
            "{report}"
        ),
        None => assert_eq!(threads, 1.0, "{report}"),
    }
    let one_gpu = [
        "--model",
        "llama-3.1-8b",
        "--cluster",
        "1x8xh100-sxm",
        "--tp",
        "1",
    ];
    let output = run(&[
        &["plan"][..],
        &one_gpu,
        &["--calibration", &decode.display().to_string()],
    ]
    .concat());
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("ran on the CPU") && stderr.contains("infer bench decode --json"),
        "{stderr}"
    );

    report["device"] = "cuda".into();
    report["device_name"] = "NVIDIA H100 80GB HBM3".into();
    report["weight_bytes_per_sec"] = 2.5e12.into();
    let h100 = dir.path().join("h100-decode.json");
    std::fs::write(&h100, report.to_string()).expect("write");
    let tpot = |extra: &[&str]| tpot_and_reasons(&one_gpu, extra);
    let (datasheet, _) = tpot(&[]);
    let (measured, explain) = tpot(&["--calibration", &h100.display().to_string()]);
    // TP 1: no collective, the step is weights and KV over HBM: 3350 / 2500 slower.
    let ratio = measured / datasheet;
    assert!((ratio - 3350.0 / 2500.0).abs() < 1e-9, "{ratio}");
    assert!(
        explain.iter().any(|l| l.contains(
            "h100-sxm GPUs read weights at 2500 GB/s in a decode step (75% of the datasheet's 3350 GB/s)"
        ) && l.contains("`h100-decode.json`")),
        "{explain:#?}"
    );
}

/// EP against MoE-TP by cost on the three MoE profiles people run across nodes: `--explain`
/// names the best layout of each kind, which won and by how much, with the figures of their
/// estimates; each layout's `moe` costs follow the formulas by hand — the tokens that meet
/// in an expert group (`batch · ep / tp` with EP, the replica's batch without), the rows of
/// each expert's GEMM (`· top_k / n_experts`), and the balls-into-bins load of the busiest
/// EP GPU (`1 + sqrt(2 · ln ep / mean)`, none with MoE-TP). See: #40
#[test]
fn ep_against_moe_tp_is_decided_by_cost_with_its_reasons() {
    // (profile, routed experts, top-k): profiles/models/*.toml, from each config.json.
    let profiles = [
        ("mixtral-8x7b", 8.0, 2.0),
        ("qwen3-235b-a22b", 128.0, 8.0),
        ("deepseek-v3", 256.0, 8.0),
    ];
    for (profile, n_experts, top_k) in profiles {
        for cluster in ["2x8xh100-sxm", "4x8xh200-sxm"] {
            for objective in ["throughput", "latency"] {
                let case = format!("{profile} on {cluster} for {objective}");
                let (code, plan) = plan_json(&[
                    "--model",
                    profile,
                    "--cluster",
                    cluster,
                    "--objective",
                    objective,
                ]);
                assert_eq!(code, 0, "{case}: {plan}");
                let line = plan["explain"]
                    .as_array()
                    .expect("explain")
                    .iter()
                    .filter_map(Value::as_str)
                    .find(|l| l.starts_with("EP vs MoE-TP: "))
                    .unwrap_or_else(|| panic!("{case}: no EP vs MoE-TP line: {}", plan["explain"]));
                check_experts_line(&case, &plan, line);
                let mut layouts = vec![(plan["parallel"].clone(), plan["estimate"]["moe"].clone())];
                for a in plan["alternatives"].as_array().expect("alternatives") {
                    if a["feasible"] == true {
                        layouts.push((a["parallel"].clone(), a["moe"].clone()));
                    }
                }
                for (parallel, moe) in layouts {
                    let degree = |k: &str| parallel[k].as_u64().expect("degree");
                    for step in [&moe["at_batch_1"], &moe["at_batch"]] {
                        let batch = step["batch"].as_u64().expect("batch");
                        let (tp, ep) = (degree("tp"), degree("ep"));
                        let group = if ep > 1 { batch * ep / tp } else { batch };
                        assert_eq!(step["group_tokens"], group, "{case}: {parallel}");
                        let rows = group as f64 * top_k / n_experts;
                        let got = step["tokens_per_expert"].as_f64().expect("rows");
                        assert!(
                            (got - rows).abs() < 1e-9 * rows.max(1.0),
                            "{case}: {parallel}"
                        );
                        let load = step["busiest_gpu_load"].as_f64().expect("load");
                        if ep > 1 {
                            let mean = group as f64 * top_k / ep as f64;
                            let cap = group as f64 * top_k.min(n_experts / ep as f64) / mean;
                            let want = (1.0 + (2.0 * (ep as f64).ln() / mean).sqrt()).min(cap);
                            assert!(
                                (load - want).abs() < 1e-9,
                                "{case}: {parallel} {load} vs {want}"
                            );
                            assert!(load >= 1.0);
                        } else {
                            assert_eq!(load, 1.0, "{case}: {parallel}");
                        }
                        assert!(step["expert_secs"].as_f64().expect("experts") > 0.0);
                    }
                }
            }
        }
    }
}

/// An inventory that gives a host more `cpu-ranks` than this host's probed cores (which
/// stand for its CPU) is planned as given, and the plan says how it counts them: ranks beyond
/// one per core take turns on the cores. See: #40
#[test]
fn more_cpu_ranks_than_cores_are_said_to_take_turns() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hosts.toml");
    let ranks = cores + 1;
    std::fs::write(
        &path,
        format!("[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1\"\ncpu-ranks = {ranks}\n"),
    )
    .expect("write");
    let inventory = path.to_str().expect("UTF-8");
    let (code, plan) = plan_json(&["--cluster", inventory, "--dp", &ranks.to_string()]);
    assert_eq!(code, 0, "{plan}");
    let explain: Vec<&str> = plan["explain"]
        .as_array()
        .expect("explain")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        explain.iter().any(|l| l.contains(&format!(
            "each taking 1 to {ranks} ranks (its `cpu-ranks`, more than its {cores} cores: ranks beyond one per core take turns"
        ))),
        "{explain:#?}"
    );
    assert!(!explain.iter().any(|l| l.contains("one per core at most")));
}

/// The number just before `unit` in `line`, after `after` (`"reading weights at"`, `"GB/s"`).
fn number_before(line: &str, after: &str, unit: &str) -> f64 {
    let rest = &line[line.find(after).expect("the phrase") + after.len()..];
    let text = rest[..rest.find(unit).expect("the unit")].trim();
    text.parse()
        .unwrap_or_else(|_| panic!("`{text}` in `{line}`"))
}

/// TP over CPU ranks is planned as the engine runs it: ranks beyond one per core get what one
/// thread reads alone (within the memory's share of the cores) for one of their `⌈ranks /
/// cores⌉` turns, and the exact-order TP chain is said, with how much faster a rank works
/// while the others wait on it. See: #40
#[test]
fn cpu_tp_is_planned_as_its_exact_order_chain_with_turns() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hosts.toml");
    std::fs::write(
        &path,
        "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1\"\ncpu-ranks = 3\n",
    )
    .expect("write");
    let inventory = path.to_str().expect("UTF-8");
    let explain_of = |degree: &str| -> Vec<String> {
        let (code, plan) = plan_json(&["--cluster", inventory, degree, "3"]);
        assert_eq!(code, 0, "{plan}");
        plan["explain"]
            .as_array()
            .expect("explain")
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect()
    };
    let explain = explain_of("--tp");
    let share = if cores < 3 {
        3usize.div_ceil(cores) * cores
    } else {
        3
    };
    let host = explain
        .iter()
        .find(|l| l.contains("reading weights at"))
        .expect("the host's line");
    let rank = explain
        .iter()
        .find(|l| l.contains("with 3 ranks per host"))
        .expect("the rank's line");
    let host_rate = number_before(host, "reading weights at", "GB/s");
    let rates = rank.split(", ").nth(3).expect("the rank's rates");
    let rank_rate = number_before(rates, "", "GB/s");
    if cores < 3 {
        // One thread's rate (at least its fair share, within the memory's bandwidth over the
        // cores running at once) for one of ⌈3 / cores⌉ turns.
        let alone = number_before(host, "GB/s (", "GB/s on one thread alone");
        let memory = number_before(host, "memory read at", "GB/s");
        let turns = 3usize.div_ceil(cores) as f64;
        let expected = alone
            .min(memory / cores as f64)
            .clamp(host_rate / cores as f64, host_rate)
            / turns;
        assert!(
            (rank_rate - expected).abs() <= 0.15,
            "{rank_rate} GB/s per rank, one thread's {alone} GB/s over {turns} turns: {explain:#?}"
        );
    } else {
        assert!(
            rank_rate >= host_rate / 3.0 - 0.1 && rank_rate <= host_rate + 0.1,
            "{rank_rate} GB/s per rank, {host_rate} GB/s on the host: {explain:#?}"
        );
    }
    let alone = ((cores / 3).max(1) * share) as f64 / cores as f64;
    let chain = "TP 3 runs in exact order, as one process would: each layer's two row-parallel products (attention output, MLP down) go from rank to rank";
    let line = explain
        .iter()
        .find(|l| l.contains(chain))
        .unwrap_or_else(|| panic!("{explain:#?}"));
    assert!(
        line.contains("(3 turns of")
            && line.contains(&format!("each {:.2}× as fast", alone.max(1.0))),
        "{line}"
    );
    // DP sums nothing: no chain.
    assert!(!explain_of("--dp").iter().any(|l| l.contains("exact order")));
}
