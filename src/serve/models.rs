//! The model list as vLLM fills it (`GET /v1/models`, and OpenAI's `GET /v1/models/{id}`)
//! and vLLM's tokenizer endpoints (`POST /tokenize`, `POST /detokenize`), so that load
//! generators and scripts written for vLLM find what they read.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::errors::ApiError;
use super::{AppState, Ready, api, authorize, now, off_the_workers, served_model};
use crate::runtime::model::tokenizer::Tokenizer;

/// One model object: OpenAI's `id`, `object`, `created`, `owned_by`, and vLLM's `root`
/// (what the model was loaded from; `vllm bench serve` reads it), `parent`,
/// `max_model_len` and `permission`.
fn model_object(state: &AppState) -> Value {
    let created = now();
    json!({
        "id": state.model_id,
        "object": "model",
        "created": created,
        "owned_by": "infer",
        "root": state.model_id,
        "parent": null,
        "max_model_len": state.max_context_tokens,
        "permission": [{
            "id": format!("modelperm-{}", state.model_id),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }],
    })
}

/// `GET /v1/models`: the served model.
pub(super) async fn list(Ready(state, _): Ready, headers: HeaderMap) -> Response {
    if let Err(response) = authorize(&state, &headers) {
        return response.into_response();
    }
    axum::Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

/// `GET /v1/models/{id}`: the served model, or a 404 `model_not_found` for another id.
pub(super) async fn one(
    Ready(state, _): Ready,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    api::check_model_name(&served_model(&state), Some(&id))?;
    Ok(axum::Json(model_object(&state)).into_response())
}

/// `POST /tokenize` (vLLM's): a prompt or a chat as token ids, counted, with the model's
/// context (`max_model_len`).
pub(super) async fn tokenize(
    Ready(state, _): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    tokenizer_endpoint(state, &headers, body, api::tokenize).await
}

/// `POST /detokenize` (vLLM's): token ids as text.
pub(super) async fn detokenize(
    Ready(state, _): Ready,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    tokenizer_endpoint(state, &headers, body, api::detokenize).await
}

/// An authorized request's `answer`, computed on the blocking pool (a long prompt takes
/// seconds to tokenize), as JSON.
async fn tokenizer_endpoint(
    state: Arc<AppState>,
    headers: &HeaderMap,
    body: Bytes,
    answer: fn(&api::ServedModel, &Tokenizer, &Bytes) -> Result<Value, ApiError>,
) -> Result<Response, ApiError> {
    authorize(&state, headers)?;
    let answer =
        off_the_workers(move || answer(&served_model(&state), &state.tokenizer, &body)).await?;
    Ok((StatusCode::OK, axum::Json(answer)).into_response())
}
