//! The request bodies of `/v1/completions` and `/v1/chat/completions` and their
//! validator: [`parse`] types every field, [`check`] refuses unsupported values by name and
//! numbers out of range (OpenAI error JSON with the field as `param`), and the prompt
//! helpers turn a body into token ids or a chat template's text.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use super::errors::{ApiError, bad_field, bad_request};
use crate::runtime::model::chat::{ChatMessage, render};
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::tokenizer::Tokenizer;

/// The most choices one request may ask for (`n`).
pub(super) const MAX_N: u64 = 16;
/// The most alternatives per token `top_logprobs` may ask for (OpenAI's limit; the legacy
/// completions `logprobs` allows 5).
pub(super) const MAX_TOP_LOGPROBS: u64 = 20;

/// A request body of either endpoint, every field typed; a field of another type, or one
/// not listed, is a 400 naming it. Fields accepted but without effect: `user` (as vLLM);
/// `presence_penalty`/`frequency_penalty` at 0, an empty `logit_bias`, `echo: false`,
/// `best_of` equal to `n`, `suffix: null`, `response_format` `{"type": "text"}` (the
/// defaults); anything else in them is refused, never silently dropped.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct Body {
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
pub(super) enum Endpoint {
    Completions,
    Chat,
}

/// A checked request: its sampling parameters and how to answer.
pub(super) struct Checked {
    pub(super) params: SamplingParams,
    /// Choices to generate (`n`).
    pub(super) n: usize,
    pub(super) stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices.
    pub(super) include_usage: bool,
}

/// What the validator knows of the served model.
pub(super) struct ServedModel<'a> {
    /// The model's id: a request naming another is a 404.
    pub(super) model_id: &'a str,
    /// The model's context, tokens: the most `max_tokens` may ask for.
    pub(super) max_context_tokens: usize,
}

