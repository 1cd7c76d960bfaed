//! Prefill/decode disaggregated deployments of vLLM and SGLang: prefill workers and decode
//! workers (each one engine server of its own TP × PP layout, on one node or several) and a
//! router in PD mode in front of them, on the first host.
//!
//! - vLLM: every worker runs `vllm serve` with `--kv-transfer-config` naming the
//!   `NixlConnector` (`kv_role` `kv_both`, a fixed `engine_id` per worker) and its NIXL side
//!   channel on its own address and port (`VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`, default port
//!   5600); the router is `vllm-router --vllm-pd-disaggregation --kv-connector nixl`
//!   (PyPI `vllm-router`), which asks a prefill worker for the KV and a decode worker for
//!   the tokens.
//! - SGLang: every worker runs `launch_server --disaggregation-mode prefill|decode` with the
//!   Mooncake transfer backend (SGLang's default) and, where the plan names HCAs,
//!   `--disaggregation-ib-device`; each prefill worker has its own bootstrap port (default
//!   8998); the router is `sglang_router.launch_router --pd-disaggregation --prefill URL
//!   BOOTSTRAP_PORT --decode URL` (PyPI `sglang-router`).
//!
//! Workers are placed on the hosts' GPUs in order, prefill workers first; a worker that
//! fits in a node never straddles two, a larger one takes whole nodes. Ports are the
//! engine's, shifted by the worker's number, so workers sharing a host never collide: HTTP
//! `http + 1 + w` (the router keeps `http`), rendezvous `dist + 10·w` (vLLM) or `dist +
//! 200·w` with `nccl + 200·w` (SGLang derives six ports above `dist`), NIXL `5600 + w`,
//! bootstrap `8998 + w`.
//!
//! Sources: vLLM 0.33.0 `docs/features/nixl_connector_usage.md` and `vllm/envs.py`
//! (`VLLM_NIXL_SIDE_CHANNEL_*`); SGLang 0.5.23 `docs/advanced_features/pd_disaggregation.md`
//! and `srt/server_args.py`; `vllm-router` 0.1.17 and `sglang-router` 0.3.2
//! `router_args.py`. `tests/it/engines.rs` parses every line with those real parsers.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{EngineKind, EngineLaunch, EngineRequest, NodeLaunch, NodeNet, NodeRole, ReservedPort};
use crate::degrees::Degrees;

/// vLLM's NIXL side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`'s default).
pub(crate) const NIXL_SIDE_CHANNEL_PORT: u16 = 5600;
/// SGLang's prefill bootstrap port (`--disaggregation-bootstrap-port`'s default).
pub(crate) const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// A process's part in a disaggregated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum PdRole {
    Prefill,
    Decode,
    Router,
}

/// Which worker of which role a node belongs to (the router: worker 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PdPart {
    pub role: PdRole,
    pub worker: usize,
}

impl PdPart {
    /// `prefill0`, `decode1`, `router`: for script names and reports.
    pub(crate) fn name(&self) -> String {
        match self.role {
            PdRole::Prefill => format!("prefill{}", self.worker),
            PdRole::Decode => format!("decode{}", self.worker),
            PdRole::Router => "router".to_string(),
        }
    }
}

/// How many prefill and decode workers, each of which layout (`dp` 1: one server each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PdLayout {
    pub prefill: Degrees,
    pub prefill_workers: usize,
    pub decode: Degrees,
    pub decode_workers: usize,
}

impl PdLayout {
    /// The workers of the planner's disaggregated deployment.
    pub(crate) fn of(plan: &crate::plan::sla::Disaggregated) -> PdLayout {
        PdLayout {
            prefill: plan.prefill,
            prefill_workers: plan.prefill_workers as usize,
            decode: plan.decode,
            decode_workers: plan.decode_workers as usize,
        }
    }

    /// The one worker shape of both roles, for infer's own ranks, which move KV shard to
    /// shard (prefill rank at (tp, pp) to the same decode rank).
    ///
    /// Errors: prefill and decode workers of different TP, PP or EP.
    pub(crate) fn one_shape(&self) -> Result<Degrees> {
        let (a, b) = (self.prefill, self.decode);
        if (a.tp, a.pp, a.ep) != (b.tp, b.pp, b.ep) {
            bail!(
                "infer's ranks move KV shard to shard and need one TP × PP on both roles; the plan has prefill workers of {a} and decode workers of {b}\nhint: `--engine vllm|sglang` runs different shapes (`infer plan --engine vllm --disaggregate --emit DIR`), or give the layout yourself: `infer up --prefill N --decode M --tp T`"
            );
        }
        Ok(a)
    }
}

