//! The boundary between the transport and a node's KV block pool.
//!
//! Owns: [`BlockSink`] (the receiver writes into reserved blocks through it), [`BlockSource`]
//! (the sender reads computed blocks through it) and [`ArenaPool`], a simple pool that
//! implements both, used by tests, the benchmark and single-process setups.
//! Invariants: a sink never accepts a write to a block that is not reserved; `release` of a
//! block that is already free is counted (a bug in the caller) and otherwise ignored, so it
//! can never put a block on the free list twice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::types::{BlockId, KvLayout};

/// Where received KV lands: the decode node's pool.
pub trait BlockSink: Send + Sync {
    /// The layout of every block in this pool.
    fn layout(&self) -> KvLayout;
    /// Takes `n` free blocks, all or none.
    fn reserve(&self, n: usize) -> Result<Vec<BlockId>>;
    /// Writes one layer of one reserved block. `bytes` is exactly
    /// `layout().bytes_per_block_layer()` long.
    fn write_layer(&self, block: BlockId, layer: u32, bytes: &[u8]) -> Result<()>;
    /// Returns blocks to the free list.
    fn release(&self, blocks: &[BlockId]);
    /// Blocks currently free.
    fn free_blocks(&self) -> usize;
}

/// Where sent KV comes from: the prefill node's pool.
pub trait BlockSource: Send + Sync {
    /// The layout of every block in this pool.
    fn layout(&self) -> KvLayout;
    /// Copies one layer of one block into `out` (`layout().bytes_per_block_layer()` long).
    fn read_layer(&self, block: BlockId, layer: u32, out: &mut [u8]) -> Result<()>;
}

struct ArenaState {
    data: Vec<u8>,
    free: Vec<BlockId>,
    reserved: Vec<bool>,
}

/// A pool of `blocks` blocks in one contiguous arena, with a free list.
///
/// Block `b`, layer `l` lives at `(b * layers + l) * bytes_per_block_layer`.
pub struct ArenaPool {
    layout: KvLayout,
    total: usize,
    state: Mutex<ArenaState>,
    layer_writes: AtomicU64,
    double_releases: AtomicU64,
}

impl ArenaPool {
    /// A pool of `blocks` zeroed blocks, all free.
    pub fn new(layout: KvLayout, blocks: usize) -> Result<Self> {
        layout.validate()?;
        let bytes = blocks
            .checked_mul(layout.bytes_per_block())
            .ok_or(Error::InvalidArgument {
                what: "pool size overflows",
            })?;
        let blocks_u32 = u32::try_from(blocks).map_err(|_| Error::InvalidArgument {
            what: "pool has more than u32::MAX blocks",
        })?;
        Ok(ArenaPool {
            layout,
            total: blocks,
            state: Mutex::new(ArenaState {
                data: vec![0u8; bytes],
                // Pop from the end hands out low IDs first.
                free: (0..blocks_u32).rev().map(BlockId).collect(),
                reserved: vec![false; blocks],
            }),
            layer_writes: AtomicU64::new(0),
            double_releases: AtomicU64::new(0),
        })
    }

    /// Total blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Layer writes accepted so far (tests use it to prove a block was not installed).
    pub fn layer_writes(&self) -> u64 {
        self.layer_writes.load(Ordering::Relaxed)
    }

    /// Releases of blocks that were already free. Always zero unless a caller has a bug.
    pub fn double_releases(&self) -> u64 {
        self.double_releases.load(Ordering::Relaxed)
    }

    /// Copies all layers of a reserved block.
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>> {
        let state = self.lock();
        let range = self.block_range(&state, block, 0)?;
        let len = self.layout.bytes_per_block();
        Ok(state.data[range.start..range.start + len].to_vec())
    }

    /// Fills all layers of a reserved block with bytes from a seeded generator.
    pub fn fill_block(&self, block: BlockId, seed: u64) -> Result<()> {
        let mut state = self.lock();
        let start = self.block_range(&state, block, 0)?.start;
        let len = self.layout.bytes_per_block();
        fill_pseudo_random(&mut state.data[start..start + len], seed);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ArenaState> {
        // A panic while holding the lock cannot leave the arena inconsistent: every critical
        // section is a copy or a free-list update that finishes or does not start.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn block_range(
        &self,
        state: &ArenaState,
        block: BlockId,
        layer: u32,
    ) -> Result<std::ops::Range<usize>> {
        let b = block.0 as usize;
        if b >= self.total || !state.reserved[b] {
            return Err(Error::Sink {
                block,
                layer,
                what: "block is not reserved",
            });
        }
        if layer >= self.layout.layers {
            return Err(Error::Sink {
                block,
                layer,
                what: "layer out of range",
            });
        }
        let bl = self.layout.bytes_per_block_layer();
        let start = (b * self.layout.layers as usize + layer as usize) * bl;
        Ok(start..start + bl)
    }
}

impl BlockSink for ArenaPool {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn reserve(&self, n: usize) -> Result<Vec<BlockId>> {
        let mut state = self.lock();
        let free = state.free.len();
        if n > free {
            return Err(Error::PoolExhausted { requested: n, free });
        }
        let blocks = state.free.split_off(free - n);
        for b in &blocks {
            state.reserved[b.0 as usize] = true;
        }
        Ok(blocks)
    }

