//! `run-outcome`: why a run of `infer up` ended, the post-mortem of `infer doctor --run`.
//!
//! What it checks: one run's record — how the launcher said it ended (`outcome.json`: its
//! error, each rank's exit code or signal), each rank's log (the stall warnings rank 0
//! writes, collective timeouts) — and the kernel's log lines about its processes (the OOM
//! killer, NVIDIA Xid errors).
//! Why it matters: after a failed run the question is which rank, which host, which link;
//! the launcher's one error line rarely says whether the kernel killed a rank for memory,
//! a rank crashed, a rank or a link stalled, or a host was lost.
//! How to fix: per cause, in each finding's hint.

use crate::doctor::{Finding, Severity};

/// Id of this check.
pub(crate) const ID: &str = "run-outcome";

/// What a run directory and the kernel's log say of one run (`launch::postmortem`
/// gathers it).
#[derive(Clone, Debug)]
pub(crate) struct RunEvidence {
    /// The run directory.
    pub run_dir: String,
    /// `outcome.json`; `None` when the launcher recorded none (it still runs, or it was
    /// killed).
    pub outcome: Option<RunOutcome>,
    /// Whether the run's launcher still runs.
    pub launcher_running: bool,
    pub ranks: Vec<RankRecord>,
    /// The kernel log's lines, or why it could not be read.
    pub kernel: Result<Vec<String>, String>,
}

/// How the launcher said the run ended.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunOutcome {
    pub ok: bool,
    /// The launcher's error, the whole chain.
    pub error: Option<String>,
}

/// One rank of the run.
#[derive(Clone, Debug, Default)]
pub(crate) struct RankRecord {
    pub rank: usize,
    pub host: String,
    pub pid: u32,
    /// Its exit code, or the signal that ended it; `None` when unknown.
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    /// Where its log is, and its text.
    pub log_path: String,
    pub log: String,
}

