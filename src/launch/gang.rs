//! The gang: every rank started or none, watched (exits, heartbeats, milestones) and stopped
//! together, SIGTERM then SIGKILL after [`GRACE_PERIOD`]; the error names the rank, its exit
//! status and its last log lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use super::run_dir::create_run_dir;
use super::spawn::{LocalSpawner, RankProcess, Spawner, spawn_rank};
use super::spec::{LaunchSpec, SECRET_ENV, StoreLocation};
use crate::keyring::{Keyring, LAUNCHER_HOST};
use crate::rendezvous::{StoreClient, StoreServer, random_token};
use crate::runtime::exec::engine::Generation;
use crate::runtime::exec::worker::Job;

/// How long a rank may go without a heartbeat before the gang is stopped.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// Time between SIGTERM and SIGKILL when stopping the gang.
pub const GRACE_PERIOD: Duration = Duration::from_secs(2);

/// What failed a gang, as [`Gang::wait_for`]'s error says it (find it with
/// `error.downcast_ref::<GangFailure>()`): what a supervisor restarts for.
#[derive(Debug)]
pub(crate) struct GangFailure {
    pub(crate) kind: FailureKind,
    /// The rank that failed (`None`: a host, or every rank gone).
    pub(crate) rank: Option<usize>,
    /// The whole message: which rank, its status or silence, its last log lines.
    pub(crate) message: String,
}

/// The kinds of [`GangFailure`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// A rank process exited (with `fail_on_any_exit`, even successfully).
    RankExited,
    /// A rank stopped heartbeating for [`HEARTBEAT_TIMEOUT`].
    HeartbeatLost,
    /// The connection to a rank's host (its agent) was lost.
    HostLost,
}

impl std::fmt::Display for GangFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GangFailure {}

/// A [`GangFailure`] of `kind` (of `rank`, when one rank failed) saying `message`.
fn failure(kind: FailureKind, rank: Option<usize>, message: String) -> anyhow::Error {
    anyhow::Error::new(GangFailure {
        kind,
        rank,
        message,
    })
}

/// What the launcher reports while it watches the gang.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// Every rank process has been started.
    Started {
        world_size: usize,
        run_dir: PathBuf,
        pids: Vec<u32>,
    },
    /// `loaded` of `world_size` ranks have loaded their shard and joined their groups.
    Loaded { loaded: usize, world_size: usize },
    /// A host passed a preflight stage (connected, binary, model, interface, ready) or
    /// failed it.
    Host { host: String, stage: String },
    /// A line a rank wrote to its stdout or stderr; `label` says where (`rank 3`,
    /// `node1 r3`).
    RankLine {
        rank: usize,
        label: String,
        line: String,
    },
}

/// A gang of local rank processes, the rendezvous store they meet at and the run directory
/// with their logs and `manifest.json`. Dropping it stops every rank that is still running.
pub struct Gang {
    ranks: Vec<RankProcess>,
    /// The store, when this process runs it.
    server: Option<StoreServer>,
    /// `MASTER_ADDR:MASTER_PORT` as the ranks see it.
    store_address: std::net::SocketAddr,
    client: StoreClient,
    /// How each rank's output lines are labelled.
    labels: Vec<String>,
    run_dir: PathBuf,
    lines: std::sync::mpsc::Receiver<(usize, String)>,
    world_size: usize,
    loaded: usize,
    /// Whether a rank that exits successfully also fails the gang (a serving gang's ranks
    /// never finish on their own).
    every_exit_fails: bool,
    /// More top-level manifest fields (`hosts` of a multi-host run).
    manifest_extra: serde_json::Map<String, serde_json::Value>,
    /// The run's keys (as the launcher holds them): a restarted rank gets its host's.
    keys: Keyring,
    /// Where the ranks' output lines go ([`Gang::restart_ranks`] starts more).
    line_sender: std::sync::mpsc::Sender<(usize, String)>,
    /// Ranks started again alone, and when: their heartbeats count from then.
    restarted: HashMap<u64, Instant>,
    /// Other nodes' launchers that follow this gang's starts (`--nnodes` node 0).
    followers: usize,
}

