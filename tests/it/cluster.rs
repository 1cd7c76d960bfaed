//! Multi-host runs over SSH on a real test cluster built by the tests themselves
//! ([`TestCluster`]: network namespaces ("hosts"), each with its own OpenSSH `sshd`, joined
//! by a management and a data bridge, with different NIC names per host). The launcher runs
//! in the root namespace, which is on the management network only.
//!
//! These need root, `ip`, `unshare` and `sshd`: in CI (`CI` set) or with
//! `INFER_TEST_HARDWARE=1` a missing one fails the test; elsewhere the test returns early.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::cluster::{TestCluster, missing_requirement};
use crate::support::process::{alive, infer, run, run_manifest, run_with_stdin, signal, wait_exit};
use crate::support::synthetic::write_tp2_model;

/// `infer generate --json` over the cluster (or locally with `inventory` `None`).
fn generate(inventory: Option<&Path>, args: &[&str]) -> Output {
    let mut command = infer();
    command.args(["generate", "--json"]);
    if let Some(inventory) = inventory {
        command.arg("--cluster").arg(inventory);
    }
    command.args(args).output().expect("run infer")
}

fn tokens_of(output: &Output) -> Vec<u64> {
    assert_eq!(
        output.status.code(),
        Some(0),
        "stderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    json["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn generation_over_two_hosts_gives_the_single_process_tokens() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 3) else {
        return;
    };
    cluster.trust_hosts();
    let prompt = ["--prompt", "def fibonacci(n):", "--max-tokens", "24"];
    let reference = tokens_of(&generate(None, &prompt));
    for layout in [&["--pp", "2"][..], &["--tp", "3", "--pp", "2"][..]] {
        let args: Vec<&str> = prompt.iter().chain(layout).copied().collect();
        // A stranger on h1 races the run for every port h1's ranks listen on while their
        // groups form: it takes no slot, and the tokens are the single process's.
        let racer = cluster.racer(1);
        let output = generate(Some(&cluster.inventory), &args);
        let reached = racer.stop();
        assert_eq!(tokens_of(&output), reference, "{layout:?}");
        assert!(!reached.is_empty(), "the racer reached no port of h1");
        // Each host's ranks got that host's own data interface, and MASTER_ADDR is rank
        // 0's host on the data network.
        let manifest = run_manifest(&stderr(&output));
        for rank in manifest["ranks"].as_array().expect("ranks") {
            let host = &cluster.hosts[usize::from(rank["host"] == "h1")];
            assert_eq!(rank["host"], host.name.as_str());
            assert_eq!(
                rank["env"]["NCCL_SOCKET_IFNAME"],
                format!("={}", host.data_nic).as_str()
            );
            assert_eq!(rank["env"]["GLOO_SOCKET_IFNAME"], host.data_nic.as_str());
            assert_eq!(rank["env"]["INFER_BIND_ADDR"], host.data.as_str());
            assert_eq!(rank["env"]["MASTER_ADDR"], cluster.hosts[0].data.as_str());
        }
        let text = stderr(&output);
        assert!(text.contains("[h0 r0]") && text.contains("[h1 r"), "{text}");
    }
    // The interfaces really differ by host.
    assert_ne!(cluster.hosts[0].data_nic, cluster.hosts[1].data_nic);
    // Bus bandwidth between the hosts, as nccl-tests prints it.
    let output = infer()
        .args([
            "bench",
            "allreduce",
            "--world",
            "4",
            "--max-bytes",
            "1048576",
            "--cluster",
        ])
        .arg(&cluster.inventory)
        .output()
        .expect("run infer");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        table.contains("4 processes on hosts h0, h1 over the data network"),
        "{table}"
    );
    assert!(
        table.contains("# one 8-byte send/recv, rank 0 to rank 1"),
        "{table}"
    );
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 18, "{table}");
    let last: Vec<f64> = rows[17]
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    assert_eq!(last[0], 1048576.0, "{table}");
    assert!(last[4] > 0.0, "busbw {table}");
}

#[test]
fn host_keys_auth_and_addresses_are_checked_before_anything_starts() {
    crate::support::model::smollm2();
    // The host says it is an `aarch64` machine (`uname -m`); our own binary is visible to
    // it at the launcher's path, so only staging asks.
    let Some(cluster) = TestCluster::start_with(1, 1, Some("aarch64")) else {
        return;
    };
    let args = ["--prompt", "1, 2, 3,", "--max-tokens", "2"];
    // Unknown key: refused with its fingerprint and the command to trust it.
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("is not known") && text.contains("SHA256:") && text.contains("ssh-keyscan"),
        "{text}"
    );
    assert!(text.contains("nothing was started"), "{text}");
    let known_hosts = cluster.dir.join("known_hosts");
    assert_eq!(
        std::fs::read_to_string(&known_hosts).expect("known_hosts"),
        ""
    );
    // --ssh-accept-new trusts it and records it.
    let mut accepted: Vec<&str> = args.to_vec();
    accepted.push("--ssh-accept-new");
    tokens_of(&generate(Some(&cluster.inventory), &accepted));
    let recorded = std::fs::read_to_string(&known_hosts).expect("known_hosts");
    assert!(
        recorded
            .trim_start()
            .starts_with(&format!("{} ssh-ed25519 ", cluster.hosts[0].management)),
        "{recorded}"
    );
    // A changed key is refused, even with --ssh-accept-new.
    let other = cluster.dir.join("other_key");
    let keygen = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&other)
        .status()
        .expect("ssh-keygen");
    assert!(keygen.success());
    let other_public = std::fs::read_to_string(other.with_extension("pub")).expect("key");
    let fields: Vec<&str> = other_public.split_whitespace().collect();
    std::fs::write(
        &known_hosts,
        format!(
            "{} {} {}\n",
            cluster.hosts[0].management, fields[0], fields[1]
        ),
    )
    .expect("known_hosts");
    let output = generate(Some(&cluster.inventory), &accepted);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("CHANGED")
            && text.contains("host key changed")
            && text.contains("ssh-keygen -R"),
        "{text}"
    );
    cluster.trust_hosts();
    // No `infer` at the inventory's path and a host of another architecture: nothing to
    // stage there.
    cluster.edit_inventory(|text| {
        text.replace(
            "cpu-ranks = 1",
            "cpu-ranks = 1\ninfer-path = \"/nonexistent/infer\"",
        )
    });
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("binary arch") && text.contains("`aarch64`") && text.contains("infer-path"),
        "{text}"
    );
    cluster.edit_inventory(|text| text.replace("\ninfer-path = \"/nonexistent/infer\"", ""));
    // An interface the inventory names that the host does not have.
    cluster.edit_inventory(|text| {
        text.replace(
            "cpu-ranks = 1",
            "cpu-ranks = 1\nnccl-socket-ifname = \"ib0\"",
        )
    });
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("interface `ib0`") && text.contains("on `h0`") && text.contains("eno1"),
        "{text}"
    );
    cluster.edit_inventory(|text| text.replace("\nnccl-socket-ifname = \"ib0\"", ""));
    // Auth refused: a key the host does not authorize.
    cluster.edit_inventory(|text| {
        let key = cluster.dir.join("client_ed25519").display().to_string();
        text.replace(&key, &other.display().to_string())
    });
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("auth refused") && text.contains("refused authentication as `root`"),
        "{text}"
    );
    // Unknown host, refused port, and a host string that would read as an option.
    let management = cluster.hosts[0].management.clone();
    for (address, port, expected) in [
        ("no-such-host.invalid", 22, "cannot resolve"),
        (management.as_str(), 2, "refused the connection"),
        ("-oProxyCommand=touch /tmp/pwned", 22, "starts with `-`"),
    ] {
        cluster.edit_inventory(|text| {
            let start = text.find("[[hosts]]").expect("a host");
            format!(
                "{}[[hosts]]\nname = \"h0\"\naddress = \"{address}\"\nport = {port}\ncpu-ranks = 1\n",
                &text[..start]
            )
        });
        let output = generate(Some(&cluster.inventory), &args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{address}: {text}");
        assert!(text.contains(expected), "{address}: {text}");
    }
    assert!(!Path::new("/tmp/pwned").exists());
}

