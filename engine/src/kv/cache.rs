//! [`KvCache`]: the block pool, the prefix index and the second tier kept consistent.
//!
//! Invariants, on top of those of the pool and the tier (all checked after every step
//! of the property tests):
//! - `index[h].block == b` iff block `b` is `Used` or `Cached` and recorded with hash
//!   `h`; a `Cached` block is always indexed;
//! - a lookup takes a block (either tier) only if its [`Entry`] equals the query's
//!   scope, tokens and parent link (see [`super::key`]); the hash alone never decides;
//! - a hash is in at most one of the primary index and the second tier's cache (a
//!   promotion moves it, a spill happens only after it left the index);
//! - every hash with a recorded publisher is in the index or the second tier, so
//!   deleting a conversation finds every copy of its data;
//! - a failing operation changes nothing.
//!
//! The scheduler drives it: `match_prefix` the prompt's block keys, `allocate` the
//! rest, `register` each block once its KV is written and it is full (passing the
//! previous block's [`ChainLink`]), `release` the sequence's blocks (in sequence
//! order) when it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::ids::{BlockHash, BlockId, BlockOwner, ConversationId, OwnerId};
use super::key::{BlockKey, ChainLink, Entry};
use super::owners::Owners;
use super::pool::{BlockPool, BlockState, Released};
use super::tier::Tier2;
use super::units::Units;
use super::window::WindowRule;
use super::{BlockStore, KvError, KvStats};

/// A store for giving back the memory of a block whose bytes no one reads again
/// (mapping changes of a free block need not reach the arena: it is remapped before
/// its next use).
struct NoStore;

impl BlockStore for NoStore {
    fn block_bytes(&self) -> usize {
        0
    }
    fn copy_out(&self, _: BlockId, _: &mut [u8]) {}
    fn copy_in(&mut self, _: BlockId, _: &[u8]) {}
}

/// Swap IDs are unique in the process, so a handle from another cache is detected
/// rather than misread as one of ours.
static NEXT_SWAP_ID: AtomicU64 = AtomicU64::new(1);

/// The result of [`KvCache::match_prefix`]: the blocks of the longest cached prefix,
/// each pinned once for the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Blocks for the leading keys, in order; release them like allocated blocks.
    pub blocks: Vec<BlockId>,
    /// The link of each matched block, in order: the parent to pass when
    /// registering the block after it.
    pub links: Vec<ChainLink>,
    /// How many came from the primary pool.
    pub primary_hits: usize,
    /// How many were promoted from the second tier (one copy each).
    pub tier2_hits: usize,
}

/// The result of [`KvCache::peek_prefix`]: how long a match would be, without
/// pinning, promoting or touching recency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixPeek {
    /// Leading keys found in the primary index.
    pub primary: usize,
    /// Leading keys found in the second tier (a promotion each).
    pub tier2: usize,
}

/// What [`KvCache::register`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// The block is now published under the hash, as this link.
    Published(ChainLink),
    /// The block was already published as this key; nothing changed.
    Unchanged(ChainLink),
    /// Another block is already published as the same key (same hash, scope,
    /// tokens and parent). This block stays private to its sequence and is freed on
    /// its last release; the caller may switch to `existing` to save memory.
    Duplicate {
        /// The block published as the key.
        existing: BlockId,
        /// Its link (valid as the parent of this block's successor).
        link: ChainLink,
    },
    /// Another block with *different* contents holds this hash: a hash collision.
    /// This block stays private and unlinked; nothing after it in its sequence can
    /// be published either (its successors have no parent link).
    Collision {
        /// The block that holds the hash.
        holder: BlockId,
    },
}

impl Registered {
    /// The link a successor block registers after, if the block has one.
    pub fn link(&self) -> Option<ChainLink> {
        match *self {
            Self::Published(link) | Self::Unchanged(link) | Self::Duplicate { link, .. } => Some(link),
            Self::Collision { .. } => None,
        }
    }
}

/// A block published in the primary index: where it is and what it holds.
#[derive(Debug)]
struct Indexed {
    block: BlockId,
    entry: Entry,
}

