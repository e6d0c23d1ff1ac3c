//! Tests of [`KvCache`] against a fake block store: the fixtures they share, unit tests
//! of each operation (`operations`), forged hash collisions (`collisions`), and here a
//! model-based property test that runs random schedules of sequences and checks every
//! invariant after every step.

use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const BLOCK_BYTES: usize = 16;
const BT: usize = 4; // tokens per block in these tests

/// Half a block: in a grouped store, the bytes of one group (0 global, 1 window
/// layers).
const UNIT_BYTES: usize = BLOCK_BYTES / 2;

/// Block bytes in a `Vec`, one row per block; or, grouped, one row per unit and each
/// block's two groups mapped to units as the cache says (unmapped: zeros, writes lost),
/// as the kernels' grouped arena does.
struct FakeStore {
    rows: Vec<Vec<u8>>,
    grouped: Option<Grouped>,
}

/// A grouped store's unit rows and each block's two units.
type Grouped = (Vec<Vec<u8>>, Vec<[u32; 2]>);

impl FakeStore {
    fn new(blocks: usize) -> Self {
        Self { rows: vec![vec![0; BLOCK_BYTES]; blocks], grouped: None }
    }
    fn grouped(blocks: usize, units: usize) -> Self {
        let unmapped = baton_kernels::UNMAPPED;
        Self { rows: Vec::new(), grouped: Some((vec![vec![0; UNIT_BYTES]; units], vec![[unmapped; 2]; blocks])) }
    }
    fn write(&mut self, b: BlockId, data: &[u8]) {
        match &mut self.grouped {
            None => self.rows[b.index()].copy_from_slice(data),
            Some((units, map)) => {
                for (g, &u) in map[b.index()].iter().enumerate() {
                    if u != baton_kernels::UNMAPPED {
                        units[u as usize].copy_from_slice(&data[g * UNIT_BYTES..(g + 1) * UNIT_BYTES]);
                    }
                }
            }
        }
    }
    fn read(&self, b: BlockId) -> Vec<u8> {
        match &self.grouped {
            None => self.rows[b.index()].clone(),
            Some((units, map)) => map[b.index()]
                .iter()
                .flat_map(|&u| if u == baton_kernels::UNMAPPED { vec![0; UNIT_BYTES] } else { units[u as usize].clone() })
                .collect(),
        }
    }
}

impl BlockStore for FakeStore {
    fn block_bytes(&self) -> usize {
        BLOCK_BYTES
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) {
        out.copy_from_slice(&self.read(block));
    }
    fn copy_in(&mut self, block: BlockId, data: &[u8]) {
        self.write(block, data);
    }
    fn map(&mut self, block: BlockId, units: &[u32]) {
        if let Some((_, map)) = &mut self.grouped {
            map[block.index()].copy_from_slice(units);
        }
    }
}

/// `data` as a block lacking its window layers holds it.
fn without_local(data: &[u8]) -> Vec<u8> {
    let mut d = data.to_vec();
    d[UNIT_BYTES..].fill(0);
    d
}

