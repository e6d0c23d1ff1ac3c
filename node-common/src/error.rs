//! The crate's one error type: what can stop a node from starting or serving.
//! Request-time failures are gRPC statuses built by `baton_proto::status`, not these.

use baton_vocab::{ErrorKind, HasKind};
use std::path::PathBuf;

/// Errors of a node process: its flags, its model, its listeners, its identity and
/// its KV transport. Each names what the node was doing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag or configuration value out of range (the message names the flag).
    #[error("{0}")]
    Config(String),
    #[error("model {} not found; run scripts/fetch-model.sh or pass --model", .0.display())]
    ModelMissing(PathBuf),
    #[error("loading {}: {source}", path.display())]
    Model { path: PathBuf, source: baton_engine::Error },
    #[error(transparent)]
    Engine(#[from] baton_engine::Error),
    #[error(transparent)]
    Backend(#[from] baton_kernels::Error),
    /// The internal plane: the node's certificate, key or CA, or a peer endpoint.
    #[error(transparent)]
    Plane(#[from] baton_proto::Error),
    /// The node's certificate, key or CA on disk.
    #[error("loading the node's TLS identity: {0}")]
    Identity(#[from] baton_identity::Error),
    #[error("{what}: {source}")]
    Transport { what: String, source: baton_kv_transport::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// A server task (gRPC, HTTP, the engine's start-up thread) ended with an error.
    #[error("{what}: {reason}")]
    Server { what: &'static str, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn config(reason: impl Into<String>) -> Self {
        Error::Config(reason.into())
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Error::Io { what, source }
    }

    pub(crate) fn transport(what: impl Into<String>) -> impl FnOnce(baton_kv_transport::Error) -> Self {
        let what = what.into();
        move |source| Error::Transport { what, source }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Config(_) | Error::ModelMissing(_) => ErrorKind::InvalidArgument,
            Error::Model { source, .. } | Error::Engine(source) => source.kind(),
            Error::Backend(e) => e.kind(),
            Error::Plane(e) => e.kind(),
            Error::Identity(e) => e.kind(),
            Error::Transport { source, .. } => source.kind(),
            Error::Io { .. } | Error::Server { .. } => ErrorKind::Internal,
        }
    }
}