/// Makes every GPU of every host of `cluster` available to the workers: the hosts the
/// aggregated plan did not use are added (in the cluster's order, addressed by their
/// inventory address or name), and each host's `gpus` become all of its GPUs.
pub(crate) fn use_every_gpu(request: &mut EngineRequest, cluster: &crate::plan::cluster::Cluster) {
    for host in &cluster.hosts {
        if !request.nodes.iter().any(|n| n.host == host.name) {
            request.nodes.push(NodeNet {
                host: host.name.clone(),
                address: host.address.clone().unwrap_or_else(|| host.name.clone()),
                ifname: None,
                ib_hcas: None,
                ib_gid_index: None,
                gpus: Vec::new(),
                gpus_on_host: host.topology.gpus.len(),
                cpus: 0,
            });
        }
    }
    for node in &mut request.nodes {
        node.gpus = (0..node.gpus_on_host).collect();
    }
}

/// The deployment: the router first (it serves the endpoint), then every worker's nodes,
/// prefill workers first. `base` gives the model, dtypes, ports and the hosts in order,
/// each with the GPUs the workers may use (`gpus`).
///
/// Errors: an engine other than vLLM or SGLang, a worker layout with DP, no workers of a
/// role, more GPUs than the hosts have, a layout the engine cannot run (from the engine's
/// own generator).
pub(crate) fn generate(base: &EngineRequest, layout: &PdLayout) -> Result<EngineLaunch> {
    generate_with_router_bind(base, layout, &base.http_host)
}

/// [`generate`] with the router bound to `router_bind` while the workers bind
/// `base.http_host` (`infer up` across hosts: the workers on every address, so the router
/// reaches them, the router on the first host's loopback, which the launcher forwards).
///
/// Errors: as [`generate`].
pub(crate) fn generate_with_router_bind(
    base: &EngineRequest,
    layout: &PdLayout,
    router_bind: &str,
) -> Result<EngineLaunch> {
    if !matches!(base.engine, EngineKind::Vllm | EngineKind::Sglang) {
        bail!(
            "infer launches prefill/decode disaggregation for vLLM and SGLang (and its own engine: `infer up --prefill N --decode M`), not {}",
            base.engine
        );
    }
    if layout.prefill_workers == 0 || layout.decode_workers == 0 {
        bail!("a disaggregated deployment needs at least one prefill and one decode worker");
    }
    if layout.prefill.dp != 1 || layout.decode.dp != 1 {
        bail!("each prefill or decode worker is one server (DP 1); more workers replace DP");
    }
    let Some(head) = base.nodes.first() else {
        bail!("no hosts to place the workers on");
    };
    // Free GPUs per host, in order.
    let mut free: Vec<Vec<usize>> = base.nodes.iter().map(|n| n.gpus.clone()).collect();
    let mut workers: Vec<(PdPart, EngineLaunch)> = Vec::new();
    let roles = [
        (PdRole::Prefill, layout.prefill, layout.prefill_workers),
        (PdRole::Decode, layout.decode, layout.decode_workers),
    ];
    for (role, parallel, count) in roles {
        for k in 0..count {
            let number = workers.len();
            let nodes = place(&base.nodes, &mut free, parallel.world_size())
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{} prefill worker{} of {} GPUs and {} decode worker{} of {} need more GPUs than the hosts give ({})",
                        layout.prefill_workers,
                        if layout.prefill_workers == 1 { "" } else { "s" },
                        layout.prefill.world_size(),
                        layout.decode_workers,
                        if layout.decode_workers == 1 { "" } else { "s" },
                        layout.decode.world_size(),
                        base.nodes.iter().map(|n| n.gpus.len()).sum::<usize>()
                    )
                })?;
            let mut request = base.clone();
            request.parallel = parallel;
            request.nodes = nodes;
            let shift = number as u16;
            request.ports.http = base.ports.http + 1 + shift;
            match base.engine {
                EngineKind::Sglang => {
                    request.ports.dist = base.ports.dist + 200 * shift;
                    request.ports.nccl = base.ports.nccl + 200 * shift;
                }
                _ => request.ports.dist = base.ports.dist + 10 * shift,
            }
            let mut launch = super::generate(&request)?;
            let part = PdPart { role, worker: k };
            for (node, net) in launch.nodes.iter_mut().zip(&request.nodes) {
                add_pd_flags(base.engine, node, net, part, number);
                node.pd = Some(part);
            }
            workers.push((part, launch));
        }
    }
    let router = router(base, head, &workers, router_bind);
    let mut notes = Vec::new();
    let mut nodes = vec![router];
    for (_, launch) in workers {
        for note in launch.notes {
            if !notes.contains(&note) {
                notes.push(note);
            }
        }
        nodes.extend(launch.nodes);
    }
    let tested = match base.engine {
        EngineKind::Sglang => super::SGLANG_TESTED,
        _ => super::VLLM_TESTED,
    };
    let version = base
        .version
        .or_else(|| super::Version::parse(tested))
        .unwrap_or(super::Version(0, 0, 0));
    Ok(EngineLaunch {
        engine: base.engine,
        version,
        endpoint: format!(
            "http://{}:{}",
            super::vllm::endpoint_host(router_bind, &head.address),
            base.ports.http
        ),
        nodes,
        notes,
    })
}

