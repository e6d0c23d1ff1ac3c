//! Placements shared by every coordinator replica: which decode node a conversation was
//! placed on, so that any replica answers the same node for it.
//!
//! Ring, load bound and membership are the same on every replica (they follow the same
//! etcd records), but a placement also depends on history: a conversation stays where it
//! was first placed (sticky), and the first placement may spill past an over-loaded home,
//! judged by the loads one replica has seen. So the decision is written down: each new
//! placement or move is *claimed* in the store with a compare-and-set on the record's
//! revision (the first replica to place a conversation wins; a loser adopts the winner's
//! node), and every replica mirrors the records, adopting a record newer than what it
//! knows before it routes. Records live under a lease of `conversation_idle_ttl`, renewed
//! by rewriting the record when it has expired, so a replica that dies leaves its records
//! behind for the others and an idle conversation's record goes away on its own.
//!
//! Keys are the routing key's hash (the coordinator keeps no conversation IDs); values
//! are the node ID. With in-memory membership there is one replica and no store.

use async_trait::async_trait;

use crate::error::Result;

/// A placement as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPlacement {
    pub node: String,
    /// The store's revision of the record: a larger one is a later decision.
    pub revision: i64,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Recorded at this revision.
    Won(i64),
    /// The record changed since it was read (another replica placed the conversation):
    /// what it holds now, if anything.
    Lost(Option<SharedPlacement>),
}

/// Where the replicas' placements meet.
#[async_trait]
pub trait SharedPlacements: Send + Sync + 'static {
    /// The mirrored record of a routing key's hash (no store round trip).
    fn get(&self, key: u64) -> Option<SharedPlacement>;
    /// Records `key → node` if the record is still at `expected` (0: absent).
    async fn claim(&self, key: u64, node: &str, expected: i64) -> Result<Claim>;
    /// Removes the record (the conversation was deleted).
    async fn forget(&self, key: u64) -> Result<()>;
}

#[cfg(feature = "etcd")]
pub use etcd::EtcdPlacements;

