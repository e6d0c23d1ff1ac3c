//! Tokenizer and chat template against llama.cpp: token IDs, decoding,
//! streaming decode, HF export, and the SmolLM2 chat template.
//!
//! Reference IDs come from llama.cpp (llama-cpp-python 0.3.36, vocab-only
//! load of the real model, `tokenize(text, add_bos=False, special=...)`).
//! When `engine/tests/golden/llamacpp.json` (scripts/llamacpp/golden.py) is
//! there, every case of it is checked too. `BATON_TOKENIZER_DIFF=<json>`
//! checks an extra file in the golden's `tokenize_only` format.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use baton_text::chat_template::{ChatMessage, ChatTemplate};
use baton_text::gguf::writer::write_gguf;
use baton_text::gguf::{GgufFile, MetaValue};
use baton_text::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};
use proptest::prelude::*;

mod common;
use common::model_path;

struct Model {
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
}

/// The real model's tokenizer and template, loaded once; `None` (and a
/// message) when the model file is absent.
fn model() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    let m = M.get_or_init(|| {
        let path = model_path()?;
        let t0 = std::time::Instant::now();
        let g = GgufFile::open(&path).expect("open model");
        let tok = Tokenizer::from_gguf(&g).expect("tokenizer from gguf");
        let template = ChatTemplate::from_gguf(&g).expect("template from gguf");
        eprintln!("loaded tokenizer and template in {:?}", t0.elapsed());
        Some(Model {
            tok: Arc::new(tok),
            template,
        })
    });
    if m.is_none() {
        eprintln!("skipped: model not found, run scripts/fetch-model.sh (or set BATON_MODEL)");
    }
    m.as_ref()
}

/// (text, IDs with parse_special=true, IDs with parse_special=false when they differ)
#[allow(clippy::type_complexity)]
const LLAMACPP_IDS: &[(&str, &[u32], Option<&[u32]>)] = &[
    ("Hello world! 123", &[19556, 905, 17, 216, 33, 34, 35], None),
    ("  multiple   spaces", &[216, 2701, 256, 5600], None),
    (
        "Café déjà vu.",
        &[51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
        None,
    ),
    (
        "The capital of France is",
        &[504, 3575, 282, 4649, 314],
        None,
    ),
    (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        &[1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198],
        Some(&[
            44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46, 198,
            44, 108, 306, 79, 3738, 108, 46, 520, 9531, 198,
        ]),
    ),
    (
        "don't I'll we're you've she'd it's they'RE DON'T",
        &[
            12420, 982, 339, 3060, 392, 2316, 346, 3543, 1041, 6737, 357, 506, 502, 23, 3256, 422,
            2154, 23, 68,
        ],
        None,
    ),
    (
        "3.14159 and 12345678901234567890 ½ ² ٣",
        &[
            35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 33, 34,
            35, 36, 37, 38, 39, 40, 41, 32, 216, 16738, 216, 19133, 216, 164, 113,
        ],
        None,
    ),
    (
        "你好，世界！こんにちは、東京。Привет, мир!",
        &[
            18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 8083, 219, 7365, 237, 10391,
            237, 41152, 7365, 111, 7365, 124, 29917, 30679, 126, 16736, 122, 19076, 155, 249,
            46879, 16464, 32547, 28, 41337, 7872, 9175, 17,
        ],
        None,
    ),
    (
        "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 #️⃣",
        &[
            10809, 33777, 42, 40303, 218, 15107, 235, 231, 10813, 233, 138, 15107, 225, 121, 10813,
            225, 132, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117, 321,
            231, 10813, 235, 116, 15107, 233, 128, 31752, 321, 231, 10813, 230, 226, 907, 31752,
            173, 221, 113,
        ],
        None,
    ),
    (
        "line1\r\nline2\n\n\tindented   \n",
        &[1311, 33, 201, 198, 1311, 34, 1116, 197, 526, 6574, 333, 198],
        None,
    ),
    (
        "a\u{0}b\u{7}c\u{1b}d e\u{301} nbsp\u{a0}here",
        &[
            81, 190, 82, 195, 83, 212, 84, 297, 151, 219, 304, 32093, 15442, 1531,
        ],
        None,
    ),
    (
        "<|im_start |> <im_start> <|notatoken|><|endoftext|>",
        &[
            44, 108, 306, 79, 3738, 2504, 46, 2067, 306, 79, 3738, 46, 2067, 108, 1766, 261, 21107,
            108, 46, 0,
        ],
        Some(&[
            44, 108, 306, 79, 3738, 2504, 46, 2067, 306, 79, 3738, 46, 2067, 108, 1766, 261, 21107,
            108, 21198, 108, 486, 1714, 2692, 108, 46,
        ]),
    ),
    (
        "    def f(x):\n        return x ** 2  # comment\n",
        &[
            333, 753, 275, 24, 104, 727, 448, 1003, 1792, 1903, 216, 34, 216, 907, 5189, 198,
        ],
        None,
    ),
];

#[test]
fn ids_match_llamacpp_on_hand_checked_texts() {
    let Some(m) = model() else { return };
    for (text, special, plain) in LLAMACPP_IDS {
        assert_eq!(
            m.tok.encode(text, true).unwrap(),
            *special,
            "parse_special=true: {text:?}"
        );
        let plain = plain.unwrap_or(special);
        assert_eq!(
            m.tok.encode(text, false).unwrap(),
            plain,
            "parse_special=false: {text:?}"
        );
        assert_eq!(
            m.tok.decode_with_special(special, true),
            *text,
            "decode: {text:?}"
        );
    }
}

#[test]
fn vocabulary_facts() {
    let Some(m) = model() else { return };
    let t = &m.tok;
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.add_bos()),
        (Some(1), Some(2), false)
    );
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert_eq!(t.token_id("Ġthe"), Some(260));
    assert_eq!(t.token_text(1), Some("<|im_start|>"));
    assert!((0..17).all(|i| t.is_special(i)) && !t.is_special(17) && !t.is_special(1_000_000));
    assert_eq!(t.token_bytes(216).as_deref(), Some(&b" "[..]));
    assert_eq!(t.token_bytes(198).as_deref(), Some(&b"\n"[..]));
    assert_eq!(t.token_bytes(2).as_deref(), Some(&b"<|im_end|>"[..]));
    assert_eq!(t.token_bytes(49152), None);
    assert_eq!(t.pre_tokenizer(), "smollm");
}

