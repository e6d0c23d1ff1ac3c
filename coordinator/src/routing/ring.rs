//! Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018).
//!
//! Each node owns `vnodes` points on a 64-bit ring; a key's *home* is the owner of the
//! first point clockwise from the key's hash. With bounded loads, a node may hold at most
//! `ceil(c * (m + 1) / n)` units of load, where `m` is the load already placed, `n` the
//! number of nodes and `c >= 1` the load factor; a key whose home is full walks clockwise
//! to the first node under the bound. The bound sums to at least `m + 1` over the nodes,
//! so some node always has room.
//!
//! Invariants: `points` is sorted by `(hash, node)` and holds exactly `vnodes` points per
//! member; `route` and `home` only return members. The struct is pure and synchronous:
//! callers own the load counts ([`Loads`]) and update them as work starts and ends.
//!
//! The coordinator routes decode turns with it; `baton simulate` (crate `bench`) reuses
//! it so the simulator and the cluster place conversations identically.

use baton_vocab::ConversationId;

/// Why a ring could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RingError {
    #[error("vnodes must be at least 1")]
    NoVnodes,
    #[error("load factor {0} must be a finite number >= 1")]
    LoadFactor(f64),
}

impl RingError {
    /// A stable short label.
    pub fn label(&self) -> &'static str {
        match self {
            RingError::NoVnodes => "ring_vnodes",
            RingError::LoadFactor(_) => "ring_load_factor",
        }
    }
}

