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
//! No input makes this module panic; every failure is a [`GgufError`] that
//! names the file and what was wrong.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use baton_kernels::WeightFormat;
use memmap2::Mmap;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are rejected (ggml itself allows none).
const MAX_ARRAY_DEPTH: usize = 4;

// GGUF metadata value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

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
    pub fn kind(&self) -> &'static str {
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

/// A metadata value, as stored in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// Elements share one type in a well-formed file (the writer enforces it).
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// GGUF's name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// The value as an integer, if it is one of the integer types.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => T_U8,
            MetaValue::I8(_) => T_I8,
            MetaValue::U16(_) => T_U16,
            MetaValue::I16(_) => T_I16,
            MetaValue::U32(_) => T_U32,
            MetaValue::I32(_) => T_I32,
            MetaValue::U64(_) => T_U64,
            MetaValue::I64(_) => T_I64,
            MetaValue::F32(_) => T_F32,
            MetaValue::F64(_) => T_F64,
            MetaValue::Bool(_) => T_BOOL,
            MetaValue::String(_) => T_STRING,
            MetaValue::Array(_) => T_ARRAY,
        }
    }
}

/// A ggml tensor element type. Only the types Baton's kernels handle have
/// their own variant; any other id is kept as `Unsupported(id)`.
#[allow(non_camel_case_types)] // ggml's names
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ4_NL,
    IQ4_XS,
    BF16,
    Unsupported(u32),
}

impl GgmlType {
    /// The type for a ggml type id.
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            20 => GgmlType::IQ4_NL,
            23 => GgmlType::IQ4_XS,
            30 => GgmlType::BF16,
            other => GgmlType::Unsupported(other),
        }
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::BF16 => 30,
            GgmlType::Unsupported(id) => id,
        }
    }

    /// ggml's name of the type (`"Q4_K"` for id 12), or `"unknown"`.
    pub fn name(self) -> &'static str {
        match self.id() {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            4 => "Q4_2",
            5 => "Q4_3",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => "unknown",
        }
    }

    /// Whether Baton can use tensors of this type.
    pub fn is_supported(self) -> bool {
        !matches!(self, GgmlType::Unsupported(_))
    }

    /// The kernels' format for this type (`None` for unsupported types).
    pub fn format(self) -> Option<WeightFormat> {
        Some(match self {
            GgmlType::F32 => WeightFormat::F32,
            GgmlType::F16 => WeightFormat::F16,
            GgmlType::BF16 => WeightFormat::BF16,
            GgmlType::Q4_0 => WeightFormat::Q4_0,
            GgmlType::Q4_1 => WeightFormat::Q4_1,
            GgmlType::Q5_0 => WeightFormat::Q5_0,
            GgmlType::Q5_1 => WeightFormat::Q5_1,
            GgmlType::Q8_0 => WeightFormat::Q8_0,
            GgmlType::Q2_K => WeightFormat::Q2_K,
            GgmlType::Q3_K => WeightFormat::Q3_K,
            GgmlType::Q4_K => WeightFormat::Q4_K,
            GgmlType::Q5_K => WeightFormat::Q5_K,
            GgmlType::Q6_K => WeightFormat::Q6_K,
            GgmlType::Q8_K => WeightFormat::Q8_K,
            GgmlType::IQ4_NL => WeightFormat::IQ4_NL,
            GgmlType::IQ4_XS => WeightFormat::IQ4_XS,
            GgmlType::Unsupported(_) => return None,
        })
    }

    /// Elements per block (`None` for unsupported types).
    pub fn block_len(self) -> Option<u64> {
        self.format().map(|f| f.block_len() as u64)
    }

    /// Bytes per block (`None` for unsupported types).
    pub fn block_bytes(self) -> Option<u64> {
        self.format().map(|f| f.block_bytes() as u64)
    }

    /// Bytes taken by `n_elements` elements, `None` if the type is
    /// unsupported, `n_elements` is not a whole number of blocks, or on overflow.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (len, bytes) = (self.block_len()?, self.block_bytes()?);
        // (`is_multiple_of` would need Rust 1.87; the workspace targets 1.85.)
        let partial = n_elements % len;
        if partial != 0 {
            return None;
        }
        (n_elements / len).checked_mul(bytes)
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset of the tensor's first byte in the file.
    pub offset: u64,
    /// Size of the tensor's data; `None` when the type is unsupported (its
    /// size is then unknown and its bounds were not checked).
    pub n_bytes: Option<u64>,
}

