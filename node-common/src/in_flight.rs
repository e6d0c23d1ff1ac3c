//! What every node's drain does first: stop taking work, leave the
//! coordinator's ring, and wait for the requests it is serving (a decode
//! node's streaming turns, a prefill node's prefills including the KV they
//! are still shipping after the engine is done).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_proto::client::MembershipHandle;
use tokio::sync::{watch, Mutex};

/// Refuses new work from now on (`draining`), reports not ready, and leaves
/// the coordinator's ring; returns whether this call deregistered the node
/// (only the first drain does).
pub async fn stop_taking_work(draining: &AtomicBool, ready: &AtomicBool, membership: &Mutex<Option<MembershipHandle>>) -> bool {
    draining.store(true, Ordering::SeqCst);
    ready.store(false, Ordering::SeqCst);
    match membership.lock().await.take() {
        Some(m) => {
            m.shutdown().await;
            true
        }
        None => false,
    }
}

/// Counts the requests a node is serving, so a drain can wait for them.
#[derive(Clone)]
pub struct InFlight {
    tx: Arc<watch::Sender<usize>>,
}

/// Held while one request is served; dropping it ends its count.
pub struct InFlightGuard {
    tx: Arc<watch::Sender<usize>>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight { tx: Arc::new(watch::channel(0).0) }
    }
}

impl InFlight {
    pub fn enter(&self) -> InFlightGuard {
        self.tx.send_modify(|n| *n += 1);
        InFlightGuard { tx: self.tx.clone() }
    }

    /// Waits until no request is served, or `within` passed; returns how many still are.
    pub async fn wait_idle(&self, within: Duration) -> usize {
        let mut rx = self.tx.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|n| *n == 0)).await;
        *self.tx.borrow()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.tx.send_modify(|n| *n = n.saturating_sub(1));
    }
}
