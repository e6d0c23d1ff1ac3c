//! GGUF reader: round trips through the test writer, and every kind of broken
//! file gives a named error, never a panic. The last test opens the real model.

use std::path::{Path, PathBuf};

use baton_text::gguf::writer::{to_bytes, write_gguf, TensorSpec};
use baton_text::gguf::{GgmlType, GgufError, GgufFile, MetaValue};
use proptest::prelude::*;

/// The default model: `BATON_MODEL` as given (a wrong path fails the test), else the
/// cache scripts/fetch-model.sh fills; `None` skips the test.
fn model_path() -> Option<PathBuf> {
    if let Some(given) = std::env::var_os("BATON_MODEL") {
        return Some(given.into());
    }
    let cache = match std::env::var_os("BATON_MODEL_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/baton/models"),
    };
    Some(cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")).filter(|p| p.exists())
}

fn all_value_types() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("t.u8", MetaValue::U8(200)),
        ("t.i8", MetaValue::I8(-5)),
        ("t.u16", MetaValue::U16(60000)),
        ("t.i16", MetaValue::I16(-30000)),
        ("t.u32", MetaValue::U32(4_000_000_000)),
        ("t.i32", MetaValue::I32(-7)),
        ("t.u64", MetaValue::U64(1 << 40)),
        ("t.i64", MetaValue::I64(-(1 << 40))),
        ("t.f32", MetaValue::F32(1.5)),
        ("t.f64", MetaValue::F64(-2.25)),
        ("t.bool", MetaValue::Bool(true)),
        ("t.str", MetaValue::String("héllo 🙂".into())),
        (
            "t.strs",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("".into()),
                MetaValue::String("Ġt".into()),
            ]),
        ),
        (
            "t.i32s",
            MetaValue::Array(vec![
                MetaValue::I32(1),
                MetaValue::I32(-3),
                MetaValue::I32(3),
            ]),
        ),
        (
            "t.f32s",
            MetaValue::Array(vec![MetaValue::F32(0.5), MetaValue::F32(2.0)]),
        ),
        ("t.empty", MetaValue::Array(vec![])),
        (
            "t.nested",
            MetaValue::Array(vec![
                MetaValue::Array(vec![MetaValue::U8(1)]),
                MetaValue::Array(vec![]),
            ]),
        ),
        ("t.small_u32_in_u8", MetaValue::U8(7)),
    ]
}

