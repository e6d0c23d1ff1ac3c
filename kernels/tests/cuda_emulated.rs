//! The CUDA kernels run on the CPU (feature `emu`, `kernels/emu`) against the
//! CPU backend, launched from the same plans the CUDA backend launches from
//! (`cuda::plan`). No GPU needed, so every CI run checks the kernels' indexing,
//! reductions, rounding and batch invariance; the GPU suite
//! (`cuda_conformance.rs`, bench/gpu/run.sh) remains the judge of what only a
//! GPU does (its math library, FMA contraction, memory model).
//!
//! Tolerances are the GPU suite's: 1e-5 relative for f32 arithmetic, exact for
//! KV bytes, conversions, copies and argmax, and the same bits for a row alone
//! as in a batch.
#![cfg(feature = "emu")]

use baton_kernels::cuda::plan::{self, ROW_THREADS, TOKEN_THREADS};
use baton_kernels::emu::{self, Launch};
use baton_kernels::{Backend, CpuBackend, GreedyRow, KvDtype, KvLayout};
use support::{rel_err, values};

mod support;
// The attention kernels (CUDA cores and tensor cores) against the CPU backend.
#[path = "emulated/attention.rs"]
mod attention;
// A captured decode step's attention (padded rows, fixed capacity) against the exact launch.
#[path = "emulated/step.rs"]
mod step;
// The fused kernels against the unfused sequences they replace.
#[path = "emulated/fused.rs"]
mod fused;
// The CRC-32 of a frame in device memory against crc32fast.
#[path = "emulated/crc.rs"]
mod crc;

fn launch(g: plan::Geometry) -> Launch {
    Launch::new(g.grid, g.block, g.shared_bytes as usize)
}

#[test]
fn row_and_elementwise_kernels_match_the_cpu() {
    let c = CpuBackend::new(1).unwrap();
    let (rows, dim) = (7, 576);
    let x = values(rows * dim, 1);
    let w = values(dim, 2);

    let mut want = c.tensor(0);
    c.rmsnorm(&x, &w, 1e-5, rows, dim, &mut want);
    let mut got = vec![0f32; rows * dim];
    unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), w.as_ptr(), 1e-5, dim as i32, got.as_mut_ptr()) };
    let e = rel_err(&got, &want[..rows * dim]);
    assert!(e <= 1e-5, "rmsnorm: {e}");

    let y = values(rows * dim, 3);
    let mut want = c.tensor(0);
    c.silu_mul(&x, &y, rows * dim, &mut want);
    let mut got = vec![0f32; rows * dim];
    unsafe { emu::silu_mul(&launch(plan::elementwise(rows * dim)), x.as_ptr(), y.as_ptr(), got.as_mut_ptr(), (rows * dim) as u64) };
    let e = rel_err(&got, &want[..rows * dim]);
    assert!(e <= 1e-5, "silu_mul: {e}");

    let mut want = x.clone();
    c.add(&mut want, &y, rows * dim);
    let mut got = x.clone();
    unsafe { emu::add_inplace(&launch(plan::elementwise(rows * dim)), got.as_mut_ptr(), y.as_ptr(), (rows * dim) as u64) };
    assert_eq!(got, want, "add is exact");

    let picks = [5usize, 0, 5];
    let mut want = c.tensor(0);
    c.gather_rows(&x, dim, &picks, &mut want);
    let ids: Vec<u32> = picks.iter().map(|&r| r as u32).collect();
    let mut got = vec![0f32; 3 * dim];
    unsafe { emu::gather_rows(&launch(plan::per_row(3, ROW_THREADS)), x.as_ptr(), ids.as_ptr(), dim as i32, got.as_mut_ptr()) };
    assert_eq!(got, want[..3 * dim], "gather is exact");

    let (heads, hd) = (9, 64);
    let q = values(rows * heads * hd, 4);
    let positions: Vec<u32> = vec![0, 1, 2, 100, 1000, 4095, 17];
    let table = c.rope(baton_kernels::RopeTable::new(hd, 10_000.0, 4096));
    let mut want = q.clone();
    c.apply_rope(&table, &mut want, &positions, heads);
    let (cos, sin) = table.tables();
    let mut got = q.clone();
    unsafe { emu::rope(&launch(plan::per_row(rows, TOKEN_THREADS)), got.as_mut_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), heads as i32, (hd / 2) as i32) };
    let e = rel_err(&got, &want);
    assert!(e <= 1e-5, "rope: {e}");
}

