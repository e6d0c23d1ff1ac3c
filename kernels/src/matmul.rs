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
use crate::pool::{Pool, SendPtr};
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
    /// 4-bit formats in panels of [`PANEL`] rows. Quants, per panel and
    /// block: four groups of 64 bytes, byte `4r + i` of group `j` being
    /// GGML's byte `4j + i` of the panel's row `r` (low nibble: element
    /// `4j + i`, high nibble: element `4j + i + 16`). The scale `d` and
    /// offset `m` (Q4_0 stores `m = -8 d`) as f16 bits, as in the file (half
    /// the bytes of f32: batch 1 reads every weight once per token), per
    /// panel and block, one per row. Rows past `n` in the last panel are
    /// zeros.
    Q4 { qs: Vec<u8>, d: Vec<u16>, m: Vec<u16> },
    /// Q8_0 in panels: per panel and block, eight groups of 64 bytes, byte
    /// `4r + i` of group `q` being element `4q + i` of row `r` stored as
    /// `w + 128` (the unsigned operand the integer dot instructions take).
    /// Scales as for Q4.
    Q8 { qs: Vec<u8>, d: Vec<u16> },
}

/// Weight rows per panel. The quantized formats interleave 16 rows, four
/// weights of each, so that one 512-bit register holds four consecutive
/// weights of 16 rows and one integer dot instruction against four broadcast
/// activation bytes advances 16 output elements. Rows side by side, instead
/// of one row's weights across the lanes, leave nothing to reduce across
/// lanes: per block and activation row, the tile spends one conversion and
/// two fused multiply-adds on 16 outputs, where a row-major layout spent
/// them on one.
pub(crate) const PANEL: usize = 16;

/// How many panel blocks ahead the tiles prefetch (4 KiB of Q4 quants).
/// Decode batch 1, three alternating runs each: none 74.6 / 92.9 / 80.7
/// tok/s, 4 blocks 89.3 / 106.2 / 82.5, 8 blocks 97.2 / 92.3 / 89.2,
/// 16 blocks 92.1 / 111.0 / 102.9.
const PREFETCH_BLOCKS: usize = 16;

/// Quant bytes per panel and block.
const Q4_PANEL_BLOCK: usize = PANEL * QK / 2;
const Q8_PANEL_BLOCK: usize = PANEL * QK;

/// Quant `e` (0..32) of block `b` of row `o`, from the Q4 panel layout.
#[inline]
fn q4_at(qs: &[u8], nb: usize, o: usize, b: usize, e: usize) -> u8 {
    let g = e % 16;
    let byte = qs[((o / PANEL) * nb + b) * Q4_PANEL_BLOCK + (g / 4) * 64 + (o % PANEL) * 4 + g % 4];
    if e < 16 {
        byte & 0x0f
    } else {
        byte >> 4
    }
}

/// Quant `e` of block `b` of row `o`, from the Q8 panel layout.
#[inline]
fn q8_at(qs: &[u8], nb: usize, o: usize, b: usize, e: usize) -> i8 {
    (qs[((o / PANEL) * nb + b) * Q8_PANEL_BLOCK + (e / 4) * 64 + (o % PANEL) * 4 + e % 4] ^ 0x80) as i8
}

/// The per-block value (scale or offset) of block `b` of row `o`.
#[inline]
fn block_at(v: &[u16], nb: usize, o: usize, b: usize) -> f32 {
    f16::from_bits(v[((o / PANEL) * nb + b) * PANEL + o % PANEL]).to_f32()
}

