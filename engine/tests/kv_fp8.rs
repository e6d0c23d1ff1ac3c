//! FP8 (E4M3) KV: half the bytes of f16 per token, at a cost in accuracy that
//! this test bounds on the default model. Logits over a 300-token chat prompt
//! with fp8 KV are compared with f16 KV at every 10th position: their Pearson
//! correlation and the share of positions with the same top-1 token, beside
//! bf16 KV as the yardstick of an accepted rounding. An engine with fp8 KV
//! holds twice the tokens of an f16 one in the same memory and returns every
//! block.

mod common;

use baton_engine::EngineConfig;
use baton_kernels::KvDtype;
use baton_text::FinishReason;
use common::pearson;

fn argmax(v: &[f32]) -> usize {
    baton_kernels::ops::argmax(v)
}

#[test]
fn fp8_kv_logits_stay_close_to_f16() {
    let Some((backend, loaded)) = common::load(2) else { return };
    let text = "<|im_start|>system\nYou are a careful assistant who answers in full sentences.<|im_end|>\n<|im_start|>user\n\
        A relay team passes a baton between runners; each runner covers one leg and hands the baton over inside a marked zone. \
        Explain why the handover zone matters, what goes wrong when a runner starts too early or too late, how teams practise \
        the exchange, and what the rules say about dropping the baton. Then compare this with how a kitchen passes plates from \
        the cook to the waiter, and list three lessons a software team could take from both for handing work between people.<|im_end|>\n\
        <|im_start|>assistant\nThe handover zone matters because";
    let tokens = loaded.tokenizer.encode(text, false).unwrap();
    assert!(tokens.len() >= 150, "{} tokens", tokens.len());
    let rows: Vec<usize> = (9..tokens.len()).step_by(10).collect();
    let run = |dtype| common::logits_at(&backend, &loaded.model, &tokens, &rows, dtype);
    let (f16, bf16, fp8) = (run(KvDtype::F16), run(KvDtype::BF16), run(KvDtype::F8E4M3));
    let stats = |other: &[Vec<f32>]| {
        let worst = f16.iter().zip(other).map(|(a, b)| pearson(a, b)).fold(1.0f64, f64::min);
        let same = f16.iter().zip(other).filter(|(a, b)| argmax(a) == argmax(b)).count() as f64 / rows.len() as f64;
        (worst, same)
    };
    let ((bf_r, bf_top), (f8_r, f8_top)) = (stats(&bf16), stats(&fp8));
    println!("{} positions: bf16 worst r {bf_r:.5}, top-1 {bf_top:.2}; fp8 worst r {f8_r:.5}, top-1 {f8_top:.2}", rows.len());
    assert!(f8_r >= 0.98, "fp8 KV: worst Pearson r {f8_r}");
    assert!(f8_top >= 0.8, "fp8 KV: top-1 agrees at {f8_top} of positions");
}

#[test]
fn an_fp8_engine_holds_twice_the_tokens_and_returns_every_block() {
    let config = |kv_dtype| EngineConfig { kv_dtype, kv_memory_bytes: 256 << 20, ..EngineConfig::default() };
    let Some(f16) = common::engine(config(KvDtype::F16)) else { return };
    let fp8 = common::engine(config(KvDtype::F8E4M3)).unwrap();
    assert_eq!(fp8.info.kv_blocks, 2 * f16.info.kv_blocks);
    let prompt = common::chat_prompt(&fp8, "You are brief.", "Name three colours.");
    let out = common::collect(fp8.submit(common::request(prompt, "u", 16)).unwrap());
    assert_eq!(out.reason, FinishReason::Length);
    assert_eq!(out.tokens.len(), 16);
    common::assert_no_leaks(&fp8);
}
