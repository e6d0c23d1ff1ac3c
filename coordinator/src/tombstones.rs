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
//! Where tombstones live ([`Tombstones`]): with one replica (in-memory membership), in
//! its memory ([`MemoryTombstones`]); with etcd membership, in etcd ([`EtcdTombstones`]),
//! so a node that was away during a deletion through one replica and re-joins through
//! another evicts it too. The nodes that may owe evictions ([`Ledger`]) stay each
//! replica's own view: every replica watches the same membership.
//!
//! Ledger invariants: a node ID is in at most one of `known` (a member at the last look)
//! and `departed`; `joining` counts registrations in flight per node and returns to zero
//! on every path (see the service's `JoinTicket`). Plain data; time is an argument.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::error::Result;

/// Deleted conversations not yet evicted everywhere: routing key -> owner.
#[async_trait]
pub trait Tombstones: Send + Sync + 'static {
    /// Records a deletion of `key` (owned by `owner`), or refreshes it: it stays until
    /// [`Tombstones::clear`] (or, in etcd, until the departed window passes without a
    /// refresh).
    async fn put(&self, key: &str, owner: &str) -> Result<()>;
    /// The conversation was evicted everywhere.
    async fn clear(&self, key: &str) -> Result<()>;
    /// Every outstanding tombstone (routing key, owner), sorted by key.
    async fn outstanding(&self) -> Result<Vec<(String, String)>>;
    /// How many are outstanding (the whole cluster's, when shared).
    async fn count(&self) -> Result<usize>;
}

/// One replica's tombstones, in its memory (the embedded single-replica default).
#[derive(Debug, Default)]
pub struct MemoryTombstones {
    map: Mutex<BTreeMap<String, String>>,
}

impl MemoryTombstones {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl Tombstones for MemoryTombstones {
    async fn put(&self, key: &str, owner: &str) -> Result<()> {
        self.map().insert(key.to_string(), owner.to_string());
        Ok(())
    }

    async fn clear(&self, key: &str) -> Result<()> {
        self.map().remove(key);
        Ok(())
    }

    async fn outstanding(&self) -> Result<Vec<(String, String)>> {
        Ok(self.map().iter().map(|(k, o)| (k.clone(), o.clone())).collect())
    }

    async fn count(&self) -> Result<usize> {
        Ok(self.map().len())
    }
}

#[cfg(feature = "etcd")]
pub use etcd::EtcdTombstones;

#[cfg(feature = "etcd")]
mod etcd {
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    use async_trait::async_trait;
    use etcd_client::{Client, GetOptions, PutOptions};
    use serde::{Deserialize, Serialize};

    use super::Tombstones;
    use crate::error::{Error, Result};

    /// A tombstone's value; the key is `<prefix>tombstones/<routing key>`.
    #[derive(Debug, Serialize, Deserialize)]
    struct Record {
        /// The conversation's owner (its KV blocks are scoped by it).
        owner: String,
        /// When a replica last wrote it (for operators reading etcd).
        unix_ms: u64,
    }

    /// Tombstones shared by every coordinator replica, in etcd under
    /// `<prefix>tombstones/`. Each record lives on a lease of the departed window plus a
    /// little slack, and every eviction that still owes something rewrites it: a tombstone
    /// lasts at least the departed window after the last answer that owed it, which is as
    /// long as any node may still be pending for it, and then goes away on its own (a
    /// replica that died, a gateway that stopped retrying).
    pub struct EtcdTombstones {
        client: Client,
        dir: String,
        /// The lease TTL: the departed window plus `reuse`.
        ttl: Duration,
        /// How long one granted lease is used for new writes (one grant per this period,
        /// not per deletion); a record lives between `ttl - reuse` and `ttl`.
        reuse: Duration,
        lease: tokio::sync::Mutex<Option<(i64, Instant)>>,
    }

    impl std::fmt::Debug for EtcdTombstones {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("EtcdTombstones").field("dir", &self.dir).field("ttl", &self.ttl).finish()
        }
    }

    impl EtcdTombstones {
        /// Tombstones through the etcd `client` already connected for membership, kept for
        /// `window` (the departed window) after their last write.
        pub fn new(client: Client, prefix: &str, window: Duration) -> Self {
            let reuse = (window / 16).clamp(Duration::from_secs(1), Duration::from_secs(60));
            Self { client, dir: format!("{prefix}tombstones/"), ttl: window + reuse, reuse, lease: tokio::sync::Mutex::new(None) }
        }

        fn key(&self, key: &str) -> String {
            format!("{}{key}", self.dir)
        }

