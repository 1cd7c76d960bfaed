//! Launching ranks with gang semantics: one `infer rank` process per rank with its
//! environment set explicitly (never inherited by accident), its own process group and its
//! own log file in a run directory; a rendezvous store protected by a random per-run token.
//! When any rank exits or stops heartbeating, every other rank is stopped (SIGTERM, then
//! SIGKILL after a grace period) and the error names the rank, its exit status and its last
//! log lines. Remote hosts (SSH) come later behind the same spawning code.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

pub mod agent;
pub mod cluster;
pub mod engine;
pub mod events;
pub mod network;
pub mod protocol;
pub mod remote;
pub mod serving;
pub mod smoke;
pub mod ssh;
pub mod ssh_config;
pub mod survey;

use crate::envvars;
use crate::rendezvous::{StoreClient, StoreServer, random_token};
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::engine::Generation;
use crate::runtime::exec::rank_env::{self, DeviceEnv, HostEnv, RankEnv, ServingEnv};
use crate::runtime::exec::worker::Job;

/// How long a rank may go without a heartbeat before the gang is stopped.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time between SIGTERM and SIGKILL when stopping the gang.
pub const GRACE_PERIOD: Duration = Duration::from_secs(2);

/// Environment variables whose values `manifest.json` never shows: our run token and API
/// key, and the credentials a rank may inherit from the usual tools (Hugging Face, OpenAI,
/// vLLM). Named one by one: `INFER_KV_CACHE_TOKENS` holds a size, not a secret.
pub const SECRET_ENV: &[&str] = &[
    envvars::RUN_TOKEN,
    envvars::API_KEY,
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY",
    "VLLM_API_KEY",
];

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub tp: usize,
    pub pp: usize,
    /// Data-parallel replicas (world size `dp × pp × tp`).
    pub dp: usize,
    /// Expert parallelism: 1, or `tp` (experts sharded over each TP group).
    pub ep: usize,
    /// The weights every rank loads (a GGUF file, or random weights every rank generates
    /// alike); `None`: a gang of collectives only, no model (it runs [`Job::AllReduce`] and
    /// nothing else).
    pub model: Option<crate::runtime::model::source::ModelSource>,
    /// Threads of each rank's pool.
    pub threads_per_rank: usize,
    /// How every rank's matrix products round (`INFER_NUMERICS`).
    pub numerics: Numerics,
    /// Timeout of collectives and store waits inside the ranks.
    pub timeout: Duration,
    /// `infer up`'s settings, which every rank of a serving gang gets (`None`: the gang
    /// serves nothing).
    pub serving: Option<ServingEnv>,
    /// Where the layout came from (flags, a plan file, a plan for a cluster), for the
    /// manifest.
    pub layout_from: String,
    /// Where each rank runs when they are spread over hosts (indexed by rank); empty: every
    /// rank on this host.
    pub placement: Vec<Placement>,
    /// The run directory (rank logs, `manifest.json`; `--run-dir`); `None`: a new one under
    /// [`runs_dir`], the oldest beyond [`KEEP_RUNS`] removed.
    pub run_dir: Option<PathBuf>,
    /// `--device cuda` ranks: each rank's `CUDA_VISIBLE_DEVICES` (indexed by rank; its host's
    /// GPU, so the rank computes on its first visible GPU); `None`: CPU ranks, which see no GPU.
    pub gpus: Option<Vec<String>>,
}

/// The timeout of a gang's collectives and store waits (`INFER_TIMEOUT_SECS`): 60 s, or
/// 600 s when the ranks run the CUDA kernels on the host harness (`harness`), which spawns a
/// CPU thread per CUDA thread and takes seconds a step even on an idle machine, so a loaded
/// one can keep a pipeline stage waiting past a minute.
pub fn rank_timeout(harness: bool) -> Duration {
    Duration::from_secs(if harness { 600 } else { 60 })
}

/// `CUDA_VISIBLE_DEVICES` of `world` device ranks on one host with `visible` GPUs: rank `r`
/// gets GPU `r % visible` (ranks beyond the GPUs share them, and their collectives go through
/// host memory); with `visible` 0 (the host harness) rank `r` gets `r`, as on a host with
/// enough GPUs.
pub fn local_gpus(world: usize, visible: usize) -> Vec<String> {
    gpus_by_local_rank(0..world, visible)
}

