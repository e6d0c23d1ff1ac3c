//! The forward pass of a shipped model (SmolLM2, Gemma 3) on another backend
//! against the CPU backend: the CUDA backend on a GPU (`cuda_engine.rs`) and the
//! CUDA kernels emulated on the CPU (`cuda_emulated_engine.rs`).

use std::path::Path;

use baton_engine::model::{load_gguf_weights, weight_format, Model};
use baton_kernels::{Backend, CpuBackend, KvDtype, QMatrix};
use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgmlType, GgufFile};
use baton_text::tokenizer::Tokenizer;

use super::{logits_at, pearson};

const TEXT: &str = "The sky is blue at noon because air scatters short wavelengths of sunlight more than long ones, \
and red at sunset because the light then crosses so much air that most of the blue is scattered away before it reaches us. ";

/// About `n` tokens of English for the model in `f`: its tokenizer, or for a
/// SentencePiece vocabulary (Gemma's, which the engine does not tokenize yet)
/// a greedy longest match over the pieces, as `gemma3.rs` does, with byte tokens
/// for a character no piece has (a vocabulary cut by `gguf_first_layers --vocab`):
/// not the exact segmentation, but valid tokens the model reads fine.
pub fn prompt_tokens(f: &GgufFile, n: usize) -> Vec<u32> {
    let text = TEXT.repeat(n / 40 + 1);
    let mut tokens = if f.opt_str("tokenizer.ggml.model") == Some("llama") {
        let vocab = f.get_str_array("tokenizer.ggml.tokens").unwrap();
        let bos = f.get_u32("tokenizer.ggml.bos_token_id").unwrap();
        let index: std::collections::HashMap<&str, u32> = vocab.iter().enumerate().map(|(i, t)| (*t, i as u32)).collect();
        let s = text.replace(' ', "▁");
        let mut out = vec![bos];
        let mut rest = s.as_str();
        while !rest.is_empty() && out.len() < n {
            let mut end = rest.len().min(32);
            while !rest.is_char_boundary(end) {
                end -= 1;
            }
            loop {
                if let Some(&id) = index.get(&rest[..end]) {
                    out.push(id);
                    rest = &rest[end..];
                    break;
                }
                match rest[..end].char_indices().last().map(|(i, _)| i).filter(|&i| i > 0) {
                    Some(shorter) => end = shorter,
                    // No piece for the character (a cut vocabulary): its bytes, as
                    // SentencePiece's byte fallback writes them.
                    None => {
                        for b in rest[..end].bytes() {
                            out.push(*index.get(format!("<0x{b:02X}>").as_str()).expect("no piece and no byte token for a character"));
                        }
                        rest = &rest[end..];
                        break;
                    }
                }
            }
        }
        out
    } else {
        Tokenizer::from_gguf(f).unwrap().encode(&text, true).unwrap()
    };
    tokens.truncate(n);
    tokens
}

/// How the other backend's logits compare with the CPU's.
pub struct Compared {
    /// The lowest Pearson correlation of a row.
    pub worst_pearson: f64,
    /// Rows whose largest logit is the same token.
    pub same_top: usize,
    pub rows: usize,
    /// max |other - cpu| / max |cpu| over all rows.
    pub rel_err: f32,
}

/// The model at `path` loaded on both backends, `n_tokens` of prompt in one
/// prefill step, logits of every `stride`-th row and the last one, KV in `dtype`.
pub fn compare<B: Backend>(other: &B, path: &Path, n_tokens: usize, stride: usize, dtype: KvDtype) -> Compared {
    let f = GgufFile::open(path).unwrap();
    let c = CpuBackend::new(2).unwrap();
    let on_cpu: Model<CpuBackend> = load_gguf_weights(&c, &f).expect("load on the CPU");
    let on_other: Model<B> = load_gguf_weights(other, &f).expect("load on the other backend");
    let tokens = prompt_tokens(&f, n_tokens);
    let mut rows: Vec<usize> = (0..tokens.len()).step_by(stride).collect();
    if rows.last() != Some(&(tokens.len() - 1)) {
        rows.push(tokens.len() - 1);
    }
    let want = logits_at(&c, &on_cpu, &tokens, &rows, dtype);
    let got = logits_at(other, &on_other, &tokens, &rows, dtype);
    let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best });
    let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    Compared {
        worst_pearson: want.iter().zip(&got).map(|(w, h)| pearson(w, h)).fold(1.0f64, f64::min),
        same_top: want.iter().zip(&got).filter(|(w, h)| argmax(w) == argmax(h)).count(),
        rows: rows.len(),
        rel_err: want.iter().flatten().zip(got.iter().flatten()).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale,
    }
}

/// A copy of the model at `path` in `dir` with its embedding table stored as bf16:
/// the values a GPU backend looks its rows up in (it expands every table to bf16),
/// so that a comparison of kernels is not a comparison of two embeddings.
pub fn with_bf16_embedding(path: &Path, dir: &Path) -> std::path::PathBuf {
    let f = GgufFile::open(path).unwrap();
    let metadata: Vec<_> = f.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut tensors = Vec::new();
    for t in &f.tensors {
        let data = f.tensor_data_checked(t).unwrap();
        tensors.push(if t.name == "token_embd.weight" {
            let (k, n) = (t.dims[0] as usize, t.dims[1] as usize);
            let q = QMatrix::from_ggml(weight_format(t.ggml_type).unwrap(), n, k, data).unwrap();
            let mut row = vec![0f32; k];
            let mut bytes = Vec::with_capacity(n * k * 2);
            for r in 0..n {
                q.row_f32(r, &mut row);
                bytes.extend(row.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()));
            }
            TensorSpec::new(t.name.clone(), &t.dims, GgmlType::BF16, bytes)
        } else {
            TensorSpec::new(t.name.clone(), &t.dims, t.ggml_type, data.to_vec())
        });
    }
    let out = dir.join(path.file_name().unwrap());
    write_gguf(&out, &metadata, &tensors).unwrap();
    out
}
