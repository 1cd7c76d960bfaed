//! `infer doctor`: every NCCL log and topology fixture gets the diagnosis written for it in
//! `../shared/fixtures/INDEX.md`; live checks run against fake sysfs trees and environments.

use serde_json::Value;

use crate::support::fixtures::{FakePort, FakeSysfs, shared_fixture};
use crate::support::process::{infer, run};

/// Runs `infer doctor --json` with `args`; returns the exit code and the findings.
fn doctor(args: &[&str]) -> (i32, Vec<Value>) {
    let mut full = vec!["doctor", "--json"];
    full.extend_from_slice(args);
    let output = run(&full);
    parse(output)
}

fn parse(output: std::process::Output) -> (i32, Vec<Value>) {
    let code = output.status.code().expect("exited");
    assert!(
        code == 0 || code == 1,
        "exit {code}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    (
        code,
        report["findings"].as_array().expect("findings").clone(),
    )
}

fn log(name: &str) -> String {
    shared_fixture(&format!("nccl_logs/{name}"))
        .to_str()
        .expect("UTF-8")
        .to_string()
}

fn topo(name: &str) -> String {
    shared_fixture(&format!("topo/{name}"))
        .to_str()
        .expect("UTF-8")
        .to_string()
}

/// The findings of `check` with `severity`.
fn with<'a>(findings: &'a [Value], check: &str, severity: &str) -> Vec<&'a Value> {
    findings
        .iter()
        .filter(|f| f["check"] == check && f["severity"] == severity)
        .collect()
}

fn text(finding: &Value) -> String {
    finding.to_string()
}

#[test]
fn socket_fallback_on_an_ib_cluster_is_an_error() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("socket_fallback_ib_present_nccl_952_channels.txt"),
    ]);
    assert_eq!(code, 1);
    let fallback = with(&findings, "nccl-tcp-fallback", "error");
    assert_eq!(fallback.len(), 1);
    assert!(
        text(fallback[0]).contains("[send] via NET/Socket/3"),
        "{}",
        fallback[0]
    );
    let transport = with(&findings, "nccl-transport", "ok");
    assert!(text(transport[0]).contains("P2P/IPC"), "{}", transport[0]);
}

#[test]
fn gcp_socket_fallback_without_rdma_is_a_warning_with_version_note() {
    let (code, findings) = doctor(&["--nccl-log", &log("socket_fallback_gcp_ens7_nccl_1267.txt")]);
    assert_eq!(code, 0);
    let fallback = with(&findings, "nccl-tcp-fallback", "warn");
    assert!(
        text(fallback[0]).contains("NET/IB : No device found"),
        "{}",
        fallback[0]
    );
    let version = with(&findings, "nccl-version", "ok");
    assert!(
        text(version[0]).contains("NCCL 2.19.3 built for CUDA 12.3, driver supports CUDA 12.0"),
        "{}",
        version[0]
    );
    assert!(text(version[0]).contains("minor-version compatibility"));
}

#[test]
fn bridge_and_vpn_interfaces_are_flagged_with_the_physical_one() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("socket_multi_iface_tailscale_lxcbr_vllm_6370.txt"),
    ]);
    assert_eq!(
        code, 0,
        "a single-node job with odd interfaces is not an error"
    );
    let interface = with(&findings, "nccl-interface", "warn");
    assert_eq!(interface.len(), 1);
    let finding = text(interface[0]);
    assert!(
        finding.contains("lxcbr0") && finding.contains("tailscale0"),
        "{finding}"
    );
    assert!(
        !finding.contains("`eno3`, "),
        "eno3 is not flagged: {finding}"
    );
    assert!(
        interface[0]["hint"]
            .as_str()
            .expect("hint")
            .contains("NCCL_SOCKET_IFNAME==eno3")
    );
    let version = with(&findings, "nccl-version", "ok");
    assert!(text(version[0]).contains("2.20.5"));
}

