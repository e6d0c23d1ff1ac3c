//! The crate's one error type: why a remote prefill did not deliver.

use baton_vocab::{ErrorKind, HasKind};
use std::time::Duration;

/// Why a remote prefill did not deliver; the turn is then prefilled locally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reserving staging blocks: {0}")]
    Reserve(baton_kv_transport::Error),
    #[error("cannot reach the prefill node: {0}")]
    Connect(String),
    #[error("the prefill node failed: {0}")]
    Prefill(tonic::Status),
    #[error("the KV transfer failed: {0}")]
    Transfer(baton_kv_transport::Error),
    /// The prefill call failed after the prefill node had opened its KV transfer here
    /// (it died or gave up while shipping, or this node refused its frames).
    #[error("the prefill node failed while shipping the KV: {0}")]
    Shipping(tonic::Status),
    #[error("the remote prefill missed its deadline of {0:?}")]
    Deadline(Duration),
    #[error("the prefill node answered without a first token")]
    NoFirstToken,
}

impl Error {
    /// Stable label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Reserve(_) => "reserve",
            Error::Connect(_) => "connect",
            Error::Prefill(_) => "prefill",
            Error::Transfer(_) => "transfer",
            Error::Shipping(_) => "shipping",
            Error::Deadline(_) => "deadline",
            Error::NoFirstToken => "no_first_token",
        }
    }
}

impl Error {
    /// Why the turn's KV was recomputed here (its `recomputed` reason, proof of transfer):
    /// a prefill node that could not be reached or went away before shipping is
    /// unavailable; one that answered with an error failed; a transfer that began and did
    /// not complete failed in transfer.
    pub fn reason(&self) -> baton_proto::node::KvReason {
        use baton_proto::node::KvReason as R;
        use tonic::Code;
        match self {
            Error::Reserve(_) => R::ReserveFailed,
            Error::Connect(_) => R::PrefillNodeUnavailable,
            Error::Prefill(s) => match s.code() {
                Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted => R::PrefillNodeUnavailable,
                _ => R::PrefillFailed,
            },
            Error::Transfer(_) | Error::Shipping(_) => R::TransferFailed,
            Error::Deadline(_) => R::Deadline,
            Error::NoFirstToken => R::PrefillFailed,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Reserve(e) | Error::Transfer(e) => e.kind(),
            Error::Prefill(s) | Error::Shipping(s) => baton_proto::kind_of(s.code()),
            Error::Connect(_) | Error::NoFirstToken => ErrorKind::Unavailable,
            Error::Deadline(_) => ErrorKind::DeadlineExceeded,
        }
    }
}
