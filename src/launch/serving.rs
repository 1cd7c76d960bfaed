//! `infer up` as a launcher: the layout (flags, a saved plan, a plan made for a cluster, or
//! an inventory's hosts), then one `infer rank` per rank — on this host or on the
//! inventory's hosts over SSH — whose rank 0 serves; watched until Ctrl-C/SIGTERM or until a
//! rank fails. One rank and no inventory: the engine is served from this process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::events::{UpEvent, watch_signals};
use super::up_settings::{NodeSettings, UpSettings};
use super::{Gang, LaunchSpec, Progress};
use crate::degrees::Degrees;
use crate::model;
use crate::runtime::exec::rank_env::{HostEnv, ServingEnv};
use crate::runtime::exec::worker::Job;
use crate::serve::http::OneProcessEvent;

/// Serves until Ctrl-C or SIGTERM (then returns `Ok`), or until a rank fails.
///
/// Errors: bad layouts or inputs, an address that cannot be bound, preflight failures on
/// an inventory's hosts, a rank that fails (named, with its host and last log lines).
pub(crate) fn up(settings: &UpSettings, events: &mut dyn FnMut(UpEvent)) -> Result<()> {
    let started = Instant::now();
    let layout = resolve_layout(settings, events)?;
    if let Some(node) = &settings.node
        && !layout.world_size().is_multiple_of(node.nnodes)
    {
        bail!(
            "--nnodes {} does not divide the world of {} ranks (dp {} × pp {} × tp {}): every node runs the same number of ranks",
            node.nnodes,
            layout.world_size(),
            layout.degrees.dp,
            layout.degrees.pp,
            layout.degrees.tp
        );
    }
    // Only node 0 serves HTTP (rank 0 runs there).
    if settings.node.as_ref().is_none_or(|n| n.node_rank == 0) {
        crate::serve::http::check_bind(&settings.host, settings.port)?;
        super::events::warn_if_exposed(&settings.host, settings.api_key.as_deref(), events);
    }
    // A supervised run restarts rank processes, even a single one.
    let ranks = layout.world_size() > 1
        || inventory(settings).is_some()
        || settings.node.is_some()
        || settings.max_restarts > 0;
    if ranks {
        return launch(settings, &layout, started, events);
    }
    crate::serve::http::serve_one_process(
        &crate::serve::http::OneProcess {
            model: &settings.model,
            gpu: settings.gpu.as_ref(),
            model_id: &settings.model_id,
            host: &settings.host,
            port: settings.port,
            threads: settings.threads,
            numerics: settings.numerics,
            limits: settings.limits,
            kv_cache_tokens: settings.kv_cache_tokens,
            prefix_cache: settings.prefix_cache,
            api_key: settings.api_key.clone(),
            protect_metrics: settings.protect_metrics,
            max_model_len: settings.max_model_len,
            shutdown_timeout: settings.shutdown_timeout,
            stall_timeout: settings.stall_timeout,
            max_queued_requests: settings.max_queued_requests,
        },
        &mut |event| match event {
            OneProcessEvent::Note(line) => events(UpEvent::Note(line)),
            OneProcessEvent::Listening(address) => events(UpEvent::Listening(address)),
            OneProcessEvent::Ready(address) => events(UpEvent::Ready {
                address: address.to_string(),
                world_size: 1,
                layout: "one process".into(),
                ready_secs: started.elapsed().as_secs_f64(),
            }),
        },
    )
}

/// The inventory `--cluster` names, when it names one (ranks then run on its hosts).
fn inventory(settings: &UpSettings) -> Option<PathBuf> {
    settings
        .cluster
        .as_deref()
        .filter(|c| crate::inventory::is_inventory(c))
        .map(PathBuf::from)
}

/// The parallel layout to launch.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Layout {
    degrees: Degrees,
    /// Where it came from: the flags, a plan file, or a plan for a cluster.
    from: String,
    /// Prefill/decode disaggregation: the first this many of the `dp` replicas prefill,
    /// the others decode (`--prefill/--decode`, or a plan's disaggregated deployment).
    pd_prefill: Option<usize>,
    /// A plan's GPU for each rank (its `cuda_visible_devices`, indexed by rank): where
    /// `--device cuda` ranks compute.
    gpus: Option<Vec<String>>,
    /// A plan's host of each rank (indexed by rank), on an inventory's hosts.
    planned_hosts: Option<Vec<String>>,
}

