//! `infer up --nnodes N --node-rank R --max-restarts M` on a node other than 0: torchrun's
//! elastic agent for one node. Node 0's launcher supervises the gang ([`super::ranks`]):
//! each start it opens a new rendezvous store at `--master-addr:--master-port` and writes
//! the start's number under [`ROUND_KEY`]. This node runs its share of the ranks for every
//! start: when one of its ranks fails, a rank anywhere stops heartbeating, or node 0's store
//! goes away, it stops its ranks (their files move to `restart-K/`) and waits for node 0's
//! next start, then joins it; when node 0 stops the gang its ranks stop with rank 0. After
//! `M` restarts the next failure ends this node's launcher with its cause.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::events::{UpEvent, watch_signals};
use crate::launch::serving::{follow_node_zero, node_keys, start_node};
use crate::launch::up_settings::NodeSettings;
use crate::launch::{LaunchSpec, Progress};

/// Where node 0's launcher writes the number of the gang's start (0 for the first) in each
/// new store.
pub(crate) const ROUND_KEY: &str = "launcher/round";

/// How long this node waits for node 0's next start after its ranks stopped.
const NEXT_START_WAIT: Duration = Duration::from_secs(90);

/// Runs this node's ranks for each start of node 0's gang until node 0 stops it (then
/// `Ok`), Ctrl-C/SIGTERM here, or a failure after `max_restarts` restarts.
///
/// Errors: this node's ranks cannot start, node 0's store does not come back within
/// [`NEXT_START_WAIT`], the last failure once no restart is left.
pub(crate) fn follow(
    spec: &LaunchSpec,
    node: &NodeSettings,
    max_restarts: usize,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    let signals = Arc::new(AtomicUsize::new(0));
    watch_signals(Arc::clone(&signals))?;
    let is_stopped = || signals.load(Ordering::SeqCst) > 0;
    let world = spec.degrees.world_size();
    let mut last: Option<(usize, PathBuf)> = None;
    let mut restarts = 0;
    loop {
        let Some(round) = next_round(node, world, last.as_ref().map(|l| l.0), &is_stopped)? else {
            return Ok(());
        };
        let mut spec = spec.clone();
        spec.restart = round;
        if let Some((_, dir)) = &last {
            // The failed start's files go aside, under the number node 0 gives this start.
            let files = dir.join(format!("restart-{round}"));
            if let Err(error) = super::move_files(dir, &files) {
                events(UpEvent::Note(format!(
                    "warning: cannot keep the failed start's files: {error:#}"
                )));
            }
            spec.run_dir = Some(dir.clone());
        }
        let mut gang = start_node(&spec, node, world)?;
        let run_dir = gang.run_dir().to_path_buf();
        gang.fail_on_any_exit();
        let mut report = |event: Progress| events(UpEvent::Gang(event));
        report(gang.started());
        let outcome = match gang.wait_for(crate::rendezvous::READY_KEY, &is_stopped, &mut report) {
            Ok(None) => {
                gang.stop();
                gang.write_outcome(None);
                return Ok(());
            }
            Ok(Some(_)) => {
                if round > 0 {
                    events(UpEvent::Note(format!(
                        "serving again with node 0's start {round} (restart {restarts} of {max_restarts})"
                    )));
                }
                follow_node_zero(&mut gang, node, &is_stopped, events)
            }
            Err(error) => Err(error),
        };
        gang.stop();
        gang.write_outcome(outcome.as_ref().err());
        let error = match outcome {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        let node_zero_ended = error
            .downcast_ref::<crate::launch::serving::NodeZeroFailed>()
            .is_some();
        if node_zero_ended {
            return Err(error);
        }
        if is_stopped() || restarts >= max_restarts {
            return Err(super::gave_up("gang", error, restarts));
        }
        restarts += 1;
        events(UpEvent::Note(format!(
            "warning: this node's ranks stopped (restart {restarts} of {max_restarts}, --max-restarts) after: {}; joining node 0's next start",
            super::first_line(&error)
        )));
        last = Some((round, run_dir));
    }
}

/// Whether node 0's store says the run ended (no restart left), and why; says it has seen
/// it.
fn node_zero_failed(node: &NodeSettings, keys: &crate::keyring::Keyring) -> Option<String> {
    use crate::launch::serving::{FAILED_PREFIX, SHUTDOWN_ACK_KEY, SHUTDOWN_KEY};
    let mut store = crate::rendezvous::StoreClient::connect(
        &node.master.to_string(),
        keys,
        None,
        Duration::from_secs(2),
    )
    .ok()?;
    let value = store.get(SHUTDOWN_KEY, Duration::from_millis(20)).ok()?;
    let why = value.strip_prefix(FAILED_PREFIX.as_bytes())?;
    let _ = store.add(SHUTDOWN_ACK_KEY, 1);
    Some(String::from_utf8_lossy(why).into_owned())
}

/// Waits until node 0's store answers with a start newer than `after` (any start when
/// `None`) and returns its number; `None` when stopped meanwhile.
///
/// Errors: no such start within [`NEXT_START_WAIT`] (node 0 gave up, stopped or cannot be
/// reached).
fn next_round(
    node: &NodeSettings,
    world: usize,
    after: Option<usize>,
    is_stopped: &dyn Fn() -> bool,
) -> Result<Option<usize>> {
    // The first start is joined as before (node 0 may still be starting); later ones wait.
    if after.is_none() {
        return Ok(Some(0));
    }
    let keys = node_keys(node, world);
    let deadline = Instant::now() + NEXT_START_WAIT;
    let mut last_error = None;
    while Instant::now() < deadline {
        if is_stopped() {
            return Ok(None);
        }
        let asked = crate::rendezvous::StoreClient::connect(
            &node.master.to_string(),
            &keys,
            None,
            Duration::from_secs(2),
        )
        .and_then(|mut store| store.get(ROUND_KEY, Duration::from_millis(500)));
        if let Some(why) = node_zero_failed(node, &keys) {
            return Err(anyhow::Error::new(crate::launch::serving::NodeZeroFailed(
                why,
            )));
        }
        match asked {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let round: usize = text
                    .parse()
                    .with_context(|| format!("node 0's store says start `{text}`"))?;
                if after.is_none_or(|after| round > after) {
                    return Ok(Some(round));
                }
            }
            Err(error) => last_error = Some(error),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!(
        "node 0 did not start the gang again within {} s at {}{}",
        NEXT_START_WAIT.as_secs(),
        node.master,
        last_error.map_or(String::new(), |e| format!(": {e:#}"))
    )
}
