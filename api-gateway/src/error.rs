//! API errors: the one place gateway errors become HTTP responses, in the
//! OpenAI error shape `{"error": {"message", "type", "param", "code"}}`. The
//! `type` is a stable kind; internal messages are logged, never sent.

use crate::generator::GenerateError;
use crate::store::StoreError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::time::Duration;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// Stable error type (the OpenAI `type` field and the metric label).
    pub kind: &'static str,
    /// Safe to show the client.
    pub message: String,
    pub param: Option<&'static str>,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, retry_after: None }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param), ..Self::bad_request(message) }
    }
    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", "missing or invalid API key (send Authorization: Bearer <key>)")
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", format!("{what} not found"))
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict_error", message)
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large", format!("request body is larger than {limit} bytes"))
    }
    pub fn rate_limited(limit: &str, retry_after: Duration) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", format!("rate limit reached: {limit}"))
        }
    }
    pub fn unavailable() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "the model service is unavailable; retry later")
    }
    pub fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", "internal error")
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.kind}
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::metrics::error(self.kind);
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(d) = self.retry_after {
            let secs = d.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

impl From<GenerateError> for ApiError {
    fn from(e: GenerateError) -> Self {
        match e {
            GenerateError::Unavailable(ref m) => {
                tracing::warn!(kind = e.kind(), error = %m, "generator unavailable");
                ApiError::unavailable()
            }
            GenerateError::Overloaded { retry_after } => ApiError {
                retry_after: Some(retry_after),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "overloaded", "the model service is overloaded; retry later")
            },
            GenerateError::BadRequest(m) => ApiError::bad_request(m),
            e @ GenerateError::ContextTooLong { .. } => ApiError::new(StatusCode::BAD_REQUEST, "context_length_exceeded", e.to_string()),
            GenerateError::Internal(m) => {
                tracing::error!(error = %m, "generator internal error");
                ApiError::internal()
            }
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(kind = e.kind(), error = %e, "store error");
        match e {
            StoreError::Unavailable(_) => ApiError {
                retry_after: Some(Duration::from_secs(1)),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "the conversation store is unavailable; retry later")
            },
            _ => ApiError::internal(),
        }
    }
}
