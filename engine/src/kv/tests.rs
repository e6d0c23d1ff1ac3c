//! Tests of [`KvCache`] against a fake block store: unit tests of each operation and
//! a model-based property test that runs random schedules of sequences and checks
//! every invariant after every step.

use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const BLOCK_BYTES: usize = 16;
const BT: usize = 4; // tokens per block in these tests

/// Block bytes in a `Vec`, one row per block.
struct FakeStore {
    rows: Vec<Vec<u8>>,
}

impl FakeStore {
    fn new(blocks: usize) -> Self {
        Self { rows: vec![vec![0; BLOCK_BYTES]; blocks] }
    }
    fn write(&mut self, b: BlockId, data: &[u8]) {
        self.rows[b.index()].copy_from_slice(data);
    }
    fn read(&self, b: BlockId) -> &[u8] {
        &self.rows[b.index()]
    }
}

impl BlockStore for FakeStore {
    fn block_bytes(&self) -> usize {
        BLOCK_BYTES
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) {
        out.copy_from_slice(&self.rows[block.index()]);
    }
    fn copy_in(&mut self, block: BlockId, data: &[u8]) {
        self.rows[block.index()].copy_from_slice(data);
    }
}

/// The bytes a block with this hash holds: any function of the hash works, and
/// checking it on every match proves the index hands out the right block.
fn content(seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BLOCK_BYTES);
    let mut x = seed;
    while out.len() < BLOCK_BYTES {
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x2545_F491_4F6C_DD1D);
        out.extend_from_slice(&(x ^ (x >> 29)).to_le_bytes());
    }
    out.truncate(BLOCK_BYTES);
    out
}

fn user(i: u8) -> OwnerId {
    OwnerId::parse(format!("user-{i}")).unwrap()
}

fn conv(i: u8) -> ConversationId {
    ConversationId::parse(format!("conv-{i}")).unwrap()
}

fn owner(u: u8, c: u8) -> BlockOwner {
    BlockOwner::conversation(user(u), conv(c))
}

/// An owned block identity for tests: what a [`BlockKey`] borrows.
#[derive(Debug, Clone)]
struct Block {
    hash: BlockHash,
    scope: OwnerScope,
    tokens: Vec<u32>,
}

impl Block {
    fn key(&self) -> BlockKey<'_> {
        BlockKey { hash: self.hash, scope: &self.scope, tokens: &self.tokens }
    }
}

fn keys(blocks: &[Block]) -> Vec<BlockKey<'_>> {
    blocks.iter().map(Block::key).collect()
}

/// A block of user 0 with a hash of our choosing and tokens derived from `tag`.
fn block(hash: u64, tag: u32) -> Block {
    Block { hash: BlockHash(hash), scope: OwnerScope::User(user(0)), tokens: vec![tag; BT] }
}

/// A lone block with hash `h` (tokens unique to `h`).
fn single(h: u64) -> Block {
    block(h, 1_000_000 + h as u32)
}

/// A chain of `n` blocks of user 0 with hashes 1000, 2000, ...
fn chain(n: u64) -> Vec<Block> {
    (1..=n).map(|i| block(i * 1000, i as u32)).collect()
}

/// The blocks of `tokens` for `u` as the engine keys them, hashed by `hasher`.
fn blocks_of(tokens: &[u32], platform_len: usize, u: &OwnerId, hasher: Arc<dyn BlockHasher>) -> Vec<Block> {
    let mut c = HashChain::with_hasher(BT, platform_len, u.clone(), hasher);
    c.update(tokens);
    c.keys(tokens, usize::MAX)
        .into_iter()
        .map(|k| Block { hash: k.hash, scope: k.scope.clone(), tokens: k.tokens.to_vec() })
        .collect()
}

/// Allocates one block per key, writes its content and publishes them as one
/// chain after `parent`; returns the blocks and the last link.
fn publish_after(
    cache: &mut KvCache,
    store: &mut FakeStore,
    blocks: &[Block],
    mut parent: Option<ChainLink>,
    who: &BlockOwner,
) -> (Vec<BlockId>, Option<ChainLink>) {
    let ids = cache.allocate(blocks.len(), store).expect("allocate");
    for (&b, k) in ids.iter().zip(blocks) {
        store.write(b, &content(k.hash.0));
        let r = cache.register(b, k.key(), parent, who).expect("register");
        assert!(matches!(r, Registered::Published(_)), "{r:?}");
        parent = r.link();
    }
    (ids, parent)
}

/// [`publish_after`] from the start of a sequence.
fn publish(cache: &mut KvCache, store: &mut FakeStore, blocks: &[Block], who: &BlockOwner) -> Vec<BlockId> {
    publish_after(cache, store, blocks, None, who).0
}