#[test]
fn conversions_round_like_the_cpu_bit_for_bit() {
    // Ties, subnormals, the largest finite values, infinities and NaN.
    let mut x = values(4096, 6);
    x.extend([0.0, -0.0, 1.0 + f32::EPSILON * 64.0, 65504.0, 65520.0, 1e-7, -3e-8, 6.0e-5, f32::INFINITY, f32::NEG_INFINITY, 3.4e38, 1.0e-40]);
    x.extend((0..64).map(|i| f32::from_bits(0x3f80_8000 + i * 0x1_0000))); // bf16 ties, odd and even
    let n = x.len();
    let mut got = vec![0u16; n];
    unsafe { emu::to_bf16(&launch(plan::elementwise(n)), x.as_ptr(), got.as_mut_ptr(), n as u64) };
    let want: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    assert_eq!(got, want, "to_bf16");

    // The embedding rows come back as exactly the bf16 values of the table.
    let (vocab, dim) = (100, 64);
    let table: Vec<u16> = values(vocab * dim, 8).iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let tokens = [0u32, 99, 17, 17];
    let mut got = vec![0f32; tokens.len() * dim];
    unsafe { emu::embed_bf16(&launch(plan::per_row(tokens.len(), ROW_THREADS)), table.as_ptr(), tokens.as_ptr(), dim as i32, got.as_mut_ptr()) };
    let want: Vec<f32> = tokens.iter().flat_map(|&t| table[t as usize * dim..(t as usize + 1) * dim].iter().map(|&b| half::bf16::from_bits(b).to_f32())).collect();
    assert_eq!(got, want, "embed_bf16");
}

#[test]
fn sampling_kernels_match_the_cpu() {
    let n = 49_152;
    let mut logits = values(3 * n, 5);
    logits[n + 7] = 5.0;
    logits[n + 9] = 5.0; // a tie: the lower index wins
    let got = greedy_rows(&logits, 3, n);
    let want: Vec<GreedyRow> = logits.chunks(n).map(|r| GreedyRow::Token(baton_kernels::ops::argmax(r) as u32)).collect();
    assert_eq!(got, want);
    assert_eq!(got[1], GreedyRow::Token(7));

    let t = 0.7f32;
    let mut got = vec![0f32; 3 * n];
    unsafe { emu::softmax_rows(&launch(plan::per_row(3, ROW_THREADS)), logits.as_ptr(), n as i32, 1.0 / t, got.as_mut_ptr()) };
    for (r, row) in logits.chunks(n).enumerate() {
        let m = row.iter().map(|&v| (v / t) as f64).fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|&v| ((v / t) as f64 - m).exp()).sum();
        let want: Vec<f32> = row.iter().map(|&v| (((v / t) as f64 - m).exp() / sum) as f32).collect();
        let e = rel_err(&got[r * n..(r + 1) * n], &want);
        assert!(e <= 1e-5, "softmax row {r}: {e}");
    }
}

/// The CPU arena's bytes, every block in order: the GPU arena's layout.
fn arena_bytes(c: &CpuBackend, kv: &<CpuBackend as Backend>::Kv, layout: KvLayout, blocks: usize) -> Vec<u8> {
    let bb = layout.block_bytes();
    let mut out = vec![0u8; blocks * bb];
    for (b, chunk) in out.chunks_exact_mut(bb).enumerate() {
        c.kv_copy_block_out(kv, b, chunk);
    }
    out
}

/// `kv_write` for `dtype` on an emulated arena.
fn emu_kv_write(arena: &mut [u8], layout: KvLayout, layer: usize, k: &[f32], v: &[f32], slots: &[(u32, u32)]) {
    let flat: Vec<u32> = slots.iter().flat_map(|&(b, s)| [b, s]).collect();
    let l = launch(plan::per_row(slots.len(), TOKEN_THREADS));
    let args = (arena.as_mut_ptr(), k.as_ptr(), v.as_ptr(), flat.as_ptr(), layer as i32, layout.layers as i32, layout.block_tokens as i32, layout.token_elems() as i32);
    unsafe {
        match layout.dtype {
            KvDtype::F32 => emu::kv_write_f32(&l, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7),
            KvDtype::F16 => emu::kv_write_f16(&l, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7),
            KvDtype::BF16 => emu::kv_write_bf16(&l, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7),
            KvDtype::F8E4M3 => emu::kv_write_e4m3(&l, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7),
        }
    }
}

