//! The model shape the capacity planner needs, from the seed's defaults, an HF
//! `config.json`, or a GGUF header; explicit flags override whatever a file says.
//!
//! Only what sizes KV memory and compute matters: layers, KV heads, head dimension, and
//! the parameter count (exact from GGUF tensor shapes, else computed from the Llama-family
//! shapes: embeddings, attention, gated MLP, norms, and an output head unless tied).

use std::path::Path;

use baton_text::gguf::GgufFile;
use serde::{Deserialize, Serialize};

use crate::error::BenchError;

/// What the arithmetic needs to know about a model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelShape {
    /// Where the shape came from (for the report).
    pub source: String,
    pub layers: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub params: f64,
    /// How `params` was obtained: `given`, `gguf tensors` or `computed from shapes`.
    pub params_source: String,
}

impl ModelShape {
    /// The seed's model: Llama 3.1 70B (80 layers, 8 KV heads, head dimension 128, 70.6 B).
    pub fn seed() -> Self {
        Self {
            source: "Llama 3.1 70B (seed defaults)".into(),
            layers: 80,
            kv_heads: 8,
            head_dim: 128,
            params: 70.6e9,
            params_source: "given".into(),
        }
    }

    /// Read an HF `config.json`.
    pub fn from_hf_config(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let c: HfConfig = serde_json::from_str(&text).map_err(|source| BenchError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let name = path.display().to_string();
        let missing = |field| BenchError::MissingField {
            source_name: name.clone(),
            field,
        };
        let layers = c
            .num_hidden_layers
            .ok_or_else(|| missing("num_hidden_layers"))?;
        let heads = c.num_attention_heads;
        let kv_heads = c
            .num_key_value_heads
            .or(heads)
            .ok_or_else(|| missing("num_key_value_heads"))?;
        let head_dim = match (c.head_dim, c.hidden_size, heads) {
            (Some(d), _, _) => d,
            (None, Some(h), Some(n)) if n > 0 => h / n,
            _ => return Err(missing("head_dim (or hidden_size and num_attention_heads)")),
        };
        let shapes = Shapes {
            layers,
            hidden: c.hidden_size,
            heads,
            kv_heads,
            head_dim,
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
            tied: c.tie_word_embeddings.unwrap_or(false),
        };
        let (params, params_source) = match shapes.params() {
            Some(p) => (p as f64, "computed from shapes".to_string()),
            None => (0.0, "unknown".to_string()),
        };
        Ok(Self {
            source: format!("HF config {name}"),
            layers,
            kv_heads,
            head_dim,
            params,
            params_source,
        })
    }

    /// Read a GGUF header (`{arch}.block_count`, `.attention.head_count_kv`,
    /// `.embedding_length`, `.attention.head_count`, `.feed_forward_length`,
    /// `.vocab_size` or the tokenizer's token array).
    pub fn from_gguf(path: &Path) -> Result<Self, BenchError> {
        // Header, scalars and shapes only: arrays (the vocabulary) are skipped, tensor
        // data is never read.
        let h = GgufFile::open_header(path)?;
        let arch = h.opt_str("general.architecture").unwrap_or("llama");
        let arch_u64 = |suffix: &str| h.opt_u64(&format!("{arch}.{suffix}"));
        let name = path.display().to_string();
        let missing = |field| BenchError::MissingField {
            source_name: name.clone(),
            field,
        };
        let layers = arch_u64("block_count").ok_or_else(|| missing("block_count"))?;
        let heads = arch_u64("attention.head_count");
        let kv_heads = arch_u64("attention.head_count_kv")
            .or(heads)
            .ok_or_else(|| missing("attention.head_count_kv"))?;
        let hidden = arch_u64("embedding_length");
        let head_dim = match (arch_u64("attention.key_length"), hidden, heads) {
            (Some(d), _, _) => d,
            (None, Some(e), Some(n)) if n > 0 => e / n,
            _ => return Err(missing("embedding_length and attention.head_count")),
        };
        let vocab = arch_u64("vocab_size").or_else(|| h.opt_array_len("tokenizer.ggml.tokens"));
        // Shapes were checked not to overflow when the file was opened.
        let tensor_params = h
            .tensors
            .iter()
            .fold(0u64, |acc, t| acc.saturating_add(t.n_elements()));
        let (params, params_source) = if tensor_params > 0 {
            (tensor_params as f64, "gguf tensors".to_string())
        } else {
            let shapes = Shapes {
                layers,
                hidden,
                heads,
                kv_heads,
                head_dim,
                ffn: arch_u64("feed_forward_length"),
                vocab,
                tied: h.tensor("output.weight").is_none(),
            };
            match shapes.params() {
                Some(p) => (p as f64, "computed from shapes".to_string()),
                None => (0.0, "unknown".to_string()),
            }
        };
        let model_name = h
            .opt_str("general.name")
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        Ok(Self {
            source: format!("GGUF {name}{model_name}"),
            layers,
            kv_heads,
            head_dim,
            params,
            params_source,
        })
    }
}

#[derive(Debug, Deserialize)]
struct HfConfig {
    num_hidden_layers: Option<u64>,
    num_attention_heads: Option<u64>,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    hidden_size: Option<u64>,
    intermediate_size: Option<u64>,
    vocab_size: Option<u64>,
    tie_word_embeddings: Option<bool>,
}

/// Llama-family shapes, enough to count parameters.
#[derive(Debug, Clone, Copy)]
pub struct Shapes {
    pub layers: u64,
    pub hidden: Option<u64>,
    pub heads: Option<u64>,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: Option<u64>,
    pub vocab: Option<u64>,
    pub tied: bool,
}

impl Shapes {
    /// Embeddings + per layer (q, k, v, o, gate/up/down, two norms) + final norm + head.
    pub fn params(&self) -> Option<u64> {
        let hidden = self.hidden?;
        let heads = self.heads?;
        let ffn = self.ffn?;
        let vocab = self.vocab?;
        let q = hidden * heads * self.head_dim;
        let kv = 2 * hidden * self.kv_heads * self.head_dim;
        let o = heads * self.head_dim * hidden;
        let mlp = 3 * hidden * ffn;
        let per_layer = q + kv + o + mlp + 2 * hidden;
        let embed = vocab * hidden;
        let head = if self.tied { 0 } else { vocab * hidden };
        Some(embed + self.layers * per_layer + hidden + head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::fixture;

    const LLAMA_70B_CONFIG: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": false,
        "rope_theta": 500000.0, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn hf_config_of_llama_70b_gives_the_seed_shape() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, LLAMA_70B_CONFIG).unwrap();
        let m = ModelShape::from_hf_config(&p).unwrap();
        assert_eq!((m.layers, m.kv_heads, m.head_dim), (80, 8, 128));
        // Llama 3.1 70B has 70.55 B parameters; the seed rounds to 70.6 B.
        assert_eq!(m.params, 70_553_706_496.0);
        assert_eq!(m.params_source, "computed from shapes");
    }

