//! `nccl-tcp-fallback`: NCCL carrying inter-node traffic over TCP sockets.
//!
//! What it checks: connections `via NET/Socket`, or `Using network Socket`.
//! Why it matters: NET/Socket moves every byte through the kernel TCP stack: on a cluster
//! with InfiniBand/RoCE it is 5–20× slower than NET/IB and dominates a TP/PP step.
//! How to fix: make the verbs library and devices visible to NCCL: install `libibverbs1`
//! (rdma-core), pass `/dev/infiniband` into the container (`--device /dev/infiniband`,
//! `--cap-add IPC_LOCK`), and unset `NCCL_IB_DISABLE`. On cloud VMs without RDMA, use the
//! provider's plugin (AWS EFA, GCP gIB/TCPXO) or accept TCP.

use crate::doctor::nccl_log::{NcclLog, Transport};
use crate::doctor::{Finding, Severity, cite};
use crate::topology::{NicKind, Topology};

/// Id of this check.
pub(crate) const ID: &str = "nccl-tcp-fallback";

/// Error when sockets carry traffic and nothing shows the hosts lack RDMA (or something
/// shows they have it); warn when NCCL reported no IB device and nothing contradicts it.
pub(crate) fn check(log: &NcclLog, topology: Option<&Topology>) -> Vec<Finding> {
    let socket_channel = log
        .connections
        .iter()
        .find(|c| c.transport == Transport::Socket);
    let socket_network = log.network.as_ref().filter(|(name, _)| name == "Socket");
    // `NET/IB : No device found` then `NET/Socket : Using …`: the socket transport is the
    // only network NCCL has, even in an excerpt without per-channel lines.
    let socket_only = log
        .net_socket
        .as_ref()
        .filter(|_| log.ib_not_found.is_some() && log.ib_devices.is_empty());
    if socket_channel.is_none() && socket_network.is_none() && socket_only.is_none() {
        return Vec::new();
    }
    let mut evidence: Vec<String> = socket_channel
        .map(|c| &c.evidence)
        .into_iter()
        .chain(socket_network.map(|(_, e)| e))
        .chain(socket_only)
        .map(|e| cite(&log.origin, e))
        .collect();
    let rdma = rdma_evidence(log, topology);
    let no_device = log.ib_not_found.as_ref();
    let cause = fix_hint(log, !rdma.is_empty());
    let (severity, message) = if !rdma.is_empty() {
        (
            Severity::Error,
            "NCCL uses TCP sockets (NET/Socket) although the hosts have InfiniBand/RoCE",
        )
    } else if let (true, Some(no_device)) =
        (socket_channel.is_some() || socket_only.is_some(), no_device)
    {
        evidence.push(cite(&log.origin, no_device));
        (
            Severity::Warn,
            "NCCL carries inter-node traffic over TCP sockets: it found no RDMA device",
        )
    } else if socket_channel.is_some() {
        (
            Severity::Error,
            "NCCL carries inter-node traffic over TCP sockets (NET/Socket), not InfiniBand/RoCE",
        )
    } else {
        if let Some(no_device) = no_device {
            evidence.push(cite(&log.origin, no_device));
        }
        (
            Severity::Warn,
            "NCCL selected TCP sockets as its network transport: if the job spans hosts, inter-node collectives run over TCP",
        )
    };
    evidence.extend(rdma);
    vec![Finding {
        check: ID,
        severity,
        host: socket_channel
            .and_then(|c| c.evidence.host.clone())
            .or_else(|| socket_network.and_then(|(_, e)| e.host.clone())),
        message: message.to_string(),
        evidence,
        hint: cause.to_string(),
    }]
}

/// Evidence that the hosts have RDMA hardware or software: IB library hints, HCAs NCCL
/// listed, `ib*` socket interfaces, and the topology's IB/RoCE NICs.
fn rdma_evidence(log: &NcclLog, topology: Option<&Topology>) -> Vec<String> {
    let mut rdma = Vec::new();
    rdma.extend(log.ib_hints.iter().map(|e| cite(&log.origin, e)));
    // HCAs NCCL listed earlier in the same log.
    rdma.extend(log.ib_devices.iter().map(|(_, e)| cite(&log.origin, e)));
    rdma.extend(
        log.socket_interfaces
            .iter()
            .filter(|(name, _)| name.starts_with("ib"))
            .map(|(_, e)| cite(&log.origin, e)),
    );
    if let Some(topology) = topology {
        for host in &topology.hosts {
            for nic in host
                .nics
                .iter()
                .filter(|n| matches!(n.kind, NicKind::Ib | NicKind::Roce))
            {
                rdma.push(format!(
                    "topology: host `{}` has HCA `{}` ({:?}, {})",
                    host.hostname,
                    nic.name,
                    nic.kind,
                    nic.state.as_deref().unwrap_or("state unknown")
                ));
            }
        }
    }
    rdma
}

