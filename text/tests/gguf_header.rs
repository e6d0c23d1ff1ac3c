//! The header-only reading (`GgufFile::open_header`) as the capacity planner uses it:
//! scalars, array lengths and tensor shapes, without decoding arrays; bad files are
//! errors naming what is wrong. (These were bench's own GGUF reader's tests.)

use std::path::{Path, PathBuf};

use baton_text::gguf::writer::{to_bytes, TensorSpec};
use baton_text::gguf::{GgufFile, MetaValue};

const T_STRING: u32 = 8;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A llama-shaped file: one layer's worth of shapes, a 3-token vocabulary.
fn small_llama() -> Vec<u8> {
    let shapes: [(&str, &[u64]); 4] = [
        ("token_embd.weight", &[64, 3]),
        ("blk.0.attn_q.weight", &[64, 64]),
        ("blk.0.attn_norm.weight", &[64]),
        ("output_norm.weight", &[64]),
    ];
    let tensors: Vec<TensorSpec> = shapes
        .iter()
        .map(|(n, d)| TensorSpec::f32(*n, d, &vec![0.0; d.iter().product::<u64>() as usize]))
        .collect();
    let s = |v: &str| MetaValue::String(v.into());
    to_bytes(
        3,
        &[
            ("general.architecture", s("llama")),
            ("general.name", s("small")),
            ("llama.block_count", MetaValue::U32(1)),
            ("llama.attention.head_count_kv", MetaValue::U32(2)),
            ("llama.rope.freq_base", MetaValue::F32(10000.0)),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(["a", "b", "c"].map(s).to_vec()),
            ),
        ],
        &tensors,
    )
    .unwrap()
}

#[test]
fn reads_metadata_and_tensor_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "small.gguf", &small_llama());
    let h = GgufFile::open_header(&p).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.opt_str("general.architecture"), Some("llama"));
    assert_eq!(h.opt_u64("llama.block_count"), Some(1));
    assert_eq!(h.opt_u64("llama.attention.head_count_kv"), Some(2));
    assert_eq!(h.opt_u64("llama.vocab_size"), None);
    assert_eq!(
        h.get("tokenizer.ggml.tokens"),
        Some(&MetaValue::ArrayLen {
            elem_type: T_STRING,
            len: 3
        })
    );
    assert_eq!(h.get_array_len("tokenizer.ggml.tokens").unwrap(), 3);
    // The elements were not read: asking for them is an error naming the key.
    let e = h.get_str_array("tokenizer.ggml.tokens").unwrap_err();
    assert_eq!(e.label(), "wrong_type");
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");
    assert_eq!(h.opt_f32("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(h.tensors.len(), 4);
    let params: u64 = h.tensors.iter().map(|t| t.n_elements()).sum();
    assert_eq!(params, 64 * 3 + 64 * 64 + 64 + 64);

    // The full reader agrees on everything but the arrays' elements.
    let full = GgufFile::open(&p).unwrap();
    assert_eq!(
        full.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "c"]
    );
    assert_eq!(full.get_array_len("tokenizer.ggml.tokens").unwrap(), 3);
    assert_eq!(full.tensors, h.tensors);
}

#[test]
fn rejects_bad_magic_version_and_truncation() {
    let dir = tempfile::tempdir().unwrap();
    let kind = |p: &Path| GgufFile::open_header(p).unwrap_err().label();
    let p = write(dir.path(), "bad.gguf", b"GGML\x03\0\0\0");
    assert_eq!(kind(&p), "bad_magic");

    let mut v1 = small_llama();
    v1[4] = 1;
    let p = write(dir.path(), "v1.gguf", &v1);
    assert_eq!(kind(&p), "unsupported_version");

    let full = small_llama();
    let p = write(dir.path(), "trunc.gguf", &full[..full.len() / 2]);
    assert!(
        matches!(kind(&p), "truncated" | "tensor_out_of_bounds"),
        "{}",
        kind(&p)
    );

    let mut huge = small_llama();
    // The first key's length field: claim an absurd string length.
    huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = write(dir.path(), "huge.gguf", &huge);
    assert_eq!(kind(&p), "truncated");

    let missing = dir.path().join("nope.gguf");
    assert_eq!(kind(&missing), "io");
}