fn all_tensor_types() -> Vec<TensorSpec> {
    let bytes = |n: usize, seed: u8| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>()
    };
    vec![
        TensorSpec::f32("a.f32", &[3], &[1.0, 2.0, 3.0]),
        TensorSpec::new("b.f16", &[4, 2], GgmlType::F16, bytes(16, 1)),
        TensorSpec::new("c.q4_0", &[64, 2], GgmlType::Q4_0, bytes(4 * 18, 2)),
        TensorSpec::new("d.q4_1", &[32, 3], GgmlType::Q4_1, bytes(3 * 20, 3)),
        TensorSpec::new("e.q8_0", &[32, 1, 1, 2], GgmlType::Q8_0, bytes(2 * 34, 4)),
        TensorSpec::new("f.bf16", &[5], GgmlType::BF16, bytes(10, 5)),
        TensorSpec::new("g.iq2_xxs", &[256], GgmlType::Unsupported(16), bytes(66, 6)),
        TensorSpec::new("h.q4_k", &[256, 2], GgmlType::Q4_K, bytes(2 * 144, 7)),
        TensorSpec::new("i.q5_1", &[64], GgmlType::Q5_1, bytes(2 * 24, 8)),
    ]
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn round_trip_all_value_and_tensor_types() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rt.gguf");
    let meta = all_value_types();
    let tensors = all_tensor_types();
    write_gguf(&path, &meta, &tensors).unwrap();

    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.data_offset % 32, 0);
    for (k, v) in &meta {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    assert_eq!(g.tensors.len(), tensors.len());
    for (spec, info) in tensors.iter().zip(&g.tensors) {
        assert_eq!(info.name, spec.name);
        assert_eq!(info.dims, spec.dims);
        assert_eq!(info.ggml_type, spec.ggml_type);
        assert_eq!(info.offset % 32, 0, "{}", info.name);
        assert_eq!(g.tensor(&spec.name), Some(info));
        if spec.ggml_type.is_supported() {
            assert_eq!(info.n_bytes, Some(spec.data.len() as u64));
            assert_eq!(g.tensor_data(info), &spec.data[..]);
        } else {
            assert_eq!(info.n_bytes, None);
        }
    }
    assert_eq!(g.tensor("e.q8_0").unwrap().n_elements(), 64);
    assert_eq!(g.tensor("e.q8_0").unwrap().n_rows(), 2);

    // Typed getters accept any integer type that fits.
    assert_eq!(g.get_u32("t.u8").unwrap(), 200);
    assert_eq!(g.get_u32("t.u64").err().unwrap().label(), "wrong_type");
    assert_eq!(g.get_u64("t.u64").unwrap(), 1 << 40);
    assert_eq!(g.get_u32("t.i32").err().unwrap().label(), "wrong_type");
    assert_eq!(g.get_f32("t.f64").unwrap(), -2.25);
    assert_eq!(g.get_str("t.str").unwrap(), "héllo 🙂");
    assert!(g.get_bool("t.bool").unwrap());
    assert_eq!(g.get_str_array("t.strs").unwrap(), vec!["a", "", "Ġt"]);
    assert_eq!(g.get_i32_array("t.i32s").unwrap(), vec![1, -3, 3]);
    assert_eq!(g.get_f32_array("t.f32s").unwrap(), vec![0.5, 2.0]);
    assert_eq!(g.get_str_array("t.empty").unwrap(), Vec::<&str>::new());

    let e = g.get_str("t.u32").err().unwrap();
    assert!(
        matches!(&e, GgufError::WrongType { key, expected: "string", found, .. } if key == "t.u32" && found == "u32"),
        "{e}"
    );
    let e = g.get_u32("nope").err().unwrap();
    assert!(matches!(&e, GgufError::MissingKey { key, .. } if key == "nope"));
    assert!(e.to_string().contains("rt.gguf"), "{e}");
    assert_eq!(g.opt_u32("nope"), None);
    assert_eq!(g.opt_u32("t.small_u32_in_u8"), Some(7));
    assert_eq!(g.opt_str("t.u8"), None);
    assert_eq!(g.opt_str("t.str"), Some("héllo 🙂"));
    assert_eq!(
        g.get_i32_array("t.strs").err().unwrap().label(),
        "wrong_type"
    );
}

#[test]
fn custom_alignment_and_version_2_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let meta = vec![("general.alignment", MetaValue::U32(64))];
    let tensors = all_tensor_types();
    let p = write(
        dir.path(),
        "v2.gguf",
        &to_bytes(2, &meta, &tensors).unwrap(),
    );
    let g = GgufFile::open(&p).unwrap();
    assert_eq!((g.version, g.alignment), (2, 64));
    for (spec, info) in tensors.iter().zip(&g.tensors) {
        assert_eq!(info.offset % 64, 0);
        if spec.ggml_type.is_supported() {
            assert_eq!(g.tensor_data(info), &spec.data[..]);
        }
    }
}

#[test]
fn every_prefix_of_a_file_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let meta = vec![
        ("general.architecture", MetaValue::String("llama".into())),
        ("n", MetaValue::U32(3)),
        (
            "toks",
            MetaValue::Array(vec![
                MetaValue::String("ab".into()),
                MetaValue::String("c".into()),
            ]),
        ),
    ];
    // The last tensor fills whole alignment units, so the file has no trailing padding
    // and every proper prefix cuts something that is needed.
    let tensors = vec![
        TensorSpec::f32("x", &[3], &[1.0, 2.0, 3.0]),
        TensorSpec::new("blk.0.attn_q.weight", &[32, 4], GgmlType::Q4_0, vec![7; 72]),
        TensorSpec::f32("y", &[8], &[0.0; 8]),
    ];
    let full = to_bytes(3, &meta, &tensors).unwrap();
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &full).unwrap();
    assert!(GgufFile::open(&p).is_ok());
    for cut in 0..full.len() {
        std::fs::write(&p, &full[..cut]).unwrap();
        match GgufFile::open(&p) {
            Ok(_) => panic!("prefix of {cut} bytes out of {} opened", full.len()),
            Err(e) => assert!(
                matches!(e.label(), "truncated" | "tensor_out_of_bounds"),
                "cut at {cut}: unexpected {e}"
            ),
        }
    }
}