#[test]
fn special_tokens_decode_only_when_asked() {
    let Some(m) = model() else { return };
    let ids = m
        .tok
        .encode("<|im_start|>assistant\nHello!<|im_end|>", true)
        .unwrap();
    assert_eq!(m.tok.decode(&ids), "assistant\nHello!");
    assert_eq!(
        m.tok.decode_with_special(&ids, true),
        "<|im_start|>assistant\nHello!<|im_end|>"
    );
    // Unknown IDs are skipped, not a panic.
    assert_eq!(m.tok.decode(&[19556, 4_000_000_000]), "Hello");
}

#[test]
fn incremental_decoding_holds_back_split_characters() {
    let Some(m) = model() else { return };
    let text = "Thumbs 👍🏽, flag 🇫🇷, family 👨‍👩‍👧‍👦, 日本語 ✓";
    let ids = m.tok.encode(text, false).unwrap();
    let mut dec = IncrementalDecoder::new(m.tok.clone());
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        let chunk = dec.push(id);
        assert!(
            !chunk.contains('\u{FFFD}'),
            "emitted a broken character after token {id}: {chunk:?}"
        );
        if chunk.is_empty() && dec.pending_bytes() > 0 {
            held_back += 1;
        }
        out.push_str(&chunk);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
    assert!(held_back > 0, "expected emoji bytes split across tokens");

    // A stream cut inside a character flushes one replacement character.
    let one = m.tok.encode("👍", false).unwrap();
    assert!(one.len() > 1);
    let mut dec = IncrementalDecoder::new(m.tok.clone());
    assert_eq!(dec.push(one[0]), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    assert_eq!(m.tok.decode(&one[..1]), "\u{FFFD}");

    // Specials are skipped by default and rendered on request.
    let mut dec = IncrementalDecoder::with_special(m.tok.clone(), true);
    assert_eq!(dec.push(2), "<|im_end|>");
    let mut dec = IncrementalDecoder::new(m.tok.clone());
    assert_eq!(dec.push(2), "");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn decode_of_encode_is_identity(s in any::<String>()) {
        if let Some(m) = model() {
            let ids = m.tok.encode(&s, false).unwrap();
            prop_assert_eq!(m.tok.decode(&ids), s);
        }
    }

    #[test]
    fn decode_of_encode_is_identity_on_mixed_text(
        parts in proptest::collection::vec(prop_oneof![
            "[a-zA-Z]{1,8}", "[0-9]{1,6}", "[ \t\r\n]{1,4}", "[.,;:!?'\"()<>|-]{1,3}",
            "[à-ÿ]{1,4}", "[а-я]{1,5}", "[一-龥]{1,3}", "[😀-🙏]{1,2}", Just("👍🏽".to_string()),
            Just("<|im_end|>".to_string()), Just("'re".to_string()),
        ], 0..20)
    ) {
        if let Some(m) = model() {
            let s: String = parts.concat();
            let ids = m.tok.encode(&s, false).unwrap();
            prop_assert_eq!(m.tok.decode(&ids), s);
        }
    }

    /// Streaming any IDs (even ones that make invalid UTF-8) gives exactly
    /// the lossy decode of the whole sequence.
    #[test]
    fn incremental_equals_full_decode(ids in proptest::collection::vec(0u32..49_200, 0..40), with_special in any::<bool>()) {
        if let Some(m) = model() {
            let mut dec = IncrementalDecoder::with_special(m.tok.clone(), with_special);
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&dec.push(id));
            }
            out.push_str(&dec.finish());
            prop_assert_eq!(out, m.tok.decode_with_special(&ids, with_special));
        }
    }
}

