//! Starting rank processes: the [`Spawner`] trait (local processes here, agents over SSH in
//! [`super::remote`]), each rank's environment built from the typed contract
//! ([`crate::runtime::exec::rank_env::RankEnv`]).

use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};

use anyhow::{Context, Result, bail};

use super::process::{find_program, start_process};
use super::spec::LaunchSpec;
use crate::envvars;
use crate::runtime::exec::rank_env::{self, DeviceEnv, RankEnv, TestFault};

/// How rank processes are started. The launcher builds each rank's environment and log
/// path; a spawner starts `infer rank` with exactly that environment (plus its host's keys),
/// copies every output line into the log and to `lines`, and returns a handle. Local
/// processes ([`LocalSpawner`]) and ranks on other hosts through their agents
/// ([`super::remote`]), behind the same trait.
pub trait Spawner {
    /// Starts rank `rank`. Errors: the process cannot be started.
    fn spawn(
        &self,
        rank: usize,
        env: &[(String, String)],
        keys: &str,
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
pub(super) struct RankProcess {
    pub(super) rank: usize,
    pub(super) child: Box<dyn RankHandle>,
    pub(super) log: PathBuf,
    /// The environment it was given, for the manifest (its keys left out).
    pub(super) env: Vec<(String, String)>,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn spawn_rank(
    spawner: &dyn Spawner,
    rank: usize,
    world: usize,
    spec: &LaunchSpec,
    store: std::net::SocketAddr,
    keys: &str,
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
        degrees: spec.degrees,
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
        // Only rank 0 serves HTTP: no other rank gets the API key.
        serving: spec.serving.clone().map(|mut serving| {
            if rank != 0 {
                serving.api_key = None;
            }
            serving
        }),
        // The tests' fault concerns a run's first start: a restart runs clean.
        test_fault: match spec.restart {
            0 => TestFault::from_process_env()?,
            _ => None,
        },
        // A replica restarted alone meets its groups under a name of this start
        // ([`Gang::restart_ranks`](super::gang::Gang::restart_ranks)).
        incarnation: spec.restart,
    };
    let env = contract.to_env()?;
    let child = spawner.spawn(rank, &env, keys, &log, lines)?;
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
        keys: &str,
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        let lines = lines.clone();
        let child = start_rank_process(&self.exe, rank, env, keys, log, move |line| {
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
/// remote agent: exactly `env` (plus `PATH`, `HOME` and its host's `keys`; nothing inherited by
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
    keys: &str,
    log: &Path,
    line: impl Fn(String) + Clone + Send + 'static,
) -> Result<Child> {
    let mut env = env.to_vec();
    env.push((envvars::RUN_KEYS.into(), keys.into()));
    start_process(exe, &["rank".to_string()], &env, log, line)
        .with_context(|| format!("cannot start rank {rank} from `{}`", exe.display()))
}
