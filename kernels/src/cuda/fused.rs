//! The CUDA backend's fused operations (`kernels/cuda/fused.cu`): the norms
//! and gated activations that feed a matrix product write its bf16 input
//! directly (no f32 tensor written, read back and converted by `to_bf16`),
//! the residual add (with Gemma's post norm before it) runs in the next norm's
//! kernel, the keys are rotated on their way into the arena in the launch that
//! rotates the queries (after QK-norm's per-head norms, in the same launch),
//! and attention's combine step writes the output projection's bf16 input.
//!
//! Each gives exactly the bits of the unfused sequence of the backend's own
//! kernels ([`crate::fused`]): the same helpers of common.cuh, the same launch
//! geometry, the same conversion. A decode layer of a Llama-family model goes
//! from 14 launches besides the products to 6.

use cudarc::driver::{CudaFunction, CudaSlice};

use super::plan::{self, ROW_THREADS, TOKEN_THREADS};
use super::attention::AttnOut;
use super::{args, config, fail, grow, kv_code, CudaBackend, CudaKv, CudaMatrix, CudaRope, Scratch, GEMM_ROWS};
use crate::attention::AttnRow;
use crate::backend::{Backend, KernelError};
use crate::fused::{Glu, QkNorm};

/// The kernels of fused.cu.
pub(super) struct FusedKernels {
    rmsnorm_bf16: CudaFunction,
    add_rmsnorm_bf16: CudaFunction,
    norm_add_rmsnorm_bf16: CudaFunction,
    silu_mul_bf16: CudaFunction,
    gelu_mul_bf16: CudaFunction,
    /// Indexed by [`kv_code`].
    rope_kv_write: [CudaFunction; 4],
    qk_norm_rope_kv_write: [CudaFunction; 4],
}

impl FusedKernels {
    /// Finds the kernels in the loaded `fused` module through `get(module, name)`.
    pub(super) fn load(get: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>) -> Result<Self, KernelError> {
        Ok(FusedKernels {
            rmsnorm_bf16: get("fused", "rmsnorm_bf16")?,
            add_rmsnorm_bf16: get("fused", "add_rmsnorm_bf16")?,
            norm_add_rmsnorm_bf16: get("fused", "norm_add_rmsnorm_bf16")?,
            silu_mul_bf16: get("fused", "silu_mul_bf16")?,
            gelu_mul_bf16: get("fused", "gelu_mul_bf16")?,
            rope_kv_write: [
                get("fused", "rope_kv_write_f32")?,
                get("fused", "rope_kv_write_f16")?,
                get("fused", "rope_kv_write_bf16")?,
                get("fused", "rope_kv_write_e4m3")?,
            ],
            qk_norm_rope_kv_write: [
                get("fused", "qk_norm_rope_kv_write_f32")?,
                get("fused", "qk_norm_rope_kv_write_f16")?,
                get("fused", "qk_norm_rope_kv_write_bf16")?,
                get("fused", "qk_norm_rope_kv_write_e4m3")?,
            ],
        })
    }
}