impl TensorInfo {
    /// Number of elements (product of `dims`; checked not to overflow at open).
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Elements per row (`dims[0]`, 1 for a scalar).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (`n_elements / row_len`).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }
}

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
        let parsed = parse(path, bytes)?;
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

    /// The raw metadata value for `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn need(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn wrong(&self, key: &str, expected: &'static str, found: String) -> GgufError {
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found,
        }
    }

    fn int_as<T: TryFrom<i128>>(
        &self,
        key: &str,
        v: &MetaValue,
        expected: &'static str,
    ) -> Result<T, GgufError> {
        match v.as_i128() {
            Some(i) => T::try_from(i).map_err(|_| {
                self.wrong(
                    key,
                    expected,
                    format!("{} {i} (out of range)", v.type_name()),
                )
            }),
            None => Err(self.wrong(key, expected, v.type_name().to_string())),
        }
    }

    /// An integer of any GGUF integer type whose value fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.int_as(key, self.need(key)?, "u32")
    }

    /// An integer of any GGUF integer type whose value fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.int_as(key, self.need(key)?, "u64")
    }

    /// An `f32` (an `f64` is narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match *self.need(key)? {
            MetaValue::F32(v) => Ok(v),
            MetaValue::F64(v) => Ok(v as f32),
            ref other => Err(self.wrong(key, "f32", other.type_name().to_string())),
        }
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.need(key)? {
            MetaValue::String(s) => Ok(s),
            other => Err(self.wrong(key, "string", other.type_name().to_string())),
        }
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match *self.need(key)? {
            MetaValue::Bool(b) => Ok(b),
            ref other => Err(self.wrong(key, "bool", other.type_name().to_string())),
        }
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&[MetaValue], GgufError> {
        match self.need(key)? {
            MetaValue::Array(a) => Ok(a),
            other => Err(self.wrong(key, "array", other.type_name().to_string())),
        }
    }

    /// An array of strings, borrowed.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                MetaValue::String(s) => Ok(s.as_str()),
                other => Err(self.wrong(
                    key,
                    "array of string",
                    format!("array of {}", other.type_name()),
                )),
            })
            .collect()
    }

    /// An array of integers of any GGUF integer type whose values fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| self.int_as(key, v, "array of i32"))
            .collect()
    }

    /// An array of `f32` (`f64` elements are narrowed).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| match *v {
                MetaValue::F32(x) => Ok(x),
                MetaValue::F64(x) => Ok(x as f32),
                ref other => Err(self.wrong(
                    key,
                    "array of f32",
                    format!("array of {}", other.type_name()),
                )),
            })
            .collect()
    }

    fn opt<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> Result<T, GgufError>,
    ) -> Option<T> {
        if !self.metadata.contains_key(key) {
            return None;
        }
        match get(self, key) {
            Ok(v) => Some(v),
            Err(e) => {
                // A present key of the wrong type is a broken file, not an absent
                // key; callers that must not fall back use the `get_*` form.
                tracing::warn!(path = %self.path.display(), key, error = %e, "ignoring GGUF metadata of the wrong type");
                None
            }
        }
    }

    /// Like [`Self::get_u32`], `None` when the key is absent (or, logged as a
    /// warning, of the wrong type; use `get_u32` to make that an error).
    pub fn opt_u32(&self, key: &str) -> Option<u32> {
        self.opt(key, Self::get_u32)
    }
    /// Like [`Self::get_u64`], `None` when the key is absent or of the wrong type.
    pub fn opt_u64(&self, key: &str) -> Option<u64> {
        self.opt(key, Self::get_u64)
    }
    /// Like [`Self::get_f32`], `None` when the key is absent or of the wrong type.
    pub fn opt_f32(&self, key: &str) -> Option<f32> {
        self.opt(key, Self::get_f32)
    }
    /// Like [`Self::get_str`], `None` when the key is absent or of the wrong type.
    pub fn opt_str(&self, key: &str) -> Option<&str> {
        self.opt(key, Self::get_str)
    }
    /// Like [`Self::get_bool`], `None` when the key is absent or of the wrong type.
    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        self.opt(key, Self::get_bool)
    }
    /// Like [`Self::get_str_array`], `None` when the key is absent or of the wrong type.
    pub fn opt_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.opt(key, Self::get_str_array)
    }
    /// Like [`Self::get_i32_array`], `None` when the key is absent or of the wrong type.
    pub fn opt_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.opt(key, Self::get_i32_array)
    }
    /// Like [`Self::get_f32_array`], `None` when the key is absent or of the wrong type.
    pub fn opt_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.opt(key, Self::get_f32_array)
    }
}