#[test]
fn allocate_takes_free_first_then_evicts_lru_all_or_nothing() {
    let mut store = FakeStore::new(4);
    let mut cache = KvCache::new(4, 0);
    let hs = chain(2);
    let a = publish(&mut cache, &mut store, &hs, &owner(0, 0));
    assert_eq!(a, vec![BlockId(0), BlockId(1)]);
    cache.release(&a).expect("release");
    assert_eq!(cache.stats().cached, 2);
    assert_eq!(cache.available_for_allocation(), 4);
    let before = cache.stats();
    let err = cache.allocate(5, &mut store).expect_err("too many");
    assert!(matches!(err, KvError::OutOfBlocks { requested: 5, available: 4 }));
    assert_eq!(err.kind(), "out_of_blocks");
    assert_eq!(cache.stats(), before, "a failed allocate changes nothing");
    // Two free blocks go first, then the tail block (1) is evicted before its prefix.
    let b = cache.allocate(3, &mut store).expect("allocate");
    assert_eq!(b, vec![BlockId(2), BlockId(3), BlockId(1)]);
    let s = cache.stats();
    assert_eq!((s.used, s.cached, s.free, s.evicted, s.spilled), (3, 1, 0, 1, 0));
    assert_eq!(cache.peek_prefix(&keys(&hs)), PrefixPeek { primary: 1, tier2: 0 });
    assert!(cache.allocate(0, &mut store).expect("empty").is_empty());
    cache.assert_consistent();
}

#[test]
fn register_publishes_once_and_duplicates_stay_private() {
    let mut store = FakeStore::new(4);
    let mut cache = KvCache::new(4, 0);
    let h = single(7);
    let b = cache.allocate(2, &mut store).expect("allocate");
    let Registered::Published(link) = cache.register(b[0], h.key(), None, &owner(0, 0)).expect("reg") else {
        panic!("not published");
    };
    assert_eq!(cache.register(b[0], h.key(), None, &owner(0, 0)).expect("reg"), Registered::Unchanged(link));
    assert!(matches!(cache.register(b[0], single(8).key(), None, &owner(0, 0)), Err(KvError::HashConflict { .. })));
    assert_eq!(
        cache.register(b[1], h.key(), None, &owner(0, 0)).expect("reg"),
        Registered::Duplicate { existing: b[0], link }
    );
    cache.release(&b).expect("release");
    assert_eq!(cache.block_state(b[0]), Some(BlockState::Cached));
    assert_eq!(cache.block_state(b[1]), Some(BlockState::Free), "the duplicate was never published");
    assert!(matches!(cache.register(b[1], single(9).key(), None, &owner(0, 0)), Err(KvError::NotInUse { .. })));
    assert!(matches!(cache.register(BlockId(99), h.key(), None, &owner(0, 0)), Err(KvError::UnknownBlock { .. })));
    cache.assert_consistent();
}

#[test]
fn registering_a_spilled_hash_drops_the_stale_tier2_copy() {
    let mut store = FakeStore::new(1);
    let mut cache = KvCache::new(1, 2);
    let a = publish(&mut cache, &mut store, &[single(1)], &owner(0, 0));
    cache.release(&a).expect("release");
    let b = cache.allocate(1, &mut store).expect("allocate");
    assert_eq!(cache.tier2_hashes(), vec![BlockHash(1)]);
    // The sequence recomputed the same block instead of matching it.
    let r = cache.register(b[0], single(1).key(), None, &owner(0, 0)).expect("register");
    assert!(matches!(r, Registered::Published(_)));
    assert!(cache.tier2_hashes().is_empty());
    cache.assert_consistent();
    cache.release(&b).expect("release");
}

#[test]
fn double_release_is_an_error_and_changes_nothing() {
    let mut store = FakeStore::new(3);
    let mut cache = KvCache::new(3, 0);
    let b = cache.allocate(2, &mut store).expect("allocate");
    cache.release(&b[..1]).expect("release");
    let before = cache.stats();
    let err = cache.release(&b).expect_err("block 0 is free");
    assert!(matches!(err, KvError::DoubleRelease { block } if block == b[0]));
    assert_eq!(err.kind(), "double_release");
    assert_eq!(cache.stats(), before);
    assert_eq!(cache.refcount(b[1]), 1, "the valid block was not released either");
    // Listing a block twice needs two holders.
    assert!(cache.release(&[b[1], b[1]]).is_err());
    assert!(matches!(cache.release(&[BlockId(3)]), Err(KvError::UnknownBlock { .. })));
    cache.release(&[b[1]]).expect("release");
    assert_eq!(cache.stats().free, 3);
    cache.assert_consistent();
}

