//! Paged KV memory: the primary block pool, the owner-scoped prefix cache and the
//! second memory tier.
//!
//! The KV cache of a sequence lives in fixed-size blocks ([`DEFAULT_BLOCK_TOKENS`]
//! tokens for all layers each). This module does the *accounting* for those blocks;
//! the bytes live elsewhere (device memory owned by the kernels) and are reached only
//! through [`BlockStore`], so everything here is plain synchronous code tested with a
//! fake store.
//!
//! - [`block_hash`]: a full block's chain hash covers its parent's hash, its owner
//!   scope and its tokens; user blocks hash the user ID, while platform blocks
//!   (system prompt) are shared. The hash finds a block; it never decides a hit.
//! - [`BlockKey`]: a hit needs the cached block's scope, tokens and parent link to
//!   equal the query's, in both tiers, so no user can match another user's blocks
//!   and no prompt another prompt's, even when hashes collide.
//! - [`KvCache`]: every primary block is `Free`, `Used` (pinned by running sequences)
//!   or `Cached` (published under its hash, unpinned, reusable until evicted least
//!   recently used first). Evicted blocks spill to the second tier (host memory) and
//!   are promoted back on a match; preempted sequences swap out to the same tier.
//!   Deleting a conversation or a user removes their blocks from both tiers.
//! - [`WindowRule`]: a block whose sliding-window layers were left off the wire or
//!   given back (they lie before every later row's window) is published as lacking
//!   them, and a match is cut where a row computed after it could read such a block.
//! - With a grouped arena ([`KvCache::with_units`]) a block holds memory for its
//!   window layers only while a row may read them: [`KvCache::ensure_local`] before
//!   rows are computed, [`KvCache::trim_local`] once they are behind every window.
//!
//! Invariant: `free + used + cached == total` at every step, and every operation that
//! fails changes nothing.

mod cache;
mod hash;
mod ids;
mod key;
mod lru;
mod owners;
mod pool;
mod tier;
mod units;
mod window;

#[cfg(test)]
mod tests;

pub use cache::{KvCache, PrefixMatch, PrefixPeek, Registered, SwapHandle};
pub use hash::{block_hash, prefix_hashes, xxh64, BlockHasher, ConstantHasher, HashChain, Xxh64BlockHasher};
pub use key::{BlockKey, ChainLink};
pub use ids::{BlockHash, BlockId, BlockOwner, ConversationId, OwnerId, OwnerScope, SeqId};
pub use pool::BlockState;
pub use window::WindowRule;

/// Tokens per block unless configured otherwise (as vLLM): small enough that a
/// partially filled last block wastes little, large enough that per-block
/// bookkeeping and hashing stay cheap.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Where the bytes of primary blocks live (device memory in the engine, a `Vec` in
/// tests). Every block has the same size.
pub trait BlockStore {
    /// Size of one block in bytes (all layers, K and V).
    fn block_bytes(&self) -> usize;
    /// Copies block `block` into `out` (`out.len() == block_bytes()`).
    fn copy_out(&self, block: BlockId, out: &mut [u8]);
    /// Overwrites block `block` with `data` (`data.len() == block_bytes()`); groups
    /// of layers the block holds no memory for are left out.
    fn copy_in(&mut self, block: BlockId, data: &[u8]);
    /// A grouped arena's block `block` now keeps group `g` in unit `units[g]`
    /// (`baton_kernels::UNMAPPED`: nowhere; see [`KvCache::with_units`]).
    fn map(&mut self, block: BlockId, units: &[u32]) {
        let _ = (block, units);
    }
}

