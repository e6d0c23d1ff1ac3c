//! The shape of a Llama-family model, read from GGUF metadata or from a
//! Hugging Face `config.json`.

use serde::Deserialize;

/// Hyper-parameters of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Context length the model was trained for.
    pub context_length: usize,
}

impl ModelConfig {
    /// Checks the relations the forward pass relies on; returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let pos = [
            ("layers", self.n_layers),
            ("hidden size", self.hidden),
            ("attention heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("ffn size", self.ffn),
            ("vocab size", self.vocab),
            ("context length", self.context_length),
        ];
        if let Some((what, _)) = pos.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{what} is zero"));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return Err(format!("{} attention heads are not a multiple of {} kv heads", self.n_heads, self.n_kv_heads));
        }
        if self.head_dim % 8 != 0 || self.head_dim * self.n_heads != self.hidden {
            return Err(format!("head dim {} x {} heads does not match hidden size {}", self.head_dim, self.n_heads, self.hidden));
        }
        if self.hidden % 32 != 0 || self.ffn % 32 != 0 {
            return Err(format!("hidden {} and ffn {} must be multiples of 32", self.hidden, self.ffn));
        }
        Ok(())
    }

    /// Parameters, counting the embedding once (tied or not).
    pub fn parameters(&self) -> usize {
        let kv = self.n_kv_heads * self.head_dim;
        let per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn + 2 * self.hidden;
        self.n_layers * per_layer + self.vocab * self.hidden + self.hidden
    }
}

/// The fields of a Hugging Face Llama `config.json` that Baton reads.
#[derive(Debug, Deserialize)]
pub struct HfConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    pub vocab_size: usize,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_ctx() -> usize {
    2048
}

impl From<&HfConfig> for ModelConfig {
    fn from(c: &HfConfig) -> Self {
        ModelConfig {
            n_layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1)),
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
            rope_base: c.rope_theta,
            rms_eps: c.rms_norm_eps,
            context_length: c.max_position_embeddings,
        }
    }
}