/// How to get NCCL off TCP, by the most specific cause the log shows: `NCCL_IB_DISABLE=1`,
/// libibverbs missing, no RDMA device (`rdma_found`: other evidence shows RDMA hardware or
/// software), or IB simply not used.
fn fix_hint(log: &NcclLog, rdma_found: bool) -> &'static str {
    let no_device = log.ib_not_found.as_ref();
    if log
        .env
        .iter()
        .any(|(name, value, _)| name == "NCCL_IB_DISABLE" && value == "1")
    {
        "`NCCL_IB_DISABLE=1` is set: unset it"
    } else if log
        .ib_hints
        .iter()
        .any(|e| e.text.to_ascii_lowercase().contains("libibverbs"))
    {
        "NCCL could not load libibverbs: install `rdma-core`/`libibverbs1` in the image"
    } else if no_device.is_some() && !rdma_found {
        "NCCL found no RDMA device: on bare metal install the HCA driver (MLNX_OFED / rdma-core) and pass \
         `/dev/infiniband` into the container (`--device /dev/infiniband --cap-add IPC_LOCK`); on AWS use EFA \
         with the aws-ofi-nccl plugin (`FI_PROVIDER=efa`); on GCP, gIB or TCPXO; otherwise inter-node traffic stays on TCP"
    } else if no_device.is_some() {
        "NCCL found no IB device: pass `/dev/infiniband` into the container (`--device /dev/infiniband --cap-add IPC_LOCK`) \
         or install the HCA driver (MLNX_OFED / rdma-core)"
    } else {
        "NCCL did not use IB: check that `/dev/infiniband` exists in the container, libibverbs is installed, and \
         `NCCL_IB_DISABLE` is unset; `NCCL_DEBUG_SUBSYS=INIT,NET` shows why"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::nccl_log::parse;

    fn findings(text: &str) -> Vec<Finding> {
        check(&parse(text, "node0.log"), None)
    }

    /// See: #19. Sockets over an IPoIB interface, or after NCCL listed HCAs, or with
    /// libibverbs failing to load: RDMA is there, so the fallback is an error.
    #[test]
    fn sockets_with_rdma_in_evidence_are_an_error() {
        for log in [
            "node0:1:1 [0] NCCL INFO NET/IB : No device found.\n\
             node0:1:1 [0] NCCL INFO NET/Socket : Using [0]ibp12s0:10.0.0.1<0>\n",
            "node0:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.1<0>\n\
             node0:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n",
            "node0:1:1 [0] NCCL INFO Failed to open libibverbs.so[.1]\n\
             node0:1:1 [0] NCCL INFO NET/IB : No device found.\n\
             node0:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n",
        ] {
            let found = findings(log);
            assert_eq!(found.len(), 1, "{log}: {found:?}");
            assert_eq!(found[0].severity, Severity::Error, "{log}: {found:?}");
        }
    }

    /// See: #19. No IB device and the socket transport, with no per-channel lines (cloud
    /// instances without EFA/RDMA): a warning whose hint names what the platform needs.
    #[test]
    fn no_ib_device_then_sockets_warns_without_channel_lines() {
        let found = findings(
            "ip-10-0-0-1:9:9 [0] NCCL INFO NET/IB : No device found.\n\
             ip-10-0-0-1:9:9 [0] NCCL INFO NET/Socket : Using [0]ens5:10.0.0.1<0>\n",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].severity, Severity::Warn);
        assert!(
            found[0].hint.contains("aws-ofi-nccl") && found[0].hint.contains("EFA"),
            "{}",
            found[0].hint
        );
        assert!(
            found[0]
                .evidence
                .iter()
                .any(|e| e.contains("NET/Socket : Using")),
            "{:?}",
            found[0].evidence
        );
        // With IB devices in use, the socket transport's init line alone is no fallback.
        let healthy = findings(
            "n:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.1<0>\n\
             n:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n",
        );
        assert!(healthy.is_empty(), "{healthy:?}");
    }
}
