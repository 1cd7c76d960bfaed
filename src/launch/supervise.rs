//! `infer up --max-restarts N`: the launcher as the supervisor of what serves (torchrun's
//! elastic agent, for a serving gang). The HTTP front ([`crate::serve::front`]) listens at
//! `--host:--port` in this process and outlives every start; behind it serves rank 0 on
//! loopback (through the SSH tunnel on a cluster), or with `--engine` the engine's head
//! ([`super::engine_supervise`]). When a process exits, a rank stops heartbeating, a host is
//! lost, or what serves stays stalled [`STALL_GRACE`] past `--stall-timeout`, every process
//! of the start is stopped everywhere (no orphan), its files are moved to `restart-K/` in
//! the run directory, and a new start begins on the same hosts (a gang: new ports, a new
//! store; on a cluster through the agents already running). After `N` restarts the next
//! failure ends the run with its cause, as without `--max-restarts`.
//!
//! [`supervise`] is the loop; a [`Supervisee`] is what it starts again: [`Ranks`] here,
//! an engine's processes in [`super::engine_supervise`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

use super::events::{UpEvent, watch_signals};
use super::gang::{FailureKind, GangFailure};
use super::hosts::{ClusterHosts, ClusterOptions};
use super::{Gang, LaunchSpec, Progress};
use crate::runtime::exec::worker::Job;
use crate::serve::front::{Front, RestartCause};

/// How long what serves stays stalled (past `--stall-timeout`) before it is restarted: a
/// step that was merely slow has had `--stall-timeout` plus this to finish.
pub(crate) const STALL_GRACE: Duration = Duration::from_secs(5);

/// How often the watchdog asks rank 0's `/health`.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// What a supervised run of infer's ranks needs besides the spec.
pub(super) struct Supervised<'a> {
    /// Restarts allowed (`--max-restarts`, at least 1 here).
    pub max_restarts: usize,
    pub stall_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub host: &'a str,
    pub port: u16,
    /// The API key `/metrics` requires (`--protect-metrics`).
    pub metrics_key: Option<String>,
    /// The inventory's hosts, when the ranks run there.
    pub cluster: Option<ClusterOptions>,
    /// `dp × pp × tp`, for the ready line.
    pub layout: String,
}

/// What a supervised run starts again after each failure: infer's rank gang ([`Ranks`]), or
/// the processes of an engine launched with `--engine`.
pub(super) trait Supervisee {
    /// One start's processes, as the loop stops them and keeps their files.
    type Started: Started;

    /// What the messages call it: `gang`, `engine`.
    const NAME: &'static str;

    /// Starts it, waits until it serves, points the front at it ([`Attempt::serving`]) and
    /// watches it until a signal (then drained and stopped: [`Ended::Stopped`]) or a
    /// failure (its processes left for the loop to stop).
    fn attempt(
        &mut self,
        attempt: &Attempt<'_>,
        events: &mut dyn FnMut(UpEvent),
    ) -> Outcome<Self::Started>;
}

/// The processes of one start, as the supervisor's loop handles them after it ended.
pub(super) trait Started {
    /// Stops every process still running, on every host, and reaps them.
    fn stop(&mut self);
    /// Writes `outcome.json` in the run directory: how the start ended (`None`: stopped on
    /// request). Best effort.
    fn write_outcome(&mut self, error: Option<&anyhow::Error>);
    /// The run directory its files are in.
    fn run_dir(&self) -> &Path;
}

/// How one start went: its processes (`None` when none started), how it ended, and how
/// long it took to serve (`None` when it never did), seconds.
pub(super) struct Outcome<S> {
    pub started: Option<S>,
    pub ended: Ended,
    pub ready_secs: Option<f64>,
}

/// How one start ended.
pub(super) enum Ended {
    /// Ctrl-C/SIGTERM: drained and stopped.
    Stopped,
    /// Failed: why (for `/metrics`), the error.
    Failed(RestartCause, anyhow::Error),
}

