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
            Error::Deadline(_) => "deadline",
            Error::NoFirstToken => "no_first_token",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Reserve(e) | Error::Transfer(e) => e.kind(),
            Error::Prefill(s) => baton_proto::kind_of(s.code()),
            Error::Connect(_) | Error::NoFirstToken => ErrorKind::Unavailable,
            Error::Deadline(_) => ErrorKind::DeadlineExceeded,
        }
    }
}
