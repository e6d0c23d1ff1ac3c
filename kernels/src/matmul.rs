//! Matrix products `y = x · Wᵀ` of activations by a weight matrix stored in
//! one of the GGML block formats.
//!
//! Quantized weights meet activations quantized to 8 bits per block (the
//! scheme llama.cpp uses); float weights meet float activations. Each output
//! element is computed by one fixed sequence of operations that depends only
//! on its own row and column, never on how many rows are in the batch or how
//! the work is split across threads: this is what makes a sequence's tokens
//! identical alone or batched, prefilled in one chunk or many.

use crate::quant::{dequantize_row, QuantizedActs, WeightFormat, QK};
use half::f16;
use crate::pool::Pool;
use std::sync::OnceLock;

/// A weight matrix of `n` rows (output features) by `k` columns (input
/// features), prepared for the kernels of this crate.
pub struct QMatrix {
    pub n: usize,
    pub k: usize,
    pub format: WeightFormat,
    kind: Prepared,
}

enum Prepared {
    /// Row-major f32 (from F32, F16 and BF16 sources).
    F32(Vec<f32>),
    /// 4-bit formats: packed nibbles (16 bytes per block, GGML order: low
    /// nibble = element j, high nibble = element j + 16), the scale `d` and
    /// the offset `m` per block (Q4_0 stores `m = -8 d`).
    Q4 { qs: Vec<u8>, d: Vec<f32>, m: Vec<f32> },
    /// Q8_0: signed bytes and scale per block.
    Q8 { qs: Vec<i8>, d: Vec<f32> },
}

/// Errors preparing a weight matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    #[error("matrix of {n}x{k} in {format} needs {expected} bytes, got {got}")]
    Size { n: usize, k: usize, format: &'static str, expected: usize, got: usize },
    #[error("row length {k} is not a multiple of {QK}")]
    RowLength { k: usize },
}

impl QMatrix {
    /// Prepares a matrix from GGML-layout bytes (`n` rows of `k` elements).
    pub fn from_ggml(format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<Self, MatrixError> {
        if k % QK != 0 {
            return Err(MatrixError::RowLength { k });
        }
        let row_bytes = format.row_bytes(k).ok_or(MatrixError::RowLength { k })?;
        let expected = row_bytes * n;
        if bytes.len() != expected {
            return Err(MatrixError::Size { n, k, format: format.name(), expected, got: bytes.len() });
        }
        let nb = n * k / QK;
        let f16_at = |b: &[u8], i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
        let kind = match format {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => {
                let mut w = vec![0f32; n * k];
                for (row, out) in bytes.chunks_exact(row_bytes).zip(w.chunks_exact_mut(k)) {
                    dequantize_row(format, row, out);
                }
                Prepared::F32(w)
            }
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                let bb = format.block_bytes();
                let hdr = bb - 16;
                let (mut qs, mut d, mut m) = (Vec::with_capacity(nb * 16), Vec::with_capacity(nb), Vec::with_capacity(nb));
                for b in bytes.chunks_exact(bb) {
                    let scale = f16_at(b, 0);
                    d.push(scale);
                    m.push(if format == WeightFormat::Q4_1 { f16_at(b, 2) } else { -8.0 * scale });
                    qs.extend_from_slice(&b[hdr..]);
                }
                Prepared::Q4 { qs, d, m }
            }
            WeightFormat::Q8_0 => {
                let (mut qs, mut d) = (Vec::with_capacity(nb * QK), Vec::with_capacity(nb));
                for b in bytes.chunks_exact(34) {
                    d.push(f16_at(b, 0));
                    qs.extend(b[2..].iter().map(|&v| v as i8));
                }
                Prepared::Q8 { qs, d }
            }
        };
        Ok(QMatrix { n, k, format, kind })
    }

    /// Prepares a float matrix from row-major f32 values.
    pub fn from_f32(n: usize, k: usize, w: Vec<f32>) -> Result<Self, MatrixError> {
        if k % QK != 0 {
            return Err(MatrixError::RowLength { k });
        }
        if w.len() != n * k {
            return Err(MatrixError::Size { n, k, format: "F32", expected: n * k * 4, got: w.len() * 4 });
        }
        Ok(QMatrix { n, k, format: WeightFormat::F32, kind: Prepared::F32(w) })
    }

