//! `infer`'s own engine, launched node by node as torchrun launches: every node runs
//! `infer up --nnodes N --node-rank R --master-addr HEAD --master-port P` with the plan's
//! layout; node 0 hosts the rendezvous store and rank 0's HTTP server, each node starts its
//! share of the ranks (the world split evenly, in rank order).
//!
//! The nodes share one secret, `INFER_RUN_TOKEN`: it is never written into a script (each
//! script requires it from the environment). `infer up` shards experts over each replica's
//! TP group: an EP degree other than 1 or TP is refused, as are models that are not GGUF
//! files (what the ranks load).

use anyhow::{Result, bail};

use super::{EngineLaunch, EngineRequest, NodeLaunch, NodeRole, ReservedPort, Version, common_env};
use crate::degrees::Degrees;

/// `infer up`'s default HTTP port, and torchrun's `--master-port` default for the store.
pub(crate) const HTTP_PORT: u16 = 8000;
/// The rendezvous store's port on node 0 (`--master-port`; torchrun's default).
pub(crate) const STORE_PORT: u16 = 29500;

/// One `infer up` line per node.
///
/// Errors: EP other than 1 or TP, a model that is not a `.gguf` path, nodes with different
/// numbers of ranks.
pub(crate) fn generate(request: &EngineRequest) -> Result<EngineLaunch> {
    generate_with_roles(request, None)
}

/// [`generate`], with `roles` (prefill, decode replicas, whose sum is `request.parallel.dp`)
/// given as `--prefill/--decode` instead of `--dp`.
fn generate_with_roles(
    request: &EngineRequest,
    roles: Option<(usize, usize)>,
) -> Result<EngineLaunch> {
    check_layout(request)?;
    let version = Version::parse(env!("CARGO_PKG_VERSION")).unwrap_or(Version(0, 0, 0));
    let nodes = (0..request.nodes.len())
        .map(|rank| node_launch(request, roles, rank))
        .collect();
    Ok(super::assemble(
        request,
        version,
        None,
        nodes,
        notes(request),
    ))
}

/// Checks that `infer up` can run the layout. Errors: EP other than 1 or TP, a model that
/// is not a `.gguf` path, ranks that do not split evenly over the nodes.
fn check_layout(request: &EngineRequest) -> Result<()> {
    let p = request.parallel;
    if p.ep > 1 && p.ep != p.tp {
        bail!(
            "infer's engine shards experts over each replica's TP group; the layout has EP {} with TP {}\nhint: plan \
             with `--ep {}` or `--ep 1`",
            p.ep,
            p.tp,
            p.tp
        );
    }
    if !request.model.ends_with(".gguf") {
        bail!(
            "infer's ranks load GGUF files; `{}` is not one\nhint: give `--engine-model /path/model.gguf` (the same path \
             on every node)",
            request.model
        );
    }
    let nnodes = request.nodes.len();
    let world = p.world_size();
    if !world.is_multiple_of(nnodes) {
        bail!(
            "`infer up --nnodes` runs the same number of ranks on every node; {world} ranks do not split over {nnodes} nodes"
        );
    }
    Ok(())
}

/// The `infer up` line of node `rank`: the layout's flags, HTTP on node 0, and
/// `--nnodes/--node-rank/--master-*/--bind-addr` over several nodes (node 0 reserving the
/// store's port).
fn node_launch(request: &EngineRequest, roles: Option<(usize, usize)>, rank: usize) -> NodeLaunch {
    let nnodes = request.nodes.len();
    let head = &request.nodes[0];
    let node = &request.nodes[rank];
    let mut argv = layout_argv(request, roles);
    let mut ports = Vec::new();
    if rank == 0 {
        super::serve_http(request, &mut argv, &mut ports);
    }
    if nnodes > 1 {
        argv.extend([
            "--nnodes".into(),
            nnodes.to_string(),
            "--node-rank".into(),
            rank.to_string(),
            "--master-addr".into(),
            head.address.clone(),
            "--master-port".into(),
            request.ports.dist.to_string(),
        ]);
        // The node's data address, where its ranks' collectives listen (else
        // `infer up` takes the address of its route to node 0).
        if node.address.parse::<std::net::IpAddr>().is_ok() {
            argv.extend(["--bind-addr".into(), node.address.clone()]);
        }
        if rank == 0 {
            ports.push(ReservedPort {
                port: request.ports.dist,
                bind: head.address.clone(),
                purpose: "the rendezvous store (--master-port)".into(),
            });
        }
    }
    NodeLaunch {
        host: node.host.clone(),
        node_rank: rank,
        role: NodeRole::of(rank),
        argv,
        env: common_env(request, node),
        ports,
        pd: None,
    }
}

