//! The HTTP side of `infer up` on the serving process: [`HttpServer`] (listening before the
//! engine is ready, answering 503 until it opens), [`serve_one_process`] (the engine in
//! this process, as vLLM at TP 1), and on a rank gang [`bind_rank_http`] and
//! [`serve_driver`] (what rank 0 and the other replicas' drivers run).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use super::router::Router;
use super::scheduler::{Limits, Scheduler};
use super::{AppState, Gate, router};
use crate::rendezvous::StoreClient;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::engine::Engine;
use crate::runtime::exec::executor::Executor;
use crate::runtime::exec::rank_env::{RankEnv, ServingEnv};
use crate::runtime::exec::worker::ReplicaDriver;

/// What the one-process server needs.
pub struct OneProcess<'a> {
    pub model: &'a crate::runtime::model::source::ModelSource,
    /// Run the model on the GPU (`--device cuda`) instead of the CPU engine.
    pub gpu: Option<&'a GpuSettings>,
    pub model_id: &'a str,
    pub host: &'a str,
    pub port: u16,
    /// Worker threads (0: one per core).
    pub threads: usize,
    pub numerics: Numerics,
    /// Most sequences running at once and tokens per step.
    pub limits: Limits,
    pub kv_cache_tokens: usize,
    /// Reuse the KV blocks of cached prompt prefixes (the CPU engine; not on the GPU yet).
    pub prefix_cache: bool,
    pub api_key: Option<String>,
    /// `/metrics` requires the API key too.
    pub protect_metrics: bool,
    /// Longest prompt plus completion, tokens (`None`: the model's context).
    pub max_model_len: Option<usize>,
    /// How long requests in flight may finish after Ctrl-C before they are cancelled.
    pub shutdown_timeout: Duration,
    /// A loop with work and no progress for longer is stalled (`--stall-timeout`).
    pub stall_timeout: Duration,
    /// Requests that may wait beyond those running (`--max-queued-requests`).
    pub max_queued_requests: Option<usize>,
}

/// `--device cuda`: where the kernels run, and how many GPUs this host shows its ranks.
#[derive(Clone, Debug)]
pub struct GpuSettings {
    pub kernels: crate::runtime::exec::kernel_executor::KernelDevice,
    /// GPUs visible here (0: the host harness); rank `r` of this host gets GPU
    /// `local_rank % gpus` unless a plan places it.
    pub gpus: usize,
}

/// What [`serve_one_process`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OneProcessEvent {
    /// A line for the user (the shutdown's drain).
    Note(String),
    /// Listening (every endpoint answers 503) while the engine loads.
    Listening(SocketAddr),
    /// Serving.
    Ready(SocketAddr),
}

/// Serves `settings.model` from this process until Ctrl-C or SIGTERM: listens first (503
/// until ready), loads, opens.
///
/// Errors: the address cannot be bound, the model does not load, the engine fails.
pub fn serve_one_process(
    settings: &OneProcess,
    events: &mut dyn FnMut(OneProcessEvent),
) -> Result<()> {
    // Listen first: until the engine is ready every endpoint answers 503.
    let server = HttpServer::bind(settings.host, settings.port)?;
    events(OneProcessEvent::Listening(server.address()));
    let mut engine = Engine::from_source(settings.model, settings.threads, settings.numerics)?;
    engine.model.set_kv_capacity(Some(settings.kv_cache_tokens));
    engine
        .model
        .kv_pool()
        .set_prefix_cache(settings.prefix_cache);
    let tokenizer = engine.tokenizer.clone();
    let max_context_tokens = settings
        .max_model_len
        .map_or(engine.model.config.max_context_tokens, |len| {
            len.min(engine.model.config.max_context_tokens)
        });
    let scheduler = match settings.gpu {
        None => Scheduler::start(engine, settings.limits),
        Some(gpu) => {
            // The weights go to the GPU (the mapped file is released after); the tokenizer
            // and the sampler stay on the host.
            let loaded = crate::runtime::exec::kernel_executor::load_executor(
                &gpu.kernels,
                &engine.model,
                settings.kv_cache_tokens,
                engine.tokenizer.clone(),
                Default::default(),
            )?;
            let printer = crate::ui::Printer::from_env();
            for note in &loaded.notes {
                printer.note_or_warn(note);
            }
            loaded
                .executor
                .kv_pool()
                .set_prefix_cache(settings.prefix_cache);
            Scheduler::start_with(loaded.executor, settings.limits)
        }
    };
    server.open(
        AppState {
            scheduler: Router::local(scheduler)
                .with_stall_timeout(settings.stall_timeout)
                .with_queue_limit(settings.limits.max_batch, settings.max_queued_requests),
            model_id: settings.model_id.to_string(),
            tokenizer,
            max_context_tokens,
            api_key: settings.api_key.clone(),
            protect_metrics: settings.protect_metrics,
            access_log: access_log(),
            rank_waits: None,
        },
        &[],
        None,
    )?;
    events(OneProcessEvent::Ready(server.address()));
    server.serve_until_stopped(settings.shutdown_timeout, &mut |line| {
        events(OneProcessEvent::Note(line.to_string()))
    })
}