impl Layout {
    fn world_size(&self) -> usize {
        self.degrees.world_size()
    }
}

/// The layout from `--tp/--pp/--dp/--ep`, a saved `--plan`, or a plan made for `--cluster`
/// (one of them: [`super::up_settings::layout`] checked).
///
/// Errors: a degree of 0, an unreadable or malformed plan, an infeasible
/// plan, a plan file spanning several hosts (their inventory is needed), `--ep` other than
/// 1 or `--tp`.
fn resolve_layout(settings: &UpSettings, events: &mut dyn FnMut(UpEvent)) -> Result<Layout> {
    let args = settings;
    let pinned = args.pins.any();
    let inventory = inventory(settings);
    let layout = if let Some(file) = inventory.as_ref().filter(|_| !pinned) {
        // An inventory without pinned degrees: the plan for its hosts (their GPUs, or the
        // CPU ranks they take), each rank on the host the plan put it on.
        let spec = model::spec_of(&settings.model)?;
        let cluster = inventory_cluster(file, settings, events)?;
        match crate::plan::plan(&spec, &cluster, &crate::plan::Settings::default()) {
            crate::plan::Outcome::Feasible(plan) => {
                let layout = Layout {
                    degrees: plan.parallel,
                    from: format!("the plan for `{}`", file.display()),
                    pd_prefill: None,
                    gpus: None,
                    planned_hosts: Some(by_rank(&plan, |r| &r.host)),
                };
                events(UpEvent::Note(format!(
                    "the plan for `{}`: tp {} × pp {} × dp {} (ep {}), {} ranks over its hosts",
                    file.display(),
                    layout.degrees.tp,
                    layout.degrees.pp,
                    layout.degrees.dp,
                    layout.degrees.ep,
                    layout.world_size()
                )));
                layout
            }
            crate::plan::Outcome::Infeasible(infeasible) => bail!(
                "no layout fits the model on this cluster:\n{}",
                crate::plan::render::render_infeasible(&infeasible, false)
            ),
        }
    } else if let Some(file) = &args.plan {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the plan `{}`", file.display()))?;
        let plan: crate::plan::Plan = serde_json::from_str(&text).with_context(|| {
            format!(
                "`{}` is not a plan; write one with `infer plan --json > plan.json`",
                file.display()
            )
        })?;
        layout_of(&plan, &format!("the plan `{}`", file.display()), events)?
    } else if let Some(cluster) = args.cluster.as_ref().filter(|_| inventory.is_none()) {
        let spec = model::spec_of(&settings.model)?;
        let cluster = crate::inventory::load(cluster, std::path::Path::new("/sys"))?;
        match crate::plan::plan(&spec, &cluster, &crate::plan::Settings::default()) {
            crate::plan::Outcome::Feasible(plan) => {
                layout_of(&plan, &format!("the plan for `{}`", plan.cluster), events)?
            }
            crate::plan::Outcome::Infeasible(infeasible) => bail!(
                "no layout fits the model on this cluster:\n{}",
                crate::plan::render::render_infeasible(&infeasible, false)
            ),
        }
    } else {
        Layout {
            degrees: args.pins.or_one(),
            from: match &inventory {
                Some(file) => format!("the --tp/--pp/--dp/--ep flags on `{}`", file.display()),
                None => "the --tp/--pp/--dp/--ep flags".into(),
            },
            pd_prefill: args.pd_prefill,
            gpus: None,
            planned_hosts: None,
        }
    };
    if layout.degrees.check().is_err() {
        bail!("--tp, --pp, --dp and --ep must be at least 1");
    }
    if layout.degrees.ep > 1 && layout.degrees.ep != layout.degrees.tp {
        bail!(
            "--ep {} must be 1 or equal --tp ({}): `infer up` shards experts over each replica's TP group",
            layout.degrees.ep,
            layout.degrees.tp
        );
    }
    Ok(layout)
}

