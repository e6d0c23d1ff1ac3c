//! GGUF (v2 and v3) reader over a memory map, plus a small writer for tests.
//!
//! Owns: parsing the header, the metadata key/value table and the tensor
//! table of a GGUF file, and handing out the bytes of each tensor.
//!
//! Invariants once [`GgufFile::open`] returns `Ok`:
//! - every length read from the file (strings, arrays, counts, dims) was
//!   checked against the bytes left in the file *before* anything was
//!   allocated, so a hostile or truncated file costs at most its own size;
//! - every tensor of a supported [`GgmlType`] has `n_bytes == Some(_)`, its
//!   row length is a multiple of the type's block length and its bytes lie
//!   inside the file, so [`GgufFile::tensor_data`] never reads out of bounds;
//! - tensors of other types are kept (with `n_bytes == None`) so that the
//!   error can name the tensor when, and only if, it is used
//!   ([`GgufFile::require_tensor`], [`GgufFile::tensor_data_checked`]);
//! - key and tensor names are unique and valid UTF-8.
//!
//! [`GgufFile::open_header`] reads the same header with the same checks but skips the
//! elements of metadata arrays ([`MetaValue::ArrayLen`] keeps their length): for
//! readers of shapes and hyper-parameters, such as the capacity planner.
//!
//! No input makes this module panic; every failure is a [`GgufError`] that
//! names the file and what was wrong.

mod error;
mod metadata;
mod parse;
mod tensor;
#[cfg(test)]
mod tests;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use parse::{parse, Arrays};

pub use error::GgufError;
pub use metadata::MetaValue;
pub use tensor::{GgmlType, TensorInfo};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are rejected (ggml itself allows none).
const MAX_ARRAY_DEPTH: usize = 4;

/// An opened, validated GGUF file. The tensor bytes stay in the memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of tensor data (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute offset where the tensor data section starts.
    pub data_offset: u64,
    /// Size of the file in bytes.
    pub file_len: u64,
    by_name: HashMap<String, usize>,
    map: Option<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("file_len", &self.file_len)
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates a GGUF v2/v3 file. Tensor data is not read, only mapped.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        Self::open_with(path, Arrays::Decode)
    }

    /// Like [`Self::open`], but metadata arrays are skipped, not decoded: each is a
    /// [`MetaValue::ArrayLen`] (read its length with [`Self::get_array_len`]). For
    /// readers of the header, shapes and scalar hyper-parameters only.
    pub fn open_header(path: &Path) -> Result<GgufFile, GgufError> {
        Self::open_with(path, Arrays::LengthOnly)
    }

    fn open_with(path: &Path, arrays: Arrays) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        // An empty file cannot be mapped on every platform; it is truncated anyway.
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the map is read-only and private to this struct. Like every
            // mmap-based model loader we assume the file is not truncated by
            // another process while mapped; that would be a SIGBUS, not UB in Rust
            // terms we could guard against.
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let parsed = parse(path, bytes, arrays)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            file_len: len,
            by_name: parsed.by_name,
            map,
        })
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The tensor named `name`, if any.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The bytes of `t`. Bounds were validated at open; a tensor of an
    /// unsupported type (or one from another file) yields an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let Some(n) = t.n_bytes else { return &[] };
        let (Ok(start), Ok(n)) = (usize::try_from(t.offset), usize::try_from(n)) else {
            return &[];
        };
        start
            .checked_add(n)
            .and_then(|end| self.bytes().get(start..end))
            .unwrap_or(&[])
    }

    /// The bytes of `t`, or an error naming it if its type is unsupported.
    pub fn tensor_data_checked(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        if !t.ggml_type.is_supported() {
            return Err(GgufError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: t.name.clone(),
                type_name: t.ggml_type.name(),
            });
        }
        Ok(self.tensor_data(t))
    }

    /// The tensor `name`, checked to exist, to have a supported type and,
    /// unless `expected_dims` is empty, to have exactly that shape (ggml order).
    pub fn require_tensor(
        &self,
        name: &str,
        expected_dims: &[u64],
    ) -> Result<&TensorInfo, GgufError> {
        let t = self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        if !t.ggml_type.is_supported() {
            return Err(GgufError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: t.name.clone(),
                type_name: t.ggml_type.name(),
            });
        }
        if !expected_dims.is_empty() && t.dims != expected_dims {
            return Err(GgufError::ShapeMismatch {
                path: self.path.clone(),
                tensor: t.name.clone(),
                expected: expected_dims.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(t)
    }
}
