//! Metadata values as stored in a GGUF file, and the typed getters over them.
//!
//! Integer getters accept any GGUF integer type whose value fits the asked type (files
//! disagree on u32 vs u64 for the same key); a present key of the wrong type is an
//! error naming the key, never a silent default.

use super::{GgufError, GgufFile};

// GGUF metadata value type ids.
pub(crate) const T_U8: u32 = 0;
pub(crate) const T_I8: u32 = 1;
pub(crate) const T_U16: u32 = 2;
pub(crate) const T_I16: u32 = 3;
pub(crate) const T_U32: u32 = 4;
pub(crate) const T_I32: u32 = 5;
pub(crate) const T_F32: u32 = 6;
pub(crate) const T_BOOL: u32 = 7;
pub(crate) const T_STRING: u32 = 8;
pub(crate) const T_ARRAY: u32 = 9;
pub(crate) const T_U64: u32 = 10;
pub(crate) const T_I64: u32 = 11;
pub(crate) const T_F64: u32 = 12;

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
    /// An array read by [`GgufFile::open_header`]: its element type id and length
    /// only, its elements skipped rather than decoded (a 150k-entry vocabulary costs
    /// no allocation).
    ArrayLen {
        elem_type: u32,
        len: u64,
    },
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
            MetaValue::Array(_) | MetaValue::ArrayLen { .. } => "array",
        }
    }

    /// The number of elements, if the value is an array (decoded or not).
    pub fn array_len(&self) -> Option<u64> {
        match self {
            MetaValue::Array(a) => Some(a.len() as u64),
            MetaValue::ArrayLen { len, .. } => Some(*len),
            _ => None,
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

    pub(crate) fn type_id(&self) -> u32 {
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
            MetaValue::Array(_) | MetaValue::ArrayLen { .. } => T_ARRAY,
        }
    }
}

/// Typed access to the metadata.
impl GgufFile {
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
            MetaValue::ArrayLen { .. } => Err(self.wrong(
                key,
                "array",
                "array whose elements were not read (file opened header-only)".to_string(),
            )),
            other => Err(self.wrong(key, "array", other.type_name().to_string())),
        }
    }

    /// The length of an array, also when its elements were not read.
    pub fn get_array_len(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.need(key)?;
        v.array_len()
            .ok_or_else(|| self.wrong(key, "array", v.type_name().to_string()))
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
    /// Like [`Self::get_array_len`], `None` when the key is absent or of the wrong type.
    pub fn opt_array_len(&self, key: &str) -> Option<u64> {
        self.opt(key, Self::get_array_len)
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
