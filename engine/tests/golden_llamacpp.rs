//! Correctness against llama.cpp, an independent implementation, on the
//! default model. The golden file is produced by scripts/llamacpp/golden.py.
//!
//! For every case: the chat template renders the same text, the tokenizer
//! gives the same IDs, the first position's full-vocabulary logits correlate
//! with llama.cpp's at Pearson >= 0.999 on average (>= 0.998 each), and, teacher-forced over
//! llama.cpp's 32 greedy tokens, Baton's top-1 equals llama.cpp's token
//! wherever Baton's top-1 beats its top-2 by at least 1.0 logit.

mod common;
use common::pearson;

use baton_kernels::KvDtype;
use baton_text::chat_template::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    cases: Vec<Case>,
    #[serde(default)]
    tokenize_only: Vec<TokCase>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    prompt_text: String,
    prompt_tokens: Vec<u32>,
    first_logits_f32_b64: String,
    greedy_tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct TokCase {
    text: String,
    tokens: Vec<u32>,
}

fn golden() -> Golden {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/llamacpp.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("golden file")).expect("golden json")
}

fn b64_f32(s: &str) -> Vec<f32> {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut rev = [255u8; 256];
    for (i, &c) in T.iter().enumerate() {
        rev[c as usize] = i as u8;
    }
    let mut bytes = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for &c in s.as_bytes() {
        if c == b'=' || rev[c as usize] == 255 {
            continue;
        }
        acc = (acc << 6) | rev[c as usize] as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            bytes.push((acc >> bits) as u8);
        }
    }
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}


#[test]
fn matches_llamacpp_on_every_golden_case() {
    let Some((backend, loaded)) = common::load(2) else { return };
    let g = golden();
    assert!(g.cases.len() >= 8, "need at least 8 golden cases");
    for t in &g.tokenize_only {
        assert_eq!(loaded.tokenizer.encode(&t.text, true).unwrap(), t.tokens, "tokenize {:?}", t.text);
    }
    let mut worst = 1.0f64;
    let mut pearsons = Vec::new();
    for case in &g.cases {
        let rendered = loaded.template.render(&case.messages, true).unwrap();
        assert_eq!(rendered, case.prompt_text, "{}: template", case.name);
        let ids = loaded.tokenizer.encode(&case.prompt_text, true).unwrap();
        assert_eq!(ids, case.prompt_tokens, "{}: token IDs", case.name);

        let mut seq = ids.clone();
        seq.extend(&case.greedy_tokens);
        let n = ids.len();
        // Logits after the prompt and after each teacher-forced token but the last.
        let rows: Vec<usize> = (n - 1..n - 1 + case.greedy_tokens.len()).collect();
        let logits = common::logits_at(&backend, &loaded.model, &seq[..seq.len() - 1], &rows, KvDtype::F16);

        let reference = b64_f32(&case.first_logits_f32_b64);
        assert_eq!(reference.len(), logits[0].len(), "{}: vocabulary", case.name);
        let r = pearson(&logits[0], &reference);
        worst = worst.min(r);
        eprintln!("{}: prompt {} tokens, first-position Pearson {r:.5}", case.name, n);
        pearsons.push(r);
        assert!(r >= 0.998, "{}: first-position logits Pearson {r:.5} < 0.998", case.name);

        for (i, (row, &want)) in logits.iter().zip(&case.greedy_tokens).enumerate() {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.select_nth_unstable_by(1, |&a, &b| row[b].total_cmp(&row[a]));
            let (top1, top2) = if row[idx[0]] >= row[idx[1]] { (idx[0], idx[1]) } else { (idx[1], idx[0]) };
            let margin = row[top1] - row[top2];
            if margin >= 1.0 {
                assert_eq!(top1 as u32, want, "{}: position {i}: baton top-1 {top1} (margin {margin:.2}) vs llama.cpp {want}", case.name);
            }
        }
    }
    let mean = pearsons.iter().sum::<f64>() / pearsons.len() as f64;
    eprintln!("first-position Pearson over {} cases: mean {mean:.6}, worst {worst:.6}", g.cases.len());
    // llama.cpp against itself with f32 instead of f16 KV correlates at
    // 0.9991-0.9995 on these prompts: single cases sit at the noise floor of
    // 8-bit activations, so the mean carries the 0.999 bar and each case 0.998.
    assert!(mean >= 0.999, "mean first-position Pearson {mean:.5} < 0.999");
}
