//! Causal attention over the paged KV arena.
//!
//! One routine serves prefill (many query rows of one sequence, causal over
//! its cached prefix and the new tokens) and decode (one row for each of many
//! sequences of different lengths): each query row names its sequence's
//! block table and its own position, and attends to positions `0..=pos`, or
//! with a sliding window of `W` (a local layer) to `pos + 1 - W..=pos` only.
//! Keys and values are always read back from the arena (after conversion to
//! the KV dtype), never from the freshly computed f32 values, so a token's
//! result is the same whether its prefix was computed in this step, in an
//! earlier chunk, or on another node.
//!
//! The softmax is computed online, one tile of [`TILE`] key positions at a
//! time (flash-attention style): no row ever holds more than one tile of
//! scores, so at long context the work stays in the L1/L2 caches instead of
//! streaming an `n x n` score matrix through memory.

use crate::kv::{KvDtype, KvStorage};
use half::{bf16, f16, slice::{HalfBitsSliceExt, HalfFloatSliceExt}};
use crate::pool::{Pool, SendPtr};

/// One query row: the sequence's block table and the row's position.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

impl KvStorage {
    /// Keys or values of heads `heads` for slots `slots` of `block`: head
    /// `heads.start + i`, slot `slots.start + j` lands at
    /// `out[(i * stride + at + j) * head_dim..]`. Slot by slot, so the reads
    /// walk the block in memory order.
    #[allow(clippy::too_many_arguments)]
    fn read_heads_slots(&self, layer: usize, block: usize, which: usize, heads: std::ops::Range<usize>, slots: std::ops::Range<usize>, stride: usize, at: usize, out: &mut [f32]) {
        let l = &self.layout;
        let (te, hd, bt) = (l.token_elems(), l.head_dim, l.block_tokens);
        let base = self.base(block, layer) + which * bt * te;
        let dst = |i: usize, j: usize| (i * stride + at + j - slots.start) * hd;
        #[cfg(target_arch = "x86_64")]
        if let (Raw::Half(d), KvDtype::F16) = (self.raw(), l.dtype) {
            if hd % 8 == 0 && std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx") {
                let src = &d[base + slots.start * te..base + slots.end * te];
                let (h0, nh) = (heads.start, heads.len());
                assert!(heads.end * hd <= te && out.len() >= dst(nh - 1, slots.end - 1) + hd);
                // SAFETY: F16C and AVX are present; the asserts bound every read and write.
                unsafe { avx2::f16_heads_to_f32(src, te, h0 * hd, nh, hd, out.as_mut_ptr().add(dst(0, slots.start)), stride * hd) };
                return;
            }
        }
        for j in slots.clone() {
            for (i, h) in heads.clone().enumerate() {
                let src = base + j * te + h * hd;
                let o = dst(i, j);
                let dst = &mut out[o..o + hd];
                match self.raw() {
                    Raw::F32(d) => dst.copy_from_slice(&d[src..src + hd]),
                    Raw::Half(d) => match l.dtype {
                        KvDtype::F16 => d[src..src + hd].reinterpret_cast::<f16>().convert_to_f32_slice(dst),
                        _ => d[src..src + hd].reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
                    },
                    Raw::Byte(d) => crate::fp8::decode_slice(&d[src..src + hd], dst),
                }
            }
        }
    }

    /// The f16 bits of slots `slot..slot + n` of `block`'s keys (`which == 0`)
    /// or values in `layer`, every head of each slot, when the arena holds f16.
    fn f16_slots(&self, layer: usize, block: usize, which: usize, slot: usize, n: usize) -> Option<&[u16]> {
        let l = &self.layout;
        let te = l.token_elems();
        let start = self.base(block, layer) + (which * l.block_tokens + slot) * te;
        match (self.raw(), l.dtype) {
            (Raw::Half(d), KvDtype::F16) => Some(&d[start..start + n * te]),
            _ => None,
        }
    }

    /// Keys or values of heads `heads` at positions `range` of a sequence
    /// (`table` its block table): position `range.start + j` of head
    /// `heads.start + i` lands at `out[(i * stride + j) * head_dim..]`.
    #[allow(clippy::too_many_arguments)]
    fn read_positions(&self, layer: usize, table: &[u32], which: usize, heads: std::ops::Range<usize>, range: std::ops::Range<usize>, stride: usize, out: &mut [f32]) {
        let bt = self.layout.block_tokens;
        let mut p = range.start;
        while p < range.end {
            let (block, slot) = (p / bt, p % bt);
            let n = (bt - slot).min(range.end - p);
            self.read_heads_slots(layer, table[block] as usize, which, heads.clone(), slot..slot + n, stride, p - range.start, out);
            p += n;
        }
    }
}