    /// Whether products with this matrix take 8-bit quantized activations.
    pub fn wants_quantized_acts(&self) -> bool {
        !matches!(self.kind, Prepared::F32(_))
    }

    /// Bytes held by the prepared matrix.
    pub fn size_bytes(&self) -> usize {
        match &self.kind {
            Prepared::F32(w) => w.len() * 4,
            Prepared::Q4 { qs, d, m } => qs.len() + (d.len() + m.len()) * 4,
            Prepared::Q8 { qs, d } => qs.len() + d.len() * 4,
        }
    }

    /// Row `r` as f32 (embedding lookup and tests).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let k = self.k;
        let nb = k / QK;
        match &self.kind {
            Prepared::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            Prepared::Q4 { qs, d, m } => {
                for b in 0..nb {
                    let (s, off) = (d[r * nb + b], m[r * nb + b]);
                    let q = &qs[(r * nb + b) * 16..(r * nb + b + 1) * 16];
                    for j in 0..16 {
                        out[b * QK + j] = (q[j] & 0x0f) as f32 * s + off;
                        out[b * QK + j + 16] = (q[j] >> 4) as f32 * s + off;
                    }
                }
            }
            Prepared::Q8 { qs, d } => {
                for b in 0..nb {
                    let s = d[r * nb + b];
                    for j in 0..QK {
                        out[b * QK + j] = qs[(r * nb + b) * QK + j] as f32 * s;
                    }
                }
            }
        }
    }
}

/// Instruction set chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512Vnni,
    Avx2,
    Scalar,
}

/// The instruction set the kernels use on this machine. All three give
/// bit-identical results; they differ only in speed.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var("BATON_KERNELS_SCALAR").is_ok_and(|v| v == "1") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx512Vnni;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// Output rows of the weight matrix handled by one task.
const ROWS_PER_TASK: usize = 16;

/// How far ahead (in bytes of 4-bit quants; scales and 8-bit quants keep the
/// same distance in blocks) the kernels prefetch weights. A row of the default
/// model is 288 to 768 bytes: too short for the hardware prefetcher to ramp up
/// before the tile moves on, so at batch 1 the kernels waited on the cache.
/// 4 KiB ahead took single-thread decode from 54 to 85 tokens/s (1 to 8 KiB
/// measured; see the README).
const PREFETCH_BYTES: usize = 4096;

/// Raw pointer that may cross threads: tasks write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[t * w.n + o] = dot(x[t], w[o])` for `rows` activation rows.
///
/// `x` is row-major `rows x w.k`; `xq` must hold the same rows quantized
/// when `w.wants_quantized_acts()`. Runs on `pool`.
pub fn matmul(pool: &Pool, x: &[f32], xq: &QuantizedActs, rows: usize, w: &QMatrix, out: &mut [f32]) {
    matmul_many(pool, x, xq, rows, &mut [(w, out)]);
}

