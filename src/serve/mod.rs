//! The OpenAI-compatible HTTP API (axum) over the continuous-batching [`scheduler`]:
//! `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (with SSE
//! streaming), `GET /health`, `GET /metrics`. Errors are OpenAI error JSON with the right
//! status; the server keeps serving after any bad request. Bound to 127.0.0.1 unless told.

pub mod http;
pub mod router;
pub mod scheduler;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::runtime::exec::engine::FinishReason;
use crate::runtime::model::chat::{ChatMessage, render};
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::Tokenizer;
use scheduler::{Event, HistogramSnapshot, MetricsSnapshot, Request};

/// What the handlers share.
pub struct AppState {
    /// Where requests go: the local scheduler, and the other DP replicas if any.
    pub scheduler: router::Router,
    /// The served model's id (what `/v1/models` lists and requests name).
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub max_context_tokens: usize,
    pub api_key: Option<String>,
    /// Where the access log goes: one line per request answered (as vLLM logs them).
    pub access_log: Arc<dyn Fn(&str) + Send + Sync>,
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

/// `GET /health`: 200 once ready and while every replica works, 503 otherwise.
async fn health(Ready(state, _): Ready) -> Result<&'static str, ApiError> {
    match state.scheduler.failure() {
        Some(failure) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("the engine has failed: {failure}"),
        )),
        None => Ok("ok"),
    }
}

/// The router with every endpoint.
pub fn router(gate: Arc<Gate>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(gate)
}

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    /// The request field at fault, when one is.
    param: Option<String>,
    /// A machine-readable code (`model_not_found`), when OpenAI has one.
    code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        (self.status, axum::Json(body)).into_response()
    }
}

fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
        param: None,
        code: None,
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A 400 about request field `param`.
fn bad_field(param: &str, message: impl Into<String>) -> ApiError {
    ApiError {
        param: Some(param.to_string()),
        ..bad_request(message)
    }
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented == Some(key.as_str()) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key: send `Authorization: Bearer <key>`",
        ))
    }
}

async fn models(Ready(state, _): Ready, headers: HeaderMap) -> Response {
    if let Err(response) = authorize(&state, &headers) {
        return response.into_response();
    }
    axum::Json(json!({"object": "list", "data": [{"id": state.model_id, "object": "model", "created": now(), "owned_by": "infer"}]})).into_response()
}

