//! The OpenAI-compatible HTTP API (axum) over the continuous-batching [`scheduler`]:
//! `GET /v1/models` (and `/v1/models/{id}`), `POST /v1/completions`,
//! `POST /v1/chat/completions` (with SSE streaming), vLLM's `POST /tokenize` and
//! `POST /detokenize`, `GET /health` (readiness: forward progress, [`mod@health`]), `GET /ping`
//! (liveness), `GET /metrics`. Errors are OpenAI error JSON with the right
//! status; the server keeps serving after any bad request. Bound to 127.0.0.1 unless told.
//!
//! Here: the shared state, the [`Gate`], the router and the handlers. Request bodies and
//! their validator are in `api`, OpenAI error JSON in `errors`, the Prometheus text in
//! `metrics`, server-sent events and logprobs in `stream`, the model list and the
//! tokenizer endpoints in `models`.

mod api;
pub(crate) mod bench;
mod errors;
pub mod front;
pub(crate) mod health;
pub mod http;
pub(crate) mod links;
mod metrics;
mod models;
pub(crate) mod router;
pub mod scheduler;
mod stream;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::runtime::exec::engine::FinishReason;
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::Tokenizer;
use api::{Body, Checked, Endpoint, ServedModel};
use errors::{ApiError, bad_field, bad_request, error};
use scheduler::{Event, MetricsSnapshot, Request};
use stream::{StreamContext, TokenOut, chat_logprobs, completion_logprobs, stream_choices};

/// What the handlers share.
pub struct AppState {
    /// Where requests go: the local scheduler, and the other DP replicas if any.
    pub scheduler: router::Router,
    /// The served model's id (what `/v1/models` lists and requests name).
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub max_context_tokens: usize,
    pub api_key: Option<String>,
    /// `/metrics` requires `api_key` too (`--protect-metrics`; vLLM leaves it open).
    pub protect_metrics: bool,
    /// Where the access log goes: one line per request answered (as vLLM logs them).
    pub access_log: Arc<dyn Fn(&str) + Send + Sync>,
    /// On a rank gang: every rank's wait state, for the stall diagnosis and
    /// `/debug/ranks` (`None` in one process).
    pub rank_waits: Option<Arc<health::RankWaits>>,
}

/// The HTTP server's shared state: the engine side once it is ready. The server listens
/// from the start; until [`Gate::open`], every endpoint answers 503 (`/health` included,
/// so a load balancer waits), as vLLM does while its engine starts.
pub struct Gate {
    ready: std::sync::OnceLock<Arc<AppState>>,
    /// Set when shutdown cancels the requests in flight: each ends with an error (a JSON
    /// error, or an error chunk on a stream) and its sequences stop.
    cancel: tokio::sync::watch::Sender<bool>,
}

impl Gate {
    /// A closed gate (answering 503).
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            ready: std::sync::OnceLock::new(),
            cancel: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Ends every request in flight with an error (shutdown after the grace period).
    pub fn cancel_requests(&self) {
        self.cancel.send_replace(true);
    }

    /// Requests running or waiting now, over every replica (0 before ready).
    pub fn in_flight(&self) -> u64 {
        self.state().map_or(0, |state| {
            let m = state.scheduler.metrics_snapshot();
            m.running + m.waiting
        })
    }

    /// Serves `state` from now on. Errors: the gate was already open.
    pub fn open(&self, state: AppState) -> anyhow::Result<()> {
        self.ready
            .set(Arc::new(state))
            .map_err(|_| anyhow::anyhow!("the server was already ready"))
    }

    /// The engine side, once ready.
    pub fn state(&self) -> Option<&Arc<AppState>> {
        self.ready.get()
    }
}

/// The ready engine side, extracted by handlers, with the shutdown's cancel signal; a 503
/// while the model loads.
struct Ready(Arc<AppState>, Cancel);

/// Resolves when shutdown cancels the requests in flight.
#[derive(Clone)]
struct Cancel(tokio::sync::watch::Receiver<bool>);

impl Cancel {
    async fn cancelled(mut self) {
        // An error means the gate is gone: as good as cancelled.
        let _ = self.0.wait_for(|cancelled| *cancelled).await;
    }
}

/// What a request cancelled by shutdown answers.
const SHUTTING_DOWN: &str = "the server is shutting down; the request was cancelled";