impl CudaBackend {
    /// Runs `fill` to write the bf16 input of `rows` rows of width `k` into the
    /// activation buffer (padded to whole [`GEMM_ROWS`] calls, as `matmul`
    /// pads), then the products of `outs` from it. `fill` gets the rest of the
    /// locked scratch too (attention's partials).
    fn products_from_bf16(&self, k: usize, rows: usize, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)], fill: impl FnOnce(&mut Scratch, &mut CudaSlice<u16>)) {
        assert!(outs.iter().all(|(w, _)| w.k == k), "fused products must share one input width");
        let padded = rows.next_multiple_of(GEMM_ROWS);
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        grow(&self.stream, &self.capture, &mut s.acts_bf16, padded * k, "bf16 activations");
        // Short only inside a capture that refused to grow it: that capture is thrown away.
        if s.acts_bf16.as_ref().is_none_or(|b| b.len() < padded * k) {
            return;
        }
        // Out of the scratch while `fill` borrows the rest of it; put back below.
        let mut xb = s.acts_bf16.take().expect("checked above");
        fill(&mut s, &mut xb);
        for (w, out) in outs.iter_mut() {
            self.ensure_len(out, padded * w.n);
            self.gemm(w, &xb, rows, out);
        }
        s.acts_bf16 = Some(xb);
    }

    /// [`crate::Backend::norm_matmul`]: `rmsnorm_bf16`, then the products.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_norm_matmul(&self, x: &CudaSlice<f32>, weight: &CudaSlice<f32>, eps: f32, rows: usize, dim: usize, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        if rows == 0 || outs.is_empty() {
            return;
        }
        assert!(x.len() >= rows * dim && weight.len() >= dim, "norm_matmul: {rows} rows of {dim} past the tensors");
        self.products_from_bf16(dim, rows, outs, |_, xb| {
            let dim_i = dim as i32;
            let mut b = self.stream.launch_builder(&self.k.fused.rmsnorm_bf16);
            args::rmsnorm_bf16(&mut b, x, weight, &eps, &dim_i, xb);
            unsafe { b.launch(config(plan::per_row(rows, ROW_THREADS))) }.unwrap_or_else(|e| fail("rmsnorm_bf16", e));
        });
    }

    /// [`crate::Backend::add_norm_matmul`]: `add_rmsnorm_bf16` (or with a post norm
    /// `norm_add_rmsnorm_bf16`), then the products.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_add_norm_matmul(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        y_norm: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        dim: usize,
        h: &mut CudaSlice<f32>,
        outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)],
    ) {
        if rows == 0 {
            return;
        }
        assert!(x.len() >= rows * dim && y.len() >= rows * dim && weight.len() >= dim, "add_norm_matmul: {rows} rows of {dim} past the tensors");
        assert!(y_norm.is_none_or(|wy| wy.len() >= dim), "add_norm_matmul: a post norm shorter than {dim}");
        if outs.is_empty() {
            // The add is still owed; the norm has no reader.
            return crate::fused::add_norm_matmul(self, x, y, y_norm, weight, eps, rows, dim, h, outs);
        }
        self.products_from_bf16(dim, rows, outs, |_, xb| {
            let dim_i = dim as i32;
            let cfg = config(plan::per_row(rows, ROW_THREADS));
            match y_norm {
                None => {
                    let mut b = self.stream.launch_builder(&self.k.fused.add_rmsnorm_bf16);
                    args::add_rmsnorm_bf16(&mut b, x, y, weight, &eps, &dim_i, xb);
                    unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("add_rmsnorm_bf16", e));
                }
                Some(wy) => {
                    let mut b = self.stream.launch_builder(&self.k.fused.norm_add_rmsnorm_bf16);
                    args::norm_add_rmsnorm_bf16(&mut b, x, y, wy, weight, &eps, &dim_i, xb);
                    unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("norm_add_rmsnorm_bf16", e));
                }
            }
        });
    }

    /// [`crate::Backend::glu_matmul`]: `silu_mul_bf16` or `gelu_mul_bf16`, then the products.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_glu_matmul(&self, glu: Glu, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, rows: usize, width: usize, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        let len = rows * width;
        if len == 0 || outs.is_empty() {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "glu_matmul: {len} elements past the tensors");
        self.products_from_bf16(width, rows, outs, |_, xb| {
            let n = len as u64;
            let (mut b, name) = match glu {
                Glu::Silu => {
                    let mut b = self.stream.launch_builder(&self.k.fused.silu_mul_bf16);
                    args::silu_mul_bf16(&mut b, gate, up, xb, &n);
                    (b, "silu_mul_bf16")
                }
                Glu::GeluTanh => {
                    let mut b = self.stream.launch_builder(&self.k.fused.gelu_mul_bf16);
                    args::gelu_mul_bf16(&mut b, gate, up, xb, &n);
                    (b, "gelu_mul_bf16")
                }
            };
            unsafe { b.launch(config(plan::elementwise(len))) }.unwrap_or_else(|e| fail(name, e));
        });
    }

    /// [`crate::Backend::rope_kv_write`]: one `rope_kv_write_*` launch; with
    /// `norm`, [`crate::Backend::qk_norm_rope_kv_write`]: one
    /// `qk_norm_rope_kv_write_*` launch (`q` and `k` normed in place).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_rope_kv_write(
        &self,
        kv: &mut CudaKv,
        layer: usize,
        rope: &CudaRope,
        norm: Option<QkNorm<'_, CudaSlice<f32>>>,
        q: &mut CudaSlice<f32>,
        q_heads: usize,
        k: &mut CudaSlice<f32>,
        kv_heads: usize,
        v: &CudaSlice<f32>,
        positions: &[u32],
        slots: &[(u32, u32)],
    ) {
        if slots.is_empty() {
            return;
        }
        let l = kv.layout;
        assert_eq!(positions.len(), slots.len(), "rope_kv_write: one position per slot");
        assert_eq!(kv_heads, l.kv_heads, "rope_kv_write: keys of {kv_heads} heads for an arena of {}", l.kv_heads);
        assert_eq!(rope.half * 2, l.head_dim, "rope_kv_write: a rotary table of head size {} for heads of {}", rope.half * 2, l.head_dim);
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= rope.max_pos) {
            panic!("position {p} beyond the rope table ({})", rope.max_pos);
        }
        let te = l.token_elems();
        let rows = slots.len();
        assert!(q.len() >= rows * q_heads * l.head_dim && k.len() >= rows * te && v.len() >= rows * te, "rope_kv_write: rows past the tensors");
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = s.active.as_mut() {
            a.limits.positions(rope.max_pos);
        }
        // A replayable step's positions and slots are where it staged them (its slots
        // checked then, padding rows' on the spare block), as rope's and kv_write's are;
        // otherwise the same reused uploads as theirs: a pass's layers upload them once.
        let (pos, flat) = match s.active.is_some() {
            true => s.step().map(|(a, words)| (words.slice(a.layout.positions.clone()), words.slice(a.layout.slots.clone()))).expect("a step is active"),
            false => {
                assert!(slots.iter().all(|&(b, s)| (b as usize) < kv.blocks && (s as usize) < l.block_tokens), "rope_kv_write: slot out of range");
                let flat: Vec<u32> = slots.iter().flat_map(|&(b, s)| [b, s]).collect();
                let super::Scratch { rope_positions, kv_slots, .. } = &mut *s;
                (rope_positions.get(&self.stream, &self.capture, positions).slice(..), kv_slots.get(&self.stream, &self.capture, &flat).slice(..))
            }
        };
        #[rustfmt::skip]
        let (qh, half, layer_i, layers_i, bt, te_i) = (q_heads as i32, rope.half as i32, layer as i32, l.layers as i32, l.block_tokens as i32, te as i32);
        let cfg = config(plan::per_row(rows, TOKEN_THREADS));
        match norm {
            None => {
                let mut b = self.stream.launch_builder(&self.k.fused.rope_kv_write[kv_code(l.dtype)]);
                #[rustfmt::skip]
                args::rope_kv_write(&mut b, &mut kv.arena, q, &*k, v, &rope.cos, &rope.sin, &pos, &flat, &qh, &half, &layer_i, &layers_i, &bt, &te_i);
                unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("rope_kv_write", e));
            }
            Some(n) => {
                let mut b = self.stream.launch_builder(&self.k.fused.qk_norm_rope_kv_write[kv_code(l.dtype)]);
                #[rustfmt::skip]
                args::qk_norm_rope_kv_write(&mut b, &mut kv.arena, q, k, v, n.q, n.k, &n.eps, &rope.cos, &rope.sin, &pos, &flat, &qh, &half, &layer_i, &layers_i, &bt, &te_i);
                unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("qk_norm_rope_kv_write", e));
            }
        }
    }

    /// [`crate::Backend::attention_matmul`]: the attention launches with the
    /// combine writing the output projection's bf16 input (`attn_combine_bf16`),
    /// then the products; no f32 output and no `to_bf16`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_attention_matmul(
        &self,
        kv: &CudaKv,
        layer: usize,
        q: &CudaSlice<f32>,
        rows: &[AttnRow],
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        attn: &mut CudaSlice<f32>,
        outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)],
    ) {
        if outs.is_empty() {
            // No product reads it: the f32 output is the result.
            return self.launch_attention(kv, layer, q, rows, n_heads, scale, window, attn);
        }
        if rows.is_empty() {
            return;
        }
        let width = n_heads * kv.layout.head_dim;
        self.products_from_bf16(width, rows.len(), outs, |s, xb| self.attention_into(s, kv, layer, q, rows, n_heads, scale, window, AttnOut::Bf16(xb)));
    }
}