async fn metrics(Ready(state, _): Ready) -> Response {
    // Every replica's metrics added up, the remote replicas' asked for now.
    let replicas = state.scheduler.replica_metrics_now().await;
    let mut m = MetricsSnapshot::default();
    for replica in &replicas {
        m.add(replica);
    }
    let mut text = render_totals(&m);
    if let Some(prefill) = state.scheduler.prefill_replicas() {
        text.push_str(&render_roles(&replicas, prefill));
    }
    if state.scheduler.replicas() > 1 {
        text.push_str(&render_routing(
            &state.scheduler.routed(),
            &state.scheduler.decisions(),
        ));
    }
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// One plain Prometheus series of `/metrics`: its name, help, type and value.
struct Series {
    name: &'static str,
    help: &'static str,
    /// `gauge` or `counter`.
    kind: &'static str,
    value: fn(&MetricsSnapshot) -> u64,
}

/// Every plain series of `/metrics`, in the order they are rendered.
const SERIES: [Series; 19] = [
    Series {
        name: "infer_requests_running",
        help: "Sequences in the running batch.",
        kind: "gauge",
        value: |m| m.running,
    },
    Series {
        name: "infer_requests_waiting",
        help: "Requests waiting to join the batch.",
        kind: "gauge",
        value: |m| m.waiting,
    },
    Series {
        name: "infer_requests_total",
        help: "Requests received.",
        kind: "counter",
        value: |m| m.requests_total,
    },
    Series {
        name: "infer_prompt_tokens_total",
        help: "Prompt tokens processed.",
        kind: "counter",
        value: |m| m.prompt_tokens_total,
    },
    Series {
        name: "infer_generation_tokens_total",
        help: "Tokens generated.",
        kind: "counter",
        value: |m| m.generation_tokens_total,
    },
    Series {
        name: "infer_kv_cache_bytes",
        help: "KV-cache bytes held by running sequences.",
        kind: "gauge",
        value: |m| m.kv_cache_bytes,
    },
    Series {
        name: "infer_kv_cache_blocks_used",
        help: "KV-cache blocks (16 positions each) held by live sequences.",
        kind: "gauge",
        value: |m| m.kv_blocks_used,
    },
    Series {
        name: "infer_kv_cache_blocks_total",
        help: "KV-cache blocks the pool can hold.",
        kind: "gauge",
        value: |m| m.kv_blocks_total,
    },
    Series {
        name: "infer_preemptions_total",
        help: "Sequences preempted (KV blocks freed, recomputed later) because blocks ran out.",
        kind: "counter",
        value: |m| m.preemptions_total,
    },
    Series {
        name: "infer_prefix_cache_queries_total",
        help: "Prompt tokens of admitted sequences looked up in the prefix cache.",
        kind: "counter",
        value: |m| m.prefix_cache_queries_total,
    },
    Series {
        name: "infer_prefix_cache_hits_total",
        help: "Prompt tokens whose KV blocks the prefix cache supplied.",
        kind: "counter",
        value: |m| m.prefix_cache_hits_total,
    },
    Series {
        name: "infer_pd_kv_bytes_sent_total",
        help: "Prefill/decode disaggregation: KV bytes prefill replicas sent to decode replicas (by each driver rank's shard).",
        kind: "counter",
        value: |m| m.pd_kv_bytes_sent_total,
    },
    Series {
        name: "infer_pd_kv_send_microseconds_total",
        help: "Prefill/decode disaggregation: time spent sending those KV bytes, microseconds.",
        kind: "counter",
        value: |m| m.pd_kv_send_micros_total,
    },
    Series {
        name: "infer_pd_kv_bytes_sent_shm_total",
        help: "Prefill/decode disaggregation: of the KV bytes sent, those that went through a shared ring in /dev/shm (prefill and decode rank on one host); the rest went over TCP.",
        kind: "counter",
        value: |m| m.pd_kv_bytes_sent_shm_total,
    },
    Series {
        name: "infer_pd_kv_parts_sent_total",
        help: "Prefill/decode disaggregation: KV parts sent, each a chunk of a prompt's positions as the prefill computed it (by each driver rank's shard).",
        kind: "counter",
        value: |m| m.pd_kv_parts_sent_total,
    },
    Series {
        name: "infer_pd_handoffs_total",
        help: "Prefill/decode disaggregation: requests a prefill replica handed to a decode replica.",
        kind: "counter",
        value: |m| m.pd_handoffs_total,
    },
    Series {
        name: "infer_pd_decode_prefill_tokens_total",
        help: "Prefill/decode disaggregation: prompt tokens a decode replica computed itself (recomputation after preemption).",
        kind: "counter",
        value: |m| m.pd_decode_prefill_tokens_total,
    },
    Series {
        name: "infer_pd_transfer_failures_total",
        help: "Prefill/decode disaggregation: requests failed because their KV transfer failed.",
        kind: "counter",
        value: |m| m.pd_transfer_failures_total,
    },
    Series {
        name: "infer_prefix_cache_evictions_total",
        help: "Cached KV blocks evicted (least recently used first) to make room.",
        kind: "counter",
        value: |m| m.prefix_cache_evictions_total,
    },
];

/// The Prometheus text of every replica's metrics added up (`m`): the KV-cache usage and
/// prefix-cache hit ratios, every [`SERIES`], and the TTFT and TPOT histograms (seconds).
fn render_totals(m: &MetricsSnapshot) -> String {
    let mut text = format!(
        "# HELP infer_kv_cache_usage_ratio Fraction of the KV-cache blocks in use (0 to 1).\n# TYPE infer_kv_cache_usage_ratio gauge\ninfer_kv_cache_usage_ratio {}\n",
        m.kv_blocks_used as f64 / m.kv_blocks_total.max(1) as f64
    );
    text.push_str(&format!(
        "# HELP infer_prefix_cache_hit_rate Fraction of the looked-up prompt tokens found in the prefix cache (0 to 1).\n# TYPE infer_prefix_cache_hit_rate gauge\ninfer_prefix_cache_hit_rate {}\n",
        m.prefix_cache_hits_total as f64 / m.prefix_cache_queries_total.max(1) as f64
    ));
    for Series {
        name,
        help,
        kind,
        value,
    } in &SERIES
    {
        let value = value(m);
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    }
    text.push_str(
        &m.ttft
            .render("infer_time_to_first_token_seconds", "Time to first token."),
    );
    text.push_str(&m.tpot.render(
        "infer_time_per_output_token_seconds",
        "Time per output token after the first.",
    ));
    text
}

/// Data parallelism's Prometheus counters: the requests `routed` to each replica, and the
/// router's `decisions` per replica by [`router::RouteReason`].
fn render_routing(routed: &[u64], decisions: &[[u64; 3]]) -> String {
    let mut text = String::from(
        "# HELP infer_dp_requests_routed_total Requests routed to each data-parallel replica.\n# TYPE infer_dp_requests_routed_total counter\n",
    );
    for (replica, count) in routed.iter().enumerate() {
        text.push_str(&format!(
            "infer_dp_requests_routed_total{{replica=\"{replica}\"}} {count}\n"
        ));
    }
    text.push_str("# HELP infer_router_decisions_total Requests routed to each replica, by the cache-aware policy's reason.\n# TYPE infer_router_decisions_total counter\n");
    for (replica, counts) in decisions.iter().enumerate() {
        for (reason, count) in router::RouteReason::ALL.iter().zip(counts) {
            text.push_str(&format!(
                "infer_router_decisions_total{{replica=\"{replica}\",reason=\"{}\"}} {count}\n",
                reason.name()
            ));
        }
    }
    text
}

/// Prefill/decode disaggregation's metrics by role (`role="prefill"`: replicas
/// `0..prefill`, `role="decode"`: the others): requests waiting and running, and the TTFT
/// and TPOT histograms. A prefill replica observes each request's TTFT; a decode replica its
/// TPOT, the first decoded token's measured from the hand-off (so it includes the KV
/// import).
fn render_roles(replicas: &[MetricsSnapshot], prefill: usize) -> String {
    let mut roles = [MetricsSnapshot::default(), MetricsSnapshot::default()];
    for (index, replica) in replicas.iter().enumerate() {
        roles[usize::from(index >= prefill)].add(replica);
    }
    let names = ["prefill", "decode"];
    let mut text = String::new();
    for (name, help, value) in [
        (
            "infer_pd_requests_waiting",
            "Requests waiting to join a batch, by prefill/decode role.",
            (|m: &MetricsSnapshot| m.waiting) as fn(&MetricsSnapshot) -> u64,
        ),
        (
            "infer_pd_requests_running",
            "Sequences in the running batches, by prefill/decode role.",
            |m: &MetricsSnapshot| m.running,
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (role, m) in names.iter().zip(&roles) {
            text.push_str(&format!("{name}{{role=\"{role}\"}} {}\n", value(m)));
        }
    }
    for (name, help, histogram) in [
        (
            "infer_pd_time_to_first_token_seconds",
            "Time to first token, by prefill/decode role (prefill replicas sample first tokens).",
            (|m: &MetricsSnapshot| &m.ttft) as fn(&MetricsSnapshot) -> &HistogramSnapshot,
        ),
        (
            "infer_pd_time_per_output_token_seconds",
            "Time per output token after the first, by prefill/decode role (a decode replica's first token counts from the hand-off).",
            |m: &MetricsSnapshot| &m.tpot,
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (role, m) in names.iter().zip(&roles) {
            text.push_str(&histogram(m).render_labelled(name, &format!("role=\"{role}\"")));
        }
    }
    text
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The most choices one request may ask for (`n`).
pub const MAX_N: u64 = 16;
/// The most alternatives per token `top_logprobs` may ask for (OpenAI's limit; the legacy
/// completions `logprobs` allows 5).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// A request body of either endpoint, every field typed; a field of another type, or one
/// not listed, is a 400 naming it. Fields accepted but without effect: `user` (as vLLM);
/// `presence_penalty`/`frequency_penalty` at 0, an empty `logit_bias`, `echo: false`,
/// `best_of` equal to `n`, `suffix: null`, `response_format` `{"type": "text"}` (the
/// defaults); anything else in them is refused, never silently dropped.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Body {
    model: Option<String>,
    /// `/v1/completions`: a string or a list of token ids.
    prompt: Option<Value>,
    /// `/v1/chat/completions`.
    messages: Option<Vec<Message>>,
    max_tokens: Option<u64>,
    /// The chat endpoint's newer name for `max_tokens`.
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    /// vLLM's extension: keep the `top_k` most likely tokens (`-1` or `0`: all).
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Completions: how many alternatives per token (0 to 5); chat: whether to report.
    logprobs: Option<Value>,
    /// Chat: alternatives per token (0 to 20), with `logprobs: true`.
    top_logprobs: Option<u64>,
    echo: Option<bool>,
    best_of: Option<u64>,
    suffix: Option<Value>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    response_format: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    parallel_tool_calls: Option<Value>,
    /// Ignored (an end-user id for abuse monitoring at OpenAI).
    #[allow(dead_code)]
    user: Option<String>,
}

/// `stop`: one string or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    /// vLLM's: usage on every chunk; accepted only as `false`.
    continuous_usage_stats: Option<bool>,
}

/// One chat message: `content` a string or a list of parts (`{"type": "text", "text"}`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: Option<Content>,
    /// A participant's name: accepted, not rendered (the chat templates have no place).
    #[allow(dead_code)]
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// Which endpoint a body came to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

/// A checked request: its sampling parameters and how to answer.
struct Checked {
    params: SamplingParams,
    /// Choices to generate (`n`).
    n: usize,
    stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices.
    include_usage: bool,
}

/// Parses a body, naming the field of any type error (`max_tokens: invalid type …`).
fn parse(body: &Bytes) -> Result<Body, ApiError> {
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            bad_request(format!("malformed request body: {inner}"))
        } else {
            bad_field(&path, format!("`{path}`: {inner}"))
        }
    })
}