impl Gang {
    /// Starts `dp × pp × tp` rank processes with `job`, all or none: when one fails to
    /// start, those already started are stopped.
    ///
    /// Errors: the store, the run directory or a rank process cannot start.
    pub fn start(spec: &LaunchSpec, job: &Job) -> Result<Gang> {
        let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
        Gang::start_with(&LocalSpawner { exe }, spec, job)
    }

    /// [`Gang::start`] with ranks started by `spawner`.
    ///
    /// Errors: the store, the run directory or a rank process cannot start.
    pub fn start_with(spawner: &dyn Spawner, spec: &LaunchSpec, job: &Job) -> Result<Gang> {
        let keys = Keyring::master(&random_token(), LAUNCHER_HOST, spec.rank_hosts());
        Gang::start_on(spawner, spec, job, StoreLocation::Local, &keys)
    }

    /// [`Gang::start_with`] with the store at `store`, the run's keys derived from `keys`
    /// (the run's secret, as the launcher holds it: each rank gets its host's keys only).
    ///
    /// Errors: the store, the run directory or a rank process cannot start.
    pub fn start_on(
        spawner: &dyn Spawner,
        spec: &LaunchSpec,
        job: &Job,
        store: StoreLocation,
        keys: &Keyring,
    ) -> Result<Gang> {
        let world = spec.degrees.world_size();
        Gang::start_part(spawner, spec, job, store, keys, 0..world)
    }

    /// [`Gang::start_on`] starting only `ranks` of the world: one node's share when each
    /// node runs its own launcher (`infer up --nnodes`); the gang still counts and watches
    /// every rank's loading and heartbeat through the store.
    ///
    /// Errors: the store, the run directory or a rank process cannot start; `ranks` outside
    /// the world.
    pub fn start_part(
        spawner: &dyn Spawner,
        spec: &LaunchSpec,
        job: &Job,
        store: StoreLocation,
        keys: &Keyring,
        part: std::ops::Range<usize>,
    ) -> Result<Gang> {
        spec.check_layout()?;
        let world = spec.degrees.world_size();
        if part.is_empty() || part.end > world {
            bail!("ranks {part:?} are not part of a world of {world}");
        }
        if !spec.placement.is_empty() && spec.placement.len() != world {
            bail!(
                "the placement names {} ranks for a world of {world}",
                spec.placement.len()
            );
        }
        let (server, store_address, launcher_address) = match store {
            StoreLocation::Local => {
                let server = StoreServer::start("127.0.0.1:0", keys)?;
                let address = server.address();
                (Some(server), address, address)
            }
            StoreLocation::Listen(address) => {
                let server = StoreServer::start(&address.to_string(), keys).with_context(|| {
                    format!(
                        "cannot listen on {address} for the rendezvous store: node 0 must own --master-addr, and the port must be free"
                    )
                })?;
                let address = server.address();
                (Some(server), address, address)
            }
            StoreLocation::Remote { ranks, launcher } => (None, ranks, launcher),
        };
        let run_dir = match (&spec.run_dir, spec.restart) {
            // A restart goes on in its run's directory (the failed start's files moved aside).
            (Some(dir), 1..) => dir.clone(),
            (dir, _) => create_run_dir(dir.as_deref())?,
        };
        let (line_sender, lines) = std::sync::mpsc::channel();
        let mut ranks = Vec::with_capacity(part.len());
        for rank in part {
            // Each rank gets its own host's keys, never the run's secret.
            let rank_keys = keys
                .host_of_rank(rank as u64)
                .with_context(|| format!("the run's keys place no host for rank {rank}"))
                .and_then(|host| keys.for_host(host)?.to_text());
            match rank_keys.and_then(|rank_keys| {
                spawn_rank(
                    spawner,
                    rank,
                    world,
                    spec,
                    store_address,
                    &rank_keys,
                    &run_dir,
                    &line_sender,
                )
            }) {
                Ok(process) => ranks.push(process),
                Err(error) => {
                    stop_gang(&mut ranks);
                    return Err(error);
                }
            }
        }
        let mut client = StoreClient::connect(
            &launcher_address.to_string(),
            keys,
            None,
            Duration::from_secs(10),
        )?;
        client.set("job", &serde_json::to_vec(job)?)?;
        let labels = (0..world).map(|rank| spawner.describe(rank)).collect();
        let gang = Gang {
            ranks,
            server,
            store_address,
            client,
            labels,
            run_dir,
            lines,
            world_size: world,
            loaded: 0,
            every_exit_fails: false,
            manifest_extra: serde_json::Map::new(),
            keys: keys.clone(),
            line_sender,
            restarted: HashMap::new(),
            followers: 0,
        };
        gang.write_manifest(spec, None)?;
        Ok(gang)
    }

