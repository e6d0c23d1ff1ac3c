//! The x86-64 kernels behind [`super::Isa::Avx512Vnni`] and [`super::Isa::Avx2`]: panel
//! tiles of Q4 and Q8 matrices against quantized activation rows, and the float dot
//! product. Each reproduces the arithmetic of [`super::scalar`] bit for bit (the same
//! operations in the same order), so the ISA never changes a token.

use super::{PANEL, PREFETCH_BLOCKS, Q4_PANEL_BLOCK, Q5_HIGH_BLOCK, Q8_PANEL_BLOCK, QK};
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
pub(super) fn live_rows(p: usize, n: usize) -> usize {
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
pub(super) unsafe fn store512(v: __m512, out: *mut f32, n: usize, p: usize, t: usize) {
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
unsafe fn q8_tile512<const C: usize, const OFFSET: bool>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    let cols = Columns::<C>::new(xq, t);
    let mut acc = [_mm512_setzero_ps(); C];
    for b in 0..nb {
        let pb = p * nb + b;
        let wp = qs.as_ptr().add(pb * Q8_PANEL_BLOCK);
        if OFFSET {
            prefetch_ahead(wp, Q8_PANEL_BLOCK, &[d.as_ptr().wrapping_add(pb * PANEL), m.as_ptr().wrapping_add(pb * PANEL)]);
        } else {
            prefetch_ahead(wp, Q8_PANEL_BLOCK, &[d.as_ptr().wrapping_add(pb * PANEL)]);
        }
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
            if OFFSET {
                let mv = _mm512_cvtph_ps(_mm256_loadu_si256(m.as_ptr().add(pb * PANEL) as *const __m256i));
                acc[c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(*cols.s[c].add(b)), acc[c]);
            }
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
pub unsafe fn q8_panel_512(qs: &[u8], d: &[u16], m: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
    if m.is_empty() {
        column_groups!(rows, [1, 2, 3, 4, 5, 6, 7, 8], |t| q8_tile512_plain(qs, d, m, k / QK, xq, p, out, n, t));
    } else {
        column_groups!(rows, [1, 2, 3, 4, 5, 6, 7, 8], |t| q8_tile512_offset(qs, d, m, k / QK, xq, p, out, n, t));
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_tile512_plain<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    q8_tile512::<C, false>(qs, d, m, nb, xq, p, out, n, t)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_tile512_offset<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    q8_tile512::<C, true>(qs, d, m, nb, xq, p, out, n, t)
}

/// Stores the 8 lanes of `v` (rows `8h..8h+8` of panel `p`) into output
/// row `t`, leaving out rows past `n`.
#[inline(always)]
pub(super) unsafe fn store256(v: __m256, out: *mut f32, n: usize, p: usize, h: usize, t: usize) {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    let live = live_rows(p, n).saturating_sub(h * 8).min(8);
    std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(t * n + p * PANEL + h * 8), live);
}

/// One Q4-layout block of a half panel (`wp`: its first byte) unpacked:
/// register `j` holds elements `4j..4j+4` of each of the 8 rows, register
/// `j + 4` elements `16 + 4j..16 + 4j + 4` (the high nibbles).
#[inline(always)]
unsafe fn q4_half_nibbles(wp: *const u8) -> [__m256i; 8] {
    let low = _mm256_set1_epi8(0x0f);
    let mut w = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        let v = _mm256_loadu_si256(wp.add(j * 64) as *const __m256i);
        w[j] = _mm256_and_si256(v, low);
        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    w
}

/// Panel `p` of a Q4 matrix against activation rows `t..t+C` (AVX2),
/// one half panel (8 rows) at a time. `maddubs` adds pairs of products
/// (at most 2 * 15 * 127 in magnitude), so eight of them still fit 16
/// bits before one widening to 32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_tile_avx2<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    let cols = Columns::<C>::new(xq, t);
    let ones = _mm256_set1_epi16(1);
    for h in 0..2 {
        if h * 8 >= live_rows(p, n) {
            break;
        }
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let pb = p * nb + b;
            let w = q4_half_nibbles(qs.as_ptr().add(pb * Q4_PANEL_BLOCK + h * 32));
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

/// Panel `p` of a Q5 matrix against activation rows `t..t+C` (AVX2): the
/// nibbles as for Q4, each register's fifth bits shifted into place from one
/// 32-byte load. Quants up to 31 against activations up to 127 in magnitude
/// make pair sums up to 7,874, so four are summed in 16 bits (31,496), not
/// eight. Q5_0 (`m` empty) then takes `16 sum(x)` off, which gives the sums
/// of the widened Q8 form exactly, and the same float operations follow.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q5_tile_avx2<const C: usize>(qs: &[u8], qh: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    let cols = Columns::<C>::new(xq, t);
    let (fifth, ones) = (_mm256_set1_epi8(0x10), _mm256_set1_epi16(1));
    let offset = !m.is_empty();
    for h in 0..2 {
        if h * 8 >= live_rows(p, n) {
            break;
        }
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let pb = p * nb + b;
            let wp = qs.as_ptr().add(pb * Q4_PANEL_BLOCK + h * 32);
            let hp = qh.as_ptr().add(pb * Q5_HIGH_BLOCK + h * 32);
            if h == 0 {
                prefetch_ahead(wp, Q4_PANEL_BLOCK, &[d.as_ptr().wrapping_add(pb * PANEL)]);
                prefetch_ahead(hp, Q5_HIGH_BLOCK, &[]);
            }
            let hv = _mm256_loadu_si256(hp as *const __m256i);
            // Bit q of each byte of `hv` to bit 4 (the shifts are per 16 bits, but
            // move no bit across a byte boundary before the mask).
            let high = [
                _mm256_slli_epi16::<4>(hv),
                _mm256_slli_epi16::<3>(hv),
                _mm256_slli_epi16::<2>(hv),
                _mm256_slli_epi16::<1>(hv),
                hv,
                _mm256_srli_epi16::<1>(hv),
                _mm256_srli_epi16::<2>(hv),
                _mm256_srli_epi16::<3>(hv),
            ];
            let mut w = q4_half_nibbles(wp);
            for (wq, hq) in w.iter_mut().zip(high) {
                *wq = _mm256_or_si256(*wq, _mm256_and_si256(hq, fifth));
            }
            let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
            // Q5_1's offsets, once per block for every column.
            let mv = if offset { _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr().add(pb * PANEL + h * 8) as *const __m128i)) } else { _mm256_setzero_ps() };
            for c in 0..C {
                let x = cols.quads(c, b);
                let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for q in 0..4 {
                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(x.add(q).read_unaligned())));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[q + 4], _mm256_set1_epi32(x.add(q + 4).read_unaligned())));
                }
                let mut s = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
                if !offset {
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * *cols.sq[c].add(b)));
                }
                let scale = _mm256_mul_ps(dv, _mm256_set1_ps(*cols.d[c].add(b)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[c]);
                if offset {
                    acc[c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(*cols.s[c].add(b)), acc[c]);
                }
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
unsafe fn q8_tile_avx2<const C: usize, const OFFSET: bool>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
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
                if OFFSET {
                    let mv = _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr().add(pb * PANEL + h * 8) as *const __m128i));
                    acc[c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(*cols.s[c].add(b)), acc[c]);
                }
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
pub unsafe fn q5_panel_avx2(qs: &[u8], qh: &[u8], d: &[u16], m: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
    column_groups!(rows, [1, 2, 3, 4], |t| q5_tile_avx2(qs, qh, d, m, k / QK, xq, p, out, n, t));
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_panel_avx2(qs: &[u8], d: &[u16], m: &[u16], k: usize, xq: &QuantizedActs, rows: usize, p: usize, out: *mut f32, n: usize) {
    if m.is_empty() {
        column_groups!(rows, [1, 2, 3, 4], |t| q8_tile_avx2_plain(qs, d, m, k / QK, xq, p, out, n, t));
    } else {
        column_groups!(rows, [1, 2, 3, 4], |t| q8_tile_avx2_offset(qs, d, m, k / QK, xq, p, out, n, t));
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_tile_avx2_plain<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    q8_tile_avx2::<C, false>(qs, d, m, nb, xq, p, out, n, t)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_tile_avx2_offset<const C: usize>(qs: &[u8], d: &[u16], m: &[u16], nb: usize, xq: &QuantizedActs, p: usize, out: *mut f32, n: usize, t: usize) {
    q8_tile_avx2::<C, true>(qs, d, m, nb, xq, p, out, n, t)
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
