//! Matrix products `y = x · Wᵀ` of activations by a weight matrix stored in
//! one of the GGML block formats.
//!
//! Quantized weights meet activations quantized to 8 bits per block (the
//! scheme llama.cpp uses); float weights meet float activations. Each output
//! element is computed by one fixed sequence of operations that depends only
//! on its own row and column, never on how many rows are in the batch or how
//! the work is split across threads: this is what makes a sequence's tokens
//! identical alone or batched, prefilled in one chunk or many.

use crate::blocks;
use crate::quant::{dequantize_row, QuantizedActs, WeightFormat, QK};
use half::f16;
use crate::pool::{Pool, SendPtr};
use std::sync::OnceLock;

mod kquant;

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
    /// 8-bit weights in panels: per panel and block, eight groups of 64
    /// bytes, byte `4r + i` of group `q` being element `4q + i` of row `r`
    /// stored as `w + 128` (the unsigned operand the integer dot
    /// instructions take). Scales as for Q4; offsets `m` likewise, or empty
    /// when the format has none. Q8_0 as stored; IQ4_NL (its levels) and,
    /// where the ISA has no 5-bit tile, Q5_0 (`q - 16`) and Q5_1 (`q`, with
    /// its offset) widened losslessly.
    Q8 { qs: Vec<u8>, d: Vec<u16>, m: Vec<u16> },
    /// Q5_0 and Q5_1 at their own 5 bits a weight (the AVX2 path, where
    /// widening them to [`Prepared::Q8`] made a bandwidth-bound decode read
    /// 1.55x their bytes): the low four bits in the Q4 layout, the fifth in
    /// [`Q5_HIGH_BLOCK`] bytes per panel and block: byte `32 h + 4 r + i`
    /// holds in bit `q` the fifth bit of element `4 q + i` of the panel's row
    /// `8 h + r`, the element that sits in byte `4 r + i` of the tile's
    /// `q`-th register. `m` as for Q4 (Q5_1), or empty for Q5_0, whose
    /// weights are `d (q - 16)`: the tile takes `16 sum(x)` off the integer
    /// sum, which then equals the widened form's exactly.
    Q5 { qs: Vec<u8>, qh: Vec<u8>, d: Vec<u16>, m: Vec<u16> },
    /// The K super-block formats (`kquant`).
    K(kquant::KPanels),
}

/// How a matrix wants its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acts {
    /// As f32 (float weights).
    F32,
    /// Quantized to 8 bits per 32-element block ([`QuantizedActs`]).
    Q8,
    /// Quantized to Q8_K ([`crate::quant::Q8KActs`]).
    Q8K,
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
/// Fifth-bit bytes per panel and block of [`Prepared::Q5`].
const Q5_HIGH_BLOCK: usize = PANEL * QK / 8;

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