/// [`local_gpus`] of ranks spread over hosts: each rank's `CUDA_VISIBLE_DEVICES` from its
/// `LOCAL_RANK` and the GPUs its host shows (`local_rank % visible`; 0: `local_rank`).
pub fn gpus_by_local_rank(
    local_ranks: impl IntoIterator<Item = usize>,
    visible: usize,
) -> Vec<String> {
    local_ranks
        .into_iter()
        .map(|local_rank| match visible {
            0 => local_rank,
            n => local_rank % n,
        })
        .map(|gpu| gpu.to_string())
        .collect()
}

/// How many run directories [`runs_dir`] keeps (`INFER_KEEP_RUNS` overrides): the newest,
/// never one whose launcher or agent still runs.
pub const KEEP_RUNS: usize = 20;

/// Where launches keep their run directories: `<cache>/runs` (the cache of
/// [`crate::model::default::cache_dir`], `~/.cache/infer` by default), beside the agents'
/// `runs/RUN_ID/HOST` on the hosts.
///
/// Errors: no cache directory can be determined.
pub fn runs_dir() -> Result<PathBuf> {
    Ok(crate::model::default::cache_dir()?.join("runs"))
}

/// Creates the run directory `dir`, or a new `run-<16 hex>` under [`runs_dir`] and prunes
/// the oldest there beyond `INFER_KEEP_RUNS` (default [`KEEP_RUNS`]).
///
/// Errors: the directory cannot be created, or `dir` exists and is not an empty directory
/// (a run never mixes its logs with another's).
pub fn create_run_dir(dir: Option<&Path>) -> Result<PathBuf> {
    if let Some(dir) = dir {
        if dir.exists()
            && std::fs::read_dir(dir)
                .with_context(|| format!("`{}` (--run-dir) is not a directory", dir.display()))?
                .next()
                .is_some()
        {
            bail!(
                "the run directory `{}` is not empty: give a new or empty one (runs never share a directory)",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the run directory `{}`", dir.display()))?;
        return Ok(dir.to_path_buf());
    }
    let root = runs_dir()?;
    std::fs::create_dir_all(&root)
        .with_context(|| format!("cannot create `{}`", root.display()))?;
    let keep = std::env::var(envvars::KEEP_RUNS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KEEP_RUNS);
    // Room for the new one.
    prune_runs(&root, keep.saturating_sub(1));
    let dir = root.join(format!("run-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the run directory `{}`", dir.display()))?;
    Ok(dir)
}

/// Removes the oldest run directories under `root` (by modification time) beyond the
/// newest `keep`, except those still in use: a `manifest.json` whose `launcher_pid` runs,
/// or an agent's `HOST/pgids` (removed when the agent exits). Only `run-*` directories
/// count. Best effort: what cannot be read or removed stays.
pub fn prune_runs(root: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut runs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("run-"))
        .filter_map(|e| {
            let modified = e.metadata().ok()?.modified().ok()?;
            e.path().is_dir().then(|| (modified, e.path()))
        })
        .collect();
    runs.sort_by_key(|run| std::cmp::Reverse(run.0));
    for (_, dir) in runs.into_iter().skip(keep) {
        if !run_in_use(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Whether a run directory's launcher or one of its agents still runs.
fn run_in_use(dir: &Path) -> bool {
    if let Ok(text) = std::fs::read_to_string(dir.join("manifest.json"))
        && let Ok(manifest) = serde_json::from_str::<serde_json::Value>(&text)
        && let Some(pid) = manifest["launcher_pid"].as_u64()
        && let Some(pid) = rustix::process::Pid::from_raw(pid as i32)
        && rustix::process::test_kill_process(pid).is_ok()
    {
        return true;
    }
    std::fs::read_dir(dir)
        .is_ok_and(|entries| entries.flatten().any(|e| e.path().join("pgids").exists()))
}

impl LaunchSpec {
    /// Checks the layout against the model's header before anything starts: the TP degree
    /// splits its heads and MLP, PP has a layer per stage, EP divides its experts. A gang
    /// without a model (collectives only) passes.
    ///
    /// Errors: a degree of 0, an unreadable GGUF header, a layout the model cannot take
    /// (the message lists the TP degrees that work).
    pub fn check_layout(&self) -> Result<()> {
        if self.tp == 0 || self.pp == 0 || self.dp == 0 || self.ep == 0 {
            bail!(
                "every degree must be at least 1 (tp {}, pp {}, dp {}, ep {})",
                self.tp,
                self.pp,
                self.dp,
                self.ep
            );
        }
        let model = match &self.model {
            None => return Ok(()),
            Some(crate::runtime::model::source::ModelSource::Dummy(dummy)) => {
                let config = dummy.config();
                return crate::runtime::model::llama::LayoutLimits {
                    name: dummy.name.clone(),
                    n_layers: config.n_layers,
                    n_heads: config.n_heads,
                    n_kv_heads: config.n_kv_heads,
                    intermediate_size: config.intermediate_size,
                    n_experts: 0,
                }
                .check(self.tp, self.pp, self.ep);
            }
            Some(crate::runtime::model::source::ModelSource::File(path)) => path,
        };
        if model.is_dir() {
            bail!(
                "`{}` is a directory: ranks load GGUF files; give the `.gguf` file",
                model.display()
            );
        }
        let header = crate::runtime::formats::gguf::Header::read_file(model)?;
        let name = model.file_name().map_or_else(
            || model.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        crate::runtime::model::llama::LayoutLimits::from_header(&header, &name)?
            .check(self.tp, self.pp, self.ep)
    }
}

/// Where one rank runs on a multi-host launch, and its host's own settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Inventory name of the host.
    pub host: String,
    /// Rank within the host (`LOCAL_RANK`); the host's ranks are consecutive.
    pub local_rank: usize,
    /// Ranks on the host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// The host's own settings: its data interface and address (where the rank's
    /// collectives listen), its HCAs.
    pub env: HostEnv,
    /// Threads of this rank's pool when its host decides them (`None`: the spec's).
    pub threads: Option<usize>,
}

/// Where the rendezvous store runs.
#[derive(Clone, Copy, Debug)]
pub enum StoreLocation {
    /// In this process, on loopback (every rank on this host).
    Local,
    /// In this process, listening on this address (node 0 of `infer up --nnodes`: the
    /// other nodes' launchers and ranks connect to it).
    Listen(std::net::SocketAddr),
    /// On another host (rank 0's, run by its agent): `ranks` is `MASTER_ADDR:MASTER_PORT`
    /// as ranks reach it, `launcher` where this process reaches it (a forwarded port).
    Remote {
        ranks: std::net::SocketAddr,
        launcher: std::net::SocketAddr,
    },
}

/// How rank processes are started. The launcher builds each rank's environment and log
/// path; a spawner starts `infer rank` with exactly that environment (plus the run token),
/// copies every output line into the log and to `lines`, and returns a handle. Local
/// processes now ([`LocalSpawner`]); an SSH spawner later, behind the same trait.
pub trait Spawner {
    /// Starts rank `rank`. Errors: the process cannot be started.
    fn spawn(
        &self,
        rank: usize,
        env: &[(String, String)],
        token: &str,
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>>;

    /// Starts another program as member `index` of the gang (an engine's process):
    /// `argv[0]` is found on the host's `PATH` unless it names a path.
    ///
    /// Errors: the program is not found or cannot be started.
    /// The default starts nothing: a spawner of ranks only.
    fn spawn_program(
        &self,
        index: usize,
        argv: &[String],
        _env: &[(String, String)],
        _log: &Path,
        _lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        bail!(
            "this spawner starts `infer rank` only, not `{}` (member {index})",
            argv.first().map_or("", String::as_str)
        )
    }

    /// How rank `rank`'s output lines are labelled (`rank 3`, `node1 r3`).
    fn describe(&self, rank: usize) -> String {
        format!("rank {rank}")
    }
}

/// A started rank process, wherever it runs.
pub trait RankHandle: Send {
    /// Its process id (on its host).
    fn id(&self) -> u32;
    /// Its exit status once it has exited. Errors: the status cannot be read.
    fn try_wait(&mut self) -> Result<Option<ExitStatus>>;
    /// Sends `signal` to its process group (the rank and anything it started).
    fn signal(&mut self, signal: rustix::process::Signal);
    /// Waits for it to exit (after a signal).
    fn wait(&mut self);
    /// The host it runs on; `None` for this host.
    fn host(&self) -> Option<&str> {
        None
    }
    /// What its host said about why ranks stopped there (an agent that lost the store),
    /// if anything.
    fn host_note(&self) -> Option<String> {
        None
    }
}

/// Starts ranks as child processes of this one, each in its own process group and with a
/// parent-death signal, so no rank outlives the launcher even if it is killed.
pub struct LocalSpawner {
    /// The `infer` executable.
    pub exe: PathBuf,
}

/// A local rank process.
struct LocalRank(Child);

impl RankHandle for LocalRank {
    fn id(&self) -> u32 {
        self.0.id()
    }

    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.0.try_wait()?)
    }

    fn signal(&mut self, signal: rustix::process::Signal) {
        // A reaped child's pid may belong to another process by now: never signal it.
        if matches!(self.0.try_wait(), Ok(None))
            && let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32)
        {
            let _ = rustix::process::kill_process_group(pid, signal);
        }
    }

    fn wait(&mut self) {
        let _ = self.0.wait();
    }
}

/// A started rank.
struct RankProcess {
    rank: usize,
    child: Box<dyn RankHandle>,
    log: PathBuf,
    /// The environment it was given, for the manifest (the run token left out).
    env: Vec<(String, String)>,
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
}

impl Gang {
    /// Starts `spec.dp × spec.pp × spec.tp` rank processes with `job`, all or none: when one fails to
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
        let token = random_token();
        Gang::start_on(spawner, spec, job, StoreLocation::Local, &token)
    }

    /// [`Gang::start_with`] with the store at `store` (whose run token is `token`).
    ///
    /// Errors: the store, the run directory or a rank process cannot start.
    pub fn start_on(
        spawner: &dyn Spawner,
        spec: &LaunchSpec,
        job: &Job,
        store: StoreLocation,
        token: &str,
    ) -> Result<Gang> {
        let world = spec.dp * spec.tp * spec.pp;
        Gang::start_part(spawner, spec, job, store, token, 0..world)
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
        token: &str,
        part: std::ops::Range<usize>,
    ) -> Result<Gang> {
        spec.check_layout()?;
        let world = spec.dp * spec.tp * spec.pp;
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
                let server = StoreServer::start("127.0.0.1:0", token)?;
                let address = server.address();
                (Some(server), address, address)
            }
            StoreLocation::Listen(address) => {
                let server = StoreServer::start(&address.to_string(), token).with_context(|| {
                    format!(
                        "cannot listen on {address} for the rendezvous store: node 0 must own --master-addr, and the port must be free"
                    )
                })?;
                let address = server.address();
                (Some(server), address, address)
            }
            StoreLocation::Remote { ranks, launcher } => (None, ranks, launcher),
        };
        let run_dir = create_run_dir(spec.run_dir.as_deref())?;
        let (line_sender, lines) = std::sync::mpsc::channel();
        let mut ranks = Vec::with_capacity(part.len());
        for rank in part {
            match spawn_rank(
                spawner,
                rank,
                world,
                spec,
                store_address,
                token,
                &run_dir,
                &line_sender,
            ) {
                Ok(process) => ranks.push(process),
                Err(error) => {
                    stop_gang(&mut ranks);
                    return Err(error);
                }
            }
        }
        let mut client = StoreClient::connect(
            &launcher_address.to_string(),
            token,
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
        };
        gang.write_manifest(spec, None)?;
        Ok(gang)
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
    /// environment (the run token left out), the store address, and `serving` once known.
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
            "tp": spec.tp,
            "pp": spec.pp,
            "dp": spec.dp,
            "ep": spec.ep,
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
        std::fs::write(&path, serde_json::to_vec_pretty(&manifest)?)
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
            let ages = self.heartbeat_ages()?;
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
        .wait_for("result", &|| false, progress)?
        .ok_or_else(|| anyhow!("the generation was stopped"))?;
    // The ranks exit on their own after the last step; do not wait forever.
    gang.finish();
    serde_json::from_slice(&bytes).context("the driver wrote a malformed result")
}

