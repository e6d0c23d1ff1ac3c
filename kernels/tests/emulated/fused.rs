//! The fused kernels (fused.cu) against the sequences of unfused kernels they
//! replace, both emulated: the same bits, not a tolerance, since the CUDA
//! backend swaps one for the other and a row's bits must not depend on which
//! ran. The launches are the CUDA backend's (`cuda::plan`).

use super::{emu_kv_write, launch};
use crate::support::values;
use baton_kernels::cuda::plan::{self, AttentionPlan, ROW_THREADS, TOKEN_THREADS};
use baton_kernels::emu;
use baton_kernels::{AttnRow, KvDtype, KvLayout, RopeTable};

/// `to_bf16` of `x`, emulated.
fn to_bf16(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    unsafe { emu::to_bf16(&launch(plan::elementwise(x.len())), x.as_ptr(), out.as_mut_ptr(), x.len() as u64) };
    out
}

/// `rmsnorm`, then `to_bf16`: what `rmsnorm_bf16` replaces.
fn rmsnorm_then_bf16(x: &[f32], w: &[f32], eps: f32, rows: usize, dim: usize) -> Vec<u16> {
    let mut normed = vec![0f32; rows * dim];
    unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), w.as_ptr(), eps, dim as i32, normed.as_mut_ptr()) };
    to_bf16(&normed)
}

/// Row widths of the shipped and reference models (SmolLM2 576, Gemma 3 640,
/// Llama 2048 and 4096), and ones that leave threads of a block idle.
const DIMS: [usize; 6] = [576, 640, 2048, 4096, 100, 33];

#[test]
fn rmsnorm_bf16_gives_the_bits_of_rmsnorm_then_to_bf16() {
    for dim in DIMS {
        let rows = 5;
        // Rows of very different scales, so that rounding to bf16 differs row to row.
        let x: Vec<f32> = values(rows * dim, dim as u64).iter().enumerate().map(|(i, v)| v * [1.0, 1e-3, 300.0, 7.0, 1e4][i / dim]).collect();
        let w = values(dim, 2);
        let want = rmsnorm_then_bf16(&x, &w, 1e-6, rows, dim);
        let mut got = vec![0u16; rows * dim];
        unsafe { emu::rmsnorm_bf16(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), w.as_ptr(), 1e-6, dim as i32, got.as_mut_ptr()) };
        assert_eq!(got, want, "rmsnorm_bf16, rows of {dim}");
        // A row alone gives the bits it gives in the batch.
        let mut alone = vec![0u16; dim];
        unsafe { emu::rmsnorm_bf16(&launch(plan::per_row(1, ROW_THREADS)), x[3 * dim..].as_ptr(), w.as_ptr(), 1e-6, dim as i32, alone.as_mut_ptr()) };
        assert_eq!(alone, want[3 * dim..4 * dim], "rmsnorm_bf16 alone, rows of {dim}");
    }
}

#[test]
fn add_rmsnorm_bf16_gives_the_bits_of_add_then_the_norm() {
    for dim in DIMS {
        let rows = 6;
        let x = values(rows * dim, 10 + dim as u64);
        let y: Vec<f32> = values(rows * dim, 20 + dim as u64).iter().map(|v| v * 3.0).collect();
        let w = values(dim, 3);
        let mut want_x = x.clone();
        unsafe { emu::add_inplace(&launch(plan::elementwise(rows * dim)), want_x.as_mut_ptr(), y.as_ptr(), (rows * dim) as u64) };
        let want = rmsnorm_then_bf16(&want_x, &w, 1e-5, rows, dim);
        let mut got_x = x.clone();
        let mut got = vec![0u16; rows * dim];
        #[rustfmt::skip]
        unsafe { emu::add_rmsnorm_bf16(&launch(plan::per_row(rows, ROW_THREADS)), got_x.as_mut_ptr(), y.as_ptr(), w.as_ptr(), 1e-5, dim as i32, got.as_mut_ptr()) };
        assert_eq!(got_x, want_x, "add_rmsnorm_bf16: the residual stream, rows of {dim}");
        assert_eq!(got, want, "add_rmsnorm_bf16: the normed product input, rows of {dim}");

        // With a post norm of y first (Gemma): rmsnorm of y into a tensor, then the above.
        let wy = values(dim, 4);
        let mut normed_y = vec![0f32; rows * dim];
        unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), y.as_ptr(), wy.as_ptr(), 1e-6, dim as i32, normed_y.as_mut_ptr()) };
        let mut want_x = x.clone();
        let mut want = vec![0u16; rows * dim];
        #[rustfmt::skip]
        unsafe { emu::add_rmsnorm_bf16(&launch(plan::per_row(rows, ROW_THREADS)), want_x.as_mut_ptr(), normed_y.as_ptr(), w.as_ptr(), 1e-6, dim as i32, want.as_mut_ptr()) };
        let mut got_x = x.clone();
        #[rustfmt::skip]
        unsafe { emu::norm_add_rmsnorm_bf16(&launch(plan::per_row(rows, ROW_THREADS)), got_x.as_mut_ptr(), y.as_ptr(), wy.as_ptr(), w.as_ptr(), 1e-6, dim as i32, got.as_mut_ptr()) };
        assert_eq!(got_x, want_x, "norm_add_rmsnorm_bf16: the residual stream, rows of {dim}");
        assert_eq!(got, want, "norm_add_rmsnorm_bf16: the normed product input, rows of {dim}");
    }
}

