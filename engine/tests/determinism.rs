//! The determinism contract: the same greedy request gives the same tokens
//! alone, in a batch of mixed requests, with any prefill chunk size, and when
//! its prefix comes from the cache instead of being computed.

mod common;

use baton_engine::kv::OwnerId;
use baton_engine::{EngineConfig, Request};
use baton_text::sampling::SamplingParams;
use common::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler. \
    When a visitor asks about physics, name the effect, say what causes it, and give one everyday example. \
    Never invent numbers; if you are unsure, say so plainly and suggest which exhibit to visit.";

fn config(step_tokens: usize) -> EngineConfig {
    EngineConfig { step_token_budget: step_tokens, kv_memory_bytes: 128 << 20, max_context: Some(2048), ..EngineConfig::default() }
}

#[test]
fn greedy_tokens_identical_alone_batched_chunked_and_cached() {
    let Some(reference_engine) = engine(config(512)) else { return };
    let prompt = chat_prompt(&reference_engine, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
    assert!(prompt.len() > 64, "prompt should span several blocks and chunks");
    let reference = collect(reference_engine.submit(request(prompt.clone(), "alice", 32)).unwrap());
    assert_eq!(reference.tokens.len(), 32);
    assert_eq!(reference.usage.cached_tokens, 0);

    // The same request again: its prefix now comes from the cache.
    let cached = collect(reference_engine.submit(request(prompt.clone(), "alice", 32)).unwrap());
    assert!(cached.usage.cached_tokens >= prompt.len() / 16 * 16 - 16, "cached {} of {}", cached.usage.cached_tokens, prompt.len());
    assert_eq!(cached.tokens, reference.tokens, "prefix from cache");

    // A second turn that extends the first: the cached prefix plus new tokens
    // equals computing everything from scratch on a fresh engine.
    let mut turn2 = prompt.clone();
    turn2.extend(&reference.tokens);
    turn2.extend(reference_engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd at sunset?<|im_end|>\n<|im_start|>assistant\n", true).unwrap());
    let warm = collect(reference_engine.submit(request(turn2.clone(), "alice", 24)).unwrap());
    assert!(warm.usage.cached_tokens > prompt.len() - 16);
    assert_no_leaks(&reference_engine);
    reference_engine.shutdown();

    for step in [16, 64] {
        let e = engine(config(step)).unwrap();
        let chunked = collect(e.submit(request(prompt.clone(), "alice", 32)).unwrap());
        assert_eq!(chunked.tokens, reference.tokens, "prefill chunks of {step}");
        let cold2 = collect(e.submit(request(turn2.clone(), "bob", 24)).unwrap());
        assert_eq!(cold2.usage.cached_tokens, 0, "bob must not hit alice's blocks");
        assert_eq!(cold2.tokens, warm.tokens, "turn 2 from scratch with chunks of {step}");
        assert_no_leaks(&e);
        e.shutdown();
    }

    // A batch of 8 mixed requests (other prompts, lengths and sampling).
    let e = engine(config(64)).unwrap();
    let mut streams = Vec::new();
    for i in 0..7 {
        let p = chat_prompt(&e, SYSTEM, &format!("Write item {i} of a list of {} animals.", 3 + i * 5));
        let sampling = SamplingParams { max_tokens: 10 + i * 7, temperature: 0.8, top_p: 0.9, seed: Some(i as u64), ..Default::default() }.validate().unwrap();
        streams.push(e.submit(Request { prompt: p, owner: OwnerId::parse(format!("u{i}")).unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: true }).unwrap());
        if i == 3 {
            streams.push(e.submit(request(prompt.clone(), "carol", 32)).unwrap());
        }
    }
    let outcomes: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(outcomes[4].tokens, reference.tokens, "in a batch of 8 mixed requests");
    assert_no_leaks(&e);
    e.shutdown();
}

#[test]
fn seeded_sampling_is_reproducible_across_batches() {
    let Some(e) = engine(config(512)) else { return };
    let prompt = chat_prompt(&e, SYSTEM, "Tell me a short story about a lighthouse.");
    let sampled = |seed| SamplingParams { max_tokens: 24, temperature: 1.0, top_k: 40, top_p: 0.95, seed: Some(seed), ..Default::default() }.validate().unwrap();
    let req = |seed, user: &str| Request { prompt: prompt.clone(), owner: OwnerId::parse(user).unwrap(), platform_prefix_len: 0, conversation: None, sampling: sampled(seed), ignore_eos: true };
    let a = collect(e.submit(req(7, "a")).unwrap());
    let b_stream = e.submit(req(7, "b")).unwrap();
    let c_stream = e.submit(req(8, "c")).unwrap();
    let (b, c) = (collect(b_stream), collect(c_stream));
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
    e.shutdown();
}

#[test]
fn greedy_tokens_identical_when_the_itl_target_splits_prefill_beside_streams() {
    let no_target = EngineConfig { itl_target: None, ..config(512) };
    let Some(reference_engine) = engine(no_target) else { return };
    let prompt = chat_prompt(&reference_engine, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
    let reference = collect(reference_engine.submit(request(prompt.clone(), "alice", 32)).unwrap());
    reference_engine.shutdown();

    // A target no step can meet: beside a decoding stream, prefill gets the
    // planner's floor, one 16-token block a step.
    // (And no wait limit: the floor is what is under test.)
    let tight = EngineConfig { itl_target: Some(std::time::Duration::from_nanos(1)), prefill_wait_limit: std::time::Duration::from_secs(3600), ..config(512) };
    let e = engine(tight).unwrap();
    let stream = chat_prompt(&e, SYSTEM, "Count slowly from one to one hundred.");
    let mut running = e.submit(request(stream, "bob", 200)).unwrap();
    // Wait until it decodes, so the prompt below arrives beside a stream.
    match running.blocking_next() {
        Some(baton_engine::Event::Token(_)) => {}
        other => panic!("expected a token, got {other:?}"),
    }
    let split = collect(e.submit(request(prompt.clone(), "alice", 32)).unwrap());
    assert_eq!(split.tokens, reference.tokens, "prefill in one-block chunks beside a stream");
    let st = e.stats();
    assert!(st.steps as usize >= prompt.len() / 16, "{} steps for a prompt of {} tokens in 16-token chunks", st.steps, prompt.len());
    assert!(st.predicted_step_seconds > 0.0 && st.measured_step_seconds > 0.0, "{st:?}");
    assert!(st.step_cost.is_some());
    drop(running);
    e.shutdown();
}