/// splitmix64's finalizer: a cheap, well-spread 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a string (FNV-1a, then mixed): the same on every process
/// and version, so every replica places a conversation, and a node, the same way.
pub fn hash_of(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// The ring key of a conversation (the wire's `routing_key`).
pub fn key_of(conversation: &ConversationId) -> u64 {
    hash_of(conversation.as_str())
}

/// A node's slot on the ring: a number the ring's user assigns to each member (the
/// decode router derives it from the node's name, the simulator counts), never the
/// node's name itself (that is a `baton_vocab::NodeId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot(pub u32);

/// Current load per node (any unit: in-flight turns, sequences, tokens), with the total
/// kept alongside so routing is O(walk) rather than O(nodes).
#[derive(Debug, Clone, Default)]
pub struct Loads {
    per_node: Vec<u64>,
    total: u64,
}

impl Loads {
    pub fn new() -> Self {
        Self::default()
    }

    /// Load of `node` (0 for a node never seen).
    #[inline]
    pub fn get(&self, node: Slot) -> u64 {
        self.per_node.get(node.0 as usize).copied().unwrap_or(0)
    }

    /// Sum of all loads.
    #[inline]
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Add one unit to `node`.
    #[inline]
    pub fn inc(&mut self, node: Slot) {
        self.add(node, 1);
    }

    /// Add `amount` units to `node`.
    pub fn add(&mut self, node: Slot, amount: u64) {
        let i = node.0 as usize;
        if i >= self.per_node.len() {
            self.per_node.resize(i + 1, 0);
        }
        self.per_node[i] += amount;
        self.total += amount;
    }

    /// Remove one unit from `node` (saturating: a node with no load stays at 0).
    #[inline]
    pub fn dec(&mut self, node: Slot) {
        if let Some(l) = self.per_node.get_mut(node.0 as usize) {
            if *l > 0 {
                *l -= 1;
                self.total -= 1;
            }
        }
    }

    /// Drop all of `node`'s load (it left the ring) and return what it had.
    pub fn clear(&mut self, node: Slot) -> u64 {
        match self.per_node.get_mut(node.0 as usize) {
            Some(l) => {
                let had = std::mem::take(l);
                self.total -= had;
                had
            }
            None => 0,
        }
    }
}

/// A consistent-hash ring with virtual nodes and a load bound.
#[derive(Debug, Clone)]
pub struct Ring {
    vnodes: u32,
    load_factor: f64,
    points: Vec<(u64, Slot)>,
    members: Vec<Slot>,
}

const KEY_SALT: u64 = 0x6261_746f_6e2d_6b65; // "baton-ke"

impl Ring {
    /// An empty ring with `vnodes` points per node and load factor `c` (>= 1).
    pub fn new(vnodes: u32, load_factor: f64) -> Result<Self, RingError> {
        if vnodes == 0 {
            return Err(RingError::NoVnodes);
        }
        if !(load_factor >= 1.0 && load_factor.is_finite()) {
            return Err(RingError::LoadFactor(load_factor));
        }
        Ok(Self {
            vnodes,
            load_factor,
            points: Vec::new(),
            members: Vec::new(),
        })
    }

    /// The members, sorted by id.
    pub fn nodes(&self) -> &[Slot] {
        &self.members
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn contains(&self, node: Slot) -> bool {
        self.members.binary_search(&node).is_ok()
    }

    pub fn load_factor(&self) -> f64 {
        self.load_factor
    }

    fn point_hash(node: Slot, replica: u32) -> u64 {
        mix64(mix64(node.0 as u64 ^ 0x5eed_0000_0000) ^ ((replica as u64) << 32 | 0x9e37))
    }

    /// Where a key lands on the ring.
    #[inline]
    pub fn key_hash(key: u64) -> u64 {
        mix64(key ^ KEY_SALT)
    }

    /// Add a node with its virtual points. Returns false if it was already a member.
    pub fn add_node(&mut self, node: Slot) -> bool {
        match self.members.binary_search(&node) {
            Ok(_) => false,
            Err(at) => {
                self.members.insert(at, node);
                self.points
                    .extend((0..self.vnodes).map(|r| (Self::point_hash(node, r), node)));
                self.points.sort_unstable();
                true
            }
        }
    }

    /// Remove a node and its points. Returns false if it was not a member.
    pub fn remove_node(&mut self, node: Slot) -> bool {
        match self.members.binary_search(&node) {
            Ok(at) => {
                self.members.remove(at);
                self.points.retain(|&(_, n)| n != node);
                true
            }
            Err(_) => false,
        }
    }

    #[inline]
    fn start(&self, key: u64) -> usize {
        let h = Self::key_hash(key);
        let i = self.points.partition_point(|&(p, _)| p < h);
        if i == self.points.len() {
            0
        } else {
            i
        }
    }

    /// The key's home node, ignoring load; `None` on an empty ring.
    #[inline]
    pub fn home(&self, key: u64) -> Option<Slot> {
        if self.points.is_empty() {
            return None;
        }
        Some(self.points[self.start(key)].1)
    }

    /// The most load one node may hold when `total_load` is already placed and one more
    /// unit arrives: `ceil(c * (total_load + 1) / n)`.
    pub fn bound(&self, total_load: u64) -> u64 {
        if self.members.is_empty() {
            return 0;
        }
        let b = self.load_factor * (total_load + 1) as f64 / self.members.len() as f64;
        // Guard against 1.25 * 4 / 4 evaluating to 1.2500000000000002 and rounding up.
        (b - 1e-9).ceil().max(1.0) as u64
    }

    /// The node a key should go to: its home if that is under the bound, else the first
    /// node clockwise that is. `None` only on an empty ring. `loads.total()` must count
    /// only members' load for the bound to hold.
    #[inline]
    pub fn route(&self, key: u64, loads: &Loads) -> Option<Slot> {
        self.route_spill(key, loads).map(|(node, _)| node)
    }

    /// Like [`Ring::route`], and also whether the key spilled off its home node.
    pub fn route_spill(&self, key: u64, loads: &Loads) -> Option<(Slot, bool)> {
        self.route_with(key, loads.total(), |n| loads.get(n), |_| true)
    }

    /// The general form of [`Ring::route_spill`]: loads come from `load_of` with
    /// `total` their sum over members, and only nodes for which `eligible` holds are
    /// chosen (an excluded home counts as a spill). `None` on an empty ring or when no
    /// member is eligible.
    pub fn route_with(
        &self,
        key: u64,
        total: u64,
        load_of: impl Fn(Slot) -> u64,
        eligible: impl Fn(Slot) -> bool,
    ) -> Option<(Slot, bool)> {
        if self.points.is_empty() {
            return None;
        }
        let bound = self.bound(total);
        let start = self.start(key);
        let home = self.points[start].1;
        if eligible(home) && load_of(home) < bound {
            return Some((home, false));
        }
        let n = self.points.len();
        let mut i = start;
        let mut first_eligible = None;
        for _ in 1..n {
            i += 1;
            if i == n {
                i = 0;
            }
            let node = self.points[i].1;
            if !eligible(node) {
                continue;
            }
            if load_of(node) < bound {
                return Some((node, true));
            }
            first_eligible.get_or_insert(node);
        }
        // Unreachable when loads only count members; fall back rather than fail.
        if eligible(home) {
            Some((home, false))
        } else {
            first_eligible.map(|n| (n, true))
        }
    }

    /// Distinct members in ring order starting at the key's home: the order in which a
    /// key would spill.
    pub fn walk(&self, key: u64) -> Vec<Slot> {
        let mut out = Vec::with_capacity(self.members.len());
        if self.points.is_empty() {
            return out;
        }
        let start = self.start(key);
        let n = self.points.len();
        for j in 0..n {
            let node = self.points[(start + j) % n].1;
            if !out.contains(&node) {
                out.push(node);
                if out.len() == self.members.len() {
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn ring_of(nodes: &[u32], vnodes: u32) -> Ring {
        let mut r = Ring::new(vnodes, 1.25).unwrap();
        for &n in nodes {
            assert!(r.add_node(Slot(n)));
        }
        r
    }

    #[test]
    fn empty_ring_routes_nowhere_and_bad_params_are_rejected() {
        let r = Ring::new(8, 1.25).unwrap();
        assert_eq!(r.home(1), None);
        assert_eq!(r.route(1, &Loads::new()), None);
        assert!(Ring::new(0, 1.25).is_err());
        assert!(Ring::new(8, 0.9).is_err());
        assert!(Ring::new(8, f64::NAN).is_err());
    }

    #[test]
    fn add_and_remove_are_idempotent_and_keep_vnode_count() {
        let mut r = ring_of(&[1, 2, 3], 16);
        assert!(!r.add_node(Slot(2)));
        assert_eq!(r.points.len(), 48);
        assert!(r.remove_node(Slot(2)));
        assert!(!r.remove_node(Slot(2)));
        assert_eq!(r.points.len(), 32);
        assert!(r.points.iter().all(|&(_, n)| n != Slot(2)));
        assert_eq!(r.nodes(), &[Slot(1), Slot(3)]);
    }

    #[test]
    fn full_home_spills_clockwise_to_a_node_under_the_bound() {
        let r = ring_of(&[0, 1, 2, 3], 64);
        let key = 42;
        let home = r.home(key).unwrap();
        let mut loads = Loads::new();
        // Home holds 10 of 10 units: bound for the 11th is ceil(1.25 * 11 / 4) = 4.
        loads.add(home, 10);
        let routed = r.route(key, &loads).unwrap();
        assert_ne!(routed, home);
        assert!(loads.get(routed) < r.bound(loads.total()));
    }

    #[test]
    fn loads_bookkeeping() {
        let mut l = Loads::new();
        l.inc(Slot(3));
        l.add(Slot(1), 5);
        l.dec(Slot(3));
        l.dec(Slot(3)); // saturates
        assert_eq!(l.total(), 5);
        assert_eq!(l.clear(Slot(1)), 5);
        assert_eq!(l.total(), 0);
        assert_eq!(l.get(Slot(99)), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Same key, same node, as long as every node is under the bound.
        #[test]
        fn same_key_same_node_when_under_bound(
            nodes in prop::collection::btree_set(0u32..1000, 1..12),
            keys in prop::collection::vec(any::<u64>(), 1..64),
            base in 0u64..4,
        ) {
            let nodes: Vec<u32> = nodes.into_iter().collect();
            let r = ring_of(&nodes, 32);
            let mut loads = Loads::new();
            for &n in &nodes {
                loads.add(Slot(n), base); // equal loads: all under ceil(1.25 (m+1)/n)
            }
            for &k in &keys {
                let a = r.route(k, &loads).unwrap();
                prop_assert_eq!(Some(a), r.home(k));
                prop_assert_eq!(r.route(k, &loads), Some(a));
            }
        }

        /// 4 nodes, 1,000 keys placed one by one: no node exceeds 1.25x the mean (rounded
        /// up to a whole key, since loads are integers).
        #[test]
        fn four_nodes_thousand_keys_max_load_within_bound(
            seed in any::<u64>(),
            ids in prop::collection::btree_set(0u32..10_000, 4..=4),
        ) {
            let ids: Vec<u32> = ids.into_iter().collect();
            let r = ring_of(&ids, 16);
            let mut loads = Loads::new();
            for i in 0..1000u64 {
                let n = r.route(mix64(seed ^ i), &loads).unwrap();
                prop_assert!(r.contains(n));
                loads.inc(n);
            }
            let mean: f64 = 1000.0 / 4.0;
            let max = ids.iter().map(|&n| loads.get(Slot(n))).max().unwrap();
            prop_assert_eq!(loads.total(), 1000);
            prop_assert!(max as f64 <= (1.25 * mean).ceil(), "max {} mean {}", max, mean);
        }

        /// Adding a fifth node moves about a fifth of the keys (0.2 +- 5 standard deviations
        /// of vnode placement and key sampling), and only to the new node.
        #[test]
        fn adding_fifth_node_moves_about_a_fifth(
            seed in any::<u64>(),
            ids in prop::collection::btree_set(0u32..10_000, 5..=5),
        ) {
            let ids: Vec<u32> = ids.into_iter().collect();
            let mut r = ring_of(&ids[..4], 160);
            let keys: Vec<u64> = (0..1000u64).map(|i| mix64(seed.wrapping_add(i))).collect();
            let before: Vec<Slot> = keys.iter().map(|&k| r.home(k).unwrap()).collect();
            r.add_node(Slot(ids[4]));
            let mut moved = 0;
            for (k, b) in keys.iter().zip(&before) {
                let a = r.home(*k).unwrap();
                if a != *b {
                    prop_assert_eq!(a, Slot(ids[4]));
                    moved += 1;
                }
            }
            let share = moved as f64 / keys.len() as f64;
            prop_assert!((0.10..=0.30).contains(&share), "moved share {}", share);
        }

        /// Removing a node moves exactly its keys, and every node stays a member.
        #[test]
        fn removing_a_node_moves_only_its_keys(
            ids in prop::collection::btree_set(0u32..10_000, 2..8),
            victim_ix in any::<prop::sample::Index>(),
        ) {
            let ids: Vec<u32> = ids.into_iter().collect();
            let mut r = ring_of(&ids, 64);
            let victim = Slot(ids[victim_ix.index(ids.len())]);
            let before: Vec<Slot> = (0..500u64).map(|k| r.home(k).unwrap()).collect();
            r.remove_node(victim);
            let members: BTreeSet<Slot> = r.nodes().iter().copied().collect();
            for (k, b) in before.iter().enumerate() {
                let a = r.home(k as u64).unwrap();
                prop_assert!(members.contains(&a));
                if *b != victim {
                    prop_assert_eq!(a, *b);
                }
            }
        }
    }
}