#[allow(clippy::too_many_arguments)]
fn spawn_rank(
    spawner: &dyn Spawner,
    rank: usize,
    world: usize,
    spec: &LaunchSpec,
    store: std::net::SocketAddr,
    token: &str,
    run_dir: &Path,
    lines: &std::sync::mpsc::Sender<(usize, String)>,
) -> Result<RankProcess> {
    let log = run_dir.join(format!("rank{rank}.log"));
    let placement = spec.placement.get(rank);
    let (local_rank, local_world) =
        placement.map_or((rank, world), |p| (p.local_rank, p.local_world_size));
    let device = spec.gpus.as_ref().map(|_| {
        // What the rank's environment lacks to find NVIDIA's libraries (it gets PATH and HOME
        // only), and the harness switch and compiler when this launcher has them.
        let dirs = crate::runtime::libraries::search_dirs(&|name| std::env::var_os(name));
        DeviceEnv {
            lib_dirs: std::env::join_paths(&dirs)
                .ok()
                .map(|joined| joined.to_string_lossy().into_owned()),
            host_harness: std::env::var(envvars::CUDA_HOST_HARNESS).is_ok_and(|v| v == "1"),
            cxx: std::env::var(rank_env::CXX).ok(),
        }
    });
    let contract = RankEnv {
        rank,
        world_size: world,
        local_rank,
        local_world_size: local_world,
        store,
        tp: spec.tp,
        pp: spec.pp,
        dp: spec.dp,
        ep: spec.ep,
        threads: placement
            .and_then(|p| p.threads)
            .unwrap_or(spec.threads_per_rank),
        numerics: spec.numerics,
        timeout: spec.timeout,
        model: spec.model.clone(),
        // NCCL-style transport switches pass through, as torchrun's ranks inherit them.
        shm_disable: std::env::var(envvars::SHM_DISABLE).is_ok_and(|v| v == "1"),
        // CPU ranks see no GPU; a device rank sees its own.
        cuda_visible_devices: spec
            .gpus
            .as_ref()
            .and_then(|gpus| gpus.get(rank).cloned())
            .unwrap_or_default(),
        device,
        host: placement.map(|p| p.env.clone()).unwrap_or_default(),
        serving: spec.serving.clone(),
    };
    let env = contract.to_env()?;
    let child = spawner.spawn(rank, &env, token, &log, lines)?;
    Ok(RankProcess {
        rank,
        child,
        log,
        env,
    })
}