#[test]
fn corrupted_magic_is_bad_magic() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = to_bytes::<&str>(3, &[], &[]).unwrap();
    b[0] = b'X';
    let p = write(dir.path(), "magic.gguf", &b);
    let e = GgufFile::open(&p).err().unwrap();
    assert!(
        matches!(&e, GgufError::BadMagic { path } if path == &p),
        "{e}"
    );
    assert_eq!(e.label(), "bad_magic");
}

#[test]
fn missing_file_is_io_error_with_path() {
    let e = GgufFile::open(Path::new("/nonexistent/model.gguf"))
        .err()
        .unwrap();
    assert_eq!(e.label(), "io");
    assert!(e.to_string().contains("/nonexistent/model.gguf"));
}

#[test]
fn huge_declared_string_lengths_are_truncated_errors() {
    let dir = tempfile::tempdir().unwrap();
    let b = to_bytes(3, &[("k", MetaValue::String("value".into()))], &[]).unwrap();
    // Header is 24 bytes; the key's length is the next u64.
    let mut key_len = b.clone();
    key_len[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::open(&write(dir.path(), "k.gguf", &key_len))
        .err()
        .unwrap();
    assert!(
        matches!(
            &e,
            GgufError::Truncated {
                needed: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
    // The value's length follows key len (8), key (1) and type (4).
    let mut val_len = b;
    val_len[37..45].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = GgufFile::open(&write(dir.path(), "v.gguf", &val_len))
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::Truncated { what, .. } if what.contains("\"k\"")),
        "{e}"
    );
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = to_bytes::<&str>(3, &[], &[]).unwrap();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    let e = GgufFile::open(&write(dir.path(), "n.gguf", &b))
        .err()
        .unwrap();
    assert_eq!(e.label(), "truncated");
    b[8..16].copy_from_slice(&0u64.to_le_bytes());
    b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes()); // metadata count
    let e = GgufFile::open(&write(dir.path(), "m.gguf", &b))
        .err()
        .unwrap();
    assert_eq!(e.label(), "truncated");
}

#[test]
fn invalid_utf8_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = to_bytes(3, &[("k", MetaValue::U8(1))], &[]).unwrap();
    b[32] = 0xff;
    let e = GgufFile::open(&write(dir.path(), "u.gguf", &b))
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::BadUtf8 { what, .. } if what.contains("key #0")),
        "{e}"
    );
}

#[test]
fn unknown_value_type_and_duplicates_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = to_bytes(3, &[("k", MetaValue::U8(1))], &[]).unwrap();
    b[33..37].copy_from_slice(&99u32.to_le_bytes());
    let e = GgufFile::open(&write(dir.path(), "t.gguf", &b))
        .err()
        .unwrap();
    assert!(
        matches!(e, GgufError::BadValueType { type_id: 99, .. }),
        "{e}"
    );

    let b = to_bytes(3, &[("k", MetaValue::U8(1)), ("k", MetaValue::U8(2))], &[]).unwrap();
    let e = GgufFile::open(&write(dir.path(), "dk.gguf", &b))
        .err()
        .unwrap();
    assert_eq!(e.label(), "duplicate_key");

    let t = TensorSpec::f32("w", &[1], &[1.0]);
    let b = to_bytes::<&str>(3, &[], &[t.clone(), t]).unwrap();
    let e = GgufFile::open(&write(dir.path(), "dt.gguf", &b))
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::DuplicateTensor { tensor, .. } if tensor == "w"),
        "{e}"
    );
}

