//! Element-wise and row-wise operations of a decoder layer: RMSNorm,
//! rotary position embedding, the SiLU- and GELU-gated MLP glue, bias adds,
//! scaling and residual adds.
//!
//! Every function treats rows independently, with a fixed order of floating
//! point operations per row, so a row's result never depends on its batch.


/// `out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight`, row by row.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, dim: usize, out: &mut [f32]) {
    let f = |(xr, or): (&[f32], &mut [f32])| {
        let mut acc = [0f32; 8];
        for c in xr.chunks_exact(8) {
            for l in 0..8 {
                acc[l] += c[l] * c[l];
            }
        }
        let mut ss = crate::matmul::hsum8(acc);
        for &v in &xr[dim / 8 * 8..] {
            ss += v * v;
        }
        let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    };
    let n = x.len() / dim;
    x[..n * dim].chunks_exact(dim).zip(out.chunks_exact_mut(dim)).for_each(f);
}

/// `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `out = silu(gate) * up`, with `silu(g) = g / (1 + e^-g)`. `e^-g` comes
/// from [`crate::exp::exp`] (eight lanes at a time, the same bits on every
/// path; libm's scalar `expf` cost as much as the attention softmax at 512
/// prompt tokens); below `g = -88` it stays at `e^88`, where `silu` is 0 to
/// within 1e-36.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    for ((o, g), u) in out[..n].chunks_mut(256).zip(gate.chunks(256)).zip(up.chunks(256)) {
        for (x, g) in o.iter_mut().zip(g) {
            *x = -*g;
        }
        crate::exp::exp_shifted(o, 0.0);
        for ((x, g), u) in o.iter_mut().zip(g).zip(u) {
            *x = *g / (1.0 + *x) * *u;
        }
    }
}

/// `out = gelu(gate) * up` with GELU's tanh form,
/// `gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))` (Gemma's GeGLU),
/// computed as `g / (1 + e^(-2y))` (the same function: `0.5 (1 + tanh y)` is the
/// logistic of `2y`) with [`crate::exp`]'s eight-lane exponential, as
/// [`silu_mul`] does: the C library's scalar `tanhf` was 9% of Gemma 3's
/// batch-32 decode. Same bits on every path.
pub fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    const MINUS_2_SQRT_2_OVER_PI: f32 = -1.595_769;
    let n = out.len().min(gate.len()).min(up.len());
    for ((o, g), u) in out[..n].chunks_mut(256).zip(gate.chunks(256)).zip(up.chunks(256)) {
        for (x, &g) in o.iter_mut().zip(g) {
            *x = MINUS_2_SQRT_2_OVER_PI * g * (1.0 + 0.044715 * g * g);
        }
        crate::exp::exp_shifted(o, 0.0);
        for ((x, g), u) in o.iter_mut().zip(g).zip(u) {
            *x = *g / (1.0 + *x) * *u;
        }
    }
}

/// [`silu_mul`] split across `pool` in chunks. One `exp` per element made
/// it ~5% of batch-32 decode on the calling thread alone while the other
/// thread spun idle; element-wise, so the split changes no result.
pub fn silu_mul_parallel(pool: &crate::pool::Pool, gate: &[f32], up: &[f32], out: &mut [f32]) {
    glu_parallel(pool, gate, up, out, silu_mul)
}

/// [`gelu_mul`] split across `pool` like [`silu_mul_parallel`].
pub fn gelu_mul_parallel(pool: &crate::pool::Pool, gate: &[f32], up: &[f32], out: &mut [f32]) {
    glu_parallel(pool, gate, up, out, gelu_mul)
}

