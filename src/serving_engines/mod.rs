//! Other serving engines — vLLM, SGLang, llama.cpp — launched with a plan's layout: the
//! command line and environment each node runs, or the reason an engine cannot express the
//! layout. Pure: no I/O; `launch::serving_engines` runs what this module writes, and `infer plan
//! --engine E --emit DIR` writes it down as one script per node.
//!
//! Every flag is written under its full name (both Python parsers accept abbreviations;
//! never rely on it), and `tests/it/engines.rs` parses the generated lines with the real
//! parsers of the pinned versions ([`VLLM_TESTED`], [`SGLANG_TESTED`]).

pub(crate) mod disagg;
pub(crate) mod infer;
pub(crate) mod llamacpp;
pub(crate) mod progress;
pub(crate) mod sglang;
pub(crate) mod vllm;

use std::collections::BTreeMap;
use std::fmt;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::degrees::Degrees;
use crate::plan::model::{Dtype, ModelSpec};
use crate::plan::{Objective, Plan};
use crate::topology::{Nic, NicKind};

/// The vLLM version whose parser the tests run (`vllm==0.33.0` from PyPI).
pub(crate) const VLLM_TESTED: &str = "0.33.0";
/// The SGLang version whose parser the tests run (`sglang==0.5.23` from PyPI).
pub(crate) const SGLANG_TESTED: &str = "0.5.23";

/// An engine `infer` can launch: its own (node by node, [`infer`]) or another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum EngineKind {
    Infer,
    Vllm,
    Sglang,
    Llamacpp,
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Infer => "infer",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Llamacpp => "llamacpp",
        })
    }
}

/// An engine version as `major.minor.patch` (llama.cpp: its build number as `major`).
/// Compared numerically; a missing part counts as 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// Reads `0.33.0`, `v0.5.23`, `0.11.0rc2`, `0.9.2+cu128` (suffixes after the numbers are
    /// ignored) or llama.cpp's `b11434` / `version: 11434 (abc123)`. `None` when no number
    /// leads the text.
    pub(crate) fn parse(text: &str) -> Option<Version> {
        let text = text.trim();
        let text = text.strip_prefix("version:").unwrap_or(text).trim();
        let text = text.trim_start_matches(['v', 'b']);
        let mut parts = [0u32; 3];
        let mut seen = 0;
        for (i, piece) in text.split('.').take(3).enumerate() {
            let digits: String = piece.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                break;
            }
            parts[i] = digits.parse().ok()?;
            seen += 1;
            if digits.len() != piece.len() {
                break;
            }
        }
        (seen > 0).then_some(Version(parts[0], parts[1], parts[2]))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// One node of an engine launch: a host, the address the other nodes reach it at on the
/// data network, and what NCCL and Gloo need there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct NodeNet {
    /// The inventory's host name.
    pub host: String,
    /// This host's data-network address (IPv4, or a name when none is known).
    pub address: String,
    /// The data interface (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`), when known.
    pub ifname: Option<String>,
    /// The HCAs NCCL should use, comma-separated (`mlx5_0,mlx5_1`), when known.
    pub ib_hcas: Option<String>,
    /// The RoCE v2 GID index of those HCAs (`NCCL_IB_GID_INDEX`), on RoCE only.
    pub ib_gid_index: Option<u32>,
    /// GPUs of this host the layout uses (NVML indices), in local-rank order.
    pub gpus: Vec<usize>,
    /// GPUs the host has.
    pub gpus_on_host: usize,
    /// CPU cores of the host (llama.cpp's `rpc-server --threads` on CPU hosts); 0: unknown.
    pub cpus: usize,
}

/// Ports an engine launch takes. Defaults are the engines' own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EnginePorts {
    /// The OpenAI-compatible HTTP server on the head node (vLLM 8000, SGLang 30000,
    /// llama-server 8080).
    pub http: u16,
    /// The cross-node rendezvous: vLLM's `--master-port` (TP/PP over nodes) or
    /// `--data-parallel-rpc-port` (DP), SGLang's `--dist-init-addr` port, llama.cpp's
    /// `rpc-server --port`.
    pub dist: u16,
    /// SGLang's `--nccl-port` (set, so that it is known and checked).
    pub nccl: u16,
}

