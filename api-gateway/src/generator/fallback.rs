//! [`LastKnown`]: what the gateway still knows when no coordinator answers.
//!
//! The cluster generator refreshes the decode nodes in the background (`ListNodes`, not a
//! call per turn) and remembers, for each conversation it routed, the node the coordinator
//! chose. When every coordinator is down, a turn of a known conversation goes to that
//! node, a turn of an unknown one to the node that rendezvous hashing over the last known
//! decode nodes picks; either way the node prefills locally, since its `RoutePrefill` gets
//! no answer either. This lasts for a bounded window after the last coordinator answer:
//! past it the membership is too old to trust, and turns fail as unavailable.
//!
//! Pure and synchronous: time comes in as an argument, the caller owns the lock.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use baton_proto::common::NodeInfo;
use baton_proto::ids::node_name as node_id;

/// Why no node could be chosen without a coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoFallback {
    /// No coordinator ever answered, or the last answer is older than the window.
    Stale,
    /// Every last known decode node is excluded (failed this turn) or there are none.
    NoNode,
}

/// The last membership a coordinator reported, and the placements it answered.
#[derive(Debug)]
pub struct LastKnown {
    decode_nodes: Vec<NodeInfo>,
    /// When a coordinator last answered anything.
    heard: Option<Instant>,
    /// Conversation ID → decode node ID, as the coordinators placed them; bounded, the
    /// oldest remembered first forgotten.
    placed: HashMap<String, String>,
    order: VecDeque<String>,
    cap: usize,
}

/// A stable 64-bit hash (rendezvous scores must not change between processes): FNV-1a,
/// then a finalizer (murmur3's fmix64) so that names differing only in their last bytes
/// still differ in the high bits the scores are compared by.
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

impl LastKnown {
    /// Remembers up to `cap` conversations' placements.
    pub fn new(cap: usize) -> Self {
        Self { decode_nodes: Vec::new(), heard: None, placed: HashMap::new(), order: VecDeque::new(), cap: cap.max(1) }
    }

    /// A coordinator answered at `now`.
    pub fn heard(&mut self, now: Instant) {
        self.heard = Some(now);
    }

    /// How long ago a coordinator last answered (`None`: never).
    pub fn silent_for(&self, now: Instant) -> Option<Duration> {
        self.heard.map(|h| now.saturating_duration_since(h))
    }

    /// The decode nodes a coordinator listed at `now`.
    pub fn set_decode_nodes(&mut self, nodes: Vec<NodeInfo>, now: Instant) {
        self.decode_nodes = nodes;
        self.heard(now);
    }

    /// The coordinator placed `conversation` on `node`.
    pub fn placed(&mut self, conversation: &str, node: &str) {
        if self.placed.insert(conversation.to_string(), node.to_string()).is_none() {
            self.order.push_back(conversation.to_string());
            while self.order.len() > self.cap {
                if let Some(oldest) = self.order.pop_front() {
                    self.placed.remove(&oldest);
                }
            }
        }
    }

    /// The node for a turn of `conversation` without a coordinator: where it was placed,
    /// else the highest rendezvous score, never one in `exclude`; refused when the last
    /// coordinator answer is older than `window`.
    pub fn route(&self, conversation: &str, exclude: &[String], now: Instant, window: Duration) -> Result<NodeInfo, NoFallback> {
        if self.silent_for(now).is_none_or(|d| d > window) {
            return Err(NoFallback::Stale);
        }
        let usable = |n: &&NodeInfo| !exclude.iter().any(|e| e == node_id(n));
        if let Some(id) = self.placed.get(conversation) {
            if let Some(n) = self.decode_nodes.iter().filter(usable).find(|n| node_id(n) == id) {
                return Ok(n.clone());
            }
        }
        self.decode_nodes
            .iter()
            .filter(usable)
            .max_by_key(|n| fnv(&[conversation, node_id(n)]))
            .cloned()
            .ok_or(NoFallback::NoNode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_proto::common::NodeId;

    fn node(id: &str) -> NodeInfo {
        NodeInfo { node_id: Some(NodeId { id: id.into() }), grpc_addr: format!("{id}:1"), ..Default::default() }
    }

    #[test]
    fn a_known_conversation_keeps_its_node_within_the_window_only() {
        let t0 = Instant::now();
        let mut k = LastKnown::new(16);
        let window = Duration::from_secs(60);
        assert_eq!(k.route("c1", &[], t0, window), Err(NoFallback::Stale), "never heard a coordinator");
        k.set_decode_nodes(vec![node("d1"), node("d2"), node("d3")], t0);
        // Whatever rendezvous hashing would say, the coordinator's placement wins.
        let hashed = k.route("c1", &[], t0, window).unwrap();
        let other = ["d1", "d2", "d3"].into_iter().find(|n| *n != node_id(&hashed)).unwrap();
        k.placed("c1", other);
        assert_eq!(node_id(&k.route("c1", &[], t0 + Duration::from_secs(59), window).unwrap()), other);
        assert_eq!(k.route("c1", &[], t0 + Duration::from_secs(61), window), Err(NoFallback::Stale));
        // Its node failed this turn: another one, never an excluded one.
        let moved = k.route("c1", &[other.to_string()], t0, window).unwrap();
        assert_ne!(node_id(&moved), other);
        let all: Vec<String> = ["d1", "d2", "d3"].iter().map(|s| s.to_string()).collect();
        assert_eq!(k.route("c1", &all, t0, window), Err(NoFallback::NoNode));
    }

    #[test]
    fn unknown_conversations_spread_and_repeat() {
        let t0 = Instant::now();
        let mut k = LastKnown::new(2);
        k.set_decode_nodes(vec![node("d1"), node("d2"), node("d3")], t0);
        let w = Duration::from_secs(1);
        let mut seen = std::collections::HashSet::new();
        for i in 0..60 {
            let c = format!("conv-{i}");
            let first = k.route(&c, &[], t0, w).unwrap();
            assert_eq!(k.route(&c, &[], t0, w).unwrap(), first);
            seen.insert(node_id(&first).to_string());
        }
        assert_eq!(seen.len(), 3);
        // Bounded memory: the oldest placement is forgotten.
        k.placed("a", "d1");
        k.placed("b", "d1");
        k.placed("c", "d1");
        assert_eq!(k.placed.len(), 2);
        assert!(!k.placed.contains_key("a"));
    }
}