/// Borrowed view of the arena's elements.
pub(crate) enum Raw<'a> {
    F32(&'a [f32]),
    Half(&'a [u16]),
    /// FP8 E4M3 bytes.
    Byte(&'a [u8]),
}

#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    crate::matmul::hsum8(acc)
}

/// Consecutive query rows of one sequence processed together, so each key
/// and value tile is read (and converted) once for all of them.
const ROW_GROUP: usize = 16;

/// Key positions per tile of the online softmax. Tiles start at multiples of
/// `TILE` (absolute positions, whatever the block size), so the tiles a row
/// is cut into, and therefore its arithmetic, depend on the row alone. For
/// each tile `t` that meets the row's range, over the row's positions `j`
/// in it, in order:
///
/// - `s_j = dot8(q, k_j) * scale`, `m_t = max(m, max_j s_j)`;
/// - `w_j = exp(s_j - m_t)` ([`crate::exp::exp`]);
/// - when `t` is not the row's first tile and `m_t != m`:
///   `c = exp(m - m_t)`, `sum *= c`, `acc *= c` (elementwise);
/// - `sum += sum8(w)`, then `acc += w_j * v_j` for each `j` in order.
///
/// The output is `acc * (1 / sum)`.
const TILE: usize = 64;

/// Positions of a tile worked for every row of a run before the next (see
/// `Task::run_heads`): 16 positions of a 256-wide head are 16 KiB, half of
/// a typical L1 data cache.
const SLICE: usize = 16;

/// `out[r]` = attention of query row `r` (`n_heads x head_dim`, already
/// rotated) over its sequence's keys and values at positions `0..=pos`
/// (with `window: Some(w)`, only the last `w` of them: blocks before are not read).
///
/// Rows of one sequence are grouped to share KV reads; the arithmetic of
/// each row is the same whatever its group (see [`TILE`]).
#[allow(clippy::too_many_arguments)]
pub fn attention(pool: &Pool, kv: &KvStorage, layer: usize, q: &[f32], rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut [f32]) {
    let l = &kv.layout;
    let (hd, kvh) = (l.head_dim, l.kv_heads);
    let width = n_heads * hd;
    assert!(q.len() >= rows.len() * width && out.len() >= rows.len() * width);
    // Split rows into runs that share a block table, at most ROW_GROUP long.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut j = i + 1;
        while j < rows.len() && j - i < ROW_GROUP && std::ptr::eq(rows[j].block_table, rows[i].block_table) {
            j += 1;
        }
        runs.push((i, j));
        i = j;
    }
    let ptr = SendPtr(out.as_mut_ptr());
    // With runs enough to keep every thread busy (a decode batch), one task
    // takes every KV head of its run, so it reads each block's keys (and
    // values) as one contiguous stretch instead of a third of every slot;
    // otherwise one task per (run, KV head). Each row's arithmetic is the same.
    let heads_per_task = if runs.len() >= 4 * pool.threads() { kvh } else { 1 };
    #[cfg(target_arch = "x86_64")]
    let direct = l.dtype == KvDtype::F16 && hd.is_multiple_of(16) && simd();
    #[cfg(not(target_arch = "x86_64"))]
    let direct = false;
    let task = Task { kv, layer, q, rows, runs: &runs, n_heads, scale, window, heads_per_task, direct };
    let tasks = runs.len() * (kvh / heads_per_task);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        pool.run(tasks, &|i| unsafe { task.run_avx2(i, ptr) });
        return;
    }
    pool.run(tasks, &|i| task.run(i, ptr));
}

/// What every task of one [`attention`] call shares; with `k` KV heads per
/// run split into groups of `heads_per_task`, task `i` computes run
/// `i / (k / heads_per_task)` for the `(i % (k / heads_per_task))`-th group.
struct Task<'a> {
    kv: &'a KvStorage,
    layer: usize,
    q: &'a [f32],
    rows: &'a [AttnRow<'a>],
    runs: &'a [(usize, usize)],
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    heads_per_task: usize,
    /// A run of one row (a decode row) reads f16 keys and values straight
    /// from the arena, converting each chunk in registers where it is used:
    /// converted to a slice first, every element would be stored and loaded
    /// once more, for a single row's use (on Zen 3 that round trip was half of
    /// a decode step's attention).
    direct: bool,
}

