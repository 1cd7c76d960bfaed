//! infer's own rank gang as the [`Supervisee`] of `infer up --max-restarts N`: each start a
//! new gang (a new store, new ports), here or through the cluster's agents already running;
//! rank 0 served behind the front and watched through its `/health` by a watchdog thread.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

use super::{Attempt, Ended, Limits, Outcome, STALL_GRACE, Started, Supervisee, supervise};
use crate::launch::events::{UpEvent, watch_signals};
use crate::launch::gang::{FailureKind, GangFailure};
use crate::launch::hosts::{ClusterHosts, ClusterOptions};
use crate::launch::{Gang, LaunchSpec, Progress};
use crate::runtime::exec::worker::Job;
use crate::serve::front::{Front, RestartCause};

/// How often the watchdog asks rank 0's `/health`.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// What a supervised run of infer's ranks needs besides the spec.
pub(crate) struct Supervised<'a> {
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
    /// Node 0 of `infer up --nnodes` (the other nodes follow its starts:
    /// [`super::nodes`]).
    pub node: Option<crate::launch::up_settings::NodeSettings>,
}

/// Serves `spec` (rank 0 on loopback, port 0) behind the front until Ctrl-C/SIGTERM, or
/// until a failure finds no restart left.
///
/// Errors: the address cannot be bound, a cluster's preflight fails, the last failure
/// (with how many restarts came before).
pub(crate) fn serve(
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
        Some(options) => Some(crate::launch::hosts::connect(spec, options, &mut |p| {
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

    fn giving_up(&mut self, error: &anyhow::Error) {
        self.tell_followers(error);
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
        let (watched, stall) = loop {
            let watchdog =
                Watchdog::start(upstream.address, self.settings.stall_timeout, STALL_GRACE);
            let stopped_or_stalled = || attempt.is_stopped() || watchdog.stalled().is_some();
            let mut report = |event: Progress| events(UpEvent::Gang(event));
            let watched = gang.wait_for("never", &stopped_or_stalled, &mut report);
            let stall = watchdog.stalled();
            drop(watchdog);
            if attempt.is_stopped() {
                break (watched, stall);
            }
            // A failure of one DP replica other than rank 0's restarts that replica alone.
            let Some((replica, cause, error)) = self.lone_replica(&watched, stall.as_ref()) else {
                break (watched, stall);
            };
            match self.restart_replica(gang, replica, cause, &error, attempt, events) {
                Ok(true) => {}
                // No restart left: the run ends with the replica's failure.
                Ok(false) => return Ended::Failed(cause, error),
                Err(restart_error) => {
                    return Ended::Failed(
                        RestartCause::StartFailed,
                        restart_error.context(format!("{error:#}")),
                    );
                }
            }
        };
        let stall = stall.map(|s| s.why);
        if let Some(forward) = &upstream.forward {
            // Connections already relayed end on their own when the ranks go.
            forward.abort();
        }
        match watched {
            Err(error) => Ended::Failed(classify(&error), error),
            Ok(_) if attempt.is_stopped() => {
                let drained = crate::launch::serving::drain(
                    gang,
                    self.settings.shutdown_timeout,
                    self.settings.node.as_ref(),
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

    /// The DP replica (other than rank 0's) whose failure alone `watched` or `stall`
    /// reports, when replicas may restart alone: it, the cause and the error.
    fn lone_replica(
        &self,
        watched: &Result<Option<Vec<u8>>>,
        stall: Option<&Stall>,
    ) -> Option<(usize, RestartCause, anyhow::Error)> {
        let serving = self.spec.serving.as_ref()?;
        if !serving.replica_restarts {
            return None;
        }
        let replica_size = self.spec.degrees.replica_size();
        match (watched, stall) {
            (Err(error), _) => {
                let failure = error.downcast_ref::<GangFailure>()?;
                let replica = failure.rank? / replica_size;
                (replica > 0).then(|| (replica, classify(error), anyhow!("{error:#}")))
            }
            (Ok(_), Some(stall)) => match stall.replicas[..] {
                [replica] if replica > 0 => {
                    Some((replica, RestartCause::Stalled, anyhow!("{}", stall.why)))
                }
                _ => None,
            },
            (Ok(_), None) => None,
        }
    }

    /// Restarts DP replica `replica` alone after `error` (its ranks stopped and started
    /// again as a new start of the replica; rank 0's router links to it when it is up),
    /// if a restart is left (`Ok(false)` when none is).
    ///
    /// Errors: its ranks cannot be started again.
    fn restart_replica(
        &self,
        gang: &mut Gang,
        replica: usize,
        cause: RestartCause,
        error: &anyhow::Error,
        attempt: &Attempt<'_>,
        events: &mut dyn FnMut(UpEvent),
    ) -> Result<bool> {
        let Some((restart, files)) = attempt.replica_restart(cause, error, gang.run_dir()) else {
            return Ok(false);
        };
        events(UpEvent::Note(format!(
            "warning: restarting DP replica {replica} alone (restart {restart} of {}, --max-restarts) after: {}; the other replicas keep serving",
            attempt.max_restarts,
            super::first_line(error)
        )));
        let size = self.spec.degrees.replica_size();
        let ranks = replica * size..(replica + 1) * size;
        match self.hosts {
            Some(hosts) => hosts.restart_ranks(gang, ranks, restart, &files)?,
            None => {
                let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
                let spawner = crate::launch::spawn::LocalSpawner { exe };
                gang.restart_ranks(&spawner, self.spec, ranks, restart, &files)?;
            }
        }
        if let Some(restarts) = attempt.restarts_json() {
            gang.set_manifest_field("restarts", restarts);
        }
        if let Err(error) = gang.write_manifest(self.spec, None) {
            events(UpEvent::Note(format!("warning: {error:#}")));
        }
        Ok(true)
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
        let Some(node) = &self.settings.node else {
            return Gang::start(&spec, &Job::Serve);
        };
        // Node 0: a new store at the same address each start, which says the start's
        // number, so that the other nodes join this one and not a store that is gone.
        let world = spec.degrees.world_size();
        let mut gang = crate::launch::serving::start_node(&spec, node, world)?;
        gang.set_followers(node.nnodes - 1);
        gang.store().set(
            super::nodes::ROUND_KEY,
            attempt.restart.to_string().as_bytes(),
        )?;
        Ok(gang)
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
    verdict: Arc<Mutex<Option<Stall>>>,
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
    fn stalled(&self) -> Option<Stall> {
        self.verdict.lock().ok().and_then(|v| v.clone())
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// What the watchdog found: the stalled replicas (empty: rank 0's server itself does not
/// answer) and why.
#[derive(Clone, Debug, PartialEq)]
struct Stall {
    replicas: Vec<usize>,
    why: String,
}

/// The watchdog's loop: `Some(stall)` when the gang (or a replica) must restart, `None`
/// when told to stop.
fn watch(
    upstream: SocketAddr,
    stall_timeout: Duration,
    grace: Duration,
    stop: &AtomicBool,
) -> Option<Stall> {
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
                return Some(Stall {
                    replicas: Vec::new(),
                    why: format!(
                        "rank 0's server has not answered /health for {:.0} s",
                        answered.elapsed().as_secs_f64()
                    ),
                });
            }
            None => {}
        }
        std::thread::sleep(WATCH_INTERVAL.saturating_sub(asked.elapsed()));
    }
    None
}

/// What a `/health` answer says is stalled (its replicas and their reasons and
/// diagnoses), if any replica is: the verdict itself (200) or under `health` (503).
fn stalled(body: &serde_json::Value) -> Option<Stall> {
    let verdict = body.get("health").unwrap_or(body);
    let (replicas, reasons): (Vec<usize>, Vec<String>) = verdict["replicas"]
        .as_array()?
        .iter()
        .enumerate()
        .filter(|(_, r)| r["status"] == "stalled")
        .map(|(index, r)| {
            let reason = r["reason"].as_str().unwrap_or("a replica stalled");
            let replica = r["replica"].as_u64().map_or(index, |r| r as usize);
            let reason = match r["diagnosis"].as_str() {
                Some(diagnosis) => format!("{reason} — {diagnosis}"),
                None => reason.to_string(),
            };
            (replica, reason)
        })
        .unzip();
    (!reasons.is_empty()).then(|| Stall {
        replicas,
        why: reasons.join("; "),
    })
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
            stalled(&degraded),
            Some(Stall {
                replicas: vec![1],
                why: "replica 1 stalled 3 s — rank 2 waits on rank 3".into()
            })
        );
        let unavailable = serde_json::json!({"error": {"message": "…"}, "health": {"status": "unavailable", "replicas": [
            {"status": "stalled", "reason": "replica 0 stalled 2 s"}]}});
        assert_eq!(
            stalled(&unavailable).map(|s| s.why).as_deref(),
            Some("replica 0 stalled 2 s")
        );
        let healthy = serde_json::json!({"status": "ok", "replicas": [{"status": "ok"}]});
        assert_eq!(stalled(&healthy), None);
    }
}