/// One failure that was restarted, for the manifest's `restarts`.
#[derive(serde::Serialize)]
pub(super) struct Restart {
    restart: usize,
    cause: &'static str,
    error: String,
    /// Where the failed start's files went.
    files: PathBuf,
}

/// One start of a supervised run, as the loop hands it to its [`Supervisee`].
pub(super) struct Attempt<'a> {
    pub front: &'a Front,
    /// How many SIGINTs and SIGTERMs arrived.
    pub signals: &'a AtomicUsize,
    /// 0 for the first start.
    pub restart: usize,
    pub max_restarts: usize,
    /// The failures restarted so far.
    pub restarts: &'a [Restart],
    /// The run directory of the earlier starts (`None` for the first): a restart goes on
    /// there.
    pub run_dir: Option<&'a Path>,
    /// When the run began: the first ready line counts from it.
    pub started: Instant,
}

impl Attempt<'_> {
    /// Whether Ctrl-C or SIGTERM arrived.
    pub(super) fn is_stopped(&self) -> bool {
        self.signals.load(Ordering::SeqCst) > 0
    }

    /// The restarts so far as the manifest's `restarts` (`None` before the first).
    pub(super) fn restarts_json(&self) -> Option<serde_json::Value> {
        (!self.restarts.is_empty()).then(|| serde_json::to_value(self.restarts).unwrap_or_default())
    }

    /// Points the front at `upstream`, which served `ready_secs` after this start began,
    /// and says so: the ready line (`world_size` processes in `layout`) on the first start,
    /// "serving again" after a restart.
    pub(super) fn serving(
        &self,
        upstream: SocketAddr,
        ready_secs: f64,
        world_size: usize,
        layout: &str,
        events: &mut dyn FnMut(UpEvent),
    ) {
        self.front.serving(upstream);
        let url = format!("http://{}", self.front.address());
        match self.restart {
            0 => events(UpEvent::Ready {
                address: self.front.address().to_string(),
                world_size,
                layout: layout.to_string(),
                ready_secs: self.started.elapsed().as_secs_f64(),
            }),
            restart => events(UpEvent::Note(format!(
                "serving again on {url} after restart {restart} of {} (ready in {ready_secs:.2} s)",
                self.max_restarts,
            ))),
        }
    }
}

/// Serves `spec` (rank 0 on loopback, port 0) behind the front until Ctrl-C/SIGTERM, or
/// until a failure finds no restart left.
///
/// Errors: the address cannot be bound, a cluster's preflight fails, the last failure
/// (with how many restarts came before).
pub(super) fn serve(
    spec: &LaunchSpec,
    settings: &Supervised,
    started: Instant,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    // Bad layouts fail as themselves, before anything listens.
    spec.check_layout()?;
    let front = Front::bind(settings.host, settings.port, settings.metrics_key.clone())?;
    let signals = Arc::new(AtomicUsize::new(0));
    watch_signals(Arc::clone(&signals))?;
    events(UpEvent::Listening(front.address()));
    let hosts = match &settings.cluster {
        Some(options) => Some(super::hosts::connect(spec, options, &mut |p| {
            events(UpEvent::Gang(p))
        })?),
        None => None,
    };
    let mut ranks = Ranks {
        spec,
        settings,
        hosts: hosts.as_ref(),
    };
    let limits = Limits {
        max_restarts: settings.max_restarts,
        started,
    };
    supervise(&mut ranks, &front, &signals, &limits, events)
}

/// What the loop of [`supervise`] is given besides what it starts.
pub(super) struct Limits {
    /// Restarts allowed (`--max-restarts`, at least 1).
    pub max_restarts: usize,
    /// When the run began.
    pub started: Instant,
}

