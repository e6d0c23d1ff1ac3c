//! KV handoff between engines: a prompt prefilled on one engine and decoded
//! on another gives exactly the tokens of one engine doing both, whether the
//! decoder had part of the prefix cached, the prefiller pulled the prefix it
//! lacked from the decoder, or the import could not be used and the decoder
//! computed the prompt itself. Every engine ends with no block pinned.

mod common;

use baton_text::sampling::SamplingParams;
use baton_engine::{Engine, EngineConfig, ImportUse, ImportedToken, KvImport, Request, SubmitOptions};
use common::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler.";

fn config() -> EngineConfig {
    EngineConfig { step_token_budget: 64, kv_memory_bytes: 64 << 20, max_context: Some(2048), tier2_bytes: 0, ..EngineConfig::default() }
}

/// Decodes with `p` as the import; also what the engine said it did with the import.
fn decode_imported(engine: &Engine, req: Request, p: Prefilled) -> (Outcome, ImportUse) {
    let sub = engine.submit_with(req, SubmitOptions { import: Some(p.into_import()), export_from_block: None }).unwrap();
    let mut said = sub.import.expect("an import is reported on");
    let out = collect(sub.stream);
    (out, said.try_recv().expect("the import's use is known once the sequence ran"))
}

fn seeded(prompt: Vec<u32>, max_tokens: usize) -> Request {
    let sampling = SamplingParams { max_tokens, temperature: 0.8, top_p: 0.95, seed: Some(7), logprobs: true, ..Default::default() };
    Request { sampling: sampling.validate().unwrap(), ..request(prompt, "alice", max_tokens) }
}

