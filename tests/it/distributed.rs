//! Distributed generation on real `infer rank` processes: the same greedy tokens as one
//! process for every (tp, pp) the issue names, on the real SmolLM2, in both rounding
//! orders; a rank killed
//! mid-generation takes the whole gang down, naming it, leaving no process behind.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::process::{alive, infer, run, signal};

fn tokens(args: &[&str]) -> Vec<u64> {
    let mut full = vec!["generate", "--json", "--max-tokens", "32"];
    full.extend_from_slice(args);
    let output = run(&full);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{args:?}: {}",
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

#[test]
fn every_layout_generates_the_single_process_tokens() {
    crate::support::model::smollm2();
    // The two prompts of the llama.cpp fixture. Pipeline stages run the very same
    // operations, and tensor parallelism continues each row-parallel dot product across the
    // ranks in the single-process order, so every layout must match all 32 tokens — even
    // through near-ties (the code prompt has one at position 24, where llama.cpp's own
    // top-1/top-2 margin is 0.23 and a ring all-reduce's rounding flips it).
    for prompt in ["1, 2, 3, 4, 5,", "def fibonacci(n):"] {
        let reference = tokens(&["--prompt", prompt]);
        assert_eq!(reference.len(), 32);
        for (tp, pp) in [("3", "1"), ("1", "2"), ("1", "3"), ("3", "2")] {
            let got = tokens(&["--prompt", prompt, "--tp", tp, "--pp", pp]);
            assert_eq!(got, reference, "{prompt:?} tp={tp} pp={pp}");
        }
    }
}

/// `--numerics fast` reaches every rank (`INFER_NUMERICS`) and keeps the layouts
/// bit-identical too: a TP continuation carries the one per-block accumulator as it carries
/// the eight lanes. On the code prompt the fast order takes a near-tie (llama.cpp margin
/// 0.11 at position 13) the other way, so a rank left on the exact order would show.
#[test]
fn fast_numerics_generate_the_same_tokens_on_every_layout() {
    crate::support::model::smollm2();
    let prompt = "def fibonacci(n):";
    let exact = tokens(&["--prompt", prompt]);
    let fast = tokens(&["--prompt", prompt, "--numerics", "fast"]);
    assert_ne!(
        fast, exact,
        "the two orders part at a near-tie on this prompt"
    );
    for (tp, pp) in [("3", "1"), ("3", "2")] {
        let got = tokens(&[
            "--prompt",
            prompt,
            "--numerics",
            "fast",
            "--tp",
            tp,
            "--pp",
            pp,
        ]);
        assert_eq!(got, fast, "tp={tp} pp={pp}");
    }
}

#[test]
fn a_killed_rank_takes_the_gang_down_within_5_seconds() {
    crate::support::model::smollm2();
    let mut child = infer()
        .args([
            "generate",
            "--tp",
            "3",
            "--max-tokens",
            "4000",
            "--prompt",
            "1, 2, 3, 4, 5,",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    let pids: Vec<u32> = loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).expect("read") > 0,
            "the launcher ended before starting ranks"
        );
        if let Some(list) = line.split("ranks (").nth(1) {
            break list
                .split(')')
                .next()
                .expect("list")
                .split(", ")
                .map(|part| part.rsplit(' ').next().expect("pid").parse().expect("pid"))
                .collect();
        }
    };
    assert_eq!(pids.len(), 3);
    std::thread::sleep(Duration::from_millis(1500));
    let killed_at = Instant::now();
    signal(pids[2], rustix::process::Signal::KILL);
    let status = child.wait().expect("wait");
    let elapsed = killed_at.elapsed();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).expect("read");
    assert_eq!(status.code(), Some(2), "{rest}");
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    if !rest.contains("rank 2") {
        // Say everything: the launcher's output and every rank's log.
        let run_dir = line.rsplit(" in ").next().unwrap_or_default().trim();
        let logs: String = (0..3)
            .map(|r| {
                let log = std::fs::read_to_string(format!("{run_dir}/rank{r}.log"));
                format!("--- rank{r}.log\n{}\n", log.unwrap_or_default())
            })
            .collect();
        panic!("the error does not name rank 2:\n{line}{rest}\n{logs}");
    }
    for pid in pids {
        assert!(!alive(pid), "rank pid {pid} is still running");
    }
}

/// A `Spawner` whose "ranks" are `sh -c 'echo …; exit 0'`: they finish at once, successfully,
/// without ever joining the store.
struct ExitingSpawner;

struct ShRank(std::process::Child);

impl infer::launch::RankHandle for ShRank {
    fn id(&self) -> u32 {
        self.0.id()
    }
    fn try_wait(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self.0.try_wait()?)
    }
    fn signal(&mut self, _signal: rustix::process::Signal) {
        let _ = self.0.kill();
    }
    fn wait(&mut self) {
        let _ = self.0.wait();
    }
}