/// Errors preparing a weight matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    #[error("matrix of {n}x{k} in {format} needs {expected} bytes, got {got}")]
    Size { n: usize, k: usize, format: &'static str, expected: usize, got: usize },
    #[error("row length {k} is not a multiple of {QK}")]
    RowLength { k: usize },
    #[error("row {row}, block {block}: Q4_0 scale {scale} is out of range (its offset -8 x scale overflows f16)")]
    ScaleRange { row: usize, block: usize, scale: String },
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
        let nb = k / QK;
        let panel_blocks = n.div_ceil(PANEL) * nb;
        let f16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
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
                let mut qs = vec![0u8; panel_blocks * Q4_PANEL_BLOCK];
                let (mut d, mut m) = (vec![0u16; panel_blocks * PANEL], vec![0u16; panel_blocks * PANEL]);
                for (o, row) in bytes.chunks_exact(row_bytes).enumerate() {
                    let (p, r) = (o / PANEL, o % PANEL);
                    for (b, blk) in row.chunks_exact(bb).enumerate() {
                        let pb = p * nb + b;
                        let scale = f16_at(blk, 0);
                        d[pb * PANEL + r] = scale;
                        m[pb * PANEL + r] = if format == WeightFormat::Q4_1 {
                            f16_at(blk, 2)
                        } else {
                            // Exact in f16 (a power-of-two multiple) unless it overflows.
                            let off = -8.0 * f16::from_bits(scale).to_f32();
                            if !f16::from_f32(off).to_f32().eq(&off) && off.is_finite() {
                                return Err(MatrixError::ScaleRange { row: o, block: b, scale: f16::from_bits(scale).to_string() });
                            }
                            f16::from_f32(off).to_bits()
                        };
                        for j in 0..4 {
                            let at = pb * Q4_PANEL_BLOCK + j * 64 + r * 4;
                            qs[at..at + 4].copy_from_slice(&blk[hdr + 4 * j..hdr + 4 * j + 4]);
                        }
                    }
                }
                Prepared::Q4 { qs, d, m }
            }
            WeightFormat::Q8_0 => {
                let mut qs = vec![0x80u8; panel_blocks * Q8_PANEL_BLOCK];
                let mut d = vec![0u16; panel_blocks * PANEL];
                for (o, row) in bytes.chunks_exact(row_bytes).enumerate() {
                    let (p, r) = (o / PANEL, o % PANEL);
                    for (b, blk) in row.chunks_exact(34).enumerate() {
                        let pb = p * nb + b;
                        d[pb * PANEL + r] = f16_at(blk, 0);
                        for q in 0..QK / 4 {
                            let at = pb * Q8_PANEL_BLOCK + q * 64 + r * 4;
                            for i in 0..4 {
                                qs[at + i] = blk[2 + 4 * q + i] ^ 0x80;
                            }
                        }
                    }
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
            Prepared::Q4 { qs, d, m } => qs.len() + (d.len() + m.len()) * 2,
            Prepared::Q8 { qs, d } => qs.len() + d.len() * 2,
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
                    let (s, off) = (block_at(d, nb, r, b), block_at(m, nb, r, b));
                    for e in 0..QK {
                        out[b * QK + e] = q4_at(qs, nb, r, b, e) as f32 * s + off;
                    }
                }
            }
            Prepared::Q8 { qs, d } => {
                for b in 0..nb {
                    let s = block_at(d, nb, r, b);
                    for e in 0..QK {
                        out[b * QK + e] = q8_at(qs, nb, r, b, e) as f32 * s;
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

/// `out[t * w.n + o] = dot(x[t], w[o])` for `rows` activation rows.
///
/// `x` is row-major `rows x w.k`; `xq` must hold the same rows quantized
/// when `w.wants_quantized_acts()`. Runs on `pool`.
pub fn matmul(pool: &Pool, x: &[f32], xq: &QuantizedActs, rows: usize, w: &QMatrix, out: &mut [f32]) {
    matmul_many(pool, x, xq, rows, &mut [(w, out)]);
}

/// Several products of the same activations (the query, key and value
/// projections; gate and up), in one parallel dispatch. One task is one
/// panel of [`PANEL`] weight rows against every activation row.
pub fn matmul_many(pool: &Pool, x: &[f32], xq: &QuantizedActs, rows: usize, outs: &mut [(&QMatrix, &mut [f32])]) {
    let mut jobs: Vec<(&QMatrix, SendPtr<f32>, usize)> = Vec::new();
    for (w, out) in outs.iter_mut() {
        assert!(out.len() >= rows * w.n, "matmul output too small");
        assert!(x.len() >= rows * w.k || w.wants_quantized_acts());
        if w.wants_quantized_acts() {
            assert!(xq.rows >= rows && xq.k == w.k, "activations not quantized for this matrix");
        }
        let ptr = SendPtr(out.as_mut_ptr());
        for panel in 0..w.n.div_ceil(PANEL) {
            jobs.push((*w, ptr, panel));
        }
    }
    pool.run(jobs.len(), &|j| {
        let (w, p, panel) = jobs[j];
        // SAFETY (every arm): the task writes only (t, o) for o in this
        // panel's rows below `n`, which no other task writes; `out` holds
        // rows * n elements (asserted above); the ISA is checked.
        match (&w.kind, isa()) {
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q4 { qs, d, m }, Isa::Avx512Vnni) => unsafe { simd::q4_panel_512(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q4 { qs, d, m }, Isa::Avx2) => unsafe { simd::q4_panel_avx2(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q8 { qs, d }, Isa::Avx512Vnni) => unsafe { simd::q8_panel_512(qs, d, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q8 { qs, d }, Isa::Avx2) => unsafe { simd::q8_panel_avx2(qs, d, w.k, xq, rows, panel, p.0, w.n) },
            _ => {
                for t in 0..rows {
                    for o in panel * PANEL..((panel + 1) * PANEL).min(w.n) {
                        let v = dot(w, o, x, xq, t);
                        unsafe { *p.0.add(t * w.n + o) = v };
                    }
                }
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
        // On SIMD machines the quantized formats always run as panels
        // (`matmul_many`); this is the portable path, bit-identical to them.
        Prepared::Q4 { qs, d, m } => scalar::dot_q4(qs, d, m, nb, o, xq.row_q(t), xq.row_d(t), xq.row_s(t)),
        Prepared::Q8 { qs, d } => scalar::dot_q8(qs, d, nb, o, xq.row_q(t), xq.row_d(t)),
    }
}

/// The fixed lane-reduction order shared by every path.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Portable reference kernels: the arithmetic every SIMD path reproduces.
pub(crate) mod scalar {
    use super::{block_at, hsum8, q4_at, q8_at, QK};

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] = ca[l].mul_add(cb[l], acc[l]);
            }
        }
        hsum8(acc)
    }

    /// The Q4 arithmetic of row `o`: per block, the exact integer dot
    /// product of the quants with the activation bytes, then, in block
    /// order, `acc = isum * (d * dx) + acc` and `acc = m * s + acc` (fused),
    /// `s` being the activation block's `dx * sum(x)`.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_q4(qs: &[u8], d: &[u16], m: &[u16], nb: usize, o: usize, xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let mut acc = 0f32;
        for b in 0..nb {
            let isum: i32 = (0..QK).map(|e| q4_at(qs, nb, o, b, e) as i32 * xq[b * QK + e] as i32).sum();
            acc = (isum as f32).mul_add(block_at(d, nb, o, b) * xd[b], acc);
            acc = block_at(m, nb, o, b).mul_add(xs[b], acc);
        }
        acc
    }

    /// The Q8_0 arithmetic of row `o`: as `dot_q4`'s, without the offset.
    pub fn dot_q8(qs: &[u8], d: &[u16], nb: usize, o: usize, xq: &[i8], xd: &[f32]) -> f32 {
        let mut acc = 0f32;
        for b in 0..nb {
            let isum: i32 = (0..QK).map(|e| q8_at(qs, nb, o, b, e) as i32 * xq[b * QK + e] as i32).sum();
            acc = (isum as f32).mul_add(block_at(d, nb, o, b) * xd[b], acc);
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{PANEL, PREFETCH_BLOCKS, Q4_PANEL_BLOCK, Q8_PANEL_BLOCK, QK};
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

    /// Walks the activation rows in groups of up to `N` (the length of the
    /// list, which must be `1..=N`), calling the tile for each group with
    /// the group's size as its const parameter and `$t` its first row.
    macro_rules! column_groups {
        ($rows:expr, [$($c:literal),+], |$t:ident| $tile:ident $args:tt) => {{
            const MAX: usize = [$($c),+].len();
            let mut $t = 0;
            while $t < $rows {
                let c = ($rows - $t).min(MAX);
                match c {
                    $($c => $tile::<$c> $args,)+
                    _ => unreachable!(),
                }
                $t += c;
            }
        }};
    }

    /// Pointers to the quantized activation rows `t..t+C`: bytes, block
    /// scales `dx`, block sums `dx * sum(x)` and integer sums `sum(x)`.
    struct Columns<const C: usize> {
        q: [*const i8; C],
        d: [*const f32; C],
        s: [*const f32; C],
        sq: [*const i32; C],
    }

    impl<const C: usize> Columns<C> {
        #[inline(always)]
        fn new(xq: &QuantizedActs, t: usize) -> Self {
            Columns {
                q: std::array::from_fn(|c| xq.row_q(t + c).as_ptr()),
                d: std::array::from_fn(|c| xq.row_d(t + c).as_ptr()),
                s: std::array::from_fn(|c| xq.row_s(t + c).as_ptr()),
                sq: std::array::from_fn(|c| xq.row_sq(t + c).as_ptr()),
            }
        }

        /// Block `b` of column `c`'s bytes, as eight groups of four (each
        /// to broadcast as one 32-bit value).
        #[inline(always)]
        unsafe fn quads(&self, c: usize, b: usize) -> *const i32 {
            self.q[c].add(b * QK) as *const i32
        }
    }

    /// Rows of this panel below `n`.
    #[inline(always)]
    fn live_rows(p: usize, n: usize) -> usize {
        (n - p * PANEL).min(PANEL)
    }

    /// Integer dot products of 16 rows' 32 weights (`w[q]`: four weights of
    /// each row, 0 <= w < 256) with one activation block (`x`: its eight
    /// groups of four bytes). With few columns in flight one chain of eight
    /// dependent instructions would stall on latency, so it runs as two.
    #[inline(always)]
    unsafe fn block_dots<const C: usize>(w: &[__m512i; 8], x: *const i32) -> __m512i {
        if C < 4 {
            let (mut a, mut b) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for q in 0..4 {
                a = _mm512_dpbusd_epi32(a, w[q], _mm512_set1_epi32(x.add(q).read_unaligned()));
                b = _mm512_dpbusd_epi32(b, w[q + 4], _mm512_set1_epi32(x.add(q + 4).read_unaligned()));
            }
            _mm512_add_epi32(a, b)
        } else {
            let mut a = _mm512_setzero_si512();
            for q in 0..8 {
                a = _mm512_dpbusd_epi32(a, w[q], _mm512_set1_epi32(x.add(q).read_unaligned()));
            }
            a
        }
    }

    /// The hardware prefetcher stops at page boundaries and ramps up too
    /// slowly for a panel's short streams (quants and two scale arrays), so
    /// the tiles fetch the block `PREFETCH_BLOCKS` ahead themselves. With
    /// eight columns the first pass over a panel stalled on these loads
    /// too: prefetching in every tile took batch-32 decode from 396 / 399 /
    /// 397 to 442 / 404 / 480 tok/s (alternating runs). Prefetches never
    /// fault, so past the matrix's end they are harmless.
    #[inline(always)]
    unsafe fn prefetch_ahead(quants: *const u8, block_bytes: usize, scales: &[*const u16]) {
        let q = quants.wrapping_add(PREFETCH_BLOCKS * block_bytes);
        for line in 0..block_bytes / 64 {
            _mm_prefetch(q.wrapping_add(line * 64) as *const i8, _MM_HINT_T0);
        }
        for s in scales {
            _mm_prefetch(s.wrapping_add(PREFETCH_BLOCKS * PANEL) as *const i8, _MM_HINT_T0);
        }
    }

    /// Stores the 16 lanes of `v` (panel `p`'s rows) into output row `t`,
    /// leaving out rows past `n`.
    #[inline(always)]
    unsafe fn store512(v: __m512, out: *mut f32, n: usize, p: usize, t: usize) {
        let live = live_rows(p, n);
        let mask: __mmask16 = if live == PANEL { !0 } else { (1u16 << live) - 1 };
        _mm512_mask_storeu_ps(out.add(t * n + p * PANEL), mask, v);
    }

    /// Panel `p` of a Q4 matrix against activation rows `t..t+C`
    /// (AVX-512 VNNI): the nibbles of a panel block are unpacked once and
    /// serve every column.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_tile512<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t);
        let low = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let pb = p * nb + b;
            let wp = qs.as_ptr().add(pb * Q4_PANEL_BLOCK);
            prefetch_ahead(wp, Q4_PANEL_BLOCK, &[d.as_ptr().wrapping_add(pb * PANEL), m.as_ptr().wrapping_add(pb * PANEL)]);
            let mut w = [_mm512_setzero_si512(); 8];
            for j in 0..4 {
                let v = _mm512_loadu_si512(wp.add(j * 64) as *const _);
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(pb * PANEL) as *const __m256i));
            let mv = _mm512_cvtph_ps(_mm256_loadu_si256(m.as_ptr().add(pb * PANEL) as *const __m256i));
            for c in 0..C {
                let s = block_dots::<C>(&w, cols.quads(c, b));
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*cols.d[c].add(b)));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[c]);
                acc[c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(*cols.s[c].add(b)), acc[c]);
            }
        }
        for c in 0..C {
            store512(acc[c], out, n, p, t + c);
        }
    }

    /// Panel `p` of a Q8_0 matrix against activation rows `t..t+C`
    /// (AVX-512 VNNI). The weights are stored as `w + 128`, so the integer
    /// sums carry `128 * sum(x)`, taken off exactly before conversion.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_tile512<const C: usize>(qs: &[u8], d: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t);
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let pb = p * nb + b;
            let wp = qs.as_ptr().add(pb * Q8_PANEL_BLOCK);
            prefetch_ahead(wp, Q8_PANEL_BLOCK, &[d.as_ptr().wrapping_add(pb * PANEL)]);
            let mut w = [_mm512_setzero_si512(); 8];
            for (q, wq) in w.iter_mut().enumerate() {
                *wq = _mm512_loadu_si512(wp.add(q * 64) as *const _);
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(pb * PANEL) as *const __m256i));
            for c in 0..C {
                let s = block_dots::<C>(&w, cols.quads(c, b));
                let s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * *cols.sq[c].add(b)));
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*cols.d[c].add(b)));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[c]);
            }
        }
        for c in 0..C {
            store512(acc[c], out, n, p, t + c);
        }
    }

    /// AVX-512 has 32 registers: eight weight registers, eight columns'
    /// accumulators and their integer sums fit.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q4_panel_512(qs: &[u8], d: &[u16], m: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        column_groups!(rows, [1, 2, 3, 4, 5, 6, 7, 8], |t| q4_tile512(qs, d, m, k / QK, xq, p, out, n, t));
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q8_panel_512(qs: &[u8], d: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        column_groups!(rows, [1, 2, 3, 4, 5, 6, 7, 8], |t| q8_tile512(qs, d, k / QK, xq, p, out, n, t));
    }

    /// Stores the 8 lanes of `v` (rows `8h..8h+8` of panel `p`) into output
    /// row `t`, leaving out rows past `n`.
    #[inline(always)]
    unsafe fn store256(v: __m256, out: *mut f32, n: usize, p: usize, h: usize, t: usize) {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        let live = live_rows(p, n).saturating_sub(h * 8).min(8);
        std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(t * n + p * PANEL + h * 8), live);
    }

    /// Panel `p` of a Q4 matrix against activation rows `t..t+C` (AVX2),
    /// one half panel (8 rows) at a time. `maddubs` adds pairs of products
    /// (at most 2 * 15 * 127 in magnitude), so eight of them still fit 16
    /// bits before one widening to 32.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4_tile_avx2<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t);
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        for h in 0..2 {
            if h * 8 >= live_rows(p, n) {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); C];
            for b in 0..nb {
                let pb = p * nb + b;
                let wp = qs.as_ptr().add(pb * Q4_PANEL_BLOCK + h * 32);
                let mut w = [_mm256_setzero_si256(); 8];
                for j in 0..4 {
                    let v = _mm256_loadu_si256(wp.add(j * 64) as *const __m256i);
                    w[j] = _mm256_and_si256(v, low);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                let mv = _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                for c in 0..C {
                    let mut s16 = _mm256_setzero_si256();
                    for q in 0..8 {
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(cols.quads(c, b).add(q).read_unaligned())));
                    }
                    let s = _mm256_madd_epi16(s16, ones);
                    let scale = _mm256_mul_ps(dv, _mm256_set1_ps(*cols.d[c].add(b)));
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[c]);
                    acc[c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(*cols.s[c].add(b)), acc[c]);
                }
            }
            for c in 0..C {
                store256(acc[c], out, n, p, h, t + c);
            }
        }
    }

    /// Panel `p` of a Q8_0 matrix against activation rows `t..t+C` (AVX2):
    /// `|w| * (x * sign(w))` keeps the unsigned operand of `maddubs` below
    /// 129, so each pair sum fits 16 bits.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q8_tile_avx2<const C: usize>(qs: &[u8], d: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t);
        let bias = _mm256_set1_epi8(0x80u8 as i8);
        let ones = _mm256_set1_epi16(1);
        for h in 0..2 {
            if h * 8 >= live_rows(p, n) {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); C];
            for b in 0..nb {
                let pb = p * nb + b;
                let wp = qs.as_ptr().add(pb * Q8_PANEL_BLOCK + h * 32);
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                let mut s = [_mm256_setzero_si256(); C];
                for q in 0..8 {
                    let w = _mm256_xor_si256(_mm256_loadu_si256(wp.add(q * 64) as *const __m256i), bias);
                    let aw = _mm256_abs_epi8(w);
                    for c in 0..C {
                        let sx = _mm256_sign_epi8(_mm256_set1_epi32(cols.quads(c, b).add(q).read_unaligned()), w);
                        s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                    }
                }
                for c in 0..C {
                    let scale = _mm256_mul_ps(dv, _mm256_set1_ps(*cols.d[c].add(b)));
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), scale, acc[c]);
                }
            }
            for c in 0..C {
                store256(acc[c], out, n, p, h, t + c);
            }
        }
    }

    /// AVX2 has 16 vector registers: eight hold the unpacked weights, so
    /// at most four columns.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_panel_avx2(qs: &[u8], d: &[u16], m: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        column_groups!(rows, [1, 2, 3, 4], |t| q4_tile_avx2(qs, d, m, k / QK, xq, p, out, n, t));
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_panel_avx2(qs: &[u8], d: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        column_groups!(rows, [1, 2, 3, 4], |t| q8_tile_avx2(qs, d, k / QK, xq, p, out, n, t));
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

    /// Every column-group size of both SIMD paths (AVX2 and AVX-512), over
    /// ragged panels (n not a multiple of 16) and row counts, equals the
    /// scalar reference bit for bit.
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
                    for rows in [1, 2, 3, 4, 5, 7, 9, 17] {
                        let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed) * 3.0).collect();
                        let mut xq = QuantizedActs::default();
                        xq.quantize(&Pool::new(1).unwrap(), &x, rows, k);
                        let mut want = vec![0f32; rows * n];
                        for t in 0..rows {
                            for o in 0..n {
                                want[t * n + o] = match &w.kind {
                                    Prepared::Q4 { qs, d, m } => scalar::dot_q4(qs, d, m, nb, o, xq.row_q(t), xq.row_d(t), xq.row_s(t)),
                                    Prepared::Q8 { qs, d } => scalar::dot_q8(qs, d, nb, o, xq.row_q(t), xq.row_d(t)),
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
                            // A sentinel shows a store past the panel's live rows.
                            let mut got = vec![f32::NAN; rows * n];
                            for p in 0..n.div_ceil(PANEL) {
                                // SAFETY: the ISA checks above; `got` holds rows * n.
                                unsafe {
                                    match (&w.kind, vnni) {
                                        (Prepared::Q4 { qs, d, m }, true) => simd::q4_panel_512(qs, d, m, k, &xq, rows, p, got.as_mut_ptr(), n),
                                        (Prepared::Q4 { qs, d, m }, false) => simd::q4_panel_avx2(qs, d, m, k, &xq, rows, p, got.as_mut_ptr(), n),
                                        (Prepared::Q8 { qs, d }, true) => simd::q8_panel_512(qs, d, k, &xq, rows, p, got.as_mut_ptr(), n),
                                        (Prepared::Q8 { qs, d }, false) => simd::q8_panel_avx2(qs, d, k, &xq, rows, p, got.as_mut_ptr(), n),
                                        (Prepared::F32(_), _) => unreachable!(),
                                    }
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

    /// Q8_0 weights of -128 (outside GGML's own range, but a file may hold
    /// them) and 127 against extreme activations: the offset and sign
    /// tricks of the SIMD paths stay exact.
    #[test]
    fn q8_extremes_are_exact() {
        let (n, k) = (16, 64);
        let mut bytes = Vec::new();
        for r in 0..n {
            for b in 0..k / QK {
                bytes.extend_from_slice(&f16::from_f32(0.5 + r as f32 + b as f32).to_bits().to_le_bytes());
                bytes.extend((0..QK).map(|e| if (e + r) % 3 == 0 { 0x80u8 } else if e % 2 == 0 { 127 } else { 0 }));
            }
        }
        let w = QMatrix::from_ggml(WeightFormat::Q8_0, n, k, &bytes).unwrap();
        let x: Vec<f32> = (0..2 * k).map(|i| if i % 5 == 0 { -1.0 } else { 1.0 }).collect();
        let got = run(&w, &x, 2);
        let mut xq = QuantizedActs::default();
        xq.quantize(&Pool::new(1).unwrap(), &x, 2, k);
        for t in 0..2 {
            for o in 0..n {
                let want = match &w.kind {
                    Prepared::Q8 { qs, d } => scalar::dot_q8(qs, d, k / QK, o, xq.row_q(t), xq.row_d(t)),
                    _ => unreachable!(),
                };
                assert_eq!(got[t * n + o].to_bits(), want.to_bits(), "t={t} o={o}");
                let mut row = vec![0f32; k];
                w.row_f32(o, &mut row);
                let exact: f32 = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(a, b)| a * b).sum();
                assert!((want - exact).abs() <= 1e-3 * exact.abs().max(1.0), "{want} vs {exact}");
            }
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(matches!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 64, &[0u8; 10]), Err(MatrixError::Size { .. })));
        assert_eq!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 40, &[0u8; 10]).err(), Some(MatrixError::RowLength { k: 40 }));
        // A Q4_0 scale whose offset (-8 x scale) has no f16 value.
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16::from_f32(10000.0).to_bits().to_le_bytes());
        let err = QMatrix::from_ggml(WeightFormat::Q4_0, 1, 32, &block).err().expect("must fail");
        assert!(matches!(err, MatrixError::ScaleRange { row: 0, block: 0, .. }), "{err}");
    }
}
