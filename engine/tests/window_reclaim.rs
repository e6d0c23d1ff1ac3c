//! Gemma 3's sliding-window layers in a grouped arena: blocks behind every window give
//! their window layers' memory back, and no output changes by a bit for it: the same
//! tokens and log-probabilities as an engine that keeps every layer, on a turn longer
//! than the window, on its warm second turn, chunked, and with sequences competing for
//! the memory.

mod common;

use baton_engine::kv::OwnerId;
use baton_engine::{Engine, EngineConfig, Event, PreemptionMode, Request};
use baton_text::sampling::SamplingParams;
use common::*;

/// Gemma 3 270M: one unit of a grouped arena (three layers of one 16-token block, f16).
const UNIT_BYTES: usize = 3 * 2 * 16 * 256 * 2;

fn gemma_engine(config: EngineConfig) -> Option<Engine> {
    let (backend, loaded) = load_file(&gemma_path()?, 2);
    Some(Engine::start(backend, loaded, config).expect("engine start"))
}

fn config(reclaim: bool, step_tokens: usize, memory: usize, max_context: usize) -> EngineConfig {
    EngineConfig {
        kv_memory_bytes: memory,
        max_context: Some(max_context),
        step_token_budget: step_tokens,
        itl_target: None,
        reclaim_window_layers: reclaim,
        ..EngineConfig::default()
    }
}

/// A turn's tokens, the bits of their log-probabilities, and its cached prompt tokens.
#[derive(Debug, PartialEq)]
struct Turn {
    tokens: Vec<u32>,
    logprobs: Vec<u32>,
    cached: usize,
}

fn submit(e: &Engine, prompt: &[u32], user: &str, n: usize) -> baton_engine::RequestStream {
    let sampling = SamplingParams { max_tokens: n, temperature: 0.0, logprobs: true, ..SamplingParams::default() }.validate().unwrap();
    let req = Request { prompt: prompt.to_vec(), owner: OwnerId::parse(user).unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: true };
    e.submit(req).unwrap()
}

fn finish(mut s: baton_engine::RequestStream) -> Turn {
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        match s.blocking_next().expect("stream ended without a final event") {
            Event::Token(t) => {
                tokens.push(t.id);
                logprobs.push(t.logprob.expect("asked for log-probabilities").to_bits());
            }
            Event::Finished { usage, .. } => return Turn { tokens, logprobs, cached: usage.cached_tokens },
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

fn turn(e: &Engine, prompt: &[u32], user: &str, n: usize) -> Turn {
    finish(submit(e, prompt, user, n))
}

/// About `tokens` tokens of prose (a different one per `seed`).
fn prose(e: &Engine, seed: usize, tokens: usize) -> Vec<u32> {
    let subjects = ["The river", "A lighthouse keeper", "The old mill", "A night train"];
    let mut text = String::new();
    let mut i = 0;
    loop {
        text.push_str(&format!("{} ({}) passes the hour {} and counts what is left of the day. ", subjects[seed % 4], seed, i));
        i += 1;
        let ids = e.tokenizer.encode(&text, true).unwrap();
        if ids.len() >= tokens {
            return ids;
        }
    }
}

#[test]
fn a_conversation_past_the_window_gives_back_memory_and_keeps_every_bit() {
    let memory = 64 << 20;
    let Some(plain) = gemma_engine(config(false, 512, memory, 2048)) else { return };
    let grouped = gemma_engine(config(true, 512, memory, 2048)).unwrap();
    assert!(plain.info.kv_unit_bytes.is_none() && grouped.info.kv_unit_bytes.is_some());
    // Blocks behind the window hold 3 of 18 layers: the same memory addresses
    // about six times the blocks.
    assert!(grouped.info.kv_blocks >= 5 * plain.info.kv_blocks, "{} vs {}", grouped.info.kv_blocks, plain.info.kv_blocks);

    let turn1 = prose(&plain, 0, 700);
    let want1 = turn(&plain, &turn1, "alice", 24);
    let got1 = turn(&grouped, &turn1, "alice", 24);
    assert_eq!(got1, want1, "turn 1 past the window");
    let st = settled(&grouped);
    // 724 tokens: the blocks before 724 - 511 give their window layers back.
    assert!(st.kv.local_reclaimed >= 12, "{:?}", st.kv);
    let cached_blocks = st.kv.cached as u64;
    assert_eq!(st.kv.units_cached as u64, cached_blocks + 5 * (cached_blocks - st.kv.local_reclaimed), "{:?}", st.kv);

    // The warm second turn continues after the reply: its cached prefix lacks window
    // layers only behind the new rows' windows.
    let mut turn2 = turn1.clone();
    turn2.extend(&want1.tokens);
    turn2.extend(prose(&plain, 1, 40).into_iter().skip(1));
    let want2 = turn(&plain, &turn2, "alice", 16);
    let got2 = turn(&grouped, &turn2, "alice", 16);
    assert!(got2.cached >= (turn1.len() + 24) / 16 * 16 - 16, "cached {} of {}", got2.cached, turn2.len());
    assert_eq!((&got2.tokens, &got2.logprobs), (&want2.tokens, &want2.logprobs), "warm turn 2");
    // The same turn from scratch, in chunks of 64, on a fresh grouped engine.
    let chunked = gemma_engine(config(true, 64, memory, 2048)).unwrap();
    let cold2 = turn(&chunked, &turn2, "bob", 16);
    assert_eq!((cold2.cached, &cold2.tokens, &cold2.logprobs), (0, &want2.tokens, &want2.logprobs), "turn 2 from scratch, chunked");
    // A user who asks with a prefix the first conversation gave back recomputes it.
    let other = turn(&grouped, &turn1[..600], "alice", 4);
    let want_other = turn(&plain, &turn1[..600], "carol", 4);
    assert_eq!((&other.tokens, &other.logprobs), (&want_other.tokens, &want_other.logprobs), "a match cut before the given-back blocks");
    for e in [&plain, &grouped, &chunked] {
        assert_no_leaks(e);
    }
}

#[test]
fn sequences_competing_for_window_memory_finish_with_their_own_tokens() {
    let Some(reference) = gemma_engine(config(false, 512, 64 << 20, 1024)) else { return };
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prose(&reference, i + 2, 600)).collect();
    let want: Vec<Turn> = prompts.iter().map(|p| turn(&reference, p, "alice", 8)).collect();
    // 400 units: one 1,024-token sequence alone (64 global units and 66 blocks of
    // window layers, 5 units each), not three 600-token prompts at once (228 each).
    // Preempted sequences recompute, or swap to the second tier and come back with
    // exactly the window layers they had.
    for preemption in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let tight = gemma_engine(EngineConfig { preemption, ..config(true, 512, 401 * UNIT_BYTES, 1024) }).unwrap();
        assert_eq!(tight.stats().kv.units_total, 400);
        let streams: Vec<_> = prompts.iter().enumerate().map(|(i, p)| submit(&tight, p, &format!("user{i}"), 8)).collect();
        let got: Vec<Turn> = streams.into_iter().map(finish).collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((&g.tokens, &g.logprobs), (&w.tokens, &w.logprobs), "prompt {i}, {preemption:?}");
        }
        let st = settled(&tight);
        assert!(st.preemptions > 0, "the prompts never competed: {st:?}");
        assert_no_leaks(&tight);
    }
}
