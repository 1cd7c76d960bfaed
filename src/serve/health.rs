//! Forward progress is health. Each replica's scheduling loop records when it last made
//! progress ([`Progress`]: a step or an idle keep-alive completed, or work arrived at an idle
//! loop); rank 0 judges every replica from that ([`judge`]): a replica with work (requests
//! running or waiting, or an executor call under way) that has made no progress for longer
//! than the stall threshold is **stalled**. An idle replica is healthy however long it
//! idles.
//!
//! The threshold is `--stall-timeout` (default [`DEFAULT_STALL_TIMEOUT`]) or
//! [`STEP_FACTOR`] times the slowest recent step, whichever is longer, so a step that
//! legitimately takes long (a big prefill chunk on a slow host) does not trip it.
//!
//! What `/health` answers ([`Verdict`]): 200 while at least one replica can serve (with
//! disaggregation: one prefill and one decode replica), the stalled or failed ones named as
//! `degraded`; 503 with the reasons when none can. The router sends no new request to a
//! stalled replica while another can take it.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::rendezvous::StoreClient;
use crate::runtime::collectives::waits::{RankWait, diagnose, read_waits};

/// `--stall-timeout`'s default: a replica with work and no completed step for 10 s is
/// stalled (the default; NCCL's own watchdogs wait minutes, which is what users
/// complain about).
pub(crate) const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A replica is stalled only past this many times its slowest recent step: a loaded 2-core
/// host's steps vary by 2–3× between a decode-only step and one with a prefill chunk.
pub(crate) const STEP_FACTOR: f64 = 4.0;

/// How much of the slowest recent step is remembered after each step: 0.98 forgets a slow
/// step's weight by half in about 34 steps.
const STEP_DECAY: f64 = 0.98;

/// The process's clock origin for [`Progress`]' microsecond stamps.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

fn now_micros() -> u64 {
    EPOCH.elapsed().as_micros() as u64
}

/// One replica's forward progress, written by its scheduling loop and read by `/health`
/// and `/metrics` (lock-free: the loop never waits for a reader).
#[derive(Debug)]
pub struct Progress {
    /// Steps completed (forward passes, the release-only ones included).
    steps_total: AtomicU64,
    /// When the loop last made progress, µs since [`EPOCH`].
    last_progress_micros: AtomicU64,
    /// When the executor call under way began, µs since [`EPOCH`] (0: none under way).
    call_since_micros: AtomicU64,
    /// The slowest recent step, µs, decaying by [`STEP_DECAY`] each step.
    recent_step_micros: AtomicU64,
}

impl Default for Progress {
    fn default() -> Progress {
        Progress {
            steps_total: AtomicU64::new(0),
            last_progress_micros: AtomicU64::new(now_micros()),
            call_since_micros: AtomicU64::new(0),
            recent_step_micros: AtomicU64::new(0),
        }
    }
}

impl Progress {
    /// Marks progress now: work arrived at an idle loop (its wait starts now).
    pub fn mark(&self) {
        self.last_progress_micros
            .store(now_micros(), Ordering::SeqCst);
    }

    /// An executor call (a step or an idle keep-alive) begins.
    pub fn call_begins(&self) {
        self.call_since_micros
            .store(now_micros().max(1), Ordering::SeqCst);
    }

    /// The executor call under way ended; `step` says whether it was a step (counted, and
    /// its duration remembered).
    pub fn call_ends(&self, step: bool) {
        let now = now_micros();
        let began = self.call_since_micros.swap(0, Ordering::SeqCst);
        self.last_progress_micros.store(now, Ordering::SeqCst);
        if step {
            self.steps_total.fetch_add(1, Ordering::SeqCst);
            let took = now.saturating_sub(began);
            let recent = self.recent_step_micros.load(Ordering::SeqCst);
            let decayed = (recent as f64 * STEP_DECAY) as u64;
            self.recent_step_micros
                .store(took.max(decayed), Ordering::SeqCst);
        }
    }