/// The findings of one run: first the cause (an error, or `ok` for a clean stop), then the
/// facts that support it.
pub(crate) fn check(run: &RunEvidence) -> Vec<Finding> {
    let mut findings = Vec::new();
    let finding = |severity, message: String, evidence: Vec<String>, hint: &str| Finding {
        check: ID,
        severity,
        host: None,
        message,
        evidence,
        hint: hint.to_string(),
    };
    // The kernel's word first: a rank it killed for memory looks like any SIGKILL.
    let kernel = run.kernel.as_ref().map(Vec::as_slice).unwrap_or(&[]);
    for rank in &run.ranks {
        let pid = rank.pid.to_string();
        let oom: Vec<String> = kernel
            .iter()
            .filter(|l| mentions_pid(l, &pid) && l.to_ascii_lowercase().contains("kill"))
            .filter(|l| l.contains("Out of memory") || l.contains("oom"))
            .cloned()
            .collect();
        if !oom.is_empty() {
            findings.push(finding(
                Severity::Error,
                format!(
                    "rank {} (pid {}) on `{}` was killed by the kernel's OOM killer",
                    rank.rank, rank.pid, rank.host
                ),
                oom,
                "give the host more memory, or lower what a rank holds: --kv-cache-tokens, --max-batch, or more ranks (--tp/--pp)",
            ));
        }
    }
    let xid: Vec<String> = kernel
        .iter()
        .filter(|l| l.contains("NVRM: Xid"))
        .cloned()
        .collect();
    if !xid.is_empty() {
        findings.push(finding(
            Severity::Error,
            format!("the GPU driver reported {} Xid error(s) during the run", xid.len()),
            xid,
            "look the Xid codes up in NVIDIA's Xid catalog; `nvidia-smi -q` shows the GPU's state (48/63/64/79: memory, ECC or a GPU off the bus)",
        ));
    }
    let error = run.outcome.as_ref().and_then(|o| o.error.clone());
    let stall = run
        .ranks
        .iter()
        .flat_map(|r| r.log.lines())
        .filter(|l| l.contains("stalled: no step completed"))
        .map(|l| l.trim_start_matches("warning: ").to_string())
        .next_back();
    if let Some(error) = &error {
        let first = error.lines().next().unwrap_or_default().to_string();
        if let Some(rank) = failed_rank(&run.ranks, error) {
            let how = match (rank.exit_signal, rank.exit_code) {
                (Some(signal), _) => {
                    format!("was killed by signal {signal} ({})", signal_name(signal))
                }
                (None, Some(code)) => format!("exited with code {code}"),
                (None, None) => "ended".to_string(),
            };
            let mut evidence = vec![first.clone()];
            evidence.extend(last_lines(&rank.log, 5).map(|l| format!("{}: {l}", rank.log_path)));
            findings.push(finding(
                Severity::Error,
                format!("rank {} on `{}` {how}; the others stopped with it (a gang stops as one)", rank.rank, rank.host),
                evidence,
                "a signal the run did not send (9, 6, 11) means something killed or crashed the rank: its log's last lines, then the kernel log (OOM, segfault) tell which",
            ));
        } else if error.contains("stopped heartbeating") {
            let remote = error.contains(" on `");
            findings.push(finding(
                Severity::Error,
                if remote {
                    format!("a host was lost: {first}")
                } else {
                    format!("a rank stopped heartbeating: frozen (SIGSTOP, swapped out) or wedged hard: {first}")
                },
                vec![first.clone()],
                if remote {
                    "check that host and the data network between it and rank 0's host (`infer doctor --cluster`)"
                } else {
                    "see whether the rank's process was stopped (`ps -o stat`) or the host ran out of memory"
                },
            ));
        } else if let Some(stall) = &stall {
            findings.push(finding(
                Severity::Error,
                format!("a replica stalled, then the run failed: {stall}"),
                vec![first.clone()],
                "the diagnosis names the rank others wait on (in no collective: computing or stuck) or the ranks waiting on each other (a link)",
            ));
        } else {
            findings.push(finding(
                Severity::Error,
                format!("the run failed: {first}"),
                error.lines().skip(1).take(8).map(str::to_string).collect(),
                "",
            ));
        }
    } else if let Some(stall) = &stall {
        findings.push(finding(
            Severity::Error,
            format!("a replica stalled before the run was stopped: {stall}"),
            Vec::new(),
            "the diagnosis names the rank others wait on (in no collective: computing or stuck) or the ranks waiting on each other (a link)",
        ));
    }
    let causes = findings.len();
    match (&run.outcome, run.launcher_running) {
        (_, true) => findings.push(finding(
            Severity::Ok,
            "the run is still running: `GET /health` and `GET /debug/ranks` show its state now"
                .to_string(),
            Vec::new(),
            "",
        )),
        (Some(outcome), false) if outcome.ok && causes == 0 => findings.push(finding(
            Severity::Ok,
            "the run ended cleanly (stopped by Ctrl-C or SIGTERM)".to_string(),
            Vec::new(),
            "",
        )),
        (None, false) => findings.push(finding(
            Severity::Warn,
            "the launcher recorded no outcome: it was killed (SIGKILL) or crashed; its ranks died with it".to_string(),
            Vec::new(),
            "what stopped the launcher is outside the run: the shell, a job scheduler, the OOM killer (see the kernel log)",
        )),
        _ => {}
    }
    if let Some(first) = findings.first_mut() {
        first
            .evidence
            .push(format!("run directory `{}`", run.run_dir));
    }
    if let Err(why) = &run.kernel {
        findings.push(finding(
            Severity::Warn,
            format!(
                "the kernel log could not be read ({why}): OOM kills and Xid errors are not checked"
            ),
            Vec::new(),
            "run `infer doctor --run` as root, or allow `dmesg` (sysctl kernel.dmesg_restrict=0)",
        ));
    }
    findings
}

/// The rank the launcher's error names as exited (`rank N … exited with`).
fn failed_rank<'a>(ranks: &'a [RankRecord], error: &str) -> Option<&'a RankRecord> {
    let named = error.split("rank ").skip(1).find_map(|rest| {
        let number: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let rank: usize = number.parse().ok()?;
        rest.lines()
            .next()
            .is_some_and(|l| l.contains("exited with"))
            .then_some(rank)
    })?;
    ranks.iter().find(|r| r.rank == named)
}