impl EnginePorts {
    /// The engine's usual ports: vLLM 8000 / 29501 (`--master-port` default) , SGLang
    /// 30000 / 20000 / 20100, llama.cpp 8080 / 50052 (`rpc-server`'s default).
    pub(crate) fn default_for(engine: EngineKind) -> EnginePorts {
        match engine {
            EngineKind::Infer => EnginePorts {
                http: infer::HTTP_PORT,
                dist: infer::STORE_PORT,
                nccl: 0,
            },
            EngineKind::Vllm => EnginePorts {
                http: 8000,
                dist: 29501,
                nccl: 0,
            },
            EngineKind::Sglang => EnginePorts {
                http: 30000,
                dist: 20000,
                nccl: 20100,
            },
            EngineKind::Llamacpp => EnginePorts {
                http: 8080,
                dist: 50052,
                nccl: 0,
            },
        }
    }
}

/// Everything an engine's command lines are made from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct EngineRequest {
    pub engine: EngineKind,
    /// The engine version installed on the hosts (read in preflight); `None`: the tested one.
    pub version: Option<Version>,
    /// What the engine loads: a Hugging Face id or a path on every host (llama.cpp: a GGUF
    /// file).
    pub model: String,
    /// The name `/v1/models` lists; `None`: the engine's default.
    pub served_model_name: Option<String>,
    pub parallel: Degrees,
    /// Whether the model is a mixture of experts (EP and attention-DP apply).
    pub is_moe: bool,
    /// `--quantization` (vLLM/SGLang spelling) when the plan quantizes the checkpoint.
    pub quantization: Option<String>,
    /// `--dtype float16` when the plan runs fp16.
    pub fp16: bool,
    /// FP8 KV cache.
    pub kv_fp8: bool,
    /// Longest sequence, tokens; 0: the engine's default (the model's own context).
    pub max_model_len_tokens: u64,
    /// Fraction of GPU memory the engine may use.
    pub gpu_memory_utilization: f64,
    pub objective: Objective,
    /// Whether an EP group spans hosts (vLLM then needs an all-to-all backend for it).
    pub ep_crosses_hosts: bool,
    /// The nodes in node-rank order; the first is the head (HTTP server, rendezvous).
    pub nodes: Vec<NodeNet>,
    pub ports: EnginePorts,
    /// Address the head's HTTP server binds (`0.0.0.0`, or the data address).
    pub http_host: String,
    /// llama.cpp only: the GPUs to offload to (`false`: CPU hosts, `--n-gpu-layers 0`).
    pub gpu: bool,
}

/// A node's part in the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum NodeRole {
    /// Serves HTTP and hosts the rendezvous.
    Head,
    /// vLLM `--headless`, SGLang `--node-rank N > 0`, llama.cpp `rpc-server`.
    Worker,
}

impl NodeRole {
    /// The role of node `node_rank`: node 0 is the head.
    pub(crate) fn of(node_rank: usize) -> NodeRole {
        if node_rank == 0 {
            NodeRole::Head
        } else {
            NodeRole::Worker
        }
    }
}

/// A port a node's engine listens on, and what for (checked free in preflight).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReservedPort {
    pub port: u16,
    /// The address it binds (`0.0.0.0` or the node's data address).
    pub bind: String,
    pub purpose: String,
}

/// What one node runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct NodeLaunch {
    pub host: String,
    pub node_rank: usize,
    pub role: NodeRole,
    /// The program and its arguments; `argv[0]` is the engine's usual command name
    /// (`vllm`, `python3`, `llama-server`, `rpc-server`), resolved on the host at launch.
    pub argv: Vec<String>,
    /// Environment besides the host's own, sorted by name.
    pub env: BTreeMap<String, String>,
    pub ports: Vec<ReservedPort>,
    /// In a prefill/decode disaggregated deployment ([`disagg`]): which worker (or the
    /// router) this process belongs to; `node_rank` is then its node within that worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<disagg::PdPart>,
}

/// The whole launch: one [`NodeLaunch`] per node, the head first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct EngineLaunch {
    pub engine: EngineKind,
    /// The version the flags are written for.
    pub version: Version,
    /// `http://HEAD:PORT` of the OpenAI-compatible server.
    pub endpoint: String,
    pub nodes: Vec<NodeLaunch>,
    /// What the user should know (a version newer than the tested one, RPC exposure).
    pub notes: Vec<String>,
}

