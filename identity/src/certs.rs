//! Cluster certificates: development certificates from a fresh CA, and a process's TLS
//! identity ([`NodeTls`]) turned into rustls server and client configs.
//!
//! Invariants: every config is TLS 1.3 only, on the `ring` provider, and authenticates both
//! ends against the cluster CA: a server requires a client certificate signed by the CA, a
//! client checks the server's certificate (its name for the KV transport, its identity for
//! the internal plane, see [`crate::Expect`]).

use std::path::Path;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::error::{Error, Result};
use crate::identity::{Identity, Role};

/// A certificate and key, PEM encoded, for the process called `name`.
#[derive(Clone, Debug)]
pub struct NodeCertPem {
    pub name: String,
    /// The identity the certificate names (None: an address-only certificate).
    pub identity: Option<Identity>,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A development cluster CA and the certificates it signed, PEM encoded.
#[derive(Clone, Debug)]
pub struct DevCerts {
    pub ca_cert_pem: String,
    pub ca_key_pem: String,
    pub nodes: Vec<NodeCertPem>,
}

fn current_year() -> i32 {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    1970 + (secs / 31_556_952) as i32
}

/// Reads one entry of a certificate list: `ROLE:NAME` (`operator:alice`), a full identity
/// name (`pod-3.decode.baton`), or a name whose first word is a role (`decode-0`,
/// `coordinator`, `gateway-1`). Any other name gets an address-only certificate.
pub(crate) fn parse_request(spec: &str) -> Result<(String, Option<Identity>)> {
    if let Some((role, name)) = spec.split_once(':') {
        let role = Role::parse(role).ok_or_else(|| Error::InvalidName {
            name: spec.to_string(),
            why: "ROLE:NAME needs a role: gateway, coordinator, prefill, decode or operator",
        })?;
        return Ok((name.to_string(), Some(Identity::new(role, name)?)));
    }
    if let Some(id) = Identity::from_dns_name(spec) {
        return Ok((spec.to_string(), Some(id)));
    }
    let first = spec.split(['-', '_', '.']).next().unwrap_or_default();
    match Role::parse(first) {
        Some(role) => Ok((spec.to_string(), Some(Identity::new(role, spec)?))),
        None => Ok((spec.to_string(), None)),
    }
}

/// Creates a cluster CA named `cluster` and one certificate per entry of `nodes` (see
/// [`parse_request`] for the forms). Each certificate is valid for its name, its identity
/// name `NAME.ROLE.baton`, `localhost`, 127.0.0.1 and ::1, for both server and client
/// authentication, for about two years.
pub fn generate_dev_certs(cluster: &str, nodes: &[&str]) -> Result<DevCerts> {
    let year = current_year();
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, format!("{cluster} cluster CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let (not_before, not_after) = (rcgen::date_time_ymd(year - 1, 12, 31), rcgen::date_time_ymd(year + 2, 1, 1));
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key)?;
    let mut out = Vec::with_capacity(nodes.len());
    for &spec in nodes {
        let (name, identity) = parse_request(spec)?;
        let key = KeyPair::generate()?;
        let mut sans = vec![name.clone()];
        if let Some(id) = &identity {
            if id.dns_name() != name {
                sans.push(id.dns_name());
            }
        }
        sans.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
        let mut p = CertificateParams::new(sans)?;
        p.distinguished_name.push(DnType::CommonName, name.as_str());
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        p.not_before = not_before;
        p.not_after = not_after;
        let cert = p.signed_by(&key, &ca_cert, &ca_key)?;
        out.push(NodeCertPem { name, identity, cert_pem: cert.pem(), key_pem: key.serialize_pem() });
    }
    Ok(DevCerts { ca_cert_pem: ca_cert.pem(), ca_key_pem: ca_key.serialize_pem(), nodes: out })
}

impl DevCerts {
    /// The TLS identity of the process called `name`.
    pub fn node_tls(&self, name: &str) -> Result<NodeTls> {
        let node = self.nodes.iter().find(|n| n.name == name).ok_or_else(|| Error::UnknownName(name.to_string()))?;
        NodeTls::from_pem(&self.ca_cert_pem, &node.cert_pem, &node.key_pem)
    }

    /// Writes `ca.pem`, `<name>.pem` and `<name>.key` into `dir` (keys mode 0600 on Unix),
    /// and `ca.key` only if `with_ca_key`: the CA's key signs new identities, so it belongs
    /// with whoever issues certificates, never in a running process's folder.
    pub fn write_to_dir(&self, dir: &Path, with_ca_key: bool) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io { what: format!("creating {}", dir.display()), source })?;
        write_file(&dir.join("ca.pem"), &self.ca_cert_pem, false)?;
        if with_ca_key {
            write_file(&dir.join("ca.key"), &self.ca_key_pem, true)?;
        }
        for n in &self.nodes {
            write_file(&dir.join(format!("{}.pem", n.name)), &n.cert_pem, false)?;
            write_file(&dir.join(format!("{}.key", n.name)), &n.key_pem, true)?;
        }
        Ok(())
    }
}

