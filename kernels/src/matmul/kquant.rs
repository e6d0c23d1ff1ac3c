//! Products with the K super-block formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
//! against activations quantized to Q8_K.
//!
//! Every format is prepared into one integer form ([`KBlock`]): unsigned
//! quants, per-sub-block integer scales `sc` and mins `mn`, and f16 `d`,
//! `dmin`. Per super-block and output element the arithmetic is
//!
//! ```text
//! isum = sum_j sc[j] * dot(q_j, x_j)       (exact in i32)
//! msum = sum_j mn[j] * bsum_j(x)           (exact in i32)
//! acc  = fma(isum, d * dx, acc)
//! acc  = fma(-msum, dmin * dx, acc)
//! ```
//!
//! The integer sums are exact on every path (their bounds are below 2^31:
//! at most 16 sub-blocks of 16 x 63 x 127 times a scale of 128), so the
//! order in which a path adds them does not matter; the two fused
//! multiply-adds per super-block run in super-block order everywhere. So the
//! AVX-512, AVX2 and portable paths give the same bits, as for the legacy
//! formats.
//!
//! Layout: panels of [`PANEL`] rows as for the legacy formats (lanes are
//! rows, nothing to reduce across lanes). Quants below 16 (Q2_K, Q3_K,
//! Q4_K) stay two a byte, in the Q4 panel order per 32 elements; Q5_K and
//! Q6_K take a byte each, in the Q8 panel order (1.45x and 1.2x the bytes
//! of the file), which keeps one unpacking step for all of them.

use super::PANEL;
use crate::blocks::{KBlock, QK_K};
use crate::quant::{Q8KActs, WeightFormat};
use half::f16;

/// Bytes of quants per panel and super-block, packed two a byte or one.
const NIBBLE_BLOCK: usize = PANEL * QK_K / 2;
const BYTE_BLOCK: usize = PANEL * QK_K;

/// A K-format matrix in panels (see the module docs).
pub(super) struct KPanels {
    /// Quants below 16, two a byte.
    nibbles: bool,
    /// Sub-blocks per super-block: 8 (Q4_K, Q5_K) or 16.
    subs: usize,
    /// Super-blocks per row.
    nsb: usize,
    qs: Vec<u8>,
    /// Per panel super-block: `[subs][PANEL]`.
    sc: Vec<i8>,
    /// Per panel super-block: `[subs / 2][PANEL][2]`, pairs for a 16-bit
    /// multiply-add against two activation sums.
    mn: Vec<i16>,
    /// Per panel super-block: `[PANEL]` f16 bits.
    d: Vec<u16>,
    dmin: Vec<u16>,
}

impl KPanels {
    /// Prepares `n` rows of `k` elements of GGML bytes in `format` (one of
    /// the five K formats; the caller has checked the size).
    pub(super) fn new(format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> KPanels {
        let decode: fn(&[u8]) -> KBlock = match format {
            WeightFormat::Q2_K => KBlock::q2_k,
            WeightFormat::Q3_K => KBlock::q3_k,
            WeightFormat::Q4_K => KBlock::q4_k,
            WeightFormat::Q5_K => KBlock::q5_k,
            WeightFormat::Q6_K => KBlock::q6_k,
            other => unreachable!("{other:?} is not a K format"),
        };
        let nibbles = matches!(format, WeightFormat::Q2_K | WeightFormat::Q3_K | WeightFormat::Q4_K);
        let subs = if matches!(format, WeightFormat::Q4_K | WeightFormat::Q5_K) { 8 } else { 16 };
        let nsb = k / QK_K;
        let blocks = n.div_ceil(PANEL) * nsb;
        let mut kp = KPanels {
            nibbles,
            subs,
            nsb,
            qs: vec![0; blocks * if nibbles { NIBBLE_BLOCK } else { BYTE_BLOCK }],
            sc: vec![0; blocks * subs * PANEL],
            mn: vec![0; blocks * subs * PANEL],
            d: vec![0; blocks * PANEL],
            dmin: vec![0; blocks * PANEL],
        };
        let bb = format.block_bytes();
        for (o, row) in bytes.chunks_exact(nsb * bb).enumerate() {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                let kb = decode(blk);
                debug_assert_eq!(kb.subs, subs);
                kp.put(o, sb, &kb);
            }
        }
        kp
    }