    #[test]
    fn hf_config_with_explicit_head_dim_and_missing_fields() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 96, "hidden_size": 512}"#,
        )
        .unwrap();
        let m = ModelShape::from_hf_config(&p).unwrap();
        // No num_key_value_heads: multi-head attention, KV heads = heads.
        assert_eq!((m.layers, m.kv_heads, m.head_dim), (4, 8, 96));
        assert_eq!(m.params_source, "unknown");

        std::fs::write(&p, r#"{"num_attention_heads": 8}"#).unwrap();
        let e = ModelShape::from_hf_config(&p).unwrap_err();
        assert_eq!(e.label(), "missing_field");
        std::fs::write(&p, "not json").unwrap();
        assert_eq!(ModelShape::from_hf_config(&p).unwrap_err().label(), "json");
    }

    #[test]
    fn gguf_fixture_gives_shape_and_exact_params() {
        let dir = tempfile::tempdir().unwrap();
        let p = fixture::write(dir.path(), "tiny.gguf", &fixture::tiny_llama());
        let m = ModelShape::from_gguf(&p).unwrap();
        assert_eq!((m.layers, m.kv_heads, m.head_dim), (2, 2, 16));
        assert_eq!(m.params, fixture::TINY_PARAMS as f64);
        assert_eq!(m.params_source, "gguf tensors");
        assert!(m.source.contains("(tiny)"));
        // The shape formula agrees with the tensor count for the same tiny model.
        let s = Shapes {
            layers: 2,
            hidden: Some(64),
            heads: Some(4),
            kv_heads: 2,
            head_dim: 16,
            ffn: Some(128),
            vocab: Some(3),
            tied: true,
        };
        assert_eq!(s.params(), Some(fixture::TINY_PARAMS));
    }

    #[test]
    fn gguf_without_tensors_falls_back_to_shapes() {
        use baton_text::gguf::MetaValue::U32;
        let dir = tempfile::tempdir().unwrap();
        let bytes = baton_text::gguf::writer::to_bytes(
            3,
            &[
                ("llama.block_count", U32(2)),
                ("llama.embedding_length", U32(64)),
                ("llama.feed_forward_length", U32(128)),
                ("llama.attention.head_count", U32(4)),
                ("llama.attention.head_count_kv", U32(2)),
                ("llama.vocab_size", U32(3)),
            ],
            &[],
        )
        .unwrap();
        let p = fixture::write(dir.path(), "shapes.gguf", &bytes);
        let m = ModelShape::from_gguf(&p).unwrap();
        // No tensors listed, so no output.weight: treated as tied.
        assert_eq!(m.params, fixture::TINY_PARAMS as f64);
        assert_eq!(m.params_source, "computed from shapes");
    }

    /// The real small model, when a developer has it locally (never downloaded by tests).
    #[test]
    #[ignore = "needs /root/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
    fn real_smollm_gguf() {
        let p = Path::new("/root/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let m = ModelShape::from_gguf(p).unwrap();
        assert_eq!((m.layers, m.kv_heads, m.head_dim), (30, 3, 64));
        assert!((1.3e8..1.4e8).contains(&m.params), "{}", m.params);
    }
}
