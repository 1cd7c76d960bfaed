//! `tp-not-nvlink`: tensor parallelism over GPUs that are not all NVLinked.
//!
//! What it checks: for each host of a topology, whether TP over all its GPUs (what vLLM's
//! `--tensor-parallel-size <all GPUs>` does) has pairs without NVLink, and which groups
//! would be better.
//! Why it matters: a TP all-reduce runs at the pace of its slowest pair; over PCIe it is
//! ~10× slower than NVLink, and across sockets (`SYS`) slower still. vLLM's custom
//! all-reduce also needs all-to-all NVLink for more than two GPUs.
//! How to fix: keep TP inside an NVLink domain (or a PCIe switch) and use PP or DP for the
//! rest: `infer plan --cluster <inventory>` places the groups.

use crate::doctor::{Finding, Severity};
use crate::plan::Plan;
use crate::topology::render::gpu_set;
use crate::topology::{Host, LinkCode, Topology};

/// Id of this check.
pub(crate) const ID: &str = "tp-not-nvlink";

/// One finding per host with at least two GPUs.
pub(crate) fn check(host: &Host) -> Option<Finding> {
    let n = host.gpus.len();
    if n < 2 {
        return None;
    }
    // The farthest pair; among equals, the one with the lowest indices.
    let worst = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .max_by(|&a, &b| {
            host.gpu_links[a.0][a.1]
                .cmp(&host.gpu_links[b.0][b.1])
                .then(b.cmp(&a))
        })
        .expect("at least two GPUs");
    let worst_code = host.gpu_links[worst.0][worst.1];
    if worst_code.is_nvlink() {
        return Some(Finding {
            check: ID,
            severity: Severity::Ok,
            host: Some(host.hostname.clone()),
            message: format!(
                "all {n} GPUs are NVLinked to each other: TP up to {n} stays on NVLink"
            ),
            evidence: vec![format!("GPU{}–GPU{}: {worst_code}", worst.0, worst.1)],
            hint: String::new(),
        });
    }
    let domains: Vec<&Vec<usize>> = host.nvlink_domains.iter().filter(|d| d.len() > 1).collect();
    let advice = if let Some(largest) = domains.iter().map(|d| d.len()).max() {
        let groups: Vec<String> = domains
            .iter()
            .filter(|d| d.len() == largest)
            .map(|d| format!("{{{}}}", gpu_set(d)))
            .collect();
        format!(
            "use TP={largest} inside the NVLink domains {} and PP or DP across them",
            groups.join(" ")
        )
    } else {
        pcie_advice(host)
    };
    Some(Finding {
        check: ID,
        severity: Severity::Warn,
        host: Some(host.hostname.clone()),
        message: format!(
            "TP={n} over all GPUs is not all-to-all NVLink: its all-reduce crosses {worst_code} (e.g. GPU{}–GPU{})",
            worst.0, worst.1
        ),
        evidence: vec![format!("GPU{}–GPU{}: {worst_code}", worst.0, worst.1)],
        hint: advice,
    })
}

/// The plan's TP groups on the hosts of `topology` (matched by host name; a topology of
/// one host applies to every host): a warning per group with a non-NVLink pair.
pub(crate) fn check_plan(plan: &Plan, topology: &Topology) -> Vec<Finding> {
    let host_of = |name: &str| -> Option<&Host> {
        topology
            .hosts
            .iter()
            .find(|h| h.hostname == name)
            .or(if topology.hosts.len() == 1 {
                topology.hosts.first()
            } else {
                None
            })
    };
    let mut findings = Vec::new();
    for group in &plan.groups.tp {
        let ranks: Vec<_> = group
            .iter()
            .filter_map(|&r| plan.ranks.get(r as usize))
            .collect();
        let Some(first) = ranks.first() else { continue };
        if ranks.iter().any(|r| r.host != first.host) {
            continue; // cross-node-tp reports these.
        }
        let Some(host) = host_of(&first.host) else {
            continue;
        };
        let worst = ranks
            .iter()
            .flat_map(|a| ranks.iter().map(move |b| (a.gpu, b.gpu)))
            .filter(|&(a, b)| a != b && a < host.gpus.len() && b < host.gpus.len())
            .max_by(|&a, &b| {
                host.gpu_links[a.0][a.1]
                    .cmp(&host.gpu_links[b.0][b.1])
                    .then(b.cmp(&a))
            });
        if let Some((a, b)) = worst.filter(|&(a, b)| !host.gpu_links[a][b].is_nvlink()) {
            let gpus: Vec<usize> = ranks.iter().map(|r| r.gpu).collect();
            findings.push(Finding {
                check: ID,
                severity: Severity::Warn,
                host: Some(first.host.clone()),
                message: format!("TP group {group:?} on GPUs {gpus:?} is not all NVLinked: its all-reduce crosses {}", host.gpu_links[a][b]),
                evidence: vec![format!("GPU{a}–GPU{b}: {}", host.gpu_links[a][b])],
                hint: "re-plan with the host's topology (`infer plan --cluster <inventory with topology>`) to keep TP inside NVLink domains".to_string(),
            });
        }
    }
    findings
}

/// Without NVLink: the closest pairs, and the largest TP whose index-contiguous groups avoid `SYS`.
fn pcie_advice(host: &Host) -> String {
    let n = host.gpus.len();
    let best_code = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .map(|(i, j)| host.gpu_links[i][j])
        .min()
        .expect("two GPUs");
    let mut used = vec![false; n];
    let mut pairs = Vec::new();
    for i in 0..n {
        for j in i + 1..n {
            if !used[i] && !used[j] && host.gpu_links[i][j] == best_code {
                used[i] = true;
                used[j] = true;
                pairs.push(format!("{{{i},{j}}}"));
            }
        }
    }
    let largest_without_sys = (2..=n)
        .filter(|size| n.is_multiple_of(*size))
        .filter(|&size| {
            (0..n / size).all(|g| {
                let group: Vec<usize> = (g * size..(g + 1) * size).collect();
                group
                    .iter()
                    .all(|&a| group.iter().all(|&b| host.gpu_links[a][b] != LinkCode::Sys))
            })
        })
        .max();
    let mut advice = format!(
        "no NVLink: the closest pairs are {} ({best_code}); prefer TP=2 on them",
        pairs.join(" ")
    );
    if let Some(size) = largest_without_sys.filter(|&s| s > 2) {
        let groups: Vec<String> = (0..n / size)
            .map(|g| format!("{{{}-{}}}", g * size, (g + 1) * size - 1))
            .collect();
        advice.push_str(&format!(
            ", or TP={size} within {} (no SYS pair)",
            groups.join(" ")
        ));
    }
    advice.push_str("; use PP or DP across the rest");
    advice
}
