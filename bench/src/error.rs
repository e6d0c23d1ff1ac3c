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
}

impl BenchError {
    /// A stable short label, usable as a metric label or error kind.
    pub fn kind(&self) -> &'static str {
        match self {
            BenchError::Io { .. } => "io",
            BenchError::Gguf(_) => "gguf",
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