#[test]
fn a_host_known_under_a_key_of_another_algorithm_is_refused_even_with_accept_new() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(1, 1) else {
        return;
    };
    // The host is known by an ECDSA key; its sshd has only an Ed25519 one.
    let ecdsa = cluster.dir.join("old_ecdsa_key");
    let keygen = Command::new("ssh-keygen")
        .args(["-q", "-t", "ecdsa", "-N", "", "-f"])
        .arg(&ecdsa)
        .status()
        .expect("ssh-keygen");
    assert!(keygen.success());
    let public = std::fs::read_to_string(ecdsa.with_extension("pub")).expect("key");
    let fields: Vec<&str> = public.split_whitespace().collect();
    assert_eq!(fields[0], "ecdsa-sha2-nistp256");
    let known_hosts = cluster.dir.join("known_hosts");
    let recorded = format!(
        "# kept by hand\n{} {} {}\n",
        cluster.hosts[0].management, fields[0], fields[1]
    );
    std::fs::write(&known_hosts, &recorded).expect("known_hosts");
    let args = ["--prompt", "1, 2, 3,", "--max-tokens", "2"];
    for accept_new in [true, false] {
        let mut args = args.to_vec();
        if accept_new {
            args.push("--ssh-accept-new");
        }
        let output = generate(Some(&cluster.inventory), &args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(
            text.contains("host key algorithm")
                && text.contains("presented an ssh-ed25519 key")
                && text.contains(&format!(
                    "line 2 of `{}` knows it by an ecdsa-sha2-nistp256 key",
                    known_hosts.display()
                ))
                && text.contains(&format!(
                    "ssh-keygen -R {} -f {}",
                    cluster.hosts[0].management,
                    known_hosts.display()
                ))
                && text.contains("nothing was started"),
            "{text}"
        );
        assert!(!text.contains("is not known"), "{text}");
        // Nothing recorded.
        assert_eq!(
            std::fs::read_to_string(&known_hosts).expect("known_hosts"),
            recorded
        );
    }
    // The fix the message names: remove the old key, then --ssh-accept-new records the
    // host's own.
    let removed = Command::new("ssh-keygen")
        .args(["-q", "-R", &cluster.hosts[0].management, "-f"])
        .arg(&known_hosts)
        .output()
        .expect("ssh-keygen -R");
    assert!(removed.status.success(), "{removed:?}");
    let mut accepted = args.to_vec();
    accepted.push("--ssh-accept-new");
    tokens_of(&generate(Some(&cluster.inventory), &accepted));
    let now = std::fs::read_to_string(&known_hosts).expect("known_hosts");
    assert!(
        now.contains(&format!("{} ssh-ed25519 ", cluster.hosts[0].management)),
        "{now}"
    );
}

#[test]
fn a_remote_binary_others_could_write_or_of_another_build_is_never_run() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(1, 1) else {
        return;
    };
    cluster.trust_hosts();
    // A program at the inventory's `infer-path` that leaves a mark when it runs, then runs
    // `infer` (so it answers as an agent of another build: it is not our file).
    let marker = cluster.dir.join("it-ran");
    let write_fake = |path: &Path, mode: u32| {
        std::fs::write(
            path,
            format!(
                "#!/bin/sh\ntouch {}\nexec {} \"$@\"\n",
                marker.display(),
                env!("CARGO_BIN_EXE_infer")
            ),
        )
        .expect("write");
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .expect("chmod");
    };
    let fake = cluster.dir.join("fake-infer");
    cluster.edit_inventory(|text| {
        text.replace(
            "cpu-ranks = 1",
            &format!("cpu-ranks = 1\ninfer-path = \"{}\"", fake.display()),
        )
    });
    let args = ["--prompt", "1, 2, 3,", "--max-tokens", "2"];
    // Writable by others: refused before it runs, with the fix.
    for mode in [0o777, 0o775] {
        write_fake(&fake, mode);
        let output = generate(Some(&cluster.inventory), &args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(
            text.contains("binary")
                && text.contains(&format!("mode {mode:04o}"))
                && text.contains(&format!("chmod go-w {}", fake.display()))
                && text.contains("nothing was started"),
            "{text}"
        );
        assert!(!marker.exists(), "the writable program ran");
    }
    // In a directory others can write (no sticky bit): refused too.
    let shared = cluster.dir.join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let in_shared = shared.join("infer");
    write_fake(&in_shared, 0o755);
    let link = cluster.dir.join("link-to-shared");
    std::os::unix::fs::symlink(&in_shared, &link).expect("symlink");
    let original = std::fs::read_to_string(&cluster.inventory).expect("inventory");
    std::fs::write(
        &cluster.inventory,
        original.replace(&fake.display().to_string(), &link.display().to_string()),
    )
    .expect("inventory");
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains(&format!("`{}` (`{}`)", link.display(), in_shared.display()))
            && text.contains(&format!("chmod go-w {}", shared.display())),
        "{text}"
    );
    assert!(!marker.exists(), "the program in a shared directory ran");
    std::fs::write(&cluster.inventory, &original).expect("inventory");
    // Owner and mode right, but not this build: not run; this build is staged and runs.
    write_fake(&fake, 0o755);
    let output = generate(Some(&cluster.inventory), &args);
    tokens_of(&output);
    assert!(
        !marker.exists(),
        "another build ran where this one is required"
    );
    let manifest = run_manifest(&stderr(&output));
    let staged = manifest["hosts"][0]["infer"].as_str().expect("infer path");
    assert!(staged.contains("/.cache/infer/bin/infer-"), "{staged}");
    // A probe takes any build whose owner and mode are right: that one runs (so the mark
    // above would have shown a run).
    let output = infer()
        .args(["topo", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .output()
        .expect("run infer");
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(marker.exists(), "the probe ran the checked program");
}

#[test]
fn twelve_ranks_on_one_host_with_a_staged_binary_and_a_pushed_model() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(1, 12) else {
        return;
    };
    cluster.trust_hosts();
    // No `infer` at the inventory's path on the host: the launcher stages its own.
    cluster.edit_inventory(|text| {
        text.replace(
            "cpu-ranks = 12",
            "cpu-ranks = 12\ninfer-path = \"/nonexistent/infer\"",
        )
    });
    // The model at a path the host does not have (its own empty tmpfs there).
    let model = cluster.dir.join("private/model.gguf");
    std::fs::copy(crate::support::model::smollm2(), &model).expect("copy");
    let model_arg = model.display().to_string();
    let args = [
        "--prompt",
        "1, 2, 3, 4, 5,",
        "--max-tokens",
        "8",
        "--tp",
        "3",
        "--pp",
        "4",
        "--model",
        &model_arg,
    ];
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("model missing") && text.contains("--push-model"),
        "{text}"
    );
    let mut pushed: Vec<&str> = args.to_vec();
    pushed.push("--push-model");
    // Twelve ranks on one host: one exec channel for the agent, not one per rank
    // (OpenSSH's MaxSessions is 10).
    let output = generate(Some(&cluster.inventory), &pushed);
    let reference = generate(None, &args[..8]);
    assert_eq!(tokens_of(&output), tokens_of(&reference));
    let manifest = run_manifest(&stderr(&output));
    assert_eq!(manifest["ranks"].as_array().expect("ranks").len(), 12);
    let staged = manifest["hosts"][0]["infer"].as_str().expect("infer path");
    assert!(staged.contains("/.cache/infer/bin/infer-"), "{staged}");
    assert_eq!(
        manifest["hosts"][0]["infer_sha256"],
        infer::launch::agent::sha256_file(Path::new(env!("CARGO_BIN_EXE_infer")))
            .expect("sha")
            .expect("exists")
            .0
            .as_str()
    );
}

/// A long generation over the cluster, running until the test stops it: the launcher, and
/// its manifest once every rank has loaded.
fn start_long_generation(
    cluster: &TestCluster,
) -> (Child, Value, std::sync::mpsc::Receiver<String>) {
    let mut child = infer()
        .args([
            "generate",
            "--prompt",
            "1, 2, 3,",
            "--max-tokens",
            "100000",
            "--pp",
            "2",
            "--cluster",
        ])
        .arg(&cluster.inventory)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start infer");
    let stderr = child.stderr.take().expect("stderr");
    let (sender, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    let mut manifest = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => {
                if line.contains("manifest.json in ") {
                    manifest = Some(line.clone());
                }
                let loaded = line.contains("2/2 ranks loaded");
                seen.push(line);
                if loaded {
                    break;
                }
            }
            Err(_) if matches!(child.try_wait(), Ok(Some(_))) => break,
            Err(_) => {}
        }
    }
    let manifest = manifest.unwrap_or_else(|| panic!("no manifest; stderr:\n{}", seen.join("\n")));
    (child, run_manifest(&manifest), lines)
}

