//! TLS to PostgreSQL as the connection URL's `sslmode` says, with libpq's meanings
//! (issue #39: the store connected without TLS whatever the URL said, so
//! `sslmode=require` could not connect to a server that demands TLS):
//!
//! | `sslmode` | encrypted | server certificate checked |
//! | --- | --- | --- |
//! | `disable` | never | - |
//! | `prefer` (the default) | if the server offers it | no |
//! | `require` | always | no; with `sslrootcert`, as `verify-ca` |
//! | `verify-ca` | always | chains to `sslrootcert` |
//! | `verify-full` | always | chains to `sslrootcert` and names the URL's host |
//!
//! `sslrootcert` is a PEM file of trusted CA certificates; without it `verify-ca` and
//! `verify-full` read `~/.postgresql/root.crt` as libpq does, and fail with a clear
//! error when there is none (never falling back to no check). tokio-postgres parses
//! only `disable`/`prefer`/`require` and no `sslrootcert`, so [`TlsPolicy::from_url`]
//! takes both out of the URL and hands the driver the rest. Client certificates
//! (`sslcert`, `sslkey`) are not supported: the driver refuses them as unknown options.
//! The handshake is rustls (TLS 1.2 or 1.3) with the ring provider, like every other
//! TLS link of the gateway.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{self, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::store::StoreError;

/// What the URL asked for, read before the driver sees the URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "disable" => Mode::Disable,
            "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            // libpq's `allow` tries plaintext first: a downgrade by design, refused.
            other => return Err(format!("sslmode={other} is not supported (disable, prefer, require, verify-ca, verify-full)")),
        })
    }
}

/// The URL's TLS settings and the URL without them (what tokio-postgres parses).
#[derive(Debug)]
pub struct TlsPolicy {
    pub mode: Mode,
    pub root_cert: Option<PathBuf>,
    /// The URL with `sslmode` and `sslrootcert` removed.
    pub url: String,
}

impl TlsPolicy {
    /// Splits `sslmode` and `sslrootcert` off `url`'s query string.
    pub fn from_url(url: &str) -> Result<Self, String> {
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => (url, ""),
        };
        let (mut mode, mut root_cert) = (Mode::Prefer, None);
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "sslmode" => mode = Mode::parse(&percent_decode(v)?)?,
                "sslrootcert" => root_cert = Some(PathBuf::from(percent_decode(v)?)),
                _ => rest.push(pair),
            }
        }
        let url = if rest.is_empty() { base.to_string() } else { format!("{base}?{}", rest.join("&")) };
        if root_cert.as_deref() == Some(Path::new("system")) {
            return Err("sslrootcert=system is not supported: name a PEM file of the CA that signed the server's certificate".into());
        }
        Ok(TlsPolicy { mode, root_cert, url })
    }

    /// The driver's mode: it only knows whether TLS is off, optional or required.
    pub fn driver_mode(&self) -> SslMode {
        match self.mode {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }

    /// The connector that enforces the mode's certificate checks.
    pub fn connector(&self) -> Result<MakeRustls, StoreError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let root = match (&self.root_cert, self.mode) {
            (Some(p), _) => Some(p.clone()),
            (None, Mode::VerifyCa | Mode::VerifyFull) => {
                let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
                Some(home.join(".postgresql/root.crt"))
            }
            (None, _) => None,
        };
        let check = match (self.mode, root) {
            (Mode::Disable, _) | (Mode::Prefer, _) | (Mode::Require, None) => Check::Encrypt,
            (Mode::Require | Mode::VerifyCa, Some(p)) => Check::Chain(verifier(&p, &provider)?),
            (Mode::VerifyFull, Some(p)) => Check::ChainAndName(verifier(&p, &provider)?),
            (Mode::VerifyCa | Mode::VerifyFull, None) => unreachable!("a root file is chosen above"),
        };
        let verifier: Arc<dyn ServerCertVerifier> = Arc::new(Verifier { check, provider: provider.clone() });
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Db(format!("postgres TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustls(Arc::new(config)))
    }
}

fn verifier(path: &Path, provider: &Arc<CryptoProvider>) -> Result<Arc<WebPkiServerVerifier>, StoreError> {
    let bad = |detail: String| StoreError::Db(format!("postgres sslrootcert {}: {detail}", path.display()));
    let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.map_err(|e| bad(e.to_string()))?).map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no certificate in the file".into()));
    }
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build().map_err(|e| bad(e.to_string()))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// How much of the server's certificate is checked.
#[derive(Debug)]
enum Check {
    /// Encryption only (`prefer`, `require` without a root file): libpq's meaning, a
    /// passive eavesdropper learns nothing, an active one in the path can impersonate.
    Encrypt,
    /// The chain must end at a trusted root; the name is not checked (`verify-ca`).
    Chain(Arc<WebPkiServerVerifier>),
    /// The chain and the URL's host name or address (`verify-full`).
    ChainAndName(Arc<WebPkiServerVerifier>),
}

