//! `infer doctor --run`: gathers one run's record for the post-mortem
//! ([`crate::doctor::checks::run_outcome`]): its run directory (`manifest.json`,
//! `outcome.json`, every rank's log) and the kernel's log lines (`dmesg`, else the
//! journal), and bundles it all for a bug report.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::doctor::checks::run_outcome::{RankRecord, RunEvidence, RunOutcome};

/// The run directory `run` names: a directory, `last` (the newest run under
/// [`super::runs_dir`]), or a run id (`run-…`, with or without the prefix) there.
///
/// Errors: none of these exists (the newest runs are listed), or it has no `manifest.json`.
pub(crate) fn run_dir(run: &str) -> Result<PathBuf> {
    let given = PathBuf::from(run);
    let dir = if given.is_dir() {
        given
    } else if run == "last" {
        let root = super::runs_dir()?;
        match newest(&root).into_iter().next() {
            Some(name) => root.join(name),
            None => bail!(
                "no run under `{}` yet: `infer up` records each run there",
                root.display()
            ),
        }
    } else {
        let root = super::runs_dir()?;
        let id = if run.starts_with("run-") {
            run.to_string()
        } else {
            format!("run-{run}")
        };
        let dir = root.join(&id);
        if !dir.is_dir() {
            bail!(
                "no run `{run}`: not a directory, and no `{id}` under `{}`{}\nhint: give a run directory (its path is printed when the run starts) or a run id from `{}`",
                root.display(),
                newest_runs(&root),
                root.display()
            );
        }
        dir
    };
    if !dir.join("manifest.json").is_file() {
        bail!(
            "`{}` is not a run directory: it has no manifest.json (an `infer up` run writes one when its ranks start)",
            dir.display()
        );
    }
    Ok(dir)
}

/// The run directories' names under `root`, newest first (by modification time).
fn newest(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut runs: Vec<(std::time::SystemTime, String)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let modified = e.metadata().ok()?.modified().ok()?;
            (name.starts_with("run-") && e.path().is_dir()).then_some((modified, name))
        })
        .collect();
    runs.sort_by_key(|run| std::cmp::Reverse(run.0));
    runs.into_iter().map(|(_, name)| name).collect()
}

/// " (newest: run-a, run-b, …)" for the runs under `root`, or nothing.
fn newest_runs(root: &Path) -> String {
    let names: Vec<String> = newest(root).into_iter().take(5).collect();
    if names.is_empty() {
        String::new()
    } else {
        format!(" (newest: {})", names.join(", "))
    }
}

/// Reads run directory `dir` and the kernel's log.
///
/// Errors: a `manifest.json` that cannot be read or parsed.
pub(crate) fn gather(dir: &Path) -> Result<RunEvidence> {
    let manifest_path = dir.join("manifest.json");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&manifest_path)
            .with_context(|| format!("cannot read `{}`", manifest_path.display()))?,
    )
    .with_context(|| format!("`{}` is not a run manifest", manifest_path.display()))?;
    let outcome: Option<serde_json::Value> = std::fs::read_to_string(dir.join("outcome.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    let exits = |rank: u64| {
        outcome
            .as_ref()
            .and_then(|o| o["ranks"].as_array())
            .and_then(|ranks| ranks.iter().find(|r| r["rank"].as_u64() == Some(rank)))
            .map(|r| r["exit"].clone())
            .unwrap_or_default()
    };
    let ranks = manifest["ranks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|r| {
            let rank = r["rank"].as_u64().unwrap_or_default();
            let exit = exits(rank);
            let log_path = r["log"].as_str().unwrap_or_default().to_string();
            RankRecord {
                rank: rank as usize,
                host: r["host"].as_str().unwrap_or("localhost").to_string(),
                pid: r["pid"].as_u64().unwrap_or_default() as u32,
                exit_code: exit["code"].as_i64().map(|c| c as i32),
                exit_signal: exit["signal"].as_i64().map(|s| s as i32),
                log: std::fs::read(&log_path)
                    .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                    .unwrap_or_default(),
                log_path,
            }
        })
        .collect();
    let launcher_running = manifest["launcher_pid"]
        .as_u64()
        .and_then(|pid| rustix::process::Pid::from_raw(pid as i32))
        .is_some_and(|pid| rustix::process::test_kill_process(pid).is_ok());
    Ok(RunEvidence {
        run_dir: dir.display().to_string(),
        outcome: outcome.as_ref().map(|o| RunOutcome {
            ok: o["ok"].as_bool().unwrap_or(false),
            error: o["error"].as_str().map(str::to_string),
        }),
        launcher_running,
        ranks,
        kernel: kernel_log(),
    })
}

/// The kernel's log lines: `dmesg`, else `journalctl -k`. Errors: why neither could be
/// read (not root, `kernel.dmesg_restrict`, no journal).
fn kernel_log() -> Result<Vec<String>, String> {
    let mut why = Vec::new();
    for (program, args) in [
        ("dmesg", &[][..]),
        ("journalctl", &["-k", "-q", "--no-pager"][..]),
    ] {
        match std::process::Command::new(program).args(args).output() {
            Ok(output) if output.status.success() => {
                return Ok(String::from_utf8_lossy(&output.stdout)
                    .lines()
                    .map(str::to_string)
                    .collect());
            }
            Ok(output) => why.push(format!(
                "{program}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(error) => why.push(format!("{program}: {error}")),
        }
    }
    Err(why.join("; "))
}

/// Writes `report` (the post-mortem as JSON) into the run directory as `postmortem.json`
/// and packs the directory into `bundle` (a `.tar.gz`, with `tar`), for a bug report. The
/// manifest already holds no secret (the run token and API keys are redacted).
///
/// Errors: the report or the bundle cannot be written.
pub(crate) fn bundle(dir: &Path, report: &serde_json::Value, bundle: &Path) -> Result<()> {
    super::run_dir::write_private(
        &dir.join("postmortem.json"),
        serde_json::to_string_pretty(report)?.as_bytes(),
    )
    .with_context(|| format!("cannot write the report into `{}`", dir.display()))?;
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        bail!(
            "`{}` has no parent directory to pack it from",
            dir.display()
        );
    };
    let output = std::process::Command::new("tar")
        .arg("-czf")
        .arg(bundle)
        .arg("-C")
        .arg(parent)
        .arg(name)
        .output()
        .context("cannot run `tar` (apt-get install tar gzip)")?;
    if !output.status.success() {
        bail!(
            "`tar` could not write `{}`: {}",
            bundle.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