impl Task<'_> {
    /// [`Self::run`] compiled with AVX2: the same operations in the same
    /// order (no FMA contraction), eight lanes wide, so results are equal.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self, i: usize, out: SendPtr<f32>) {
        self.run(i, out)
    }

    #[inline(always)]
    fn run(&self, task: usize, p: SendPtr<f32>) {
        let groups = self.kv.layout.kv_heads / self.heads_per_task;
        let first = (task % groups) * self.heads_per_task;
        self.run_heads(self.runs[task / groups], first..first + self.heads_per_task, p);
    }

    /// First position row `row` attends to.
    #[inline(always)]
    fn first(&self, row: &AttnRow) -> usize {
        self.window.map_or(0, |w| (row.pos + 1).saturating_sub(w))
    }

    /// Run `(r0, r1)` of rows for KV heads `heads` (KV head `h` serves query
    /// heads `h * group .. (h + 1) * group`), one key tile at a time (see
    /// [`TILE`] for the arithmetic every row follows).
    #[inline(always)]
    fn run_heads(&self, (r0, r1): (usize, usize), heads: std::ops::Range<usize>, p: SendPtr<f32>) {
        let (kv, layer, q, rows, scale) = (self.kv, self.layer, self.q, &self.rows[r0..r1], self.scale);
        let l = &kv.layout;
        let (hd, kvh) = (l.head_dim, l.kv_heads);
        let group = self.n_heads / kvh;
        let width = self.n_heads * hd;
        let table = rows[0].block_table;
        let (nh, h0) = (heads.len(), heads.start);
        // Per row, the query heads of `heads` in order: index (ri * nh + i) * group + g.
        let nq = rows.len() * nh * group;
        let lo = rows.iter().map(|r| self.first(r)).min().unwrap_or(0);
        let hi = rows.iter().map(|r| r.pos + 1).max().unwrap_or(0);
        // One slice of keys or values, converted to f32: small enough to stay
        // in L1 between its conversion and its use (a whole tile of every KV
        // head, in a decode batch, is 48-96 KiB).
        let mut keys = vec![0f32; nh * SLICE * hd];
        let mut values = vec![0f32; nh * SLICE * hd];
        // One tile's scores (then weights) per query head; its running max,
        // weight sum and weighted values.
        let mut s = vec![0f32; nq * TILE];
        let mut max = vec![f32::NEG_INFINITY; nq];
        let mut sum = vec![0f32; nq];
        let mut acc = vec![0f32; nq * hd];
        // The row's part of tile `t0` (positions `ra..rb`), if any.
        let part = |row: &AttnRow, t0: usize| {
            let (ra, rb) = (t0.max(self.first(row)), (t0 + TILE).min(row.pos + 1));
            (ra < rb).then_some((ra, rb))
        };
        // The rows with positions in slice `s0..s1` of tile `t0`: (row index,
        // the row's first position in the tile, the slice's part of the row).
        let slice_rows = |t0: usize, s0: usize, s1: usize| {
            rows.iter().enumerate().filter_map(move |(ri, row)| {
                let (ra, rb) = part(row, t0)?;
                let (x0, x1) = (s0.max(ra), s1.min(rb));
                (x0 < x1).then_some((ri, ra, x0, x1))
            })
        };
        let (te, bt) = (l.token_elems(), l.block_tokens);
        let direct = self.direct && rows.len() == 1;
        // The slices of `a..b`: SLICE positions, and (read in place) within one block.
        let slices = |a: usize, b: usize| {
            let mut s0 = a;
            std::iter::from_fn(move || {
                let s1 = (s0 + SLICE).min(b).min(if direct { (s0 / bt + 1) * bt } else { usize::MAX });
                let r = (s0 < b).then_some((s0, s1));
                s0 = s1;
                r
            })
        };
        // Direct reads: keys (0) or values (1) at positions `x0..x1` of one
        // block, every head of each slot, in the arena.
        let in_arena = |which: usize, x0: usize, x1: usize| kv.f16_slots(layer, table[x0 / bt] as usize, which, x0 % bt, x1 - x0).expect("direct reads need an f16 arena");
        // Direct reads walk a slice head by head, a stride the hardware
        // prefetcher follows poorly: ask for the tile's first slice, and for
        // the next slice while this one is worked.
        let ask_ahead = |which: usize, s0: usize, s1: usize, a: usize, b: usize| {
            if s0 == a {
                prefetch(in_arena(which, s0, s1));
            }
            if let Some((n0, n1)) = slices(s1, b).next() {
                prefetch(in_arena(which, n0, n1));
            }
        };
        let mut t0 = lo / TILE * TILE;
        while t0 < hi {
            let (a, b) = (t0.max(lo), (t0 + TILE).min(hi));
            // The tile is worked in slices of SLICE positions, each slice
            // for every row before the next: a slice of one head's keys (or
            // values) stays in L1 while every row of the run reads it, where
            // a whole tile per row would stream from L2. Each query's own
            // operations and their order are unchanged (scores are
            // independent; values are added in position order).
            for (s0, s1) in slices(a, b) {
                if direct {
                    ask_ahead(0, s0, s1, a, b);
                } else {
                    kv.read_positions(layer, table, 0, heads.clone(), s0..s1, SLICE, &mut keys);
                }
                for (ri, ra, x0, x1) in slice_rows(t0, s0, s1) {
                    let qrow = &q[(r0 + ri) * width..(r0 + ri + 1) * width];
                    // Direct reads: the keys of every head at x0..x1, in place.
                    #[cfg(target_arch = "x86_64")]
                    let slots = if direct { in_arena(0, x0, x1) } else { &[] };
                    for i in 0..nh {
                        let k = (ri * nh + i) * group;
                        // The query heads of KV head h0 + i, consecutive in the row.
                        let qh = &qrow[(h0 + i) * group * hd..(h0 + i + 1) * group * hd];
                        let out = &mut s[k * TILE + x0 - ra..(k + group) * TILE];
                        if direct {
                            #[cfg(target_arch = "x86_64")]
                            {
                                let src = &slots[(h0 + i) * hd..];
                                assert!(src.len() >= (x1 - x0 - 1) * te + hd);
                                // SAFETY: `direct` implies AVX2 and F16C; key j is
                                // `src[j * te..][..hd]`, in bounds (asserted).
                                unsafe { scores_group_simd(qh, hd, src.as_ptr(), te, x1 - x0, scale, out) };
                            }
                        } else {
                            scores_heads(qh, &keys[(i * SLICE + x0 - s0) * hd..], hd, x1 - x0, scale, out);
                        }
                    }
                }
            }
            // The tile's softmax step, query by query.
            for (ri, row) in rows.iter().enumerate() {
                let Some((ra, rb)) = part(row, t0) else { continue };
                for k in ri * nh * group..(ri + 1) * nh * group {
                    let sk = &mut s[k * TILE..k * TILE + rb - ra];
                    let tile_max = sk.iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
                    let m = max[k].max(tile_max);
                    crate::exp::exp_shifted(sk, m);
                    // The row's first tile starts from nothing; a later one
                    // rescales what came before when the maximum rose.
                    if max[k] != f32::NEG_INFINITY && m != max[k] {
                        let c = crate::exp::exp(max[k] - m);
                        sum[k] *= c;
                        acc[k * hd..(k + 1) * hd].iter_mut().for_each(|x| *x *= c);
                    }
                    max[k] = m;
                    sum[k] += sum8(sk);
                }
            }
            for (s0, s1) in slices(a, b) {
                if direct {
                    ask_ahead(1, s0, s1, a, b);
                } else {
                    kv.read_positions(layer, table, 1, heads.clone(), s0..s1, SLICE, &mut values);
                }
                for (ri, ra, x0, x1) in slice_rows(t0, s0, s1) {
                    // Direct reads: the values of every head at x0..x1, in place.
                    #[cfg(target_arch = "x86_64")]
                    let slots = if direct { in_arena(1, x0, x1) } else { &[] };
                    for i in 0..nh {
                        let k = (ri * nh + i) * group;
                        let (a, w) = (&mut acc[k * hd..(k + group) * hd], &s[k * TILE..(k + group) * TILE]);
                        if direct {
                            #[cfg(target_arch = "x86_64")]
                            {
                                let src = &slots[(h0 + i) * hd..];
                                assert!(src.len() >= (x1 - x0 - 1) * te + hd && w.len() >= (group - 1) * TILE + x1 - ra);
                                // SAFETY: `direct` implies AVX2, F16C and `hd` a
                                // multiple of 16; value j is `src[j * te..][..hd]`,
                                // the weights `w[g * TILE..][x0 - ra..x1 - ra]` (asserted).
                                unsafe { accumulate_heads_simd(a, w.as_ptr().add(x0 - ra), x1 - x0, src.as_ptr(), te, hd) };
                            }
                        } else {
                            accumulate_heads(a, w, x0 - ra..x1 - ra, &values[(i * SLICE + x0 - s0) * hd..], hd);
                        }
                    }
                }
            }
            t0 += TILE;
        }
        // Query head `k` of a row's `nh * group` is head `h0 * group + k` of the model.
        let per_row = nh * group;
        for (k, (a, total)) in acc.chunks_exact(hd).zip(&sum).enumerate() {
            let inv = 1.0 / total;
            let (ri, head) = (k / per_row, h0 * group + k % per_row);
            for (d, v) in a.iter().enumerate() {
                // SAFETY: this task alone writes query heads h0*group..(h0+nh)*group
                // of the run's rows, inside `out` (asserted in `attention`).
                unsafe { *p.0.add((r0 + ri) * width + head * hd + d) = v * inv };
            }
        }
    }
}

