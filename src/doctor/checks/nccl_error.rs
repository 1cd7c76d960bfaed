//! `nccl-error`: each NCCL failure classified with its likely cause.
//!
//! What it checks: `NCCL WARN` lines, `ncclInternalError`/`ncclSystemError` reports and
//! their `Last error`, bootstrap and transport failures.
//! Why it matters: NCCL's messages name the syscall that failed, not the mistake that made
//! it fail; the same few mistakes cause most of them.
//! How to fix: per cause, in each finding's hint.

use crate::doctor::nccl_log::{Evidence, NcclLog};
use crate::doctor::{Finding, Severity, cite};

/// Id of this check.
pub(crate) const ID: &str = "nccl-error";

/// Known causes: a needle in the lowercased line, the diagnosis, the fix.
const CAUSES: &[(&[&str], &str, &str)] = &[
    (
        &["connection refused"],
        "a peer refused the connection: it is not listening (crashed or not started), a firewall blocks the port, or the rendezvous address is stale",
        "check that every rank runs, that `MASTER_ADDR`/`MASTER_PORT` point at rank 0's host, and that the hosts reach each other on all ports (firewall)",
    ),
    (
        &[
            "neither af_inet",
            "no socket interface found",
            "no usable listening interface",
            "bootstrap : no socket interface",
        ],
        "NCCL found no usable socket interface: `NCCL_SOCKET_IFNAME` matches no interface with an address",
        "set `NCCL_SOCKET_IFNAME` to an interface that exists on every host (`ip -br addr`), or unset it",
    ),
    (
        &["ibv_modify_qp", "network is unreachable"],
        "an RDMA queue pair could not connect: on RoCE this is usually the wrong GID index or no IP route between the HCAs",
        "set `NCCL_IB_GID_INDEX` to the RoCE v2 IPv4 entry (`show_gids`; often 3) and check that the HCAs' netdevs route to each other",
    ),
    (
        &[
            "duplicate gpu",
            "duplicate rank",
            "same cuda device",
            "rank mismatch",
        ],
        "two processes claimed the same GPU or rank: the launcher gave them the same `RANK`/`LOCAL_RANK` or `CUDA_VISIBLE_DEVICES`",
        "give every process a distinct `RANK` and GPU (`infer plan` prints them); do not start the same job twice",
    ),
    (
        &["libibverbs"],
        "NCCL could not load the verbs library, so InfiniBand/RoCE is unusable",
        "install `libibverbs1`/`rdma-core` in the image and mount `/dev/infiniband`",
    ),
    (
        &["timeout", "timed out"],
        "a collective or connection timed out: a rank hung or died, or the network dropped",
        "look for a rank that exited first (its log), then check the links between the hosts",
    ),
];

/// One finding per cause seen, with every line that shows it.
pub(crate) fn check(log: &NcclLog) -> Vec<Finding> {
    let mut findings: Vec<Finding> = Vec::new();
    let mut unexplained: Vec<&Evidence> = Vec::new();
    for failure in &log.failures {
        let text = failure.text.to_ascii_lowercase();
        match CAUSES
            .iter()
            .find(|(needles, _, _)| needles.iter().any(|n| text.contains(n)))
        {
            Some((_, message, hint)) => match findings.iter_mut().find(|f| f.message == *message) {
                Some(finding) => finding.evidence.push(cite(&log.origin, failure)),
                None => findings.push(Finding {
                    check: ID,
                    severity: Severity::Error,
                    host: failure.host.clone(),
                    message: message.to_string(),
                    evidence: vec![cite(&log.origin, failure)],
                    hint: hint.to_string(),
                }),
            },
            None => unexplained.push(failure),
        }
    }
    // Context lines (`ncclInternalError: Internal check failed.`, `Last error:`) belong to
    // the classified failure they precede; alone, they are an unclassified error.
    if findings.is_empty() && !unexplained.is_empty() {
        findings.push(Finding {
            check: ID,
            severity: Severity::Error,
            host: unexplained[0].host.clone(),
            message: "NCCL reported an error this check does not recognise".to_string(),
            evidence: unexplained.iter().map(|e| cite(&log.origin, e)).collect(),
            hint: "rerun with `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET` and read the first WARN line".to_string(),
        });
    } else if let Some(first) = findings.first_mut() {
        first
            .evidence
            .extend(unexplained.iter().map(|e| cite(&log.origin, e)));
    }
    findings
}
