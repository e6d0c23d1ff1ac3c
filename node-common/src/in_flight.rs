//! What every node's drain does first: stop taking work, leave the
//! coordinator's ring, and wait for the requests it is serving (a decode
//! node's streaming turns, a prefill node's prefills including the KV they
//! are still shipping after the engine is done).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use baton_proto::client::MembershipHandle;
use bytes::Bytes;
use tokio::sync::{watch, Mutex};
use tonic::codegen::{http, BoxFuture, Service};
use tonic::server::NamedService;

/// After the last request ended: time for its final frames to leave the
/// connection's HTTP/2 buffer for the socket (the connection task flushes
/// them on its next turn), so a kill right after the drain cannot cut them off.
const FLUSH_GRACE: Duration = Duration::from_millis(100);

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
        let idle = matches!(tokio::time::timeout(within, rx.wait_for(|n| *n == 0)).await, Ok(Ok(_)));
        if idle {
            tokio::time::sleep(FLUSH_GRACE).await;
        }
        *self.tx.borrow()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.tx.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Wraps a gRPC service so that each call stays in flight until hyper has
/// taken the last frame of its response and dropped the body, not merely
/// until the handler returned: a unary handler returns before its reply is
/// written, and a drain that reported idle in that gap let a preStop kill cut
/// the reply off.
#[derive(Clone)]
pub struct CountedService<S> {
    inner: S,
    in_flight: InFlight,
}

impl<S> CountedService<S> {
    pub fn new(inner: S, in_flight: InFlight) -> Self {
        CountedService { inner, in_flight }
    }
}

impl<S> Service<http::Request<tonic::body::Body>> for CountedService<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        // Counted before the handler runs, so a drain that starts now waits for it.
        let guard = self.in_flight.enter();
        let reply = self.inner.call(request);
        Box::pin(async move {
            let response = reply.await?;
            Ok(response.map(|body| tonic::body::Body::new(GuardedBody { body, _guard: guard })))
        })
    }
}

impl<S: NamedService> NamedService for CountedService<S> {
    const NAME: &'static str = S::NAME;
}

/// A response body that ends its call's in-flight count when dropped.
struct GuardedBody {
    body: tonic::body::Body,
    _guard: InFlightGuard,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A handler that answers at once with a fixed body, as a unary gRPC handler does.
    #[derive(Clone)]
    struct Answer;

    impl Service<http::Request<tonic::body::Body>> for Answer {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _request: http::Request<tonic::body::Body>) -> Self::Future {
            let body = http_body_util::Full::new(Bytes::from_static(b"the reply"));
            Box::pin(async move { Ok(http::Response::new(tonic::body::Body::new(body))) })
        }
    }

    fn count(in_flight: &InFlight) -> usize {
        *in_flight.tx.borrow()
    }

    #[tokio::test]
    async fn a_call_stays_in_flight_until_its_reply_body_is_dropped() {
        let in_flight = InFlight::default();
        let mut svc = CountedService::new(Answer, in_flight.clone());
        let reply = svc.call(http::Request::new(tonic::body::Body::empty()));
        assert_eq!(count(&in_flight), 1, "counted from the call, before the handler runs");
        let response = reply.await.unwrap();
        assert_eq!(count(&in_flight), 1, "the handler returned but nothing was written yet");
        let mut body = response.into_body();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from_static(b"the reply"));
        assert!(body.frame().await.is_none());
        assert_eq!(count(&in_flight), 1, "the server still holds the body");
        drop(body);
        assert_eq!(count(&in_flight), 0);
    }

    #[tokio::test]
    async fn wait_idle_waits_for_the_last_reply_and_reports_what_is_left() {
        let in_flight = InFlight::default();
        let mut svc = CountedService::new(Answer, in_flight.clone());
        let body = svc.call(http::Request::new(tonic::body::Body::empty())).await.unwrap().into_body();
        assert_eq!(in_flight.wait_idle(Duration::from_millis(20)).await, 1, "the reply is still held");
        let releaser = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(body);
        });
        let started = std::time::Instant::now();
        assert_eq!(in_flight.wait_idle(Duration::from_secs(10)).await, 0);
        assert!(started.elapsed() >= Duration::from_millis(50) + FLUSH_GRACE, "idle only after the reply and the flush grace");
        releaser.await.unwrap();
    }
}
