//! What a prefix-cache lookup costs: hashing a prompt's blocks, then matching
//! (pin and release) or peeking them, every block a primary hit, which is the
//! most work a lookup does. Prints nanoseconds per lookup and per block.
//!
//! `cargo bench -p baton-engine --bench prefix_lookup`; before/after a change
//! to the cache: `scripts/bench-prefix-lookup.sh BASE_COMMIT`.
//!
//! The calls that differ between cache versions live in `api.rs`, so the same
//! harness can be built against an older engine.

mod api;

use std::hint::black_box;
use std::time::{Duration, Instant};

use baton_engine::kv::{BlockId, BlockStore, HashChain, KvCache, OwnerId};

const BLOCK_TOKENS: usize = 16;

/// Primary hits never touch block bytes.
struct NoBytes;

impl BlockStore for NoBytes {
    fn block_bytes(&self) -> usize {
        64
    }
    fn copy_out(&self, _: BlockId, _: &mut [u8]) {}
    fn copy_in(&mut self, _: BlockId, _: &[u8]) {}
}

/// The median over 7 runs of the mean time of `f`, each run about 50 ms.
fn time(mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < Duration::from_millis(20) {
        f();
        n += 1;
    }
    let per_run = (n * 5 / 2).max(1);
    let mut runs: Vec<Duration> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..per_run {
                f();
            }
            t.elapsed() / per_run
        })
        .collect();
    runs.sort();
    runs[3]
}

fn main() {
    let user = OwnerId::parse("bench-user-0042").unwrap();
    println!("prefix lookup, {BLOCK_TOKENS}-token blocks, every block a primary hit ({})", api::VARIANT);
    println!("{:>8} {:>7} {:>12} {:>14} {:>14} {:>14}", "tokens", "blocks", "hash ns", "match ns", "peek ns", "match ns/blk");
    for tokens in [512usize, 2048, 8192] {
        let prompt: Vec<u32> = (0..tokens as u32).map(|i| i.wrapping_mul(2_654_435_761) % 49_152).collect();
        let blocks = tokens / BLOCK_TOKENS;
        let mut cache = KvCache::new(blocks as u32 + 8, 0);
        let mut store = NoBytes;
        let mut chain = HashChain::new(BLOCK_TOKENS, 0, user.clone());
        chain.update(&prompt);
        let ids = api::publish(&mut cache, &chain, &prompt, &mut store);
        cache.release(&ids).expect("release");
        let hash = time(|| {
            let mut c = HashChain::new(BLOCK_TOKENS, 0, user.clone());
            c.update(black_box(&prompt));
            black_box(c.hashes().len());
        });
        let matched = time(|| {
            let m = api::match_all(&mut cache, &chain, black_box(&prompt), &mut store);
            assert_eq!(m.len(), blocks);
            cache.release(&m).expect("release");
        });
        let peek = time(|| {
            black_box(api::peek_all(&cache, &chain, black_box(&prompt)));
        });
        println!(
            "{:>8} {:>7} {:>12} {:>14} {:>14} {:>14.1}",
            tokens,
            blocks,
            hash.as_nanos(),
            matched.as_nanos(),
            peek.as_nanos(),
            matched.as_nanos() as f64 / blocks as f64
        );
    }
}