/// The weights' sum in a fixed order: eight lanes, `w[j]` added to lane
/// `j % 8` in order, then [`crate::matmul::hsum8`].
#[inline(always)]
fn sum8(w: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    for (l, v) in chunks.remainder().iter().enumerate() {
        lanes[l] += v;
    }
    crate::matmul::hsum8(lanes)
}

/// `out[j] = dot8(qh, key j) * scale` for the first `m` keys of `keys` (rows of
/// `hd`). Four keys at a time with independent accumulators, so the adds do
/// not wait on each other; each score's arithmetic is exactly [`dot8`]'s.
#[inline(always)]
fn scores_into(qh: &[f32], keys: &[f32], hd: usize, m: usize, scale: f32, out: &mut [f32]) {
    let chunks = hd / 8;
    let mut j = 0;
    while j + 4 <= m {
        let mut acc = [[0f32; 8]; 4];
        for c in 0..chunks {
            let qc: &[f32; 8] = qh[c * 8..c * 8 + 8].try_into().unwrap();
            for (t, at) in acc.iter_mut().enumerate() {
                let o = (j + t) * hd + c * 8;
                let kc: &[f32; 8] = keys[o..o + 8].try_into().unwrap();
                for l in 0..8 {
                    at[l] += qc[l] * kc[l];
                }
            }
        }
        for (t, at) in acc.into_iter().enumerate() {
            out[j + t] = crate::matmul::hsum8(at) * scale;
        }
        j += 4;
    }
    for j in j..m {
        out[j] = dot8(qh, &keys[j * hd..(j + 1) * hd]) * scale;
    }
}

