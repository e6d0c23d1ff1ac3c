//! Membership in etcd: one etcd lease per node, the node's record under
//! `<prefix>nodes/<node id>` attached to it, so etcd deletes the record when the lease
//! expires. A watcher task mirrors the records into memory (re-listing after any break,
//! such as an etcd restart), so routing never waits on etcd.
//!
//! Renewal is a one-shot keep-alive on the lease; etcd answers TTL 0 for a lease it does
//! not know (expired, or lost with its data), which the node hears as "register again".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use baton_proto::common::NodeInfo;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, LeaseGrantOptions, PutOptions, WatchOptions};
use prost::Message;
use tokio::sync::watch;

use super::{node_id_of, Lease, Member, Membership};
use crate::error::{Error, Result};

/// Membership stored in etcd.
pub struct EtcdMembership {
    client: Client,
    prefix: String,
    ttl: Duration,
    cache: Mutex<BTreeMap<String, Member>>,
    generation: watch::Sender<u64>,
}

impl std::fmt::Debug for EtcdMembership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdMembership").field("prefix", &self.prefix).field("ttl", &self.ttl).finish()
    }
}

impl EtcdMembership {
    /// Connects to `endpoints` (like `http://127.0.0.1:2379`) and starts mirroring the
    /// records under `prefix`. The TTL is rounded up to whole seconds (etcd's unit).
    pub async fn connect(endpoints: &[String], prefix: &str, ttl: Duration) -> Result<Arc<Self>> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        let client = Client::connect(endpoints, Some(opts)).await?;
        let secs = ttl.as_secs_f64().ceil().max(1.0) as u64;
        let (generation, _) = watch::channel(0);
        let me = Arc::new(Self {
            client,
            prefix: prefix.to_string(),
            ttl: Duration::from_secs(secs),
            cache: Mutex::new(BTreeMap::new()),
            generation,
        });
        // First listing before returning, so members() is right from the start.
        me.resync().await?;
        tokio::spawn(mirror(Arc::downgrade(&me)));
        Ok(me)
    }

    /// The etcd client, shared with the placements every replica follows.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    fn nodes_prefix(&self) -> String {
        format!("{}nodes/", self.prefix)
    }

    fn key(&self, node: &str) -> String {
        format!("{}{node}", self.nodes_prefix())
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Member>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    fn decode(&self, key: &[u8], value: &[u8], lease: i64) -> Option<(String, Member)> {
        let key = String::from_utf8_lossy(key).into_owned();
        match NodeInfo::decode(value) {
            Ok(info) => Some((node_id_of(&info).to_string(), Member { lease_id: lease as u64, info })),
            Err(_) => {
                tracing::warn!(error = %Error::CorruptRecord { key }, "skipping a node record");
                None
            }
        }
    }

    /// Replaces the cache with a fresh listing; returns the store revision.
    async fn resync(&self) -> Result<i64> {
        let resp = self.client.clone().get(self.nodes_prefix(), Some(GetOptions::new().with_prefix())).await?;
        let fresh: BTreeMap<String, Member> =
            resp.kvs().iter().filter_map(|kv| self.decode(kv.key(), kv.value(), kv.lease())).collect();
        let changed = {
            let mut cache = self.cache();
            let changed = *cache != fresh;
            *cache = fresh;
            changed
        };
        if changed {
            self.bump();
        }
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// Applies watch events until the stream breaks.
    async fn follow(&self, from_revision: i64) -> Result<()> {
        let opts = WatchOptions::new().with_prefix().with_start_revision(from_revision + 1);
        let mut stream = self.client.clone().watch(self.nodes_prefix(), Some(opts)).await?;
        while let Some(resp) = stream.message().await? {
            if resp.canceled() {
                return Ok(());
            }
            let mut changed = false;
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                match ev.event_type() {
                    EventType::Put => {
                        if let Some((id, m)) = self.decode(kv.key(), kv.value(), kv.lease()) {
                            self.cache().insert(id, m);
                            changed = true;
                        }
                    }
                    EventType::Delete => {
                        let key = String::from_utf8_lossy(kv.key());
                        if let Some(id) = key.strip_prefix(&self.nodes_prefix()) {
                            changed |= self.cache().remove(id).is_some();
                        }
                    }
                }
            }
            if changed {
                self.bump();
            }
        }
        Ok(())
    }
}

/// Mirrors etcd into the cache for as long as the membership lives.
async fn mirror(weak: Weak<EtcdMembership>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(me) = weak.upgrade() else { return };
        let result = match me.resync().await {
            Ok(rev) => {
                backoff = Duration::from_millis(100);
                me.follow(rev).await
            }
            Err(e) => Err(e),
        };
        drop(me);
        if let Err(e) = result {
            tracing::warn!(error = %e, "etcd watch broke; re-listing");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[async_trait]
impl Membership for EtcdMembership {
    async fn register(&self, info: NodeInfo) -> Result<Lease> {
        let node = node_id_of(&info).to_string();
        let mut c = self.client.clone();
        let old = c.get(self.key(&node), None).await?.kvs().first().map(|kv| kv.lease());
        // A random ID (etcd's own are predictable): see `super::new_lease_id`.
        let opts = LeaseGrantOptions::new().with_id(super::new_lease_id() as i64);
        let lease = c.lease_grant(self.ttl.as_secs() as i64, Some(opts)).await?;
        c.put(self.key(&node), info.encode_to_vec(), Some(PutOptions::new().with_lease(lease.id()))).await?;
        if let Some(old) = old.filter(|&o| o != 0 && o != lease.id()) {
            // The node's previous lease holds nothing now; drop it (it may be gone).
            let _ = c.lease_revoke(old).await;
        }
        self.cache().insert(node, Member { lease_id: lease.id() as u64, info });
        self.bump();
        Ok(Lease { id: lease.id() as u64, ttl: Duration::from_secs(lease.ttl().max(1) as u64) })
    }

    async fn keep_alive(&self, lease_id: u64) -> Result<bool> {
        let renew = async {
            let (mut keeper, mut stream) = self.client.clone().lease_keep_alive(lease_id as i64).await?;
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.is_some_and(|r| r.ttl() > 0))
        };
        match renew.await {
            Ok(alive) => Ok(alive),
            // etcd-client reports a lease etcd does not know as an error; to the node it
            // means "register again", not "the store is down".
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn deregister(&self, lease_id: u64) -> Result<bool> {
        match self.client.clone().lease_revoke(lease_id as i64).await {
            Ok(_) => {
                let removed = {
                    let mut cache = self.cache();
                    let before = cache.len();
                    cache.retain(|_, m| m.lease_id != lease_id);
                    cache.len() != before
                };
                if removed {
                    self.bump();
                }
                Ok(true)
            }
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn members(&self) -> Result<Vec<Member>> {
        Ok(self.cache().values().cloned().collect())
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn backend(&self) -> &'static str {
        "etcd"
    }
}