#[test]
fn roce_init_is_healthy_and_names_the_hcas() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("ib_roce_init_dgxh100_nccl_tests_185.txt"),
    ]);
    assert_eq!(code, 0);
    assert!(
        findings.iter().all(|f| f["severity"] == "ok"),
        "{findings:?}"
    );
    let transport = with(&findings, "nccl-transport", "ok");
    let message = transport[0]["message"].as_str().expect("message");
    assert!(
        message.contains("IB")
            && message.contains("mlx5_10:1/RoCE")
            && message.contains("mlx5_11:1/RoCE"),
        "{message}"
    );
    assert!(message.contains("relaxed ordering"), "{message}");
}

#[test]
fn gdrdma_and_cumem_are_healthy() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("ib_gdrdma_and_p2p_cumem_h20_nccl_1189.txt"),
    ]);
    assert_eq!(code, 0);
    assert!(
        findings.iter().all(|f| f["severity"] == "ok"),
        "{findings:?}"
    );
    let message = with(&findings, "nccl-transport", "ok")[0]["message"]
        .as_str()
        .expect("message")
        .to_string();
    assert!(
        message.contains("NET/IB/GDRDMA") && message.contains("P2P/CUMEM"),
        "{message}"
    );
}

#[test]
fn container_shm_and_socket_are_flagged() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("shm_direct_and_socket_container_eth0_nccl_367.txt"),
    ]);
    assert_eq!(code, 1);
    let shm = with(&findings, "nccl-transport", "warn");
    assert!(
        text(shm[0]).contains("direct shared memory") && text(shm[0]).contains("CUDA Dev 0["),
        "{}",
        shm[0]
    );
    assert_eq!(with(&findings, "nccl-tcp-fallback", "error").len(), 1);
    let virtual_nic = with(&findings, "nccl-interface", "warn");
    assert!(text(virtual_nic[0]).contains("eth0"), "{}", virtual_nic[0]);
}

#[test]
fn nonexistent_socket_ifname_is_an_error() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("fail_socket_ifname_nonexistent_nccl_1837.txt"),
    ]);
    assert_eq!(code, 1);
    let interface = with(&findings, "nccl-interface", "error");
    assert!(
        text(interface[0]).contains("NCCL_SOCKET_IFNAME=eth2")
            && text(interface[0]).contains("family 59936"),
        "{}",
        interface[0]
    );
    assert!(!with(&findings, "nccl-error", "error").is_empty());
}

#[test]
fn different_nccl_versions_across_logs_are_an_error() {
    let (code, findings) = doctor(&[
        "--nccl-log",
        &log("socket_fallback_gcp_ens7_nccl_1267.txt"),
        "--nccl-log",
        &log("socket_multi_iface_tailscale_lxcbr_vllm_6370.txt"),
    ]);
    assert_eq!(code, 1);
    let mismatch = with(&findings, "nccl-version", "error");
    assert!(
        text(mismatch[0]).contains("2.19.3") && text(mismatch[0]).contains("2.20.5"),
        "{}",
        mismatch[0]
    );
}

#[test]
fn nccl_errors_are_classified() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("node1.log");
    std::fs::write(
        &path,
        "some launcher line\n\
         node1:100:200 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n\
         node1:100:200 [0] NCCL WARN Call to connect returned Connection refused, retrying\n\
         node1:100:201 [1] NCCL WARN NET/IB : mlx5_0:1 ibv_modify_qp failed with 101 Network is unreachable\n\
         node1:100:202 [2] NCCL WARN Duplicate GPU detected : rank 2 and rank 3 both on CUDA device 41000\n",
    )
    .expect("write");
    let (code, findings) = doctor(&["--nccl-log", path.to_str().expect("UTF-8")]);
    assert_eq!(code, 1);
    let errors = with(&findings, "nccl-error", "error");
    let all: String = errors.iter().map(|f| text(f)).collect();
    assert_eq!(errors.len(), 3, "{all}");
    assert!(
        all.contains("refused the connection")
            && all.contains("GID index")
            && all.contains("same GPU or rank"),
        "{all}"
    );
    assert!(errors.iter().all(|f| f["host"] == "node1"));
}

