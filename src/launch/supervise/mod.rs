//! `infer up --max-restarts N`: the launcher as the supervisor of what serves (torchrun's
//! elastic agent, for a serving gang). The HTTP front ([`crate::serve::front`]) listens at
//! `--host:--port` in this process and outlives every start; behind it serves rank 0 on
//! loopback (through the SSH tunnel on a cluster), or with `--engine` the engine's head.
//! When a process exits, a rank stops heartbeating, a host is lost, or what serves stays
//! stalled [`STALL_GRACE`] past `--stall-timeout`, every process of the start is stopped
//! everywhere (no orphan), its files are moved to `restart-K/` in the run directory, and a
//! new start begins on the same hosts (a gang: new ports, a new store; on a cluster through
//! the agents already running). After `N` restarts the next failure ends the run with its
//! cause, as without `--max-restarts`.
//!
//! [`supervise`] is the loop; a [`Supervisee`] is what it starts again: infer's rank gang
//! ([`ranks`]) or an engine's processes ([`serving_engines`]).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::events::UpEvent;
use crate::serve::front::{Front, RestartCause};

pub(crate) mod nodes;
pub(crate) mod ranks;
pub(crate) mod serving_engines;

/// How long what serves stays stalled (past `--stall-timeout`) before it is restarted: a
/// step that was merely slow has had `--stall-timeout` plus this to finish.
pub(crate) const STALL_GRACE: Duration = Duration::from_secs(5);

/// What a supervised run starts again after each failure: infer's rank gang ([`ranks`]), or
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
    /// The run ends with `error` (no restart left), before its processes stop: tells
    /// whoever follows its starts. Best effort; the default tells no one.
    fn giving_up(&mut self, _error: &anyhow::Error) {}
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
    /// The failures restarted so far (a DP replica restarted alone adds one while the
    /// start goes on).
    pub restarts: &'a RefCell<Vec<Restart>>,
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
        let restarts = self.restarts.borrow();
        (!restarts.is_empty()).then(|| serde_json::to_value(&*restarts).unwrap_or_default())
    }

    /// Takes a restart from `--max-restarts` for one DP replica that failed alone with
    /// `error` (counted under `cause` in `/metrics`; the front keeps serving from the
    /// others): its number and where the failed ranks' files go in `run_dir`, or `None`
    /// when no restart is left.
    pub(super) fn replica_restart(
        &self,
        cause: RestartCause,
        error: &anyhow::Error,
        run_dir: &Path,
    ) -> Option<(usize, PathBuf)> {
        let mut restarts = self.restarts.borrow_mut();
        if restarts.len() >= self.max_restarts {
            return None;
        }
        let restart = restarts.len() + 1;
        let files = run_dir.join(format!("restart-{restart}"));
        restarts.push(Restart {
            restart,
            cause: cause.label(),
            error: format!("{error:#}"),
            files: files.clone(),
        });
        self.front.replica_restarting(cause);
        Some((restart, files))
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
    let restarts: RefCell<Vec<Restart>> = RefCell::new(Vec::new());
    let mut run_dir: Option<PathBuf> = None;
    // What the last start took to serve: `Retry-After` while restarting.
    let mut ready_secs = limits.started.elapsed().as_secs_f64();
    let mut served = false;
    loop {
        let restart = restarts.borrow().len();
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
        // DP replicas restarted alone during the start count too.
        let restart = restarts.borrow().len();
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
        let mut started = outcome.started;
        if !restarting && let Some(started) = started.as_mut() {
            started.giving_up(&error);
        }
        let files = retire(
            started,
            &error,
            restarting.then_some(restart + 1),
            &mut run_dir,
            events,
        );
        if !restarting {
            return Err(gave_up(S::NAME, error, restart));
        }
        restarts.borrow_mut().push(Restart {
            restart: restart + 1,
            cause: cause.label(),
            error: format!("{error:#}"),
            files,
        });
    }
}

/// Stops the processes of a start that failed with `error` and records how it ended (the
/// run directory goes into `run_dir` if it holds none); before restart `restart`, moves
/// its files to `restart-K/`. Returns where they went (empty when they stay).
fn retire<S: Started>(
    started: Option<S>,
    error: &anyhow::Error,
    restart: Option<usize>,
    run_dir: &mut Option<PathBuf>,
    events: &mut dyn FnMut(UpEvent),
) -> PathBuf {
    let Some(mut started) = started else {
        return PathBuf::new();
    };
    started.stop();
    started.write_outcome(Some(error));
    let dir = started.run_dir().to_path_buf();
    drop(started);
    run_dir.get_or_insert(dir.clone());
    let Some(restart) = restart else {
        return PathBuf::new();
    };
    let files = dir.join(format!("restart-{restart}"));
    if let Err(move_error) = move_files(&dir, &files) {
        events(UpEvent::Note(format!(
            "warning: cannot keep the failed start's files: {move_error:#}"
        )));
    }
    files
}

/// The last failure of the `name` (`gang`, `engine`), saying how many restarts came before
/// it.
pub(super) fn gave_up(name: &str, error: anyhow::Error, restarts: usize) -> anyhow::Error {
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
pub(super) fn first_line(error: &anyhow::Error) -> String {
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
pub(super) fn move_files(dir: &Path, to: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use anyhow::anyhow;

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
}
