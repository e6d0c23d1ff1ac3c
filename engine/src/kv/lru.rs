//! An intrusive LRU list over dense slot indices.
//!
//! The pool has one slot per block and the second tier one slot per stored entry, so
//! both keep their recency order as `prev`/`next` arrays indexed by slot: every
//! operation is O(1) and allocation-free, which matters with 100k+ blocks where a
//! `VecDeque` with removal from the middle would be O(n).
//!
//! Invariant: a slot is linked at most once; `len` counts linked slots; the head is
//! the least recently used slot and the tail the most recently used.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for LruList {
    fn default() -> Self {
        Self::with_slots(0)
    }
}

impl LruList {
    /// An empty list able to hold slots `0..slots`.
    pub(crate) fn with_slots(slots: usize) -> Self {
        Self {
            prev: vec![NIL; slots],
            next: vec![NIL; slots],
            linked: vec![false; slots],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Makes room for slots `0..slots` (never shrinks).
    pub(crate) fn grow(&mut self, slots: usize) {
        if slots > self.prev.len() {
            self.prev.resize(slots, NIL);
            self.next.resize(slots, NIL);
            self.linked.resize(slots, false);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.linked.get(slot as usize).copied().unwrap_or(false)
    }

    /// Links `slot` as the most recently used. Returns false (and changes nothing)
    /// if it is already linked or out of range.
    pub(crate) fn push_back(&mut self, slot: u32) -> bool {
        let i = slot as usize;
        if i >= self.linked.len() || self.linked[i] {
            return false;
        }
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = slot;
        } else {
            self.next[self.tail as usize] = slot;
        }
        self.tail = slot;
        self.len += 1;
        true
    }

    /// Unlinks `slot`. Returns false if it was not linked.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        if !self.contains(slot) {
            return false;
        }
        let i = slot as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// The least recently used slot, if any.
    pub(crate) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Unlinks and returns the least recently used slot.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let slot = self.front()?;
        self.remove(slot);
        Some(slot)
    }

    /// Slots from least to most recently used (for audits and tests).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let slot = cur;
            cur = self.next[slot as usize];
            Some(slot)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_orders_by_recency_and_removes_from_middle() {
        let mut l = LruList::with_slots(4);
        for s in [2, 0, 3] {
            assert!(l.push_back(s));
        }
        assert!(!l.push_back(0), "double link is refused");
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![2, 0, 3]);
        assert!(l.remove(0));
        assert!(!l.remove(0));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(l.pop_front(), Some(2));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.len(), 0);
        assert!(!l.push_back(9), "out of range");
        l.grow(10);
        assert!(l.push_back(9));
        assert_eq!(l.front(), Some(9));
        // A default list is empty, not a list whose head is slot 0.
        let mut d = LruList::default();
        d.grow(1);
        assert!(d.push_back(0));
        assert_eq!(d.iter().collect::<Vec<_>>(), vec![0]);
    }
}
