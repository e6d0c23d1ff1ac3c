//! The primary block pool: the state, reference count and published hash of every
//! block, the free stack and the LRU order of cached blocks.
//!
//! Invariants (checked by `KvCache::assert_consistent` in tests):
//! - every block is in exactly one state: `Free` (on the free stack, no hash),
//!   `Used` (refcount >= 1, off both lists, hash optional) or `Cached` (refcount 0,
//!   has a hash, on the LRU list);
//! - `free + used + cached == total`, with the three counts kept exactly.
//!
//! The pool knows nothing about the prefix index or the second tier: `KvCache` keeps
//! those consistent with the hashes recorded here.

use super::ids::{BlockHash, BlockId};
use super::lru::LruList;

/// The state of one primary block, as seen from outside the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Unallocated, holds nothing reusable.
    Free,
    /// Pinned by `refcount` running sequences.
    Used {
        /// Number of holders (>= 1).
        refcount: u32,
    },
    /// Nobody holds it, but it is published in the prefix index and may be reused
    /// until it is evicted (least recently used first).
    Cached,
}

/// What a release did to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    StillUsed,
    Cached,
    Freed,
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    state: Vec<BlockState>,
    hash: Vec<Option<BlockHash>>,
    /// Free blocks; a stack so that recently freed blocks (warm in caches) go first.
    free: Vec<u32>,
    lru: LruList,
    used: usize,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        Self {
            state: vec![BlockState::Free; n],
            hash: vec![None; n],
            // Reversed so that a fresh pool hands out block 0 first.
            free: (0..num_blocks).rev().collect(),
            lru: LruList::with_slots(n),
            used: 0,
        }
    }

    pub(crate) fn total(&self) -> usize {
        self.state.len()
    }

    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn cached_count(&self) -> usize {
        self.lru.len()
    }

    pub(crate) fn used_count(&self) -> usize {
        self.used
    }

    pub(crate) fn state(&self, block: BlockId) -> Option<BlockState> {
        self.state.get(block.index()).copied()
    }

    pub(crate) fn hash(&self, block: BlockId) -> Option<BlockHash> {
        self.hash.get(block.index()).copied().flatten()
    }

    pub(crate) fn refcount(&self, block: BlockId) -> u32 {
        match self.state(block) {
            Some(BlockState::Used { refcount }) => refcount,
            _ => 0,
        }
    }

    /// Takes a free block and pins it (refcount 1).
    pub(crate) fn pop_free(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.state[b as usize] = BlockState::Used { refcount: 1 };
        self.used += 1;
        Some(BlockId(b))
    }

    /// Evicts the least recently used cached block and pins it (refcount 1) for a new
    /// owner. Returns the block and the hash it was published under; the caller must
    /// remove that hash from the index (and may copy the old bytes out first).
    pub(crate) fn pop_lru(&mut self) -> Option<(BlockId, BlockHash)> {
        let b = self.lru.pop_front()?;
        let i = b as usize;
        self.state[i] = BlockState::Used { refcount: 1 };
        self.used += 1;
        // A cached block always has a hash; the fallback only keeps the pool total.
        let hash = self.hash[i].take().unwrap_or(BlockHash(0));
        Some((BlockId(b), hash))
    }

    /// Adds a holder to a published block: `Cached -> Used(1)`, `Used(n) -> Used(n+1)`.
    /// Returns false (changing nothing) for a free or unknown block.
    pub(crate) fn acquire(&mut self, block: BlockId) -> bool {
        let i = block.index();
        match self.state.get(i).copied() {
            Some(BlockState::Cached) => {
                self.lru.remove(block.0);
                self.state[i] = BlockState::Used { refcount: 1 };
                self.used += 1;
                true
            }
            Some(BlockState::Used { refcount }) => {
                self.state[i] = BlockState::Used {
                    refcount: refcount.saturating_add(1),
                };
                true
            }
            _ => false,
        }
    }

    /// Drops one holder. The caller has checked that the block is `Used`. At zero a
    /// published block becomes the most recently used cached block, an unpublished
    /// one becomes free.
    pub(crate) fn release(&mut self, block: BlockId) -> Released {
        let i = block.index();
        let Some(BlockState::Used { refcount }) = self.state.get(i).copied() else {
            return Released::StillUsed;
        };
        if refcount > 1 {
            self.state[i] = BlockState::Used { refcount: refcount - 1 };
            return Released::StillUsed;
        }
        self.used -= 1;
        if self.hash[i].is_some() {
            self.state[i] = BlockState::Cached;
            self.lru.push_back(block.0);
            Released::Cached
        } else {
            self.state[i] = BlockState::Free;
            self.free.push(block.0);
            Released::Freed
        }
    }

    /// Records that a used block is published under `hash`.
    pub(crate) fn set_hash(&mut self, block: BlockId, hash: BlockHash) {
        if let Some(h) = self.hash.get_mut(block.index()) {
            *h = Some(hash);
        }
    }

    /// Withdraws a block from publication: a cached block becomes free at once, a used
    /// one simply loses its hash and becomes free on its last release.
    pub(crate) fn unpublish(&mut self, block: BlockId) {
        let i = block.index();
        if i >= self.state.len() {
            return;
        }
        self.hash[i] = None;
        if self.state[i] == BlockState::Cached {
            self.lru.remove(block.0);
            self.state[i] = BlockState::Free;
            self.free.push(block.0);
        }
    }

    /// Full audit of the pool's own invariants (tests only).
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        let n = self.total();
        let mut on_free = vec![0u32; n];
        for &b in &self.free {
            on_free[b as usize] += 1;
        }
        let mut on_lru = vec![0u32; n];
        for b in self.lru.iter() {
            on_lru[b as usize] += 1;
        }
        let (mut free, mut used, mut cached) = (0, 0, 0);
        for i in 0..n {
            let (f, l) = (on_free[i], on_lru[i]);
            match self.state[i] {
                BlockState::Free => {
                    free += 1;
                    assert!(f == 1 && l == 0 && self.hash[i].is_none(), "free block {i}: free={f} lru={l}");
                }
                BlockState::Used { refcount } => {
                    used += 1;
                    assert!(refcount >= 1 && f == 0 && l == 0, "used block {i}: rc={refcount} free={f} lru={l}");
                }
                BlockState::Cached => {
                    cached += 1;
                    assert!(f == 0 && l == 1 && self.hash[i].is_some(), "cached block {i}: free={f} lru={l}");
                }
            }
        }
        assert_eq!((free, used, cached), (self.free_count(), self.used, self.cached_count()));
        assert_eq!(free + used + cached, n);
    }
}