    fn block_bytes(&self) -> usize {
        if self.nibbles {
            NIBBLE_BLOCK
        } else {
            BYTE_BLOCK
        }
    }

    /// Index of the quant byte of element `e` of panel super-block `pb`,
    /// row `r` (in the panel), and whether it is the high nibble.
    #[inline]
    fn q_index(&self, pb: usize, r: usize, e: usize) -> (usize, bool) {
        let (ch, i) = (e / 32, e % 32);
        if self.nibbles {
            let g = i % 16;
            (pb * NIBBLE_BLOCK + ch * 256 + (g / 4) * 64 + r * 4 + g % 4, i >= 16)
        } else {
            (pb * BYTE_BLOCK + ch * 512 + (i / 4) * 64 + r * 4 + i % 4, false)
        }
    }

    #[inline]
    fn q_at(&self, pb: usize, r: usize, e: usize) -> u8 {
        let (at, high) = self.q_index(pb, r, e);
        if !self.nibbles {
            self.qs[at]
        } else if high {
            self.qs[at] >> 4
        } else {
            self.qs[at] & 0x0f
        }
    }

    #[inline]
    fn sc_at(&self, pb: usize, r: usize, j: usize) -> i8 {
        self.sc[(pb * self.subs + j) * PANEL + r]
    }

    #[inline]
    fn mn_at(&self, pb: usize, r: usize, j: usize) -> i16 {
        self.mn[((pb * self.subs / 2 + j / 2) * PANEL + r) * 2 + j % 2]
    }

    fn put(&mut self, o: usize, sb: usize, kb: &KBlock) {
        let (pb, r) = ((o / PANEL) * self.nsb + sb, o % PANEL);
        for (e, &q) in kb.q.iter().enumerate() {
            let (at, high) = self.q_index(pb, r, e);
            self.qs[at] |= if high { q << 4 } else { q };
        }
        for j in 0..self.subs {
            self.sc[(pb * self.subs + j) * PANEL + r] = kb.sc[j];
            self.mn[((pb * self.subs / 2 + j / 2) * PANEL + r) * 2 + j % 2] = kb.mn[j];
        }
        self.d[pb * PANEL + r] = kb.d;
        self.dmin[pb * PANEL + r] = kb.dmin;
    }

    /// Bytes held.
    pub(super) fn size_bytes(&self) -> usize {
        self.qs.len() + self.sc.len() + 2 * (self.mn.len() + self.d.len() + self.dmin.len())
    }

    /// Row `o` as f32, with GGML's dequantization arithmetic for `format`
    /// (Q3_K and Q6_K scale the signed quant; the others subtract the min).
    pub(super) fn row_f32(&self, format: WeightFormat, o: usize, out: &mut [f32]) {
        let len = QK_K / self.subs;
        let (p, r) = (o / PANEL, o % PANEL);
        for sb in 0..self.nsb {
            let pb = p * self.nsb + sb;
            let d = f16::from_bits(self.d[pb * PANEL + r]).to_f32();
            let dmin = f16::from_bits(self.dmin[pb * PANEL + r]).to_f32();
            for e in 0..QK_K {
                let (sc, mn) = (self.sc_at(pb, r, e / len) as f32, self.mn_at(pb, r, e / len) as f32);
                let q = self.q_at(pb, r, e) as i32;
                out[sb * QK_K + e] = match format {
                    WeightFormat::Q3_K => d * sc * (q - 4) as f32,
                    WeightFormat::Q6_K => d * sc * (q - 32) as f32,
                    _ => d * sc * q as f32 - dmin * mn,
                };
            }
        }
    }
}