/// Explicit AVX2 forms where the compiler's own vectorization of the plain
/// loops is poor. Lane for lane the same operations as the plain code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`crate::matmul::hsum8`] of the eight lanes, in its order:
    /// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn hsum8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<1>(t, t)))
    }

    /// [`hsum8`] of eight vectors at once, lane `t` of the result from
    /// `v[t]`, in hsum8's order `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`:
    /// a transposing add network, about three operations per sum instead of eight.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn hsum8x8(v: [__m256; 8]) -> __m256 {
        // b_i = a_i + a_(i+4): vectors t and t+4 side by side (t in the low half).
        let half = |x: __m256, y: __m256| _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y));
        // Reordered (b0, b2, b1, b3) so that each hadd pairs b0 with b2 and b1 with b3.
        let order = |x: __m256| _mm256_permute_ps::<0b11_01_10_00>(x);
        let (s04, s15, s26, s37) = (order(half(v[0], v[4])), order(half(v[1], v[5])), order(half(v[2], v[6])), order(half(v[3], v[7])));
        _mm256_hadd_ps(_mm256_hadd_ps(s04, s15), _mm256_hadd_ps(s26, s37))
    }

    /// Eight keys' or values' elements as f32: from an f32 slice, or from f16
    /// bits (converted exactly, so the arithmetic on them is the same).
    pub trait Lanes: Copy {
        /// Query heads [`scores_group`] takes at once: three (12 accumulators,
        /// one spilled) pays where each key chunk costs a conversion, not where
        /// it is a plain load.
        const MAX_HEADS: usize;
        /// # Safety
        /// AVX2 and F16C present; `p` readable for eight elements.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Lanes for f32 {
        const MAX_HEADS: usize = 2;
        #[target_feature(enable = "avx2,f16c")]
        #[inline]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }

    impl Lanes for u16 {
        const MAX_HEADS: usize = 3;
        #[target_feature(enable = "avx2,f16c")]
        #[inline]
        unsafe fn load8(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
    }

    /// Four keys (`k + t * ks`, `t < 4`) against `G` queries: per query and
    /// key, lane sums of `q * k` over the chunks in order, multiply then add.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn dot4<const G: usize, T: Lanes>(q: *const f32, hd: usize, k: *const T, ks: usize) -> [[__m256; 4]; G] {
        let mut a = [[_mm256_setzero_ps(); 4]; G];
        for c in (0..hd).step_by(8) {
            let mut x = [_mm256_setzero_ps(); G];
            for (g, xg) in x.iter_mut().enumerate() {
                *xg = _mm256_loadu_ps(q.add(g * hd + c));
            }
            for t in 0..4 {
                let kt = T::load8(k.add(t * ks + c));
                for g in 0..G {
                    a[g][t] = _mm256_add_ps(a[g][t], _mm256_mul_ps(x[g], kt));
                }
            }
        }
        a
    }

    /// [`super::scores_into`] for `G` consecutive query heads (`q + g * hd`)
    /// over the same `m` keys (key `j` at `k + j * ks`), scores to
    /// `out + g * out_stride + j`: each key chunk is loaded (and, from f16,
    /// converted) once for all `G`. Each score's arithmetic is exactly
    /// [`super::dot8`]'s times `scale`.
    ///
    /// # Safety
    /// AVX2 and F16C present; `hd` a multiple of 8; `q` readable for `G * hd`,
    /// `k + j * ks` for `hd` and `out + g * out_stride + j` writable for each
    /// `j < m`, `g < G`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn scores_group<const G: usize, T: Lanes>(q: *const f32, hd: usize, k: *const T, ks: usize, m: usize, scale: f32, out: *mut f32, out_stride: usize) {
        let sc = _mm256_set1_ps(scale);
        let mut j = 0;
        while j + 8 <= m {
            let (lo, hi) = (dot4::<G, T>(q, hd, k.add(j * ks), ks), dot4::<G, T>(q, hd, k.add((j + 4) * ks), ks));
            for g in 0..G {
                let v = [lo[g][0], lo[g][1], lo[g][2], lo[g][3], hi[g][0], hi[g][1], hi[g][2], hi[g][3]];
                _mm256_storeu_ps(out.add(g * out_stride + j), _mm256_mul_ps(hsum8x8(v), sc));
            }
            j += 8;
        }
        while j + 4 <= m {
            let a = dot4::<G, T>(q, hd, k.add(j * ks), ks);
            for (g, ag) in a.iter().enumerate() {
                for (t, &at) in ag.iter().enumerate() {
                    *out.add(g * out_stride + j + t) = hsum8(at) * scale;
                }
            }
            j += 4;
        }
        while j < m {
            for g in 0..G {
                let mut a = _mm256_setzero_ps();
                for c in (0..hd).step_by(8) {
                    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q.add(g * hd + c)), T::load8(k.add(j * ks + c))));
                }
                *out.add(g * out_stride + j) = hsum8(a) * scale;
            }
            j += 1;
        }
    }

    /// IEEE half to single precision (exact), eight at a time, for every slot
    /// of `src` (slots of `te` elements) and `nh` heads of `hd` from element
    /// `first` of each slot: head `i` of slot `j` lands at
    /// `dst + i * head_stride + j * hd`. One call per block, where a call per
    /// head and slot cost more in dispatch than the conversion itself.
    ///
    /// # Safety
    /// F16C and AVX present; `src` holds whole slots, `first + nh * hd <= te`,
    /// and `dst` is writable at every place named above.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn f16_heads_to_f32(src: &[u16], te: usize, first: usize, nh: usize, hd: usize, dst: *mut f32, head_stride: usize) {
        debug_assert!(hd.is_multiple_of(8) && first + nh * hd <= te && src.len().is_multiple_of(te));
        for (j, slot) in src.chunks_exact(te).enumerate() {
            let s = slot.as_ptr().add(first);
            for i in 0..nh {
                let (from, to) = (s.add(i * hd), dst.add(i * head_stride + j * hd));
                for c in (0..hd).step_by(8) {
                    _mm256_storeu_ps(to.add(c), _mm256_cvtph_ps(_mm_loadu_si128(from.add(c) as *const __m128i)));
                }
            }
        }
    }

    /// [`super::accumulate`] for `G` heads over the same `m` values (rows of
    /// `hd`): head `g`'s accumulator is at `acc + g * hd`, its weights at
    /// `w + g * w_stride`. Sixteen columns at a time, so the `2 G`
    /// accumulators stay in registers across all `m` values and each value
    /// chunk is loaded once for the `G` heads. Per element: `a = a + p * v`,
    /// multiply then add, in value order.
    ///
    /// Value `j` is at `vals + j * vs`: the f32 slice (`vs == hd`) or, in a
    /// decode row, f16 straight from the arena (`vs` the slot's elements).
    ///
    /// # Safety
    /// AVX2 and F16C present; `hd` a multiple of 16; `acc` writable for `G * hd`,
    /// `w + g * w_stride` readable for `m`, `vals + j * vs` readable for `hd`
    /// for each `j < m`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn accumulate_heads<const G: usize, T: Lanes>(acc: *mut f32, hd: usize, w: *const f32, w_stride: usize, m: usize, vals: *const T, vs: usize) {
        for c in (0..hd).step_by(16) {
            let mut r = [[_mm256_setzero_ps(); 2]; G];
            for (g, rg) in r.iter_mut().enumerate() {
                *rg = [_mm256_loadu_ps(acc.add(g * hd + c)), _mm256_loadu_ps(acc.add(g * hd + c + 8))];
            }
            for j in 0..m {
                let v = vals.add(j * vs + c);
                let (v0, v1) = (T::load8(v), T::load8(v.add(8)));
                for (g, rg) in r.iter_mut().enumerate() {
                    let p = _mm256_broadcast_ss(&*w.add(g * w_stride + j));
                    rg[0] = _mm256_add_ps(rg[0], _mm256_mul_ps(p, v0));
                    rg[1] = _mm256_add_ps(rg[1], _mm256_mul_ps(p, v1));
                }
            }
            for (g, rg) in r.iter().enumerate() {
                _mm256_storeu_ps(acc.add(g * hd + c), rg[0]);
                _mm256_storeu_ps(acc.add(g * hd + c + 8), rg[1]);
            }
        }
    }
}

