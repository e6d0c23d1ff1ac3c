//! The internal plane: how Baton's processes call each other's gRPC services, and who may.
//!
//! Owns: [`Plane`] (a process's side of the plane: mutual TLS from its certificate, or
//! plaintext when the operator asked for it by name), the server's accept loop
//! ([`Plane::incoming`]: TLS handshakes off the accept path, each bounded in time), the
//! client's connector ([`Plane::connect`]: the server must hold the identity the caller
//! expects), and the authorization table ([`authz`]).
//!
//! Invariants: with TLS on, every connection in either direction is TLS 1.3 with a
//! certificate from the cluster CA that names one identity; a request reaches a service
//! only if the table lets the caller's role call that method ([`AuthorizeLayer`]); the
//! caller's identity reaches handlers as [`Caller`], read from the certificate, never
//! from a request field.

pub mod authz;
mod client;
mod server;
pub mod stats;

use std::sync::Arc;
use std::time::Duration;

use baton_identity::{Identity, NodeTls};

pub use authz::{AuthorizeLayer, Caller};
pub use baton_identity::{Expect, Role};
pub use server::{PeerInfo, PlaneConn};
pub use stats::{ConnectionRefusal, PlaneStats};

/// ALPN protocol of the internal plane (gRPC over HTTP/2).
pub const ALPN: &[u8] = b"h2";

/// How long a client may take to complete its TLS handshake before the server drops it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// At most this many TLS handshakes in flight per listener; connections past it are
/// closed at once rather than queued (a flood of slow handshakes cannot pin memory).
pub const MAX_PENDING_HANDSHAKES: usize = 4096;

/// Why a [`Plane`] could not be set up: the crate's one error type.
pub use crate::error::Error as PlaneError;

enum Security {
    Mtls { tls: NodeTls, identity: Identity, acceptor: tokio_rustls::TlsAcceptor },
    InsecurePlaintext,
}

/// One process's side of the internal plane; cheap to clone.
#[derive(Clone)]
pub struct Plane {
    security: Arc<Security>,
    /// What this plane's servers refused (shared by clones: one process role, one count).
    stats: Arc<PlaneStats>,
}

impl std::fmt::Debug for Plane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.security {
            Security::Mtls { identity, .. } => write!(f, "Plane(mTLS as {identity})"),
            Security::InsecurePlaintext => f.write_str("Plane(INSECURE plaintext)"),
        }
    }
}

impl Plane {
    /// Mutual TLS as the identity `tls`'s certificate names (it must name one).
    pub fn mtls(tls: NodeTls) -> Result<Plane, PlaneError> {
        let identity = tls.identity()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls.server_config(ALPN)?));
        Ok(Plane { security: Arc::new(Security::Mtls { tls, identity, acceptor }), stats: Arc::default() })
    }

    /// No TLS, no identities, no authorization: anyone who reaches a port may call any
    /// method. Only for a network where every process is trusted; the flag that selects
    /// it says so (`--insecure-plaintext-internal`).
    pub fn insecure_plaintext() -> Plane {
        Plane { security: Arc::new(Security::InsecurePlaintext), stats: Arc::default() }
    }

    /// This process's identity (None in plaintext mode).
    pub fn identity(&self) -> Option<&Identity> {
        match &*self.security {
            Security::Mtls { identity, .. } => Some(identity),
            Security::InsecurePlaintext => None,
        }
    }

    /// True when running without TLS.
    pub fn is_insecure(&self) -> bool {
        matches!(&*self.security, Security::InsecurePlaintext)
    }

    /// The authorization layer for a server of this plane.
    pub fn authorize(&self) -> AuthorizeLayer {
        AuthorizeLayer::new(self.identity().cloned(), self.is_insecure(), self.stats.clone())
    }

    /// What this plane's servers refused, for the role's `/metrics`.
    pub fn stats(&self) -> Arc<PlaneStats> {
        self.stats.clone()
    }
}

/// The `http://host:port` form of an address or URL (the plane's own TLS replaces the
/// scheme's; `https://` is accepted and means the same).
pub fn normalize_url(addr: &str) -> String {
    match addr.split_once("://") {
        Some(("https", rest)) => format!("http://{rest}"),
        Some(_) => addr.to_string(),
        None => format!("http://{addr}"),
    }
}

impl PartialEq for Plane {
    fn eq(&self, other: &Plane) -> bool {
        self.is_insecure() == other.is_insecure() && self.identity() == other.identity()
    }
}

impl Plane {
    /// The plane of a process whose flags name a certificate: `dir/NAME.pem`, `dir/NAME.key`
    /// and `dir/ca.pem`, which must name a `role` identity; or plaintext if the operator
    /// passed `--insecure-plaintext-internal`.
    pub fn from_flags(dir: &std::path::Path, name: &str, role: Role, insecure_plaintext: bool) -> Result<Plane, PlaneError> {
        let file = || dir.join(format!("{name}.pem")).display().to_string();
        Plane::checked(insecure_plaintext, || NodeTls::from_dir(dir, name), role, |id| id.role() == role, file)
    }

    /// The plane of a node called `name` in `role`, from the TLS identity it also uses on
    /// the KV transport: its certificate must let it act as that node. Plaintext if the
    /// operator passed `--insecure-plaintext-internal`.
    pub fn for_node(tls: &NodeTls, name: &str, role: Role, insecure_plaintext: bool) -> Result<Plane, PlaneError> {
        let fits = |id: &Identity| id.role() == role && id.may_act_as(name);
        Plane::checked(insecure_plaintext, || Ok(tls.clone()), role, fits, || format!("the certificate of {name}"))
    }

    /// Plaintext (with a warning) when asked for; else mutual TLS with the certificate
    /// `tls` gives, whose identity must pass `fits`.
    fn checked(
        insecure_plaintext: bool,
        tls: impl FnOnce() -> baton_identity::Result<NodeTls>,
        role: Role,
        fits: impl Fn(&Identity) -> bool,
        file: impl Fn() -> String,
    ) -> Result<Plane, PlaneError> {
        if insecure_plaintext {
            tracing::warn!("the internal plane runs WITHOUT TLS or identities (--insecure-plaintext-internal): anyone who reaches this process's ports may call it");
            return Ok(Plane::insecure_plaintext());
        }
        let plane = Plane::mtls(tls()?)?;
        let id = plane.identity().expect("an mTLS plane has an identity");
        if !fits(id) {
            return Err(PlaneError::WrongRole { file: file(), names: id.to_string(), role });
        }
        Ok(plane)
    }
}