/// A swapped-out sequence's blocks, held in the second tier until [`KvCache::swap_in`]
/// or [`KvCache::drop_swap`] consumes the handle. Not `Clone`: one owner, one use.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a swap holds second-tier memory until swapped in or dropped"]
pub struct SwapHandle {
    id: u64,
    blocks: usize,
}

impl SwapHandle {
    /// Number of blocks in the swap.
    pub fn len(&self) -> usize {
        self.blocks
    }

    /// Whether the swap holds no blocks.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// The swap's process-unique ID (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// The paged KV block pool with its owner-scoped prefix cache and second tier.
#[derive(Debug)]
pub struct KvCache {
    pool: BlockPool,
    index: HashMap<BlockHash, Indexed>,
    tier2: Tier2,
    owners: Owners,
    stats: KvStats,
    /// Scratch for hashes the second tier dropped (reused to avoid allocating).
    dropped: Vec<BlockHash>,
    /// The model's sliding windows, which decide how much of a match whose blocks lack
    /// their local layers may be used; `None`: no block ever lacks them.
    window: Option<WindowRule>,
    /// A grouped arena's units (`None`: a plain arena, memory for every layer of every
    /// block).
    units: Option<Units>,
    /// Units held by cached blocks (evictable, so available to an allocation).
    units_cached: usize,
    /// Per swap: which of its blocks held their local layers.
    swap_local: HashMap<u64, Vec<bool>>,
}

impl KvCache {
    /// A cache of `num_blocks` primary blocks, all free, and a second tier of
    /// `tier2_capacity_blocks` blocks (0 disables spilling and swapping).
    pub fn new(num_blocks: u32, tier2_capacity_blocks: usize) -> Self {
        Self {
            pool: BlockPool::new(num_blocks),
            index: HashMap::new(),
            tier2: Tier2::new(tier2_capacity_blocks),
            owners: Owners::default(),
            stats: KvStats::default(),
            dropped: Vec::new(),
            window: None,
            units: None,
            units_cached: 0,
            swap_local: HashMap::new(),
        }
    }

    /// A cache over a grouped arena of `units` units: group `g` of a block holds
    /// sliding-window layers where `local[g]`. [`KvCache::allocate`] gives blocks
    /// memory for their global groups only; [`KvCache::ensure_local`] adds the local
    /// ones before rows are computed into or read from a block, and
    /// [`KvCache::trim_local`] gives them back once no row reads them.
    pub fn with_units(num_blocks: u32, tier2_capacity_blocks: usize, units: usize, local: Vec<bool>) -> Self {
        let mut cache = Self::new(num_blocks, tier2_capacity_blocks);
        cache.units = Some(Units::new(num_blocks as usize, units, local));
        cache
    }

    /// Sets the model's sliding windows: matches over blocks marked by
    /// [`KvCache::mark_without_local_layers`] are cut by [`WindowRule::usable_prefix`].
    pub fn set_window_rule(&mut self, rule: WindowRule) {
        self.window = Some(rule);
    }

    /// How many of `n` matched blocks, `partial` of them lacking their local layers, a
    /// sequence may use (all of them unless a window rule says otherwise).
    fn usable(&self, partial: &[bool]) -> usize {
        match &self.window {
            Some(rule) if partial.iter().any(|&p| p) => rule.usable_prefix(partial),
            _ if partial.iter().any(|&p| p) => 0,
            _ => partial.len(),
        }
    }

    /// Current counts and cumulative counters.
    pub fn stats(&self) -> KvStats {
        KvStats {
            total: self.pool.total(),
            free: self.pool.free_count(),
            used: self.pool.used_count(),
            cached: self.pool.cached_count(),
            tier2_blocks: self.tier2.cached_len(),
            tier2_capacity: self.tier2.capacity(),
            swapped: self.tier2.swapped(),
            indexed: self.index.len(),
            units_total: self.units.as_ref().map_or(0, Units::total),
            units_free: self.units.as_ref().map_or(0, Units::free),
            units_cached: self.units_cached,
            allocatable: self.available_for_allocation(),
            ..self.stats
        }
    }

