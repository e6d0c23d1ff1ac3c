//! Accepting client connections under limits, so idle or slow clients cannot take the
//! gateway away from everyone else:
//! - at most `max_connections` open connections, and `max_per_address` from one client
//!   address ([`crate::conn_table`]); a connection past the address's cap is closed at
//!   once (counted in `baton_gateway_connections_refused_total{reason}`), one past the
//!   total cap takes the place of the connection idle the longest (no request in
//!   progress; `baton_gateway_connections_evicted_total`), and is refused only when every
//!   open connection is busy. At start the soft limit on open
//!   files is raised to the hard one and `max_connections` kept under it
//!   ([`ConnLimits::within`]), so the cap engages before the kernel stops accepting;
//! - a request's headers must arrive within `header_timeout`, which also closes a
//!   keep-alive connection idle for that long between requests;
//! - TLS handshakes run in the connection's own task, bounded by
//!   [`crate::tls::HANDSHAKE_TIMEOUT`];
//! - request bodies are read with a deadline ([`read_body`]).
//!
//! Shutdown stops accepting, lets every connection finish its current response, and
//! returns when the last one has closed.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use axum::Router;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::conn_table::{Slot, Table, Tracker};
use crate::error::ApiError;
use baton_vocab::ErrorKind;

/// The client's address, in every request's extensions (per-address limits read it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// The gateway's connection limits (flags `--max-connections`, `--max-connections-per-address`,
/// `--header-timeout-seconds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub max_per_address: usize,
    pub header_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits { max_connections: 8192, max_per_address: 256, header_timeout: Duration::from_secs(15) }
    }
}

/// Descriptors kept out of the client connections' reach, for the process's own files:
/// the store, gRPC channels to the coordinators and nodes, listeners, logs.
pub const RESERVED_DESCRIPTORS: u64 = 512;

impl ConnLimits {
    /// These limits with `max_connections` lowered where needed so that every connection
    /// and the process's own files fit `open_files` (the soft limit on open files). Past
    /// that limit `accept` fails in the kernel: new connections, real clients' among them,
    /// wait in its queue, and the gateway's own cap, which would close them at once, never
    /// engages.
    pub fn within(self, open_files: u64) -> ConnLimits {
        let room = open_files.saturating_sub(RESERVED_DESCRIPTORS).max(1);
        ConnLimits { max_connections: self.max_connections.min(usize::try_from(room).unwrap_or(usize::MAX)), ..self }
    }
}

/// Raises this process's soft limit on open files to its hard limit (which needs no
/// privilege), and returns the soft limit then in force.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read or write only the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}

/// Serves `router` on `listener` (HTTPS when `tls` is given) until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let table = Table::new(limits.max_connections, limits.max_per_address);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        while conns.try_join_next().is_some() {}
        let slot = match table.admit(peer.ip()) {
            Ok((slot, evicted)) => {
                if evicted {
                    crate::metrics::connection_evicted();
                }
                slot
            }
            Err(reason) => {
                crate::metrics::connection_refused(reason);
                tracing::debug!(%peer, reason, "connection refused");
                continue;
            }
        };
        // Without TCP_NODELAY, a small SSE frame written after another waits for the
        // peer's delayed ACK (up to 40 ms): every token would stall.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
        let router = router.clone().layer(axum::Extension(ClientAddr(peer.ip())));
        let (tls, stop) = (tls.clone(), stop_rx.clone());
        conns.spawn(async move {
            match tls {
                None => serve_one(tcp, router, &slot, limits.header_timeout, stop).await,
                Some(acceptor) => {
                    let accepted = tokio::select! {
                        a = tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(tcp)) => a,
                        // Evicted during its handshake: no request can be in progress.
                        () = slot.evicted() => return tracing::debug!(%peer, "evicted during its TLS handshake"),
                    };
                    match accepted {
                        Ok(Ok(stream)) => serve_one(stream, router, &slot, limits.header_timeout, stop).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One HTTP/1.1 connection, until the client closes it, a deadline closes it, it is
/// evicted (closed at once when idle, else after the response in progress), or shutdown
/// (then after the response in progress). Each request marks the connection busy in its
/// table ([`Tracking`]).
async fn serve_one<I>(io: I, router: Router, slot: &Slot, header_timeout: Duration, mut stop: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let tracker = slot.tracker();
    let service = Tracking { inner: hyper_util::service::TowerToHyperService::new(router), tracker: tracker.clone() };
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let stopping = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        }
        () = slot.evicted() => {
            // Chosen while idle; a request that started since is answered first.
            if tracker.is_busy() {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        }
        _ = stopping => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// The router as hyper's service, marking the connection busy from a request's parsed
/// headers until its response body is done (or dropped).
struct Tracking {
    inner: hyper_util::service::TowerToHyperService<Router>,
    tracker: Tracker,
}

impl hyper::service::Service<Request<hyper::body::Incoming>> for Tracking {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Self::Error>> + Send>>;

    fn call(&self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let busy = self.tracker.busy();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _ = &busy;
                    frame
                }))
            }))
        })
    }
}

/// Reads a whole body, refusing more than `limit` bytes with 413, and a body that takes
/// longer than `deadline` to arrive with 408.
pub async fn read_body(body: Body, limit: usize, deadline: Duration) -> Result<Bytes, ApiError> {
    let limited = http_body_util::Limited::new(body, limit);
    let Ok(collected) = tokio::time::timeout(deadline, limited.collect()).await else {
        return Err(ApiError::new(ErrorKind::DeadlineExceeded, format!("the request body did not arrive within {deadline:?}")));
    };
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(ApiError::too_large(limit)),
        Err(_) => Err(ApiError::bad_request("could not read the request body")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_fits_under_the_open_files_limit() {
        let asked = ConnLimits::default();
        // A container's common soft limit: 8,192 connections would exhaust it first.
        assert_eq!(asked.within(1024).max_connections, 1024 - RESERVED_DESCRIPTORS as usize);
        assert_eq!(asked.within(4096).max_connections, 4096 - RESERVED_DESCRIPTORS as usize);
        // A large limit leaves the flag as given; the other limits never change.
        assert_eq!(asked.within(1 << 20), asked);
        assert_eq!(asked.within(1024).max_per_address, asked.max_per_address);
        // Below the reserve, one connection at a time rather than none.
        assert_eq!(asked.within(100).max_connections, 1);
    }

    #[test]
    fn the_soft_open_files_limit_is_raised_to_the_hard_one() {
        let soft = raise_open_files_limit().unwrap();
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes only the struct passed.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(soft, lim.rlim_cur, "the limit in force is the one returned");
        // (An unlimited hard limit cannot be the soft one for open files: it stays as it was.)
        assert!(lim.rlim_cur == lim.rlim_max || lim.rlim_max == libc::RLIM_INFINITY, "{} of {}", lim.rlim_cur, lim.rlim_max);
    }
}