/// The inventory `file` as the planner sees it, each CPU-rank host with its own CPU probed
/// there over SSH by its agent (as `infer plan --probe-hosts` does): the hosts' processors,
/// cores and memory bandwidth need not be this one's.
///
/// Errors: an unreadable or malformed inventory; a CPU-rank host that cannot be reached or
/// probed (named).
fn inventory_cluster(
    file: &Path,
    settings: &UpSettings,
    events: &mut dyn FnMut(UpEvent),
) -> Result<crate::plan::cluster::Cluster> {
    let mut cluster = crate::inventory::load(&file.display().to_string(), Path::new("/sys"))?;
    if cluster.hosts.iter().any(|h| h.cpu.is_some()) {
        events(UpEvent::Note(format!(
            "probing the CPU of each host of `{}` over SSH to plan for them",
            file.display()
        )));
        let probed = super::survey::probe_cpus(file, settings.ssh, &mut |_| {})?;
        crate::plan::cluster::use_probed_cpus(&mut cluster, &probed)?;
    }
    Ok(cluster)
}

/// `field` of each of `plan`'s ranks, indexed by rank (its host, its GPUs).
fn by_rank(
    plan: &crate::plan::Plan,
    field: fn(&crate::plan::layout::RankPlacement) -> &String,
) -> Vec<String> {
    let mut ranks: Vec<_> = plan.ranks.iter().collect();
    ranks.sort_by_key(|r| r.rank);
    ranks.iter().map(|r| field(r).clone()).collect()
}

