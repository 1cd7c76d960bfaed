//! `infer up`: serve the OpenAI-compatible API until Ctrl-C or SIGTERM. With one rank the
//! engine runs in this process (as vLLM does at TP 1); with `--tp`/`--pp` this process is
//! the launcher: it starts the rendezvous store and one `infer rank` per rank, waits until
//! rank 0 (the replica's driver, which runs the scheduler and the HTTP server) is ready,
//! and then watches the gang until it is told to stop or a rank fails.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::cli::{DeviceArg, UpArgs};
use crate::launch::{Gang, LaunchSpec, Progress};
use crate::rendezvous::StoreClient;
use crate::runtime::engine::Engine;
use crate::runtime::executor::Executor;
use crate::runtime::gguf::Header;
use crate::runtime::tokenizer::Tokenizer;
use crate::runtime::worker::{Job, ReplicaDriver};
use crate::serve::router::Router;
use crate::serve::scheduler::Scheduler;
use crate::serve::{AppState, Gate, router};
use crate::ui::{self, Printer};
use crate::{ExitStatus, model};

/// Runs `infer up`. Errors: bad flags, a model that does not load, an address that cannot
/// be bound, a rank that fails (named, with its last log lines).
pub fn run(args: &UpArgs, printer: &Printer) -> Result<ExitStatus> {
    let started = Instant::now();
    if args.kv_cache_tokens < crate::runtime::kv::BLOCK_TOKENS {
        bail!(
            "--kv-cache-tokens must hold at least one block of {} tokens, got {}",
            crate::runtime::kv::BLOCK_TOKENS,
            args.kv_cache_tokens
        );
    }
    if args.device == DeviceArg::Cuda {
        bail!(
            "--device cuda: this build has no CUDA backend yet; run CPU ranks with `--device cpu`"
        );
    }
    let path = model::weights_path(args.model.as_deref(), &mut |line| printer.note(line))?;
    let model_id = model_id(&path);
    let layout = resolve_layout(args, &path, printer)?;
    if layout.world_size() > 1 || inventory(args).is_some() {
        return launch(args, &layout, &path, &model_id, started, printer);
    }
    // Listen first: until the engine is ready every endpoint answers 503.
    let server = HttpServer::bind(&args.host, args.port)?;
    printer.note(&format!(
        "loading `{model_id}`; http://{} answers 503 until it is ready",
        server.address()
    ));
    let mut engine = Engine::load(&path, args.threads, args.numerics.into())?;
    engine.model.set_kv_capacity(Some(args.kv_cache_tokens));
    let tokenizer = if path.is_dir() {
        Tokenizer::from_dir(&path)?
    } else {
        Tokenizer::from_gguf(&Header::read_file(&path)?)?
    };
    let max_context_tokens = engine.model.config.max_context_tokens;
    server.open(
        AppState {
            scheduler: Router::local(Scheduler::start(engine, args.max_batch)),
            model_id: model_id.clone(),
            tokenizer,
            max_context_tokens,
            api_key: args.api_key.clone(),
        },
        &[],
        "",
    )?;
    printer.note(&format!(
        "serving `{model_id}` on http://{} (ready in {:.2} s); Ctrl-C stops",
        server.address(),
        started.elapsed().as_secs_f64()
    ));
    server.serve_until_stopped()?;
    printer.note("stopped");
    Ok(ExitStatus::Success)
}

/// The inventory `--cluster` names, when it names one (ranks then run on its hosts).
fn inventory(args: &UpArgs) -> Option<std::path::PathBuf> {
    args.cluster
        .as_deref()
        .filter(|c| crate::cluster::is_inventory(c))
        .map(std::path::PathBuf::from)
}

/// The id `/v1/models` lists for the model at `path`: its file stem.
fn model_id(path: &std::path::Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// The parallel layout to launch.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Layout {
    tp: usize,
    pp: usize,
    dp: usize,
    ep: usize,
    /// Where it came from: the flags, a plan file, or a plan for a cluster.
    from: String,
}

impl Layout {
    fn world_size(&self) -> usize {
        self.dp * self.pp * self.tp
    }
}