/// The driver of a serving replica. Replica 0's driver (global rank 0) runs the scheduler
/// over `driver`, connects the router to the other replicas' drivers (their addresses come
/// from the store), opens `server` (bound at `env`'s HTTP address before the shard loaded,
/// see [`bind_rank_http`]), publishes its address under `rank/0/ready`, and serves until SIGTERM
/// (from the launcher) or until a replica fails. Any other replica's driver serves the
/// router's requests instead ([`super::router::serve_remote`]). `keys` are its host's.
///
/// Errors: `env` without serving settings, no server on rank 0, a failed replica (a lost
/// rank), a lost router.
pub fn serve_driver(
    driver: ReplicaDriver,
    store: &mut StoreClient,
    server: Option<HttpServer>,
    env: &RankEnv,
    keys: &crate::keyring::Keyring,
    note: &mut dyn FnMut(&str),
) -> Result<()> {
    let serving = env.serving.as_ref().with_context(|| {
        format!(
            "a serving rank needs `{}` and the other serving settings from its launcher",
            crate::envvars::HTTP_PORT
        )
    })?;
    let limits = match serving.max_num_batched_tokens {
        Some(max_batched_tokens) => Limits {
            max_batch: serving.max_batch,
            max_batched_tokens,
        },
        None => Limits::for_this_host(serving.max_batch),
    };
    let dp = env.degrees.dp;
    let replica = driver.replica_index();
    let timeout = driver.timeout();
    if replica > 0 {
        let scheduler = Scheduler::start_with(Box::new(driver), limits);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("failed to start the replica's runtime")?;
        return runtime.block_on(async {
            // The data-network address on a multi-host run, loopback otherwise.
            let bind = env.bind_addr();
            let listener = tokio::net::TcpListener::bind((bind, 0))
                .await
                .with_context(|| format!("cannot listen for the router on `{bind}`"))?;
            store.set(
                &super::links::router_key(env.rank as u64),
                super::links::router_value(env.incarnation, listener.local_addr()?).as_bytes(),
            )?;
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                result = super::router::serve_remote(listener, keys, replica, scheduler) => result,
                _ = terminate.recv() => Ok(()),
            }
        });
    }
    let server = server.context("rank 0 has no HTTP server")?;
    // Replica `r`'s driver is its first rank.
    let replica_size = env.degrees.replica_size() as u64;
    let remotes = super::links::first_starts(store, dp as u64, replica_size, timeout)?;
    server.open(
        AppState {
            model_id: serving.model_id.clone(),
            tokenizer: driver.tokenizer().clone(),
            // `--max-model-len`, when set, caps the model's context.
            max_context_tokens: match serving.max_model_len {
                Some(len) => len.min(driver.max_context_tokens()),
                None => driver.max_context_tokens(),
            },
            api_key: serving.api_key.clone(),
            protect_metrics: serving.protect_metrics,
            access_log: access_log(),
            rank_waits: Some(Arc::new(super::health::RankWaits::new(
                env.store.to_string(),
                keys.clone(),
                env.world_size as u64,
                env.degrees.replica_size() as u64,
            ))),
            scheduler: {
                let router = Router::local(Scheduler::start_with(Box::new(driver), limits))
                    .with_stall_timeout(serving.stall_timeout)
                    .with_queue_limit(limits.max_batch, serving.max_queued_requests);
                let router = match serving.replica_restarts {
                    true => router.with_replica_restarts(super::links::Rejoin {
                        store: env.store.to_string(),
                    }),
                    false => router,
                };
                match serving.pd_prefill {
                    Some(prefill) => router.disaggregated(prefill),
                    None => router,
                }
            },
        },
        &remotes,
        Some(keys),
    )?;
    store.set(
        crate::rendezvous::READY_KEY,
        server.address().to_string().as_bytes(),
    )?;
    server.serve_until_stopped(serving.shutdown_timeout, note)
}

/// The access log: a `note:` line on stderr per request (rank 0's reach the launcher's
/// stderr as `[rank 0]` lines).
fn access_log() -> Arc<dyn Fn(&str) + Send + Sync> {
    let printer = crate::ui::Printer::from_env();
    Arc::new(move |line| printer.note(line))
}

