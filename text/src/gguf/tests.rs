//! Unit tests of the parser over in-memory files.

use super::metadata::{T_ARRAY, T_F32, T_STRING};
use super::parse::{parse, Arrays, Parsed};
use super::writer::{to_bytes, TensorSpec};
use super::*;

fn parse_bytes(b: &[u8]) -> Result<Parsed, GgufError> {
    parse(Path::new("mem.gguf"), b, Arrays::Decode)
}

#[test]
fn header_only_file_parses() {
    let b = to_bytes::<&str>(3, &[], &[]).unwrap();
    let p = parse_bytes(&b).unwrap();
    assert_eq!(p.version, 3);
    assert!(p.metadata.is_empty() && p.tensors.is_empty());
}

#[test]
fn version_2_is_accepted_and_1_is_not() {
    let b = to_bytes(2, &[("a", MetaValue::U8(1))], &[]).unwrap();
    assert_eq!(parse_bytes(&b).unwrap().version, 2);
    let b = to_bytes::<&str>(1, &[], &[]).unwrap();
    assert!(matches!(
        parse_bytes(&b),
        Err(GgufError::UnsupportedVersion { version: 1, .. })
    ));
}

#[test]
fn huge_array_count_is_rejected_before_allocating() {
    let mut b = to_bytes(3, &[("a", MetaValue::Array(vec![MetaValue::U64(1)]))], &[]).unwrap();
    // The count follows key len (8) + key (1) + type (4) + elem type (4) after the 24-byte header.
    let at = 24 + 8 + 1 + 4 + 4;
    b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = parse_bytes(&b).err().unwrap();
    assert_eq!(e.label(), "truncated", "{e}");
}

#[test]
fn deep_arrays_are_rejected() {
    let mut v = MetaValue::U8(1);
    for _ in 0..(MAX_ARRAY_DEPTH + 1) {
        v = MetaValue::Array(vec![v]);
    }
    let b = to_bytes(3, &[("deep", v)], &[]).unwrap();
    assert_eq!(parse_bytes(&b).err().unwrap().label(), "array_too_deep");
}

#[test]
fn unsupported_tensor_type_opens_and_is_named_on_use() {
    let t = TensorSpec::new(
        "blk.0.ffn_up.weight",
        &[256, 2],
        GgmlType::Unsupported(16),
        vec![0; 132],
    );
    let b = to_bytes::<&str>(3, &[], &[t]).unwrap();
    let p = parse_bytes(&b).unwrap();
    assert_eq!(p.tensors[0].n_bytes, None);
    assert_eq!(p.tensors[0].ggml_type.name(), "IQ2_XXS");
}

#[test]
fn row_not_block_aligned_is_an_error() {
    let t = TensorSpec::new("w", &[33, 1], GgmlType::Q8_0, vec![0; 68]);
    let b = to_bytes::<&str>(3, &[], &[t]).unwrap();
    assert_eq!(
        parse_bytes(&b).err().unwrap().label(),
        "row_not_block_aligned"
    );
}

#[test]
fn bad_alignment_is_an_error() {
    let b = to_bytes(3, &[("general.alignment", MetaValue::U32(3))], &[]).unwrap();
    assert_eq!(parse_bytes(&b).err().unwrap().label(), "bad_alignment");
}

#[test]
fn block_sizes_match_ggml() {
    assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
    assert_eq!(GgmlType::Q4_1.bytes_for(32), Some(20));
    assert_eq!(GgmlType::Q8_0.bytes_for(32), Some(34));
    assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
    assert_eq!(GgmlType::BF16.bytes_for(3), Some(6));
    assert_eq!(GgmlType::F32.bytes_for(3), Some(12));
    assert_eq!(GgmlType::Q8_0.bytes_for(31), None);
    // ggml-common.h's block sizes (static_asserts there).
    for (t, bytes) in [
        (GgmlType::Q5_0, 22),
        (GgmlType::Q5_1, 24),
        (GgmlType::IQ4_NL, 18),
    ] {
        assert_eq!(t.bytes_for(64), Some(2 * bytes), "{t:?}");
    }
    for (t, bytes) in [
        (GgmlType::Q2_K, 84),
        (GgmlType::Q3_K, 110),
        (GgmlType::Q4_K, 144),
        (GgmlType::Q5_K, 176),
        (GgmlType::Q6_K, 210),
        (GgmlType::Q8_K, 292),
        (GgmlType::IQ4_XS, 136),
    ] {
        assert_eq!(t.bytes_for(512), Some(2 * bytes), "{t:?}");
        assert_eq!(t.bytes_for(576), None, "{t:?}");
    }
    for id in [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 20, 23, 30] {
        let t = GgmlType::from_id(id);
        assert_eq!(t.id(), id);
        assert!(t.is_supported());
        assert!(
            t.block_len().is_some() && t.block_bytes().is_some(),
            "{t:?}"
        );
    }
    assert!(
        !GgmlType::from_id(16).is_supported(),
        "IQ2_XXS has no decoder"
    );
}