// ---------------------------------------------------------------------------
// Parsing

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

/// What is being read, rendered into an error message only on failure (the
/// hot path reads ~100k strings and must not format anything).
#[derive(Clone, Copy)]
enum What<'k> {
    Header(&'static str),
    Key(u64),
    Value(&'k str),
    TensorName(u64),
    Tensor(&'k str),
}

impl What<'_> {
    fn render(self) -> String {
        match self {
            What::Header(s) => s.to_string(),
            What::Key(i) => format!("metadata key #{i}"),
            What::Value(k) => format!("value of metadata key {k:?}"),
            What::TensorName(i) => format!("name of tensor #{i}"),
            What::Tensor(n) => format!("header of tensor {n:?}"),
        }
    }
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos.min(self.buf.len())) as u64
    }

    fn truncated(&self, what: What<'_>, needed: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            what: what.render(),
            offset: self.pos as u64,
            needed,
            len: self.buf.len() as u64,
        }
    }

    fn take(&mut self, n: u64, what: What<'_>) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(self.truncated(what, n));
        }
        // n <= left <= usize::MAX, so the casts and the add are exact.
        let start = self.pos;
        let end = start + n as usize;
        self.pos = end;
        Ok(&self.buf[start..end])
    }

    fn arr<const N: usize>(&mut self, what: What<'_>) -> Result<[u8; N], GgufError> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: What<'_>) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: What<'_>) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: What<'_>) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let b = self.take(n, what)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::BadUtf8 {
                path: self.path.to_path_buf(),
                what: what.render(),
            }),
        }
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<MetaValue, GgufError> {
        let w = What::Value(key);
        Ok(match type_id {
            T_U8 => MetaValue::U8(u8::from_le_bytes(self.arr(w)?)),
            T_I8 => MetaValue::I8(i8::from_le_bytes(self.arr(w)?)),
            T_U16 => MetaValue::U16(u16::from_le_bytes(self.arr(w)?)),
            T_I16 => MetaValue::I16(i16::from_le_bytes(self.arr(w)?)),
            T_U32 => MetaValue::U32(u32::from_le_bytes(self.arr(w)?)),
            T_I32 => MetaValue::I32(i32::from_le_bytes(self.arr(w)?)),
            T_U64 => MetaValue::U64(u64::from_le_bytes(self.arr(w)?)),
            T_I64 => MetaValue::I64(i64::from_le_bytes(self.arr(w)?)),
            T_F32 => MetaValue::F32(f32::from_le_bytes(self.arr(w)?)),
            T_F64 => MetaValue::F64(f64::from_le_bytes(self.arr(w)?)),
            T_BOOL => MetaValue::Bool(self.arr::<1>(w)?[0] != 0),
            T_STRING => MetaValue::String(self.string(w)?),
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep {
                        path: self.path.to_path_buf(),
                        key: key.to_string(),
                    });
                }
                let elem = self.u32(w)?;
                let count = self.u64(w)?;
                let min = min_value_size(elem).ok_or_else(|| GgufError::BadValueType {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    type_id: elem,
                })?;
                // Cap the count by what the rest of the file could hold before
                // allocating for it.
                let needed = count.saturating_mul(min);
                if needed > self.left() {
                    return Err(self.truncated(w, needed));
                }
                let mut out = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    out.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array(out)
            }
            other => {
                return Err(GgufError::BadValueType {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    type_id: other,
                })
            }
        })
    }
}