#[test]
fn match_prefix_pins_the_longest_leading_run() {
    let mut store = FakeStore::new(8);
    let mut cache = KvCache::new(8, 0);
    let hs = chain(4);
    let a = publish(&mut cache, &mut store, &hs[..3], &owner(0, 0));
    // Block 1 (second) still pinned by its sequence: a match shares it.
    let m = cache.match_prefix(&keys(&hs), &mut store);
    assert_eq!(m.blocks, a);
    assert_eq!(m.links.len(), 3);
    assert_eq!((m.primary_hits, m.tier2_hits), (3, 0));
    assert_eq!(cache.refcount(a[1]), 2);
    cache.release(&a).expect("release");
    cache.release(&m.blocks).expect("release");
    // A gap stops the match even if later hashes are cached.
    let miss = cache.match_prefix(&[single(1).key(), hs[0].key()], &mut store);
    assert!(miss.blocks.is_empty());
    // So does a block matched out of place: hs[1] is cached, but after hs[0].
    assert!(cache.match_prefix(&[hs[1].key()], &mut store).blocks.is_empty());
    let m = cache.match_prefix(&keys(&hs[..2]), &mut store);
    assert_eq!(cache.block_state(m.blocks[0]), Some(BlockState::Used { refcount: 1 }));
    assert_eq!(cache.stats().primary_hits, 5);
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn eviction_spills_to_tier2_and_a_match_promotes_the_exact_bytes() {
    let mut store = FakeStore::new(2);
    let mut cache = KvCache::new(2, 4);
    let hs = chain(2);
    let a = publish(&mut cache, &mut store, &hs, &owner(0, 0));
    cache.release(&a).expect("release");
    // Overwrite both primary blocks with someone else's data.
    let other = cache.allocate(2, &mut store).expect("allocate");
    for &b in &other {
        store.write(b, &[0xAA; BLOCK_BYTES]);
    }
    let s = cache.stats();
    assert_eq!((s.evicted, s.spilled, s.tier2_blocks), (2, 2, 2));
    assert_eq!(cache.peek_prefix(&keys(&hs)), PrefixPeek { primary: 0, tier2: 2 });
    // Nothing to promote into while everything is pinned: the match stops, intact.
    assert!(cache.match_prefix(&keys(&hs), &mut store).blocks.is_empty());
    assert_eq!(cache.stats().tier2_blocks, 2);
    cache.release(&other).expect("release");
    let m = cache.match_prefix(&keys(&hs), &mut store);
    assert_eq!((m.primary_hits, m.tier2_hits), (0, 2));
    for (&b, h) in m.blocks.iter().zip(&hs) {
        assert_eq!(store.read(b), content(h.hash.0).as_slice());
        assert_eq!(cache.block_hash_of(b), Some(h.hash));
    }
    assert_eq!(cache.stats().tier2_blocks, 0, "promotion moves, not copies");
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn promotion_with_a_full_pool_evicts_into_the_tier_it_came_from() {
    let mut store = FakeStore::new(1);
    let mut cache = KvCache::new(1, 1);
    let a = publish(&mut cache, &mut store, &[single(1)], &owner(0, 0));
    cache.release(&a).expect("release");
    let b = publish(&mut cache, &mut store, &[single(2)], &owner(0, 0));
    cache.release(&b).expect("release");
    assert_eq!(cache.tier2_hashes(), vec![BlockHash(1)]);
    // Promoting 1 evicts 2, which takes the tier-2 place 1 just left.
    let m = cache.match_prefix(&[single(1).key()], &mut store);
    assert_eq!(m.tier2_hits, 1);
    assert_eq!(store.read(m.blocks[0]), content(1).as_slice());
    assert_eq!(cache.tier2_hashes(), vec![BlockHash(2)]);
    assert_eq!(cache.stats().tier2_dropped, 0);
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn users_never_share_blocks_but_share_the_platform_prefix() {
    let mut store = FakeStore::new(16);
    let mut cache = KvCache::new(16, 8);
    let tokens: Vec<u32> = (0..24).collect();
    let platform_len = 8; // two platform blocks
    let ha = blocks_of(&tokens, platform_len, &user(0), Arc::new(Xxh64BlockHasher));
    let hb = blocks_of(&tokens, platform_len, &user(1), Arc::new(Xxh64BlockHasher));
    assert_eq!(ha.len(), 6);
    assert_eq!(ha[..2].iter().map(|b| b.hash).collect::<Vec<_>>(), hb[..2].iter().map(|b| b.hash).collect::<Vec<_>>());
    assert!(ha[2..].iter().all(|a| hb.iter().all(|b| a.hash != b.hash)));
    let a = cache.allocate(6, &mut store).expect("allocate");
    let mut parent = None;
    for (i, (&b, h)) in a.iter().zip(&ha).enumerate() {
        store.write(b, &content(h.hash.0));
        let who = if i < 2 { BlockOwner::Platform } else { owner(0, 0) };
        parent = cache.register(b, h.key(), parent, &who).expect("register").link();
    }
    cache.release(&a).expect("release");
    let m = cache.match_prefix(&keys(&hb), &mut store);
    assert_eq!(m.blocks, a[..2], "user 1 gets exactly the platform blocks");
    cache.release(&m.blocks).expect("release");
    // Deleting user 0 leaves the platform blocks.
    assert_eq!(cache.evict_owner(&user(0)), 4);
    assert_eq!(cache.match_prefix(&keys(&ha), &mut store).blocks.len(), 2);
    assert_eq!(cache.owner_groups(), 0);
}

#[test]
fn evict_conversation_removes_every_copy() {
    let mut store = FakeStore::new(4);
    let mut cache = KvCache::new(4, 8);
    let hs = chain(4);
    let (a, link) = publish_after(&mut cache, &mut store, &hs[..2], None, &owner(0, 1));
    cache.release(&a).expect("release");
    // Spill conversation 1's blocks to tier 2, then publish two more, one pinned.
    let filler = cache.allocate(4, &mut store).expect("allocate");
    cache.release(&filler).expect("release");
    let (c, _) = publish_after(&mut cache, &mut store, &hs[2..], link, &owner(0, 1));
    cache.release(&c[..1]).expect("release");
    assert_eq!(cache.peek_prefix(&keys(&hs)), PrefixPeek { primary: 2, tier2: 2 });
    let other = publish(&mut cache, &mut store, &[single(5)], &owner(0, 2));
    assert_eq!(cache.stats().tier2_blocks, 2);
    assert_eq!(cache.evict_conversation(&conv(1)), 4);
    let s = cache.stats();
    assert_eq!((s.tier2_blocks, s.indexed, s.cached), (0, 1, 0));
    assert_eq!(cache.block_state(c[1]), Some(BlockState::Used { refcount: 1 }));
    assert_eq!(cache.peek_prefix(&keys(&hs)), PrefixPeek::default());
    cache.release(&c[1..]).expect("release");
    assert_eq!(cache.block_state(c[1]), Some(BlockState::Free), "unpublished while pinned");
    assert_eq!(cache.evict_conversation(&conv(1)), 0);
    cache.release(&other).expect("release");
    assert_eq!(cache.owner_groups(), 1);
    cache.assert_consistent();
}

#[test]
fn swap_round_trip_restores_bytes_and_errors_return_the_handle() {
    let mut store = FakeStore::new(4);
    let mut cache = KvCache::new(4, 3);
    let blocks = cache.allocate(3, &mut store).expect("allocate");
    for (i, &b) in blocks.iter().enumerate() {
        store.write(b, &content(100 + i as u64));
    }
    cache.register(blocks[0], single(1).key(), None, &owner(0, 0)).expect("register");
    let err = cache.swap_out(&[blocks[0]; 2], &mut store).expect_err("one holder, listed twice");
    assert!(matches!(err, KvError::NotInUse { .. }));
    let handle = cache.swap_out(&blocks, &mut store).expect("swap out");
    assert_eq!(handle.len(), 3);
    let s = cache.stats();
    assert_eq!((s.swapped, s.used, s.cached, s.free), (3, 0, 1, 3));
    // No room for a second swap while the first holds the tier.
    let more = cache.allocate(1, &mut store).expect("allocate");
    let err = cache.swap_out(&more, &mut store).expect_err("tier full");
    assert!(matches!(err, KvError::Tier2Full { requested: 1, available: 0 }));
    // Pin everything, so the swap-in cannot get blocks, and get the handle back.
    let pin = cache.allocate(3, &mut store).expect("allocate");
    for &b in pin.iter().chain(&more) {
        store.write(b, &[0xEE; BLOCK_BYTES]);
    }
    let err = cache.swap_in(handle, &mut store).expect_err("pool pinned");
    assert_eq!(err.kind(), "out_of_blocks");
    let handle = err.into_swap_handle().expect("handle returned");
    assert_eq!(cache.stats().swapped, 3);
    cache.release(&pin).expect("release");
    cache.release(&more).expect("release");
    let back = cache.swap_in(handle, &mut store).expect("swap in");
    for (i, &b) in back.iter().enumerate() {
        assert_eq!(store.read(b), content(100 + i as u64).as_slice());
    }
    assert_eq!(cache.stats().swapped, 0);
    let h2 = cache.swap_out(&back[..1], &mut store).expect("swap out");
    assert_eq!(cache.drop_swap(h2), 1);
    cache.release(&back[1..]).expect("release");
    cache.assert_consistent();
    // A handle of another cache is refused and handed back.
    let mut other = KvCache::new(4, 4);
    let foreign = other.swap_out(&[], &mut store).expect("empty swap");
    let err = cache.swap_in(foreign, &mut store).expect_err("foreign");
    assert_eq!(err.kind(), "unknown_swap");
}

#[test]
fn release_order_makes_the_tail_least_recently_used() {
    let mut store = FakeStore::new(3);
    let mut cache = KvCache::new(3, 0);
    let hs = chain(3);
    let a = publish(&mut cache, &mut store, &hs, &owner(0, 0));
    cache.release(&a).expect("release");
    cache.allocate(1, &mut store).expect("allocate");
    assert_eq!(cache.peek_prefix(&keys(&hs)).primary, 2, "the last block went first");
}

// ---- forged hash collisions: the hash finds a block, it never decides a hit ----

/// `tokens` for `u`, keyed by a hasher that maps every block to the same value.
fn forged(tokens: &[u32], u: u8) -> Vec<Block> {
    blocks_of(tokens, 0, &user(u), Arc::new(ConstantHasher(42)))
}

#[test]
fn a_forged_hash_collision_is_not_a_hit_across_owners() {
    let mut store = FakeStore::new(8);
    let mut cache = KvCache::new(8, 0);
    let tokens: Vec<u32> = (0..8).collect();
    let alice = forged(&tokens, 0);
    let a = publish(&mut cache, &mut store, &alice[..1], &owner(0, 0));
    cache.release(&a).expect("release");
    // Bob sends alice's exact tokens; his keys carry alice's hash.
    let bob = forged(&tokens, 1);
    assert_eq!(bob[0].hash, alice[0].hash);
    assert_eq!(cache.peek_prefix(&keys(&bob)), PrefixPeek::default());
    let m = cache.match_prefix(&keys(&bob), &mut store);
    assert!(m.blocks.is_empty(), "bob got alice's block {:?}", m.blocks);
    // Bob's own block under the same hash stays private; alice's is untouched.
    let b = cache.allocate(1, &mut store).expect("allocate");
    assert_eq!(cache.register(b[0], bob[0].key(), None, &owner(1, 0)).expect("register"), Registered::Collision { holder: a[0] });
    cache.release(&b).expect("release");
    assert_eq!(cache.block_state(b[0]), Some(BlockState::Free));
    assert_eq!(store.read(a[0]), content(alice[0].hash.0).as_slice());
    assert_eq!(cache.stats().hash_collisions, 2);
    // The owner still hits her own block.
    let m = cache.match_prefix(&keys(&alice), &mut store);
    assert_eq!(m.blocks, a);
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn a_forged_hash_collision_is_not_a_hit_across_contents() {
    let mut store = FakeStore::new(8);
    let mut cache = KvCache::new(8, 0);
    let first = forged(&[1, 2, 3, 4], 0);
    let a = publish(&mut cache, &mut store, &first, &owner(0, 0));
    cache.release(&a).expect("release");
    // Same owner, same hash, one token different.
    let other = forged(&[1, 2, 3, 5], 0);
    assert_eq!(other[0].hash, first[0].hash);
    assert!(cache.match_prefix(&keys(&other), &mut store).blocks.is_empty());
    assert_eq!(cache.peek_prefix(&keys(&other)), PrefixPeek::default());
    // A second block that collides with the first one's hash is not the first one
    // either (same tokens, but it follows a parent).
    let twice = forged(&[1, 2, 3, 4, 1, 2, 3, 4], 0);
    let m = cache.match_prefix(&keys(&twice), &mut store);
    assert_eq!(m.blocks, a, "only block 0 is the cached block");
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn a_forged_chain_cannot_splice_onto_another_parent() {
    let mut store = FakeStore::new(8);
    let mut cache = KvCache::new(8, 0);
    // x0 then x1, published by one sequence; y0 collides with x0's hash.
    let (x0, x1, y0) = (block(1, 10), block(2, 11), block(1, 99));
    let (a, x0_link) = publish_after(&mut cache, &mut store, &[x0.clone()], None, &owner(0, 1));
    let (b, _) = publish_after(&mut cache, &mut store, &[x1.clone()], x0_link, &owner(0, 2));
    cache.release(&a).expect("release");
    cache.release(&b).expect("release");
    // x0 goes away; y0 takes its hash. x1 stays cached, still under its own hash.
    assert_eq!(cache.evict_conversation(&conv(1)), 1);
    let y = publish(&mut cache, &mut store, &[y0.clone()], &owner(0, 3));
    cache.release(&y).expect("release");
    // [y0, x1] matches y0 (it is y0), but x1's KV was computed after x0: no hit.
    let m = cache.match_prefix(&[y0.key(), x1.key()], &mut store);
    assert_eq!(m.blocks, y);
    cache.release(&m.blocks).expect("release");
    // Not even after x0 itself comes back: a new entry is a new link.
    assert_eq!(cache.evict_conversation(&conv(3)), 1);
    let c = publish(&mut cache, &mut store, &[x0.clone()], &owner(0, 1));
    cache.release(&c).expect("release");
    let m = cache.match_prefix(&[x0.key(), x1.key()], &mut store);
    assert_eq!(m.blocks, c);
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn a_forged_hash_collision_is_not_promoted_from_the_second_tier() {
    let mut store = FakeStore::new(1);
    let mut cache = KvCache::new(1, 4);
    let tokens = [5, 6, 7, 8];
    let alice = forged(&tokens, 0);
    let a = publish(&mut cache, &mut store, &alice, &owner(0, 0));
    cache.release(&a).expect("release");
    // Evict alice's block to the second tier.
    let filler = cache.allocate(1, &mut store).expect("allocate");
    store.write(filler[0], &[0xAA; BLOCK_BYTES]);
    cache.release(&filler).expect("release");
    assert_eq!(cache.tier2_hashes(), vec![alice[0].hash]);
    for (who, other) in [("another owner", forged(&tokens, 1)), ("other tokens", forged(&[5, 6, 7, 9], 0))] {
        assert_eq!(cache.peek_prefix(&keys(&other)), PrefixPeek::default(), "{who}");
        let m = cache.match_prefix(&keys(&other), &mut store);
        assert!(m.blocks.is_empty(), "{who} promoted alice's block");
        assert_eq!(cache.tier2_hashes(), vec![alice[0].hash], "{who}: alice's copy stays");
    }
    // Alice herself still promotes it, bytes intact.
    let m = cache.match_prefix(&keys(&alice), &mut store);
    assert_eq!(m.tier2_hits, 1);
    assert_eq!(store.read(m.blocks[0]), content(alice[0].hash.0).as_slice());
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn a_colliding_block_replaces_a_spilled_one_without_inheriting_its_owner() {
    let mut store = FakeStore::new(1);
    let mut cache = KvCache::new(1, 4);
    let tokens = [5, 6, 7, 8];
    let alice = forged(&tokens, 0);
    let a = publish(&mut cache, &mut store, &alice, &owner(0, 0));
    cache.release(&a).expect("release");
    // Bob computes his own block with the same hash while alice's is spilled.
    let bob = forged(&tokens, 1);
    let b = publish(&mut cache, &mut store, &bob, &owner(1, 0));
    assert!(cache.tier2_hashes().is_empty(), "the primary copy wins");
    // Deleting alice must not delete bob's block, nor leave alice's behind.
    assert_eq!(cache.evict_owner(&user(0)), 0);
    assert_eq!(cache.match_prefix(&keys(&alice), &mut store).blocks, Vec::<BlockId>::new());
    cache.release(&b).expect("release");
    let m = cache.match_prefix(&keys(&bob), &mut store);
    assert_eq!(m.blocks, b);
    cache.release(&m.blocks).expect("release");
    assert_eq!(cache.evict_owner(&user(1)), 1);
    cache.assert_consistent();
}

// ---- model-based property test ----

#[derive(Debug, Clone)]
enum Op {
    /// Start a sequence: prompt `family`, `len` tokens, platform prefix of
    /// `platform_blocks` blocks, for user `user` in conversation `conv`.
    Start { user: u8, conv: u8, family: u8, len: usize, platform_blocks: usize },
    Finish(usize),
    SwapOut(usize),
    SwapIn(usize),
    EvictConversation(u8),
    EvictUser(u8),
    BadRelease(u32),
    /// Other traffic: allocate up to `n` blocks and release them at once, pushing
    /// cached blocks out to the second tier.
    Churn(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..2, 0u8..3, 0u8..2, 0usize..40, 0usize..3).prop_map(|(user, conv, family, len, platform_blocks)| {
            Op::Start { user, conv, family, len, platform_blocks }
        }),
        4 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::SwapOut),
        1 => (0usize..8).prop_map(Op::SwapIn),
        1 => (0u8..3).prop_map(Op::EvictConversation),
        1 => (0u8..3).prop_map(Op::EvictUser),
        1 => (0u32..64).prop_map(Op::BadRelease),
        2 => (1usize..12).prop_map(Op::Churn),
    ]
}

struct Seq {
    blocks: Vec<BlockId>,
    /// Expected bytes of each block, in order (survive swaps).
    contents: Vec<Vec<u8>>,
    swap: Option<SwapHandle>,
}

/// Prompts of one family share their start with the other families (a common
/// "system prompt"), then diverge, so schedules exercise partial prefix hits.
fn prompt(family: u8, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| if i < 8 { i } else { 1000 * u32::from(family) + i }).collect()
}

struct Harness {
    cache: KvCache,
    store: FakeStore,
    seqs: Vec<Seq>,
    partial: u64,
    /// Keys the cache: canonical, or a weak one that makes collisions common.
    hasher: Arc<dyn BlockHasher>,
}

/// A hasher with four values: most lookups meet a collision, yet chains of
/// different hashes still coexist in the index.
#[derive(Debug)]
struct FourValues;

impl BlockHasher for FourValues {
    fn hash_block(&self, scratch: &mut Vec<u8>, parent: Option<BlockHash>, scope: &OwnerScope, tokens: &[u32]) -> BlockHash {
        BlockHash(Xxh64BlockHasher.hash_block(scratch, parent, scope, tokens).0 % 4)
    }
}

impl Harness {
    fn check(&self) {
        self.cache.assert_consistent();
        let s = self.cache.stats();
        let mut expected = vec![0u32; s.total];
        for seq in self.seqs.iter().filter(|q| q.swap.is_none()) {
            for b in &seq.blocks {
                expected[b.index()] += 1;
            }
        }
        for (i, &n) in expected.iter().enumerate() {
            assert_eq!(self.cache.refcount(BlockId(i as u32)), n, "refcount of block {i}");
        }
        let swapped: usize = self.seqs.iter().filter_map(|q| q.swap.as_ref()).map(SwapHandle::len).sum();
        assert_eq!(s.swapped, swapped);
        assert_eq!(s.used, expected.iter().filter(|&&n| n > 0).count());
    }

    fn start(&mut self, u: u8, c: u8, family: u8, len: usize, platform_blocks: usize) {
        let tokens = prompt(family, len);
        let platform_len = platform_blocks * BT;
        // The blocks' true identities (canonical chain hashes) decide their bytes;
        // the cache sees only the keys of `self.hasher`, which may collide.
        let truth = prefix_hashes(&tokens, BT, platform_len, &user(u));
        let ks = blocks_of(&tokens, platform_len, &user(u), self.hasher.clone());
        let m = self.cache.match_prefix(&keys(&ks), &mut self.store);
        assert!(m.blocks.len() <= ks.len());
        assert_eq!(m.primary_hits + m.tier2_hits, m.blocks.len());
        assert_eq!(m.links.len(), m.blocks.len());
        let mut contents = Vec::new();
        for (&b, &h) in m.blocks.iter().zip(&truth) {
            // The right bytes, whichever tier they came from: never another
            // user's block, never another prefix's, never a stale one.
            assert_eq!(self.store.read(b), content(h.0).as_slice(), "matched {b} for {h}");
            contents.push(content(h.0));
        }
        let mut links: Vec<Option<ChainLink>> = m.links.iter().copied().map(Some).collect();
        let need = len.div_ceil(BT) - m.blocks.len();
        let before = self.cache.stats();
        let new = match self.cache.allocate(need, &mut self.store) {
            Ok(new) => new,
            Err(KvError::OutOfBlocks { requested, available }) => {
                assert!(requested > available);
                assert_eq!(self.cache.stats(), before, "failed allocate changed the cache");
                self.cache.release(&m.blocks).expect("release the match");
                return;
            }
            Err(e) => panic!("unexpected {e}"),
        };
        let mut blocks = m.blocks;
        for &b in &new {
            let i = blocks.len();
            let data = match truth.get(i) {
                Some(h) => content(h.0),
                None => {
                    self.partial += 1;
                    content(u64::MAX - self.partial)
                }
            };
            self.store.write(b, &data);
            contents.push(data);
            // Register as the scheduler does: a block after an unlinked one is not.
            let parent = match i.checked_sub(1) {
                None => Some(None),
                Some(p) => links[p].map(Some),
            };
            if let (Some(k), Some(parent)) = (ks.get(i), parent) {
                let who = if (i + 1) * BT <= platform_len { BlockOwner::Platform } else { owner(u, c) };
                let r = self.cache.register(b, k.key(), parent, &who).expect("register a fresh block");
                links.push(r.link());
            } else {
                links.push(None);
            }
            blocks.push(b);
        }
        self.seqs.push(Seq { blocks, contents, swap: None });
    }

    fn apply(&mut self, op: Op) {
        let n = self.seqs.len();
        match op {
            Op::Start { user, conv, family, len, platform_blocks } => {
                self.start(user, conv, family, len, platform_blocks)
            }
            Op::Finish(i) if i < n => {
                let seq = self.seqs.swap_remove(i);
                match seq.swap {
                    Some(h) => assert_eq!(self.cache.drop_swap(h), seq.contents.len()),
                    None => self.cache.release(&seq.blocks).expect("release"),
                }
            }
            Op::SwapOut(i) if i < n && self.seqs[i].swap.is_none() => {
                let room = self.cache.stats().tier2_capacity - self.cache.stats().swapped;
                let blocks = std::mem::take(&mut self.seqs[i].blocks);
                match self.cache.swap_out(&blocks, &mut self.store) {
                    Ok(h) => self.seqs[i].swap = Some(h),
                    Err(KvError::Tier2Full { .. }) => {
                        assert!(blocks.len() > room);
                        self.seqs[i].blocks = blocks;
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            Op::SwapIn(i) if i < n && self.seqs[i].swap.is_some() => {
                let Some(h) = self.seqs[i].swap.take() else { return };
                match self.cache.swap_in(h, &mut self.store) {
                    Ok(blocks) => {
                        for (&b, data) in blocks.iter().zip(&self.seqs[i].contents) {
                            assert_eq!(self.store.read(b), data.as_slice(), "swap round trip");
                        }
                        self.seqs[i].blocks = blocks;
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), "out_of_blocks");
                        self.seqs[i].swap = e.into_swap_handle();
                        assert!(self.seqs[i].swap.is_some());
                    }
                }
            }
            Op::EvictConversation(c) => {
                self.cache.evict_conversation(&conv(c));
            }
            Op::EvictUser(u) => {
                self.cache.evict_owner(&user(u));
            }
            Op::BadRelease(b) => {
                let b = BlockId(b);
                if self.cache.refcount(b) == 0 {
                    let before = self.cache.stats();
                    assert!(self.cache.release(&[b]).is_err());
                    assert_eq!(self.cache.stats(), before);
                }
            }
            Op::Churn(n) => {
                let n = n.min(self.cache.available_for_allocation());
                let blocks = self.cache.allocate(n, &mut self.store).expect("allocate what is available");
                for &b in &blocks {
                    self.store.write(b, &[0xCC; BLOCK_BYTES]);
                }
                self.cache.release(&blocks).expect("release");
            }
            _ => {}
        }
    }

    /// Releases everything and checks that every block comes back.
    fn drain(mut self) {
        for seq in std::mem::take(&mut self.seqs) {
            match seq.swap {
                Some(h) => {
                    self.cache.drop_swap(h);
                }
                None => self.cache.release(&seq.blocks).expect("release"),
            }
        }
        let s = self.cache.stats();
        assert_eq!((s.used, s.swapped), (0, 0));
        assert_eq!(s.free + s.cached, s.total);
        let all = self.cache.allocate(s.total, &mut self.store).expect("every block is reusable");
        self.cache.release(&all).expect("release");
        assert_eq!(self.cache.stats().free, s.total);
        self.cache.assert_consistent();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn random_schedules_keep_every_invariant(
        num_blocks in 4u32..32,
        tier2 in prop_oneof![1 => Just(0usize), 3 => 1usize..32],
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness {
            cache: KvCache::new(num_blocks, tier2),
            store: FakeStore::new(num_blocks as usize),
            seqs: Vec::new(),
            partial: 0,
            hasher: Arc::new(Xxh64BlockHasher),
        };
        for op in ops {
            h.apply(op);
            h.check();
        }
        h.drain();
    }

    /// The same schedules with a hasher that collides all the time: every block
    /// handed out still holds exactly the KV of the asker's own prefix.
    #[test]
    fn random_schedules_with_colliding_hashes_never_hand_out_wrong_kv(
        num_blocks in 4u32..32,
        tier2 in prop_oneof![1 => Just(0usize), 3 => 1usize..32],
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness {
            cache: KvCache::new(num_blocks, tier2),
            store: FakeStore::new(num_blocks as usize),
            seqs: Vec::new(),
            partial: 0,
            hasher: Arc::new(FourValues),
        };
        for op in ops {
            h.apply(op);
            h.check();
        }
        h.drain();
    }

    #[test]
    fn identical_tokens_never_match_across_users(
        tokens in prop::collection::vec(0u32..50, 0..40),
        platform_blocks in 0usize..4,
    ) {
        let mut store = FakeStore::new(32);
        let mut cache = KvCache::new(32, 32);
        let platform_len = platform_blocks * BT;
        let ha = blocks_of(&tokens, platform_len, &user(0), Arc::new(Xxh64BlockHasher));
        let hb = blocks_of(&tokens, platform_len, &user(1), Arc::new(Xxh64BlockHasher));
        let a = publish(&mut cache, &mut store, &ha, &owner(0, 0));
        cache.release(&a).expect("release");
        let m = cache.match_prefix(&keys(&hb), &mut store);
        let shared = ha.len().min(platform_blocks);
        prop_assert_eq!(m.blocks.as_slice(), &a[..shared]);
        cache.release(&m.blocks).expect("release");
    }
}
