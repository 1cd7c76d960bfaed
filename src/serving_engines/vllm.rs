//! `vllm serve` lines for a layout, without Ray: the multiprocessing executor on every
//! node.
//!
//! - TP × PP over several nodes: every node runs the same line with `--nnodes N
//!   --node-rank i --master-addr HEAD --master-port P`, the others with `--headless` (no API
//!   server). vLLM splits the world evenly: node `i` holds global ranks `[i·L, (i+1)·L)`.
//! - DP (each replica inside one node): `--data-parallel-size D --data-parallel-size-local
//!   L --data-parallel-address HEAD --data-parallel-rpc-port P`, the other nodes
//!   `--headless --data-parallel-start-rank i·L`.
//! - MoE: `--enable-expert-parallel` makes the experts' group TP × DP wide; an EP group that
//!   spans nodes also gets `--all2all-backend` (DeepEP: low-latency kernels for the latency
//!   objective, high-throughput ones otherwise).
//!
//! Source: vLLM 0.33.0 `vllm/engine/arg_utils.py` (the flags, `_set_data_parallel…` rules)
//! and `vllm/entrypoints/cli/serve.py` (`--headless` refuses `--api-server-count`; we never
//! write it).

use anyhow::{Result, bail};

use super::{
    EngineLaunch, EngineRequest, NodeLaunch, NodeRole, ReservedPort, VLLM_TESTED, Version,
    assemble, common_env, dtype_flags, serve_http,
};
use crate::plan::Objective;

/// The `vllm serve` line and environment of every node.
///
/// Errors: an EP degree other than TP × DP (vLLM's only one), a DP replica split over
/// nodes.
pub(crate) fn generate(request: &EngineRequest) -> Result<EngineLaunch> {
    let tested = Version::parse(VLLM_TESTED).unwrap_or(Version(0, 0, 0));
    let version = request.version.unwrap_or(tested);
    let p = request.parallel;
    check_layout(request)?;
    let replica = p.replica_size();
    let per_node = request.nodes[0].gpus.len().max(1);
    let common = common_argv(request);
    let dp_local = if p.dp > 1 { per_node / replica } else { 0 };
    let launches = (0..request.nodes.len())
        .map(|i| node_launch(request, &common, i, dp_local))
        .collect();
    Ok(assemble(
        request,
        version,
        Some(("vLLM", VLLM_TESTED)),
        launches,
        Vec::new(),
    ))
}

/// Checks that vLLM can run the layout. Errors: an EP degree other than TP × DP, or a DP
/// replica (TP × PP GPUs) that does not fit evenly inside one node.
fn check_layout(request: &EngineRequest) -> Result<()> {
    let p = request.parallel;
    let nodes = request.nodes.len();
    let head = &request.nodes[0];
    if p.ep > 1 && p.ep != p.tp * p.dp {
        bail!(
            "vLLM's expert parallelism spans TP × DP = {} ranks, but the plan's EP is {}\nhint: pin `--ep {}` (or `--ep 1`: experts sharded by TP) when planning for vLLM",
            p.tp * p.dp,
            p.ep,
            p.tp * p.dp
        );
    }
    let replica = p.replica_size();
    let per_node = head.gpus.len().max(1);
    if p.dp > 1 && nodes > 1 && (replica > per_node || !per_node.is_multiple_of(replica)) {
        bail!(
            "vLLM's data-parallel launch keeps each replica (TP × PP = {replica} GPUs) inside one node, but each node gives \
             the layout {per_node}\nhint: plan with `--dp 1` (one replica over the nodes), or a TP × PP that divides the GPUs of a node"
        );
    }
    Ok(())
}

