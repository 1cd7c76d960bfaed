//! Answers as they are generated and the tokens' log-probabilities: [`stream_choices`]
//! merges a request's choices into one server-sent-event stream (`data: {chunk}` lines, a
//! usage chunk when asked, then `data: [DONE]`), and the `logprobs` objects of both
//! endpoints.

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::errors::error;
use super::scheduler::Event;
use super::{AppState, Cancel, SHUTTING_DOWN, Served, log_access, usage};
use crate::runtime::model::tokenizer::Tokenizer;

/// Chunks rendered ahead of what the client has read, at most.
const SSE_CHUNKS_IN_FLIGHT: usize = 64;

/// One generated token as a request hears it.
pub(super) struct TokenOut {
    pub(super) id: u32,
    /// Its log-probability (nats), when asked.
    pub(super) logprob: Option<f32>,
    /// The step's most likely tokens with their log-probabilities (nats), when asked.
    pub(super) top: Vec<(u32, f32)>,
}

/// A token's text as a user reads it (`" iron"`, not the vocabulary's `Ġiron`).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// The legacy completions `logprobs` object: tokens, their logprobs, the top alternatives
/// per token (a map text → logprob) and each token's offset in the text.
pub(super) fn completion_logprobs(
    tokenizer: &Tokenizer,
    tokens: &[TokenOut],
    with_top: bool,
) -> Value {
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
pub(super) fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[TokenOut]) -> Value {
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

/// Who a streamed answer is for and how it ends: what [`stream_choices`] needs besides
/// the choices and their chunks.
pub(super) struct StreamContext {
    pub(super) state: Arc<AppState>,
    /// The endpoint's path, for the access log.
    pub(super) path: &'static str,
    /// The answer's id (`cmpl-7`), for the access log.
    pub(super) id: String,
    /// When the request arrived.
    pub(super) started: Instant,
    /// Ends the stream with an error chunk when shutdown cancels the request.
    pub(super) cancel: Cancel,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices.
    pub(super) include_usage: bool,
    /// vLLM's `stream_options.continuous_usage_stats`: every chunk with choices carries the
    /// usage so far, this being the prompt's tokens.
    pub(super) continuous_usage: Option<usize>,
}

/// Streams every choice's events merged, each chunk made by `chunk(index, event)`, then a
/// usage chunk (no choices) when asked, then `[DONE]`.
pub(super) fn stream_choices(
    ctx: StreamContext,
    streams: Vec<UnboundedReceiverStream<Event>>,
    head: Vec<Value>,
    chunk: impl Fn(usize, &Event) -> Option<Value> + Send + 'static,
    usage_chunk: impl Fn(Value) -> Value + Send + 'static,
) -> Response {
    let StreamContext {
        state,
        path,
        id,
        started,
        cancel,
        include_usage,
        continuous_usage,
    } = ctx;
    let mut merged = tokio_stream::StreamMap::new();
    for (index, stream) in streams.into_iter().enumerate() {
        merged.insert(index, stream);
    }
    let n = merged.len();
    // A task drives the choices and hands chunks to the response; when the client goes
    // away (the response, dropped, closes the channel), the task ends at once, even before
    // the first token, and dropping the choices' receivers cancels their sequences (a
    // waiting one is never computed).
    // Bounded: a client that reads slowly holds back this task (its tokens wait as events),
    // never a growing heap of rendered chunks.
    let (sender, receiver) = tokio::sync::mpsc::channel::<Value>(SSE_CHUNKS_IN_FLIGHT);
    tokio::spawn(async move {
        for mut value in head {
            if let Some(prompt_tokens) = continuous_usage {
                value["usage"] = json!({
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 0,
                    "total_tokens": prompt_tokens,
                });
            }
            if sender.send(value).await.is_err() {
                return;
            }
        }
        let (mut prompt, mut completion, mut cached, mut done) = (0, 0, 0, 0);
        // Tokens sent so far per choice (the continuous usage is the chunk's choice's, as
        // vLLM counts it).
        let mut sent_tokens = vec![0usize; n];
        let mut first_token_at = None;
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        loop {
            let (index, event) = tokio::select! {
                next = merged.next() => match next {
                    Some(next) => next,
                    None => break,
                },
                () = sender.closed() => return,
                () = &mut cancelled => {
                    // Best effort: a client that reads nothing does not hold up shutdown.
                    let _ = sender.try_send(json!({"error": {"message": SHUTTING_DOWN, "type": "server_error"}}));
                    log_access(&state, path, Err(&error(StatusCode::SERVICE_UNAVAILABLE, "server_error", SHUTTING_DOWN)), started);
                    return;
                }
            };
            if matches!(event, Event::Token { .. }) {
                first_token_at.get_or_insert_with(Instant::now);
                if let Some(sent) = sent_tokens.get_mut(index) {
                    *sent += 1;
                }
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
            if let Some(mut value) = chunk(index, &event) {
                if let Some(prompt_tokens) = continuous_usage {
                    let so_far = match &event {
                        Event::Done {
                            completion_tokens, ..
                        } => *completion_tokens,
                        _ => sent_tokens.get(index).copied().unwrap_or(0),
                    };
                    value["usage"] = json!({
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": so_far,
                        "total_tokens": prompt_tokens + so_far,
                    });
                }
                if sender.send(value).await.is_err() {
                    return;
                }
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
                    .await
                    .is_err()
            {
                return;
            }
        }
    });
    sse_response(receiver)
}

/// The server-sent-event response of the chunks `receiver` hands over: `data: {chunk}` for
/// each, then `data: [DONE]` once the sender is gone.
fn sse_response(receiver: tokio::sync::mpsc::Receiver<Value>) -> Response {
    let body = tokio_stream::wrappers::ReceiverStream::new(receiver)
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