/// Every line the launcher wrote, up to its end (the reader thread stops at EOF), so the
/// last error line is there even if the launcher exited a moment ago.
fn drain(lines: std::sync::mpsc::Receiver<String>) -> String {
    let mut text = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        text.push(line);
    }
    text.join("\n")
}

fn rank_pids(manifest: &Value) -> Vec<(String, u32)> {
    manifest["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            (
                r["host"].as_str().expect("host").to_string(),
                r["pid"].as_u64().expect("pid") as u32,
            )
        })
        .collect()
}

fn wait_gone(pids: &[(String, u32)], within: Duration) -> Option<Vec<(String, u32)>> {
    let deadline = Instant::now() + within;
    loop {
        let left: Vec<(String, u32)> = pids
            .iter()
            .filter(|(_, pid)| alive(*pid))
            .cloned()
            .collect();
        if left.is_empty() {
            return None;
        }
        if Instant::now() >= deadline {
            return Some(left);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_killed_launcher_leaves_no_remote_rank_and_another_run_keeps_going() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 2) else {
        return;
    };
    cluster.trust_hosts();
    let (mut first, first_manifest, _first_lines) = start_long_generation(&cluster);
    let (mut second, second_manifest, second_lines) = start_long_generation(&cluster);
    // The pipeline's activations travel between the hosts' data addresses: h1 has an
    // established connection to h0's data address (and none to its management address
    // but SSH).
    cluster.assert_data_connection(1, 0);
    let first_pids = rank_pids(&first_manifest);
    let second_pids = rank_pids(&second_manifest);
    assert!(
        first_pids
            .iter()
            .chain(&second_pids)
            .all(|(_, pid)| alive(*pid))
    );
    // kill -9 of the first launcher: its remote ranks are gone within 3 s (stdin EOF at
    // each agent), the second run's ranks are untouched.
    first.kill().expect("kill -9");
    let _ = first.wait();
    let killed_at = Instant::now();
    assert_eq!(
        wait_gone(&first_pids, Duration::from_secs(3)),
        None,
        "ranks left after kill -9"
    );
    let teardown = killed_at.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        second_pids.iter().all(|(_, pid)| alive(*pid)),
        "the other run lost ranks"
    );
    assert!(
        matches!(second.try_wait(), Ok(None)),
        "the other run stopped"
    );
    // `infer agent --kill RUN_ID` on a host stops exactly that run's ranks there; the
    // launcher then fails, naming the rank and its host.
    let run_id = second_manifest["run_id"].as_str().expect("run id");
    let killed = Command::new("ip")
        .args(["netns", "exec", &cluster.hosts[1].namespace])
        .arg(env!("CARGO_BIN_EXE_infer"))
        .args(["agent", "--kill", run_id, "--host", "h1"])
        .output()
        .expect("infer agent --kill");
    assert!(
        String::from_utf8_lossy(&killed.stderr).contains("stopped 1 rank"),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let status = wait_exit(&mut second, Duration::from_secs(10)).expect("the launcher exits");
    let text = drain(second_lines);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(text.contains("rank 1 on `h1`"), "{text}");
    assert_eq!(wait_gone(&second_pids, Duration::from_secs(3)), None);
    assert!(teardown < Duration::from_secs(3), "{teardown:?}");
}

#[test]
fn a_killed_remote_rank_or_a_partitioned_host_takes_the_gang_down_naming_it() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    // A rank killed on h1.
    let (mut launcher, manifest, lines) = start_long_generation(&cluster);
    let pids = rank_pids(&manifest);
    let (_, victim) = pids
        .iter()
        .find(|(host, _)| host == "h1")
        .cloned()
        .expect("a rank on h1");
    signal(victim, rustix::process::Signal::KILL);
    let status =
        wait_exit(&mut launcher, Duration::from_secs(5)).expect("the launcher exits within 5 s");
    assert_eq!(status.code(), Some(2));
    let text = drain(lines);
    assert!(
        text.contains("rank 1 on `h1`") && text.contains("signal: 9"),
        "{text}"
    );
    assert_eq!(wait_gone(&pids, Duration::from_secs(3)), None);
    // The data link of h1 goes down: its rank can no longer reach the store (nor its peer)
    // on rank 0's host; the launcher names the host and the data network.
    let (mut launcher, manifest, lines) = start_long_generation(&cluster);
    let pids = rank_pids(&manifest);
    let data_link = format!(
        "{}d",
        &cluster.management_link(1)[..cluster.management_link(1).len() - 1]
    );
    let down = Command::new("ip")
        .args(["link", "set", "dev", &data_link, "down"])
        .status()
        .expect("ip");
    assert!(down.success());
    let status = wait_exit(&mut launcher, Duration::from_secs(12)).expect("the launcher exits");
    assert_eq!(status.code(), Some(2));
    let text = drain(lines);
    assert!(
        text.contains("`h1`") && text.contains("data network"),
        "{text}"
    );
    assert_eq!(wait_gone(&pids, Duration::from_secs(3)), None);
    let up = Command::new("ip")
        .args(["link", "set", "dev", &data_link, "up"])
        .status()
        .expect("ip");
    assert!(up.success());
    // The management link of h1 goes down (a partition between the launcher and h1): the
    // launcher names h1 and exits non-zero; h1's agent stops its rank within the lease.
    let (mut launcher, manifest, lines) = start_long_generation(&cluster);
    let pids = rank_pids(&manifest);
    let link = cluster.management_link(1);
    let down = Command::new("ip")
        .args(["link", "set", "dev", &link, "down"])
        .status()
        .expect("ip");
    assert!(down.success());
    let cut_at = Instant::now();
    let status = wait_exit(&mut launcher, Duration::from_secs(15)).expect("the launcher exits");
    assert_ne!(status.code(), Some(0));
    let text = drain(lines);
    assert!(text.contains("`h1`"), "{text}");
    let lease = infer::launch::remote::LEASE + infer::launch::GRACE_PERIOD + Duration::from_secs(2);
    assert_eq!(
        wait_gone(&pids, lease.saturating_sub(cut_at.elapsed())),
        None,
        "h1's rank outlived the lease"
    );
}

