//! Causal attention over the paged KV arena.
//!
//! One routine serves prefill (many query rows of one sequence, causal over
//! its cached prefix and the new tokens) and decode (one row for each of many
//! sequences of different lengths): each query row names its sequence's
//! block table and its own position, and attends to positions `0..=pos`.
//! Keys and values are always read back from the arena (after conversion to
//! the KV dtype), never from the freshly computed f32 values, so a token's
//! result is the same whether its prefix was computed in this step, in an
//! earlier chunk, or on another node.

use crate::kv::{KvDtype, KvStorage};
use half::{bf16, f16, slice::{HalfBitsSliceExt, HalfFloatSliceExt}};
use crate::pool::Pool;

/// One query row: the sequence's block table and the row's position.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl KvStorage {
    /// Keys or values of head `head` for the first `n` slots of `block`.
    fn read_head_slots(&self, layer: usize, block: usize, which: usize, head: usize, n: usize, out: &mut [f32]) {
        let l = &self.layout;
        let (te, hd) = (l.token_elems(), l.head_dim);
        let base = ((block * l.layers + layer) * 2 + which) * l.block_tokens * te + head * hd;
        for j in 0..n {
            let src = base + j * te;
            let dst = &mut out[j * hd..(j + 1) * hd];
            match self.raw() {
                Raw::F32(d) => dst.copy_from_slice(&d[src..src + hd]),
                Raw::Half(d) => match l.dtype {
                    KvDtype::F16 => d[src..src + hd].reinterpret_cast::<f16>().convert_to_f32_slice(dst),
                    _ => d[src..src + hd].reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
                },
            }
        }
    }
}

/// Borrowed view of the arena's elements.
pub(crate) enum Raw<'a> {
    F32(&'a [f32]),
    Half(&'a [u16]),
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
/// and value block is read (and converted) once for all of them.
const ROW_GROUP: usize = 16;

/// `out[r]` = attention of query row `r` (`n_heads x head_dim`, already
/// rotated) over its sequence's keys and values at positions `0..=pos`.
///
/// Rows of one sequence are grouped to share KV reads; the arithmetic of
/// each row is the same whatever its group: scores in position order, a
/// two-pass softmax, values accumulated in position order.
pub fn attention(pool: &Pool, kv: &KvStorage, layer: usize, q: &[f32], rows: &[AttnRow], n_heads: usize, scale: f32, out: &mut [f32]) {
    let l = &kv.layout;
    let (hd, kvh, bt) = (l.head_dim, l.kv_heads, l.block_tokens);
    let group = n_heads / kvh;
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
    let ptr = OutPtr(out.as_mut_ptr());
    pool.run(runs.len() * kvh, &|task| {
        let p = ptr;
        let ((r0, r1), h) = (runs[task / kvh], task % kvh);
        let max_ctx = rows[r0..r1].iter().map(|r| r.pos + 1).max().unwrap_or(0);
        let table = rows[r0].block_table;
        let nr = r1 - r0;
        let mut scores = vec![0f32; nr * group * max_ctx];
        let mut buf = vec![0f32; bt * hd];
        for (bi, &block) in table.iter().enumerate().take(max_ctx.div_ceil(bt)) {
            let n = bt.min(max_ctx - bi * bt);
            kv.read_head_slots(layer, block as usize, 0, h, n, &mut buf);
            for (ri, row) in rows[r0..r1].iter().enumerate() {
                let ctx = row.pos + 1;
                let m = n.min(ctx.saturating_sub(bi * bt));
                let qrow = &q[(r0 + ri) * width..(r0 + ri + 1) * width];
                for g in 0..group {
                    let qh = &qrow[(h * group + g) * hd..(h * group + g + 1) * hd];
                    let srow = &mut scores[(ri * group + g) * max_ctx..];
                    for j in 0..m {
                        srow[bi * bt + j] = dot8(qh, &buf[j * hd..(j + 1) * hd]) * scale;
                    }
                }
            }
        }
        let mut sums = vec![0f32; nr * group];
        for (ri, row) in rows[r0..r1].iter().enumerate() {
            let ctx = row.pos + 1;
            for g in 0..group {
                let s = &mut scores[(ri * group + g) * max_ctx..(ri * group + g) * max_ctx + ctx];
                let max = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0f32;
                for v in s.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                sums[ri * group + g] = sum;
            }
        }
        let mut acc = vec![0f32; nr * group * hd];
        for (bi, &block) in table.iter().enumerate().take(max_ctx.div_ceil(bt)) {
            let n = bt.min(max_ctx - bi * bt);
            kv.read_head_slots(layer, block as usize, 1, h, n, &mut buf);
            for (ri, row) in rows[r0..r1].iter().enumerate() {
                let m = n.min((row.pos + 1).saturating_sub(bi * bt));
                for g in 0..group {
                    let a = &mut acc[(ri * group + g) * hd..(ri * group + g + 1) * hd];
                    let srow = &scores[(ri * group + g) * max_ctx..];
                    for j in 0..m {
                        let pj = srow[bi * bt + j];
                        for (x, &v) in a.iter_mut().zip(&buf[j * hd..(j + 1) * hd]) {
                            *x += pj * v;
                        }
                    }
                }
            }
        }
        for ri in 0..nr {
            for g in 0..group {
                let inv = 1.0 / sums[ri * group + g];
                let head = h * group + g;
                for d in 0..hd {
                    // SAFETY: task (run, h) alone writes heads h*group..(h+1)*group
                    // of the run's rows, inside `out` (asserted above).
                    unsafe { *p.0.add((r0 + ri) * width + head * hd + d) = acc[(ri * group + g) * hd + d] * inv };
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
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
        attention(&Pool::new(2).unwrap(), &kv, 0, &q, &rows, nh, scale, &mut out);
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
            attention(&Pool::new(1).unwrap(), &kv, 0, &q[p * nh * hd..(p + 1) * nh * hd], &rows[p..p + 1], nh, scale, &mut single);
            assert_eq!(single, out[p * nh * hd..(p + 1) * nh * hd].to_vec());
        }
    }
}
