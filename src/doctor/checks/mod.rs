//! Every check of `infer doctor`, one file each, named after its stable id.

pub(crate) mod bandwidth;
pub(crate) mod clock_skew;
pub(crate) mod cross_node_tp;
pub(crate) mod engine;
pub(crate) mod ep_cross_node;
pub(crate) mod gpu_nic_affinity;
pub(crate) mod ib_port;
pub(crate) mod interface;
pub(crate) mod limits;
pub(crate) mod nccl_env;
pub(crate) mod nccl_error;
pub(crate) mod nccl_hca;
pub(crate) mod nccl_interface;
pub(crate) mod nccl_output;
pub(crate) mod nccl_tcp_fallback;
pub(crate) mod nccl_transport;
pub(crate) mod nccl_version;
pub(crate) mod nvlink_down;
pub(crate) mod nvml;
pub(crate) mod p2p;
pub(crate) mod pp_bubble;
pub(crate) mod rdma;
pub(crate) mod reachability;
pub(crate) mod run_outcome;
pub(crate) mod shm;
pub(crate) mod tp_not_nvlink;
pub(crate) mod versions;

use super::Finding;
use super::nccl_log::NcclLog;
use crate::topology::Topology;

/// Runs every NCCL-log check over `logs` (one per node or rank). `topology`, when given, is
/// the hosts' recorded topology: it adds evidence (HCAs present, interface names).
pub fn nccl_logs(logs: &[NcclLog], topology: Option<&Topology>) -> Vec<Finding> {
    let mut findings = nccl_output::check(logs);
    for log in logs {
        findings.extend(nccl_transport::check(log));
        findings.extend(nccl_tcp_fallback::check(log, topology));
        findings.extend(nccl_interface::check(log, topology));
        findings.extend(nccl_error::check(log));
    }
    findings.extend(nccl_version::check(logs));
    findings.extend(nccl_hca::check(logs));
    findings
}

/// Checks of recorded topologies: TP over non-NVLink pairs, NVLinks down (probed JSON),
/// missing P2P, GPUs far from NICs.
pub fn topology(topology: &Topology) -> Vec<Finding> {
    let mut findings = Vec::new();
    for host in &topology.hosts {
        findings.extend(tp_not_nvlink::check(host));
        findings.extend(nvlink_down::check(host));
        findings.extend(p2p::check(host));
        findings.extend(gpu_nic_affinity::check(host));
    }
    findings
}

/// The cross-host checks of `infer doctor --cluster`, then every host's own live findings
/// and a finding per host that could not be reached.
pub fn cluster(evidence: &crate::doctor::evidence::ClusterEvidence) -> Vec<Finding> {
    let mut findings: Vec<Finding> = evidence
        .unreachable
        .iter()
        .map(|(host, stage, message)| Finding {
            check: "ssh",
            severity: super::Severity::Error,
            host: Some(host.clone()),
            message: format!("cannot reach `{host}` ({stage}): {message}"),
            evidence: Vec::new(),
            hint: format!("check `{host}` with `ssh` as the inventory describes it"),
        })
        .collect();
    for host in &evidence.hosts {
        findings.extend(host.live.iter().cloned());
    }
    findings.extend(interface::check(evidence));
    findings.extend(reachability::check(evidence));
    findings.extend(versions::check(evidence));
    findings.extend(clock_skew::check(evidence));
    findings.extend(rdma::check(evidence));
    findings.extend(bandwidth::check(evidence));
    findings.extend(engine::check(evidence));
    findings
}

/// A plan against the hosts `infer doctor --cluster` surveyed: the plan checks over their
/// probed topologies (cross-node TP, TP over non-NVLink pairs, EP, the PP bubble), and each
/// host's `NCCL_SOCKET_IFNAME`/`NCCL_IB_HCA` from the plan against what that host has.
pub fn cluster_plan(
    saved: &crate::plan::Plan,
    evidence: &crate::doctor::evidence::ClusterEvidence,
) -> Vec<Finding> {
    let hosts: Vec<crate::topology::Host> = evidence
        .hosts
        .iter()
        .map(|h| {
            let mut topology = h.topology.clone();
            topology.hostname = h.name.clone();
            topology
        })
        .collect();
    let mut findings = plan(
        saved,
        Some(&Topology {
            hosts: hosts.clone(),
        }),
        None,
    );
    for (name, env) in &saved.env {
        match hosts.iter().find(|h| &h.hostname == name) {
            Some(host) => findings.extend(nccl_env::check(host, env)),
            None => findings.push(Finding {
                check: "plan",
                severity: super::Severity::Error,
                host: Some(name.clone()),
                message: format!(
                    "the plan places ranks on `{name}`, which is not a host of the inventory"
                ),
                evidence: Vec::new(),
                hint:
                    "plan for this inventory: `infer plan --cluster hosts.toml --json > plan.json`"
                        .into(),
            }),
        }
    }
    findings
}

