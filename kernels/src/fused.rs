//! The fused operations of [`Backend`] as the sequences of plain operations
//! they stand for: the trait's default implementations, and the reference a
//! backend's fused kernels are tested against.
//!
//! A forward pass calls the fused operations; a backend with nothing to gain
//! from fusing (the CPU backend, whose threads stream rows through cache
//! anyway) keeps these defaults and runs exactly the operations it ran before.
//! A backend with launch overhead and a product input type of its own (the
//! CUDA backend: bf16 activations for cuBLAS) overrides them with kernels that
//! write the product's input directly and skip the f32 round trips between
//! the steps (`kernels/cuda/fused.cu`).

use crate::attention::AttnRow;
use crate::backend::Backend;

/// The gated activation of a GLU feed-forward: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// SiLU (SwiGLU: Llama, Qwen, SmolLM).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma; [`crate::OptionalOp::GeluMul`]).
    GeluTanh,
}

/// `h = rmsnorm(x)`, then `outs[i] = h · wᵢᵀ`.
#[allow(clippy::too_many_arguments)]
pub fn norm_matmul<B: Backend + ?Sized>(b: &B, x: &B::Tensor, weight: &B::Tensor, eps: f32, rows: usize, dim: usize, h: &mut B::Tensor, outs: &mut [(&B::Matrix, &mut B::Tensor)]) {
    b.rmsnorm(x, weight, eps, rows, dim, h);
    b.matmul(h, rows, outs);
}

/// `x += y`, or with `y_norm` `x += rmsnorm(y) * y_norm` (through `h`), then
/// [`norm_matmul`] of the new `x`.
#[allow(clippy::too_many_arguments)]
pub fn add_norm_matmul<B: Backend + ?Sized>(
    b: &B,
    x: &mut B::Tensor,
    y: &B::Tensor,
    y_norm: Option<&B::Tensor>,
    weight: &B::Tensor,
    eps: f32,
    rows: usize,
    dim: usize,
    h: &mut B::Tensor,
    outs: &mut [(&B::Matrix, &mut B::Tensor)],
) {
    match y_norm {
        Some(wy) => {
            b.rmsnorm(y, wy, eps, rows, dim, h);
            b.add(x, h, rows * dim);
        }
        None => b.add(x, y, rows * dim),
    }
    norm_matmul(b, x, weight, eps, rows, dim, h, outs);
}

/// `a = glu(gate) * up` over `rows x width` elements, then `outs[i] = a · wᵢᵀ`.
#[allow(clippy::too_many_arguments)]
pub fn glu_matmul<B: Backend + ?Sized>(b: &B, glu: Glu, gate: &B::Tensor, up: &B::Tensor, rows: usize, width: usize, a: &mut B::Tensor, outs: &mut [(&B::Matrix, &mut B::Tensor)]) {
    match glu {
        Glu::Silu => b.silu_mul(gate, up, rows * width, a),
        Glu::GeluTanh => b.gelu_mul(gate, up, rows * width, a),
    }
    b.matmul(a, rows, outs);
}

/// Rotates `q` (`q_heads` heads a row) and `k` (`kv_heads`) by each row's
/// position, then stores `k` and `v` into `slots` of `layer`.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_write<B: Backend + ?Sized>(
    b: &B,
    kv: &mut B::Kv,
    layer: usize,
    rope: &B::Rope,
    q: &mut B::Tensor,
    q_heads: usize,
    k: &mut B::Tensor,
    kv_heads: usize,
    v: &B::Tensor,
    positions: &[u32],
    slots: &[(u32, u32)],
) {
    b.apply_rope(rope, q, positions, q_heads);
    b.apply_rope(rope, k, positions, kv_heads);
    b.kv_write(kv, layer, k, v, slots);
}

/// The per-head norms of QK-norm (Qwen3, Gemma 3): every head of the queries
/// and of the keys RMS-normed, over its `head_dim` elements, by `q` or `k`.
pub struct QkNorm<'a, T> {
    pub q: &'a T,
    pub k: &'a T,
    pub eps: f32,
    pub head_dim: usize,
}

/// Each head of `q` (`q_heads` a row) and `k` (`kv_heads`) normed by `norm`
/// through `t`, then [`rope_kv_write`]. `q` and `k` are swapped with `t` after
/// their norms, as the forward pass did before the fusion.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_kv_write<B: Backend + ?Sized>(
    b: &B,
    kv: &mut B::Kv,
    layer: usize,
    rope: &B::Rope,
    norm: QkNorm<'_, B::Tensor>,
    q: &mut B::Tensor,
    q_heads: usize,
    k: &mut B::Tensor,
    kv_heads: usize,
    v: &B::Tensor,
    t: &mut B::Tensor,
    positions: &[u32],
    slots: &[(u32, u32)],
) {
    let (rows, hd) = (positions.len(), norm.head_dim);
    b.rmsnorm(q, norm.q, norm.eps, rows * q_heads, hd, t);
    std::mem::swap(q, t);
    b.rmsnorm(k, norm.k, norm.eps, rows * kv_heads, hd, t);
    std::mem::swap(k, t);
    rope_kv_write(b, kv, layer, rope, q, q_heads, k, kv_heads, v, positions, slots);
}

/// [`Backend::attention`] into `attn`, then `outs[i] = attn · wᵢᵀ`.
#[allow(clippy::too_many_arguments)]
pub fn attention_matmul<B: Backend + ?Sized>(
    b: &B,
    kv: &B::Kv,
    layer: usize,
    q: &B::Tensor,
    rows: &[AttnRow],
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    attn: &mut B::Tensor,
    outs: &mut [(&B::Matrix, &mut B::Tensor)],
) {
    b.attention(kv, layer, q, rows, n_heads, scale, window, attn);
    b.matmul(attn, rows.len(), outs);
}
