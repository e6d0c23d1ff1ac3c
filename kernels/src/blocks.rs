//! GGML's block layouts beyond Q4_0, Q4_1 and Q8_0: byte offsets, the
//! dequantization of each block exactly as GGML writes it, and the decoding
//! of the super-block formats into one integer form the kernels share.
//!
//! The integer form ([`KBlock`]) of a 256-element super-block is: unsigned
//! quants `q` (below 64), per-sub-block integer scales `sc` and mins `mn`,
//! and two f16 factors, so that element `e` is
//! `d * sc[e / len] * q[e] - dmin * mn[e / len]` (`len` = 256 / `subs`).
//! Formats with signed quants (Q3_K, Q6_K) shift them to unsigned and fold
//! the shift into the mins (`mn = shift * sc`, `dmin = d`), so one integer
//! dot product with a min term serves every K format.

use half::f16;

/// Elements per super-block of the K formats.
pub const QK_K: usize = 256;

/// IQ4_NL's and IQ4_XS's sixteen non-linear levels.
pub const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

#[inline]
pub(crate) fn f16_bits(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(f16_bits(b, at)).to_f32()
}

/// Bytes of one block.
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;
pub const IQ4_NL_BYTES: usize = 18;
pub const Q2_K_BYTES: usize = 84;
pub const Q3_K_BYTES: usize = 110;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;
pub const Q8_K_BYTES: usize = 292;
pub const IQ4_XS_BYTES: usize = 136;

/// Quant `j` (0..32) of a Q5_0 or Q5_1 block: the nibble (low nibbles are
/// elements 0..16, high nibbles 16..32) and bit `j` of `qh`.
#[inline]
fn q5_quant(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nib = if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
    nib | ((((qh >> j) & 1) as u8) << 4)
}

/// Q5_0 (d, qh, qs): `(q - 16) * d`. Returns the block's signed quants.
pub fn q5_0_quants(b: &[u8]) -> [i8; 32] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    std::array::from_fn(|j| q5_quant(&b[6..22], qh, j) as i8 - 16)
}

/// Q5_1 (d, m, qh, qs): `q * d + m`. Returns the block's unsigned quants.
pub fn q5_1_quants(b: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    std::array::from_fn(|j| q5_quant(&b[8..24], qh, j))
}

/// IQ4_NL (d, qs): `d * level[nibble]`. Returns the levels.
pub fn iq4_nl_levels(b: &[u8]) -> [i8; 32] {
    std::array::from_fn(|j| IQ4_LEVELS[(if j < 16 { b[2 + j] & 0x0f } else { b[2 + j - 16] >> 4 }) as usize])
}

/// Q4_K's and Q5_K's 6-bit scale and min of sub-block `j` (0..8) from the
/// 12 packed bytes: the first four pairs are the low 6 bits of bytes
/// `j` and `j + 4`; the last four take their low 4 bits from byte `j + 4`
/// and their top 2 from the top bits of bytes `j - 4` and `j`.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q3_K's signed 6-bit scale of sub-block `j` (0..16): low 4 bits in the
/// low or high nibble of bytes 0..8, top 2 bits in bytes 8..12.
#[inline]
pub fn scale_q3_k(j: usize, s: &[u8]) -> i8 {
    let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Element `e` of a 2-bit plane shared by Q2_K and Q3_K: each 128-element
/// half reads 32 bytes, element `32 j + l` of the half from bits `2j` of
/// byte `l`.
#[inline]
fn crumb(qs: &[u8], e: usize) -> u8 {
    let (n, r) = (e / 128, e % 128);
    (qs[32 * n + r % 32] >> (2 * (r / 32))) & 3
}

/// A super-block in the integer form the kernels take (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KBlock {
    pub d: u16,
    pub dmin: u16,
    /// Sub-blocks per super-block: 8 (of 32 elements) or 16 (of 16).
    pub subs: usize,
    pub sc: [i8; 16],
    pub mn: [i16; 16],
    pub q: [u8; QK_K],
}