/// Rank 0's HTTP server, bound before the shard loads so the port answers 503 meanwhile:
/// at `serving`'s host and port when the launcher serves (`None` otherwise).
///
/// Errors: the address cannot be bound.
pub fn bind_rank_http(serving: Option<&ServingEnv>) -> Result<Option<HttpServer>> {
    serving
        .map(|s| {
            let clients_at = s.client_host.as_deref().unwrap_or(&s.http_host);
            HttpServer::bind_for(&s.http_host, s.http_port, clients_at)
        })
        .transpose()
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

/// What went wrong binding `host:port`, in words a user can act on: not an address, not an
/// address of this host, the port taken, a privileged port.
pub fn bind_error(host: &str, port: u16, error: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let is_ip = host.parse::<std::net::IpAddr>().is_ok();
    match error.kind() {
        ErrorKind::AddrInUse => format!(
            "cannot listen on {host}:{port}: the port is already in use (another server?); stop it or choose another with --port"
        ),
        ErrorKind::AddrNotAvailable => format!(
            "cannot listen on {host}:{port}: {host} is not an address of this host (see `ip -brief addr`); use one of them, 127.0.0.1 for this host only, or 0.0.0.0 for all"
        ),
        ErrorKind::PermissionDenied => format!(
            "cannot listen on {host}:{port}: ports below 1024 need root or CAP_NET_BIND_SERVICE; choose another with --port"
        ),
        _ if !is_ip => format!(
            "cannot listen on {host}:{port}: `{host}` is not an IP address or a name that resolves ({error}); give an address of this host, e.g. 127.0.0.1 or 0.0.0.0"
        ),
        _ => format!("cannot listen on {host}:{port}: {error}"),
    }
}

/// Binds `host:port` once and lets it go, so a bad `--host`/`--port` fails before any rank
/// starts (rank 0 binds it again; listeners set `SO_REUSEADDR`).
///
/// Errors: as [`bind_error`] says.
pub fn check_bind(host: &str, port: u16) -> Result<()> {
    std::net::TcpListener::bind((host, port))
        .map(drop)
        .map_err(|error| anyhow::anyhow!(bind_error(host, port, &error)))
}

/// Connections served at once; more wait in the kernel's backlog until one closes.
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a client may take to send a request's head (line and headers): a half-sent
/// request is closed after it, instead of holding its connection open.
pub(crate) const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a `Host` header's value names this machine's loopback interface: `localhost`
/// (or a name under `.localhost`, RFC 6761), an address of 127.0.0.0/8 or `[::1]`, with or
/// without a port.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        match rest.split_once(']') {
            Some((address, _)) => address,
            None => return false,
        }
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a `--host` value binds the loopback interface (`localhost`, 127.0.0.0/8, `::1`).
pub(crate) fn names_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses (403, OpenAI error JSON) a request whose `Host` does not name the loopback
/// interface, on a server bound to it: a web page whose name an attacker points at
/// 127.0.0.1 (DNS rebinding) is then same-origin with the server, and only the `Host` it
/// sends tells it apart. A request without `Host` (HTTP/1.0) passes.
async fn loopback_hosts_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let host = request
        .headers()
        .get(axum::http::header::HOST)
        .map(|h| h.to_str().unwrap_or("(not text)").to_string());
    match host {
        Some(host) if !is_loopback_host(&host) => super::errors::error(
            axum::http::StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!(
                "the Host `{}` does not name this server: bound to loopback, it answers only localhost, 127.0.0.1 and [::1] (a guard against DNS rebinding); to serve other names, bind them with --host",
                crate::ui::escape_controls(&host)
            ),
        )
        .into_response(),
        _ => next.run(request).await,
    }
}