#[test]
fn gated_activations_in_bf16_give_the_bits_of_the_gate_then_to_bf16() {
    let n = 5 * 1536 + 17;
    // Gates over the activations' whole range, then far out where the exponential saturates.
    let mut gate: Vec<f32> = values(n, 40).iter().map(|v| v * 8.0).collect();
    gate[..2401].iter_mut().enumerate().for_each(|(i, g)| *g = -120.0 + i as f32 * 0.1);
    let up = values(n, 41);
    let g = launch(plan::elementwise(n));
    let mut f32_out = vec![0f32; n];
    let mut got = vec![0u16; n];
    unsafe { emu::silu_mul(&g, gate.as_ptr(), up.as_ptr(), f32_out.as_mut_ptr(), n as u64) };
    unsafe { emu::silu_mul_bf16(&g, gate.as_ptr(), up.as_ptr(), got.as_mut_ptr(), n as u64) };
    assert_eq!(got, to_bf16(&f32_out), "silu_mul_bf16");
    unsafe { emu::gelu_mul(&g, gate.as_ptr(), up.as_ptr(), f32_out.as_mut_ptr(), n as u64) };
    unsafe { emu::gelu_mul_bf16(&g, gate.as_ptr(), up.as_ptr(), got.as_mut_ptr(), n as u64) };
    assert_eq!(got, to_bf16(&f32_out), "gelu_mul_bf16");
}

/// `rope_kv_write_*` for `layout.dtype` into an emulated arena.
#[allow(clippy::too_many_arguments)]
fn emu_rope_kv_write(arena: &mut [u8], layout: KvLayout, layer: usize, table: &RopeTable, q: &mut [f32], q_heads: usize, k: &[f32], v: &[f32], positions: &[u32], slots: &[(u32, u32)]) {
    let flat: Vec<u32> = slots.iter().flat_map(|&(b, s)| [b, s]).collect();
    let (cos, sin) = table.tables();
    let g = launch(plan::per_row(slots.len(), TOKEN_THREADS));
    let (a, qp, kp, vp, c, s, p, f) = (arena.as_mut_ptr(), q.as_mut_ptr(), k.as_ptr(), v.as_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), flat.as_ptr());
    let (qh, half, l, nl, bt, te) = (q_heads as i32, (layout.head_dim / 2) as i32, layer as i32, layout.layers as i32, layout.block_tokens as i32, layout.token_elems() as i32);
    unsafe {
        match layout.dtype {
            KvDtype::F32 => emu::rope_kv_write_f32(&g, a, qp, kp, vp, c, s, p, f, qh, half, l, nl, bt, te),
            KvDtype::F16 => emu::rope_kv_write_f16(&g, a, qp, kp, vp, c, s, p, f, qh, half, l, nl, bt, te),
            KvDtype::BF16 => emu::rope_kv_write_bf16(&g, a, qp, kp, vp, c, s, p, f, qh, half, l, nl, bt, te),
            KvDtype::F8E4M3 => emu::rope_kv_write_e4m3(&g, a, qp, kp, vp, c, s, p, f, qh, half, l, nl, bt, te),
        }
    }
}

/// `rope` of the queries, `rope` of the keys, `kv_write`: what `rope_kv_write_*` replaces.
#[allow(clippy::too_many_arguments)]
fn rope_then_kv_write(arena: &mut [u8], layout: KvLayout, layer: usize, table: &RopeTable, q: &mut [f32], q_heads: usize, k: &[f32], v: &[f32], positions: &[u32], slots: &[(u32, u32)]) {
    let (cos, sin) = table.tables();
    let g = launch(plan::per_row(positions.len(), TOKEN_THREADS));
    let half = (layout.head_dim / 2) as i32;
    let mut k = k.to_vec();
    unsafe { emu::rope(&g, q.as_mut_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), q_heads as i32, half) };
    unsafe { emu::rope(&g, k.as_mut_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), layout.kv_heads as i32, half) };
    emu_kv_write(arena, layout, layer, &k, v, slots);
}

