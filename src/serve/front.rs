//! The HTTP front of a supervised run (`infer up --max-restarts N`): it listens at the
//! user's `--host:--port` in the launcher's process, which outlives the gang, and relays
//! every request to rank 0's server (on loopback, or through the SSH tunnel to rank 0's
//! host), or with `--engine` to the engine's head. While the gang starts or restarts it
//! answers for it: `/ping` 200, `/health` 503 saying why (and while an engine's head is
//! stalled, which its own `/health` does not say), every other endpoint 503 with `Retry-After` (OpenAI error JSON). A request
//! whose gang fails under it gets an error that names the cause: a 503 when no answer had
//! started, an `error` event then `[DONE]` on a stream (as vLLM ends a failed stream).
//! `/metrics` adds `infer_restarts_total{cause}` and `infer_gang_serving` to rank 0's.
//!
//! The relay is one HTTP/1.1 connection per request (hyper's client): on loopback that
//! costs ~0.1 ms, and a connection never outlives the gang it went to.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body_util::BodyExt;
use serde_json::json;

/// Why a gang was restarted: the label of `infer_restarts_total{cause}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RestartCause {
    /// A rank process exited (crashed, killed, out of memory).
    RankExited,
    /// A process of an engine launched with `--engine` exited (its server, an RPC worker).
    EngineExited,
    /// A rank stopped heartbeating to the store (frozen, or its host unreachable).
    HeartbeatLost,
    /// The connection to a host's agent was lost.
    HostLost,
    /// A replica made no progress past `--stall-timeout` and the grace.
    Stalled,
    /// The gang did not start or load again.
    StartFailed,
    /// Any other failure (the store lost, every rank gone at once).
    Other,
}

impl RestartCause {
    /// Every cause, in the order `/metrics` lists them.
    pub const ALL: [RestartCause; 7] = [
        RestartCause::RankExited,
        RestartCause::EngineExited,
        RestartCause::HeartbeatLost,
        RestartCause::HostLost,
        RestartCause::Stalled,
        RestartCause::StartFailed,
        RestartCause::Other,
    ];

    /// The Prometheus label value.
    pub fn label(self) -> &'static str {
        match self {
            RestartCause::RankExited => "rank_exited",
            RestartCause::EngineExited => "engine_exited",
            RestartCause::HeartbeatLost => "heartbeat_lost",
            RestartCause::HostLost => "host_lost",
            RestartCause::Stalled => "stalled",
            RestartCause::StartFailed => "start_failed",
            RestartCause::Other => "other",
        }
    }
}

/// What the gang behind the front is doing.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// Starting for the first time: loading.
    Starting,
    /// Rank 0's server answers at this address.
    Serving(SocketAddr),
    /// Stopped after a failure and starting again.
    Restarting {
        /// The failure, as the launcher reports it.
        cause: String,
        /// This restart's number (1 for the first) and the most allowed.
        restart: usize,
        max_restarts: usize,
        /// What `Retry-After` says: about how long the last start took, seconds.
        retry_after_secs: u64,
    },
}

/// The state the front's handlers share with the launcher.
struct Shared {
    phase: tokio::sync::watch::Sender<Phase>,
    /// Why the engine behind the front is stalled, while it is ([`Front::stalled`]).
    stalled: Mutex<Option<String>>,
    restarts: Mutex<BTreeMap<RestartCause, u64>>,
    /// The API key `/metrics` requires, if any.
    metrics_key: Option<String>,
}

