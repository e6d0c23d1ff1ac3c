//! Both tokenizer kinds against llama.cpp on the tokenizer corpus
//! (tests/golden/tokenizer_corpus.json, 400+ texts: whitespace runs, digits,
//! code, many scripts, emoji, invalid-looking text, special-token texts, very
//! long words), plus the SentencePiece tokenizer on tiny synthetic
//! vocabularies that need no model file.
//!
//! Expected IDs: tests/golden/tokenizer_llamacpp.json, written by
//! scripts/llamacpp/tokenizer_golden.py from llama.cpp itself. A model file
//! that is absent skips its half (run scripts/fetch-model.sh [gemma3]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use baton_text::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use baton_text::gguf::writer::write_gguf;
use baton_text::gguf::{GgufFile, MetaValue};
use baton_text::tokenizer::{IncrementalDecoder, Tokenizer};
use serde_json::Value;

mod common;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        let text = std::fs::read_to_string(golden_dir().join("tokenizer_llamacpp.json"))
            .expect("tests/golden/tokenizer_llamacpp.json (scripts/llamacpp/tokenizer_golden.py)");
        serde_json::from_str(&text).expect("fixture JSON")
    })
}

fn load(path: Option<PathBuf>) -> Option<Arc<Tokenizer>> {
    let path = path?;
    let t0 = std::time::Instant::now();
    let g = GgufFile::open(&path).expect("open model");
    let t1 = std::time::Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer from gguf");
    eprintln!(
        "{}: GGUF opened in {:?}, tokenizer ({} tokens) built in {:?}",
        path.display(),
        t1 - t0,
        tok.vocab_size(),
        t1.elapsed()
    );
    Some(Arc::new(tok))
}

fn smollm2() -> Option<&'static Arc<Tokenizer>> {
    static T: OnceLock<Option<Arc<Tokenizer>>> = OnceLock::new();
    T.get_or_init(|| load(common::model_path())).as_ref()
}

fn gemma3() -> Option<&'static Arc<Tokenizer>> {
    static T: OnceLock<Option<Arc<Tokenizer>>> = OnceLock::new();
    T.get_or_init(|| load(common::gemma_path())).as_ref()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token list")
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}

/// Every corpus text through `tok`; returns the mismatches, described.
fn compare(tok: &Tokenizer, name: &str) -> Vec<String> {
    let doc = fixture();
    let m = &doc["models"][name];
    let texts = doc["texts"].as_array().expect("texts");
    let special = m["special"].as_array().expect("special");
    assert_eq!(
        texts.len(),
        special.len(),
        "{name}: fixture is inconsistent"
    );
    let mut bad = Vec::new();
    for (i, (t, want)) in texts.iter().zip(special).enumerate() {
        let text = t.as_str().expect("text");
        let want = ids(want);
        let got = tok.encode(text, true).unwrap();
        if got != want {
            bad.push(format!(
                "#{i} {text:?} (parse_special): ours {got:?} llama.cpp {want:?}"
            ));
        }
        let want_plain = m["plain"]
            .get(i.to_string())
            .map(ids)
            .unwrap_or(want.clone());
        let got = tok.encode(text, false).unwrap();
        if got != want_plain {
            bad.push(format!(
                "#{i} {text:?} (plain): ours {got:?} llama.cpp {want_plain:?}"
            ));
        }
        let want_text = m["decoded"]
            .get(i.to_string())
            .and_then(Value::as_str)
            .unwrap_or(text);
        let got = tok.decode_with_special(&want, true);
        if got != want_text {
            bad.push(format!("#{i} decode: ours {got:?} llama.cpp {want_text:?}"));
        }
    }
    eprintln!("{name}: {} texts, {} mismatches", texts.len(), bad.len());
    bad
}

#[test]
fn fixture_is_the_corpus() {
    let corpus: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir().join("tokenizer_corpus.json")).unwrap(),
    )
    .unwrap();
    let n = corpus.as_array().unwrap().len();
    assert!(n >= 300, "the corpus has {n} texts");
    assert_eq!(
        fixture()["texts"],
        corpus,
        "tokenizer_llamacpp.json is stale: rerun scripts/llamacpp/tokenizer_golden.py"
    );
}