impl axum::extract::FromRequestParts<Arc<Gate>> for Ready {
    type Rejection = ApiError;

    async fn from_request_parts(
        _parts: &mut axum::http::request::Parts,
        gate: &Arc<Gate>,
    ) -> Result<Ready, ApiError> {
        let cancel = Cancel(gate.cancel.subscribe());
        gate.state()
            .cloned()
            .map(|s| Ready(s, cancel))
            .ok_or_else(|| {
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "the model is still loading; retry shortly",
                )
            })
    }
}

/// `GET /health`, readiness: 200 with every replica's state (`health::Verdict` as JSON)
/// while the server can serve, `degraded` naming the replicas that cannot; 503 with the
/// reasons (OpenAI error JSON, the verdict under `health`) while loading, when the engine
/// failed, or when no replica makes progress (`--stall-timeout`).
async fn health(Ready(state, _): Ready) -> Response {
    let verdict = diagnosed_health(&state).await;
    if verdict.ready() {
        return axum::Json(verdict).into_response();
    }
    let message = format!("the server cannot serve: {}", verdict.reasons());
    let body = json!({
        "error": {"message": message, "type": "server_error", "param": null, "code": null},
        "health": verdict,
    });
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}

/// Every replica's health, with the diagnosis of each stalled one (which of its ranks waits
/// on which, read from the store on a blocking thread).
async fn diagnosed_health(state: &AppState) -> health::Verdict {
    let verdict = state.scheduler.health();
    let Some(waits) = state.rank_waits.clone() else {
        return verdict;
    };
    if verdict.stalled().next().is_none() {
        return verdict;
    }
    let undiagnosed = verdict.clone();
    tokio::task::spawn_blocking(move || {
        let mut verdict = verdict;
        waits.diagnose(&mut verdict);
        verdict
    })
    .await
    .unwrap_or(undiagnosed)
}

/// `GET /debug/ranks`: what every rank of the run waits for now (its collective, group,
/// peer and for how long; `null` when in none), readable while the run is alive.
async fn debug_ranks(Ready(state, _): Ready, headers: HeaderMap) -> Response {
    if let Err(response) = authorize(&state, &headers) {
        return response.into_response();
    }
    let Some(waits) = state.rank_waits.clone() else {
        return axum::Json(json!({"ranks": [], "note": "one process: no rank gang"}))
            .into_response();
    };
    let read = tokio::task::spawn_blocking(move || {
        let read = waits.read(0..waits.world_size);
        (read, waits.replica_size)
    })
    .await;
    let (waits, replica_size) = match read {
        Ok((Ok(waits), replica_size)) => (waits, replica_size),
        Ok((Err(failure), _)) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("cannot read the ranks' wait states: {failure:#}"),
            )
            .into_response();
        }
        Err(_) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the wait-state reader failed",
            )
            .into_response();
        }
    };
    use crate::runtime::collectives::waits::RankWait;
    let ranks: Vec<Value> = waits
        .iter()
        .map(|(rank, wait)| {
            let (state, wait) = match wait {
                RankWait::Waiting(w) => (
                    "waiting",
                    json!({"group": w.group, "operation": w.operation, "verb": w.verb,
                        "peer_rank": w.peer_rank, "bytes_expected": w.bytes_expected,
                        "seconds": w.seconds()}),
                ),
                RankWait::NotWaiting => ("in_no_collective", Value::Null),
                RankWait::Unknown => ("unknown", Value::Null),
            };
            json!({"rank": rank, "replica": rank / replica_size.max(1), "state": state, "wait": wait})
        })
        .collect();
    axum::Json(json!({"ranks": ranks})).into_response()
}

/// Logs each replica's stall with its diagnosis, and when it ends; checks every second
/// until the gate closes. A stall is logged at its second check, so that its ranks have
/// published their waits (after `waits::REPORT_AFTER`).
pub(crate) async fn watch_stalls(gate: Arc<Gate>) {
    let printer = crate::ui::Printer::from_env();
    // Checks each replica has been seen stalled in a row (0: not stalled).
    let mut stalled: Vec<u32> = Vec::new();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let Some(state) = gate.state() else {
            continue;
        };
        let verdict = diagnosed_health(state).await;
        stalled.resize(verdict.replicas.len(), 0);
        for replica in &verdict.replicas {
            let checks = &mut stalled[replica.replica];
            if replica.status != "stalled" {
                if *checks >= 2 {
                    printer.note(&format!(
                        "replica {} makes progress again ({} steps)",
                        replica.replica, replica.steps_total
                    ));
                }
                *checks = 0;
                continue;
            }
            *checks += 1;
            if *checks == 2 {
                let mut line = replica.reason.clone().unwrap_or_default();
                if let Some(diagnosis) = &replica.diagnosis {
                    line.push_str(&format!(" — {diagnosis}"));
                }
                printer.warn(&line);
            }
        }
    }
}

