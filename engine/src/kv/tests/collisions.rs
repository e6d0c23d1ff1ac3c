//! Forged hash collisions: the hash finds a block, it never decides a hit. Blocks keyed
//! by a hasher that maps every block to one value must never match across owners,
//! contents or parents, nor be promoted from the second tier.

use super::*;

/// `tokens` for `u`, keyed by a hasher that maps every block to the same value.
fn forged(tokens: &[u32], u: u8) -> Vec<Block> {
    blocks_of(tokens, 0, &user(u), Arc::new(ConstantHasher(42)))
}

/// A one-block pool with a second tier, holding alice's released block of `tokens`
/// (keyed by the forged hash): the set-up of the second-tier collision tests.
fn alice_cached_in_a_one_block_pool() -> (FakeStore, KvCache, [u32; 4], Vec<Block>) {
    let mut store = FakeStore::new(1);
    let mut cache = KvCache::new(1, 4);
    let tokens = [5, 6, 7, 8];
    let alice = forged(&tokens, 0);
    let a = publish(&mut cache, &mut store, &alice, &owner(0, 0));
    cache.release(&a).expect("release");
    (store, cache, tokens, alice)
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
    let (a, x0_link) = publish_after(&mut cache, &mut store, std::slice::from_ref(&x0), None, &owner(0, 1));
    let (b, _) = publish_after(&mut cache, &mut store, std::slice::from_ref(&x1), x0_link, &owner(0, 2));
    cache.release(&a).expect("release");
    cache.release(&b).expect("release");
    // x0 goes away; y0 takes its hash. x1 stays cached, still under its own hash.
    assert_eq!(cache.evict_conversation(&conv(1)), 1);
    let y = publish(&mut cache, &mut store, std::slice::from_ref(&y0), &owner(0, 3));
    cache.release(&y).expect("release");
    // [y0, x1] matches y0 (it is y0), but x1's KV was computed after x0: no hit.
    let m = cache.match_prefix(&[y0.key(), x1.key()], &mut store);
    assert_eq!(m.blocks, y);
    cache.release(&m.blocks).expect("release");
    // Not even after x0 itself comes back: a new entry is a new link.
    assert_eq!(cache.evict_conversation(&conv(3)), 1);
    let c = publish(&mut cache, &mut store, std::slice::from_ref(&x0), &owner(0, 1));
    cache.release(&c).expect("release");
    let m = cache.match_prefix(&[x0.key(), x1.key()], &mut store);
    assert_eq!(m.blocks, c);
    cache.release(&m.blocks).expect("release");
    cache.assert_consistent();
}

#[test]
fn a_forged_hash_collision_is_not_promoted_from_the_second_tier() {
    let (mut store, mut cache, tokens, alice) = alice_cached_in_a_one_block_pool();
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
    let (mut store, mut cache, tokens, alice) = alice_cached_in_a_one_block_pool();
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
