//! Who is who in a Baton cluster.
//!
//! Owns: the cluster's identities ([`Identity`]: a [`Role`] and a name, read from a
//! certificate the cluster CA signed), development certificates ([`generate_dev_certs`],
//! for `baton certs`, `baton up` and tests), and the mutual-TLS configurations built from a
//! process's CA, chain and key ([`NodeTls`]) for the KV transport and the internal gRPC plane,
//! and the operators' [`AdminKey`] for HTTP endpoints a certificate cannot open.
//!
//! Invariants: an identity comes only from a certificate that chains to the cluster CA,
//! never from a field a caller fills in; a certificate names exactly one role; every TLS
//! config here is TLS 1.3 only and authenticates both ends.

mod admin_key;
mod certs;
mod error;
mod identity;
mod verify;

pub use admin_key::{AdminKey, ADMIN_KEY_ENV, MIN_ADMIN_KEY_BYTES};
pub use certs::{crypto_provider, generate_dev_certs, DevCerts, NodeCertPem, NodeTls};
pub use error::{Error, Result};
pub use identity::{Identity, Role, IDENTITY_DOMAIN};
pub use verify::Expect;
