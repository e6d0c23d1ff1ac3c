//! The prefix cache under forged hash collisions: engines whose block hasher
//! maps every block to the same value, so every lookup, export and import meets
//! a collision. Replies must equal a normal engine's, and no owner or prompt
//! may reuse another's KV: not by a match, not by an export, not by publishing
//! imported blocks under a hash someone else holds.

mod common;

use std::sync::Arc;

use baton_engine::kv::{ConstantHasher, OwnerId};
use baton_engine::{Engine, EngineConfig, KvImport, Request, SubmitOptions};
use common::*;

fn config() -> EngineConfig {
    EngineConfig { step_token_budget: 64, kv_memory_bytes: 64 << 20, max_context: Some(2048), tier2_bytes: 0, ..EngineConfig::default() }
}

/// An engine whose every block hashes to 7.
fn colliding() -> Option<Engine> {
    let (backend, loaded) = load(2)?;
    Some(Engine::start_with_block_hasher(backend, loaded, config(), Arc::new(ConstantHasher(7))).expect("engine start"))
}

/// Prefills `req` (one token) on `engine` and returns the import a decode node
/// would receive: every prompt block and the first token.
fn prefilled(engine: &Engine, req: Request) -> KvImport {
    prefill(engine, req, 0, None).into_import()
}

#[test]
fn a_forged_hash_collision_is_not_a_hit_in_the_engine() {
    let Some(reference) = engine(config()) else { return };
    let forged = colliding().unwrap();
    let bt = reference.info.kv_layout.block_tokens;
    let (alice, bob) = (OwnerId::parse("alice").unwrap(), OwnerId::parse("bob").unwrap());
    // Two prompts that differ inside their first block.
    let p = chat_prompt(&reference, "You are a careful assistant for a science museum.", "Why is the sky blue?");
    let q = chat_prompt(&reference, "Answer like a pirate would, in one sentence.", "Name three planets.");
    assert_ne!(p[..bt], q[..bt]);
    let ref_p = collect(reference.submit(request(p.clone(), "alice", 12)).unwrap());
    let ref_q = collect(reference.submit(request(q.clone(), "alice", 12)).unwrap());

    // Alice warms p. Every later block collides with block 0, so only block 0
    // is published; she hits exactly that (the positive control).
    assert_eq!(collect(forged.submit(request(p.clone(), "alice", 12)).unwrap()).tokens, ref_p.tokens);
    assert_eq!(forged.cached_prefix_tokens(&p, &alice, 0).unwrap(), bt);
    let again = collect(forged.submit(request(p.clone(), "alice", 12)).unwrap());
    assert_eq!((again.usage.cached_tokens, &again.tokens), (bt, &ref_p.tokens));

    // (1) Bob sends alice's exact tokens: same hash, another owner.
    assert_eq!(forged.cached_prefix_tokens(&p, &bob, 0).unwrap(), 0);
    assert!(forged.export_prefix(&p, &bob, 0, 0).unwrap().blocks.is_empty());
    let bob_p = collect(forged.submit(request(p.clone(), "bob", 12)).unwrap());
    assert_eq!((bob_p.usage.cached_tokens, &bob_p.tokens), (0, &ref_p.tokens));

    // (2) Alice sends other tokens: same hash, same owner, other content.
    assert_eq!(forged.cached_prefix_tokens(&q, &alice, 0).unwrap(), 0);
    assert!(forged.export_prefix(&q, &alice, 0, 0).unwrap().blocks.is_empty());
    let alice_q = collect(forged.submit(request(q.clone(), "alice", 12)).unwrap());
    assert_eq!((alice_q.usage.cached_tokens, &alice_q.tokens), (0, &ref_q.tokens));

    // (3) Imports: a decode node that holds alice's p receives bob's p, prefilled
    // elsewhere. Bob decodes from the imported KV, but his blocks are not
    // published under the hash alice's block holds, and alice keeps hers.
    let import = prefilled(&reference, request(p.clone(), "bob", 12));
    let bob_imported = collect(forged.submit_with(request(p.clone(), "bob", 12), SubmitOptions { import: Some(import), export_from_block: None }).unwrap().stream);
    assert_eq!((bob_imported.usage.cached_tokens, &bob_imported.tokens), (0, &ref_p.tokens));
    assert_eq!(forged.cached_prefix_tokens(&p, &bob, 0).unwrap(), 0);
    assert_eq!(forged.cached_prefix_tokens(&p, &alice, 0).unwrap(), bt);
    assert!(forged.stats().kv.hash_collisions > 0);

    // An import on a fresh node is published under the receiver's own key: its
    // owner hits it, another owner or prompt does not.
    let fresh = colliding().unwrap();
    let import = prefilled(&reference, request(q.clone(), "bob", 12));
    let bob_q = collect(fresh.submit_with(request(q.clone(), "bob", 12), SubmitOptions { import: Some(import), export_from_block: None }).unwrap().stream);
    assert_eq!(bob_q.tokens, ref_q.tokens);
    assert_eq!(fresh.cached_prefix_tokens(&q, &bob, 0).unwrap(), bt);
    assert_eq!(fresh.cached_prefix_tokens(&q, &alice, 0).unwrap(), 0);
    assert_eq!(fresh.cached_prefix_tokens(&p, &bob, 0).unwrap(), 0);
    assert!(fresh.export_prefix(&q, &alice, 0, 0).unwrap().blocks.is_empty());

    for e in [&reference, &forged, &fresh] {
        assert_no_leaks(e);
        e.shutdown();
    }
}