impl infer::launch::Spawner for ExitingSpawner {
    fn spawn(
        &self,
        rank: usize,
        env: &[(String, String)],
        _token: &str,
        log: &std::path::Path,
        _lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> anyhow::Result<Box<dyn infer::launch::RankHandle>> {
        // The launcher hands every rank its explicit environment.
        let rank_var = env.iter().find(|(k, _)| k == "RANK").expect("RANK set");
        assert_eq!(rank_var.1, rank.to_string());
        let file = std::fs::File::create(log)?;
        let child = std::process::Command::new("sh")
            .args(["-c", &format!("echo rank {rank} done early; exit 0")])
            .stdout(file)
            .spawn()?;
        Ok(Box::new(ShRank(child)))
    }
}

/// Ranks are started through the `Spawner` trait. A rank that exits — even successfully —
/// fails a serving gang (named, with its log), while a generation gang only fails once
/// every rank is gone without a result.
#[test]
fn a_rank_that_exits_fails_a_serving_gang_through_any_spawner() {
    let spec = infer::launch::LaunchSpec {
        degrees: infer::degrees::Degrees {
            tp: 2,
            ..infer::degrees::Degrees::ONE
        },
        // The spawner starts nothing real: no model to check.
        model: None,
        threads_per_rank: 1,
        numerics: infer::runtime::cpu::quant::Numerics::Exact,
        timeout: Duration::from_secs(5),
        serving: None,
        layout_from: "a test".into(),
        placement: Vec::new(),
        planned_hosts: None,
        run_dir: None,
        gpus: None,
        restart: 0,
    };
    let job = infer::runtime::exec::worker::Job::Serve;
    let mut serving =
        infer::launch::Gang::start_with(&ExitingSpawner, &spec, &job).expect("gang starts");
    serving.fail_on_any_exit();
    let error = serving
        .wait_for("ready", &|| false, &mut |_| {})
        .expect_err("a rank exited");
    let message = format!("{error:#}");
    assert!(message.contains("exited with exit status: 0"), "{message}");
    assert!(message.contains("done early"), "{message}");

    let mut generating =
        infer::launch::Gang::start_with(&ExitingSpawner, &spec, &job).expect("gang starts");
    let error = generating
        .wait_for("result", &|| false, &mut |_| {})
        .expect_err("no result");
    assert!(
        format!("{error:#}").contains("every rank exited without `result`"),
        "{error:#}"
    );
}

/// Run directories live under the cache's `runs/` (not `/tmp`), the newest
/// `INFER_KEEP_RUNS` kept, never one whose launcher still runs; `--run-dir` puts one where
/// the user says and refuses a directory that holds another run.
#[test]
fn run_directories_are_kept_under_the_cache_and_pruned() {
    let model = crate::support::model::smollm2();
    let cache = tempfile::tempdir().expect("tempdir");
    let runs = cache.path().join("runs");
    std::fs::create_dir_all(&runs).expect("runs");
    // Five old runs: one still held by a live launcher (this test process), four not.
    for i in 0..5 {
        let dir = runs.join(format!("run-old{i}"));
        std::fs::create_dir_all(&dir).expect("old run");
        let pid = if i == 0 {
            std::process::id()
        } else {
            999_999_999
        };
        std::fs::write(
            dir.join("manifest.json"),
            format!("{{\"launcher_pid\": {pid}}}"),
        )
        .expect("manifest");
        // Apart by more than the file system's timestamp granularity.
        std::thread::sleep(Duration::from_millis(30));
    }
    let generate = |extra: &[&str]| {
        infer()
            .env("INFER_CACHE_DIR", cache.path())
            .env("INFER_KEEP_RUNS", "3")
            .args([
                "generate",
                "--tp",
                "3",
                "--max-tokens",
                "2",
                "--prompt",
                "1, 2,",
            ])
            .arg("--model")
            .arg(&model)
            .args(extra)
            .output()
            .expect("run infer")
    };
    let output = generate(&[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut left: Vec<String> = std::fs::read_dir(&runs)
        .expect("runs")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    // The newest three (the new run and the two newest old ones), and the oldest, whose
    // launcher still runs.
    let new: Vec<&String> = left.iter().filter(|n| !n.starts_with("run-old")).collect();
    assert_eq!(new.len(), 1, "{left:?}");
    let old: Vec<&String> = left.iter().filter(|n| n.starts_with("run-old")).collect();
    assert_eq!(old, ["run-old0", "run-old3", "run-old4"], "{left:?}");
    assert!(runs.join(new[0]).join("manifest.json").is_file());
    assert!(runs.join(new[0]).join("rank2.log").is_file());

    // `--run-dir`: there, and never into a directory that holds another run.
    let chosen = cache.path().join("mine");
    let output = generate(&["--run-dir", chosen.to_str().expect("utf-8")]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(chosen.join("manifest.json").is_file());
    let output = generate(&["--run-dir", chosen.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not empty"), "{stderr}");
}