#[test]
fn tensor_past_eof_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![
        TensorSpec::f32("ok", &[8], &[0.0; 8]),
        TensorSpec::new(
            "blk.3.ffn_down.weight",
            &[32, 2],
            GgmlType::Q8_0,
            vec![1; 68],
        ),
    ];
    let b = to_bytes::<&str>(3, &[], &tensors).unwrap();
    let cut = &b[..b.len() - 40];
    let p = write(dir.path(), "eof.gguf", cut);
    let e = GgufFile::open(&p).err().unwrap();
    match &e {
        GgufError::TensorOutOfBounds {
            tensor,
            n_bytes,
            file_len,
            ..
        } => {
            assert_eq!(tensor, "blk.3.ffn_down.weight");
            assert_eq!(*n_bytes, 68);
            assert_eq!(*file_len, cut.len() as u64);
        }
        other => panic!("unexpected {other}"),
    }
    assert!(
        e.to_string().contains("blk.3.ffn_down.weight") && e.to_string().contains("eof.gguf"),
        "{e}"
    );
}

#[test]
fn bad_tensor_headers_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let five = TensorSpec::new("five", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]);
    let e = GgufFile::open(&write(
        dir.path(),
        "d.gguf",
        &to_bytes::<&str>(3, &[], &[five]).unwrap(),
    ))
    .err()
    .unwrap();
    assert!(
        matches!(&e, GgufError::TooManyDims { tensor, n_dims: 5, .. } if tensor == "five"),
        "{e}"
    );

    let big = TensorSpec::new("big", &[u64::MAX, 2], GgmlType::F32, vec![]);
    let e = GgufFile::open(&write(
        dir.path(),
        "o.gguf",
        &to_bytes::<&str>(3, &[], &[big]).unwrap(),
    ))
    .err()
    .unwrap();
    assert!(
        matches!(&e, GgufError::ShapeOverflow { tensor, .. } if tensor == "big"),
        "{e}"
    );

    let odd = TensorSpec::new("odd", &[48], GgmlType::Q4_1, vec![0; 40]);
    let e = GgufFile::open(&write(
        dir.path(),
        "r.gguf",
        &to_bytes::<&str>(3, &[], &[odd]).unwrap(),
    ))
    .err()
    .unwrap();
    assert!(
        matches!(&e, GgufError::RowNotBlockAligned { tensor, row_len: 48, block_len: 32, .. } if tensor == "odd"),
        "{e}"
    );

    // Misaligned data offset: patch the first tensor's relative offset to 4.
    let t = TensorSpec::f32("m", &[1], &[1.0]);
    let mut b = to_bytes::<&str>(3, &[], &[t]).unwrap();
    let off_at = 24 + 8 + 1 + 4 + 8 + 4;
    b[off_at..off_at + 8].copy_from_slice(&4u64.to_le_bytes());
    let e = GgufFile::open(&write(dir.path(), "a.gguf", &b))
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::MisalignedTensor { tensor, offset: 4, alignment: 32, .. } if tensor == "m"),
        "{e}"
    );
}

#[test]
fn unsupported_type_missing_tensor_and_shape_are_reported_on_use() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("use.gguf");
    write_gguf::<&str>(&p, &[], &all_tensor_types()).unwrap();
    let g = GgufFile::open(&p).unwrap();

    let e = g.require_tensor("g.iq2_xxs", &[]).err().unwrap();
    assert!(
        matches!(&e, GgufError::UnsupportedTensorType { tensor, type_name: "IQ2_XXS", .. } if tensor == "g.iq2_xxs"),
        "{e}"
    );
    assert!(e.to_string().contains("IQ2_XXS"));
    let t = g.tensor("g.iq2_xxs").unwrap();
    assert_eq!(g.tensor_data(t), &[] as &[u8]);
    assert_eq!(
        g.tensor_data_checked(t).err().unwrap().label(),
        "unsupported_tensor_type"
    );

    let e = g.require_tensor("output.weight", &[]).err().unwrap();
    assert!(matches!(&e, GgufError::MissingTensor { tensor, .. } if tensor == "output.weight"));

    let e = g.require_tensor("d.q4_1", &[32, 4]).err().unwrap();
    assert!(
        matches!(&e, GgufError::ShapeMismatch { expected, found, .. } if expected == &[32, 4] && found == &[32, 3]),
        "{e}"
    );
    assert_eq!(
        g.require_tensor("d.q4_1", &[32, 3]).unwrap().ggml_type,
        GgmlType::Q4_1
    );
}

