//! Every path out of a sequence returns its blocks exactly once: finish,
//! stop, cancel (explicit or by dropping the stream), preemption and errors.
//! Plus the engine's admission errors and owner-scoped prefix sharing.

mod common;

use baton_engine::kv::{ConversationId, OwnerId};
use baton_text::sampling::SamplingParams;
use baton_engine::{EngineConfig, EngineError, Event, PreemptionMode, Request};
use baton_text::FinishReason;
use baton_kernels::KvDtype;
use common::*;

#[test]
fn finish_and_cancel_return_every_block() {
    let Some(e) = engine(EngineConfig { kv_memory_bytes: 64 << 20, max_context: Some(2048), ..EngineConfig::default() }) else { return };
    let prompt = chat_prompt(&e, "Be brief.", "Count from one to fifty in words.");
    let done = collect(e.submit(request(prompt.clone(), "a", 8)).unwrap());
    assert_eq!(done.reason, FinishReason::Length);
    assert_no_leaks(&e);

    // Dropping a stream mid-generation cancels at the next step.
    let mut s = e.submit(request(prompt.clone(), "b", 200)).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(Event::Token(_))));
    }
    drop(s);
    assert_no_leaks(&e);

    // Explicit cancel is reported as such.
    let mut s = e.submit(request(prompt.clone(), "c", 200)).unwrap();
    assert!(matches!(s.blocking_next(), Some(Event::Token(_))));
    s.cancel();
    loop {
        match s.blocking_next() {
            Some(Event::Finished { reason, .. }) => {
                assert_eq!(reason, FinishReason::Cancelled);
                break;
            }
            Some(Event::Token(_)) => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_no_leaks(&e);

    // Stop strings end the reply without emitting the stop string.
    let sampling = SamplingParams { max_tokens: 64, stop_strings: vec!["three".into()], ..Default::default() }.validate().unwrap();
    let out = collect(e.submit(Request { sampling, ..request(prompt, "d", 64) }).unwrap());
    if out.reason == FinishReason::Stop {
        assert!(!out.text.contains("three"));
    }
    assert_no_leaks(&e);
    e.shutdown();
}

/// 24 primary blocks of 16 f32 tokens (the default model's layout) and a
/// 16 MiB second tier: small enough for a few prompts to fill.
fn small_pool_with_tier2() -> EngineConfig {
    let layout_bytes_per_token = 2 * 30 * 3 * 64 * 4;
    EngineConfig {
        kv_memory_bytes: 24 * 16 * layout_bytes_per_token,
        kv_dtype: KvDtype::F32,
        max_context: Some(300),
        tier2_bytes: 16 << 20,
        ..EngineConfig::default()
    }
}

fn preemption_run(mode: PreemptionMode) {
    // Four sequences of ~150 tokens (10 blocks each) cannot all decode in
    // 24 blocks at once, so some must be preempted.
    let config = EngineConfig { step_token_budget: 256, preemption: mode, ..small_pool_with_tier2() };
    let Some(e) = engine(config) else { return };
    let reference = engine(EngineConfig { kv_dtype: KvDtype::F32, ..EngineConfig::default() }).unwrap();
    let mut streams = Vec::new();
    let mut prompts = Vec::new();
    for i in 0..4 {
        let p = chat_prompt(&e, "You are a poet.", &format!("Write a long poem number {i} about the sea and ships."));
        prompts.push(p.clone());
        streams.push(e.submit(request(p, &format!("user{i}"), 120)).unwrap());
    }
    let outs: Vec<_> = streams.into_iter().map(collect).collect();
    assert!(e.stats().preemptions > 0, "the test must force preemption: {:?}", e.stats());
    for (p, o) in prompts.into_iter().zip(outs) {
        assert_eq!(o.tokens.len(), 120);
        let alone = collect(reference.submit(request(p, "solo", 120)).unwrap());
        assert_eq!(o.tokens, alone.tokens, "preempted sequence ({mode:?}) must give the same tokens");
    }
    assert_no_leaks(&e);
    e.shutdown();
    reference.shutdown();
}

#[test]
fn preemption_by_recompute_keeps_tokens_and_blocks() {
    preemption_run(PreemptionMode::Recompute);
}

#[test]
fn preemption_by_swap_keeps_tokens_and_blocks() {
    preemption_run(PreemptionMode::Swap);
}

/// A swapped-out sequence whose blocks come back but whose next block cannot
/// be had is parked again, not left waiting with its blocks in hand (which
/// leaked them and then failed it as "cannot get KV blocks").
#[test]
fn swap_in_without_room_for_the_next_block_parks_again() {
    let config = EngineConfig { step_token_budget: 256, preemption: PreemptionMode::Swap, ..small_pool_with_tier2() };
    let Some(e) = engine(config) else { return };
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| chat_prompt(&e, "You are a poet.", &format!("Write a long poem number {i} about the sea and ships."))).collect();
    // A long reply already decoding: the four below join it together at one
    // step and all decode into the full pool at once.
    let first: Vec<u32> = prompts.iter().flatten().copied().take(120).collect();
    let mut running = e.submit(request(first, "first", 40)).unwrap();
    assert!(matches!(running.blocking_next(), Some(Event::Token(_))));
    let streams: Vec<_> = prompts.into_iter().enumerate().map(|(i, p)| e.submit(request(p, &format!("user{i}"), 100)).unwrap()).collect();
    for s in streams {
        assert_eq!(collect(s).tokens.len(), 100);
    }
    collect(running);
    assert!(e.stats().preemptions > 0, "the test must force preemption: {:?}", e.stats());
    assert_no_leaks(&e);
    e.shutdown();
}

