//! Weight block formats (GGML's float, legacy 32-wide, K super-block and
//! IQ4 formats) and the 8-bit quantization of activations used by the
//! integer dot products: 32-wide blocks for the legacy formats, 256-wide
//! Q8_K blocks with per-16 sums for the K formats.
//!
//! Invariant: every quantized dot product in this crate reduces to the same
//! arithmetic, independent of batch size and of the instruction set: per
//! block (32 elements, or a 256-element super-block whose integer
//! sub-block scales and mins enter the integer sums) exact integer sums,
//! then f32 fused multiply-adds in block order. Integer sums are exact in
//! any order, so the portable, AVX2 and AVX-512 paths compute bit-identical
//! results (`matmul` and `matmul::kquant` say how).

use half::{bf16, f16};
use crate::blocks::{self, QK_K};
use crate::pool::SendPtr;

/// Elements per legacy quantization block (and per activation block of
/// the legacy formats' products).
pub const QK: usize = 32;

/// Storage format of a weight matrix row: GGML's block layouts, read
/// exactly as ggml-common.h declares them.
#[allow(non_camel_case_types)] // GGML's names, as files and tools spell them
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ4_NL,
    IQ4_XS,
}

impl WeightFormat {
    /// Every format, for tests and tools.
    pub const ALL: [WeightFormat; 16] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
        WeightFormat::Q8_K,
        WeightFormat::IQ4_NL,
        WeightFormat::IQ4_XS,
    ];

    /// The formats with an integer dot-product kernel on every ISA path; the others
    /// (F32, F16, BF16, Q8_K, IQ4_XS) are dequantized to f32 when a matrix is prepared
    /// (`matmul` says why). Tests and benchmarks of the integer kernels run over these.
    pub const INTEGER_KERNEL: [WeightFormat; 11] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::IQ4_NL,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ];

    /// Elements per block.
    pub fn block_len(self) -> usize {
        use WeightFormat::*;
        match self {
            F32 | F16 | BF16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL => QK,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ4_XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use WeightFormat::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => blocks::Q5_0_BYTES,
            Q5_1 => blocks::Q5_1_BYTES,
            Q8_0 => 34,
            Q2_K => blocks::Q2_K_BYTES,
            Q3_K => blocks::Q3_K_BYTES,
            Q4_K => blocks::Q4_K_BYTES,
            Q5_K => blocks::Q5_K_BYTES,
            Q6_K => blocks::Q6_K_BYTES,
            Q8_K => blocks::Q8_K_BYTES,
            IQ4_NL => blocks::IQ4_NL_BYTES,
            IQ4_XS => blocks::IQ4_XS_BYTES,
        }
    }

    /// Bytes of one row of `k` elements, or `None` when `k` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        let bl = self.block_len();
        k.is_multiple_of(bl).then(|| k / bl * self.block_bytes())
    }

    /// GGML's name of the format.
    pub fn name(self) -> &'static str {
        use WeightFormat::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ4_NL => "IQ4_NL",
            IQ4_XS => "IQ4_XS",
        }
    }

    /// Whether the format is one of the 256-element super-block formats.
    pub fn is_super_block(self) -> bool {
        self.block_len() == QK_K
    }
}

