//! Weight block formats (GGML's Q4_0, Q4_1, Q8_0, F16, BF16, F32) and the
//! 8-bit quantization of activations used by the integer dot products.
//!
//! Invariant: every quantized dot product in this crate reduces to the same
//! arithmetic, independent of batch size and of the instruction set: per
//! 32-element block an exact integer sum split into 8 lanes of 4 products,
//! scaled in f32 and accumulated lane-wise with fused multiply-add, then the
//! lanes are summed in a fixed tree order. The scalar fallback emulates the
//! lanes exactly, so every machine computes bit-identical results.

use half::{bf16, f16};

/// Elements per quantization block (all formats here).
pub const QK: usize = 32;

/// Storage format of a weight matrix row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl WeightFormat {
    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => 1,
            _ => QK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::BF16 => 2,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
        }
    }

    /// Bytes of one row of `k` elements, or `None` when `k` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        let bl = self.block_len();
        (k % bl == 0).then(|| k / bl * self.block_bytes())
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "F32",
            WeightFormat::F16 => "F16",
            WeightFormat::BF16 => "BF16",
            WeightFormat::Q4_0 => "Q4_0",
            WeightFormat::Q4_1 => "Q4_1",
            WeightFormat::Q8_0 => "Q8_0",
        }
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
/// Per block: `q` (32 signed bytes in [-127, 127]), the scale `d`, and
/// `s = d * sum(q)` (the block sum, used by the formats with an offset).
#[derive(Default)]
pub struct QuantizedActs {
    pub rows: usize,
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
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
        let x = &x[..rows * k];
        let (qp, dp, sp) = (SendPtr(self.q.as_mut_ptr()), SendPtr(self.d.as_mut_ptr()), SendPtr(self.s.as_mut_ptr()));
        const ROWS: usize = 4;
        pool.run(rows.div_ceil(ROWS), &|task| {
            let (r0, r1) = (task * ROWS, (task * ROWS + ROWS).min(rows));
            let (qp, dp, sp) = (qp, dp, sp);
            // SAFETY: tasks cover disjoint rows of buffers sized above.
            let (qr, dr, sr) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qp.0.add(r0 * k), (r1 - r0) * k),
                    std::slice::from_raw_parts_mut(dp.0.add(r0 * nb), (r1 - r0) * nb),
                    std::slice::from_raw_parts_mut(sp.0.add(r0 * nb), (r1 - r0) * nb),
                )
            };
            let xr = &x[r0 * k..r1 * k];
            #[cfg(target_arch = "x86_64")]
            if crate::matmul::isa() != crate::matmul::Isa::Scalar {
                // SAFETY: the ISA check above guarantees AVX2, FMA and F16C.
                return unsafe { quantize_rows_avx2(xr, qr, dr, sr) };
            }
            quantize_rows(xr, qr, dr, sr)
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
}

#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// 8-bit quantization of whole blocks: `q = round(x / d)` with
/// `d = max|x| / 127`, ties to even; `d` and `d * sum(q)` kept at f16
/// precision, as GGML's activation blocks store them.
#[inline(always)]
fn quantize_rows(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
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
    }
}

/// The same code compiled for AVX2 (rounding and max become single
/// instructions); results are identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_rows_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    quantize_rows(x, q, d, s)
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

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(WeightFormat::Q4_1.row_bytes(33), None);
        assert_eq!(WeightFormat::F16.row_bytes(33), Some(66));
    }
}