/// Checks every field of `body` for `endpoint` (unsupported values refused by name, numbers
/// against their ranges) and builds the sampling parameters; `default_max_tokens` when the
/// body has none.
///
/// Errors: a 404 for another model, a 400 naming the first field at fault, in the order of
/// the helpers called here.
fn check(
    state: &AppState,
    body: &Body,
    endpoint: Endpoint,
    default_max_tokens: usize,
) -> Result<Checked, ApiError> {
    check_model(state, body)?;
    check_endpoint_fields(body, endpoint)?;
    check_unsupported(body)?;
    let n = check_n(body)?;
    let max_tokens = check_max_tokens(state, body, default_max_tokens)?;
    let (temperature, top_p, top_k) = check_sampling(body)?;
    let stop = check_stop(body)?;
    let (logprobs, top_logprobs) = check_logprobs(body, endpoint)?;
    let (stream, include_usage) = check_stream(body)?;
    Ok(Checked {
        params: SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            // A negative seed keeps its bits (OpenAI's seed is any integer).
            seed: body.seed.map(|s| s as u64),
            max_tokens,
            stop,
            logprobs,
            top_logprobs,
        },
        n: n as usize,
        stream,
        include_usage,
    })
}

/// Checks that `body` names no model but the served one. Errors: a 404 `model_not_found`.
fn check_model(state: &AppState, body: &Body) -> Result<(), ApiError> {
    if let Some(model) = &body.model
        && model != &state.model_id
    {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..bad_request(format!(
                "the model `{model}` does not exist; this server serves `{}`",
                state.model_id
            ))
        });
    }
    Ok(())
}

