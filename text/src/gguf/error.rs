//! The reader's one error type: every variant names the file and what was wrong.

use std::path::PathBuf;

use super::{MAX_ARRAY_DEPTH, MAX_DIMS};

/// Errors of the GGUF reader. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (bad magic)")]
    BadMagic { path: PathBuf },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated while reading {what} at offset {offset}: needs {needed} bytes, file has {len}")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{path}: {what} is not valid UTF-8")]
    BadUtf8 { path: PathBuf, what: String },
    #[error("{path}: metadata key {key:?} has unknown value type id {type_id}")]
    BadValueType {
        path: PathBuf,
        key: String,
        type_id: u32,
    },
    #[error("{path}: metadata key {key:?} nests arrays deeper than {MAX_ARRAY_DEPTH}")]
    ArrayTooDeep { path: PathBuf, key: String },
    #[error("{path}: metadata key {key:?} appears twice")]
    DuplicateKey { path: PathBuf, key: String },
    #[error("{path}: tensor {tensor:?} appears twice")]
    DuplicateTensor { path: PathBuf, tensor: String },
    #[error("{path}: general.alignment = {alignment} is not a non-zero power of two")]
    BadAlignment { path: PathBuf, alignment: u64 },
    #[error("{path}: tensor {tensor:?} data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("{path}: tensor {tensor:?} has {n_dims} dimensions (at most {MAX_DIMS})")]
    TooManyDims {
        path: PathBuf,
        tensor: String,
        n_dims: u32,
    },
    #[error("{path}: tensor {tensor:?} shape {dims:?} overflows")]
    ShapeOverflow {
        path: PathBuf,
        tensor: String,
        dims: Vec<u64>,
    },
    #[error("{path}: tensor {tensor:?} ({type_name}) has rows of {row_len} elements, not a multiple of the block length {block_len}")]
    RowNotBlockAligned {
        path: PathBuf,
        tensor: String,
        type_name: &'static str,
        row_len: u64,
        block_len: u64,
    },
    #[error("{path}: tensor {tensor:?} at offset {offset} with {n_bytes} bytes ends past the end of the file ({file_len} bytes)")]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        offset: u64,
        n_bytes: u64,
        file_len: u64,
    },
    #[error("{path}: missing metadata key {key:?}")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: missing tensor {tensor:?}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor:?} has type {type_name}, which Baton does not support")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        type_name: &'static str,
    },
    #[error("{path}: tensor {tensor:?} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
}

impl GgufError {
    /// A stable, short name of the variant, for metric labels and API errors.
    pub fn label(&self) -> &'static str {
        match self {
            GgufError::Io { .. } => "io",
            GgufError::BadMagic { .. } => "bad_magic",
            GgufError::UnsupportedVersion { .. } => "unsupported_version",
            GgufError::Truncated { .. } => "truncated",
            GgufError::BadUtf8 { .. } => "bad_utf8",
            GgufError::BadValueType { .. } => "bad_value_type",
            GgufError::ArrayTooDeep { .. } => "array_too_deep",
            GgufError::DuplicateKey { .. } => "duplicate_key",
            GgufError::DuplicateTensor { .. } => "duplicate_tensor",
            GgufError::BadAlignment { .. } => "bad_alignment",
            GgufError::MisalignedTensor { .. } => "misaligned_tensor",
            GgufError::TooManyDims { .. } => "too_many_dims",
            GgufError::ShapeOverflow { .. } => "shape_overflow",
            GgufError::RowNotBlockAligned { .. } => "row_not_block_aligned",
            GgufError::TensorOutOfBounds { .. } => "tensor_out_of_bounds",
            GgufError::MissingKey { .. } => "missing_key",
            GgufError::WrongType { .. } => "wrong_type",
            GgufError::MissingTensor { .. } => "missing_tensor",
            GgufError::UnsupportedTensorType { .. } => "unsupported_tensor_type",
            GgufError::ShapeMismatch { .. } => "shape_mismatch",
        }
    }
}