/// `GET /ping`, liveness: 200 while the HTTP process runs, whatever the engine does
/// (loading, stalled, failed); `/health` says whether it can serve.
async fn ping() -> &'static str {
    "pong"
}

/// The router with every endpoint.
pub fn router(gate: Arc<Gate>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ping", get(ping))
        .route("/debug/ranks", get(debug_ranks))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::one))
        .route("/tokenize", post(models::tokenize))
        .route("/detokenize", post(models::detokenize))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(gate)
}

/// Whether `headers` carry `Authorization: Bearer <key>`, compared in constant time (how
/// long a wrong key takes says nothing of the right one).
fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|presented| {
            bool::from(subtle::ConstantTimeEq::ct_eq(
                presented.as_bytes(),
                key.as_bytes(),
            ))
        })
}

/// The 401 of a request without the right API key.
fn unauthorized() -> ApiError {
    error(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "missing or wrong API key: send `Authorization: Bearer <key>`",
    )
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    if bearer_matches(headers, key) {
        Ok(())
    } else {
        Err(unauthorized())
    }
}

async fn metrics(Ready(state, _): Ready, headers: HeaderMap) -> Response {
    if state.protect_metrics
        && let Err(response) = authorize(&state, &headers)
    {
        return response.into_response();
    }
    // Every replica's metrics added up, the remote replicas' asked for now.
    let replicas = state.scheduler.replica_metrics_now().await;
    let mut m = MetricsSnapshot::default();
    for replica in &replicas {
        m.add(replica);
    }
    let mut text = metrics::render_totals(&m);
    text.push_str(&metrics::render_vllm(&m, &state.model_id));
    if let Some(prefill) = state.scheduler.prefill_replicas() {
        text.push_str(&metrics::render_roles(&replicas, prefill));
    }
    text.push_str(&metrics::render_health(&state.scheduler.health()));
    if state.scheduler.replicas() > 1 {
        text.push_str(&metrics::render_routing(
            &state.scheduler.routed(),
            &state.scheduler.decisions(),
        ));
    }
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The parameters of choice `index` of `n`: its own seed (`seed + index`), so seeded
/// requests give `n` different and reproducible choices.
fn choice_params(params: &SamplingParams, index: usize) -> SamplingParams {
    SamplingParams {
        seed: params.seed.map(|s| s.wrapping_add(index as u64)),
        ..params.clone()
    }
}

/// Submits `prompt_tokens` and returns the event stream, or a 400 when it cannot fit.
fn submit(
    state: &AppState,
    prompt_tokens: Vec<u32>,
    params: SamplingParams,
) -> Result<UnboundedReceiverStream<Event>, ApiError> {
    if prompt_tokens.is_empty() {
        return Err(bad_request("the prompt is empty"));
    }
    let total = prompt_tokens.len().checked_add(params.max_tokens);
    if total.is_none_or(|total| total > state.max_context_tokens) {
        return Err(bad_field(
            "max_tokens",
            format!(
                "this model's maximum context length is {} tokens; the prompt has {} and `max_tokens` asks for {} (at most {} here)",
                state.max_context_tokens,
                prompt_tokens.len(),
                params.max_tokens,
                state.max_context_tokens.saturating_sub(prompt_tokens.len())
            ),
        ));
    }
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    state
        .scheduler
        .submit(Request {
            prompt_tokens,
            params,
            events,
            received_at: Instant::now(),
            pd: None,
        })
        .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "server_error", e))?;
    Ok(UnboundedReceiverStream::new(receiver))
}

/// Runs `work` (tokenizing, a chat template: seconds for a prompt of megabytes) on the
/// blocking pool, so the async workers go on answering `/health` and the other requests.
///
/// Errors: `work`'s, or a 500 when it panicked.
async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("tokenizing the prompt failed: {e}"),
        )
    })?
}