/// Checks that `body` holds no field of the other endpoint than `endpoint`. Errors: a 400
/// naming the first such field and where it belongs.
fn check_endpoint_fields(body: &Body, endpoint: Endpoint) -> Result<(), ApiError> {
    let wrong_endpoint = match endpoint {
        Endpoint::Completions => [
            ("messages", body.messages.is_some()),
            (
                "max_completion_tokens",
                body.max_completion_tokens.is_some(),
            ),
            ("top_logprobs", body.top_logprobs.is_some()),
        ],
        Endpoint::Chat => [
            ("prompt", body.prompt.is_some()),
            ("echo", body.echo.is_some()),
            ("suffix", body.suffix.is_some()),
        ],
    };
    if let Some((field, _)) = wrong_endpoint.iter().find(|(_, present)| *present) {
        let other = match endpoint {
            Endpoint::Completions => "/v1/chat/completions",
            Endpoint::Chat => "/v1/completions",
        };
        return Err(bad_field(
            field,
            format!("`{field}` belongs to {other}, not this endpoint"),
        ));
    }
    Ok(())
}

/// Checks the fields accepted only at their defaults: tools, penalties, `logit_bias`,
/// `echo`, `suffix`, `response_format`. Errors: a 400 naming the first field set otherwise.
fn check_unsupported(body: &Body) -> Result<(), ApiError> {
    for (field, present) in [
        ("tools", body.tools.is_some()),
        ("tool_choice", body.tool_choice.is_some()),
        ("functions", body.functions.is_some()),
        ("function_call", body.function_call.is_some()),
        ("parallel_tool_calls", body.parallel_tool_calls.is_some()),
    ] {
        if present {
            return Err(bad_field(
                field,
                format!("`{field}` is not supported: this server does not call tools"),
            ));
        }
    }
    for (field, value) in [
        ("presence_penalty", body.presence_penalty),
        ("frequency_penalty", body.frequency_penalty),
    ] {
        if value.is_some_and(|v| v != 0.0) {
            return Err(bad_field(
                field,
                format!("`{field}` is not supported (only 0, its default)"),
            ));
        }
    }
    if body.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(bad_field(
            "logit_bias",
            "`logit_bias` is not supported (only an empty map)",
        ));
    }
    if body.echo == Some(true) {
        return Err(bad_field(
            "echo",
            "`echo` is not supported (only false, its default)",
        ));
    }
    if body.suffix.as_ref().is_some_and(|s| !s.is_null()) {
        return Err(bad_field("suffix", "`suffix` is not supported"));
    }
    if let Some(format) = &body.response_format {
        let kind = format.get("type").and_then(Value::as_str);
        if kind != Some("text") {
            return Err(bad_field(
                "response_format",
                format!(
                    "`response_format` {} is not supported: only {{\"type\": \"text\"}} (no constrained decoding)",
                    kind.map_or_else(|| format.to_string(), |k| format!("`{k}`"))
                ),
            ));
        }
    }
    Ok(())
}

