//! `interface`: the data interface of every host exists, is up, has an IPv4 address on a
//! network all hosts share, and has the same MTU as the others.
//!
//! What it checks: the interface chosen for each host (the inventory's
//! `nccl-socket-ifname`, else the network every host has an address in that is not the
//! SSH one), its state, and the MTU across hosts.
//! Why it matters: NCCL and our collectives bind to that interface: a missing or down one
//! fails at start-up, a host on another subnet cannot be reached, and an MTU mismatch
//! passes small messages but hangs large transfers (frames dropped on the smaller side).
//! How to fix: name the right interface per host with `nccl-socket-ifname`, bring it up,
//! put every host's data address on one subnet, set one MTU (`ip link set dev X mtu N`).

use crate::doctor::evidence::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "interface";

/// Findings for the data interfaces of `evidence`'s hosts.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let mut findings = partial_networks(evidence);
    let problems = !findings.is_empty();
    findings.extend(
        chosen(evidence)
            .into_iter()
            .filter(|f| !problems || f.severity != Severity::Ok),
    );
    findings
}

/// `(network, prefix)` of an `a.b.c.d/nn` address.
fn network(cidr: &str) -> Option<(u32, u8)> {
    let (ip, prefix) = cidr.split_once('/')?;
    let ip: std::net::Ipv4Addr = ip.parse().ok()?;
    let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32)?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    Some((u32::from(ip) & mask, prefix))
}

/// A network that several hosts share on a non-management interface but some host lacks:
/// that host's data address is elsewhere (another subnet, a typo), so the collectives of
/// the whole cluster would fall back to the network all hosts share, or fail.
fn partial_networks(evidence: &ClusterEvidence) -> Vec<Finding> {
    let n = evidence.hosts.len();
    if n < 2 {
        return Vec::new();
    }
    let management: Vec<(u32, u8)> = evidence
        .hosts
        .iter()
        .flat_map(|h| {
            h.interfaces
                .iter()
                .flat_map(|i| i.ipv4.iter())
                .filter(|cidr| cidr.split('/').next() == Some(h.ssh_address.as_str()))
                .filter_map(|cidr| network(cidr))
        })
        .collect();
    let per_host: Vec<Vec<(u32, u8)>> = evidence
        .hosts
        .iter()
        .map(|h| {
            h.interfaces
                .iter()
                .filter(|i| i.name != "lo")
                .flat_map(|i| i.ipv4.iter())
                .filter_map(|cidr| network(cidr))
                .filter(|net| !management.contains(net) && !net.0.to_be_bytes().starts_with(&[127]))
                .collect()
        })
        .collect();
    let mut networks: Vec<(u32, u8)> = per_host.iter().flatten().copied().collect();
    networks.sort_unstable();
    networks.dedup();
    let mut findings = Vec::new();
    for net in networks {
        let having: Vec<usize> = (0..n).filter(|h| per_host[*h].contains(&net)).collect();
        if having.len() < 2 || having.len() == n {
            continue;
        }
        let shown = format!("{}/{}", std::net::Ipv4Addr::from(net.0), net.1);
        for (index, host) in evidence.hosts.iter().enumerate() {
            if having.contains(&index) {
                continue;
            }
            let has: Vec<String> = host
                .interfaces
                .iter()
                .filter(|i| i.name != "lo")
                .map(|i| format!("{} {}", i.name, i.ipv4.join(" ")))
                .collect();
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.name.clone()),
                message: format!(
                    "no address on {shown}, the data network of {}: its data interface is elsewhere",
                    having
                        .iter()
                        .map(|h| format!("`{}`", evidence.hosts[*h].name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                evidence: vec![format!("{}: {}", host.name, has.join(", "))],
                hint: format!(
                    "give `{}` an address on {shown} (or fix the address of its data interface)",
                    host.name
                ),
            });
        }
    }
    findings
}

/// The chosen data interfaces: up, same MTU.
fn chosen(evidence: &ClusterEvidence) -> Vec<Finding> {
    let data = match &evidence.data {
        Ok(data) => data,
        Err(error) => {
            return vec![Finding {
                check: ID,
                severity: Severity::Error,
                host: None,
                message: error.clone(),
                evidence: evidence
                    .hosts
                    .iter()
                    .map(|h| {
                        let addresses: Vec<String> = h
                            .interfaces
                            .iter()
                            .filter(|i| i.name != "lo")
                            .map(|i| format!("{} {}", i.name, i.ipv4.join(" ")))
                            .collect();
                        format!("{}: {}", h.name, addresses.join(", "))
                    })
                    .collect(),
                hint: "put every host's data address on one subnet, or name each host's data interface with `nccl-socket-ifname` in the inventory".into(),
            }];
        }
    };
    let mut findings = Vec::new();
    let mut mtus: Vec<(String, u32)> = Vec::new();
    for (host, (name, address)) in evidence.hosts.iter().zip(data) {
        let Some(interface) = host.interfaces.iter().find(|i| &i.name == name) else {
            continue;
        };
        if !interface.up {
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.name.clone()),
                message: format!("data interface `{name}` is down"),
                evidence: Vec::new(),
                hint: format!("`ip link set dev {name} up` on `{}`", host.name),
            });
        }
        if let Some(mtu) = interface.mtu_bytes {
            mtus.push((host.name.clone(), mtu));
        }
        let _ = address;
    }
    let mut distinct: Vec<u32> = mtus.iter().map(|(_, m)| *m).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() > 1 {
        let largest = distinct[distinct.len() - 1];
        for (host, mtu) in mtus.iter().filter(|(_, m)| *m != largest) {
            let (name, _) = &data[evidence
                .hosts
                .iter()
                .position(|h| &h.name == host)
                .unwrap_or(0)];
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.clone()),
                message: format!(
                    "MTU {mtu} on `{name}` differs from the other hosts' {largest}: large transfers hang"
                ),
                evidence: mtus.iter().map(|(h, m)| format!("{h}: mtu {m}")).collect(),
                hint: format!("`ip link set dev {name} mtu {largest}` on `{host}` (and on its switch port)"),
            });
        }
    }
    if findings.is_empty() {
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "data interfaces {} are up, on one network, MTU {}",
                evidence
                    .hosts
                    .iter()
                    .zip(data)
                    .map(|(h, (name, address))| format!("{}:{name} ({address})", h.name))
                    .collect::<Vec<_>>()
                    .join(", "),
                distinct.first().map_or("unknown".into(), u32::to_string)
            ),
            evidence: Vec::new(),
            hint: String::new(),
        });
    }
    findings
}
