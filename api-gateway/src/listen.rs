//! Accepting client connections under limits, so idle or slow clients cannot take the
//! gateway away from everyone else:
//! - at most `max_connections` open connections, and `max_per_address` from one client
//!   address; a connection past either is closed at once (counted in
//!   `baton_gateway_connections_refused_total{reason}`);
//! - a request's headers must arrive within `header_timeout`, which also closes a
//!   keep-alive connection idle for that long between requests;
//! - TLS handshakes run in the connection's own task, bounded by
//!   [`crate::tls::HANDSHAKE_TIMEOUT`];
//! - request bodies are read with a deadline ([`read_body`]).
//!
//! Shutdown stops accepting, lets every connection finish its current response, and
//! returns when the last one has closed.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

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

/// Open connections, in all and per client address.
#[derive(Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// One connection's place in [`Open`]; given back when dropped.
struct Slot {
    open: Arc<Mutex<Open>>,
    address: IpAddr,
}

impl Slot {
    fn take(open: &Arc<Mutex<Open>>, address: IpAddr, limits: &ConnLimits) -> Result<Slot, &'static str> {
        let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
        if o.total >= limits.max_connections {
            return Err("max_connections");
        }
        let mine = o.by_address.entry(address).or_default();
        if *mine >= limits.max_per_address {
            return Err("max_per_address");
        }
        *mine += 1;
        o.total += 1;
        crate::metrics::set_open_connections(o.total);
        Ok(Slot { open: open.clone(), address })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(|p| p.into_inner());
        o.total -= 1;
        if let Some(n) = o.by_address.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                o.by_address.remove(&self.address);
            }
        }
        crate::metrics::set_open_connections(o.total);
    }
}

/// Serves `router` on `listener` (HTTPS when `tls` is given) until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let open = Arc::new(Mutex::new(Open::default()));
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
        let slot = match Slot::take(&open, peer.ip(), &limits) {
            Ok(s) => s,
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
            let _slot = slot;
            match tls {
                None => serve_one(tcp, router, limits.header_timeout, stop).await,
                Some(acceptor) => match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => serve_one(stream, router, limits.header_timeout, stop).await,
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                },
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One HTTP/1.1 connection, until the client closes it, a deadline closes it, or shutdown
/// (then after the response in progress).
async fn serve_one<I>(io: I, router: Router, header_timeout: Duration, mut stop: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(router);
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
        _ = stopping => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
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