/// The command lines and environments for `request`, or why the engine cannot express
/// its layout.
///
/// Errors: a layout the engine cannot run (named, with what would work), no nodes.
pub(crate) fn generate(request: &EngineRequest) -> Result<EngineLaunch> {
    if request.nodes.is_empty() {
        bail!("no nodes to launch {} on", request.engine);
    }
    check_even_split(request)?;
    let mut launch = match request.engine {
        EngineKind::Infer => infer::generate(request)?,
        EngineKind::Vllm => vllm::generate(request)?,
        EngineKind::Sglang => sglang::generate(request)?,
        EngineKind::Llamacpp => llamacpp::generate(request)?,
    };
    let unnamed: Vec<&str> = request
        .nodes
        .iter()
        .filter(|n| n.address.parse::<std::net::IpAddr>().is_err())
        .map(|n| n.host.as_str())
        .collect();
    if request.nodes.len() > 1 && !unnamed.is_empty() {
        launch.notes.push(format!(
            "no address known for {}: the lines use the host name, which must resolve to its data-network address              (and the engine's host-IP variable is left out); plan on an inventory with `address = \"…\"` for real addresses",
            unnamed.join(", ")
        ));
    }
    Ok(launch)
}

/// GPU engines run the same number of GPUs on every node (vLLM and SGLang split the world
/// evenly over `--nnodes`).
fn check_even_split(request: &EngineRequest) -> Result<()> {
    if !request.gpu || request.engine == EngineKind::Llamacpp {
        return Ok(());
    }
    let world = request.parallel.world_size();
    let nodes = request.nodes.len();
    let uneven: Vec<String> = request
        .nodes
        .iter()
        .filter(|n| n.gpus.len() * nodes != world)
        .map(|n| format!("{} uses {}", n.host, n.gpus.len()))
        .collect();
    if !uneven.is_empty() {
        bail!(
            "{} splits the world ({world} GPUs) evenly over its {nodes} nodes, but {}\nhint: plan for a cluster whose hosts \
             each give the layout the same number of GPUs",
            request.engine,
            uneven.join(", ")
        );
    }
    Ok(())
}

/// The environment every GPU engine's node gets: device order, the data interface for
/// NCCL's bootstrap and socket transport and for Gloo, the HCAs, the RoCE GID index, the
/// GPUs when the layout uses part of the host, and offline Hugging Face hub.
fn common_env(request: &EngineRequest, node: &NodeNet) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    if request.gpu {
        // NVML and nvidia-smi number GPUs in PCI bus order; CUDA's default is "fastest first".
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        let in_order = node.gpus.iter().enumerate().all(|(i, &g)| i == g);
        if node.gpus.len() < node.gpus_on_host || !in_order {
            let list: Vec<String> = node.gpus.iter().map(|g| g.to_string()).collect();
            env.insert("CUDA_VISIBLE_DEVICES".into(), list.join(","));
        }
    }
    if request.nodes.len() > 1 {
        if let Some(ifname) = &node.ifname {
            // `=`: this exact interface (a bare `eth1` would also select `eth10`). Gloo
            // takes one plain name.
            env.insert("NCCL_SOCKET_IFNAME".into(), format!("={ifname}"));
            env.insert("GLOO_SOCKET_IFNAME".into(), ifname.clone());
        }
        if let Some(hcas) = &node.ib_hcas {
            env.insert("NCCL_IB_HCA".into(), format!("={hcas}"));
        }
        if let Some(index) = node.ib_gid_index {
            env.insert("NCCL_IB_GID_INDEX".into(), index.to_string());
        }
    }
    env.insert("HF_HUB_OFFLINE".into(), "1".into());
    env
}

/// The RoCE v2 GID index NCCL should use on `hcas` (`NCCL_IB_GID_INDEX`): the first port's
/// GID of type `RoCE v2` that maps an IPv4 address (`::ffff:a.b.c.d`), as NVIDIA's RoCE
/// guides choose. `None` on InfiniBand or when the GID table is unknown.
pub(crate) fn roce_gid_index(nics: &[Nic], hcas: &[String]) -> Option<u32> {
    nics.iter()
        .filter(|nic| nic.kind == NicKind::Roce && hcas.contains(&nic.name))
        .flat_map(|nic| nic.ports.iter())
        .filter(|port| port.link_layer.eq_ignore_ascii_case("ethernet"))
        .flat_map(|port| port.gids.iter())
        .find(|gid| {
            gid.gid_type.as_deref() == Some("RoCE v2")
                && gid.gid.starts_with("0000:0000:0000:0000:0000:ffff:")
        })
        .map(|gid| gid.index)
}

/// What `infer plan --engine E` launches: a feasible plan of `spec` on `cluster`, the
/// model the engine loads (`None`: the plan's), and whether `--disaggregate` asks for the
/// plan's prefill/decode deployment.
pub(crate) struct PlanLaunch<'a> {
    pub engine: EngineKind,
    pub plan: &'a Plan,
    pub spec: &'a ModelSpec,
    pub cluster: &'a crate::plan::cluster::Cluster,
    pub model: Option<&'a str>,
    pub disaggregate: bool,
}

