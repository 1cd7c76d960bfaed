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

/// A request body of either endpoint, every field typed; a field of another type is a 400
/// naming it, and unknown fields are a 400 naming every one of them ([`parse`]). OpenAI's
/// fields and vLLM's sampling extensions (`top_k`, `min_p`, `repetition_penalty`,
/// `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
/// `skip_special_tokens`, `add_special_tokens`, `stream_options.continuous_usage_stats`)
/// take effect with vLLM's meaning. Accepted but without effect: `user` (as vLLM), and
/// vLLM's `use_beam_search: false`, `length_penalty: 1`, `spaces_between_special_tokens:
/// true`, `add_generation_prompt: true`, `continue_final_message: false`,
/// `prompt_logprobs`/`truncate_prompt_tokens: null`, `priority: 0`, and OpenAI's
/// `echo: false`, `best_of` equal to `n`, `suffix: null`, `response_format`
/// `{"type": "text"}` (the defaults); anything else in them is refused, never silently
/// dropped.
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
    /// vLLM: tokens barred until `min_tokens`; an EOS token does not stop the generation.
    ignore_eos: Option<bool>,
    min_tokens: Option<u64>,
    repetition_penalty: Option<f64>,
    min_p: Option<f64>,
    stop_token_ids: Option<Vec<u64>>,
    include_stop_str_in_output: Option<bool>,
    skip_special_tokens: Option<bool>,
    /// vLLM: whether the tokenizer adds its special tokens (BOS) to the prompt.
    add_special_tokens: Option<bool>,
    /// vLLM's, accepted at their defaults only.
    use_beam_search: Option<bool>,
    length_penalty: Option<f64>,
    spaces_between_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    prompt_logprobs: Option<Value>,
    truncate_prompt_tokens: Option<Value>,
    priority: Option<i64>,
}

/// The top-level fields of vLLM's `CompletionRequest` and `ChatCompletionRequest`
/// (`vllm/entrypoints/openai/protocol.py`), for telling a user whose unknown field is a
/// vLLM extension that this is a gap in compatibility, not a typo.
const VLLM_FIELDS: &[&str] = &[
    "add_generation_prompt",
    "add_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "best_of",
    "cache_salt",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
    "echo",
    "frequency_penalty",
    "guided_choice",
    "guided_decoding_backend",
    "guided_grammar",
    "guided_json",
    "guided_regex",
    "guided_whitespace_pattern",
    "ignore_eos",
    "include_reasoning",
    "include_stop_str_in_output",
    "kv_transfer_params",
    "length_penalty",
    "logit_bias",
    "logits_processors",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "messages",
    "min_p",
    "min_tokens",
    "mm_processor_kwargs",
    "model",
    "n",
    "parallel_tool_calls",
    "presence_penalty",
    "priority",
    "prompt",
    "prompt_embeds",
    "prompt_logprobs",
    "reasoning_effort",
    "repetition_penalty",
    "request_id",
    "response_format",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "structural_tag",
    "structured_outputs",
    "suffix",
    "temperature",
    "tool_choice",
    "tools",
    "top_k",
    "top_logprobs",
    "top_p",
    "truncate_prompt_tokens",
    "use_beam_search",
    "user",
    "vllm_xargs",
];

/// The field names of a struct that derives `Deserialize`, as serde lists them: a
/// deserializer that records the list `deserialize_struct` is handed and stops there.
fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("field names recorded")
        }
    }
    impl std::error::Error for Stop {}
    impl serde::de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Stop {
            Stop
        }
    }
    impl<'de> serde::Deserializer<'de> for Names<'_> {
        type Error = Stop;
        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            *self.0 = fields;
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

