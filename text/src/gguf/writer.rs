//! A minimal GGUF writer for tests and fixtures (tiny models, corrupt files).
//!
//! It writes exactly what it is given: tensor bytes are not checked against
//! the shape, so tests can build broken files on purpose.
use std::io::{self, Write};
use std::path::Path;

use super::metadata::T_U8;
use super::{GgmlType, MetaValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};

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
    pub fn new(name: impl Into<String>, dims: &[u64], ggml_type: GgmlType, data: Vec<u8>) -> Self {
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

/// Tokenizer metadata of the smallest SentencePiece vocabulary: `<unk>`, `<s>` (BOS),
/// `</s>` (EOS) and the 256 byte tokens; no chat template, no `add_bos_token` (fixtures
/// of tests that need a tokenizer, not a model).
pub fn byte_spm_vocab() -> Vec<(&'static str, MetaValue)> {
    let specials = [("<unk>", 2), ("<s>", 3), ("</s>", 3)];
    let bytes = (0..256).map(|b| (format!("<0x{b:02X}>"), 6));
    let vocab: Vec<(String, i32)> = specials.iter().map(|&(t, k)| (t.to_string(), k)).chain(bytes).collect();
    vec![
        ("tokenizer.ggml.model", MetaValue::String("llama".into())),
        ("tokenizer.ggml.tokens", MetaValue::Array(vocab.iter().map(|(t, _)| MetaValue::String(t.clone())).collect())),
        ("tokenizer.ggml.token_type", MetaValue::Array(vocab.iter().map(|&(_, k)| MetaValue::I32(k)).collect())),
    ]
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
        MetaValue::ArrayLen { .. } => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an array read header-only has no elements to write",
            ))
        }
    }
    Ok(())
}
