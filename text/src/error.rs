//! The crate's one error type. Each module keeps its own sub-vocabulary (the GGUF
//! reader's, the tokenizer's, the template's, the sampler's) as the payload of a
//! variant; every one of them reports an [`ErrorKind`], so a protocol boundary maps any
//! of them with one function.

use baton_vocab::{ErrorKind, HasKind};

pub use crate::chat_template::TemplateError;
pub use crate::gguf::GgufError;
pub use crate::sampling::SamplingError;
pub use crate::spm_tokenizer::SpmError;
pub use crate::tokenizer::TokenizerError;

/// What went wrong in the text layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The stable, fine-grained label of the underlying variant (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            Error::Gguf(e) => e.label(),
            Error::Template(e) => e.label(),
            Error::Tokenizer(e) => e.label(),
            Error::Sampling(e) => e.label(),
        }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Gguf(e) => e.kind(),
            Error::Template(e) => e.kind(),
            Error::Tokenizer(e) => e.kind(),
            Error::Sampling(e) => e.kind(),
        }
    }
}

/// A model file is the operator's, never a caller's: a broken or unsupported one is a
/// deployment fault, and its details (paths, offsets) stay in the logs.
impl HasKind for GgufError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Internal
    }
}

impl HasKind for TemplateError {
    fn kind(&self) -> ErrorKind {
        match self {
            TemplateError::Gguf(e) => e.kind(),
            // The template itself raised on these messages (e.g. roles that do not alternate).
            TemplateError::Raised { .. } => ErrorKind::InvalidArgument,
            TemplateError::Missing => ErrorKind::FailedPrecondition,
            TemplateError::Syntax { .. } | TemplateError::Render { .. } => ErrorKind::Internal,
        }
    }
}

impl HasKind for TokenizerError {
    fn kind(&self) -> ErrorKind {
        match self {
            TokenizerError::Gguf(e) => e.kind(),
            TokenizerError::Spm(e) => e.kind(),
            _ => ErrorKind::Internal,
        }
    }
}

impl HasKind for SpmError {
    fn kind(&self) -> ErrorKind {
        match self {
            // The caller's text needs a byte the vocabulary cannot spell.
            SpmError::NoByteToken { .. } => ErrorKind::InvalidArgument,
            _ => ErrorKind::Internal,
        }
    }
}

impl HasKind for SamplingError {
    fn kind(&self) -> ErrorKind {
        match self {
            SamplingError::InvalidParam { .. } => ErrorKind::InvalidArgument,
            // Bad logits are engine bugs, never the caller's.
            _ => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_faults_and_bugs_get_their_kinds() {
        let bad_param = SamplingError::InvalidParam { field: "temperature", reason: "must be in [0, 2]" };
        assert_eq!(Error::from(bad_param).kind(), ErrorKind::InvalidArgument);
        assert_eq!(Error::from(SamplingError::AllMasked).kind(), ErrorKind::Internal);
        assert_eq!(Error::from(TemplateError::Missing).kind(), ErrorKind::FailedPrecondition);
        assert_eq!(Error::from(SamplingError::AllMasked).label(), "all_masked");
    }
}