#[derive(Debug)]
struct Verifier {
    check: Check,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match &self.check {
            Check::Encrypt => Ok(ServerCertVerified::assertion()),
            Check::ChainAndName(v) => v.verify_server_cert(end_entity, intermediates, server_name, ocsp, now),
            Check::Chain(v) => match v.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
                // Only the name may differ; every other failure (unknown issuer, expired,
                // bad signature) stands.
                Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. })) => {
                    Ok(ServerCertVerified::assertion())
                }
                other => other,
            },
        }
    }

    // The handshake's own signature is checked in every mode: it proves the server holds
    // the key of the certificate it sent.
    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// tokio-postgres' TLS hook over rustls.
#[derive(Clone)]
pub struct MakeRustls(Arc<ClientConfig>);

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        // The URL's host: a name or an address, which `verify-full` checks against the
        // certificate's subject alternative names.
        let name = ServerName::try_from(domain.trim_start_matches('[').trim_end_matches(']'))?.to_owned();
        Ok(RustlsConnect { config: self.0.clone(), name })
    }
}

pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move { Ok(RustlsStream(connector.connect(self.name, stream).await?)) })
    }
}

/// An established TLS connection to the server.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM channel binding (tls-server-end-point) needs the certificate's signature
        // hash; not offered, so `channel_binding=require` in the URL fails to connect.
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_settings_leave_the_url_and_the_rest_stays() {
        let p = TlsPolicy::from_url("postgres://u:pw@db:5432/baton?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem").unwrap();
        assert_eq!(p.mode, Mode::VerifyFull);
        assert_eq!(p.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(p.url, "postgres://u:pw@db:5432/baton?application_name=x");
        assert_eq!(p.driver_mode(), SslMode::Require);
        let plain = TlsPolicy::from_url("postgres://u@db/baton").unwrap();
        assert_eq!((plain.mode, plain.url.as_str()), (Mode::Prefer, "postgres://u@db/baton"));
        assert!(TlsPolicy::from_url("postgres://u@db/b?sslmode=allow").is_err());
        assert!(TlsPolicy::from_url("postgres://u@db/b?sslmode=verify-ca&sslrootcert=system").is_err());
        assert!(TlsPolicy::from_url("postgres://u@db/b?sslrootcert=%zz").is_err());
    }

    #[test]
    fn verification_without_a_root_file_is_an_error_not_a_skipped_check() {
        let dir = tempfile::tempdir().unwrap();
        let p = TlsPolicy { mode: Mode::VerifyFull, root_cert: Some(dir.path().join("missing.pem")), url: String::new() };
        let e = p.connector().err().expect("a missing root file must fail");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        std::fs::write(dir.path().join("empty.pem"), "").unwrap();
        let p = TlsPolicy { mode: Mode::VerifyCa, root_cert: Some(dir.path().join("empty.pem")), url: String::new() };
        assert!(p.connector().is_err());
    }
}