#[test]
fn hf_tokenizer_json_export_round_trips() {
    let Some(m) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        m.tok.to_tokenizer_json().unwrap(),
    )
    .unwrap();
    let cfg = serde_json::json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": false});
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let hf = Tokenizer::from_tokenizer_json(dir.path()).unwrap();
    assert_eq!(hf.vocab_size(), m.tok.vocab_size());
    assert_eq!(
        (hf.bos_id(), hf.eos_id(), hf.add_bos()),
        (Some(1), Some(2), false)
    );
    for id in 0..m.tok.vocab_size() as u32 {
        assert_eq!(hf.token_bytes(id), m.tok.token_bytes(id), "id {id}");
        assert_eq!(hf.is_special(id), m.tok.is_special(id), "id {id}");
    }
    for (text, special, _) in LLAMACPP_IDS {
        assert_eq!(hf.encode(text, true).unwrap(), *special, "{text:?}");
        assert_eq!(
            hf.encode(text, false).unwrap(),
            m.tok.encode(text, false).unwrap(),
            "{text:?}"
        );
    }
    // The file path works as well as the folder.
    assert_eq!(
        Tokenizer::from_tokenizer_json(&dir.path().join("tokenizer.json"))
            .unwrap()
            .vocab_size(),
        49152
    );
    let e = Tokenizer::from_tokenizer_json(&dir.path().join("missing.json")).unwrap_err();
    assert_eq!(e.label(), "tokenizer_load");
}

// ---------------------------------------------------------------------------
// Chat template

const SMOL_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

#[test]
fn smollm2_template_without_system_adds_default() {
    let Some(m) = model() else { return };
    let text = m
        .template
        .render(&[ChatMessage::user("Hi there")], true)
        .unwrap();
    assert_eq!(
        text,
        format!("{SMOL_SYSTEM}<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    );
    let text = m
        .template
        .render(&[ChatMessage::user("Hi there")], false)
        .unwrap();
    assert_eq!(
        text,
        format!("{SMOL_SYSTEM}<|im_start|>user\nHi there<|im_end|>\n")
    );
}

#[test]
fn smollm2_template_with_system_and_multi_turn() {
    let Some(m) = model() else { return };
    let msgs = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("Hello! 👋"),
        ChatMessage::user("Count: 1, 2, 3?"),
    ];
    let text = m.template.render(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! 👋<|im_end|>\n\
         <|im_start|>user\nCount: 1, 2, 3?<|im_end|>\n<|im_start|>assistant\n"
    );
    // No system message, several turns: the default system goes first, once.
    let text = m.template.render(&msgs[1..], true).unwrap();
    assert!(text.starts_with(SMOL_SYSTEM));
    assert_eq!(text.matches("<|im_start|>system").count(), 1);
    // Content is data, not template: Jinja syntax in it is not evaluated.
    let text = m
        .template
        .render(&[ChatMessage::system("{{ 1 + 1 }} {% if %}")], false)
        .unwrap();
    assert_eq!(text, "<|im_start|>system\n{{ 1 + 1 }} {% if %}<|im_end|>\n");
    // And the rendered prompt tokenizes with the special tokens as single IDs.
    let ids = m
        .tok
        .encode(
            &m.template.render(&[ChatMessage::user("Hi")], true).unwrap(),
            true,
        )
        .unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert!(ids.ends_with(&[1, 520, 9531, 198]), "{ids:?}");
}

#[test]
fn template_variables_and_messages_from_json() {
    let t = ChatTemplate::from_str(
        r"{{ bos_token }}{% for m in messages %}{% if loop.first %}[first]{% endif %}{{ m.role|upper }}: {{ m.content.strip() }}{% if not loop.last %}{{ '\n' }}{% endif %}{% endfor %}{{ eos_token }}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let msgs: Vec<ChatMessage> = serde_json::from_str(
        r#"[{"role":"user","content":"  a  "},{"role":"assistant","content":"b"}]"#,
    )
    .unwrap();
    assert_eq!(
        t.render(&msgs, false).unwrap(),
        "<s>[first]USER: a\nASSISTANT: b</s>"
    );
}

// ---------------------------------------------------------------------------
// Synthetic GGUF tokenizers (no model needed)

fn byte_level_vocab() -> Vec<String> {
    // GPT-2's byte -> char map, in byte order.
    let direct = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut n = 0;
    (0u32..256)
        .map(|b| {
            if direct(b) {
                char::from_u32(b).unwrap().to_string()
            } else {
                n += 1;
                char::from_u32(0x100 + n - 1).unwrap().to_string()
            }
        })
        .collect()
}

fn tiny_gguf(dir: &Path, pre: Option<&str>) -> PathBuf {
    let mut tokens = vec!["<|end|>".to_string()];
    tokens.extend(byte_level_vocab());
    tokens.extend(["Ġt", "he", "Ġthe", "12"].map(String::from));
    let mut types = vec![MetaValue::I32(3)];
    types.extend(std::iter::repeat_n(MetaValue::I32(1), tokens.len() - 1));
    let mut meta = vec![
        ("tokenizer.ggml.model", MetaValue::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        ),
        ("tokenizer.ggml.token_type", MetaValue::Array(types)),
        (
            "tokenizer.ggml.merges",
            MetaValue::Array(
                ["Ġ t", "h e", "Ġt he", "1 2"]
                    .map(|s| MetaValue::String(s.into()))
                    .to_vec(),
            ),
        ),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(0)),
    ];
    if let Some(p) = pre {
        meta.push(("tokenizer.ggml.pre", MetaValue::String(p.into())));
    }
    let path = dir.join(format!("tiny-{}.gguf", pre.unwrap_or("none")));
    write_gguf(&path, &meta, &[]).unwrap();
    path
}