/// Refuses a body with fields other than `known`, naming every one of them and which of
/// them vLLM would accept (`vllm`). Errors: a 400, `param` the first unknown field.
fn check_known_fields(
    body: &serde_json::Map<String, Value>,
    known: &[&str],
    vllm: &[&str],
) -> Result<(), ApiError> {
    let unknown: Vec<&str> = body
        .keys()
        .map(String::as_str)
        .filter(|k| !known.contains(k))
        .collect();
    let Some(first) = unknown.first() else {
        return Ok(());
    };
    let quoted = |names: &[&str]| {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (vllm, other): (Vec<&str>, Vec<&str>) = unknown.iter().partition(|k| vllm.contains(k));
    let mut message = format!(
        "unknown field{} {}",
        if unknown.len() > 1 { "s" } else { "" },
        quoted(&unknown)
    );
    if !vllm.is_empty() {
        message.push_str(&format!(
            "; vLLM accepts {} but this server does not support {} yet (a compatibility gap, not a mistake in the request)",
            quoted(&vllm),
            if vllm.len() > 1 { "them" } else { "it" }
        ));
    }
    if !other.is_empty() {
        message.push_str(&format!(
            "; {} {} a field of neither the OpenAI nor the vLLM API (a typo?)",
            quoted(&other),
            if other.len() > 1 { "are" } else { "is" }
        ));
    }
    Err(bad_field(first, message))
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
    /// vLLM's: the usage so far on every chunk.
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
    /// vLLM's `stream_options.continuous_usage_stats`: the usage so far in every chunk.
    pub(super) continuous_usage: bool,
    /// vLLM's `add_special_tokens`: whether the prompt's text gets the tokenizer's special
    /// tokens (BOS); `None`: the endpoint's default (the model's `add_bos`).
    pub(super) add_special_tokens: Option<bool>,
}

/// What the validator knows of the served model.
pub(super) struct ServedModel<'a> {
    /// The model's id: a request naming another is a 404.
    pub(super) model_id: &'a str,
    /// The model's context, tokens: the most `max_tokens` may ask for.
    pub(super) max_context_tokens: usize,
    /// The vocabulary's size: token ids in `logit_bias` and `stop_token_ids` are below it.
    pub(super) vocab_size: usize,
    /// The end-of-sequence ids, barred until `min_tokens` unless `ignore_eos`.
    pub(super) eos_ids: &'a [u32],
}

/// Parses a body, naming every unknown field ([`check_known_fields`]) and the field of any
/// type error (`max_tokens: invalid type …`).
pub(super) fn parse(body: &Bytes) -> Result<Body, ApiError> {
    parse_as(body, VLLM_FIELDS)
}

/// Parses a body as `T`, naming every unknown field (and which of them are `vllm`'s) and
/// the field of any type error.
fn parse_as<T: serde::de::DeserializeOwned>(body: &Bytes, vllm: &[&str]) -> Result<T, ApiError> {
    // Parsed once: the unknown fields are read off the tree the body is then typed from.
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("malformed request body: {e}")))?;
    if let Value::Object(fields) = &value {
        check_known_fields(fields, field_names::<T>(), vllm)?;
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
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
    let (stream, include_usage, continuous_usage) = check_stream(body)?;
    let penalties = check_penalties(model, body)?;
    let ending = check_ending(model, body, max_tokens)?;
    let min_p = body.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(bad_field(
            "min_p",
            format!("`min_p` must be in [0, 1], got {min_p}"),
        ));
    }
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
            presence_penalty: penalties.presence,
            frequency_penalty: penalties.frequency,
            repetition_penalty: penalties.repetition,
            min_p: min_p as f32,
            logit_bias: penalties.logit_bias,
            min_tokens: ending.min_tokens,
            min_tokens_barred: ending.min_tokens_barred,
            ignore_eos: ending.ignore_eos,
            stop_token_ids: ending.stop_token_ids,
            include_stop_str_in_output: body.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: body.skip_special_tokens.unwrap_or(true),
        },
        n: n as usize,
        stream,
        include_usage,
        continuous_usage,
        add_special_tokens: body.add_special_tokens,
    })
}

/// The penalties and `logit_bias` of a body, checked.
struct Penalties {
    presence: f32,
    frequency: f32,
    repetition: f32,
    logit_bias: Vec<(u32, f32)>,
}

