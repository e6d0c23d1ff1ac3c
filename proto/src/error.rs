//! The crate's one error type: why the internal plane could not be set up.

use crate::plane::Role;
use baton_vocab::{ErrorKind, HasKind};

/// Why a [`crate::plane::Plane`] could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("internal plane TLS: {0}")]
    Identity(#[from] baton_identity::Error),
    #[error("{file} names {names}, not a {role} identity")]
    WrongRole { file: String, names: String, role: Role },
    #[error("internal plane URL {url:?}: {why}")]
    Url { url: String, why: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Identity(e) => e.kind(),
            Error::WrongRole { .. } | Error::Url { .. } => ErrorKind::InvalidArgument,
        }
    }
}
