//! `python3 -m sglang.launch_server` lines for a layout. Every node runs the same line with
//! its `--node-rank`; `--dist-init-addr HEAD:PORT` is where they meet.
//!
//! SGLang counts parallelism differently from vLLM: `--tp-size` is the whole world of one
//! server across nodes. A dense layout maps as is (`--tp-size TP --pp-size PP`, `--dp-size
//! DP` inside one node). A MoE layout with DP is DeepSeek-style attention data parallelism:
//! `--tp-size TP·DP` with an attention-DP width of DP — spelled `--attn-dp-size DP` from
//! SGLang 0.5.22, `--dp-size DP --enable-dp-attention` before (0.5.21's parser has no
//! `--attn-dp-size`) — and `--ep-size EP`, with `--moe-a2a-backend deepep` when an EP group
//! spans nodes.
//!
//! Ports (source: SGLang 0.5.23 `srt/server_args.py`, `PortArgs.init_new`): with attention
//! DP the head binds the `--dist-init-addr` port and the six after it (the ZMQ ports
//! SGLang derives from it); `--nccl-port` is set so that it is known and checked.

use anyhow::{Result, bail};

use super::{
    EngineLaunch, EngineRequest, NodeLaunch, NodeRole, ReservedPort, SGLANG_TESTED, Version,
    assemble, common_env, dtype_flags, serve_http,
};

/// The first SGLang with `--attn-dp-size` (its 0.5.21 wheel has no such flag).
const ATTN_DP_SIZE_SINCE: Version = Version(0, 5, 22);

/// Ports SGLang derives above the `--dist-init-addr` port with attention DP (`port_base`
/// and five more, `PortArgs.init_new`).
const DERIVED_PORTS: u16 = 6;

/// The launch line and environment of every node.
///
/// Errors: dense data parallelism across nodes (SGLang runs that as separate servers behind
/// its router), EP without a MoE model.
pub(crate) fn generate(request: &EngineRequest) -> Result<EngineLaunch> {
    let tested = Version::parse(SGLANG_TESTED).unwrap_or(Version(0, 0, 0));
    let version = request.version.unwrap_or(tested);
    check_layout(request)?;
    let common = common_argv(request, version);
    let launches = (0..request.nodes.len())
        .map(|i| node_launch(request, &common, i))
        .collect();
    Ok(assemble(
        request,
        version,
        Some(("SGLang", SGLANG_TESTED)),
        launches,
        Vec::new(),
    ))
}

/// Whether the layout is DeepSeek-style attention data parallelism (a MoE model with DP).
fn attention_dp(request: &EngineRequest) -> bool {
    request.is_moe && request.parallel.dp > 1
}

/// Checks that one SGLang server can run the layout. Errors: dense data parallelism across
/// nodes, EP without a MoE model.
fn check_layout(request: &EngineRequest) -> Result<()> {
    let p = request.parallel;
    let nodes = request.nodes.len();
    if p.dp > 1 && !request.is_moe && nodes > 1 {
        bail!(
            "SGLang serves a dense model's {} replicas across nodes as separate servers behind `sglang-router`; one \
             `launch_server` cannot\nhint: use `--engine vllm` for this layout, or plan one node per replica group",
            p.dp
        );
    }
    if p.ep > 1 && !request.is_moe {
        bail!("expert parallelism needs a mixture-of-experts model");
    }
    Ok(())
}

/// The launch arguments every node shares: the model, the degrees as SGLang counts them
/// (attention DP spelled for `version`), expert parallelism's backend, dtypes, the context
/// in tokens and the served name.
fn common_argv(request: &EngineRequest, version: Version) -> Vec<String> {
    let p = request.parallel;
    let attention_dp = attention_dp(request);
    let tp_size = if attention_dp { p.tp * p.dp } else { p.tp };
    let mut common: Vec<String> = vec![
        "python3".into(),
        "-m".into(),
        "sglang.launch_server".into(),
        "--model-path".into(),
        request.model.clone(),
        "--tp-size".into(),
        tp_size.to_string(),
    ];
    if p.pp > 1 {
        common.extend(["--pp-size".into(), p.pp.to_string()]);
    }
    if attention_dp {
        if version >= ATTN_DP_SIZE_SINCE {
            common.extend(["--attn-dp-size".into(), p.dp.to_string()]);
        } else {
            common.extend([
                "--dp-size".into(),
                p.dp.to_string(),
                "--enable-dp-attention".into(),
            ]);
        }
    } else if p.dp > 1 {
        common.extend(["--dp-size".into(), p.dp.to_string()]);
    }
    if p.ep > 1 {
        common.extend(["--ep-size".into(), p.ep.to_string()]);
        if request.ep_crosses_hosts {
            common.extend(["--moe-a2a-backend".into(), "deepep".into()]);
        }
    }
    dtype_flags(request, &mut common, true);
    if request.max_model_len_tokens > 0 {
        common.extend([
            "--context-length".into(),
            request.max_model_len_tokens.to_string(),
        ]);
    }
    if let Some(name) = &request.served_model_name {
        common.extend(["--served-model-name".into(), name.clone()]);
    }
    common
}

/// Node `i`'s launch: the shared arguments plus `--nnodes/--node-rank/--dist-init-addr`
/// over several nodes and `--nccl-port`; the head serves HTTP and reserves the ports.
fn node_launch(request: &EngineRequest, common: &[String], i: usize) -> NodeLaunch {
    let nodes = request.nodes.len();
    let head = &request.nodes[0];
    let node = &request.nodes[i];
    let dist_init = format!("{}:{}", head.address, request.ports.dist);
    let mut argv = common.to_vec();
    let mut ports = Vec::new();
    if nodes > 1 {
        argv.extend([
            "--nnodes".into(),
            nodes.to_string(),
            "--node-rank".into(),
            i.to_string(),
            "--dist-init-addr".into(),
            dist_init,
        ]);
    }
    argv.extend(["--nccl-port".into(), request.ports.nccl.to_string()]);
    if i == 0 {
        head_ports(request, &mut argv, &mut ports);
    }
    let mut env = common_env(request, node);
    if nodes > 1 && node.address.parse::<std::net::IpAddr>().is_ok() {
        env.insert("SGLANG_HOST_IP".into(), node.address.clone());
    }
    NodeLaunch {
        host: node.host.clone(),
        node_rank: i,
        role: NodeRole::of(i),
        argv,
        env,
        ports,
        pd: None,
    }
}

/// The head's HTTP flags and reserved ports: HTTP, `--nccl-port`, the `--dist-init-addr`
/// port (over several nodes or with attention DP), and the ports SGLang derives from it
/// with attention DP.
fn head_ports(request: &EngineRequest, argv: &mut Vec<String>, ports: &mut Vec<ReservedPort>) {
    let nodes = request.nodes.len();
    let head = &request.nodes[0];
    let attention_dp = attention_dp(request);
    serve_http(request, argv, ports);
    ports.push(ReservedPort {
        port: request.ports.nccl,
        bind: "0.0.0.0".into(),
        purpose: "torch.distributed (--nccl-port)".into(),
    });
    if nodes > 1 || attention_dp {
        ports.push(ReservedPort {
            port: request.ports.dist,
            bind: head.address.clone(),
            purpose: "distributed init (--dist-init-addr)".into(),
        });
    }
    if attention_dp {
        for k in 1..=DERIVED_PORTS {
            ports.push(ReservedPort {
                port: request.ports.dist.saturating_add(k),
                bind: head.address.clone(),
                purpose: format!("SGLang ZMQ port derived from --dist-init-addr (+{k})"),
            });
        }
    }
}