/// Checks the penalties against vLLM's ranges (`presence_penalty` and `frequency_penalty`
/// in [-2, 2], `repetition_penalty` > 0) and `logit_bias` against OpenAI's (token ids of
/// the vocabulary, biases in [-100, 100]). Errors: a 400 naming the field.
fn check_penalties(model: &ServedModel, body: &Body) -> Result<Penalties, ApiError> {
    for (field, value) in [
        ("presence_penalty", body.presence_penalty),
        ("frequency_penalty", body.frequency_penalty),
    ] {
        if let Some(v) = value
            && !(-2.0..=2.0).contains(&v)
        {
            return Err(bad_field(
                field,
                format!("`{field}` must be in [-2, 2], got {v}"),
            ));
        }
    }
    let repetition = body.repetition_penalty.unwrap_or(1.0);
    if !(repetition > 0.0 && repetition.is_finite()) {
        return Err(bad_field(
            "repetition_penalty",
            format!("`repetition_penalty` must be greater than 0 (1 is off), got {repetition}"),
        ));
    }
    let mut logit_bias = Vec::new();
    for (key, value) in body.logit_bias.iter().flatten() {
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < model.vocab_size);
        let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b));
        match (token, bias) {
            (Some(token), Some(bias)) => logit_bias.push((token, bias as f32)),
            (None, _) => {
                return Err(bad_field(
                    "logit_bias",
                    format!(
                        "`logit_bias` key `{key}` is not a token id of this model's vocabulary (0 to {})",
                        model.vocab_size.saturating_sub(1)
                    ),
                ));
            }
            (_, None) => {
                return Err(bad_field(
                    "logit_bias",
                    format!(
                        "`logit_bias` of token {key} must be a number in [-100, 100], got {value}"
                    ),
                ));
            }
        }
    }
    Ok(Penalties {
        presence: body.presence_penalty.unwrap_or(0.0) as f32,
        frequency: body.frequency_penalty.unwrap_or(0.0) as f32,
        repetition: repetition as f32,
        logit_bias,
    })
}

/// How a generation may end: vLLM's `min_tokens`, `ignore_eos` and `stop_token_ids`.
struct Ending {
    min_tokens: usize,
    min_tokens_barred: Vec<u32>,
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
}

/// Checks `min_tokens` (at most `max_tokens`) and `stop_token_ids` (ids of the vocabulary)
/// and lists the tokens barred until `min_tokens`: the model's EOS ids (unless
/// `ignore_eos`) and the stop token ids, as vLLM does. Errors: a 400 naming the field.
fn check_ending(model: &ServedModel, body: &Body, max_tokens: usize) -> Result<Ending, ApiError> {
    let min_tokens = body.min_tokens.unwrap_or(0);
    if min_tokens > max_tokens as u64 {
        return Err(bad_field(
            "min_tokens",
            format!("`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max_tokens})"),
        ));
    }
    let mut stop_token_ids = Vec::new();
    for &id in body.stop_token_ids.iter().flatten() {
        match u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < model.vocab_size)
        {
            Some(token) => stop_token_ids.push(token),
            None => {
                return Err(bad_field(
                    "stop_token_ids",
                    format!(
                        "`stop_token_ids` holds {id}, not a token id of this model's vocabulary (0 to {})",
                        model.vocab_size.saturating_sub(1)
                    ),
                ));
            }
        }
    }
    if stop_token_ids.len() > MAX_STOP_STRINGS {
        return Err(bad_field(
            "stop_token_ids",
            format!(
                "`stop_token_ids` has {} ids; at most {MAX_STOP_STRINGS} are allowed",
                stop_token_ids.len()
            ),
        ));
    }
    let ignore_eos = body.ignore_eos.unwrap_or(false);
    let min_tokens = min_tokens as usize;
    let mut min_tokens_barred = Vec::new();
    if min_tokens > 0 {
        if !ignore_eos {
            min_tokens_barred.extend(model.eos_ids);
        }
        min_tokens_barred.extend(&stop_token_ids);
        min_tokens_barred.sort_unstable();
        min_tokens_barred.dedup();
    }
    Ok(Ending {
        min_tokens,
        min_tokens_barred,
        ignore_eos,
        stop_token_ids,
    })
}

/// Checks that `body` names no model but the served one. Errors: a 404 `model_not_found`.
fn check_model(served: &ServedModel, body: &Body) -> Result<(), ApiError> {
    check_model_name(served, body.model.as_deref())
}