/// The `vllm serve` arguments every node shares: the model, the degrees, expert
/// parallelism's backend, dtypes, the context in tokens, memory and the served name.
fn common_argv(request: &EngineRequest) -> Vec<String> {
    let p = request.parallel;
    let mut common: Vec<String> = vec![
        "vllm".into(),
        "serve".into(),
        request.model.clone(),
        "--tensor-parallel-size".into(),
        p.tp.to_string(),
    ];
    if p.pp > 1 {
        common.extend(["--pipeline-parallel-size".into(), p.pp.to_string()]);
    }
    if p.dp > 1 {
        common.extend(["--data-parallel-size".into(), p.dp.to_string()]);
    }
    if p.ep > 1 {
        common.push("--enable-expert-parallel".into());
        if request.ep_crosses_hosts {
            common.extend([
                "--all2all-backend".into(),
                match request.objective {
                    Objective::Latency => "deepep_low_latency",
                    Objective::Throughput | Objective::Cost => "deepep_high_throughput",
                }
                .into(),
            ]);
        }
    }
    dtype_flags(request, &mut common, false);
    if request.max_model_len_tokens > 0 {
        common.extend([
            "--max-model-len".into(),
            request.max_model_len_tokens.to_string(),
        ]);
    }
    common.extend([
        "--gpu-memory-utilization".into(),
        request.gpu_memory_utilization.to_string(),
    ]);
    if let Some(name) = &request.served_model_name {
        common.extend(["--served-model-name".into(), name.clone()]);
    }
    common
}

/// Node `i`'s launch: the shared arguments plus its place in the multi-node (or
/// data-parallel) launch, the HTTP server on the head, and `VLLM_HOST_IP`. `dp_local`:
/// DP replicas per node (0 without DP).
fn node_launch(
    request: &EngineRequest,
    common: &[String],
    i: usize,
    dp_local: usize,
) -> NodeLaunch {
    let node = &request.nodes[i];
    let role = if i == 0 {
        NodeRole::Head
    } else {
        NodeRole::Worker
    };
    let mut argv = common.to_vec();
    let mut ports = Vec::new();
    if request.nodes.len() > 1 {
        multi_node_flags(request, i, dp_local, &mut argv, &mut ports);
    }
    if i == 0 {
        serve_http(request, &mut argv, &mut ports);
    }
    let mut env = common_env(request, node);
    if request.nodes.len() > 1 && node.address.parse::<std::net::IpAddr>().is_ok() {
        // Unset, vLLM takes the address of whatever interface routes to the internet.
        env.insert("VLLM_HOST_IP".into(), node.address.clone());
    }
    NodeLaunch {
        host: node.host.clone(),
        node_rank: i,
        role,
        argv,
        env,
        ports,
        pd: None,
    }
}

/// Node `i`'s flags in a launch over several nodes: the data-parallel address and start
/// rank with DP, else torch.distributed's `--nnodes/--node-rank/--master-*`; `--headless`
/// off the head. The head reserves the rendezvous port.
fn multi_node_flags(
    request: &EngineRequest,
    i: usize,
    dp_local: usize,
    argv: &mut Vec<String>,
    ports: &mut Vec<ReservedPort>,
) {
    let p = request.parallel;
    let nodes = request.nodes.len();
    let head = &request.nodes[0];
    if p.dp > 1 {
        argv.extend([
            "--data-parallel-size-local".into(),
            dp_local.to_string(),
            "--data-parallel-address".into(),
            head.address.clone(),
            "--data-parallel-rpc-port".into(),
            request.ports.dist.to_string(),
        ]);
        if i > 0 {
            argv.extend([
                "--data-parallel-start-rank".into(),
                (i * dp_local).to_string(),
            ]);
        } else {
            ports.push(ReservedPort {
                port: request.ports.dist,
                bind: head.address.clone(),
                purpose: "data-parallel RPC (--data-parallel-rpc-port)".into(),
            });
        }
    } else {
        argv.extend([
            "--nnodes".into(),
            nodes.to_string(),
            "--node-rank".into(),
            i.to_string(),
            "--master-addr".into(),
            head.address.clone(),
            "--master-port".into(),
            request.ports.dist.to_string(),
        ]);
        if i == 0 {
            ports.push(ReservedPort {
                port: request.ports.dist,
                bind: head.address.clone(),
                purpose: "torch.distributed rendezvous (--master-port)".into(),
            });
        }
    }
    if i > 0 {
        argv.push("--headless".into());
    }
}

/// The address clients use: the data address when the server binds every interface.
pub(super) fn endpoint_host(bind: &str, address: &str) -> String {
    if bind == "0.0.0.0" || bind == "::" {
        address.to_string()
    } else {
        bind.to_string()
    }
}