/// The portable path: the arithmetic of the module docs for row `o`
/// against activation row `t`.
pub(super) fn dot(kp: &KPanels, o: usize, xq: &Q8KActs, t: usize) -> f32 {
    let (q, xd) = (xq.row_q(t), xq.row_d(t));
    let bsums = if kp.subs == 8 { xq.row_bsum32(t) } else { xq.row_bsum16(t) };
    let len = QK_K / kp.subs;
    let (p, r) = (o / PANEL, o % PANEL);
    let mut acc = 0f32;
    for sb in 0..kp.nsb {
        let pb = p * kp.nsb + sb;
        let mut isum = 0i32;
        let mut msum = 0i32;
        for j in 0..kp.subs {
            let dot: i32 = (j * len..(j + 1) * len).map(|e| kp.q_at(pb, r, e) as i32 * q[sb * QK_K + e] as i32).sum();
            isum += kp.sc_at(pb, r, j) as i32 * dot;
            msum += kp.mn_at(pb, r, j) as i32 * bsums[sb * kp.subs + j] as i32;
        }
        let d = f16::from_bits(kp.d[pb * PANEL + r]).to_f32();
        let dmin = f16::from_bits(kp.dmin[pb * PANEL + r]).to_f32();
        acc = (isum as f32).mul_add(d * xd[sb], acc);
        acc = (-(msum as f32)).mul_add(dmin * xd[sb], acc);
    }
    acc
}