#[test]
fn smollm2_bpe_matches_llamacpp_on_the_corpus() {
    let Some(tok) = smollm2() else { return };
    let m = &fixture()["models"]["smollm2"];
    assert_eq!(m["tokenizer_model"], "gpt2");
    assert_eq!(m["n_vocab"].as_u64(), Some(tok.vocab_size() as u64));
    let bad = compare(tok, "smollm2");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gemma3_spm_matches_llamacpp_on_the_corpus() {
    let Some(tok) = gemma3() else { return };
    let m = &fixture()["models"]["gemma3"];
    assert_eq!(m["tokenizer_model"], "llama");
    assert_eq!(m["n_vocab"].as_u64(), Some(tok.vocab_size() as u64));
    let bad = compare(tok, "gemma3");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gemma3_vocabulary_facts() {
    let Some(t) = gemma3() else { return };
    assert_eq!(t.model(), "llama");
    assert_eq!(t.pre_tokenizer(), "spm");
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.add_bos()),
        (Some(2), Some(1), true)
    );
    assert_eq!(t.token_id("<start_of_turn>"), Some(105));
    assert_eq!(t.token_id("<end_of_turn>"), Some(106));
    // A chat reply ends on <end_of_turn> as well as on <eos> (llama.cpp's EOG set).
    assert!(t.is_end_of_generation(106) && t.is_end_of_generation(1));
    assert!(!t.is_end_of_generation(105) && !t.is_end_of_generation(2));
    assert_eq!(t.token_text(105), Some("<start_of_turn>"));
    // Control tokens are special; user-defined ones ("\n", "[multimodal]") are not.
    assert!(t.is_special(105) && t.is_special(106) && t.is_special(2));
    assert!(!t.is_special(107) && !t.is_special(5) && !t.is_special(238));
    assert_eq!(t.token_bytes(107).as_deref(), Some(&b"\n"[..]));
    // Byte-fallback tokens decode to their byte.
    assert_eq!(t.token_id("<0x00>"), Some(238));
    assert_eq!(t.token_bytes(238).as_deref(), Some(&[0u8][..]));
    assert_eq!(t.token_bytes(238 + 0xff).as_deref(), Some(&[0xffu8][..]));
    assert_eq!(t.token_bytes(262_144), None);
    assert!(t.to_tokenizer_json().is_err());
}

#[test]
fn gemma3_chat_framing_and_streaming() {
    let Some(t) = gemma3() else { return };
    let prompt = "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n";
    let ids = t.encode(prompt, true).unwrap();
    assert_eq!(ids[..2], [2, 105]);
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 2);
    assert!(ids.contains(&106));
    // Without parse_special the markers are plain text.
    let plain = t.encode(prompt, false).unwrap();
    assert!(!plain.contains(&105) && !plain.contains(&2));
    assert_eq!(t.decode_with_special(&ids, true), prompt);
    assert_eq!(t.decode(&ids), "user\nHi there\nmodel\n");

    // Streaming: a split character is held back, never emitted broken.
    let text = "Thumbs 👍🏽, flag 🇫🇷, 日本語 ✓ \u{fffd} 𝔘𝔫𝔦";
    let ids = t.encode(text, false).unwrap();
    let mut dec = IncrementalDecoder::new(t.clone());
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.push(id));
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
    // Any ID sequence streams to exactly the full decode.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..200 {
        let ids: Vec<u32> = (0..24)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 600) as u32
            })
            .collect();
        let mut dec = IncrementalDecoder::with_special(t.clone(), true);
        let mut s = String::new();
        for &id in &ids {
            s.push_str(&dec.push(id));
        }
        s.push_str(&dec.finish());
        assert_eq!(s, t.decode_with_special(&ids, true), "{ids:?}");
    }
}

