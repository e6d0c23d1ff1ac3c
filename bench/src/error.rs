//! The crate's one error type. Library functions return [`Error`] (also named
//! [`BenchError`]); only the `run` entry points (glue for the CLI) convert to `anyhow`.

use crate::load::TurnError;
use baton_vocab::{ErrorKind, HasKind};
use std::path::PathBuf;

pub use self::Error as BenchError;

/// What went wrong while reading inputs or configuring a run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF reader's error; it names the file and what was wrong.
    #[error(transparent)]
    Gguf(#[from] baton_text::gguf::GgufError),
    #[error("{source_name}: required model field {field} is missing")]
    MissingField {
        source_name: String,
        field: &'static str,
    },
    #[error("cannot parse {path} as JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid value for {name}: {why}")]
    InvalidInput { name: &'static str, why: String },
    #[error(transparent)]
    BadValue(#[from] BadValue),
    #[error(transparent)]
    Turn(#[from] TurnError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A command-line value that does not parse (clap shows the message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not {expected}")]
pub struct BadValue {
    pub value: String,
    pub expected: &'static str,
}

impl BadValue {
    pub fn new(value: &str, expected: &'static str) -> Self {
        BadValue { value: value.to_string(), expected }
    }
}

impl Error {
    /// A stable short label, usable as a metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Gguf(_) => "gguf",
            Error::MissingField { .. } => "missing_field",
            Error::Json { .. } => "json",
            Error::InvalidInput { .. } | Error::BadValue(_) => "invalid_input",
            Error::Turn(_) => "turn",
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            // Every input names a file or value the user gave: theirs to fix.
            Error::Io { .. } | Error::MissingField { .. } | Error::Json { .. } | Error::InvalidInput { .. } | Error::BadValue(_) => {
                ErrorKind::InvalidArgument
            }
            Error::Gguf(e) => e.kind(),
            Error::Turn(e) => e.kind(),
        }
    }
}

impl HasKind for TurnError {
    /// The kind the gateway's status stands for (its table in `baton-api-gateway`,
    /// read backwards), so a load run can tell refusals from failures.
    fn kind(&self) -> ErrorKind {
        match self {
            TurnError::Status { status, .. } => match status {
                400 | 413 => ErrorKind::InvalidArgument,
                401 => ErrorKind::Unauthenticated,
                403 => ErrorKind::PermissionDenied,
                404 => ErrorKind::NotFound,
                408 => ErrorKind::DeadlineExceeded,
                409 => ErrorKind::Conflict,
                429 => ErrorKind::ResourceExhausted,
                503 => ErrorKind::Unavailable,
                _ => ErrorKind::Internal,
            },
            TurnError::Transport(_) => ErrorKind::Unavailable,
            TurnError::Protocol(_) => ErrorKind::Internal,
        }
    }
}

/// Shorthand for an invalid-input error.
pub(crate) fn invalid(name: &'static str, why: impl Into<String>) -> BenchError {
    BenchError::InvalidInput {
        name,
        why: why.into(),
    }
}