/// The choices `body` asks for (`n`, 1 by default). Errors: a 400 for `n` outside 1 to
/// [`MAX_N`], or a `best_of` other than `n`.
fn check_n(body: &Body) -> Result<u64, ApiError> {
    let n = body.n.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(bad_field("n", format!("`n` must be 1 to {MAX_N}, got {n}")));
    }
    if let Some(best_of) = body.best_of
        && best_of != n
    {
        return Err(bad_field(
            "best_of",
            format!("`best_of` is not supported (only equal to `n`, {n}), got {best_of}"),
        ));
    }
    Ok(n)
}

/// The tokens to generate at most: `max_tokens` or `max_completion_tokens`, else
/// `default_max_tokens`. Errors: a 400 for two different values, 0, or more than the
/// model's context.
fn check_max_tokens(
    state: &AppState,
    body: &Body,
    default_max_tokens: usize,
) -> Result<usize, ApiError> {
    let max_tokens = match (body.max_tokens, body.max_completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad_field(
                "max_completion_tokens",
                "give `max_tokens` or `max_completion_tokens`, not two different values",
            ));
        }
        (Some(v), _) | (None, Some(v)) => v,
        (None, None) => default_max_tokens as u64,
    };
    let field = if body.max_tokens.is_some() || body.max_completion_tokens.is_none() {
        "max_tokens"
    } else {
        "max_completion_tokens"
    };
    if max_tokens == 0 {
        return Err(bad_field(field, format!("`{field}` must be at least 1")));
    }
    usize::try_from(max_tokens)
        .ok()
        .filter(|&v| v <= state.max_context_tokens)
        .ok_or_else(|| {
            bad_field(
                field,
                format!(
                    "`{field}` is {max_tokens}, more than this model's context of {} tokens",
                    state.max_context_tokens
                ),
            )
        })
}

/// The sampling knobs `(temperature, top_p, top_k)`, defaults 1, 1 and 0 (all tokens).
/// Errors: a 400 for a temperature outside [0, 2], a `top_p` outside (0, 1], a negative
/// `top_k` other than -1.
fn check_sampling(body: &Body) -> Result<(f64, f64, usize), ApiError> {
    let temperature = body.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad_field(
            "temperature",
            format!("`temperature` must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad_field(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match body.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        k => {
            return Err(bad_field(
                "top_k",
                format!("`top_k` must be -1 or 0 (all tokens) or positive, got {k}"),
            ));
        }
    };
    Ok((temperature, top_p, top_k))
}

