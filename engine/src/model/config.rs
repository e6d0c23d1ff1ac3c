//! The shape of a decoder model, read from GGUF metadata (in `load.rs`) or
//! from a Hugging Face `config.json` (here): its family's layer recipe plus
//! its sizes, per-layer windows and rope.

use super::arch::{self, Family, LayerSpec, RopeSpec};
use serde::Deserialize;

/// Why a model's shape cannot be served: the message names the field or key and the
/// value that is wrong (it becomes `ModelError::Config`, which adds the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct ConfigError {
    pub reason: String,
}

impl From<String> for ConfigError {
    fn from(reason: String) -> Self {
        ConfigError { reason }
    }
}

impl From<&str> for ConfigError {
    fn from(reason: &str) -> Self {
        ConfigError { reason: reason.to_string() }
    }
}

/// Hyper-parameters of a decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// Window and rope of each layer (`n_layers` of them).
    pub layers: Vec<LayerSpec>,
    /// Per-pair rotary frequency factors (Llama 3 rope scaling), `head_dim / 2`.
    pub rope_factors: Option<Vec<f32>>,
    /// Multiplies attention scores (`1 / sqrt(head_dim)` unless the family says otherwise).
    pub attn_scale: f32,
    /// Final logits become `cap * tanh(logit / cap)`.
    pub logit_softcap: Option<f32>,
}

impl ModelConfig {
    /// Checks the relations the forward pass relies on; returns what is wrong.
    pub fn check(&self) -> Result<(), ConfigError> {
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
            return Err(format!("{what} is zero").into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!("{} attention heads are not a multiple of {} kv heads", self.n_heads, self.n_kv_heads).into());
        }
        if !self.head_dim.is_multiple_of(8) {
            return Err(format!("head dim {} is not a multiple of 8", self.head_dim).into());
        }
        if self.layers.len() != self.n_layers {
            return Err(format!("{} layer descriptions for {} layers", self.layers.len(), self.n_layers).into());
        }
        if let Some(f) = &self.rope_factors {
            if f.len() != self.head_dim / 2 || f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(format!("rope frequency factors: {} positive values expected, found {}", self.head_dim / 2, f.len()).into());
            }
        }
        let bad = |v: f32| !(v.is_finite() && v > 0.0);
        if self.layers.iter().any(|l| bad(l.rope.base) || bad(l.rope.freq_scale)) || bad(self.attn_scale) || self.logit_softcap.is_some_and(bad) {
            return Err("rope base, rope scale, attention scale and logit soft-cap must be positive".into());
        }
        if !self.hidden.is_multiple_of(32) || !self.ffn.is_multiple_of(32) {
            return Err(format!("hidden {} and ffn {} must be multiples of 32", self.hidden, self.ffn).into());
        }
        Ok(())
    }

    /// Parameters, counting the embedding once (tied or not).
    pub fn parameters(&self) -> usize {
        let (q, kv) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        let f = &self.family;
        let norms = if f.post_norms { 4 } else { 2 } * self.hidden + if f.qk_norm { 2 * self.head_dim } else { 0 };
        let bias = if f.qkv_bias { q + 2 * kv } else { 0 };
        let per_layer = 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.ffn + norms + bias;
        self.n_layers * per_layer + self.vocab * self.hidden + self.hidden
    }

    /// The sliding window of each layer (`None`: global).
    pub fn windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|l| l.window).collect()
    }
}

/// The fields of a Hugging Face `config.json` that Baton reads.
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
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub sliding_window: Option<usize>,
    pub sliding_window_pattern: Option<usize>,
    pub rope_local_base_freq: Option<f32>,
    pub query_pre_attn_scalar: Option<f32>,
    pub final_logit_softcapping: Option<f32>,
    pub rope_scaling: Option<HfRopeScaling>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<serde_json::Value>,
}

/// `rope_scaling` of a `config.json`: `linear` (factor) or `llama3`.
#[derive(Debug, Deserialize)]
pub struct HfRopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: f32,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<usize>,
}