/// `infer up --cluster hosts.toml --dp 2`: one replica per host, rank 0's router sends
/// requests to both (over the data network), this launcher serves the port (forwarded to
/// rank 0 over SSH), and the official `openai` client gets `infer generate`'s text.
#[test]
fn up_over_two_hosts_serves_routes_to_both_and_answers_the_openai_client() {
    use crate::support::server::{
        Server, assert_every_replica_routed, generate_counting, run_openai_client,
    };
    use serde_json::json;
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 2) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    // A port in use is refused before anything starts anywhere.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port().to_string();
    let output = infer()
        .args(["up", "--cluster", &inventory, "--dp", "2", "--port", &port])
        .output()
        .expect("run infer");
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("the port is already in use"),
        "{}",
        stderr(&output)
    );
    assert!(
        !stderr(&output).contains("connected"),
        "{}",
        stderr(&output)
    );
    drop(taken);
    // Served beyond loopback (the launcher forwards to rank 0, which listens on h0's
    // loopback): a request naming the server's public name is answered.
    // A stranger on h1 races the run for the port replica 1's rank listens on for its
    // router link: it takes no slot, and both replicas serve.
    let racer = cluster.racer(1);
    let mut server = Server::start(&["--cluster", &inventory, "--dp", "2", "--host", "0.0.0.0"]);
    // Replica 1 stops listening once the router has proved itself: the stranger reached
    // its router link while that was being set up.
    let reached = racer.stop();
    assert!(!reached.is_empty(), "the racer reached no port of h1");
    let ranks = server.rank_pids();
    assert_eq!(ranks.len(), 2, "{}", server.startup);
    {
        use std::io::{Read, Write};
        let address = server
            .url
            .trim_start_matches("http://")
            .replace("0.0.0.0", "127.0.0.1");
        let mut stream = std::net::TcpStream::connect(&address).expect("connect");
        write!(
            stream,
            "GET /v1/models HTTP/1.1\r\nHost: inference.example:8000\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("read");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }
    let manifest = run_manifest(&server.startup);
    assert_eq!(manifest["ranks"][0]["host"], "h0");
    assert_eq!(manifest["ranks"][1]["host"], "h1");
    let reference = generate_counting();
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let prompt = if i % 2 == 0 {
                "1, 2, 3, 4, 5,"
            } else {
                "Once upon a time"
            };
            json!({"prompt": prompt, "max_tokens": 16, "temperature": 0})
        })
        .collect();
    for (i, (status, body)) in server
        .post_all("/v1/completions", &bodies)
        .iter()
        .enumerate()
    {
        assert_eq!(*status, 200, "{body}");
        if i % 2 == 0 {
            assert_eq!(body["choices"][0]["text"], reference["text"], "{body}");
        }
    }
    let metrics = server.metrics();
    assert_every_replica_routed(&metrics, 2);
    // The router's connection to replica 1 runs between the data addresses.
    cluster.assert_data_connection(1, 0);
    // The collectives and the router need only the data network: with h1's management
    // link down for a moment (shorter than the launcher's 5 s patience), requests that
    // rank 0 routes to h1's replica still complete.
    let routed_to_h1 = |metrics: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("infer_dp_requests_routed_total{replica=\"1\"} "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let before = routed_to_h1(&server.metrics());
    let link = cluster.management_link(1);
    assert!(
        Command::new("ip")
            .args(["link", "set", "dev", &link, "down"])
            .status()
            .expect("ip")
            .success()
    );
    let cut = Instant::now();
    let results = server.post_all("/v1/completions", &bodies);
    let during = routed_to_h1(&server.metrics());
    let cut_for = cut.elapsed();
    assert!(
        Command::new("ip")
            .args(["link", "set", "dev", &link, "up"])
            .status()
            .expect("ip")
            .success()
    );
    assert!(
        cut_for < Duration::from_secs(4),
        "the requests took {cut_for:?}"
    );
    for (status, body) in &results {
        assert_eq!(*status, 200, "{body}");
    }
    assert!(
        during > before,
        "no request reached h1's replica while its management link was down"
    );
    std::thread::sleep(Duration::from_secs(2));
    let got = run_openai_client(&server.url);
    assert_eq!(got["completion_text"], reference["text"], "{got}");
    assert_eq!(got["streamed_text"], reference["text"], "{got}");
    // A second run on the same hosts; kill -9 of the first launcher takes only the first
    // run's ranks, and the second keeps serving.
    let mut second = Server::start(&["--cluster", &inventory, "--dp", "2"]);
    let second_ranks = second.rank_pids();
    server.child.kill().expect("kill -9");
    let _ = server.child.wait();
    let first: Vec<(String, u32)> = ranks.iter().map(|p| (String::new(), *p)).collect();
    assert_eq!(
        wait_gone(&first, Duration::from_secs(3)),
        None,
        "ranks left after kill -9"
    );
    let (status, body) = second.post("/v1/completions", &bodies[0]);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], reference["text"], "{body}");
    // Ctrl-C (SIGINT) of the second launcher: exit 0, every remote rank gone.
    signal(second.child.id(), rustix::process::Signal::INT);
    let status = wait_exit(&mut second.child, Duration::from_secs(10)).expect("infer up exits");
    assert_eq!(status.code(), Some(0));
    let pids: Vec<(String, u32)> = second_ranks.iter().map(|p| (String::new(), *p)).collect();
    assert_eq!(
        wait_gone(&pids, Duration::from_secs(3)),
        None,
        "ranks left after Ctrl-C"
    );
}

/// The host of each of `ranks[]` in a plan's or a run manifest's JSON, in rank order.
fn rank_hosts(value: &Value) -> Vec<&Value> {
    value["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| &r["host"])
        .collect()
}

/// `infer up --cluster hosts.toml` without `--tp/--pp/--dp` on hosts of CPU ranks probes each
/// host's CPU over SSH and launches the plan `infer plan --cluster hosts.toml --probe-hosts`
/// makes for them: its layout, each rank on the host the plan put it on; and it answers as
/// `infer generate` does. See: #40
#[test]
fn up_over_cpu_rank_hosts_launches_their_plan() {
    use crate::support::server::{Server, generate_counting};
    use serde_json::json;
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 2) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    // Both plan with each host's CPU as probed there over SSH.
    let output = run(&["plan", "--cluster", &inventory, "--probe-hosts", "--json"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    assert_eq!(plan["device"], "cpu", "{plan}");
    let server = Server::start(&["--cluster", &inventory]);
    assert!(
        server.startup.contains(&format!(
            "probing the CPU of each host of `{inventory}` over SSH"
        )),
        "{}",
        server.startup
    );
    // The layout `infer up` planned, from its startup line.
    let prefix = format!("the plan for `{inventory}`: ");
    let launched = server
        .startup
        .lines()
        .find_map(|l| l.split_once(&prefix).map(|(_, rest)| rest.to_string()))
        .unwrap_or_else(|| panic!("no plan line: {}", server.startup));
    let degrees: Vec<u64> = ["tp", "pp", "dp"]
        .iter()
        .map(|k| {
            launched
                .split(&format!("{k} "))
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|degree| degree.parse().ok())
                .unwrap_or_else(|| panic!("no {k} in `{launched}`"))
        })
        .collect();
    // Whether a JSON `parallel` is `infer up`'s layout.
    let is_launched = |parallel: &Value| {
        ["tp", "pp", "dp"]
            .iter()
            .zip(&degrees)
            .all(|(k, d)| parallel[*k].as_u64() == Some(*d))
    };
    let same = is_launched(&plan["parallel"]);
    // Each probe times the hosts anew: two layouts of nearly the same throughput may swap
    // between the two plans. Then `infer up`'s must be one `infer plan` costed within 15% of
    // its choice, placed as `infer plan` pinned to it places it.
    let placed = if same {
        plan.clone()
    } else {
        let chosen = plan["estimate"]["tokens_per_sec"]
            .as_f64()
            .expect("tokens/s");
        let alternative = plan["alternatives"]
            .as_array()
            .expect("alternatives")
            .iter()
            .find(|a| is_launched(&a["parallel"]))
            .unwrap_or_else(|| panic!("`{launched}` is not among {plan}"));
        let tokens = alternative["tokens_per_sec"].as_f64().unwrap_or(0.0);
        assert!(
            alternative["feasible"] == true && tokens >= 0.85 * chosen,
            "`{launched}` against the plan's {chosen} tokens/s: {alternative}"
        );
        let [tp, pp, dp] = [0, 1, 2].map(|i| degrees[i].to_string());
        let pinned = run(&[
            "plan",
            "--cluster",
            &inventory,
            "--probe-hosts",
            "--json",
            "--tp",
            &tp,
            "--pp",
            &pp,
            "--dp",
            &dp,
        ]);
        assert!(pinned.status.success(), "{}", stderr(&pinned));
        serde_json::from_slice(&pinned.stdout).expect("plan JSON")
    };
    let planned_hosts = rank_hosts(&placed);
    let manifest = run_manifest(&server.startup);
    let launched_hosts = rank_hosts(&manifest);
    assert_eq!(launched_hosts, planned_hosts, "{manifest}");
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], generate_counting()["text"]);
}

