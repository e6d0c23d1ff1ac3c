//! An O(1) LRU of prefix lengths, bounded by total tokens: the prefix cache of one
//! simulated replica (or its host-memory tier).
//!
//! Entries are `conversation -> cached prefix length in tokens`; the simulator tracks
//! prefixes as token counts, never token arrays. Storage is a slab of slots linked into an
//! intrusive doubly linked list (head = most recently used, tail = least), with freed slots
//! recycled, plus a hash index from key to slot. Every operation is O(1) amortized.
//!
//! Semantics match the seed's `OrderedDict` replica: `insert` replaces and moves the key to
//! the most-recent end, then evicts least-recently-used entries while the total exceeds
//! the capacity (which can evict the entry just inserted if it alone is too large).
//! Invariant: `used` equals the sum of the lengths of the entries present.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const NIL: u32 = u32::MAX;

/// A fast hasher for dense integer keys (conversation ids). Not DoS-resistant: keys here
/// come from the simulator, never from users.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        // Low bits of an odd multiple permute the low bits of dense keys (good buckets);
        // the high bits, used by the table's control bytes, are well mixed.
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap = HashMap<u32, u32, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// A token-bounded LRU from key to prefix length.
#[derive(Debug, Clone)]
pub struct PrefixLru {
    capacity: u64,
    used: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    index: IdMap,
}

