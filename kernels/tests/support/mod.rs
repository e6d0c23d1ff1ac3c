//! Inputs and comparisons shared by the backend test suites (the GPU's and the emulated kernels').

/// A deterministic xorshift stream of `n` words.
fn xorshift(n: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

/// Deterministic values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    xorshift(n, seed).map(|s| ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect()
}

/// Deterministic bytes: every byte value, no structure a table error could hide in.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    xorshift(n, seed).map(|s| (s >> 32) as u8).collect()
}

/// max |got - want| / max |want|.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// Block tables for sequences of `lens` tokens (16 per block), their blocks
/// scattered over an arena of `blocks` by stepping `stride` (coprime to `blocks`).
pub fn scattered_tables(lens: &[usize], blocks: usize, stride: u32) -> Vec<Vec<u32>> {
    let mut order = (0..blocks as u32).map(|i| (i * stride) % blocks as u32);
    lens.iter().map(|&len| order.by_ref().take(len.div_ceil(16)).collect()).collect()
}

/// The (block, slot) of each of the first `len` positions of `table` (16 tokens per block).
pub fn slots_of(table: &[u32], len: usize) -> Vec<(u32, u32)> {
    (0..len).map(|p| (table[p / 16], (p % 16) as u32)).collect()
}

/// Keys, values and slots of sequence `s` of `len` tokens over `table`: the data every
/// suite writes into a KV arena (keys from seed `100 + s`, values from `200 + s`).
pub fn sequence_kv(s: usize, len: usize, table: &[u32], token_elems: usize) -> (Vec<f32>, Vec<f32>, Vec<(u32, u32)>) {
    (values(len * token_elems, 100 + s as u64), values(len * token_elems, 200 + s as u64), slots_of(table, len))
}
