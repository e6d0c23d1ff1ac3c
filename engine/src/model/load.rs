//! Loading weights from GGUF files and Hugging Face folders (config.json,
//! safetensors, tokenizer.json), and exporting a GGUF model to such a folder.
//!
//! Every failure names the file, the tensor when there is one, and what is
//! wrong; nothing here panics on a bad file.
//!
//! Rotary embeddings run in GGML's "normal" (interleaved pairs) convention.
//! Hugging Face checkpoints, and GGUF files of "neox" families (Qwen, Gemma),
//! use the "rotate half" convention, so their query and key rows (and the
//! query/key norms and biases) are permuted at load time, as llama.cpp's
//! converter does for Llama, and permuted back on export.

use super::arch::{self, RopeSpec, RopeStyle};
use super::config::ConfigError;
use super::{weight_format, Layer, Model, ModelConfig};
use crate::model::HfConfig;
use baton_kernels::{Backend, KernelError, OptionalOp, RopeTable, WeightFormat};
use baton_text::chat_template::{ChatTemplate, TemplateError};
use baton_text::gguf::{GgmlType, GgufError, GgufFile};
use baton_text::tokenizer::{Tokenizer, TokenizerError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Errors loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tensor {tensor}: {reason}")]
    Tensor { path: PathBuf, tensor: String, reason: String },
    #[error("{path}: missing tensor {tensor}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: ConfigError },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: tokenizer: {source}")]
    Tokenizer { path: PathBuf, source: TokenizerError },
    #[error("{path}: chat template: {source}")]
    Template { path: PathBuf, source: TemplateError },
}

impl ModelError {
    /// A stable, fine-grained label of the variant (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            ModelError::Gguf(e) => e.label(),
            ModelError::Tensor { .. } => "model_tensor",
            ModelError::MissingTensor { .. } => "model_missing_tensor",
            ModelError::Config { .. } => "model_config",
            ModelError::Io { .. } => "model_io",
            ModelError::Tokenizer { .. } => "model_tokenizer",
            ModelError::Template { .. } => "model_template",
        }
    }
}

/// A model with the tokenizer and chat template that came with it.
pub struct LoadedModel<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub source: PathBuf,
}

fn kernel_err(path: &Path, tensor: &str, e: KernelError) -> ModelError {
    ModelError::Tensor { path: path.to_path_buf(), tensor: tensor.to_string(), reason: e.to_string() }
}

/// Loads a GGUF file of any family in [`arch::FAMILIES`], with its
/// tokenizer and chat template. Matrices may be in any type of
/// [`WeightFormat::ALL`]: the legacy and K formats run as integer products on
/// the CPU; IQ4_XS and Q8_K are expanded to f32 at load (the CUDA backend
/// expands every format to bf16). Any other type is an error naming the
/// tensor and the type.
pub fn load_gguf<B: Backend>(backend: &B, path: &Path) -> Result<LoadedModel<B>, ModelError> {
    let f = GgufFile::open(path)?;
    let model = load_gguf_weights(backend, &f)?;
    let tokenizer = Tokenizer::from_gguf(&f).map_err(|source| ModelError::Tokenizer { path: path.into(), source })?;
    let template = ChatTemplate::from_gguf(&f).map_err(|source| ModelError::Template { path: path.into(), source })?;
    Ok(LoadedModel { model, tokenizer, template, source: path.to_path_buf() })
}

/// The configuration a GGUF file's metadata (and `rope_freqs.weight`) describes.
/// Most layers a GGUF's `block_count` may declare (see [`config_from_gguf`]).
pub const MAX_LAYERS: usize = 4096;

pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
    let path = f.path.as_path();
    let cfg_err = |reason: ConfigError| ModelError::Config { path: path.into(), reason };
    let name = f.get_str("general.architecture")?.to_string();
    let family = *arch::by_gguf_name(&name).map_err(cfg_err)?;
    let key = |k: &str| format!("{name}.{k}");
    let g = |k: &str| f.get_u32(&key(k)).map(|v| v as usize);
    let opt = |k: &str| f.opt_u32(&key(k)).map(|v| v as usize);
    let hidden = g("embedding_length")?;
    let n_heads = g("attention.head_count")?;
    let vocab = match opt("vocab_size") {
        Some(v) => v,
        None => {
            let embd = f.tensor("token_embd.weight").ok_or_else(|| ModelError::MissingTensor { path: path.into(), tensor: "token_embd.weight".into() })?;
            embd.dims.get(1).copied().unwrap_or(0) as usize
        }
    };
    // Gemma and Qwen3 name the head size; Llama files imply it.
    let head_dim = opt("attention.key_length").or(opt("rope.dimension_count")).unwrap_or(hidden / n_heads.max(1));
    if let Some(v) = opt("attention.value_length").filter(|&v| v != head_dim) {
        return Err(cfg_err(format!("value head size {v} differs from key head size {head_dim}").into()));
    }
    if let Some(r) = opt("rope.dimension_count").filter(|&r| r != head_dim) {
        return Err(cfg_err(format!("rotary dimension {r} differs from head size {head_dim} (partial rotary is not supported)").into()));
    }
    let freq_scale = match f.opt_str(&key("rope.scaling.type")) {
        None | Some("none") => 1.0,
        Some("linear") => 1.0 / f.get_f32(&key("rope.scaling.factor"))?,
        Some(other) => return Err(cfg_err(format!("rope scaling {other:?} is not supported (linear is)").into())),
    };
    let rope_factors = match f.tensor("rope_freqs.weight") {
        None => None,
        Some(t) if t.ggml_type == GgmlType::F32 && t.dims == [head_dim as u64 / 2] => {
            let data = f.tensor_data_checked(t)?;
            Some(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        }
        Some(t) => return Err(ModelError::Tensor { path: path.into(), tensor: t.name.clone(), reason: format!("{:?} {:?}, expected F32 [{}]", t.ggml_type, t.dims, head_dim / 2) }),
    };
    if f.get(&key("attention.sliding_window_pattern")).is_some() && opt("attention.sliding_window_pattern").is_none() {
        return Err(cfg_err("a per-layer sliding_window_pattern array is not supported (a period is)".into()));
    }
    let global = RopeSpec { base: f.opt_f32(&key("rope.freq_base")).unwrap_or(10000.0), freq_scale };
    let n_layers = g("block_count")?;
    // The per-layer table below is allocated from this count: a nonsense one (u32::MAX) must be
    // refused first, not cost a hundred gigabytes. The deepest released decoders have ~130 layers.
    if n_layers > MAX_LAYERS {
        return Err(cfg_err(format!("block_count {n_layers} is more than {MAX_LAYERS} layers").into()));
    }
    let window = opt("attention.sliding_window");
    let layers = arch::layer_specs(&family, n_layers, window, opt("attention.sliding_window_pattern"), f.opt_f32(&key("rope.freq_base_swa")), global).map_err(cfg_err)?;
    // Gemma 3 27B scales by hidden / heads, every other size by the head
    // size (query_pre_attn_scalar, which GGUF does not carry; llama.cpp's rule).
    let scale_dim = if family.name == "gemma3" && n_layers == 62 { hidden / n_heads.max(1) } else { head_dim };
    let config = ModelConfig {
        family,
        n_layers,
        hidden,
        n_heads,
        n_kv_heads: opt("attention.head_count_kv").unwrap_or(n_heads),
        head_dim,
        ffn: g("feed_forward_length")?,
        vocab,
        rms_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        context_length: g("context_length")?,
        layers,
        rope_factors,
        attn_scale: 1.0 / (scale_dim as f32).sqrt(),
        logit_softcap: f.opt_f32(&key("final_logit_softcapping")).filter(|&c| c != 0.0),
    };
    config.check().map_err(cfg_err)?;
    Ok(config)
}

