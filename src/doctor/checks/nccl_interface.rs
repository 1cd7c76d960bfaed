//! `nccl-interface`: the network interfaces NCCL used or was told to use.
//!
//! What it checks: the interfaces of `NET/Socket : Using …` and `Bootstrap : Using …`,
//! interfaces NCCL found to be virtual (`Could not find real path of /sys/class/net/…`),
//! and `NCCL_SOCKET_IFNAME` against the hosts' interfaces and the bootstrap's failures.
//! Why it matters: NCCL spreads socket traffic over every interface it picks; a docker or
//! LXC bridge, a VPN (tailscale) or a tunnel is slow or does not reach the other hosts, and
//! a `NCCL_SOCKET_IFNAME` that matches nothing fails the bootstrap with odd errors
//! (`family 59936 is neither AF_INET nor AF_INET6`).
//! How to fix: set `NCCL_SOCKET_IFNAME` (and `GLOO_SOCKET_IFNAME`) to the physical
//! interface that carries the hosts' addresses, e.g. `NCCL_SOCKET_IFNAME==eno3`.

use crate::doctor::nccl_log::NcclLog;
use crate::doctor::{Finding, Severity, cite};
use crate::topology::Topology;
use crate::topology::sysfs::VIRTUAL_PREFIXES;

/// Id of this check.
pub(crate) const ID: &str = "nccl-interface";

/// Warns about virtual or link-local interfaces; errors on a `NCCL_SOCKET_IFNAME` that
/// names no interface.
pub(crate) fn check(log: &NcclLog, topology: Option<&Topology>) -> Vec<Finding> {
    let mut findings = Vec::new();
    let is_virtual = |name: &str| VIRTUAL_PREFIXES.iter().any(|p| name.starts_with(p));
    let physical: Option<String> = log
        .socket_interfaces
        .iter()
        .map(|(name, _)| name.clone())
        .find(|name| !is_virtual(name) && !log.virtual_interfaces.iter().any(|(v, _)| v == name))
        .or_else(|| physical_from_topology(topology));
    let fix = |physical: &Option<String>| {
        match physical {
        Some(name) => format!("set `NCCL_SOCKET_IFNAME=={name}` and `GLOO_SOCKET_IFNAME={name}` on every rank"),
        None => "set `NCCL_SOCKET_IFNAME` to the physical interface that carries the hosts' addresses (see `ip -br addr`)".to_string(),
    }
    };

    let bad: Vec<&(String, crate::doctor::nccl_log::Evidence)> = log
        .socket_interfaces
        .iter()
        .filter(|(name, evidence)| {
            is_virtual(name) || evidence.text.contains(&format!("{name}:fe80"))
        })
        .collect();
    if !bad.is_empty() {
        let names: Vec<&str> = bad.iter().map(|(n, _)| n.as_str()).collect();
        let mut evidence: Vec<String> = bad.iter().map(|(_, e)| cite(&log.origin, e)).collect();
        evidence.dedup();
        findings.push(Finding {
            check: ID,
            severity: Severity::Warn,
            host: bad[0].1.host.clone(),
            message: format!(
                "NCCL uses {} for socket traffic: bridges, VPNs, tunnels and link-local addresses are slow or do not reach other hosts",
                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            ),
            evidence,
            hint: fix(&physical),
        });
    }
    for (name, evidence) in &log.virtual_interfaces {
        findings.push(Finding {
            check: ID,
            severity: Severity::Warn,
            host: evidence.host.clone(),
            message: format!("`{name}` has no physical device (a container or virtual interface): NCCL cannot place it near a GPU"),
            evidence: vec![cite(&log.origin, evidence)],
            hint: "run the container with host networking (`--network host`) so NCCL sees the physical NICs".to_string(),
        });
    }
    for (variable, value, evidence) in log.env.iter().filter(|(v, _, _)| v == "NCCL_SOCKET_IFNAME")
    {
        let names: Vec<&str> = value
            .trim_start_matches(['^', '='])
            .split(',')
            .filter(|n| !n.is_empty())
            .collect();
        let known: Option<Vec<String>> = topology.map(|t| {
            t.hosts
                .iter()
                .flat_map(|h| h.nics.iter().filter_map(|n| n.netdev.clone()))
                .collect()
        });
        let missing_in_topology = known.as_ref().is_some_and(|known| {
            !value.starts_with('^')
                && names.iter().all(|n| {
                    !known.iter().any(|k| {
                        if value.starts_with('=') {
                            k == n
                        } else {
                            k.starts_with(n)
                        }
                    })
                })
        });
        let bootstrap_failure = log.failures.iter().find(|f| {
            let text = f.text.to_ascii_lowercase();
            text.contains("neither af_inet")
                || text.contains("no socket interface found")
                || text.contains("no usable listening interface")
        });
        if missing_in_topology || bootstrap_failure.is_some() {
            let mut cited = vec![cite(&log.origin, evidence)];
            cited.extend(bootstrap_failure.map(|f| cite(&log.origin, f)));
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: evidence.host.clone(),
                message: format!("`{variable}={value}` names no interface with an address on this host, so NCCL's bootstrap cannot open a socket"),
                evidence: cited,
                hint: fix(&physical),
            });
        }
    }
    findings
}

fn physical_from_topology(topology: Option<&Topology>) -> Option<String> {
    topology?
        .hosts
        .iter()
        .flat_map(|h| h.nics.iter())
        .find(|n| {
            !n.is_virtual
                && n.netdev.is_some()
                && n.state
                    .as_deref()
                    .is_none_or(|s| s == "up" || s == "ACTIVE")
        })
        .and_then(|n| n.netdev.clone())
}