/// A sequence swapped out halfway through its prefill resumes from the tokens
/// it had computed, not from the end of its reserved blocks.
#[test]
fn swap_preemption_mid_prefill_keeps_the_tokens() {
    // Two replies decode while a 230-token prompt is prefilled 6 tokens a
    // step into 15 reserved blocks; their growth then takes the pool and
    // preempts the prompt (the most recently admitted) before it is done.
    let config = EngineConfig { step_token_budget: 8, preemption: PreemptionMode::Swap, ..small_pool_with_tier2() };
    let Some(e) = engine(config) else { return };
    let reference = engine(EngineConfig { kv_dtype: KvDtype::F32, ..EngineConfig::default() }).unwrap();
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| chat_prompt(&e, "You are a poet.", &format!("Write a long poem number {i} about the sea and ships."))).collect();
    let long: Vec<u32> = prompts.iter().cycle().flatten().copied().take(230).collect();
    let mut a = e.submit(request(prompts[0].clone(), "a", 120)).unwrap();
    let b = e.submit(request(prompts[1].clone(), "b", 120)).unwrap();
    assert!(matches!(a.blocking_next(), Some(Event::Token(_))));
    let c = collect(e.submit(request(long.clone(), "c", 20)).unwrap());
    collect(a);
    collect(b);
    assert!(e.stats().preemptions > 0, "the test must force preemption: {:?}", e.stats());
    let alone = collect(reference.submit(request(long, "solo", 20)).unwrap());
    assert_eq!(c.tokens, alone.tokens, "the prompt preempted mid-prefill must give the same tokens");
    assert_no_leaks(&e);
    e.shutdown();
    reference.shutdown();
}

#[test]
fn kv_budget_too_small_for_max_context_is_refused_with_numbers() {
    let Some((backend, loaded)) = load(1) else { return };
    let err = baton_engine::Engine::start(backend, loaded, EngineConfig { kv_memory_bytes: 8 << 20, max_context: Some(8192), ..EngineConfig::default() }).err().expect("must refuse");
    let msg = err.to_string();
    assert!(matches!(err, EngineError::KvTooSmall { .. }), "{msg}");
    assert!(msg.contains("8192") && msg.contains("8388608"), "{msg}");
}

/// Unasked, the max context is the model's as far as the KV budget holds it, so a
/// long-context model starts on a small budget (Gemma 3 270M's 32k tokens on the default
/// 512 MiB); a prompt past it is refused, and one that fits runs.
#[test]
fn an_unasked_max_context_is_lowered_to_what_the_kv_budget_holds() {
    let Some((backend, loaded)) = load(1) else { return };
    let model_context = loaded.model.config.context_length;
    let e = baton_engine::Engine::start(backend, loaded, EngineConfig { kv_memory_bytes: 8 << 20, tier2_bytes: 0, ..EngineConfig::default() }).unwrap();
    let (blocks, bt) = (e.info.kv_blocks, e.info.kv_layout.block_tokens);
    assert!(blocks * bt < model_context, "the budget must be smaller than the model's context ({blocks} blocks)");
    assert_eq!(e.info.max_context, blocks * bt);
    assert!(matches!(e.submit(request(vec![5; blocks * bt], "a", 1)), Err(EngineError::ContextTooLong { .. })));
    let out = collect(e.submit(request(vec![5; blocks * bt - 8], "a", 4)).unwrap());
    assert_eq!(out.tokens.len(), 4);
    assert_no_leaks(&e);
    e.shutdown();
}

