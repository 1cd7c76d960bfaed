//! Launching ranks with gang semantics: one `infer rank` process per rank with its
//! environment set explicitly (never inherited by accident), its own process group and its
//! own log file in a run directory; a rendezvous store protected by a random per-run token.
//! When any rank exits or stops heartbeating, every other rank is stopped (SIGTERM, then
//! SIGKILL after a grace period) and the error names the rank, its exit status and its last
//! log lines. Remote hosts (SSH) come later behind the same spawning code.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::rendezvous::{StoreClient, StoreServer, random_token};
use crate::runtime::engine::Generation;
use crate::runtime::worker::Job;

/// How long a rank may go without a heartbeat before the gang is stopped.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time between SIGTERM and SIGKILL when stopping the gang.
pub const GRACE_PERIOD: Duration = Duration::from_secs(2);

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub tp: usize,
    pub pp: usize,
    pub model: PathBuf,
    /// Threads of each rank's pool.
    pub threads_per_rank: usize,
    /// Timeout of collectives and store waits inside the ranks.
    pub timeout: Duration,
}

/// A started rank.
struct RankProcess {
    rank: usize,
    child: Child,
    log: PathBuf,
}

/// Runs one generation on `tp × pp` local rank processes and returns the driver's result.
/// `progress` receives one line per milestone (ranks started, result).
///
/// Errors: a rank that fails or stops heartbeating (after every rank has been stopped), a
/// store that cannot start.
pub fn run_generation(
    spec: &LaunchSpec,
    job: &Job,
    progress: &mut dyn FnMut(&str),
) -> Result<Generation> {
    let world = spec.tp * spec.pp;
    let token = random_token();
    let server = StoreServer::start("127.0.0.1:0", &token)?;
    let run_dir = tempfile::Builder::new()
        .prefix("infer-run-")
        .tempdir()
        .context("cannot create a run directory")?
        .keep();
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        match spawn_rank(&exe, rank, world, spec, &server, &token, &run_dir) {
            Ok(process) => ranks.push(process),
            Err(error) => {
                stop_gang(&mut ranks);
                return Err(error);
            }
        }
    }
    let pids: Vec<String> = ranks
        .iter()
        .map(|r| format!("rank {} pid {}", r.rank, r.child.id()))
        .collect();
    progress(&format!(
        "started {world} ranks ({}); logs in {}",
        pids.join(", "),
        run_dir.display()
    ));
    let mut client = StoreClient::connect(
        &server.address().to_string(),
        &token,
        None,
        Duration::from_secs(10),
    )?;
    client.set("job", &serde_json::to_vec(job)?)?;
    let result = monitor(&mut ranks, &server, &mut client);
    if result.is_err() {
        stop_gang(&mut ranks);
    } else {
        // The ranks exit on their own after the last step; do not wait forever.
        let deadline = Instant::now() + GRACE_PERIOD;
        while Instant::now() < deadline
            && ranks
                .iter_mut()
                .any(|r| matches!(r.child.try_wait(), Ok(None)))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop_gang(&mut ranks);
    }
    result
}

fn spawn_rank(
    exe: &Path,
    rank: usize,
    world: usize,
    spec: &LaunchSpec,
    server: &StoreServer,
    token: &str,
    run_dir: &Path,
) -> Result<RankProcess> {
    let log = run_dir.join(format!("rank{rank}.log"));
    let file = File::create(&log).with_context(|| format!("cannot create `{}`", log.display()))?;
    let mut command = Command::new(exe);
    command
        .arg("rank")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", std::env::var_os("HOME").unwrap_or_default())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", server.address().ip().to_string())
        .env("MASTER_PORT", server.address().port().to_string())
        .env("INFER_RUN_TOKEN", token)
        .env("INFER_TP", spec.tp.to_string())
        .env("INFER_PP", spec.pp.to_string())
        .env("INFER_MODEL", &spec.model)
        .env("INFER_THREADS", spec.threads_per_rank.to_string())
        .env("INFER_TIMEOUT_SECS", spec.timeout.as_secs().to_string())
        // CPU ranks: no GPU is visible.
        .env("CUDA_VISIBLE_DEVICES", "")
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        // Its own process group, so stopping the gang reaches anything the rank starts.
        .process_group(0);
    let child = command
        .spawn()
        .with_context(|| format!("failed to start rank {rank}"))?;
    Ok(RankProcess { rank, child, log })
}

/// Every rank that has exited unsuccessfully: (killed by a signal, rank, status, log path).
fn failed_ranks(
    ranks: &mut [RankProcess],
) -> Result<Vec<(bool, usize, std::process::ExitStatus, PathBuf)>> {
    use std::os::unix::process::ExitStatusExt;
    let mut failed = Vec::new();
    for rank in ranks.iter_mut() {
        if let Some(status) = rank.child.try_wait()? {
            if !status.success() {
                failed.push((
                    status.signal().is_some(),
                    rank.rank,
                    status,
                    rank.log.clone(),
                ));
            }
        }
    }
    Ok(failed)
}

/// Waits for the driver's result while watching every rank.
fn monitor(
    ranks: &mut [RankProcess],
    server: &StoreServer,
    client: &mut StoreClient,
) -> Result<Generation> {
    loop {
        // Every rank that failed since the last look; the one killed by a signal is the
        // cause, the others usually its casualties (they lost their peer).
        let mut failed = failed_ranks(ranks)?;
        if !failed.is_empty() && !failed.iter().any(|(signalled, ..)| *signalled) {
            // A casualty can notice its lost peer before the kernel has reaped the killed
            // rank; give the cause a moment to show up so the error names it.
            std::thread::sleep(Duration::from_millis(300));
            failed = failed_ranks(ranks)?;
        }
        if let Some((_, rank, status, log)) = failed
            .iter()
            .max_by_key(|(signalled, rank, ..)| (*signalled, std::cmp::Reverse(*rank)))
        {
            bail!(
                "rank {rank} exited with {status}; last lines of `{}`:\n{}",
                log.display(),
                last_lines(log, 8)
            );
        }
        for (rank, age) in server.heartbeat_ages() {
            if age > HEARTBEAT_TIMEOUT {
                bail!(
                    "rank {rank} stopped heartbeating {:.1} s ago",
                    age.as_secs_f64()
                );
            }
        }
        match client.get("result", Duration::from_millis(50)) {
            Ok(bytes) => {
                return serde_json::from_slice(&bytes)
                    .context("the driver wrote a malformed result");
            }
            Err(error) if error.to_string().contains("timed out") => {}
            Err(error) => return Err(error),
        }
        if ranks
            .iter_mut()
            .all(|r| matches!(r.child.try_wait(), Ok(Some(_))))
        {
            return Err(anyhow!("every rank exited without a result"));
        }
    }
}

/// SIGTERM to every live rank's process group, then SIGKILL after [`GRACE_PERIOD`], and reap.
fn stop_gang(ranks: &mut [RankProcess]) {
    for rank in ranks.iter_mut() {
        if matches!(rank.child.try_wait(), Ok(None)) {
            signal_group(&rank.child, rustix::process::Signal::TERM);
        }
    }
    let deadline = Instant::now() + GRACE_PERIOD;
    while Instant::now() < deadline
        && ranks
            .iter_mut()
            .any(|r| matches!(r.child.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for rank in ranks.iter_mut() {
        if matches!(rank.child.try_wait(), Ok(None)) {
            signal_group(&rank.child, rustix::process::Signal::KILL);
        }
        let _ = rank.child.wait();
    }
}

fn signal_group(child: &Child, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

fn last_lines(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
