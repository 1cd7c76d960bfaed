//! OpenAI error JSON: [`ApiError`] (`{"error": {"message", "type", "param", "code"}}` with
//! an HTTP status) and its constructors, for every 4xx and 5xx the API answers.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    /// OpenAI's error `type` (`invalid_request_error`, `server_error`, …).
    pub(super) kind: &'static str,
    pub(super) message: String,
    /// The request field at fault, when one is.
    pub(super) param: Option<String>,
    /// A machine-readable code (`model_not_found`), when OpenAI has one.
    pub(super) code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (a 503 that sheds load).
    pub(super) retry_after_secs: Option<u64>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

/// An error of `kind` with `status`, about no field in particular.
pub(super) fn error(
    status: StatusCode,
    kind: &'static str,
    message: impl Into<String>,
) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
        param: None,
        code: None,
        retry_after_secs: None,
    }
}

/// A 503 that sheds load: the queue is full (`--max-queued-requests`); retry in a second.
pub(super) fn overloaded(message: impl Into<String>) -> ApiError {
    ApiError {
        code: Some("queue_full"),
        retry_after_secs: Some(1),
        ..error(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }
}

/// A 400 (`invalid_request_error`) about no field in particular.
pub(super) fn bad_request(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A 400 about request field `param`.
pub(super) fn bad_field(param: &str, message: impl Into<String>) -> ApiError {
    ApiError {
        param: Some(param.to_string()),
        ..bad_request(message)
    }
}