/// The stop strings (none by default). Errors: a 400 for an empty one.
fn check_stop(body: &Body) -> Result<Vec<String>, ApiError> {
    let stop = match &body.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(list)) => list.clone(),
    };
    if stop.iter().any(String::is_empty) {
        return Err(bad_field("stop", "`stop` strings must not be empty"));
    }
    Ok(stop)
}

/// Whether to report logprobs, and how many alternatives per token: completions'
/// `logprobs` is a count (0 to 5), chat's a flag with `top_logprobs` (0 to
/// [`MAX_TOP_LOGPROBS`]). Errors: a 400 for a value of the wrong kind or range, or
/// `top_logprobs` without `logprobs: true`.
fn check_logprobs(body: &Body, endpoint: Endpoint) -> Result<(bool, usize), ApiError> {
    match endpoint {
        Endpoint::Completions => match &body.logprobs {
            None | Some(Value::Null) => Ok((false, 0)),
            Some(Value::Number(k)) if k.as_u64().is_some_and(|k| k <= 5) => {
                Ok((true, k.as_u64().unwrap_or(0) as usize))
            }
            Some(other) => Err(bad_field(
                "logprobs",
                format!(
                    "`logprobs` on /v1/completions is the number of alternatives per token, 0 to 5; got {other}"
                ),
            )),
        },
        Endpoint::Chat => {
            let on = match &body.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(on)) => *on,
                Some(other) => {
                    return Err(bad_field(
                        "logprobs",
                        format!(
                            "`logprobs` on /v1/chat/completions is true or false; got {other} (alternatives: `top_logprobs`)"
                        ),
                    ));
                }
            };
            let top = body.top_logprobs.unwrap_or(0);
            if top > MAX_TOP_LOGPROBS {
                return Err(bad_field(
                    "top_logprobs",
                    format!("`top_logprobs` must be 0 to {MAX_TOP_LOGPROBS}, got {top}"),
                ));
            }
            if top > 0 && !on {
                return Err(bad_field(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            Ok((on, top as usize))
        }
    }
}

/// Whether to stream, and whether a last chunk carries the usage
/// (`stream_options.include_usage`). Errors: a 400 for `stream_options` without
/// `stream: true`, or `continuous_usage_stats: true`.
fn check_stream(body: &Body) -> Result<(bool, bool), ApiError> {
    let stream = body.stream.unwrap_or(false);
    let include_usage = match &body.stream_options {
        None => false,
        Some(_) if !stream => {
            return Err(bad_field(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
        Some(options) => {
            if options.continuous_usage_stats == Some(true) {
                return Err(bad_field(
                    "stream_options.continuous_usage_stats",
                    "`continuous_usage_stats` is not supported (usage comes once, at the end, with `include_usage`)",
                ));
            }
            options.include_usage.unwrap_or(false)
        }
    };
    Ok((stream, include_usage))
}

/// The parameters of choice `index` of `n`: its own seed (`seed + index`), so seeded
/// requests give `n` different and reproducible choices.
fn choice_params(params: &SamplingParams, index: usize) -> SamplingParams {
    SamplingParams {
        seed: params.seed.map(|s| s.wrapping_add(index as u64)),
        ..params.clone()
    }
}

/// Renders a chat's messages as one prompt text through the model's template.
///
/// Errors (400): a role other than `system`, `developer` (as `system`), `user` or
/// `assistant`; a content part that is not text; a template that fails.
fn chat_prompt(state: &AppState, messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(bad_field("messages", "`messages` is empty"));
    }
    let mut rendered = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let role = match message.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(bad_field(
                    &format!("messages[{i}].role"),
                    format!(
                        "`messages[{i}].role` is `{other}`: use `system`, `developer`, `user` or `assistant` (tool messages are not supported)"
                    ),
                ));
            }
        };
        let content = match &message.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str);
                    match (kind, part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(text)) => texts.push(text),
                        (Some("text"), None) => {
                            return Err(bad_field(
                                &format!("messages[{i}].content[{j}].text"),
                                format!(
                                    "`messages[{i}].content[{j}]` is a text part without a `text` string"
                                ),
                            ));
                        }
                        (kind, _) => {
                            return Err(bad_field(
                                &format!("messages[{i}].content[{j}]"),
                                format!(
                                    "`messages[{i}].content[{j}]` is a `{}` part: this model takes text only",
                                    kind.unwrap_or("untyped")
                                ),
                            ));
                        }
                    }
                }
                // As vLLM joins a message's text parts.
                texts.join("\n")
            }
        };
        rendered.push(ChatMessage {
            role: role.to_string(),
            content,
        });
    }
    let Some(template) = state.tokenizer.chat_template.as_deref() else {
        return Err(bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    };
    let token = |id: Option<u32>| {
        id.and_then(|i| state.tokenizer.token(i))
            .unwrap_or_default()
    };
    render(
        template,
        &rendered,
        true,
        &token(state.tokenizer.bos_id),
        &token(state.tokenizer.eos_ids.first().copied()),
    )
    .map_err(|e| bad_request(format!("{e:#}")))
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

/// Submits choice `i` of `n` for each `i`, each with its own seed.
fn submit_choices(
    state: &AppState,
    prompt_tokens: &[u32],
    checked: &Checked,
) -> Result<Vec<UnboundedReceiverStream<Event>>, ApiError> {
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

/// One generated token as a request hears it.
struct TokenOut {
    id: u32,
    logprob: Option<f32>,
    top: Vec<(u32, f32)>,
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

/// Every choice, generated concurrently.
async fn collect_each(
    streams: Vec<UnboundedReceiverStream<Event>>,
) -> Result<Vec<Choice>, ApiError> {
    let mut choices = Vec::with_capacity(streams.len());
    let handles: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(collect(s)))
        .collect();
    for handle in handles {
        choices.push(handle.await.map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("a choice failed: {e}"),
            )
        })??);
    }
    Ok(choices)
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

