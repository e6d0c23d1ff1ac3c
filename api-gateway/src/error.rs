//! The crate's one error type, and the one place errors become HTTP responses, in the
//! OpenAI error shape `{"error": {"message", "type", "param", "code"}}`.
//!
//! Every error reports an [`ErrorKind`]; [`http_status`] and [`error_type`] are the
//! one table from a kind to what a client sees, used by [`ApiError`] for both plain
//! responses and the SSE error event of a stream. The `type` is stable (it is also the
//! metric label); internal messages are logged, never sent.

use crate::checks::{Refusal, RulesError};
use crate::context::ContextError;
use crate::generator::GenerateError;
use crate::store::StoreError;
use crate::tls::TlsError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_vocab::{ErrorKind, HasKind};
use std::time::Duration;

/// What went wrong in the gateway: each module's own vocabulary, carried as a variant.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Context(#[from] ContextError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Rules(#[from] RulesError),
    #[error(transparent)]
    Refused(#[from] Refusal),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Generate(e) => e.kind(),
            Error::Context(e) => e.kind(),
            Error::Store(e) => e.kind(),
            Error::Tls(e) => e.kind(),
            Error::Rules(e) => e.kind(),
            Error::Refused(e) => e.kind(),
        }
    }
}

impl HasKind for GenerateError {
    fn kind(&self) -> ErrorKind {
        match self {
            GenerateError::Unavailable(_) => ErrorKind::Unavailable,
            GenerateError::Overloaded { .. } => ErrorKind::ResourceExhausted,
            GenerateError::BadRequest(_) | GenerateError::ContextTooLong { .. } => ErrorKind::InvalidArgument,
            GenerateError::Internal(_) => ErrorKind::Internal,
        }
    }
}

impl HasKind for ContextError {
    fn kind(&self) -> ErrorKind {
        // The messages cannot be rendered or encoded as the client sent them.
        ErrorKind::InvalidArgument
    }
}

impl HasKind for StoreError {
    fn kind(&self) -> ErrorKind {
        match self {
            StoreError::NotFound { .. } => ErrorKind::NotFound,
            StoreError::Unavailable(_) => ErrorKind::Unavailable,
            StoreError::Db(_) | StoreError::Corrupt(_) => ErrorKind::Internal,
        }
    }
}

impl HasKind for TlsError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }
}

impl HasKind for RulesError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }
}

impl HasKind for Refusal {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }
}

/// The HTTP status a client sees for a kind of error.
pub fn http_status(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidArgument | ErrorKind::FailedPrecondition => StatusCode::BAD_REQUEST,
        ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        ErrorKind::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::DeadlineExceeded => StatusCode::REQUEST_TIMEOUT,
        // nginx's "client closed request": only logs and metrics ever see it.
        ErrorKind::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The OpenAI error `type` of a kind (also the metric label), unless the error names a
/// finer one (`context_length_exceeded`, `overloaded`, `content_policy_violation`).
pub fn error_type(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument | ErrorKind::FailedPrecondition => "invalid_request_error",
        ErrorKind::Unauthenticated => "authentication_error",
        ErrorKind::PermissionDenied => "permission_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::Conflict => "conflict_error",
        ErrorKind::ResourceExhausted => "rate_limit_error",
        ErrorKind::Unavailable => "service_unavailable",
        ErrorKind::DeadlineExceeded => "request_timeout",
        ErrorKind::Cancelled => "cancelled",
        ErrorKind::Internal => "internal_error",
    }
}

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    /// [`http_status`] of the kind, except for the few statuses about HTTP itself (405,
    /// 413) that no error kind names.
    pub status: StatusCode,
    /// Stable error type (the OpenAI `type` field and the metric label).
    pub error_type: &'static str,
    /// Safe to show the client.
    pub message: String,
    pub param: Option<&'static str>,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// An error of `kind`, with its status and type from the table.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError { kind, status: http_status(kind), error_type: error_type(kind), message: message.into(), param: None, retry_after: None }
    }
    /// The same error under a finer OpenAI `type`.
    pub fn typed(self, error_type: &'static str) -> Self {
        ApiError { error_type, ..self }
    }
    /// The same error with a status about HTTP itself (405, 413).
    pub fn with_status(self, status: StatusCode) -> Self {
        ApiError { status, ..self }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param), ..Self::bad_request(message) }
    }
    pub fn unauthorized() -> Self {
        Self::new(ErrorKind::Unauthenticated, "missing or invalid API key (send Authorization: Bearer <key>)")
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorKind::NotFound, format!("{what} not found"))
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }
    pub fn too_large(limit: usize) -> Self {
        Self::bad_request(format!("request body is larger than {limit} bytes")).typed("request_too_large").with_status(StatusCode::PAYLOAD_TOO_LARGE)
    }
    pub fn rate_limited(limit: &str, retry_after: Duration) -> Self {
        ApiError { retry_after: Some(retry_after), ..Self::new(ErrorKind::ResourceExhausted, format!("rate limit reached: {limit}")) }
    }
    /// A content check refused the text.
    pub fn refused(message: impl Into<String>) -> Self {
        Self::bad_request(message).typed("content_policy_violation")
    }
    pub fn unavailable() -> Self {
        Self::new(ErrorKind::Unavailable, "the model service is unavailable; retry later")
    }
    pub fn internal() -> Self {
        Self::new(ErrorKind::Internal, "internal error")
    }

    /// The JSON body (of a response, or the data of an SSE error event).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.error_type}
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::metrics::error(self.error_type);
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
                tracing::warn!(kind = e.label(), error = %m, "generator unavailable");
                ApiError::unavailable()
            }
            GenerateError::Overloaded { retry_after } => ApiError {
                retry_after: Some(retry_after),
                ..ApiError::new(ErrorKind::ResourceExhausted, "the model service is overloaded; retry later").typed("overloaded")
            },
            GenerateError::BadRequest(m) => ApiError::bad_request(m),
            e @ GenerateError::ContextTooLong { .. } => ApiError::bad_request(e.to_string()).typed("context_length_exceeded"),
            GenerateError::Internal(m) => {
                tracing::error!(error = %m, "generator internal error");
                ApiError::internal()
            }
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(kind = e.label(), error = %e, "store error");
        match e.kind() {
            ErrorKind::Unavailable => ApiError {
                retry_after: Some(Duration::from_secs(1)),
                ..Self::new(ErrorKind::Unavailable, "the conversation store is unavailable; retry later")
            },
            // A missing row the handler did not turn into its own 404 is a bug here.
            _ => ApiError::internal(),
        }
    }
}