/// The launch of `launch.engine` for its plan (`infer plan --engine E`), on the ports given
/// (`(http, dist)`; `None`: the engine's defaults).
///
/// Errors: vLLM or SGLang for a CPU plan, `--disaggregate` when no disaggregated deployment
/// fits, a launch the engine cannot express.
pub(crate) fn launch_for_plan(
    launch: &PlanLaunch<'_>,
    (http_port, dist_port): (Option<u16>, Option<u16>),
) -> Result<EngineLaunch> {
    let PlanLaunch {
        engine,
        plan,
        spec,
        cluster,
        model,
        disaggregate,
    } = *launch;
    if plan.device == crate::plan::cluster::Device::Cpu
        && matches!(engine, EngineKind::Vllm | EngineKind::Sglang)
    {
        bail!(
            "--engine {engine}: this plan runs CPU ranks (`{}` has no GPUs), and {engine} serves on GPUs\nhint: serve it with `infer up --plan` (this plan's `--json`), or `--engine infer`/`--engine llamacpp`",
            plan.cluster
        );
    }
    let mut request = request_from_plan(engine, plan, spec, cluster, model);
    if let Some(port) = http_port {
        request.ports.http = port;
    }
    if let Some(port) = dist_port {
        request.ports.dist = port;
    }
    match (&plan.disaggregated, disaggregate) {
        (Some(d), true) => {
            disagg::use_every_gpu(&mut request, cluster);
            let layout = disagg::PdLayout::of(d);
            match engine {
                EngineKind::Infer => infer::generate_disaggregated(&request, &layout),
                _ => disagg::generate(&request, &layout),
            }
        }
        (None, true) => bail!(
            "--disaggregate --engine {engine}: no disaggregated deployment fits this cluster and these targets (see `--explain`); drop --disaggregate for the aggregated launch"
        ),
        _ => generate(&request),
    }
}

/// Builds the request for `engine` from a feasible plan of `spec` on `cluster`: the nodes
/// are the plan's hosts in rank order, their addresses the inventory's (else the host
/// name), their interfaces and HCAs the plan's NCCL environment.
pub(crate) fn request_from_plan(
    engine: EngineKind,
    plan: &Plan,
    spec: &ModelSpec,
    cluster: &crate::plan::cluster::Cluster,
    model: Option<&str>,
) -> EngineRequest {
    let mut hosts: Vec<&str> = Vec::new();
    for rank in &plan.ranks {
        if !hosts.contains(&rank.host.as_str()) {
            hosts.push(&rank.host);
        }
    }
    let nodes = hosts
        .iter()
        .map(|&name| {
            let host = cluster.hosts.iter().find(|h| h.name == name);
            // In rank order: the engine's local rank k runs on the k-th visible GPU.
            let gpus: Vec<usize> = plan
                .ranks
                .iter()
                .filter(|r| r.host == name)
                .map(|r| r.gpu)
                .collect();
            let env = plan.env.get(name);
            let strip = |key: &str| {
                env.and_then(|e| e.get(key))
                    .map(|v| v.trim_start_matches('=').to_string())
            };
            let ib_hcas = strip("NCCL_IB_HCA");
            let ib_gid_index = match (host, &ib_hcas) {
                (Some(host), Some(hcas)) => {
                    let names: Vec<String> = hcas.split(',').map(str::to_string).collect();
                    roce_gid_index(&host.topology.nics, &names)
                }
                _ => None,
            };
            NodeNet {
                host: name.to_string(),
                address: host
                    .and_then(|h| h.address.clone())
                    .unwrap_or_else(|| name.to_string()),
                ifname: strip("NCCL_SOCKET_IFNAME"),
                ib_hcas,
                ib_gid_index,
                gpus,
                gpus_on_host: host.map_or(0, |h| h.topology.gpus.len()),
                cpus: 0,
            }
        })
        .collect();
    let ep_crosses_hosts = plan.groups.ep.iter().any(|group| {
        let first = group
            .first()
            .and_then(|&r| plan.ranks.get(r as usize))
            .map(|r| &r.host);
        group
            .iter()
            .any(|&r| plan.ranks.get(r as usize).map(|r| &r.host) != first)
    });
    let quantization = if plan.dtype != spec.native_dtype {
        plan.dtype.vllm_quantization().map(str::to_string)
    } else {
        None
    };
    EngineRequest {
        engine,
        version: None,
        model: model.unwrap_or(&plan.serve_id).to_string(),
        served_model_name: None,
        parallel: plan.parallel,
        is_moe: spec.moe.is_some(),
        quantization,
        fp16: plan.dtype == Dtype::Fp16,
        kv_fp8: plan.kv_dtype == Dtype::Fp8,
        max_model_len_tokens: plan.max_model_len,
        gpu_memory_utilization: plan.gpu_memory_utilization,
        objective: plan.objective,
        ep_crosses_hosts,
        nodes,
        ports: EnginePorts::default_for(engine),
        http_host: "0.0.0.0".into(),
        // A plan of CPU ranks runs on the hosts' CPUs.
        gpu: plan.device == crate::plan::cluster::Device::Gpu,
    }
}

