//! Every replica's prefix cache at once, laid out by conversation: the simulator's hot
//! data structure.
//!
//! A per-replica hash map plus linked list ([`crate::lru::PrefixLru`]) costs six to eight
//! cache misses per turn once the fleet's caches outgrow the CPU cache. Here each
//! conversation owns a row of `k` slots `(node, prefix length, stamp)`, one per replica
//! that has cached it (`k = min(turns, nodes)`, so a row never overflows), and LRU order is
//! generation-indexed: every store takes a fresh global stamp and appends
//! `(conversation, stamp, length)` to the node's HBM FIFO queue. A stamp is live in at
//! most one tier, kept in two bitmaps (HBM, host) small enough to stay in the CPU cache.
//! Eviction pops the queue front, skips records whose stamp is no longer live (touched
//! again since), and moves a live one to the host tier by flipping its bits and queueing
//! it there: it never touches a conversation's row, so a turn costs one row access, which
//! the simulator prefetches from the trace.
//!
//! Semantics are those of [`crate::lru::PrefixLru`] per (node, tier), which the tests
//! check: `store` replaces and makes most-recent, then evicts from the LRU end while over
//! capacity (possibly the entry just stored); HBM evictions move to the host tier when it
//! exists, host evictions are dropped.
//!
//! Invariants: stamps are unique; a slot's entry is live iff its stamp is set in exactly
//! one tier bitmap; a live queue record's length equals its slot's; a row holds at most
//! one slot per node, used slots packed at its front (dead ones are reused in place);
//! `used` of a tier is the sum of the lengths of its live entries.

use std::collections::VecDeque;

const EMPTY: u32 = u32::MAX;

/// Memory tier of a cached prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Hbm = 0,
    Host = 1,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Node id; `EMPTY` if never used.
    node: u32,
    len: u32,
    stamp: u32,
}

const NO_SLOT: Slot = Slot {
    node: EMPTY,
    len: 0,
    stamp: 0,
};

#[derive(Debug, Clone, Default)]
struct TierState {
    capacity: u64,
    used: u64,
    live: usize,
    /// `(conversation, stamp, length)`, oldest first.
    queue: VecDeque<(u32, u32, u32)>,
}

/// One bit per stamp.
#[derive(Debug, Clone, Default)]
struct Bits(Vec<u64>);

