//! [`Role`] and [`Identity`]: what a certificate says its holder is.
//!
//! An identity is carried as a DNS subject alternative name `NAME.ROLE.baton`, the form
//! the Kubernetes pool certificates already use (`*.decode.baton` names every member of
//! the decode pool). Plain DNS names and IP addresses in the same certificate (the node
//! name the KV transport dials, `localhost`) are addresses, not identities.

use std::fmt;

use x509_parser::extensions::GeneralName;

use crate::error::{Error, Result};

/// The pseudo top-level domain of identity names.
pub const IDENTITY_DOMAIN: &str = "baton";

/// What a process is allowed to be in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Serves the public API; routes turns and runs them on decode nodes.
    Gateway,
    /// Holds membership and routes.
    Coordinator,
    /// Computes prompt tails and ships their KV.
    Prefill,
    /// Keeps conversations warm and generates replies.
    Decode,
    /// A person's admin tools (`baton drain`, inspection).
    Operator,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Gateway, Role::Coordinator, Role::Prefill, Role::Decode, Role::Operator];

    /// The role's label in identity names and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Coordinator => "coordinator",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Operator => "operator",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role and a name, as a certificate signed by the cluster CA states them. The name
/// `*` is a pool identity: any one member of that role's pool.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    role: Role,
    name: String,
}

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Identity {
    /// `name` is one DNS label (lowercase letters, digits, `-`) or `*` for a pool.
    pub fn new(role: Role, name: &str) -> Result<Identity> {
        if name != "*" && !is_label(name) {
            return Err(Error::InvalidName {
                name: name.to_string(),
                why: "an identity name is one DNS label: lowercase letters, digits and '-'",
            });
        }
        Ok(Identity { role, name: name.to_string() })
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// True for a pool identity (`*.ROLE.baton`).
    pub fn is_pool(&self) -> bool {
        self.name == "*"
    }

    /// The identity as a DNS name: `NAME.ROLE.baton`.
    pub fn dns_name(&self) -> String {
        format!("{}.{}.{IDENTITY_DOMAIN}", self.name, self.role)
    }

    /// Reads `NAME.ROLE.baton`; None for any other name (an address, not an identity).
    pub fn from_dns_name(dns: &str) -> Option<Identity> {
        let rest = dns.strip_suffix(IDENTITY_DOMAIN)?.strip_suffix('.')?;
        let (name, role) = rest.rsplit_once('.')?;
        let role = Role::parse(role)?;
        Identity::new(role, name).ok()
    }

    /// The one identity a DER certificate names. Its chain must have been checked against
    /// the cluster CA already (the TLS handshake does that).
    pub fn from_cert_der(der: &[u8]) -> Result<Identity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| Error::Parse(e.to_string()))?;
        let san = cert.subject_alternative_name().map_err(|e| Error::Parse(e.to_string()))?;
        let mut found: Option<Identity> = None;
        for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
            let GeneralName::DNSName(dns) = name else { continue };
            let Some(id) = Identity::from_dns_name(dns) else { continue };
            match &found {
                Some(f) if *f != id => return Err(Error::AmbiguousIdentity(f.dns_name(), id.dns_name())),
                _ => found = Some(id),
            }
        }
        found.ok_or(Error::NoIdentity)
    }

    /// The certificate's key: SHA-256 over its SubjectPublicKeyInfo. A node's name is bound
    /// to the key that first registered it, so a certificate re-issued for the same key
    /// (cert-manager's renewal) keeps the name, and a different key never takes it.
    pub fn key_of_cert_der(der: &[u8]) -> Result<[u8; 32]> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| Error::Parse(e.to_string()))?;
        let spki = cert.tbs_certificate.subject_pki.raw;
        let d = ring::digest::digest(&ring::digest::SHA256, spki);
        let mut out = [0u8; 32];
        out.copy_from_slice(d.as_ref());
        Ok(out)
    }

    /// Whether this identity may call itself `node` (a node's registered name): its own
    /// name or full identity name; for a pool, any `LABEL.ROLE.baton`. A pool member
    /// must use the full form, so it can never take the name of another role's node.
    pub fn may_act_as(&self, node: &str) -> bool {
        if self.is_pool() {
            return Identity::from_dns_name(node).is_some_and(|n| n.role == self.role && !n.is_pool());
        }
        node == self.name || node == self.dns_name()
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.role, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_names_round_trip_and_addresses_are_not_identities() {
        let id = Identity::from_dns_name("decode-0.decode.baton").unwrap();
        assert_eq!((id.role(), id.name()), (Role::Decode, "decode-0"));
        assert_eq!(id.dns_name(), "decode-0.decode.baton");
        assert!(Identity::from_dns_name("*.prefill.baton").unwrap().is_pool());
        for not in ["decode-0", "localhost", "a.b.decode.baton", "x.admin.baton", ".decode.baton", "X.decode.baton", "decode.baton"] {
            assert_eq!(Identity::from_dns_name(not), None, "{not}");
        }
    }

    #[test]
    fn names_a_node_may_use() {
        let exact = Identity::new(Role::Decode, "decode-0").unwrap();
        assert!(exact.may_act_as("decode-0"));
        assert!(exact.may_act_as("decode-0.decode.baton"));
        assert!(!exact.may_act_as("decode-1"));
        assert!(!exact.may_act_as("prefill-0"));
        let pool = Identity::new(Role::Decode, "*").unwrap();
        assert!(pool.may_act_as("pod-7.decode.baton"));
        assert!(!pool.may_act_as("pod-7"), "a pool member uses the full name");
        assert!(!pool.may_act_as("pod-7.prefill.baton"));
        assert!(!pool.may_act_as("*.decode.baton"));
    }
}