/// `value` quoted for a POSIX shell: as is when it is only safe characters, else in single
/// quotes with each `'` written `'\''`. Used for the scripts `--emit` writes and the lines
/// shown to the user — never to build a remote shell command (agents start argv directly).
pub(crate) fn shell_quote(value: &str) -> String {
    let safe = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if safe {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// The node's environment and command as one shell line (`K=V … argv…`).
pub(crate) fn command_line(node: &NodeLaunch) -> String {
    let mut words: Vec<String> = node
        .env
        .iter()
        .map(|(k, v)| format!("{k}={}", shell_quote(v)))
        .collect();
    words.extend(node.argv.iter().map(|a| shell_quote(a)));
    words.join(" ")
}

/// The run script for one node: a bash script that exports the environment and `exec`s
/// the engine, with a header naming the node, the ports it takes and the start order.
pub(crate) fn script(launch: &EngineLaunch, node: &NodeLaunch) -> String {
    let mut out = String::from("#!/usr/bin/env bash\n");
    match &node.pd {
        Some(part) => {
            out.push_str(&format!(
                "# {} {} of a prefill/decode deployment: node {} ({}), written by `infer plan --engine {} --disaggregate --emit`.\n",
                launch.engine,
                part.name(),
                node.node_rank,
                node.host,
                launch.engine
            ));
            out.push_str(match part.role {
                disagg::PdRole::Router => {
                    "# Start every prefill and decode worker first, then this router.\n"
                }
                _ => "# Start the workers (a worker's other nodes before its node 0), then the router.\n",
            });
        }
        None => out.push_str(&script_header(launch, node)),
    }
    for port in &node.ports {
        out.push_str(&format!(
            "# listens on {}:{} ({})\n",
            port.bind, port.port, port.purpose
        ));
    }
    if node.role == NodeRole::Head {
        out.push_str(&format!("# serves {}\n", launch.endpoint));
    }
    out.push_str("set -euo pipefail\n");
    if launch.engine == EngineKind::Infer && launch.nodes.len() > 1 {
        // The shared secret stays out of the file.
        let token = crate::envvars::RUN_TOKEN;
        out.push_str(&format!(
            ": \"${{{token}:?set {token} to one secret shared by every node}}\"\n"
        ));
    }
    for (key, value) in &node.env {
        out.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    // The program and its positional words on the first line, then one flag (with its
    // value) per line.
    let mut lines: Vec<String> = vec![String::new()];
    for word in &node.argv {
        let quoted = shell_quote(word);
        let last = lines.last_mut().expect("never empty");
        if word.starts_with("--") && !last.is_empty() {
            lines.push(quoted);
        } else if last.is_empty() {
            *last = quoted;
        } else {
            last.push(' ');
            last.push_str(&quoted);
        }
    }
    out.push_str(&format!("exec {}\n", lines.join(" \\\n  ")));
    out
}

/// The header lines of a plain (not disaggregated) launch's node script: which node, and
/// the start order.
fn script_header(launch: &EngineLaunch, node: &NodeLaunch) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "# {} node {} of {} ({}, {}), written by `infer plan --engine {} --emit`.\n",
        launch.engine,
        node.node_rank,
        launch.nodes.len(),
        node.host,
        match node.role {
            NodeRole::Head => "head",
            NodeRole::Worker => "worker",
        },
        launch.engine
    ));
    if launch.nodes.len() > 1 {
        out.push_str(match (launch.engine, node.role) {
            (EngineKind::Llamacpp, NodeRole::Head) => {
                "# Start the rpc-server nodes first, then this one.\n"
            }
            (EngineKind::Infer, NodeRole::Head) => {
                "# Start this node first (it hosts the store), then the others within a minute.\n"
            }
            (EngineKind::Infer, NodeRole::Worker) => {
                "# Start node 0 first, then this one within a minute.\n"
            }
            (_, NodeRole::Head) => {
                "# Start the worker nodes first (any order), then this one; all must run.\n"
            }
            (_, NodeRole::Worker) => "# Start this before the head node.\n",
        });
    }
    out
}