/// Checks that `model`, when given, is the served one. Errors: a 404 `model_not_found`.
pub(super) fn check_model_name(served: &ServedModel, model: Option<&str>) -> Result<(), ApiError> {
    if let Some(model) = model
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
    let wrong_endpoint: &[(&str, bool)] = match endpoint {
        Endpoint::Completions => &[
            ("messages", body.messages.is_some()),
            (
                "max_completion_tokens",
                body.max_completion_tokens.is_some(),
            ),
            ("top_logprobs", body.top_logprobs.is_some()),
            (
                "add_generation_prompt",
                body.add_generation_prompt.is_some(),
            ),
            (
                "continue_final_message",
                body.continue_final_message.is_some(),
            ),
        ],
        Endpoint::Chat => &[
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

/// Checks the fields accepted only at their defaults: tools, `echo`, `suffix`,
/// `response_format`, and vLLM's beam search, `spaces_between_special_tokens`, chat
/// continuation, prompt logprobs, prompt truncation and priority. Errors: a 400 naming the
/// first field set otherwise.
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
    let null = |v: &Option<Value>| v.as_ref().is_none_or(Value::is_null);
    for (field, at_default, default) in [
        (
            "use_beam_search",
            body.use_beam_search != Some(true),
            "false",
        ),
        (
            "length_penalty",
            body.length_penalty.is_none_or(|v| v == 1.0),
            "1",
        ),
        (
            "spaces_between_special_tokens",
            body.spaces_between_special_tokens != Some(false),
            "true",
        ),
        (
            "add_generation_prompt",
            body.add_generation_prompt != Some(false),
            "true",
        ),
        (
            "continue_final_message",
            body.continue_final_message != Some(true),
            "false",
        ),
        ("prompt_logprobs", null(&body.prompt_logprobs), "null"),
        (
            "truncate_prompt_tokens",
            null(&body.truncate_prompt_tokens),
            "null",
        ),
        ("priority", body.priority.is_none_or(|p| p == 0), "0"),
    ] {
        if !at_default {
            return Err(bad_field(
                field,
                format!("`{field}` is not supported (only {default}, its default)"),
            ));
        }
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

/// Whether to stream, whether a last chunk carries the usage
/// (`stream_options.include_usage`), and whether every chunk does (vLLM's
/// `continuous_usage_stats`, which needs `include_usage` as in vLLM). Errors: a 400 for `stream_options` without `stream: true`.
fn check_stream(body: &Body) -> Result<(bool, bool, bool), ApiError> {
    let stream = body.stream.unwrap_or(false);
    match &body.stream_options {
        None => Ok((stream, false, false)),
        Some(_) if !stream => Err(bad_field(
            "stream_options",
            "`stream_options` is only allowed with `stream: true`",
        )),
        Some(options) => {
            // As vLLM: the usage on every chunk only with the usage at all.
            let include_usage = options.include_usage.unwrap_or(false);
            Ok((
                stream,
                include_usage,
                include_usage && options.continuous_usage_stats.unwrap_or(false),
            ))
        }
    }
}

/// Renders a chat's messages as one prompt text through the model's template.
///
/// Errors (400): no `messages` or none in it; a role other than `system`, `developer` (as
/// `system`), `user` or `assistant`; a content part that is not text; a model without a
/// chat template; a template that fails.
pub(super) fn chat_prompt(tokenizer: &Tokenizer, body: &Body) -> Result<String, ApiError> {
    render_chat(tokenizer, body.messages.as_deref())
}

/// The token ids of a chat's rendered `prompt`. With `add_special_tokens` unset, the
/// tokenizer's BOS is added unless the template wrote it already (vLLM leaves special
/// tokens to the template; a template without BOS keeps the model's `add_bos`).
///
/// Errors (400): a text the tokenizer refuses.
pub(super) fn chat_prompt_tokens(
    tokenizer: &Tokenizer,
    prompt: &str,
    add_special_tokens: Option<bool>,
) -> Result<Vec<u32>, ApiError> {
    let bos_text = tokenizer
        .bos_id
        .and_then(|id| tokenizer.token(id))
        .filter(|t| !t.is_empty());
    let add = add_special_tokens
        .unwrap_or_else(|| !bos_text.is_some_and(|bos| prompt.starts_with(bos.as_str())));
    tokenizer
        .encode(prompt, add)
        .map_err(|e| bad_request(format!("{e:#}")))
}

/// Renders `messages` through the model's template (errors as [`chat_prompt`]'s).
fn render_chat(tokenizer: &Tokenizer, messages: Option<&[Message]>) -> Result<String, ApiError> {
    let Some(messages) = messages else {
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

/// A `POST /tokenize` body, vLLM's two shapes in one: a `prompt`, or chat `messages`
/// rendered through the template.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    /// Default: true for a prompt; for messages, as the chat endpoint does.
    add_special_tokens: Option<bool>,
    /// Accepted as true only (the template always ends with the assistant's turn).
    add_generation_prompt: Option<bool>,
    /// Also return each token's vocabulary string.
    return_token_strs: Option<bool>,
}

/// A `POST /detokenize` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u64>,
}

/// Fields of vLLM's tokenize and detokenize requests this server does not take.
const VLLM_TOKENIZE_FIELDS: &[&str] = &[
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "mm_processor_kwargs",
    "tools",
];

/// vLLM's `/tokenize` answer: `{count, max_model_len, tokens, token_strs}`.
///
/// Errors: a 404 for another model; a 400 for a malformed body, neither or both of
/// `prompt` and `messages`, `add_generation_prompt: false`, or a chat the template refuses.
pub(super) fn tokenize(
    model: &ServedModel,
    tokenizer: &Tokenizer,
    body: &Bytes,
) -> Result<Value, ApiError> {
    let request: TokenizeBody = parse_as(body, VLLM_TOKENIZE_FIELDS)?;
    check_model_name(model, request.model.as_deref())?;
    if request.add_generation_prompt == Some(false) {
        return Err(bad_field(
            "add_generation_prompt",
            "`add_generation_prompt` is not supported (only true, its default)",
        ));
    }
    let tokens = match (&request.prompt, &request.messages) {
        (Some(prompt), None) => tokenizer
            .encode(prompt, request.add_special_tokens.unwrap_or(true))
            .map_err(|e| bad_field("prompt", format!("{e:#}")))?,
        (None, Some(messages)) => {
            let prompt = render_chat(tokenizer, Some(messages))?;
            chat_prompt_tokens(tokenizer, &prompt, request.add_special_tokens)?
        }
        _ => {
            return Err(bad_request(
                "give either `prompt` (text) or `messages` (a chat), not both or neither",
            ));
        }
    };
    let token_strs = request.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| tokenizer.token(id).unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(serde_json::json!({
        "count": tokens.len(),
        "max_model_len": model.max_context_tokens,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

/// vLLM's `/detokenize` answer: `{prompt}`, the text of the token ids (special tokens
/// included). Errors: a 404 for another model; a 400 for a malformed body or an id outside
/// the vocabulary.
pub(super) fn detokenize(
    model: &ServedModel,
    tokenizer: &Tokenizer,
    body: &Bytes,
) -> Result<Value, ApiError> {
    let request: DetokenizeBody = parse_as(body, &[])?;
    check_model_name(model, request.model.as_deref())?;
    let mut ids = Vec::with_capacity(request.tokens.len());
    for &id in &request.tokens {
        match u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < model.vocab_size)
        {
            Some(id) => ids.push(id),
            None => {
                return Err(bad_field(
                    "tokens",
                    format!(
                        "`tokens` holds {id}, not a token id of this model's vocabulary (0 to {})",
                        model.vocab_size.saturating_sub(1)
                    ),
                ));
            }
        }
    }
    let prompt = tokenizer
        .decode(&ids, false)
        .map_err(|e| bad_field("tokens", format!("{e:#}")))?;
    Ok(serde_json::json!({ "prompt": prompt }))
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
    let add_special = request.add_special_tokens.unwrap_or(true);
    let prompt_tokens = match &request.prompt {
        Some(Value::String(text)) => match tokenizer.encode(text, add_special) {
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
        vocab_size: 1000,
        eos_ids: &[2],
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
                "unknown field `frobnicate`; `frobnicate` is a field of neither the OpenAI nor the vLLM API (a typo?)",
            ),
            // Every unknown field is named, vLLM's apart from typos.
            (
                Chat,
                json!({"messages": hello, "guided_json": {}, "frobnicate": 1, "bad_words": ["x"], "tempreature": 1}),
                400,
                Some("bad_words"),
                "unknown fields `bad_words`, `frobnicate`, `guided_json`, `tempreature`; vLLM accepts `bad_words`, `guided_json` but this server does not support them yet (a compatibility gap, not a mistake in the request); `frobnicate`, `tempreature` are a field of neither",
            ),
            (
                Completions,
                json!({"prompt": "x", "stream_options": {"include_usage": true, "frob": 1}, "stream": true}),
                400,
                Some("stream_options.frob"),
                "`stream_options.frob`: unknown field `frob`",
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
                json!({"prompt": "x", "frequency_penalty": 2.5}),
                400,
                Some("frequency_penalty"),
                "`frequency_penalty` must be in [-2, 2], got 2.5",
            ),
            (
                Chat,
                json!({"messages": hello, "presence_penalty": -3}),
                400,
                Some("presence_penalty"),
                "`presence_penalty` must be in [-2, 2], got -3",
            ),
            (
                Completions,
                json!({"prompt": "x", "repetition_penalty": 0}),
                400,
                Some("repetition_penalty"),
                "`repetition_penalty` must be greater than 0 (1 is off), got 0",
            ),
            (
                Completions,
                json!({"prompt": "x", "logit_bias": {"1000": 1}}),
                400,
                Some("logit_bias"),
                "`logit_bias` key `1000` is not a token id of this model's vocabulary (0 to 999)",
            ),
            (
                Completions,
                json!({"prompt": "x", "logit_bias": {"seven": 1}}),
                400,
                Some("logit_bias"),
                "`logit_bias` key `seven` is not a token id",
            ),
            (
                Completions,
                json!({"prompt": "x", "logit_bias": {"7": 101}}),
                400,
                Some("logit_bias"),
                "`logit_bias` of token 7 must be a number in [-100, 100], got 101",
            ),
            (
                Completions,
                json!({"prompt": "x", "min_p": 1.5}),
                400,
                Some("min_p"),
                "`min_p` must be in [0, 1], got 1.5",
            ),
            (
                Completions,
                json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5}),
                400,
                Some("min_tokens"),
                "`min_tokens` (5) must not exceed `max_tokens` (4)",
            ),
            (
                Chat,
                json!({"messages": hello, "stop_token_ids": [3, 1000]}),
                400,
                Some("stop_token_ids"),
                "`stop_token_ids` holds 1000, not a token id of this model's vocabulary (0 to 999)",
            ),
            (
                Completions,
                json!({"prompt": "x", "use_beam_search": true}),
                400,
                Some("use_beam_search"),
                "`use_beam_search` is not supported (only false, its default)",
            ),
            (
                Completions,
                json!({"prompt": "x", "priority": 3}),
                400,
                Some("priority"),
                "`priority` is not supported (only 0, its default)",
            ),
            (
                Chat,
                json!({"messages": hello, "prompt_logprobs": 1}),
                400,
                Some("prompt_logprobs"),
                "`prompt_logprobs` is not supported (only null, its default)",
            ),
            (
                Completions,
                json!({"prompt": "x", "add_generation_prompt": true}),
                400,
                Some("add_generation_prompt"),
                "`add_generation_prompt` belongs to /v1/chat/completions",
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

    #[test]
    fn vllms_extensions_reach_the_sampling_parameters() {
        // As `vllm bench serve`, GuideLLM and AIPerf send them.
        let checked = validate(
            Endpoint::Completions,
            &json!({"prompt": "x", "max_tokens": 8, "ignore_eos": true, "min_tokens": 8,
                    "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                    "min_p": 0.05, "logit_bias": {"7": -100, "9": 2.5}, "stop_token_ids": [5, 6],
                    "include_stop_str_in_output": true, "skip_special_tokens": false,
                    "add_special_tokens": false, "use_beam_search": false, "length_penalty": 1.0,
                    "spaces_between_special_tokens": true, "prompt_logprobs": null,
                    "truncate_prompt_tokens": null, "priority": 0, "stream": true,
                    "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let p = &checked.params;
        assert!(p.ignore_eos && p.include_stop_str_in_output && !p.skip_special_tokens);
        assert_eq!(p.min_tokens, 8);
        // `ignore_eos`: the EOS id (2) is not barred, the stop token ids are.
        assert_eq!(p.min_tokens_barred, vec![5, 6]);
        assert_eq!(p.stop_token_ids, vec![5, 6]);
        assert_eq!(
            (
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
                p.min_p
            ),
            (1.1, 0.5, -0.5, 0.05)
        );
        let mut bias = p.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(7, -100.0), (9, 2.5)]);
        assert!(checked.continuous_usage && checked.include_usage);
        assert_eq!(checked.add_special_tokens, Some(false));
        // Without `ignore_eos`, `min_tokens` bars the EOS ids too; without `min_tokens`,
        // nothing is barred.
        let barred = |body: Value| {
            validate(Endpoint::Chat, &body)
                .unwrap_or_else(|e| panic!("{e:?}"))
                .params
                .min_tokens_barred
        };
        let hello = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(
            barred(json!({"messages": hello, "min_tokens": 2, "stop_token_ids": [9]})),
            vec![2, 9]
        );
        assert!(barred(json!({"messages": hello, "stop_token_ids": [9]})).is_empty());
        // The neutral values change nothing.
        let neutral = validate(
            Endpoint::Chat,
            &json!({"messages": hello, "ignore_eos": false, "min_tokens": 0,
                    "repetition_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0,
                    "min_p": 0, "logit_bias": {}, "stop_token_ids": [],
                    "add_generation_prompt": true, "continue_final_message": false}),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let plain = validate(Endpoint::Chat, &json!({"messages": hello}))
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(neutral.params, plain.params);
    }
}