/// Walks activation rows in groups of up to `$max`, calling
/// `$tile::<group size, ...$g>` with the group's first row as `$t`.
macro_rules! k_column_groups {
    ($rows:expr, $max:literal, [$($g:tt)*], |$t:ident| $tile:ident $args:tt) => {{
        let mut $t = 0;
        while $t < $rows {
            let c = ($rows - $t).min($max);
            match c {
                1 => $tile::<1, $($g)*> $args,
                2 => $tile::<2, $($g)*> $args,
                3 => $tile::<3, $($g)*> $args,
                4 => $tile::<4, $($g)*> $args,
                5 if $max >= 5 => $tile::<5, $($g)*> $args,
                6 if $max >= 6 => $tile::<6, $($g)*> $args,
                7 if $max >= 7 => $tile::<7, $($g)*> $args,
                8 if $max >= 8 => $tile::<8, $($g)*> $args,
                _ => unreachable!(),
            }
            $t += c;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use super::{KPanels, PANEL, QK_K};
    use crate::matmul::simd::{live_rows, store256, store512};
    use crate::quant::Q8KActs;
    use std::arch::x86_64::*;

    /// Pointers to activation rows `t..t+C`: bytes, scales and the
    /// activation sums that match the matrix's sub-blocks.
    struct Columns<const C: usize> {
        q: [*const i8; C],
        d: [*const f32; C],
        bsums: [*const i16; C],
    }

    impl<const C: usize> Columns<C> {
        #[inline(always)]
        fn new(xq: &Q8KActs, t: usize, subs: usize) -> Self {
            Columns {
                q: std::array::from_fn(|c| xq.row_q(t + c).as_ptr()),
                d: std::array::from_fn(|c| xq.row_d(t + c).as_ptr()),
                bsums: std::array::from_fn(|c| if subs == 8 { xq.row_bsum32(t + c).as_ptr() } else { xq.row_bsum16(t + c).as_ptr() }),
            }
        }

        /// The 32 bytes of chunk `ch` of super-block `sb`, as eight groups of four.
        #[inline(always)]
        unsafe fn quads(&self, c: usize, sb: usize, ch: usize) -> *const i32 {
            self.q[c].add(sb * QK_K + ch * 32) as *const i32
        }

        /// Activation sums `2i, 2i + 1` of super-block `sb` as one 32-bit value.
        #[inline(always)]
        unsafe fn bsum_pair(&self, c: usize, sb: usize, subs: usize, i: usize) -> i32 {
            (self.bsums[c].add(sb * subs + 2 * i) as *const i32).read_unaligned()
        }
    }

    /// Four integer dot instructions: 16 elements of 16 rows.
    #[inline(always)]
    unsafe fn dots4_512(w: &[__m512i], x: *const i32) -> __m512i {
        let mut a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x.read_unaligned()));
        for q in 1..4 {
            a = _mm512_dpbusd_epi32(a, w[q], _mm512_set1_epi32(x.add(q).read_unaligned()));
        }
        a
    }

    /// Unpacks chunk `ch` (32 elements) of a panel super-block into eight
    /// registers, register `q` holding elements `4q..4q+4` of 16 rows.
    #[inline(always)]
    unsafe fn weights512<const NIB: bool>(base: *const u8, ch: usize) -> [__m512i; 8] {
        let mut w = [_mm512_setzero_si512(); 8];
        if NIB {
            let low = _mm512_set1_epi8(0x0f);
            for j in 0..4 {
                let v = _mm512_loadu_si512(base.add(ch * 256 + j * 64) as *const _);
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (g, wg) in w.iter_mut().enumerate() {
                *wg = _mm512_loadu_si512(base.add(ch * 512 + g * 64) as *const _);
            }
        }
        w
    }

    /// Panel `p` against activation rows `t..t+C` (AVX-512 VNNI).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile512<const C: usize, const NIB: bool, const SUBS: usize>(kp: &KPanels, xq: &Q8KActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t, SUBS);
        let bb = kp.block_bytes();
        let mut acc = [_mm512_setzero_ps(); C];
        for sb in 0..kp.nsb {
            let pb = p * kp.nsb + sb;
            let base = kp.qs.as_ptr().add(pb * bb);
            // The next super-block's quants (the prefetcher stops at pages).
            for line in 0..bb / 64 {
                _mm_prefetch(base.wrapping_add(bb + line * 64) as *const i8, _MM_HINT_T0);
            }
            let mut isum = [_mm512_setzero_si512(); C];
            for ch in 0..8 {
                let w = weights512::<NIB>(base, ch);
                let sc_at = |j: usize| _mm512_cvtepi8_epi32(_mm_loadu_si128(kp.sc.as_ptr().add((pb * SUBS + j) * PANEL) as *const __m128i));
                if SUBS == 8 {
                    let sc = sc_at(ch);
                    for c in 0..C {
                        let x = cols.quads(c, sb, ch);
                        let s = _mm512_add_epi32(dots4_512(&w[..4], x), dots4_512(&w[4..], x.add(4)));
                        isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(s, sc));
                    }
                } else {
                    let (sc0, sc1) = (sc_at(2 * ch), sc_at(2 * ch + 1));
                    for c in 0..C {
                        let x = cols.quads(c, sb, ch);
                        let s0 = _mm512_mullo_epi32(dots4_512(&w[..4], x), sc0);
                        let s1 = _mm512_mullo_epi32(dots4_512(&w[4..], x.add(4)), sc1);
                        isum[c] = _mm512_add_epi32(isum[c], _mm512_add_epi32(s0, s1));
                    }
                }
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(kp.d.as_ptr().add(pb * PANEL) as *const __m256i));
            let dminv = _mm512_cvtph_ps(_mm256_loadu_si256(kp.dmin.as_ptr().add(pb * PANEL) as *const __m256i));
            let mn = kp.mn.as_ptr().add(pb * SUBS * PANEL);
            for c in 0..C {
                let mut msum = _mm512_setzero_si512();
                for i in 0..SUBS / 2 {
                    let m = _mm512_loadu_si512(mn.add(i * PANEL * 2) as *const _);
                    msum = _mm512_add_epi32(msum, _mm512_madd_epi16(m, _mm512_set1_epi32(cols.bsum_pair(c, sb, SUBS, i))));
                }
                let dx = _mm512_set1_ps(*cols.d[c].add(sb));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(dv, dx), acc[c]);
                acc[c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dminv, dx), acc[c]);
            }
        }
        for c in 0..C {
            store512(acc[c], out, n, p, t + c);
        }
    }

    /// Panel `p` of a K matrix against `rows` activation rows (AVX-512 VNNI).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn panel_512(kp: &KPanels, xq: &Q8KActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        match (kp.nibbles, kp.subs) {
            (true, 8) => k_column_groups!(rows, 8, [true, 8], |t| tile512(kp, xq, p, out, n, t)),
            (true, _) => k_column_groups!(rows, 8, [true, 16], |t| tile512(kp, xq, p, out, n, t)),
            (false, 8) => k_column_groups!(rows, 8, [false, 8], |t| tile512(kp, xq, p, out, n, t)),
            (false, _) => k_column_groups!(rows, 8, [false, 16], |t| tile512(kp, xq, p, out, n, t)),
        }
    }

    /// Integer dot products of 16 elements of 8 rows (AVX2). `maddubs`
    /// adds pairs of products (at most 2 x 63 x 127), and two of those
    /// still fit 16 bits before the widening to 32.
    #[inline(always)]
    unsafe fn dots4_256(w: &[__m256i], x: *const i32) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let pair = |a: usize| {
            let p0 = _mm256_maddubs_epi16(w[a], _mm256_set1_epi32(x.add(a).read_unaligned()));
            let p1 = _mm256_maddubs_epi16(w[a + 1], _mm256_set1_epi32(x.add(a + 1).read_unaligned()));
            _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones)
        };
        _mm256_add_epi32(pair(0), pair(2))
    }

    /// Rows `8h..8h+8` of panel `p` against activation rows `t..t+C` (AVX2).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile256<const C: usize, const NIB: bool, const SUBS: usize>(kp: &KPanels, xq: &Q8KActs, p: usize, out: *mut f32, n: usize, t: usize) {
        let cols = Columns::<C>::new(xq, t, SUBS);
        let bb = kp.block_bytes();
        let low = _mm256_set1_epi8(0x0f);
        for h in 0..2 {
            if h * 8 >= live_rows(p, n) {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); C];
            for sb in 0..kp.nsb {
                let pb = p * kp.nsb + sb;
                let base = kp.qs.as_ptr().add(pb * bb + h * 32);
                let mut isum = [_mm256_setzero_si256(); C];
                for ch in 0..8 {
                    let mut w = [_mm256_setzero_si256(); 8];
                    if NIB {
                        for j in 0..4 {
                            let v = _mm256_loadu_si256(base.add(ch * 256 + j * 64) as *const __m256i);
                            w[j] = _mm256_and_si256(v, low);
                            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        }
                    } else {
                        for (g, wg) in w.iter_mut().enumerate() {
                            *wg = _mm256_loadu_si256(base.add(ch * 512 + g * 64) as *const __m256i);
                        }
                    }
                    let sc_at = |j: usize| _mm256_cvtepi8_epi32(_mm_loadl_epi64(kp.sc.as_ptr().add((pb * SUBS + j) * PANEL + h * 8) as *const __m128i));
                    if SUBS == 8 {
                        let sc = sc_at(ch);
                        for c in 0..C {
                            let x = cols.quads(c, sb, ch);
                            let s = _mm256_add_epi32(dots4_256(&w[..4], x), dots4_256(&w[4..], x.add(4)));
                            isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(s, sc));
                        }
                    } else {
                        let (sc0, sc1) = (sc_at(2 * ch), sc_at(2 * ch + 1));
                        for c in 0..C {
                            let x = cols.quads(c, sb, ch);
                            let s0 = _mm256_mullo_epi32(dots4_256(&w[..4], x), sc0);
                            let s1 = _mm256_mullo_epi32(dots4_256(&w[4..], x.add(4)), sc1);
                            isum[c] = _mm256_add_epi32(isum[c], _mm256_add_epi32(s0, s1));
                        }
                    }
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(kp.d.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                let dminv = _mm256_cvtph_ps(_mm_loadu_si128(kp.dmin.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                let mn = kp.mn.as_ptr().add(pb * SUBS * PANEL + h * 16);
                for c in 0..C {
                    let mut msum = _mm256_setzero_si256();
                    for i in 0..SUBS / 2 {
                        let m = _mm256_loadu_si256(mn.add(i * PANEL * 2) as *const __m256i);
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, _mm256_set1_epi32(cols.bsum_pair(c, sb, SUBS, i))));
                    }
                    let dx = _mm256_set1_ps(*cols.d[c].add(sb));
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_mul_ps(dv, dx), acc[c]);
                    acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dminv, dx), acc[c]);
                }
            }
            for c in 0..C {
                store256(acc[c], out, n, p, h, t + c);
            }
        }
    }

    /// Panel `p` of a K matrix against `rows` activation rows (AVX2): eight
    /// weight registers leave room for four columns.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel_avx2(kp: &KPanels, xq: &Q8KActs, rows: usize, p: usize, out: *mut f32, n: usize) {
        match (kp.nibbles, kp.subs) {
            (true, 8) => k_column_groups!(rows, 4, [true, 8], |t| tile256(kp, xq, p, out, n, t)),
            (true, _) => k_column_groups!(rows, 4, [true, 16], |t| tile256(kp, xq, p, out, n, t)),
            (false, 8) => k_column_groups!(rows, 4, [false, 8], |t| tile256(kp, xq, p, out, n, t)),
            (false, _) => k_column_groups!(rows, 4, [false, 16], |t| tile256(kp, xq, p, out, n, t)),
        }
    }
}