/// Serves `app` on `listener` over HTTP/1.1 until `stopped`, at most [`MAX_CONNECTIONS`] at
/// once, each request's head read within [`HEADER_READ_TIMEOUT`]; then stops accepting and
/// waits for the connections to finish their requests (idle ones close at once). With
/// `guard_host` (clients reach it on loopback), only requests for a loopback `Host` are
/// answered ([`is_loopback_host`]).
///
/// Errors: none; a failed accept is retried after 10 ms (a full file table frees up).
pub(crate) async fn serve_bounded(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    guard_host: bool,
    stopped: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let app = if guard_host {
        app.layer(axum::middleware::from_fn(loopback_hosts_only))
    } else {
        app
    };
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    tokio::pin!(stopped);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut stopped => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut stopped => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let connection =
            graceful.watch(http1.serve_connection(hyper_util::rt::TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = connection.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

impl HttpServer {
    /// Binds `host:port` and starts answering 503. Errors: the address cannot be bound.
    pub fn bind(host: &str, port: u16) -> Result<HttpServer> {
        HttpServer::bind_for(host, port, host)
    }

    /// [`HttpServer::bind`] for clients that reach the server at `clients_at` (another
    /// address when the launcher forwards to it): only when that is loopback too does the
    /// server answer only loopback `Host` names.
    ///
    /// Errors: the address cannot be bound.
    pub(crate) fn bind_for(host: &str, port: u16, clients_at: &str) -> Result<HttpServer> {
        let guard_host = names_loopback(clients_at);
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
                .map_err(|error| anyhow::anyhow!(bind_error(host, port, &error)))?;
            let address = listener.local_addr()?;
            let app = router(Arc::clone(&gate));
            let guard_host = guard_host && address.ip().is_loopback();
            let server = tokio::spawn(serve_bounded(listener, app, guard_host, async move {
                let _ = stopped.await;
            }));
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

    /// Connects the router to the `remotes` replicas (each one's address and driver rank,
    /// proving this host's `keys`) and starts serving `state`. Errors: a replica that
    /// cannot be reached; remotes without keys.
    pub fn open(
        &self,
        mut state: AppState,
        remotes: &[((usize, String), u64)],
        keys: Option<&crate::keyring::Keyring>,
    ) -> Result<()> {
        if !remotes.is_empty() {
            let keys = keys.context("remote replicas need this host's keys")?;
            self.runtime
                .block_on(state.scheduler.connect_remotes(remotes, keys))?;
        }
        self.gate.open(state)?;
        self.runtime
            .spawn(super::watch_stalls(Arc::clone(&self.gate)));
        Ok(())
    }

    /// Serves until Ctrl-C, SIGTERM or a failed replica. Then, as vLLM's and SGLang's
    /// servers do: stop accepting, give the requests in flight `shutdown_timeout` to finish
    /// (reported through `note`), cancel those still running (each gets an error), and
    /// return; a second Ctrl-C or SIGTERM returns at once.
    ///
    /// Errors: a replica failed (the error names it), the server failed.
    pub fn serve_until_stopped(
        self,
        shutdown_timeout: Duration,
        note: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let HttpServer {
            runtime,
            gate,
            shutdown,
            mut server,
            ..
        } = self;
        runtime.block_on(async move {
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let mut interrupt =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
            // Resolves at each Ctrl-C or SIGTERM.
            let mut signalled = async || match (terminate.as_mut(), interrupt.as_mut()) {
                (Some(t), Some(i)) => {
                    tokio::select! {
                        _ = t.recv() => {}
                        _ = i.recv() => {}
                    }
                }
                _ => std::future::pending::<()>().await,
            };
            let engine_failed = async {
                match gate.state() {
                    Some(state) => state.scheduler.failed().await,
                    None => std::future::pending::<String>().await,
                }
            };
            let failure = tokio::select! {
                () = signalled() => None,
                error = engine_failed => Some(error),
            };
            let _ = shutdown.send(());
            if let Some(error) = failure {
                gate.cancel_requests();
                let _ = tokio::time::timeout(Duration::from_secs(2), &mut server).await;
                return Err(anyhow!("the engine failed: {error}"));
            }
            let in_flight = gate.in_flight();
            if in_flight > 0 {
                note(&format!(
                    "stopping: no new requests; {in_flight} in flight get up to {:.0} s to finish (--shutdown-timeout), then are cancelled; Ctrl-C again stops at once",
                    shutdown_timeout.as_secs_f64()
                ));
            }
            let finished = tokio::select! {
                result = &mut server => Some(result),
                () = tokio::time::sleep(shutdown_timeout) => None,
                () = signalled() => {
                    note("stopping at once");
                    return Ok(());
                }
            };
            let result = match finished {
                Some(result) => result,
                None => {
                    note(&format!(
                        "cancelled {} request(s) still running after {:.0} s",
                        gate.in_flight(),
                        shutdown_timeout.as_secs_f64()
                    ));
                    gate.cancel_requests();
                    tokio::select! {
                        result = &mut server => result,
                        () = tokio::time::sleep(Duration::from_secs(2)) => return Ok(()),
                        () = signalled() => return Ok(()),
                    }
                }
            };
            result
                .context("the HTTP server task failed")?
                .context("the HTTP server failed")?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_hosts_are_told_from_other_names() {
        for host in [
            "localhost",
            "localhost:8000",
            "LOCALHOST.",
            "app.localhost:1",
            "127.0.0.1",
            "127.0.0.1:8000",
            "127.1.2.3:9",
            "[::1]",
            "[::1]:8000",
        ] {
            assert!(super::is_loopback_host(host), "{host}");
        }
        for host in ["localhost", "LocalHost", "127.0.0.1", "127.8.0.1", "::1"] {
            assert!(super::names_loopback(host), "{host}");
        }
        for host in ["0.0.0.0", "::", "10.0.0.1", "myhost", "[::1]"] {
            assert!(!super::names_loopback(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8000",
            "localhost.evil.example",
            "10.0.0.1:8000",
            "[::2]:80",
            "[::1",
            "",
            "127.0.0.1.evil.example",
        ] {
            assert!(!super::is_loopback_host(host), "{host}");
        }
    }
}