#[test]
fn bad_requests_are_refused_and_queue_overflow_is_an_error() {
    let Some(e) = engine(EngineConfig { max_waiting: 2, max_context: Some(512), kv_memory_bytes: 64 << 20, ..EngineConfig::default() }) else { return };
    assert!(matches!(e.submit(request(vec![], "a", 4)), Err(EngineError::EmptyPrompt)));
    assert!(matches!(e.submit(request(vec![999_999], "a", 4)), Err(EngineError::BadToken { .. })));
    assert!(matches!(e.submit(request(vec![5; 600], "a", 4)), Err(EngineError::ContextTooLong { .. })));
    let a = e.submit(request(vec![100; 40], "a", 50)).unwrap();
    let b = e.submit(request(vec![101; 40], "b", 50)).unwrap();
    assert!(matches!(e.submit(request(vec![102; 40], "c", 50)), Err(EngineError::Overloaded { .. })));
    drop(a);
    drop(b);
    assert_no_leaks(&e);
    e.shutdown();
}

#[test]
fn users_share_platform_blocks_only_and_deletion_evicts() {
    let Some(e) = engine(EngineConfig { kv_memory_bytes: 64 << 20, max_context: Some(2048), ..EngineConfig::default() }) else { return };
    let system = "You are Baton's helpful assistant. Follow the house rules: be accurate, be kind, cite sources when you can, and keep answers short unless asked for detail.";
    let sys_prompt = e.template.render(&[baton_text::chat_template::ChatMessage::new("system", system)], false).unwrap();
    let platform = e.tokenizer.encode(&sys_prompt, true).unwrap().len();
    let alice = chat_prompt(&e, system, "What is the capital of France?");
    let req = |p: &Vec<u32>, user: &str, conv: &str| Request {
        prompt: p.clone(),
        owner: OwnerId::parse(user).unwrap(),
        platform_prefix_len: platform,
        conversation: Some(ConversationId::parse(conv).unwrap()),
        sampling: greedy(8),
        ignore_eos: true,
    };
    let a1 = collect(e.submit(req(&alice, "alice", "c1")).unwrap());
    assert_eq!(a1.usage.cached_tokens, 0);
    // Bob sends Alice's exact history: only the platform blocks are shared.
    let b1 = collect(e.submit(req(&alice, "bob", "c2")).unwrap());
    assert_eq!(b1.usage.cached_tokens, platform / 16 * 16, "bob may reuse only platform blocks");
    // Alice again: everything but the last partial block is cached.
    let a2 = collect(e.submit(req(&alice, "alice", "c1")).unwrap());
    assert_eq!(a2.usage.cached_tokens, (alice.len() - 1) / 16 * 16);
    // Deleting Alice's conversation removes her blocks, not the platform's.
    assert!(e.evict_conversation(ConversationId::parse("c1").unwrap()).unwrap() > 0);
    let a3 = collect(e.submit(req(&alice, "alice", "c1")).unwrap());
    assert_eq!(a3.usage.cached_tokens, platform / 16 * 16);
    assert_eq!(a3.tokens, a1.tokens);
    assert_no_leaks(&e);
    e.shutdown();
}

#[test]
fn prompt_tokens_from_the_second_tier_are_counted_exactly() {
    // Three other users' prompts push the first one's blocks out of the 24
    // primary blocks to the second tier, and its next turn promotes them back.
    let Some(e) = engine(small_pool_with_tier2()) else { return };
    let first = chat_prompt(&e, "You are a poet.", &"Write a short poem about the sea and the ships that sail on it at night. ".repeat(4));
    collect(e.submit(request(first.clone(), "a", 4)).unwrap());
    for (i, user) in ["b", "c", "d"].into_iter().enumerate() {
        let story = format!("Tell me, in detail, story number {i} about old harbours, lighthouses and the keepers who lived in them. ");
        collect(e.submit(request(chat_prompt(&e, "You are a historian.", &story.repeat(6)), user, 4)).unwrap());
    }
    let before = settled(&e);
    let again = collect(e.submit(request(first, "a", 4)).unwrap());
    let after = settled(&e);
    let bt = 16;
    let from_tier2 = (after.kv.tier2_hits - before.kv.tier2_hits) * bt;
    assert!(from_tier2 > 0, "the test must promote blocks from the second tier: {after:?}");
    assert_eq!(after.cached_tier2_prompt_tokens - before.cached_tier2_prompt_tokens, from_tier2);
    assert_eq!(after.cached_prompt_tokens - before.cached_prompt_tokens, again.usage.cached_tokens as u64);
    assert!(again.usage.cached_tokens as u64 >= from_tier2);
    assert_no_leaks(&e);
    e.shutdown();
}