    /// The progress now; `queued` is the replica's requests running and waiting.
    pub fn snapshot(&self, queued: u64) -> ProgressSnapshot {
        let now = now_micros();
        let in_call = self.call_since_micros.load(Ordering::SeqCst) != 0;
        let last = self.last_progress_micros.load(Ordering::SeqCst);
        ProgressSnapshot {
            steps_total: self.steps_total.load(Ordering::SeqCst),
            seconds_since_progress: now.saturating_sub(last) as f64 / 1e6,
            has_work: queued > 0 || in_call,
            recent_step_secs: self.recent_step_micros.load(Ordering::SeqCst) as f64 / 1e6,
        }
    }
}

/// A replica's forward progress at one moment (remote replicas send theirs to rank 0).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgressSnapshot {
    /// Steps completed.
    pub steps_total: u64,
    /// Seconds since the loop last made progress (a step or keep-alive ended, or work
    /// arrived while it was idle).
    pub seconds_since_progress: f64,
    /// Requests running or waiting, or an executor call under way.
    pub has_work: bool,
    /// The slowest recent step, seconds (decaying).
    pub recent_step_secs: f64,
}

impl ProgressSnapshot {
    /// This snapshot `age` later (a remote replica's last report): the time since progress
    /// grows by `age`.
    pub fn aged(mut self, age: Duration) -> ProgressSnapshot {
        self.seconds_since_progress += age.as_secs_f64();
        self
    }

    /// The seconds without progress past which this replica is stalled: `stall_timeout`
    /// or [`STEP_FACTOR`] × its slowest recent step, whichever is longer.
    pub(crate) fn threshold_secs(&self, stall_timeout: Duration) -> f64 {
        stall_timeout
            .as_secs_f64()
            .max(STEP_FACTOR * self.recent_step_secs)
    }

    /// Whether the replica is stalled under `stall_timeout` (see the module docs).
    pub fn stalled(&self, stall_timeout: Duration) -> bool {
        self.has_work && self.seconds_since_progress > self.threshold_secs(stall_timeout)
    }
}

/// One replica as `/health` reports it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaHealth {
    pub replica: usize,
    /// `prefill` or `decode` under disaggregation, else absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// `ok`, `stalled` or `failed`.
    pub status: &'static str,
    /// Why it is not `ok`, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub seconds_since_progress: f64,
    pub steps_total: u64,
    /// Which of its ranks waits on which, when it is stalled and the ranks report
    /// ([`crate::runtime::collectives::waits::diagnose`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<String>,
}

/// What `/health` answers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    /// `ok` (every replica can serve), `degraded` (some cannot, the others serve) or
    /// `unavailable` (503).
    pub status: &'static str,
    pub replicas: Vec<ReplicaHealth>,
}

impl Verdict {
    /// Whether the server can serve (`/health` 200).
    pub fn ready(&self) -> bool {
        self.status != "unavailable"
    }