#[cfg(feature = "etcd")]
mod etcd {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, Weak};
    use std::time::{Duration, Instant};

    use async_trait::async_trait;
    use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};

    use super::{Claim, SharedPlacement, SharedPlacements};
    use crate::error::Result;

    /// Placements under `<prefix>placements/<hash as 16 hex digits>`.
    pub struct EtcdPlacements {
        client: Client,
        dir: String,
        idle_ttl: Duration,
        records: Mutex<HashMap<u64, SharedPlacement>>,
        /// The lease new records are written under, and when it was granted.
        lease: tokio::sync::Mutex<Option<(i64, Instant)>>,
    }

    impl std::fmt::Debug for EtcdPlacements {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("EtcdPlacements").field("dir", &self.dir).finish()
        }
    }

    fn parse_key(dir: &str, key: &[u8]) -> Option<u64> {
        let key = std::str::from_utf8(key).ok()?;
        u64::from_str_radix(key.strip_prefix(dir)?, 16).ok()
    }

    impl EtcdPlacements {
        /// Shares placements through the etcd `client` already connected for membership.
        pub async fn start(client: Client, prefix: &str, idle_ttl: Duration) -> Result<Arc<Self>> {
            let me = Arc::new(Self {
                client,
                dir: format!("{prefix}placements/"),
                idle_ttl: idle_ttl.max(Duration::from_secs(2)),
                records: Mutex::new(HashMap::new()),
                lease: tokio::sync::Mutex::new(None),
            });
            let revision = me.relist().await?;
            tokio::spawn(watch_records(Arc::downgrade(&me), revision));
            Ok(me)
        }

        fn records(&self) -> std::sync::MutexGuard<'_, HashMap<u64, SharedPlacement>> {
            self.records.lock().unwrap_or_else(|p| p.into_inner())
        }

        fn key(&self, key: u64) -> String {
            format!("{}{key:016x}", self.dir)
        }

        /// Keeps the later of two decisions about a key.
        fn learn(&self, key: u64, p: SharedPlacement) {
            let mut records = self.records();
            if records.get(&key).is_none_or(|old| old.revision < p.revision) {
                records.insert(key, p);
            }
        }

        /// Reads every record; returns the store revision the listing is at.
        async fn relist(&self) -> Result<i64> {
            let resp = self.client.clone().get(self.dir.as_str(), Some(GetOptions::new().with_prefix())).await?;
            let fresh = resp
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let node = String::from_utf8(kv.value().to_vec()).ok()?;
                    Some((parse_key(&self.dir, kv.key())?, SharedPlacement { node, revision: kv.mod_revision() }))
                })
                .collect();
            *self.records() = fresh;
            Ok(resp.header().map_or(0, |h| h.revision()))
        }

        /// The lease records are written under: one per replica, replaced once it is half
        /// spent, so a record lives between half and all of the idle TTL after its write.
        async fn lease(&self) -> Result<i64> {
            let mut held = self.lease.lock().await;
            if let Some((id, granted)) = *held {
                if granted.elapsed() < self.idle_ttl / 2 {
                    return Ok(id);
                }
            }
            let lease = self.client.clone().lease_grant(self.idle_ttl.as_secs().max(1) as i64, None).await?;
            *held = Some((lease.id(), Instant::now()));
            Ok(lease.id())
        }
    }

    /// Mirrors the records for as long as the store lives, re-listing after any break.
    async fn watch_records(weak: Weak<EtcdPlacements>, mut revision: i64) {
        let mut pause = Duration::from_millis(100);
        loop {
            let Some(me) = weak.upgrade() else { return };
            let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
            let watched = async {
                let mut stream = me.client.clone().watch(me.dir.as_str(), Some(opts)).await?;
                while let Some(resp) = stream.message().await? {
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let Some(key) = parse_key(&me.dir, kv.key()) else { continue };
                        match ev.event_type() {
                            EventType::Put => {
                                if let Ok(node) = String::from_utf8(kv.value().to_vec()) {
                                    me.learn(key, SharedPlacement { node, revision: kv.mod_revision() });
                                }
                            }
                            EventType::Delete => {
                                me.records().remove(&key);
                            }
                        }
                    }
                    if resp.canceled() {
                        break;
                    }
                }
                Ok::<_, etcd_client::Error>(())
            };
            if let Err(e) = watched.await {
                tracing::warn!(error = %e, "etcd placement watch broke; re-listing");
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
            match me.relist().await {
                Ok(r) => {
                    revision = r;
                    pause = Duration::from_millis(100);
                }
                Err(e) => tracing::warn!(error = %e, "cannot list placements in etcd"),
            }
        }
    }

    #[async_trait]
    impl SharedPlacements for EtcdPlacements {
        fn get(&self, key: u64) -> Option<SharedPlacement> {
            self.records().get(&key).cloned()
        }

        async fn claim(&self, key: u64, node: &str, expected: i64) -> Result<Claim> {
            let lease = self.lease().await?;
            let k = self.key(key);
            let unchanged = match expected {
                0 => Compare::create_revision(k.as_str(), CompareOp::Equal, 0),
                rev => Compare::mod_revision(k.as_str(), CompareOp::Equal, rev),
            };
            let txn = Txn::new()
                .when([unchanged])
                .and_then([TxnOp::put(k.as_str(), node, Some(PutOptions::new().with_lease(lease)))])
                .or_else([TxnOp::get(k.as_str(), None)]);
            let resp = self.client.clone().txn(txn).await?;
            let revision = resp.header().map_or(0, |h| h.revision());
            if resp.succeeded() {
                self.learn(key, SharedPlacement { node: node.to_string(), revision });
                return Ok(Claim::Won(revision));
            }
            let current = resp.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(g) => g.kvs().first().and_then(|kv| {
                    let node = String::from_utf8(kv.value().to_vec()).ok()?;
                    Some(SharedPlacement { node, revision: kv.mod_revision() })
                }),
                _ => None,
            });
            match &current {
                Some(p) => self.learn(key, p.clone()),
                None => {
                    self.records().remove(&key);
                }
            }
            Ok(Claim::Lost(current))
        }

        async fn forget(&self, key: u64) -> Result<()> {
            self.records().remove(&key);
            self.client.clone().delete(self.key(key), None).await?;
            Ok(())
        }
    }
}