/// Element `e`'s 4-bit quant in the nibble layout of Q4_K and Q5_K starting at `qs`:
/// each 64 elements read 32 bytes, low nibbles first, then high.
#[inline]
fn k4_nibble(qs: &[u8], e: usize) -> u8 {
    let byte = qs[32 * (e / 64) + e % 32];
    if e % 64 < 32 {
        byte & 0x0f
    } else {
        byte >> 4
    }
}

impl KBlock {
    fn new(d: u16, dmin: u16, subs: usize) -> KBlock {
        KBlock { d, dmin, subs, sc: [0; 16], mn: [0; 16], q: [0; QK_K] }
    }

    pub fn q2_k(b: &[u8]) -> KBlock {
        let mut k = KBlock::new(f16_bits(b, 80), f16_bits(b, 82), 16);
        for j in 0..16 {
            k.sc[j] = (b[j] & 0x0f) as i8;
            k.mn[j] = (b[j] >> 4) as i16;
        }
        for e in 0..QK_K {
            k.q[e] = crumb(&b[16..80], e);
        }
        k
    }

    /// Q3_K's quants are `low - 4` unless the high-mask bit is set: as
    /// unsigned `low + 4 * bit` with a min of `4 * sc`.
    pub fn q3_k(b: &[u8]) -> KBlock {
        let d = f16_bits(b, 108);
        let mut k = KBlock::new(d, d, 16);
        for j in 0..16 {
            k.sc[j] = scale_q3_k(j, &b[96..108]);
            k.mn[j] = 4 * k.sc[j] as i16;
        }
        for e in 0..QK_K {
            let (n, r) = (e / 128, e % 128);
            let bit = (b[r % 32] >> (4 * n + r / 32)) & 1;
            k.q[e] = crumb(&b[32..96], e) + 4 * bit;
        }
        k
    }

    pub fn q4_k(b: &[u8]) -> KBlock {
        let mut k = Self::k4_scales(b);
        for e in 0..QK_K {
            k.q[e] = k4_nibble(&b[16..], e);
        }
        k
    }

    /// Q5_K: Q4_K's nibbles plus a fifth bit, bit `e / 32` of `qh[e % 32]`.
    pub fn q5_k(b: &[u8]) -> KBlock {
        let mut k = Self::k4_scales(b);
        for e in 0..QK_K {
            k.q[e] = k4_nibble(&b[48..], e) | (((b[16 + e % 32] >> (e / 32)) & 1) << 4);
        }
        k
    }

    /// What Q4_K and Q5_K share ahead of their quants: `d`, `dmin`, and eight 6-bit
    /// scale/min pairs packed in bytes 4..16.
    fn k4_scales(b: &[u8]) -> KBlock {
        let mut k = KBlock::new(f16_bits(b, 0), f16_bits(b, 2), 8);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            k.sc[j] = sc as i8;
            k.mn[j] = m as i16;
        }
        k
    }

    /// Q6_K's quants are `q - 32`: unsigned `q` with a min of `32 * sc`.
    pub fn q6_k(b: &[u8]) -> KBlock {
        let d = f16_bits(b, 208);
        let mut k = KBlock::new(d, d, 16);
        for j in 0..16 {
            k.sc[j] = b[192 + j] as i8;
            k.mn[j] = 32 * k.sc[j] as i16;
        }
        for e in 0..QK_K {
            k.q[e] = q6_k_quant(b, e);
        }
        k
    }
}

/// Q6_K's unsigned 6-bit quant `e`: each 128-element half reads 64 bytes of
/// low nibbles and 32 bytes of 2-bit pairs; element `32 j + l` takes the
/// nibble of byte `l + 32 (j % 2)` (low for `j < 2`) and bits `2j` of
/// `qh[l]`.
#[inline]
fn q6_k_quant(b: &[u8], e: usize) -> u8 {
    let (n, r) = (e / 128, e % 128);
    let (j, l) = (r / 32, r % 32);
    let byte = b[64 * n + l + 32 * (j % 2)];
    let low = if j < 2 { byte & 0x0f } else { byte >> 4 };
    let high = (b[128 + 32 * n + l] >> (2 * j)) & 3;
    low | (high << 4)
}

// The dequantizers below walk each block in GGML's own loop order, apart
// from the element-wise decoders above (which the kernels' preparation
// uses), so that a misread layout in either shows as a disagreement.