/// A point-in-time view of the cache, for admission decisions and metrics.
///
/// Invariants: `free + used + cached == total`;
/// `tier2_blocks + swapped <= tier2_capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvStats {
    /// Primary blocks in the pool.
    pub total: usize,
    /// Primary blocks holding nothing.
    pub free: usize,
    /// Primary blocks pinned by running sequences.
    pub used: usize,
    /// Primary blocks published in the prefix index and unpinned (reusable).
    pub cached: usize,
    /// Second-tier blocks holding spilled prefix blocks.
    pub tier2_blocks: usize,
    /// Second-tier capacity in blocks (spilled plus swapped).
    pub tier2_capacity: usize,
    /// Second-tier blocks held by swapped-out sequences.
    pub swapped: usize,
    /// Hashes currently published in the primary index (used or cached blocks).
    pub indexed: usize,
    /// Cumulative: matched blocks found in the primary pool.
    pub primary_hits: u64,
    /// Cumulative: matched blocks promoted from the second tier.
    pub tier2_hits: u64,
    /// Cumulative: cached blocks evicted from the primary pool to make room.
    pub evicted: u64,
    /// Cumulative: evicted blocks whose bytes were kept in the second tier.
    pub spilled: u64,
    /// Cumulative: second-tier entries dropped to make room.
    pub tier2_dropped: u64,
    /// Cumulative: lookups and registrations that found a block under the right
    /// hash but with another scope, other tokens or another parent (refused).
    pub hash_collisions: u64,
    /// Blocks an allocation could get now (free plus cached, as far as a grouped
    /// arena's units go: [`KvCache::available_for_allocation`]).
    pub allocatable: usize,
    /// Units of a grouped arena (0 for a plain one; see [`KvCache::with_units`]).
    pub units_total: usize,
    /// Units held by no block.
    pub units_free: usize,
    /// Units held by cached blocks (evictable).
    pub units_cached: usize,
    /// Cumulative: blocks whose sliding-window layers' memory was given back because
    /// no row of their sequence reads them again ([`KvCache::trim_local`]).
    pub local_reclaimed: u64,
}

/// Errors of the KV layer. Every failing operation leaves the cache unchanged; an
/// error that owns a resource (a swap handle) hands it back.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Not enough free or evictable blocks for an all-or-nothing request.
    #[error("out of KV blocks: requested {requested}, available {available}")]
    OutOfBlocks {
        /// Blocks asked for.
        requested: usize,
        /// Free plus cached blocks at the time.
        available: usize,
    },
    /// A block ID outside the pool.
    #[error("{block} does not exist (the pool has {total} blocks)")]
    UnknownBlock {
        /// The offending ID.
        block: BlockId,
        /// Pool size.
        total: usize,
    },
    /// Release of a block that has no holder left (a scheduler bug: the block may
    /// already belong to someone else).
    #[error("release of {block}, which is not in use")]
    DoubleRelease {
        /// The offending block.
        block: BlockId,
    },
    /// An operation that needs a pinned block got a free or cached one.
    #[error("{block} is not in use")]
    NotInUse {
        /// The offending block.
        block: BlockId,
    },
    /// A block already published under one hash was registered under another.
    #[error("{block} is published as {published}, cannot register it as {requested}")]
    HashConflict {
        /// The block.
        block: BlockId,
        /// Its current hash.
        published: BlockHash,
        /// The hash it was registered with now.
        requested: BlockHash,
    },
    /// The second tier cannot hold a swap of this size (other swaps hold the rest).
    #[error("second tier full: {requested} blocks to swap out, room for {available}")]
    Tier2Full {
        /// Blocks to swap out.
        requested: usize,
        /// Blocks the tier could take.
        available: usize,
    },
    /// A swap handle this cache did not issue.
    #[error("unknown swap handle {id}")]
    UnknownSwap {
        /// The handle's ID.
        id: u64,
    },
    /// Stored bytes do not fit the block store (a store of a different shape).
    #[error("block size mismatch: stored {stored} bytes, store blocks are {store} bytes")]
    BlockBytesMismatch {
        /// Size of the stored copy.
        stored: usize,
        /// `BlockStore::block_bytes()`.
        store: usize,
    },
    /// A swap-in failed; the swap is intact and its handle is returned.
    #[error("swap-in failed: {source}")]
    SwapIn {
        /// The handle, still valid: retry later or drop it with `drop_swap`.
        handle: SwapHandle,
        /// Why.
        #[source]
        source: Box<KvError>,
    },
}

impl KvError {
    /// A stable, low-cardinality name for metrics labels and API error types.
    pub fn label(&self) -> &'static str {
        match self {
            Self::OutOfBlocks { .. } => "out_of_blocks",
            Self::UnknownBlock { .. } => "unknown_block",
            Self::DoubleRelease { .. } => "double_release",
            Self::NotInUse { .. } => "not_in_use",
            Self::HashConflict { .. } => "hash_conflict",
            Self::Tier2Full { .. } => "tier2_full",
            Self::UnknownSwap { .. } => "unknown_swap",
            Self::BlockBytesMismatch { .. } => "block_bytes_mismatch",
            Self::SwapIn { source, .. } => source.label(),
        }
    }

    /// The swap handle carried by a failed swap-in, if this is one.
    pub fn into_swap_handle(self) -> Option<SwapHandle> {
        match self {
            Self::SwapIn { handle, .. } => Some(handle),
            _ => None,
        }
    }
}
