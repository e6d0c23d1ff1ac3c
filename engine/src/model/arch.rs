//! Decoder families as data: what differs between Llama, Mistral, Qwen2,
//! Qwen3 and Gemma 3 is written once per family in [`FAMILIES`]; the sizes
//! (and windows, rope bases) of one model come from its metadata
//! ([`super::ModelConfig`]). Adding a family is a row here plus tests.

use super::config::ConfigError;

/// How the rotary embedding pairs elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// GGML "normal": pairs `(2i, 2i + 1)`. llama.cpp's converter already
    /// permuted Llama-family query and key rows into this order.
    Interleaved,
    /// GGML "neox" (Hugging Face "rotate half"): pairs `(i, i + d/2)`. Query
    /// and key rows (and their norms and biases) are permuted at load into
    /// the interleaved order, so one rope kernel serves both.
    Neox,
}

/// The gated feed-forward's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (Llama, Mistral, Qwen).
    SiluGlu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanhGlu,
}

/// Which layers attend through a sliding window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sliding {
    /// Every layer is global.
    Never,
    /// Every layer uses the window, when the metadata names one (Mistral 7B v0.1).
    AllLayers,
    /// Layers `i` with `i % period < period - 1` are local (the last of each
    /// period is global), with their own rope base; `period` and the base
    /// may be overridden by metadata (Gemma 3: 6 and 10 000).
    Pattern { period: usize, local_rope_base: f32 },
}

/// What one family's decoder layer is made of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Family {
    /// `general.architecture` in GGUF files; also the metadata key prefix.
    pub name: &'static str,
    /// `model_type` in a Hugging Face `config.json`.
    pub hf_model_type: &'static str,
    pub rope_style: RopeStyle,
    /// RMSNorm after attention and after the feed-forward too, before each
    /// residual add (Gemma's "sandwich" norms).
    pub post_norms: bool,
    /// RMSNorm of each query and key head before the rotation.
    pub qk_norm: bool,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    pub activation: Activation,
    /// Embeddings multiplied by `sqrt(hidden)`.
    pub embed_scale: bool,
    pub sliding: Sliding,
}

const LLAMA: Family = Family {
    name: "llama",
    hf_model_type: "llama",
    rope_style: RopeStyle::Interleaved,
    post_norms: false,
    qk_norm: false,
    qkv_bias: false,
    activation: Activation::SiluGlu,
    embed_scale: false,
    sliding: Sliding::Never,
};

/// Every family Baton runs.
pub const FAMILIES: &[Family] = &[
    LLAMA,
    Family {
        name: "mistral",
        hf_model_type: "mistral",
        sliding: Sliding::AllLayers,
        ..LLAMA
    },
    Family {
        name: "qwen2",
        hf_model_type: "qwen2",
        rope_style: RopeStyle::Neox,
        qkv_bias: true,
        ..LLAMA
    },
    Family {
        name: "qwen3",
        hf_model_type: "qwen3",
        rope_style: RopeStyle::Neox,
        qk_norm: true,
        ..LLAMA
    },
    Family {
        name: "gemma3",
        hf_model_type: "gemma3_text",
        rope_style: RopeStyle::Neox,
        post_norms: true,
        qk_norm: true,
        qkv_bias: false,
        activation: Activation::GeluTanhGlu,
        embed_scale: true,
        sliding: Sliding::Pattern {
            period: 6,
            local_rope_base: 10_000.0,
        },
    },
];

/// The family named `name` in GGUF metadata.
pub fn by_gguf_name(name: &str) -> Result<&'static Family, ConfigError> {
    FAMILIES
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| unknown("architecture", name, |f| f.name))
}

/// The family of a Hugging Face `model_type`.
pub fn by_hf_model_type(name: &str) -> Result<&'static Family, ConfigError> {
    FAMILIES
        .iter()
        .find(|f| f.hf_model_type == name)
        .ok_or_else(|| unknown("model_type", name, |f| f.hf_model_type))
}

fn unknown(what: &str, name: &str, key: fn(&Family) -> &'static str) -> ConfigError {
    let known: Vec<&str> = FAMILIES.iter().map(key).collect();
    format!(
        "{what} {name:?} is not supported (Baton runs {})",
        known.join(", ")
    )
    .into()
}

/// Rotary angles of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSpec {
    pub base: f32,
    /// 1 / linear scaling factor (1.0: none).
    pub freq_scale: f32,
}

/// What differs between the layers of one model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    /// `Some(w)`: the layer attends to the last `w` positions only.
    pub window: Option<usize>,
    pub rope: RopeSpec,
}