impl Bits {
    #[inline]
    fn get(&self, i: u32) -> bool {
        self.0
            .get(i as usize / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    #[inline]
    fn set(&mut self, i: u32) {
        let w = i as usize / 64;
        if w >= self.0.len() {
            self.0.resize((w + 1).next_power_of_two(), 0);
        }
        self.0[w] |= 1 << (i % 64);
    }
    #[inline]
    fn clear(&mut self, i: u32) {
        if let Some(w) = self.0.get_mut(i as usize / 64) {
            *w &= !(1 << (i % 64));
        }
    }
}

/// Prefix caches of all nodes (HBM, and host when its capacity is non-zero).
#[derive(Debug, Clone)]
pub struct PrefixStore {
    k: usize,
    slots: Vec<Slot>,
    tiers: Vec<[TierState; 2]>,
    live: [Bits; 2],
    hbm_capacity: u64,
    host_capacity: u64,
    stamp: u32,
    forced_evictions: u64,
}

impl PrefixStore {
    /// Caches for `conversations`, each cached on at most `k` nodes at once, with the
    /// given per-node capacities in tokens (host 0: no host tier).
    pub fn new(conversations: u32, k: usize, hbm_capacity: u64, host_capacity: u64) -> Self {
        let k = k.max(1);
        Self {
            k,
            slots: vec![NO_SLOT; conversations as usize * k],
            tiers: Vec::new(),
            live: [Bits::default(), Bits::default()],
            hbm_capacity,
            host_capacity,
            stamp: 0,
            forced_evictions: 0,
        }
    }

    /// Entries dropped because a conversation needed more than `k` slots (0 whenever
    /// `k >= min(turns, nodes)`).
    pub fn forced_evictions(&self) -> u64 {
        self.forced_evictions
    }

    fn ensure_node(&mut self, node: u32) {
        while self.tiers.len() <= node as usize {
            let t = |capacity| TierState {
                capacity,
                ..TierState::default()
            };
            self.tiers
                .push([t(self.hbm_capacity), t(self.host_capacity)]);
        }
    }

    /// Tokens held by `node` in `tier`.
    pub fn used(&self, node: u32, tier: Tier) -> u64 {
        self.tiers
            .get(node as usize)
            .map_or(0, |t| t[tier as usize].used)
    }

    /// Hint the CPU to fetch `conv`'s row now, ahead of a turn that will touch it: the
    /// trace is known in advance, so misses overlap instead of queueing.
    #[inline]
    pub fn prefetch(&self, conv: u32) {
        prefetch(self.slots.as_ptr().wrapping_add(conv as usize * self.k));
    }

    #[inline]
    fn row(&self, conv: u32) -> std::ops::Range<usize> {
        let a = conv as usize * self.k;
        a..a + self.k
    }

    #[inline]
    fn next_stamp(&mut self) -> u32 {
        self.stamp = self
            .stamp
            .checked_add(1)
            .expect("more than 2^32 cache stores");
        self.stamp
    }

    #[inline]
    fn tier_of(&self, stamp: u32) -> Option<Tier> {
        if self.live[0].get(stamp) {
            Some(Tier::Hbm)
        } else if self.live[1].get(stamp) {
            Some(Tier::Host)
        } else {
            None
        }
    }

    /// The slot of `conv` on `node`, live or dead.
    #[inline]
    fn find_ix(&self, conv: u32, node: u32) -> Option<usize> {
        for i in self.row(conv) {
            let n = self.slots[i].node;
            if n == EMPTY {
                return None;
            }
            if n == node {
                return Some(i);
            }
        }
        None
    }

    /// `conv`'s live entry on `node`: its tier and length.
    #[inline]
    pub fn find(&self, conv: u32, node: u32) -> Option<(Tier, u32)> {
        let s = self.slots[self.find_ix(conv, node)?];
        self.tier_of(s.stamp).map(|t| (t, s.len))
    }

    /// Make a live entry dead, fixing its tier's accounting.
    #[inline]
    fn kill(&mut self, node: u32, stamp: u32, len: u32, tier: Tier) {
        self.live[tier as usize].clear(stamp);
        let t = &mut self.tiers[node as usize][tier as usize];
        t.used -= len as u64;
        t.live -= 1;
    }

    /// Make `stamp` live in `tier` of `node`, as its most recently used entry.
    #[inline]
    fn revive(&mut self, conv: u32, node: u32, stamp: u32, len: u32, tier: Tier) {
        self.live[tier as usize].set(stamp);
        let t = &mut self.tiers[node as usize][tier as usize];
        t.used += len as u64;
        t.live += 1;
        t.queue.push_back((conv, stamp, len));
    }

    /// Look `conv` up on `node` for a turn: an HBM entry is returned as is; a host entry is
    /// taken out of the host tier (the turn will store it back into HBM).
    #[inline]
    pub fn take_for_turn(&mut self, conv: u32, node: u32) -> Option<(Tier, u32)> {
        let s = self.slots[self.find_ix(conv, node)?];
        let tier = self.tier_of(s.stamp)?;
        if tier == Tier::Host {
            self.kill(node, s.stamp, s.len, Tier::Host);
        }
        Some((tier, s.len))
    }

    /// Make `conv`'s prefix on `node` `len` tokens long and most recently used in HBM, then
    /// evict least-recently-used HBM entries while over capacity (into the host tier, if
    /// any; the host tier drops its own overflow the same way).
    pub fn store(&mut self, conv: u32, node: u32, len: u32) {
        self.ensure_node(node);
        let i = match self.find_ix(conv, node) {
            Some(i) => {
                let old = self.slots[i];
                if let Some(tier) = self.tier_of(old.stamp) {
                    self.kill(node, old.stamp, old.len, tier);
                }
                i
            }
            None => self.free_slot(conv),
        };
        let stamp = self.next_stamp();
        self.slots[i] = Slot { node, len, stamp };
        self.revive(conv, node, stamp, len, Tier::Hbm);
        self.evict(node);
    }

    /// A slot for a new (conv, node) pair: never used, else dead, else the oldest live one
    /// (counted as a forced eviction).
    fn free_slot(&mut self, conv: u32) -> usize {
        let row = self.row(conv);
        let mut oldest: Option<usize> = None;
        for i in row {
            let s = self.slots[i];
            if s.node == EMPTY || self.tier_of(s.stamp).is_none() {
                return i;
            }
            if oldest.is_none_or(|o| s.stamp < self.slots[o].stamp) {
                oldest = Some(i);
            }
        }
        let i = oldest.expect("k >= 1");
        let s = self.slots[i];
        let tier = self.tier_of(s.stamp).expect("live");
        self.kill(s.node, s.stamp, s.len, tier);
        self.forced_evictions += 1;
        i
    }

    fn evict(&mut self, node: u32) {
        let n = node as usize;
        let host_on = self.host_capacity > 0;
        while self.tiers[n][0].used > self.tiers[n][0].capacity {
            let Some((conv, stamp, len)) = self.tiers[n][0].queue.pop_front() else {
                break;
            };
            if !self.live[0].get(stamp) {
                continue; // stored again since: a stale record
            }
            self.kill(node, stamp, len, Tier::Hbm);
            if host_on {
                // Same stamp, other tier: the conversation's row needs no update.
                self.revive(conv, node, stamp, len, Tier::Host);
                while self.tiers[n][1].used > self.tiers[n][1].capacity {
                    let Some((_, s, l)) = self.tiers[n][1].queue.pop_front() else {
                        break;
                    };
                    if self.live[1].get(s) {
                        self.kill(node, s, l, Tier::Host);
                    }
                }
            }
        }
        for tier in 0..2 {
            self.compact(node, tier);
        }
    }

    /// Drop stale records when a queue is mostly stale, keeping memory O(live entries).
    fn compact(&mut self, node: u32, tier: usize) {
        let t = &self.tiers[node as usize][tier];
        if t.queue.len() <= 2 * t.live + 1024 {
            return;
        }
        let mut q = std::mem::take(&mut self.tiers[node as usize][tier].queue);
        q.retain(|&(_, stamp, _)| self.live[tier].get(stamp));
        self.tiers[node as usize][tier].queue = q;
    }

    /// A node failed: drop everything it held.
    pub fn clear_node(&mut self, node: u32) {
        let Some(tiers) = self.tiers.get_mut(node as usize) else {
            return;
        };
        for (tier, t) in tiers.iter_mut().enumerate() {
            for (_, stamp, _) in t.queue.drain(..) {
                self.live[tier].clear(stamp);
            }
            t.used = 0;
            t.live = 0;
        }
    }
}

/// A read prefetch hint; a no-op off x86_64. Never dereferences the pointer.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unused_unsafe)]
    // SAFETY: prefetch is a hint that cannot fault, whatever the address; SSE is part of
    // the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lru::PrefixLru;
    use proptest::prelude::*;

    /// The reference: one PrefixLru per (node, tier), driven the way the simulator did
    /// before this store existed.
    struct Model {
        nodes: Vec<(PrefixLru, PrefixLru)>,
        host_on: bool,
    }

    impl Model {
        fn turn(&mut self, conv: u32, node: usize, len: u32) -> Option<(Tier, u32)> {
            let host_on = self.host_on;
            let (hbm, host) = &mut self.nodes[node];
            let found = match hbm.get(conv) {
                Some(l) => Some((Tier::Hbm, l)),
                None if host_on => host.remove(conv).map(|l| (Tier::Host, l)),
                None => None,
            };
            hbm.insert(conv, len, |k, l| {
                if host_on {
                    host.insert(k, l, |_, _| {});
                }
            });
            found
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn matches_per_node_prefix_lrus(
            hbm_cap in 1u64..400,
            host_cap in prop::sample::select(vec![0u64, 50, 300]),
            ops in prop::collection::vec((0u32..10, 0usize..3, 1u32..120, 0u8..40), 1..300),
        ) {
            let mut store = PrefixStore::new(10, 3, hbm_cap, host_cap);
            let mut model = Model {
                nodes: (0..3).map(|_| (PrefixLru::new(hbm_cap), PrefixLru::new(host_cap))).collect(),
                host_on: host_cap > 0,
            };
            for (conv, node, len, op) in ops {
                if op == 0 {
                    store.clear_node(node as u32);
                    model.nodes[node].0.clear();
                    model.nodes[node].1.clear();
                    continue;
                }
                let got = store.take_for_turn(conv, node as u32);
                store.store(conv, node as u32, len);
                prop_assert_eq!(got, model.turn(conv, node, len));
                for n in 0..3 {
                    prop_assert_eq!(store.used(n as u32, Tier::Hbm), model.nodes[n].0.used());
                    prop_assert_eq!(store.used(n as u32, Tier::Host), model.nodes[n].1.used());
                }
            }
            prop_assert_eq!(store.forced_evictions(), 0);
        }
    }

    #[test]
    fn queues_stay_bounded_without_evictions() {
        // A huge cache never evicts, so touches would pile up without compaction.
        let mut s = PrefixStore::new(4, 1, u64::MAX / 2, 0);
        for i in 0..100_000u32 {
            s.store(i % 4, 0, i);
        }
        assert!(s.tiers[0][0].queue.len() <= 2 * 4 + 1024 + 1);
        assert_eq!(s.find(3, 0), Some((Tier::Hbm, 99_999)));
    }

    #[test]
    fn a_full_row_drops_its_oldest_entry_and_counts_it() {
        let mut s = PrefixStore::new(1, 2, 1_000, 0);
        s.store(0, 0, 10);
        s.store(0, 1, 20);
        s.store(0, 2, 30);
        assert_eq!(s.forced_evictions(), 1);
        assert_eq!(s.find(0, 0), None);
        assert_eq!(s.find(0, 2), Some((Tier::Hbm, 30)));
        assert_eq!(s.used(0, Tier::Hbm), 0);
    }
}