/// Starts `supervisee` behind `front` and starts it again after each failure, until
/// Ctrl-C/SIGTERM (counted in `signals`) or until a failure finds no restart left.
///
/// Errors: the last failure (with how many restarts came before).
pub(super) fn supervise<S: Supervisee>(
    supervisee: &mut S,
    front: &Front,
    signals: &AtomicUsize,
    limits: &Limits,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    let mut restarts: Vec<Restart> = Vec::new();
    let mut run_dir: Option<PathBuf> = None;
    // What the last start took to serve: `Retry-After` while restarting.
    let mut ready_secs = limits.started.elapsed().as_secs_f64();
    let mut served = false;
    loop {
        let restart = restarts.len();
        let attempt = Attempt {
            front,
            signals,
            restart,
            max_restarts: limits.max_restarts,
            restarts: &restarts,
            run_dir: run_dir.as_deref(),
            started: limits.started,
        };
        let outcome = supervisee.attempt(&attempt, events);
        ready_secs = outcome.ready_secs.unwrap_or(ready_secs);
        // A first start that never served is a bad layout, model or host, not a fault:
        // starting it again would fail the same way.
        served |= outcome.ready_secs.is_some();
        let (cause, error) = match outcome.ended {
            Ended::Stopped => {
                if let Some(mut started) = outcome.started {
                    started.write_outcome(None);
                }
                return Ok(());
            }
            Ended::Failed(cause, error) => (cause, error),
        };
        let restarting = restart < limits.max_restarts && served;
        if restarting {
            // Before the processes stop: what the server answers while it stops is the
            // restart's fault, and the front says so.
            announce(
                front,
                Failure {
                    name: S::NAME,
                    cause,
                    error: &error,
                },
                (restart + 1, limits.max_restarts),
                ready_secs,
                events,
            );
        }
        let mut files = PathBuf::new();
        if let Some(mut started) = outcome.started {
            started.stop();
            started.write_outcome(Some(&error));
            let dir = started.run_dir().to_path_buf();
            drop(started);
            run_dir.get_or_insert(dir.clone());
            if restarting {
                files = dir.join(format!("restart-{}", restart + 1));
                if let Err(move_error) = move_files(&dir, &files) {
                    events(UpEvent::Note(format!(
                        "warning: cannot keep the failed start's files: {move_error:#}"
                    )));
                }
            }
        }
        if !restarting {
            return Err(gave_up(S::NAME, error, restart));
        }
        restarts.push(Restart {
            restart: restart + 1,
            cause: cause.label(),
            error: format!("{error:#}"),
            files,
        });
    }
}

/// The last failure of the `name` (`gang`, `engine`), saying how many restarts came before
/// it.
fn gave_up(name: &str, error: anyhow::Error, restarts: usize) -> anyhow::Error {
    match restarts {
        0 => error,
        n => error.context(format!(
            "the {name} failed again after {n} restart{} (--max-restarts {n}); the run directory keeps each failed start's files in `restart-K/`",
            if n == 1 { "" } else { "s" }
        )),
    }
}

/// A failure the loop restarts: of what (`gang`, `engine`), why, the error.
struct Failure<'a> {
    name: &'static str,
    cause: RestartCause,
    error: &'a anyhow::Error,
}

/// Tells the front and the user that restart `restart` of `max_restarts` begins after
/// `failure`; `start_secs` is what the last start took to serve.
fn announce(
    front: &Front,
    failure: Failure<'_>,
    (restart, max_restarts): (usize, usize),
    start_secs: f64,
    events: &mut dyn FnMut(UpEvent),
) {
    let first_line = first_line(failure.error);
    front.restarting(
        failure.cause,
        &first_line,
        restart,
        max_restarts,
        start_secs.ceil() as u64,
    );
    events(UpEvent::Note(format!(
        "warning: restarting the {} (restart {restart} of {max_restarts}, --max-restarts) after: {first_line}",
        failure.name
    )));
}

/// The first line of `error`, without the log lines it announces (a rank's "; last lines of
/// `…`", an engine process's "; its last lines:"): the run directory keeps them.
fn first_line(error: &anyhow::Error) -> String {
    let text = format!("{error:#}");
    let line = text.lines().next().unwrap_or_default();
    ["; last lines of `", "; its last lines:"]
        .iter()
        .fold(line, |line, marker| {
            line.split(marker).next().unwrap_or(line)
        })
        .to_string()
}

