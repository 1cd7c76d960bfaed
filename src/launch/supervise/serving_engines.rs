//! `infer up --engine E --max-restarts N`: an engine's processes (vLLM, SGLang, or
//! llama.cpp's server and its RPC workers, on every host) supervised as infer's own rank
//! gang is, by the same loop ([`super::supervise`]). The launcher's front holds
//! `--host:--port` and relays to the head (on this host's loopback, or through the SSH
//! forward to the head's). When any engine process exits or is lost, or the head's forward
//! progress stays stalled [`STALL_GRACE`] past `--stall-timeout`, every process is stopped
//! on every host, the start's logs, manifest and outcome go to `restart-K/`, and the same
//! launch starts again. Must not decide the launch: [`crate::launch::serving_engines`] does, once.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, anyhow};

use super::{Attempt, Ended, Limits, Outcome, STALL_GRACE, Started, Supervisee, supervise};
use crate::launch::GRACE_PERIOD;
use crate::launch::events::UpEvent;
use crate::launch::serving_engines::{EngineRun, Member, Watched, stop_members, write_outcome};
use crate::serve::front::{Front, RestartCause};

/// Serves `run` behind `front` (already listening) and starts every engine process again
/// after each failure, until Ctrl-C/SIGTERM or until a failure finds no restart left.
///
/// Errors: the last failure (with how many restarts came before).
pub(in crate::launch) fn serve(
    run: &mut EngineRun<'_>,
    front: &Front,
    started: Instant,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    events(UpEvent::Listening(front.address()));
    let limits = Limits {
        max_restarts: run.settings.max_restarts,
        started,
    };
    let signals = run.signals;
    supervise(run, front, signals, &limits, events)
}

/// The processes of one start of an engine; stopped when dropped.
pub(in crate::launch) struct EngineProcesses {
    members: Vec<Member>,
    run_dir: PathBuf,
}

impl Started for EngineProcesses {
    /// SIGTERM (and SIGCONT) to each process group, SIGKILL after [`GRACE_PERIOD`], as for
    /// a failed gang.
    fn stop(&mut self) {
        stop_members(&mut self.members, GRACE_PERIOD);
    }

    fn write_outcome(&mut self, error: Option<&anyhow::Error>) {
        write_outcome(&self.run_dir, &mut self.members, error);
    }

    fn run_dir(&self) -> &Path {
        &self.run_dir
    }
}

impl Drop for EngineProcesses {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Supervisee for EngineRun<'_> {
    type Started = EngineProcesses;
    const NAME: &'static str = "engine";

    fn attempt(
        &mut self,
        attempt: &Attempt<'_>,
        events: &mut dyn FnMut(UpEvent),
    ) -> Outcome<EngineProcesses> {
        let began = Instant::now();
        let ready = self.start_and_wait_ready(events);
        let ended = match ready {
            Ok(true) => None,
            Ok(false) => {
                self.stop_all(events);
                events(UpEvent::Note("stopped before the engine was ready".into()));
                Some(Ended::Stopped)
            }
            Err(error) => Some(Ended::Failed(RestartCause::StartFailed, error)),
        };
        if let Some(ended) = ended {
            return self.outcome(ended, None);
        }
        let ready_secs = began.elapsed().as_secs_f64();
        if let Err(error) = self.write_manifest(attempt.restarts_json()) {
            events(UpEvent::Note(format!("warning: {error:#}")));
        }
        attempt.serving(
            self.address,
            ready_secs,
            self.launch.nodes.len(),
            self.layout,
            events,
        );
        // The head's own `/health` does not say it is stalled: the front does.
        let front = attempt.front;
        let ended = match self.watch(Some(STALL_GRACE), &mut |why| front.stalled(why), events) {
            Watched::Signal => {
                self.stop_all(events);
                Ended::Stopped
            }
            Watched::Failed(cause, why) => Ended::Failed(cause, anyhow!(why)),
        };
        self.outcome(ended, Some(ready_secs))
    }
}

impl EngineRun<'_> {
    /// The outcome of this start: its processes (taken out of the run) and how it ended.
    fn outcome(&mut self, ended: Ended, ready_secs: Option<f64>) -> Outcome<EngineProcesses> {
        Outcome {
            started: Some(EngineProcesses {
                members: self.take_members(),
                run_dir: self.run_dir.to_path_buf(),
            }),
            ended,
            ready_secs,
        }
    }
}