impl Spawner for LocalSpawner {
    fn spawn(
        &self,
        rank: usize,
        env: &[(String, String)],
        token: &str,
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        let lines = lines.clone();
        let child = start_rank_process(&self.exe, rank, env, token, log, move |line| {
            let _ = lines.send((rank, line));
        })?;
        Ok(Box::new(LocalRank(child)))
    }

    fn spawn_program(
        &self,
        index: usize,
        argv: &[String],
        env: &[(String, String)],
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        let Some((name, args)) = argv.split_first() else {
            bail!("an empty command line");
        };
        let path = std::env::var_os("PATH").unwrap_or_default();
        let program = find_program(name, &path)
            .with_context(|| format!("`{name}` is not on this host's PATH"))?;
        let lines = lines.clone();
        let child = start_process(&program, args, env, log, move |line| {
            let _ = lines.send((index, line));
        })?;
        Ok(Box::new(LocalRank(child)))
    }
}

/// Starts `exe rank` as one rank process, the same way on the launcher's host and in a
/// remote agent: exactly `env` (plus `PATH`, `HOME` and the run token; nothing inherited by
/// accident), its own process group (stopping the gang reaches anything the rank starts), a
/// parent-death signal, and every line it writes copied into `log` and handed to `line`.
///
/// The parent-death signal fires when the *thread* that spawned the rank exits: callers
/// spawn from a thread that lives as long as they watch the rank (the launcher's main
/// thread, the agent's).
///
/// Errors: the log file cannot be created, the process cannot be started.
pub fn start_rank_process(
    exe: &Path,
    rank: usize,
    env: &[(String, String)],
    token: &str,
    log: &Path,
    line: impl Fn(String) + Clone + Send + 'static,
) -> Result<Child> {
    let mut env = env.to_vec();
    env.push((envvars::RUN_TOKEN.into(), token.into()));
    start_process(exe, &["rank".to_string()], &env, log, line)
        .with_context(|| format!("cannot start rank {rank} from `{}`", exe.display()))
}

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
/// `line`. The same caveat as [`start_rank_process`] about the spawning thread holds.
///
/// Errors: the log file cannot be created, the process cannot be started.
pub fn start_process(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    line: impl Fn(String) + Clone + Send + 'static,
) -> Result<Child> {
    let file = File::create(log).with_context(|| format!("cannot create `{}`", log.display()))?;
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
        bail!(
            "rank {rank}{host} exited with {status}; last lines of `{}`:\n{}{note}",
            log.display(),
            last_lines(log, 8)
        );
    }
    for (rank, age) in heartbeat_ages {
        let age = *age;
        if age > HEARTBEAT_TIMEOUT {
            let host = ranks
                .iter()
                .find(|r| r.rank as u64 == *rank)
                .and_then(|r| r.child.host().map(str::to_string));
            match host {
                Some(host) => bail!(
                    "rank {rank} on `{host}` stopped heartbeating {:.1} s ago: its host cannot reach \
                     the rendezvous store at {store} (rank 0's host) over the data network\n\
                     hint: check the data interfaces and links between `{host}` and rank 0's host",
                    age.as_secs_f64()
                ),
                None => bail!(
                    "rank {rank} stopped heartbeating {:.1} s ago",
                    age.as_secs_f64()
                ),
            }
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
        if let Some(status) = rank.child.try_wait()?
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

fn last_lines(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `argv` (no shell: `argv[0]` found on `PATH` unless it names a path) with this
/// process's environment plus `env`, for at most `timeout` (then its process group is
/// killed), keeping each stream's first 64 KiB. What an agent answers to
/// [`protocol::ToAgent::Exec`], and how `infer up --engine` probes this host.
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