#[test]
fn topology_diagnoses() {
    let (_, dgx1) = doctor(&[
        "--topology",
        &topo("v100_dgx1_nv1nv2_mlx5x4_pytorch_ddp_benchmark_readme.txt"),
    ]);
    let tp = with(&dgx1, "tp-not-nvlink", "warn");
    assert!(
        text(tp[0]).contains("TP=4 inside the NVLink domains {0-3} {4-7}"),
        "{}",
        tp[0]
    );
    assert_eq!(with(&dgx1, "gpu-nic-affinity", "ok").len(), 1);

    let (_, l40s) = doctor(&[
        "--topology",
        &topo("l40s_x4_node_sys_mlx5x2_missalignment_106.txt"),
    ]);
    let tp = with(&l40s, "tp-not-nvlink", "warn");
    assert!(
        text(tp[0]).contains("SYS") && text(tp[0]).contains("{0,1} {2,3}"),
        "{}",
        tp[0]
    );
    assert_eq!(with(&l40s, "gpu-nic-affinity", "warn").len(), 1);

    let (_, a5000) = doctor(&[
        "--topology",
        &topo("a5000_pcie8_pxb_pix_sys_mlx5x2_tin6150_psg.txt"),
    ]);
    let tp = text(with(&a5000, "tp-not-nvlink", "warn")[0]);
    assert!(
        tp.contains("{2,3} {6,7} (PIX)") && tp.contains("TP=4 within {0-3} {4-7}"),
        "{tp}"
    );
    assert!(text(with(&a5000, "gpu-nic-affinity", "warn")[0]).contains("GPU 0-7"));

    let (_, rtx) = doctor(&[
        "--topology",
        &topo("rtx5090_x2_phb_p2p_gns_club3090_1229.txt"),
    ]);
    assert!(text(with(&rtx, "p2p", "warn")[0]).contains("GNS"));

    let (code, h20) = doctor(&["--topology", &topo("h20_sxm8_nv18_mlx5x8_sglang_9696.txt")]);
    assert_eq!(code, 0);
    assert!(h20.iter().all(|f| f["severity"] == "ok"), "{h20:?}");
}

#[test]
fn live_checks_on_a_fake_host() {
    let sysfs = FakeSysfs::new();
    sysfs.pci_device("pci0000:3a/0000:3a:02.0/0000:40:00.0", 0);
    sysfs.pci_device("pci0000:3a/0000:3a:03.0/0000:41:00.0", 0);
    sysfs.hca(
        "mlx5_0",
        "pci0000:3a/0000:3a:02.0/0000:40:00.0",
        &[FakePort {
            state: "1: DOWN",
            phys_state: "3: Disabled",
            rate: "400 Gb/sec (4X NDR)",
            link_layer: "InfiniBand",
            gids: &[],
        }],
    );
    sysfs.hca(
        "mlx5_1",
        "pci0000:3a/0000:3a:03.0/0000:41:00.0",
        &[FakePort {
            state: "4: ACTIVE",
            phys_state: "5: LinkUp",
            rate: "400 Gb/sec (4X NDR)",
            link_layer: "InfiniBand",
            gids: &[],
        }],
    );
    sysfs.netdev(
        "eno1",
        Some("pci0000:3a/0000:3a:03.0/0000:41:00.0"),
        "up",
        25000,
        1,
    );
    let root = sysfs.root().to_str().expect("UTF-8").to_string();
    let output = infer()
        .args(["doctor", "--json", "--sysfs-root", &root])
        .env("NCCL_SOCKET_IFNAME", "eth9")
        .env("NCCL_IB_HCA", "=mlx5_7")
        .env("NCCL_IB_DISABLE", "1")
        .env("MASTER_PORT", "0")
        .output()
        .expect("run");
    let (code, findings) = parse(output);
    assert_eq!(code, 1);
    let port = with(&findings, "ib-port", "error");
    assert_eq!(port.len(), 1);
    assert!(
        text(port[0]).contains("mlx5_0") && text(port[0]).contains("DOWN"),
        "{}",
        port[0]
    );
    let env: String = with(&findings, "nccl-env", "error")
        .iter()
        .map(|f| text(f))
        .collect();
    assert!(
        env.contains("NCCL_SOCKET_IFNAME=eth9") && env.contains("NCCL_IB_HCA==mlx5_7"),
        "{env}"
    );
    assert!(text(with(&findings, "nccl-env", "warn")[0]).contains("NCCL_IB_DISABLE=1"));
    assert!(!with(&findings, "nvml", "ok").is_empty());
    assert!(
        findings.iter().any(|f| f["check"] == "shm"),
        "the /dev/shm check runs"
    );
}