/// The front: a listening HTTP server on its own runtime. Dropping it stops the server
/// (requests in flight are cut).
pub struct Front {
    shared: Arc<Shared>,
    address: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Front {
    /// Listens at `host:port` and answers 503 ("loading") until [`Front::serving`];
    /// `/metrics` requires `metrics_key` when given (`--protect-metrics`).
    ///
    /// Errors: the address cannot be bound (as [`super::http::bind_error`] says), the
    /// runtime cannot start.
    pub fn bind(host: &str, port: u16, metrics_key: Option<String>) -> Result<Front> {
        let listener = std::net::TcpListener::bind((host, port))
            .map_err(|error| anyhow::anyhow!(super::http::bind_error(host, port, &error)))?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("infer-front")
            .enable_all()
            .build()
            .context("failed to start the HTTP front's runtime")?;
        let shared = Arc::new(Shared {
            phase: tokio::sync::watch::Sender::new(Phase::Starting),
            stalled: Mutex::default(),
            restarts: Mutex::default(),
            metrics_key,
        });
        let app = axum::Router::new()
            .route("/ping", get(|| async { "pong" }))
            .route("/metrics", get(metrics))
            .route("/health", get(health))
            .fallback(relay_any)
            .with_state(Arc::clone(&shared));
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        {
            let _guard = runtime.enter();
            let listener = tokio::net::TcpListener::from_std(listener)
                .context("cannot hand the front's listener to its runtime")?;
            let guard_host = address.ip().is_loopback();
            runtime.spawn(super::http::serve_bounded(
                listener,
                app,
                guard_host,
                async move {
                    let _ = stopped.await;
                },
            ));
        }
        Ok(Front {
            shared,
            address,
            runtime: Some(runtime),
            shutdown: Some(shutdown),
        })
    }

    /// Where the front listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Relays every request to rank 0's server at `upstream` from now on.
    pub fn serving(&self, upstream: SocketAddr) {
        self.stalled(None);
        self.shared.phase.send_replace(Phase::Serving(upstream));
    }

    /// The engine behind the front is stalled (`Some(why)`: it has work and makes no
    /// progress; its own `/health` may still say 200, or never answer) or no longer
    /// (`None`): while stalled, `/health` answers 503 `{"status": "stalled", "reason"}`
    /// itself; every other request is still relayed.
    pub fn stalled(&self, why: Option<&str>) {
        if let Ok(mut stalled) = self.shared.stalled.lock() {
            *stalled = why.map(str::to_string);
        }
    }

    /// One DP replica failed with `kind` and starts again alone while the others serve:
    /// counted in `infer_restarts_total`; the front keeps relaying (rank 0's `/health`
    /// names the replica `restarting`).
    pub fn replica_restarting(&self, kind: RestartCause) {
        if let Ok(mut restarts) = self.shared.restarts.lock() {
            *restarts.entry(kind).or_default() += 1;
        }
    }

    /// The gang failed with `cause` (`kind`, for `/metrics`) and starts again, restart
    /// `restart` of `max_restarts`: new requests get 503 with `Retry-After:
    /// retry_after_secs`, requests in flight an error naming `cause`.
    pub fn restarting(
        &self,
        kind: RestartCause,
        cause: &str,
        restart: usize,
        max_restarts: usize,
        retry_after_secs: u64,
    ) {
        if let Ok(mut restarts) = self.shared.restarts.lock() {
            *restarts.entry(kind).or_default() += 1;
        }
        self.shared.phase.send_replace(Phase::Restarting {
            cause: cause.to_string(),
            restart,
            max_restarts,
            retry_after_secs: retry_after_secs.max(1),
        });
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// How long a request whose connection to rank 0 broke waits for the launcher to say why
/// (the launcher sees a dead rank within ~100 ms, a lost heartbeat within 5 s).
const CAUSE_WAIT: Duration = Duration::from_secs(6);

/// The 503 for `phase` (not serving): OpenAI error JSON with `Retry-After`, and the front's
/// health under `health`.
fn unavailable(phase: &Phase) -> Response {
    let (message, retry_after, health) = match phase {
        Phase::Starting | Phase::Serving(_) => (
            "the model is loading; retry shortly".to_string(),
            5,
            json!({"status": "loading", "replicas": []}),
        ),
        Phase::Restarting {
            cause,
            restart,
            max_restarts,
            retry_after_secs,
        } => (
            format!(
                "the server is restarting (restart {restart} of {max_restarts}) after: {cause}; retry in {retry_after_secs} s"
            ),
            *retry_after_secs,
            json!({"status": "restarting", "cause": cause, "restart": restart, "max_restarts": max_restarts, "replicas": []}),
        ),
    };
    let body = json!({
        "error": {"message": message, "type": "server_error", "param": null, "code": "restarting"},
        "health": health,
    });
    let mut response = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
    response
}

/// `/metrics`: rank 0's text (when serving) with the front's counters after it.
async fn metrics(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    if let Some(key) = &shared.metrics_key
        && !super::bearer_matches(request.headers(), key)
    {
        return super::unauthorized().into_response();
    }
    let phase = shared.phase.borrow().clone();
    let mut text = String::new();
    if let Phase::Serving(upstream) = phase
        && let Ok(response) = forward(upstream, request).await
        && response.status().is_success()
        && let Ok(body) = response.into_body().collect().await
    {
        text.push_str(&String::from_utf8_lossy(&body.to_bytes()));
    }
    text.push_str("# HELP infer_restarts_total Times the gang was stopped and started again, by cause.\n# TYPE infer_restarts_total counter\n");
    let restarts = shared
        .restarts
        .lock()
        .map(|r| r.clone())
        .unwrap_or_default();
    for cause in RestartCause::ALL {
        text.push_str(&format!(
            "infer_restarts_total{{cause=\"{}\"}} {}\n",
            cause.label(),
            restarts.get(&cause).copied().unwrap_or(0)
        ));
    }
    let serving = matches!(*shared.phase.borrow(), Phase::Serving(_));
    text.push_str(&format!(
        "# HELP infer_gang_serving Whether the rank gang serves (1) or is starting or restarting (0).\n# TYPE infer_gang_serving gauge\ninfer_gang_serving {}\n",
        u8::from(serving)
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `/health`: 503 with the reason while the engine behind the front is stalled, else as
/// [`relay_any`].
async fn health(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let stalled = shared.stalled.lock().ok().and_then(|s| s.clone());
    match stalled {
        Some(reason) if matches!(*shared.phase.borrow(), Phase::Serving(_)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "stalled", "reason": reason, "replicas": []})),
        )
            .into_response(),
        _ => relay(&shared, request).await,
    }
}

/// Every endpoint but `/ping` and `/metrics`: rank 0's answer while serving; 503 saying
/// why while starting or restarting.
async fn relay_any(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    relay(&shared, request).await
}

/// Relays `request` to rank 0 while serving; else, or when the connection to rank 0 breaks
/// before its answer, the 503 that says why.
async fn relay(shared: &Arc<Shared>, request: Request) -> Response {
    let phase = shared.phase.borrow().clone();
    let Phase::Serving(upstream) = phase else {
        return unavailable(&phase);
    };
    match forward(upstream, request).await {
        Ok(response) => {
            if response.status().is_server_error()
                && let Some(phase) = left(shared, upstream)
            {
                // Rank 0's own error as its gang is stopped: the cause is the launcher's.
                return unavailable(&phase);
            }
            let (mut parts, incoming) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            let sse = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            Response::from_parts(
                parts,
                relay_body(Arc::clone(shared), upstream, incoming, sse),
            )
        }
        Err(error) => match changed_from(shared, upstream).await {
            Some(phase) => unavailable(&phase),
            None => {
                let body = json!({"error": {
                    "message": format!("rank 0's server did not answer: {error:#}"),
                    "type": "server_error", "param": null, "code": null}});
                (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
            }
        },
    }
}

/// Sends `request` to `upstream` over a new HTTP/1.1 connection and returns its answer
/// (the body still streaming).
///
/// Errors: the connection cannot be made, or breaks before the answer's head.
async fn forward(
    upstream: SocketAddr,
    request: Request,
) -> Result<axum::http::Response<hyper::body::Incoming>> {
    let stream = tokio::net::TcpStream::connect(upstream)
        .await
        .with_context(|| format!("cannot connect to {upstream}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let (mut parts, body) = request.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // Rank 0 listens on loopback and answers only loopback names; the client's `Host` was
    // the front's to judge.
    if let Ok(host) = HeaderValue::from_str(&upstream.to_string()) {
        parts.headers.insert(header::HOST, host);
    }
    Ok(sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await?)
}

/// Removes the headers that describe one connection, not the message (RFC 9110 §7.6.1).
fn strip_hop_by_hop(headers: &mut axum::http::HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}

/// The phase now, when it is no longer serving at `upstream` (the launcher has begun to
/// stop that gang).
fn left(shared: &Shared, upstream: SocketAddr) -> Option<Phase> {
    let phase = shared.phase.borrow().clone();
    (phase != Phase::Serving(upstream)).then_some(phase)
}

/// What a request that the restart cut short is told.
fn cut_short(phase: Option<Phase>, otherwise: impl FnOnce() -> String) -> String {
    match phase {
        Some(Phase::Restarting { cause, .. }) => {
            format!("the server failed and restarts: {cause}")
        }
        _ => otherwise(),
    }
}

/// An SSE `error` event saying `message`, then `[DONE]`.
fn error_event(message: &str) -> Bytes {
    let event =
        json!({"error": {"message": message, "type": "server_error", "param": null, "code": 503}});
    Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))
}

/// Waits up to [`CAUSE_WAIT`] for the launcher to leave the serving phase of `upstream`
/// (a broken connection means the gang is failing); returns the new phase, or `None` when
/// it still serves there.
async fn changed_from(shared: &Shared, upstream: SocketAddr) -> Option<Phase> {
    let mut phase = shared.phase.subscribe();
    let left = tokio::time::timeout(
        CAUSE_WAIT,
        phase.wait_for(|p| *p != Phase::Serving(upstream)),
    )
    .await;
    match left {
        Ok(Ok(p)) => Some(p.clone()),
        _ => None,
    }
}

/// The body of rank 0's answer, relayed as it arrives. When rank 0's connection breaks
/// mid-stream, a server-sent event stream ends with an `error` event naming the cause and
/// `[DONE]`; another body is cut (the client sees an incomplete message).
fn relay_body(
    shared: Arc<Shared>,
    upstream: SocketAddr,
    mut incoming: hyper::body::Incoming,
    sse: bool,
) -> Body {
    let (sender, receiver) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(16);
    tokio::spawn(async move {
        loop {
            // The client left (the body, dropped, closes the channel): dropping `incoming`
            // closes rank 0's connection, which cancels the request there, even before its
            // first chunk.
            let frame = tokio::select! {
                frame = incoming.frame() => frame,
                () = sender.closed() => return,
            };
            match frame {
                None => return,
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if sse
                        && contains(&data, b"data: {\"error\"")
                        && let Some(phase) = left(&shared, upstream)
                    {
                        // Rank 0's own error event as its gang is stopped: name the cause.
                        let message = cut_short(Some(phase), String::new);
                        let _ = sender.send(Ok(error_event(&message))).await;
                        return;
                    }
                    if sender.send(Ok(data)).await.is_err() {
                        return;
                    }
                }
                Some(Err(error)) => {
                    if !sse {
                        let _ = sender.send(Err(std::io::Error::other(error))).await;
                        return;
                    }
                    let message = cut_short(changed_from(&shared, upstream).await, || {
                        format!("rank 0's server broke the stream: {error}")
                    });
                    let _ = sender.send(Ok(error_event(&message))).await;
                    return;
                }
            }
        }
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(receiver))
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that answers `/health` and streams two events on `/stream`, then dies
    /// (the process of rank 0, killed): the front relays the first and ends the stream with
    /// an error event naming the cause the launcher gave.
    #[test]
    fn a_stream_cut_by_a_failing_gang_ends_with_an_error_event_naming_the_cause() {
        let upstream = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let upstream_address = upstream.local_addr().expect("address");
        let front = Front::bind("127.0.0.1", 0, None).expect("front");
        let (status, body) = get(front.address(), "/health");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("\"loading\""), "{body}");
        front.serving(upstream_address);
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut socket, _) = upstream.accept().expect("accept");
            let mut buffer = [0u8; 4096];
            let _ = socket.read(&mut buffer).expect("request");
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .expect("head");
            let event = b"data: {\"n\":1}\n\n";
            socket
                .write_all(format!("{:x}\r\n", event.len()).as_bytes())
                .expect("chunk");
            socket.write_all(event).expect("event");
            socket.write_all(b"\r\n").expect("chunk end");
            socket.flush().expect("flush");
            std::thread::sleep(Duration::from_millis(200));
            // Rank 0 dies: the connection closes mid-body.
        });
        let stream = std::thread::spawn({
            let address = front.address();
            move || get(address, "/stream")
        });
        server.join().expect("upstream");
        front.restarting(
            RestartCause::RankExited,
            "rank 2 exited with signal 9",
            1,
            3,
            4,
        );
        let (status, body) = stream.join().expect("client");
        assert_eq!(status, 200);
        assert!(body.starts_with("data: {\"n\":1}\n\n"), "{body}");
        assert!(
            body.contains("the server failed and restarts: rank 2 exited with signal 9"),
            "{body}"
        );
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        // New requests: 503 with Retry-After, /ping 200, the restart counted.
        let (status, body) = get(front.address(), "/v1/models");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("restart 1 of 3"), "{body}");
        let response = ureq::get(&format!("http://{}/v1/models", front.address()))
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .expect("request");
        assert_eq!(
            response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()),
            Some("4")
        );
        assert_eq!(get(front.address(), "/ping"), (200, "pong".to_string()));
        let (_, metrics) = get(front.address(), "/metrics");
        assert!(
            metrics.contains("infer_restarts_total{cause=\"rank_exited\"} 1\n"),
            "{metrics}"
        );
        assert!(metrics.contains("infer_gang_serving 0\n"), "{metrics}");
    }

    /// `GET address path`: status and body.
    fn get(address: SocketAddr, path: &str) -> (u16, String) {
        let mut response = ureq::get(&format!("http://{address}{path}"))
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .expect("request");
        let status = response.status().as_u16();
        let body = response.body_mut().read_to_string().unwrap_or_default();
        (status, body)
    }
}