/// The layout from `--tp/--pp/--dp/--ep`, a saved `--plan`, or a plan made for `--cluster`.
///
/// Errors: both ways given, a degree of 0, an unreadable or malformed plan, an infeasible
/// plan, a plan spanning several hosts (remote launching is not built yet), `--ep` other
/// than 1 or `--tp`.
fn resolve_layout(args: &UpArgs, path: &std::path::Path, printer: &Printer) -> Result<Layout> {
    let explicit = [args.tp, args.pp, args.dp, args.ep];
    let pinned = explicit.iter().any(Option::is_some);
    let inventory = inventory(args);
    let from_plan = args.plan.is_some() || (args.cluster.is_some() && inventory.is_none());
    if from_plan && pinned {
        bail!("give the layout either with --plan/--cluster or with --tp/--pp/--dp/--ep, not both");
    }
    let layout = if let Some(file) = inventory.as_ref().filter(|_| !pinned) {
        // An inventory without pinned degrees: plan over its GPU hosts, or one replica per
        // host when they run CPU ranks.
        let entries = crate::cluster::launch_inventory(file)?;
        if entries.iter().all(|e| e.cpu) {
            Layout {
                tp: 1,
                pp: 1,
                dp: entries.len(),
                ep: 1,
                from: format!("one replica per host of `{}`", file.display()),
            }
        } else {
            let spec = model::load(&path.display().to_string())?;
            let cluster =
                crate::cluster::load(&file.display().to_string(), std::path::Path::new("/sys"))?;
            match crate::plan::plan(&spec, &cluster, &crate::plan::Settings::default()) {
                crate::plan::Outcome::Feasible(plan) => {
                    let p = &plan.parallel;
                    Layout {
                        tp: p.tp as usize,
                        pp: p.pp as usize,
                        dp: p.dp as usize,
                        ep: p.ep as usize,
                        from: format!("the plan for `{}`", file.display()),
                    }
                }
                crate::plan::Outcome::Infeasible(infeasible) => bail!(
                    "no layout fits the model on this cluster:\n{}",
                    crate::plan::render::render_infeasible(&infeasible, false)
                ),
            }
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
        layout_of(&plan, &format!("the plan `{}`", file.display()), printer)?
    } else if let Some(cluster) = args.cluster.as_ref().filter(|_| inventory.is_none()) {
        let spec = model::load(&path.display().to_string())?;
        let cluster = crate::cluster::load(cluster, std::path::Path::new("/sys"))?;
        match crate::plan::plan(&spec, &cluster, &crate::plan::Settings::default()) {
            crate::plan::Outcome::Feasible(plan) => {
                layout_of(&plan, &format!("the plan for `{}`", plan.cluster), printer)?
            }
            crate::plan::Outcome::Infeasible(infeasible) => bail!(
                "no layout fits the model on this cluster:\n{}",
                crate::plan::render::render_infeasible(&infeasible, false)
            ),
        }
    } else {
        Layout {
            tp: args.tp.unwrap_or(1),
            pp: args.pp.unwrap_or(1),
            dp: args.dp.unwrap_or(1),
            ep: args.ep.unwrap_or(1),
            from: match &inventory {
                Some(file) => format!("the --tp/--pp/--dp/--ep flags on `{}`", file.display()),
                None => "the --tp/--pp/--dp/--ep flags".into(),
            },
        }
    };
    if layout.tp == 0 || layout.pp == 0 || layout.dp == 0 || layout.ep == 0 {
        bail!("--tp, --pp, --dp and --ep must be at least 1");
    }
    if layout.ep > 1 && layout.ep != layout.tp {
        bail!(
            "--ep {} must be 1 or equal --tp ({}): `infer up` shards experts over each replica's TP group",
            layout.ep,
            layout.tp
        );
    }
    Ok(layout)
}

/// The layout of `plan`, which must place every rank on one host (remote hosts need the SSH
/// launcher). CPU ranks run it on this host.
fn layout_of(plan: &crate::plan::Plan, what: &str, printer: &Printer) -> Result<Layout> {
    let mut hosts: Vec<&str> = plan.ranks.iter().map(|r| r.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    if hosts.len() > 1 {
        bail!(
            "{what} places ranks on {} hosts ({}); `infer up` launches on this host only until remote launching lands\nhint: plan for one node, e.g. `--cluster 1x8xh100-sxm`, or launch each host's ranks there",
            hosts.len(),
            hosts.join(", ")
        );
    }
    let p = &plan.parallel;
    let layout = Layout {
        tp: p.tp as usize,
        pp: p.pp as usize,
        dp: p.dp as usize,
        ep: p.ep as usize,
        from: what.to_string(),
    };
    printer.note(&format!(
        "{what}: tp {} × pp {} × dp {} (ep {}), {} ranks; running them as CPU ranks on this host",
        layout.tp,
        layout.pp,
        layout.dp,
        layout.ep,
        layout.world_size()
    ));
    Ok(layout)
}

/// Launches `dp × pp × tp` rank processes whose rank 0 serves, and watches them.
fn launch(
    args: &UpArgs,
    layout: &Layout,
    path: &std::path::Path,
    model_id: &str,
    started: Instant,
    printer: &Printer,
) -> Result<ExitStatus> {
    super::require_gguf_for_ranks(path)?;
    let world = layout.world_size();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let inventory = inventory(args);
    // On a cluster, the launcher listens at --host:--port itself (before anything starts,
    // so a port in use fails first) and forwards to rank 0's server on its host's loopback.
    let local_http = match &inventory {
        Some(_) => Some(
            std::net::TcpListener::bind((args.host.as_str(), args.port))
                .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?,
        ),
        None => None,
    };
    let (http_host, http_port) = match &local_http {
        Some(_) => ("127.0.0.1".to_string(), "0".to_string()),
        None => (args.host.clone(), args.port.to_string()),
    };
    let mut extra_env = vec![
        ("INFER_HTTP_HOST".to_string(), http_host),
        ("INFER_HTTP_PORT".to_string(), http_port),
        ("INFER_MAX_BATCH".to_string(), args.max_batch.to_string()),
        ("INFER_MODEL_ID".to_string(), model_id.to_string()),
        (
            "INFER_KV_CACHE_TOKENS".to_string(),
            args.kv_cache_tokens.to_string(),
        ),
    ];
    if let Some(key) = &args.api_key {
        extra_env.push(("INFER_API_KEY".to_string(), key.clone()));
    }
    let spec = LaunchSpec {
        tp: layout.tp,
        pp: layout.pp,
        dp: layout.dp,
        ep: layout.ep,
        model: path.to_path_buf(),
        threads_per_rank: match (args.threads, &inventory) {
            (0, None) => (cores / world).max(1),
            // On a cluster, 0 means each host's cores over its ranks.
            (threads, _) => threads,
        },
        numerics: args.numerics.into(),
        timeout: Duration::from_secs(60),
        extra_env,
        layout_from: layout.from.clone(),
        placement: Vec::new(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    watch_signals(Arc::clone(&stop))?;
    // Steps: every rank started, every rank loaded, serving.
    let progress = printer.progress(2 * world as u64 + 1);
    let mut report = |event: Progress| report_progress(&progress, &event, true);
    let mut cluster = match &inventory {
        Some(file) => {
            let options = crate::launch::cluster::ClusterOptions {
                inventory: file.clone(),
                ssh: crate::launch::ssh::SshOptions {
                    accept_new: args.ssh.ssh_accept_new,
                },
                push_model: args.ssh.push_model,
            };
            Some(crate::launch::cluster::start(
                &spec,
                &Job::Serve,
                &options,
                &mut report,
            )?)
        }
        None => None,
    };
    let mut local_gang = match &cluster {
        Some(_) => None,
        None => Some(Gang::start(&spec, &Job::Serve)?),
    };
    let gang = match (&mut cluster, &mut local_gang) {
        (Some(run), _) => &mut run.gang,
        (None, Some(gang)) => gang,
        (None, None) => unreachable!("one of the two was started above"),
    };
    gang.fail_on_any_exit();
    report(gang.started());
    let is_stopped = || stop.load(Ordering::SeqCst);
    let Some(address) = gang.wait_for("ready", &is_stopped, &mut report)? else {
        progress.finish();
        gang.stop();
        printer.note("stopped before the ranks were ready");
        return Ok(ExitStatus::Success);
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
    if progress.is_bar() {
        progress.update(2 * world as u64 + 1, "ready");
    }
    progress.finish();
    printer.note(&format!(
        "serving `{model_id}` on http://{address} with {world} ranks (dp {} × pp {} × tp {}), ready in {:.2} s; Ctrl-C stops",
        layout.dp,
        layout.pp,
        layout.tp,
        started.elapsed().as_secs_f64()
    ));
    let mut report = |event: Progress| report_progress_plain(printer, &event);
    // Serve until told to stop; the gang's rank 0 never sets this key.
    gang.wait_for("never", &is_stopped, &mut report)?;
    gang.stop();
    printer.note("stopped");
    Ok(ExitStatus::Success)
}

/// Shows a launcher milestone on `progress` (a bar on a terminal, plain lines otherwise):
/// ranks started, shards loaded; rank output prefixed with `[rank N]` when `echo_ranks`.
pub fn report_progress(progress: &ui::Progress, event: &Progress, echo_ranks: bool) {
    match event {
        Progress::Started {
            world_size,
            run_dir,
            pids,
        } => progress.update(
            *world_size as u64,
            &format!(
                "started {world_size} ranks (pids {}); logs and manifest.json in {}",
                pids.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                run_dir.display()
            ),
        ),
        Progress::Loaded { loaded, world_size } => {
            let message = format!("{loaded}/{world_size} ranks loaded their shard");
            if progress.is_bar() || loaded == world_size {
                progress.update((world_size + loaded) as u64, &message);
            }
        }
        Progress::Host { host, stage } => progress.note(&format!("[{host}] {stage}")),
        Progress::RankLine { label, line, .. } if echo_ranks => {
            let line = line.strip_prefix("note: ").unwrap_or(line);
            progress.note(&format!("[{label}] {line}"))
        }
        Progress::RankLine { .. } => {}
    }
}

/// After the bar is gone: rank output as plain `[rank N]` lines.
fn report_progress_plain(printer: &Printer, event: &Progress) {
    if let Progress::RankLine { label, line, .. } = event {
        let line = line.strip_prefix("note: ").unwrap_or(line);
        printer.note(&format!("[{label}] {line}"));
    }
}

/// Sets `stop` on SIGINT or SIGTERM (a thread with its own small runtime).
fn watch_signals(stop: Arc<AtomicBool>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the signal watcher")?;
    let mut terminate = runtime
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .context("cannot watch SIGTERM")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            runtime.block_on(async {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            });
            stop.store(true, Ordering::SeqCst);
        })
        .context("failed to start the signal watcher")?;
    Ok(())
}

/// The driver of a serving replica. Replica 0's driver (global rank 0) runs the scheduler
/// over `driver`, connects the router to the other replicas' drivers (their addresses come
/// from the store), opens `server` (bound at `INFER_HTTP_HOST:INFER_HTTP_PORT` before the
/// shard loaded, see [`bind_rank_http`]), publishes its address under `ready`, and serves
/// until SIGTERM (from the launcher) or until a replica fails. Any other replica's driver serves the router's requests instead
/// ([`crate::serve::router::serve_remote`]).
///
/// Errors: a missing `INFER_*` variable or server, a failed replica (a lost rank), a lost
/// router.
pub fn serve_driver(
    driver: ReplicaDriver,
    store: &mut StoreClient,
    server: Option<HttpServer>,
) -> Result<()> {
    let var = |name: &str| {
        std::env::var(name).with_context(|| format!("`{name}` is not set by the launcher"))
    };
    let max_batch: usize = var("INFER_MAX_BATCH")?
        .parse()
        .context("INFER_MAX_BATCH is not a number")?;
    let dp: usize = var("INFER_DP")?
        .parse()
        .context("INFER_DP is not a number")?;
    let token = var("INFER_RUN_TOKEN")?;
    let replica = driver.replica_index();
    let timeout = driver.timeout();
    if replica > 0 {
        let scheduler = Scheduler::start_with(Box::new(driver), max_batch);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("failed to start the replica's runtime")?;
        return runtime.block_on(async {
            // The data-network address on a multi-host run, loopback otherwise.
            let bind = std::env::var("INFER_BIND_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
            let listener = tokio::net::TcpListener::bind((bind.as_str(), 0))
                .await
                .with_context(|| format!("cannot listen for the router on `{bind}`"))?;
            store.set(
                &format!("dp/{replica}/router"),
                listener.local_addr()?.to_string().as_bytes(),
            )?;
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                result = crate::serve::router::serve_remote(listener, &token, scheduler) => result,
                _ = terminate.recv() => Ok(()),
            }
        });
    }
    let server = server.context("rank 0 has no HTTP server: `INFER_HTTP_PORT` is not set")?;
    let remotes = (1..dp)
        .map(|r| {
            let bytes = store.get(&format!("dp/{r}/router"), timeout)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        })
        .collect::<Result<Vec<String>>>()?;
    server.open(
        AppState {
            model_id: var("INFER_MODEL_ID")?,
            tokenizer: driver.tokenizer().clone(),
            max_context_tokens: driver.max_context_tokens(),
            api_key: std::env::var("INFER_API_KEY").ok(),
            scheduler: Router::local(Scheduler::start_with(Box::new(driver), max_batch)),
        },
        &remotes,
        &token,
    )?;
    store.set("ready", server.address().to_string().as_bytes())?;
    server.serve_until_stopped()
}

/// Rank 0's HTTP server, bound before the shard loads so the port answers 503 meanwhile:
/// `INFER_HTTP_HOST:INFER_HTTP_PORT` when the launcher set them (`None` otherwise).
///
/// Errors: the address cannot be bound.
pub fn bind_rank_http() -> Result<Option<HttpServer>> {
    match (
        std::env::var("INFER_HTTP_HOST"),
        std::env::var("INFER_HTTP_PORT"),
    ) {
        (Ok(host), Ok(port)) => {
            let port: u16 = port.parse().context("INFER_HTTP_PORT is not a port")?;
            HttpServer::bind(&host, port).map(Some)
        }
        _ => Ok(None),
    }
}

/// The HTTP server of `infer up`: listening from [`HttpServer::bind`] (every endpoint
/// answers 503), serving from [`HttpServer::open`], until Ctrl-C, SIGTERM, or a failed
/// replica ([`HttpServer::serve_until_stopped`]).
pub struct HttpServer {
    runtime: tokio::runtime::Runtime,
    gate: Arc<Gate>,
    address: SocketAddr,
    shutdown: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl HttpServer {
    /// Binds `host:port` and starts answering 503. Errors: the address cannot be bound.
    pub fn bind(host: &str, port: u16) -> Result<HttpServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("failed to start the HTTP runtime")?;
        let gate = Gate::new();
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let (address, server) = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind((host, port))
                .await
                .with_context(|| {
                    format!("cannot listen on {host}:{port} (in use? try `--port`)")
                })?;
            let address = listener.local_addr()?;
            let app = router(Arc::clone(&gate));
            let server = tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
            });
            anyhow::Ok((address, server))
        })?;
        Ok(HttpServer {
            runtime,
            gate,
            address,
            shutdown,
            server,
        })
    }

    /// The bound address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Connects the router to the `remotes` replicas (proving `token`) and starts serving
    /// `state`. Errors: a replica that cannot be reached.
    pub fn open(&self, mut state: AppState, remotes: &[String], token: &str) -> Result<()> {
        self.runtime
            .block_on(state.scheduler.connect_remotes(remotes, token))?;
        self.gate.open(state)
    }

    /// Serves until Ctrl-C, SIGTERM or a failed replica, then shuts down gracefully.
    ///
    /// Errors: a replica failed (the error names it), the server failed.
    pub fn serve_until_stopped(self) -> Result<()> {
        let HttpServer {
            runtime,
            gate,
            shutdown,
            server,
            ..
        } = self;
        runtime.block_on(async move {
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let sigterm = async {
                match terminate.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let engine_failed = async {
                match gate.state() {
                    Some(state) => state.scheduler.failed().await,
                    None => std::future::pending::<String>().await,
                }
            };
            let failure = tokio::select! {
                _ = tokio::signal::ctrl_c() => None,
                _ = sigterm => None,
                error = engine_failed => Some(error),
            };
            let _ = shutdown.send(());
            server
                .await
                .context("the HTTP server task failed")?
                .context("the HTTP server failed")?;
            match failure {
                Some(error) => Err(anyhow!("the engine failed: {error}")),
                None => Ok(()),
            }
        })
    }
}