/// The layers of a model of `family`: which are local (given the metadata's
/// window, and pattern period and local base if it names them) and their
/// rope. Errors when the metadata contradicts itself.
pub fn layer_specs(
    family: &Family,
    n_layers: usize,
    window: Option<usize>,
    period: Option<usize>,
    local_base: Option<f32>,
    global: RopeSpec,
) -> Result<Vec<LayerSpec>, ConfigError> {
    if window == Some(0) {
        return Err("sliding window of 0 tokens".into());
    }
    let global_layer = LayerSpec {
        window: None,
        rope: global,
    };
    Ok(match (family.sliding, window) {
        (Sliding::Never, _) | (_, None) => vec![global_layer; n_layers],
        (Sliding::AllLayers, Some(w)) => vec![
            LayerSpec {
                window: Some(w),
                rope: global
            };
            n_layers
        ],
        (
            Sliding::Pattern {
                period: p,
                local_rope_base,
            },
            Some(w),
        ) => {
            let p = period.unwrap_or(p);
            if p == 0 {
                return Err("sliding window pattern period of 0".into());
            }
            let local = LayerSpec {
                window: Some(w),
                rope: RopeSpec {
                    base: local_base.unwrap_or(local_rope_base),
                    freq_scale: 1.0,
                },
            };
            (0..n_layers)
                .map(|i| if i % p < p - 1 { local } else { global_layer })
                .collect()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: RopeSpec = RopeSpec {
        base: 1e6,
        freq_scale: 1.0,
    };

    #[test]
    fn gemma3_every_sixth_layer_is_global_with_its_own_base() {
        let f = by_gguf_name("gemma3").unwrap();
        let l = layer_specs(f, 18, Some(512), None, None, G).unwrap();
        let globals: Vec<usize> = (0..18).filter(|&i| l[i].window.is_none()).collect();
        assert_eq!(globals, [5, 11, 17]);
        assert_eq!(
            l[0],
            LayerSpec {
                window: Some(512),
                rope: RopeSpec {
                    base: 10_000.0,
                    freq_scale: 1.0
                }
            }
        );
        assert_eq!(l[5].rope, G);
        // Metadata overrides the period and the local base.
        let l = layer_specs(f, 4, Some(8), Some(2), Some(5.0), G).unwrap();
        assert_eq!(
            l.iter().map(|s| s.window).collect::<Vec<_>>(),
            [Some(8), None, Some(8), None]
        );
        assert_eq!(l[0].rope.base, 5.0);
        // Without a window every layer is global.
        assert!(layer_specs(f, 6, None, None, None, G)
            .unwrap()
            .iter()
            .all(|s| s.window.is_none() && s.rope == G));
    }

    #[test]
    fn mistral_windows_every_layer_and_llama_none() {
        let m = layer_specs(
            by_gguf_name("mistral").unwrap(),
            3,
            Some(4096),
            None,
            None,
            G,
        )
        .unwrap();
        assert!(m.iter().all(|s| s.window == Some(4096) && s.rope == G));
        let l = layer_specs(by_gguf_name("llama").unwrap(), 3, Some(4096), None, None, G).unwrap();
        assert!(l.iter().all(|s| s.window.is_none()));
    }

    #[test]
    fn bad_metadata_and_unknown_names_are_errors_naming_them() {
        let f = by_gguf_name("gemma3").unwrap();
        assert!(layer_specs(f, 6, Some(0), None, None, G)
            .unwrap_err()
            .to_string()
            .contains("window of 0"));
        assert!(layer_specs(f, 6, Some(8), Some(0), None, G)
            .unwrap_err()
            .to_string()
            .contains("period of 0"));
        let e = by_gguf_name("mamba").unwrap_err().to_string();
        assert!(
            e.contains("\"mamba\"") && e.contains("gemma3") && e.contains("qwen2"),
            "{e}"
        );
        assert_eq!(by_hf_model_type("qwen3").unwrap().name, "qwen3");
        assert!(by_hf_model_type("gpt2").unwrap_err().to_string().contains("\"gpt2\""));
    }

    #[test]
    fn families_differ_as_documented() {
        let f = |n| *by_gguf_name(n).unwrap();
        assert!(
            f("qwen2").qkv_bias && !f("qwen2").qk_norm && f("qwen2").rope_style == RopeStyle::Neox
        );
        assert!(f("qwen3").qk_norm && !f("qwen3").qkv_bias);
        let g = f("gemma3");
        assert!(
            g.post_norms && g.qk_norm && g.embed_scale && g.activation == Activation::GeluTanhGlu
        );
        assert_eq!(f("llama").rope_style, RopeStyle::Interleaved);
    }
}