/// A token's text as a user reads it (`" iron"`, not the vocabulary's `Ġiron`).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// The legacy completions `logprobs` object: tokens, their logprobs, the top alternatives
/// per token (a map text → logprob) and each token's offset in the text.
fn completion_logprobs(tokenizer: &Tokenizer, tokens: &[TokenOut], with_top: bool) -> Value {
    let texts: Vec<String> = tokens.iter().map(|t| token_text(tokenizer, t.id)).collect();
    let mut offset = 0;
    let offsets: Vec<usize> = texts
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.len();
            at
        })
        .collect();
    let top: Option<Vec<Value>> = with_top.then(|| {
        tokens
            .iter()
            .map(|t| {
                let map: serde_json::Map<String, Value> = t
                    .top
                    .iter()
                    .map(|(id, lp)| (token_text(tokenizer, *id), json!(lp)))
                    .collect();
                Value::Object(map)
            })
            .collect()
    });
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[TokenOut]) -> Value {
    let entry = |id: u32, logprob: Option<f32>| {
        let text = token_text(tokenizer, id);
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut value = entry(t.id, t.logprob);
            value["top_logprobs"] = t.top.iter().map(|(id, lp)| entry(*id, Some(*lp))).collect();
            value
        })
        .collect();
    json!({ "content": content })
}

