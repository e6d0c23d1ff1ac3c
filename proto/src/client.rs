//! [`MembershipClient`]: how a node joins the cluster and stays in it.
//!
//! The node registers with the coordinator, renews its lease every third of the TTL with
//! its current load, and registers again on its own whenever the coordinator answers that
//! the lease is unknown (it expired, the coordinator restarted, or etcd lost it). A
//! coordinator that cannot be reached is retried with a capped backoff; the loop never
//! gives up until it is told to stop.
//!
//! With several coordinator replicas (active-active over etcd) the node registers through
//! whichever answers ([`Coordinators::call`]) and renews with *every* replica, so each
//! one holds the node's latest load report (loads are not kept in etcd) and the lease
//! lives on while any replica is up.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::coordinators::Coordinators;
use crate::plane::Plane;

use crate::common::{LoadReport, NodeInfo};
use crate::coordinator::{DeregisterRequest, KeepAliveRequest, KeepAliveStatus, RegisterRequest};

/// Where the membership loop stands, as seen by the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MembershipState {
    /// The lease currently held, if registered.
    pub lease_id: Option<u64>,
    /// How many times the node has registered (1 after the first join; more after
    /// re-registrations).
    pub registrations: u64,
}

/// Builds and starts a node's membership loop.
pub struct MembershipClient {
    coordinator_urls: Vec<String>,
    plane: Plane,
    node: NodeInfo,
    load: Arc<dyn Fn() -> LoadReport + Send + Sync>,
    max_backoff: Duration,
}

impl std::fmt::Debug for MembershipClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipClient")
            .field("coordinator_urls", &self.coordinator_urls)
            .field("node", &self.node)
            .finish()
    }
}

impl MembershipClient {
    /// `coordinator_url` like `http://127.0.0.1:7100`, reached over `plane` (the server
    /// must hold a coordinator identity); `node` is what gets registered (its `load`
    /// field is replaced by the load callback's answer on each renewal).
    pub fn new(coordinator_url: impl Into<String>, node: NodeInfo, plane: Plane) -> Self {
        Self::replicas(vec![coordinator_url.into()], node, plane)
    }

    /// As [`MembershipClient::new`], with every coordinator replica's URL.
    pub fn replicas(coordinator_urls: Vec<String>, node: NodeInfo, plane: Plane) -> Self {
        Self {
            coordinator_urls,
            plane,
            node,
            load: Arc::new(LoadReport::default),
            max_backoff: Duration::from_secs(2),
        }
    }

    /// Reports the node's current load at registration and on every keep-alive.
    pub fn with_load(mut self, load: impl Fn() -> LoadReport + Send + Sync + 'static) -> Self {
        self.load = Arc::new(load);
        self
    }

    /// The longest wait between attempts to reach the coordinator.
    pub fn with_max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// Starts the loop on the current tokio runtime.
    pub fn spawn(self) -> MembershipHandle {
        let (state_tx, state_rx) = watch::channel(MembershipState::default());
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(self.run(state_tx, stop_rx));
        MembershipHandle { state: state_rx, stop: stop_tx, task }
    }

