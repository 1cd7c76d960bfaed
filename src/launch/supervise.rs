//! `infer up --max-restarts N`: the launcher as the gang's supervisor (torchrun's elastic
//! agent, for a serving gang). The HTTP front ([`crate::serve::front`]) listens at
//! `--host:--port` in this process and outlives every gang; rank 0 serves behind it on
//! loopback (through the SSH tunnel on a cluster). When a rank exits, stops heartbeating, its
//! host is lost, or a replica stays stalled [`STALL_GRACE`] past `--stall-timeout`, the whole
//! gang is stopped everywhere (no orphan), its files are moved to `restart-K/` in the run
//! directory, and a new gang starts on the same hosts (new ports, a new store; on a cluster
//! through the agents already running). After `N` restarts the next failure ends the run
//! with its cause, as without `--max-restarts`.

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

/// How long a replica stays stalled (`/health` says so, past `--stall-timeout`) before its
/// gang is restarted: a step that was merely slow has had `--stall-timeout` plus this to
/// finish.
pub(crate) const STALL_GRACE: Duration = Duration::from_secs(5);

/// How often the watchdog asks rank 0's `/health`.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// What a supervised run needs besides the spec.
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

/// How one start went: its gang (`None` when it did not start), how it ended, and how long
/// it took to serve (`None` when it never did).
struct Outcome {
    gang: Option<Gang>,
    ended: Ended,
    ready_secs: Option<f64>,
}

/// How one gang ended.
enum Ended {
    /// Ctrl-C/SIGTERM: drained and stopped.
    Stopped,
    /// Failed: why (for `/metrics`), the error.
    Failed(RestartCause, anyhow::Error),
}

/// One failure that was restarted, for the manifest's `restarts`.
#[derive(serde::Serialize)]
struct Restart {
    restart: usize,
    cause: &'static str,
    error: String,
    /// Where the failed start's files went.
    files: PathBuf,
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
    let mut restarts: Vec<Restart> = Vec::new();
    let mut run_dir: Option<PathBuf> = None;
    // What the last start took to serve: `Retry-After` while restarting.
    let mut ready_secs = started.elapsed().as_secs_f64();
    let mut served = false;
    loop {
        let restart = restarts.len();
        let attempt = Attempt {
            spec,
            settings,
            hosts: hosts.as_ref(),
            front: &front,
            signals: &signals,
            restart,
        };
        let outcome = attempt.run(run_dir.as_deref(), &restarts, started, events);
        ready_secs = outcome.ready_secs.unwrap_or(ready_secs);
        // A first start that never served is a bad layout, model or host, not a fault:
        // starting it again would fail the same way.
        served |= outcome.ready_secs.is_some();
        let (cause, error) = match outcome.ended {
            Ended::Stopped => {
                if let Some(mut gang) = outcome.gang {
                    gang.write_outcome(None);
                }
                return Ok(());
            }
            Ended::Failed(cause, error) => (cause, error),
        };
        let restarting = restart < settings.max_restarts && served;
        if restarting {
            // Before the gang stops: what rank 0 answers while it stops is the restart's
            // fault, and the front says so.
            announce(
                &front,
                cause,
                &error,
                restart + 1,
                settings,
                ready_secs,
                events,
            );
        }
        let mut files = PathBuf::new();
        if let Some(mut gang) = outcome.gang {
            gang.stop();
            gang.write_outcome(Some(&error));
            let dir = gang.run_dir().to_path_buf();
            drop(gang);
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
            return Err(gave_up(error, restart));
        }
        restarts.push(Restart {
            restart: restart + 1,
            cause: cause.label(),
            error: format!("{error:#}"),
            files,
        });
    }
}

/// The last failure, saying how many restarts came before it.
fn gave_up(error: anyhow::Error, restarts: usize) -> anyhow::Error {
    match restarts {
        0 => error,
        n => error.context(format!(
            "the gang failed again after {n} restart{} (--max-restarts {n}); the run directory keeps each failed start's files in `restart-K/`",
            if n == 1 { "" } else { "s" }
        )),
    }
}

