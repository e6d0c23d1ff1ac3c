//! Block identity: the owner-scoped hash chain over full blocks of tokens.
//!
//! A block's hash covers its parent's hash, its owner scope and its token IDs, so a
//! hash stands for a whole prefix, not just one block: two sequences get the same hash
//! for block `i` when they agree on every token before it *and* on every scope. Because
//! a user's blocks hash their [`OwnerId`], user B does not get user A's hashes from the
//! same tokens, while blocks that lie entirely inside the platform prefix (the system
//! prompt) hash [`OwnerScope::Platform`] and are shared by everyone.
//!
//! Invariant: the hash is stable across processes, platforms, builds and releases.
//! Prefill and decode nodes compute it independently and must agree, so it uses a
//! fixed algorithm (XXH64, seed 0, written out here so that the value never depends on
//! a dependency's version) over an explicit little-endian, length-prefixed encoding:
//!
//! ```text
//! version:u8 = 1
//! parent:  u8 0                       (no parent)
//!        | u8 1, u64 parent hash       (has parent)
//! scope:   u8 0                       (platform)
//!        | u8 1, u32 len, len bytes    (user ID, UTF-8)
//! tokens:  u32 count, count x u32
//! ```
//!
//! Changing this encoding invalidates every cached block in a fleet at once; bump the
//! version byte if it must ever change. A 64-bit hash makes an accidental collision
//! among a node's live blocks about as likely as n^2 / 2^65 (n = 10^6 blocks: 3e-8).
//!
//! The hash only *finds* a block; it never decides a hit. XXH64 is not collision
//! resistant, so the prefix cache stores each block's scope, tokens and parent link and
//! compares them on every lookup (see [`super::BlockKey`]). The hasher is a trait so
//! that tests can forge collisions at will ([`ConstantHasher`]).

use std::fmt;
use std::sync::Arc;

use super::ids::{BlockHash, OwnerScope, OwnerId};
use super::key::BlockKey;

const VERSION: u8 = 1;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline]
fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

#[inline]
fn read_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

#[inline]
fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

#[inline]
fn merge_round(acc: u64, val: u64) -> u64 {
    (acc ^ round(0, val)).wrapping_mul(P1).wrapping_add(P4)
}

