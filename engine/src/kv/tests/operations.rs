//! Unit tests of each [`KvCache`] operation: allocation and LRU eviction, publishing,
//! release, prefix matches, the second tier, per-owner isolation and eviction, swaps.

use super::*;

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
    assert_eq!(err.label(), "out_of_blocks");
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
    assert_eq!(err.label(), "double_release");
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
    assert_eq!(err.label(), "out_of_blocks");
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
    assert_eq!(err.label(), "unknown_swap");
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

/// Blocks published as lacking their sliding-window layers serve a match only when the
/// first row computed after it lies past every local window that reaches them, in either
/// tier; matches that would read them are cut and their blocks released.
#[test]
fn blocks_lacking_local_layers_serve_only_matches_that_skip_them() {
    let mut store = FakeStore::new(5);
    let mut cache = KvCache::new(5, 5);
    // One local layer whose window makes a row at m * BT read blocks m - 2 and later.
    cache.set_window_rule(WindowRule::new(BT, vec![Some(2 * BT + 1), None]));
    let hs = chain(5);
    let ids = cache.allocate(5, &mut store).expect("allocate");
    let mut parent = None;
    for (i, (&b, k)) in ids.iter().zip(&hs).enumerate() {
        store.write(b, &content(k.hash.0));
        parent = cache.register(b, k.key(), parent, &owner(0, 0)).expect("register").link();
        if i < 2 {
            cache.mark_without_local_layers(b);
        }
    }
    cache.release(&ids).expect("release");
    for tier in [1, 2] {
        // Five blocks: a row at 5 * BT reads from block 3 on, past both partial blocks.
        let m = cache.match_prefix(&keys(&hs), &mut store);
        assert_eq!(m.blocks.len(), 5, "tier {tier}");
        assert_eq!((m.primary_hits, m.tier2_hits), if tier == 1 { (5, 0) } else { (0, 5) });
        for (&b, k) in m.blocks.iter().zip(&hs) {
            assert_eq!(store.read(b), content(k.hash.0));
        }
        cache.release(&m.blocks).expect("release");
        // Three or four blocks: a row at 3 * BT would read block 1, at 4 * BT block 2
        // (complete) and on, so four are usable and three are not at all.
        assert_eq!(cache.peek_prefix(&keys(&hs[..4])).primary, 4);
        let m = cache.match_prefix(&keys(&hs[..4]), &mut store);
        assert_eq!(m.blocks.len(), 4);
        cache.release(&m.blocks).expect("release");
        assert_eq!(cache.peek_prefix(&keys(&hs[..3])), PrefixPeek::default());
        let before = cache.stats();
        let m = cache.match_prefix(&keys(&hs[..3]), &mut store);
        assert_eq!(m, PrefixMatch::default());
        let after = cache.stats();
        assert_eq!((after.used, after.cached), (before.used, before.cached), "a cut match pins nothing");
        cache.assert_consistent();
        if tier == 1 {
            // Spill every block to the second tier: the mark travels with the entry.
            let b = cache.allocate(5, &mut store).expect("allocate");
            assert_eq!(cache.stats().tier2_blocks, 5);
            cache.release(&b).expect("release");
            assert_eq!(cache.peek_prefix(&keys(&hs[..3])), PrefixPeek::default());
            assert_eq!(cache.peek_prefix(&keys(&hs)), PrefixPeek { primary: 0, tier2: 5 });
        }
    }
    // Without a window rule a block lacking layers is never matched.
    let mut plain = KvCache::new(2, 0);
    let b = plain.allocate(1, &mut store).expect("allocate");
    plain.register(b[0], hs[0].key(), None, &owner(0, 0)).expect("register");
    plain.mark_without_local_layers(b[0]);
    plain.release(&b).expect("release");
    assert_eq!(plain.match_prefix(&keys(&hs[..2]), &mut store).blocks.len(), 0);
    plain.assert_consistent();
}
