//! In-memory membership: a lease table inside the coordinator.
//!
//! [`LeaseTable`] is the pure core (time is an argument); [`MemoryMembership`] wraps it
//! in a mutex and runs a reaper that expires leases every quarter TTL, so a node that
//! stops renewing leaves within 1.25 TTL even when nobody asks.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use baton_proto::common::NodeInfo;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{node_id_of, Lease, Member, Membership};
use crate::error::Result;

#[derive(Debug)]
struct Entry {
    info: NodeInfo,
    deadline: Instant,
}

/// Leases by ID with deadlines, and the node each one holds.
#[derive(Debug, Default)]
pub struct LeaseTable {
    leases: HashMap<u64, Entry>,
    by_node: BTreeMap<String, u64>,
}

impl LeaseTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `info` until `now + ttl`, replacing the node's previous lease. Lease IDs
    /// are random ([`super::new_lease_id`]): renewing or dropping a lease needs its ID,
    /// which only the node that registered it learnt.
    pub fn register(&mut self, info: NodeInfo, now: Instant, ttl: Duration) -> u64 {
        let id = loop {
            let id = super::new_lease_id();
            if !self.leases.contains_key(&id) {
                break id;
            }
        };
        let node = node_id_of(&info).to_string();
        if let Some(old) = self.by_node.insert(node, id) {
            self.leases.remove(&old);
        }
        self.leases.insert(id, Entry { info, deadline: now + ttl });
        id
    }

    /// Extends a live lease; false if unknown or already past its deadline.
    pub fn renew(&mut self, id: u64, now: Instant, ttl: Duration) -> bool {
        match self.leases.get_mut(&id) {
            Some(e) if e.deadline >= now => {
                e.deadline = now + ttl;
                true
            }
            _ => false,
        }
    }

    pub fn remove(&mut self, id: u64) -> bool {
        match self.leases.remove(&id) {
            Some(e) => {
                self.by_node.remove(node_id_of(&e.info));
                true
            }
            None => false,
        }
    }

    /// Drops every lease past its deadline; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let dead: Vec<u64> = self.leases.iter().filter(|(_, e)| e.deadline < now).map(|(id, _)| *id).collect();
        for id in &dead {
            self.remove(*id);
        }
        dead.len()
    }

    /// Live members sorted by node ID.
    pub fn members(&self) -> Vec<Member> {
        self.by_node
            .values()
            .filter_map(|id| self.leases.get(id).map(|e| Member { lease_id: *id, info: e.info.clone() }))
            .collect()
    }
}

/// The embedded membership: a [`LeaseTable`] behind a mutex, with a reaper task.
#[derive(Debug)]
pub struct MemoryMembership {
    table: Mutex<LeaseTable>,
    ttl: Duration,
    generation: watch::Sender<u64>,
}

impl MemoryMembership {
    /// Starts the membership (and its reaper) on the current tokio runtime.
    pub fn new(ttl: Duration) -> Arc<Self> {
        let (generation, _) = watch::channel(0);
        let me = Arc::new(Self { table: Mutex::new(LeaseTable::new()), ttl, generation });
        let weak: Weak<Self> = Arc::downgrade(&me);
        let period = (ttl / 4).max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { break };
                me.expire();
            }
        });
        me
    }

    fn table(&self) -> std::sync::MutexGuard<'_, LeaseTable> {
        // A panic while holding the lock cannot leave the table half-updated in a way
        // that matters more than losing membership; keep serving.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    fn expire(&self) {
        let n = self.table().expire(Instant::now());
        if n > 0 {
            tracing::info!(expired = n, "leases expired");
            self.bump();
        }
    }
}

#[async_trait]
impl Membership for MemoryMembership {
    async fn register(&self, info: NodeInfo) -> Result<Lease> {
        let id = self.table().register(info, Instant::now(), self.ttl);
        self.bump();
        Ok(Lease { id, ttl: self.ttl })
    }

    async fn keep_alive(&self, lease_id: u64) -> Result<bool> {
        self.expire();
        Ok(self.table().renew(lease_id, Instant::now(), self.ttl))
    }

    async fn deregister(&self, lease_id: u64) -> Result<bool> {
        let removed = self.table().remove(lease_id);
        if removed {
            self.bump();
        }
        Ok(removed)
    }

    async fn members(&self) -> Result<Vec<Member>> {
        self.expire();
        Ok(self.table().members())
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn backend(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_proto::common::NodeId;

    fn info(id: &str) -> NodeInfo {
        NodeInfo { node_id: Some(NodeId { id: id.into() }), ..Default::default() }
    }

    #[test]
    fn lease_table_expires_renews_and_replaces() {
        let mut t = LeaseTable::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(3);
        let a = t.register(info("a"), t0, ttl);
        let b = t.register(info("b"), t0, ttl);
        assert!(t.renew(a, t0 + Duration::from_secs(2), ttl));
        assert_eq!(t.expire(t0 + Duration::from_secs(4)), 1);
        assert_eq!(t.members().iter().map(|m| m.id().to_string()).collect::<Vec<_>>(), vec!["a"]);
        assert!(!t.renew(b, t0 + Duration::from_secs(4), ttl));
        let a2 = t.register(info("a"), t0, ttl);
        assert!(!t.renew(a, t0, ttl), "the replaced lease is gone");
        assert_eq!(t.members()[0].lease_id, a2);
        assert!(t.remove(a2));
        assert!(t.members().is_empty());
    }

    #[tokio::test]
    async fn conformance() {
        let m = MemoryMembership::new(Duration::from_millis(600));
        super::super::conformance::run(m).await;
    }
}