#[test]
fn gemma3_encoding_cost() {
    let Some(t) = gemma3() else { return };
    // A few KB of mixed prose and code (printed, not asserted: timings are noisy).
    let doc = fixture();
    let text: String = doc["texts"].as_array().unwrap()[..200]
        .iter()
        .filter_map(Value::as_str)
        .collect::<Vec<_>>()
        .join(" ");
    let text = &text[..text.floor_char_boundary(4096)];
    let runs = 50;
    let t0 = std::time::Instant::now();
    let mut n = 0;
    for _ in 0..runs {
        n = t.encode(text, true).unwrap().len();
    }
    eprintln!(
        "gemma3: {} bytes -> {n} tokens in {:?} per encode",
        text.len(),
        t0.elapsed() / runs
    );
}

// ---------------------------------------------------------------------------
// Synthetic SentencePiece vocabularies (no model needed)

const S: &str = "\u{2581}";

/// (text, score, type) -> a GGUF with only tokenizer metadata.
fn spm_gguf(
    dir: &Path,
    name: &str,
    vocab: &[(&str, f32, i32)],
    extra: Vec<(&str, MetaValue)>,
) -> Result<Tokenizer, baton_text::tokenizer::TokenizerError> {
    let mut meta = vec![
        ("tokenizer.ggml.model", MetaValue::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            MetaValue::Array(
                vocab
                    .iter()
                    .map(|(t, _, _)| MetaValue::String(t.to_string()))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.scores",
            MetaValue::Array(vocab.iter().map(|&(_, s, _)| MetaValue::F32(s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            MetaValue::Array(vocab.iter().map(|&(_, _, t)| MetaValue::I32(t)).collect()),
        ),
    ];
    meta.extend(extra);
    let path = dir.join(format!("{name}.gguf"));
    write_gguf(&path, &meta, &[]).unwrap();
    Tokenizer::from_gguf(&GgufFile::open(&path).unwrap())
}

/// `<unk> <s> </s>`, the 256 byte tokens, then `extra`.
fn base_vocab(extra: &[(&'static str, f32, i32)]) -> Vec<(String, f32, i32)> {
    let mut v: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    v.extend((0..256).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    v.extend(extra.iter().map(|&(t, s, ty)| (t.to_string(), s, ty)));
    v
}

fn as_refs(v: &[(String, f32, i32)]) -> Vec<(&str, f32, i32)> {
    v.iter().map(|(t, s, ty)| (t.as_str(), *s, *ty)).collect()
}

/// ID of the `k`-th extra token of [`base_vocab`].
const fn extra(k: u32) -> u32 {
    259 + k
}

fn byte(b: u8) -> u32 {
    3 + b as u32
}

#[test]
fn synthetic_spm_merges_by_score_and_falls_back_to_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ab = format!("{S}ab");
    let v = base_vocab(&[
        (S, -1.0, 1),      // 0
        ("a", -2.0, 1),    // 1
        ("b", -2.0, 1),    // 2
        ("c", -2.0, 1),    // 3
        ("ab", -5.0, 1),   // 4
        ("bc", -3.0, 1),   // 5: beats "ab" in "abc"
        ("<sep>", 0.0, 4), // 6: user-defined
    ]);
    let mut v = v;
    v.push((ab.clone(), -4.0, 1)); // 7
    let tok = spm_gguf(dir.path(), "merge", &as_refs(&v), vec![]).unwrap();
    assert_eq!(tok.model(), "llama");
    // Defaults of llama.cpp: BOS 1, EOS 2, add_bos and add_space_prefix on.
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.add_bos()),
        (Some(1), Some(2), true)
    );
    // "abc" with a space prefix: ▁ a b c -> "bc" (-3) beats "ab" (-5), and
    // "▁a" is not a token, so ▁ a bc.
    assert_eq!(
        tok.encode("abc", false).unwrap(),
        vec![extra(0), extra(1), extra(5)]
    );
    // "ab": ▁ a b -> "ab" (-5) then "▁ab" (-4).
    assert_eq!(tok.encode("ab", false).unwrap(), vec![extra(7)]);
    // Unknown characters fall back to their UTF-8 bytes.
    assert_eq!(
        tok.encode("é", false).unwrap(),
        vec![extra(0), byte(0xc3), byte(0xa9)]
    );
    // Spaces are ▁; a user-defined token is cut out even without
    // parse_special, and the text after it gets the space prefix again.
    assert_eq!(
        tok.encode("a b<sep>c", false).unwrap(),
        vec![
            extra(0),
            extra(1),
            extra(0),
            extra(2),
            extra(6),
            extra(0),
            extra(3)
        ]
    );
    // Control tokens only with parse_special.
    assert_eq!(tok.encode("<s>", true).unwrap(), vec![1]);
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
    let plain = tok.encode("<s>", false).unwrap();
    assert!(!plain.contains(&1), "{plain:?}");
    // Decoding drops the prefixed space of the first token only, like
    // llama.cpp's detokenize; streaming does the same.
    let ids = tok.encode("ab ab", false).unwrap();
    assert_eq!(tok.decode(&ids), "ab ab");
    let mut dec = IncrementalDecoder::new(Arc::new(tok));
    let streamed: String = ids.iter().map(|&i| dec.push(i)).collect();
    assert_eq!(streamed + &dec.finish(), "ab ab");
}

#[test]
fn synthetic_spm_specials_go_longest_first_over_the_whole_text() {
    let dir = tempfile::tempdir().unwrap();
    let no_prefix = || vec![("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false))];
    let v = base_vocab(&[
        ("<ab>", 0.0, 4),     // 0
        ("b><c", 0.0, 4),     // 1: same length as <ab>, overlapping it
        ("<ab><c>x", 0.0, 4), // 2: longest
    ]);
    let tok = spm_gguf(dir.path(), "specials", &as_refs(&v), no_prefix()).unwrap();
    assert_eq!(tok.encode("<ab><c>x", true).unwrap(), vec![extra(2)]);
    // Equal lengths: the lower ID is cut first and "b><c" no longer fits.
    let ids = tok.encode("<ab><c>y", true).unwrap();
    assert_eq!(
        ids,
        vec![extra(0), byte(b'<'), byte(b'c'), byte(b'>'), byte(b'y')]
    );
    // Longest first over the whole text, not leftmost-longest: "yzw" is cut
    // before the shorter "xy", which then no longer fits.
    let v2 = base_vocab(&[("xy", 0.0, 4), ("yzw", 0.0, 4)]);
    let tok2 = spm_gguf(dir.path(), "order", &as_refs(&v2), no_prefix()).unwrap();
    assert_eq!(
        tok2.encode("xyzw", false).unwrap(),
        vec![byte(b'x'), extra(1)]
    );
    assert_eq!(
        tok2.encode("xyxyzw", false).unwrap(),
        vec![extra(0), byte(b'x'), extra(1)]
    );
}

#[test]
fn synthetic_spm_phi3_specials_eat_following_whitespace() {
    let dir = tempfile::tempdir().unwrap();
    let v = base_vocab(&[
        (S, 0.0, 1),
        ("a", 0.0, 1),
        ("b", 0.0, 1),
        ("<|end|>", 0.0, 3),
    ]);
    let phi3 = spm_gguf(
        dir.path(),
        "phi3",
        &as_refs(&v),
        vec![("general.name", MetaValue::String("Phi-3 mini 4k".into()))],
    )
    .unwrap();
    let other = spm_gguf(dir.path(), "other", &as_refs(&v), vec![]).unwrap();
    let end = extra(3);
    assert_eq!(
        phi3.encode("a<|end|> \t\n b", true).unwrap(),
        vec![extra(0), extra(1), end, extra(0), extra(2)]
    );
    assert_eq!(
        other.encode("a<|end|> b", true).unwrap(),
        vec![extra(0), extra(1), end, extra(0), extra(0), extra(2)]
    );
}

#[test]
fn synthetic_spm_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut bad_byte = base_vocab(&[]);
    bad_byte[10].0 = "<0xZZ>".into();
    let e = spm_gguf(dir.path(), "badbyte", &as_refs(&bad_byte), vec![]).unwrap_err();
    assert_eq!(e.label(), "bad_byte_token", "{e}");
    let dup = base_vocab(&[("x", 0.0, 1), ("x", 0.0, 1)]);
    let e = spm_gguf(dir.path(), "dup", &as_refs(&dup), vec![]).unwrap_err();
    assert_eq!(e.label(), "duplicate_token", "{e}");
    assert!(e.to_string().contains("\"x\""), "{e}");
    let e = spm_gguf(
        dir.path(),
        "bos",
        &as_refs(&base_vocab(&[])),
        vec![("tokenizer.ggml.bos_token_id", MetaValue::U32(9999))],
    )
    .unwrap_err();
    assert_eq!(e.label(), "token_id_out_of_range", "{e}");
    // A byte with no token at all is an encode error, not a panic.
    let tiny = [
        ("<unk>", 0.0, 2),
        ("<s>", 0.0, 3),
        ("</s>", 0.0, 3),
        (S, 0.0, 1),
    ];
    let tok = spm_gguf(dir.path(), "nobytes", &tiny, vec![]).unwrap();
    assert_eq!(tok.encode(" ", false).unwrap(), vec![3, 3]);
    let e = tok.encode("q", false).unwrap_err();
    assert_eq!(e.label(), "no_byte_token", "{e}");
}

// ---------------------------------------------------------------------------
// Gemma 3's chat template (the GGUF we serve has none; the file is Google's)

#[test]
fn gemma3_chat_template_renders_like_jinja2() {
    let src = std::fs::read_to_string(golden_dir().join("gemma3_chat_template.jinja")).unwrap();
    let tmpl = ChatTemplate::from_str(&src, "<bos>", "<eos>").unwrap();
    let cases = fixture()["gemma3_chat"].as_array().expect("gemma3_chat");
    assert!(cases.len() >= 10);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let gen = c["add_generation_prompt"].as_bool().unwrap();
        let ours = tmpl.render(&msgs, gen);
        match (c.get("jinja2").and_then(Value::as_str), ours) {
            (Some(want), Ok(got)) => {
                assert_eq!(got, want, "{name}");
                // The chat path tokenizes the rendered prompt with special tokens.
                if let Some(t) = gemma3() {
                    assert_eq!(t.encode(&got, true).unwrap(), ids(&c["tokens"]), "{name}");
                }
            }
            (None, Err(TemplateError::Raised { message })) => {
                assert_eq!(Some(message.as_str()), c["error"].as_str(), "{name}");
            }
            (want, got) => panic!("{name}: jinja2 {want:?}, ours {got:?}"),
        }
    }
}

#[test]
fn a_model_without_a_template_loads_and_refuses_chat() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notemplate.gguf");
    let vocab = base_vocab(&[]);
    let meta = vec![
        ("tokenizer.ggml.model", MetaValue::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            MetaValue::Array(
                vocab
                    .iter()
                    .map(|(t, _, _)| MetaValue::String(t.clone()))
                    .collect(),
            ),
        ),
    ];
    write_gguf(&path, &meta, &[]).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let tmpl = ChatTemplate::from_gguf(&g).unwrap();
    assert!(!tmpl.is_present());
    assert_eq!(tmpl.source(), "");
    let e = tmpl.render(&[ChatMessage::user("hi")], true).unwrap_err();
    assert_eq!(e.label(), "template_missing");
    assert!(e.to_string().contains("no chat template"), "{e}");
    // A present but broken key is still an error, not "missing".
    let bad = dir.path().join("badtemplate.gguf");
    let mut meta = meta;
    meta.push(("tokenizer.chat_template", MetaValue::U32(7)));
    write_gguf(&bad, &meta, &[]).unwrap();
    assert!(ChatTemplate::from_gguf(&GgufFile::open(&bad).unwrap()).is_err());
}