#[inline]
fn read_f16(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Dequantizes one row of `k` elements stored in `format` into `out`.
/// `row` must hold exactly `format.row_bytes(k)` bytes.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    match format {
        WeightFormat::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = read_f16(c);
            }
        }
        WeightFormat::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        WeightFormat::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = read_f16(&b[0..2]);
                for j in 0..16 {
                    o[j] = ((b[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let d = read_f16(&b[0..2]);
                let m = read_f16(&b[2..4]);
                for j in 0..16 {
                    o[j] = (b[4 + j] & 0x0f) as f32 * d + m;
                    o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        WeightFormat::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(34)) {
                let d = read_f16(&b[0..2]);
                for j in 0..QK {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        other => {
            let per_block: fn(&[u8], &mut [f32]) = match other {
                WeightFormat::Q5_0 => blocks::dequantize_q5_0,
                WeightFormat::Q5_1 => blocks::dequantize_q5_1,
                WeightFormat::IQ4_NL => blocks::dequantize_iq4_nl,
                WeightFormat::Q2_K => blocks::dequantize_q2_k,
                WeightFormat::Q3_K => blocks::dequantize_q3_k,
                WeightFormat::Q4_K => blocks::dequantize_q4_k,
                WeightFormat::Q5_K => blocks::dequantize_q5_k,
                WeightFormat::Q6_K => blocks::dequantize_q6_k,
                WeightFormat::Q8_K => blocks::dequantize_q8_k,
                WeightFormat::IQ4_XS => blocks::dequantize_iq4_xs,
                _ => unreachable!("handled above"),
            };
            for (o, b) in out.chunks_exact_mut(other.block_len()).zip(row.chunks_exact(other.block_bytes())) {
                per_block(b, o);
            }
        }
    }
}

/// Quantizes a row of f32 into Q4_1 blocks (used by tests and tools that
/// write small models; not on the serving path).
pub fn quantize_row_q4_1(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let (mut lo, mut hi) = (f32::MAX, f32::MIN);
        for &v in blk {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        let d = (hi - lo) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        out.extend_from_slice(&f16::from_f32(lo).to_bits().to_le_bytes());
        for j in 0..16 {
            let q0 = (((blk[j] - lo) * id + 0.5) as u8).min(15);
            let q1 = (((blk[j + 16] - lo) * id + 0.5) as u8).min(15);
            out.push(q0 | (q1 << 4));
        }
    }
}

/// Quantizes a row of f32 into Q8_0 blocks (tests and tools).
pub fn quantize_row_q8_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for &v in blk {
            out.push((v * id).round().clamp(-127.0, 127.0) as i8 as u8);
        }
    }
}

/// Quantizes a row of f32 into Q4_0 blocks (tests and tools).
pub fn quantize_row_q4_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let mut max = 0f32;
        for &v in blk {
            if v.abs() > max.abs() {
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for j in 0..16 {
            let q0 = ((blk[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let q1 = ((blk[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
}

/// A batch of activation rows quantized to 8 bits per 32-element block.
///
/// Per block: `q` (32 signed bytes in [-127, 127]), the scale `d`,
/// `s = d * sum(q)` (the block sum, used by the formats with an offset) and
/// `sq = sum(q)` exactly (the Q8_0 tiles take `128 * sq` off their sums).
#[derive(Default)]
pub struct QuantizedActs {
    pub rows: usize,
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub sq: Vec<i32>,
    /// The same rows as Q8_K, for the K formats (filled by
    /// [`Q8KActs::quantize`] when a product needs it).
    pub q8k: Q8KActs,
}

impl QuantizedActs {
    /// Quantizes `rows` rows of `k` elements (`k` a multiple of 32).
    pub fn quantize(&mut self, pool: &crate::pool::Pool, x: &[f32], rows: usize, k: usize) {
        debug_assert_eq!(k % QK, 0);
        let nb = k / QK;
        self.rows = rows;
        self.k = k;
        self.q.resize(rows * k, 0);
        self.d.resize(rows * nb, 0.0);
        self.s.resize(rows * nb, 0.0);
        self.sq.resize(rows * nb, 0);
        let x = &x[..rows * k];
        let (qp, dp, sp, sqp) =
            (SendPtr(self.q.as_mut_ptr()), SendPtr(self.d.as_mut_ptr()), SendPtr(self.s.as_mut_ptr()), SendPtr(self.sq.as_mut_ptr()));
        const ROWS: usize = 4;
        pool.run(rows.div_ceil(ROWS), &|task| {
            let (r0, r1) = (task * ROWS, (task * ROWS + ROWS).min(rows));
            let (qp, dp, sp, sqp) = (qp, dp, sp, sqp);
            // SAFETY: tasks cover disjoint rows of buffers sized above.
            let (qr, dr, sr, sqr) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qp.0.add(r0 * k), (r1 - r0) * k),
                    std::slice::from_raw_parts_mut(dp.0.add(r0 * nb), (r1 - r0) * nb),
                    std::slice::from_raw_parts_mut(sp.0.add(r0 * nb), (r1 - r0) * nb),
                    std::slice::from_raw_parts_mut(sqp.0.add(r0 * nb), (r1 - r0) * nb),
                )
            };
            let xr = &x[r0 * k..r1 * k];
            #[cfg(target_arch = "x86_64")]
            if crate::matmul::isa() != crate::matmul::Isa::Scalar {
                // SAFETY: the ISA check above guarantees AVX2, FMA and F16C.
                return unsafe { quantize_rows_avx2(xr, qr, dr, sr, sqr) };
            }
            quantize_rows(xr, qr, dr, sr, sqr)
        });
    }

    #[inline]
    pub fn row_q(&self, r: usize) -> &[i8] {
        &self.q[r * self.k..(r + 1) * self.k]
    }

    #[inline]
    pub fn row_d(&self, r: usize) -> &[f32] {
        let nb = self.k / QK;
        &self.d[r * nb..(r + 1) * nb]
    }

    #[inline]
    pub fn row_s(&self, r: usize) -> &[f32] {
        let nb = self.k / QK;
        &self.s[r * nb..(r + 1) * nb]
    }

    #[inline]
    pub fn row_sq(&self, r: usize) -> &[i32] {
        let nb = self.k / QK;
        &self.sq[r * nb..(r + 1) * nb]
    }
}

/// A batch of activation rows quantized to GGML's Q8_K: per 256-element
/// super-block 256 signed bytes in [-127, 127] (`q`), the f32 scale `d`
/// (`max|x| / 127`, not rounded to f16), and exact sums of the bytes per
/// 16 (`bsum16`, 16 a block) and per 32 (`bsum32`, 8 a block): the K
/// formats' min terms multiply them by their per-sub-block mins.
#[derive(Default)]
pub struct Q8KActs {
    pub rows: usize,
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub bsum16: Vec<i16>,
    pub bsum32: Vec<i16>,
}

impl Q8KActs {
    /// Quantizes `rows` rows of `k` elements (`k` a multiple of 256).
    pub fn quantize(&mut self, pool: &crate::pool::Pool, x: &[f32], rows: usize, k: usize) {
        debug_assert_eq!(k % QK_K, 0);
        let nb = k / QK_K;
        self.rows = rows;
        self.k = k;
        self.q.resize(rows * k, 0);
        self.d.resize(rows * nb, 0.0);
        self.bsum16.resize(rows * nb * 16, 0);
        self.bsum32.resize(rows * nb * 8, 0);
        let x = &x[..rows * k];
        let ptrs = (SendPtr(self.q.as_mut_ptr()), SendPtr(self.d.as_mut_ptr()), SendPtr(self.bsum16.as_mut_ptr()), SendPtr(self.bsum32.as_mut_ptr()));
        pool.run(rows, &|r| {
            let (qp, dp, b16, b32) = ptrs;
            // SAFETY: each task writes row `r` of buffers sized above.
            let (q, d, s16, s32) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qp.0.add(r * k), k),
                    std::slice::from_raw_parts_mut(dp.0.add(r * nb), nb),
                    std::slice::from_raw_parts_mut(b16.0.add(r * nb * 16), nb * 16),
                    std::slice::from_raw_parts_mut(b32.0.add(r * nb * 8), nb * 8),
                )
            };
            let xr = &x[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            if crate::matmul::isa() != crate::matmul::Isa::Scalar {
                // SAFETY: the ISA check above guarantees AVX2 and FMA.
                return unsafe { quantize_q8k_rows_avx2(xr, q, d, s16, s32) };
            }
            quantize_q8k_rows(xr, q, d, s16, s32)
        });
    }

    #[inline]
    pub fn row_q(&self, r: usize) -> &[i8] {
        &self.q[r * self.k..(r + 1) * self.k]
    }

    #[inline]
    pub fn row_d(&self, r: usize) -> &[f32] {
        let nb = self.k / QK_K;
        &self.d[r * nb..(r + 1) * nb]
    }

    #[inline]
    pub fn row_bsum16(&self, r: usize) -> &[i16] {
        let n = self.k / QK_K * 16;
        &self.bsum16[r * n..(r + 1) * n]
    }

    #[inline]
    pub fn row_bsum32(&self, r: usize) -> &[i16] {
        let n = self.k / QK_K * 8;
        &self.bsum32[r * n..(r + 1) * n]
    }
}

/// Q8_K quantization of whole super-blocks: the operations of
/// [`quantize_rows`] (one multiply by `1 / d`, rounding to nearest even,
/// clamping), which are exact IEEE operations and so give the same bits
/// whether the compiler vectorizes them or not.
#[inline(always)]
fn quantize_q8k_rows(x: &[f32], q: &mut [i8], d: &mut [f32], bsum16: &mut [i16], bsum32: &mut [i16]) {
    for (b, blk) in x.chunks_exact(QK_K).enumerate() {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let qb = &mut q[b * QK_K..(b + 1) * QK_K];
        for (o, &v) in qb.iter_mut().zip(blk) {
            *o = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        for (j, sub) in qb.chunks_exact(16).enumerate() {
            bsum16[b * 16 + j] = sub.iter().map(|&v| v as i16).sum();
        }
        for j in 0..8 {
            bsum32[b * 8 + j] = bsum16[b * 16 + 2 * j] + bsum16[b * 16 + 2 * j + 1];
        }
        d[b] = scale;
    }
}

/// [`quantize_q8k_rows`] compiled for AVX2 (vector rounding instead of a
/// library call per element); the same operations, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8k_rows_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], bsum16: &mut [i16], bsum32: &mut [i16]) {
    quantize_q8k_rows(x, q, d, bsum16, bsum32)
}

/// 8-bit quantization of whole blocks: `q = round(x / d)` with
/// `d = max|x| / 127`, ties to even; `d` and `d * sum(q)` kept at f16
/// precision, as GGML's activation blocks store them.
#[inline(always)]
fn quantize_rows(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], sq: &mut [i32]) {
    for (b, blk) in x.chunks_exact(QK).enumerate() {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let mut sum = 0i32;
        for (j, &v) in blk.iter().enumerate() {
            let qv = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
            q[b * QK + j] = qv;
            sum += qv as i32;
        }
        d[b] = f16::from_f32(scale).to_f32();
        s[b] = f16::from_f32(scale * sum as f32).to_f32();
        sq[b] = sum;
    }
}

/// [`quantize_rows`] in AVX2: the same operations per element (max of
/// absolute values, one multiply by `1 / d`, rounding to nearest even,
/// clamping), so the results are bit-identical for finite inputs (tested).
/// The compiler left the scalar loop mostly scalar: at batch 32 it took 9% of
/// decode time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_rows_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], sq: &mut [i32]) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // packs_epi32 then packs_epi16 interleave 4-byte groups across the two
    // 128-bit lanes; this puts them back in element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, blk) in x.chunks_exact(QK).enumerate() {
        let p = blk.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        let scale = amax / 127.0;
        let id = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let qi = v.map(|vi| {
            let r = _mm256_round_ps(_mm256_mul_ps(vi, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let sum8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        let sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        let sum2 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0b01_00_11_10));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 0b00_00_00_01)));
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256(q.as_mut_ptr().add(b * QK) as *mut __m256i, _mm256_permutevar8x32_epi32(bytes, order));
        d[b] = f16::from_f32(scale).to_f32();
        s[b] = f16::from_f32(scale * sum as f32).to_f32();
        sq[b] = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_round_trip_is_close() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 17) as f32 - 8.0) / 3.0).collect();
        let mut b = Vec::new();
        quantize_row_q4_1(&x, &mut b);
        assert_eq!(b.len(), WeightFormat::Q4_1.row_bytes(64).unwrap());
        let mut y = vec![0.0; 64];
        dequantize_row(WeightFormat::Q4_1, &b, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 0.3, "{a} vs {b}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_activation_quantization_is_bit_identical() {
        if crate::matmul::isa() == crate::matmul::Isa::Scalar {
            eprintln!("SKIPPED: no AVX2 on this machine");
            return;
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut x: Vec<f32> = (0..QK * 64).map(|_| next() * 3.0).collect();
        // A zero block, a block of exact ties (k + 0.5 steps of d = 1) and
        // one with a single large outlier.
        x[..QK].fill(0.0);
        for (j, v) in x[QK..2 * QK].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { (j as f32 - 16.0) + 0.5 };
        }
        x[2 * QK + 5] = 1e6;
        let nb = x.len() / QK;
        let (mut q1, mut d1, mut s1) = (vec![0i8; x.len()], vec![0f32; nb], vec![0f32; nb]);
        let (mut q2, mut d2, mut s2) = (q1.clone(), d1.clone(), s1.clone());
        let (mut sq1, mut sq2) = (vec![0i32; nb], vec![0i32; nb]);
        quantize_rows(&x, &mut q1, &mut d1, &mut s1, &mut sq1);
        // SAFETY: the ISA check above guarantees AVX2, FMA and F16C.
        unsafe { quantize_rows_avx2(&x, &mut q2, &mut d2, &mut s2, &mut sq2) };
        assert_eq!(q1, q2);
        assert_eq!(sq1, sq2);
        let sums: Vec<i32> = q1.chunks_exact(QK).map(|b| b.iter().map(|&v| v as i32).sum()).collect();
        assert_eq!(sq1, sums);
        assert_eq!(d1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), d2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert_eq!(s1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), s2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert!(q1[QK..2 * QK].iter().any(|&v| v % 2 != 0), "the tie block quantizes to mixed parities");
    }

    /// Q8_K: the AVX2 build of the quantizer gives the same bits as the
    /// portable one; `d` is max|x| / 127 in f32; the sums are exact.
    #[test]
    fn q8_k_activations() {
        let mut seed = 9u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut x: Vec<f32> = (0..QK_K * 6).map(|_| next() * 5.0).collect();
        // A zero block, a block of exact ties, one with a single outlier.
        x[..QK_K].fill(0.0);
        for (j, v) in x[QK_K..2 * QK_K].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { (j % 200) as f32 - 100.5 };
        }
        x[2 * QK_K + 77] = -1e5;
        let nb = x.len() / QK_K;
        let mut a = (vec![0i8; x.len()], vec![0f32; nb], vec![0i16; nb * 16], vec![0i16; nb * 8]);
        let mut b = (vec![0i8; x.len()], vec![0f32; nb], vec![0i16; nb * 16], vec![0i16; nb * 8]);
        quantize_q8k_rows(&x, &mut a.0, &mut a.1, &mut a.2, &mut a.3);
        #[cfg(target_arch = "x86_64")]
        if crate::matmul::isa() != crate::matmul::Isa::Scalar {
            // SAFETY: the ISA check guarantees AVX2 and FMA.
            unsafe { quantize_q8k_rows_avx2(&x, &mut b.0, &mut b.1, &mut b.2, &mut b.3) };
            assert_eq!(a.0, b.0);
            assert_eq!(a.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            assert_eq!((&a.2, &a.3), (&b.2, &b.3));
        }
        assert!(a.0[..QK_K].iter().all(|&q| q == 0) && a.1[0] == 0.0);
        assert_eq!(a.1[1], 127.0 / 127.0);
        assert_eq!(a.0[QK_K + 1], -100, "-99.5 rounds to the even -100");
        assert_eq!(a.0[QK_K + 2], -98, "-98.5 rounds to the even -98");
        assert_eq!(a.0[2 * QK_K + 77], -127);
        for blk in 0..nb {
            let q = &a.0[blk * QK_K..(blk + 1) * QK_K];
            for j in 0..16 {
                assert_eq!(a.2[blk * 16 + j], q[16 * j..16 * j + 16].iter().map(|&v| v as i16).sum::<i16>());
            }
            for j in 0..8 {
                assert_eq!(a.3[blk * 8 + j], q[32 * j..32 * j + 32].iter().map(|&v| v as i16).sum::<i16>());
            }
            let amax = x[blk * QK_K..(blk + 1) * QK_K].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(a.1[blk], amax / 127.0);
        }
    }

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(WeightFormat::Q4_1.row_bytes(33), None);
        assert_eq!(WeightFormat::F16.row_bytes(33), Some(66));
    }
}