impl From<crate::limits::LimitError> for ApiError {
    /// A refusal is a 429 with Retry-After, counted by limit; a ledger that could not be
    /// asked is the store's error (503 when unreachable).
    fn from(e: crate::limits::LimitError) -> Self {
        match e {
            crate::limits::LimitError::Refused(r) => {
                crate::metrics::rate_limited(r.limit);
                ApiError::rate_limited(r.limit, r.retry_after)
            }
            crate::limits::LimitError::Ledger(e) => e.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table clients see; a change here changes the API.
    #[test]
    fn every_kind_has_a_status_and_a_type() {
        let want = [
            (ErrorKind::InvalidArgument, 400, "invalid_request_error"),
            (ErrorKind::Unauthenticated, 401, "authentication_error"),
            (ErrorKind::PermissionDenied, 403, "permission_error"),
            (ErrorKind::NotFound, 404, "not_found_error"),
            (ErrorKind::Conflict, 409, "conflict_error"),
            (ErrorKind::FailedPrecondition, 400, "invalid_request_error"),
            (ErrorKind::ResourceExhausted, 429, "rate_limit_error"),
            (ErrorKind::Unavailable, 503, "service_unavailable"),
            (ErrorKind::DeadlineExceeded, 408, "request_timeout"),
            (ErrorKind::Cancelled, 499, "cancelled"),
            (ErrorKind::Internal, 500, "internal_error"),
        ];
        assert_eq!(want.len(), ErrorKind::ALL.len());
        for (kind, (k, status, ty)) in ErrorKind::ALL.into_iter().zip(want) {
            assert_eq!(kind, k, "the table follows ErrorKind::ALL");
            assert_eq!(http_status(kind).as_u16(), status, "{kind}");
            assert_eq!(error_type(kind), ty, "{kind}");
            let e = ApiError::new(kind, "m");
            assert_eq!((e.status.as_u16(), e.error_type), (status, ty));
        }
    }

    #[test]
    fn generator_errors_keep_their_statuses_and_types() {
        let cases = [
            (GenerateError::Unavailable("node down".into()), 503, "service_unavailable"),
            (GenerateError::Overloaded { retry_after: Duration::from_secs(1) }, 429, "overloaded"),
            (GenerateError::BadRequest("bad".into()), 400, "invalid_request_error"),
            (GenerateError::ContextTooLong { prompt: 10, max_tokens: 10, max_context: 8 }, 400, "context_length_exceeded"),
            (GenerateError::Internal("bug".into()), 500, "internal_error"),
        ];
        for (e, status, ty) in cases {
            let api = ApiError::from(e);
            assert_eq!((api.status.as_u16(), api.error_type), (status, ty));
            assert!(!api.message.contains("node down") && !api.message.contains("bug"), "{}", api.message);
        }
        assert_eq!(ApiError::too_large(10).status, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