/// `~/.ssh/config` is read (HostName, User, ProxyJump): a host whose sshd the launcher
/// cannot reach (it listens where only the data network goes) is reached through a bastion
/// on the management network; and ssh-agent's key authenticates when the inventory names no
/// identity file.
#[test]
fn proxy_jump_through_a_bastion_and_ssh_agent_keys_work() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    // Known keys of h1 under its data address too (what the jump reaches it by).
    let listing = std::fs::read_to_string(cluster.dir.join("hosts.txt")).expect("hosts.txt");
    let h1: Vec<&str> = listing
        .lines()
        .nth(1)
        .expect("h1")
        .split_whitespace()
        .collect();
    let mut known = std::fs::read_to_string(cluster.dir.join("known_hosts")).expect("known_hosts");
    known.push_str(&format!("{} {} {}\n", h1[3], h1[6], h1[7]));
    std::fs::write(cluster.dir.join("known_hosts"), known).expect("known_hosts");
    let home = cluster.dir.join("home");
    std::fs::create_dir_all(home.join(".ssh")).expect("home");
    std::fs::write(
        home.join(".ssh/config"),
        format!(
            "Host h1-behind-bastion\n    HostName {}\n    User root\n    ProxyJump root@{}\n",
            cluster.hosts[1].data, cluster.hosts[0].management
        ),
    )
    .expect("ssh config");
    std::fs::write(
        &cluster.inventory,
        format!(
            "[defaults]\nidentity-file = \"{}\"\nknown-hosts = \"{}\"\n\n[[hosts]]\nname = \"h1\"\naddress = \"h1-behind-bastion\"\ncpu-ranks = 1\n",
            cluster.dir.join("client_ed25519").display(),
            cluster.dir.join("known_hosts").display()
        ),
    )
    .expect("inventory");
    // The launcher cannot reach h1's sshd directly.
    let direct = format!("{}:22", cluster.hosts[1].data)
        .parse()
        .expect("address");
    assert!(std::net::TcpStream::connect_timeout(&direct, Duration::from_secs(1)).is_err());
    let args = ["--prompt", "1, 2, 3,", "--max-tokens", "4"];
    let mut command = infer();
    command
        .env("HOME", &home)
        .args(["generate", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .args(args);
    let through_bastion = command.output().expect("run infer");
    let reference = generate(None, &args);
    assert_eq!(tokens_of(&through_bastion), tokens_of(&reference));
    let manifest = run_manifest(&stderr(&through_bastion));
    assert_eq!(manifest["hosts"][0]["name"], "h1");
    assert_eq!(manifest["ranks"][0]["host"], "h1");

    // ssh-agent: no identity file anywhere, the key is in the agent.
    let socket = cluster.dir.join("agent.sock");
    let mut agent = Command::new("ssh-agent")
        .arg("-D")
        .arg("-a")
        .arg(&socket)
        .stdout(Stdio::null())
        .spawn()
        .expect("ssh-agent");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "ssh-agent never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let added = Command::new("ssh-add")
        .arg(cluster.dir.join("client_ed25519"))
        .env("SSH_AUTH_SOCK", &socket)
        .output()
        .expect("ssh-add");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    std::fs::write(
        &cluster.inventory,
        format!(
            "[[hosts]]\nname = \"h0\"\naddress = \"{}\"\nuser = \"root\"\nknown-hosts = \"{}\"\ncpu-ranks = 1\n",
            cluster.hosts[0].management,
            cluster.dir.join("known_hosts").display()
        ),
    )
    .expect("inventory");
    let run_with = |sock: Option<&Path>| {
        let mut command = infer();
        command.env("HOME", &home).env_remove("SSH_AUTH_SOCK");
        if let Some(sock) = sock {
            command.env("SSH_AUTH_SOCK", sock);
        }
        command
            .args(["generate", "--json", "--cluster"])
            .arg(&cluster.inventory)
            .args(args)
            .output()
            .expect("run infer")
    };
    let without = run_with(None);
    assert_eq!(without.status.code(), Some(2), "{}", stderr(&without));
    assert!(
        stderr(&without).contains("auth refused"),
        "{}",
        stderr(&without)
    );
    assert_eq!(tokens_of(&run_with(Some(&socket))), tokens_of(&reference));
    let _ = agent.kill();
    let _ = agent.wait();
}

/// The inventory's launch keys: `[defaults]`, the `ssh-user`/`ssh-port` aliases, `cpu-ranks`,
/// and unknown keys refused naming the line.
#[test]
fn inventories_take_defaults_aliases_and_refuse_unknown_keys() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("hosts.toml");
    std::fs::write(
        &path,
        "[defaults]\nuser = \"ops\"\nport = 2222\nknown-hosts = \"kh\"\n\n\
         [[hosts]]\nname = \"a\"\naddress = \"10.0.0.1\"\ncpu-ranks = 2\n\n\
         [[hosts]]\naddress = \"10.0.0.2\"\nssh-user = \"root\"\nssh-port = 22\ngpus = 8\nhardware = \"h100-sxm\"\nnccl-socket-ifname = \"ens5\"\n",
    )
    .expect("write");
    let hosts = infer::inventory::launch_inventory(&path).expect("inventory");
    assert_eq!(
        (
            hosts[0].name.as_str(),
            hosts[0].user.as_deref(),
            hosts[0].port
        ),
        ("a", Some("ops"), Some(2222))
    );
    assert_eq!((hosts[0].slots, hosts[0].cpu), (2, true));
    assert_eq!(
        hosts[0].known_hosts.as_deref(),
        Some(dir.path().join("kh").as_path())
    );
    assert_eq!(
        (
            hosts[1].name.as_str(),
            hosts[1].user.as_deref(),
            hosts[1].port
        ),
        ("10.0.0.2", Some("root"), Some(22))
    );
    assert_eq!(
        (
            hosts[1].slots,
            hosts[1].cpu,
            hosts[1].nccl_socket_ifname.as_deref()
        ),
        (8, false, Some("ens5"))
    );
    std::fs::write(
        &path,
        "[[hosts]]\naddress = \"10.0.0.1\"\ncpu-ranks = 1\nidentity_file = \"k\"\n",
    )
    .expect("write");
    let error = format!(
        "{:#}",
        infer::inventory::launch_inventory(&path).expect_err("unknown key")
    );
    assert!(
        error.contains("line 4") && error.contains("identity_file"),
        "{error}"
    );
    std::fs::write(&path, "[[hosts]]\naddress = \"10.0.0.1\"\n").expect("write");
    let error = format!(
        "{:#}",
        infer::inventory::launch_inventory(&path).expect_err("no slots")
    );
    assert!(
        error.contains("exactly one of `gpus` and `cpu-ranks`"),
        "{error}"
    );
}