fn default_model_type() -> String {
    "llama".into()
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_ctx() -> usize {
    2048
}

impl ModelConfig {
    /// The configuration a `config.json` describes; errors name what is not
    /// supported.
    pub fn from_hf(c: &HfConfig) -> Result<Self, ConfigError> {
        let family = *arch::by_hf_model_type(&c.model_type)?;
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
        let (mut freq_scale, mut rope_factors) = (1.0, None);
        match &c.rope_scaling {
            None => {}
            Some(r) if r.rope_type == "linear" => freq_scale = 1.0 / r.factor,
            Some(r) if r.rope_type == "llama3" => rope_factors = Some(llama3_rope_factors(r, c.rope_theta, head_dim)?),
            Some(r) => return Err(format!("rope scaling {:?} is not supported (linear and llama3 are)", r.rope_type).into()),
        }
        let global = RopeSpec { base: c.rope_theta, freq_scale };
        let layers = arch::layer_specs(&family, c.num_hidden_layers, c.sliding_window, c.sliding_window_pattern, c.rope_local_base_freq, global)?;
        Ok(ModelConfig {
            family,
            n_layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
            rms_eps: c.rms_norm_eps,
            context_length: c.max_position_embeddings,
            layers,
            rope_factors,
            attn_scale: 1.0 / c.query_pre_attn_scalar.unwrap_or(head_dim as f32).sqrt(),
            logit_softcap: c.final_logit_softcapping,
        })
    }
}

/// Llama 3's per-pair frequency factors, as llama.cpp's converter writes
/// them into `rope_freqs.weight`: short wavelengths unchanged, long ones
/// slowed by `factor`, a smooth blend between.
pub fn llama3_rope_factors(r: &HfRopeScaling, base: f32, head_dim: usize) -> Result<Vec<f32>, ConfigError> {
    let (Some(low), Some(high), Some(old)) = (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) else {
        return Err("llama3 rope scaling needs low_freq_factor, high_freq_factor and original_max_position_embeddings".into());
    };
    if high <= low {
        return Err(format!("llama3 rope scaling: high_freq_factor {high} must exceed low_freq_factor {low}").into());
    }
    let (old, base) = (old as f64, base as f64);
    let (low_wavelen, high_wavelen) = (old / low as f64, old / high as f64);
    Ok((0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                r.factor
            } else {
                let smooth = (old / wavelen - low as f64) / (high as f64 - low as f64);
                (1.0 / ((1.0 - smooth) / r.factor as f64 + smooth)) as f32
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(json: &str) -> Result<ModelConfig, ConfigError> {
        ModelConfig::from_hf(&serde_json::from_str::<HfConfig>(json).unwrap())
    }

    const BASE: &str = r#""hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4, "num_hidden_layers": 12,
        "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 1000"#;

    #[test]
    fn gemma3_config_json() {
        let c = hf(&format!(
            r#"{{{BASE}, "model_type": "gemma3_text", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": 512, "query_pre_attn_scalar": 256}}"#
        ))
        .unwrap();
        c.check().unwrap();
        assert_eq!(c.family.name, "gemma3");
        assert_eq!(c.windows().iter().filter(|w| w.is_none()).count(), 2);
        assert_eq!(c.layers[0].rope.base, 10000.0);
        assert_eq!(c.layers[5].rope.base, 1e6);
        assert_eq!(c.attn_scale, 1.0 / 16.0);
    }

    #[test]
    fn llama3_rope_scaling_matches_llama_cpp_converter() {
        let json = format!(
            r#"{{{BASE}, "head_dim": 64, "rope_theta": 500000.0,
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        );
        let c = hf(&json.replace(r#""head_dim": 256, "#, "")).unwrap();
        let f = c.rope_factors.as_ref().unwrap();
        assert_eq!(f.len(), 32);
        // Fast pairs keep their frequency, the slowest are slowed by the full factor, in between it grows.
        assert_eq!(f[0], 1.0);
        assert_eq!(f[31], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
        assert!(f.iter().any(|&v| v > 1.0 && v < 8.0));
        c.check().unwrap();
    }

    #[test]
    fn unknown_model_type_and_rope_scaling_are_named() {
        assert!(hf(&format!(r#"{{{BASE}, "model_type": "falcon"}}"#)).unwrap_err().reason.contains("\"falcon\""));
        let e = hf(&format!(r#"{{{BASE}, "rope_scaling": {{"type": "yarn", "factor": 4.0}}}}"#)).unwrap_err();
        assert!(e.reason.contains("yarn"), "{e}");
        let lin = hf(&format!(r#"{{{BASE}, "rope_scaling": {{"type": "linear", "factor": 4.0}}}}"#)).unwrap();
        assert!(lin.layers.iter().all(|l| l.rope.freq_scale == 0.25));
    }
}