/// XXH64 of `data` with `seed`, bit-identical to the reference implementation (and
/// to `xxhash_rust::xxh64::xxh64`), so the block hash could later move to that crate
/// without changing a single value.
pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let len = data.len();
    let mut rest = data;
    let mut h = if len >= 32 {
        let mut v1 = seed.wrapping_add(P1).wrapping_add(P2);
        let mut v2 = seed.wrapping_add(P2);
        let mut v3 = seed;
        let mut v4 = seed.wrapping_sub(P1);
        while rest.len() >= 32 {
            v1 = round(v1, read_u64(&rest[0..]));
            v2 = round(v2, read_u64(&rest[8..]));
            v3 = round(v3, read_u64(&rest[16..]));
            v4 = round(v4, read_u64(&rest[24..]));
            rest = &rest[32..];
        }
        let mut h = v1
            .rotate_left(1)
            .wrapping_add(v2.rotate_left(7))
            .wrapping_add(v3.rotate_left(12))
            .wrapping_add(v4.rotate_left(18));
        h = merge_round(h, v1);
        h = merge_round(h, v2);
        h = merge_round(h, v3);
        merge_round(h, v4)
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(len as u64);
    while rest.len() >= 8 {
        h ^= round(0, read_u64(rest));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        h ^= u64::from(read_u32(rest)).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &byte in rest {
        h ^= u64::from(byte).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// Writes the canonical encoding of one block into `buf` (cleared first), so a chain
/// of blocks reuses one buffer.
fn encode_block(buf: &mut Vec<u8>, parent: Option<BlockHash>, scope: &OwnerScope, tokens: &[u32]) {
    buf.clear();
    buf.push(VERSION);
    match parent {
        None => buf.push(0),
        Some(p) => {
            buf.push(1);
            buf.extend_from_slice(&p.0.to_le_bytes());
        }
    }
    match scope {
        OwnerScope::Platform => buf.push(0),
        OwnerScope::User(user) => {
            buf.push(1);
            let bytes = user.as_str().as_bytes();
            // A u32 length is plenty for an ID; saturating keeps the encoding total
            // even for absurd input (the bytes themselves still differ).
            buf.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_le_bytes());
            buf.extend_from_slice(bytes);
        }
    }
    buf.extend_from_slice(&u32::try_from(tokens.len()).unwrap_or(u32::MAX).to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
}

/// The identity of one block: its parent's hash (`None` for the first block of a
/// sequence), its owner scope and its token IDs. Stable everywhere (see the module
/// docs for the exact encoding).
pub fn block_hash(parent: Option<BlockHash>, scope: &OwnerScope, tokens: &[u32]) -> BlockHash {
    let mut buf = Vec::with_capacity(32 + 4 * tokens.len());
    Xxh64BlockHasher.hash_block(&mut buf, parent, scope, tokens)
}

/// How a block's chain hash is computed from its parent's hash, scope and tokens.
///
/// Production uses [`Xxh64BlockHasher`] everywhere (nodes must agree on it). The
/// prefix cache never trusts the hash alone, so any implementation is *safe*, a poor
/// one only costs hits; that is what lets tests plug in [`ConstantHasher`].
pub trait BlockHasher: fmt::Debug + Send + Sync {
    /// The hash of one block. `scratch` is a reusable buffer for an encoding.
    fn hash_block(&self, scratch: &mut Vec<u8>, parent: Option<BlockHash>, scope: &OwnerScope, tokens: &[u32]) -> BlockHash;
}

/// The canonical block hash: XXH64 over the encoding in the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Xxh64BlockHasher;

impl BlockHasher for Xxh64BlockHasher {
    fn hash_block(&self, scratch: &mut Vec<u8>, parent: Option<BlockHash>, scope: &OwnerScope, tokens: &[u32]) -> BlockHash {
        encode_block(scratch, parent, scope, tokens);
        BlockHash(xxh64(scratch, 0))
    }
}

/// A deliberately broken hasher: every block of every owner hashes to the same
/// value. For tests only: it turns every lookup into a hash collision, which the
/// prefix cache must refuse unless scope, tokens and parent all match.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConstantHasher(pub u64);

impl BlockHasher for ConstantHasher {
    fn hash_block(&self, _: &mut Vec<u8>, _: Option<BlockHash>, _: &OwnerScope, _: &[u32]) -> BlockHash {
        BlockHash(self.0)
    }
}

/// The hashes of every full block of `tokens`, `block_tokens` tokens per block.
///
/// Block `i` covers tokens `i*block_tokens .. (i+1)*block_tokens`; it has platform
/// scope when it lies entirely inside the platform-shared prefix (`tokens[..platform_len]`),
/// else the scope of `user`. A trailing partial block has no hash (its contents are
/// not final). `block_tokens == 0` yields no blocks.
pub fn prefix_hashes(
    tokens: &[u32],
    block_tokens: usize,
    platform_len: usize,
    user: &OwnerId,
) -> Vec<BlockHash> {
    let mut chain = HashChain::new(block_tokens, platform_len, user.clone());
    chain.update(tokens);
    chain.into_hashes()
}

/// The hash chain of one growing sequence: feed it the sequence's tokens after each
/// step and it hashes only the blocks that became full since the last call. The
/// scheduler keeps one per sequence to register blocks as decode fills them.
#[derive(Debug, Clone)]
pub struct HashChain {
    block_tokens: usize,
    platform_len: usize,
    user: OwnerScope,
    /// Kept here so that [`HashChain::keys`] can lend it out like `user`.
    platform: OwnerScope,
    hasher: Arc<dyn BlockHasher>,
    hashes: Vec<BlockHash>,
    buf: Vec<u8>,
}

impl HashChain {
    /// An empty chain for a sequence of `user` whose first `platform_len` tokens are
    /// the platform-shared prefix, hashed with the canonical [`Xxh64BlockHasher`].
    pub fn new(block_tokens: usize, platform_len: usize, user: OwnerId) -> Self {
        Self::with_hasher(block_tokens, platform_len, user, Arc::new(Xxh64BlockHasher))
    }

    /// [`HashChain::new`] with another hasher (tests that forge collisions).
    pub fn with_hasher(block_tokens: usize, platform_len: usize, user: OwnerId, hasher: Arc<dyn BlockHasher>) -> Self {
        Self {
            block_tokens,
            platform_len,
            user: OwnerScope::User(user),
            platform: OwnerScope::Platform,
            hasher,
            hashes: Vec::new(),
            buf: Vec::new(),
        }
    }

    /// The scope of block `i`: platform when it lies entirely inside the platform
    /// prefix, else the user's.
    fn scope(&self, i: usize) -> &OwnerScope {
        if (i + 1) * self.block_tokens <= self.platform_len {
            &self.platform
        } else {
            &self.user
        }
    }

    /// Brings the chain up to date with `tokens`, the sequence's full token list so
    /// far, and returns the hashes of the blocks that became full. `tokens` must
    /// extend the tokens of the previous call; if it is shorter, the chain drops the
    /// hashes of blocks that are no longer full.
    pub fn update(&mut self, tokens: &[u32]) -> &[BlockHash] {
        let full = tokens.len().checked_div(self.block_tokens).unwrap_or(0);
        if full < self.hashes.len() {
            self.hashes.truncate(full);
        }
        let start = self.hashes.len();
        for i in start..full {
            let begin = i * self.block_tokens;
            let end = begin + self.block_tokens;
            let scope = if end <= self.platform_len { &self.platform } else { &self.user };
            let parent = self.hashes.last().copied();
            let hash = self.hasher.hash_block(&mut self.buf, parent, scope, &tokens[begin..end]);
            self.hashes.push(hash);
        }
        &self.hashes[start..]
    }

    /// The cache keys of the first `n` full blocks (at most the blocks hashed so far):
    /// each block's hash with the scope and tokens it stands for. `tokens` must be the
    /// sequence the chain was updated with (or extend it).
    pub fn keys<'a>(&'a self, tokens: &'a [u32], n: usize) -> Vec<BlockKey<'a>> {
        let bt = self.block_tokens;
        let n = n.min(self.hashes.len()).min(tokens.len().checked_div(bt).unwrap_or(0));
        (0..n)
            .map(|i| BlockKey { hash: self.hashes[i], scope: self.scope(i), tokens: &tokens[i * bt..(i + 1) * bt] })
            .collect()
    }

    /// The cache key of full block `i`, if it has been hashed (see [`HashChain::keys`]).
    pub fn key<'a>(&'a self, tokens: &'a [u32], i: usize) -> Option<BlockKey<'a>> {
        let bt = self.block_tokens;
        let hash = *self.hashes.get(i)?;
        let tokens = tokens.get(i * bt..(i + 1) * bt)?;
        Some(BlockKey { hash, scope: self.scope(i), tokens })
    }

    /// Hashes of all full blocks so far, in sequence order.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Consumes the chain, returning its hashes.
    pub fn into_hashes(self) -> Vec<BlockHash> {
        self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_matches_reference_vectors() {
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
        // 39 bytes: exercises the 32-byte stripes, the 4-byte and 1-byte tails.
        assert_eq!(xxh64(b"Nobody inspects the spammish repetition", 0), 0xFBCE_A83C_8A37_8BF1);
        // Every tail length, with a seed, against the `xxhash` Python package.
        let expected: [(usize, u64); 13] = [
            (0, 0xC434_9FC9_3C01_0000),
            (1, 0x5858_8242_2A61_65E7),
            (3, 0x5ACB_303E_7813_3C22),
            (4, 0x7D51_D5E2_4617_32B3),
            (7, 0x2CE9_ADEC_2B2C_8104),
            (8, 0x7588_48F0_33FA_76A2),
            (31, 0xF51C_9323_5F25_11CB),
            (32, 0x5D74_20E0_08FD_87B8),
            (33, 0x55A3_CECD_9490_AE56),
            (63, 0x26A8_88F0_A86A_CA92),
            (64, 0x51DC_1183_EBCF_BE79),
            (100, 0xE93A_69CD_BE4C_C97B),
            (1000, 0x923A_32EC_0386_C267),
        ];
        for (n, want) in expected {
            let data: Vec<u8> = (0..n).map(|i| ((i * 31 + 7) % 251) as u8).collect();
            assert_eq!(xxh64(&data, 0x9E37_79B9_7F4A_7C15), want, "length {n}");
        }
    }

    fn owner(id: &str) -> OwnerId {
        OwnerId::parse(id).expect("a valid test owner")
    }

    #[test]
    fn block_hash_is_pinned() {
        // Pinned values (cross-checked by encoding the blocks by hand and hashing them
        // with the `xxhash` Python package): if this test fails, every fleet's cache
        // keys changed. Only update it together with the VERSION byte.
        let user = OwnerScope::User(owner("u1"));
        let a = block_hash(None, &OwnerScope::Platform, &[1, 2, 3]);
        let b = block_hash(Some(a), &user, &[4, 5, 6]);
        assert_eq!((a, b), (PINNED_A, PINNED_B));
    }

    const PINNED_A: BlockHash = BlockHash(15_667_452_940_868_529_868);
    const PINNED_B: BlockHash = BlockHash(5_651_737_593_663_896_499);

    #[test]
    fn scope_bytes_are_length_prefixed() {
        let t = [7u32, 8];
        let ab = block_hash(None, &OwnerScope::User(owner("ab")), &t);
        let a = block_hash(None, &OwnerScope::User(owner("a")), &t);
        assert_ne!(ab, a);
        // The owner ID's bytes must not run into the token bytes. (An owner ID cannot
        // hold a control character any more, but the encoding must not rely on that.)
        let u1 = block_hash(None, &OwnerScope::User(owner("x1")), &[0]);
        let u2 = block_hash(None, &OwnerScope::User(owner("x")), &[1, 0]);
        assert_ne!(u1, u2);
        // The shortest owner (an empty one cannot be made) is still not the platform.
        assert_ne!(
            block_hash(None, &OwnerScope::Platform, &t),
            block_hash(None, &OwnerScope::User(owner("x")), &t)
        );
    }

    #[test]
    fn parent_is_part_of_identity() {
        let p = block_hash(None, &OwnerScope::Platform, &[1]);
        let with = block_hash(Some(p), &OwnerScope::Platform, &[2]);
        let without = block_hash(None, &OwnerScope::Platform, &[2]);
        assert_ne!(with, without);
        assert_ne!(block_hash(Some(BlockHash(0)), &OwnerScope::Platform, &[2]), without);
    }

    #[test]
    fn prefix_hashes_scopes_platform_blocks_and_skips_partial_tail() {
        let tokens: Vec<u32> = (0..10).collect();
        let alice = owner("alice");
        let bob = owner("bob");
        let a = prefix_hashes(&tokens, 4, 8, &alice);
        let b = prefix_hashes(&tokens, 4, 8, &bob);
        assert_eq!(a.len(), 2, "10 tokens make two full blocks of 4");
        assert_eq!(a, b, "both blocks lie inside the platform prefix");
        // A platform prefix that ends mid-block makes that block user-scoped.
        let a = prefix_hashes(&tokens, 4, 6, &alice);
        let b = prefix_hashes(&tokens, 4, 6, &bob);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert!(prefix_hashes(&tokens, 0, 0, &alice).is_empty());
        // Blocks follow the chain definition.
        let first = block_hash(None, &OwnerScope::Platform, &tokens[0..4]);
        let second = block_hash(Some(first), &OwnerScope::User(alice.clone()), &tokens[4..8]);
        assert_eq!(a, vec![first, second]);
    }

    #[test]
    fn hash_chain_updates_incrementally() {
        let user = owner("u");
        let tokens: Vec<u32> = (100..140).collect();
        let mut chain = HashChain::new(16, 16, user.clone());
        assert!(chain.update(&tokens[..15]).is_empty());
        assert_eq!(chain.update(&tokens[..16]).len(), 1);
        assert!(chain.update(&tokens[..31]).is_empty());
        assert_eq!(chain.update(&tokens).len(), 1);
        assert_eq!(chain.hashes(), prefix_hashes(&tokens, 16, 16, &user).as_slice());
        // Shrinking drops blocks that are no longer full.
        assert!(chain.update(&tokens[..20]).is_empty());
        assert_eq!(chain.hashes().len(), 1);
    }
}