fn glu_parallel(pool: &crate::pool::Pool, gate: &[f32], up: &[f32], out: &mut [f32], f: fn(&[f32], &[f32], &mut [f32])) {
    const CHUNK: usize = 4096;
    let len = out.len();
    if len < 2 * CHUNK {
        return f(gate, up, out);
    }
    // Tasks write disjoint chunks of `out`.
    let o = crate::pool::SendPtr(out.as_mut_ptr());
    pool.run(len.div_ceil(CHUNK), &|task| {
        let (a, b) = (task * CHUNK, (task * CHUNK + CHUNK).min(len));
        let o = &o;
        // SAFETY: chunk `task` is `a..b`, within `len`, and no other task's.
        let chunk = unsafe { std::slice::from_raw_parts_mut(o.0.add(a), b - a) };
        f(&gate[a..b], &up[a..b], chunk);
    });
}

/// `x[r] += bias` for every row `r` of `bias.len()` elements (QKV bias).
pub fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_inplace(row, bias);
    }
}

/// `x *= s`.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// `x = cap * tanh(x / cap)`: final logit soft-capping.
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// Precomputed cos/sin of rotary angles for positions `0..max_pos`.
///
/// Angles follow GGML's recurrence (`theta *= base^(-2/d)` in f32), the
/// convention of the GGUF files Baton loads, in "normal" mode: element pairs
/// `(2i, 2i + 1)` rotate together (weights from Hugging Face checkpoints are
/// permuted at load time to this convention).
pub struct RopeTable {
    pub head_dim: usize,
    pub max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, base: f32, max_pos: usize) -> Self {
        Self::scaled(head_dim, base, max_pos, 1.0, None)
    }

    /// Angles with GGML's scalings: each pair's angle divided by its
    /// frequency factor (Llama 3's `rope_freqs`, `head_dim / 2` of them),
    /// then multiplied by `freq_scale` (linear scaling: 1 / factor). With
    /// 1.0 and no factors the table equals [`RopeTable::new`]'s exactly
    /// (both operations are then exact in IEEE arithmetic).
    pub fn scaled(head_dim: usize, base: f32, max_pos: usize, freq_scale: f32, factors: Option<&[f32]>) -> Self {
        let half = head_dim / 2;
        assert!(factors.is_none_or(|f| f.len() == half), "rope: {half} frequency factors expected");
        let theta_scale = base.powf(-2.0 / head_dim as f32);
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        for p in 0..max_pos {
            let mut theta = p as f32;
            for i in 0..half {
                let ff = factors.map_or(1.0, |f| f[i]);
                let t = freq_scale * (theta / ff);
                cos[p * half + i] = t.cos();
                sin[p * half + i] = t.sin();
                theta *= theta_scale;
            }
        }
        RopeTable { head_dim, max_pos, cos, sin }
    }

    /// The cos and sin tables, `max_pos x head_dim / 2` each (uploaded by accelerator backends).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotates each head of each row of `x` (`rows x heads x head_dim`) by
    /// the angle of that row's position.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], heads: usize) {
        let hd = self.head_dim;
        let half = hd / 2;
        for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
            let p = p as usize;
            assert!(p < self.max_pos, "position {p} beyond the rope table ({})", self.max_pos);
            let (c, s) = (&self.cos[p * half..(p + 1) * half], &self.sin[p * half..(p + 1) * half]);
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c[i] - b * s[i];
                    head[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
        }
    }
}