/// Smallest encoding of a value of type `t`; `None` for an unknown type.
fn min_value_size(t: u32) -> Option<u64> {
    Some(match t {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

/// Smallest tensor-table entry: name length, n_dims, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 4 + 8;
/// Smallest metadata entry: key length, type, a one-byte value.
const MIN_KV: u64 = 8 + 4 + 1;

fn parse(path: &Path, buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { path, buf, pos: 0 };
    let magic: [u8; 4] = c.arr(What::Header("magic"))?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    let version = c.u32(What::Header("version"))?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors = c.u64(What::Header("tensor count"))?;
    let n_kv = c.u64(What::Header("metadata count"))?;
    let needed = n_kv
        .saturating_mul(MIN_KV)
        .saturating_add(n_tensors.saturating_mul(MIN_TENSOR_INFO));
    if needed > c.left() {
        return Err(c.truncated(What::Header("metadata and tensor tables"), needed));
    }

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(What::Key(i))?;
        let type_id = c.u32(What::Value(&key))?;
        let value = c.value(type_id, &key, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                path: path.to_path_buf(),
                key,
            });
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i128() {
            Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => a as u64,
            Some(a) => {
                return Err(GgufError::BadAlignment {
                    path: path.to_path_buf(),
                    alignment: a.clamp(0, u64::MAX as i128) as u64,
                })
            }
            None => {
                return Err(GgufError::WrongType {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    expected: "u32",
                    found: v.type_name().into(),
                })
            }
        },
    };

    // Raw entries first: the data section starts after the whole table.
    let mut raw: Vec<(String, Vec<u64>, GgmlType, u64)> = Vec::with_capacity(n_tensors as usize);
    let mut by_name = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(What::TensorName(i))?;
        let w = What::Tensor(&name);
        let n_dims = c.u32(w)?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                path: path.to_path_buf(),
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(w)?);
        }
        let ggml_type = GgmlType::from_id(c.u32(w)?);
        let offset = c.u64(w)?;
        if by_name.insert(name.clone(), raw.len()).is_some() {
            return Err(GgufError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: name,
            });
        }
        raw.push((name, dims, ggml_type, offset));
    }

    let file_len = buf.len() as u64;
    let header_end = c.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ggml_type, rel) in raw {
        let err_path = || path.to_path_buf();
        if rel % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                path: err_path(),
                tensor: name,
                offset: rel,
                alignment,
            });
        }
        let Some(n_elements) = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)) else {
            return Err(GgufError::ShapeOverflow {
                path: err_path(),
                tensor: name,
                dims,
            });
        };
        let Some(offset) = data_offset.checked_add(rel) else {
            return Err(GgufError::TensorOutOfBounds {
                path: err_path(),
                tensor: name,
                offset: u64::MAX,
                n_bytes: 0,
                file_len,
            });
        };
        let n_bytes = match (ggml_type.block_len(), ggml_type.block_bytes()) {
            (Some(block_len), Some(_)) => {
                let row_len = dims.first().copied().unwrap_or(1);
                if row_len % block_len != 0 {
                    return Err(GgufError::RowNotBlockAligned {
                        path: err_path(),
                        tensor: name,
                        type_name: ggml_type.name(),
                        row_len,
                        block_len,
                    });
                }
                match ggml_type.bytes_for(n_elements) {
                    Some(n) => Some(n),
                    None => {
                        return Err(GgufError::ShapeOverflow {
                            path: err_path(),
                            tensor: name,
                            dims,
                        })
                    }
                }
            }
            _ => None,
        };
        let end = offset.checked_add(n_bytes.unwrap_or(0));
        if end.is_none_or(|e| e > file_len) {
            return Err(GgufError::TensorOutOfBounds {
                path: err_path(),
                tensor: name,
                offset,
                n_bytes: n_bytes.unwrap_or(0),
                file_len,
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
        });
    }

    Ok(Parsed {
        version,
        metadata,
        tensors,
        by_name,
        alignment,
        data_offset,
    })
}

// ---------------------------------------------------------------------------
// Writer

/// A minimal GGUF writer for tests and fixtures (tiny models, corrupt files).
///
/// It writes exactly what it is given: tensor bytes are not checked against
/// the shape, so tests can build broken files on purpose.
pub mod writer {
    use std::io::{self, Write};
    use std::path::Path;