fn open_bytes(dir: &Path, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let p = dir.join("fuzz.gguf");
    std::fs::write(&p, bytes).unwrap();
    GgufFile::open(&p)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary bytes behind a valid magic and version never panic.
    #[test]
    fn arbitrary_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512), v in 2u32..4) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&v.to_le_bytes());
        b.extend_from_slice(&tail);
        let _ = open_bytes(dir.path(), &b);
        let _ = open_bytes(dir.path(), &tail);
    }

    /// Random byte edits and truncations of a valid file never panic.
    #[test]
    fn mutated_valid_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = to_bytes(3, &all_value_types(), &all_tensor_types()).unwrap();
        for (at, byte) in edits {
            let i = at.index(b.len());
            b[i] = byte;
        }
        let keep = cut.index(b.len() + 1);
        let _ = open_bytes(dir.path(), &b);
        let _ = open_bytes(dir.path(), &b[..keep]);
    }
}

#[test]
fn real_model_has_known_layout_and_metadata() {
    let Some(path) = model_path() else {
        eprintln!("skipped: model not found, run scripts/fetch-model.sh (or set BATON_MODEL)");
        return;
    };
    let t0 = std::time::Instant::now();
    let g = GgufFile::open(&path).unwrap();
    eprintln!("opened {} in {:?}", path.display(), t0.elapsed());
    let t0 = std::time::Instant::now();
    let h = GgufFile::open_header(&path).unwrap();
    eprintln!("opened its header only in {:?}", t0.elapsed());
    assert_eq!(h.tensors, g.tensors);
    assert_eq!(h.get_array_len("tokenizer.ggml.tokens").unwrap(), 49152);
    assert_eq!(h.get_array_len("tokenizer.ggml.merges").unwrap(), 48900);
    assert_eq!(h.get_u32("llama.block_count").unwrap(), 30);

    assert_eq!(g.version, 3);
    assert_eq!(g.tensors.len(), 272);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[1], "<|im_start|>");
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.len(), 49152);
    assert_eq!(types.iter().filter(|&&t| t == 3).count(), 17);
    let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
    assert_eq!(merges.len(), 48900);
    assert_eq!(merges[0], "Ġ t");
    assert_eq!(g.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(g.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert_eq!(g.get_u32("tokenizer.ggml.unknown_token_id").unwrap(), 0);
    assert_eq!(g.get_u32("tokenizer.ggml.padding_token_id").unwrap(), 2);
    assert!(!g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(!g.get_bool("tokenizer.ggml.add_space_prefix").unwrap());
    assert!(g
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("<|im_start|>"));

    let emb = g
        .require_tensor("token_embd.weight", &[576, 49152])
        .unwrap();
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    assert_eq!(emb.n_bytes, Some(576 * 49152 / 32 * 34));
    assert_eq!(g.tensor_data(emb).len() as u64, emb.n_bytes.unwrap());
    assert_eq!(
        g.require_tensor("output_norm.weight", &[576])
            .unwrap()
            .ggml_type,
        GgmlType::F32
    );
    for i in 0..30 {
        for n in ["attn_norm", "ffn_norm"] {
            assert_eq!(
                g.require_tensor(&format!("blk.{i}.{n}.weight"), &[576])
                    .unwrap()
                    .ggml_type,
                GgmlType::F32
            );
        }
        for n in [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            let t = g
                .require_tensor(&format!("blk.{i}.{n}.weight"), &[])
                .unwrap();
            assert_eq!(t.ggml_type, GgmlType::Q4_1, "{}", t.name);
        }
    }
    assert_eq!(
        g.tensor("blk.0.attn_k.weight").unwrap().dims,
        vec![576, 192]
    );
    assert_eq!(
        g.tensor("blk.0.ffn_down.weight").unwrap().dims,
        vec![1536, 576]
    );
    let end = g
        .tensors
        .iter()
        .map(|t| t.offset + t.n_bytes.unwrap())
        .max()
        .unwrap();
    assert!(end <= g.file_len);
}
