//! The crate's one error type.

use baton_vocab::{ErrorKind, HasKind};

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong with certificates and identities.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("certificate cannot be parsed: {0}")]
    Parse(String),
    #[error("certificate names no Baton identity (a DNS name NAME.ROLE.{domain})", domain = crate::IDENTITY_DOMAIN)]
    NoIdentity,
    #[error("certificate names more than one Baton identity ({0} and {1})")]
    AmbiguousIdentity(String, String),
    #[error("no certificate for {0}")]
    UnknownName(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid name {name:?}: {why}")]
    InvalidName { name: String, why: &'static str },
    #[error("invalid admin key: {0}")]
    InvalidAdminKey(String),
}

impl Error {
    /// A stable short label (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            Error::Generate(_) => "generate",
            Error::Tls(_) => "tls",
            Error::Parse(_) => "parse",
            Error::NoIdentity => "no_identity",
            Error::AmbiguousIdentity(..) => "ambiguous_identity",
            Error::UnknownName(_) => "unknown_name",
            Error::Io { .. } => "io",
            Error::InvalidName { .. } => "invalid_name",
            Error::InvalidAdminKey(_) => "invalid_admin_key",
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            // A certificate or name the peer presented that does not say who it is.
            Error::NoIdentity | Error::AmbiguousIdentity(..) => ErrorKind::Unauthenticated,
            Error::UnknownName(_) => ErrorKind::NotFound,
            Error::InvalidName { .. } | Error::InvalidAdminKey(_) | Error::Parse(_) => ErrorKind::InvalidArgument,
            Error::Generate(_) | Error::Tls(_) | Error::Io { .. } => ErrorKind::Internal,
        }
    }
}