    async fn run(self, state: watch::Sender<MembershipState>, mut stop: watch::Receiver<bool>) {
        let coordinators = match Coordinators::connect_lazy(&self.coordinator_urls, &self.plane, Duration::from_secs(2), Some(Duration::from_secs(5))) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, urls = ?self.coordinator_urls, "bad coordinator URL; this node cannot join");
                let _ = stop.wait_for(|s| *s).await;
                return;
            }
        };
        let mut backoff = Duration::from_millis(50);
        let mut lease: Option<(u64, Duration)> = None;
        loop {
            if *stop.borrow() {
                break;
            }
            let step = match lease {
                None => {
                    let mut node = self.node.clone();
                    node.load = Some((self.load)());
                    let node = Some(node);
                    let registered = coordinators
                        .call(|mut c| {
                            let node = node.clone();
                            async move { c.register(RegisterRequest { node }).await }
                        })
                        .await;
                    match registered {
                        Ok(r) => {
                            let ttl = Duration::from_millis(u64::from(r.ttl_ms.max(30)));
                            lease = Some((r.lease_id, ttl));
                            state.send_modify(|s| {
                                s.lease_id = Some(r.lease_id);
                                s.registrations += 1;
                            });
                            tracing::info!(
                                lease_id = r.lease_id,
                                ttl_ms = r.ttl_ms,
                                tombstones_evicted = r.tombstones_evicted,
                                "registered with the coordinator"
                            );
                            Ok(ttl / 3)
                        }
                        Err(e) => Err(e.status),
                    }
                }
                Some((id, ttl)) => {
                    let req = KeepAliveRequest { lease_id: id, node_id: self.node.node_id.clone(), load: Some((self.load)()) };
                    match keep_alive_everywhere(&coordinators, req).await {
                        Ok(true) => Ok(ttl / 3),
                        Ok(false) => {
                            tracing::warn!(lease_id = id, "lease unknown to the coordinator; registering again");
                            lease = None;
                            state.send_modify(|s| s.lease_id = None);
                            Ok(Duration::ZERO)
                        }
                        Err(e) => Err(e),
                    }
                }
            };
            match step {
                Ok(wait) => {
                    backoff = Duration::from_millis(50);
                    if sleep_or_stop(wait, &mut stop).await {
                        break;
                    }
                }
                Err(status) => {
                    tracing::debug!(code = ?status.code(), "coordinator call failed; retrying");
                    if sleep_or_stop(backoff, &mut stop).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.max_backoff);
                }
            }
        }
        // Leaving on purpose: tell the coordinator, best effort and bounded in time.
        if let Some((id, _)) = lease {
            let req = DeregisterRequest { lease_id: id, node_id: self.node.node_id.clone() };
            let leave = coordinators.call(|mut c| {
                let req = req.clone();
                async move { c.deregister(req).await }
            });
            let _ = tokio::time::timeout(Duration::from_secs(2), leave).await;
        }
        state.send_modify(|s| s.lease_id = None);
    }
}

/// Renews the lease with every replica at once (each keeps the load report). `Ok(true)`:
/// some replica renewed it; `Ok(false)`: none did and one said the lease is unknown
/// (register again); `Err`: no replica could be asked.
async fn keep_alive_everywhere(coordinators: &Coordinators, req: KeepAliveRequest) -> Result<bool, tonic::Status> {
    let mut calls = JoinSet::new();
    for (_, mut c) in coordinators.each() {
        let req = req.clone();
        calls.spawn(async move { c.keep_alive(req).await });
    }
    let (mut renewed, mut unknown, mut last_error) = (false, false, None);
    while let Some(joined) = calls.join_next().await {
        match joined {
            Ok(Ok(r)) if r.get_ref().status() == KeepAliveStatus::Ok => renewed = true,
            Ok(Ok(_)) => unknown = true,
            Ok(Err(status)) => last_error = Some(status),
            Err(e) => last_error = Some(tonic::Status::internal(format!("keep-alive task: {e}"))),
        }
    }
    match (renewed, unknown) {
        (true, _) => Ok(true),
        (false, true) => Ok(false),
        (false, false) => Err(last_error.unwrap_or_else(|| tonic::Status::unavailable("no coordinator is configured"))),
    }
}

/// Sleeps `d`; true if told to stop meanwhile.
async fn sleep_or_stop(d: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => *stop.borrow(),
        r = stop.changed() => r.is_err() || *stop.borrow(),
    }
}

/// A running membership loop.
#[derive(Debug)]
pub struct MembershipHandle {
    state: watch::Receiver<MembershipState>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl MembershipHandle {
    /// The loop's current state.
    pub fn state(&self) -> MembershipState {
        *self.state.borrow()
    }

    /// A receiver that sees every state change.
    pub fn watch(&self) -> watch::Receiver<MembershipState> {
        self.state.clone()
    }

    /// Waits until the node holds a lease and has registered at least `registrations`
    /// times; returns the lease.
    pub async fn wait_registered(&self, registrations: u64) -> u64 {
        let mut rx = self.state.clone();
        loop {
            let s = *rx.borrow_and_update();
            if let (Some(id), true) = (s.lease_id, s.registrations >= registrations) {
                return id;
            }
            if rx.changed().await.is_err() {
                // The loop ended; nothing more will change.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops the loop and deregisters (bounded by two seconds).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Stops renewing without deregistering, as if the node had died: the lease expires.
    pub fn abort(self) {
        self.task.abort();
    }
}
