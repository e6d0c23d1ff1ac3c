//! The crate's one error type. Library functions return [`BenchError`]; only the `run`
//! entry points (glue for the CLI) convert to `anyhow`.

use std::path::PathBuf;

/// What went wrong while reading inputs or configuring a run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (magic {magic:?})")]
    GgufMagic { path: PathBuf, magic: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (2 or 3 are)")]
    GgufVersion { path: PathBuf, version: u32 },
    #[error("{path}: malformed GGUF metadata at key {key:?}: {what}")]
    GgufMalformed {
        path: PathBuf,
        key: String,
        what: &'static str,
    },
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
}

impl BenchError {
    /// A stable short label, usable as a metric label or error kind.
    pub fn kind(&self) -> &'static str {
        match self {
            BenchError::Io { .. } => "io",
            BenchError::GgufMagic { .. } => "gguf_magic",
            BenchError::GgufVersion { .. } => "gguf_version",
            BenchError::GgufMalformed { .. } => "gguf_malformed",
            BenchError::MissingField { .. } => "missing_field",
            BenchError::Json { .. } => "json",
            BenchError::InvalidInput { .. } => "invalid_input",
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
