//! Decode placement: which decode node serves a conversation's turn.
//!
//! Consistent hashing with bounded loads ([`Ring`]) over the live decode nodes, where a
//! node's load is the number of conversations placed on it and still active (a turn
//! within `idle_ttl`). A conversation stays on the node it was placed on (its prefix is
//! warm there) until that node leaves, is excluded by the caller, or a newly joined node
//! becomes its home on the ring: then it moves, so a join takes over about `1/n` of the
//! conversations, as consistent hashing promises.
//!
//! Pure and synchronous: time comes in as an argument, the caller owns the lock.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use baton_vocab::ConversationId;

use super::ring::{hash_of, key_of, mix64, Ring, RingError, Slot};

/// Why the decode router chose a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeReason {
    /// The conversation already lives there.
    Sticky,
    /// Its home on the ring, under the load bound.
    Home,
    /// Home over the bound or excluded: the first node clockwise that is not.
    Spilled,
}

/// One node considered, in ring order from the key's home.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecodeCandidate {
    pub node: String,
    pub load: u64,
    pub eligible: bool,
}

/// The outcome of [`DecodeRouter::route`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecodeDecision {
    pub node: String,
    pub reason: DecodeReason,
    /// The most conversations one node may hold when this one arrived.
    pub bound: u64,
    pub candidates: Vec<DecodeCandidate>,
    /// The node the conversation was on before a join moved it to `node`
    /// (reported once, on the first turn after the move): it may still hold
    /// the warm prefix for `node` to pull.
    pub previous: Option<String>,
}

#[derive(Debug, Clone, Copy)]
struct Placement {
    slot: Slot,
    last_used: Instant,
    /// Set when a joining node became the conversation's home; taken by the next turn.
    moved_from: Option<Slot>,
    /// The shared store's revision of the record this placement follows or wrote (0:
    /// none; see `crate::placements`): a record with a larger one is a later decision.
    revision: i64,
}

/// The decode router's state: ring, node names, and conversation placements.
#[derive(Debug)]
pub struct DecodeRouter {
    ring: Ring,
    names: BTreeMap<Slot, String>,
    slots: HashMap<String, Slot>,
    /// Keyed by the routing key's hash: the coordinator keeps no conversation IDs.
    placements: HashMap<u64, Placement>,
    counts: HashMap<Slot, u64>,
    total: u64,
    idle_ttl: Duration,
}

impl DecodeRouter {
    /// `vnodes` ring points per node, load bound factor `load_factor` (>= 1), and
    /// conversations idle longer than `idle_ttl` stop counting as load.
    pub fn new(vnodes: u32, load_factor: f64, idle_ttl: Duration) -> Result<Self, RingError> {
        Ok(Self {
            ring: Ring::new(vnodes, load_factor)?,
            names: BTreeMap::new(),
            slots: HashMap::new(),
            placements: HashMap::new(),
            counts: HashMap::new(),
            total: 0,
            idle_ttl,
        })
    }