/// [`accumulate`] for the query heads that share one KV head: head `g`'s
/// accumulator is `acc[g * hd..][..hd]` and its weights are
/// `w[g * TILE..][span]`, all over the same values. On AVX2 up to four heads
/// are worked together, so each value chunk is loaded once for all of them;
/// every element's operations and their order are [`accumulate`]'s.
#[inline(always)]
fn accumulate_heads(acc: &mut [f32], w: &[f32], span: std::ops::Range<usize>, vals: &[f32], hd: usize) {
    let heads = acc.len() / hd;
    #[cfg(target_arch = "x86_64")]
    if heads > 1 && hd.is_multiple_of(16) && simd() {
        assert!(w.len() >= (heads - 1) * TILE + span.end && span.start <= span.end && vals.len() >= span.len() * hd);
        // SAFETY: AVX2 and F16C are present; the heads' weights over `span`
        // and `span.len()` values of `hd` are in bounds (asserted above).
        unsafe { accumulate_heads_simd(acc, w[span.start..].as_ptr(), span.len(), vals.as_ptr(), hd, hd) };
        return;
    }
    for g in 0..heads {
        accumulate(&mut acc[g * hd..(g + 1) * hd], &w[g * TILE + span.start..g * TILE + span.end], vals, hd);
    }
}

/// [`accumulate_heads`] for `acc.len() / hd` heads over `m` values (value `j`
/// at `vals + j * vs`, f32 or f16 bits), head `g`'s weights at `w + g * TILE`:
/// up to four heads at a time, each value chunk loaded once for all of them.
///
/// # Safety
/// AVX2 and F16C present; `hd` a multiple of 16; `w + g * TILE` readable for
/// `m` for every head `g`, `vals + j * vs` readable for `hd` for each `j < m`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_heads_simd<T: avx2::Lanes>(acc: &mut [f32], w: *const f32, m: usize, vals: *const T, vs: usize, hd: usize) {
    let heads = acc.len() / hd;
    let mut g = 0;
    while g < heads {
        let n = (heads - g).min(4);
        let (a, p) = (acc[g * hd..].as_mut_ptr(), w.add(g * TILE));
        match n {
            4 => avx2::accumulate_heads::<4, T>(a, hd, p, TILE, m, vals, vs),
            3 => avx2::accumulate_heads::<3, T>(a, hd, p, TILE, m, vals, vs),
            2 => avx2::accumulate_heads::<2, T>(a, hd, p, TILE, m, vals, vs),
            _ => avx2::accumulate_heads::<1, T>(a, hd, p, TILE, m, vals, vs),
        }
        g += n;
    }
}

/// Scores of the `qh.len() / hd` query heads of one KV head against `m`
/// keys (rows of `hd` in `keys`): head `g`'s score of key `j` to
/// `out[g * TILE + j]`, each exactly [`scores_into`]'s.
#[inline(always)]
fn scores_heads(qh: &[f32], keys: &[f32], hd: usize, m: usize, scale: f32, out: &mut [f32]) {
    let heads = qh.len() / hd;
    assert!(m == 0 || (keys.len() >= m * hd && out.len() >= (heads - 1) * TILE + m));
    #[cfg(target_arch = "x86_64")]
    if simd() && hd.is_multiple_of(8) {
        // SAFETY: AVX2 and F16C are present; keys, queries and outputs are
        // in bounds (asserted above).
        return unsafe { scores_group_simd(qh, hd, keys.as_ptr(), hd, m, scale, out) };
    }
    for g in 0..heads {
        scores_into(&qh[g * hd..(g + 1) * hd], keys, hd, m, scale, &mut out[g * TILE..]);
    }
}

/// [`scores_heads`] with key `j` at `k + j * ks` (f32, or f16 bits straight
/// from the arena): up to three heads at a time (two and two for four), so
/// each key chunk is loaded and converted once for them.
///
/// # Safety
/// AVX2 and F16C present; `hd` a multiple of 8; `k + j * ks` readable for
/// `hd` for each `j < m`; `out` as [`scores_heads`] asserts.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_group_simd<T: avx2::Lanes>(qh: &[f32], hd: usize, k: *const T, ks: usize, m: usize, scale: f32, out: &mut [f32]) {
    let heads = qh.len() / hd;
    assert!(m == 0 || out.len() >= (heads - 1) * TILE + m);
    let mut g = 0;
    while g < heads {
        let n = match heads - g {
            4 => 2,
            r => r.min(T::MAX_HEADS),
        };
        let (q, o) = (qh[g * hd..].as_ptr(), out[g * TILE..].as_mut_ptr());
        match n {
            3 => avx2::scores_group::<3, T>(q, hd, k, ks, m, scale, o, TILE),
            2 => avx2::scores_group::<2, T>(q, hd, k, ks, m, scale, o, TILE),
            _ => avx2::scores_group::<1, T>(q, hd, k, ks, m, scale, o, TILE),
        }
        g += n;
    }
}

/// Asks the CPU for every cache line of `data` (a hint; nothing is read).
#[inline(always)]
fn prefetch(data: &[u16]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(32) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: the address is inside `data`; a prefetch reads nothing.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// AVX2 and F16C, the explicit kernels' features (F16C comes with every AVX2 CPU).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn simd() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
}

/// `a += p[j] * value j` for each `j` in order (values are rows of `hd`). For
/// head sizes that are a multiple of 64 the accumulator is worked 64 columns
/// at a time, held in registers across `j`; the per-element order of
/// operations is the same either way.
#[inline(always)]
fn accumulate(a: &mut [f32], p: &[f32], vals: &[f32], hd: usize) {
    if hd.is_multiple_of(64) {
        for c in (0..hd).step_by(64) {
            accumulate_columns::<64>(&mut a[c..c + 64], p, &vals[c..], hd);
        }
        return;
    }
    for (j, &pj) in p.iter().enumerate() {
        for (x, &v) in a.iter_mut().zip(&vals[j * hd..(j + 1) * hd]) {
            *x += pj * v;
        }
    }
}

