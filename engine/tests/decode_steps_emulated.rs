//! Replayable decode steps (the CUDA backend's graphs, `kernels/src/cuda/graph.rs`)
//! through the engine's forward pass, on the emulated backend made with them
//! (`EmuBackend::with_decode_steps`, `kernels/src/emu_steps.rs`): decode steps
//! padded to their batch buckets, every kernel reading its step's inputs from
//! the staged words, the padding rows on the arena's spare block.
//!
//! - Logits of every decode step, at batches of 5, 2 and 1 (buckets 8, 2, 1),
//!   are the same bits as the same backend's without decode steps: padding and
//!   staging change no real row.
//! - Each shape runs eagerly once, is captured on its next step and replayed
//!   after; while captured or replayed nothing allocates or uploads from host
//!   memory (the guard refuses nothing), so the CUDA backend's capture holds.
//! - The guard catches a body that allocates during a capture, and an allocation
//!   between steps (a tensor, a matrix, rope tables) sends a captured shape back to
//!   eager (its buffers may have moved).
//!
//! The model is a tiny Qwen3 (QK-norm: the forward pass swaps scratch buffers
//! every layer) with random weights, written as a GGUF here.
#![cfg(feature = "emu")]

use baton_engine::model::{load_gguf_weights, Model, Scratch, StepInput};
use baton_kernels::{AttnRow, Backend, EmuBackend, GreedyRow, KvDtype, KvLayout};
use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgufFile, MetaValue};

const HIDDEN: usize = 64;
const FFN: usize = 128;
const VOCAB: usize = 32;
const LAYERS: usize = 2;
const HEAD: usize = 16;

