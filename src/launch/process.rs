//! Child processes of a gang: finding a program on `PATH`, starting one in its own process
//! group with a parent-death signal and its output copied to a log, running one to completion
//! with a timeout.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// `name` as `execvp` would find it: itself when it names a path (has a `/`), else the
/// first executable file of that name in `path` (a `PATH`-style list).
pub fn find_program(name: &str, path: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.contains('/') {
        let candidate = PathBuf::from(name);
        return executable(&candidate).then_some(candidate);
    }
    std::env::split_paths(path)
        .map(|dir| dir.join(name))
        .find(|candidate| executable(candidate))
}

/// Starts `program args…` as a gang member: exactly `env` plus `PATH` and `HOME`, its own
/// process group, a parent-death signal, stdout and stderr line by line to `log` and to
/// `line`. The same caveat as [`super::spawn::start_rank_process`] about the spawning thread holds.
///
/// Errors: the log file cannot be created, the process cannot be started.
pub fn start_process(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    line: impl Fn(String) + Clone + Send + 'static,
) -> Result<Child> {
    let file = super::run_dir::create_private(log)
        .with_context(|| format!("cannot create `{}`", log.display()))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", std::env::var_os("HOME").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: `set_parent_process_death_signal` is one prctl(2) call, async-signal-safe,
    // allowed between fork and exec; it allocates nothing and touches no lock.
    unsafe {
        command.pre_exec(|| {
            // If the parent dies (even by SIGKILL), the kernel kills the rank.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(std::io::Error::from)
        });
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start `{}`", program.display()))?;
    let log_file = std::sync::Arc::new(std::sync::Mutex::new(file));
    let outputs: [Option<Box<dyn std::io::Read + Send>>; 2] = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ];
    for output in outputs.into_iter().flatten() {
        let (log_file, line) = (std::sync::Arc::clone(&log_file), line.clone());
        std::thread::spawn(move || {
            use std::io::{BufRead, Write};
            for text in std::io::BufReader::new(output).lines() {
                let Ok(text) = text else { break };
                if let Ok(mut file) = log_file.lock() {
                    let _ = writeln!(file, "{text}");
                }
                line(text);
            }
        });
    }
    Ok(child)
}

/// Runs `argv` (no shell: `argv[0]` found on `PATH` unless it names a path) with this
/// process's environment plus `env`, for at most `timeout` (then its process group is
/// killed), keeping each stream's first 64 KiB. What an agent answers to
/// [`super::protocol::ToAgent::Exec`], and how `infer up --engine` probes this host.
pub fn run_program(argv: &[String], env: &[(String, String)], timeout: Duration) -> Executed {
    const KEEP_BYTES: usize = 64 << 10;
    let failed = |program: Option<String>, error: String| Executed {
        program,
        code: None,
        stdout: String::new(),
        stderr: String::new(),
        error: Some(error),
    };
    let Some((name, args)) = argv.split_first() else {
        return failed(None, "an empty command line".into());
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    let Some(program) = find_program(name, &path) else {
        return failed(None, format!("`{name}` is not on this host's PATH"));
    };
    let shown = program.display().to_string();
    use std::os::unix::process::CommandExt;
    let child = std::process::Command::new(&program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) => return failed(Some(shown), format!("cannot start it: {error}")),
    };
    let read = |stream: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(stream) = stream {
                use std::io::Read;
                let _ = stream.take(KEEP_BYTES as u64).read_to_end(&mut bytes);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                }
                let _ = child.wait();
                break None;
            }
        }
    };
    let (stdout, stderr) = (
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    );
    match status {
        Some(status) => Executed {
            program: Some(shown),
            code: status.code(),
            stdout,
            stderr,
            error: None,
        },
        None => Executed {
            program: Some(shown),
            code: None,
            stdout,
            stderr,
            error: Some(format!("no answer within {} s", timeout.as_secs())),
        },
    }
}

/// What a program run by [`run_program`] (here or through an agent) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Executed {
    /// The program's path as the host found it; `None`: not found.
    pub program: Option<String>,
    /// Its exit code; `None`: not found, killed or out of time (`error` says which).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub error: Option<String>,
}
