//! The crate's one error type.

use crate::matmul::MatrixError;
use baton_vocab::{ErrorKind, HasKind};

/// Errors of the kernels crate. Preparing a weight matrix has its own small vocabulary
/// ([`MatrixError`], comparable in tests), carried as one variant.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Matrix(#[from] MatrixError),
    #[error("backend {backend} is unavailable: {reason}")]
    BackendUnavailable { backend: &'static str, reason: String },
    #[error("could not start {threads} compute threads: {reason}")]
    Threads { threads: usize, reason: String },
    #[error("NVRTC could not compile {file} for {arch}:\n{log}")]
    Compile { file: String, arch: &'static str, log: String },
    /// A driver, NVRTC or cuBLAS call failed; `detail` is the library's own status.
    #[error("{call} failed: {detail}")]
    Device { call: &'static str, detail: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A stable, fine-grained label of the variant (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            Error::Matrix(_) => "matrix",
            Error::BackendUnavailable { .. } => "backend_unavailable",
            Error::Threads { .. } => "threads",
            Error::Compile { .. } => "compile",
            Error::Device { .. } => "device",
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            // The machine lacks what was asked for (a GPU, a driver): not a bug, and not
            // fixed by retrying.
            Error::BackendUnavailable { .. } => ErrorKind::FailedPrecondition,
            Error::Threads { .. } => ErrorKind::ResourceExhausted,
            Error::Matrix(_) | Error::Compile { .. } | Error::Device { .. } => ErrorKind::Internal,
        }
    }
}

impl HasKind for MatrixError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Internal
    }
}