/// Blocks packed by the emulated kernel (a layer range of scattered blocks)
/// equal the CPU arena's slices; unpacked into other blocks, they read back the same.
#[test]
fn kv_pack_and_unpack_move_whole_layers() {
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 5, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype: KvDtype::BF16 };
    let blocks = 12;
    let mut kc = c.kv(layout, blocks).unwrap();
    let te = layout.token_elems();
    for layer in 0..layout.layers {
        let slots: Vec<(u32, u32)> = (0..6 * 16).map(|p| (p / 16, p % 16)).collect();
        c.kv_write(&mut kc, layer, &values(96 * te, layer as u64), &values(96 * te, 50 + layer as u64), &slots);
    }
    let mut arena = arena_bytes(&c, &kc, layout, blocks);
    let (ids, layers) = ([4u32, 0, 2], 1..4);
    let (lb, span) = (layout.block_layer_bytes(), 3 * layout.block_layer_bytes());
    let mut packed = vec![0u8; ids.len() * span];
    let words_per_block_layer = (lb / 4) as u64;
    let (nl, l0, l1) = (layout.layers as i32, layers.start as i32, layers.end as i32);
    let arena_words = arena.as_ptr().cast::<u32>();
    unsafe { emu::kv_pack(&launch(plan::kv_copy(span, ids.len())), arena_words, ids.as_ptr(), words_per_block_layer, nl, l0, l1, packed.as_mut_ptr().cast()) };
    for (i, &b) in ids.iter().enumerate() {
        let at = b as usize * layout.block_bytes() + layers.start * lb;
        assert!(packed[i * span..(i + 1) * span] == arena[at..at + span], "block {b}: packed bytes differ");
    }
    let into = [11u32, 7, 9];
    unsafe { emu::kv_unpack(&launch(plan::kv_copy(span, into.len())), arena.as_mut_ptr().cast(), into.as_ptr(), words_per_block_layer, nl, l0, l1, packed.as_ptr().cast()) };
    for (i, &b) in into.iter().enumerate() {
        let at = b as usize * layout.block_bytes() + layers.start * lb;
        assert!(arena[at..at + span] == packed[i * span..(i + 1) * span], "block {b}: unpacked bytes differ");
    }
}

/// `kv_unpack_from` (each block's layers at its own device address: frames left in a
/// GPU-memory RDMA ring) installs the same bytes as `kv_unpack` from one packed buffer,
/// the sources scattered through a larger buffer, in another order than the blocks.
#[test]
fn kv_unpack_from_scattered_sources_equals_kv_unpack() {
    let layout = KvLayout { layers: 4, block_tokens: 16, kv_heads: 2, head_dim: 32, dtype: KvDtype::F16 };
    let blocks = 10;
    let (lb, bb) = (layout.block_layer_bytes(), layout.block_bytes());
    let (layers, into) = (1usize..3, [7u32, 2, 9, 0, 5]);
    let span = layers.len() * lb;
    let packed: Vec<u8> = values(into.len() * span / 4, 31).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    let (wpbl, nl, l0, l1) = ((lb / 4) as u64, layout.layers as i32, layers.start as i32, layers.end as i32);
    let before: Vec<u8> = values(blocks * bb / 4, 32).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();

    let mut want = before.clone();
    unsafe { emu::kv_unpack(&launch(plan::kv_copy(span, into.len())), want.as_mut_ptr().cast(), into.as_ptr(), wpbl, nl, l0, l1, packed.as_ptr().cast()) };

    // Block i's bytes at slot order[i] of a ring with room between the slots (a header's worth).
    let (slot, order) = (span + 44, [3usize, 0, 4, 1, 2]);
    let mut ring = vec![0xa5u8; (into.len() + 1) * slot];
    for (i, &o) in order.iter().enumerate() {
        ring[o * slot + 44..o * slot + 44 + span].copy_from_slice(&packed[i * span..(i + 1) * span]);
    }
    let addrs = order.iter().map(|&o| ring[o * slot + 44..].as_ptr() as u64);
    let srcs: Vec<u32> = addrs.flat_map(|a| [a as u32, (a >> 32) as u32]).collect();
    let mut got = before.clone();
    unsafe { emu::kv_unpack_from(&launch(plan::kv_copy(span, into.len())), got.as_mut_ptr().cast(), into.as_ptr(), wpbl, nl, l0, l1, srcs.as_ptr()) };
    assert!(got == want, "kv_unpack_from and kv_unpack installed different bytes");
    assert!(got != before, "nothing was installed");
}

