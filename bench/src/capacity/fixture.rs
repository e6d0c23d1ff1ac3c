//! GGUF fixtures of the capacity planner's tests, written with `baton-text`'s writer
//! (no downloads in tests).

use std::path::{Path, PathBuf};

use baton_text::gguf::writer::{to_bytes, TensorSpec};
use baton_text::gguf::MetaValue;

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A tiny llama-shaped model: 2 layers, hidden 64, 4 heads, 2 KV heads, ffn 128,
/// vocabulary of 3 given as a token array (no `vocab_size` key), tied embeddings.
/// Tensors are zero F32.
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
    let mut shapes: Vec<(String, Vec<u64>)> = vec![("token_embd.weight".into(), vec![64, 3])];
    shapes.extend(layer(0));
    shapes.extend(layer(1));
    shapes.push(("output_norm.weight".into(), vec![64]));
    let tensors: Vec<TensorSpec> = shapes
        .iter()
        .map(|(n, d)| {
            TensorSpec::f32(
                n.as_str(),
                d,
                &vec![0.0; d.iter().product::<u64>() as usize],
            )
        })
        .collect();
    let s = |v: &str| MetaValue::String(v.into());
    let tokens = MetaValue::Array(["a", "b", "c"].map(s).to_vec());
    to_bytes(
        3,
        &[
            ("general.architecture", s("llama")),
            ("general.name", s("tiny")),
            ("llama.block_count", MetaValue::U32(2)),
            ("llama.embedding_length", MetaValue::U32(64)),
            ("llama.feed_forward_length", MetaValue::U32(128)),
            ("llama.attention.head_count", MetaValue::U32(4)),
            ("llama.attention.head_count_kv", MetaValue::U32(2)),
            ("llama.rope.freq_base", MetaValue::F32(10000.0)),
            ("tokenizer.ggml.tokens", tokens),
        ],
        &tensors,
    )
    .unwrap()
}

/// Parameters of [`tiny_llama`], counted by hand.
pub const TINY_PARAMS: u64 = 64 * 3 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64;