/// The weights of a GGUF file on `backend`, without its tokenizer (for
/// callers that feed token IDs).
pub fn load_gguf_weights<B: Backend>(backend: &B, f: &GgufFile) -> Result<Model<B>, ModelError> {
    let path = f.path.as_path();
    let config = config_from_gguf(f)?;
    check_backend(backend, &config).map_err(|reason| ModelError::Config { path: path.into(), reason })?;
    let neox = config.family.rope_style == RopeStyle::Neox;
    let matrix_p = |name: &str, k: usize, n: usize, permute_heads: Option<usize>| -> Result<B::Matrix, ModelError> {
        let t = f.tensor(name).ok_or_else(|| ModelError::MissingTensor { path: path.into(), tensor: name.into() })?;
        let dims: Vec<u64> = t.dims.clone();
        if dims != [k as u64, n as u64] {
            return Err(ModelError::Tensor { path: path.into(), tensor: name.into(), reason: format!("shape {dims:?}, expected [{k}, {n}]") });
        }
        let format = weight_format(t.ggml_type).ok_or_else(|| unsupported_type(path, name, t.ggml_type))?;
        let data = f.tensor_data(t);
        match permute_heads.filter(|_| neox) {
            // Whole quantized rows move, so any format permutes.
            Some(h) => backend.matrix(format, n, k, &permute_rows(data, n, h, true)),
            None => backend.matrix(format, n, k, data),
        }
        .map_err(|e| kernel_err(path, name, e))
    };
    let matrix = |name: &str, k: usize, n: usize| matrix_p(name, k, n, None);
    let vector_p = |name: &str, n: usize, permute_heads: Option<usize>| -> Result<B::Tensor, ModelError> {
        let t = f.tensor(name).ok_or_else(|| ModelError::MissingTensor { path: path.into(), tensor: name.into() })?;
        if t.dims != [n as u64] {
            return Err(ModelError::Tensor { path: path.into(), tensor: name.into(), reason: format!("shape {:?}, expected [{n}]", t.dims) });
        }
        let format = weight_format(t.ggml_type).filter(|f| f.block_len() == 1).ok_or_else(|| ModelError::Tensor {
            path: path.into(),
            tensor: name.into(),
            reason: format!("norm and bias weights must be F32, F16 or BF16, found {:?}", t.ggml_type),
        })?;
        let mut v = vec![0f32; n];
        baton_kernels::quant::dequantize_row(format, f.tensor_data(t), &mut v);
        if let Some(h) = permute_heads.filter(|_| neox) {
            v = permute_f32(&v, h);
        }
        Ok(backend.upload(&v))
    };
    let vector = |name: &str, n: usize| vector_p(name, n, None);
    let c = &config;
    let fam = &c.family;
    let (qw, kvw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        let b = |s: &str| format!("blk.{i}.{s}.bias");
        layers.push(Layer {
            attn_norm: vector(&p("attn_norm"), c.hidden)?,
            wq: matrix_p(&p("attn_q"), c.hidden, qw, Some(c.n_heads))?,
            wk: matrix_p(&p("attn_k"), c.hidden, kvw, Some(c.n_kv_heads))?,
            wv: matrix(&p("attn_v"), c.hidden, kvw)?,
            qkv_bias: if fam.qkv_bias {
                Some([vector_p(&b("attn_q"), qw, Some(c.n_heads))?, vector_p(&b("attn_k"), kvw, Some(c.n_kv_heads))?, vector(&b("attn_v"), kvw)?])
            } else {
                None
            },
            qk_norm: if fam.qk_norm { Some([vector_p(&p("attn_q_norm"), c.head_dim, Some(1))?, vector_p(&p("attn_k_norm"), c.head_dim, Some(1))?]) } else { None },
            wo: matrix(&p("attn_output"), qw, c.hidden)?,
            post_norms: if fam.post_norms { Some([vector(&p("post_attention_norm"), c.hidden)?, vector(&p("post_ffw_norm"), c.hidden)?]) } else { None },
            ffn_norm: vector(&p("ffn_norm"), c.hidden)?,
            w_gate: matrix(&p("ffn_gate"), c.hidden, c.ffn)?,
            w_up: matrix(&p("ffn_up"), c.hidden, c.ffn)?,
            w_down: matrix(&p("ffn_down"), c.ffn, c.hidden)?,
        });
    }
    let embed = matrix("token_embd.weight", c.hidden, c.vocab)?;
    let output = match f.tensor("output.weight") {
        Some(_) => Some(matrix("output.weight", c.hidden, c.vocab)?),
        None => None,
    };
    let out_norm = vector("output_norm.weight", c.hidden)?;
    Ok(assemble(backend, config, embed, output, out_norm, layers))
}