/// The layout of `plan`, which must place every rank on one host (a plan over several
/// hosts is launched from their inventory): its disaggregated deployment when it has one
/// (prefill and decode replicas), else its aggregated layout. CPU ranks run it on this
/// host.
///
/// Errors: ranks on several hosts; a disaggregated deployment whose roles differ in shape.
fn layout_of(
    plan: &crate::plan::Plan,
    what: &str,
    events: &mut dyn FnMut(UpEvent),
) -> Result<Layout> {
    let mut hosts: Vec<&str> = plan.ranks.iter().map(|r| r.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    if hosts.len() > 1 {
        bail!(
            "{what} places ranks on {} hosts ({}), and a plan file does not say how to reach them\nhint: give the hosts' inventory instead, `--cluster hosts.toml` (planned on the spot and launched over SSH), or plan for one node, e.g. `--cluster 1x8xh100-sxm`",
            hosts.len(),
            hosts.join(", ")
        );
    }
    if let Some(d) = &plan.disaggregated {
        // The planner's disaggregated deployment (it wins, or `--disaggregate` asked for
        // it): its workers become prefill and decode replicas. KV moves shard to shard, so
        // both roles need one shape.
        let a = crate::serving_engines::disagg::PdLayout::of(d)
            .one_shape()
            .with_context(|| format!("{what} disaggregates"))?;
        let layout = Layout {
            degrees: Degrees {
                dp: (d.prefill_workers + d.decode_workers) as usize,
                ..a
            },
            from: format!("{what} (disaggregated)"),
            pd_prefill: Some(d.prefill_workers as usize),
            gpus: None,
            planned_hosts: None,
        };
        events(UpEvent::Note(format!(
            "{what}: disaggregated, {} prefill + {} decode replicas of tp {} × pp {} (ep {}), {} ranks; running them as CPU ranks on this host",
            d.prefill_workers,
            d.decode_workers,
            layout.degrees.tp,
            layout.degrees.pp,
            layout.degrees.ep,
            layout.world_size()
        )));
        return Ok(layout);
    }
    let layout = Layout {
        degrees: plan.parallel,
        from: what.to_string(),
        pd_prefill: None,
        // A plan of CPU ranks names no GPU.
        gpus: (plan.device == crate::plan::cluster::Device::Gpu)
            .then(|| by_rank(plan, |r| &r.cuda_visible_devices)),
        planned_hosts: None,
    };
    events(UpEvent::Note(format!(
        "{what}: tp {} × pp {} × dp {} (ep {}), {} ranks; running them on this host",
        layout.degrees.tp,
        layout.degrees.pp,
        layout.degrees.dp,
        layout.degrees.ep,
        layout.world_size()
    )));
    Ok(layout)
}

/// Launches `dp × pp × tp` rank processes (here, or on an inventory's hosts) whose rank 0
/// serves, and watches them until Ctrl-C/SIGTERM or a failure.
fn launch(
    settings: &UpSettings,
    layout: &Layout,
    started: Instant,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    if let Some(dir) = settings.model.path().filter(|p| p.is_dir()) {
        bail!(
            "rank processes run GGUF models for now; `{}` is a directory",
            dir.display()
        );
    }
    let world = layout.world_size();
    let inventory = inventory(settings);
    if settings.max_restarts > 0 {
        // Rank 0 serves on its host's loopback behind the launcher's front.
        let spec = rank_spec(settings, layout, inventory.is_some(), true);
        if let Some(node) = settings.node.as_ref().filter(|n| n.node_rank > 0) {
            spec.check_layout()?;
            note_node(node, world, events);
            return super::supervise::nodes::follow(&spec, node, settings.max_restarts, events);
        }
        if let Some(node) = &settings.node {
            spec.check_layout()?;
            note_node(node, world, events);
        }
        return super::supervise::ranks::serve(
            &spec,
            &super::supervise::ranks::Supervised {
                max_restarts: settings.max_restarts,
                stall_timeout: settings.stall_timeout,
                shutdown_timeout: settings.shutdown_timeout,
                host: &settings.host,
                port: settings.port,
                metrics_key: settings
                    .api_key
                    .clone()
                    .filter(|_| settings.protect_metrics),
                cluster: inventory.map(|file| super::hosts::ClusterOptions {
                    inventory: file,
                    ssh: settings.ssh,
                    push_model: settings.push_model,
                }),
                layout: format!(
                    "dp {} × pp {} × tp {}",
                    layout.degrees.dp, layout.degrees.pp, layout.degrees.tp
                ),
                node: settings.node.clone(),
            },
            started,
            events,
        );
    }
    // On a cluster, the launcher listens at --host:--port itself (before anything starts,
    // so a port in use fails first) and forwards to rank 0's server on its host's loopback.
    let local_http = match &inventory {
        Some(_) => Some(
            std::net::TcpListener::bind((settings.host.as_str(), settings.port)).map_err(
                |error| {
                    anyhow::anyhow!(crate::serve::http::bind_error(
                        &settings.host,
                        settings.port,
                        &error
                    ))
                },
            )?,
        ),
        None => None,
    };
    let spec = rank_spec(settings, layout, inventory.is_some(), local_http.is_some());
    let signals = Arc::new(AtomicUsize::new(0));
    watch_signals(Arc::clone(&signals))?;
    if let Some(node) = &settings.node {
        // Bad layouts fail as themselves, before any store is involved.
        spec.check_layout()?;
        note_node(node, world, events);
    }
    let mut report = |event: Progress| events(UpEvent::Gang(event));
    let (mut cluster, mut local_gang) =
        start_ranks(settings, &spec, inventory, world, &mut report)?;
    let gang = match (&mut cluster, &mut local_gang) {
        (Some(run), _) => &mut run.gang,
        (None, Some(gang)) => gang,
        (None, None) => unreachable!("one of the two was started above"),
    };
    gang.fail_on_any_exit();
    report(gang.started());
    let is_stopped = || signals.load(Ordering::SeqCst) > 0;
    let ready = gang.wait_for(crate::rendezvous::READY_KEY, &is_stopped, &mut report);
    if let Err(error) = &ready {
        gang.write_outcome(Some(error));
    }
    let Some(address) = ready? else {
        gang.stop();
        gang.write_outcome(None);
        events(UpEvent::Note("stopped before the ranks were ready".into()));
        return Ok(());
    };
    let mut address = String::from_utf8_lossy(&address).into_owned();
    if let (Some(run), Some(listener)) = (&cluster, local_http) {
        // Rank 0 listens on its host's loopback; this launcher forwards to it over SSH.
        let remote: SocketAddr = address
            .parse()
            .with_context(|| format!("rank 0 published a malformed address `{address}`"))?;
        let local = listener.local_addr()?;
        run.remote.forward(run.rank0_host, remote, listener)?;
        address = local.to_string();
    }
    let gang = match (&mut cluster, &mut local_gang) {
        (Some(run), _) => &mut run.gang,
        (None, Some(gang)) => gang,
        (None, None) => unreachable!("one of the two was started above"),
    };
    gang.write_manifest(&spec, Some(&format!("http://{address}")))?;
    events(UpEvent::Ready {
        address,
        world_size: world,
        layout: format!(
            "dp {} × pp {} × tp {}",
            layout.degrees.dp, layout.degrees.pp, layout.degrees.tp
        ),
        ready_secs: started.elapsed().as_secs_f64(),
    });
    let result = match settings.node.as_ref().filter(|n| n.node_rank > 0) {
        Some(node) => follow_node_zero(gang, node, &is_stopped, events),
        None => serve_until_stopped(gang, settings, &signals, events),
    };
    gang.write_outcome(result.as_ref().err());
    result
}

/// The ranks' launch: `layout`, the serving settings of rank 0 (on a cluster, `forwarded`:
/// it serves on its host's loopback at a port of its choosing), threads per rank (0 here:
/// this host's cores over its ranks; `on_cluster`: each host's), and each rank's GPUs.
fn rank_spec(
    settings: &UpSettings,
    layout: &Layout,
    on_cluster: bool,
    forwarded: bool,
) -> LaunchSpec {
    let world = layout.world_size();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (http_host, http_port) = if forwarded {
        ("127.0.0.1".to_string(), 0)
    } else {
        (settings.host.clone(), settings.port)
    };
    let serving = ServingEnv {
        http_host,
        http_port,
        client_host: forwarded.then(|| settings.host.clone()),
        max_batch: settings.limits.max_batch,
        max_num_batched_tokens: Some(settings.limits.max_batched_tokens),
        prefix_cache: settings.prefix_cache,
        model_id: settings.model_id.clone(),
        kv_cache_tokens: settings.kv_cache_tokens,
        api_key: settings.api_key.clone(),
        protect_metrics: settings.protect_metrics,
        pd_prefill: layout.pd_prefill,
        shutdown_timeout: settings.shutdown_timeout,
        stall_timeout: settings.stall_timeout,
        max_model_len: settings.max_model_len,
        max_queued_requests: settings.max_queued_requests,
        // A lost replica restarts alone under `--max-restarts` (not with PD: its KV links
        // would need re-linking too).
        // Nor with `--nnodes`: a replica's ranks may run under another node's launcher.
        replica_restarts: settings.max_restarts > 0
            && layout.degrees.dp > 1
            && layout.pd_prefill.is_none()
            && settings.node.is_none(),
    };
    LaunchSpec {
        degrees: layout.degrees,
        model: Some(settings.model.clone()),
        threads_per_rank: match (settings.threads, on_cluster) {
            (0, false) => {
                let nodes = settings.node.as_ref().map_or(1, |n| n.nnodes);
                (cores * nodes / world).max(1)
            }
            // On a cluster, 0 means each host's cores over its ranks.
            (threads, _) => threads,
        },
        numerics: settings.numerics,
        timeout: super::rank_timeout(matches!(
            settings.gpu.as_ref().map(|g| &g.kernels),
            Some(crate::runtime::exec::kernel_executor::KernelDevice::HostHarness { .. })
        )),
        serving: Some(serving),
        layout_from: layout.from.clone(),
        placement: match &settings.node {
            Some(node) => node_placement(node, world),
            None => Vec::new(),
        },
        planned_hosts: layout.planned_hosts.clone(),
        run_dir: settings.run_dir.clone(),
        // A plan's GPUs; else each rank's by its local rank (an inventory's hosts: by what
        // their agents report, when the cluster launch starts).
        gpus: settings.gpu.as_ref().map(|gpu| {
            layout
                .gpus
                .clone()
                .filter(|gpus| gpus.len() == world)
                .unwrap_or_else(|| match &settings.node {
                    Some(node) => super::gpus_by_local_rank(
                        node_placement(node, world).iter().map(|p| p.local_rank),
                        gpu.gpus,
                    ),
                    None => super::local_gpus(world, gpu.gpus),
                })
        }),
        restart: 0,
    }
}

/// Says which of the `world` ranks this node of `infer up --nnodes` runs, where its
/// collectives listen and where the rendezvous store is.
fn note_node(node: &NodeSettings, world: usize, events: &mut dyn FnMut(UpEvent)) {
    let ranks = node.ranks(world);
    events(UpEvent::Note(format!(
        "node {} of {}: ranks {}–{} of {world} on this host (collectives on {}); rendezvous store at {}{}",
        node.node_rank,
        node.nnodes,
        ranks.start,
        ranks.end - 1,
        node.bind_addr,
        node.master,
        if node.node_rank == 0 { " (here)" } else { "" }
    )));
}

/// Starts the ranks: over the inventory's hosts (the first of the pair), or on this host
/// (the second): all of them, or this node's share of an `infer up --nnodes` launch.
///
/// Errors: preflight or placement failures on a cluster, a rank that cannot start, a node
/// other than 0 that cannot join node 0's store.
fn start_ranks(
    settings: &UpSettings,
    spec: &LaunchSpec,
    inventory: Option<PathBuf>,
    world: usize,
    report: &mut dyn FnMut(Progress),
) -> Result<(Option<super::hosts::ClusterRun>, Option<Gang>)> {
    if let Some(file) = inventory {
        let options = super::hosts::ClusterOptions {
            inventory: file,
            ssh: settings.ssh,
            push_model: settings.push_model,
        };
        let run = super::hosts::start(spec, &Job::Serve, &options, report)?;
        return Ok((Some(run), None));
    }
    let Some(node) = &settings.node else {
        return Ok((None, Some(Gang::start(spec, &Job::Serve)?)));
    };
    Ok((None, Some(start_node(spec, node, world)?)))
}

/// Starts this node's share of `world` ranks for `infer up --nnodes` (node 0 with the
/// store at `--master-addr:--master-port`, the others joining it), each rank with its
/// host's keys derived from the shared secret.
///
/// Errors: the store cannot listen (node 0) or be joined (the others), a rank that
/// cannot start.
pub(super) fn start_node(spec: &LaunchSpec, node: &NodeSettings, world: usize) -> Result<Gang> {
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let store = if node.node_rank == 0 {
        super::StoreLocation::Listen(node.master)
    } else {
        super::StoreLocation::Remote {
            ranks: node.master,
            launcher: node.master,
        }
    };
    let keys = node_keys(node, world);
    let gang = Gang::start_part(
        &super::LocalSpawner { exe },
        spec,
        &Job::Serve,
        store,
        &keys,
        node.ranks(world),
    )
    .with_context(|| {
        if node.node_rank > 0 {
            format!(
                "node {} cannot join node 0's store at {}: start node 0 first, with the same {}",
                node.node_rank,
                node.master,
                crate::envvars::RUN_TOKEN
            )
        } else {
            "node 0 cannot start its ranks".to_string()
        }
    })?;
    Ok(gang)
}

/// The run's keys as every node of `infer up --nnodes` derives them from the shared
/// secret: node `n` runs its even share of the `world` ranks (host `n`).
pub(super) fn node_keys(node: &NodeSettings, world: usize) -> crate::keyring::Keyring {
    let share = (world / node.nnodes.max(1)).max(1);
    crate::keyring::Keyring::master(
        &node.token,
        crate::keyring::LAUNCHER_HOST,
        (0..world).map(|rank| (rank / share) as u32).collect(),
    )
    .with_hosts(node.nnodes)
}

/// Serves until told to stop, then drains ([`drain`]).
///
/// Errors: a rank that fails while serving, the store cannot be written.
fn serve_until_stopped(
    gang: &mut Gang,
    settings: &UpSettings,
    signals: &AtomicUsize,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    let is_stopped = || signals.load(Ordering::SeqCst) > 0;
    let mut report = |event: Progress| events(UpEvent::Gang(event));
    // Serve until told to stop; the gang's rank 0 never sets this key.
    gang.wait_for("never", &is_stopped, &mut report)?;
    drain(
        gang,
        settings.shutdown_timeout,
        settings.node.as_ref(),
        signals,
        events,
    )
}

/// Once told to stop: lets rank 0 drain (up to `shutdown_timeout`; a second signal stops it
/// at once) and stops the gang; with other nodes (`node`), tells them through the store and
/// waits up to 3 s for them to see it.
///
/// Errors: the store cannot be written.
pub(super) fn drain(
    gang: &mut Gang,
    shutdown_timeout: Duration,
    node: Option<&NodeSettings>,
    signals: &AtomicUsize,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    // Rank 0 drains: it stops accepting, gives requests in flight the shutdown timeout,
    // cancels the rest and exits; then the gang stops. A second Ctrl-C stops it at once.
    events(UpEvent::Note(format!(
        "stopping: rank 0 finishes the requests in flight for up to {:.0} s (--shutdown-timeout), then cancels them; Ctrl-C again stops at once",
        shutdown_timeout.as_secs_f64()
    )));
    let grace = shutdown_timeout + Duration::from_secs(3);
    if node.is_some() {
        // The other nodes' ranks exit with rank 0: tell their launchers it is a stop.
        gang.store()
            .set(SHUTDOWN_KEY, grace.as_secs_f64().to_string().as_bytes())?;
    }
    gang.signal_rank(0, rustix::process::Signal::TERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && signals.load(Ordering::SeqCst) < 2 && !gang.rank_exited(0) {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(node) = node {
        // Keep the store up until every other node has seen the stop (at most 3 s).
        let others = (node.nnodes - 1) as i64;
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline
            && gang.store().add(SHUTDOWN_ACK_KEY, 0).unwrap_or(others) < others
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    gang.stop();
    Ok(())
}

/// Set by node 0's launcher in the store when it stops (the value: the seconds its drain
/// may take); the other nodes' launchers then let their ranks exit with rank 0.
pub(super) const SHUTDOWN_KEY: &str = "launcher/shutdown";
/// Counts the other nodes that have seen [`SHUTDOWN_KEY`].
pub(super) const SHUTDOWN_ACK_KEY: &str = "launcher/shutdown/acks";
/// How [`SHUTDOWN_KEY`]'s value begins when node 0's gang failed with no restart left
/// (`--max-restarts`): the rest is the failure, and the other nodes end with it.
pub(super) const FAILED_PREFIX: &str = "failed: ";

/// Node 0 ended the run after a failure with no restart left (its failure, as it said it):
/// what a node other than 0 ends with, at once.
#[derive(Debug)]
pub(crate) struct NodeZeroFailed(pub String);

impl std::fmt::Display for NodeZeroFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node 0 ended the run: {}", self.0)
    }
}

impl std::error::Error for NodeZeroFailed {}

/// A node other than 0 of `infer up --nnodes`, once serving: watches its ranks until node
/// 0 stops the gang (its ranks exit with rank 0: a clean stop), a rank fails (the error), or
/// this node is told to stop (its ranks stop; the others fail with them, as a gang).
pub(super) fn follow_node_zero(
    gang: &mut Gang,
    node: &NodeSettings,
    is_stopped: &dyn Fn() -> bool,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    let outcome = gang.wait_for(SHUTDOWN_KEY, is_stopped, &mut |event| {
        events(UpEvent::Gang(event))
    });
    // A rank can see rank 0 leave before this launcher sees the key: ask the store again.
    let stopping = match &outcome {
        Ok(value) => value.clone(),
        Err(_) => gang
            .store()
            .get(SHUTDOWN_KEY, Duration::from_millis(300))
            .ok(),
    };
    match stopping {
        Some(value) if value.starts_with(FAILED_PREFIX.as_bytes()) => {
            let _ = gang.store().add(SHUTDOWN_ACK_KEY, 1);
            gang.stop();
            let why = String::from_utf8_lossy(&value[FAILED_PREFIX.len()..]).into_owned();
            Err(anyhow::Error::new(NodeZeroFailed(why)))
        }
        Some(value) => {
            let _ = gang.store().add(SHUTDOWN_ACK_KEY, 1);
            let grace: f64 = String::from_utf8_lossy(&value).parse().unwrap_or(8.0);
            events(UpEvent::Note(
                "node 0 is stopping the gang: this node's ranks stop with rank 0".into(),
            ));
            let deadline = Instant::now() + Duration::from_secs_f64(grace.clamp(0.0, 600.0));
            while Instant::now() < deadline && !gang.every_rank_exited() {
                std::thread::sleep(Duration::from_millis(20));
            }
            gang.stop();
            Ok(())
        }
        None => {
            gang.stop();
            outcome.map(|_| ()).with_context(|| {
                format!(
                    "node {} stopped its ranks: a rank failed, or node 0's store at {} went away (node 0 stopped or unreachable)",
                    node.node_rank, node.master
                )
            })
        }
    }
}

/// Every rank's placement for one node of `infer up --nnodes`: consecutive shares of the
/// world per node; this node's ranks' collectives listen on its bind address.
fn node_placement(node: &NodeSettings, world: usize) -> Vec<super::Placement> {
    let share = world / node.nnodes;
    (0..world)
        .map(|rank| super::Placement {
            host: format!("node{}", rank / share),
            local_rank: rank % share,
            local_world_size: share,
            env: HostEnv {
                bind_addr: node
                    .ranks(world)
                    .contains(&rank)
                    .then(|| node.bind_addr.to_string()),
                ..HostEnv::default()
            },
            threads: None,
        })
        .collect()
}
