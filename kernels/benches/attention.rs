//! Prefill attention benchmark: one 512-row chunk of a sequence attending
//! causally to its cached prefix, at the end of a 512-token and of a
//! 3,072-token prompt, on the default model's shapes (SmolLM2-135M: 9 query
//! heads over 3 KV heads of 64) and Gemma 3 270M's (4 over 1 of 256), f16 KV.
//!
//! GFLOP/s counts `4 head_dim` per (query head, attended position): the
//! score's dot product and the value's multiply-add. The 512-token row is
//! the baseline of the same run: at long context the same kernel should
//! keep its rate (the work per position does not change, only the count).
//! Time is wall time on a one-thread pool, the best of `BATON_BENCH_ROUNDS`
//! (default 10) rounds: the minimum is the run least disturbed by other
//! processes. (Per-thread CPU time was tried; on this VM it advances in 4 ms
//! scheduler ticks, coarser than the differences being measured.)
//!
//! Then a decode step: 12 sequences of 640 tokens (a chat history), one row
//! each, through all 30 layers of SmolLM2's KV (173 MiB, past the L3 cache, as
//! in serving), blocks allocated sequence by sequence.
//!
//! `cargo bench -p baton-kernels --bench attention [-- smollm2|gemma|decode]`

use std::time::Instant;

use baton_kernels::attention::attention;
use baton_kernels::pool::Pool;
use baton_kernels::{AttnRow, KvDtype, KvLayout, KvStorage};

fn values(len: usize, seed: &mut u64) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn main() {
    let rounds: usize = std::env::var("BATON_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let pool = Pool::new(1).unwrap();
    // `cargo bench ... -- gemma` runs only the shapes whose name has "gemma".
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).map(|a| a.to_lowercase()).collect();
    println!("| model shape | prompt | rows | ms per chunk | GFLOP/s | rate vs 512 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, n_heads, kv_heads, head_dim) in [("SmolLM2 9x64 (3 KV)", 9, 3, 64), ("Gemma 3 4x256 (1 KV)", 4, 1, 256)] {
        if !filter.is_empty() && !filter.iter().any(|f| name.to_lowercase().contains(f)) {
            continue;
        }
        let mut base = None;
        for prompt in [512usize, 3072] {
            let rows = 512;
            let block_tokens = 16;
            let blocks = prompt / block_tokens;
            let layout = KvLayout { layers: 1, block_tokens, kv_heads, head_dim, dtype: KvDtype::F16 };
            let mut kv = KvStorage::new(layout, blocks);
            let mut seed = 7;
            let te = kv_heads * head_dim;
            for p in 0..prompt {
                let (k, v) = (values(te, &mut seed), values(te, &mut seed));
                kv.write_token(0, p / block_tokens, p % block_tokens, &k, &v);
            }
            let table: Vec<u32> = (0..blocks as u32).collect();
            let attn: Vec<AttnRow> = (prompt - rows..prompt).map(|pos| AttnRow { block_table: &table, pos }).collect();
            let q = values(rows * n_heads * head_dim, &mut seed);
            let mut out = vec![0f32; rows * n_heads * head_dim];
            let scale = 1.0 / (head_dim as f32).sqrt();
            let mut best = f64::INFINITY;
            for _ in 0..rounds {
                let t = Instant::now();
                attention(&pool, &kv, 0, &q, &attn, n_heads, scale, None, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            let attended: usize = attn.iter().map(|r| r.pos + 1).sum();
            let gflops = (attended * n_heads * head_dim * 4) as f64 / best / 1e9;
            let rel = base.map_or(1.0, |b: f64| gflops / b);
            base.get_or_insert(gflops);
            println!("| {name} | {prompt} | {rows} | {:.2} | {gflops:.1} | {:.0}% |", best * 1e3, rel * 100.0);
        }
    }
    if filter.is_empty() || filter.iter().any(|f| "decode".contains(f.as_str())) {
        decode_step(&pool, rounds);
    }
}

/// One decode step's attention over every layer: 12 rows, each its own
/// sequence of 640 positions, SmolLM2's shape.
fn decode_step(pool: &Pool, rounds: usize) {
    let (n_heads, kv_heads, head_dim, layers, seqs, context, block_tokens) = (9, 3, 64, 30, 12, 640, 16);
    let per_seq = context / block_tokens;
    let layout = KvLayout { layers, block_tokens, kv_heads, head_dim, dtype: KvDtype::F16 };
    let mut kv = KvStorage::new(layout, seqs * per_seq);
    let mut seed = 9;
    let te = kv_heads * head_dim;
    let (k, v) = (values(te, &mut seed), values(te, &mut seed));
    for b in 0..seqs * per_seq {
        for layer in 0..layers {
            for slot in 0..block_tokens {
                kv.write_token(layer, b, slot, &k, &v);
            }
        }
    }
    let tables: Vec<Vec<u32>> = (0..seqs).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
    let rows: Vec<AttnRow> = tables.iter().map(|t| AttnRow { block_table: t, pos: context - 1 }).collect();
    let q = values(seqs * n_heads * head_dim, &mut seed);
    let mut out = vec![0f32; seqs * n_heads * head_dim];
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut best = f64::INFINITY;
    for _ in 0..rounds {
        let t = Instant::now();
        for layer in 0..layers {
            attention(pool, &kv, layer, &q, &rows, n_heads, scale, None, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = seqs * context * layers * 2 * te * 2;
    println!();
    println!("| decode step (SmolLM2, {seqs} x {context} positions, {layers} layers) | ms | KV GB/s |");
    println!("| --- | --- | --- |");
    println!("| attention | {:.2} | {:.1} |", best * 1e3, bytes as f64 / best / 1e9);
}
