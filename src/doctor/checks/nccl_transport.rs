//! `nccl-transport`: which transport each NCCL connection took.
//!
//! What it checks: every `Channel …/Ring … via X` line, grouped by transport (P2P/IPC,
//! P2P/CUMEM, SHM, NET/Socket, NET/IB with or without GDRDMA, net plugins).
//! Why it matters: inside a node NCCL should use P2P (NVLink or PCIe peer access); SHM
//! bounces every byte through host memory. Between nodes it should use NET/IB, ideally
//! with GPUDirect RDMA.
//! How to fix: SHM inside a node usually means each rank sees only its own GPU or P2P is
//! off (`NCCL_P2P_DISABLE`, containers without IPC): make the node's GPUs visible to every
//! rank and run the container with `--ipc=host`.

use std::collections::BTreeMap;

use crate::doctor::nccl_log::{NcclLog, Transport};
use crate::doctor::{Finding, Severity, cite};

/// Id of this check.
pub(crate) const ID: &str = "nccl-transport";

/// One `ok` finding summarising transports, plus a `warn` when SHM carries intra-node traffic.
pub(crate) fn check(log: &NcclLog) -> Vec<Finding> {
    let mut findings = Vec::new();
    findings.extend(network_finding(log));
    if log.connections.is_empty() {
        return findings;
    }
    findings.push(summary_finding(log));
    findings.extend(shm_finding(log));
    findings
}

/// The `ok` finding naming the network NCCL chose (not sockets), with its HCA ports,
/// RoCE and PCIe relaxed ordering; `None` without one.
fn network_finding(log: &NcclLog) -> Option<Finding> {
    let (network, evidence) = log.network.as_ref()?;
    if network == "Socket" {
        return None;
    }
    let ports: Vec<&str> = log.ib_devices.iter().map(|(d, _)| d.as_str()).collect();
    let mut ports_unique = ports.clone();
    ports_unique.sort();
    ports_unique.dedup();
    let roce = ports_unique.iter().any(|p| p.ends_with("/RoCE"));
    let relaxed = log.ib_devices.iter().any(|(_, e)| e.text.contains("[RO]"));
    let mut cited = vec![cite(&log.origin, evidence)];
    cited.extend(log.ib_devices.first().map(|(_, e)| cite(&log.origin, e)));
    Some(Finding {
        check: ID,
        severity: Severity::Ok,
        host: evidence.host.clone(),
        message: format!(
            "NCCL network: {network}{}{}{}",
            if ports_unique.is_empty() {
                String::new()
            } else {
                format!(
                    " over {} HCA port(s) {}",
                    ports_unique.len(),
                    ports_unique.join(" ")
                )
            },
            if roce { " (RoCE)" } else { "" },
            if relaxed {
                ", PCIe relaxed ordering on"
            } else {
                ""
            }
        ),
        evidence: cited,
        hint: String::new(),
    })
}

/// The `ok` finding counting connections per transport, citing the first of each.
fn summary_finding(log: &NcclLog) -> Finding {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for connection in &log.connections {
        *counts.entry(name(&connection.transport)).or_default() += 1;
    }
    let summary: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{name} ×{n}"))
        .collect();
    Finding {
        check: ID,
        severity: Severity::Ok,
        host: None,
        message: format!(
            "{} connections in `{}`: {}",
            log.connections.len(),
            log.origin,
            summary.join(", ")
        ),
        evidence: log
            .connections
            .iter()
            .fold(Vec::<&Transport>::new(), |mut seen, c| {
                if !seen.contains(&&c.transport) {
                    seen.push(&c.transport);
                }
                seen
            })
            .iter()
            .filter_map(|t| log.connections.iter().find(|c| &c.transport == *t))
            .map(|c| cite(&log.origin, &c.evidence))
            .collect(),
        hint: String::new(),
    }
}

/// The `warn` finding when SHM carries intra-node traffic (and why, when a rank sees only
/// its own GPU); `None` otherwise.
fn shm_finding(log: &NcclLog) -> Option<Finding> {
    let shm = log
        .connections
        .iter()
        .find(|c| c.transport == Transport::Shm)?;
    let mut evidence = vec![cite(&log.origin, &shm.evidence)];
    let mut message =
        "intra-node traffic goes through host shared memory (SHM), not GPU peer-to-peer"
            .to_string();
    if let Some(single) = &log.single_visible_device {
        evidence.push(cite(&log.origin, single));
        message.push_str(": each rank sees only its own GPU (per-rank CUDA_VISIBLE_DEVICES)");
    }
    Some(Finding {
        check: ID,
        severity: Severity::Warn,
        host: shm.evidence.host.clone(),
        message,
        evidence,
        hint: "make every GPU of the node visible to each rank (select the device by LOCAL_RANK instead of \
               CUDA_VISIBLE_DEVICES), run containers with `--ipc=host`, and leave `NCCL_P2P_DISABLE` unset"
            .to_string(),
    })
}

/// Display name of a transport.
pub(crate) fn name(transport: &Transport) -> String {
    match transport {
        Transport::P2p(via) => via.split('/').take(2).collect::<Vec<_>>().join("/"),
        Transport::Shm => "SHM".to_string(),
        Transport::Socket => "NET/Socket".to_string(),
        Transport::Ib { gdr: true } => "NET/IB/GDRDMA".to_string(),
        Transport::Ib { gdr: false } => "NET/IB".to_string(),
        Transport::Plugin(name) => format!("NET/{name}"),
    }
}