    /// Writes `outcome.json` in the run directory once the gang has ended: whether the run
    /// failed and why (`error`, the whole chain), when, and how each rank ended (`exit`:
    /// its exit code or the signal that ended it; `null` when unknown). `infer doctor
    /// --run` reads it. Best effort: a run directory that cannot be written is skipped.
    pub fn write_outcome(&mut self, error: Option<&anyhow::Error>) {
        let ranks: Vec<serde_json::Value> = self
            .ranks
            .iter_mut()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank,
                    "host": r.child.host().unwrap_or("localhost"),
                    "pid": r.child.id(),
                    "exit": super::run_dir::exit_json(r.child.try_wait()),
                })
            })
            .collect();
        super::run_dir::write_outcome(&self.run_dir, error, "ranks", ranks);
    }

    /// Adds a top-level field to `manifest.json` (written at the next
    /// [`Gang::write_manifest`]).
    pub fn set_manifest_field(&mut self, key: &str, value: serde_json::Value) {
        self.manifest_extra.insert(key.to_string(), value);
    }

    /// From now on a rank that exits at all — even with status 0 — fails the gang, as for
    /// serving, where no rank finishes on its own.
    pub fn fail_on_any_exit(&mut self) {
        self.every_exit_fails = true;
    }

    /// This launcher's connection to the gang's rendezvous store.
    pub fn store(&mut self) -> &mut StoreClient {
        &mut self.client
    }

    /// The run directory (rank logs, `manifest.json`).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The [`Progress::Started`] report of this gang.
    pub fn started(&self) -> Progress {
        Progress::Started {
            world_size: self.world_size,
            run_dir: self.run_dir.clone(),
            pids: self.ranks.iter().map(|r| r.child.id()).collect(),
        }
    }

    /// Writes `manifest.json` in the run directory: the spec, every rank's pid, log and
    /// environment (its keys left out), the store address, and `serving` once known.
    ///
    /// Errors: the file cannot be written.
    pub fn write_manifest(&self, spec: &LaunchSpec, serving: Option<&str>) -> Result<()> {
        let ranks: Vec<serde_json::Value> = self
            .ranks
            .iter()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank,
                    "host": r.child.host().unwrap_or("localhost"),
                    "pid": r.child.id(),
                    // Each rank leads its own process group.
                    "pgid": r.child.id(),
                    "log": r.log,
                    "env": r
                        .env
                        .iter()
                        .map(|(k, v)| {
                            // Secrets stay out of the manifest.
                            let value = if SECRET_ENV.contains(&k.as_str()) {
                                "<redacted>".to_string()
                            } else {
                                v.clone()
                            };
                            (k.clone(), value)
                        })
                        .collect::<std::collections::BTreeMap<_, _>>(),
                })
            })
            .collect();
        let mut manifest = serde_json::json!({
            "tp": spec.degrees.tp,
            "pp": spec.degrees.pp,
            "dp": spec.degrees.dp,
            "ep": spec.degrees.ep,
            "layout_from": spec.layout_from,
            "world_size": self.world_size,
            "model": spec.model,
            "threads_per_rank": spec.threads_per_rank,
            "numerics": spec.numerics.name(),
            "store": self.store_address.to_string(),
            "store_on_launcher": self.server.is_some(),
            "launcher_pid": std::process::id(),
            "serving": serving,
            "ranks": ranks,
        });
        if let Some(object) = manifest.as_object_mut() {
            object.extend(self.manifest_extra.clone());
        }
        let path = self.run_dir.join("manifest.json");
        super::run_dir::write_private(&path, &serde_json::to_vec_pretty(&manifest)?)
            .with_context(|| format!("cannot write `{}`", path.display()))
    }

    /// Watches the gang until the driver sets `key` in the store and returns its value, or
    /// until `stop()` is true (`None`). `progress` hears rank output lines and loading
    /// milestones as they come.
    ///
    /// Errors: a rank that exited unsuccessfully or stopped heartbeating (named, with its
    /// exit status and last log lines), every rank gone without `key`. The caller stops the
    /// gang (or drops it).
    pub fn wait_for(
        &mut self,
        key: &str,
        stop: &dyn Fn() -> bool,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Option<Vec<u8>>> {
        loop {
            while let Ok((rank, line)) = self.lines.try_recv() {
                let label = self.labels.get(rank).cloned().unwrap_or_default();
                progress(Progress::RankLine { rank, label, line });
            }
            if self.loaded < self.world_size {
                let loaded = self.client.add("barrier/loaded/count", 0)?.max(0) as usize;
                if loaded > self.loaded {
                    self.loaded = loaded;
                    progress(Progress::Loaded {
                        loaded,
                        world_size: self.world_size,
                    });
                }
            }
            let mut ages = self.heartbeat_ages()?;
            // A rank started again alone is not late for what its predecessor missed.
            for (rank, at) in &self.restarted {
                if let Some(age) = ages.get_mut(rank) {
                    *age = (*age).min(at.elapsed());
                }
            }
            check_ranks(
                &mut self.ranks,
                &ages,
                self.every_exit_fails,
                self.store_address,
            )?;
            if stop() {
                return Ok(None);
            }
            match self.client.get(key, Duration::from_millis(50)) {
                Ok(bytes) => return Ok(Some(bytes)),
                Err(error) if error.to_string().contains("timed out") => {}
                Err(error) => return Err(error),
            }
            if self
                .ranks
                .iter_mut()
                .all(|r| matches!(r.child.try_wait(), Ok(Some(_))))
            {
                // Name a failed rank if there is one (it may have exited since the check).
                check_ranks(
                    &mut self.ranks,
                    &HashMap::new(),
                    self.every_exit_fails,
                    self.store_address,
                )?;
                // A rank that stored the result and exited between the wait above and
                // this check succeeded: look once more before calling it a failure.
                if let Ok(bytes) = self.client.get(key, Duration::from_millis(500)) {
                    return Ok(Some(bytes));
                }
                return Err(anyhow!("every rank exited without `{key}`"));
            }
        }
    }

    /// Time since each rank's last heartbeat, from the store wherever it runs.
    fn heartbeat_ages(&mut self) -> Result<HashMap<u64, Duration>> {
        match &self.server {
            Some(server) => Ok(server.heartbeat_ages()),
            None => self.client.heartbeat_ages(),
        }
    }

    /// Gives the ranks up to [`GRACE_PERIOD`] to exit on their own, then stops the rest.
    pub fn finish(&mut self) {
        let deadline = Instant::now() + GRACE_PERIOD;
        while Instant::now() < deadline
            && self
                .ranks
                .iter_mut()
                .any(|r| matches!(r.child.try_wait(), Ok(None)))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
    }

    /// Sends `signal` to rank `rank`'s process group (rank 0's SIGTERM starts its drain).
    pub fn signal_rank(&mut self, rank: usize, signal: rustix::process::Signal) {
        if let Some(process) = self.ranks.iter_mut().find(|r| r.rank == rank) {
            process.child.signal(signal);
        }
    }

    /// Whether every rank this launcher started has exited.
    pub fn every_rank_exited(&mut self) -> bool {
        self.ranks
            .iter_mut()
            .all(|r| !matches!(r.child.try_wait(), Ok(None)))
    }

    /// Whether rank `rank` has exited (an unknown rank counts as exited).
    pub fn rank_exited(&mut self, rank: usize) -> bool {
        self.ranks
            .iter_mut()
            .find(|r| r.rank == rank)
            .is_none_or(|r| !matches!(r.child.try_wait(), Ok(None)))
    }

    /// Stops `ranks` (one DP replica's: the others keep running) and starts them again
    /// with `spawner` as start `restart` of the run (their groups named for it, see
    /// [`crate::envvars::INCARNATION`]); the stopped ranks' logs move to `files` first.
    ///
    /// Errors: `ranks` outside the world, a log that cannot be moved, a rank that cannot
    /// start (the others of `ranks` started so far keep running; the caller gives up).
    pub(crate) fn restart_ranks(
        &mut self,
        spawner: &dyn Spawner,
        spec: &LaunchSpec,
        ranks: std::ops::Range<usize>,
        restart: usize,
        files: &Path,
    ) -> Result<()> {
        if ranks.is_empty() || ranks.end > self.world_size {
            bail!(
                "ranks {ranks:?} are not part of a world of {}",
                self.world_size
            );
        }
        let (mut stopped, kept): (Vec<RankProcess>, Vec<RankProcess>) =
            std::mem::take(&mut self.ranks)
                .into_iter()
                .partition(|r| ranks.contains(&r.rank));
        self.ranks = kept;
        stop_gang(&mut stopped);
        super::run_dir::private_dir(files)
            .with_context(|| format!("cannot create `{}`", files.display()))?;
        for process in &stopped {
            if let Some(name) = process.log.file_name() {
                std::fs::rename(&process.log, files.join(name))
                    .with_context(|| format!("cannot move `{}`", process.log.display()))?;
            }
        }
        let mut spec = spec.clone();
        spec.restart = restart;
        for rank in ranks {
            let rank_keys = self
                .keys
                .host_of_rank(rank as u64)
                .with_context(|| format!("the run's keys place no host for rank {rank}"))
                .and_then(|host| self.keys.for_host(host)?.to_text())?;
            let process = spawn_rank(
                spawner,
                rank,
                self.world_size,
                &spec,
                self.store_address,
                &rank_keys,
                &self.run_dir,
                &self.line_sender,
            )?;
            self.ranks.push(process);
            self.restarted.insert(rank as u64, Instant::now());
        }
        self.ranks.sort_by_key(|r| r.rank);
        Ok(())
    }

    /// `followers` other nodes' launchers follow this gang's starts (node 0 of `infer up
    /// --nnodes --max-restarts`): [`Gang::tell_followers`] tells them when the run ends.
    pub(crate) fn set_followers(&mut self, followers: usize) {
        self.followers = followers;
    }

    /// The run ends with `error` and no restart left: tells the following nodes' launchers
    /// through the store (`launcher/shutdown` = `failed: …`), waiting up to 3 s for each to
    /// say it has seen it, so that they end now rather than wait for a next start.
    pub(crate) fn tell_followers(&mut self, error: &anyhow::Error) {
        if self.followers == 0 {
            return;
        }
        let why = format!("{error:#}");
        let why = why.lines().next().unwrap_or_default();
        let value = format!("{}{why}", super::serving::FAILED_PREFIX);
        if self
            .client
            .set(super::serving::SHUTDOWN_KEY, value.as_bytes())
            .is_err()
        {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline
            && self
                .client
                .add(super::serving::SHUTDOWN_ACK_KEY, 0)
                .unwrap_or(self.followers as i64)
                < self.followers as i64
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every live rank (SIGTERM to its process group, SIGKILL after
    /// [`GRACE_PERIOD`]) and reaps them all.
    pub fn stop(&mut self) {
        stop_gang(&mut self.ranks);
    }
}

impl Drop for Gang {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs one generation on `tp × pp` local rank processes and returns the driver's result.
/// `progress` hears the milestones (ranks started, shards loaded).
///
/// Errors: a rank that fails or stops heartbeating (after every rank has been stopped), a
/// store that cannot start.
pub fn run_generation(
    spec: &LaunchSpec,
    job: &Job,
    progress: &mut dyn FnMut(Progress),
) -> Result<Generation> {
    let mut gang = Gang::start(spec, job)?;
    progress(gang.started());
    let bytes = gang
        .wait_for(crate::rendezvous::RESULT_KEY, &|| false, progress)?
        .ok_or_else(|| anyhow!("the generation was stopped"))?;
    // The ranks exit on their own after the last step; do not wait forever.
    gang.finish();
    serde_json::from_slice(&bytes).context("the driver wrote a malformed result")
}

/// Fails when a rank has exited unsuccessfully or stopped heartbeating, naming it.
fn check_ranks(
    ranks: &mut [RankProcess],
    heartbeat_ages: &HashMap<u64, Duration>,
    any_exit: bool,
    store: std::net::SocketAddr,
) -> Result<()> {
    // Every rank that failed since the last look; the one killed by a signal is the
    // cause, the others usually its casualties (they lost their peer).
    let mut failed = failed_ranks(ranks, any_exit)?;
    if !failed.is_empty() && !failed.iter().any(|(signalled, ..)| *signalled) {
        // A casualty can notice its lost peer before the kernel has reaped the killed
        // rank; give the cause a moment to show up so the error names it.
        std::thread::sleep(Duration::from_millis(300));
        failed = failed_ranks(ranks, any_exit)?;
    }
    if let Some((_, rank, status, log)) = failed
        .iter()
        .max_by_key(|(signalled, rank, ..)| (*signalled, std::cmp::Reverse(*rank)))
    {
        // Let the output threads flush the last lines into the log.
        std::thread::sleep(Duration::from_millis(50));
        let process = ranks.iter().find(|r| r.rank == *rank);
        let host = process
            .and_then(|r| r.child.host().map(|h| format!(" on `{h}`")))
            .unwrap_or_default();
        let note = process
            .and_then(|r| Some(format!("\n{}", r.child.host_note()?)))
            .unwrap_or_default();
        return Err(failure(
            FailureKind::RankExited,
            Some(*rank),
            format!(
                "rank {rank}{host} exited with {status}; last lines of `{}`:\n{}{note}",
                log.display(),
                last_lines(log, 8)
            ),
        ));
    }
    for (rank, age) in heartbeat_ages {
        let age = *age;
        if age > HEARTBEAT_TIMEOUT {
            let host = ranks
                .iter()
                .find(|r| r.rank as u64 == *rank)
                .and_then(|r| r.child.host().map(str::to_string));
            let message = match host {
                Some(host) => format!(
                    "rank {rank} on `{host}` stopped heartbeating {:.1} s ago: its host cannot reach \
                     the rendezvous store at {store} (rank 0's host) over the data network\n\
                     hint: check the data interfaces and links between `{host}` and rank 0's host",
                    age.as_secs_f64()
                ),
                None => format!(
                    "rank {rank} stopped heartbeating {:.1} s ago",
                    age.as_secs_f64()
                ),
            };
            return Err(failure(
                FailureKind::HeartbeatLost,
                Some(*rank as usize),
                message,
            ));
        }
    }
    Ok(())
}

/// Every rank that has exited unsuccessfully (or at all, with `any_exit`): (killed by a
/// signal, rank, status, log path).
fn failed_ranks(
    ranks: &mut [RankProcess],
    any_exit: bool,
) -> Result<Vec<(bool, usize, std::process::ExitStatus, PathBuf)>> {
    use std::os::unix::process::ExitStatusExt;
    let mut failed = Vec::new();
    for rank in ranks.iter_mut() {
        let status = rank
            .child
            .try_wait()
            .map_err(|error| failure(FailureKind::HostLost, None, format!("{error:#}")))?;
        if let Some(status) = status
            && (any_exit || !status.success())
        {
            failed.push((
                status.signal().is_some(),
                rank.rank,
                status,
                rank.log.clone(),
            ));
        }
    }
    Ok(failed)
}

/// SIGTERM to every live rank's process group, then SIGKILL after [`GRACE_PERIOD`], and reap.
fn stop_gang(ranks: &mut [RankProcess]) {
    for rank in ranks.iter_mut() {
        if matches!(rank.child.try_wait(), Ok(None)) {
            rank.child.signal(rustix::process::Signal::TERM);
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
            rank.child.signal(rustix::process::Signal::KILL);
        }
        rank.child.wait();
    }
}

pub(super) fn last_lines(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
