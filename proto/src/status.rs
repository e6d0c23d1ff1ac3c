//! The one crossing between Baton's errors and gRPC statuses, both ways.
//!
//! A service answers a failed library call with [`status`]; a client turns a status it
//! got back into an [`ErrorKind`] with [`kind_of`]. Kinds map one-to-one onto codes, so
//! a kind survives a hop through the plane.

use baton_vocab::{ErrorKind, HasKind};
use std::fmt::Display;
use tonic::{Code, Status};

/// The gRPC code of a kind (one-to-one).
pub fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::Conflict => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::Internal => Code::Internal,
    }
}

/// The status a service answers an error with. The caller sees the error's message
/// only where it is about the caller's request; an internal or unavailable error
/// answers with its kind's label alone (its message may name stores, addresses, files
/// or other callers' data) and its detail goes to the log.
pub fn status<E: HasKind + Display + ?Sized>(e: &E) -> Status {
    let kind = e.kind();
    match kind {
        ErrorKind::Internal => {
            tracing::error!(error = %e, kind = kind.label(), "internal error answered to a caller");
            Status::new(code(kind), kind.label())
        }
        ErrorKind::Unavailable => {
            tracing::warn!(error = %e, kind = kind.label(), "unavailable");
            Status::new(code(kind), kind.label())
        }
        _ => Status::new(code(kind), e.to_string()),
    }
}

/// The kind of a status a client got back: the inverse of [`code`], and for the codes
/// Baton never sends, the kind a client should treat them as (`Aborted` and `Unknown`,
/// which a broken connection or a peer's proxy may produce, as unavailable: retry).
pub fn kind_of(code: Code) -> ErrorKind {
    match code {
        Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
        Code::Unauthenticated => ErrorKind::Unauthenticated,
        Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::NotFound => ErrorKind::NotFound,
        Code::AlreadyExists => ErrorKind::Conflict,
        Code::FailedPrecondition => ErrorKind::FailedPrecondition,
        Code::ResourceExhausted => ErrorKind::ResourceExhausted,
        Code::Unavailable | Code::Aborted | Code::Unknown => ErrorKind::Unavailable,
        Code::DeadlineExceeded => ErrorKind::DeadlineExceeded,
        Code::Cancelled => ErrorKind::Cancelled,
        Code::Internal | Code::Unimplemented | Code::DataLoss | Code::Ok => ErrorKind::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("secret detail of {0:?}")]
    struct Failure(ErrorKind);

    impl HasKind for Failure {
        fn kind(&self) -> ErrorKind {
            self.0
        }
    }

    #[test]
    fn every_kind_survives_a_round_trip_through_a_status() {
        let mut codes: Vec<Code> = ErrorKind::ALL.iter().map(|&k| code(k)).collect();
        for kind in ErrorKind::ALL {
            let s = status(&Failure(kind));
            assert_eq!(s.code(), code(kind));
            assert_eq!(kind_of(s.code()), kind, "{kind}");
        }
        codes.sort_by_key(|c| *c as i32);
        codes.dedup();
        assert_eq!(codes.len(), ErrorKind::ALL.len(), "two kinds share a code");
    }

    #[test]
    fn internal_and_unavailable_details_stay_in_the_logs() {
        for kind in ErrorKind::ALL {
            let s = status(&Failure(kind));
            let hidden = matches!(kind, ErrorKind::Internal | ErrorKind::Unavailable);
            assert_eq!(s.message().contains("secret"), !hidden, "{kind}: {}", s.message());
            if hidden {
                assert_eq!(s.message(), kind.label());
            }
        }
    }
}