/// The grouped caches' model: layer 0 global, layer 1 a window of two blocks.
fn window_rule() -> WindowRule {
    WindowRule::new(BT, vec![None, Some(2 * BT)])
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

mod collisions;
mod operations;

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
    /// Sequence `.0` gives back the window layers of its first `.1` blocks (grouped
    /// caches only).
    Trim(usize, usize),
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
        2 => (0usize..8, 0usize..10).prop_map(|(i, n)| Op::Trim(i, n)),
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
    /// The cache is grouped (see [`FakeStore::grouped`]).
    grouped: bool,
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
    /// Applies `ops` to a fresh pool of `num_blocks` with `tier2` second-tier slots,
    /// checking every invariant after each.
    fn run(num_blocks: u32, tier2: usize, hasher: Arc<dyn BlockHasher>, ops: Vec<Op>) -> Self {
        let h = Harness { cache: KvCache::new(num_blocks, tier2), store: FakeStore::new(num_blocks as usize), seqs: Vec::new(), partial: 0, hasher, grouped: false };
        h.apply_all(ops)
    }

    /// [`Harness::run`] over a grouped cache of `units` units (one per group of a
    /// block, two groups per block) with [`window_rule`].
    fn run_grouped(num_blocks: u32, units: usize, tier2: usize, hasher: Arc<dyn BlockHasher>, ops: Vec<Op>) -> Self {
        let mut cache = KvCache::with_units(num_blocks, tier2, units, vec![false, true]);
        cache.set_window_rule(window_rule());
        let store = FakeStore::grouped(num_blocks as usize, units);
        let h = Harness { cache, store, seqs: Vec::new(), partial: 0, hasher, grouped: true };
        h.apply_all(ops)
    }

    fn apply_all(mut self, ops: Vec<Op>) -> Self {
        let h = &mut self;
        for op in ops {
            h.apply(op);
            h.check();
        }
        self
    }

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
        let usable_from = window_rule().reclaimable_blocks(m.blocks.len() * BT);
        for (i, (&b, &h)) in m.blocks.iter().zip(&truth).enumerate() {
            // The right bytes, whichever tier they came from: never another
            // user's block, never another prefix's, never a stale one. A block
            // lacking its window layers lies behind the window of every row after
            // the match.
            let want = if self.cache.has_local(b) { content(h.0) } else { without_local(&content(h.0)) };
            assert!(self.cache.has_local(b) || i < usable_from, "matched {b} at {i} lacks its window layers");
            assert_eq!(self.store.read(b), want, "matched {b} for {h}");
            contents.push(want);
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
        // As the scheduler does before computing into them.
        if let Err(e) = self.cache.ensure_local(&new, &mut self.store) {
            assert_eq!(e.label(), "out_of_blocks");
            self.cache.release(&new).expect("release the new blocks");
            self.cache.release(&m.blocks).expect("release the match");
            return;
        }
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
                            assert_eq!(&self.store.read(b), data, "swap round trip");
                        }
                        self.seqs[i].blocks = blocks;
                    }
                    Err(e) => {
                        assert_eq!(e.label(), "out_of_blocks");
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
            Op::Trim(i, k) if i < n && self.seqs[i].swap.is_none() => {
                let seq = &mut self.seqs[i];
                let k = k.min(seq.blocks.len());
                let before: Vec<bool> = seq.blocks.iter().map(|&b| self.cache.has_local(b)).collect();
                let trimmed = self.cache.trim_local(&seq.blocks[..k], &mut self.store);
                let mut count = 0;
                for (j, &b) in seq.blocks.iter().enumerate() {
                    if before[j] && !self.cache.has_local(b) {
                        assert!(j < k, "block {j} past the trim lost its window layers");
                        assert_eq!(self.cache.refcount(b), 1, "a shared block lost its window layers");
                        seq.contents[j] = without_local(&seq.contents[j]);
                        count += 1;
                    }
                }
                assert_eq!(trimmed, count);
                assert!(self.grouped || trimmed == 0);
                for (&b, data) in seq.blocks.iter().zip(&seq.contents) {
                    assert_eq!(&self.store.read(b), data, "trim changed what a block holds");
                }
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
        let h = Harness::run(num_blocks, tier2, Arc::new(Xxh64BlockHasher), ops);
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
        let h = Harness::run(num_blocks, tier2, Arc::new(FourValues), ops);
        h.drain();
    }

    /// The same schedules over a grouped arena whose sequences give back their old
    /// blocks' window layers: units are never lost or shared, a block lacking its
    /// window layers is never matched where a row could read them, swaps restore
    /// exactly what they took.
    #[test]
    fn random_schedules_over_grouped_units_keep_every_invariant(
        num_blocks in 4u32..32,
        extra_units in 0usize..32,
        tier2 in prop_oneof![1 => Just(0usize), 3 => 1usize..32],
        colliding in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let hasher: Arc<dyn BlockHasher> = if colliding { Arc::new(FourValues) } else { Arc::new(Xxh64BlockHasher) };
        let h = Harness::run_grouped(num_blocks, num_blocks as usize + extra_units, tier2, hasher, ops);
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