/// Moves the files (not the directories) of `dir` into `to`: a failed start's logs,
/// manifest and outcome, out of the next start's way.
///
/// Errors: `to` cannot be created, a file cannot be moved.
fn move_files(dir: &Path, to: &Path) -> Result<()> {
    super::run_dir::private_dir(to).with_context(|| format!("cannot create `{}`", to.display()))?;
    for entry in
        std::fs::read_dir(dir).with_context(|| format!("cannot read `{}`", dir.display()))?
    {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::rename(entry.path(), to.join(entry.file_name()))
                .with_context(|| format!("cannot move `{}`", entry.path().display()))?;
        }
    }
    Ok(())
}

/// infer's own rank gang as a [`Supervisee`]: each start a new gang, here or through the
/// cluster's agents, rank 0 watched through its `/health`.
struct Ranks<'a> {
    spec: &'a LaunchSpec,
    settings: &'a Supervised<'a>,
    hosts: Option<&'a ClusterHosts>,
}

impl Started for Gang {
    fn stop(&mut self) {
        Gang::stop(self);
    }

    fn write_outcome(&mut self, error: Option<&anyhow::Error>) {
        Gang::write_outcome(self, error);
    }

    fn run_dir(&self) -> &Path {
        Gang::run_dir(self)
    }
}

impl Supervisee for Ranks<'_> {
    type Started = Gang;
    const NAME: &'static str = "gang";

    fn attempt(&mut self, attempt: &Attempt<'_>, events: &mut dyn FnMut(UpEvent)) -> Outcome<Gang> {
        let began = Instant::now();
        let mut gang = match self.start(attempt) {
            Ok(gang) => gang,
            Err(error) => {
                return Outcome {
                    started: None,
                    ended: Ended::Failed(RestartCause::StartFailed, error),
                    ready_secs: None,
                };
            }
        };
        let (ended, ready_secs) = self.serve(&mut gang, attempt, began, events);
        Outcome {
            started: Some(gang),
            ended,
            ready_secs,
        }
    }
}