#[test]
fn remote_prefill_matches_local_including_pulled_prefix_and_fallback() {
    let Some(reference) = engine(config()) else { return };
    let prefiller = engine(config()).unwrap();
    let decoder = engine(config()).unwrap();
    let bt = reference.info.kv_layout.block_tokens;

    // Turn 1, nothing cached anywhere.
    let prompt = chat_prompt(&reference, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
    assert!(prompt.len() > 3 * bt && !prompt.len().is_multiple_of(bt), "prompt of {} tokens", prompt.len());
    let local = collect(reference.submit(request(prompt.clone(), "alice", 24)).unwrap());
    assert_eq!(decoder.cached_prefix_tokens(&prompt, &baton_engine::kv::OwnerId::parse("alice").unwrap(), 0).unwrap(), 0);
    let p = prefill(&prefiller, request(prompt.clone(), "alice", 24), 0, None);
    assert_eq!(p.export.blocks.len(), prompt.len().div_ceil(bt));
    assert_eq!(p.first.id, local.tokens[0]);
    let (remote, used) = decode_imported(&decoder, request(prompt.clone(), "alice", 24), p);
    assert_eq!(used, ImportUse::Used);
    assert_eq!(remote.tokens, local.tokens, "turn 1: remote prefill vs local");
    assert_eq!(remote.usage.cached_tokens, 0);

    // Turn 2: the decoder holds turn 1 (prompt and reply); the prefiller holds
    // only turn 1's prompt, so it pulls the rest of the prefix from the decoder.
    let mut turn2 = prompt.clone();
    turn2.extend(&local.tokens);
    turn2.extend(reference.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd why are sunsets red, then?<|im_end|>\n<|im_start|>assistant\n", true).unwrap());
    let alice = baton_engine::kv::OwnerId::parse("alice").unwrap();
    let local2 = collect(reference.submit(request(turn2.clone(), "alice", 24)).unwrap());
    let k = decoder.cached_prefix_tokens(&turn2, &alice, 0).unwrap();
    assert!(k >= (prompt.len() + local.tokens.len()) / bt * bt - bt, "decoder holds {k} tokens of turn 2");
    let have = prefiller.cached_prefix_tokens(&turn2[..k], &alice, 0).unwrap();
    assert!(have < k, "the prefiller must lack part of the prefix ({have} of {k})");
    let pulled = decoder.export_prefix(&turn2[..k], &alice, 0, have / bt).unwrap();
    assert_eq!(pulled.blocks.len(), (k - have) / bt);
    let pulled = KvImport { start_block: pulled.start_block, blocks: pulled.blocks.into(), first_token: None };
    let p2 = prefill(&prefiller, request(turn2.clone(), "alice", 24), k / bt, Some(pulled));
    let (remote2, used) = decode_imported(&decoder, request(turn2.clone(), "alice", 24), p2);
    assert_eq!(used, ImportUse::Used);
    assert_eq!(remote2.tokens, local2.tokens, "turn 2: pulled prefix + remote tail vs local");
    assert_eq!(remote2.usage.cached_tokens, k);
    // The prefiller now holds the pulled blocks in its own cache.
    assert!(prefiller.cached_prefix_tokens(&turn2, &alice, 0).unwrap() >= k);

    // Another user gets nothing of alice's prefix.
    assert_eq!(decoder.cached_prefix_tokens(&turn2, &baton_engine::kv::OwnerId::parse("bob").unwrap(), 0).unwrap(), 0);
    assert!(decoder.export_prefix(&turn2[..k], &baton_engine::kv::OwnerId::parse("bob").unwrap(), 0, 0).unwrap().blocks.is_empty());

    // An import the decoder cannot attach (a gap before it): it computes locally.
    let fresh = engine(config()).unwrap();
    let mut p3 = prefill(&prefiller, request(prompt.clone(), "carol", 24), 0, None);
    p3.export.blocks.remove(0);
    p3.export.start_block = 1;
    let (fallback, used) = decode_imported(&fresh, request(prompt.clone(), "carol", 24), p3);
    assert_eq!(fallback.tokens, local.tokens, "gap: local recompute");
    assert_eq!(used, ImportUse::NotContiguous, "the engine says it dropped the import");

    // Seeded sampling: the decoder continues the prefiller's generator.
    let seeded_local = collect(reference.submit(seeded(prompt.clone(), 16)).unwrap());
    let p4 = prefill(&prefiller, seeded(prompt.clone(), 16), 0, None);
    let (seeded_remote, _) = decode_imported(&fresh, seeded(prompt.clone(), 16), p4);
    assert_eq!(seeded_remote.tokens, seeded_local.tokens, "seeded sampling across the handoff");

    for e in [&reference, &prefiller, &decoder, &fresh] {
        assert_no_leaks(e);
        e.shutdown();
    }
}

#[test]
fn bad_imports_are_refused() {
    let Some(e) = engine(config()) else { return };
    let prompt: Vec<u32> = (1..50).collect();
    let bytes = e.info.kv_layout.block_bytes();
    let bad = |import: KvImport| e.submit_with(request(prompt.clone(), "u", 4), SubmitOptions { import: Some(import), export_from_block: None }).err().map(|x| x.label());
    let first = Some(ImportedToken { id: 5, logprob: 0.0, top_logprobs: vec![] });
    assert_eq!(bad(KvImport { start_block: 0, blocks: vec![vec![0; bytes - 1]; 4].into(), first_token: first.clone() }), Some("bad_import"));
    assert_eq!(bad(KvImport { start_block: 0, blocks: vec![vec![0; bytes]; 2].into(), first_token: first }), Some("bad_import"));
    assert_eq!(bad(KvImport { start_block: 0, blocks: vec![vec![0; bytes]; 4].into(), first_token: None }), Some("bad_import"));
    // A prefill node's first token outside the vocabulary (it panicked the engine's
    // thread, leaving a node in the ring with a dead engine), or one with a NaN logprob.
    let vocab = e.info.vocab as u32;
    for first in [ImportedToken { id: vocab, logprob: 0.0, top_logprobs: vec![] }, ImportedToken { id: 5, logprob: 0.0, top_logprobs: vec![(u32::MAX, -1.0)] }, ImportedToken { id: 5, logprob: f32::NAN, top_logprobs: vec![] }] {
        assert_eq!(bad(KvImport { start_block: 0, blocks: vec![vec![0; bytes]; 4].into(), first_token: Some(first) }), Some("bad_import"));
    }
    // The engine is alive and serves.
    assert!(!collect(e.submit(request(prompt.clone(), "u", 2)).unwrap()).tokens.is_empty());
    assert!(e.submit_with(request(prompt.clone(), "u", 4), SubmitOptions { import: None, export_from_block: Some(4) }).is_err());
    assert_no_leaks(&e);
    e.shutdown();
}

/// Blocks standing in for a staging pool in device memory: the CPU backend cannot copy on
/// a device, so the engine reads them through the holder; the holder is let go once the
/// import was admitted (the node's staging blocks are released then).
struct Staged {
    blocks: Vec<Vec<u8>>,
    reads: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    broken: bool,
    dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl baton_engine::DeviceBlockHolder for Staged {
    fn read_block(&self, i: usize, out: &mut [u8]) -> Result<(), String> {
        if self.broken {
            return Err("the device is gone".into());
        }
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        out.copy_from_slice(&self.blocks[i]);
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.dropped.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn an_import_left_in_device_memory_is_read_through_its_holder_or_recomputed() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let Some(reference) = engine(config()) else { return };
    let prefiller = engine(config()).unwrap();
    let prompt = chat_prompt(&reference, SYSTEM, "What is a comet made of?");
    let local = collect(reference.submit(request(prompt.clone(), "alice", 16)).unwrap());
    for broken in [false, true] {
        let decoder = engine(config()).unwrap();
        let p = prefill(&prefiller, request(prompt.clone(), "alice", 16), 0, None);
        let n = p.export.blocks.len();
        let block_bytes = p.export.blocks[0].len();
        let dropped = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicUsize::new(0));
        let holder = Arc::new(Staged { blocks: p.export.blocks.clone(), reads: reads.clone(), broken, dropped: dropped.clone() });
        let import = KvImport {
            start_block: 0,
            blocks: baton_engine::ImportBlocks::Device(baton_engine::DeviceBlocks { addrs: (0..n as u64).map(|i| 0x1000 * (i + 1)).collect(), block_bytes, holder }),
            first_token: Some(p.first.clone()),
        };
        let sub = decoder.submit_with(request(prompt.clone(), "alice", 16), SubmitOptions { import: Some(import), export_from_block: None }).unwrap();
        let mut said = sub.import.unwrap();
        let out = collect(sub.stream);
        assert_eq!(out.tokens, local.tokens, "broken holder: {broken}");
        let used = said.try_recv().unwrap();
        if broken {
            // Nothing could be read: computed here, said so, same tokens.
            assert_eq!(used, ImportUse::DeviceCopyFailed);
            assert_eq!(out.usage.cached_tokens, 0);
        } else {
            assert_eq!(used, ImportUse::Used);
            assert_eq!(reads.load(Ordering::SeqCst), n, "each block read once");
        }
        assert!(dropped.load(Ordering::SeqCst), "the holder is let go once the import was admitted");
        assert_no_leaks(&decoder);
    }
}