/// A prefill chunk's rows (in 6 blocks of 16): scattered slots, positions up to a
/// 4,096-position rope table's end.
const CHUNK_POSITIONS: [u32; 7] = [0, 1, 2, 17, 511, 4095, 77];
const CHUNK_SLOTS: [(u32, u32); 7] = [(5, 0), (5, 1), (0, 15), (2, 7), (3, 3), (1, 9), (4, 12)];

#[test]
fn rope_kv_write_gives_the_bits_of_rope_then_kv_write() {
    // (query heads, KV heads, head size, rotary table): SmolLM2, Gemma 3 (local and
    // global tables), Llama 3 with frequency factors.
    let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 0.125).collect();
    let shapes = [
        (9, 3, 64, RopeTable::new(64, 100_000.0, 4096)),
        (4, 1, 256, RopeTable::scaled(256, 10_000.0, 4096, 1.0, None)),
        (4, 1, 256, RopeTable::scaled(256, 1_000_000.0, 4096, 0.125, None)),
        (32, 8, 128, RopeTable::scaled(128, 500_000.0, 4096, 1.0, Some(&factors))),
    ];
    for (q_heads, kv_heads, hd, table) in shapes {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
            let layout = KvLayout { layers: 3, block_tokens: 16, kv_heads, head_dim: hd, dtype };
            let blocks = 6;
            let te = layout.token_elems();
            let (positions, slots) = (CHUNK_POSITIONS, CHUNK_SLOTS);
            let rows = slots.len();
            let q = values(rows * q_heads * hd, 50 + hd as u64);
            // Keys past e4m3's range, so that saturation is checked too.
            let k: Vec<f32> = values(rows * te, 51).iter().map(|x| x * 600.0).collect();
            let v = values(rows * te, 52);
            let mut want_arena = vec![0u8; blocks * layout.block_bytes()];
            let mut want_q = q.clone();
            rope_then_kv_write(&mut want_arena, layout, 1, &table, &mut want_q, q_heads, &k, &v, &positions, &slots);
            let mut got_arena = vec![0u8; blocks * layout.block_bytes()];
            let mut got_q = q.clone();
            emu_rope_kv_write(&mut got_arena, layout, 1, &table, &mut got_q, q_heads, &k, &v, &positions, &slots);
            let what = format!("rope_kv_write, {q_heads}/{kv_heads} heads of {hd}, {dtype:?}");
            assert!(got_q == want_q, "{what}: the rotated queries differ");
            assert!(got_arena == want_arena, "{what}: the arena's bytes differ");
            assert!(want_arena.iter().any(|&b| b != 0), "{what}: nothing written");
        }
    }
}

/// `rmsnorm` of each head (rows of `hd`, rmsnorm's launch), what QK-norm runs unfused.
fn head_norms(x: &[f32], w: &[f32], eps: f32, hd: usize) -> Vec<f32> {
    let rows = x.len() / hd;
    let mut out = vec![0f32; x.len()];
    unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), w.as_ptr(), eps, hd as i32, out.as_mut_ptr()) };
    out
}