/// The human report of a launch: the endpoint, then each node's role, ports and command
/// line, then the notes.
pub(crate) fn render(launch: &EngineLaunch) -> String {
    let mut out = format!(
        "{} launch: {} node{}, serving {}\n",
        launch.engine,
        launch.nodes.len(),
        if launch.nodes.len() == 1 { "" } else { "s" },
        launch.endpoint
    );
    for node in &launch.nodes {
        let ports: Vec<String> = node.ports.iter().map(|p| p.port.to_string()).collect();
        out.push_str(&format!(
            "\n  {}node {} {} ({}{}):\n    {}\n",
            node.pd
                .map_or(String::new(), |part| format!("{} ", part.name())),
            node.node_rank,
            node.host,
            match node.role {
                NodeRole::Head => "head",
                NodeRole::Worker => "worker",
            },
            if ports.is_empty() {
                String::new()
            } else {
                format!(", ports {}", ports.join(" "))
            },
            command_line(node)
        ));
    }
    if launch.nodes.iter().any(|n| n.pd.is_some()) {
        out.push_str("\n  start every prefill and decode worker (a worker's other nodes before its node 0), then the router\n");
    } else if launch.nodes.len() > 1 {
        out.push_str(if launch.engine == EngineKind::Infer {
            "\n  start node 0 first (it hosts the store), then the others\n"
        } else {
            "\n  start the workers first, then the head\n"
        });
    }
    for note in &launch.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    out
}

/// The file name of `node`'s script in an `--emit` directory (`node0-gpu-node-1.sh`).
pub(crate) fn script_name(node: &NodeLaunch) -> String {
    let host: String = node
        .host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    match &node.pd {
        Some(part) => format!("{}-node{}-{host}.sh", part.name(), node.node_rank),
        None => format!("node{}-{host}.sh", node.node_rank),
    }
}

/// The launch of `nodes`, served from the head's HTTP port, with a note when the flags
/// were written for another version than the `tested` one.
fn assemble(
    request: &EngineRequest,
    version: Version,
    tested: Option<(&str, &str)>,
    nodes: Vec<NodeLaunch>,
    mut notes: Vec<String>,
) -> EngineLaunch {
    if let Some((name, tested)) = tested
        && Version::parse(tested) != Some(version)
    {
        notes.push(format!(
            "flags written for {name} {version} as for {tested}, the version infer's parser tests pin"
        ));
    }
    let head = &request.nodes[0];
    EngineLaunch {
        engine: request.engine,
        version,
        endpoint: format!(
            "http://{}:{}",
            vllm::endpoint_host(&request.http_host, &head.address),
            request.ports.http
        ),
        nodes,
        notes,
    }
}

/// The head's `--host H --port P` (vLLM and SGLang spell them alike) and the port it
/// reserves.
fn serve_http(request: &EngineRequest, argv: &mut Vec<String>, ports: &mut Vec<ReservedPort>) {
    argv.extend([
        "--host".into(),
        request.http_host.clone(),
        "--port".into(),
        request.ports.http.to_string(),
    ]);
    ports.push(ReservedPort {
        port: request.ports.http,
        bind: request.http_host.clone(),
        purpose: "OpenAI-compatible HTTP API".into(),
    });
}

