//! The server side of the plane: accepted TCP connections become [`PlaneConn`]s after a
//! TLS handshake that runs off the accept loop, bounded in time and in number, so slow or
//! silent clients cannot hold the listener.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use baton_identity::Identity;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tonic::transport::server::Connected;

use super::stats::{ConnectionRefusal, PlaneStats};
use super::{Plane, Security, HANDSHAKE_TIMEOUT, MAX_PENDING_HANDSHAKES};

/// Who is on the other end of a server connection; tonic puts it in every request's
/// extensions, where [`super::AuthorizeLayer`] reads it.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// The identity the client's certificate names (None in plaintext mode).
    pub identity: Option<Identity>,
    /// SHA-256 of the client certificate's public key ([`Identity::key_of_cert_der`]):
    /// what tells two holders of one identity apart (None in plaintext mode).
    pub key: Option<[u8; 32]>,
}

/// An accepted connection: TLS, or plain TCP in plaintext mode.
pub struct PlaneConn {
    io: MaybeTls<tokio_rustls::server::TlsStream<TcpStream>>,
    peer: PeerInfo,
}

impl Connected for PlaneConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

/// Either a TLS stream or the bare TCP stream.
pub(crate) enum MaybeTls<T> {
    Tls(Box<T>),
    Plain(TcpStream),
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
            MaybeTls::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Tls(s) => s.is_write_vectored(),
            MaybeTls::Plain(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for PlaneConn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for PlaneConn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Why a connection never became a [`PlaneConn`]. Logged at debug: a flood of them must
/// not flood the log.
fn reject(stats: &PlaneStats, why: ConnectionRefusal, remote: Option<SocketAddr>, detail: &dyn std::fmt::Display) {
    stats.refuse_connection(why);
    tracing::debug!(?remote, reason = why.as_str(), %detail, "internal plane: connection refused");
}

impl Plane {
    /// The connections `listener` accepts, ready for tonic's `serve_with_incoming*`. The
    /// accept loop runs until the returned stream is dropped (the server stopped).
    pub fn incoming(&self, listener: TcpListener) -> tokio_stream::wrappers::ReceiverStream<io::Result<PlaneConn>> {
        let (tx, rx) = mpsc::channel(64);
        let security = self.security.clone();
        let stats = self.stats.clone();
        tokio::spawn(async move {
            let pending = Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES));
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = tx.closed() => return,
                };
                let (tcp, remote) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "internal plane: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let Security::Mtls { acceptor, .. } = &*security else {
                    let conn = PlaneConn { io: MaybeTls::Plain(tcp), peer: PeerInfo { remote: Some(remote), identity: None, key: None } };
                    if tx.send(Ok(conn)).await.is_err() {
                        return;
                    }
                    continue;
                };
                let Ok(permit) = pending.clone().try_acquire_owned() else {
                    reject(&stats, ConnectionRefusal::TooManyHandshakes, Some(remote), &"handshake slots full");
                    continue;
                };
                let (acceptor, tx, stats) = (acceptor.clone(), tx.clone(), stats.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Err(_) => return reject(&stats, ConnectionRefusal::HandshakeTimeout, Some(remote), &"no handshake in time"),
                        Ok(Err(e)) => return reject(&stats, ConnectionRefusal::Handshake, Some(remote), &e),
                        Ok(Ok(tls)) => tls,
                    };
                    // The chain was checked against the cluster CA in the handshake; the
                    // certificate must also name an identity.
                    let (identity, key) = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
                        None => return reject(&stats, ConnectionRefusal::NoCertificate, Some(remote), &"no client certificate"),
                        Some(cert) => match Identity::from_cert_der(cert).and_then(|id| Ok((id, Identity::key_of_cert_der(cert)?))) {
                            Ok(found) => found,
                            Err(e) => return reject(&stats, ConnectionRefusal::NoIdentity, Some(remote), &e),
                        },
                    };
                    let peer = PeerInfo { remote: Some(remote), identity: Some(identity), key: Some(key) };
                    let conn = PlaneConn { io: MaybeTls::Tls(Box::new(tls)), peer };
                    let _ = tx.send(Ok(conn)).await;
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}
