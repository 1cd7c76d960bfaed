//! `shm`: the size of `/dev/shm`.
//!
//! What it checks: the capacity of the tmpfs at `/dev/shm` (statvfs).
//! Why it matters: NCCL's SHM transport and its proxy buffers live in `/dev/shm`; Docker's
//! default of 64 MiB makes NCCL fail with `failed to extend /dev/shm/nccl-… to N bytes` or
//! `unhandled system error` as soon as two ranks of a node talk through it.
//! How to fix: run containers with `--ipc=host` or `--shm-size=16g`; on Kubernetes, mount an
//! `emptyDir` with `medium: Memory` at `/dev/shm`.

use crate::doctor::{Finding, Severity};

/// Id of this check.
pub(crate) const ID: &str = "shm";

/// Smallest `/dev/shm` that NCCL's guidance accepts (it recommends at least 1 GiB), bytes.
pub(crate) const MIN_SHM_BYTES: u64 = 1 << 30;

/// A finding from the capacity of `/dev/shm` in bytes (`None` when it is not mounted).
pub(crate) fn check(shm_bytes: Option<u64>) -> Finding {
    match shm_bytes {
        None => Finding {
            check: ID,
            severity: Severity::Warn,
            host: None,
            message: "`/dev/shm` is not mounted: NCCL's shared-memory transport cannot work"
                .to_string(),
            evidence: Vec::new(),
            hint: "mount a tmpfs at `/dev/shm` (`--ipc=host` for containers)".to_string(),
        },
        Some(bytes) => {
            let small = bytes < MIN_SHM_BYTES;
            Finding {
                check: ID,
                severity: if small { Severity::Warn } else { Severity::Ok },
                host: None,
                message: format!(
                    "`/dev/shm` holds {:.1} GiB{}",
                    bytes as f64 / (1u64 << 30) as f64,
                    if small {
                        ", expected at least 1 GiB for NCCL's SHM transport"
                    } else {
                        ""
                    }
                ),
                evidence: vec![format!("statvfs(/dev/shm): {bytes} bytes")],
                hint: if small {
                    "run the container with `--ipc=host` or `--shm-size=16g`".to_string()
                } else {
                    String::new()
                },
            }
        }
    }
}

/// Capacity of the filesystem at `/dev/shm` in bytes, `None` when it does not exist.
pub(crate) fn shm_capacity_bytes() -> Option<u64> {
    let stats = rustix::fs::statvfs("/dev/shm").ok()?;
    Some(stats.f_blocks * stats.f_frsize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_default_shm_warns() {
        let finding = check(Some(64 << 20));
        assert_eq!(finding.severity, Severity::Warn);
        assert!(finding.message.contains("0.1 GiB"), "{}", finding.message);
        assert_eq!(check(Some(16 << 30)).severity, Severity::Ok);
        assert_eq!(check(None).severity, Severity::Warn);
    }
}