#[test]
fn this_machine_is_reported_honestly() {
    let output = run(&["doctor"]);
    let code = output.status.code().expect("exited");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(code == 0 || code == 1, "{stdout}");
    assert!(stdout.contains("nvml"), "{stdout}");
    if !std::path::Path::new("/proc/driver/nvidia/version").exists() {
        assert!(stdout.contains("no NVIDIA GPUs"), "{stdout}");
    }
    assert!(stdout.contains("error(s)"), "{stdout}");
}

#[test]
fn unreadable_log_exits_2() {
    let output = run(&["doctor", "--nccl-log", "/nonexistent/nccl.log"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("failed to read NCCL log `/nonexistent/nccl.log`")
    );
}

/// Writes `infer plan --json` output for `args` to a temp file.
fn saved_plan(dir: &std::path::Path, name: &str, args: &[&str]) -> String {
    let mut full = vec!["plan", "--json"];
    full.extend_from_slice(args);
    let output = run(&full);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = dir.join(name);
    std::fs::write(&path, &output.stdout).expect("write plan");
    path.to_str().expect("UTF-8").to_string()
}

#[test]
fn plan_checks_cross_node_tp_and_ep() {
    let dir = tempfile::tempdir().expect("temp dir");
    let good = saved_plan(
        dir.path(),
        "good.json",
        &[
            "--model",
            "llama-3.1-405b",
            "--cluster",
            "2x8xh100-sxm",
            "--objective",
            "latency",
        ],
    );
    let (code, findings) = doctor(&["--plan", &good]);
    assert_eq!(code, 0);
    assert_eq!(with(&findings, "cross-node-tp", "ok").len(), 1);
    assert_eq!(
        with(&findings, "pp-bubble", "ok").len(),
        1,
        "steady-state decode with PP2 keeps stages busy"
    );

    let stretched = saved_plan(
        dir.path(),
        "tp16.json",
        &[
            "--model",
            "llama-3.1-405b",
            "--cluster",
            "2x8xh100-sxm",
            "--tp",
            "16",
        ],
    );
    let (code, findings) = doctor(&["--plan", &stretched]);
    assert_eq!(code, 1);
    let error = with(&findings, "cross-node-tp", "error");
    assert!(
        error[0]["hint"]
            .as_str()
            .expect("hint")
            .contains("--tp 8 --pp 2"),
        "{}",
        error[0]
    );

    let moe = saved_plan(
        dir.path(),
        "ep.json",
        &[
            "--model",
            "qwen3-235b-a22b",
            "--cluster",
            "2x8xh100-sxm",
            "--tp",
            "2",
            "--ep",
            "16",
            "--max-model-len",
            "8192",
        ],
    );
    let (_, findings) = doctor(&["--plan", &moe]);
    assert_eq!(with(&findings, "ep-cross-node", "warn").len(), 1);
}

#[test]
fn pp_bubble_warns_above_thirty_percent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = saved_plan(
        dir.path(),
        "pp.json",
        &[
            "--model",
            "llama-3.1-405b",
            "--cluster",
            "2x8xh100-sxm",
            "--objective",
            "latency",
        ],
    );
    // The same plan with one sequence in flight: GPipe's (pp−1)/pp = 50% idle.
    let mut plan: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("JSON");
    plan["estimate"]["pp_bubble_fraction"] = serde_json::json!(0.5);
    std::fs::write(&path, plan.to_string()).expect("write");
    let (code, findings) = doctor(&["--plan", &path]);
    assert_eq!(code, 0, "a bubble is a warning, not an error");
    assert!(text(with(&findings, "pp-bubble", "warn")[0]).contains("50%"));
}