/// Several products of the same activations (the query, key and value
/// projections; gate and up), in one parallel dispatch.
pub fn matmul_many(pool: &Pool, x: &[f32], xq: &QuantizedActs, rows: usize, outs: &mut [(&QMatrix, &mut [f32])]) {
    let mut jobs: Vec<(&QMatrix, OutPtr, usize)> = Vec::new();
    for (w, out) in outs.iter_mut() {
        assert!(out.len() >= rows * w.n, "matmul output too small");
        assert!(x.len() >= rows * w.k || w.wants_quantized_acts());
        if w.wants_quantized_acts() {
            assert!(xq.rows >= rows && xq.k == w.k, "activations not quantized for this matrix");
        }
        let ptr = OutPtr(out.as_mut_ptr());
        for task in 0..w.n.div_ceil(ROWS_PER_TASK) {
            jobs.push((*w, ptr, task));
        }
    }
    // Activation scales laid out for the Q4 tiles, once per call (per group
    // of four rows), shared by every task.
    #[cfg(target_arch = "x86_64")]
    let groups: Vec<simd::ActBlocks> = if xq.k > 0 && isa() != Isa::Scalar && jobs.iter().any(|(w, _, _)| matches!(w.kind, Prepared::Q4 { .. })) {
        // SAFETY: the ISA check guarantees AVX2.
        (0..rows.div_ceil(4)).map(|g| unsafe { simd::ActBlocks::new(xq, g * 4, (rows - g * 4).min(4)) }).collect()
    } else {
        Vec::new()
    };
    pool.run(jobs.len(), &|j| {
        let (w, p, task) = jobs[j];
        let n = w.n;
        let o0 = task * ROWS_PER_TASK;
        let o1 = (o0 + ROWS_PER_TASK).min(n);
        #[cfg(target_arch = "x86_64")]
        if let (Prepared::Q4 { qs, d, m }, Isa::Avx512Vnni | Isa::Avx2) = (&w.kind, isa()) {
            // SAFETY: the tile writes only (t, o) for o in o0..o1, which this
            // task owns; `out` holds rows * n elements.
            unsafe { simd::q4_task(qs, d, m, w.k, xq, &groups, rows, o0, o1, p.0, n, isa() == Isa::Avx512Vnni) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let (Prepared::Q8 { qs, d }, Isa::Avx512Vnni | Isa::Avx2) = (&w.kind, isa()) {
            // SAFETY: as above.
            unsafe { simd::q8_task(qs, d, w.k, xq, rows, o0, o1, p.0, n, isa() == Isa::Avx512Vnni) };
            return;
        }
        for t in 0..rows {
            for o in o0..o1 {
                let v = dot(w, o, x, xq, t);
                // SAFETY: each (t, o) is written by exactly one task, and
                // `out` holds rows * n elements (asserted above).
                unsafe { *p.0.add(t * n + o) = v };
            }
        }
    });
}

/// One output element: row `o` of `w` against activation row `t`.
#[inline]
fn dot(w: &QMatrix, o: usize, x: &[f32], xq: &QuantizedActs, t: usize) -> f32 {
    let k = w.k;
    let nb = k / QK;
    match &w.kind {
        Prepared::F32(wf) => {
            let a = &wf[o * k..(o + 1) * k];
            let b = &x[t * k..(t + 1) * k];
            match isa() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni | Isa::Avx2 => unsafe { simd::dot_f32(a, b) },
                _ => scalar::dot_f32(a, b),
            }
        }
        Prepared::Q4 { qs, d, m } => {
            let wq = &qs[o * nb * 16..(o + 1) * nb * 16];
            let (wd, wm) = (&d[o * nb..(o + 1) * nb], &m[o * nb..(o + 1) * nb]);
            let (xq_, xd, xs) = (xq.row_q(t), xq.row_d(t), xq.row_s(t));
            match isa() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => unsafe { simd::dot_q4_vnni(wq, wd, wm, xq_, xd, xs) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { simd::dot_q4_avx2(wq, wd, wm, xq_, xd, xs) },
                _ => scalar::dot_q4(wq, wd, wm, xq_, xd, xs),
            }
        }
        Prepared::Q8 { qs, d } => {
            let wq = &qs[o * k..(o + 1) * k];
            let wd = &d[o * nb..(o + 1) * nb];
            let (xq_, xd) = (xq.row_q(t), xq.row_d(t));
            match isa() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => unsafe { simd::dot_q8_vnni(wq, wd, xq_, xd) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { simd::dot_q8_avx2(wq, wd, xq_, xd) },
                _ => scalar::dot_q8(wq, wd, xq_, xd),
            }
        }
    }
}

/// The fixed lane-reduction order shared by every path.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Portable reference kernels: they emulate the SIMD lanes exactly.
pub(crate) mod scalar {
    use super::{hsum8, QK};

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] = ca[l].mul_add(cb[l], acc[l]);
            }
        }
        hsum8(acc)
    }

    pub fn dot_q4(wq: &[u8], wd: &[f32], wm: &[f32], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let mut macc = 0f32;
        for b in 0..wd.len() {
            let q = &wq[b * 16..b * 16 + 16];
            let x = &xq[b * QK..b * QK + QK];
            let scale = wd[b] * xd[b];
            for l in 0..8 {
                let mut s = 0i32;
                for i in 4 * l..4 * l + 4 {
                    let wv = if i < 16 { q[i] & 0x0f } else { q[i - 16] >> 4 };
                    s += wv as i32 * x[i] as i32;
                }
                acc[l] = (s as f32).mul_add(scale, acc[l]);
            }
            macc = wm[b].mul_add(xs[b], macc);
        }
        hsum8(acc) + macc
    }

    pub fn dot_q8(wq: &[i8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for b in 0..wd.len() {
            let scale = wd[b] * xd[b];
            for l in 0..8 {
                let mut s = 0i32;
                for i in b * QK + 4 * l..b * QK + 4 * l + 4 {
                    s += wq[i] as i32 * xq[i] as i32;
                }
                acc[l] = (s as f32).mul_add(scale, acc[l]);
            }
        }
        hsum8(acc)
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{PREFETCH_BYTES, QK};
    use crate::quant::QuantizedActs;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), as `hsum8`.
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s3 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s3)
    }


    /// Integer dot products of one Q4 block against 32 activation bytes:
    /// 8 lanes of 4 products each.
    #[inline(always)]
    unsafe fn isum(w: __m256i, x: __m256i, vnni: bool) -> __m256i {
        if vnni {
            dpbusd(w, x)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
        }
    }

    #[inline(always)]
    unsafe fn dpbusd(w: __m256i, x: __m256i) -> __m256i {
        #[cfg(target_feature = "avx512vnni")]
        {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
        }
        #[cfg(not(target_feature = "avx512vnni"))]
        {
            dpbusd_vnni(w, x)
        }
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn dpbusd_vnni(w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
    }

    /// Per-block activation scales of up to four rows, laid out for the
    /// tiles: `dx` broadcast to 8 lanes, and the block sums of the rows side
    /// by side so one fused multiply-add serves them all.
    pub struct ActBlocks {
        dxv: Vec<__m256>,
        xs4: Vec<__m128>,
    }

    impl ActBlocks {
        #[target_feature(enable = "avx2")]
        pub unsafe fn new(xq: &QuantizedActs, t: usize, c: usize) -> Self {
            let nb = xq.k / QK;
            let mut dxv = Vec::with_capacity(nb * 4);
            let mut xs4 = Vec::with_capacity(nb);
            for b in 0..nb {
                let mut s = [0f32; 4];
                for j in 0..4 {
                    let r = t + j.min(c - 1);
                    dxv.push(_mm256_set1_ps(*xq.row_d(r).get_unchecked(b)));
                    s[j] = *xq.row_s(r).get_unchecked(b);
                }
                xs4.push(_mm_loadu_ps(s.as_ptr()));
            }
            ActBlocks { dxv, xs4 }
        }
    }

    /// An R x C tile: weight rows `o..o+R` against activation rows
    /// `t..t+C`. Per output element the arithmetic is exactly that of
    /// `dot_q4_*` (and of `scalar::dot_q4`): the tile only shares loads.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_tile<const R: usize, const C: usize>(
        qs: &[u8], d: &[f32], m: &[f32], nb: usize, xq: &QuantizedActs, acts: &ActBlocks, o: usize, t: usize, out: *mut f32, n: usize, vnni: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut macc = [_mm_setzero_ps(); R];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        for b in 0..nb {
            let mut xs = [_mm256_setzero_si256(); C];
            for c in 0..C {
                xs[c] = _mm256_loadu_si256(xqp[c].add(b * QK) as *const __m256i);
            }
            let xs4 = *acts.xs4.get_unchecked(b);
            // One prefetch per cache line of each stream (16 B of quants and
            // 4 B of each scale per block); prefetches never fault, so the
            // last rows may point past the matrix.
            if b % 4 == 0 {
                for r in 0..R {
                    let rb = (o + r) * nb + b;
                    _mm_prefetch(qs.as_ptr().wrapping_add(rb * 16 + PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                    if b % 16 == 0 {
                        _mm_prefetch(d.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                        _mm_prefetch(m.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                    }
                }
            }
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let wv = unpack_q4(qs.as_ptr().add(rb * 16));
                let dw = _mm256_set1_ps(*d.get_unchecked(rb));
                macc[r] = _mm_fmadd_ps(_mm_set1_ps(*m.get_unchecked(rb)), xs4, macc[r]);
                for c in 0..C {
                    let s = isum(wv, xs[c], vnni);
                    let scale = _mm256_mul_ps(dw, *acts.dxv.get_unchecked(b * 4 + c));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            let mut ms = [0f32; 4];
            _mm_storeu_ps(ms.as_mut_ptr(), macc[r]);
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum(acc[r][c]) + ms[c];
            }
        }
    }

    /// All rows `t` and weight rows `o0..o1` of a Q4 product, in tiles.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_task(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        if vnni {
            q4_task_vnni(qs, d, m, k, xq, groups, rows, o0, o1, out, n)
        } else {
            q4_task_impl(qs, d, m, k, xq, groups, rows, o0, o1, out, n, false)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn q4_task_vnni(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        q4_task_impl(qs, d, m, k, xq, groups, rows, o0, o1, out, n, true)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_task_impl(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        let nb = k / QK;
        let mut t = 0;
        while t < rows {
            let left = rows - t;
            let acts = &groups[t / 4];
            let mut o = o0;
            if left >= 4 {
                // With AVX-512VL's 32 vector registers a 4 x 4 tile fits (16
                // accumulators): each unpacked weight block serves four rows of
                // activations and each activation block four weight rows.
                while vnni && o + 4 <= o1 {
                    q4_tile::<4, 4>(qs, d, m, nb, xq, acts, o, t, out, n, vnni);
                    o += 4;
                }
                while o + 2 <= o1 {
                    q4_tile::<2, 4>(qs, d, m, nb, xq, acts, o, t, out, n, vnni);
                    o += 2;
                }
                while o < o1 {
                    q4_tile::<1, 4>(qs, d, m, nb, xq, acts, o, t, out, n, vnni);
                    o += 1;
                }
                t += 4;
                continue;
            }
            while o + 4 <= o1 {
                match left {
                    1 => q4_tile::<4, 1>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                    2 => q4_tile::<4, 2>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                    _ => q4_tile::<4, 3>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                }
                o += 4;
            }
            while o < o1 {
                match left {
                    1 => q4_tile::<1, 1>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                    2 => q4_tile::<1, 2>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                    _ => q4_tile::<1, 3>(qs, d, m, nb, xq, acts, o, t, out, n, vnni),
                }
                o += 1;
            }
            t = rows;
        }
    }

    /// An R x C tile of a Q8_0 product; per element the arithmetic of
    /// `dot_q8_*`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_tile<const R: usize, const C: usize>(
        qs: &[i8], d: &[f32], nb: usize, xq: &QuantizedActs, o: usize, t: usize, out: *mut f32, n: usize, vnni: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        let xdp: [&[f32]; C] = std::array::from_fn(|c| xq.row_d(t + c));
        for b in 0..nb {
            let mut xs = [_mm256_setzero_si256(); C];
            for c in 0..C {
                xs[c] = _mm256_loadu_si256(xqp[c].add(b * QK) as *const __m256i);
            }
            // As in `q4_tile`, the same distance in blocks (32 B per block).
            if b % 2 == 0 {
                for r in 0..R {
                    let rb = (o + r) * nb + b;
                    _mm_prefetch(qs.as_ptr().wrapping_add(rb * QK + 2 * PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                    if b % 16 == 0 {
                        _mm_prefetch(d.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                    }
                }
            }
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let w = _mm256_loadu_si256(qs.as_ptr().add(rb * QK) as *const __m256i);
                let aw = _mm256_abs_epi8(w);
                let dw = *d.get_unchecked(rb);
                for c in 0..C {
                    let s = isum(aw, _mm256_sign_epi8(xs[c], w), vnni);
                    let scale = _mm256_set1_ps(dw * *xdp[c].get_unchecked(b));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum(acc[r][c]);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q8_task(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        if vnni {
            q8_task_vnni(qs, d, k, xq, rows, o0, o1, out, n)
        } else {
            q8_task_impl(qs, d, k, xq, rows, o0, o1, out, n, false)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn q8_task_vnni(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        q8_task_impl(qs, d, k, xq, rows, o0, o1, out, n, true)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_task_impl(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        let nb = k / QK;
        let mut t = 0;
        while t < rows {
            let left = rows - t;
            let mut o = o0;
            if left >= 4 {
                while o + 2 <= o1 {
                    q8_tile::<2, 4>(qs, d, nb, xq, o, t, out, n, vnni);
                    o += 2;
                }
                while o < o1 {
                    q8_tile::<1, 4>(qs, d, nb, xq, o, t, out, n, vnni);
                    o += 1;
                }
                t += 4;
                continue;
            }
            while o + 4 <= o1 {
                match left {
                    1 => q8_tile::<4, 1>(qs, d, nb, xq, o, t, out, n, vnni),
                    2 => q8_tile::<4, 2>(qs, d, nb, xq, o, t, out, n, vnni),
                    _ => q8_tile::<4, 3>(qs, d, nb, xq, o, t, out, n, vnni),
                }
                o += 4;
            }
            while o < o1 {
                match left {
                    1 => q8_tile::<1, 1>(qs, d, nb, xq, o, t, out, n, vnni),
                    2 => q8_tile::<1, 2>(qs, d, nb, xq, o, t, out, n, vnni),
                    _ => q8_tile::<1, 3>(qs, d, nb, xq, o, t, out, n, vnni),
                }
                o += 1;
            }
            t = rows;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let n = a.len() / 8;
        for i in 0..n {
            let va = _mm256_loadu_ps(a.as_ptr().add(i * 8));
            let vb = _mm256_loadu_ps(b.as_ptr().add(i * 8));
            acc = _mm256_fmadd_ps(va, vb, acc);
        }
        hsum(acc)
    }

    /// 32 nibbles of one Q4 block as 32 unsigned bytes in element order.
    #[inline(always)]
    unsafe fn unpack_q4(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(v, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    pub unsafe fn dot_q4_vnni(wq: &[u8], wd: &[f32], wm: &[f32], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut macc = 0f32;
        for b in 0..wd.len() {
            let w = unpack_q4(wq.as_ptr().add(b * 16));
            let x = _mm256_loadu_si256(xq.as_ptr().add(b * QK) as *const __m256i);
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
            let scale = _mm256_set1_ps(wd[b] * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
            macc = wm[b].mul_add(xs[b], macc);
        }
        hsum(acc) + macc
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_avx2(wq: &[u8], wd: &[f32], wm: &[f32], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut macc = 0f32;
        for b in 0..wd.len() {
            let w = unpack_q4(wq.as_ptr().add(b * 16));
            let x = _mm256_loadu_si256(xq.as_ptr().add(b * QK) as *const __m256i);
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
            let scale = _mm256_set1_ps(wd[b] * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
            macc = wm[b].mul_add(xs[b], macc);
        }
        hsum(acc) + macc
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    pub unsafe fn dot_q8_vnni(wq: &[i8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for b in 0..wd.len() {
            let w = _mm256_loadu_si256(wq.as_ptr().add(b * QK) as *const __m256i);
            let x = _mm256_loadu_si256(xq.as_ptr().add(b * QK) as *const __m256i);
            // |w| * (x * sign(w)) = w * x, with an unsigned left operand.
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            let scale = _mm256_set1_ps(wd[b] * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q8_avx2(wq: &[i8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for b in 0..wd.len() {
            let w = _mm256_loadu_si256(wq.as_ptr().add(b * QK) as *const __m256i);
            let x = _mm256_loadu_si256(xq.as_ptr().add(b * QK) as *const __m256i);
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            let s = _mm256_madd_epi16(p, ones);
            let scale = _mm256_set1_ps(wd[b] * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
        }
        hsum(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_row_q4_0, quantize_row_q4_1, quantize_row_q8_0};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn matrix(format: WeightFormat, n: usize, k: usize, seed: &mut u64) -> (QMatrix, Vec<f32>) {
        let w: Vec<f32> = (0..n * k).map(|_| lcg(seed)).collect();
        let mut bytes = Vec::new();
        for row in w.chunks(k) {
            match format {
                WeightFormat::Q4_1 => quantize_row_q4_1(row, &mut bytes),
                WeightFormat::Q4_0 => quantize_row_q4_0(row, &mut bytes),
                WeightFormat::Q8_0 => quantize_row_q8_0(row, &mut bytes),
                WeightFormat::F32 => row.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
                WeightFormat::F16 => row.iter().for_each(|v| bytes.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
                WeightFormat::BF16 => row
                    .iter()
                    .for_each(|v| bytes.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())),
            }
        }
        let m = QMatrix::from_ggml(format, n, k, &bytes).unwrap();
        let mut deq = vec![0f32; n * k];
        for r in 0..n {
            m.row_f32(r, &mut deq[r * k..(r + 1) * k]);
        }
        (m, deq)
    }

    fn run(w: &QMatrix, x: &[f32], rows: usize) -> Vec<f32> {
        let pool = Pool::new(2).unwrap();
        let mut xq = QuantizedActs::default();
        if w.wants_quantized_acts() {
            xq.quantize(&pool, x, rows, w.k);
        }
        let mut out = vec![0f32; rows * w.n];
        matmul(&pool, x, &xq, rows, w, &mut out);
        out
    }

    #[test]
    fn every_format_matches_dequantized_reference() {
        let mut seed = 7;
        for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16, WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let (n, k, rows) = (37, 96, 5);
            let (w, deq) = matrix(format, n, k, &mut seed);
            let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
            let out = run(&w, &x, rows);
            for t in 0..rows {
                for o in 0..n {
                    let r: f32 = (0..k).map(|i| deq[o * k + i] * x[t * k + i]).sum();
                    let tol = if w.wants_quantized_acts() { 0.05 * (1.0 + r.abs()) } else { 1e-4 };
                    assert!((out[t * n + o] - r).abs() < tol, "{format:?} t={t} o={o}: {} vs {r}", out[t * n + o]);
                }
            }
        }
    }

    #[test]
    fn rows_are_independent_of_batch_bit_for_bit() {
        let mut seed = 11;
        for format in [WeightFormat::F32, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let (n, k, rows) = (70, 128, 9);
            let (w, _) = matrix(format, n, k, &mut seed);
            let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
            let all = run(&w, &x, rows);
            for t in 0..rows {
                let one = run(&w, &x[t * k..(t + 1) * k], 1);
                assert_eq!(one, all[t * n..(t + 1) * n].to_vec(), "{format:?} row {t}");
            }
        }
    }

    #[test]
    fn simd_equals_scalar_bit_for_bit() {
        let mut seed = 3;
        let k = 256;
        let nb = k / QK;
        let (w, _) = matrix(WeightFormat::Q4_1, 4, k, &mut seed);
        let (w8, _) = matrix(WeightFormat::Q8_0, 4, k, &mut seed);
        let x: Vec<f32> = (0..k).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut xq = QuantizedActs::default();
        xq.quantize(&Pool::new(1).unwrap(), &x, 1, k);
        let (Prepared::Q4 { qs, d, m }, Prepared::Q8 { qs: q8, d: d8 }) = (&w.kind, &w8.kind) else { unreachable!() };
        let s = scalar::dot_q4(&qs[..nb * 16], &d[..nb], &m[..nb], xq.row_q(0), xq.row_d(0), xq.row_s(0));
        let s8 = scalar::dot_q8(&q8[..k], &d8[..nb], xq.row_q(0), xq.row_d(0));
        let sf = scalar::dot_f32(&x, &x);
        #[cfg(target_arch = "x86_64")]
        unsafe {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                assert_eq!(s.to_bits(), simd::dot_q4_avx2(&qs[..nb * 16], &d[..nb], &m[..nb], xq.row_q(0), xq.row_d(0), xq.row_s(0)).to_bits());
                assert_eq!(s8.to_bits(), simd::dot_q8_avx2(&q8[..k], &d8[..nb], xq.row_q(0), xq.row_d(0)).to_bits());
                assert_eq!(sf.to_bits(), simd::dot_f32(&x, &x).to_bits());
            }
            if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                assert_eq!(s.to_bits(), simd::dot_q4_vnni(&qs[..nb * 16], &d[..nb], &m[..nb], xq.row_q(0), xq.row_d(0), xq.row_s(0)).to_bits());
                assert_eq!(s8.to_bits(), simd::dot_q8_vnni(&q8[..k], &d8[..nb], xq.row_q(0), xq.row_d(0)).to_bits());
            }
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(matches!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 64, &[0u8; 10]), Err(MatrixError::Size { .. })));
        assert_eq!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 40, &[0u8; 10]).err(), Some(MatrixError::RowLength { k: 40 }));
    }
}
