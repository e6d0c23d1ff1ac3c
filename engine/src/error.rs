//! The crate's one error type. Loading a model, running the engine and managing KV
//! blocks each keep their own vocabulary ([`ModelError`], [`EngineError`], [`KvError`]),
//! carried as variants here; each reports an [`ErrorKind`], so a protocol boundary
//! maps any of them with one function (`baton_proto::status`).

use crate::kv::KvError;
use crate::model::ConfigError;
use crate::model::ModelError;
use crate::EngineError;
use baton_vocab::{ErrorKind, HasKind};

/// What went wrong in the engine crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<KvError> for Error {
    fn from(e: KvError) -> Self {
        Error::Engine(EngineError::Kv(e))
    }
}

impl Error {
    /// The stable, fine-grained label of the underlying variant (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            Error::Model(e) => e.label(),
            Error::Engine(e) => e.label(),
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Model(e) => e.kind(),
            Error::Engine(e) => e.kind(),
        }
    }
}

impl HasKind for EngineError {
    fn kind(&self) -> ErrorKind {
        match self {
            EngineError::Overloaded { .. } => ErrorKind::ResourceExhausted,
            EngineError::ContextTooLong { .. }
            | EngineError::EmptyPrompt
            | EngineError::BadToken { .. }
            | EngineError::BadPlatformPrefix { .. }
            | EngineError::BadImport { .. } => ErrorKind::InvalidArgument,
            EngineError::Sampling(e) => e.kind(),
            EngineError::Kv(e) => e.kind(),
            EngineError::Stopped => ErrorKind::Unavailable,
            // Set-up errors of the operator's configuration; never a caller's.
            EngineError::KvTooSmall { .. } | EngineError::Config(_) => ErrorKind::Internal,
        }
    }
}

impl HasKind for KvError {
    fn kind(&self) -> ErrorKind {
        match self {
            KvError::OutOfBlocks { .. } | KvError::Tier2Full { .. } => ErrorKind::ResourceExhausted,
            KvError::SwapIn { source, .. } => source.kind(),
            // Misuse of the pool by the engine itself.
            _ => ErrorKind::Internal,
        }
    }
}

impl HasKind for ModelError {
    fn kind(&self) -> ErrorKind {
        match self {
            // A model this build or backend cannot serve, named in the message.
            ModelError::Config { .. } => ErrorKind::FailedPrecondition,
            ModelError::Tokenizer { source, .. } => source.kind(),
            ModelError::Template { source, .. } => source.kind(),
            ModelError::Gguf(_) | ModelError::Tensor { .. } | ModelError::MissingTensor { .. } | ModelError::Io { .. } => ErrorKind::Internal,
        }
    }
}

impl HasKind for ConfigError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::FailedPrecondition
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_faults_are_invalid_and_full_queues_exhausted() {
        assert_eq!(Error::from(EngineError::EmptyPrompt).kind(), ErrorKind::InvalidArgument);
        assert_eq!(Error::from(EngineError::Overloaded { waiting: 3 }).kind(), ErrorKind::ResourceExhausted);
        assert_eq!(Error::from(EngineError::Stopped).kind(), ErrorKind::Unavailable);
        assert_eq!(Error::from(KvError::OutOfBlocks { requested: 2, available: 1 }).label(), "kv");
    }
}