/// Submits choice `i` of `n` for each `i`, each with its own seed.
fn submit_choices(
    state: &AppState,
    prompt_tokens: &[u32],
    checked: &Checked,
) -> Result<Vec<UnboundedReceiverStream<Event>>, ApiError> {
    state
        .scheduler
        .admit(checked.n)
        .map_err(errors::overloaded)?;
    (0..checked.n)
        .map(|i| {
            submit(
                state,
                prompt_tokens.to_vec(),
                choice_params(&checked.params, i),
            )
        })
        .collect()
}

fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// One whole choice.
struct Choice {
    text: String,
    finish_reason: &'static str,
    tokens: Vec<TokenOut>,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens the prefix cache supplied.
    cached_tokens: usize,
    /// When its first token arrived.
    first_token_at: Option<Instant>,
}

/// Collects a whole generation: text, finish reason, tokens with their logprobs, usage.
async fn collect(mut events: UnboundedReceiverStream<Event>) -> Result<Choice, ApiError> {
    let (mut text, mut tokens) = (String::new(), Vec::new());
    let mut first_token_at = None;
    while let Some(event) = events.next().await {
        match event {
            Event::Token {
                id,
                text: piece,
                logprob,
                top,
            } => {
                first_token_at.get_or_insert_with(Instant::now);
                text.push_str(&piece);
                tokens.push(TokenOut { id, logprob, top });
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                return Ok(Choice {
                    text,
                    finish_reason: finish_name(finish_reason),
                    tokens,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    first_token_at,
                });
            }
            Event::Error(message) => {
                return Err(error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    message,
                ));
            }
            // The router turns a hand-off into the decode replica's events.
            Event::HandedOff { .. } => {}
        }
    }
    Err(error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine stopped",
    ))
}

/// Every choice, generated concurrently; a 503 when shutdown cancels them first (dropping
/// the streams stops their sequences).
async fn collect_all(
    streams: Vec<UnboundedReceiverStream<Event>>,
    cancel: Cancel,
) -> Result<Vec<Choice>, ApiError> {
    tokio::select! {
        choices = collect_each(streams) => choices,
        () = cancel.cancelled() => Err(error(StatusCode::SERVICE_UNAVAILABLE, "server_error", SHUTTING_DOWN)),
    }
}

/// Every choice, generated concurrently. The tasks that collect them belong to this future:
/// dropped (its client went away), it aborts them, and their receivers, dropped, take the
/// choices out of the scheduler (a waiting one is never computed).
async fn collect_each(
    streams: Vec<UnboundedReceiverStream<Event>>,
) -> Result<Vec<Choice>, ApiError> {
    let mut tasks = tokio::task::JoinSet::new();
    for (index, stream) in streams.into_iter().enumerate() {
        tasks.spawn(async move { (index, collect(stream).await) });
    }
    let mut choices: Vec<Option<Choice>> = (0..tasks.len()).map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        let (index, choice) = joined.map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("a choice failed: {e}"),
            )
        })?;
        choices[index] = Some(choice?);
    }
    Ok(choices.into_iter().flatten().collect())
}

/// OpenAI's usage: the prompt counted once, the completions of every choice summed, and
/// the prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`:
/// the most any choice found, as the prompt is counted once).
fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn usage_of(choices: &[Choice]) -> Value {
    usage(
        choices.first().map_or(0, |c| c.prompt_tokens),
        choices.iter().map(|c| c.completion_tokens).sum(),
        choices.iter().map(|c| c.cached_tokens).max().unwrap_or(0),
    )
}

/// A request answered, for the access log.
struct Served<'a> {
    id: &'a str,
    /// Prompt tokens, and tokens generated over every choice.
    prompt: usize,
    completion: usize,
    /// Choices.
    n: usize,
    stream: bool,
    first_token_at: Option<Instant>,
}

/// One access-log line: `POST /v1/completions 200 cmpl-7: 14 prompt + 16 generated tokens
/// (n 1, stream), TTFT 35 ms, 0.41 s` — or the status and the error's message.
fn log_access(state: &AppState, path: &str, outcome: Result<Served, &ApiError>, started: Instant) {
    let line = match outcome {
        Ok(Served {
            id,
            prompt,
            completion,
            n,
            stream,
            first_token_at,
        }) => format!(
            "POST {path} 200 {id}: {prompt} prompt + {completion} generated tokens (n {n}{}), TTFT {}, {:.2} s",
            if stream { ", stream" } else { "" },
            first_token_at.map_or("-".to_string(), |t| format!(
                "{:.0} ms",
                t.duration_since(started).as_secs_f64() * 1e3
            )),
            started.elapsed().as_secs_f64()
        ),
        Err(error) => format!("POST {path} {}: {}", error.status.as_u16(), error.message),
    };
    (state.access_log)(&line);
}

