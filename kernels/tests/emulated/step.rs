//! A captured decode step's attention (`cuda::graph`, `cuda::step_inputs`)
//! against the exact launch, on the emulated kernels: the step padded to its
//! batch bucket (padding rows on the arena's spare block), its index arrays
//! from the step's fixed-offset words, its grid sized for a capacity of
//! partitions larger than the rows need. The real rows must come out with the
//! same bits as from the exact grid; the partial buffers start as NaN, so a
//! padded work item that wrote, or a combine that read a partition its row
//! lacks, would show.

use std::ops::Range;

use baton_kernels::cuda::plan::{AttentionPlan, AttnKernel};
use baton_kernels::cuda::step_inputs::{capacity_parts, StepLayout, StepShape};
use baton_kernels::emu;
use baton_kernels::step::{bucket, pad_tables, PaddedStep};
use baton_kernels::{AttnRow, KvDtype, KvLayout, StepInput};

use super::support::{scattered_tables, sequence_kv, values};
use super::{emu_kv_write, launch};

const BLOCKS: usize = 64;
const LAYER: usize = 1;

/// One attention call of plan `p`, its five index arrays at `ranges` of `index`.
#[allow(clippy::too_many_arguments)]
fn run(arena: &[u8], layout: KvLayout, q: &[f32], p: &AttentionPlan, index: &[u32], ranges: [Range<usize>; 5], n_heads: usize, window: Option<usize>) -> Vec<f32> {
    let hd = layout.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = p.positions.len();
    let slots = p.partial_slots(n_heads);
    let (mut part_acc, mut part_ml) = (vec![f32::NAN; slots * hd], vec![f32::NAN; slots * 2]);
    let mut out = vec![f32::NAN; rows * n_heads * hd];
    let (layer, layers, bt, kvh, hd_i, nh, mp) = (LAYER as i32, layout.layers as i32, layout.block_tokens as i32, layout.kv_heads as i32, hd as i32, n_heads as i32, p.max_parts as i32);
    let w = window.map_or(0, |w| w as i32);
    let [t, o, pos, s, n] = ranges.map(|r| index[r].as_ptr());
    let (a, qp, acc, ml) = (arena.as_ptr(), q.as_ptr(), part_acc.as_mut_ptr(), part_ml.as_mut_ptr());
    let l = launch(p.partial);
    unsafe {
        match (p.kernel, layout.dtype, hd) {
            (AttnKernel::Mma, KvDtype::BF16, 64) => emu::attn_mma_bf16_d64(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, nh, scale, w, mp, acc, ml),
            (AttnKernel::Mma, KvDtype::F16, 128) => emu::attn_mma_f16_d128(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, nh, scale, w, mp, acc, ml),
            (AttnKernel::Mma, KvDtype::F8E4M3, 64) => emu::attn_mma_e4m3_d64(&l, a, qp, t, o, pos, s, n, layer, layers, bt, kvh, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::F32, _) => emu::attn_partial_f32(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            (AttnKernel::Rows, KvDtype::BF16, _) => emu::attn_partial_bf16(&l, a, qp, t, o, pos, layer, layers, bt, kvh, hd_i, nh, scale, w, mp, acc, ml),
            other => unreachable!("no case for {other:?}"),
        }
        emu::attn_combine(&launch(p.combine), acc, ml, pos, nh, hd_i, w, mp, out.as_mut_ptr());
    }
    out
}

/// Sequences of `lens` tokens written into layer `LAYER` of an emulated arena of
/// `BLOCKS` blocks and one spare (the padding rows'); their block tables.
fn arena(layout: KvLayout, lens: &[usize]) -> (Vec<u8>, Vec<Vec<u32>>) {
    let mut bytes = vec![0u8; (BLOCKS + 1) * layout.block_bytes()];
    let tables = scattered_tables(lens, BLOCKS, 5);
    for (s, (&len, table)) in lens.iter().zip(&tables).enumerate() {
        let (k, v, slots) = sequence_kv(s, len, table, layout.token_elems());
        emu_kv_write(&mut bytes, layout, LAYER, &k, &v, &slots);
    }
    (bytes, tables)
}

/// Decode rows at the ends of sequences of 600, 150 and 1 tokens (and each
/// alone), exact against captured at the shape's capacity and at twice it.
fn check(layout: KvLayout, n_heads: usize, window: Option<usize>, tensor_cores: bool, want: AttnKernel) {
    let what = format!("{:?}, {n_heads} heads over {}, head size {}, window {window:?}", layout.dtype, layout.kv_heads, layout.head_dim);
    let (bytes, tables) = arena(layout, &[600, 150, 1]);
    let w = n_heads * layout.head_dim;
    // Each sequence's last token.
    let all: Vec<AttnRow> = tables.iter().zip([599, 149, 0]).map(|(t, pos)| AttnRow { block_table: t, pos }).collect();
    for rows in [&all[..], &all[1..2], &all[..2]] {
        let n = rows.len();
        let q = values(n * w, 9);
        let exact = AttentionPlan::for_gpu(rows, layout.block_tokens, layout.head_dim, n_heads, layout.kv_heads, tensor_cores);
        assert_eq!(exact.kernel, want, "{what}: kernel");
        let (words, ranges) = exact.index_words();
        let want_out = run(&bytes, layout, &q, &exact, &words, ranges, n_heads, window);
        assert!(want_out.iter().all(|v| v.is_finite()), "{what}: the exact launch left a value unwritten");

        let tokens = vec![1u32; n];
        let positions: Vec<u32> = rows.iter().map(|r| r.pos as u32).collect();
        let slots: Vec<(u32, u32)> = rows.iter().map(|r| (r.block_table[r.pos / 16], (r.pos % 16) as u32)).collect();
        let logit_rows: Vec<usize> = (0..n).collect();
        let input = StepInput { tokens: &tokens, positions: &positions, slots: &slots, attn: rows, logit_rows: &logit_rows };
        let padded_rows = bucket(n).unwrap();
        let pads = pad_tables(padded_rows - n);
        let padded = PaddedStep::new(&input, padded_rows, &pads);
        let step = padded.input();
        let shape = StepShape::of(&step);
        assert_eq!(shape.parts, capacity_parts(rows.iter().map(|r| r.pos).max().unwrap()));
        // Padding rows' queries: any finite values.
        let mut q_padded = q.clone();
        q_padded.extend(values((padded_rows - n) * w, 77));
        for parts in [shape.parts, 2 * shape.parts] {
            let layout_words = StepLayout::new(StepShape { rows: padded_rows, parts }, layout.block_tokens);
            let mut words = vec![0u32; layout_words.words];
            layout_words.fill(&step, BLOCKS, BLOCKS as u32, &mut words).unwrap();
            let plan = AttentionPlan::for_gpu(step.attn, layout.block_tokens, layout.head_dim, n_heads, layout.kv_heads, tensor_cores).with_capacity(parts);
            assert_eq!(plan.kernel, want, "{what}: the captured step's kernel");
            assert_eq!(plan.partial.grid.0 as usize, padded_rows, "{what}: a block row per step row");
            assert_eq!(plan.partial.grid.2 as usize, parts, "{what}: the grid is the capacity's");
            let got = run(&bytes, layout, &q_padded, &plan, &words, layout_words.attention_ranges(), n_heads, window);
            assert_eq!(got[..n * w], want_out[..], "{what}: {n} rows padded to {padded_rows}, capacity {parts}: not the exact launch's bits");
            assert!(got[n * w..].iter().all(|v| v.is_finite()), "{what}: a padding row's output is not finite");
        }
    }
}

fn layout(dtype: KvDtype, kv_heads: usize, head_dim: usize) -> KvLayout {
    KvLayout { layers: 2, block_tokens: 16, kv_heads, head_dim, dtype }
}

/// The CUDA-core decode kernel (f32 KV, GPUs before sm_80): grouped and plain heads.
#[test]
fn captured_cuda_core_attention_equals_the_exact_grid_bit_for_bit() {
    check(layout(KvDtype::F32, 2, 64), 4, None, false, AttnKernel::Rows);
    check(layout(KvDtype::BF16, 3, 64), 9, Some(100), false, AttnKernel::Rows);
}

/// The tensor-core kernel: SmolLM2's group of 3, Llama 3's head size 128, e4m3 KV.
#[test]
fn captured_tensor_core_attention_equals_the_exact_grid_bit_for_bit() {
    check(layout(KvDtype::BF16, 3, 64), 9, None, true, AttnKernel::Mma);
    check(layout(KvDtype::F16, 2, 128), 8, Some(100), true, AttnKernel::Mma);
    check(layout(KvDtype::F8E4M3, 2, 64), 4, None, true, AttnKernel::Mma);
}
