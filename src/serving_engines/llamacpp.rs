//! llama.cpp: `llama-server` on the head; on every other node `ggml-rpc-server` (llama.cpp's
//! RPC backend server, `tools/rpc`), which exposes the node's devices to the head: the
//! model's layers are split over the head's GPUs and the RPC devices, a pipeline over hosts.
//!
//! llama.cpp has no tensor parallelism across hosts, no expert parallelism and one replica
//! per server: those layouts are refused. Inside one node, TP > 1 becomes `--split-mode
//! row`. The RPC protocol has no authentication and is meant for private networks only
//! (llama.cpp's `tools/rpc/README.md`): each RPC server binds its data-network address,
//! never `0.0.0.0`.

use anyhow::{Result, bail};

use super::{
    EngineLaunch, EngineRequest, NodeLaunch, NodeNet, NodeRole, ReservedPort, Version, assemble,
    common_env,
};

/// All layers to the devices (the head's GPUs and the RPC servers).
const ALL_LAYERS: &str = "999";

/// The `llama-server` line for the head and a `ggml-rpc-server` line for every other node.
///
/// Errors: DP, EP, TP across hosts, a model that is not a GGUF file.
pub(crate) fn generate(request: &EngineRequest) -> Result<EngineLaunch> {
    let nodes = request.nodes.len();
    check_layout(request)?;
    let mut launches = vec![head_launch(request)];
    for (i, node) in request.nodes.iter().enumerate().skip(1) {
        launches.push(rpc_server_launch(request, i, node));
    }
    launches[0].env.remove("HF_HUB_OFFLINE");
    let mut notes = Vec::new();
    if nodes > 1 {
        notes.push(format!(
            "the RPC servers accept anyone who reaches port {} (llama.cpp's RPC has no authentication): they bind the data \
             network only; keep it private",
            request.ports.dist
        ));
    }
    Ok(assemble(
        request,
        request.version.unwrap_or(Version(0, 0, 0)),
        None,
        launches,
        notes,
    ))
}

/// Checks that llama.cpp can serve the layout. Errors: DP, EP, TP across hosts, a model
/// that is not a GGUF file.
fn check_layout(request: &EngineRequest) -> Result<()> {
    let p = request.parallel;
    let nodes = request.nodes.len();
    if p.dp > 1 {
        bail!(
            "llama.cpp serves one replica per `llama-server`; the layout has {} (DP)\nhint: plan with `--dp 1`, or run \
             one `infer up --engine llamacpp` per replica behind a load balancer",
            p.dp
        );
    }
    if p.ep > 1 {
        bail!(
            "llama.cpp has no expert parallelism (the layout has EP {}): plan with `--ep 1`",
            p.ep
        );
    }
    if p.tp > 1 && nodes > 1 {
        bail!(
            "llama.cpp splits a model over hosts by layers only (RPC); the layout has TP {} across {nodes} hosts\nhint: \
             plan with `--tp 1` across hosts (PP), or keep the model on one host",
            p.tp
        );
    }
    if !request.model.ends_with(".gguf") {
        bail!(
            "llama.cpp loads GGUF files; `{}` is not one\nhint: give `--model` a `.gguf` path that exists on the head host",
            request.model
        );
    }
    Ok(())
}

/// The head's `llama-server` line: the model, HTTP, the context in tokens, every layer on
/// the devices (its GPUs and the RPC servers), `--split-mode row` for TP, and the alias.
fn head_launch(request: &EngineRequest) -> NodeLaunch {
    let p = request.parallel;
    let head = &request.nodes[0];
    let rpc: Vec<String> = request.nodes[1..]
        .iter()
        .map(|n| format!("{}:{}", n.address, request.ports.dist))
        .collect();
    let mut argv: Vec<String> = vec![
        "llama-server".into(),
        "--model".into(),
        request.model.clone(),
        "--host".into(),
        request.http_host.clone(),
        "--port".into(),
        request.ports.http.to_string(),
        // `/metrics` (Prometheus): requests processing and tokens predicted, which the
        // launcher watches for forward progress.
        "--metrics".into(),
    ];
    if request.max_model_len_tokens > 0 {
        argv.extend([
            "--ctx-size".into(),
            request.max_model_len_tokens.to_string(),
        ]);
    }
    if request.gpu || !rpc.is_empty() {
        argv.extend(["--n-gpu-layers".into(), ALL_LAYERS.into()]);
    } else {
        argv.extend(["--n-gpu-layers".into(), "0".into()]);
    }
    if request.gpu && p.tp > 1 {
        argv.extend(["--split-mode".into(), "row".into()]);
    }
    if !rpc.is_empty() {
        argv.extend(["--rpc".into(), rpc.join(",")]);
    }
    if let Some(name) = &request.served_model_name {
        argv.extend(["--alias".into(), name.clone()]);
    }
    NodeLaunch {
        host: head.host.clone(),
        node_rank: 0,
        role: NodeRole::Head,
        argv,
        env: common_env(request, head),
        ports: vec![ReservedPort {
            port: request.ports.http,
            bind: request.http_host.clone(),
            purpose: "OpenAI-compatible HTTP API".into(),
        }],
        pd: None,
    }
}

/// Node `i`'s `ggml-rpc-server` line, bound to its data-network address (RPC has no
/// authentication), with its CPU threads when it has no GPU.
fn rpc_server_launch(request: &EngineRequest, i: usize, node: &NodeNet) -> NodeLaunch {
    let mut argv: Vec<String> = vec![
        "ggml-rpc-server".into(),
        "--host".into(),
        node.address.clone(),
        "--port".into(),
        request.ports.dist.to_string(),
    ];
    if !request.gpu && node.cpus > 0 {
        // Its CPU device runs one thread unless told (`ggml-rpc-server --help`).
        argv.extend(["--threads".into(), node.cpus.to_string()]);
    }
    let mut env = common_env(request, node);
    env.remove("HF_HUB_OFFLINE");
    NodeLaunch {
        host: node.host.clone(),
        node_rank: i,
        role: NodeRole::Worker,
        argv,
        env,
        ports: vec![ReservedPort {
            port: request.ports.dist,
            bind: node.address.clone(),
            purpose: "llama.cpp RPC server (unauthenticated: data network only)".into(),
        }],
        pd: None,
    }
}