/// The emulator keeps CUDA's rules: a warp shuffle needs a whole warp, so a
/// block of 48 threads (a warp and a half) is an error, not a quiet answer.
#[test]
#[should_panic(expected = "warp shuffle in a warp of 16 threads")]
fn a_shuffle_in_a_partial_warp_is_reported() {
    let x = values(576, 1);
    let w = values(576, 2);
    let mut out = vec![0f32; 576];
    unsafe { emu::rmsnorm(&launch(plan::per_row(1, 48)), x.as_ptr(), w.as_ptr(), 1e-5, 576, out.as_mut_ptr()) };
}

/// The operations the other families add to Llama's forward pass, against the CPU
/// backend: Gemma's GELU-tanh gate (over the whole range of gates, past where the
/// exponential saturates), Qwen2's Q/K/V biases (exact), Gemma's embedding scale
/// (exact), QK-norm (the row norm over each head: Qwen3's head size 128, Gemma 3's
/// 256), and rotary tables per layer: Gemma 3's local and global bases, Llama 3's
/// frequency factors and linear scaling.
#[test]
fn family_operations_match_the_cpu() {
    let c = CpuBackend::new(1).unwrap();
    let (rows, ffn) = (5, 2048);
    let n = rows * ffn;
    // Gates of the range activations take, then far out on both sides.
    let mut gate: Vec<f32> = values(n, 31).iter().map(|v| v * 8.0).collect();
    gate[..2401].iter_mut().enumerate().for_each(|(i, g)| *g = -120.0 + i as f32 * 0.1);
    let up = values(n, 32);
    let mut want = c.tensor(0);
    c.gelu_mul(&gate, &up, n, &mut want);
    let mut got = vec![0f32; n];
    unsafe { emu::gelu_mul(&launch(plan::elementwise(n)), gate.as_ptr(), up.as_ptr(), got.as_mut_ptr(), n as u64) };
    let e = rel_err(&got, &want[..n]);
    assert!(e <= 1e-5, "gelu_mul: {e}");
    // Element by element too: a relative error that the largest value would hide.
    for ((g, w), o) in gate.iter().zip(&want).zip(&got) {
        assert!((w - o).abs() <= 1e-5 * w.abs() + 1e-30, "gelu_mul({g}): {o} vs the CPU's {w}");
    }

    // Qwen2: q (14 heads of 64) and k/v (2 heads of 64) biases over 9 rows.
    for width in [896usize, 128] {
        let rows = 9;
        let x = values(rows * width, 33);
        let bias = values(width, 34);
        let mut want = x.clone();
        c.add_rows(&mut want, &bias, rows, width);
        let mut got = x.clone();
        unsafe { emu::add_rows(&launch(plan::elementwise(rows * width)), got.as_mut_ptr(), bias.as_ptr(), (rows * width) as u64, width as i32) };
        assert_eq!(got, want, "add_rows of width {width} is exact");
    }

    let hidden = 640;
    let x = values(rows * hidden, 35);
    let s = (hidden as f32).sqrt();
    let mut want = x.clone();
    c.scale(&mut want, s, rows * hidden);
    let mut got = x.clone();
    unsafe { emu::scale_inplace(&launch(plan::elementwise(rows * hidden)), got.as_mut_ptr(), s, (rows * hidden) as u64) };
    assert_eq!(got, want, "scale is exact");

    // QK-norm: rows x heads rows of one head each, the backend's rmsnorm launch.
    for (heads, hd) in [(16usize, 128usize), (4, 256), (1, 256)] {
        let x = values(rows * heads * hd, 36 + hd as u64);
        let w = values(hd, 37);
        let n_rows = rows * heads;
        let mut want = c.tensor(0);
        c.rmsnorm(&x, &w, 1e-6, n_rows, hd, &mut want);
        let mut got = vec![0f32; n_rows * hd];
        unsafe { emu::rmsnorm(&launch(plan::per_row(n_rows, ROW_THREADS)), x.as_ptr(), w.as_ptr(), 1e-6, hd as i32, got.as_mut_ptr()) };
        let e = rel_err(&got, &want[..n_rows * hd]);
        assert!(e <= 1e-5, "head norm ({heads} heads of {hd}): {e}");
    }

    // Rotary tables of different layers: the kernel reads whichever table it is given.
    let positions: Vec<u32> = vec![0, 1, 511, 4095, 77];
    let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 0.125).collect();
    let tables = [
        ("Gemma 3 local", 256, baton_kernels::RopeTable::scaled(256, 10_000.0, 4096, 1.0, None)),
        ("Gemma 3 global", 256, baton_kernels::RopeTable::scaled(256, 1_000_000.0, 4096, 0.125, None)),
        ("Llama 3 factors", 128, baton_kernels::RopeTable::scaled(128, 500_000.0, 4096, 1.0, Some(&factors))),
    ];
    for (what, hd, table) in tables {
        let heads = 4;
        let q = values(positions.len() * heads * hd, 38);
        let table = c.rope(table);
        let mut want = q.clone();
        c.apply_rope(&table, &mut want, &positions, heads);
        let (cos, sin) = table.tables();
        let mut got = q.clone();
        #[rustfmt::skip]
        unsafe { emu::rope(&launch(plan::per_row(positions.len(), TOKEN_THREADS)), got.as_mut_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), heads as i32, (hd / 2) as i32) };
        let e = rel_err(&got, &want);
        assert!(e <= 1e-5, "rope ({what}): {e}");
    }
}