/// The flags every node's `infer up` shares: the model, the degrees (`roles` as
/// `--prefill/--decode`, else `--dp`), the device, the served name and the context in
/// tokens.
fn layout_argv(request: &EngineRequest, roles: Option<(usize, usize)>) -> Vec<String> {
    let p = request.parallel;
    let mut argv: Vec<String> = vec![
        "infer".into(),
        "up".into(),
        "--model".into(),
        request.model.clone(),
        "--tp".into(),
        p.tp.to_string(),
        "--pp".into(),
        p.pp.to_string(),
    ];
    match roles {
        Some((prefill, decode)) => argv.extend([
            "--prefill".into(),
            prefill.to_string(),
            "--decode".into(),
            decode.to_string(),
        ]),
        None => argv.extend(["--dp".into(), p.dp.to_string()]),
    }
    if p.ep > 1 {
        argv.extend(["--ep".into(), p.ep.to_string()]);
    }
    argv.extend([
        "--device".into(),
        if request.gpu { "cuda" } else { "cpu" }.into(),
    ]);
    if let Some(name) = &request.served_model_name {
        argv.extend(["--served-model-name".into(), name.clone()]);
    }
    if request.max_model_len_tokens > 0 {
        argv.extend([
            "--max-model-len".into(),
            request.max_model_len_tokens.to_string(),
        ]);
    }
    argv
}

/// The launch's notes: the shared [`crate::envvars::RUN_TOKEN`] over several nodes, and what
/// `--device cuda` means for the ranks.
fn notes(request: &EngineRequest) -> Vec<String> {
    let nnodes = request.nodes.len();
    let mut notes = Vec::new();
    if nnodes > 1 {
        let token = crate::envvars::RUN_TOKEN;
        notes.push(format!(
            "every node needs the same `{token}` in its environment (e.g. `export {token}=$(openssl rand \
             -hex 16)` once, copied to each node): node 0's store admits only ranks that present it"
        ));
    }
    if request.gpu {
        notes.push(
            "`--device cuda`: infer's rank processes run on CPU in this build (`infer up --device cuda` serves one process on \
             one GPU, and exits 2 when ranks are asked for); the same lines with `--device cpu` run CPU ranks"
                .to_string(),
        );
    }
    notes
}

/// The planner's disaggregated deployment as `infer up --prefill N --decode M` lines: its
/// workers become prefill and decode replicas of one TP × PP shape (infer's ranks move KV
/// shard to shard), on as many of the hosts as their GPUs need (`request.nodes` holds every
/// host with all its GPUs, [`super::disagg::use_every_gpu`]).
///
/// Errors: prefill and decode workers of different shapes, ranks that do not split evenly
/// over whole hosts, and [`generate`]'s.
pub(crate) fn generate_disaggregated(
    request: &EngineRequest,
    layout: &super::disagg::PdLayout,
) -> Result<EngineLaunch> {
    let a = layout.one_shape()?;
    let (prefill, decode) = (layout.prefill_workers, layout.decode_workers);
    let world = (prefill + decode) * a.replica_size();
    let per_host = request.nodes.first().map_or(0, |n| n.gpus_on_host);
    let mut pd = request.clone();
    pd.parallel = Degrees {
        dp: prefill + decode,
        ..a
    };
    if request.gpu && per_host > 0 {
        let hosts = world.div_ceil(per_host);
        if hosts > pd.nodes.len() {
            bail!(
                "{world} ranks need {hosts} hosts of {per_host} GPUs; the cluster has {}",
                pd.nodes.len()
            );
        }
        pd.nodes.truncate(hosts);
    }
    generate_with_roles(&pd, Some((prefill, decode)))
}
