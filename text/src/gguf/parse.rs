//! The file layout: header, metadata table, tensor table, aligned data section.
//! Every length is checked against the bytes left before anything is allocated.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::metadata::*;
use super::{
    GgmlType, GgufError, MetaValue, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH,
    MAX_DIMS,
};

pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) metadata: BTreeMap<String, MetaValue>,
    pub(super) tensors: Vec<TensorInfo>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) alignment: u64,
    pub(super) data_offset: u64,
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

/// What the parser does with the elements of a metadata array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arrays {
    /// Decode them into [`MetaValue::Array`].
    Decode,
    /// Skip them, keeping [`MetaValue::ArrayLen`]: their lengths and nesting are still
    /// checked, string elements are not checked to be UTF-8.
    LengthOnly,
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
    arrays: Arrays,
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
                let (elem, count) = self.array_header(key, depth)?;
                if self.arrays == Arrays::LengthOnly {
                    self.skip_elements(elem, count, key, depth + 1)?;
                    return Ok(MetaValue::ArrayLen {
                        elem_type: elem,
                        len: count,
                    });
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

    /// Reads an array's element type and count, checking the nesting depth, the type
    /// and that the rest of the file could hold that many elements (before anything
    /// is allocated or skipped for them).
    fn array_header(&mut self, key: &str, depth: usize) -> Result<(u32, u64), GgufError> {
        let w = What::Value(key);
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
        let needed = count.saturating_mul(min);
        if needed > self.left() {
            return Err(self.truncated(w, needed));
        }
        Ok((elem, count))
    }

    /// Steps over `count` array elements of type `elem` at nesting `depth` without
    /// decoding them, with the same checks on lengths, types and depth as decoding.
    fn skip_elements(
        &mut self,
        elem: u32,
        count: u64,
        key: &str,
        depth: usize,
    ) -> Result<(), GgufError> {
        let w = What::Value(key);
        match elem {
            T_STRING => {
                for _ in 0..count {
                    let n = self.u64(w)?;
                    self.take(n, w)?;
                }
            }
            T_ARRAY => {
                for _ in 0..count {
                    let (inner, n) = self.array_header(key, depth)?;
                    self.skip_elements(inner, n, key, depth + 1)?;
                }
            }
            // Fixed-size scalars: their minimum size is their size.
            scalar => {
                let size = min_value_size(scalar).ok_or_else(|| GgufError::BadValueType {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    type_id: scalar,
                })?;
                self.take(count.saturating_mul(size), w)?;
            }
        }
        Ok(())
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

pub(super) fn parse(path: &Path, buf: &[u8], arrays: Arrays) -> Result<Parsed, GgufError> {
    let mut c = Cursor {
        path,
        buf,
        pos: 0,
        arrays,
    };
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
