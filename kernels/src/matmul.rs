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
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
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
    // Activation scales laid out for the quantized tiles, once per call
    // (per group of four rows), shared by every task.
    #[cfg(target_arch = "x86_64")]
    let groups: Vec<simd::ActBlocks> = if xq.k > 0 && isa() != Isa::Scalar && jobs.iter().any(|(w, _, _)| w.wants_quantized_acts()) {
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
            unsafe { simd::q8_task(qs, d, w.k, xq, &groups, rows, o0, o1, p.0, n, isa() == Isa::Avx512Vnni) };
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
        // On SIMD machines the quantized formats always run as tiles
        // (`matmul_many`); this is the portable path, bit-identical to them.
        Prepared::Q4 { qs, d, m } => {
            let wq = &qs[o * nb * 16..(o + 1) * nb * 16];
            let (wd, wm) = (&d[o * nb..(o + 1) * nb], &m[o * nb..(o + 1) * nb]);
            scalar::dot_q4(wq, wd, wm, xq.row_q(t), xq.row_d(t), xq.row_s(t))
        }
        Prepared::Q8 { qs, d } => {
            let wq = &qs[o * k..(o + 1) * k];
            let wd = &d[o * nb..(o + 1) * nb];
            scalar::dot_q8(wq, wd, xq.row_q(t), xq.row_d(t))
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

    /// The Q4 arithmetic: per block, 8 lanes of 4 integer products; even
    /// and odd blocks accumulate in separate lane sets (a 512-bit register
    /// holds one of each), added lane by lane at the end; the offset term
    /// `m * sum(x)` accumulates block by block.
    pub fn dot_q4(wq: &[u8], wd: &[f32], wm: &[f32], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let mut acc = [[0f32; 8]; 2];
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
                acc[b % 2][l] = (s as f32).mul_add(scale, acc[b % 2][l]);
            }
            macc = wm[b].mul_add(xs[b], macc);
        }
        hsum8(std::array::from_fn(|l| acc[0][l] + acc[1][l])) + macc
    }

    /// The Q8_0 arithmetic: as `dot_q4`'s (even and odd blocks in
    /// separate lane sets), without the offset term.
    pub fn dot_q8(wq: &[i8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
        let mut acc = [[0f32; 8]; 2];
        for b in 0..wd.len() {
            let scale = wd[b] * xd[b];
            for l in 0..8 {
                let mut s = 0i32;
                for i in b * QK + 4 * l..b * QK + 4 * l + 4 {
                    s += wq[i] as i32 * xq[i] as i32;
                }
                acc[b % 2][l] = (s as f32).mul_add(scale, acc[b % 2][l]);
            }
        }
        hsum8(std::array::from_fn(|l| acc[0][l] + acc[1][l]))
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


    /// Integer dot products of 32 unsigned weight bytes against 32 signed
    /// activation bytes: 8 lanes of 4 products each (AVX2 has no VNNI).
    #[inline(always)]
    unsafe fn isum(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// Per-block activation scales of up to four rows, laid out for the
    /// tiles: `dx` broadcast to 8 lanes (and, for the 512-bit tiles, the
    /// scales of a pair of blocks side by side), and the block sums of the
    /// rows side by side so one fused multiply-add serves them all.
    pub struct ActBlocks {
        dxv: Vec<__m256>,
        dxz: Vec<[f32; 16]>,
        xs4: Vec<__m128>,
    }

    impl ActBlocks {
        #[target_feature(enable = "avx2")]
        pub unsafe fn new(xq: &QuantizedActs, t: usize, c: usize) -> Self {
            let nb = xq.k / QK;
            let mut dxv = Vec::with_capacity(nb * 4);
            let mut dxz = vec![[0f32; 16]; nb.div_ceil(2) * 4];
            let mut xs4 = Vec::with_capacity(nb);
            for b in 0..nb {
                let mut s = [0f32; 4];
                for j in 0..4 {
                    let r = t + j.min(c - 1);
                    let dx = *xq.row_d(r).get_unchecked(b);
                    dxv.push(_mm256_set1_ps(dx));
                    dxz[b / 2 * 4 + j][b % 2 * 8..b % 2 * 8 + 8].fill(dx);
                    s[j] = *xq.row_s(r).get_unchecked(b);
                }
                xs4.push(_mm_loadu_ps(s.as_ptr()));
            }
            ActBlocks { dxv, dxz, xs4 }
        }
    }

    /// Walks activation rows in groups of up to four (`c` of them) and the
    /// weight rows `o0..o1` in tiles of `R` rows (`R` chosen per `c` from
    /// `[R1, R2, R3, R4]`), then single rows: the one loop of every task.
    macro_rules! sweep_tiles {
        ($rows:expr, $o0:expr, $o1:expr, [$r1:literal, $r2:literal, $r3:literal, $r4:literal], |$t:ident, $o:ident| $tile:ident($($arg:expr),*)) => {{
            let mut $t = 0;
            while $t < $rows {
                let c = ($rows - $t).min(4);
                let mut $o = $o0;
                match c {
                    1 => sweep_tiles!(@run $o, $o1, $r1, 1, $tile($($arg),*)),
                    2 => sweep_tiles!(@run $o, $o1, $r2, 2, $tile($($arg),*)),
                    3 => sweep_tiles!(@run $o, $o1, $r3, 3, $tile($($arg),*)),
                    _ => sweep_tiles!(@run $o, $o1, $r4, 4, $tile($($arg),*)),
                }
                $t += c;
            }
        }};
        (@run $o:ident, $o1:expr, $r:literal, $c:literal, $tile:ident($($arg:expr),*)) => {{
            while $o + $r <= $o1 {
                $tile::<$r, $c>($($arg),*);
                $o += $r;
            }
            while $o < $o1 {
                $tile::<1, $c>($($arg),*);
                $o += 1;
            }
        }};
    }

    /// An R x C tile (AVX2): weight rows `o..o+R` against activation rows
    /// `t..t+C`. Per output element the arithmetic is exactly that of
    /// `scalar::dot_q4`, even and odd blocks in separate accumulators; the
    /// tile only shares loads.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_tile<const R: usize, const C: usize>(
        qs: &[u8], d: &[f32], m: &[f32], nb: usize, xq: &QuantizedActs, acts: &ActBlocks, o: usize, t: usize, out: *mut f32, n: usize,
    ) {
        let mut acc = [[[_mm256_setzero_ps(); C]; R]; 2];
        let mut macc = [_mm_setzero_ps(); R];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        for b in 0..nb {
            let mut xs = [_mm256_setzero_si256(); C];
            for c in 0..C {
                xs[c] = _mm256_loadu_si256(xqp[c].add(b * QK) as *const __m256i);
            }
            let xs4 = *acts.xs4.get_unchecked(b);
            prefetch_q4(qs, d, m, nb, o, R, b);
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let wv = unpack_q4(qs.as_ptr().add(rb * 16));
                let dw = _mm256_set1_ps(*d.get_unchecked(rb));
                macc[r] = _mm_fmadd_ps(_mm_set1_ps(*m.get_unchecked(rb)), xs4, macc[r]);
                for c in 0..C {
                    let s = isum(wv, xs[c]);
                    let scale = _mm256_mul_ps(dw, *acts.dxv.get_unchecked(b * 4 + c));
                    acc[b % 2][r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[b % 2][r][c]);
                }
            }
        }
        for r in 0..R {
            let mut ms = [0f32; 4];
            _mm_storeu_ps(ms.as_mut_ptr(), macc[r]);
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum(_mm256_add_ps(acc[0][r][c], acc[1][r][c])) + ms[c];
            }
        }
    }

    /// Prefetches the weights `PREFETCH_BYTES` ahead of block `b` of rows
    /// `o..o+R`: one prefetch per cache line of each stream (16 B of quants
    /// and 4 B of each scale per block). Prefetches never fault, so the last
    /// rows may point past the matrix.
    #[inline(always)]
    unsafe fn prefetch_q4(qs: &[u8], d: &[f32], m: &[f32], nb: usize, o: usize, rows: usize, b: usize) {
        if b % 4 == 0 {
            for r in 0..rows {
                let rb = (o + r) * nb + b;
                _mm_prefetch(qs.as_ptr().wrapping_add(rb * 16 + PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                if b % 16 == 0 {
                    _mm_prefetch(d.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                    _mm_prefetch(m.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                }
            }
        }
    }

    /// The nibbles of two consecutive Q4 blocks as 64 unsigned bytes in
    /// element order (`mask` 0xffff loads only the first block, the second
    /// reads as zero weights).
    #[inline(always)]
    unsafe fn unpack_q4_pair(p: *const u8, mask: u32) -> __m512i {
        let v = _mm256_maskz_loadu_epi8(mask, p as *const i8);
        // 128-bit lanes: [block b, block b, block b+1, block b+1] ...
        let z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(v));
        // ... low nibbles (elements 0..16) from the first copy, high
        // nibbles (elements 16..32) from the second.
        let four = 0x0004_0004_0004_0004;
        let z = _mm512_srlv_epi16(z, _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four));
        _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
    }

    /// An R x C tile with 512-bit registers (AVX-512 VNNI): two blocks per
    /// instruction, the even block in the low 8 lanes and the odd one in the
    /// high 8, which is the order `scalar::dot_q4` defines.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_tile512<const R: usize, const C: usize>(
        qs: &[u8], d: &[f32], m: &[f32], nb: usize, xq: &QuantizedActs, acts: &ActBlocks, o: usize, t: usize, out: *mut f32, n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut macc = [_mm_setzero_ps(); R];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for b in (0..nb).step_by(2) {
            // The last block of an odd count pairs with zero weights and zero
            // scales: it adds exact zeros to the odd lanes.
            let pair = b + 1 < nb;
            let mut xs = [_mm512_setzero_si512(); C];
            for c in 0..C {
                xs[c] = _mm512_maskz_loadu_epi8(if pair { !0 } else { 0xffff_ffff }, xqp[c].add(b * QK));
            }
            // `b` is even: every other pair starts a cache line of quants.
            prefetch_q4(qs, d, m, nb, o, R, b);
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let wv = unpack_q4_pair(qs.as_ptr().add(rb * 16), if pair { !0 } else { 0xffff });
                let dw2 = _mm_maskz_loadu_ps(if pair { 0b11 } else { 0b01 }, d.as_ptr().add(rb));
                let dw = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dw2));
                macc[r] = _mm_fmadd_ps(_mm_set1_ps(*m.get_unchecked(rb)), *acts.xs4.get_unchecked(b), macc[r]);
                if pair {
                    macc[r] = _mm_fmadd_ps(_mm_set1_ps(*m.get_unchecked(rb + 1)), *acts.xs4.get_unchecked(b + 1), macc[r]);
                }
                for c in 0..C {
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xs[c]);
                    let scale = _mm512_mul_ps(dw, _mm512_loadu_ps(acts.dxz.get_unchecked(b / 2 * 4 + c).as_ptr()));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            let mut ms = [0f32; 4];
            _mm_storeu_ps(ms.as_mut_ptr(), macc[r]);
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum512(acc[r][c]) + ms[c];
            }
        }
    }

    /// All rows `t` and weight rows `o0..o1` of a Q4 product, in tiles.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_task(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        if vnni {
            q4_task_512(qs, d, m, k, xq, groups, rows, o0, o1, out, n)
        } else {
            q4_task_avx2(qs, d, m, k, xq, groups, rows, o0, o1, out, n)
        }
    }

    /// AVX2 has 16 vector registers and the tiles hold two accumulators per
    /// element, so they stay at 8 accumulators or fewer.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_task_avx2(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        let nb = k / QK;
        sweep_tiles!(rows, o0, o1, [4, 2, 1, 1], |t, o| q4_tile(qs, d, m, nb, xq, &groups[t / 4], o, t, out, n));
    }

    /// AVX-512 has 32 registers: up to 4 x 4 tiles (16 accumulators), so
    /// each unpacked weight pair serves four activation rows and each
    /// activation pair four weight rows.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q4_task_512(qs: &[u8], d: &[f32], m: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        let nb = k / QK;
        sweep_tiles!(rows, o0, o1, [4, 4, 4, 4], |t, o| q4_tile512(qs, d, m, nb, xq, &groups[t / 4], o, t, out, n));
    }

    /// An R x C tile of a Q8_0 product (AVX2); per element the arithmetic
    /// of `scalar::dot_q8`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_tile<const R: usize, const C: usize>(
        qs: &[i8], d: &[f32], nb: usize, xq: &QuantizedActs, o: usize, t: usize, out: *mut f32, n: usize,
    ) {
        let mut acc = [[[_mm256_setzero_ps(); C]; R]; 2];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        let xdp: [&[f32]; C] = std::array::from_fn(|c| xq.row_d(t + c));
        for b in 0..nb {
            let mut xs = [_mm256_setzero_si256(); C];
            for c in 0..C {
                xs[c] = _mm256_loadu_si256(xqp[c].add(b * QK) as *const __m256i);
            }
            prefetch_q8(qs, d, nb, o, R, b);
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let w = _mm256_loadu_si256(qs.as_ptr().add(rb * QK) as *const __m256i);
                let aw = _mm256_abs_epi8(w);
                let dw = *d.get_unchecked(rb);
                for c in 0..C {
                    let s = isum(aw, _mm256_sign_epi8(xs[c], w));
                    let scale = _mm256_set1_ps(dw * *xdp[c].get_unchecked(b));
                    acc[b % 2][r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[b % 2][r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum(_mm256_add_ps(acc[0][r][c], acc[1][r][c]));
            }
        }
    }

    /// As `prefetch_q4`, for Q8_0 (32 B of quants per block).
    #[inline(always)]
    unsafe fn prefetch_q8(qs: &[i8], d: &[f32], nb: usize, o: usize, rows: usize, b: usize) {
        if b % 2 == 0 {
            for r in 0..rows {
                let rb = (o + r) * nb + b;
                _mm_prefetch(qs.as_ptr().wrapping_add(rb * QK + 2 * PREFETCH_BYTES), _MM_HINT_T0);
                if b % 16 == 0 {
                    _mm_prefetch(d.as_ptr().wrapping_add(rb + PREFETCH_BYTES / 16) as *const i8, _MM_HINT_T0);
                }
            }
        }
    }

    /// An R x C tile of a Q8_0 product with 512-bit registers: two blocks
    /// per instruction, even block low, odd block high, as `scalar::dot_q8`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_tile512<const R: usize, const C: usize>(
        qs: &[i8], d: &[f32], nb: usize, xq: &QuantizedActs, acts: &ActBlocks, o: usize, t: usize, out: *mut f32, n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let xqp: [*const i8; C] = std::array::from_fn(|c| xq.row_q(t + c).as_ptr());
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for b in (0..nb).step_by(2) {
            // An odd count's last block pairs with zeros (exact zeros added).
            let pair = b + 1 < nb;
            let bytes = if pair { !0u64 } else { 0xffff_ffff };
            let mut xs = [_mm512_setzero_si512(); C];
            for c in 0..C {
                xs[c] = _mm512_maskz_loadu_epi8(bytes, xqp[c].add(b * QK));
            }
            prefetch_q8(qs, d, nb, o, R, b);
            for r in 0..R {
                let rb = (o + r) * nb + b;
                let w = _mm512_maskz_loadu_epi8(bytes, qs.as_ptr().add(rb * QK));
                // |w| * (x * sign(w)) = w * x with an unsigned left operand;
                // w = 0 contributes 0 either way.
                let neg = _mm512_movepi8_mask(w);
                let aw = _mm512_abs_epi8(w);
                let dw2 = _mm_maskz_loadu_ps(if pair { 0b11 } else { 0b01 }, d.as_ptr().add(rb));
                let dw = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dw2));
                for c in 0..C {
                    let sx = _mm512_mask_sub_epi8(xs[c], neg, _mm512_setzero_si512(), xs[c]);
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
                    let scale = _mm512_mul_ps(dw, _mm512_loadu_ps(acts.dxz.get_unchecked(b / 2 * 4 + c).as_ptr()));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((t + c) * n + o + r) = hsum512(acc[r][c]);
            }
        }
    }

    /// `hsum8` of the lane-wise sum of the two halves.
    #[inline(always)]
    unsafe fn hsum512(v: __m512) -> f32 {
        hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))))
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q8_task(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize, vnni: bool) {
        if vnni {
            q8_task_512(qs, d, k, xq, groups, rows, o0, o1, out, n)
        } else {
            q8_task_avx2(qs, d, k, xq, rows, o0, o1, out, n)
        }
    }

    /// Tiles of at most 8 accumulators (two per element), as `q4_task_avx2`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8_task_avx2(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        let nb = k / QK;
        sweep_tiles!(rows, o0, o1, [4, 2, 1, 1], |t, o| q8_tile(qs, d, nb, xq, o, t, out, n));
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q8_task_512(qs: &[i8], d: &[f32], k: usize, xq: &QuantizedActs, groups: &[ActBlocks], rows: usize, o0: usize, o1: usize, out: *mut f32, n: usize) {
        let nb = k / QK;
        sweep_tiles!(rows, o0, o1, [4, 4, 4, 4], |t, o| q8_tile512(qs, d, nb, xq, &groups[t / 4], o, t, out, n));
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

    /// Every tile shape of both SIMD paths (AVX2 and AVX-512), over odd and
    /// even block counts and ragged row counts, equals the scalar reference
    /// bit for bit.
    #[test]
    fn simd_tiles_equal_scalar_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            if isa() == Isa::Scalar {
                eprintln!("SKIPPED: no AVX2 on this machine");
                return;
            }
            let mut seed = 3;
            for format in [WeightFormat::Q4_1, WeightFormat::Q4_0, WeightFormat::Q8_0] {
                for (n, k) in [(5, 32), (37, 96), (9, 256), (70, 160)] {
                    let nb = k / QK;
                    let (w, _) = matrix(format, n, k, &mut seed);
                    for rows in [1, 2, 3, 4, 5, 7, 9] {
                        let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed) * 3.0).collect();
                        let mut xq = QuantizedActs::default();
                        xq.quantize(&Pool::new(1).unwrap(), &x, rows, k);
                        let mut want = vec![0f32; rows * n];
                        for t in 0..rows {
                            for o in 0..n {
                                want[t * n + o] = match &w.kind {
                                    Prepared::Q4 { qs, d, m } => scalar::dot_q4(
                                        &qs[o * nb * 16..(o + 1) * nb * 16],
                                        &d[o * nb..(o + 1) * nb],
                                        &m[o * nb..(o + 1) * nb],
                                        xq.row_q(t),
                                        xq.row_d(t),
                                        xq.row_s(t),
                                    ),
                                    Prepared::Q8 { qs, d } => scalar::dot_q8(&qs[o * k..(o + 1) * k], &d[o * nb..(o + 1) * nb], xq.row_q(t), xq.row_d(t)),
                                    Prepared::F32(_) => unreachable!(),
                                };
                            }
                        }
                        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                        for vnni in [false, true] {
                            if vnni && isa() != Isa::Avx512Vnni {
                                eprintln!("SKIPPED: the AVX-512 tiles (no AVX-512 VNNI here)");
                                continue;
                            }
                            let mut got = vec![0f32; rows * n];
                            // SAFETY: the ISA checks above; `got` holds rows * n.
                            unsafe {
                                match &w.kind {
                                    Prepared::Q4 { qs, d, m } => {
                                        let groups: Vec<simd::ActBlocks> =
                                            (0..rows.div_ceil(4)).map(|g| simd::ActBlocks::new(&xq, g * 4, (rows - g * 4).min(4))).collect();
                                        simd::q4_task(qs, d, m, k, &xq, &groups, rows, 0, n, got.as_mut_ptr(), n, vnni)
                                    }
                                    Prepared::Q8 { qs, d } => {
                                        let groups: Vec<simd::ActBlocks> =
                                            (0..rows.div_ceil(4)).map(|g| simd::ActBlocks::new(&xq, g * 4, (rows - g * 4).min(4))).collect();
                                        simd::q8_task(qs, d, k, &xq, &groups, rows, 0, n, got.as_mut_ptr(), n, vnni)
                                    }
                                    Prepared::F32(_) => unreachable!(),
                                }
                            }
                            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(got, want, "{format:?} n={n} k={k} rows={rows} vnni={vnni}");
                        }
                    }
                }
            }
            let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed)).collect();
            // SAFETY: AVX2 and FMA (the ISA check above).
            assert_eq!(scalar::dot_f32(&x, &x).to_bits(), unsafe { simd::dot_f32(&x, &x) }.to_bits());
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(matches!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 64, &[0u8; 10]), Err(MatrixError::Size { .. })));
        assert_eq!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 40, &[0u8; 10]).err(), Some(MatrixError::RowLength { k: 40 }));
    }
}