/// Every check id `live` can produce, for findings that come back from other hosts.
const LIVE_IDS: &[&str] = &[
    nvml::ID,
    tp_not_nvlink::ID,
    nvlink_down::ID,
    p2p::ID,
    ib_port::ID,
    nccl_env::ID,
    limits::ULIMIT_ID,
    limits::MEMLOCK_ID,
    shm::ID,
    "master-port",
];

/// The static id equal to `name`, if `name` is a live check's id.
pub fn known_id(name: &str) -> Option<&'static str> {
    LIVE_IDS.iter().copied().find(|id| *id == name)
}

/// Checks of this host: driver, NVLink links, HCA ports, NCCL variables, limits, `/dev/shm`, the rendezvous port.
///
/// Errors: the probe of this host failed (NVML loaded but broke, sysfs unreadable).
pub fn live(sysfs_root: &std::path::Path) -> anyhow::Result<Vec<Finding>> {
    use super::Severity;
    let host = crate::topology::probe::probe_host(&crate::topology::probe::ProbeOptions {
        sysfs_root: sysfs_root.to_path_buf(),
    })?;
    let mut findings = vec![nvml::check(&host, None)];
    findings.extend(tp_not_nvlink::check(&host));
    findings.extend(nvlink_down::check(&host));
    findings.extend(p2p::check(&host));
    findings.extend(ib_port::check(&host));
    let env: std::collections::BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_"))
        .collect();
    findings.extend(nccl_env::check(&host, &env));
    let has_rdma = host.nics.iter().any(|n| {
        matches!(
            n.kind,
            crate::topology::NicKind::Ib | crate::topology::NicKind::Roce
        )
    });
    if let Ok(limits) = std::fs::read_to_string("/proc/self/limits") {
        findings.extend(limits::check(&limits, has_rdma));
    }
    findings.push(shm::check(shm::shm_capacity_bytes()));
    let port: u16 = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(29500);
    if std::net::TcpListener::bind(("0.0.0.0", port)).is_err() {
        findings.push(Finding {
            check: "master-port",
            severity: Severity::Warn,
            host: Some(host.hostname.clone()),
            message: format!("port {port} (`MASTER_PORT`) is already in use: a rendezvous store cannot listen on it"),
            evidence: Vec::new(),
            hint: format!("stop the process on port {port} (`ss -ltnp 'sport = :{port}'`) or choose another `MASTER_PORT`"),
        });
    }
    Ok(findings)
}

/// Checks of a plan: TP or EP groups across hosts, the PP bubble, and (with the hosts'
/// topology) TP groups over non-NVLink pairs. `this_host`, when given, is checked for the
/// GPUs the plan places on it. A plan of CPU ranks needs no GPU and uses no GPU link.
pub fn plan(
    plan: &crate::plan::Plan,
    topology: Option<&Topology>,
    this_host: Option<&crate::topology::Host>,
) -> Vec<Finding> {
    let gpus = plan.device == crate::plan::cluster::Device::Gpu;
    let mut findings = cross_node_tp::check(plan);
    if let Some(host) = this_host.filter(|h| plan.ranks.iter().any(|r| r.host == h.hostname)) {
        findings.push(nvml::check(host, Some(plan).filter(|_| gpus)));
    }
    findings.extend(ep_cross_node::check(plan));
    findings.extend(pp_bubble::check(plan));
    if let Some(topology) = topology.filter(|_| gpus) {
        findings.extend(tp_not_nvlink::check_plan(plan, topology));
    }
    findings
}