fn parse_header(b: &[u8]) -> Result<Parsed, GgufError> {
    parse(Path::new("mem.gguf"), b, Arrays::LengthOnly)
}

#[test]
fn header_only_keeps_array_lengths_and_tensors() {
    let tokens = MetaValue::Array(vec![
        MetaValue::String("a".into()),
        MetaValue::String("bc".into()),
    ]);
    let nested = MetaValue::Array(vec![MetaValue::Array(vec![
        MetaValue::U32(1),
        MetaValue::U32(2),
    ])]);
    let meta = [
        ("tokenizer.ggml.tokens", tokens),
        ("nested", nested),
        ("scores", MetaValue::Array(vec![MetaValue::F32(0.5); 3])),
        ("llama.block_count", MetaValue::U32(2)),
    ];
    let t = TensorSpec::f32("w", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let b = to_bytes(3, &meta, &[t]).unwrap();
    let full = parse_bytes(&b).unwrap();
    let head = parse_header(&b).unwrap();
    assert_eq!(
        head.metadata["tokenizer.ggml.tokens"],
        MetaValue::ArrayLen {
            elem_type: T_STRING,
            len: 2
        }
    );
    assert_eq!(
        head.metadata["nested"],
        MetaValue::ArrayLen {
            elem_type: T_ARRAY,
            len: 1
        }
    );
    assert_eq!(
        head.metadata["scores"],
        MetaValue::ArrayLen {
            elem_type: T_F32,
            len: 3
        }
    );
    assert_eq!(head.metadata["llama.block_count"], MetaValue::U32(2));
    for (k, v) in &full.metadata {
        assert_eq!(head.metadata[k].array_len(), v.array_len(), "{k}");
    }
    assert_eq!(head.tensors, full.tensors);
    assert_eq!(head.data_offset, full.data_offset);
}

#[test]
fn header_only_checks_what_it_skips() {
    // A huge element count is refused before anything is skipped or allocated.
    let mut b = to_bytes(3, &[("a", MetaValue::Array(vec![MetaValue::U64(1)]))], &[]).unwrap();
    let at = 24 + 8 + 1 + 4 + 4;
    b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(parse_header(&b).err().unwrap().label(), "truncated");
    // A string element longer than the file.
    let mut b = to_bytes(
        3,
        &[("s", MetaValue::Array(vec![MetaValue::String("x".into())]))],
        &[],
    )
    .unwrap();
    let at = 24 + 8 + 1 + 4 + 4 + 8;
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_eq!(parse_header(&b).err().unwrap().label(), "truncated");
    // Nesting past the limit, as when decoding.
    let mut v = MetaValue::U8(1);
    for _ in 0..(MAX_ARRAY_DEPTH + 1) {
        v = MetaValue::Array(vec![v]);
    }
    let b = to_bytes(3, &[("deep", v)], &[]).unwrap();
    assert_eq!(parse_header(&b).err().unwrap().label(), "array_too_deep");
    // Every prefix that cuts the table is an error, never a panic (the alignment
    // padding after the last entry may go).
    let b = to_bytes(
        3,
        &[(
            "t",
            MetaValue::Array(vec![MetaValue::String("ab".into()); 3]),
        )],
        &[],
    )
    .unwrap();
    let table_end = 24 + (8 + 1) + 4 + 4 + 8 + 3 * (8 + 2);
    assert!(parse_header(&b[..table_end]).is_ok());
    for n in 0..table_end {
        assert!(parse_header(&b[..n]).is_err(), "prefix {n}");
    }
}