    /// The reasons of the replicas that cannot serve, each with its diagnosis, joined:
    /// what a 503 says.
    pub fn reasons(&self) -> String {
        self.replicas
            .iter()
            .filter_map(|r| {
                let reason = r.reason.as_deref()?;
                Some(match &r.diagnosis {
                    Some(diagnosis) => format!("{reason} — {diagnosis}"),
                    None => reason.to_string(),
                })
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The replicas judged stalled.
    pub fn stalled(&self) -> impl Iterator<Item = usize> + '_ {
        self.replicas
            .iter()
            .filter(|r| r.status == "stalled")
            .map(|r| r.replica)
    }
}

/// Rank 0's reader of every rank's wait state through the rendezvous store (its own
/// connection, opened when first needed and again after an error): what the stall
/// diagnosis and `GET /debug/ranks` show.
pub struct RankWaits {
    address: String,
    keys: crate::keyring::Keyring,
    /// Ranks in the run, and in each DP replica (replica `r` holds ranks
    /// `r × replica_size ..`).
    pub world_size: u64,
    pub replica_size: u64,
    store: std::sync::Mutex<Option<StoreClient>>,
}

impl RankWaits {
    /// A reader of the store at `address`, as rank 0 of host keys `keys`.
    pub fn new(
        address: String,
        keys: crate::keyring::Keyring,
        world_size: u64,
        replica_size: u64,
    ) -> RankWaits {
        RankWaits {
            address,
            keys,
            world_size,
            replica_size,
            store: std::sync::Mutex::new(None),
        }
    }

    /// Each rank's wait among `ranks`. Blocking (the store). Errors: the store cannot be
    /// reached.
    pub fn read(&self, ranks: std::ops::Range<u64>) -> anyhow::Result<Vec<(u64, RankWait)>> {
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        if store.is_none() {
            *store = Some(StoreClient::connect(
                &self.address,
                &self.keys,
                Some(0),
                Duration::from_secs(2),
            )?);
        }
        let Some(client) = store.as_mut() else {
            anyhow::bail!("no store connection");
        };
        let waits = read_waits(client, ranks);
        if waits.is_err() {
            *store = None;
        }
        waits
    }

    /// The diagnosis of replica `replica`'s ranks, or why there is none.
    pub(crate) fn diagnose_replica(&self, replica: usize) -> String {
        let first = replica as u64 * self.replica_size;
        match self.read(first..first + self.replica_size) {
            Ok(waits) => diagnose(&waits),
            Err(error) => format!("the ranks' wait states could not be read: {error:#}"),
        }
    }

    /// Adds the diagnosis of each stalled replica to `verdict`.
    pub fn diagnose(&self, verdict: &mut Verdict) {
        let stalled: Vec<usize> = verdict.stalled().collect();
        for replica in stalled {
            let line = self.diagnose_replica(replica);
            verdict.replicas[replica].diagnosis = Some(line);
        }
    }
}

/// One replica as the judge sees it: its progress, and its failure if it failed for good.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReplicaState {
    pub progress: ProgressSnapshot,
    pub failure: Option<String>,
    /// Why it is down and restarting (its driver's link was lost and the launcher starts
    /// it again alone), and for how long, seconds.
    pub restarting: Option<(String, f64)>,
    /// Requests running and waiting on it.
    pub running: u64,
    pub waiting: u64,
}

/// Judges every replica (index = replica) under `stall_timeout`; `prefill` is the number
/// of prefill replicas under disaggregation (the first ones). The rule: ready while at
/// least one replica of each role (one role without disaggregation) is `ok`.
pub(crate) fn judge(
    replicas: &[ReplicaState],
    stall_timeout: Duration,
    prefill: Option<usize>,
) -> Verdict {
    let role = |index: usize| prefill.map(|p| if index < p { "prefill" } else { "decode" });
    let judged: Vec<ReplicaHealth> = replicas
        .iter()
        .enumerate()
        .map(|(replica, state)| {
            let p = &state.progress;
            let (status, reason) = if let Some((why, secs)) = &state.restarting {
                (
                    "restarting",
                    Some(format!(
                        "replica {replica} is restarting ({secs:.1} s so far) after: {why}"
                    )),
                )
            } else if let Some(failure) = &state.failure {
                ("failed", Some(format!("replica {replica} failed: {failure}")))
            } else if p.stalled(stall_timeout) {
                (
                    "stalled",
                    Some(format!(
                        "replica {replica} stalled: no step completed for {:.1} s with {} request(s) running and {} waiting (threshold {:.1} s: --stall-timeout, or {STEP_FACTOR}× its slowest recent step of {:.2} s)",
                        p.seconds_since_progress,
                        state.running,
                        state.waiting,
                        p.threshold_secs(stall_timeout),
                        p.recent_step_secs
                    )),
                )
            } else {
                ("ok", None)
            };
            ReplicaHealth {
                replica,
                role: role(replica),
                status,
                reason,
                seconds_since_progress: p.seconds_since_progress,
                steps_total: p.steps_total,
                diagnosis: None,
            }
        })
        .collect();
    let serving = |wanted: Option<&str>| {
        judged
            .iter()
            .any(|r| r.status == "ok" && (wanted.is_none() || r.role == wanted))
    };
    let ready = match prefill {
        Some(_) => serving(Some("prefill")) && serving(Some("decode")),
        None => serving(None),
    };
    let status = if !ready {
        "unavailable"
    } else if judged.iter().all(|r| r.status == "ok") {
        "ok"
    } else {
        "degraded"
    };
    Verdict {
        status,
        replicas: judged,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(secs: f64, has_work: bool, recent: f64) -> ReplicaState {
        ReplicaState {
            progress: ProgressSnapshot {
                steps_total: 7,
                seconds_since_progress: secs,
                has_work,
                recent_step_secs: recent,
            },
            failure: None,
            restarting: None,
            running: u64::from(has_work),
            waiting: 0,
        }
    }

    const TEN: Duration = Duration::from_secs(10);

    #[test]
    fn an_idle_replica_is_healthy_however_long_it_idles() {
        let verdict = judge(&[state(3600.0, false, 0.1)], TEN, None);
        assert_eq!(verdict.status, "ok");
        assert!(verdict.ready());
    }

    #[test]
    fn work_without_progress_past_the_timeout_is_a_stall_named_with_its_replica() {
        let verdict = judge(&[state(10.5, true, 0.1)], TEN, None);
        assert_eq!(verdict.status, "unavailable");
        assert_eq!(verdict.replicas[0].status, "stalled");
        let reasons = verdict.reasons();
        assert!(
            reasons.starts_with("replica 0 stalled: no step completed for 10.5 s"),
            "{reasons}"
        );
        // Just under the timeout: not yet.
        assert_eq!(judge(&[state(9.9, true, 0.1)], TEN, None).status, "ok");
    }

    #[test]
    fn the_threshold_scales_with_the_slowest_recent_step() {
        // Steps of 4 s: 16 s without progress is still within 4 × 4 s.
        assert_eq!(judge(&[state(15.0, true, 4.0)], TEN, None).status, "ok");
        assert_eq!(
            judge(&[state(16.5, true, 4.0)], TEN, None).status,
            "unavailable"
        );
    }

    #[test]
    fn one_stalled_replica_of_two_degrades_and_both_unready_is_unavailable() {
        let verdict = judge(&[state(0.1, true, 0.1), state(30.0, true, 0.1)], TEN, None);
        assert_eq!(verdict.status, "degraded");
        assert!(verdict.ready());
        assert!(verdict.reasons().starts_with("replica 1 stalled"));
        let mut failed = state(0.0, false, 0.0);
        failed.failure = Some("rank 2 exited".into());
        let verdict = judge(&[state(30.0, true, 0.1), failed], TEN, None);
        assert_eq!(verdict.status, "unavailable");
        assert!(
            verdict
                .reasons()
                .contains("replica 1 failed: rank 2 exited")
        );
    }

    #[test]
    fn disaggregation_needs_a_healthy_replica_of_each_role() {
        let replicas = [
            state(0.1, true, 0.1),
            state(30.0, true, 0.1),
            state(0.1, false, 0.1),
        ];
        // Prefill 0 and decode 2 serve: degraded.
        assert_eq!(judge(&replicas, TEN, Some(2)).status, "degraded");
        // Prefill 0 only, and its one decode replica stalled: unavailable.
        let verdict = judge(&replicas[..2], TEN, Some(1));
        assert_eq!(verdict.status, "unavailable");
        assert_eq!(verdict.replicas[1].role, Some("decode"));
    }

    #[test]
    fn progress_counts_steps_and_remembers_the_slowest_recent_one() {
        let progress = Progress::default();
        progress.call_begins();
        assert!(progress.snapshot(0).has_work, "a call under way is work");
        std::thread::sleep(Duration::from_millis(20));
        progress.call_ends(true);
        let snapshot = progress.snapshot(0);
        assert_eq!(snapshot.steps_total, 1);
        assert!(!snapshot.has_work);
        assert!(snapshot.recent_step_secs >= 0.02, "{snapshot:?}");
        // An idle keep-alive is progress but not a step.
        progress.call_begins();
        progress.call_ends(false);
        assert_eq!(progress.snapshot(0).steps_total, 1);
        let aged = progress.snapshot(1).aged(Duration::from_secs(3));
        assert!(aged.seconds_since_progress >= 3.0);
    }
}
