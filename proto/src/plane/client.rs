//! The client side of the plane: a tonic connector that dials TCP and, with TLS on,
//! accepts the server only if its certificate names the identity the caller expects.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use baton_identity::Expect;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

use super::server::MaybeTls;
use super::{normalize_url, Plane, PlaneError, Security, ALPN, HANDSHAKE_TIMEOUT};

type ClientIo = TokioIo<MaybeTls<tokio_rustls::client::TlsStream<TcpStream>>>;

/// Dials for tonic; one per channel.
#[derive(Clone)]
pub(crate) struct Connector {
    tls: Option<tokio_rustls::TlsConnector>,
}

impl tower_service::Service<Uri> for Connector {
    type Response = ClientIo;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<ClientIo>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let authority = uri.authority().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "URL has no host"))?;
            let addr = match authority.port_u16() {
                Some(_) => authority.as_str().to_string(),
                None => format!("{}:80", authority.host()),
            };
            let tcp = TcpStream::connect(&addr).await?;
            let _ = tcp.set_nodelay(true);
            let Some(tls) = tls else {
                return Ok(TokioIo::new(MaybeTls::Plain(tcp)));
            };
            // The name is only sent as SNI: the verifier judges the identity, not it.
            let sni = rustls::pki_types::ServerName::try_from("plane.baton").expect("a valid DNS name");
            let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.connect(sni, tcp))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("TLS handshake with {addr} timed out")))??;
            Ok(TokioIo::new(MaybeTls::Tls(Box::new(stream))))
        })
    }
}

impl Plane {
    /// The tonic endpoint for `url` (`host:port` or `http(s)://host:port`), to be
    /// configured (timeouts) and then connected with [`Plane::connect`] or
    /// [`Plane::connect_lazy`].
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, PlaneError> {
        let url = normalize_url(url);
        Endpoint::from_shared(url.clone()).map_err(|e| PlaneError::Url { url, why: e.to_string() })
    }

    /// The connector for a server that must be `expect`.
    pub(crate) fn connector(&self, expect: Expect) -> Result<Connector, PlaneError> {
        match &*self.security {
            Security::InsecurePlaintext => Ok(Connector { tls: None }),
            Security::Mtls { tls, .. } => {
                let config = tls.identity_client_config(ALPN, expect)?;
                Ok(Connector { tls: Some(tokio_rustls::TlsConnector::from(Arc::new(config))) })
            }
        }
    }

    /// Connects now to a server that must be `expect`.
    pub async fn connect(&self, endpoint: &Endpoint, expect: Expect) -> Result<Channel, tonic::transport::Error> {
        match self.connector(expect) {
            Ok(c) => endpoint.connect_with_connector(c).await,
            // A config that cannot be built is reported as the connection's failure.
            Err(e) => endpoint.connect_with_connector(Failing(Arc::new(e.to_string()))).await,
        }
    }

    /// A channel that connects on first use to a server that must be `expect`.
    pub fn connect_lazy(&self, endpoint: &Endpoint, expect: Expect) -> Result<Channel, PlaneError> {
        Ok(endpoint.connect_with_connector_lazy(self.connector(expect)?))
    }
}

/// A connector whose every call fails with the same message.
#[derive(Clone)]
struct Failing(Arc<String>);

impl tower_service::Service<Uri> for Failing {
    type Response = ClientIo;
    type Error = io::Error;
    type Future = std::future::Ready<io::Result<ClientIo>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        std::future::ready(Err(io::Error::other(self.0.to_string())))
    }
}