/// Refuses a model that needs an operation the backend lacks, naming both.
fn check_backend<B: Backend>(backend: &B, c: &ModelConfig) -> Result<(), ConfigError> {
    let f = &c.family;
    let needs = [
        (f.activation == arch::Activation::GeluTanhGlu, OptionalOp::GeluMul),
        (f.qkv_bias, OptionalOp::BiasAdd),
        (f.embed_scale, OptionalOp::Scale),
        (f.qk_norm, OptionalOp::HeadNorm),
        (c.layers.iter().any(|l| l.window.is_some()), OptionalOp::SlidingWindow),
    ];
    match needs.iter().find(|(need, op)| *need && !backend.supports(*op)) {
        Some((_, op)) => Err(format!("architecture {} needs {}, which backend {} does not implement", f.name, op.name(), backend.describe()).into()),
        None => Ok(()),
    }
}

/// [`permute_rows`] for a vector of `heads` heads of f32 values.
fn permute_f32(v: &[f32], heads: usize) -> Vec<f32> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    permute_rows(&bytes, v.len(), heads, true).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn assemble<B: Backend>(backend: &B, config: ModelConfig, embed: B::Matrix, output: Option<B::Matrix>, out_norm: B::Tensor, layers: Vec<Layer<B>>) -> Model<B> {
    let mut weight_bytes = backend.matrix_bytes(&embed) + output.as_ref().map_or(0, |m| backend.matrix_bytes(m));
    for l in &layers {
        for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
            weight_bytes += backend.matrix_bytes(m);
        }
    }
    // One table per distinct rope of the layers (Gemma 3: local and global).
    let mut specs: Vec<RopeSpec> = Vec::new();
    let layer_rope = config
        .layers
        .iter()
        .map(|l| match specs.iter().position(|s| *s == l.rope) {
            Some(i) => i,
            None => {
                specs.push(l.rope);
                specs.len() - 1
            }
        })
        .collect();
    let (hd, ctx, factors) = (config.head_dim, config.context_length, config.rope_factors.as_deref());
    let ropes = specs.iter().map(|s| backend.rope(RopeTable::scaled(hd, s.base, ctx, s.freq_scale, factors))).collect();
    Model { config, embed, output, out_norm, layers, ropes, layer_rope, weight_bytes }
}

/// An error naming the tensor, its type and the types Baton reads.
fn unsupported_type(path: &Path, tensor: &str, t: GgmlType) -> ModelError {
    let supported: Vec<&str> = WeightFormat::ALL.iter().map(|f| f.name()).collect();
    ModelError::Tensor {
        path: path.into(),
        tensor: tensor.into(),
        reason: format!("tensor type {} (ggml type {}) is not supported; Baton reads {}", t.name(), t.id(), supported.join(", ")),
    }
}