/// Q5_0: `((nibble | bit << 4) - 16) * d`, element `j` and `j + 16` from
/// byte `j`, their fifth bits at bits `j` and `j + 16` of `qh`.
pub fn dequantize_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as i32;
        let h1 = ((qh >> (j + 16)) & 1) as i32;
        out[j] = (((b[6 + j] & 0x0f) as i32 | h0 << 4) - 16) as f32 * d;
        out[j + 16] = (((b[6 + j] >> 4) as i32 | h1 << 4) - 16) as f32 * d;
    }
}

/// Q5_1: `(nibble | bit << 4) * d + m`, bits as Q5_0's.
pub fn dequantize_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as i32;
        let h1 = ((qh >> (j + 16)) & 1) as i32;
        out[j] = ((b[8 + j] & 0x0f) as i32 | h0 << 4) as f32 * d + m;
        out[j + 16] = ((b[8 + j] >> 4) as i32 | h1 << 4) as f32 * d + m;
    }
}

pub fn dequantize_iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        out[j] = d * IQ4_LEVELS[(b[2 + j] & 0x0f) as usize] as f32;
        out[j + 16] = d * IQ4_LEVELS[(b[2 + j] >> 4) as usize] as f32;
    }
}

/// Q2_K (scales[16], qs[64], d, dmin): per 128-element half, 32 bytes of
/// 2-bit quants; the four shifts of a byte serve four runs of 32 elements,
/// each two sub-blocks of 16 with their own 4-bit scale and min.
pub fn dequantize_q2_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut y = 0;
    let mut is = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = b[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                for l in 0..16 {
                    out[y] = dl * ((q[16 * part + l] >> shift) & 3) as f32 - ml;
                    y += 1;
                }
            }
        }
    }
}

/// Q3_K (hmask[32], qs[64], scales[12], d): Q2_K's 2-bit runs, minus 4
/// where the run's bit of `hmask[l]` is clear, times signed 6-bit scales.
pub fn dequantize_q3_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 108);
    let hm = &b[0..32];
    let mut y = 0;
    let mut is = 0;
    let mut bit = 1u8;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scale_q3_k(is, &b[96..108]) as f32;
                is += 1;
                for l in 0..16 {
                    let low = ((q[16 * part + l] >> shift) & 3) as i32;
                    let v = low - if hm[16 * part + l] & bit != 0 { 0 } else { 4 };
                    out[y] = dl * v as f32;
                    y += 1;
                }
            }
            bit <<= 1;
        }
    }
}

/// Q4_K (d, dmin, scales[12], qs[128]): per 64 elements, 32 bytes whose low
/// nibbles are the first 32 and high nibbles the next 32, each run with
/// its 6-bit scale and min.
pub fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for g in 0..4 {
        let q = &b[16 + 32 * g..48 + 32 * g];
        let (s1, m1) = scale_min_k4(2 * g, &b[4..16]);
        let (s2, m2) = scale_min_k4(2 * g + 1, &b[4..16]);
        let (d1, dm1, d2, dm2) = (d * s1 as f32, dmin * m1 as f32, d * s2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            out[64 * g + l] = d1 * (q[l] & 0x0f) as f32 - dm1;
            out[64 * g + 32 + l] = d2 * (q[l] >> 4) as f32 - dm2;
        }
    }
}

/// Q5_K (d, dmin, scales[12], qh[32], qs[128]): Q4_K plus a fifth bit, for
/// run `r` (of 32 elements) bit `r` of `qh[l]`.
pub fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let qh = &b[16..48];
    for g in 0..4 {
        let q = &b[48 + 32 * g..80 + 32 * g];
        let (s1, m1) = scale_min_k4(2 * g, &b[4..16]);
        let (s2, m2) = scale_min_k4(2 * g + 1, &b[4..16]);
        let (d1, dm1, d2, dm2) = (d * s1 as f32, dmin * m1 as f32, d * s2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[64 * g + l] = d1 * ((q[l] & 0x0f) + h1) as f32 - dm1;
            out[64 * g + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - dm2;
        }
    }
}

