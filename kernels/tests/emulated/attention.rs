//! The attention kernels on the CPU (emulated) against the CPU backend, each
//! launched from the plan `CudaBackend::attention` launches it from: the
//! CUDA-core kernels (f32 KV, GPUs before sm_80, head sizes the tensor-core
//! kernel lacks) and the tensor-core kernel (`attn_mma_*`: ldmatrix, mma.sync
//! and cp.async, emulated with the PTX fragment layouts), with and without a
//! sliding window. Beside the CPU's results, each checks the determinism
//! contract bit for bit: a row alone gives the same bits as in its batch, a
//! prefill row the same as that position decoded alone, and as in a chunk cut
//! elsewhere.

use baton_kernels::cuda::plan::{AttentionPlan, AttnKernel};
use baton_kernels::emu;
use baton_kernels::{AttnRow, Backend, CpuBackend, KvDtype, KvLayout};

use super::support::{rel_err, scattered_tables, sequence_kv, values};
use super::{arena_bytes, emu_kv_write, launch};

/// One attention call on an emulated arena, as `CudaBackend::attention` makes it
/// on a GPU with (`tensor_cores`) or without tensor cores; and the kernel it ran.
#[allow(clippy::too_many_arguments)]
fn emu_attention(arena: &[u8], layout: KvLayout, layer: usize, q: &[f32], rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, tensor_cores: bool) -> (Vec<f32>, AttnKernel) {
    let hd = layout.head_dim;
    let p = AttentionPlan::for_gpu(rows, layout.block_tokens, hd, n_heads, layout.kv_heads, tensor_cores && layout.dtype != KvDtype::F32);
    let slots = p.partial_slots(n_heads);
    let (mut part_acc, mut part_ml) = (vec![f32::NAN; slots * hd], vec![f32::NAN; slots * 2]);
    let mut out = vec![0f32; rows.len() * n_heads * hd];
    let (layer, layers, bt, kvh, hd_i, nh, mp) = (layer as i32, layout.layers as i32, layout.block_tokens as i32, layout.kv_heads as i32, hd as i32, n_heads as i32, p.max_parts as i32);
    let w = window.map_or(0, |w| w as i32);
    let (a, qp, t, o, pos) = (arena.as_ptr(), q.as_ptr(), p.tables.as_ptr(), p.offsets.as_ptr(), p.positions.as_ptr());
    let (s, n) = (p.run_start.as_ptr(), p.run_len.as_ptr());
    let (acc, ml) = (part_acc.as_mut_ptr(), part_ml.as_mut_ptr());
    let l = launch(p.partial);
    unsafe {
        match (p.kernel, layout.dtype) {
            (AttnKernel::Mma, dtype) => {
                let kernel = match (dtype, hd) {
                    (KvDtype::F16, 32) => emu::attn_mma_f16_d32,
                    (KvDtype::F16, 64) => emu::attn_mma_f16_d64,
                    (KvDtype::F16, 128) => emu::attn_mma_f16_d128,
                    (KvDtype::BF16, 32) => emu::attn_mma_bf16_d32,
                    (KvDtype::BF16, 64) => emu::attn_mma_bf16_d64,
                    (KvDtype::BF16, 128) => emu::attn_mma_bf16_d128,
                    (KvDtype::F8E4M3, 32) => emu::attn_mma_e4m3_d32,
                    (KvDtype::F8E4M3, 64) => emu::attn_mma_e4m3_d64,
                    (KvDtype::F8E4M3, 128) => emu::attn_mma_e4m3_d128,
                    other => unreachable!("planned the tensor-core kernel for {other:?}"),
                };
                kernel(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, nh, scale, w, mp, acc, ml);
            }
            (AttnKernel::Tiled, KvDtype::F32) => emu::attn_partial_tiled_f32(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Tiled, KvDtype::F16) => emu::attn_partial_tiled_f16(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Tiled, KvDtype::BF16) => emu::attn_partial_tiled_bf16(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Tiled, KvDtype::F8E4M3) => emu::attn_partial_tiled_e4m3(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::F32) => emu::attn_partial_f32(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::F16) => emu::attn_partial_f16(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::BF16) => emu::attn_partial_bf16(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::F8E4M3) => emu::attn_partial_e4m3(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
        }
        emu::attn_combine(&launch(p.combine), acc, ml, pos, nh, hd_i, w, mp, out.as_mut_ptr());
    }
    (out, p.kernel)
}

/// An arena written by the CPU backend and, the same tokens, by the emulated
/// kv_write (asserted to be the same bytes): sequences of `lens` tokens on
/// scattered block tables, in layer 1; layer 0 holds values past e4m3's 448
/// and in f16's subnormals, so saturation and rounding are compared too.
struct Arena {
    layout: KvLayout,
    cpu: <CpuBackend as Backend>::Kv,
    bytes: Vec<u8>,
    tables: Vec<Vec<u32>>,
}

const LAYER: usize = 1;

fn arena(c: &CpuBackend, layout: KvLayout, lens: &[usize], what: &str) -> Arena {
    let blocks = 64;
    let mut cpu = c.kv(layout, blocks).unwrap();
    let mut bytes = arena_bytes(c, &cpu, layout, blocks);
    let tables = scattered_tables(lens, blocks, 5);
    let te = layout.token_elems();
    for (s, (&len, table)) in lens.iter().zip(&tables).enumerate() {
        let (k, v, slots) = sequence_kv(s, len, table, te);
        c.kv_write(&mut cpu, LAYER, &k, &v, &slots);
        emu_kv_write(&mut bytes, layout, LAYER, &k, &v, &slots);
        let wide: Vec<f32> = k.iter().enumerate().map(|(i, v)| v * [1.0, 600.0, 1e-5, 7e4][i % 4]).collect();
        c.kv_write(&mut cpu, 0, &wide, &v, &slots);
        emu_kv_write(&mut bytes, layout, 0, &wide, &v, &slots);
    }
    assert!(bytes == arena_bytes(c, &cpu, layout, blocks), "{what}: KV bytes differ from the CPU arena's");
    Arena { layout, cpu, bytes, tables }
}

/// Decode rows of different lengths (up to 3 partitions) and prefill chunks
/// (positions 240..276 of the first sequence: the partition boundary at 256
/// inside), through the kernels of `tensor_cores`, against the CPU within
/// `tolerance` (max |error| / max |value|), and the determinism contract bit
/// for bit. Returns the largest error seen.
fn check_attention(c: &CpuBackend, a: &Arena, n_heads: usize, window: Option<usize>, tensor_cores: bool, tolerance: f32, what: &str) -> f32 {
    let layout = a.layout;
    let hd = layout.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let w = n_heads * hd;
    let want_kernel = |rows: usize| match () {
        _ if tensor_cores && layout.dtype != KvDtype::F32 => AttnKernel::Mma,
        _ if rows > 1 => AttnKernel::Tiled,
        _ => AttnKernel::Rows,
    };
    let emulated = |q: &[f32], rows: &[AttnRow]| {
        let (out, kernel) = emu_attention(&a.bytes, layout, LAYER, q, rows, n_heads, scale, window, tensor_cores);
        let runs_of_one = rows.windows(2).all(|p| p[0].block_table.as_ptr() != p[1].block_table.as_ptr());
        assert_eq!(kernel, want_kernel(if runs_of_one { 1 } else { 2 }), "{what}: kernel for {} rows", rows.len());
        out
    };
    let mut worst = 0f32;
    let mut checked = |q: &Vec<f32>, rows: &[AttnRow], kind: &str| {
        let mut want = c.tensor(0);
        c.attention(&a.cpu, LAYER, q, rows, n_heads, scale, window, &mut want);
        let got = emulated(q, rows);
        assert!(got.iter().all(|v| v.is_finite()), "{what}: {kind} attention: a value is not finite");
        let e = rel_err(&got, &want[..q.len()]);
        assert!(e <= tolerance, "{what}: {kind} attention: error {e} over {tolerance}");
        worst = worst.max(e);
        got
    };

    let rows: Vec<AttnRow> = a.tables.iter().enumerate().map(|(s, t)| AttnRow { block_table: t, pos: [600, 150, 1][s] - 1 }).collect();
    let q = values(rows.len() * w, 9);
    let batch = checked(&q, &rows, "decode");
    assert_eq!(emulated(&q[..w], &rows[..1]), batch[..w], "{what}: attention depends on the batch");
    assert_eq!(emulated(&q[2 * w..], &rows[2..]), batch[2 * w..], "{what}: attention depends on the batch");

    let chunk: Vec<AttnRow> = (240..276).map(|p| AttnRow { block_table: &a.tables[0], pos: p }).collect();
    let q = values(chunk.len() * w, 10);
    let chunk_out = checked(&q, &chunk, "prefill");
    // A chunk row equals the same position decoded alone...
    for &i in &[0usize, 15, 16, 20, 35] {
        let alone = emulated(&q[i * w..(i + 1) * w], &chunk[i..i + 1]);
        assert_eq!(alone, chunk_out[i * w..(i + 1) * w], "{what}: prefill row {i} depends on its chunk");
    }
    // ...and the same position in a chunk cut elsewhere (other runs, other places in a run).
    let later = emulated(&q[9 * w..], &chunk[9..]);
    assert_eq!(later, chunk_out[9 * w..], "{what}: prefill rows depend on where the chunk starts");
    worst
}

fn layout(dtype: KvDtype, kv_heads: usize, head_dim: usize) -> KvLayout {
    KvLayout { layers: 2, block_tokens: 16, kv_heads, head_dim, dtype }
}

/// The CUDA-core kernels: f32 arithmetic in the CPU's order, so within 1e-5.
/// Head shapes: grouped queries of 2, 3 and 10 (more than one block's group of
/// 8) query heads per KV head, plain multi-head, and head sizes of 32, 64 and
/// 128 (a value element per thread, or shared by several); and a window of 100
/// keys (which starts inside the prefill chunk's first partition).
#[test]
fn cuda_core_attention_matches_the_cpu_for_every_dtype() {
    let c = CpuBackend::new(1).unwrap();
    let cases = [
        (KvDtype::F32, 2, 4, 64),
        (KvDtype::F16, 2, 4, 64),
        (KvDtype::BF16, 2, 4, 64),
        (KvDtype::F8E4M3, 2, 4, 64),
        (KvDtype::F16, 3, 9, 64),
        (KvDtype::BF16, 1, 10, 32),
        (KvDtype::F32, 2, 2, 128),
    ];
    for (dtype, kv_heads, n_heads, hd) in cases {
        let what = format!("{dtype:?}, {n_heads} heads over {kv_heads}, head size {hd}");
        let a = arena(&c, layout(dtype, kv_heads, hd), &[600, 150, 1], &what);
        check_attention(&c, &a, n_heads, None, false, 1e-5, &what);
        // The window's masks are the same code for every type and head size: two shapes
        // (the grouped decode kernel's every-head block and a head-size-32 chunk) check them.
        if (dtype, n_heads) == (KvDtype::F16, 9) || hd == 32 {
            check_attention(&c, &a, n_heads, Some(100), false, 1e-5, &format!("{what}, window of 100"));
        }
    }
}

/// The tensor-core kernel: queries and probabilities rounded to the mma's
/// 16-bit inputs, so within a bound set by that rounding (2^-8 relative for
/// bf16, 2^-11 for f16, over a few hundred keys), not the CPU's 1e-5; and the
/// same bits for a position whatever its batch or chunk. Shapes: SmolLM2's
/// (3 query heads a KV head, 64), Llama 3's group of 4 at head size 128, 10
/// heads a group (6 rows a block, padding rows), head size 32, every KV type
/// it serves, with and without a window.
#[test]
fn tensor_core_attention_matches_the_cpu_for_every_dtype() {
    let c = CpuBackend::new(1).unwrap();
    let cases = [
        (KvDtype::BF16, 3, 9, 64, 5e-3),
        (KvDtype::F16, 3, 9, 64, 8e-4),
        (KvDtype::F8E4M3, 2, 4, 64, 8e-4),
        (KvDtype::BF16, 2, 8, 128, 5e-3),
        (KvDtype::F16, 1, 10, 32, 8e-4),
    ];
    for (dtype, kv_heads, n_heads, hd, tolerance) in cases {
        let what = format!("tensor cores, {dtype:?}, {n_heads} heads over {kv_heads}, head size {hd}");
        let a = arena(&c, layout(dtype, kv_heads, hd), &[600, 150, 1], &what);
        for window in [None, Some(100)] {
            let e = check_attention(&c, &a, n_heads, window, true, tolerance, &format!("{what}, window {window:?}"));
            eprintln!("{what}, window {window:?}: largest error {e:.2e} (bound {tolerance:.1e})");
        }
    }
}
