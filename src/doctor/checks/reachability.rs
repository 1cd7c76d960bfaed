//! `reachability`: every host connects to every other on the data interface NCCL (and our
//! collectives) would use, and the peer sees the connection come from the right address.
//!
//! What it checks: for every ordered pair of hosts, a TCP connection from the row host's
//! data address to the column host's data address, one byte's round trip, and the source
//! address the column host saw; and every host connecting to a rendezvous store run on the
//! first host's data address (where rank 0's store listens).
//! Why it matters: a pair that cannot connect hangs `ncclCommInitRank` (or our rendezvous)
//! until a timeout; a connection that leaves through another NIC (Linux's weak host model
//! routes by destination, not by the bound address) works here but runs at that NIC's
//! speed, or breaks when that network is filtered.
//! How to fix: bring the data link up, open the firewall between the data addresses, or
//! route the data subnet through the data interface (`ip route`), then rerun.

use crate::doctor::evidence::{Cell, ClusterEvidence};
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "reachability";

/// One finding per failed or misrouted pair; one `ok` when every pair connects.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let Some(matrix) = &evidence.matrix else {
        return Vec::new();
    };
    let mut findings = Vec::new();
    let mut worst_us = 0;
    let interface = |index: usize| match &evidence.data {
        Ok(data) => data.get(index).map_or("?".into(), |(name, _)| name.clone()),
        Err(_) => "?".into(),
    };
    for (row, cells) in matrix.cells.iter().enumerate() {
        for (column, cell) in cells.iter().enumerate() {
            let Some(cell) = cell else { continue };
            let (from, to) = (&matrix.hosts[row], &matrix.hosts[column]);
            if let Some(error) = &cell.error {
                findings.push(Finding {
                    check: ID,
                    severity: Severity::Error,
                    host: Some(from.clone()),
                    message: format!(
                        "`{from}` cannot connect to `{to}` on the data network ({} -> {}, interface `{}`): {error}",
                        cell.from,
                        cell.to,
                        interface(row)
                    ),
                    evidence: Vec::new(),
                    hint: format!(
                        "check the link of `{}` on `{to}` and `{}` on `{from}` (`ip link`), and any firewall between {} and {}",
                        interface(column),
                        interface(row),
                        cell.from,
                        cell.to
                    ),
                });
            } else if cell.seen_as.as_deref() != Some(cell.from.as_str()) {
                findings.push(Finding {
                    check: ID,
                    severity: Severity::Error,
                    host: Some(from.clone()),
                    message: format!(
                        "`{to}` saw the connection from `{from}` come from {}, not from its data address {}: the traffic leaves through another interface",
                        cell.seen_as.as_deref().unwrap_or("an unknown address"),
                        cell.from
                    ),
                    evidence: Vec::new(),
                    hint: format!(
                        "route {} through `{}` on `{from}` (`ip route get {}` shows the path)",
                        cell.to,
                        interface(row),
                        cell.to
                    ),
                });
            } else if let Some(us) = cell.rtt_us {
                worst_us = worst_us.max(us);
            }
        }
    }
    for (row, cell) in matrix.store_cells.iter().enumerate() {
        let Some(Cell {
            error: Some(error),
            from,
            ..
        }) = cell
        else {
            continue;
        };
        let (host, first) = (&matrix.hosts[row], &matrix.hosts[0]);
        findings.push(Finding {
            check: ID,
            severity: Severity::Error,
            host: Some(host.clone()),
            message: format!(
                "`{host}` cannot reach the rendezvous port on `{first}` ({} -> {}): {error}",
                from, matrix.store
            ),
            evidence: Vec::new(),
            hint: format!(
                "ranks on `{host}` could not register with the store (`MASTER_ADDR`): check the data link and any firewall between them"
            ),
        });
    }
    if findings.is_empty() {
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "every pair of the {} hosts connects on the data network from the right address (worst RTT {worst_us} µs)",
                matrix.hosts.len()
            ),
            evidence: Vec::new(),
            hint: String::new(),
        });
    }
    findings
}