/// The access-log line of a whole (not streamed) answer.
fn log_choices(state: &AppState, path: &str, id: &str, choices: &[Choice], started: Instant) {
    let first = choices.iter().filter_map(|c| c.first_token_at).min();
    log_access(
        state,
        path,
        Ok(Served {
            id,
            prompt: choices.first().map_or(0, |c| c.prompt_tokens),
            completion: choices.iter().map(|c| c.completion_tokens).sum(),
            n: choices.len(),
            stream: false,
            first_token_at: first,
        }),
        started,
    );
}

/// What the validator knows of the model `state` serves.
fn served_model(state: &AppState) -> ServedModel<'_> {
    ServedModel {
        model_id: &state.model_id,
        max_context_tokens: state.max_context_tokens,
        vocab_size: state.tokenizer.vocab_size(),
        eos_ids: &state.tokenizer.eos_ids,
    }
}

/// Reads and checks a request of `endpoint`: authorized, parsed, every field checked.
fn read(
    state: &AppState,
    headers: &HeaderMap,
    body: &Bytes,
    endpoint: Endpoint,
    default_max_tokens: usize,
) -> Result<(Body, Checked), ApiError> {
    authorize(state, headers)?;
    // JSON only (as FastAPI, behind vLLM and SGLang, since 0.65.2): a web page can post
    // `text/plain` across sites without a preflight, never `application/json`.
    if let Some(kind) = headers.get(axum::http::header::CONTENT_TYPE) {
        let kind = kind.to_str().unwrap_or_default().to_ascii_lowercase();
        let essence = kind.split(';').next().unwrap_or_default().trim();
        if essence != "application/json" && !essence.ends_with("+json") {
            return Err(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!(
                    "the body must be JSON: send `Content-Type: application/json` (got `{essence}`)"
                ),
            ));
        }
    }
    let request = api::parse(body)?;
    let checked = api::check(&served_model(state), &request, endpoint, default_max_tokens)?;
    Ok((request, checked))
}

async fn completions(
    Ready(state, cancel): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    completions_inner(Arc::clone(&state), cancel, headers, body, started)
        .await
        .inspect_err(|e| log_access(&state, "/v1/completions", Err(e), started))
}

async fn completions_inner(
    state: Arc<AppState>,
    cancel: Cancel,
    headers: HeaderMap,
    body: Bytes,
    started: Instant,
) -> Result<Response, ApiError> {
    const PATH: &str = "/v1/completions";
    let (request, checked) = read(&state, &headers, &body, Endpoint::Completions, 16)?;
    let tokenizer_state = Arc::clone(&state);
    let prompt_tokens = off_the_workers(move || {
        api::completion_prompt_tokens(&tokenizer_state.tokenizer, &request)
    })
    .await?;
    let id = format!(
        "cmpl-{}",
        scheduler::REQUEST_COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let model = state.model_id.clone();
    let streams = submit_choices(&state, &prompt_tokens, &checked)?;
    if checked.stream {
        let (id2, model2) = (id.clone(), model.clone());
        let tokenizer_state = Arc::clone(&state);
        let with_logprobs = checked.params.logprobs;
        let with_top = checked.params.top_logprobs > 0;
        let ctx = StreamContext {
            state: Arc::clone(&state),
            path: PATH,
            id: id.clone(),
            started,
            cancel,
            include_usage: checked.include_usage,
            continuous_usage: checked.continuous_usage.then_some(prompt_tokens.len()),
        };
        return Ok(stream_choices(
            ctx,
            streams,
            Vec::new(),
            move |index, event| match event {
                Event::Token {
                    id: token,
                    text,
                    logprob,
                    top,
                } => {
                    let logprobs = with_logprobs.then(|| {
                        completion_logprobs(
                            &tokenizer_state.tokenizer,
                            &[TokenOut {
                                id: *token,
                                logprob: *logprob,
                                top: top.clone(),
                            }],
                            with_top,
                        )
                    });
                    Some(
                        json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": null}]}),
                    )
                }
                Event::Done { finish_reason, .. } => Some(
                    json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": [{"index": index, "text": "", "logprobs": null, "finish_reason": finish_name(*finish_reason)}]}),
                ),
                Event::Error(message) => {
                    Some(json!({"error": {"message": message, "type": "server_error"}}))
                }
                Event::HandedOff { .. } => None,
            },
            move |usage| json!({"id": id2, "object": "text_completion", "created": now(), "model": model2, "choices": [], "usage": usage}),
        ));
    }
    let choices = collect_all(streams, cancel).await?;
    log_choices(&state, PATH, &id, &choices, started);
    let with_top = checked.params.top_logprobs > 0;
    let rendered: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = checked
                .params
                .logprobs
                .then(|| completion_logprobs(&state.tokenizer, &c.tokens, with_top));
            json!({"index": index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs})
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": state.model_id,
        "choices": rendered,
        "usage": usage_of(&choices)
    }))
    .into_response())
}

