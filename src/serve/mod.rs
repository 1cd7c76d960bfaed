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

use crate::runtime::chat::{ChatMessage, render};
use crate::runtime::engine::FinishReason;
use crate::runtime::sampling::SamplingParams;
use crate::runtime::tokenizer::Tokenizer;
use scheduler::{Event, Request};

/// What the handlers share.
pub struct AppState {
    /// Where requests go: the local scheduler, and the other DP replicas if any.
    pub scheduler: router::Router,
    /// The served model's id (what `/v1/models` lists and requests name).
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub max_context_tokens: usize,
    pub api_key: Option<String>,
}

/// The HTTP server's shared state: the engine side once it is ready. The server listens
/// from the start; until [`Gate::open`], every endpoint answers 503 (`/health` included,
/// so a load balancer waits), as vLLM does while its engine starts.
#[derive(Default)]
pub struct Gate {
    ready: std::sync::OnceLock<Arc<AppState>>,
}

impl Gate {
    /// A closed gate (answering 503).
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate::default())
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

/// The ready engine side, extracted by handlers; a 503 while the model loads.
struct Ready(Arc<AppState>);

impl axum::extract::FromRequestParts<Arc<Gate>> for Ready {
    type Rejection = ApiError;

    async fn from_request_parts(
        _parts: &mut axum::http::request::Parts,
        gate: &Arc<Gate>,
    ) -> Result<Ready, ApiError> {
        gate.state().cloned().map(Ready).ok_or_else(|| {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the model is still loading; retry shortly",
            )
        })
    }
}

/// `GET /health`: 200 once ready and while every replica works, 503 otherwise.
async fn health(Ready(state): Ready) -> Result<&'static str, ApiError> {
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}});
        (self.status, axum::Json(body)).into_response()
    }
}

fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
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

async fn models(Ready(state): Ready, headers: HeaderMap) -> Response {
    if let Err(response) = authorize(&state, &headers) {
        return response.into_response();
    }
    axum::Json(json!({"object": "list", "data": [{"id": state.model_id, "object": "model", "created": now(), "owned_by": "infer"}]})).into_response()
}

async fn metrics(Ready(state): Ready) -> Response {
    // Every replica's metrics added up (remote replicas report twice a second).
    let m = state.scheduler.metrics_snapshot();
    let series = [
        (
            "infer_requests_running",
            "Sequences in the running batch.",
            "gauge",
            m.running,
        ),
        (
            "infer_requests_waiting",
            "Requests waiting to join the batch.",
            "gauge",
            m.waiting,
        ),
        (
            "infer_requests_total",
            "Requests received.",
            "counter",
            m.requests_total,
        ),
        (
            "infer_prompt_tokens_total",
            "Prompt tokens processed.",
            "counter",
            m.prompt_tokens_total,
        ),
        (
            "infer_generation_tokens_total",
            "Tokens generated.",
            "counter",
            m.generation_tokens_total,
        ),
        (
            "infer_kv_cache_bytes",
            "KV-cache bytes held by running sequences.",
            "gauge",
            m.kv_cache_bytes,
        ),
        (
            "infer_kv_cache_blocks_used",
            "KV-cache blocks (16 positions each) held by live sequences.",
            "gauge",
            m.kv_blocks_used,
        ),
        (
            "infer_kv_cache_blocks_total",
            "KV-cache blocks the pool can hold.",
            "gauge",
            m.kv_blocks_total,
        ),
        (
            "infer_preemptions_total",
            "Sequences preempted (KV blocks freed, recomputed later) because blocks ran out.",
            "counter",
            m.preemptions_total,
        ),
    ];
    let mut text = format!(
        "# HELP infer_kv_cache_usage_ratio Fraction of the KV-cache blocks in use (0 to 1).\n# TYPE infer_kv_cache_usage_ratio gauge\ninfer_kv_cache_usage_ratio {}\n",
        m.kv_blocks_used as f64 / m.kv_blocks_total.max(1) as f64
    );
    for (name, help, kind, value) in series {
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
    if state.scheduler.replicas() > 1 {
        text.push_str("# HELP infer_dp_requests_routed_total Requests routed to each data-parallel replica.\n# TYPE infer_dp_requests_routed_total counter\n");
        for (replica, count) in state.scheduler.routed().iter().enumerate() {
            text.push_str(&format!(
                "infer_dp_requests_routed_total{{replica=\"{replica}\"}} {count}\n"
            ));
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Fields common to both endpoints.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Value>,
    #[serde(default)]
    stream: bool,
}

fn params(
    state: &AppState,
    common: &Common,
    default_max_tokens: usize,
) -> Result<SamplingParams, ApiError> {
    if let Some(model) = &common.model
        && model != &state.model_id
    {
        return Err(bad_request(format!(
            "model `{model}` does not exist; this server serves `{}`",
            state.model_id
        )));
    }
    let temperature = common.temperature.unwrap_or(1.0);
    let top_p = common.top_p.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad_request(format!(
            "`temperature` must be in [0, 2], got {temperature}"
        )));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad_request(format!(
            "`top_p` must be in (0, 1], got {top_p}"
        )));
    }
    let stop = match &common.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        Some(_) => return Err(bad_request("`stop` must be a string or a list of strings")),
    };
    Ok(SamplingParams {
        temperature,
        top_k: 0,
        top_p,
        seed: common.seed,
        max_tokens: common.max_tokens.unwrap_or(default_max_tokens),
        stop,
        logprobs: false,
    })
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("malformed request body: {e}")))
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
    if prompt_tokens.len() + params.max_tokens > state.max_context_tokens {
        return Err(bad_request(format!(
            "this model's maximum context length is {} tokens; the prompt has {} and `max_tokens` asks for {}",
            state.max_context_tokens,
            prompt_tokens.len(),
            params.max_tokens
        )));
    }
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    state
        .scheduler
        .submit(Request {
            prompt_tokens,
            params,
            events,
            received_at: Instant::now(),
        })
        .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "server_error", e))?;
    Ok(UnboundedReceiverStream::new(receiver))
}

fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Collects a whole generation: text, finish reason, token ids, logprobs, usage.
async fn collect(
    mut events: UnboundedReceiverStream<Event>,
) -> Result<
    (
        String,
        &'static str,
        Vec<u32>,
        Vec<Option<f32>>,
        usize,
        usize,
    ),
    ApiError,
> {
    let (mut text, mut ids, mut logprobs) = (String::new(), Vec::new(), Vec::new());
    while let Some(event) = events.next().await {
        match event {
            Event::Token {
                id,
                text: piece,
                logprob,
            } => {
                text.push_str(&piece);
                ids.push(id);
                logprobs.push(logprob);
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                return Ok((
                    text,
                    finish_name(finish_reason),
                    ids,
                    logprobs,
                    prompt_tokens,
                    completion_tokens,
                ));
            }
            Event::Error(message) => {
                return Err(error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    message,
                ));
            }
        }
    }
    Err(error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine stopped",
    ))
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Value,
    logprobs: Option<u32>,
    #[serde(flatten)]
    common: Common,
}

async fn completions(
    Ready(state): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let request: CompletionBody = parse(&body)?;
    let params = SamplingParams {
        logprobs: request.logprobs.is_some(),
        ..params(&state, &request.common, 16)?
    };
    let prompt_tokens = match &request.prompt {
        Value::String(text) => match state.tokenizer.encode(text, true) {
            Ok(ids) => ids,
            Err(e) => return Err(bad_request(format!("{e:#}"))),
        },
        Value::Array(items) if items.iter().all(Value::is_u64) => items
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        _ => {
            return Err(bad_request(
                "`prompt` must be a string or a list of token ids",
            ));
        }
    };
    if prompt_tokens
        .iter()
        .any(|&t| t as usize >= state.tokenizer.vocab_size())
    {
        return Err(bad_request(
            "`prompt` holds a token id outside the vocabulary",
        ));
    }
    let id = format!(
        "cmpl-{}",
        scheduler::REQUEST_COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let model = state.model_id.clone();
    let events = submit(&state, prompt_tokens, params)?;
    if request.common.stream {
        let stream = events.map(move |event| {
            let chunk = match event {
                Event::Token { text, .. } => json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": [{"index": 0, "text": text, "finish_reason": null}]}),
                Event::Done { finish_reason, prompt_tokens, completion_tokens } => json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": [{"index": 0, "text": "", "finish_reason": finish_name(finish_reason)}], "usage": usage(prompt_tokens, completion_tokens)}),
                Event::Error(message) => json!({"error": {"message": message, "type": "server_error"}}),
            };
            Ok::<_, std::convert::Infallible>(SseEvent::default().data(chunk.to_string()))
        });
        let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
        return Ok(Sse::new(stream.chain(done)).into_response());
    }
    let (text, finish_reason, ids, logprobs, prompt, completion) = collect(events).await?;
    let logprobs = request.logprobs.map(|_| {
        let tokens: Vec<String> = ids
            .iter()
            .map(|&t| state.tokenizer.token(t).unwrap_or_default())
            .collect();
        json!({"tokens": tokens, "token_logprobs": logprobs})
    });
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": state.model_id,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": usage(prompt, completion)
    }))
    .into_response())
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    common: Common,
}

async fn chat_completions(
    Ready(state): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let request: ChatBody = parse(&body)?;
    if request.messages.is_empty() {
        return Err(bad_request("`messages` is empty"));
    }
    let params = params(
        &state,
        &request.common,
        state.max_context_tokens.min(1024) / 2,
    )?;
    let Some(template) = state.tokenizer.chat_template.as_deref() else {
        return Err(bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    };
    let token = |id: Option<u32>| {
        id.and_then(|i| state.tokenizer.token(i))
            .unwrap_or_default()
    };
    let prompt = match render(
        template,
        &request.messages,
        true,
        &token(state.tokenizer.bos_id),
        &token(state.tokenizer.eos_ids.first().copied()),
    ) {
        Ok(p) => p,
        Err(e) => return Err(bad_request(format!("{e:#}"))),
    };
    let prompt_tokens = match state.tokenizer.encode(&prompt, true) {
        Ok(ids) => ids,
        Err(e) => return Err(bad_request(format!("{e:#}"))),
    };
    let id = format!(
        "chatcmpl-{}",
        scheduler::REQUEST_COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let model = state.model_id.clone();
    let events = submit(&state, prompt_tokens, params)?;
    if request.common.stream {
        let first = json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]});
        let head = tokio_stream::once(Ok::<_, std::convert::Infallible>(
            SseEvent::default().data(first.to_string()),
        ));
        let stream = events.map(move |event| {
            let chunk = match event {
                Event::Token { text, .. } => json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
                Event::Done { finish_reason, prompt_tokens, completion_tokens } => json!({"id": id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_name(finish_reason)}], "usage": usage(prompt_tokens, completion_tokens)}),
                Event::Error(message) => json!({"error": {"message": message, "type": "server_error"}}),
            };
            Ok(SseEvent::default().data(chunk.to_string()))
        });
        let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
        return Ok(Sse::new(head.chain(stream).chain(done)).into_response());
    }
    let (text, finish_reason, _, _, prompt, completion) = collect(events).await?;
    Ok(axum::Json(json!({
            "id": id, "object": "chat.completion", "created": now(), "model": state.model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
            "usage": usage(prompt, completion)
    }))
    .into_response())
}