        /// The lease to write under; `fresh` drops the one held (etcd lost it).
        async fn lease(&self, fresh: bool) -> Result<i64> {
            let mut held = self.lease.lock().await;
            if let (Some((id, granted)), false) = (*held, fresh) {
                if granted.elapsed() < self.reuse {
                    return Ok(id);
                }
            }
            // Whole seconds, rounded up: never shorter than the window.
            let secs = self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0);
            let lease = self.client.clone().lease_grant(secs.max(1) as i64, None).await?;
            *held = Some((lease.id(), Instant::now()));
            Ok(lease.id())
        }
    }

    #[async_trait]
    impl Tombstones for EtcdTombstones {
        async fn put(&self, key: &str, owner: &str) -> Result<()> {
            let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            let value = serde_json::to_vec(&Record { owner: owner.to_string(), unix_ms }).expect("a record serializes");
            let k = self.key(key);
            // A held lease may be gone (etcd restarted empty): one retry on a fresh one.
            let lease = self.lease(false).await?;
            match self.client.clone().put(k.as_str(), value.clone(), Some(PutOptions::new().with_lease(lease))).await {
                Ok(_) => Ok(()),
                Err(e) => {
                    tracing::debug!(error = %e, "tombstone write failed; retrying on a new lease");
                    let lease = self.lease(true).await?;
                    self.client.clone().put(k, value, Some(PutOptions::new().with_lease(lease))).await?;
                    Ok(())
                }
            }
        }

        async fn clear(&self, key: &str) -> Result<()> {
            self.client.clone().delete(self.key(key), None).await?;
            Ok(())
        }

        /// A record that cannot be read fails the call: a joining node is refused rather
        /// than admitted owing an eviction nobody can name.
        async fn outstanding(&self) -> Result<Vec<(String, String)>> {
            let resp = self.client.clone().get(self.dir.as_str(), Some(GetOptions::new().with_prefix())).await?;
            let mut all = Vec::with_capacity(resp.kvs().len());
            for kv in resp.kvs() {
                let corrupt = || Error::CorruptRecord { key: String::from_utf8_lossy(kv.key()).into_owned() };
                let key = std::str::from_utf8(kv.key()).ok().and_then(|k| k.strip_prefix(self.dir.as_str())).filter(|k| !k.is_empty()).ok_or_else(corrupt)?;
                let record: Record = serde_json::from_slice(kv.value()).map_err(|_| corrupt())?;
                all.push((key.to_string(), record.owner));
            }
            all.sort();
            Ok(all)
        }

        async fn count(&self) -> Result<usize> {
            let resp = self.client.clone().get(self.dir.as_str(), Some(GetOptions::new().with_prefix().with_count_only())).await?;
            Ok(resp.count().max(0) as usize)
        }
    }
}

/// The nodes that may owe evictions, as one replica sees membership.
#[derive(Debug)]
pub struct Ledger {
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
        Self { known: BTreeSet::new(), departed: HashMap::new(), joining: HashMap::new(), window }
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
    /// The tombstones it must evict are read after this, so a deletion either happens
    /// before the read (and is evicted) or sees the node pending.
    pub fn begin_join(&mut self, node: &str) {
        *self.joining.entry(node.to_string()).or_insert(0) += 1;
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
        l.begin_join("b");
        assert_eq!(l.pending(&["a"], t0), vec!["b"], "joining (and departed): not asked, so pending");
        l.end_join("b", true);
        assert!(l.pending(&["a", "b"], t0).is_empty());
        assert!(l.pending(&["a"], t0).is_empty(), "a member is asked, never pending");
        // A refused registration leaves nothing behind.
        l.begin_join("c");
        l.end_join("c", false);
        assert!(l.pending(&["a", "b"], t0).is_empty());
    }

    #[tokio::test]
    async fn memory_tombstones_stay_until_cleared() {
        let t = MemoryTombstones::default();
        t.put("conv-2", "bob").await.unwrap();
        t.put("conv-1", "alice").await.unwrap();
        t.put("conv-1", "alice").await.unwrap();
        assert_eq!(t.count().await.unwrap(), 2);
        assert_eq!(t.outstanding().await.unwrap(), vec![("conv-1".into(), "alice".into()), ("conv-2".into(), "bob".into())]);
        t.clear("conv-1").await.unwrap();
        t.clear("conv-9").await.unwrap();
        assert_eq!(t.outstanding().await.unwrap(), vec![("conv-2".to_string(), "bob".to_string())]);
        assert_eq!(t.count().await.unwrap(), 1);
    }
}
