//! `ulimit` and `memlock`: per-process limits that break NCCL at scale.
//!
//! What it checks: `Max open files` and `Max locked memory` of this process
//! (`/proc/self/limits`, which ranks started from this shell inherit).
//! Why it matters: NCCL opens sockets and file descriptors per peer and channel; below
//! 65536 large jobs fail with `Too many open files`. RDMA registers (pins) buffers: a small
//! memlock limit makes `ibv_reg_mr` fail.
//! How to fix: `ulimit -n 1048576` and `ulimit -l unlimited` in the launching shell, or
//! `nofile`/`memlock` in `/etc/security/limits.conf` (`LimitNOFILE`/`LimitMEMLOCK` for systemd).

use crate::doctor::{Finding, Severity};

/// Id of the open-files check.
pub(crate) const ULIMIT_ID: &str = "ulimit";
/// Id of the locked-memory check.
pub(crate) const MEMLOCK_ID: &str = "memlock";

/// Open files NCCL needs at scale (NCCL's troubleshooting guide suggests raising it well above 1024).
pub(crate) const MIN_OPEN_FILES: u64 = 65536;

/// Findings from the text of `/proc/self/limits`; `has_rdma` makes a small memlock a warning.
pub(crate) fn check(limits: &str, has_rdma: bool) -> Vec<Finding> {
    let mut findings = Vec::new();
    if let Some(soft) = soft_limit(limits, "Max open files") {
        let (severity, hint) = match soft {
            Some(n) if n < MIN_OPEN_FILES => (
                Severity::Warn,
                "run `ulimit -n 1048576` before launching, or raise `nofile` in /etc/security/limits.conf",
            ),
            _ => (Severity::Ok, ""),
        };
        findings.push(Finding {
            check: ULIMIT_ID,
            severity,
            host: None,
            message: format!(
                "open files limit is {}, expected at least {MIN_OPEN_FILES}",
                soft.map_or("unlimited".to_string(), |n| n.to_string())
            ),
            evidence: limits
                .lines()
                .filter(|l| l.starts_with("Max open files"))
                .map(str::to_string)
                .collect(),
            hint: hint.to_string(),
        });
    }
    if let Some(soft) = soft_limit(limits, "Max locked memory") {
        let small = soft.is_some_and(|bytes| bytes < 1 << 30);
        findings.push(Finding {
            check: MEMLOCK_ID,
            severity: if small && has_rdma {
                Severity::Warn
            } else {
                Severity::Ok
            },
            host: None,
            message: format!(
                "locked-memory limit is {}{}",
                soft.map_or("unlimited".to_string(), |b| format!("{b} bytes")),
                if small && has_rdma {
                    ": RDMA memory registration may fail"
                } else {
                    ""
                }
            ),
            evidence: limits
                .lines()
                .filter(|l| l.starts_with("Max locked memory"))
                .map(str::to_string)
                .collect(),
            hint: if small && has_rdma {
                "run `ulimit -l unlimited`, or set `memlock unlimited` in /etc/security/limits.conf"
                    .to_string()
            } else {
                String::new()
            },
        });
    }
    findings
}

/// The soft limit of `name`: `Some(Some(n))`, `Some(None)` for unlimited, `None` when absent.
fn soft_limit(limits: &str, name: &str) -> Option<Option<u64>> {
    let line = limits.lines().find(|l| l.starts_with(name))?;
    let soft = line[name.len()..].split_whitespace().next()?;
    Some(soft.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units\n\
Max open files            1024                 1048576              files\n\
Max locked memory         8388608              8388608              bytes\n";

    #[test]
    fn low_limits_warn() {
        let findings = check(LIMITS, true);
        assert_eq!(findings[0].severity, Severity::Warn);
        assert!(findings[0].message.contains("1024"));
        assert_eq!(findings[1].severity, Severity::Warn);
        // Without RDMA a small memlock does not matter.
        assert_eq!(check(LIMITS, false)[1].severity, Severity::Ok);
    }

    #[test]
    fn unlimited_is_fine() {
        let limits = "Max open files            unlimited            unlimited            files\n";
        assert_eq!(check(limits, true)[0].severity, Severity::Ok);
    }
}
