//! A small reader for the GGUF header: magic `GGUF`, version (2 or 3), tensor count (u64),
//! metadata count (u64), the metadata key/value pairs, then the tensor infos.
//!
//! It reads only what the capacity planner needs: scalar metadata values (arrays are
//! skipped, keeping only their element type and length, so a 100k-entry vocabulary costs
//! nothing) and each tensor's shape, whose products sum to the exact parameter count. It
//! never reads tensor data. Lengths are checked against sane limits so a corrupt file
//! gives an error, not an allocation of exabytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use crate::error::BenchError;

const MAX_STRING: u64 = 1 << 24;
const MAX_ITEMS: u64 = 1 << 32;
const MAX_DIMS: u32 = 8;

/// One metadata value. Arrays keep only their shape.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { elem_type: u32, len: u64 },
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::Uint(v) => Some(v),
            MetaValue::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    /// Each tensor's name and dimensions.
    pub tensors: Vec<(String, Vec<u64>)>,
}

impl GgufHeader {
    /// Read the header of the GGUF file at `path`.
    pub fn read(path: &Path) -> Result<Self, BenchError> {
        let file = File::open(path).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut r = Reader {
            inner: BufReader::new(file),
            path: path.to_path_buf(),
            key: String::new(),
        };
        r.header()
    }

    /// `general.architecture`, defaulting to `llama`.
    pub fn architecture(&self) -> &str {
        self.metadata
            .get("general.architecture")
            .and_then(MetaValue::as_str)
            .unwrap_or("llama")
    }

    /// An integer value for `{architecture}.{suffix}`.
    pub fn arch_u64(&self, suffix: &str) -> Option<u64> {
        let key = format!("{}.{}", self.architecture(), suffix);
        self.metadata.get(&key).and_then(MetaValue::as_u64)
    }

    /// The sum over tensors of the product of their dimensions.
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, dims)| dims.iter().product::<u64>())
            .sum()
    }
}

struct Reader {
    inner: BufReader<File>,
    path: PathBuf,
    key: String,
}

impl Reader {
    fn malformed(&self, what: &'static str) -> BenchError {
        BenchError::GgufMalformed {
            path: self.path.clone(),
            key: self.key.clone(),
            what,
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], BenchError> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.malformed("file ends inside the header")
            } else {
                BenchError::Io {
                    path: self.path.clone(),
                    source: e,
                }
            }
        })?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, BenchError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, BenchError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn skip(&mut self, n: u64) -> Result<(), BenchError> {
        let n = i64::try_from(n).map_err(|_| self.malformed("length overflows"))?;
        self.inner
            .seek_relative(n)
            .map_err(|source| BenchError::Io {
                path: self.path.clone(),
                source,
            })
    }

    fn string(&mut self) -> Result<String, BenchError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.malformed("string longer than 16 MiB"));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| self.malformed("file ends inside a string"))?;
        String::from_utf8(buf).map_err(|_| self.malformed("string is not UTF-8"))
    }

    fn scalar_size(t: u32) -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    fn value(&mut self, t: u32) -> Result<MetaValue, BenchError> {
        Ok(match t {
            0 => MetaValue::Uint(u8::from_le_bytes(self.bytes()?) as u64),
            1 => MetaValue::Int(i8::from_le_bytes(self.bytes()?) as i64),
            2 => MetaValue::Uint(u16::from_le_bytes(self.bytes()?) as u64),
            3 => MetaValue::Int(i16::from_le_bytes(self.bytes()?) as i64),
            4 => MetaValue::Uint(self.u32()? as u64),
            5 => MetaValue::Int(i32::from_le_bytes(self.bytes()?) as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.bytes()?) as f64),
            7 => MetaValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let elem_type = self.u32()?;
                let len = self.u64()?;
                if len > MAX_ITEMS {
                    return Err(self.malformed("array longer than 2^32 items"));
                }
                if let Some(size) = Self::scalar_size(elem_type) {
                    self.skip(size * len)?;
                } else if elem_type == 8 {
                    for _ in 0..len {
                        let n = self.u64()?;
                        if n > MAX_STRING {
                            return Err(self.malformed("string longer than 16 MiB"));
                        }
                        self.skip(n)?;
                    }
                } else {
                    // Nested arrays do not occur in the metadata this reader needs.
                    return Err(self.malformed("unsupported array element type"));
                }
                MetaValue::Array { elem_type, len }
            }
            10 => MetaValue::Uint(self.u64()?),
            11 => MetaValue::Int(i64::from_le_bytes(self.bytes()?)),
            12 => MetaValue::Float(f64::from_le_bytes(self.bytes()?)),
            _ => return Err(self.malformed("unknown value type")),
        })
    }

    fn header(&mut self) -> Result<GgufHeader, BenchError> {
        let magic = self.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(BenchError::GgufMagic {
                path: self.path.clone(),
                magic,
            });
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(BenchError::GgufVersion {
                path: self.path.clone(),
                version,
            });
        }
        let tensor_count = self.u64()?;
        let kv_count = self.u64()?;
        if kv_count > MAX_ITEMS || tensor_count > MAX_ITEMS {
            return Err(self.malformed("implausible tensor or metadata count"));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            self.key = self.string()?;
            let t = self.u32()?;
            let v = self.value(t)?;
            metadata.insert(std::mem::take(&mut self.key), v);
        }
        let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16) as usize);
        for _ in 0..tensor_count {
            self.key = self.string()?;
            let n_dims = self.u32()?;
            if n_dims > MAX_DIMS {
                return Err(self.malformed("tensor has more than 8 dimensions"));
            }
            let dims = (0..n_dims)
                .map(|_| self.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let _ggml_type = self.u32()?;
            let _offset = self.u64()?;
            tensors.push((std::mem::take(&mut self.key), dims));
        }
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
        })
    }
}

