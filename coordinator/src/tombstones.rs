//! Which nodes may still hold a deleted conversation's KV, and which conversations are
//! tombstoned (deleted, not yet evicted everywhere).
//!
//! The rule ("every node that may hold KV"): a conversation's KV may be on any node that
//! was a member while the conversation existed. The coordinator asks every current
//! member; the members that left the ring (lease expired or deregistered) within the
//! departed window, and the nodes registering right now, were not asked and are
//! reported as pending. A member that fails to evict is removed from the ring at once
//! (its lease revoked). A tombstone clears only on an answer with no failure and nothing
//! pending. A node that joins (or re-joins) is admitted only after it evicted every
//! outstanding tombstone, so a node cut off while a conversation was deleted never serves
//! that conversation's prefix when it comes back.
//!
//! Invariants: a node ID is in at most one of `known` (a member at the last look) and
//! `departed`; `joining` counts registrations in flight per node and returns to zero on
//! every path (see [`JoinTicket`]). Plain data; time is an argument.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Tombstones and the nodes that may owe evictions.
#[derive(Debug)]
pub struct Ledger {
    /// Routing key -> owner, of conversations deleted and not yet evicted everywhere.
    tombstones: BTreeMap<String, String>,
    /// Nodes that were members at the last look.
    known: BTreeSet<String>,
    /// Nodes that left the ring, and when the coordinator noticed.
    departed: HashMap<String, Instant>,
    /// Registrations in flight, per node.
    joining: HashMap<String, usize>,
    window: Duration,
}

impl Ledger {
    /// Remembers departed nodes for `window`.
    pub fn new(window: Duration) -> Self {
        Self { tombstones: BTreeMap::new(), known: BTreeSet::new(), departed: HashMap::new(), joining: HashMap::new(), window }
    }

    /// Records a deletion; it stays until [`Ledger::clear`].
    pub fn tombstone(&mut self, key: &str, owner: &str) {
        self.tombstones.insert(key.to_string(), owner.to_string());
    }

    /// The conversation was evicted everywhere.
    pub fn clear(&mut self, key: &str) {
        self.tombstones.remove(key);
    }

    pub fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    /// Every outstanding tombstone (routing key, owner).
    pub fn outstanding(&self) -> Vec<(String, String)> {
        self.tombstones.iter().map(|(k, o)| (k.clone(), o.clone())).collect()
    }

    /// The members now: a node known before and missing now departed at `now`; departed
    /// nodes past the window are forgotten.
    pub fn observe<'a>(&mut self, members: impl IntoIterator<Item = &'a str>, now: Instant) {
        let current: BTreeSet<String> = members.into_iter().map(str::to_string).collect();
        for gone in self.known.difference(&current) {
            self.departed.insert(gone.clone(), now);
        }
        for m in &current {
            self.departed.remove(m);
        }
        self.known = current;
        let window = self.window;
        self.departed.retain(|_, at| now.saturating_duration_since(*at) <= window);
    }

    /// Nodes that may hold KV but are not in `asked`: departed within the window, or
    /// registering now. Sorted.
    pub fn pending(&self, asked: &[&str], now: Instant) -> Vec<String> {
        let departed = self.departed.iter().filter(|(_, at)| now.saturating_duration_since(**at) <= self.window).map(|(n, _)| n);
        let joining = self.joining.keys();
        let all: BTreeSet<&String> = departed.chain(joining).filter(|n| !asked.contains(&n.as_str())).collect();
        all.into_iter().cloned().collect()
    }

    /// A registration of `node` starts: until it ends, evictions report the node pending.
    /// Returns the tombstones the node must evict before it is admitted.
    pub fn begin_join(&mut self, node: &str) -> Vec<(String, String)> {
        *self.joining.entry(node.to_string()).or_insert(0) += 1;
        self.outstanding()
    }

    /// A registration of `node` ended; `admitted` if the node is now a member.
    pub fn end_join(&mut self, node: &str, admitted: bool) {
        if let Some(n) = self.joining.get_mut(node) {
            *n -= 1;
            if *n == 0 {
                self.joining.remove(node);
            }
        }
        if admitted {
            self.departed.remove(node);
            self.known.insert(node.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_departed_node_is_pending_for_the_window_then_forgotten() {
        let t0 = Instant::now();
        let mut l = Ledger::new(Duration::from_secs(60));
        l.observe(["a", "b"], t0);
        assert!(l.pending(&["a", "b"], t0).is_empty());
        l.observe(["a"], t0 + Duration::from_secs(1));
        assert_eq!(l.pending(&["a"], t0 + Duration::from_secs(2)), vec!["b"]);
        // Asked (it came back and acknowledged): not pending.
        assert!(l.pending(&["a", "b"], t0 + Duration::from_secs(2)).is_empty());
        l.observe(["a"], t0 + Duration::from_secs(62));
        assert!(l.pending(&["a"], t0 + Duration::from_secs(62)).is_empty(), "forgotten after the window");
    }

    #[test]
    fn a_joining_node_is_pending_until_admitted_and_rejoining_clears_departure() {
        let t0 = Instant::now();
        let mut l = Ledger::new(Duration::from_secs(60));
        l.observe(["a", "b"], t0);
        l.observe(["a"], t0);
        l.tombstone("conv-1", "alice");
        assert_eq!(l.begin_join("b"), vec![("conv-1".to_string(), "alice".to_string())]);
        l.tombstone("conv-2", "alice");
        assert_eq!(l.pending(&["a"], t0), vec!["b"], "joining (and departed): not asked, so pending");
        l.end_join("b", true);
        assert!(l.pending(&["a", "b"], t0).is_empty());
        assert!(l.pending(&["a"], t0).is_empty(), "a member is asked, never pending");
        // A refused registration leaves nothing behind.
        l.begin_join("c");
        l.end_join("c", false);
        assert!(l.pending(&["a", "b"], t0).is_empty());
        l.clear("conv-1");
        assert_eq!(l.outstanding(), vec![("conv-2".to_string(), "alice".to_string())]);
        assert_eq!(l.tombstones(), 1);
    }
}
