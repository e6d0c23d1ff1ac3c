//! The attention launches: the partial kernels (tensor-core, tiled, per-row) over the
//! paged arena, then the combine step that merges a row's partials into its output
//! (f32, or bf16 as the input of the output projection: `attention_matmul`).

use super::*;

/// Where the combine step writes a call's output.
pub(super) enum AttnOut<'a> {
    /// f32 (`attn_combine`): [`crate::Backend::attention`].
    F32(&'a mut CudaSlice<f32>),
    /// bf16 (`attn_combine_bf16`): the output projection's input, for
    /// [`crate::Backend::attention_matmul`].
    Bf16(&'a mut CudaSlice<u16>),
}

impl CudaBackend {
    // The trait operation's own arguments, passed through unchanged.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_attention(&self, kv: &CudaKv, layer: usize, q: &CudaSlice<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut CudaSlice<f32>) {
        if rows.is_empty() {
            return;
        }
        self.ensure_len(out, rows.len() * n_heads * kv.layout.head_dim);
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.attention_into(&mut s, kv, layer, q, rows, n_heads, scale, window, AttnOut::F32(out));
    }

    /// The attention launches, with the scratch already locked; `out` (as long
    /// as the rows' heads need) is written by the combine.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_into(&self, s: &mut Scratch, kv: &CudaKv, layer: usize, q: &CudaSlice<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: AttnOut<'_>) {
        if rows.is_empty() {
            return;
        }
        let l = &kv.layout;
        let hd = l.head_dim;
        let mma = self.k.attn_mma.as_ref().zip(mma_index(l.dtype, hd)).map(|(fs, i)| &fs[i]);
        let mut p = AttentionPlan::for_gpu(rows, l.block_tokens, hd, n_heads, l.kv_heads, mma.is_some());
        // 0 is no window; a window as long as i32 allows covers every position the arena holds.
        let window_i = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        // A step's index arrays are staged at fixed places, its grid sized for the shape's capacity.
        let ranges = match s.active.as_ref() {
            Some(a) => {
                assert_eq!(p.run_start.len(), rows.len(), "a captured step's rows each on a table of their own");
                p = p.with_capacity(a.layout.shape.parts);
                a.layout.attention_ranges()
            }
            None => {
                let (words, ranges) = p.index_words();
                s.attn_index.get(&self.stream, &self.capture, &words);
                ranges
            }
        };
        let max_parts = p.max_parts;
        let slots = p.partial_slots(n_heads);
        grow(&self.stream, &self.capture, &mut s.part_acc, slots * hd, "attention partials");
        grow(&self.stream, &self.capture, &mut s.part_ml, slots * 2, "attention partials");
        let Scratch { part_acc, part_ml, attn_index, step_words, active, .. } = s;
        let (Some(part_acc), Some(part_ml)) = (part_acc.as_mut(), part_ml.as_mut()) else { return };
        let index = match active {
            Some(a) => &step_words[&a.key],
            None => attn_index.device(),
        };
        let [tables, offsets, positions, starts, lens] = ranges.map(|r| index.slice(r));
        let (layer_i, layers_i, bt, kvh, hd_i, nh, mp) =
            (layer as i32, l.layers as i32, l.block_tokens as i32, l.kv_heads as i32, hd as i32, n_heads as i32, max_parts as i32);
        match p.kernel {
            // Decode rows and prefill chunks alike on the tensor cores: every query head of
            // a KV head's group, and every row of a run, from one read of its keys and values.
            AttnKernel::Mma => {
                let mut b = self.stream.launch_builder(mma.expect("planned only where the kernel exists"));
                #[rustfmt::skip]
                args::attn_mma(&mut b, &kv.arena, q, &tables, &offsets, &positions, &starts, &lens,
                    &layer_i, &layers_i, &bt, &kvh, &nh, &scale, &window_i, &mp, &mut *part_acc, &mut *part_ml);
                unsafe { b.launch(config(p.partial)) }.unwrap_or_else(|e| fail("attn_mma", e));
            }
            // Prefill chunks: each key and value is read once per run of rows, not once per row.
            AttnKernel::Tiled => {
                let mut b = self.stream.launch_builder(&self.k.attn_partial_tiled[kv_code(l.dtype)]);
                #[rustfmt::skip]
                args::attn_partial_tiled(&mut b, &kv.arena, q, &tables, &offsets, &positions, &starts, &lens,
                    &layer_i, &layers_i, &bt, &kvh, &hd_i, &nh, &scale, &window_i, &mp, &mut *part_acc, &mut *part_ml);
                unsafe { b.launch(config(p.partial)) }.unwrap_or_else(|e| fail("attn_partial_tiled", e));
            }
            AttnKernel::Rows => {
                let mut b = self.stream.launch_builder(&self.k.attn_partial[kv_code(l.dtype)]);
                #[rustfmt::skip]
                args::attn_partial(&mut b, &kv.arena, q, &tables, &offsets, &positions,
                    &layer_i, &layers_i, &bt, &kvh, &hd_i, &nh, &scale, &window_i, &mp, &mut *part_acc, &mut *part_ml);
                unsafe { b.launch(config(p.partial)) }.unwrap_or_else(|e| fail("attn_partial", e));
            }
        }
        match out {
            AttnOut::F32(out) => {
                let mut b = self.stream.launch_builder(&self.k.attn_combine);
                args::attn_combine(&mut b, &*part_acc, &*part_ml, &positions, &nh, &hd_i, &window_i, &mp, out);
                unsafe { b.launch(config(p.combine)) }.unwrap_or_else(|e| fail("attn_combine", e));
            }
            AttnOut::Bf16(out) => {
                let mut b = self.stream.launch_builder(&self.k.attn_combine_bf16);
                args::attn_combine_bf16(&mut b, &*part_acc, &*part_ml, &positions, &nh, &hd_i, &window_i, &mp, out);
                unsafe { b.launch(config(p.combine)) }.unwrap_or_else(|e| fail("attn_combine_bf16", e));
            }
        }
    }
}