    fn write_layer(&self, block: BlockId, layer: u32, bytes: &[u8]) -> Result<()> {
        let mut state = self.lock();
        let range = self.block_range(&state, block, layer)?;
        if bytes.len() != range.len() {
            return Err(Error::Sink {
                block,
                layer,
                what: "write is not exactly one block-layer",
            });
        }
        state.data[range].copy_from_slice(bytes);
        self.layer_writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn release(&self, blocks: &[BlockId]) {
        let mut state = self.lock();
        for &b in blocks {
            let i = b.0 as usize;
            if i < self.total && state.reserved[i] {
                state.reserved[i] = false;
                state.free.push(b);
            } else {
                self.double_releases.fetch_add(1, Ordering::Relaxed);
                tracing::error!(block = b.0, "release of a block that is not reserved");
            }
        }
    }

    fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }
}

impl BlockSource for ArenaPool {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn read_layer(&self, block: BlockId, layer: u32, out: &mut [u8]) -> Result<()> {
        let state = self.lock();
        let range = self.block_range(&state, block, layer)?;
        if out.len() != range.len() {
            return Err(Error::Sink {
                block,
                layer,
                what: "read is not exactly one block-layer",
            });
        }
        out.copy_from_slice(&state.data[range]);
        Ok(())
    }
}

/// splitmix64-seeded xorshift bytes: cheap, reproducible test data.
pub fn fill_pseudo_random(out: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x |= 1;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&x.to_le_bytes()[..n]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::KvDtype;
    use proptest::prelude::*;

    fn tiny() -> KvLayout {
        KvLayout {
            layers: 3,
            block_tokens: 2,
            kv_heads: 1,
            head_dim: 4,
            dtype: KvDtype::F16,
        }
    }

    #[test]
    fn writes_only_to_reserved_blocks() {
        let pool = ArenaPool::new(tiny(), 4).unwrap();
        let bl = tiny().bytes_per_block_layer();
        assert!(pool.write_layer(BlockId(0), 0, &vec![1; bl]).is_err());
        let b = pool.reserve(2).unwrap();
        pool.write_layer(b[0], 2, &vec![7; bl]).unwrap();
        assert!(pool.write_layer(b[0], 3, &vec![7; bl]).is_err());
        assert!(pool.write_layer(b[0], 1, &vec![7; bl - 1]).is_err());
        let mut out = vec![0; bl];
        pool.read_layer(b[0], 2, &mut out).unwrap();
        assert_eq!(out, vec![7; bl]);
        pool.release(&b);
        pool.release(&b);
        assert_eq!(pool.double_releases(), 2);
        assert_eq!(pool.free_blocks(), 4);
    }

    proptest! {
        #[test]
        fn free_list_stays_consistent(ops in prop::collection::vec((any::<bool>(), 0usize..5), 0..64)) {
            let pool = ArenaPool::new(tiny(), 8).unwrap();
            let mut held: Vec<Vec<BlockId>> = Vec::new();
            for (reserve, n) in ops {
                if reserve {
                    match pool.reserve(n) {
                        Ok(b) => { prop_assert_eq!(b.len(), n); held.push(b) }
                        Err(Error::PoolExhausted { requested, free }) => {
                            prop_assert!(requested > free)
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                } else if let Some(b) = held.pop() {
                    pool.release(&b);
                }
                let out: usize = held.iter().map(Vec::len).sum();
                prop_assert_eq!(pool.free_blocks() + out, 8);
            }
            let mut all: Vec<u32> = held.concat().iter().map(|b| b.0).collect();
            all.sort_unstable();
            all.dedup();
            prop_assert_eq!(all.len(), held.iter().map(Vec::len).sum::<usize>());
            prop_assert_eq!(pool.double_releases(), 0);
        }
    }
}