/// [`accumulate`] for `W` columns: value `j`'s are `vals[j * stride..][..W]`.
#[inline(always)]
fn accumulate_columns<const W: usize>(a: &mut [f32], p: &[f32], vals: &[f32], stride: usize) {
    let mut r: [f32; W] = a[..W].try_into().unwrap();
    for (j, &pj) in p.iter().enumerate() {
        let v: &[f32; W] = vals[j * stride..j * stride + W].try_into().unwrap();
        for d in 0..W {
            r[d] += pj * v[d];
        }
    }
    a[..W].copy_from_slice(&r);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// The arithmetic the kernel promises (see [`TILE`]), written plainly,
    /// one position at a time. The kernel must equal it bit for bit (its
    /// grouping of rows, its reordering of independent work and its SIMD
    /// widths may not change a result).
    fn plain(kv: &KvStorage, q: &[f32], table: &[u32], pos: usize, nh: usize, scale: f32, window: Option<usize>) -> Vec<f32> {
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let l = &kv.layout;
        let (hd, group) = (l.head_dim, nh / l.kv_heads);
        let read = |which: usize, h: usize, j: usize| {
            let mut b = vec![0f32; hd];
            let (block, slot) = (table[j / l.block_tokens] as usize, j % l.block_tokens);
            kv.read_heads_slots(0, block, which, h..h + 1, slot..slot + 1, 1, 0, &mut b);
            b
        };
        let mut out = vec![0f32; nh * hd];
        for head in 0..nh {
            let h = head / group;
            let qh = &q[head * hd..(head + 1) * hd];
            let (mut max, mut sum, mut a) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
            let mut t0 = first / TILE * TILE;
            while t0 <= pos {
                let range = t0.max(first)..(t0 + TILE).min(pos + 1);
                let scores: Vec<f32> = range.clone().map(|j| dot8(qh, &read(0, h, j)) * scale).collect();
                let m = scores.iter().fold(max, |x, &y| x.max(y));
                let w: Vec<f32> = scores.iter().map(|s| crate::exp::exp(s - m)).collect();
                if max != f32::NEG_INFINITY && m != max {
                    let c = crate::exp::exp(max - m);
                    sum *= c;
                    a.iter_mut().for_each(|x| *x *= c);
                }
                max = m;
                let mut lanes = [0f32; 8];
                for (j, v) in w.iter().enumerate() {
                    lanes[j % 8] += v;
                }
                sum += crate::matmul::hsum8(lanes);
                for (wj, j) in w.iter().zip(range) {
                    for (x, v) in a.iter_mut().zip(read(1, h, j)) {
                        *x += wj * v;
                    }
                }
                t0 += TILE;
            }
            for d in 0..hd {
                out[head * hd + d] = a[d] * (1.0 / sum);
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn half_conversion_is_exact_for_every_number() {
        if !(std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx")) {
            return;
        }
        let bits: Vec<u16> = (0..=u16::MAX).filter(|&b| !f16::from_bits(b).is_nan()).collect();
        let n = bits.len() / 8 * 8;
        let mut got = vec![0f32; n];
        // One slot of one head holding every number.
        unsafe { avx2::f16_heads_to_f32(&bits[..n], n, 0, 1, n, got.as_mut_ptr(), 0) };
        for (b, g) in bits[..n].iter().zip(&got) {
            assert_eq!(g.to_bits(), f16::from_bits(*b).to_f32().to_bits(), "half {b:#06x}");
        }
    }

    #[test]
    fn equals_the_plain_arithmetic_bit_for_bit() {
        // (head_dim, dtype, window, query heads, KV heads): groups of 1, 2, 3,
        // 4 and 7 query heads per KV head (the AVX2 value sums take up to
        // four heads at a time, so 7 is a four and a three).
        let cases = [
            (64, KvDtype::F16, None, 9, 3),
            (128, KvDtype::F32, None, 4, 2),
            (24, KvDtype::BF16, None, 9, 3),
            (256, KvDtype::F16, Some(20), 4, 1),
            (64, KvDtype::F32, Some(1), 7, 1),
            (128, KvDtype::F16, Some(32), 9, 3),
            (64, KvDtype::F16, Some(100), 3, 3),
        ];
        for (hd, dtype, window, nh, kv_heads) in cases {
            let layout = KvLayout { layers: 1, block_tokens: 16, kv_heads, head_dim: hd, dtype };
            let (te, len) = (kv_heads * hd, 200);
            let mut kv = KvStorage::new(layout, 16);
            let table = [7u32, 2, 5, 0, 4, 9, 15, 1, 12, 3, 8, 6, 14];
            let mut seed = 11;
            for p in 0..len {
                let k: Vec<f32> = (0..te).map(|_| lcg(&mut seed)).collect();
                let v: Vec<f32> = (0..te).map(|_| lcg(&mut seed)).collect();
                kv.write_token(0, table[p / 16] as usize, p % 16, &k, &v);
            }
            let q: Vec<f32> = (0..len * nh * hd).map(|_| lcg(&mut seed) * 3.0).collect();
            let rows: Vec<AttnRow> = (0..len).map(|p| AttnRow { block_table: &table, pos: p }).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let mut out = vec![0f32; len * nh * hd];
            attention(&Pool::new(2).unwrap(), &kv, 0, &q, &rows, nh, scale, window, &mut out);
            // The same rows as a decode batch: each its own sequence (its own
            // block table), so one task takes every KV head of a row.
            let tables: Vec<[u32; 13]> = vec![table; len];
            let batch: Vec<AttnRow> = (0..len).map(|p| AttnRow { block_table: &tables[p], pos: p }).collect();
            let mut batched = vec![0f32; len * nh * hd];
            attention(&Pool::new(2).unwrap(), &kv, 0, &q, &batch, nh, scale, window, &mut batched);
            // The last rows alone, as a late prefill chunk.
            let tail = len - 83;
            let mut chunk = vec![0f32; 83 * nh * hd];
            attention(&Pool::new(2).unwrap(), &kv, 0, &q[tail * nh * hd..], &rows[tail..], nh, scale, window, &mut chunk);
            for p in 0..len {
                let want = plain(&kv, &q[p * nh * hd..(p + 1) * nh * hd], &table, p, nh, scale, window);
                assert_eq!(out[p * nh * hd..(p + 1) * nh * hd], want[..], "head_dim {hd}, position {p}, window {window:?}");
                assert_eq!(batched[p * nh * hd..(p + 1) * nh * hd], want[..], "head_dim {hd}, position {p}, window {window:?}, batched");
                if p >= tail {
                    assert_eq!(chunk[(p - tail) * nh * hd..(p - tail + 1) * nh * hd], want[..], "position {p}, window {window:?}, chunk");
                }
            }
        }
    }

    /// Attention over a grouped arena (each block's layer groups in scattered units,
    /// the window layer's blocks before the window unmapped) equals the plain
    /// arena's, bit for bit.
    #[test]
    fn a_grouped_arena_attends_like_the_plain_one() {
        use crate::kv::{KvGroups, UNMAPPED};
        let (hd, nh, kv_heads, len, window) = (64, 4, 2, 100, 40);
        let layout = KvLayout { layers: 2, block_tokens: 16, kv_heads, head_dim: hd, dtype: KvDtype::F16 };
        let te = kv_heads * hd;
        let table = [3u32, 0, 6, 2, 5, 1, 4];
        let mut plain = KvStorage::new(layout, 8);
        // Layer 0 global (group 0), layer 1 local (group 1).
        let mut grouped = KvStorage::grouped(layout, 8, 14, KvGroups::new(&[0, 1]).unwrap());
        for (i, &b) in table.iter().enumerate() {
            // Position 99 reads 60..=99: blocks 0..3 are out of the window.
            let local = if i < 3 { UNMAPPED } else { 13 - i as u32 };
            grouped.map(b as usize, &[6 - i as u32, local]);
        }
        let mut seed = 3;
        for p in 0..len {
            for layer in 0..2 {
                let k: Vec<f32> = (0..te).map(|_| lcg(&mut seed)).collect();
                let v: Vec<f32> = (0..te).map(|_| lcg(&mut seed)).collect();
                let (b, s) = (table[p / 16] as usize, p % 16);
                plain.write_token(layer, b, s, &k, &v);
                grouped.write_token(layer, b, s, &k, &v);
            }
        }
        let q: Vec<f32> = (0..4 * nh * hd).map(|_| lcg(&mut seed)).collect();
        let rows: Vec<AttnRow> = (96..len).map(|p| AttnRow { block_table: &table, pos: p }).collect();
        let pool = Pool::new(2).unwrap();
        for (layer, w) in [(0, None), (1, Some(window))] {
            let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            attention(&pool, &plain, layer, &q, &rows, nh, 0.125, w, &mut a);
            attention(&pool, &grouped, layer, &q, &rows, nh, 0.125, w, &mut b);
            assert_eq!(a, b, "layer {layer}");
        }
    }

    #[test]
    fn matches_dense_reference_and_is_batch_independent() {
        let layout = KvLayout { layers: 1, block_tokens: 4, kv_heads: 2, head_dim: 8, dtype: KvDtype::F32 };
        let (nh, hd, te) = (4, 8, 16);
        let mut kv = KvStorage::new(layout, 8);
        let mut seed = 5;
        let len = 11;
        let table = [6u32, 1, 3];
        let keys: Vec<f32> = (0..len * te).map(|_| lcg(&mut seed)).collect();
        let vals: Vec<f32> = (0..len * te).map(|_| lcg(&mut seed)).collect();
        for p in 0..len {
            kv.write_token(0, table[p / 4] as usize, p % 4, &keys[p * te..(p + 1) * te], &vals[p * te..(p + 1) * te]);
        }
        let q: Vec<f32> = (0..len * nh * hd).map(|_| lcg(&mut seed)).collect();
        let rows: Vec<AttnRow> = (0..len).map(|p| AttnRow { block_table: &table, pos: p }).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; len * nh * hd];
        attention(&Pool::new(2).unwrap(), &kv, 0, &q, &rows, nh, scale, None, &mut out);
        for p in 0..len {
            for h in 0..nh {
                let kh = h / 2;
                let qh = &q[(p * nh + h) * hd..(p * nh + h + 1) * hd];
                let s: Vec<f32> = (0..=p)
                    .map(|j| (0..hd).map(|d| qh[d] * keys[j * te + kh * hd + d]).sum::<f32>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    let r: f32 = (0..=p).map(|j| e[j] * vals[j * te + kh * hd + d]).sum::<f32>() / z;
                    assert!((out[(p * nh + h) * hd + d] - r).abs() < 1e-5);
                }
            }
            let mut single = vec![0f32; nh * hd];
            attention(&Pool::new(1).unwrap(), &kv, 0, &q[p * nh * hd..(p + 1) * nh * hd], &rows[p..p + 1], nh, scale, None, &mut single);
            assert_eq!(single, out[p * nh * hd..(p + 1) * nh * hd].to_vec());
        }
    }
}