/// The nodes of one worker of `need` GPUs, taken from `free`: the first host with that many
/// free when it fits in one host, else whole free hosts. `None` when they run out.
fn place(hosts: &[NodeNet], free: &mut [Vec<usize>], need: usize) -> Option<Vec<NodeNet>> {
    let with_gpus = |i: usize, gpus: Vec<usize>| NodeNet {
        gpus,
        ..hosts[i].clone()
    };
    if let Some(i) = (0..hosts.len()).find(|&i| free[i].len() >= need) {
        let gpus: Vec<usize> = free[i].drain(..need).collect();
        return Some(vec![with_gpus(i, gpus)]);
    }
    // Larger than any host's free GPUs: whole untouched hosts, the same count on each.
    let whole: Vec<usize> = (0..hosts.len())
        .filter(|&i| !free[i].is_empty() && free[i].len() == hosts[i].gpus.len())
        .collect();
    let per_host = whole.first().map(|&i| free[i].len())?;
    if per_host == 0 || !need.is_multiple_of(per_host) {
        return None;
    }
    let chosen: Vec<usize> = whole
        .into_iter()
        .filter(|&i| free[i].len() == per_host)
        .take(need / per_host)
        .collect();
    if chosen.len() * per_host != need {
        return None;
    }
    Some(
        chosen
            .into_iter()
            .map(|i| with_gpus(i, std::mem::take(&mut free[i])))
            .collect(),
    )
}

/// A worker node's disaggregation flags and environment (`number`: the worker's place
/// among all workers, for its ports).
fn add_pd_flags(
    engine: EngineKind,
    node: &mut NodeLaunch,
    net: &NodeNet,
    part: PdPart,
    number: usize,
) {
    let shift = number as u16;
    match engine {
        EngineKind::Vllm => {
            let config = serde_json::json!({
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "engine_id": part.name(),
            });
            node.argv
                .extend(["--kv-transfer-config".into(), config.to_string()]);
            let port = NIXL_SIDE_CHANNEL_PORT + shift;
            node.env
                .insert("VLLM_NIXL_SIDE_CHANNEL_HOST".into(), net.address.clone());
            node.env
                .insert("VLLM_NIXL_SIDE_CHANNEL_PORT".into(), port.to_string());
            node.ports.push(ReservedPort {
                port,
                bind: net.address.clone(),
                purpose: "NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT): KV transfer handshakes"
                    .into(),
            });
        }
        _ => {
            let mode = match part.role {
                PdRole::Prefill => "prefill",
                _ => "decode",
            };
            node.argv.extend([
                "--disaggregation-mode".into(),
                mode.into(),
                "--disaggregation-transfer-backend".into(),
                "mooncake".into(),
            ]);
            if let Some(hcas) = &net.ib_hcas {
                node.argv
                    .extend(["--disaggregation-ib-device".into(), hcas.clone()]);
            }
            if part.role == PdRole::Prefill {
                let port = SGLANG_BOOTSTRAP_PORT + shift;
                node.argv
                    .extend(["--disaggregation-bootstrap-port".into(), port.to_string()]);
                if node.role == NodeRole::Head {
                    node.ports.push(ReservedPort {
                        port,
                        bind: "0.0.0.0".into(),
                        purpose: "prefill bootstrap (--disaggregation-bootstrap-port)".into(),
                    });
                }
            }
        }
    }
}

/// The router in PD mode on the first host, at the base HTTP port.
fn router(
    base: &EngineRequest,
    head: &NodeNet,
    workers: &[(PdPart, EngineLaunch)],
    bind: &str,
) -> NodeLaunch {
    let mut argv: Vec<String> = match base.engine {
        EngineKind::Sglang => vec![
            "python3".into(),
            "-m".into(),
            "sglang_router.launch_router".into(),
            "--pd-disaggregation".into(),
        ],
        _ => vec![
            "vllm-router".into(),
            "--vllm-pd-disaggregation".into(),
            "--kv-connector".into(),
            "nixl".into(),
        ],
    };
    for (number, (part, launch)) in workers.iter().enumerate() {
        match part.role {
            PdRole::Prefill => {
                argv.extend(["--prefill".into(), launch.endpoint.clone()]);
                if base.engine == EngineKind::Sglang {
                    argv.push((SGLANG_BOOTSTRAP_PORT + number as u16).to_string());
                }
            }
            _ => argv.extend(["--decode".into(), launch.endpoint.clone()]),
        }
    }
    argv.extend([
        "--host".into(),
        bind.to_string(),
        "--port".into(),
        base.ports.http.to_string(),
    ]);
    NodeLaunch {
        host: head.host.clone(),
        node_rank: 0,
        role: NodeRole::Head,
        argv,
        env: Default::default(),
        ports: vec![ReservedPort {
            port: base.ports.http,
            bind: bind.to_string(),
            purpose: "OpenAI-compatible HTTP API (the PD router)".into(),
        }],
        pd: Some(PdPart {
            role: PdRole::Router,
            worker: 0,
        }),
    }
}
