//! The internal plane's server check: a client accepts a server only if its certificate
//! chains to the cluster CA and names the identity the client expected ([`Expect`]),
//! whatever address it dialled.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, OtherError, RootCertStore, SignatureScheme};

use crate::certs::{crypto_provider, tls_err};
use crate::error::Result;
use crate::identity::{Identity, Role};
use crate::IDENTITY_DOMAIN;

/// Who a client expects to reach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Any holder of this role (a coordinator behind a load balancer).
    Role(Role),
    /// Any holder of one of these roles (an operator's tool pointed at "a node").
    OneOf(Vec<Role>),
    /// The node registered as `name` in `role` (a decode node the coordinator routed to).
    Node { role: Role, name: String },
}

impl Expect {
    /// Whether `id` is what was expected.
    pub fn admits(&self, id: &Identity) -> bool {
        match self {
            Expect::Role(r) => id.role() == *r,
            Expect::OneOf(rs) => rs.contains(&id.role()),
            Expect::Node { role, name } => id.role() == *role && id.may_act_as(name),
        }
    }
}

impl std::fmt::Display for Expect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expect::Role(r) => write!(f, "any {r}"),
            Expect::OneOf(rs) => write!(f, "any of {rs:?}"),
            Expect::Node { role, name } => write!(f, "{role} {name}"),
        }
    }
}

#[derive(Debug)]
struct WrongPeer(String);

impl std::fmt::Display for WrongPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongPeer {}

fn rejected(why: String) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(WrongPeer(why)))))
}

#[derive(Debug)]
pub(crate) struct PeerVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    expect: Expect,
}

impl PeerVerifier {
    pub(crate) fn new(roots: Arc<RootCertStore>, expect: Expect) -> Result<Self> {
        let webpki = WebPkiServerVerifier::builder_with_provider(roots, crypto_provider()).build().map_err(tls_err)?;
        Ok(PeerVerifier { webpki, expect })
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let id = Identity::from_cert_der(end_entity).map_err(|e| rejected(format!("peer certificate: {e}")))?;
        // The chain, validity and key usage, checked by webpki for the identity's own name
        // (for a pool, one member's name, which its wildcard covers).
        let probe = if id.is_pool() { format!("member.{}.{IDENTITY_DOMAIN}", id.role()) } else { id.dns_name() };
        let probe = ServerName::try_from(probe).map_err(|e| rejected(e.to_string()))?;
        self.webpki.verify_server_cert(end_entity, intermediates, &probe, ocsp_response, now)?;
        if !self.expect.admits(&id) {
            return Err(rejected(format!("peer is {id}, expected {}", self.expect)));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations() {
        let d0 = Identity::new(Role::Decode, "decode-0").unwrap();
        assert!(Expect::Role(Role::Decode).admits(&d0));
        assert!(!Expect::Role(Role::Coordinator).admits(&d0));
        assert!(Expect::Node { role: Role::Decode, name: "decode-0".into() }.admits(&d0));
        assert!(!Expect::Node { role: Role::Decode, name: "decode-1".into() }.admits(&d0));
    }
}