#[test]
fn synthetic_gguf_tokenizers_follow_the_pre_type() {
    let dir = tempfile::tempdir().unwrap();
    let open = |pre| Tokenizer::from_gguf(&GgufFile::open(&tiny_gguf(dir.path(), pre)).unwrap());
    // IDs: 0 is <|end|>, byte b is b + 1, then the merged tokens.
    let (the, t12, end, b1, b2) = (259, 260, 0, 0x31 + 1, 0x32 + 1);

    // gpt2: "12" is one pre-token and merges; smollm: digits are split first.
    let gpt2 = open(Some("gpt-2")).unwrap();
    assert_eq!(
        gpt2.encode(" the12<|end|>", true).unwrap(),
        vec![the, t12, end]
    );
    let smol = open(Some("smollm")).unwrap();
    assert_eq!(
        smol.encode(" the12<|end|>", true).unwrap(),
        vec![the, b1, b2, end]
    );
    assert_eq!(
        smol.decode_with_special(&[the, b1, b2, end], true),
        " the12<|end|>"
    );
    assert_eq!(smol.eos_id(), Some(0));
    assert_eq!(smol.bos_id(), None);
    // llama.cpp's "default" splits digit runs in threes after the GPT-2 regex.
    let default = open(Some("default")).unwrap();
    assert_eq!(default.encode(" the12", false).unwrap(), vec![the, t12]);
    // A missing pre type is llama.cpp's "default".
    assert_eq!(open(None).unwrap().pre_tokenizer(), "default");

    let e = open(Some("some-new-model")).unwrap_err();
    assert!(
        matches!(&e, TokenizerError::UnsupportedPreTokenizer { pre } if pre == "some-new-model"),
        "{e}"
    );
    assert_eq!(e.label(), "unsupported_pre_tokenizer");
}