    /// Blocks an `allocate` could get now: free plus cached (evictable), as far as
    /// the units for their global layers go.
    pub fn available_for_allocation(&self) -> usize {
        let ids = self.pool.free_count() + self.pool.cached_count();
        match &self.units {
            Some(u) if u.per_block(false) > 0 => ids.min((u.free() + self.units_cached) / u.per_block(false)),
            _ => ids,
        }
    }

    /// Whether `blocks` new blocks plus local layers for `local_sets` blocks can be had
    /// now, evicting cached blocks as needed.
    fn can_take(&self, blocks: usize, local_sets: usize) -> bool {
        let ids = self.pool.free_count() + self.pool.cached_count() >= blocks;
        match &self.units {
            None => ids,
            Some(u) => ids && u.free() + self.units_cached >= blocks * u.per_block(false) + local_sets * u.local_per_block(),
        }
    }

    /// Whether `block` holds memory for its sliding-window layers (always, in a plain arena).
    /// Whether blocks hold their window layers' memory in units mapped and unmapped
    /// as windows slide (a grouped arena), rather than in every block for good.
    pub fn is_grouped(&self) -> bool {
        self.units.is_some()
    }

    pub fn has_local(&self, block: BlockId) -> bool {
        self.pool.state(block).is_some_and(|s| s != BlockState::Free) && self.units.as_ref().is_none_or(|u| u.has_local(block))
    }

    fn held(&self, block: BlockId) -> usize {
        self.units.as_ref().map_or(0, |u| u.held(block))
    }

    /// The state of a block, `None` if it is outside the pool.
    pub fn block_state(&self, block: BlockId) -> Option<BlockState> {
        self.pool.state(block)
    }

    /// Number of sequences pinning a block (0 for free, cached or unknown blocks).
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.pool.refcount(block)
    }

