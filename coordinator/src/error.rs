//! The crate's one error type. Building a ring and evicting on one node keep their own
//! small vocabularies ([`RingError`], [`EvictError`]); all three report an
//! [`ErrorKind`], which `baton_proto::status` maps to a gRPC status.

use crate::evict::EvictError;
use crate::routing::ring::RingError;
use baton_vocab::{ErrorKind, HasKind};

/// What went wrong in the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {field}: {why}")]
    Config { field: &'static str, why: String },
    #[error("invalid request: {what}")]
    InvalidRequest { what: &'static str },
    #[error("no {role} node is registered")]
    NoNodes { role: &'static str },
    #[cfg(feature = "etcd")]
    #[error("membership store: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("stored node record {key} cannot be decoded")]
    CorruptRecord { key: String },
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("server: {0}")]
    Serve(String),
    #[error("registration refused: {0}")]
    Binding(#[from] crate::membership::binding::Refusal),
}

impl Error {
    /// A stable short label, for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Config { .. } => "config",
            Error::InvalidRequest { .. } => "invalid_request",
            Error::NoNodes { .. } => "no_nodes",
            #[cfg(feature = "etcd")]
            Error::Etcd(_) => "membership_store",
            Error::CorruptRecord { .. } => "corrupt_record",
            Error::Bind { .. } => "bind",
            Error::Serve(_) => "serve",
            Error::Binding(_) => "name_binding",
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidRequest { .. } | Error::Config { .. } => ErrorKind::InvalidArgument,
            // The membership store or the server is down: retry, maybe at another
            // replica. `baton_proto::status` answers these with the label only, so
            // store addresses and keys stay in the logs.
            Error::NoNodes { .. } | Error::CorruptRecord { .. } | Error::Bind { .. } | Error::Serve(_) => ErrorKind::Unavailable,
            #[cfg(feature = "etcd")]
            Error::Etcd(_) => ErrorKind::Unavailable,
            Error::Binding(r) => r.kind(),
        }
    }
}

/// Lets a service answer with `?`; the mapping itself is `baton_proto::status`.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        baton_proto::status(&e)
    }
}

impl HasKind for RingError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }
}

impl HasKind for EvictError {
    fn kind(&self) -> ErrorKind {
        match self {
            EvictError::Unreachable(_) | EvictError::Refused(_) => ErrorKind::Unavailable,
            EvictError::Timeout(_) => ErrorKind::DeadlineExceeded,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