/// The flags shared by vLLM and SGLang for the plan's dtypes and memory.
fn dtype_flags(request: &EngineRequest, args: &mut Vec<String>, sglang: bool) {
    if let Some(method) = &request.quantization {
        args.extend(["--quantization".into(), method.clone()]);
    }
    if request.fp16 {
        args.extend(["--dtype".into(), "float16".into()]);
    }
    if request.kv_fp8 {
        args.extend([
            "--kv-cache-dtype".into(),
            if sglang { "fp8_e4m3" } else { "fp8" }.into(),
        ]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_as_the_engines_print_them() {
        assert_eq!(Version::parse("0.33.0"), Some(Version(0, 33, 0)));
        assert_eq!(Version::parse("v0.5.23\n"), Some(Version(0, 5, 23)));
        assert_eq!(Version::parse("0.11.0rc2"), Some(Version(0, 11, 0)));
        assert_eq!(Version::parse("0.9.2+cu128"), Some(Version(0, 9, 2)));
        assert_eq!(Version::parse("b11434"), Some(Version(11434, 0, 0)));
        assert_eq!(
            Version::parse("version: 11434 (a1b2c3d)"),
            Some(Version(11434, 0, 0))
        );
        assert_eq!(Version::parse("unknown"), None);
        assert!(Version(0, 5, 23) > Version(0, 5, 9));
    }

    /// Two 8-GPU nodes at 10.0.0.1/2 on `eth1` with `mlx5_0`.
    fn request(engine: EngineKind, parallel: Degrees, is_moe: bool) -> EngineRequest {
        let per_node = parallel.world_size() / 2;
        let node = |i: usize| NodeNet {
            host: format!("n{i}"),
            address: format!("10.0.0.{}", i + 1),
            ifname: Some("eth1".into()),
            ib_hcas: Some("mlx5_0".into()),
            ib_gid_index: Some(3),
            gpus: (0..per_node).collect(),
            gpus_on_host: 8,
            cpus: 64,
        };
        EngineRequest {
            engine,
            version: None,
            model: "org/model".into(),
            served_model_name: None,
            parallel,
            is_moe,
            quantization: None,
            fp16: false,
            kv_fp8: false,
            max_model_len_tokens: 8192,
            gpu_memory_utilization: 0.9,
            objective: Objective::Throughput,
            ep_crosses_hosts: false,
            nodes: vec![node(0), node(1)],
            ports: EnginePorts::default_for(engine),
            http_host: "0.0.0.0".into(),
            gpu: true,
        }
    }

    fn words(launch: &EngineLaunch, node: usize) -> String {
        launch.nodes[node].argv.join(" ")
    }

    #[test]
    fn every_node_gets_its_network_and_the_head_its_ports() {
        let p = Degrees {
            tp: 8,
            pp: 2,
            ep: 1,
            dp: 1,
        };
        let launch = generate(&request(EngineKind::Vllm, p, false)).expect("launch");
        let worker = &launch.nodes[1];
        assert_eq!(worker.env["NCCL_SOCKET_IFNAME"], "=eth1");
        assert_eq!(worker.env["GLOO_SOCKET_IFNAME"], "eth1");
        assert_eq!(worker.env["NCCL_IB_HCA"], "=mlx5_0");
        assert_eq!(worker.env["NCCL_IB_GID_INDEX"], "3");
        assert_eq!(worker.env["VLLM_HOST_IP"], "10.0.0.2");
        assert!(!worker.env.contains_key("CUDA_VISIBLE_DEVICES"));
        assert!(worker.ports.is_empty());
        assert!(words(&launch, 1).ends_with("--headless"));
        let head_ports: Vec<u16> = launch.nodes[0].ports.iter().map(|p| p.port).collect();
        assert_eq!(head_ports, [29501, 8000]);
        assert_eq!(launch.endpoint, "http://10.0.0.1:8000");
    }

    #[test]
    fn vllm_refuses_a_replica_split_over_nodes_and_a_narrow_ep() {
        // DP 4 × TP 4 on two 8-GPU nodes: two local replicas per node.
        let dp = generate(&request(
            EngineKind::Vllm,
            Degrees {
                tp: 4,
                pp: 1,
                ep: 1,
                dp: 4,
            },
            false,
        ))
        .expect("DP 4 × TP 4 over two nodes");
        assert!(words(&dp, 1).contains("--data-parallel-size-local 2"));
        assert!(words(&dp, 1).contains("--data-parallel-start-rank 2"));
        assert!(words(&dp, 1).contains("--headless"));
        // DP 3 × TP 4 = 12 GPUs, 6 per node: a replica would straddle the nodes.
        let odd = request(
            EngineKind::Vllm,
            Degrees {
                tp: 4,
                pp: 1,
                ep: 1,
                dp: 3,
            },
            false,
        );
        let error = generate(&odd)
            .expect_err("TP 4 does not divide 6 GPUs per node")
            .to_string();
        assert!(error.contains("inside one node"), "{error}");
        let moe = request(
            EngineKind::Vllm,
            Degrees {
                tp: 4,
                pp: 1,
                ep: 2,
                dp: 4,
            },
            true,
        );
        let error = generate(&moe).expect_err("EP 2 of TP × DP 16").to_string();
        assert!(error.contains("TP × DP = 16"), "{error}");
    }

    #[test]
    fn sglang_spells_attention_dp_as_the_installed_version_does() {
        let p = Degrees {
            tp: 1,
            pp: 1,
            ep: 16,
            dp: 16,
        };
        let mut r = request(EngineKind::Sglang, p, true);
        let new = generate(&r).expect("launch");
        assert!(words(&new, 0).contains("--tp-size 16 --attn-dp-size 16 --ep-size 16"));
        assert!(!words(&new, 0).contains("--enable-dp-attention"));
        r.version = Version::parse("0.5.21");
        let old = generate(&r).expect("launch");
        assert!(words(&old, 0).contains("--tp-size 16 --dp-size 16 --enable-dp-attention"));
        assert!(old.notes.iter().any(|n| n.contains("0.5.23")));
        // The six ports SGLang derives above --dist-init-addr are the head's.
        let ports: Vec<u16> = new.nodes[0].ports.iter().map(|p| p.port).collect();
        assert!((20000..=20006).all(|p| ports.contains(&p)), "{ports:?}");
    }

    #[test]
    fn llamacpp_puts_rpc_servers_on_the_data_network() {
        let mut r = request(
            EngineKind::Llamacpp,
            Degrees {
                tp: 1,
                pp: 2,
                ep: 1,
                dp: 1,
            },
            false,
        );
        r.model = "/models/m.gguf".into();
        r.gpu = false;
        for node in &mut r.nodes {
            node.gpus.clear();
            node.gpus_on_host = 0;
        }
        let launch = generate(&r).expect("launch");
        assert_eq!(
            words(&launch, 1),
            "ggml-rpc-server --host 10.0.0.2 --port 50052 --threads 64"
        );
        assert!(words(&launch, 0).contains("--rpc 10.0.0.2:50052"));
        assert!(words(&launch, 0).contains("--n-gpu-layers 999"));
        assert!(launch.notes.iter().any(|n| n.contains("no authentication")));
        r.model = "org/model".into();
        assert!(generate(&r).is_err());
    }

    /// What `infer up --engine E --prefill 2 --decode 1 --tp 4` starts across two hosts:
    /// workers listen on every address and are reached at their hosts' addresses, the
    /// router on the first host's loopback (the launcher forwards it); workers sharing a
    /// host get their own GPUs and ports.
    #[test]
    fn a_disaggregated_launch_binds_the_router_apart_from_the_workers() {
        let worker = Degrees {
            tp: 4,
            pp: 1,
            ep: 1,
            dp: 1,
        };
        for engine in [EngineKind::Vllm, EngineKind::Sglang] {
            let mut base = request(engine, worker, false);
            for node in &mut base.nodes {
                node.gpus = (0..8).collect();
            }
            let layout = disagg::PdLayout {
                prefill: worker,
                prefill_workers: 2,
                decode: worker,
                decode_workers: 1,
            };
            let launch =
                disagg::generate_with_router_bind(&base, &layout, "127.0.0.1").expect("launch");
            let http = base.ports.http;
            assert_eq!(
                launch.endpoint,
                format!("http://127.0.0.1:{http}"),
                "{engine}"
            );
            let router = words(&launch, 0);
            assert!(
                router.contains(&format!("--host 127.0.0.1 --port {http}")),
                "{router}"
            );
            assert_eq!(launch.nodes[0].ports[0].bind, "127.0.0.1");
            // Two prefill workers on n0 (GPUs 0-3 and 4-7), the decode worker on n1.
            for (address, port) in [("10.0.0.1", 1), ("10.0.0.1", 2), ("10.0.0.2", 3)] {
                let worker = format!("http://{address}:{}", http + port);
                assert!(router.contains(&worker), "{engine}: {worker} in {router}");
            }
            let hosts: Vec<&str> = launch.nodes.iter().map(|n| n.host.as_str()).collect();
            assert_eq!(hosts, ["n0", "n0", "n0", "n1"], "{engine}");
            assert_eq!(launch.nodes[1].env["CUDA_VISIBLE_DEVICES"], "0,1,2,3");
            assert_eq!(launch.nodes[2].env["CUDA_VISIBLE_DEVICES"], "4,5,6,7");
            for index in 1..launch.nodes.len() {
                let line = words(&launch, index);
                assert!(line.contains("--host 0.0.0.0"), "{engine}: {line}");
            }
        }
    }

    #[test]
    fn shell_quoting_keeps_every_byte() {
        assert_eq!(shell_quote("--port"), "--port");
        assert_eq!(shell_quote("=eth0"), "=eth0");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("$(rm -rf /)"), "'$(rm -rf /)'");
        assert_eq!(shell_quote(""), "''");
    }
}
