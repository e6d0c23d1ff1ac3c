//! Writes a copy of a Llama GGUF with its layer matrices requantized the way
//! llama-quantize types a Q4_K_M file: Q6_K for `attn_v` and `ffn_down` in
//! the first and last eighth of the layers and every third layer between,
//! Q4_K elsewhere; where a row is not a whole number of 256-element
//! super-blocks, llama-quantize's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0).
//! Embedding, output head and norms are copied as they are. The quantizers
//! are Baton's round-to-nearest ones (`baton_kernels::blocks`), not
//! llama.cpp's error-minimizing searches: a file for checking the K-format
//! path end to end and timing it without a llama.cpp build, not for serving.
//!
//!   cargo run --release -p baton-engine --example gguf_requantize -- IN.gguf OUT.gguf

use std::collections::BTreeMap;
use std::path::Path;

use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgmlType, GgufFile, MetaValue};
use baton_kernels::quant::{dequantize_row, quantize_row_q8_0};
use baton_kernels::blocks::{self, QK_K};

/// The type llama-quantize's Q4_K_M gives layer `i` of `n`'s tensor `what`
/// with rows of `k` elements.
fn q4_k_m_type(what: &str, i: u32, n: u32, k: usize) -> GgmlType {
    let more_bits = i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
    let wanted = if (what == "attn_v" || what == "ffn_down") && more_bits { GgmlType::Q6_K } else { GgmlType::Q4_K };
    match wanted {
        _ if k.is_multiple_of(QK_K) => wanted,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::Q5_0,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        return Err("usage: gguf_requantize IN.gguf OUT.gguf".into());
    };
    let f = GgufFile::open(Path::new(input))?;
    let layers = f.get_u32("llama.block_count")?;
    let metadata: Vec<(String, MetaValue)> = f.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut tensors = Vec::new();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &f.tensors {
        let data = f.tensor_data_checked(t)?;
        let mut parts = t.name.split('.');
        let layer = (parts.next() == Some("blk")).then(|| parts.next().and_then(|i| i.parse::<u32>().ok())).flatten();
        let (Some(i), Some(what), 2) = (layer, parts.next(), t.dims.len()) else {
            tensors.push(TensorSpec::new(t.name.clone(), &t.dims, t.ggml_type, data.to_vec()));
            continue;
        };
        let from = baton_engine::model::weight_format(t.ggml_type).ok_or_else(|| format!("{}: type {} has no decoder", t.name, t.ggml_type.name()))?;
        let k = t.dims[0] as usize;
        let to = q4_k_m_type(what, i, layers, k);
        let quantize: fn(&[f32], &mut Vec<u8>) = match to {
            GgmlType::Q4_K => blocks::quantize_row_q4_k,
            GgmlType::Q6_K => blocks::quantize_row_q6_k,
            GgmlType::Q8_0 => quantize_row_q8_0,
            _ => blocks::quantize_row_q5_0,
        };
        let (mut row, mut out) = (vec![0f32; k], Vec::new());
        let row_bytes = from.row_bytes(k).ok_or_else(|| format!("{}: rows of {k} are not whole blocks", t.name))?;
        for r in data.chunks_exact(row_bytes) {
            dequantize_row(from, r, &mut row);
            quantize(&row, &mut out);
        }
        *counts.entry(to.name()).or_default() += 1;
        tensors.push(TensorSpec::new(t.name.clone(), &t.dims, to, out));
    }
    write_gguf(Path::new(output), &metadata, &tensors)?;
    let bytes = std::fs::metadata(output)?.len();
    println!("{output}: {counts:?}, {:.1} MiB", bytes as f64 / (1 << 20) as f64);
    Ok(())
}
