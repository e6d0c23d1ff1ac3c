//! The second memory tier: host-memory copies of blocks evicted from the primary
//! pool, plus the blocks of preempted (swapped-out) sequences.
//!
//! Users pause about a minute between turns; a block evicted from the device in that
//! time is spilled here instead of being dropped, so the next turn can promote it
//! back with one copy instead of recomputing the prefix.
//!
//! Invariants:
//! - `cached + swapped <= capacity` (all counted in blocks);
//! - cached entries form an LRU keyed by [`BlockHash`]; inserting into a full tier
//!   drops the least recently used entry;
//! - each cached entry keeps the block's [`Entry`] (scope, tokens, parent link), so a
//!   promotion is decided exactly like a primary hit, never by the hash alone;
//! - swapped blocks belong to a swap handle and are never dropped by the LRU; only
//!   `take_swap`/`drop_swap` remove them.

use std::collections::HashMap;

use super::ids::BlockHash;
use super::key::Entry;
use super::lru::LruList;

/// A spilled block: where it is found, what it must equal, and its bytes.
#[derive(Debug)]
struct Spilled {
    hash: BlockHash,
    entry: Entry,
    data: Box<[u8]>,
}

#[derive(Debug)]
pub(crate) struct Tier2 {
    capacity: usize,
    index: HashMap<BlockHash, u32>,
    slots: Vec<Option<Spilled>>,
    free_slots: Vec<u32>,
    lru: LruList,
    swaps: HashMap<u64, Vec<Box<[u8]>>>,
    swapped: usize,
}

impl Tier2 {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            index: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            lru: LruList::default(),
            swaps: HashMap::new(),
            swapped: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of cached (hash-keyed) entries.
    pub(crate) fn cached_len(&self) -> usize {
        self.index.len()
    }

    /// Number of blocks held by swap handles.
    pub(crate) fn swapped(&self) -> usize {
        self.swapped
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.index.contains_key(&hash)
    }

    /// The entry cached under `hash`, to compare with a lookup before taking it.
    pub(crate) fn entry(&self, hash: BlockHash) -> Option<&Entry> {
        let &slot = self.index.get(&hash)?;
        self.slots[slot as usize].as_ref().map(|s| &s.entry)
    }

    /// Drops least recently used cached entries until `needed` more blocks fit,
    /// recording the dropped hashes. Returns false (dropping nothing) when even an
    /// empty cache could not make room, because swaps hold the rest.
    fn make_room(&mut self, needed: usize, dropped: &mut Vec<BlockHash>) -> bool {
        if self.swapped + needed > self.capacity {
            return false;
        }
        while self.index.len() + self.swapped + needed > self.capacity {
            let Some(slot) = self.lru.pop_front() else {
                return false;
            };
            if let Some(s) = self.slots[slot as usize].take() {
                self.index.remove(&s.hash);
                dropped.push(s.hash);
            }
            self.free_slots.push(slot);
        }
        true
    }