/// Writers for GGUF fixtures, used by this crate's tests (no downloads in tests).
#[cfg(test)]
pub(crate) mod fixture {
    use std::io::Write;

    pub enum V<'a> {
        U32(u32),
        Str(&'a str),
        F32(f32),
        StrArray(&'a [&'a str]),
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A GGUF v3 file with the given metadata and tensor shapes (no tensor data).
    pub fn gguf_bytes(kvs: &[(&str, V)], tensors: &[(&str, &[u64])]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            string(&mut out, k);
            match v {
                V::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                V::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                V::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                V::StrArray(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    for s in *items {
                        string(&mut out, s);
                    }
                }
            }
        }
        for (name, dims) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(0u32.to_le_bytes()); // F32
            out.extend(0u64.to_le_bytes());
        }
        out
    }

    pub fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    /// A tiny llama-shaped model: 2 layers, hidden 64, 4 heads, 2 KV heads, ffn 128,
    /// vocabulary of 3 given as a token array (no `vocab_size` key), tied embeddings.
    pub fn tiny_llama() -> Vec<u8> {
        let layer = |i: usize| -> Vec<(String, Vec<u64>)> {
            vec![
                (format!("blk.{i}.attn_q.weight"), vec![64, 64]),
                (format!("blk.{i}.attn_k.weight"), vec![64, 32]),
                (format!("blk.{i}.attn_v.weight"), vec![64, 32]),
                (format!("blk.{i}.attn_output.weight"), vec![64, 64]),
                (format!("blk.{i}.ffn_gate.weight"), vec![64, 128]),
                (format!("blk.{i}.ffn_up.weight"), vec![64, 128]),
                (format!("blk.{i}.ffn_down.weight"), vec![128, 64]),
                (format!("blk.{i}.attn_norm.weight"), vec![64]),
                (format!("blk.{i}.ffn_norm.weight"), vec![64]),
            ]
        };
        let mut ts: Vec<(String, Vec<u64>)> = vec![("token_embd.weight".into(), vec![64, 3])];
        ts.extend(layer(0));
        ts.extend(layer(1));
        ts.push(("output_norm.weight".into(), vec![64]));
        let tensors: Vec<(&str, &[u64])> =
            ts.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
        gguf_bytes(
            &[
                ("general.architecture", V::Str("llama")),
                ("general.name", V::Str("tiny")),
                ("llama.block_count", V::U32(2)),
                ("llama.embedding_length", V::U32(64)),
                ("llama.feed_forward_length", V::U32(128)),
                ("llama.attention.head_count", V::U32(4)),
                ("llama.attention.head_count_kv", V::U32(2)),
                ("llama.rope.freq_base", V::F32(10000.0)),
                ("tokenizer.ggml.tokens", V::StrArray(&["a", "b", "c"])),
            ],
            &tensors,
        )
    }

    /// Parameters of [`tiny_llama`], counted by hand.
    pub const TINY_PARAMS: u64 =
        64 * 3 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64;
}

#[cfg(test)]
mod tests {
    use super::fixture::*;
    use super::*;

    #[test]
    fn reads_metadata_and_tensor_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "tiny.gguf", &tiny_llama());
        let h = GgufHeader::read(&p).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.architecture(), "llama");
        assert_eq!(h.arch_u64("block_count"), Some(2));
        assert_eq!(h.arch_u64("attention.head_count_kv"), Some(2));
        assert_eq!(h.arch_u64("vocab_size"), None);
        assert_eq!(
            h.metadata.get("tokenizer.ggml.tokens"),
            Some(&MetaValue::Array {
                elem_type: 8,
                len: 3
            })
        );
        assert_eq!(
            h.metadata.get("llama.rope.freq_base"),
            Some(&MetaValue::Float(10000.0))
        );
        assert_eq!(h.tensors.len(), 1 + 2 * 9 + 1);
        assert_eq!(h.parameter_count(), TINY_PARAMS);
    }

    #[test]
    fn rejects_bad_magic_version_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "bad.gguf", b"GGML\x03\0\0\0");
        assert_eq!(GgufHeader::read(&p).unwrap_err().kind(), "gguf_magic");

        let mut v1 = tiny_llama();
        v1[4] = 1;
        let p = write(dir.path(), "v1.gguf", &v1);
        assert_eq!(GgufHeader::read(&p).unwrap_err().kind(), "gguf_version");

        let full = tiny_llama();
        let p = write(dir.path(), "trunc.gguf", &full[..full.len() / 2]);
        assert_eq!(GgufHeader::read(&p).unwrap_err().kind(), "gguf_malformed");

        let mut huge = tiny_llama();
        // The first key's length field: claim an absurd string length.
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let p = write(dir.path(), "huge.gguf", &huge);
        assert_eq!(GgufHeader::read(&p).unwrap_err().kind(), "gguf_malformed");

        let missing = dir.path().join("nope.gguf");
        assert_eq!(GgufHeader::read(&missing).unwrap_err().kind(), "io");
    }
}
