//! `infer up` as a running server the tests talk to ([`Server`]: started, asked over HTTP,
//! watched until it exits, stopped when dropped), what it reports (Prometheus samples,
//! `infer bench serve` rows), and the references serving is compared with: `infer
//! generate`'s greedy output and the official `openai` Python client.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::process::Signal;
use serde_json::Value;

use crate::support::cache::openai_python_package;
use crate::support::process::{alive, infer, run, run_manifest, wait_exit};

/// A running `infer up` (with `--engine` or without), its stderr read on a thread so it
/// never blocks on a full pipe; sent SIGTERM (or SIGKILL, see [`Server::kill_on_drop`])
/// and reaped when dropped.
pub struct Server {
    pub child: Child,
    /// `http://ADDRESS` from the "serving … on http://ADDRESS" line.
    pub url: String,
    /// Every stderr line up to "serving on" (the rank pids and the run directory).
    pub startup: String,
    /// The rest of stderr, read until the server exits.
    rest: Option<JoinHandle<String>>,
    /// The same lines as they arrive, for failure messages while the server runs.
    log: Arc<Mutex<String>>,
    /// What a drop sends a server still running.
    stop_with: Signal,
}

impl Server {
    /// Starts `infer up --port 0 --threads 2 EXTRA` and waits until it serves.
    pub fn start(extra: &[&str]) -> Server {
        let mut command = infer();
        command
            .args(["up", "--port", "0", "--threads", "2"])
            .args(extra);
        Server::start_command(command)
    }

    /// Starts `command` (an `infer up` line) and waits until it serves (the default model
    /// fetched first); panics with its stderr if it exits before.
    pub fn start_command(mut command: Command) -> Server {
        crate::support::model::smollm2();
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start infer up");
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut startup = String::new();
        let url = loop {
            let mut line = String::new();
            assert!(
                stderr.read_line(&mut line).expect("read") > 0,
                "`infer up` exited before serving:\n{startup}"
            );
            startup.push_str(&line);
            // "serving `MODEL` on http://…" or, with `--engine`, "serving on http://…" (an
            // engine's own lines may name other addresses).
            if !line.contains("serving") {
                continue;
            }
            if let Some(rest) = line.split(" on http://").nth(1) {
                break format!(
                    "http://{}",
                    rest.split_whitespace().next().expect("address")
                );
            }
        };
        let log = Arc::new(Mutex::new(String::new()));
        let shared = log.clone();
        let rest = Some(std::thread::spawn(move || {
            let mut text = String::new();
            let mut line = String::new();
            while matches!(stderr.read_line(&mut line), Ok(n) if n > 0) {
                if let Ok(mut log) = shared.lock() {
                    log.push_str(&line);
                }
                text.push_str(&line);
                line.clear();
            }
            text
        }));
        Server {
            child,
            url,
            startup,
            rest,
            log,
            stop_with: Signal::TERM,
        }
    }

    /// This server, SIGKILLed instead of stopped with SIGTERM when dropped.
    pub fn kill_on_drop(mut self) -> Server {
        self.stop_with = Signal::KILL;
        self
    }

    /// The Prometheus text of `/metrics`; a failure names the server's state and its stderr
    /// so far (a server that died says why).
    pub fn metrics(&self) -> String {
        match ureq::get(&format!("{}/metrics", self.url)).call() {
            Ok(response) => response.into_body().read_to_string().expect("text"),
            Err(error) => self.unreachable("metrics", &error),
        }
    }

    /// Panics with what a request to this server met, the server's state (running or
    /// exited) and its stderr so far: a server that died says why.
    fn unreachable(&self, what: &str, error: &dyn std::fmt::Display) -> ! {
        let state = if alive(self.child.id()) {
            "running"
        } else {
            "exited"
        };
        std::thread::sleep(Duration::from_millis(200));
        let log = self.stderr_so_far();
        panic!(
            "{what}: {error} (server {state})\nstartup:\n{}\nstderr since:\n{log}",
            self.startup
        )
    }