/// Index of the largest value (ties to the lowest index).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_unit_rows() {
        let x = vec![3.0, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = vec![0.0; 8];
        rmsnorm(&x, &[1.0; 4], 0.0, 4, &mut out);
        let r = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6);
        assert!((out[4] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_preserves_norm_and_position_zero_is_identity() {
        let t = RopeTable::new(8, 10000.0, 16);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 1.0).collect();
        let orig = x.clone();
        t.apply(&mut x, &[0, 5], 1);
        assert_eq!(&x[..8], &orig[..8]);
        let n0: f32 = orig[8..].iter().map(|v| v * v).sum();
        let n1: f32 = x[8..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
    }

    #[test]
    fn silu_mul_parallel_equals_serial_bit_for_bit() {
        let n = 20_003;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        silu_mul(&g, &u, &mut a);
        silu_mul_parallel(&crate::pool::Pool::new(2).unwrap(), &g, &u, &mut b);
        assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn rope_scaled_without_scaling_is_new_bit_for_bit_and_factors_slow_pairs() {
        let (a, b) = (RopeTable::new(64, 10000.0, 40), RopeTable::scaled(64, 10000.0, 40, 1.0, None));
        assert_eq!(a.cos.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.cos.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert_eq!(a.sin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.sin.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        let f = vec![4.0f32; 32];
        let c = RopeTable::scaled(64, 10000.0, 40, 1.0, Some(&f));
        let l = RopeTable::scaled(64, 10000.0, 40, 0.25, None);
        // Position 8 with every pair slowed 4x turns like position 2 (linear scaling alike).
        for i in 0..32 {
            assert!((c.cos[8 * 32 + i] - a.cos[2 * 32 + i]).abs() < 1e-5);
            assert!((l.sin[8 * 32 + i] - a.sin[2 * 32 + i]).abs() < 1e-5);
        }
    }

    #[test]
    fn gelu_mul_matches_formula_and_parallel_equals_serial() {
        let mut out = [0.0; 3];
        gelu_mul(&[1.0, -3.0, 0.0], &[2.0, 1.0, 5.0], &mut out);
        // gelu_tanh(1) = 0.841192, gelu_tanh(-3) = -0.003637.
        assert!((out[0] - 2.0 * 0.841192).abs() < 1e-5, "{out:?}");
        assert!((out[1] + 0.003637).abs() < 1e-5, "{out:?}");
        assert_eq!(out[2], 0.0);
        // Against the tanh form in f64 over the range activations take, and far out
        // (where e^(-2y) saturates or underflows): within a few f32 ulps of the value
        // or 1e-7 absolute (near zero, where both forms round differently).
        for i in -20_000i32..=20_000 {
            let g = i as f32 * 0.001 * if i.abs() > 15_000 { 20.0 } else { 1.0 };
            let mut o = [0f32];
            gelu_mul(&[g], &[1.0], &mut o);
            let gd = g as f64;
            let want = 0.5 * gd * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (gd + 0.044715 * gd * gd * gd)).tanh());
            let err = (o[0] as f64 - want).abs();
            assert!(err <= 1e-7_f64.max(want.abs() * 4e-7), "gelu({g}) = {} vs {want}", o[0]);
        }
        let n = 20_003;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        gelu_mul(&g, &u, &mut a);
        gelu_mul_parallel(&crate::pool::Pool::new(2).unwrap(), &g, &u, &mut b);
        assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn bias_scale_and_softcap() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        add_rows(&mut x, &[10.0, 20.0]);
        assert_eq!(x, [11.0, 22.0, 13.0, 24.0]);
        scale_inplace(&mut x, 0.5);
        assert_eq!(x, [5.5, 11.0, 6.5, 12.0]);
        let mut l = vec![0.0, 1000.0, -1000.0, 1.0];
        softcap(&mut l, 30.0);
        assert_eq!(l[0], 0.0);
        assert!((l[1] - 30.0).abs() < 1e-4 && (l[2] + 30.0).abs() < 1e-4);
        assert!((l[3] - 30.0 * (1.0f32 / 30.0).tanh()).abs() < 1e-7);
    }

    #[test]
    fn silu_mul_matches_formula() {
        let mut out = [0.0];
        silu_mul(&[1.0], &[2.0], &mut out);
        assert!((out[0] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        // Every gate from -120 to 120 (past the clamp of e^x on both sides),
        // lengths that are not a multiple of the lanes or the chunk.
        let gate: Vec<f32> = (0..2401).map(|i| -120.0 + i as f32 * 0.1).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut out = vec![0f32; gate.len()];
        silu_mul(&gate, &up, &mut out);
        for ((g, u), o) in gate.iter().zip(&up).zip(&out) {
            let want = (*g as f64) / (1.0 + (-*g as f64).exp()) * *u as f64;
            assert!((*o as f64 - want).abs() <= 4e-7 * want.abs().max(1e-30) + 1e-35, "silu({g}) * {u}: {o} vs {want}");
        }
    }
}