impl Ranks<'_> {
    /// [`Supervisee::attempt`] once `gang` has started: how it ended, and how long it took
    /// to serve.
    fn serve(
        &self,
        gang: &mut Gang,
        attempt: &Attempt<'_>,
        began: Instant,
        events: &mut dyn FnMut(UpEvent),
    ) -> (Ended, Option<f64>) {
        gang.fail_on_any_exit();
        if let Some(restarts) = attempt.restarts_json() {
            gang.set_manifest_field("restarts", restarts);
        }
        let mut report = |event: Progress| events(UpEvent::Gang(event));
        report(gang.started());
        let is_stopped = || attempt.is_stopped();
        let address = match gang.wait_for(crate::rendezvous::READY_KEY, &is_stopped, &mut report) {
            Ok(Some(address)) => address,
            Ok(None) => {
                gang.stop();
                events(UpEvent::Note("stopped before the ranks were ready".into()));
                return (Ended::Stopped, None);
            }
            Err(error) => return (Ended::Failed(classify(&error), error), None),
        };
        let upstream = match self.upstream(&address) {
            Ok(upstream) => upstream,
            Err(error) => return (Ended::Failed(RestartCause::StartFailed, error), None),
        };
        let ready_secs = began.elapsed().as_secs_f64();
        let url = format!("http://{}", attempt.front.address());
        if let Err(error) = gang.write_manifest(self.spec, Some(&url)) {
            events(UpEvent::Note(format!("warning: {error:#}")));
        }
        attempt.serving(
            upstream.address,
            ready_secs,
            self.spec.degrees.world_size(),
            &self.settings.layout,
            events,
        );
        let ended = self.watch(gang, &upstream, attempt, events);
        (ended, Some(ready_secs))
    }

    /// Watches the serving `gang` (rank 0 at `upstream`) until a signal (then drained) or a
    /// failure: a rank's, or a stall the watchdog found.
    fn watch(
        &self,
        gang: &mut Gang,
        upstream: &Upstream,
        attempt: &Attempt<'_>,
        events: &mut dyn FnMut(UpEvent),
    ) -> Ended {
        let watchdog = Watchdog::start(upstream.address, self.settings.stall_timeout, STALL_GRACE);
        let stopped_or_stalled = || attempt.is_stopped() || watchdog.stalled().is_some();
        let mut report = |event: Progress| events(UpEvent::Gang(event));
        let watched = gang.wait_for("never", &stopped_or_stalled, &mut report);
        let stall = watchdog.stalled();
        drop(watchdog);
        if let Some(forward) = &upstream.forward {
            // Connections already relayed end on their own when the ranks go.
            forward.abort();
        }
        match watched {
            Err(error) => Ended::Failed(classify(&error), error),
            Ok(_) if attempt.is_stopped() => {
                let drained = super::serving::drain(
                    gang,
                    self.settings.shutdown_timeout,
                    None,
                    attempt.signals,
                    events,
                );
                match drained {
                    Ok(()) => Ended::Stopped,
                    Err(error) => Ended::Failed(classify(&error), error),
                }
            }
            Ok(_) => Ended::Failed(
                RestartCause::Stalled,
                anyhow!(stall.unwrap_or_else(|| "a replica stalled".into())),
            ),
        }
    }

    /// Starts the gang: on the cluster's hosts through their agents, or here; a restart in
    /// the run directory of the first start.
    ///
    /// Errors: the store or a rank cannot start.
    fn start(&self, attempt: &Attempt<'_>) -> Result<Gang> {
        if let Some(hosts) = self.hosts {
            return hosts.start_gang_in(&Job::Serve, attempt.restart, attempt.run_dir);
        }
        let mut spec = self.spec.clone();
        spec.restart = attempt.restart;
        if let Some(dir) = attempt.run_dir {
            spec.run_dir = Some(dir.to_path_buf());
        }
        Gang::start(&spec, &Job::Serve)
    }

    /// Where the front reaches rank 0's server, which published `address`: there, or on
    /// a cluster a local port forwarded to it over rank 0's host's SSH connection.
    ///
    /// Errors: a malformed address, a forward that cannot start.
    fn upstream(&self, address: &[u8]) -> Result<Upstream> {
        let text = String::from_utf8_lossy(address);
        let remote: SocketAddr = text
            .parse()
            .with_context(|| format!("rank 0 published a malformed address `{text}`"))?;
        let Some(hosts) = self.hosts else {
            return Ok(Upstream {
                address: remote,
                forward: None,
            });
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .context("cannot open the local end of rank 0's tunnel")?;
        let local = listener.local_addr()?;
        let forward = hosts.remote.forward(hosts.rank0_host, remote, listener)?;
        Ok(Upstream {
            address: local,
            forward: Some(forward),
        })
    }
}

/// Where the front reaches rank 0, and the forward that carries it on a cluster.
struct Upstream {
    address: SocketAddr,
    forward: Option<tokio::task::AbortHandle>,
}

/// What failed a gang, for `infer_restarts_total{cause}`.
fn classify(error: &anyhow::Error) -> RestartCause {
    match error.downcast_ref::<GangFailure>().map(|f| f.kind) {
        Some(FailureKind::RankExited) => RestartCause::RankExited,
        Some(FailureKind::HeartbeatLost) => RestartCause::HeartbeatLost,
        Some(FailureKind::HostLost) => RestartCause::HostLost,
        None => RestartCause::Other,
    }
}

