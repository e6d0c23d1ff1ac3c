//! What a cached block must equal for a lookup to be a hit.
//!
//! The chain hash ([`super::block_hash`]) only *finds* a candidate: XXH64 is fast,
//! not collision resistant, and a user chooses their own tokens. So every cached
//! block carries an [`Entry`]: its owner scope, its full token IDs and the
//! [`ChainLink`] of the entry it was published after. A lookup walks a sequence's
//! blocks from the first and takes a block only when scope and tokens equal the
//! query's *and* its parent link is the entry the walk took for the previous block.
//! By induction a hit at block `i` means the whole prefix `0..=i` is token for token
//! the one that produced the cached KV, under the same owner scopes, whatever the
//! hashes did.
//!
//! Links are never reused (one process-wide counter), so a child whose parent entry
//! was evicted and replaced, even by a block with the same hash, can no longer be
//! reached through the replacement: a forged chain cannot splice.

use std::sync::atomic::{AtomicU64, Ordering};

use super::ids::{BlockHash, OwnerScope};

/// Process-wide, so a link from one cache never names an entry of another.
static NEXT_LINK: AtomicU64 = AtomicU64::new(1);

/// One full block of a query: its chain hash (where to look) and the scope and
/// tokens the cached block must hold (what decides the hit). Built by
/// [`super::HashChain::keys`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockKey<'a> {
    /// The block's chain hash.
    pub hash: BlockHash,
    /// Who may reuse the block.
    pub scope: &'a OwnerScope,
    /// The block's token IDs (exactly one block of them).
    pub tokens: &'a [u32],
}

/// The identity of one published block in a prefix cache. A sequence keeps the
/// link of each of its blocks (from a match or a register) and passes the previous
/// one as the parent when it registers the next block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChainLink(u64);

impl ChainLink {
    fn fresh() -> Self {
        Self(NEXT_LINK.fetch_add(1, Ordering::Relaxed))
    }
}

/// What the cache stores beside a published block (in either tier): everything a
/// lookup compares. Costs `4 * block_tokens` bytes of tokens plus the user ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    link: ChainLink,
    parent: Option<ChainLink>,
    scope: OwnerScope,
    tokens: Box<[u32]>,
    /// The block's sliding-window layers were not received (see [`super::window`]): it
    /// serves only matches that the window rule lets skip it. Not compared by [`Entry::is`]:
    /// it says how the block may be used, not which block it is.
    local_layers_absent: bool,
}

impl Entry {
    /// A new entry for a block published as `key` after `parent`, with a fresh link.
    pub(crate) fn new(key: &BlockKey<'_>, parent: Option<ChainLink>) -> Self {
        Self { link: ChainLink::fresh(), parent, scope: key.scope.clone(), tokens: key.tokens.into(), local_layers_absent: false }
    }

    /// Marks the entry (same link) as lacking its sliding-window layers.
    pub(crate) fn mark_without_local_layers(&mut self) {
        self.local_layers_absent = true;
    }

    pub(crate) fn local_layers_absent(&self) -> bool {
        self.local_layers_absent
    }

    pub(crate) fn link(&self) -> ChainLink {
        self.link
    }

    /// Whether this entry is the block `key` names, published right after the entry
    /// `parent` (`None`: the first block of a sequence). The hash is not compared:
    /// the caller found the entry by it.
    pub(crate) fn is(&self, key: &BlockKey<'_>, parent: Option<ChainLink>) -> bool {
        self.parent == parent && *self.tokens == *key.tokens && self.scope == *key.scope
    }
}