async fn chat_completions(
    Ready(state, cancel): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    chat_inner(Arc::clone(&state), cancel, headers, body, started)
        .await
        .inspect_err(|e| log_access(&state, "/v1/chat/completions", Err(e), started))
}

async fn chat_inner(
    state: Arc<AppState>,
    cancel: Cancel,
    headers: HeaderMap,
    body: Bytes,
    started: Instant,
) -> Result<Response, ApiError> {
    let default_max_tokens = state.max_context_tokens.min(1024) / 2;
    const PATH: &str = "/v1/chat/completions";
    let (request, checked) = read(&state, &headers, &body, Endpoint::Chat, default_max_tokens)?;
    let tokenizer_state = Arc::clone(&state);
    let add_special_tokens = checked.add_special_tokens;
    let prompt_tokens = off_the_workers(move || {
        let prompt = api::chat_prompt(&tokenizer_state.tokenizer, &request)?;
        api::chat_prompt_tokens(&tokenizer_state.tokenizer, &prompt, add_special_tokens)
    })
    .await?;
    let id = format!(
        "chatcmpl-{}",
        scheduler::REQUEST_COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let model = state.model_id.clone();
    let streams = submit_choices(&state, &prompt_tokens, &checked)?;
    if checked.stream {
        let head = (0..checked.n)
            .map(|index| json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}))
            .collect();
        let (id2, model2) = (id.clone(), model.clone());
        let tokenizer_state = Arc::clone(&state);
        let with_logprobs = checked.params.logprobs;
        let ctx = StreamContext {
            state: Arc::clone(&state),
            path: PATH,
            id: id.clone(),
            started,
            cancel,
            include_usage: checked.include_usage,
            continuous_usage: checked.continuous_usage.then_some(prompt_tokens.len()),
        };
        return Ok(stream_choices(
            ctx,
            streams,
            head,
            move |index, event| match event {
                Event::Token {
                    id: token,
                    text,
                    logprob,
                    top,
                } => {
                    let logprobs = with_logprobs.then(|| {
                        chat_logprobs(
                            &tokenizer_state.tokenizer,
                            &[TokenOut {
                                id: *token,
                                logprob: *logprob,
                                top: top.clone(),
                            }],
                        )
                    });
                    Some(
                        json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null}]}),
                    )
                }
                Event::Done { finish_reason, .. } => Some(
                    json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": index, "delta": {}, "logprobs": null, "finish_reason": finish_name(*finish_reason)}]}),
                ),
                Event::Error(message) => {
                    Some(json!({"error": {"message": message, "type": "server_error"}}))
                }
                Event::HandedOff { .. } => None,
            },
            move |usage| json!({"id": id2, "object": "chat.completion.chunk", "created": now(), "model": model2, "choices": [], "usage": usage}),
        ));
    }
    let choices = collect_all(streams, cancel).await?;
    log_choices(&state, PATH, &id, &choices, started);
    let rendered: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = checked
                .params
                .logprobs
                .then(|| chat_logprobs(&state.tokenizer, &c.tokens));
            json!({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs, "finish_reason": c.finish_reason})
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "chat.completion", "created": now(), "model": state.model_id,
        "choices": rendered,
        "usage": usage_of(&choices)
    }))
    .into_response())
}