/// Q6_K (ql[128], qh[64], scales[16], d): per 128-element half, 64 bytes of
/// low nibbles and 32 bytes of 2-bit pairs make four runs of 32.
pub fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..160 + 32 * half];
        let sc = &b[192 + 8 * half..200 + 8 * half];
        let y = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}
pub fn dequantize_q8_k(b: &[u8], out: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in out.iter_mut().zip(&b[4..4 + QK_K]) {
        *o = d * (q as i8) as f32;
    }
}

/// IQ4_XS (d, scales_h, scales_l[4], qs[128]): 8 sub-blocks of 32 with a
/// 6-bit scale (low 4 bits in `scales_l`, top 2 in `scales_h`) minus 32.
pub fn dequantize_iq4_xs(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let high = u16::from_le_bytes([b[2], b[3]]);
    for (ib, o) in out.chunks_exact_mut(32).enumerate() {
        let ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | ((((high >> (2 * ib)) & 3) as u8) << 4);
        let dl = d * (ls as i32 - 32) as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        for j in 0..16 {
            o[j] = dl * IQ4_LEVELS[(qs[j] & 0x0f) as usize] as f32;
            o[j + 16] = dl * IQ4_LEVELS[(qs[j] >> 4) as usize] as f32;
        }
    }
}

// Quantizers for tests and tools (benchmarks, requantized test models):
// straightforward round-to-nearest on GGML's layouts, not llama.cpp's
// error-minimizing searches, and not on the serving path.

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// The value of largest magnitude, with its sign.
fn signed_max(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Q5_0: `d = max / -16` (the signed extreme maps to quant 0).
pub fn quantize_row_q5_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let d = signed_max(blk) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<u8> = blk.iter().map(|&v| ((v * id + 16.5) as i32).clamp(0, 31) as u8).collect();
        push_f16(out, d);
        out.extend_from_slice(&q5_high_bits(&q).to_le_bytes());
        out.extend((0..16).map(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)));
    }
}

/// Q5_1: `d = (max - min) / 31`, `m = min`.
pub fn quantize_row_q5_1(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let (lo, hi) = blk.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let d = (hi - lo) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<u8> = blk.iter().map(|&v| (((v - lo) * id + 0.5) as i32).clamp(0, 31) as u8).collect();
        push_f16(out, d);
        push_f16(out, lo);
        out.extend_from_slice(&q5_high_bits(&q).to_le_bytes());
        out.extend((0..16).map(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)));
    }
}

fn q5_high_bits(q: &[u8]) -> u32 {
    q.iter().enumerate().fold(0u32, |h, (j, &v)| h | (((v >> 4) & 1) as u32) << j)
}

/// 6-bit codes of `v / step`, rounded, for the packed scales and mins.
fn six_bits(v: f32, step: f32) -> u8 {
    if step == 0.0 {
        0
    } else {
        ((v / step).round() as i32).clamp(0, 63) as u8
    }
}

/// Q4_K (`bits` = 4) or Q5_K (`bits` = 5): per sub-block of 32 a scale and
/// a non-negative min (`min(0, min x)` negated) so that `x ~ d sc q - dmin m`,
/// both 6-bit codes of the super-block's `d` and `dmin`.
fn quantize_row_k4(x: &[f32], bits: u32, out: &mut Vec<u8>) {
    let nmax = ((1 << bits) - 1) as f32;
    for blk in x.chunks(QK_K) {
        let mut scales = [0f32; 8];
        let mut mins = [0f32; 8];
        for (j, sub) in blk.chunks(32).enumerate() {
            let (lo, hi) = sub.iter().fold((0f32, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            scales[j] = (hi - lo) / nmax;
            mins[j] = -lo;
        }
        let d = scales.iter().fold(0f32, |a, &v| a.max(v)) / 63.0;
        let dmin = mins.iter().fold(0f32, |a, &v| a.max(v)) / 63.0;
        let (d, dmin) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
        let sc: Vec<u8> = scales.iter().map(|&v| six_bits(v, d)).collect();
        let mn: Vec<u8> = mins.iter().map(|&v| six_bits(v, dmin)).collect();
        let mut q = [0u8; QK_K];
        for (e, &v) in blk.iter().enumerate() {
            let step = d * sc[e / 32] as f32;
            if step != 0.0 {
                q[e] = (((v + dmin * mn[e / 32] as f32) / step).round() as i32).clamp(0, nmax as i32) as u8;
            }
        }
        push_f16(out, d);
        push_f16(out, dmin);
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
        }
        out.extend_from_slice(&packed);
        if bits == 5 {
            out.extend((0..32).map(|l| (0..8).fold(0u8, |h, r| h | ((q[32 * r + l] >> 4) & 1) << r)));
        }
        for g in 0..4 {
            out.extend((0..32).map(|l| (q[64 * g + l] & 0x0f) | ((q[64 * g + 32 + l] & 0x0f) << 4)));
        }
    }
}

pub fn quantize_row_q4_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_row_k4(x, 4, out)
}