fn write_file(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::io::Write;
    let io = |source| Error::Io { what: format!("writing {}", path.display()), source };
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = o.open(path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

/// A process's TLS identity: the cluster CA it trusts and its own certificate and key.
#[derive(Debug)]
pub struct NodeTls {
    pub(crate) roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for NodeTls {
    fn clone(&self) -> Self {
        NodeTls { roots: self.roots.clone(), chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

pub(crate) fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Tls(e.to_string())
}

/// The `ring` provider with AES-128-GCM first: the cheapest suite on CPUs with AES-NI, and
/// the one that dominates bulk KV throughput.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

impl NodeTls {
    /// Parses PEM text: the CA certificate(s), the process's chain and its private key.
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
        Ok(NodeTls { roots: Arc::new(roots), chain, key })
    }

    /// Reads `ca.pem`, `<name>.pem` and `<name>.key` from `dir` (what `baton certs` writes),
    /// or, where `<name>.pem` is absent and `tls.crt` present, a Kubernetes TLS Secret
    /// mounted as is (`ca.crt`, `tls.crt`, `tls.key`).
    pub fn from_dir(dir: &Path, name: &str) -> Result<Self> {
        let read = |file: &str| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).map_err(|source| Error::Io { what: format!("reading {}", path.display()), source })
        };
        let (ca, cert, key) = if !dir.join(format!("{name}.pem")).exists() && dir.join("tls.crt").exists() {
            ("ca.crt".to_string(), "tls.crt".to_string(), "tls.key".to_string())
        } else {
            ("ca.pem".to_string(), format!("{name}.pem"), format!("{name}.key"))
        };
        if !dir.join(&cert).exists() {
            return Err(Error::UnknownName(format!(
                "{name} in {}: expected ca.pem, {name}.pem and {name}.key (`baton certs`) or a Kubernetes TLS Secret (ca.crt, tls.crt, tls.key)",
                dir.display()
            )));
        }
        NodeTls::from_pem(&read(&ca)?, &read(&cert)?, &read(&key)?)
    }

    /// The identity this process's own certificate names.
    pub fn identity(&self) -> Result<Identity> {
        Identity::from_cert_der(&self.chain[0])
    }

    /// Server side: TLS 1.3, a client certificate required and checked against the CA;
    /// `alpn` is the one protocol offered.
    pub fn server_config(&self, alpn: &[u8]) -> Result<rustls::ServerConfig> {
        let provider = crypto_provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(tls_err)?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(c)
    }

    /// Client side: TLS 1.3, the server's certificate checked against the CA and the name
    /// dialled, own certificate presented; `alpn` is the one protocol offered.
    pub fn client_config(&self, alpn: &[u8]) -> Result<rustls::ClientConfig> {
        let mut c = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(c)
    }

    /// Client side for the internal plane: as [`NodeTls::client_config`], but the server
    /// is judged by the identity its certificate names (`expect`), not by an address.
    pub fn identity_client_config(&self, alpn: &[u8], expect: crate::Expect) -> Result<rustls::ClientConfig> {
        let verifier = crate::verify::PeerVerifier::new(self.roots.clone(), expect)?;
        let mut c = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_certs_name_identities_and_build_configs() {
        let certs = generate_dev_certs("test", &["decode-0", "prefill-0", "operator:alice", "pod-1.decode.baton", "kv-peer"]).unwrap();
        let ids: Vec<Option<String>> = certs.nodes.iter().map(|n| n.identity.as_ref().map(Identity::dns_name)).collect();
        assert_eq!(
            ids,
            [Some("decode-0.decode.baton"), Some("prefill-0.prefill.baton"), Some("alice.operator.baton"), Some("pod-1.decode.baton"), None]
                .map(|s| s.map(String::from))
        );
        let tls = certs.node_tls("decode-0").unwrap();
        assert_eq!(tls.identity().unwrap(), Identity::new(Role::Decode, "decode-0").unwrap());
        assert_eq!(certs.node_tls("alice").unwrap().identity().unwrap().role(), Role::Operator);
        assert!(matches!(certs.node_tls("kv-peer").unwrap().identity(), Err(Error::NoIdentity)));
        tls.server_config(b"h2").unwrap();
        tls.client_config(b"h2").unwrap();
        assert!(certs.node_tls("nobody").is_err());
        assert!(generate_dev_certs("test", &["admin:bob"]).is_err());
    }

    #[test]
    fn written_keys_are_private_and_the_ca_key_stays_out_unless_asked() {
        let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
        let dir = std::env::temp_dir().join(format!("baton-identity-certs-{}", std::process::id()));
        certs.write_to_dir(&dir, false).unwrap();
        assert!(!dir.join("ca.key").exists());
        let tls = NodeTls::from_dir(&dir, "prefill-0").unwrap();
        assert_eq!(tls.identity().unwrap().name(), "prefill-0");
        certs.write_to_dir(&dir, true).unwrap();
        #[cfg(unix)]
        for f in ["ca.key", "decode-0.key"] {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.join(f)).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{f}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn provider_prefers_aes_128() {
        assert_eq!(crypto_provider().cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    }
}
