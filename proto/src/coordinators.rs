//! [`Coordinators`]: every coordinator replica a client knows, called with failover.
//!
//! Coordinator replicas are equal (active-active over one etcd membership), so any of
//! them may answer any call. A call goes first to the replica that answered last; when
//! that replica gives no answer (connection refused or reset, a deadline) or answers
//! UNAVAILABLE, the same call moves on to the next replica. A dead replica thus costs a
//! turn one failed attempt, never the turn. Whether *no* replica answered (as opposed to
//! one answering with an error) is what [`CallError::unanswered`] tells: the gateway routes
//! on its last known membership only then.

use std::error::Error as _;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::coordinator::coordinator_client::CoordinatorClient;
use crate::plane::{Expect, Plane, PlaneError, Role};

/// The coordinator replicas, each behind a lazily connected channel.
#[derive(Debug)]
pub struct Coordinators {
    replicas: Vec<(String, CoordinatorClient<Channel>)>,
    /// Index of the replica that answered last: the first one tried.
    preferred: AtomicUsize,
}

/// A call that no replica completed.
#[derive(Debug)]
pub struct CallError {
    /// The last replica's status.
    pub status: Status,
    /// True when no replica answered at all (every one unreachable or timed out): the
    /// coordinators are down, not refusing.
    pub unanswered: bool,
}

impl From<CallError> for Status {
    fn from(e: CallError) -> Status {
        e.status
    }
}

/// True when the status was made on this side of the connection (a transport failure or
/// a deadline), so the replica gave no answer; a status a server sent carries no source.
pub fn unanswered(status: &Status) -> bool {
    status.source().is_some() || status.code() == Code::DeadlineExceeded
}

impl Coordinators {
    /// One lazy channel per URL (`http://host:7100`), each server required to hold a
    /// coordinator identity. `request_timeout` bounds each call on one replica.
    pub fn connect_lazy(urls: &[String], plane: &Plane, connect_timeout: Duration, request_timeout: Option<Duration>) -> Result<Self, PlaneError> {
        let mut replicas = Vec::with_capacity(urls.len());
        for url in urls.iter().map(|u| u.trim()).filter(|u| !u.is_empty()) {
            let mut endpoint = plane.endpoint(url)?.connect_timeout(connect_timeout);
            if let Some(t) = request_timeout {
                endpoint = endpoint.timeout(t);
            }
            let channel = plane.connect_lazy(&endpoint, Expect::Role(Role::Coordinator))?;
            replicas.push((url.to_string(), CoordinatorClient::new(channel)));
        }
        Ok(Self { replicas, preferred: AtomicUsize::new(0) })
    }

    /// How many replicas are known.
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// True when no replica is known.
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// Every replica's URL and client, for calls that go to each (load reports).
    pub fn each(&self) -> impl Iterator<Item = (&str, CoordinatorClient<Channel>)> {
        self.replicas.iter().map(|(u, c)| (u.as_str(), c.clone()))
    }

    /// Runs `call` on the preferred replica, and on the next ones while a replica gives
    /// no answer or answers UNAVAILABLE. Any other answer (success or error) is final.
    pub async fn call<T, F, Fut>(&self, mut call: F) -> Result<T, CallError>
    where
        F: FnMut(CoordinatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let n = self.replicas.len();
        if n == 0 {
            return Err(CallError { status: Status::unavailable("no coordinator is configured"), unanswered: true });
        }
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut all_unanswered = true;
        let mut last = None;
        for i in (0..n).map(|k| (first + k) % n) {
            let (url, client) = &self.replicas[i];
            match call(client.clone()).await {
                Ok(r) => {
                    if i != first {
                        tracing::info!(coordinator = %url, "failed over to another coordinator");
                        self.preferred.store(i, Ordering::Relaxed);
                    }
                    return Ok(r.into_inner());
                }
                Err(status) => {
                    let silent = unanswered(&status);
                    if !silent && status.code() != Code::Unavailable {
                        return Err(CallError { status, unanswered: false });
                    }
                    tracing::debug!(coordinator = %url, code = ?status.code(), silent, "coordinator call failed; trying the next replica");
                    all_unanswered &= silent;
                    last = Some(status);
                }
            }
        }
        let status = last.unwrap_or_else(|| Status::unavailable("no coordinator answered"));
        Err(CallError { status, unanswered: all_unanswered })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::ListNodesRequest;

    fn dead_url() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", l.local_addr().expect("addr"));
        drop(l);
        url
    }

    #[tokio::test]
    async fn every_replica_down_is_unanswered() {
        let c = Coordinators::connect_lazy(&[dead_url(), dead_url()], &Plane::insecure_plaintext(), Duration::from_millis(500), None)
            .expect("lazy channels");
        assert_eq!(c.len(), 2);
        let e = c.call(|mut c| async move { c.list_nodes(ListNodesRequest { role: 0 }).await }).await.expect_err("nobody listens");
        assert!(e.unanswered, "{:?}", e.status);
        assert!(unanswered(&e.status));
    }

    #[tokio::test]
    async fn a_status_a_server_sent_is_an_answer() {
        assert!(!unanswered(&Status::unavailable("no decode node")));
        assert!(unanswered(&Status::deadline_exceeded("slow")));
        let empty = Coordinators::connect_lazy(&[" ".to_string()], &Plane::insecure_plaintext(), Duration::from_millis(100), None).expect("none");
        assert!(empty.is_empty());
    }
}