/// Parses a body, naming the field of any type error (`max_tokens: invalid type …`).
pub(super) fn parse(body: &Bytes) -> Result<Body, ApiError> {
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
pub(super) fn check(
    model: &ServedModel,
    body: &Body,
    endpoint: Endpoint,
    default_max_tokens: usize,
) -> Result<Checked, ApiError> {
    check_model(model, body)?;
    check_endpoint_fields(body, endpoint)?;
    check_unsupported(body)?;
    let n = check_n(body)?;
    let max_tokens = check_max_tokens(model, body, default_max_tokens)?;
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
fn check_model(served: &ServedModel, body: &Body) -> Result<(), ApiError> {
    if let Some(model) = &body.model
        && model != served.model_id
    {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..bad_request(format!(
                "the model `{model}` does not exist; this server serves `{}`",
                served.model_id
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
    model: &ServedModel,
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
        .filter(|&v| v <= model.max_context_tokens)
        .ok_or_else(|| {
            bad_field(
                field,
                format!(
                    "`{field}` is {max_tokens}, more than this model's context of {} tokens",
                    model.max_context_tokens
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

/// Most stop strings a request may give (OpenAI takes 4; the scheduler scans each on every
/// token, so a bound keeps one request from slowing the others).
pub(super) const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, bytes.
pub(super) const MAX_STOP_BYTES: usize = 1024;

/// The stop strings (none by default). Errors: a 400 for an empty one, more than
/// [`MAX_STOP_STRINGS`], or one longer than [`MAX_STOP_BYTES`].
fn check_stop(body: &Body) -> Result<Vec<String>, ApiError> {
    let stop = match &body.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(list)) => list.clone(),
    };
    if stop.iter().any(String::is_empty) {
        return Err(bad_field("stop", "`stop` strings must not be empty"));
    }
    if stop.len() > MAX_STOP_STRINGS {
        return Err(bad_field(
            "stop",
            format!(
                "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
                stop.len()
            ),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(bad_field(
            "stop",
            format!(
                "a `stop` string of {} bytes; at most {MAX_STOP_BYTES} are allowed",
                long.len()
            ),
        ));
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

/// Renders a chat's messages as one prompt text through the model's template.
///
/// Errors (400): no `messages` or none in it; a role other than `system`, `developer` (as
/// `system`), `user` or `assistant`; a content part that is not text; a model without a
/// chat template; a template that fails.
pub(super) fn chat_prompt(tokenizer: &Tokenizer, body: &Body) -> Result<String, ApiError> {
    let Some(messages) = &body.messages else {
        return Err(bad_field("messages", "`messages` is missing"));
    };
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
    let Some(template) = tokenizer.chat_template.as_deref() else {
        return Err(bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    };
    let token = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
    render(
        template,
        &rendered,
        true,
        &token(tokenizer.bos_id),
        &token(tokenizer.eos_ids.first().copied()),
    )
    .map_err(|e| bad_request(format!("{e:#}")))
}

/// The prompt of a `/v1/completions` body as token ids: its text encoded, or its list of
/// token ids as given.
///
/// Errors (400, `param` `prompt`): no prompt, one of another type, a text the tokenizer
/// refuses, a token id outside the vocabulary.
pub(super) fn completion_prompt_tokens(
    tokenizer: &Tokenizer,
    request: &Body,
) -> Result<Vec<u32>, ApiError> {
    let prompt_tokens = match &request.prompt {
        Some(Value::String(text)) => match tokenizer.encode(text, true) {
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
        .any(|&t| t as usize >= tokenizer.vocab_size())
    {
        return Err(bad_field(
            "prompt",
            "`prompt` holds a token id outside the vocabulary",
        ));
    }
    Ok(prompt_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The served model of every case: `m`, with a context of 4096 tokens.
    const MODEL: ServedModel = ServedModel {
        model_id: "m",
        max_context_tokens: 4096,
    };

    /// Parses and checks `body` for `endpoint` as the handlers do (16 tokens by default).
    fn validate(endpoint: Endpoint, body: &Value) -> Result<Checked, ApiError> {
        let bytes = Bytes::from(body.to_string());
        check(&MODEL, &parse(&bytes)?, endpoint, 16)
    }

    #[test]
    fn the_validator_refuses_each_bad_field_by_name() {
        use Endpoint::{Chat, Completions};
        let hello = json!([{"role": "user", "content": "hi"}]);
        // (endpoint, body, HTTP status, `param`, a fragment of the message)
        let cases: Vec<(Endpoint, Value, u16, Option<&str>, &str)> = vec![
            (
                Completions,
                json!({"prompt": "x", "max_tokens": "many"}),
                400,
                Some("max_tokens"),
                "`max_tokens`: invalid type",
            ),
            (
                Completions,
                json!({"prompt": "x", "frobnicate": 1}),
                400,
                Some("frobnicate"),
                "`frobnicate`: unknown field `frobnicate`, expected one of `model`",
            ),
            (
                Completions,
                json!({"prompt": "x", "stop": [1, 2]}),
                400,
                Some("stop"),
                "did not match",
            ),
            (
                Completions,
                json!({"model": "other", "prompt": "x"}),
                404,
                Some("model"),
                "the model `other` does not exist; this server serves `m`",
            ),
            (
                Completions,
                json!({"prompt": "x", "messages": hello}),
                400,
                Some("messages"),
                "`messages` belongs to /v1/chat/completions, not this endpoint",
            ),
            (
                Completions,
                json!({"prompt": "x", "top_logprobs": 2}),
                400,
                Some("top_logprobs"),
                "`top_logprobs` belongs to /v1/chat/completions",
            ),
            (
                Chat,
                json!({"messages": hello, "suffix": ""}),
                400,
                Some("suffix"),
                "`suffix` belongs to /v1/completions, not this endpoint",
            ),
            (
                Chat,
                json!({"messages": hello, "tool_choice": "auto"}),
                400,
                Some("tool_choice"),
                "`tool_choice` is not supported: this server does not call tools",
            ),
            (
                Completions,
                json!({"prompt": "x", "frequency_penalty": -1.0}),
                400,
                Some("frequency_penalty"),
                "`frequency_penalty` is not supported (only 0, its default)",
            ),
            (
                Completions,
                json!({"prompt": "x", "logit_bias": {"7": 100}}),
                400,
                Some("logit_bias"),
                "`logit_bias` is not supported (only an empty map)",
            ),
            (
                Completions,
                json!({"prompt": "x", "echo": true}),
                400,
                Some("echo"),
                "`echo` is not supported (only false, its default)",
            ),
            (
                Completions,
                json!({"prompt": "x", "suffix": "end"}),
                400,
                Some("suffix"),
                "`suffix` is not supported",
            ),
            (
                Completions,
                json!({"prompt": "x", "response_format": {"type": "json_object"}}),
                400,
                Some("response_format"),
                "`response_format` `json_object` is not supported: only {\"type\": \"text\"}",
            ),
            (
                Completions,
                json!({"prompt": "x", "response_format": {}}),
                400,
                Some("response_format"),
                "`response_format` {} is not supported",
            ),
            (
                Completions,
                json!({"prompt": "x", "n": 0}),
                400,
                Some("n"),
                "`n` must be 1 to 16, got 0",
            ),
            (
                Completions,
                json!({"prompt": "x", "n": 17}),
                400,
                Some("n"),
                "`n` must be 1 to 16, got 17",
            ),
            (
                Completions,
                json!({"prompt": "x", "n": 2, "best_of": 3}),
                400,
                Some("best_of"),
                "`best_of` is not supported (only equal to `n`, 2), got 3",
            ),
            (
                Chat,
                json!({"messages": hello, "max_tokens": 5, "max_completion_tokens": 6}),
                400,
                Some("max_completion_tokens"),
                "give `max_tokens` or `max_completion_tokens`, not two different values",
            ),
            (
                Completions,
                json!({"prompt": "x", "max_tokens": 0}),
                400,
                Some("max_tokens"),
                "`max_tokens` must be at least 1",
            ),
            (
                Chat,
                json!({"messages": hello, "max_completion_tokens": 0}),
                400,
                Some("max_completion_tokens"),
                "`max_completion_tokens` must be at least 1",
            ),
            (
                Completions,
                json!({"prompt": "x", "max_tokens": 5000}),
                400,
                Some("max_tokens"),
                "`max_tokens` is 5000, more than this model's context of 4096 tokens",
            ),
            (
                Completions,
                json!({"prompt": "x", "temperature": 2.5}),
                400,
                Some("temperature"),
                "`temperature` must be in [0, 2], got 2.5",
            ),
            (
                Completions,
                json!({"prompt": "x", "top_p": 0}),
                400,
                Some("top_p"),
                "`top_p` must be in (0, 1], got 0",
            ),
            (
                Completions,
                json!({"prompt": "x", "top_k": -2}),
                400,
                Some("top_k"),
                "`top_k` must be -1 or 0 (all tokens) or positive, got -2",
            ),
            (
                Completions,
                json!({"prompt": "x", "stop": ["a", ""]}),
                400,
                Some("stop"),
                "`stop` strings must not be empty",
            ),
            (
                Completions,
                json!({"prompt": "x", "stop": vec!["s"; 100_000]}),
                400,
                Some("stop"),
                "`stop` has 100000 strings; at most 64 are allowed",
            ),
            (
                Chat,
                json!({"messages": [{"role": "user", "content": "x"}], "stop": "x".repeat(2000)}),
                400,
                Some("stop"),
                "a `stop` string of 2000 bytes; at most 1024 are allowed",
            ),
            (
                Completions,
                json!({"prompt": "x", "logprobs": 6}),
                400,
                Some("logprobs"),
                "`logprobs` on /v1/completions is the number of alternatives per token, 0 to 5; got 6",
            ),
            (
                Completions,
                json!({"prompt": "x", "logprobs": true}),
                400,
                Some("logprobs"),
                "0 to 5; got true",
            ),
            (
                Chat,
                json!({"messages": hello, "logprobs": 3}),
                400,
                Some("logprobs"),
                "`logprobs` on /v1/chat/completions is true or false; got 3",
            ),
            (
                Chat,
                json!({"messages": hello, "logprobs": true, "top_logprobs": 21}),
                400,
                Some("top_logprobs"),
                "`top_logprobs` must be 0 to 20, got 21",
            ),
            (
                Chat,
                json!({"messages": hello, "top_logprobs": 2}),
                400,
                Some("top_logprobs"),
                "`top_logprobs` needs `logprobs: true`",
            ),
            (
                Completions,
                json!({"prompt": "x", "stream_options": {"include_usage": true}}),
                400,
                Some("stream_options"),
                "`stream_options` is only allowed with `stream: true`",
            ),
            (
                Chat,
                json!({"messages": hello, "stream": true, "stream_options": {"continuous_usage_stats": true}}),
                400,
                Some("stream_options.continuous_usage_stats"),
                "`continuous_usage_stats` is not supported",
            ),
            // Several faults: the first checked is the one reported.
            (
                Completions,
                json!({"prompt": "x", "temperature": 9, "n": 0, "tools": []}),
                400,
                Some("tools"),
                "does not call tools",
            ),
            (
                Completions,
                json!({"prompt": "x", "temperature": 9, "n": 0}),
                400,
                Some("n"),
                "`n` must be 1 to 16",
            ),
        ];
        for (endpoint, body, status, param, fragment) in cases {
            let Err(error) = validate(endpoint, &body) else {
                panic!("{body} was accepted");
            };
            assert_eq!(error.status.as_u16(), status, "{body}: {error:?}");
            assert_eq!(error.param.as_deref(), param, "{body}: {error:?}");
            assert!(error.message.contains(fragment), "{body}: {error:?}");
            let code = (status == 404).then_some("model_not_found");
            assert_eq!(error.code, code, "{body}: {error:?}");
        }
        // A body that is not a JSON object names no field.
        let Err(error) = parse(&Bytes::from_static(b"42")) else {
            panic!("a number was parsed as a body");
        };
        assert_eq!((error.status.as_u16(), error.param.as_deref()), (400, None));
        assert!(
            error
                .message
                .starts_with("malformed request body: invalid type: integer `42`"),
            "{error:?}"
        );
    }

    #[test]
    fn the_validator_accepts_defaults_and_builds_the_sampling_parameters() {
        let accepted = [
            (
                Endpoint::Completions,
                json!({"model": "m", "prompt": [1, 2], "presence_penalty": 0, "logit_bias": {},
                       "echo": false, "suffix": null, "best_of": 1, "user": "u",
                       "response_format": {"type": "text"}}),
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": null}),
            ),
        ];
        for (endpoint, body) in accepted {
            let checked = validate(endpoint, &body).unwrap_or_else(|e| panic!("{body}: {e:?}"));
            assert_eq!(checked.params.max_tokens, 16, "{body}");
            assert_eq!(checked.n, 1, "{body}");
            assert!(!checked.stream && !checked.include_usage, "{body}");
        }
        let checked = validate(
            Endpoint::Chat,
            &json!({"messages": [], "max_completion_tokens": 7, "temperature": 0.5,
                    "top_p": 0.9, "top_k": -1, "seed": -1, "stop": "END", "n": 3,
                    "logprobs": true, "top_logprobs": 4, "stream": true,
                    "stream_options": {"include_usage": true, "continuous_usage_stats": false}}),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let params = &checked.params;
        assert_eq!(params.max_tokens, 7);
        assert_eq!(
            (params.temperature, params.top_p, params.top_k),
            (0.5, 0.9, 0)
        );
        assert_eq!(params.seed, Some(u64::MAX));
        assert_eq!(params.stop, vec!["END".to_string()]);
        assert_eq!((params.logprobs, params.top_logprobs), (true, 4));
        assert_eq!(checked.n, 3);
        assert!(checked.stream && checked.include_usage);
        let completions = validate(
            Endpoint::Completions,
            &json!({"prompt": "x", "logprobs": 2, "top_k": 40, "stop": ["a", "b"]}),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(completions.params.top_k, 40);
        assert_eq!(
            (completions.params.logprobs, completions.params.top_logprobs),
            (true, 2)
        );
        assert_eq!(completions.params.stop, vec!["a", "b"]);
    }
}
