//! TLS over TCP transport: the baseline QUIC is measured against, and a fallback where UDP
//! is blocked.
//!
//! Owns: [`TlsTcpListener`] and [`TlsTcpConnector`]. One TCP connection per transfer (no
//! pooling: the TLS handshake costs about a millisecond on a LAN, small next to a turn).
//! Invariants: TLS 1.3 with mutual authentication against the cluster CA; a connection that
//! does not finish its handshake within the open timeout is dropped; listener shutdown
//! aborts every connection it accepted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::certs::NodeTls;
use crate::error::{Error, Result};
use crate::handoff::frame::{read_frame, write_frame, Frame, FrameLimits};
use crate::handoff::KvReceiver;
use crate::transport::{BoxFuture, Connector, Link, LinkRx, LinkTx, Listener, Peer, StreamLimits};

const NAME: &str = "tls_tcp";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

struct StreamTx<W>(W);
struct StreamRx<R> {
    r: R,
    limits: StreamLimits,
}

impl<W: AsyncWrite + Unpin + Send> LinkTx for StreamTx<W> {
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            write_frame(&mut self.0, &frame).await?;
            self.0
                .flush()
                .await
                .map_err(|e| Error::io("flushing a frame", e))
        })
    }
}

impl<R: AsyncRead + Unpin + Send> LinkRx for StreamRx<R> {
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>> {
        Box::pin(async move {
            let frame = read_frame(&mut self.r, &self.limits.next()).await;
            self.limits.read(frame)
        })
    }

    fn limit(&mut self, limits: FrameLimits) {
        self.limits.tighten(limits);
    }
}

fn link<S>(stream: S, limits: FrameLimits, peer: Option<baton_identity::Identity>) -> Link
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (r, w): (ReadHalf<S>, WriteHalf<S>) = tokio::io::split(stream);
    Link {
        tx: Box::new(StreamTx(w)),
        rx: Box::new(StreamRx { r, limits: StreamLimits::new(limits) }),
        transport: NAME,
        peer,
    }
}

/// Accepts TLS connections, one transfer each.
pub struct TlsTcpListener {
    peer: Peer,
    task: tokio::task::AbortHandle,
}

impl TlsTcpListener {
    /// Binds `addr` (port 0 for any) and serves links with `receiver`. Needs a Tokio runtime.
    pub async fn bind(
        addr: SocketAddr,
        server_name: &str,
        tls: &NodeTls,
        receiver: KvReceiver,
    ) -> Result<Self> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls.server_config(crate::certs::ALPN)?));
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io("binding a TCP listener", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("reading the TCP listener address", e))?;
        let limits = receiver.frame_limits();
        let task = tokio::spawn(async move {
            let mut links = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            let acceptor = acceptor.clone();
                            let r = receiver.clone();
                            links.spawn(async move {
                                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                                    Ok(Ok(tls)) => {
                                        let peer = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(|c| baton_identity::Identity::from_cert_der(c).ok());
                                        r.serve_link(link(tls, limits, peer)).await
                                    }
                                    Ok(Err(e)) => tracing::info!(error = %e, "TLS handshake failed"),
                                    Err(_) => tracing::info!("TLS handshake timed out"),
                                }
                            });
                        }
                        Err(e) => {
                            // Out of descriptors and the like: back off instead of spinning.
                            tracing::warn!(error = %e, "TCP accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    Some(_) = links.join_next() => {}
                }
            }
        });
        Ok(TlsTcpListener {
            peer: Peer::Net {
                addr: local,
                server_name: server_name.to_string(),
            },
            task: task.abort_handle(),
        })
    }
}

impl Listener for TlsTcpListener {
    fn transport(&self) -> &'static str {
        NAME
    }
    fn peer(&self) -> Peer {
        self.peer.clone()
    }
    fn shutdown(&self) {
        self.task.abort();
    }
}

impl Drop for TlsTcpListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens one TLS connection per transfer.
#[derive(Clone)]
pub struct TlsTcpConnector {
    connector: tokio_rustls::TlsConnector,
}

impl TlsTcpConnector {
    pub fn new(tls: &NodeTls) -> Result<Self> {
        Ok(TlsTcpConnector {
            connector: tokio_rustls::TlsConnector::from(Arc::new(tls.client_config(crate::certs::ALPN)?)),
        })
    }
}

impl Connector for TlsTcpConnector {
    fn transport(&self) -> &'static str {
        NAME
    }

    fn open<'a>(&'a self, peer: &'a Peer) -> BoxFuture<'a, Result<Link>> {
        Box::pin(async move {
            let Peer::Net { addr, server_name } = peer else {
                return Err(Error::InvalidArgument {
                    what: "the TLS/TCP transport needs a network peer",
                });
            };
            let refused = |detail: String| Error::Connect {
                transport: NAME,
                peer: peer.to_string(),
                detail,
            };
            let name = ServerName::try_from(server_name.clone()).map_err(|e| refused(e.to_string()))?;
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|e| refused(e.to_string()))?;
            let _ = tcp.set_nodelay(true);
            let tls = self
                .connector
                .connect(name, tcp)
                .await
                .map_err(|e| refused(e.to_string()))?;
            Ok(link(tls, FrameLimits { max_payload: 0 }, None))
        })
    }
}