/// Asks rank 0's `/health` every [`WATCH_INTERVAL`] on its own thread; once a replica has
/// been stalled for the grace, or rank 0 has not answered for `--stall-timeout` plus the
/// grace, says why (and stops asking).
struct Watchdog {
    verdict: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(upstream: SocketAddr, stall_timeout: Duration, grace: Duration) -> Watchdog {
        let verdict = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (found, stopped) = (Arc::clone(&verdict), Arc::clone(&stop));
        let _ = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                let why = watch(upstream, stall_timeout, grace, &stopped);
                if let (Some(why), Ok(mut verdict)) = (why, found.lock()) {
                    *verdict = Some(why);
                }
            });
        Watchdog { verdict, stop }
    }

    /// Why the gang must restart, once the watchdog has found it.
    fn stalled(&self) -> Option<String> {
        self.verdict.lock().ok().and_then(|v| v.clone())
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The watchdog's loop: `Some(why)` when the gang must restart, `None` when told to stop.
fn watch(
    upstream: SocketAddr,
    stall_timeout: Duration,
    grace: Duration,
    stop: &AtomicBool,
) -> Option<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("http://{upstream}/health");
    let mut answered = Instant::now();
    let mut stalled_since: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let asked = Instant::now();
        let body = agent
            .get(&url)
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_json::<serde_json::Value>().ok());
        match body {
            Some(body) => {
                answered = Instant::now();
                match stalled(&body) {
                    Some(why) => {
                        let since = *stalled_since.get_or_insert(asked);
                        if since.elapsed() >= grace {
                            return Some(why);
                        }
                    }
                    None => stalled_since = None,
                }
            }
            None if answered.elapsed() >= stall_timeout + grace => {
                return Some(format!(
                    "rank 0's server has not answered /health for {:.0} s",
                    answered.elapsed().as_secs_f64()
                ));
            }
            None => {}
        }
        std::thread::sleep(WATCH_INTERVAL.saturating_sub(asked.elapsed()));
    }
    None
}

/// What a `/health` answer says is stalled (its replicas' reasons and diagnoses), if any
/// replica is: the verdict itself (200) or under `health` (503).
fn stalled(body: &serde_json::Value) -> Option<String> {
    let verdict = body.get("health").unwrap_or(body);
    let reasons: Vec<String> = verdict["replicas"]
        .as_array()?
        .iter()
        .filter(|r| r["status"] == "stalled")
        .map(|r| {
            let reason = r["reason"].as_str().unwrap_or("a replica stalled");
            match r["diagnosis"].as_str() {
                Some(diagnosis) => format!("{reason} — {diagnosis}"),
                None => reason.to_string(),
            }
        })
        .collect();
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_announced_cause_is_the_first_line_without_the_log_lines_it_announces() {
        let rank = anyhow!(
            "rank 1 exited with signal: 9 (SIGKILL); last lines of `rank1.log`:\n  | loaded"
        );
        assert_eq!(first_line(&rank), "rank 1 exited with signal: 9 (SIGKILL)");
        let engine = anyhow!(
            "`localhost llama-server` (node 0) exited (signal: 9 (SIGKILL)); the engine is down; its last lines:\n  | main: loop"
        );
        assert_eq!(
            first_line(&engine),
            "`localhost llama-server` (node 0) exited (signal: 9 (SIGKILL)); the engine is down"
        );
        let gave_up = gave_up("engine", engine, 1);
        assert!(
            format!("{gave_up:#}").starts_with(
                "the engine failed again after 1 restart (--max-restarts 1); the run directory keeps"
            ),
            "{gave_up:#}"
        );
    }

    #[test]
    fn a_stall_is_read_from_either_health_answer() {
        let degraded = serde_json::json!({"status": "degraded", "replicas": [
            {"status": "ok"},
            {"status": "stalled", "reason": "replica 1 stalled 3 s", "diagnosis": "rank 2 waits on rank 3"}]});
        assert_eq!(
            stalled(&degraded).as_deref(),
            Some("replica 1 stalled 3 s — rank 2 waits on rank 3")
        );
        let unavailable = serde_json::json!({"error": {"message": "…"}, "health": {"status": "unavailable", "replicas": [
            {"status": "stalled", "reason": "replica 0 stalled 2 s"}]}});
        assert_eq!(
            stalled(&unavailable).as_deref(),
            Some("replica 0 stalled 2 s")
        );
        let healthy = serde_json::json!({"status": "ok", "replicas": [{"status": "ok"}]});
        assert_eq!(stalled(&healthy), None);
    }
}