/// Reorders the rows of a query or key projection between the Hugging Face
/// ("rotate half") and GGML ("interleaved pairs") rotary conventions.
/// `to_ggml` picks the direction. Rows are opaque byte strings.
fn permute_rows(bytes: &[u8], rows: usize, heads: usize, to_ggml: bool) -> Vec<u8> {
    let row = bytes.len() / rows;
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let ggml = h * hd + 2 * i + j;
                let hf = h * hd + j * half + i;
                let (dst, src) = if to_ggml { (ggml, hf) } else { (hf, ggml) };
                out[dst * row..(dst + 1) * row].copy_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    out
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.into(), source })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config { path: path.into(), reason: e.to_string().into() })
}

/// Loads a Hugging Face model folder: `config.json`, `*.safetensors` (F32,
/// F16 or BF16), `tokenizer.json` and the chat template from
/// `tokenizer_config.json`.
pub fn load_hf_dir<B: Backend>(backend: &B, dir: &Path) -> Result<LoadedModel<B>, ModelError> {
    use safetensors::{tensor::Dtype, SafeTensors};
    let hf: HfConfig = read_json(&dir.join("config.json"))?;
    let cfg_err = |reason: ConfigError| ModelError::Config { path: dir.join("config.json"), reason };
    let config = ModelConfig::from_hf(&hf).map_err(cfg_err)?;
    config.check().map_err(cfg_err)?;
    if config.family.post_norms || config.family.embed_scale {
        // Gemma checkpoints name their norms differently and store them as
        // w - 1; only their GGUF conversion is read so far.
        return Err(cfg_err(format!("{} models load from GGUF files only", config.family.name).into()));
    }
    check_backend(backend, &config).map_err(cfg_err)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| ModelError::Io { path: dir.into(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Config { path: dir.into(), reason: "no .safetensors file".into() });
    }
    let mut maps = Vec::new();
    for p in &files {
        let file = std::fs::File::open(p).map_err(|source| ModelError::Io { path: p.clone(), source })?;
        // SAFETY: the file is opened read-only; Baton does not modify model
        // files while serving them.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io { path: p.clone(), source })?;
        maps.push((p.clone(), map));
    }
    let mut parsed = Vec::new();
    for (p, m) in &maps {
        let st = SafeTensors::deserialize(m).map_err(|e| ModelError::Config { path: p.clone(), reason: format!("safetensors: {e}").into() })?;
        parsed.push((p.clone(), st));
    }
    // A tensor: its file, dtype, shape and bytes.
    type Found<'a> = (PathBuf, Dtype, Vec<usize>, &'a [u8]);
    let find = |name: &str| -> Result<Found<'_>, ModelError> {
        for (p, st) in &parsed {
            if let Ok(v) = st.tensor(name) {
                return Ok((p.clone(), v.dtype(), v.shape().to_vec(), v.data()));
            }
        }
        Err(ModelError::MissingTensor { path: dir.into(), tensor: name.into() })
    };
    let format_of = |p: &Path, name: &str, d: Dtype| -> Result<WeightFormat, ModelError> {
        match d {
            Dtype::F32 => Ok(WeightFormat::F32),
            Dtype::F16 => Ok(WeightFormat::F16),
            Dtype::BF16 => Ok(WeightFormat::BF16),
            other => Err(ModelError::Tensor { path: p.into(), tensor: name.into(), reason: format!("dtype {other:?} is not supported (F32, F16, BF16 are)") }),
        }
    };
    let matrix = |name: &str, n: usize, k: usize, permute_heads: Option<usize>| -> Result<B::Matrix, ModelError> {
        let (p, dtype, shape, data) = find(name)?;
        if shape != [n, k] {
            return Err(ModelError::Tensor { path: p, tensor: name.into(), reason: format!("shape {shape:?}, expected [{n}, {k}]") });
        }
        let format = format_of(&p, name, dtype)?;
        let owned;
        let bytes = match permute_heads {
            Some(h) => {
                owned = permute_rows(data, n, h, true);
                &owned[..]
            }
            None => data,
        };
        backend.matrix(format, n, k, bytes).map_err(|e| kernel_err(&p, name, e))
    };
    let vector_p = |name: &str, n: usize, permute_heads: Option<usize>| -> Result<B::Tensor, ModelError> {
        let (p, dtype, shape, data) = find(name)?;
        if shape != [n] {
            return Err(ModelError::Tensor { path: p, tensor: name.into(), reason: format!("shape {shape:?}, expected [{n}]") });
        }
        let mut v = vec![0f32; n];
        baton_kernels::quant::dequantize_row(format_of(&p, name, dtype)?, data, &mut v);
        if let Some(h) = permute_heads {
            v = permute_f32(&v, h);
        }
        Ok(backend.upload(&v))
    };
    let vector = |name: &str, n: usize| vector_p(name, n, None);
    let c = &config;
    let kvw = c.n_kv_heads * c.head_dim;
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let b = |s: &str| format!("model.layers.{i}.{s}.bias");
        let qw = c.n_heads * c.head_dim;
        layers.push(Layer {
            attn_norm: vector(&p("input_layernorm"), c.hidden)?,
            wq: matrix(&p("self_attn.q_proj"), qw, c.hidden, Some(c.n_heads))?,
            wk: matrix(&p("self_attn.k_proj"), kvw, c.hidden, Some(c.n_kv_heads))?,
            wv: matrix(&p("self_attn.v_proj"), kvw, c.hidden, None)?,
            qkv_bias: if c.family.qkv_bias {
                Some([vector_p(&b("self_attn.q_proj"), qw, Some(c.n_heads))?, vector_p(&b("self_attn.k_proj"), kvw, Some(c.n_kv_heads))?, vector(&b("self_attn.v_proj"), kvw)?])
            } else {
                None
            },
            qk_norm: if c.family.qk_norm { Some([vector_p(&p("self_attn.q_norm"), c.head_dim, Some(1))?, vector_p(&p("self_attn.k_norm"), c.head_dim, Some(1))?]) } else { None },
            wo: matrix(&p("self_attn.o_proj"), c.hidden, qw, None)?,
            post_norms: None,
            ffn_norm: vector(&p("post_attention_layernorm"), c.hidden)?,
            w_gate: matrix(&p("mlp.gate_proj"), c.ffn, c.hidden, None)?,
            w_up: matrix(&p("mlp.up_proj"), c.ffn, c.hidden, None)?,
            w_down: matrix(&p("mlp.down_proj"), c.hidden, c.ffn, None)?,
        });
    }
    let embed = matrix("model.embed_tokens.weight", c.vocab, c.hidden, None)?;
    let output = if hf.tie_word_embeddings { None } else { Some(matrix("lm_head.weight", c.vocab, c.hidden, None)?) };
    let out_norm = vector("model.norm.weight", c.hidden)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_tokenizer_json(&tok_path).map_err(|source| ModelError::Tokenizer { path: tok_path.clone(), source })?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc: serde_json::Value = read_json(&tc_path)?;
    let template_src = tc.get("chat_template").and_then(|v| v.as_str()).ok_or_else(|| ModelError::Config { path: tc_path.clone(), reason: "no chat_template".into() })?;
    let tok_str = |k: &str| tc.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
    let template = ChatTemplate::from_str(template_src, &tok_str("bos_token"), &tok_str("eos_token")).map_err(|source| ModelError::Template { path: tc_path, source })?;
    let model = assemble(backend, config, embed, output, out_norm, layers);
    Ok(LoadedModel { model, tokenizer, template, source: dir.to_path_buf() })
}