/// Tells the front and the user that restart `restart` begins after `error`.
fn announce(
    front: &Front,
    cause: RestartCause,
    error: &anyhow::Error,
    restart: usize,
    settings: &Supervised,
    start_secs: f64,
    events: &mut dyn FnMut(UpEvent),
) {
    // The first line, without the log lines it announces (the run directory keeps them).
    let text = format!("{error:#}");
    let first_line = text.lines().next().unwrap_or_default();
    let first_line = first_line
        .split("; last lines of `")
        .next()
        .unwrap_or(first_line)
        .to_string();
    front.restarting(
        cause,
        &first_line,
        restart,
        settings.max_restarts,
        start_secs.ceil() as u64,
    );
    events(UpEvent::Note(format!(
        "warning: restarting the gang (restart {restart} of {}, --max-restarts) after: {first_line}",
        settings.max_restarts
    )));
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

/// One start of the gang and its life.
struct Attempt<'a> {
    spec: &'a LaunchSpec,
    settings: &'a Supervised<'a>,
    hosts: Option<&'a ClusterHosts>,
    front: &'a Front,
    signals: &'a AtomicUsize,
    /// 0 for the first start.
    restart: usize,
}

impl Attempt<'_> {
    /// Starts the gang, waits until rank 0 serves, points the front at it and watches it
    /// until a signal (drained: [`Ended::Stopped`]) or a failure.
    fn run(
        &self,
        run_dir: Option<&Path>,
        restarts: &[Restart],
        started: Instant,
        events: &mut dyn FnMut(UpEvent),
    ) -> Outcome {
        let began = Instant::now();
        let mut gang = match self.start(run_dir) {
            Ok(gang) => gang,
            Err(error) => {
                return Outcome {
                    gang: None,
                    ended: Ended::Failed(RestartCause::StartFailed, error),
                    ready_secs: None,
                };
            }
        };
        let (ended, ready_secs) = self.serve(&mut gang, restarts, began, started, events);
        Outcome {
            gang: Some(gang),
            ended,
            ready_secs,
        }
    }

    /// [`Attempt::run`] once `gang` has started: how it ended, and how long it took to
    /// serve.
    fn serve(
        &self,
        gang: &mut Gang,
        restarts: &[Restart],
        began: Instant,
        started: Instant,
        events: &mut dyn FnMut(UpEvent),
    ) -> (Ended, Option<f64>) {
        gang.fail_on_any_exit();
        if !restarts.is_empty() {
            gang.set_manifest_field(
                "restarts",
                serde_json::to_value(restarts).unwrap_or_default(),
            );
        }
        let mut report = |event: Progress| events(UpEvent::Gang(event));
        report(gang.started());
        let is_stopped = || self.signals.load(Ordering::SeqCst) > 0;
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
        let url = format!("http://{}", self.front.address());
        if let Err(error) = gang.write_manifest(self.spec, Some(&url)) {
            events(UpEvent::Note(format!("warning: {error:#}")));
        }
        self.front.serving(upstream.address);
        match self.restart {
            0 => events(UpEvent::Ready {
                address: self.front.address().to_string(),
                world_size: self.spec.degrees.world_size(),
                layout: self.settings.layout.clone(),
                ready_secs: started.elapsed().as_secs_f64(),
            }),
            restart => events(UpEvent::Note(format!(
                "serving again on {url} after restart {restart} of {} (ready in {ready_secs:.2} s)",
                self.settings.max_restarts,
            ))),
        }
        let watchdog = Watchdog::start(upstream.address, self.settings.stall_timeout, STALL_GRACE);
        let stopped_or_stalled = || is_stopped() || watchdog.stalled().is_some();
        let mut report = |event: Progress| events(UpEvent::Gang(event));
        let watched = gang.wait_for("never", &stopped_or_stalled, &mut report);
        let stall = watchdog.stalled();
        drop(watchdog);
        if let Some(forward) = upstream.forward {
            // Connections already relayed end on their own when the ranks go.
            forward.abort();
        }
        let ended = match watched {
            Err(error) => Ended::Failed(classify(&error), error),
            Ok(_) if is_stopped() => {
                let drained = super::serving::drain(
                    gang,
                    self.settings.shutdown_timeout,
                    None,
                    self.signals,
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
        };
        (ended, Some(ready_secs))
    }

    /// Starts the gang: on the cluster's hosts through their agents, or here.
    ///
    /// Errors: the store or a rank cannot start.
    fn start(&self, run_dir: Option<&Path>) -> Result<Gang> {
        if let Some(hosts) = self.hosts {
            return hosts.start_gang_in(&Job::Serve, self.restart, run_dir);
        }
        let mut spec = self.spec.clone();
        spec.restart = self.restart;
        if let Some(dir) = run_dir {
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