/// Whether a kernel log line names process `pid` (`Killed process 1234 (infer)` or
/// `pid=1234,`).
fn mentions_pid(line: &str, pid: &str) -> bool {
    line.contains(&format!("process {pid} "))
        || line.contains(&format!("pid={pid},"))
        || line.contains(&format!("pid={pid} "))
}

/// The last `n` lines of `text`.
fn last_lines(text: &str, n: usize) -> impl Iterator<Item = &str> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    lines.into_iter().skip(start)
}

/// A signal's name (the common ones).
fn signal_name(signal: i32) -> &'static str {
    match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        7 => "SIGBUS",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: usize, pid: u32, signal: Option<i32>) -> RankRecord {
        RankRecord {
            rank,
            host: "localhost".into(),
            pid,
            exit_code: if signal.is_none() { Some(1) } else { None },
            exit_signal: signal,
            log_path: format!("rank-{rank}.log"),
            log: "loaded\nstep\n".into(),
        }
    }

    fn failed(error: &str, ranks: Vec<RankRecord>, kernel: Vec<&str>) -> RunEvidence {
        RunEvidence {
            run_dir: "run-1".into(),
            outcome: Some(RunOutcome {
                ok: false,
                error: Some(error.into()),
            }),
            launcher_running: false,
            ranks,
            kernel: Ok(kernel.into_iter().map(str::to_string).collect()),
        }
    }

    #[test]
    fn a_rank_killed_by_a_signal_is_the_cause_and_the_oom_killer_is_named_when_it_was() {
        let ranks = vec![rank(0, 100, Some(15)), rank(1, 101, Some(9))];
        let error = "rank 1 exited with signal: 9 (SIGKILL); last lines of `rank-1.log`:";
        let findings = check(&failed(error, ranks.clone(), vec![]));
        assert_eq!(findings[0].severity, Severity::Error);
        assert_eq!(
            findings[0].message,
            "rank 1 on `localhost` was killed by signal 9 (SIGKILL); the others stopped with it (a gang stops as one)"
        );
        let oom = "[12.3] Out of memory: Killed process 101 (infer) total-vm:1kB, anon-rss:1kB";
        let findings = check(&failed(error, ranks, vec!["[1.0] unrelated", oom]));
        assert_eq!(
            findings[0].message,
            "rank 1 (pid 101) on `localhost` was killed by the kernel's OOM killer"
        );
        assert_eq!(findings[0].evidence[0], oom);
    }

    #[test]
    fn a_stall_line_in_a_rank_log_is_the_cause_of_a_stopped_run() {
        let mut ranks = vec![rank(0, 100, Some(15))];
        ranks[0].log = "warning: replica 0 stalled: no step completed for 3.0 s — rank 2 holds the others up\n".into();
        let run = RunEvidence {
            outcome: Some(RunOutcome {
                ok: true,
                error: None,
            }),
            ..failed("", ranks, vec![])
        };
        let findings = check(&run);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert!(findings[0].message.starts_with(
            "a replica stalled before the run was stopped: replica 0 stalled: no step completed for 3.0 s"
        ));
    }

    #[test]
    fn no_outcome_means_a_killed_launcher_and_an_unreadable_kernel_log_is_said() {
        let run = RunEvidence {
            outcome: None,
            kernel: Err("dmesg: Operation not permitted".into()),
            ..failed("", vec![rank(0, 100, None)], vec![])
        };
        let findings = check(&run);
        assert_eq!(findings[0].severity, Severity::Warn);
        assert!(
            findings[0]
                .message
                .starts_with("the launcher recorded no outcome")
        );
        assert!(
            findings[1]
                .message
                .contains("dmesg: Operation not permitted")
        );
        let lost = "rank 1 on `h1` stopped heartbeating 6.0 s ago: its host cannot reach the rendezvous store";
        let findings = check(&failed(lost, vec![rank(1, 5, None)], vec![]));
        assert!(
            findings[0]
                .message
                .starts_with("a host was lost: rank 1 on `h1`")
        );
    }
}