    /// Stderr after the startup lines, as far as it has arrived.
    pub fn stderr_so_far(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Stderr after the startup lines, read to its end: call it once the server exits (it
    /// waits for the end of the pipe). Empty when already taken.
    pub fn rest_of_stderr(&mut self) -> String {
        self.rest
            .take()
            .map(|reader| reader.join().expect("stderr reader"))
            .unwrap_or_default()
    }

    /// Waits for `infer up` to exit after a rank was killed: returns its status and the rest
    /// of its stderr, after checking that no rank process is left.
    pub fn wait_for_gang_exit(&mut self, ranks: &[u32]) -> (ExitStatus, String) {
        let status = self.child.wait().expect("wait");
        let rest = self.rest_of_stderr();
        for &pid in ranks {
            assert!(!alive(pid), "rank pid {pid} is still running");
        }
        (status, rest)
    }

    /// Waits up to `within` for `infer up` to exit: its status and the rest of its stderr.
    /// Panics (after killing it) when it does not exit in time.
    pub fn wait_exit(&mut self, within: Duration) -> (ExitStatus, String) {
        let status = wait_exit(&mut self.child, within)
            .unwrap_or_else(|| panic!("`infer up` did not exit within {within:?}"));
        (status, self.rest_of_stderr())
    }

    /// The run directory's `manifest.json`, from the "manifest.json in DIR" line.
    pub fn manifest(&self) -> Value {
        run_manifest(&self.startup)
    }

    /// The rank processes' pids, from the "started N ranks (pids …)" line.
    pub fn rank_pids(&self) -> Vec<u32> {
        let list = self
            .startup
            .split("(pids ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .unwrap_or_else(|| panic!("no rank pids in:\n{}", self.startup));
        list.split(", ")
            .map(|pid| pid.parse().expect("pid"))
            .collect()
    }

    /// The ranks' logs, in rank order, from the run's manifest.
    pub fn rank_logs(&self) -> Vec<String> {
        let manifest = self.manifest();
        manifest["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .map(|rank| {
                let path = rank["log"].as_str().expect("log");
                std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
            })
            .collect()
    }

    /// GETs `path`: the reply's HTTP status and body (a 4xx or 5xx is returned, not an
    /// error; an unreachable server panics with its stderr).
    pub fn get(&self, path: &str) -> (u16, String) {
        let response = ureq::get(&format!("{}{path}", self.url))
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .unwrap_or_else(|error| self.unreachable(&format!("GET {path}"), &error));
        let status = response.status().as_u16();
        (status, response.into_body().read_to_string().expect("text"))
    }

    /// Posts every body at once (one client thread each) and returns the replies in order.
    pub fn post_all(&self, path: &str, bodies: &[Value]) -> Vec<(u16, Value)> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = bodies
                .iter()
                .map(|body| scope.spawn(move || self.post(path, body)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("client"))
                .collect()
        })
    }

    /// Posts `body` as JSON to `path`: the reply's HTTP status and JSON body (a 4xx or 5xx
    /// is returned, not an error; an unreachable server panics with its stderr).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = ureq::post(&format!("{}{path}", self.url))
            .config()
            .http_status_as_error(false)
            .build()
            .send_json(body)
            .unwrap_or_else(|error| self.unreachable(&format!("POST {path}"), &error));
        let status = response.status().as_u16();
        (status, response.into_body().read_json().expect("JSON body"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A reaped child's pid may already belong to another process: never signal it.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = rustix::process::Pid::from_raw(self.child.id() as i32)
            .map(|pid| rustix::process::kill_process(pid, self.stop_with));
        let _ = self.child.wait();
    }
}

/// An answer's `Retry-After` header, if any.
pub fn retry_after<B>(response: &ureq::http::Response<B>) -> Option<String> {
    response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The value of the Prometheus sample `name` (with its labels) in `text`.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// Every one of `replicas` DP replicas was routed a request, by the router's
/// `infer_dp_requests_routed_total` in `metrics`.
pub fn assert_every_replica_routed(metrics: &str, replicas: usize) {
    for replica in 0..replicas {
        let routed = metric(
            metrics,
            &format!("infer_dp_requests_routed_total{{replica=\"{replica}\"}}"),
        );
        assert!(routed > 0.0, "replica {replica} got nothing:\n{metrics}");
    }
}

/// `infer generate --json` on the counting prompt, 16 greedy tokens: the reference output.
pub fn generate_counting() -> Value {
    let output = run(&[
        "generate",
        "--json",
        "--max-tokens",
        "16",
        "--prompt",
        "1, 2, 3, 4, 5,",
    ]);
    serde_json::from_slice(&output.stdout).expect("generate JSON")
}

/// Runs `tests/python/openai_client.py` (the official `openai` package) against the server
/// at `url` and returns what it printed.
pub fn run_openai_client(url: &str) -> Value {
    let output = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/openai_client.py"
        ))
        .arg(format!("{url}/v1"))
        .env("PYTHONPATH", openai_python_package())
        .output()
        .expect("run python3");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("script JSON")
}

/// The stdout of a successful `infer bench serve` run (a failure shows both streams).
pub fn bench_serve_stdout(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The tokens column of `infer bench serve`'s row for `streams` streams.
pub fn bench_serve_tokens(stdout: &str, streams: usize) -> usize {
    let row = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&streams.to_string()))
        .unwrap_or_else(|| panic!("no row for {streams} streams:\n{stdout}"));
    row.split_whitespace()
        .last()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no tokens column in {row}"))
}