pub fn quantize_row_q5_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_row_k4(x, 5, out)
}

/// Q6_K: per sub-block of 16 a signed 8-bit scale so that
/// `x ~ d sc (q - 32)`, `q` in 0..64.
pub fn quantize_row_q6_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK_K) {
        let steps: Vec<f32> = blk.chunks(16).map(|s| signed_max(s) / -32.0).collect();
        let d = f16::from_f32(steps.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0).to_f32();
        let sc: Vec<i8> = steps.iter().map(|&s| if d == 0.0 { 0 } else { (s / d).round().clamp(-128.0, 127.0) as i8 }).collect();
        let mut q = [32u8; QK_K];
        for (e, &v) in blk.iter().enumerate() {
            let step = d * sc[e / 16] as f32;
            if step != 0.0 {
                q[e] = ((v / step).round() as i32 + 32).clamp(0, 63) as u8;
            }
        }
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for half in 0..2 {
            for l in 0..32 {
                let [q1, q2, q3, q4] = [0, 32, 64, 96].map(|o| q[128 * half + o + l]);
                ql[64 * half + l] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
                ql[64 * half + l + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
                qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&v| v as u8));
        push_f16(out, d);
    }
}

/// Known answers: one hand-built block per format, bytes set by hand from
/// GGML's layout, values worked out by hand. Each puts distinct quants at
/// positions that a swapped nibble, half or sub-block would move.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, WeightFormat};

    const ONE: [u8; 2] = [0x00, 0x3c]; // f16 1.0
    const HALF: [u8; 2] = [0x00, 0x38]; // f16 0.5
    const TWO: [u8; 2] = [0x00, 0x40]; // f16 2.0

    fn deq(format: WeightFormat, b: &[u8]) -> Vec<f32> {
        assert_eq!(b.len(), format.block_bytes());
        let mut out = vec![f32::NAN; format.block_len()];
        dequantize_row(format, b, &mut out);
        out
    }

    /// Checks `(element, value)` pairs, and that the kernels' decoding
    /// (prepared matrix rows) agrees on the whole block.
    fn check(format: WeightFormat, b: &[u8], want: &[(usize, f32)]) {
        let got = deq(format, b);
        for &(e, v) in want {
            assert_eq!(got[e], v, "{format:?} element {e}");
        }
        let m = crate::matmul::QMatrix::from_ggml(format, 1, format.block_len(), b).unwrap();
        let mut row = vec![f32::NAN; format.block_len()];
        m.row_f32(0, &mut row);
        assert_eq!(row, got, "{format:?}: prepared row");
    }

    #[test]
    fn q5_0_and_q5_1_take_the_fifth_bit_from_qh() {
        // qh bits 0 and 17: elements 0 and 17 get 16 added.
        let qh = (1u32 | 1 << 17).to_le_bytes();
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&HALF);
        b[2..6].copy_from_slice(&qh);
        b[6] = 0x3f; // element 0: 15, element 16: 3
        check(WeightFormat::Q5_0, &b, &[(0, 7.5), (16, -6.5), (1, -8.0), (17, 0.0)]);
        let mut b = vec![0u8; 24];
        b[0..2].copy_from_slice(&HALF);
        b[2..4].copy_from_slice(&ONE);
        b[4..8].copy_from_slice(&qh);
        b[8] = 0x3f;
        check(WeightFormat::Q5_1, &b, &[(0, 16.5), (16, 2.5), (1, 1.0), (17, 9.0)]);
    }

    #[test]
    fn iq4_nl_maps_nibbles_to_levels() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&TWO);
        b[2] = 0xf0; // element 0: level 0 (-127), element 16: level 15 (113)
        b[5] = 0x98; // element 3: level 8 (1), element 19: level 9 (13)
        check(WeightFormat::IQ4_NL, &b, &[(0, -254.0), (16, 226.0), (3, 2.0), (19, 26.0)]);
    }

    #[test]
    fn q2_k_layout() {
        let mut b = vec![0u8; 84];
        for j in 0..16 {
            b[j] = j as u8 | ((15 - j as u8) << 4); // scale j, min 15 - j
        }
        b[16] = 0b11_10_01_00; // elements 0, 32, 64, 96: quants 0, 1, 2, 3
        b[16 + 32 + 16 + 3] = 0b01; // second half, byte 19: element 128 + 16 + 3
        b[80..82].copy_from_slice(&ONE);
        b[82..84].copy_from_slice(&HALF);
        // d * scale * q - dmin * min, sub-block = element / 16.
        check(WeightFormat::Q2_K, &b, &[(0, -7.5), (32, -4.5), (64, 2.5), (96, 13.5), (147, 6.0), (146, -3.0)]);
    }

    #[test]
    fn q3_k_layout() {
        let mut b = vec![0u8; 110];
        b[0] = 1; // hmask[0] bit 0: element 0 is not shifted down by 4
        b[8] = 1 << 4; // hmask[8] bit 4: element 128 + 8
        b[32] = 0b11; // element 0: low bits 3
        b[32 + 32 + 8] = 0b10; // element 136: low bits 2
        // Scale 0: low nibble 5 (byte 0), top bits 3 (byte 8, bits 0-1): 53 - 32 = 21.
        // Scale 12: low nibble 0 (byte 4 high), top bits 2 (byte 8, bits 6-7): 32 - 32 = 0.
        // Every other scale: 0 - 32.
        b[96] = 0x05;
        b[96 + 8] = 0b10_00_00_11;
        b[108..110].copy_from_slice(&ONE);
        check(WeightFormat::Q3_K, &b, &[(0, 63.0), (1, -84.0), (16, 128.0), (136, -64.0), (137, 128.0), (200, 0.0)]);
    }

    /// Q4_K's and Q5_K's packed scales: sub-blocks 0..4 from the low 6 bits
    /// of bytes 0..4 (scales) and 4..8 (mins); sub-blocks 4..8 from bytes
    /// 8..12 plus the top two bits of bytes 0..8.
    fn k4_scales() -> [u8; 12] {
        // Scales 1, 2, 3, 4, 17, 1, 1, 1; mins 0, 0, 0, 0, 34, 2, 2, 2.
        [0x41, 2, 3, 4, 0x80, 0, 0, 0, 0x21, 0x21, 0x21, 0x21]
    }

    #[test]
    fn q4_k_layout() {
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&ONE);
        b[2..4].copy_from_slice(&HALF);
        b[4..16].copy_from_slice(&k4_scales());
        b[16] = 0x21; // element 0: 1 (low nibble), element 32: 2 (high)
        b[16 + 64 + 5] = 0x0f; // element 128 + 5: 15
        check(WeightFormat::Q4_K, &b, &[(0, 1.0), (32, 4.0), (133, 238.0), (134, -17.0), (160, -1.0), (1, 0.0)]);
    }

    #[test]
    fn q5_k_layout() {
        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&ONE);
        b[2..4].copy_from_slice(&HALF);
        b[4..16].copy_from_slice(&k4_scales());
        b[16] = 1 << 1; // qh[0] bit 1: element 32 gets 16
        b[16 + 5] = 1 << 4; // qh[5] bit 4: element 128 + 5 gets 16
        b[48] = 0x21;
        b[48 + 64 + 5] = 0x0f;
        check(WeightFormat::Q5_K, &b, &[(0, 1.0), (32, 36.0), (133, 510.0), (134, -17.0), (160, -1.0), (1, 0.0)]);
    }

    #[test]
    fn q6_k_layout() {
        let mut b = vec![0u8; 210];
        b[0] = 0x21; // ql[0]: element 0 low nibble 1, element 64 high nibble 2
        b[64 + 33] = 0x05; // second half, ql[33]: element 128 + 32 + 1 low nibble 5
        b[128] = 0b11_00_00_01; // qh[0]: element 0 top bits 1, element 96 top bits 3
        for j in 0..16 {
            b[192 + j] = (2 * j as i8 - 15) as u8; // scales -15, -13, ..., 15
        }
        b[208..210].copy_from_slice(&ONE);
        // d * scale[e / 16] * (q - 32).
        check(WeightFormat::Q6_K, &b, &[(0, 225.0), (64, 210.0), (96, -48.0), (161, -135.0), (1, 480.0)]);
    }

    #[test]
    fn q8_k_and_iq4_xs_layout() {
        let mut b = vec![0u8; 292];
        b[0..4].copy_from_slice(&0.25f32.to_le_bytes());
        b[4 + 7] = (-3i8) as u8;
        b[4 + 255] = 127;
        let got = deq(WeightFormat::Q8_K, &b);
        assert_eq!((got[7], got[255], got[0]), (-0.75, 31.75, 0.0));

        let mut b = vec![0u8; 136];
        b[0..2].copy_from_slice(&ONE);
        // Sub-block 0: low 0xa, top 2 -> 42 - 32 = 10; sub-block 1: low 3,
        // top 0 -> -29; sub-block 7: low 0, top 3 -> 16; others -32.
        b[2..4].copy_from_slice(&(0b11u16 << 14 | 0b10).to_le_bytes());
        b[4] = 0x3a;
        b[8] = 0x9f; // element 0: level 15 (113), element 16: level 9 (13)
        b[8 + 112 + 2] = 0x80; // element 224 + 2: level 0, element 242: level 8 (1)
        check(WeightFormat::IQ4_XS, &b, &[(0, 1130.0), (16, 130.0), (32, 3683.0), (226, -2032.0), (242, 16.0), (64, 4064.0)]);
    }

    /// The quantizers write what the dequantizers read: each value comes
    /// back within its format's step (the packing written from the
    /// quantizing side, a second reading of each layout).
    #[test]
    fn quantizers_round_trip() {
        let mut seed = 1u64;
        let x: Vec<f32> = (0..4 * QK_K)
            .map(|i| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let v = (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                if i % 97 == 0 { 4.0 * v } else { v }
            })
            .collect();
        type Quantizer = fn(&[f32], &mut Vec<u8>);
        let cases: [(WeightFormat, Quantizer, f32); 5] = [
            (WeightFormat::Q5_0, quantize_row_q5_0, 1.0 / 16.0),
            (WeightFormat::Q5_1, quantize_row_q5_1, 1.0 / 31.0),
            (WeightFormat::Q4_K, quantize_row_q4_k, 1.0 / 15.0),
            (WeightFormat::Q5_K, quantize_row_q5_k, 1.0 / 31.0),
            (WeightFormat::Q6_K, quantize_row_q6_k, 1.0 / 32.0),
        ];
        for (format, quantize, rel_step) in cases {
            let mut bytes = Vec::new();
            quantize(&x, &mut bytes);
            assert_eq!(bytes.len(), format.row_bytes(x.len()).unwrap(), "{format:?}");
            let mut y = vec![0f32; x.len()];
            dequantize_row(format, &bytes, &mut y);
            let bl = format.block_len().min(32);
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                // Half a step of the block's range, plus the 6- and 8-bit
                // rounding of the K formats' scales (a relative 1/63 of
                // the super-block's range).
                let blk = &x[i / bl * bl..(i / bl + 1) * bl];
                let sup = &x[i / format.block_len() * format.block_len()..][..format.block_len()];
                let range = |s: &[f32]| s.iter().fold(0f32, |m, v| m.max(v.abs())) * 2.0;
                let tol = range(blk) * rel_step * 0.5 + if format.is_super_block() { range(sup) * 2.0 / 63.0 } else { 1e-3 };
                assert!((a - b).abs() <= tol, "{format:?} element {i}: {a} vs {b} (tolerance {tol})");
            }
        }
    }
}
