//! The crate's one error type, and its single crossing into gRPC statuses.

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
}

impl Error {
    /// A stable short label, for metrics and the API error type.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Config { .. } => "config",
            Error::InvalidRequest { .. } => "invalid_request",
            Error::NoNodes { .. } => "no_nodes",
            #[cfg(feature = "etcd")]
            Error::Etcd(_) => "membership_store",
            Error::CorruptRecord { .. } => "corrupt_record",
            Error::Bind { .. } => "bind",
            Error::Serve(_) => "serve",
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        match &e {
            Error::InvalidRequest { .. } | Error::Config { .. } => tonic::Status::invalid_argument(e.to_string()),
            Error::NoNodes { .. } => tonic::Status::unavailable(e.to_string()),
            // Internal details (store addresses, keys) stay in the logs.
            Error::CorruptRecord { .. } | Error::Bind { .. } | Error::Serve(_) => {
                tracing::warn!(error = %e, kind = e.kind(), "coordinator error");
                tonic::Status::unavailable(e.kind())
            }
            #[cfg(feature = "etcd")]
            Error::Etcd(_) => {
                tracing::warn!(error = %e, kind = e.kind(), "coordinator error");
                tonic::Status::unavailable(e.kind())
            }
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
