//! `nccl-output`: a log given with `--nccl-log` holds NCCL's own output.
//!
//! What it checks: each log has at least one line NCCL writes (`NCCL INFO`, `NCCL WARN`,
//! `NCCL version`, an `nccl…Error` code).
//! Why it matters: a file without them (an empty capture, the wrong file, a log from a run
//! without `NCCL_DEBUG=INFO`) gives every other log check nothing to see; "0 errors" would
//! be a false all-clear.
//! How to fix: rerun with `NCCL_DEBUG=INFO` (and `NCCL_DEBUG_SUBSYS=INIT,NET` for less) and
//! pass every rank's stderr, or the file `NCCL_DEBUG_FILE` names.

use crate::doctor::nccl_log::NcclLog;
use crate::doctor::{Finding, Severity};

/// Id of this check.
pub(crate) const ID: &str = "nccl-output";

/// What to do about a log without NCCL output.
pub(crate) const HINT: &str = "capture the ranks' stderr with `NCCL_DEBUG=INFO` set (or the file `NCCL_DEBUG_FILE` names) and pass it with --nccl-log";

/// A warning per log without a single NCCL line.
pub(crate) fn check(logs: &[NcclLog]) -> Vec<Finding> {
    logs.iter()
        .filter(|log| log.nccl_lines == 0)
        .map(|log| Finding {
            check: ID,
            severity: Severity::Warn,
            host: None,
            message: format!(
                "`{}` holds no NCCL output ({} lines, none from NCCL): nothing in it was checked",
                log.origin, log.lines
            ),
            evidence: Vec::new(),
            hint: HINT.into(),
        })
        .collect()
}