    use super::{GgmlType, MetaValue, DEFAULT_ALIGNMENT, GGUF_MAGIC, T_U8};

    /// A tensor to write: its data are written as given.
    #[derive(Debug, Clone)]
    pub struct TensorSpec {
        pub name: String,
        /// ggml order (`dims[0]` is the row length).
        pub dims: Vec<u64>,
        pub ggml_type: GgmlType,
        pub data: Vec<u8>,
    }

    impl TensorSpec {
        /// A tensor with the given name, shape, type and raw bytes.
        pub fn new(
            name: impl Into<String>,
            dims: &[u64],
            ggml_type: GgmlType,
            data: Vec<u8>,
        ) -> Self {
            TensorSpec {
                name: name.into(),
                dims: dims.to_vec(),
                ggml_type,
                data,
            }
        }

        /// An F32 tensor from values.
        pub fn f32(name: impl Into<String>, dims: &[u64], values: &[f32]) -> Self {
            let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            Self::new(name, dims, GgmlType::F32, data)
        }
    }

    /// Writes a GGUF v3 file at `path` (alignment: `general.alignment` if it is
    /// in `metadata`, else 32).
    pub fn write_gguf<K: AsRef<str>>(
        path: &Path,
        metadata: &[(K, MetaValue)],
        tensors: &[TensorSpec],
    ) -> io::Result<()> {
        let bytes = to_bytes(3, metadata, tensors)?;
        std::fs::write(path, bytes)
    }

