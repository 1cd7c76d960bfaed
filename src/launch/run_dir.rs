//! Run directories: one per launch (rank logs, `manifest.json`), the newest
//! [`KEEP_RUNS`] kept, never one whose launcher or agent still runs.

use std::path::{Path, PathBuf};

use crate::envvars;
use anyhow::{Context, Result, bail};

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