    /// The hash a block is published under, if any.
    pub fn block_hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.pool.hash(block)
    }

    /// Number of live publisher groups (user, conversation) with cached blocks.
    pub fn owner_groups(&self) -> usize {
        self.owners.group_count()
    }

    /// How many leading `keys` are cached, by tier, without changing anything.
    /// Cheap enough for admission and routing decisions. Decided exactly like
    /// [`KvCache::match_prefix`].
    pub fn peek_prefix(&self, keys: &[BlockKey<'_>]) -> PrefixPeek {
        let mut parent = None;
        // Per matched block: (from the second tier, lacks its local layers).
        let mut found: Vec<(bool, bool)> = Vec::new();
        for key in keys {
            if let Some(ix) = self.index.get(&key.hash) {
                if !ix.entry.is(key, parent) {
                    break;
                }
                parent = Some(ix.entry.link());
                found.push((false, ix.entry.local_layers_absent()));
            } else if let Some(entry) = self.tier2.entry(key.hash).filter(|e| e.is(key, parent)) {
                parent = Some(entry.link());
                found.push((true, entry.local_layers_absent()));
            } else {
                break;
            }
        }
        let partial: Vec<bool> = found.iter().map(|&(_, p)| p).collect();
        let usable = &found[..self.usable(&partial)];
        let tier2 = usable.iter().filter(|&&(t, _)| t).count();
        PrefixPeek { primary: usable.len() - tier2, tier2 }
    }

    /// Pins the blocks of the longest run of leading `keys` that is cached.
    ///
    /// A block is a hit only when the cached block's scope and tokens equal the
    /// key's and it was published right after the block matched before it (see
    /// [`super::key`]): an equal hash is where to look, never a reason to share KV,
    /// so neither a collision nor a forged chain crosses owners or contents.
    ///
    /// Primary hits are pinned in place (`Cached -> Used`, or one more holder for a
    /// block in use). A second-tier hit is promoted into a freshly allocated primary
    /// block with `copy_in`; if no primary block can be had (everything pinned) the
    /// match stops there.
    ///
    /// A match over blocks that lack their sliding-window layers is then cut where the
    /// window rule says (see [`KvCache::set_window_rule`]); the blocks past the cut are
    /// released again (a promoted one stays in the primary pool, cached).
    pub fn match_prefix(&mut self, keys: &[BlockKey<'_>], store: &mut dyn BlockStore) -> PrefixMatch {
        let mut out = PrefixMatch::default();
        let mut parent = None;
        // Per matched block: lacks its local layers.
        let mut partial: Vec<bool> = Vec::new();
        let mut from_tier2: Vec<bool> = Vec::new();
        for key in keys {
            let h = key.hash;
            if let Some(ix) = self.index.get(&h) {
                if !ix.entry.is(key, parent) {
                    self.stats.hash_collisions += 1;
                    break;
                }
                let (b, link) = (ix.block, ix.entry.link());
                let was_cached = self.pool.state(b) == Some(BlockState::Cached);
                if !self.pool.acquire(b) {
                    break; // unreachable while the invariants hold
                }
                if was_cached {
                    self.units_cached -= self.held(b);
                }
                partial.push(ix.entry.local_layers_absent());
                from_tier2.push(false);
                out.blocks.push(b);
                out.links.push(link);
                out.primary_hits += 1;
                parent = Some(link);
                continue;
            }
            match self.tier2.entry(h) {
                None => break,
                Some(entry) if !entry.is(key, parent) => {
                    self.stats.hash_collisions += 1;
                    break;
                }
                Some(entry) => {
                    if !self.can_take(1, usize::from(!entry.local_layers_absent())) {
                        break;
                    }
                }
            }
            // Take the bytes out first: that frees the room the eviction below may
            // need to spill its victim.
            let Some((entry, data)) = self.tier2.take(h) else { break };
            if data.len() != store.block_bytes() {
                // Written by a store of another shape: useless, drop it.
                self.owners.forget(h);
                break;
            }
            let Some(b) = self.grab_block(store, !entry.local_layers_absent()) else {
                self.reinsert(h, entry, data);
                break;
            };
            store.copy_in(b, &data);
            let link = entry.link();
            partial.push(entry.local_layers_absent());
            from_tier2.push(true);
            self.pool.set_hash(b, h);
            self.index.insert(h, Indexed { block: b, entry });
            out.blocks.push(b);
            out.links.push(link);
            out.tier2_hits += 1;
            parent = Some(link);
        }
        let usable = self.usable(&partial);
        if usable < out.blocks.len() {
            self.release_unchecked(&out.blocks[usable..]);
            out.blocks.truncate(usable);
            out.links.truncate(usable);
            out.tier2_hits = from_tier2[..usable].iter().filter(|&&t| t).count();
            out.primary_hits = usable - out.tier2_hits;
        }
        self.stats.primary_hits += out.primary_hits as u64;
        self.stats.tier2_hits += out.tier2_hits as u64;
        out
    }

    /// Puts a taken tier-2 entry back (a promotion that could not complete).
    fn reinsert(&mut self, hash: BlockHash, entry: Entry, data: Box<[u8]>) {
        if !self.tier2.insert(hash, entry, data, &mut self.dropped) {
            self.owners.forget(hash);
        }
        self.forget_dropped();
    }

    fn forget_dropped(&mut self) {
        for h in self.dropped.drain(..) {
            self.owners.forget(h);
            self.stats.tier2_dropped += 1;
        }
    }

    /// One block for a new owner, with memory for its global layers and, `with_local`,
    /// its sliding-window ones: a free block, after evicting least recently used
    /// cached blocks (spilled to the second tier when it has room) while there is no
    /// free block or too few free units.
    fn grab_block(&mut self, store: &mut dyn BlockStore, with_local: bool) -> Option<BlockId> {
        let need = self.units.as_ref().map_or(0, |u| u.per_block(with_local));
        if !self.make_room(1, need, store) {
            return None;
        }
        let b = self.pool.pop_free()?;
        if let Some(u) = &mut self.units {
            u.take(b, with_local, store);
        }
        Some(b)
    }

    /// Evicts least recently used cached blocks until `ids` blocks and `units` units
    /// are free; false when the cached blocks run out first.
    fn make_room(&mut self, ids: usize, units: usize, store: &mut dyn BlockStore) -> bool {
        while self.pool.free_count() < ids || self.units.as_ref().is_some_and(|u| u.free() < units) {
            if !self.evict_lru(store) {
                return false;
            }
        }
        true
    }

    /// Evicts the least recently used cached block: its bytes spill to the second tier
    /// when it has room, its memory and ID become free. False when nothing is cached.
    fn evict_lru(&mut self, store: &mut dyn BlockStore) -> bool {
        let Some((b, old)) = self.pool.pop_lru() else { return false };
        self.units_cached -= self.held(b);
        let evicted = self.index.remove(&old);
        self.stats.evicted += 1;
        match evicted.filter(|_| self.tier2.swap_room() > 0) {
            None => self.owners.forget(old),
            Some(Indexed { entry, .. }) => {
                let mut data = vec![0u8; store.block_bytes()].into_boxed_slice();
                store.copy_out(b, &mut data);
                if self.tier2.insert(old, entry, data, &mut self.dropped) {
                    self.stats.spilled += 1;
                } else {
                    self.owners.forget(old);
                }
                self.forget_dropped();
            }
        }
        if let Some(u) = &mut self.units {
            u.give_back(b, false, store);
        }
        // Its hash went with `pop_lru`: the release frees it.
        let _: Released = self.pool.release(b);
        true
    }

    /// Gives every block of `blocks` that lacks them memory for its sliding-window
    /// layers, evicting cached blocks as needed. Returns how many got it. All or
    /// nothing: [`KvError::OutOfBlocks`] (counted in blocks) when the memory cannot be
    /// had, [`KvError::NotInUse`] for a block no sequence holds. A plain arena's
    /// blocks always have it.
    pub fn ensure_local(&mut self, blocks: &[BlockId], store: &mut dyn BlockStore) -> Result<usize, KvError> {
        let Some(units) = &self.units else { return Ok(0) };
        let mut lacking: Vec<BlockId> = Vec::new();
        for &b in blocks {
            match self.pool.state(b) {
                None => return Err(self.unknown(b)),
                Some(BlockState::Used { .. }) => {}
                Some(_) => return Err(KvError::NotInUse { block: b }),
            }
            if !units.has_local(b) && !lacking.contains(&b) {
                lacking.push(b);
            }
        }
        let (per_block, free) = (units.local_per_block(), units.free());
        if !self.can_take(0, lacking.len()) {
            let available = (free + self.units_cached) / per_block.max(1);
            return Err(KvError::OutOfBlocks { requested: lacking.len(), available });
        }
        // Cannot fail: `can_take` counted the cached blocks' units.
        self.make_room(0, lacking.len() * per_block, store);
        let Some(units) = &mut self.units else { return Ok(0) };
        for &b in &lacking {
            units.take(b, true, store);
        }
        Ok(lacking.len())
    }

    /// Gives back the sliding-window layers' memory of those `blocks` that no other
    /// sequence holds: the caller's rows will not read them again (they lie before
    /// every window of its next row, [`WindowRule::reclaimable_blocks`]). A published
    /// block given back is marked as lacking them, so later matches skip it by the
    /// window rule. Returns how many blocks gave it back (0 in a plain arena).
    pub fn trim_local(&mut self, blocks: &[BlockId], store: &mut dyn BlockStore) -> usize {
        let mut n = 0;
        for &b in blocks {
            if self.pool.refcount(b) != 1 || !self.units.as_ref().is_some_and(|u| u.has_local(b) && u.local_per_block() > 0) {
                continue;
            }
            if let Some(u) = &mut self.units {
                u.give_back(b, true, store);
            }
            self.mark_without_local_layers(b);
            n += 1;
        }
        self.stats.local_reclaimed += n as u64;
        n
    }

    /// Pins `n` new blocks (free first, then evicting least recently used cached
    /// blocks, spilling them to the second tier). All or nothing: on
    /// [`KvError::OutOfBlocks`] nothing changed. The blocks' contents are undefined.
    ///
    /// In a grouped arena ([`KvCache::with_units`]) the blocks get memory for their
    /// global layers only; [`KvCache::ensure_local`] adds the rest.
    pub fn allocate(&mut self, n: usize, store: &mut dyn BlockStore) -> Result<Vec<BlockId>, KvError> {
        let available = self.available_for_allocation();
        if !self.can_take(n, 0) {
            return Err(KvError::OutOfBlocks { requested: n, available });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match self.grab_block(store, false) {
                Some(b) => out.push(b),
                None => {
                    // Unreachable given the check above; undo rather than leak.
                    self.release_unchecked(&out);
                    return Err(KvError::OutOfBlocks { requested: n, available });
                }
            }
        }
        Ok(out)
    }

    /// Publishes a pinned, full block as `key` so that later sequences can match
    /// it. Call only once the block's KV is written. `parent` is the link of the
    /// sequence's previous block (`None` for its first block); a block whose
    /// predecessor has no link must not be registered. If the key's hash is taken,
    /// this block stays private: [`Registered::Duplicate`] when the holder is the
    /// same block, [`Registered::Collision`] when it is not. `owner` is recorded for
    /// deletion; pass [`BlockOwner::Platform`] for platform-scope blocks so that
    /// deleting a conversation never drops the shared system prompt.
    pub fn register(
        &mut self,
        block: BlockId,
        key: BlockKey<'_>,
        parent: Option<ChainLink>,
        owner: &BlockOwner,
    ) -> Result<Registered, KvError> {
        let hash = key.hash;
        match self.pool.state(block) {
            None => return Err(self.unknown(block)),
            Some(BlockState::Used { .. }) => {}
            Some(_) => return Err(KvError::NotInUse { block }),
        }
        if let Some(published) = self.pool.hash(block) {
            return match self.index.get(&published) {
                Some(ix) if published == hash && ix.entry.is(&key, parent) => Ok(Registered::Unchanged(ix.entry.link())),
                _ => Err(KvError::HashConflict { block, published, requested: hash }),
            };
        }
        if let Some(ix) = self.index.get(&hash) {
            if ix.entry.is(&key, parent) {
                return Ok(Registered::Duplicate { existing: ix.block, link: ix.entry.link() });
            }
            self.stats.hash_collisions += 1;
            return Ok(Registered::Collision { holder: ix.block });
        }
        // A spilled copy under the same hash is now redundant (the same block) or
        // another block (a collision): either way the primary copy wins. A
        // different block's publishers must not be charged with this one.
        if let Some((old, _)) = self.tier2.take(hash) {
            if !old.is(&key, parent) {
                self.owners.forget(hash);
            }
        }
        let mut entry = Entry::new(&key, parent);
        if !self.has_local(block) {
            // Its window layers' memory was given back: matches must skip it.
            entry.mark_without_local_layers();
        }
        let link = entry.link();
        self.pool.set_hash(block, hash);
        self.index.insert(hash, Indexed { block, entry });
        self.owners.record(hash, owner);
        Ok(Registered::Published(link))
    }

    /// Marks a block this sequence just published ([`Registered::Published`]) as lacking
    /// its sliding-window layers (they were not received; zeros there): matches then use
    /// it only where the window rule lets them skip it. A block not published is left as
    /// it is (a duplicate's holder has its own layers).
    pub fn mark_without_local_layers(&mut self, block: BlockId) {
        let Some(hash) = self.pool.hash(block) else { return };
        if let Some(ix) = self.index.get_mut(&hash).filter(|ix| ix.block == block) {
            ix.entry.mark_without_local_layers();
        }
    }

    fn unknown(&self, block: BlockId) -> KvError {
        KvError::UnknownBlock { block, total: self.pool.total() }
    }

    /// Checks that every block can lose one holder per occurrence in `blocks`;
    /// returns the first that cannot.
    fn check_pinned(&self, blocks: &[BlockId]) -> Result<(), (BlockId, bool)> {
        let mut sorted: Vec<BlockId> = blocks.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            let b = run[0];
            match self.pool.state(b) {
                None => return Err((b, false)),
                Some(BlockState::Used { refcount }) if refcount as usize >= run.len() => {}
                Some(_) => return Err((b, true)),
            }
        }
        Ok(())
    }

    /// Drops one holder of each block (a block listed twice loses two). At zero a
    /// published block becomes cached, an unpublished one free. Pass a sequence's
    /// blocks in sequence order: the tail becomes least recently used, so eviction
    /// takes it before the prefix it depends on. All or nothing: releasing a block
    /// that is not in use is [`KvError::DoubleRelease`] and changes nothing.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        match self.check_pinned(blocks) {
            Ok(()) => {
                self.release_unchecked(blocks);
                Ok(())
            }
            Err((block, true)) => Err(KvError::DoubleRelease { block }),
            Err((block, false)) => Err(self.unknown(block)),
        }
    }

    fn release_unchecked(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            match self.pool.release(b) {
                Released::StillUsed => {}
                Released::Cached => self.units_cached += self.held(b),
                Released::Freed => self.free_units(b),
            }
        }
    }

    /// A block that became free gives back all its memory.
    fn free_units(&mut self, block: BlockId) {
        if let Some(u) = &mut self.units {
            u.give_back(block, false, &mut NoStore);
        }
    }

    /// Deletes everything a conversation published: its blocks leave the index and
    /// the second tier. Cached blocks become free at once; pinned ones stay with
    /// their sequences, unpublished, and become free on their last release. Returns
    /// the number of blocks removed (both tiers). Swaps are not touched: the scheduler
    /// drops the swaps of the conversation's sequences itself.
    pub fn evict_conversation(&mut self, conversation: &ConversationId) -> usize {
        let hashes = self.owners.take_conversation(conversation);
        self.evict_hashes(&hashes)
    }

    /// Deletes everything a user published, in every conversation (see
    /// [`KvCache::evict_conversation`]).
    pub fn evict_owner(&mut self, user: &OwnerId) -> usize {
        let hashes = self.owners.take_user(user);
        self.evict_hashes(&hashes)
    }

    fn evict_hashes(&mut self, hashes: &[BlockHash]) -> usize {
        let mut n = 0;
        for &h in hashes {
            let mut found = false;
            if let Some(ix) = self.index.remove(&h) {
                if self.pool.state(ix.block) == Some(BlockState::Cached) {
                    self.units_cached -= self.held(ix.block);
                    self.free_units(ix.block);
                }
                self.pool.unpublish(ix.block);
                found = true;
            }
            found |= self.tier2.remove(h);
            n += usize::from(found);
        }
        n
    }

    /// Preempts a sequence: copies its blocks' bytes to the second tier (never
    /// dropped by the LRU while swapped) and releases them like [`KvCache::release`].
    /// All or nothing: [`KvError::Tier2Full`] if other swaps leave too little room,
    /// [`KvError::NotInUse`] for a block that is not pinned.
    pub fn swap_out(&mut self, blocks: &[BlockId], store: &mut dyn BlockStore) -> Result<SwapHandle, KvError> {
        match self.check_pinned(blocks) {
            Ok(()) => {}
            Err((block, true)) => return Err(KvError::NotInUse { block }),
            Err((block, false)) => return Err(self.unknown(block)),
        }
        let room = self.tier2.swap_room();
        if blocks.len() > room {
            return Err(KvError::Tier2Full { requested: blocks.len(), available: room });
        }
        let bytes = store.block_bytes();
        let data: Vec<Box<[u8]>> = blocks
            .iter()
            .map(|&b| {
                let mut d = vec![0u8; bytes].into_boxed_slice();
                store.copy_out(b, &mut d);
                d
            })
            .collect();
        let id = NEXT_SWAP_ID.fetch_add(1, Ordering::Relaxed);
        if self.tier2.insert_swap(id, data, &mut self.dropped).is_err() {
            return Err(KvError::Tier2Full { requested: blocks.len(), available: room });
        }
        self.forget_dropped();
        if self.units.is_some() {
            let local = blocks.iter().map(|&b| self.has_local(b)).collect();
            self.swap_local.insert(id, local);
        }
        self.release_unchecked(blocks);
        Ok(SwapHandle { id, blocks: blocks.len() })
    }

    /// Resumes a swapped-out sequence: allocates blocks (like `allocate`) and copies
    /// its bytes back, returning the blocks in the order they were swapped out. All
    /// or nothing: on failure the swap is intact and the error ([`KvError::SwapIn`])
    /// carries the handle back.
    pub fn swap_in(&mut self, handle: SwapHandle, store: &mut dyn BlockStore) -> Result<Vec<BlockId>, KvError> {
        let fail = |handle, source| Err(KvError::SwapIn { handle, source: Box::new(source) });
        let Some(data) = self.tier2.swap_data(handle.id) else {
            let id = handle.id;
            return fail(handle, KvError::UnknownSwap { id });
        };
        if let Some(d) = data.iter().find(|d| d.len() != store.block_bytes()) {
            let source = KvError::BlockBytesMismatch { stored: d.len(), store: store.block_bytes() };
            return fail(handle, source);
        }
        let n = data.len();
        let local: Vec<bool> = self.swap_local.get(&handle.id).cloned().unwrap_or_else(|| vec![true; n]);
        if !self.can_take(n, local.iter().filter(|&&l| l).count()) {
            let available = self.available_for_allocation();
            return fail(handle, KvError::OutOfBlocks { requested: n, available });
        }
        // Drop the swap's reservation first, so that blocks evicted to make room can
        // spill into it instead of pushing out other cached entries.
        let Some(data) = self.tier2.take_swap(handle.id) else {
            let id = handle.id;
            return fail(handle, KvError::UnknownSwap { id });
        };
        let blocks = match self.allocate(n, store) {
            Ok(blocks) => {
                let with_local: Vec<BlockId> = blocks.iter().zip(&local).filter(|&(_, &l)| l).map(|(&b, _)| b).collect();
                // Cannot fail: `can_take` counted these units.
                if let Err(e) = self.ensure_local(&with_local, store) {
                    tracing::error!(error = %e, "swap-in: window layers' memory refused after the check");
                }
                self.swap_local.remove(&handle.id);
                blocks
            }
            Err(source) => {
                // Unreachable given the check above. Restoring cannot fail: the
                // room was ours a moment ago and cached entries yield to swaps.
                let _ = self.tier2.insert_swap(handle.id, data, &mut self.dropped);
                self.forget_dropped();
                return fail(handle, source);
            }
        };
        for (&b, d) in blocks.iter().zip(&data) {
            store.copy_in(b, d);
        }
        Ok(blocks)
    }

    /// Discards a swap (its sequence was cancelled). Returns the blocks freed in the
    /// second tier (0 for a handle of another cache).
    pub fn drop_swap(&mut self, handle: SwapHandle) -> usize {
        let n = self.tier2.swap_len(handle.id).unwrap_or(0);
        self.tier2.drop_swap(handle.id);
        self.swap_local.remove(&handle.id);
        n
    }

    /// Audits every invariant of the cache; panics with the first violation.
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        self.pool.assert_consistent();
        self.tier2.assert_consistent();
        self.owners.assert_consistent();
        let s = self.stats();
        assert_eq!(s.free + s.used + s.cached, s.total);
        for (&h, ix) in &self.index {
            let b = ix.block;
            assert_eq!(self.pool.hash(b), Some(h), "index {h} -> {b} disagrees with the pool");
            assert_ne!(self.pool.state(b), Some(BlockState::Free));
            assert!(!self.tier2.contains(h), "{h} is in both tiers");
        }
        let published = (0..s.total as u32).filter(|&b| self.pool.hash(BlockId(b)).is_some()).count();
        assert_eq!(published, self.index.len());
        for h in self.owners.hashes() {
            assert!(self.index.contains_key(&h) || self.tier2.contains(h), "owner of {h} outlived its data");
        }
        if let Some(u) = &self.units {
            u.assert_consistent(|b| self.pool.state(b) != Some(BlockState::Free));
            let cached: usize = (0..s.total as u32).map(BlockId).filter(|&b| self.pool.state(b) == Some(BlockState::Cached)).map(|b| u.held(b)).sum();
            assert_eq!(cached, self.units_cached, "units of cached blocks");
            for ix in self.index.values() {
                assert!(u.has_local(ix.block) || ix.entry.local_layers_absent(), "{} lacks its window layers' memory but is not marked", ix.block);
            }
        }
    }

    /// Second-tier cached hashes, least recently used first (tests only).
    #[cfg(test)]
    pub(crate) fn tier2_hashes(&self) -> Vec<BlockHash> {
        self.tier2.cached_hashes()
    }
}