#[test]
fn qk_norm_rope_kv_write_gives_the_bits_of_the_head_norms_then_rope_kv_write() {
    // (query heads, KV heads, head size): Qwen3, Gemma 3, a head past rmsnorm's
    // 256 threads (each thread two elements), and a small one (idle lanes).
    let shapes = [(16, 8, 128), (4, 1, 256), (2, 1, 512), (9, 3, 64), (3, 1, 16)];
    for (q_heads, kv_heads, hd) in shapes {
        let table = RopeTable::new(hd, 1_000_000.0, 4096);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
            let layout = KvLayout { layers: 3, block_tokens: 16, kv_heads, head_dim: hd, dtype };
            let blocks = 6;
            let te = layout.token_elems();
            let (positions, slots) = (CHUNK_POSITIONS, CHUNK_SLOTS);
            let rows = slots.len();
            // Heads of very different scales, so that each head's factor matters.
            let q: Vec<f32> = values(rows * q_heads * hd, 60 + hd as u64).iter().enumerate().map(|(i, x)| x * [1.0, 1e-3, 40.0][(i / hd) % 3]).collect();
            let k: Vec<f32> = values(rows * te, 61).iter().enumerate().map(|(i, x)| x * [600.0, 0.01][(i / hd) % 2]).collect();
            let v = values(rows * te, 62);
            // Norm weights past e4m3's range, so that saturation is checked after the norm too.
            let (wq, wk): (Vec<f32>, Vec<f32>) = (values(hd, 63), values(hd, 64).iter().map(|x| x * 900.0).collect());
            let eps = 1e-6;

            let mut want_arena = vec![0u8; blocks * layout.block_bytes()];
            let mut want_q = head_norms(&q, &wq, eps, hd);
            let want_k = head_norms(&k, &wk, eps, hd);
            rope_then_kv_write(&mut want_arena, layout, 1, &table, &mut want_q, q_heads, &want_k, &v, &positions, &slots);

            let mut got_arena = vec![0u8; blocks * layout.block_bytes()];
            let (mut got_q, mut got_k) = (q.clone(), k.clone());
            let flat: Vec<u32> = slots.iter().flat_map(|&(b, s)| [b, s]).collect();
            let (cos, sin) = table.tables();
            let g = launch(plan::per_row(rows, TOKEN_THREADS));
            let (a, qp, kp, vp, c, s, p, f) = (got_arena.as_mut_ptr(), got_q.as_mut_ptr(), got_k.as_mut_ptr(), v.as_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), flat.as_ptr());
            let (qh, half, nl, bt, te_i) = (q_heads as i32, (hd / 2) as i32, layout.layers as i32, layout.block_tokens as i32, te as i32);
            let kernel = match dtype {
                KvDtype::F32 => emu::qk_norm_rope_kv_write_f32,
                KvDtype::F16 => emu::qk_norm_rope_kv_write_f16,
                KvDtype::BF16 => emu::qk_norm_rope_kv_write_bf16,
                KvDtype::F8E4M3 => emu::qk_norm_rope_kv_write_e4m3,
            };
            unsafe { kernel(&g, a, qp, kp, vp, wq.as_ptr(), wk.as_ptr(), eps, c, s, p, f, qh, half, 1, nl, bt, te_i) };

            let what = format!("qk_norm_rope_kv_write, {q_heads}/{kv_heads} heads of {hd}, {dtype:?}");
            assert!(got_q == want_q, "{what}: the normed, rotated queries differ");
            assert!(got_k == want_k, "{what}: the normed keys differ");
            assert!(got_arena == want_arena, "{what}: the arena's bytes differ");
            assert!(want_arena.iter().any(|&b| b != 0), "{what}: nothing written");
        }
    }
}

#[test]
fn attn_combine_bf16_gives_the_bits_of_attn_combine_then_to_bf16() {
    // Rows in one partition, at its edges and over many (a decode row at 3000),
    // with and without a window that drops the first partitions.
    let positions = [0usize, 5, 255, 256, 700, 3000];
    let table: Vec<u32> = (0..3000 / 16 + 1).collect();
    let rows: Vec<AttnRow> = positions.iter().map(|&pos| AttnRow { block_table: &table, pos }).collect();
    for (n_heads, kv_heads, hd) in [(9, 3, 64), (4, 1, 256), (32, 8, 128)] {
        let p = AttentionPlan::new(&rows, 16, hd, n_heads, kv_heads);
        let slots = p.partial_slots(n_heads);
        // Partials of very different maxima (the exponentials reach zero) and sums.
        let acc: Vec<f32> = values(slots * hd, 70 + hd as u64).iter().map(|x| x * 50.0).collect();
        let ml: Vec<f32> = values(slots * 2, 71).chunks(2).flat_map(|c| [c[0] * 120.0, c[1].abs() * 30.0 + 0.5]).collect();
        for window in [0i32, 300] {
            let n = rows.len() * n_heads * hd;
            let (nh, hd_i, mp) = (n_heads as i32, hd as i32, p.max_parts as i32);
            let mut f32_out = vec![0f32; n];
            let mut got = vec![0u16; n];
            let g = launch(p.combine);
            unsafe { emu::attn_combine(&g, acc.as_ptr(), ml.as_ptr(), p.positions.as_ptr(), nh, hd_i, window, mp, f32_out.as_mut_ptr()) };
            unsafe { emu::attn_combine_bf16(&g, acc.as_ptr(), ml.as_ptr(), p.positions.as_ptr(), nh, hd_i, window, mp, got.as_mut_ptr()) };
            let what = format!("attn_combine_bf16, {n_heads}/{kv_heads} heads of {hd}, window {window}");
            assert!(f32_out.iter().all(|x| x.is_finite()) && f32_out.iter().any(|&x| x != 0.0), "{what}: the f32 output is not a real one");
            assert_eq!(got, to_bf16(&f32_out), "{what}");
        }
    }
}
