//! The pipelined export (`Engine::submit_exporting_layers`): each layer of the prompt's
//! blocks leaves while the forward pass computes, and what arrives is, byte for byte,
//! the whole-block export after the prefill. Every (block, layer) comes exactly once,
//! `Done` only after the last one, and an export whose sequence ends first ends
//! without `Done`.

mod common;

use std::collections::BTreeMap;

use baton_engine::{Engine, EngineConfig, LayerExportEvent, Request};
use common::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler.";

/// Chunks of 24 tokens (not whole blocks, so blocks straddle chunks): a prompt of a
/// hundred tokens is computed in several steps.
const CHUNK: usize = 24;

fn config() -> EngineConfig {
    EngineConfig { step_token_budget: CHUNK, kv_memory_bytes: 64 << 20, max_context: Some(2048), tier2_bytes: 0, ..EngineConfig::default() }
}

fn one_token(mut req: Request) -> Request {
    let mut p = req.sampling.clone().into_inner();
    p.max_tokens = 1;
    req.sampling = p.validate().unwrap();
    req
}

/// What a pipelined export delivered: each block's bytes (all layers, the arena's block
/// layout), the runs in arrival order, and the `Done` count.
struct Streamed {
    first: u32,
    blocks: BTreeMap<usize, Vec<u8>>,
    runs: Vec<(usize, usize, usize)>,
    done: Option<usize>,
}

fn prefill_streamed(engine: &Engine, req: Request, from_block: usize) -> Streamed {
    let layout = engine.info.kv_layout;
    let bl = layout.block_layer_bytes();
    let (sub, mut layers) = engine.submit_exporting_layers(one_token(req), None, from_block).unwrap();
    let first = collect(sub.stream).tokens[0];
    let mut out = Streamed { first, blocks: BTreeMap::new(), runs: Vec::new(), done: None };
    let mut seen = std::collections::HashSet::new();
    while let Some(ev) = layers.blocking_recv() {
        match ev {
            LayerExportEvent::Layer(c) => {
                assert!(out.done.is_none(), "a layer after Done");
                let bytes = c.bytes.wait();
                assert_eq!(bytes.len(), c.blocks * bl);
                for (i, b) in bytes.chunks_exact(bl).enumerate() {
                    let block = c.first_block + i;
                    assert!(block >= from_block, "block {block} is before the export's start");
                    assert!(seen.insert((block, c.layer)), "block {block} layer {} twice", c.layer);
                    let whole = out.blocks.entry(block).or_insert_with(|| vec![0; layout.block_bytes()]);
                    whole[c.layer * bl..(c.layer + 1) * bl].copy_from_slice(b);
                }
                out.runs.push((c.first_block, c.blocks, c.layer));
            }
            LayerExportEvent::Done { blocks } => out.done = Some(blocks),
        }
    }
    let n = out.blocks.len();
    assert_eq!(seen.len(), n * layout.layers, "every layer of every block");
    out
}

#[test]
fn a_pipelined_export_equals_the_whole_export_across_chunks() {
    let Some(engine) = common::engine(config()) else { return };
    let bt = engine.info.kv_layout.block_tokens;
    let layers = engine.info.kv_layout.layers;
    let prompt = chat_prompt(&engine, SYSTEM, "Why is the sky blue at noon and red at sunset? Explain Rayleigh scattering, the path length through the air, and why clouds look white, in enough detail for a curious student who likes physics and wants numbers.");
    assert!(prompt.len() > 3 * CHUNK && !prompt.len().is_multiple_of(bt), "several chunks and a partial last block: {} tokens", prompt.len());

    // The baseline: whole blocks after the prefill, on a fresh owner.
    let whole = prefill(&engine, request(prompt.clone(), "whole", 1), 1, None);
    let streamed = prefill_streamed(&engine, request(prompt.clone(), "streamed", 1), 1);
    assert_eq!(streamed.first, whole.first.id);
    let blocks = prompt.len().div_ceil(bt);
    assert_eq!(streamed.done, Some(blocks - 1), "Done with the export's block count");
    let got: Vec<Vec<u8>> = streamed.blocks.into_values().collect();
    assert_eq!(got.len(), whole.export.blocks.len());
    for (i, (a, b)) in got.iter().zip(&whole.export.blocks).enumerate() {
        assert!(a == b, "block {} differs from the whole export", i + 1);
    }
    // Pipelined across chunks: blocks left in several runs, each layer by layer in order,
    // the first run before the later chunks were computed.
    let starts: std::collections::BTreeSet<usize> = streamed.runs.iter().map(|r| r.0).collect();
    assert!(starts.len() >= 3, "one run per chunk at least: {:?}", streamed.runs);
    for run in streamed.runs.chunks(layers) {
        assert!(run.iter().enumerate().all(|(l, r)| r.2 == l && r.0 == run[0].0), "a run's layers in order: {run:?}");
    }
    assert_no_leaks(&engine);
}

/// Blocks this engine already held (its own prefix cache) go out in the first step,
/// every layer, as the computed ones do.
#[test]
fn cached_blocks_are_exported_in_the_first_step() {
    let Some(engine) = common::engine(config()) else { return };
    let bt = engine.info.kv_layout.block_tokens;
    let prompt = chat_prompt(&engine, SYSTEM, "How do bees find their way home? Mention the sun, polarized light and landmarks.");
    let first = prefill_streamed(&engine, request(prompt.clone(), "alice", 1), 0);
    // The same owner again: all whole blocks but the last hit the cache.
    let again = prefill_streamed(&engine, request(prompt.clone(), "alice", 1), 0);
    assert_eq!(again.done, Some(prompt.len().div_ceil(bt)));
    assert_eq!(again.first, first.first);
    assert_eq!(again.blocks, first.blocks, "cached blocks are the same bytes");
    assert!(again.runs.iter().all(|r| r.0 == 0), "one step, one run from block 0: {:?}", again.runs);
    assert_no_leaks(&engine);
}

/// A sequence that ends before its first token (cancelled) drops its export without
/// `Done`: the consumer must treat it as failed. Nothing stays pinned.
#[test]
fn an_export_whose_sequence_ends_first_has_no_done() {
    let Some(engine) = common::engine(config()) else { return };
    // Several chunks: the cancel lands before the last one.
    let prompt = chat_prompt(&engine, SYSTEM, "Describe how a river delta forms over centuries, with the role of sediment, tides, floods, vegetation, human engineering, dams upstream, and the sea level, for a student who wants the whole story from the mountains to the coast and the numbers that go with it.");
    assert!(prompt.len() > 3 * CHUNK);
    let (sub, mut layers) = engine.submit_exporting_layers(one_token(request(prompt, "bob", 1)), None, 0).unwrap();
    drop(sub.stream);
    while let Some(ev) = layers.blocking_recv() {
        assert!(matches!(ev, LayerExportEvent::Layer(_)), "no Done for a cancelled sequence");
    }
    assert_no_leaks(&engine);
    // A start past the prompt, and an import with a first token, are refused.
    let short = vec![1u32; 20];
    assert!(engine.submit_exporting_layers(one_token(request(short, "bob", 1)), None, 2).is_err());
}
