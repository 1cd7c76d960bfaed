//! `nccl-env`: NCCL variables in this host's environment that point at nothing.
//!
//! What it checks: `NCCL_SOCKET_IFNAME` against the host's interfaces, `NCCL_IB_HCA` against
//! its HCAs, and `NCCL_IB_DISABLE=1` while active HCAs exist.
//! Why it matters: a name that matches nothing fails NCCL's bootstrap or silently drops
//! RDMA; `NCCL_IB_DISABLE=1` left from debugging forces TCP.
//! How to fix: correct or unset the variable; `infer plan` prints the values per host.

use std::collections::BTreeMap;

use crate::doctor::{Finding, Severity};
use crate::topology::{Host, NicKind};

/// Id of this check.
pub(crate) const ID: &str = "nccl-env";

/// Findings for each NCCL variable set in `env` that does not fit `host`.
pub(crate) fn check(host: &Host, env: &BTreeMap<String, String>) -> Vec<Finding> {
    let mut findings = Vec::new();
    let netdevs: Vec<&str> = host
        .nics
        .iter()
        .filter_map(|n| n.netdev.as_deref())
        .collect();
    let hcas: Vec<&str> = host
        .nics
        .iter()
        .filter(|n| matches!(n.kind, NicKind::Ib | NicKind::Roce) && !n.ports.is_empty())
        .map(|n| n.name.as_str())
        .collect();
    let physical = host
        .nics
        .iter()
        .find(|n| !n.is_virtual && n.state.as_deref() == Some("up"))
        .and_then(|n| n.netdev.clone());
    // NCCL's list syntax: `^` excludes, `=` matches exactly, otherwise a prefix matches.
    let matches = |value: &str, names: &[&str]| -> bool {
        if value.starts_with('^') {
            return true;
        }
        let exact = value.starts_with('=');
        value
            .trim_start_matches('=')
            .split(',')
            .map(|item| item.split(':').next().unwrap_or(item))
            .any(|wanted| {
                names.iter().any(|name| {
                    if exact {
                        *name == wanted
                    } else {
                        name.starts_with(wanted)
                    }
                })
            })
    };
    if let Some(value) = env.get("NCCL_SOCKET_IFNAME")
        && !matches(value, &netdevs)
    {
        findings.push(Finding {
            check: ID,
            severity: Severity::Error,
            host: Some(host.hostname.clone()),
            message: format!(
                "`NCCL_SOCKET_IFNAME={value}` matches none of this host's interfaces ({})",
                netdevs.join(", ")
            ),
            evidence: vec![format!("NCCL_SOCKET_IFNAME={value}")],
            hint: match &physical {
                Some(name) => format!("set `NCCL_SOCKET_IFNAME=={name}`, or unset it"),
                None => "set it to an existing interface (`ip -br addr`), or unset it".to_string(),
            },
        });
    }
    if let Some(value) = env.get("NCCL_IB_HCA")
        && !matches(value, &hcas)
    {
        findings.push(Finding {
            check: ID,
            severity: Severity::Error,
            host: Some(host.hostname.clone()),
            message: format!(
                "`NCCL_IB_HCA={value}` matches none of this host's HCAs ({}): NCCL will not use RDMA",
                if hcas.is_empty() { "none".to_string() } else { hcas.join(", ") }
            ),
            evidence: vec![format!("NCCL_IB_HCA={value}")],
            hint: if hcas.is_empty() { "unset `NCCL_IB_HCA`: this host has no HCA".to_string() } else { format!("set `NCCL_IB_HCA=={}`", hcas.join(",")) },
        });
    }
    let active = host
        .nics
        .iter()
        .filter(|n| {
            matches!(n.kind, NicKind::Ib | NicKind::Roce) && n.state.as_deref() == Some("ACTIVE")
        })
        .count();
    if env.get("NCCL_IB_DISABLE").map(String::as_str) == Some("1") && active > 0 {
        findings.push(Finding {
            check: ID,
            severity: Severity::Warn,
            host: Some(host.hostname.clone()),
            message: format!("`NCCL_IB_DISABLE=1` while {active} HCA(s) are ACTIVE: NCCL will use TCP sockets between hosts"),
            evidence: vec!["NCCL_IB_DISABLE=1".to_string()],
            hint: "unset `NCCL_IB_DISABLE`".to_string(),
        });
    }
    findings
}
