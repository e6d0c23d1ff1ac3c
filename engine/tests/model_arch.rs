//! Model metadata for families other than the default model's: an unknown
//! architecture and contradicting metadata are refused at load with a
//! message naming the problem, and a family's keys fill the layer description.

use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgufFile, MetaValue};
use baton_engine::model::{config_from_gguf, load_gguf_weights};
use baton_kernels::CpuBackend;

fn meta(arch: &str, extra: &[(&str, MetaValue)]) -> Vec<(String, MetaValue)> {
    let k = |s: &str| format!("{arch}.{s}");
    let mut m = vec![
        (
            "general.architecture".to_string(),
            MetaValue::String(arch.into()),
        ),
        (k("embedding_length"), MetaValue::U32(64)),
        (k("attention.head_count"), MetaValue::U32(4)),
        (k("attention.head_count_kv"), MetaValue::U32(2)),
        (k("block_count"), MetaValue::U32(4)),
        (k("feed_forward_length"), MetaValue::U32(128)),
        (k("context_length"), MetaValue::U32(256)),
        (k("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-6)),
        (k("vocab_size"), MetaValue::U32(32)),
    ];
    m.extend(extra.iter().map(|(key, v)| (k(key), v.clone())));
    m
}

fn open(meta: &[(String, MetaValue)]) -> (tempfile::TempDir, GgufFile) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_gguf(
        &p,
        meta,
        &[TensorSpec::f32(
            "rope_freqs.weight",
            &[8],
            &[1.0, 1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 8.0],
        )],
    )
    .unwrap();
    let f = GgufFile::open(&p).unwrap();
    (dir, f)
}

#[test]
fn unknown_architecture_is_refused_naming_it_and_the_known_ones() {
    let (_d, f) = open(&meta("mamba", &[]));
    let e = load_gguf_weights(&CpuBackend::new(1).unwrap(), &f)
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("\"mamba\"") && msg.contains("llama") && msg.contains("gemma3"),
        "{msg}"
    );
    assert!(msg.contains("m.gguf"), "names the file: {msg}");
    assert_eq!(e.label(), "model_config");
}

#[test]
fn family_keys_fill_the_layer_description() {
    // Qwen3: the head size comes from key_length.
    let (_d, f) = open(&meta(
        "qwen3",
        &[
            ("attention.key_length", MetaValue::U32(16)),
            ("attention.value_length", MetaValue::U32(16)),
        ],
    ));
    let c = config_from_gguf(&f).unwrap();
    assert_eq!((c.family.name, c.head_dim), ("qwen3", 16));
    assert!(c.family.qk_norm && c.layers.iter().all(|l| l.window.is_none()));
    // rope_freqs.weight becomes the Llama 3 frequency factors.
    assert_eq!(
        c.rope_factors.as_deref(),
        Some(&[1.0, 1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 8.0][..])
    );
    // Gemma 3 with its pattern period, window and local base from metadata.
    let (_d, f) = open(&meta(
        "gemma3",
        &[
            ("attention.key_length", MetaValue::U32(16)),
            ("attention.sliding_window", MetaValue::U32(64)),
            ("attention.sliding_window_pattern", MetaValue::U32(2)),
            ("rope.freq_base_swa", MetaValue::F32(5000.0)),
            ("rope.freq_base", MetaValue::F32(1e6)),
            ("final_logit_softcapping", MetaValue::F32(30.0)),
        ],
    ));
    let c = config_from_gguf(&f).unwrap();
    assert_eq!(c.windows(), [Some(64), None, Some(64), None]);
    assert_eq!(
        (c.layers[0].rope.base, c.layers[1].rope.base),
        (5000.0, 1e6)
    );
    assert_eq!(c.logit_softcap, Some(30.0));
    assert_eq!(c.attn_scale, 0.25);
    // Mistral: a window on every layer.
    let (_d, f) = open(&meta(
        "mistral",
        &[("attention.sliding_window", MetaValue::U32(128))],
    ));
    assert!(config_from_gguf(&f)
        .unwrap()
        .windows()
        .iter()
        .all(|w| *w == Some(128)));
}

#[test]
fn contradicting_metadata_is_refused_naming_it() {
    let cases: Vec<(Vec<(&str, MetaValue)>, &str)> = vec![
        (
            vec![
                ("attention.key_length", MetaValue::U32(16)),
                ("attention.value_length", MetaValue::U32(32)),
            ],
            "value head size 32",
        ),
        (
            vec![
                ("attention.key_length", MetaValue::U32(16)),
                ("rope.dimension_count", MetaValue::U32(8)),
            ],
            "partial rotary",
        ),
        (
            vec![("attention.sliding_window", MetaValue::U32(0))],
            "window of 0",
        ),
        (
            vec![
                ("attention.sliding_window", MetaValue::U32(8)),
                ("attention.sliding_window_pattern", MetaValue::U32(0)),
            ],
            "period of 0",
        ),
        (
            vec![(
                "attention.sliding_window_pattern",
                MetaValue::Array(vec![MetaValue::Bool(true)]),
            )],
            "per-layer sliding_window_pattern",
        ),
        (
            vec![("rope.scaling.type", MetaValue::String("yarn".into()))],
            "\"yarn\"",
        ),
        (
            vec![("rope.freq_base", MetaValue::F32(-1.0))],
            "must be positive",
        ),
    ];
    for (extra, want) in cases {
        let (_d, f) = open(&meta("gemma3", &extra));
        let e = config_from_gguf(&f)
            .err()
            .unwrap_or_else(|| panic!("{want}: accepted"));
        assert!(e.to_string().contains(want), "want {want:?} in {e}");
    }
}

/// Found by fuzzing the GGUF reader (issue #21): a structurally valid file whose `block_count` is huge
/// must be refused with a message, before a per-layer table of that size is allocated.
#[test]
fn huge_block_count_is_refused_before_allocating() {
    let mut m = meta("llama", &[]);
    for (k, v) in &mut m {
        if k == "llama.block_count" {
            *v = MetaValue::U32(u32::MAX);
        }
    }
    let (_dir, f) = open(&m);
    let e = config_from_gguf(&f).expect_err("a huge block_count is refused");
    assert!(e.to_string().contains("block_count 4294967295"), "{e}");
}