#[test]
fn plan_tp_groups_checked_against_the_topology() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dgx1 = topo("v100_dgx1_nv1nv2_mlx5x4_pytorch_ddp_benchmark_readme.txt");
    // A plan made without the topology (a shorthand assumes NVSwitch) puts TP8 on a DGX-1.
    let plan = saved_plan(
        dir.path(),
        "tp8.json",
        &[
            "--model",
            "llama-3.1-70b",
            "--cluster",
            "1x8xa100-sxm-80g",
            "--tp",
            "8",
        ],
    );
    let (_, findings) = doctor(&["--plan", &plan, "--topology", &dgx1]);
    let warnings: Vec<&Value> = with(&findings, "tp-not-nvlink", "warn");
    assert!(
        warnings
            .iter()
            .any(|f| text(f).contains("TP group [0, 1, 2, 3, 4, 5, 6, 7]")
                && text(f).contains("SYS")),
        "{warnings:?}"
    );
}

#[test]
fn malformed_plan_exits_2() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("plan.json");
    std::fs::write(&path, "{\"parallel\": 3}").expect("write");
    let output = run(&["doctor", "--plan", path.to_str().expect("UTF-8")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not `infer plan --json` output"));
}

#[test]
fn l40s_plan_checked_against_its_topology() {
    let dir = tempfile::tempdir().expect("temp dir");
    let l40s = topo("l40s_x4_node_sys_mlx5x2_missalignment_106.txt");
    let plan = saved_plan(
        dir.path(),
        "l40s.json",
        &[
            "--model",
            "llama-3.1-8b",
            "--cluster",
            "1x4xl40s",
            "--tp",
            "4",
            "--max-model-len",
            "8192",
        ],
    );
    let (_, findings) = doctor(&["--plan", &plan, "--topology", &l40s]);
    let warnings = with(&findings, "tp-not-nvlink", "warn");
    assert!(
        warnings
            .iter()
            .any(|f| text(f).contains("TP group [0, 1, 2, 3]") && text(f).contains("SYS")),
        "{warnings:?}"
    );
    assert_eq!(with(&findings, "cross-node-tp", "ok").len(), 1);
}

#[test]
fn plan_flags_build_and_check_a_plan() {
    let (code, findings) = doctor(&[
        "--model",
        "llama-3.1-405b",
        "--cluster",
        "2x8xh100-sxm",
        "--tp",
        "16",
    ]);
    assert_eq!(code, 1);
    assert_eq!(with(&findings, "cross-node-tp", "error").len(), 1);
    let (code, findings) = doctor(&["--model", "deepseek-v3", "--cluster", "1x8xh100-sxm"]);
    assert_eq!(code, 1);
    assert!(text(with(&findings, "plan", "error")[0]).contains("needs at least"));
    let (code, findings) = doctor(&[
        "--model",
        "llama-3.1-405b",
        "--cluster",
        "2x8xh100-sxm",
        "--objective",
        "latency",
    ]);
    assert_eq!(code, 0);
    assert_eq!(with(&findings, "cross-node-tp", "ok").len(), 1);
}

#[test]
fn nvlinks_down_in_a_probed_topology() {
    let dir = tempfile::tempdir().expect("temp dir");
    let h20 =
        std::fs::read_to_string(topo("h20_sxm8_nv18_mlx5x8_sglang_9696.txt")).expect("fixture");
    let mut topology = infer::topology::Topology::import(&h20, "h20").expect("import");
    for gpu in &mut topology.hosts[0].gpus {
        gpu.nvlinks_active = Some(if gpu.index == 5 { 12 } else { 18 });
        gpu.nvlinks_inactive = Some(if gpu.index == 5 { 6 } else { 0 });
    }
    let path = dir.path().join("h20.json");
    std::fs::write(&path, serde_json::to_string(&topology).expect("JSON")).expect("write");
    let (code, findings) = doctor(&["--topology", path.to_str().expect("UTF-8")]);
    assert_eq!(code, 1);
    let down = with(&findings, "nvlink-down", "error");
    assert_eq!(down.len(), 1);
    assert!(
        text(down[0]).contains("GPU5 has 12 active NVLinks, its peers have 18"),
        "{}",
        down[0]
    );
}

#[test]
fn plan_for_this_host_needs_its_gpus() {
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        return;
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("hostname")
        .trim()
        .to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    let inventory = dir.path().join("cluster.toml");
    std::fs::write(&inventory, format!("[[hosts]]\nname = \"{hostname}\"\naddress = \"127.0.0.1\"\ngpus = 8\nhardware = \"h100-sxm\"\n"))
        .expect("write");
    let plan = saved_plan(
        dir.path(),
        "here.json",
        &[
            "--model",
            "llama-3.1-8b",
            "--cluster",
            inventory.to_str().expect("UTF-8"),
        ],
    );
    let (code, findings) = doctor(&["--plan", &plan]);
    assert_eq!(code, 1);
    let nvml = with(&findings, "nvml", "error");
    assert!(
        text(nvml[0]).contains("places 8 GPU rank(s) on this host but NVML finds 0"),
        "{}",
        nvml[0]
    );
}

/// A log without NCCL output is never an all-clear: alone it is bad input (exit 2, saying
/// so); beside real logs it is a warning. One invalid UTF-8 byte in a real log changes
/// nothing about its diagnosis.
#[test]
fn logs_without_nccl_output_and_with_stray_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let empty = dir.path().join("empty.log");
    std::fs::write(&empty, "").expect("write");
    let readme = dir.path().join("README.md");
    std::fs::write(
        &readme,
        "# A project\n\nSet NCCL_SOCKET_IFNAME to your data NIC.\n",
    )
    .expect("write");
    for files in [vec![&empty], vec![&empty, &readme]] {
        let mut args = vec!["doctor".to_string()];
        for file in &files {
            args.push("--nccl-log".into());
            args.push(file.display().to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = run(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("no NCCL output in"), "{stderr}");
        assert!(stderr.contains("NCCL_DEBUG=INFO"), "{stderr}");
    }
    let real = log("socket_fallback_gcp_ens7_nccl_1267.txt");
    let (code, findings) = doctor(&[
        "--nccl-log",
        &real,
        "--nccl-log",
        &readme.display().to_string(),
    ]);
    let empty_warning = with(&findings, "nccl-output", "warn");
    assert_eq!(empty_warning.len(), 1, "{findings:?}");
    assert!(text(empty_warning[0]).contains("README.md"));
    let (real_code, real_findings) = doctor(&["--nccl-log", &real]);
    assert_eq!(code, real_code);
    assert_eq!(findings.len(), real_findings.len() + 1);

    // A stray byte (0xff) in the middle of a real log.
    let mut bytes = std::fs::read(&real).expect("read fixture");
    let middle = bytes.len() / 2;
    let at = middle
        + bytes[middle..]
            .iter()
            .position(|&b| b == b'\n')
            .expect("newline");
    bytes.insert(at, 0xff);
    let damaged = dir.path().join("damaged.log");
    std::fs::write(&damaged, &bytes).expect("write");
    let (damaged_code, damaged_findings) = doctor(&["--nccl-log", &damaged.display().to_string()]);
    assert_eq!(damaged_code, real_code);
    let checks = |findings: &[Value]| -> Vec<(String, String)> {
        findings
            .iter()
            .map(|f| (f["check"].to_string(), f["severity"].to_string()))
            .collect()
    };
    assert_eq!(checks(&damaged_findings), checks(&real_findings));
}