impl PrefixLru {
    /// An empty cache holding at most `capacity` tokens.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            index: IdMap::default(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Tokens held.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    #[inline]
    fn unlink(&mut self, i: u32) {
        let Slot { prev, next, .. } = self.slots[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    #[inline]
    fn push_front(&mut self, i: u32) {
        let old = self.head;
        {
            let s = &mut self.slots[i as usize];
            s.prev = NIL;
            s.next = old;
        }
        if old == NIL {
            self.tail = i;
        } else {
            self.slots[old as usize].prev = i;
        }
        self.head = i;
    }

    /// The cached length for `key`, marking it most recently used.
    #[inline]
    pub fn get(&mut self, key: u32) -> Option<u32> {
        let i = *self.index.get(&key)?;
        if self.head != i {
            self.unlink(i);
            self.push_front(i);
        }
        Some(self.slots[i as usize].len)
    }

    /// The cached length for `key`, without touching recency.
    pub fn peek(&self, key: u32) -> Option<u32> {
        self.index.get(&key).map(|&i| self.slots[i as usize].len)
    }

    /// Remove `key`, returning its length.
    #[inline]
    pub fn remove(&mut self, key: u32) -> Option<u32> {
        let i = self.index.remove(&key)?;
        self.unlink(i);
        self.free.push(i);
        let len = self.slots[i as usize].len;
        self.used -= len as u64;
        Some(len)
    }

    /// Set `key`'s length and make it most recently used, then evict from the LRU end while
    /// over capacity, handing each evicted `(key, len)` to `evicted`.
    #[inline]
    pub fn insert(&mut self, key: u32, len: u32, mut evicted: impl FnMut(u32, u32)) {
        match self.index.get(&key) {
            Some(&i) => {
                let s = &mut self.slots[i as usize];
                self.used = self.used - s.len as u64 + len as u64;
                s.len = len;
                if self.head != i {
                    self.unlink(i);
                    self.push_front(i);
                }
            }
            None => {
                let slot = Slot {
                    key,
                    len,
                    prev: NIL,
                    next: NIL,
                };
                let i = match self.free.pop() {
                    Some(i) => {
                        self.slots[i as usize] = slot;
                        i
                    }
                    None => {
                        self.slots.push(slot);
                        (self.slots.len() - 1) as u32
                    }
                };
                self.index.insert(key, i);
                self.used += len as u64;
                self.push_front(i);
            }
        }
        while self.used > self.capacity && self.tail != NIL {
            let t = self.tail;
            let Slot { key, len, .. } = self.slots[t as usize];
            self.unlink(t);
            self.index.remove(&key);
            self.free.push(t);
            self.used -= len as u64;
            evicted(key, len);
        }
    }

    /// Drop everything (a failed node loses its memory).
    pub fn clear(&mut self) {
        self.used = 0;
        self.slots.clear();
        self.free.clear();
        self.index.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    /// Keys from most to least recently used (for tests and debugging).
    pub fn keys_mru(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        let mut i = self.head;
        while i != NIL {
            out.push(self.slots[i as usize].key);
            i = self.slots[i as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The seed's `Replica` (an OrderedDict), transcribed as the reference model.
    #[derive(Default)]
    struct Model {
        cap: u64,
        used: u64,
        order: Vec<(u32, u32)>, // least recent first
    }

    impl Model {
        fn get(&mut self, k: u32) -> Option<u32> {
            let p = self.order.iter().position(|e| e.0 == k)?;
            let e = self.order.remove(p);
            self.order.push(e);
            Some(e.1)
        }
        fn insert(&mut self, k: u32, len: u32) -> Vec<(u32, u32)> {
            if let Some(p) = self.order.iter().position(|e| e.0 == k) {
                self.used -= self.order.remove(p).1 as u64;
            }
            self.order.push((k, len));
            self.used += len as u64;
            let mut ev = Vec::new();
            while self.used > self.cap && !self.order.is_empty() {
                let e = self.order.remove(0);
                self.used -= e.1 as u64;
                ev.push(e);
            }
            ev
        }
        fn remove(&mut self, k: u32) -> Option<u32> {
            let p = self.order.iter().position(|e| e.0 == k)?;
            let e = self.order.remove(p);
            self.used -= e.1 as u64;
            Some(e.1)
        }
    }

    #[test]
    fn evicts_least_recent_first_and_touch_protects() {
        let mut c = PrefixLru::new(10);
        let mut ev = Vec::new();
        c.insert(1, 4, |k, l| ev.push((k, l)));
        c.insert(2, 4, |k, l| ev.push((k, l)));
        assert_eq!(c.get(1), Some(4)); // 1 is now most recent
        c.insert(3, 4, |k, l| ev.push((k, l)));
        assert_eq!(ev, vec![(2, 4)]);
        assert_eq!(c.keys_mru(), vec![3, 1]);
        assert_eq!(c.used(), 8);
        // An entry larger than the whole cache evicts everything, itself last.
        ev.clear();
        c.insert(9, 11, |k, l| ev.push((k, l)));
        assert_eq!(ev, vec![(1, 4), (3, 4), (9, 11)]);
        assert!(c.is_empty());
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn replace_updates_usage_and_recency() {
        let mut c = PrefixLru::new(100);
        c.insert(1, 10, |_, _| {});
        c.insert(2, 10, |_, _| {});
        c.insert(1, 30, |_, _| {});
        assert_eq!(c.used(), 40);
        assert_eq!(c.keys_mru(), vec![1, 2]);
        assert_eq!(c.remove(2), Some(10));
        assert_eq!(c.peek(2), None);
        assert_eq!(c.used(), 30);
        c.clear();
        assert_eq!((c.len(), c.used()), (0, 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn matches_the_seeds_ordered_dict(
            cap in 1u64..200,
            ops in prop::collection::vec((0u8..3, 0u32..12, 1u32..60), 1..200),
        ) {
            let mut c = PrefixLru::new(cap);
            let mut m = Model { cap, ..Model::default() };
            for (op, k, len) in ops {
                match op {
                    0 => prop_assert_eq!(c.get(k), m.get(k)),
                    1 => {
                        let mut ev = Vec::new();
                        c.insert(k, len, |a, b| ev.push((a, b)));
                        prop_assert_eq!(ev, m.insert(k, len));
                    }
                    _ => prop_assert_eq!(c.remove(k), m.remove(k)),
                }
                prop_assert_eq!(c.used(), m.used);
                prop_assert!(c.used() <= cap);
                let mut want: Vec<u32> = m.order.iter().map(|e| e.0).collect();
                want.reverse();
                prop_assert_eq!(c.keys_mru(), want);
            }
        }
    }
}