    /// Current members by name.
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.names.values().map(String::as_str)
    }

    /// Conversations placed on `node` (0 for a non-member).
    pub fn load(&self, node: &str) -> u64 {
        self.slots.get(node).map_or(0, |s| self.count(*s))
    }

    /// Conversations placed in total.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The node a conversation is placed on now, if any.
    pub fn placement(&self, conversation: &ConversationId) -> Option<&str> {
        let p = self.placements.get(&key_of(conversation))?;
        self.names.get(&p.slot).map(String::as_str)
    }

    /// The shared-store revision the conversation's placement follows (0: none).
    pub fn revision(&self, conversation: &ConversationId) -> i64 {
        self.placements.get(&key_of(conversation)).map_or(0, |p| p.revision)
    }

    /// Notes that the conversation's placement is recorded in the shared store at `revision`.
    pub fn set_revision(&mut self, conversation: &ConversationId, revision: i64) {
        if let Some(p) = self.placements.get_mut(&key_of(conversation)) {
            p.revision = revision;
        }
    }

    /// Follows a placement another replica decided (recorded at `revision`), unless this
    /// router already follows that decision or a later one, or `node` is not a member.
    /// Returns true if the conversation now sits on `node` at `revision`.
    pub fn adopt(&mut self, conversation: &ConversationId, node: &str, revision: i64, now: Instant) -> bool {
        let Some(&slot) = self.slots.get(node) else { return false };
        let key = key_of(conversation);
        match self.placements.get_mut(&key) {
            Some(p) if p.revision >= revision => return p.slot == slot,
            Some(p) => {
                if p.slot != slot {
                    if let Some(c) = self.counts.get_mut(&p.slot) {
                        *c = c.saturating_sub(1);
                    }
                    *self.counts.entry(slot).or_insert(0) += 1;
                    p.slot = slot;
                    p.moved_from = None;
                }
                p.revision = revision;
            }
            None => {
                self.placements.insert(key, Placement { slot, last_used: now, moved_from: None, revision });
                *self.counts.entry(slot).or_insert(0) += 1;
                self.total += 1;
            }
        }
        true
    }

    fn count(&self, slot: Slot) -> u64 {
        self.counts.get(&slot).copied().unwrap_or(0)
    }

    /// A ring slot derived from the node's name, so every coordinator replica puts a
    /// node at the same ring points; probes on the (rare) collision.
    fn slot_for(&self, node: &str) -> Slot {
        let mut s = mix64(hash_of(node)) as u32;
        while self.names.contains_key(&Slot(s)) {
            s = s.wrapping_add(1);
        }
        Slot(s)
    }

    /// Makes the ring's members exactly `nodes`. Conversations on a node that left are
    /// forgotten (their next turn is placed again); conversations whose home is a node
    /// that joined move to it. Returns true if membership changed.
    pub fn set_members<'a>(&mut self, nodes: impl IntoIterator<Item = &'a str>) -> bool {
        let want: HashSet<&str> = nodes.into_iter().collect();
        let gone: Vec<(String, Slot)> = self
            .slots
            .iter()
            .filter(|(n, _)| !want.contains(n.as_str()))
            .map(|(n, s)| (n.clone(), *s))
            .collect();
        for (name, slot) in &gone {
            self.ring.remove_node(*slot);
            self.slots.remove(name);
            self.names.remove(slot);
            self.total -= self.counts.remove(slot).unwrap_or(0);
        }
        if !gone.is_empty() {
            let left: HashSet<Slot> = gone.iter().map(|(_, s)| *s).collect();
            self.placements.retain(|_, p| !left.contains(&p.slot));
            for p in self.placements.values_mut() {
                if p.moved_from.is_some_and(|s| left.contains(&s)) {
                    p.moved_from = None;
                }
            }
        }
        let mut joined = HashSet::new();
        let mut names: Vec<&str> = want.into_iter().filter(|n| !self.slots.contains_key(*n)).collect();
        names.sort_unstable();
        for name in names {
            let slot = self.slot_for(name);
            self.ring.add_node(slot);
            self.slots.insert(name.to_string(), slot);
            self.names.insert(slot, name.to_string());
            joined.insert(slot);
        }
        if !joined.is_empty() {
            let ring = &self.ring;
            let counts = &mut self.counts;
            for (key, p) in self.placements.iter_mut() {
                if let Some(home) = ring.home(*key) {
                    if joined.contains(&home) && home != p.slot {
                        if let Some(c) = counts.get_mut(&p.slot) {
                            *c = c.saturating_sub(1);
                        }
                        *counts.entry(home).or_insert(0) += 1;
                        p.moved_from = Some(p.slot);
                        p.slot = home;
                    }
                }
            }
        }
        !gone.is_empty() || !joined.is_empty()
    }

    /// Forgets conversations idle for longer than `idle_ttl` at `now`.
    pub fn expire(&mut self, now: Instant) {
        let ttl = self.idle_ttl;
        let counts = &mut self.counts;
        let mut dropped = 0;
        self.placements.retain(|_, p| {
            let keep = now.saturating_duration_since(p.last_used) <= ttl;
            if !keep {
                if let Some(c) = counts.get_mut(&p.slot) {
                    *c = c.saturating_sub(1);
                }
                dropped += 1;
            }
            keep
        });
        self.total -= dropped;
    }

    /// Forgets one conversation (it was deleted).
    pub fn forget(&mut self, conversation: &ConversationId) {
        if let Some(p) = self.placements.remove(&key_of(conversation)) {
            if let Some(c) = self.counts.get_mut(&p.slot) {
                *c = c.saturating_sub(1);
            }
            self.total -= 1;
        }
    }

    /// Places a turn of `conversation`, avoiding the nodes in `exclude`. `None` when no
    /// eligible node is a member.
    pub fn route(&mut self, conversation: &ConversationId, exclude: &[&str], now: Instant) -> Option<DecodeDecision> {
        let key = key_of(conversation);
        let excluded: HashSet<Slot> = exclude.iter().filter_map(|n| self.slots.get(*n).copied()).collect();
        let bound = self.ring.bound(self.total);
        let candidates: Vec<DecodeCandidate> = self
            .ring
            .walk(key)
            .into_iter()
            .map(|s| DecodeCandidate {
                node: self.names[&s].clone(),
                load: self.count(s),
                eligible: !excluded.contains(&s),
            })
            .collect();
        if let Some(p) = self.placements.get_mut(&key) {
            if !excluded.contains(&p.slot) {
                p.last_used = now;
                let previous = p.moved_from.take().and_then(|s| self.names.get(&s).cloned());
                return Some(DecodeDecision {
                    node: self.names[&p.slot].clone(),
                    reason: DecodeReason::Sticky,
                    bound: self.ring.bound(self.total.saturating_sub(1)),
                    candidates,
                    previous,
                });
            }
            let old = p.slot;
            self.placements.remove(&key);
            if let Some(c) = self.counts.get_mut(&old) {
                *c = c.saturating_sub(1);
            }
            self.total -= 1;
        }
        let bound_now = self.ring.bound(self.total);
        let counts = &self.counts;
        let (slot, spilled) = self.ring.route_with(
            key,
            self.total,
            |s| counts.get(&s).copied().unwrap_or(0),
            |s| !excluded.contains(&s),
        )?;
        self.placements.insert(key, Placement { slot, last_used: now, moved_from: None, revision: 0 });
        *self.counts.entry(slot).or_insert(0) += 1;
        self.total += 1;
        let _ = bound;
        Some(DecodeDecision {
            node: self.names[&slot].clone(),
            reason: if spilled { DecodeReason::Spilled } else { DecodeReason::Home },
            bound: bound_now,
            candidates,
            previous: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn conv(id: &str) -> ConversationId {
        ConversationId::parse(id).expect("a valid test conversation")
    }

    fn router(nodes: &[&str]) -> DecodeRouter {
        let mut r = DecodeRouter::new(160, 1.25, Duration::from_secs(600)).unwrap();
        r.set_members(nodes.iter().copied());
        r
    }

    #[test]
    fn four_nodes_thousand_conversations_within_bound() {
        let mut r = router(&["d0", "d1", "d2", "d3"]);
        let now = Instant::now();
        for i in 0..1000 {
            r.route(&conv(&format!("conv-{i}")), &[], now).unwrap();
        }
        let mean = 1000.0 / 4.0;
        let max = ["d0", "d1", "d2", "d3"].iter().map(|n| r.load(n)).max().unwrap();
        assert_eq!(r.total(), 1000);
        assert!(max as f64 <= 1.25 * mean, "max {max} mean {mean}");
    }

    #[test]
    fn adding_a_fifth_node_moves_about_a_fifth_and_only_to_it() {
        let mut r = router(&["d0", "d1", "d2", "d3"]);
        let now = Instant::now();
        let keys: Vec<ConversationId> = (0..1000).map(|i| conv(&format!("conv-{i}"))).collect();
        let before: Vec<String> = keys.iter().map(|k| r.route(k, &[], now).unwrap().node).collect();
        assert!(r.set_members(["d0", "d1", "d2", "d3", "d4"]));
        let mut moved = 0;
        for (k, b) in keys.iter().zip(&before) {
            let d = r.route(k, &[], now).unwrap();
            assert_eq!(d.reason, DecodeReason::Sticky);
            if d.node != *b {
                assert_eq!(d.node, "d4");
                // The first turn after the move names where the warm prefix is.
                assert_eq!(d.previous.as_deref(), Some(b.as_str()));
                moved += 1;
            } else {
                assert_eq!(d.previous, None);
            }
            assert_eq!(r.route(k, &[], now).unwrap().previous, None, "reported once");
        }
        let share = moved as f64 / 1000.0;
        assert!((0.12..=0.28).contains(&share), "moved share {share}");
        let max = ["d0", "d1", "d2", "d3", "d4"].iter().map(|n| r.load(n)).max().unwrap();
        assert!(max as f64 <= 1.25 * 200.0 + 1.0, "max {max}");
    }

    #[test]
    fn same_conversation_same_node_and_a_leaving_node_takes_its_conversations_along() {
        let mut r = router(&["a", "b", "c"]);
        let now = Instant::now();
        let first = r.route(&conv("conv"), &[], now).unwrap();
        assert_ne!(first.reason, DecodeReason::Sticky);
        assert_eq!(r.route(&conv("conv"), &[], now).unwrap().node, first.node);
        assert_eq!(r.route(&conv("conv"), &[], now).unwrap().reason, DecodeReason::Sticky);
        let rest: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != first.node).collect();
        r.set_members(rest.iter().copied());
        assert_eq!(r.total(), 0);
        let again = r.route(&conv("conv"), &[], now).unwrap();
        assert!(rest.contains(&again.node.as_str()));
    }

    #[test]
    fn excluded_node_is_avoided_and_the_conversation_moves() {
        let mut r = router(&["a", "b"]);
        let now = Instant::now();
        let first = r.route(&conv("conv"), &[], now).unwrap().node;
        let d = r.route(&conv("conv"), &[first.as_str()], now).unwrap();
        assert_ne!(d.node, first);
        assert_eq!(d.reason, DecodeReason::Spilled);
        assert_eq!(r.total(), 1);
        assert!(r.route(&conv("conv"), &["a", "b"], now).is_none());
    }

    #[test]
    fn idle_conversations_stop_counting() {
        let mut r = DecodeRouter::new(16, 1.25, Duration::from_secs(60)).unwrap();
        r.set_members(["a"]);
        let t0 = Instant::now();
        r.route(&conv("x"), &[], t0).unwrap();
        r.route(&conv("y"), &[], t0 + Duration::from_secs(50)).unwrap();
        r.expire(t0 + Duration::from_secs(61));
        assert_eq!(r.total(), 1);
        assert_eq!(r.placement(&conv("x")), None);
        assert_eq!(r.placement(&conv("y")), Some("a"));
        r.forget(&conv("y"));
        assert_eq!(r.total(), 0);
    }

    /// Two replicas over the same members: the second follows what the first recorded
    /// (even a spill its own loads would not make), and only a later record moves it.
    #[test]
    fn a_replica_adopts_a_recorded_placement_and_only_a_later_one() {
        let mut first = router(&["a", "b", "c"]);
        let mut second = router(&["a", "b", "c"]);
        let now = Instant::now();
        let home = first.route(&conv("conv"), &[], now).unwrap().node;
        let spilled = first.route(&conv("conv"), &[home.as_str()], now).unwrap().node;
        assert_ne!(spilled, home);
        assert!(second.adopt(&conv("conv"), &spilled, 7, now));
        let d = second.route(&conv("conv"), &[], now).unwrap();
        assert_eq!((d.node.as_str(), d.reason), (spilled.as_str(), DecodeReason::Sticky));
        assert_eq!((second.total(), second.load(&spilled)), (1, 1));
        assert!(!second.adopt(&conv("conv"), &home, 5, now), "an older record is not followed");
        assert_eq!(second.placement(&conv("conv")), Some(spilled.as_str()));
        assert!(second.adopt(&conv("conv"), &home, 9, now));
        assert_eq!((second.placement(&conv("conv")), second.revision(&conv("conv"))), (Some(home.as_str()), 9));
        assert_eq!((second.total(), second.load(&spilled), second.load(&home)), (1, 0, 1));
        assert!(!second.adopt(&conv("other"), "gone", 10, now), "a non-member is not followed");
    }

    #[test]
    fn empty_router_routes_nowhere() {
        let mut r = router(&[]);
        assert!(r.route(&conv("k"), &[], Instant::now()).is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Whatever the sequence of turns, joins and leaves: loads add up, no node holds
        /// more than the bound allowed when its last conversation arrived, and every
        /// placement is on a member.
        #[test]
        fn loads_stay_consistent_and_bounded(
            ops in prop::collection::vec((0u8..10, 0u32..300), 1..400),
        ) {
            let names = ["n0", "n1", "n2", "n3", "n4", "n5"];
            let mut live: Vec<&str> = names[..3].to_vec();
            let mut r = router(&live);
            let now = Instant::now();
            for (op, x) in ops {
                match op {
                    0 => {
                        let n = names[x as usize % names.len()];
                        if live.contains(&n) { if live.len() > 1 { live.retain(|m| *m != n); } } else { live.push(n); }
                        r.set_members(live.iter().copied());
                    }
                    _ => {
                        let d = r.route(&conv(&format!("k{x}")), &[], now).unwrap();
                        prop_assert!(live.contains(&d.node.as_str()));
                        if d.reason != DecodeReason::Sticky {
                            prop_assert!(r.load(&d.node) <= d.bound, "load {} bound {}", r.load(&d.node), d.bound);
                        }
                    }
                }
                let sum: u64 = live.iter().map(|n| r.load(n)).sum();
                prop_assert_eq!(sum, r.total());
            }
        }
    }
}