    /// Stores a spilled block as the most recently used entry, dropping older entries
    /// to make room (their hashes are pushed to `dropped`). Returns false when the tier
    /// has no room at all (capacity 0, or all of it held by swaps).
    pub(crate) fn insert(&mut self, hash: BlockHash, entry: Entry, data: Box<[u8]>, dropped: &mut Vec<BlockHash>) -> bool {
        if let Some(&slot) = self.index.get(&hash) {
            // The newer block replaces the older one, entry and bytes together (the
            // two need not be the same block: hashes collide).
            self.slots[slot as usize] = Some(Spilled { hash, entry, data });
            self.lru.remove(slot);
            self.lru.push_back(slot);
            return true;
        }
        if !self.make_room(1, dropped) {
            return false;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let Ok(s) = u32::try_from(self.slots.len()) else {
                    return false;
                };
                self.slots.push(None);
                self.lru.grow(self.slots.len());
                s
            }
        };
        self.slots[slot as usize] = Some(Spilled { hash, entry, data });
        self.index.insert(hash, slot);
        self.lru.push_back(slot);
        true
    }

    /// Removes and returns a cached entry (for promotion to the primary pool).
    pub(crate) fn take(&mut self, hash: BlockHash) -> Option<(Entry, Box<[u8]>)> {
        let slot = self.index.remove(&hash)?;
        self.lru.remove(slot);
        self.free_slots.push(slot);
        self.slots[slot as usize].take().map(|s| (s.entry, s.data))
    }

    /// Removes a cached entry; returns whether it existed.
    pub(crate) fn remove(&mut self, hash: BlockHash) -> bool {
        self.take(hash).is_some()
    }

    /// Blocks a new swap could hold (dropping cached entries as needed).
    pub(crate) fn swap_room(&self) -> usize {
        self.capacity - self.swapped
    }

    /// Stores the blocks of a swapped-out sequence under `id`, dropping cached entries
    /// to make room. Hands the data back if it does not fit.
    pub(crate) fn insert_swap(
        &mut self,
        id: u64,
        data: Vec<Box<[u8]>>,
        dropped: &mut Vec<BlockHash>,
    ) -> Result<(), Vec<Box<[u8]>>> {
        if self.swaps.contains_key(&id) || !self.make_room(data.len(), dropped) {
            return Err(data);
        }
        self.swapped += data.len();
        self.swaps.insert(id, data);
        Ok(())
    }

    /// Number of blocks in swap `id`, if it exists.
    pub(crate) fn swap_len(&self, id: u64) -> Option<usize> {
        self.swaps.get(&id).map(Vec::len)
    }

    /// The bytes of swap `id`, without removing them.
    pub(crate) fn swap_data(&self, id: u64) -> Option<&[Box<[u8]>]> {
        self.swaps.get(&id).map(Vec::as_slice)
    }

    /// Removes and returns the bytes of swap `id`.
    pub(crate) fn take_swap(&mut self, id: u64) -> Option<Vec<Box<[u8]>>> {
        let data = self.swaps.remove(&id)?;
        self.swapped -= data.len();
        Some(data)
    }

    /// Removes swap `id`, returning whether it existed.
    pub(crate) fn drop_swap(&mut self, id: u64) -> bool {
        match self.swaps.remove(&id) {
            Some(data) => {
                self.swapped -= data.len();
                true
            }
            None => false,
        }
    }

    /// Cached hashes, least recently used first (tests only).
    #[cfg(test)]
    pub(crate) fn cached_hashes(&self) -> Vec<BlockHash> {
        self.lru
            .iter()
            .filter_map(|s| self.slots[s as usize].as_ref().map(|s| s.hash))
            .collect()
    }

    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        assert!(self.index.len() + self.swapped <= self.capacity, "tier2 over capacity");
        assert_eq!(self.lru.len(), self.index.len());
        for (hash, &slot) in &self.index {
            assert!(self.lru.contains(slot));
            assert_eq!(self.slots[slot as usize].as_ref().map(|s| s.hash), Some(*hash));
        }
        assert_eq!(self.swaps.values().map(Vec::len).sum::<usize>(), self.swapped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockKey, OwnerScope};

    fn key(t: &[u32; 1]) -> BlockKey<'_> {
        BlockKey { hash: BlockHash(0), scope: &OwnerScope::Platform, tokens: t }
    }

    fn entry(t: u32) -> Entry {
        Entry::new(&key(&[t]), None)
    }

    fn data(b: u8) -> Box<[u8]> {
        vec![b; 4].into_boxed_slice()
    }

    #[test]
    fn tier2_drops_oldest_and_never_drops_swaps() {
        let mut t = Tier2::new(3);
        let mut dropped = Vec::new();
        for i in 0..3 {
            assert!(t.insert(BlockHash(i), entry(i as u32), data(i as u8), &mut dropped));
        }
        // Touch 0 by re-inserting: 1 becomes the oldest.
        assert!(t.insert(BlockHash(0), entry(0), data(9), &mut dropped));
        assert!(t.insert(BlockHash(3), entry(3), data(3), &mut dropped));
        assert_eq!(dropped, vec![BlockHash(1)]);
        assert_eq!(t.cached_hashes(), vec![BlockHash(2), BlockHash(0), BlockHash(3)]);
        // A swap of 2 pushes out the two oldest cached entries.
        dropped.clear();
        assert!(t.insert_swap(7, vec![data(1), data(2)], &mut dropped).is_ok());
        assert_eq!(dropped, vec![BlockHash(2), BlockHash(0)]);
        assert_eq!((t.cached_len(), t.swapped()), (1, 2));
        // A swap that cannot fit is handed back untouched.
        assert!(t.insert_swap(8, vec![data(1), data(2)], &mut dropped).is_err());
        assert_eq!(t.cached_len(), 1);
        // The cache can still cycle through the one free place.
        assert!(t.insert(BlockHash(4), entry(4), data(4), &mut dropped));
        assert!(!t.contains(BlockHash(3)));
        let (e, d) = t.take(BlockHash(4)).expect("cached");
        assert!(e.is(&key(&[4]), None), "the entry travels with its bytes");
        assert_eq!(&*d, &[4u8; 4][..]);
        assert_eq!(t.swap_data(7).map(|d| d.len()), Some(2));
        assert!(t.drop_swap(7));
        assert!(!t.drop_swap(7));
        t.assert_consistent();
        let mut none = Tier2::new(0);
        assert!(!none.insert(BlockHash(1), entry(1), data(1), &mut dropped));
    }
}
