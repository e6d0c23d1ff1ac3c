//! HTTPS on the gateway's listener (`--tls-cert`, `--tls-key`): the PEM files
//! are read and checked once at start (a bad file is an error naming it, not
//! a failure on the first connection). [`crate::listen`] runs each handshake in
//! its connection's task, bounded by [`HANDSHAKE_TIMEOUT`], so a slow or silent
//! client cannot hold up the others; a plain-HTTP request to the port fails its
//! handshake.
//!
//! rustls with the ring provider, as kv-transport uses, so the workspace
//! carries one TLS stack.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Longest a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What is wrong with the TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls-cert and --tls-key go together: {given} was given without {missing}")]
    Incomplete { given: &'static str, missing: &'static str },
    #[error("reading {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: not a PEM certificate chain: {detail}", path.display())]
    BadCertificate { path: PathBuf, detail: String },
    #[error("{}: no PEM private key (PKCS#8, PKCS#1 or SEC1): {detail}", path.display())]
    BadKey { path: PathBuf, detail: String },
    #[error("certificate {} and key {} do not make a TLS server configuration: {detail}", cert.display(), key.display())]
    Config { cert: PathBuf, key: PathBuf, detail: String },
}

/// A checked certificate chain and key, ready to accept connections.
#[derive(Clone)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig").field("cert", &self.cert).field("key", &self.key).finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// From the two optional flags: none is plain HTTP, both is HTTPS, one is an error.
    pub fn from_flags(cert: Option<&Path>, key: Option<&Path>) -> Result<Option<Self>, TlsError> {
        match (cert, key) {
            (None, None) => Ok(None),
            (Some(c), Some(k)) => Self::load(c, k).map(Some),
            (Some(_), None) => Err(TlsError::Incomplete { given: "--tls-cert", missing: "--tls-key" }),
            (None, Some(_)) => Err(TlsError::Incomplete { given: "--tls-key", missing: "--tls-cert" }),
        }
    }

    /// Reads and checks a PEM certificate chain (leaf first) and its private key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let read = |p: &Path| std::fs::read(p).map_err(|source| TlsError::Read { path: p.to_path_buf(), source });
        let cert_pem = read(cert)?;
        let key_pem = read(key)?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::BadCertificate { path: cert.to_path_buf(), detail: e.to_string() })?;
        if chain.is_empty() {
            return Err(TlsError::BadCertificate { path: cert.to_path_buf(), detail: "no CERTIFICATE block".into() });
        }
        let private =
            PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::BadKey { path: key.to_path_buf(), detail: e.to_string() })?;
        let config_err = |detail: String| TlsError::Config { cert: cert.to_path_buf(), key: key.to_path_buf(), detail };
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| config_err(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(|e| config_err(e.to_string()))?;
        // The gateway's HTTP stack speaks HTTP/1.1.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsConfig { cert: cert.to_path_buf(), key: key.to_path_buf(), server: Arc::new(server) })
    }

    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.server.clone())
    }
}

