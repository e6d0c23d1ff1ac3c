//! Kinds of failure, shared by every crate's error type.

use std::fmt;

/// What kind of failure an error is: decides the status a protocol answers with and
/// whether the caller may retry. The variants follow gRPC's codes that Baton uses, so
/// the mapping to gRPC is one-to-one and the mapping to HTTP is a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The caller sent something that can never succeed as sent (bad field, bad size).
    InvalidArgument,
    /// The caller's credentials are missing or wrong.
    Unauthenticated,
    /// The caller is known but may not do this.
    PermissionDenied,
    /// What the caller named does not exist (or is not theirs: the two look the same).
    NotFound,
    /// What the caller would create exists already, or another request holds it.
    Conflict,
    /// The system is not in the state the request needs (a model without a chat template).
    FailedPrecondition,
    /// A limit was reached (memory, KV blocks, a quota); retrying later may succeed.
    ResourceExhausted,
    /// A peer or dependency is down or not ready; retrying (elsewhere) may succeed.
    Unavailable,
    /// The deadline passed before the work finished.
    DeadlineExceeded,
    /// The caller went away or asked to stop.
    Cancelled,
    /// A bug or a broken invariant; details stay in the logs.
    Internal,
}

impl ErrorKind {
    /// A stable snake_case label, for metrics, logs and API error types.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::FailedPrecondition => "failed_precondition",
            ErrorKind::ResourceExhausted => "resource_exhausted",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Internal => "internal",
        }
    }

    /// Whether the same request may succeed if sent again later or to another node.
    pub fn retryable(self) -> bool {
        matches!(self, ErrorKind::ResourceExhausted | ErrorKind::Unavailable | ErrorKind::DeadlineExceeded | ErrorKind::Conflict)
    }

    /// Every kind, for tables and tests that must cover them all.
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::InvalidArgument,
        ErrorKind::Unauthenticated,
        ErrorKind::PermissionDenied,
        ErrorKind::NotFound,
        ErrorKind::Conflict,
        ErrorKind::FailedPrecondition,
        ErrorKind::ResourceExhausted,
        ErrorKind::Unavailable,
        ErrorKind::DeadlineExceeded,
        ErrorKind::Cancelled,
        ErrorKind::Internal,
    ];
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// An error that knows its [`ErrorKind`]: every crate's error type implements it, so a
/// protocol boundary maps any of them with one function.
pub trait HasKind: std::error::Error {
    /// The kind of this failure.
    fn kind(&self) -> ErrorKind;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<_> = ErrorKind::ALL.iter().map(|k| k.label()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), ErrorKind::ALL.len());
    }
}