fn noise(n: usize, seed: u64, scale: f32, offset: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            offset + scale * (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

fn tiny_qwen3(dir: &std::path::Path) -> std::path::PathBuf {
    let k = |s: &str| format!("qwen3.{s}");
    let meta = vec![
        ("general.architecture".to_string(), MetaValue::String("qwen3".into())),
        (k("embedding_length"), MetaValue::U32(HIDDEN as u32)),
        (k("attention.head_count"), MetaValue::U32(4)),
        (k("attention.head_count_kv"), MetaValue::U32(2)),
        (k("attention.key_length"), MetaValue::U32(HEAD as u32)),
        (k("attention.value_length"), MetaValue::U32(HEAD as u32)),
        (k("block_count"), MetaValue::U32(LAYERS as u32)),
        (k("feed_forward_length"), MetaValue::U32(FFN as u32)),
        (k("context_length"), MetaValue::U32(2048)),
        (k("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-6)),
        (k("vocab_size"), MetaValue::U32(VOCAB as u32)),
    ];
    let mut seed = 0;
    let mut t = |name: String, dims: &[u64]| {
        seed += 1;
        let n: u64 = dims.iter().product();
        let v = if dims.len() == 1 { noise(n as usize, seed, 0.1, 1.0) } else { noise(n as usize, seed, 1.0 / (dims[0] as f32).sqrt(), 0.0) };
        TensorSpec::f32(name, dims, &v)
    };
    let (h, f, q, kv) = (HIDDEN as u64, FFN as u64, 4 * HEAD as u64, 2 * HEAD as u64);
    let mut tensors = vec![t("token_embd.weight".into(), &[h, VOCAB as u64]), t("output_norm.weight".into(), &[h])];
    for i in 0..LAYERS {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        for (name, dims) in [
            ("attn_norm", vec![h]),
            ("attn_q", vec![h, q]),
            ("attn_k", vec![h, kv]),
            ("attn_v", vec![h, kv]),
            ("attn_q_norm", vec![HEAD as u64]),
            ("attn_k_norm", vec![HEAD as u64]),
            ("attn_output", vec![q, h]),
            ("ffn_norm", vec![h]),
            ("ffn_gate", vec![h, f]),
            ("ffn_up", vec![h, f]),
            ("ffn_down", vec![f, h]),
        ] {
            tensors.push(t(p(name), &dims));
        }
    }
    let path = dir.join("tiny-qwen3.gguf");
    write_gguf(&path, &meta, &tensors).unwrap();
    path
}

/// One backend's model, arena and scratch, and the sequences it runs.
struct Run<B: Backend> {
    model: Model<B>,
    kv: B::Kv,
    scratch: Scratch<B>,
}

const BLOCKS_PER_SEQ: usize = 40;

impl<B: Backend> Run<B> {
    fn new(backend: &B, path: &std::path::Path, seqs: usize) -> Self {
        let model = load_gguf_weights(backend, &GgufFile::open(path).unwrap()).unwrap();
        let layout = KvLayout { layers: LAYERS, block_tokens: 16, kv_heads: 2, head_dim: HEAD, dtype: KvDtype::F16 };
        let kv = backend.kv(layout, seqs * BLOCKS_PER_SEQ).unwrap();
        Run { model, kv, scratch: Scratch::new(backend) }
    }

    /// One step: `rows` = (sequence, token, position); logits of every row.
    fn step(&mut self, backend: &B, tables: &[Vec<u32>], rows: &[(usize, u32, usize)], logit_rows: &[usize]) -> Vec<f32> {
        let tokens: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let positions: Vec<u32> = rows.iter().map(|r| r.2 as u32).collect();
        let slots: Vec<(u32, u32)> = rows.iter().map(|&(s, _, p)| (tables[s][p / 16], (p % 16) as u32)).collect();
        let attn: Vec<AttnRow> = rows.iter().map(|&(s, _, p)| AttnRow { block_table: &tables[s], pos: p }).collect();
        let input = StepInput { tokens: &tokens, positions: &positions, slots: &slots, attn: &attn, logit_rows };
        let Run { model, kv, scratch } = self;
        backend.run(|| model.forward(backend, kv, &input, scratch))
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn padded_replayed_decode_steps_give_the_eager_bits_and_allocate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_qwen3(dir.path());
    let lens = [260usize, 12, 5, 3, 1];
    let tables: Vec<Vec<u32>> = (0..lens.len()).map(|s| ((s * BLOCKS_PER_SEQ) as u32..((s + 1) * BLOCKS_PER_SEQ) as u32).collect()).collect();
    let plain_b = EmuBackend::new(1).unwrap();
    let stepped_b = EmuBackend::with_decode_steps(1).unwrap();
    let mut plain = Run::new(&plain_b, &path, lens.len());
    let mut stepped = Run::new(&stepped_b, &path, lens.len());

    // Prompts, one chunk each (the 1-token prompt is decode-shaped: it runs as a step too).
    let mut next = vec![0u32; lens.len()];
    for (s, &len) in lens.iter().enumerate() {
        let rows: Vec<(usize, u32, usize)> = (0..len).map(|p| (s, ((p * 7 + s) % VOCAB) as u32, p)).collect();
        let want = plain.step(&plain_b, &tables, &rows, &[len - 1]);
        let got = stepped.step(&stepped_b, &tables, &rows, &[len - 1]);
        assert_eq!(bits(&got), bits(&want), "prompt {s}: logits differ");
        next[s] = argmax(&want);
    }
    let mut pos = lens.to_vec();
    let host_b = EmuBackend::new(1).unwrap().with_host_sampling();
    // Batches of 5 (bucket 8), 2 (bucket 2) and 1; each shape at least three times.
    let schedule: Vec<Vec<usize>> = [vec![vec![0, 1, 2, 3, 4]; 4], vec![vec![1, 3]; 3], vec![vec![2]; 3], vec![vec![4, 0, 3, 1, 2]; 2]].concat();
    for (i, seqs) in schedule.iter().enumerate() {
        let rows: Vec<(usize, u32, usize)> = seqs.iter().map(|&s| (s, next[s], pos[s])).collect();
        let logit_rows: Vec<usize> = (0..rows.len()).collect();
        let want = plain.step(&plain_b, &tables, &rows, &logit_rows);
        let got = stepped.step(&stepped_b, &tables, &rows, &logit_rows);
        assert_eq!(got.len(), rows.len() * VOCAB, "step {i}: the real rows' logits only");
        assert_eq!(bits(&got), bits(&want), "step {i} ({} rows): a padded, staged step changed a row's bits", rows.len());
        for (r, &s) in seqs.iter().enumerate() {
            next[s] = argmax(&want[r * VOCAB..(r + 1) * VOCAB]);
            pos[s] += 1;
        }
        // The sampling kernel picks the same tokens from the (replayed) step's logits on the device.
        let picked = stepped.model.greedy(&stepped_b, &stepped.scratch, rows.len()).expect("the emulated backend samples greedy rows");
        let want_tokens: Vec<GreedyRow> = seqs.iter().map(|&s| GreedyRow::Token(next[s])).collect();
        assert_eq!(picked, want_tokens, "step {i}: greedy tokens sampled on the device");
        assert_eq!(stepped.model.greedy(&host_b, &stepped.scratch, rows.len()), None, "BATON_DEVICE_SAMPLING=0's backend declines");
    }
    let st = stepped_b.step_stats();
    println!("{st:?}");
    assert!(st.refused.is_empty(), "allocations or host uploads while captured: {:?}", st.refused);
    assert_eq!(st.unfit, 0);
    // Shapes (8 rows, 2 partitions), (2, 1) and (1, 1): one capture each, the later steps replayed.
    assert_eq!(st.captures, 3, "{st:?}");
    assert_eq!(st.replays, 2 + 2 + 1 + 1, "{st:?}");
    assert_eq!(plain_b.step_stats(), Default::default(), "no decode steps without them");
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// A body that allocates while captured is caught (on a GPU the capture would be
/// thrown away), and an allocation between steps sends a captured shape back to eager.
#[test]
fn the_guard_catches_allocations_in_a_capture_and_allocations_invalidate() {
    let b = EmuBackend::with_decode_steps(1).unwrap();
    let layout = KvLayout { layers: 1, block_tokens: 16, kv_heads: 1, head_dim: 16, dtype: KvDtype::F16 };
    let mut kv = b.kv(layout, 4).unwrap();
    let table = vec![2u32];
    let attn = [AttnRow { block_table: &table, pos: 3 }];
    let input = StepInput { tokens: &[1], positions: &[3], slots: &[(2, 3)], attn: &attn, logit_rows: &[0] };
    let mut t = b.tensor(8);
    let mut grow_to = 8;
    let mut step = |b: &EmuBackend, kv: &mut _, grow: bool| {
        grow_to += usize::from(grow) * 8;
        b.decode_step(kv, &input, 7, &mut |_| b.ensure_len(&mut t, grow_to));
    };
    step(&b, &mut kv, false); // eager
    step(&b, &mut kv, false); // captured
    step(&b, &mut kv, false); // replayed
    let st = b.step_stats();
    assert_eq!((st.eager, st.captures, st.replays, st.refused.len()), (1, 1, 1, 0), "{st:?}");
    step(&b, &mut kv, true); // replayed, and grows: caught
    let st = b.step_stats();
    assert_eq!(st.refused, ["growing a tensor"], "{st:?}");
    step(&b, &mut kv, false); // captured again (no longer trusted)
    assert_eq!(b.step_stats().captures, 2);
    let _moved = b.tensor(16); // an allocation between steps: the captured buffers may have moved
    step(&b, &mut kv, false);
    let st = b.step_stats();
    assert_eq!((st.eager, st.captures, st.replays), (2, 2, 1), "an allocation sends the shape back to eager: {st:?}");
    // Uploads are new buffers too (a graph bakes in the rope tables' and weights' addresses).
    step(&b, &mut kv, false); // captured
    let _rope = b.rope(baton_kernels::RopeTable::new(16, 10_000.0, 64));
    step(&b, &mut kv, false);
    let st = b.step_stats();
    assert_eq!((st.eager, st.captures), (3, 3), "new rope tables send the shape back to eager: {st:?}");
    step(&b, &mut kv, false); // captured
    let _w = b.matrix_from_f32(4, 32, vec![0.0; 128]).unwrap();
    step(&b, &mut kv, false);
    let st = b.step_stats();
    assert_eq!((st.eager, st.captures, st.refused.len()), (4, 4, 1), "a new matrix sends the shape back to eager: {st:?}");
}