/// Writes a GGUF model as a Hugging Face folder with F32 safetensors (the
/// dequantized values of the GGUF weights, so both load to the same model).
pub fn export_hf(gguf_path: &Path, out: &Path) -> Result<(), ModelError> {
    use safetensors::tensor::{Dtype, TensorView};
    let f = GgufFile::open(gguf_path)?;
    let arch = f.get_str("general.architecture")?;
    if arch != "llama" {
        return Err(ModelError::Config { path: gguf_path.into(), reason: format!("export writes Llama models only, not {arch:?}").into() });
    }
    let io = |path: &Path, source| ModelError::Io { path: path.into(), source };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let g = |k: &str| f.get_u32(&format!("llama.{k}")).map(|v| v as usize);
    let (hidden, n_heads) = (g("embedding_length")?, g("attention.head_count")?);
    let n_kv = f.opt_u32("llama.attention.head_count_kv").map(|v| v as usize).unwrap_or(n_heads);
    let n_layers = g("block_count")?;
    let vocab = f.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied()).unwrap_or(0) as usize;
    let tied = f.tensor("output.weight").is_none();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length")?,
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": f.get_f32("llama.attention.layer_norm_rms_epsilon")?,
        "rope_theta": f.opt_f32("llama.rope.freq_base").unwrap_or(10000.0),
        "vocab_size": vocab,
        "max_position_embeddings": g("context_length")?,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    });
    let write = |name: &str, text: String| std::fs::write(out.join(name), text).map_err(|e| io(&out.join(name), e));
    write("config.json", serde_json::to_string_pretty(&config).unwrap_or_default())?;
    let tokenizer = Tokenizer::from_gguf(&f).map_err(|source| ModelError::Tokenizer { path: gguf_path.into(), source })?;
    write("tokenizer.json", tokenizer.to_tokenizer_json().map_err(|source| ModelError::Tokenizer { path: gguf_path.into(), source })?)?;
    let tok_text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    let tc = serde_json::json!({
        "chat_template": f.get_str("tokenizer.chat_template")?,
        "bos_token": tok_text(f.opt_u32("tokenizer.ggml.bos_token_id")),
        "eos_token": tok_text(f.opt_u32("tokenizer.ggml.eos_token_id")),
    });
    write("tokenizer_config.json", serde_json::to_string_pretty(&tc).unwrap_or_default())?;

    let mut names: HashMap<String, String> = HashMap::new();
    names.insert("token_embd.weight".into(), "model.embed_tokens.weight".into());
    names.insert("output_norm.weight".into(), "model.norm.weight".into());
    names.insert("output.weight".into(), "lm_head.weight".into());
    for i in 0..n_layers {
        for (g, h) in [
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ] {
            names.insert(format!("blk.{i}.{g}.weight"), format!("model.layers.{i}.{h}.weight"));
        }
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in &f.tensors {
        let Some(hf_name) = names.get(&t.name) else { continue };
        let format = weight_format(t.ggml_type).ok_or_else(|| unsupported_type(gguf_path, &t.name, t.ggml_type))?;
        let k = t.dims[0] as usize;
        let n = t.dims.get(1).copied().unwrap_or(1) as usize;
        let data = f.tensor_data(t);
        let row_bytes = format.row_bytes(k).ok_or_else(|| ModelError::Tensor { path: gguf_path.into(), tensor: t.name.clone(), reason: "row not block aligned".into() })?;
        let mut vals = vec![0f32; n * k];
        for (r, o) in data.chunks_exact(row_bytes).zip(vals.chunks_exact_mut(k)) {
            baton_kernels::quant::dequantize_row(format, r, o);
        }
        let mut bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        if t.name.ends_with("attn_q.weight") {
            bytes = permute_rows(&bytes, n, n_heads, false);
        } else if t.name.ends_with("attn_k.weight") {
            bytes = permute_rows(&bytes, n, n_kv, false);
        }
        let shape = if t.dims.len() == 1 { vec![k] } else { vec![n, k] };
        tensors.push((hf_name.clone(), shape, bytes));
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| ModelError::Tensor { path: out.into(), tensor: name.clone(), reason: e.to_string() })
        })
        .collect::<Result<_, _>>()?;
    let st_path = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st_path).map_err(|e| ModelError::Config { path: st_path.clone(), reason: e.to_string().into() })?;
    Ok(())
}
