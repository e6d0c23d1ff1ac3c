//! Cluster TLS: development certificates and the mutual-TLS configurations built from them.
//!
//! Owns: [`generate_dev_certs`] (a cluster CA plus one certificate per node, for the
//! `baton certs` command and tests) and [`NodeTls`] (a node's CA roots, certificate chain
//! and key, turned into rustls server and client configs).
//! Invariants: every config is TLS 1.3 only, on the `ring` provider, and authenticates both
//! ends against the cluster CA: a server requires a client certificate signed by the CA, a
//! client checks the server's certificate names the peer it dialled.

use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::error::{Error, Result};

/// ALPN protocol both ends of a KV link must speak.
pub const ALPN: &[u8] = b"baton-kv/1";

/// A node's certificate and key, PEM encoded.
#[derive(Clone, Debug)]
pub struct NodeCertPem {
    pub name: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A development cluster CA and node certificates, PEM encoded.
#[derive(Clone, Debug)]
pub struct DevCerts {
    pub ca_cert_pem: String,
    pub ca_key_pem: String,
    pub nodes: Vec<NodeCertPem>,
}

fn current_year() -> i32 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    1970 + (secs / 31_556_952) as i32
}

fn certs_err(source: rcgen::Error) -> Error {
    Error::Certs { source }
}

/// Creates a cluster CA named `cluster` and one certificate per node name. Each node
/// certificate is valid for the node name, `localhost`, 127.0.0.1 and ::1, for both server
/// and client authentication, for about two years.
pub fn generate_dev_certs(cluster: &str, nodes: &[&str]) -> Result<DevCerts> {
    let year = current_year();
    let ca_key = KeyPair::generate().map_err(certs_err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(certs_err)?;
    ca.distinguished_name
        .push(DnType::CommonName, format!("{cluster} cluster CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let (not_before, not_after) = (
        rcgen::date_time_ymd(year - 1, 12, 31),
        rcgen::date_time_ymd(year + 2, 1, 1),
    );
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key).map_err(certs_err)?;
    let mut out = Vec::with_capacity(nodes.len());
    for &name in nodes {
        let key = KeyPair::generate().map_err(certs_err)?;
        let mut p = CertificateParams::new(vec![
            name.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ])
        .map_err(certs_err)?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.not_before = not_before;
        p.not_after = not_after;
        let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(certs_err)?;
        out.push(NodeCertPem {
            name: name.to_string(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        });
    }
    Ok(DevCerts {
        ca_cert_pem: ca_cert.pem(),
        ca_key_pem: ca_key.serialize_pem(),
        nodes: out,
    })
}

impl DevCerts {
    /// The TLS identity of node `name`.
    pub fn node_tls(&self, name: &str) -> Result<NodeTls> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or(Error::InvalidArgument {
                what: "no certificate for that node name",
            })?;
        NodeTls::from_pem(&self.ca_cert_pem, &node.cert_pem, &node.key_pem)
    }

    /// Writes `ca.pem`, `ca.key`, `<node>.pem` and `<node>.key` into `dir` (keys mode 0600
    /// on Unix).
    pub fn write_to_dir(&self, dir: &Path) -> Result<()> {
        let io = |e| Error::io("writing certificates", e);
        std::fs::create_dir_all(dir).map_err(io)?;
        write_file(&dir.join("ca.pem"), &self.ca_cert_pem, false)?;
        write_file(&dir.join("ca.key"), &self.ca_key_pem, true)?;
        for n in &self.nodes {
            write_file(&dir.join(format!("{}.pem", n.name)), &n.cert_pem, false)?;
            write_file(&dir.join(format!("{}.key", n.name)), &n.key_pem, true)?;
        }
        Ok(())
    }
}

fn write_file(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = o.open(path).map_err(|e| Error::io("writing certificates", e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Error::io("writing certificates", e))
}

/// A node's TLS identity: the cluster CA it trusts and its own certificate and key.
#[derive(Debug)]
pub struct NodeTls {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for NodeTls {
    fn clone(&self) -> Self {
        NodeTls {
            roots: self.roots.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Tls {
        detail: e.to_string(),
    }
}

/// The `ring` provider with AES-128-GCM first: the cheapest suite on CPUs with AES-NI, and
/// the one that dominates bulk KV throughput.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

impl NodeTls {
    /// Parses PEM text: the CA certificate(s), the node's chain and its private key.
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(c.map_err(tls_err)?).map_err(tls_err)?;
        }
        if roots.is_empty() {
            return Err(tls_err("no CA certificate in the CA PEM"));
        }
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(tls_err)?;
        if chain.is_empty() {
            return Err(tls_err("no certificate in the node PEM"));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(tls_err)?;
        Ok(NodeTls {
            roots: Arc::new(roots),
            chain,
            key,
        })
    }

    /// Server side: TLS 1.3, client certificate required and checked against the CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig> {
        let provider = crypto_provider();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
                .build()
                .map_err(tls_err)?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        Ok(c)
    }

    /// Client side: TLS 1.3, server checked against the CA, own certificate presented.
    pub fn client_config(&self) -> Result<rustls::ClientConfig> {
        let mut c = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_certs_parse_and_build_configs() {
        let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
        assert_eq!(certs.nodes.len(), 2);
        let tls = certs.node_tls("decode-0").unwrap();
        tls.server_config().unwrap();
        tls.client_config().unwrap();
        assert!(certs.node_tls("nobody").is_err());
        let dir = std::env::temp_dir().join(format!("baton-kvt-certs-{}", std::process::id()));
        certs.write_to_dir(&dir).unwrap();
        let key = std::fs::read_to_string(dir.join("prefill-0.key")).unwrap();
        assert_eq!(key, certs.nodes[1].key_pem);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.join("ca.key")).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn provider_prefers_aes_128() {
        let p = crypto_provider();
        assert_eq!(
            p.cipher_suites[0].suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
    }
}