/// The sampling kernel's greedy token and status of each of `rows` rows of `n`.
fn greedy_rows(logits: &[f32], rows: usize, n: usize) -> Vec<GreedyRow> {
    let (mut token, mut status) = (vec![0u32; rows], vec![0u32; rows]);
    // SAFETY: logits holds rows x n values; token and status one word a row.
    unsafe { emu::argmax_rows(&launch(plan::per_row(rows, ROW_THREADS)), logits.as_ptr(), n as i32, token.as_mut_ptr(), status.as_mut_ptr()) };
    token.into_iter().zip(status).map(|(t, s)| GreedyRow::from_kernel(t, s)).collect()
}

/// The CPU sampler's greedy outcome for `row`, in the kernel's terms.
fn sampler_greedy(row: &[f32]) -> GreedyRow {
    use baton_text::sampling::{Sampler, SamplingError, SamplingParams};
    let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() }.validate().expect("greedy parameters");
    let mut sampler = Sampler::with_seed(&params, 1);
    assert!(sampler.is_plain_greedy());
    match sampler.sample(row) {
        Ok(s) => GreedyRow::Token(s.token),
        Err(SamplingError::NonFiniteLogit { index }) => GreedyRow::NonFinite(index as u32),
        Err(SamplingError::AllMasked) => GreedyRow::AllMasked,
        Err(e) => panic!("greedy sampling failed unexpectedly: {e}"),
    }
}

#[test]
fn greedy_kernel_follows_the_cpu_sampler() {
    // A vocabulary that is not a multiple of the 256 threads, and one shorter than them.
    for n in [1000usize, 37] {
        let base = values(n, 11);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        rows.push(base.clone());
        let mut tie = base.clone();
        tie[n - 3] = 9.0;
        tie[n - 1] = 9.0;
        tie[n / 2] = 9.0; // the lowest of three equal maxima wins
        rows.push(tie);
        let mut zeros = vec![f32::NEG_INFINITY; n];
        zeros[n - 1] = 0.0;
        zeros[n - 2] = -0.0; // -0 equals 0: the lower index wins
        rows.push(zeros);
        let mut nan = base.clone();
        nan[n - 2] = f32::NAN;
        nan[n - 1] = f32::INFINITY;
        rows.push(nan);
        let mut inf = base.clone();
        inf[n / 3] = f32::INFINITY;
        inf[n - 1] = f32::NAN;
        rows.push(inf);
        rows.push(vec![f32::NEG_INFINITY; n]);
        let mut single = vec![f32::NEG_INFINITY; n];
        single[n - 1] = -1e30;
        rows.push(single);
        let mut low = vec![f32::NEG_INFINITY; n];
        low[0] = f32::MIN;
        rows.push(low);
        let flat: Vec<f32> = rows.concat();
        let got = greedy_rows(&flat, rows.len(), n);
        let want: Vec<GreedyRow> = rows.iter().map(|r| sampler_greedy(r)).collect();
        assert_eq!(got, want, "vocabulary {n}");
        // The rules were exercised: a tie, both failures, a lone finite value.
        assert_eq!(want[1], GreedyRow::Token((n / 2) as u32));
        assert_eq!(want[2], GreedyRow::Token((n - 2) as u32));
        assert_eq!(want[3], GreedyRow::NonFinite((n - 2) as u32));
        assert_eq!(want[4], GreedyRow::NonFinite((n / 3) as u32));
        assert_eq!(want[5], GreedyRow::AllMasked);
        assert_eq!(want[6], GreedyRow::Token((n - 1) as u32));
        assert_eq!(want[7], GreedyRow::Token(0));
    }
}