/// Quant `e` (0..32, unsigned) of block `b` of row `o`, from the Q5 panel layout.
#[inline]
fn q5_at(qs: &[u8], qh: &[u8], nb: usize, o: usize, b: usize, e: usize) -> u8 {
    let r = o % PANEL;
    let high = qh[((o / PANEL) * nb + b) * Q5_HIGH_BLOCK + (r / 8) * 32 + (r % 8) * 4 + e % 4] >> (e / 4) & 1;
    q4_at(qs, nb, o, b, e) | high << 4
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

/// Where one GGML block of a matrix goes in the panel layouts.
struct BlockAt {
    row: usize,
    /// Its index in the row.
    block: usize,
    /// Panel of its row, times the blocks of a row, plus `block`.
    panel_block: usize,
    /// Its row within the panel.
    panel_row: usize,
}

/// Calls `f` for every block of a GGML matrix (rows of `row_bytes`, blocks of
/// `block_bytes`, `nb` to a row), row by row, stopping at the first error.
fn each_block(bytes: &[u8], row_bytes: usize, block_bytes: usize, nb: usize, mut f: impl FnMut(BlockAt, &[u8]) -> Result<(), MatrixError>) -> Result<(), MatrixError> {
    for (row, data) in bytes.chunks_exact(row_bytes).enumerate() {
        for (block, blk) in data.chunks_exact(block_bytes).enumerate() {
            f(BlockAt { row, block, panel_block: (row / PANEL) * nb + block, panel_row: row % PANEL }, blk)?;
        }
    }
    Ok(())
}

/// Errors preparing a weight matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    #[error("matrix of {n}x{k} in {format} needs {expected} bytes, got {got}")]
    Size { n: usize, k: usize, format: &'static str, expected: usize, got: usize },
    #[error("row length {k} is not a multiple of {block}, the block length of {format}")]
    RowLength { k: usize, block: usize, format: &'static str },
    #[error("row {row}, block {block}: Q4_0 scale {scale} is out of range (its offset -8 x scale overflows f16)")]
    ScaleRange { row: usize, block: usize, scale: String },
}

impl QMatrix {
    /// Prepares a matrix from GGML-layout bytes (`n` rows of `k` elements).
    pub fn from_ggml(format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<Self, MatrixError> {
        // The AVX2 path has a 5-bit tile; the others take Q5 widened to 8 bits
        // (same sums, same results).
        Self::prepare(format, n, k, bytes, isa() == Isa::Avx2)
    }

    /// [`Self::from_ggml`], with Q5_0 and Q5_1 kept at 5 bits (`native_q5`) or
    /// widened to the 8-bit layout.
    fn prepare(format: WeightFormat, n: usize, k: usize, bytes: &[u8], native_q5: bool) -> Result<Self, MatrixError> {
        let row_length = MatrixError::RowLength { k, block: format.block_len().max(QK), format: format.name() };
        if !k.is_multiple_of(QK) {
            return Err(row_length);
        }
        let row_bytes = format.row_bytes(k).ok_or(row_length)?;
        let expected = row_bytes * n;
        if bytes.len() != expected {
            return Err(MatrixError::Size { n, k, format: format.name(), expected, got: bytes.len() });
        }
        let nb = k / QK;
        let panel_blocks = n.div_ceil(PANEL) * nb;
        let f16_at = blocks::f16_bits;
        let kind = match format {
            // No integer kernel: IQ4_XS's levels times its 6-bit scales
            // overflow the 16-bit pair sums of the AVX2 path, and Q8_K is an
            // activation format that files rarely hold.
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::Q8_K | WeightFormat::IQ4_XS => {
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
                each_block(bytes, row_bytes, bb, nb, |at, blk| {
                    let (pb, r) = (at.panel_block, at.panel_row);
                    let scale = f16_at(blk, 0);
                    d[pb * PANEL + r] = scale;
                    m[pb * PANEL + r] = if format == WeightFormat::Q4_1 {
                        f16_at(blk, 2)
                    } else {
                        // Exact in f16 (a power-of-two multiple) unless it overflows.
                        let off = -8.0 * f16::from_bits(scale).to_f32();
                        if !f16::from_f32(off).to_f32().eq(&off) && off.is_finite() {
                            return Err(MatrixError::ScaleRange { row: at.row, block: at.block, scale: f16::from_bits(scale).to_string() });
                        }
                        f16::from_f32(off).to_bits()
                    };
                    for j in 0..4 {
                        let at = pb * Q4_PANEL_BLOCK + j * 64 + r * 4;
                        qs[at..at + 4].copy_from_slice(&blk[hdr + 4 * j..hdr + 4 * j + 4]);
                    }
                    Ok(())
                })?;
                Prepared::Q4 { qs, d, m }
            }
            WeightFormat::Q5_0 | WeightFormat::Q5_1 if native_q5 => {
                let bb = format.block_bytes();
                let offset = format == WeightFormat::Q5_1;
                let mut qs = vec![0u8; panel_blocks * Q4_PANEL_BLOCK];
                let mut qh = vec![0u8; panel_blocks * Q5_HIGH_BLOCK];
                let mut d = vec![0u16; panel_blocks * PANEL];
                let mut m = vec![0u16; if offset { panel_blocks * PANEL } else { 0 }];
                each_block(bytes, row_bytes, bb, nb, |at, blk| {
                    let (pb, r) = (at.panel_block, at.panel_row);
                    let q: [u8; QK] = if offset { blocks::q5_1_quants(blk) } else { blocks::q5_0_quants(blk).map(|v| (v + 16) as u8) };
                    d[pb * PANEL + r] = f16_at(blk, 0);
                    if offset {
                        m[pb * PANEL + r] = f16_at(blk, 2);
                    }
                    for (e, &v) in q.iter().enumerate() {
                        let g = e % 16;
                        qs[pb * Q4_PANEL_BLOCK + (g / 4) * 64 + r * 4 + g % 4] |= if e < 16 { v & 0x0f } else { (v & 0x0f) << 4 };
                        qh[pb * Q5_HIGH_BLOCK + (r / 8) * 32 + (r % 8) * 4 + e % 4] |= (v >> 4) << (e / 4);
                    }
                    Ok(())
                })?;
                Prepared::Q5 { qs, qh, d, m }
            }
            WeightFormat::Q8_0 | WeightFormat::Q5_0 | WeightFormat::Q5_1 | WeightFormat::IQ4_NL => {
                let bb = format.block_bytes();
                let offset = format == WeightFormat::Q5_1;
                let mut qs = vec![0x80u8; panel_blocks * Q8_PANEL_BLOCK];
                let mut d = vec![0u16; panel_blocks * PANEL];
                let mut m = vec![0u16; if offset { panel_blocks * PANEL } else { 0 }];
                each_block(bytes, row_bytes, bb, nb, |at, blk| {
                    let (pb, r) = (at.panel_block, at.panel_row);
                    let w: [i8; QK] = match format {
                        WeightFormat::Q8_0 => std::array::from_fn(|e| blk[2 + e] as i8),
                        WeightFormat::Q5_0 => blocks::q5_0_quants(blk),
                        WeightFormat::Q5_1 => blocks::q5_1_quants(blk).map(|q| q as i8),
                        _ => blocks::iq4_nl_levels(blk),
                    };
                    d[pb * PANEL + r] = f16_at(blk, 0);
                    if offset {
                        m[pb * PANEL + r] = f16_at(blk, 2);
                    }
                    for (e, &v) in w.iter().enumerate() {
                        qs[pb * Q8_PANEL_BLOCK + (e / 4) * 64 + r * 4 + e % 4] = v as u8 ^ 0x80;
                    }
                    Ok(())
                })?;
                Prepared::Q8 { qs, d, m }
            }
            WeightFormat::Q2_K | WeightFormat::Q3_K | WeightFormat::Q4_K | WeightFormat::Q5_K | WeightFormat::Q6_K => {
                Prepared::K(kquant::KPanels::new(format, n, k, bytes))
            }
        };
        Ok(QMatrix { n, k, format, kind })
    }

    /// Prepares a float matrix from row-major f32 values.
    pub fn from_f32(n: usize, k: usize, w: Vec<f32>) -> Result<Self, MatrixError> {
        if !k.is_multiple_of(QK) {
            return Err(MatrixError::RowLength { k, block: QK, format: "F32" });
        }
        if w.len() != n * k {
            return Err(MatrixError::Size { n, k, format: "F32", expected: n * k * 4, got: w.len() * 4 });
        }
        Ok(QMatrix { n, k, format: WeightFormat::F32, kind: Prepared::F32(w) })
    }

    /// Whether products with this matrix take 8-bit quantized activations.
    pub fn wants_quantized_acts(&self) -> bool {
        self.acts() != Acts::F32
    }

    /// The activations products with this matrix take.
    pub fn acts(&self) -> Acts {
        match self.kind {
            Prepared::F32(_) => Acts::F32,
            Prepared::Q4 { .. } | Prepared::Q8 { .. } | Prepared::Q5 { .. } => Acts::Q8,
            Prepared::K(_) => Acts::Q8K,
        }
    }

    /// Bytes held by the prepared matrix.
    pub fn size_bytes(&self) -> usize {
        match &self.kind {
            Prepared::F32(w) => w.len() * 4,
            Prepared::Q4 { qs, d, m } => qs.len() + (d.len() + m.len()) * 2,
            Prepared::Q8 { qs, d, m } => qs.len() + (d.len() + m.len()) * 2,
            Prepared::Q5 { qs, qh, d, m } => qs.len() + qh.len() + (d.len() + m.len()) * 2,
            Prepared::K(kp) => kp.size_bytes(),
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
            Prepared::Q8 { qs, d, m } => {
                for b in 0..nb {
                    let s = block_at(d, nb, r, b);
                    for e in 0..QK {
                        out[b * QK + e] = q8_at(qs, nb, r, b, e) as f32 * s;
                    }
                    if !m.is_empty() {
                        let off = block_at(m, nb, r, b);
                        out[b * QK..(b + 1) * QK].iter_mut().for_each(|v| *v += off);
                    }
                }
            }
            Prepared::Q5 { qs, qh, d, m } => {
                let centre = if m.is_empty() { 16 } else { 0 };
                for b in 0..nb {
                    let s = block_at(d, nb, r, b);
                    for e in 0..QK {
                        out[b * QK + e] = (q5_at(qs, qh, nb, r, b, e) as i32 - centre) as f32 * s;
                    }
                    if !m.is_empty() {
                        let off = block_at(m, nb, r, b);
                        out[b * QK..(b + 1) * QK].iter_mut().for_each(|v| *v += off);
                    }
                }
            }
            Prepared::K(kp) => kp.row_f32(self.format, r, out),
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
    matmul_many_on(isa(), pool, x, xq, rows, outs)
}

/// [`matmul_many`] on a given instruction set (tests compare them); `isa`
/// must be available on this machine.
pub(crate) fn matmul_many_on(isa: Isa, pool: &Pool, x: &[f32], xq: &QuantizedActs, rows: usize, outs: &mut [(&QMatrix, &mut [f32])]) {
    assert!(isa == Isa::Scalar || isa == self::isa() || self::isa() == Isa::Avx512Vnni, "{isa:?} is not available here");
    let mut jobs: Vec<(&QMatrix, SendPtr<f32>, usize)> = Vec::new();
    for (w, out) in outs.iter_mut() {
        assert!(out.len() >= rows * w.n, "matmul output too small");
        match w.acts() {
            Acts::F32 => assert!(x.len() >= rows * w.k),
            Acts::Q8 => assert!(xq.rows >= rows && xq.k == w.k, "activations not quantized for this matrix"),
            Acts::Q8K => assert!(xq.q8k.rows >= rows && xq.q8k.k == w.k, "activations not quantized to Q8_K for this matrix"),
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
        match (&w.kind, isa) {
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q4 { qs, d, m }, Isa::Avx512Vnni) => unsafe { simd::q4_panel_512(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q4 { qs, d, m }, Isa::Avx2) => unsafe { simd::q4_panel_avx2(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q8 { qs, d, m }, Isa::Avx512Vnni) => unsafe { simd::q8_panel_512(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q8 { qs, d, m }, Isa::Avx2) => unsafe { simd::q8_panel_avx2(qs, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::Q5 { qs, qh, d, m }, Isa::Avx2) => unsafe { simd::q5_panel_avx2(qs, qh, d, m, w.k, xq, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::K(kp), Isa::Avx512Vnni) => unsafe { kquant::simd::panel_512(kp, &xq.q8k, rows, panel, p.0, w.n) },
            #[cfg(target_arch = "x86_64")]
            (Prepared::K(kp), Isa::Avx2) => unsafe { kquant::simd::panel_avx2(kp, &xq.q8k, rows, panel, p.0, w.n) },
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
        Prepared::Q8 { qs, d, m } => scalar::dot_q8(qs, d, m, nb, o, xq.row_q(t), xq.row_d(t), xq.row_s(t)),
        Prepared::Q5 { qs, qh, d, m } => scalar::dot_q5(qs, qh, d, m, nb, o, xq.row_q(t), xq.row_d(t), xq.row_s(t)),
        Prepared::K(kp) => kquant::dot(kp, o, &xq.q8k, t),
    }
}

/// The fixed lane-reduction order shared by every path.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Portable reference kernels: the arithmetic every SIMD path reproduces.
pub(crate) mod scalar {
    use super::{block_at, hsum8, q4_at, q5_at, q8_at, QK};

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

    /// The 8-bit arithmetic of row `o`: as `dot_q4`'s, the offset term
    /// only when the format has offsets (`m` not empty).
    #[allow(clippy::too_many_arguments)]
    pub fn dot_q8(qs: &[u8], d: &[u16], m: &[u16], nb: usize, o: usize, xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        weighted_blocks(d, m, nb, o, xd, xs, |b| (0..QK).map(|e| q8_at(qs, nb, o, b, e) as i32 * xq[b * QK + e] as i32).sum())
    }

    /// The Q5 arithmetic of row `o`: `dot_q8`'s, with the same integer sums
    /// (Q5_0's quants centred by 16, as when widened).
    #[allow(clippy::too_many_arguments)]
    pub fn dot_q5(qs: &[u8], qh: &[u8], d: &[u16], m: &[u16], nb: usize, o: usize, xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
        let centre = if m.is_empty() { 16 } else { 0 };
        weighted_blocks(d, m, nb, o, xd, xs, |b| (0..QK).map(|e| (q5_at(qs, qh, nb, o, b, e) as i32 - centre) * xq[b * QK + e] as i32).sum())
    }

    /// In block order, `acc = isum(b) * (d * dx) + acc`, then with offsets
    /// `acc = m * s + acc` (fused).
    fn weighted_blocks(d: &[u16], m: &[u16], nb: usize, o: usize, xd: &[f32], xs: &[f32], isum: impl Fn(usize) -> i32) -> f32 {
        let mut acc = 0f32;
        for b in 0..nb {
            acc = (isum(b) as f32).mul_add(block_at(d, nb, o, b) * xd[b], acc);
            if !m.is_empty() {
                acc = block_at(m, nb, o, b).mul_add(xs[b], acc);
            }
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;

#[cfg(test)]
mod tests;