/// `infer topo --cluster`: every host probed on that host (its own NIC names), one JSON
/// topology that `infer topo --from` reads back; a host that cannot be reached is named and
/// the others still print (exit 1).
#[test]
fn topo_over_the_cluster_probes_every_host_there() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let output = infer()
        .args(["topo", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .output()
        .expect("run infer");
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let topology: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    for (index, host) in cluster.hosts.iter().enumerate() {
        let probed = &topology["hosts"][index];
        assert_eq!(probed["hostname"], host.name.as_str());
        let nic = probed["nics"]
            .as_array()
            .expect("nics")
            .iter()
            .find(|n| n["name"] == host.data_nic.as_str())
            .unwrap_or_else(|| panic!("no {} on {}: {probed}", host.data_nic, host.name));
        assert!(
            nic["addresses"]
                .as_array()
                .expect("addresses")
                .iter()
                .any(|a| a == host.data.as_str())
        );
    }
    let round_trip = run_with_stdin(&["topo", "--json", "--from", "-"], &output.stdout);
    assert_eq!(round_trip.status.code(), Some(0), "{}", stderr(&round_trip));
    let again: Value = serde_json::from_slice(&round_trip.stdout).expect("JSON");
    assert_eq!(again["hosts"].as_array().map(Vec::len), Some(2));
    // h1's sshd stops: h1 is an error line, h0 still prints.
    let pid: u32 = std::fs::read_to_string(cluster.dir.join("h1/sshd.pid"))
        .expect("sshd.pid")
        .trim()
        .parse()
        .expect("pid");
    signal(pid, rustix::process::Signal::TERM);
    std::thread::sleep(Duration::from_millis(200));
    let output = infer()
        .args(["topo", "--cluster"])
        .arg(&cluster.inventory)
        .output()
        .expect("run infer");
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("host `h1` could not be probed") && text.contains("refused"),
        "{text}"
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("host h0"),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

/// `infer doctor --cluster` on a real cluster: healthy, it names no error and prints the
/// reachability matrix; then each fault injected on one host is named, host included: a
/// host whose sessions have `ulimit -n 1024`, another `infer` build on one host, MTU 1400
/// on one data NIC, an inventory interface missing on one host, one host's data link down,
/// one host's data address on another subnet.
#[test]
fn doctor_over_the_cluster_names_each_fault_and_its_host() {
    let Some(cluster) = TestCluster::start_full(3, 1, None, Some(2)) else {
        return;
    };
    cluster.trust_hosts();
    let doctor = |extra: &[&str]| {
        let output = infer()
            .args(["doctor", "--cluster"])
            .arg(&cluster.inventory)
            .args(extra)
            .output()
            .expect("run infer");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr(&output),
        )
    };
    let errors_of = |json: &str| -> Vec<(String, Option<String>, String)> {
        let report: Value = serde_json::from_str(json).expect("JSON report");
        report["findings"]
            .as_array()
            .expect("findings")
            .iter()
            .filter(|f| f["severity"] == "error")
            .map(|f| {
                (
                    f["check"].as_str().unwrap_or("").to_string(),
                    f["host"].as_str().map(str::to_string),
                    f["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    };
    // Healthy: no error, the matrix, h2's low open-files limit as its own warning; with
    // `--bandwidth`, the all-reduce's nccl-tests table.
    let (code, text, err) = doctor(&["--bandwidth"]);
    assert_eq!(code, Some(0), "{text}{err}");
    assert!(
        text.contains("reachability (RTT µs)") && text.contains("0 error(s)"),
        "{text}"
    );
    // The human report groups findings under each host, cluster-wide ones last.
    let section = |heading: &str| -> String {
        text.split("\n\n")
            .find_map(|block| block.strip_prefix(&format!("{heading}\n")))
            .unwrap_or_default()
            .to_string()
    };
    assert!(section("h2").contains("open files limit is 1024"), "{text}");
    assert!(!section("h0").contains("limit is 1024"), "{text}");
    assert!(section("across hosts").contains("reachability"), "{text}");
    assert!(
        text.contains("# all-reduce (sum, float32): 3 ranks, one per host (h0, h1, h2)")
            && text.contains("    67108864     16777216  float"),
        "{text}"
    );
    let (code, json, err) = doctor(&["--json"]);
    assert_eq!(code, Some(0), "{err}");
    let report: Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(
        report["matrix"]["hosts"],
        serde_json::json!(["h0", "h1", "h2"])
    );
    assert!(
        report["matrix"]["cells"][0][1]["rtt_us"].as_u64().is_some(),
        "{json}"
    );
    assert_eq!(
        report["matrix"]["cells"][0][1]["seen_as"],
        cluster.hosts[0].data.as_str()
    );
    // Every other host reaches the rendezvous port on h0's data address.
    assert!(
        report["matrix"]["store"]
            .as_str()
            .is_some_and(|s| s.starts_with(&cluster.hosts[0].data)),
        "{json}"
    );
    assert!(report["matrix"]["store_cells"][0].is_null(), "{json}");
    assert!(
        report["matrix"]["store_cells"][2]["rtt_us"]
            .as_u64()
            .is_some(),
        "{json}"
    );

    // Another `infer` build on h1 (a copy with a byte appended: same version, other sha256).
    let copy = cluster.dir.join("infer-other");
    let mut bytes = std::fs::read(env!("CARGO_BIN_EXE_infer")).expect("read infer");
    bytes.push(0);
    std::fs::write(&copy, bytes).expect("write copy");
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let original = std::fs::read_to_string(&cluster.inventory).expect("inventory");
    let with_copy = original.replacen(
        "name = \"h1\"",
        &format!("name = \"h1\"\ninfer-path = \"{}\"", copy.display()),
        1,
    );
    std::fs::write(&cluster.inventory, &with_copy).expect("inventory");
    let (code, json, err) = doctor(&["--json"]);
    assert_eq!(code, Some(1), "{err}");
    let errors = errors_of(&json);
    assert!(
        errors
            .iter()
            .any(|(check, _, message)| check == "versions" && message.contains("`infer` build")),
        "{errors:?}"
    );
    std::fs::write(&cluster.inventory, &original).expect("inventory");

    // MTU 1400 on h1's data NIC.
    let in_h1 = |args: &[&str]| {
        let status = Command::new("ip")
            .args(["netns", "exec", &cluster.hosts[1].namespace, "ip"])
            .args(args)
            .status()
            .expect("ip");
        assert!(status.success(), "{args:?}");
    };
    in_h1(&[
        "link",
        "set",
        "dev",
        &cluster.hosts[1].data_nic,
        "mtu",
        "1400",
    ]);
    let (code, json, _) = doctor(&["--json"]);
    assert_eq!(code, Some(1));
    let errors = errors_of(&json);
    assert!(
        errors
            .iter()
            .any(|(check, host, message)| check == "interface"
                && host.as_deref() == Some("h1")
                && message.contains("MTU 1400")),
        "{errors:?}"
    );
    in_h1(&[
        "link",
        "set",
        "dev",
        &cluster.hosts[1].data_nic,
        "mtu",
        "1500",
    ]);

    // h1's data NIC shaped to 500 Mbit/s: `--bandwidth` names the slow pair.
    let tc = |verb: &str, qdisc: &[&str]| {
        let status = Command::new("ip")
            .args([
                "netns",
                "exec",
                &cluster.hosts[1].namespace,
                "tc",
                "qdisc",
                verb,
            ])
            .args(["dev", &cluster.hosts[1].data_nic, "root"])
            .args(qdisc)
            .status()
            .expect("tc");
        assert!(status.success(), "tc {verb} {qdisc:?}");
    };
    tc(
        "add",
        &["tbf", "rate", "500mbit", "burst", "64kb", "latency", "50ms"],
    );
    let (code, json, err) = {
        let output = infer()
            .args(["doctor", "--json", "--bandwidth", "--cluster"])
            .arg(&cluster.inventory)
            .output()
            .expect("run infer");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr(&output),
        )
    };
    tc("del", &[]);
    assert_eq!(code, Some(0), "{err}");
    let report: Value = serde_json::from_str(&json).expect("JSON");
    let slow: Vec<&Value> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["check"] == "bandwidth" && f["severity"] == "warn")
        .collect();
    // (Other pairs can dip too when the machine is busy: only h1's is sure to be slow.)
    assert!(
        slow.iter().any(|f| f["message"]
            .as_str()
            .is_some_and(|m| m.contains("`h1` -> `h2`") || m.contains("`h0` -> `h1`"))),
        "{json}"
    );
    // The all-reduce with our collectives, one model-less rank per host, swept as
    // nccl-tests does (8 B to 64 MiB): its ring passes h1's shaped egress, so its busbw is
    // under half the 10 Gbit/s veth rate.
    assert_eq!(
        report["allreduce"]["hosts"],
        serde_json::json!(["h0", "h1", "h2"]),
        "{json}"
    );
    let rows = report["allreduce"]["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 24, "{json}");
    assert_eq!(rows[23]["bytes"], 64 << 20);
    assert!(
        slow.iter().any(|f| f["message"]
            .as_str()
            .is_some_and(|m| m.contains("all-reduce over h0, h1, h2") && m.contains("busbw"))),
        "{json}"
    );

    // An inventory interface that h2 does not have.
    let with_ib = original.replacen(
        "name = \"h2\"",
        "name = \"h2\"\nnccl-socket-ifname = \"ib0\"",
        1,
    );
    std::fs::write(&cluster.inventory, &with_ib).expect("inventory");
    let (code, json, _) = doctor(&["--json"]);
    assert_eq!(code, Some(1));
    let errors = errors_of(&json);
    assert!(
        errors.iter().any(|(check, _, message)| check == "interface"
            && message.contains("`ib0`")
            && message.contains("`h2`")),
        "{errors:?}"
    );
    std::fs::write(&cluster.inventory, &original).expect("inventory");

    // h1's data link down: h0 and h2 cannot reach h1 and h1 reaches nobody.
    let data_link = format!(
        "{}d",
        &cluster.management_link(1)[..cluster.management_link(1).len() - 1]
    );
    let status = Command::new("ip")
        .args(["link", "set", "dev", &data_link, "down"])
        .status()
        .expect("ip");
    assert!(status.success());
    let (code, json, _) = doctor(&["--json"]);
    let status = Command::new("ip")
        .args(["link", "set", "dev", &data_link, "up"])
        .status()
        .expect("ip");
    assert!(status.success());
    assert_eq!(code, Some(1));
    let errors = errors_of(&json);
    assert!(
        errors
            .iter()
            .any(|(check, host, message)| check == "reachability"
                && host.as_deref() == Some("h0")
                && message.contains("cannot connect to `h1`")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|(check, host, message)| check == "reachability"
                && host.as_deref() == Some("h1")
                && message.contains("rendezvous port on `h0`")),
        "{errors:?}"
    );
    assert!(
        !errors
            .iter()
            .any(|(_, _, message)| message.contains("`h0` cannot connect to `h2`")),
        "{errors:?}"
    );

    // h1's data address moves to another subnet: no network reaches every host.
    let address = format!("{}/24", cluster.hosts[1].data);
    let octets: Vec<&str> = cluster.hosts[1].data.split('.').collect();
    let moved = format!("{}.{}.9.{}/24", octets[0], octets[1], octets[3]);
    in_h1(&["addr", "del", &address, "dev", &cluster.hosts[1].data_nic]);
    in_h1(&["addr", "add", &moved, "dev", &cluster.hosts[1].data_nic]);
    let (code, json, _) = doctor(&["--json"]);
    in_h1(&["addr", "del", &moved, "dev", &cluster.hosts[1].data_nic]);
    in_h1(&["addr", "add", &address, "dev", &cluster.hosts[1].data_nic]);
    assert_eq!(code, Some(1));
    let errors = errors_of(&json);
    assert!(
        errors
            .iter()
            .any(|(check, host, message)| check == "interface"
                && host.as_deref() == Some("h1")
                && message.contains("no address on")
                && message.contains("`h0`, `h2`")),
        "{errors:?}"
    );
}

/// The NCCL library each host would load is found as the dynamic loader finds it and its
/// version read with `ncclGetVersion`: a fake `libnccl.so.2` of version 2.21.5 (built
/// here with `cc`) on one host only is a version mismatch naming both hosts.
#[test]
fn doctor_names_a_different_nccl_library_on_one_host() {
    if missing_requirement().is_some() && std::env::var_os("CI").is_none() {
        return;
    }
    let build = tempfile::tempdir().expect("temp dir");
    let source = build.path().join("nccl.c");
    std::fs::write(
        &source,
        "int ncclGetVersion(int *version) { *version = 22105; return 0; }\n",
    )
    .expect("write");
    let library = build.path().join("libnccl.so.2");
    let compiled = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .output()
        .expect("cc (apt install build-essential)");
    assert!(
        compiled.status.success(),
        "{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let Some(cluster) = TestCluster::start_faulty(2, 1, None, None, Some((1, &library))) else {
        return;
    };
    cluster.trust_hosts();
    let output = infer()
        .args(["doctor", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .output()
        .expect("run infer");
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let finding = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| {
            f["check"] == "versions"
                && f["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("NCCL library"))
        })
        .unwrap_or_else(|| panic!("no NCCL version finding: {report}"));
    assert_eq!(finding["severity"], "error");
    let evidence: Vec<&str> = finding["evidence"]
        .as_array()
        .expect("evidence")
        .iter()
        .filter_map(|e| e.as_str())
        .collect();
    assert!(
        evidence.contains(&"h1: 2.21.5 at `/usr/local/lib/libnccl.so.2`"),
        "{evidence:?}"
    );
    assert!(
        evidence.iter().any(|e| e.starts_with("h0: ")),
        "{evidence:?}"
    );
}

/// `infer doctor --cluster hosts.toml --plan plan.json`: the plan checked against the
/// surveyed hosts: a TP group across hosts is an error, and so is an `NCCL_SOCKET_IFNAME`
/// in the plan's env that names nothing on its host.
#[test]
fn doctor_over_the_cluster_checks_a_plan_against_the_hosts() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    // The plan names its hosts node0 and node1: so does the inventory.
    cluster.edit_inventory(|text| {
        text.replace("name = \"h0\"", "name = \"node0\"")
            .replace("name = \"h1\"", "name = \"node1\"")
    });
    let output = run(&[
        "plan",
        "--model",
        "llama-3.1-70b",
        "--cluster",
        "2x8xh100-sxm",
        "--tp",
        "16",
        "--json",
    ]);
    let mut plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    plan["env"]["node1"]["NCCL_SOCKET_IFNAME"] = Value::from("=ib0");
    let plan_path = cluster.dir.join("plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan).expect("JSON")).expect("write plan");
    let output = infer()
        .args(["doctor", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .arg("--plan")
        .arg(&plan_path)
        .output()
        .expect("run infer");
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let errors: Vec<(String, String)> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| {
            (
                f["check"].as_str().unwrap_or("").to_string(),
                f["host"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert!(
        errors.iter().any(|(check, _)| check == "cross-node-tp"),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|(check, host)| check == "nccl-env" && host == "node1"),
        "{errors:?}"
    );
}

/// Prefill/decode disaggregation across two hosts: `infer up --cluster hosts.toml --prefill 1
/// --decode 1` runs the prefill replica on h0 and the decode replica on h1, whose KV
/// arrives over the data network; answers equal `infer generate`'s, the decode replica
/// computes no prompt, and `/metrics` reports by role. A KV transfer that fails (h1's
/// inbox port dropping packets, which the decode side detects, or resetting them, which
/// the prefill side detects) fails its request with an OpenAI error within seconds, the
/// server goes on, and answers again once the rule is gone; killing the decode
/// rank stops the gang, naming it.
#[test]
fn disaggregation_across_two_hosts_moves_kv_over_the_data_network_and_survives_a_failed_transfer() {
    use crate::support::model::KV_BYTES_PER_TOKEN;
    use crate::support::server::{Server, generate_counting, metric};
    use serde_json::json;
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let mut server = Server::start(&["--cluster", &inventory, "--prefill", "1", "--decode", "1"]);
    let manifest = run_manifest(&server.startup);
    assert_eq!(manifest["ranks"][0]["host"], "h0");
    assert_eq!(manifest["ranks"][1]["host"], "h1");
    let reference = generate_counting();
    let body = json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 16, "temperature": 0});
    let bodies = vec![body.clone(); 3];
    let mut prompt_tokens = 0;
    for (status, reply) in server.post_all("/v1/completions", &bodies) {
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
        prompt_tokens += reply["usage"]["prompt_tokens"].as_u64().expect("usage");
    }
    // The prefill rank on h0 keeps its connection to the decode rank's inbox on h1.
    cluster.assert_data_connection(0, 1);
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_pd_handoffs_total"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_total"),
        (prompt_tokens * KV_BYTES_PER_TOKEN) as f64,
        "{metrics}"
    );
    // Another host: nothing through shared memory (the launcher's placement decides, even
    // though these namespaces share one /dev/shm).
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_shm_total"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_decode_prefill_tokens_total"),
        0.0,
        "{metrics}"
    );
    // By role: first tokens on the prefill replica, the other 15 on the decode replica.
    for (name, value) in [
        (
            "infer_pd_time_to_first_token_seconds_count{role=\"prefill\"}",
            3.0,
        ),
        (
            "infer_pd_time_to_first_token_seconds_count{role=\"decode\"}",
            0.0,
        ),
        (
            "infer_pd_time_per_output_token_seconds_count{role=\"prefill\"}",
            0.0,
        ),
        (
            "infer_pd_time_per_output_token_seconds_count{role=\"decode\"}",
            45.0,
        ),
        ("infer_pd_requests_waiting{role=\"prefill\"}", 0.0),
        ("infer_pd_requests_running{role=\"decode\"}", 0.0),
    ] {
        assert_eq!(metric(&metrics, name), value, "{name}:\n{metrics}");
    }
    // The decode rank's inbox, from its log; a firewall rule on h1 resets every packet to it.
    let log_path = manifest["ranks"][1]["log"].as_str().expect("rank 1's log");
    let log = std::fs::read_to_string(log_path).expect("rank 1's log");
    let inbox = kv_inbox_in(&log);
    let port = inbox.rsplit(':').next().expect("port").to_string();
    let prefill_log =
        std::fs::read_to_string(manifest["ranks"][0]["log"].as_str().expect("rank 0's log"))
            .expect("rank 0's log");
    assert!(
        prefill_log.contains(&format!("KV to decode replicas 1 over TCP to {inbox}")),
        "rank 0's log:\n{prefill_log}"
    );
    // Strangers on the data network (a process on h0 that holds no key of the run): idle
    // connections, garbage, an oversized hello and an oversized length prefix at the decode
    // rank's inbox on h1 and at the rendezvous store. Both keep serving the run: answers
    // still come, and KV moves only for them.
    let store = manifest["store"].as_str().expect("store address");
    let strangers = cluster.strangers(0, &[&inbox, store]);
    for (status, reply) in server.post_all("/v1/completions", &bodies[..2]) {
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    }
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_pd_handoffs_total"),
        5.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_total"),
        (prompt_tokens * 5 / 3 * KV_BYTES_PER_TOKEN) as f64,
        "{metrics}"
    );
    drop(strangers);
    let rule = |action: &str, target: &[&str]| cluster.port_rule(1, &port, action, target);
    // First a link that silently drops everything: the prefill rank's few KiB of KV (a
    // one-token prompt) sit in its socket's send buffer, so it sees nothing wrong and
    // samples the first token; the decode rank waits for KV that never comes and gives up
    // after 5 s (`IMPORT_WAIT`), and its replica drops the request with an error.
    rule("-A", &["DROP"]);
    let started = Instant::now();
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "1", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 500, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("layer positions arrived within 5 s"),
        "the decode side's wait should fail it: {reply}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    rule("-D", &["DROP"]);
    // Then a link that resets every packet: the prefill rank's send fails at once.
    let firewall = |action: &str| rule(action, &["REJECT", "--reject-with", "tcp-reset"]);
    firewall("-A");
    for attempt in 0..3 {
        let started = Instant::now();
        let (status, reply) = server.post("/v1/completions", &body);
        assert_eq!(status, 500, "attempt {attempt}: {reply}");
        assert_eq!(reply["error"]["type"], "server_error", "{reply}");
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("KV transfer"), "{reply}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "attempt {attempt} took {:?}",
            started.elapsed()
        );
    }
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_pd_transfer_failures_total"),
        4.0,
        "{metrics}"
    );
    // Nothing is left running on either role (the gauges settle after each step).
    let settled = Instant::now();
    loop {
        let metrics = server.metrics();
        let running = |role: &str| {
            metric(
                &metrics,
                &format!("infer_pd_requests_running{{role=\"{role}\"}}"),
            )
        };
        if running("prefill") == 0.0 && running("decode") == 0.0 {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(5),
            "failed requests still running:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    firewall("-D");
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    // A killed decode rank takes the gang down, named.
    let ranks = server.rank_pids();
    let victim = manifest["ranks"][1]["pid"].as_u64().expect("pid") as u32;
    signal(victim, rustix::process::Signal::KILL);
    let (status, rest) = server.wait_for_gang_exit(&ranks);
    assert_eq!(status.code(), Some(2), "{rest}");
    assert!(
        rest.contains("rank 1 on `h1`") && rest.contains("signal: 9"),
        "{rest}"
    );
}

/// The greedy request the device-rank tests make of the [`write_tp2_model`] model (after
/// `--model`).
const DEVICE_PROMPT: [&str; 6] = [
    "--prompt",
    "HELLO THERE",
    "--max-tokens",
    "8",
    "--temperature",
    "0",
];

/// The [`write_tp2_model`] model written into `dir` (its path), with what `infer generate
/// --json` of [`DEVICE_PROMPT`] gives on this host's CPU engine: the tokens device ranks must
/// give.
fn device_model_and_reference(dir: &Path) -> (String, Output) {
    let model = write_tp2_model(dir);
    let model = model.to_str().expect("utf-8").to_string();
    let args: Vec<&str> = ["--model", &model]
        .iter()
        .chain(&DEVICE_PROMPT)
        .copied()
        .collect();
    let reference = generate(None, &args);
    (model, reference)
}

/// `--device cuda` ranks on an inventory's hosts: a host without a GPU is named before any
/// rank starts (the agents' NVML probes find none here); with the host harness standing in
/// for the GPUs (`INFER_CUDA_HOST_HARNESS=1`), two pipeline stages on two hosts each take
/// their host's first GPU slot, run the CUDA kernels there and give the CPU engine's tokens.
#[test]
fn device_ranks_on_two_hosts_need_a_gpu_on_each_and_give_the_cpu_engines_tokens() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, reference) = device_model_and_reference(dir.path());
    let reference = tokens_of(&reference);
    let args: Vec<&str> = ["--model", &model]
        .iter()
        .chain(&DEVICE_PROMPT)
        .chain(&["--device", "cuda", "--pp", "2"])
        .copied()
        .collect();
    let output = generate(Some(&cluster.inventory), &args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--device cuda: host `h0`") && text.contains("has no GPU that NVML can see"),
        "{text}"
    );
    assert!(!text.contains("[h0 r0]"), "no rank started: {text}");

    let mut command = infer();
    let output = command
        .env("INFER_CUDA_HOST_HARNESS", "1")
        .args(["generate", "--json", "--cluster"])
        .arg(&cluster.inventory)
        .args(&args)
        .output()
        .expect("run infer");
    assert_eq!(tokens_of(&output), reference);
    let text = stderr(&output);
    assert!(
        text.contains("[h0 r0] rank 0 on the host harness")
            && text.contains("[h1 r1] rank 1 on the host harness"),
        "{text}"
    );
    let manifest = run_manifest(&text);
    for rank in manifest["ranks"].as_array().expect("ranks") {
        assert_eq!(rank["env"]["CUDA_VISIBLE_DEVICES"], "0", "{rank}");
        assert_eq!(rank["env"]["INFER_DEVICE"], "cuda", "{rank}");
    }
}

/// Prefill/decode disaggregation of `--device cuda` ranks across two hosts, the host
/// harness standing in for the GPUs: the prefill rank on h0 copies its KV blocks out of its
/// device cache and sends them over the data network (TCP, not shared memory) to the decode
/// rank on h1, which writes them into its own and gives the CPU engine's completion. KV that
/// never arrives (h1's inbox port dropping packets) fails that request within seconds, the
/// decode device drops the half-imported sequence, and the next request is answered again.
#[test]
fn device_ranks_disaggregate_across_two_hosts_and_survive_kv_that_never_arrives() {
    use crate::support::server::{Server, metric};
    use serde_json::json;
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let dir = tempfile::tempdir().expect("tempdir");
    let (model, output) = device_model_and_reference(dir.path());
    tokens_of(&output);
    let reference: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let mut command = infer();
    command
        .env("INFER_CUDA_HOST_HARNESS", "1")
        .args(["up", "--port", "0", "--device", "cuda", "--model", &model])
        .arg("--cluster")
        .arg(&cluster.inventory)
        .args(["--prefill", "1", "--decode", "1"]);
    let server = Server::start_command(command);
    let manifest = run_manifest(&server.startup);
    assert_eq!(manifest["ranks"][0]["host"], "h0");
    assert_eq!(manifest["ranks"][1]["host"], "h1");
    let body = json!({"prompt": "HELLO THERE", "max_tokens": 8, "temperature": 0});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_pd_handoffs_total"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_decode_prefill_tokens_total"),
        0.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "infer_pd_kv_bytes_sent_total") > 0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_pd_kv_bytes_sent_shm_total"),
        0.0,
        "another host: {metrics}"
    );
    let log_of = |rank: usize| {
        let path = manifest["ranks"][rank]["log"].as_str().expect("log");
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let decode_log = log_of(1);
    assert!(
        decode_log.contains("rank 1 on the host harness"),
        "{decode_log}"
    );
    let inbox = kv_inbox_in(&decode_log);
    let prefill_log = log_of(0);
    assert!(
        prefill_log.contains(&format!("KV to decode replicas 1 over TCP to {inbox}")),
        "rank 0's log:\n{prefill_log}"
    );
    let port = inbox.rsplit(':').next().expect("port").to_string();
    let drop_packets = |action: &str| cluster.port_rule(1, &port, action, &["DROP"]);
    drop_packets("-A");
    let started = Instant::now();
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "H", "max_tokens": 4, "temperature": 0}),
    );
    drop_packets("-D");
    assert_eq!(status, 500, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("layer positions arrived within 5 s"),
        "the decode side's wait should fail it: {reply}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], reference["text"], "{reply}");
    assert_eq!(
        metric(&server.metrics(), "infer_pd_transfer_failures_total"),
        1.0
    );
}