#[test]
fn synthetic_gguf_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, meta: Vec<(&str, MetaValue)>| {
        let p = dir.path().join(name);
        write_gguf(&p, &meta, &[]).unwrap();
        Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err()
    };
    let s = |v: &str| MetaValue::String(v.into());
    let e = write("rwkv.gguf", vec![("tokenizer.ggml.model", s("rwkv"))]);
    assert_eq!(e.label(), "unsupported_tokenizer_model");
    // SentencePiece is supported; without a token list it is a missing key.
    let e = write("spm.gguf", vec![("tokenizer.ggml.model", s("llama"))]);
    assert_eq!(e.label(), "missing_key", "{e}");
    let e = write(
        "nomerges.gguf",
        vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("gpt2")),
            ("tokenizer.ggml.tokens", MetaValue::Array(vec![s("a")])),
        ],
    );
    assert_eq!(e.label(), "missing_key", "{e}");
    let e = write(
        "badmerge.gguf",
        vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("gpt2")),
            ("tokenizer.ggml.tokens", MetaValue::Array(vec![s("a")])),
            ("tokenizer.ggml.merges", MetaValue::Array(vec![s("ab")])),
        ],
    );
    assert!(
        matches!(&e, TokenizerError::BadMerge { index: 0, .. }),
        "{e}"
    );
    let e = write(
        "badeos.gguf",
        vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("gpt2")),
            ("tokenizer.ggml.tokens", MetaValue::Array(vec![s("a")])),
            ("tokenizer.ggml.merges", MetaValue::Array(vec![])),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(5)),
        ],
    );
    assert!(
        matches!(
            &e,
            TokenizerError::TokenIdOutOfRange {
                id: 5,
                vocab_size: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = write(
        "types.gguf",
        vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("gpt2")),
            ("tokenizer.ggml.tokens", MetaValue::Array(vec![s("a")])),
            (
                "tokenizer.ggml.token_type",
                MetaValue::Array(vec![MetaValue::I32(1), MetaValue::I32(1)]),
            ),
            ("tokenizer.ggml.merges", MetaValue::Array(vec![])),
        ],
    );
    assert_eq!(e.label(), "length_mismatch");
}

// ---------------------------------------------------------------------------
// llama.cpp golden file

fn golden_path() -> PathBuf {
    std::env::var_os("BATON_LLAMACPP_GOLDEN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/llamacpp.json"))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("token list")
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}

/// Checks every `tokenize_only` entry; returns (cases, mismatches) and prints each mismatch.
fn check_tokenize_only(tok: &Tokenizer, doc: &serde_json::Value) -> (usize, Vec<String>) {
    let mut bad = Vec::new();
    let cases = doc["tokenize_only"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let ours = tok.encode(text, true).unwrap();
        if ours != ids(&c["tokens"]) {
            bad.push(format!(
                "{text:?} (special): ours {ours:?} llama.cpp {:?}",
                ids(&c["tokens"])
            ));
        }
        if let Some(plain) = c.get("tokens_special_false") {
            let ours = tok.encode(text, false).unwrap();
            if ours != ids(plain) {
                bad.push(format!(
                    "{text:?} (plain): ours {ours:?} llama.cpp {:?}",
                    ids(plain)
                ));
            }
        }
    }
    (cases.len(), bad)
}

#[test]
fn llamacpp_golden_prompts_and_tokens() {
    let Some(m) = model() else { return };
    let path = golden_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "skipped: {} not found (scripts/llamacpp/golden.py writes it)",
            path.display()
        );
        return;
    };
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut bad = Vec::new();
    let cases = doc["cases"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for c in cases {
        let name = c["name"].as_str().unwrap_or("?");
        let prompt = c["prompt_text"].as_str().expect("prompt_text");
        if let Some(msgs) = c.get("messages") {
            let msgs: Vec<ChatMessage> = serde_json::from_value(msgs.clone()).unwrap();
            let ours = m.template.render(&msgs, true).unwrap();
            if ours != prompt {
                bad.push(format!(
                    "{name}: rendered prompt differs:\n ours {ours:?}\n gold {prompt:?}"
                ));
            }
        }
        let gold = ids(&c["prompt_tokens"]);
        let ours = m.tok.encode(prompt, true).unwrap();
        if ours != gold {
            let at = ours
                .iter()
                .zip(&gold)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(gold.len()));
            bad.push(format!(
                "{name}: prompt tokens differ at {at}: ours {:?} llama.cpp {:?}",
                &ours[at..(at + 8).min(ours.len())],
                &gold[at..(at + 8).min(gold.len())]
            ));
        }
        if m.tok.decode_with_special(&gold, true) != prompt {
            bad.push(format!(
                "{name}: decoding llama.cpp's tokens does not give the prompt back"
            ));
        }
    }
    let (n_tok, tok_bad) = check_tokenize_only(&m.tok, &doc);
    bad.extend(tok_bad);
    eprintln!(
        "golden: {} chat cases, {n_tok} tokenize cases, {} mismatches",
        cases.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn extra_llamacpp_differential_file() {
    let Some(path) = std::env::var_os("BATON_TOKENIZER_DIFF") else {
        return;
    };
    let Some(m) = model() else { return };
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (n, bad) = check_tokenize_only(&m.tok, &doc);
    eprintln!("differential: {n} texts, {} mismatches", bad.len());
    for b in bad.iter().take(20) {
        eprintln!("  {b}");
    }
    assert!(bad.is_empty());
}
