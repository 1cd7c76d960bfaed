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
        private_dir(dir)
            .with_context(|| format!("cannot create the run directory `{}`", dir.display()))?;
        return Ok(dir.to_path_buf());
    }
    let root = runs_dir()?;
    private_dir(&root).with_context(|| format!("cannot create `{}`", root.display()))?;
    let keep = std::env::var(envvars::KEEP_RUNS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KEEP_RUNS);
    // Room for the new one.
    prune_runs(&root, keep.saturating_sub(1));
    let dir = root.join(format!("run-{:016x}", rand::random::<u64>()));
    private_dir(&dir)
        .with_context(|| format!("cannot create the run directory `{}`", dir.display()))?;
    Ok(dir)
}

/// Creates `dir` (and its parents) readable by this user only (0700): a run's logs hold
/// prompts and outputs. A directory that exists keeps its mode.
///
/// Errors: as [`std::fs::DirBuilder::create`].
pub(crate) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Creates (or truncates) the file `path` for writing, readable by this user only (0600),
/// never through a symbolic link (`O_NOFOLLOW`: in a shared directory such as `/tmp`,
/// another user's link would otherwise redirect the write).
///
/// Errors: `path` is a symbolic link, or cannot be opened.
pub(crate) fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
}

/// Writes `bytes` to `path` through [`create_private`].
///
/// Errors: as [`create_private`], or the write fails.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    create_private(path)?.write_all(bytes)
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

/// How a process ended, as `outcome.json` records it: `{"code", "signal"}` from
/// `try_wait`'s answer, `null` while unknown (still running, or not ours to wait for).
pub(crate) fn exit_json<E>(
    status: Result<Option<std::process::ExitStatus>, E>,
) -> serde_json::Value {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(Some(status)) => serde_json::json!({"code": status.code(), "signal": status.signal()}),
        _ => serde_json::Value::Null,
    }
}

/// Writes `outcome.json` in `run_dir` once a run's processes have ended: whether it failed
/// and why (`error`, the whole chain), when (`ended_unix_ms`), and how each process ended
/// under `list` (`ranks`, or an engine's `processes`). `infer doctor --run` reads it. Best
/// effort: a run directory that cannot be written is skipped.
pub(crate) fn write_outcome(
    run_dir: &Path,
    error: Option<&anyhow::Error>,
    list: &str,
    processes: Vec<serde_json::Value>,
) {
    let ended_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut outcome = serde_json::json!({
        "ok": error.is_none(),
        "error": error.map(|e| format!("{e:#}")),
        "ended_unix_ms": ended_unix_ms,
    });
    outcome[list] = serde_json::Value::Array(processes);
    if let Ok(text) = serde_json::to_vec_pretty(&outcome) {
        let _ = write_private(&run_dir.join("outcome.json"), &text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A run directory is 0700, its files 0600, and a symbolic link planted where a file
    /// goes (another user's, in `/tmp`) is not followed: the write fails, the target keeps
    /// its bytes.
    #[test]
    fn run_files_are_private_and_never_written_through_a_link() {
        let temp = tempfile::tempdir().expect("tempdir");
        let dir = temp.path().join("run");
        let created = create_run_dir(Some(&dir)).expect("run dir");
        let mode = |p: &Path| std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode(&created), 0o700);
        write_private(&dir.join("manifest.json"), b"{}").expect("write");
        assert_eq!(mode(&dir.join("manifest.json")), 0o600);
        let target = temp.path().join("victim");
        std::fs::write(&target, b"precious").expect("victim");
        std::os::unix::fs::symlink(&target, dir.join("rank0.log")).expect("symlink");
        assert!(create_private(&dir.join("rank0.log")).is_err());
        assert_eq!(std::fs::read(&target).expect("victim"), b"precious");
    }
}