/// Streams every choice's events merged, each chunk made by `chunk(index, event)`, then a
/// usage chunk (no choices) when asked, then `[DONE]`.
#[allow(clippy::too_many_arguments)]
fn stream_choices(
    state: Arc<AppState>,
    path: &'static str,
    id: String,
    started: Instant,
    streams: Vec<UnboundedReceiverStream<Event>>,
    cancel: Cancel,
    include_usage: bool,
    head: Vec<Value>,
    chunk: impl Fn(usize, &Event) -> Option<Value> + Send + 'static,
    usage_chunk: impl Fn(Value) -> Value + Send + 'static,
) -> Response {
    let mut merged = tokio_stream::StreamMap::new();
    for (index, stream) in streams.into_iter().enumerate() {
        merged.insert(index, stream);
    }
    let n = merged.len();
    // A task drives the choices and hands chunks to the response; when the client goes
    // away, its next send fails, the task ends and dropping the choices' receivers cancels
    // their sequences.
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        for value in head {
            if sender.send(value).is_err() {
                return;
            }
        }
        let (mut prompt, mut completion, mut cached, mut done) = (0, 0, 0, 0);
        let mut first_token_at = None;
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        loop {
            let (index, event) = tokio::select! {
                next = merged.next() => match next {
                    Some(next) => next,
                    None => break,
                },
                () = &mut cancelled => {
                    let _ = sender.send(json!({"error": {"message": SHUTTING_DOWN, "type": "server_error"}}));
                    log_access(&state, path, Err(&error(StatusCode::SERVICE_UNAVAILABLE, "server_error", SHUTTING_DOWN)), started);
                    return;
                }
            };
            if matches!(event, Event::Token { .. }) {
                first_token_at.get_or_insert_with(Instant::now);
            }
            if let Event::Done {
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                ..
            } = &event
            {
                prompt = *prompt_tokens;
                completion += completion_tokens;
                cached = cached.max(*cached_tokens);
                done += 1;
            }
            if let Some(value) = chunk(index, &event)
                && sender.send(value).is_err()
            {
                return;
            }
            let finished = done == n && matches!(event, Event::Done { .. });
            if finished {
                log_access(
                    &state,
                    path,
                    Ok(Served {
                        id: &id,
                        prompt,
                        completion,
                        n,
                        stream: true,
                        first_token_at,
                    }),
                    started,
                );
            }
            if include_usage
                && finished
                && sender
                    .send(usage_chunk(usage(prompt, completion, cached)))
                    .is_err()
            {
                return;
            }
        }
    });
    let body = UnboundedReceiverStream::new(receiver)
        .map(Some)
        .chain(tokio_stream::once(None))
        .map(|chunk| {
            Ok::<_, std::convert::Infallible>(match chunk {
                Some(value) => SseEvent::default().data(value.to_string()),
                None => SseEvent::default().data("[DONE]"),
            })
        });
    Sse::new(body).into_response()
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

/// Reads and checks a request of `endpoint`: authorized, parsed, every field checked.
fn read(
    state: &AppState,
    headers: &HeaderMap,
    body: &Bytes,
    endpoint: Endpoint,
    default_max_tokens: usize,
) -> Result<(Body, Checked), ApiError> {
    authorize(state, headers)?;
    let request = parse(body)?;
    let checked = check(state, &request, endpoint, default_max_tokens)?;
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

/// The prompt of a `/v1/completions` body as token ids: its text encoded, or its list of
/// token ids as given.
///
/// Errors (400, `param` `prompt`): no prompt, one of another type, a text the tokenizer
/// refuses, a token id outside the vocabulary.
fn completion_prompt_tokens(state: &AppState, request: &Body) -> Result<Vec<u32>, ApiError> {
    let prompt_tokens = match &request.prompt {
        Some(Value::String(text)) => match state.tokenizer.encode(text, true) {
            Ok(ids) => ids,
            Err(e) => return Err(bad_field("prompt", format!("{e:#}"))),
        },
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
            .collect(),
        None => return Err(bad_field("prompt", "`prompt` is missing")),
        _ => {
            return Err(bad_field(
                "prompt",
                "`prompt` must be a string or a list of token ids",
            ));
        }
    };
    if prompt_tokens
        .iter()
        .any(|&t| t as usize >= state.tokenizer.vocab_size())
    {
        return Err(bad_field(
            "prompt",
            "`prompt` holds a token id outside the vocabulary",
        ));
    }
    Ok(prompt_tokens)
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
    let prompt_tokens = completion_prompt_tokens(&state, &request)?;
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
        return Ok(stream_choices(
            Arc::clone(&state),
            PATH,
            id.clone(),
            started,
            streams,
            cancel,
            checked.include_usage,
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
    let Some(messages) = &request.messages else {
        return Err(bad_field("messages", "`messages` is missing"));
    };
    let prompt = chat_prompt(&state, messages)?;
    let prompt_tokens = match state.tokenizer.encode(&prompt, true) {
        Ok(ids) => ids,
        Err(e) => return Err(bad_request(format!("{e:#}"))),
    };
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
        return Ok(stream_choices(
            Arc::clone(&state),
            PATH,
            id.clone(),
            started,
            streams,
            cancel,
            checked.include_usage,
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