/// The address of the KV inbox a decode rank's log names ("…KV inbox on ADDR").
fn kv_inbox_in(log: &str) -> String {
    log.split("KV inbox on ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no inbox address in the decode rank's log:\n{log}"))
        .to_string()
}

/// `infer plan --probe-hosts` on an inventory of CPU-rank hosts (namespaces with their own
/// sshd): each host's CPU is probed there by its agent, and the plan names each probe's
/// host instead of standing this host's CPU in for theirs. Without an inventory the flag is
/// refused with the fix. See: #40
#[test]
fn plan_probes_each_cpu_rank_hosts_own_cpu_over_ssh() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let args = ["plan", "--cluster", &inventory, "--probe-hosts", "--json"];
    let output = run(&[&args[..], &["--dp", "2"]].concat());
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let plan: Value = serde_json::from_slice(&output.stdout).expect("plan JSON");
    let explain: Vec<&str> = plan["explain"]
        .as_array()
        .expect("explain")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for host in ["h0", "h1"] {
        assert!(
            explain
                .iter()
                .any(|l| l.contains(&format!("probed on `{host}` over SSH"))),
            "{explain:#?}"
        );
    }
    assert!(
        !explain.iter().any(|l| l.contains("this host's CPU")),
        "{explain:#?}"
    );
    let refused = run(&["plan", "--cluster", "2x8xh100-sxm", "--probe-hosts"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("give `--cluster hosts.toml`"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
