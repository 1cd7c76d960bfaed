//! Running the `infer` binary under test and watching processes: a command with a clean
//! environment, its output, the run's manifest from the launcher's output, whether a pid
//! still runs, signals, bounded waits and free ports.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `infer` binary under test, with a clean environment for colour and no stdin.
pub fn infer() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infer"));
    command.env("NO_COLOR", "1").stdin(Stdio::null());
    command
}

/// Runs `infer` with `args` and returns its output.
pub fn run(args: &[&str]) -> Output {
    infer()
        .args(args)
        .output()
        .expect("failed to start the `infer` binary")
}

/// Runs `infer` with `args` and `stdin`, and returns its output.
pub fn run_with_stdin(args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut child = infer()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("failed to start the `infer` binary");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(stdin)
        .expect("write stdin");
    child.wait_with_output().expect("wait for `infer`")
}

/// Stdout of a run that must succeed (a failure shows the exit code and stderr).
pub fn stdout_ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "`infer` failed with {:?}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

/// One run for a snapshot: `$ infer ARGS`, its exit code, and its stdout and stderr (each
/// only when not empty), with every `redact` (text, placeholder) pair replaced.
pub fn transcript_of(args: &[&str], output: &Output, redact: &[(&str, &str)]) -> String {
    let mut text = format!(
        "$ infer {}\nexit {}\n",
        args.join(" "),
        output
            .status
            .code()
            .map_or("by a signal".to_string(), |c| c.to_string())
    );
    for (name, bytes) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
        if !bytes.is_empty() {
            text.push_str(&format!("{name}:\n{}", String::from_utf8_lossy(bytes)));
        }
    }
    for (from, to) in redact {
        text = text.replace(from, to);
    }
    text
}

/// The run directory, from the launcher's "…manifest.json in DIR" line in `stderr`.
pub fn run_dir_of(stderr: &str) -> String {
    stderr
        .split("manifest.json in ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no run directory in:\n{stderr}"))
        .to_string()
}

/// `infer doctor --run DIR --json` on run directory `dir`: its exit code and report.
pub fn postmortem(dir: &str) -> (Option<i32>, Value) {
    let output = run(&["doctor", "--run", dir, "--json"]);
    let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), report)
}

/// The run's `manifest.json`, from the launcher's "…manifest.json in DIR" line in `stderr`.
pub fn run_manifest(stderr: &str) -> Value {
    let dir = run_dir_of(stderr);
    serde_json::from_slice(
        &std::fs::read(Path::new(&dir).join("manifest.json")).expect("manifest.json"),
    )
    .expect("manifest JSON")
}

/// Whether `pid` is a running process. A zombie has been reaped by nobody yet; launchers
/// reap their ranks, so a live `/proc/<pid>` that is not a zombie means a leftover process.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

/// Sends `signal` to `pid`; panics when it cannot.
pub fn signal(pid: u32, signal: rustix::process::Signal) {
    let target = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    rustix::process::kill_process(target, signal)
        .unwrap_or_else(|e| panic!("cannot send {signal:?} to pid {pid}: {e}"));
}

/// Waits up to `within` for `child` to exit and returns its status; `None` when it did not
/// (it is then killed and reaped, so nothing is left running).
pub fn wait_exit(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `infer up` as node `rank` of a two-node `--nnodes` launch on this host (node 0's store
/// on 127.0.0.1:`store_port`, one thread a rank, the shared secret set; node 0 serves on a
/// free port), with `layout`'s flags.
pub fn nnodes_up(rank: &str, store_port: &str, layout: &[&str]) -> Command {
    let mut command = infer();
    command
        .args(["up", "--threads", "1", "--nnodes", "2", "--node-rank", rank])
        .args(["--master-addr", "127.0.0.1", "--master-port", store_port])
        .args(layout)
        .env("INFER_RUN_TOKEN", "nnodes-test-secret-of-enough-length");
    if rank == "0" {
        command.args(["--port", "0"]);
    }
    command
}

/// Starts the other node of a two-node `--nnodes` launch (`command`, from [`nnodes_up`])
/// half a second from now, on a thread, so that node 0, started meanwhile, hosts the store
/// it joins; stdout is dropped and stderr goes to `stderr`. Join the handle for the child.
pub fn join_later(mut command: Command, stderr: Stdio) -> std::thread::JoinHandle<Child> {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        command
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start node 1")
    })
}
