//! Custody of conversations: for whom the gateway last routed a conversation and which
//! decode nodes held it (its home now, and the one before a move), so that the
//! coordinator can vouch for an adoption (`VouchAdoption`) before one decode node pulls
//! a conversation's owner-scoped KV from another on that other's word.
//!
//! Why the coordinator answers yes/no rather than signing a voucher the draining node
//! carries: the adopting node must ask someone it trusts either way (a voucher needs a
//! signing key every decode node can verify, its rotation, and an expiry), while one
//! RPC to the coordinator that made the routing decision needs no new key material, and
//! the answer is about the custody at the moment of the pull.
//!
//! Only the gateway names owners (it authenticates users), so only a gateway's
//! `RouteDecode` creates a record or changes its owner; a draining decode node's
//! `RouteDecode` (which may exclude only itself) moves the conversation and so records
//! the drained node as the one before, but never names the owner.
//!
//! Bounded: at most [`CAPACITY`] records, the oldest forgotten first. A conversation
//! whose record was forgotten (or was never seen by this replica: records live in each
//! coordinator replica's memory, not in etcd) is not vouched for: the adoption is
//! refused and the conversation's next turn recomputes its prefix. A miss is never
//! taken as a yes.

use std::collections::{HashMap, VecDeque};

/// Conversations remembered, per coordinator replica (a record is an owner and two node
/// names: about 200 bytes, so some 20 MB at most).
pub const CAPACITY: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    owner: String,
    home: String,
    /// The node that held it before it moved to `home`.
    previous: Option<String>,
}

/// Custody records keyed by the routing key's hash (the coordinator keeps no IDs).
#[derive(Debug)]
pub struct Custody {
    cap: usize,
    map: HashMap<u64, Held>,
    /// Keys by first record, oldest first (a key appears once).
    order: VecDeque<u64>,
}

/// Why the coordinator does not vouch for an adoption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No record: never routed by the gateway through this replica, or forgotten.
    Unknown,
    /// The gateway last routed the conversation for another owner.
    Owner,
    /// The source neither is nor was the conversation's node.
    Source,
    /// The adopting node is not where the conversation is routed now.
    Adopter,
}

impl Refusal {
    pub fn why(self) -> &'static str {
        match self {
            Refusal::Unknown => "this coordinator has no record of the conversation (never routed here, or forgotten): its next turn recomputes",
            Refusal::Owner => "the gateway routed the conversation for another owner",
            Refusal::Source => "the source never held the conversation",
            Refusal::Adopter => "the conversation is not routed to the adopting node",
        }
    }
}

impl Custody {
    pub fn new(cap: usize) -> Self {
        Self { cap: cap.max(1), map: HashMap::new(), order: VecDeque::new() }
    }

    /// A routing decision placed conversation `key` on `node`; `owner` is the owner the
    /// gateway named (`None` when a decode node asked: it names no owner here).
    pub fn routed(&mut self, key: u64, owner: Option<&str>, node: &str) {
        match (self.map.get_mut(&key), owner) {
            // The gateway names another owner: what was held before was someone else's.
            (Some(h), Some(o)) if h.owner != o => *h = Held { owner: o.to_string(), home: node.to_string(), previous: None },
            (Some(h), _) => {
                if h.home != node {
                    h.previous = Some(std::mem::replace(&mut h.home, node.to_string()));
                }
            }
            (None, Some(o)) => {
                self.map.insert(key, Held { owner: o.to_string(), home: node.to_string(), previous: None });
                self.order.push_back(key);
                while self.order.len() > self.cap {
                    if let Some(old) = self.order.pop_front() {
                        self.map.remove(&old);
                    }
                }
            }
            (None, None) => {}
        }
    }

    /// Whether `adopter` may pull conversation `key`'s KV of `owner` from `source`.
    pub fn vouch(&self, key: u64, owner: &str, source: &str, adopter: &str) -> Result<(), Refusal> {
        let h = self.map.get(&key).ok_or(Refusal::Unknown)?;
        if h.owner != owner {
            return Err(Refusal::Owner);
        }
        if source == adopter || (h.home != source && h.previous.as_deref() != Some(source)) {
            return Err(Refusal::Source);
        }
        if h.home != adopter {
            return Err(Refusal::Adopter);
        }
        Ok(())
    }

    /// Forgets a deleted conversation. Its key stays in `order` until it comes round, so
    /// a later record of the same key may be forgotten early: a refusal, never a yes.
    pub fn forget(&mut self, key: u64) {
        self.map.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_vouches_for_the_drained_node_toward_the_new_home_only() {
        let mut c = Custody::new(8);
        c.routed(1, Some("alice"), "decode-0");
        // The drained node asks where the conversation goes (it names no owner).
        c.routed(1, None, "decode-1");
        assert_eq!(c.vouch(1, "alice", "decode-0", "decode-1"), Ok(()));
        assert_eq!(c.vouch(1, "mallory", "decode-0", "decode-1"), Err(Refusal::Owner));
        assert_eq!(c.vouch(1, "alice", "decode-2", "decode-1"), Err(Refusal::Source), "a node that never held it");
        assert_eq!(c.vouch(1, "alice", "decode-1", "decode-0"), Err(Refusal::Adopter), "back to where it was");
        assert_eq!(c.vouch(1, "alice", "decode-1", "decode-1"), Err(Refusal::Source), "from itself");
    }

    #[test]
    fn a_decode_node_never_names_an_owner_nor_creates_a_record() {
        let mut c = Custody::new(8);
        c.routed(2, None, "decode-1");
        c.routed(2, None, "decode-0");
        assert_eq!(c.vouch(2, "alice", "decode-1", "decode-0"), Err(Refusal::Unknown));
        // The gateway's new owner wipes the nodes that held it for the old one.
        c.routed(3, Some("alice"), "decode-1");
        c.routed(3, None, "decode-0");
        c.routed(3, Some("bob"), "decode-0");
        assert_eq!(c.vouch(3, "bob", "decode-1", "decode-0"), Err(Refusal::Source));
    }

    #[test]
    fn forgotten_records_are_refused_never_accepted() {
        let mut c = Custody::new(2);
        for k in 0..3 {
            c.routed(k, Some("alice"), "decode-0");
            c.routed(k, None, "decode-1");
        }
        assert_eq!(c.vouch(0, "alice", "decode-0", "decode-1"), Err(Refusal::Unknown), "the oldest was evicted");
        assert_eq!(c.vouch(2, "alice", "decode-0", "decode-1"), Ok(()));
        c.forget(2);
        assert_eq!(c.vouch(2, "alice", "decode-0", "decode-1"), Err(Refusal::Unknown), "deleted");
        assert!(c.map.len() <= 2 && c.order.len() <= 2);
    }
}
