//! Launching ranks with gang semantics: one `infer rank` process per rank with its
//! environment set explicitly (never inherited by accident), its own process group and its
//! own log file in a run directory; a rendezvous store protected by a random per-run token.
//! When any rank exits or stops heartbeating, every other rank is stopped (SIGTERM, then
//! SIGKILL after a grace period) and the error names the rank, its exit status and its last
//! log lines. Ranks on other hosts start through an agent reached over SSH ([`remote`],
//! [`agent`]), behind the same [`Spawner`] trait as local ones.
//!
//! The files: [`spec`] (what to launch), [`spawn`] (starting ranks), [`gang`] (watching and
//! stopping them), [`process`] (child processes), [`run_dir`] (run directories).

pub mod agent;
pub(crate) mod bench;
pub(crate) mod events;
pub(crate) mod gang;
pub(crate) mod hosts;
pub(crate) mod network;
pub(crate) mod postmortem;
pub(crate) mod probes;
pub(crate) mod process;
pub(crate) mod protocol;
pub mod remote;
pub(crate) mod run_dir;
pub(crate) mod serving;
pub(crate) mod serving_engines;
pub mod smoke;
pub(crate) mod spawn;
pub(crate) mod spec;
pub(crate) mod ssh;
pub(crate) mod ssh_config;
pub(crate) mod supervise;
pub(crate) mod survey;
pub(crate) mod up_settings;

pub use gang::{GRACE_PERIOD, Gang, HEARTBEAT_TIMEOUT, Progress, run_generation};
pub use process::{Executed, find_program, run_program, start_process};
pub use run_dir::{KEEP_RUNS, create_run_dir, prune_runs, runs_dir};
pub use spawn::{LocalSpawner, RankHandle, Spawner, start_rank_process};
pub use spec::{
    LaunchSpec, Placement, SECRET_ENV, StoreLocation, gpus_by_local_rank, local_gpus, rank_timeout,
};