    /// The bytes of a GGUF file with the given header version.
    pub fn to_bytes<K: AsRef<str>>(
        version: u32,
        metadata: &[(K, MetaValue)],
        tensors: &[TensorSpec],
    ) -> io::Result<Vec<u8>> {
        let alignment = metadata
            .iter()
            .find(|(k, _)| k.as_ref() == "general.alignment")
            .and_then(|(_, v)| v.as_i128())
            .and_then(|a| u64::try_from(a).ok())
            .filter(|a| *a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT);
        let mut out = Vec::new();
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&version.to_le_bytes())?;
        out.write_all(&(tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(metadata.len() as u64).to_le_bytes())?;
        for (k, v) in metadata {
            write_str(&mut out, k.as_ref());
            out.write_all(&v.type_id().to_le_bytes())?;
            write_value(&mut out, v)?;
        }
        let mut rel = 0u64;
        let mut offsets = Vec::with_capacity(tensors.len());
        for t in tensors {
            offsets.push(rel);
            rel = (rel + t.data.len() as u64).div_ceil(alignment) * alignment;
        }
        for (t, off) in tensors.iter().zip(&offsets) {
            write_str(&mut out, &t.name);
            out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.write_all(&d.to_le_bytes())?;
            }
            out.write_all(&t.ggml_type.id().to_le_bytes())?;
            out.write_all(&off.to_le_bytes())?;
        }
        let data_start = (out.len() as u64).div_ceil(alignment) * alignment;
        out.resize(data_start as usize, 0);
        for (t, off) in tensors.iter().zip(&offsets) {
            out.resize((data_start + off) as usize, 0);
            out.write_all(&t.data)?;
        }
        if !tensors.is_empty() {
            out.resize((data_start + rel) as usize, 0);
        }
        Ok(out)
    }

    fn write_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn write_value(out: &mut Vec<u8>, v: &MetaValue) -> io::Result<()> {
        match v {
            MetaValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::Bool(x) => out.push(u8::from(*x)),
            MetaValue::String(s) => write_str(out, s),
            MetaValue::Array(items) => {
                // An empty array has no element to take the type from; u8 it is.
                let elem = items.first().map_or(T_U8, MetaValue::type_id);
                if items.iter().any(|i| i.type_id() != elem) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "GGUF arrays must have one element type",
                    ));
                }
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for i in items {
                    write_value(out, i)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{to_bytes, TensorSpec};
    use super::*;

    fn parse_bytes(b: &[u8]) -> Result<Parsed, GgufError> {
        parse(Path::new("mem.gguf"), b)
    }

    #[test]
    fn header_only_file_parses() {
        let b = to_bytes::<&str>(3, &[], &[]).unwrap();
        let p = parse_bytes(&b).unwrap();
        assert_eq!(p.version, 3);
        assert!(p.metadata.is_empty() && p.tensors.is_empty());
    }

    #[test]
    fn version_2_is_accepted_and_1_is_not() {
        let b = to_bytes(2, &[("a", MetaValue::U8(1))], &[]).unwrap();
        assert_eq!(parse_bytes(&b).unwrap().version, 2);
        let b = to_bytes::<&str>(1, &[], &[]).unwrap();
        assert!(matches!(
            parse_bytes(&b),
            Err(GgufError::UnsupportedVersion { version: 1, .. })
        ));
    }

    #[test]
    fn huge_array_count_is_rejected_before_allocating() {
        let mut b = to_bytes(3, &[("a", MetaValue::Array(vec![MetaValue::U64(1)]))], &[]).unwrap();
        // The count follows key len (8) + key (1) + type (4) + elem type (4) after the 24-byte header.
        let at = 24 + 8 + 1 + 4 + 4;
        b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_bytes(&b).err().unwrap();
        assert_eq!(e.kind(), "truncated", "{e}");
    }

    #[test]
    fn deep_arrays_are_rejected() {
        let mut v = MetaValue::U8(1);
        for _ in 0..(MAX_ARRAY_DEPTH + 1) {
            v = MetaValue::Array(vec![v]);
        }
        let b = to_bytes(3, &[("deep", v)], &[]).unwrap();
        assert_eq!(parse_bytes(&b).err().unwrap().kind(), "array_too_deep");
    }

    #[test]
    fn unsupported_tensor_type_opens_and_is_named_on_use() {
        let t = TensorSpec::new(
            "blk.0.ffn_up.weight",
            &[256, 2],
            GgmlType::Unsupported(16),
            vec![0; 132],
        );
        let b = to_bytes::<&str>(3, &[], &[t]).unwrap();
        let p = parse_bytes(&b).unwrap();
        assert_eq!(p.tensors[0].n_bytes, None);
        assert_eq!(p.tensors[0].ggml_type.name(), "IQ2_XXS");
    }

    #[test]
    fn row_not_block_aligned_is_an_error() {
        let t = TensorSpec::new("w", &[33, 1], GgmlType::Q8_0, vec![0; 68]);
        let b = to_bytes::<&str>(3, &[], &[t]).unwrap();
        assert_eq!(
            parse_bytes(&b).err().unwrap().kind(),
            "row_not_block_aligned"
        );
    }

    #[test]
    fn bad_alignment_is_an_error() {
        let b = to_bytes(3, &[("general.alignment", MetaValue::U32(3))], &[]).unwrap();
        assert_eq!(parse_bytes(&b).err().unwrap().kind(), "bad_alignment");
    }

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_1.bytes_for(32), Some(20));
        assert_eq!(GgmlType::Q8_0.bytes_for(32), Some(34));
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
        assert_eq!(GgmlType::BF16.bytes_for(3), Some(6));
        assert_eq!(GgmlType::F32.bytes_for(3), Some(12));
        assert_eq!(GgmlType::Q8_0.bytes_for(31), None);
        // ggml-common.h's block sizes (static_asserts there).
        for (t, bytes) in [
            (GgmlType::Q5_0, 22),
            (GgmlType::Q5_1, 24),
            (GgmlType::IQ4_NL, 18),
        ] {
            assert_eq!(t.bytes_for(64), Some(2 * bytes), "{t:?}");
        }
        for (t, bytes) in [
            (GgmlType::Q2_K, 84),
            (GgmlType::Q3_K, 110),
            (GgmlType::Q4_K, 144),
            (GgmlType::Q5_K, 176),
            (GgmlType::Q6_K, 210),
            (GgmlType::Q8_K, 292),
            (GgmlType::IQ4_XS, 136),
        ] {
            assert_eq!(t.bytes_for(512), Some(2 * bytes), "{t:?}");
            assert_eq!(t.bytes_for(576), None, "{t:?}");
        }
        for id in [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 20, 23, 30] {
            let t = GgmlType::from_id(id);
            assert_eq!(t.id(), id);
            assert!(t.is_supported());
            assert_eq!(t.format().unwrap().name(), t.name());
        }
        assert!(!GgmlType::from_id(16).is_supported(), "IQ2_XXS has no decoder");
    }
}
