//! The KV transport's side of the cluster identities (crate `baton-identity`): the same
//! CA, certificates and mutual-TLS configs as the internal plane, with the KV link's own
//! ALPN protocol, so a KV connection can never be mistaken for a gRPC one.

pub use baton_identity::{crypto_provider, generate_dev_certs, DevCerts, NodeCertPem, NodeTls};

/// ALPN protocol both ends of a KV link must speak.
pub const ALPN: &[u8] = b"baton-kv/1";
