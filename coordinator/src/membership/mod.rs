//! Membership: which nodes are in the cluster, each held by a lease with a TTL.
//!
//! One trait, two implementations: [`MemoryMembership`] (inside the coordinator, the
//! embedded default) and [`EtcdMembership`] (leases and keys in a real etcd, so several
//! coordinators share one view). A lease not renewed within its TTL expires and its node
//! leaves; renewing an unknown lease answers `false`, which tells the node to register
//! again. Every change bumps a generation number that [`Membership::subscribe`] exposes.

pub mod binding;
#[cfg(feature = "etcd")]
mod etcd;
mod memory;
/// The conformance suite every implementation must pass (used by this crate's tests and
/// the root `tests/etcd_*.rs`); it panics on a violation.
#[doc(hidden)]
pub mod conformance;

use std::time::Duration;

use async_trait::async_trait;
use baton_proto::common::NodeInfo;
use tokio::sync::watch;

#[cfg(feature = "etcd")]
pub use etcd::EtcdMembership;
pub use memory::MemoryMembership;

use crate::error::Result;

/// A lease as the node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub ttl: Duration,
}

/// A registered node with the lease that holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub lease_id: u64,
    pub info: NodeInfo,
}

impl Member {
    /// The node's ID string.
    pub fn id(&self) -> &str {
        node_id_of(&self.info)
    }
}

/// A fresh lease ID: 63 random bits from a CSPRNG (positive as etcd's signed IDs, never
/// 0). A lease ID is what renews and drops a lease, so it must not be guessable by other
/// holders of a pool certificate.
pub fn new_lease_id() -> u64 {
    loop {
        let id = rand::random::<u64>() >> 1;
        if id != 0 {
            return id;
        }
    }
}

/// The node ID inside a `NodeInfo`, empty if missing.
pub use baton_proto::ids::node_name as node_id_of;

#[async_trait]
pub trait Membership: Send + Sync + 'static {
    /// Adds (or replaces: same node ID) a node under a fresh lease.
    async fn register(&self, info: NodeInfo) -> Result<Lease>;
    /// Renews a lease; `Ok(false)` if it is unknown (expired, revoked, store reset).
    async fn keep_alive(&self, lease_id: u64) -> Result<bool>;
    /// Removes the lease's node now; `Ok(false)` if the lease was unknown.
    async fn deregister(&self, lease_id: u64) -> Result<bool>;
    /// The live members, sorted by node ID.
    async fn members(&self) -> Result<Vec<Member>>;
    /// A generation number bumped on every membership change.
    fn subscribe(&self) -> watch::Receiver<u64>;
    /// The TTL given to new leases.
    fn ttl(&self) -> Duration;
    /// Short name for logs and metrics.
    fn backend(&self) -> &'static str;
}
