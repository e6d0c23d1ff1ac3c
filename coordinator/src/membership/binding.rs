//! Which certificate holds which node name: the rule a registration must pass, as a pure
//! function of the live members.
//!
//! A name is bound to the key of the certificate that registered it
//! (`NodeInfo.identity_key`, which the coordinator fills in from the TLS handshake, never
//! from the request) for as long as its lease lives:
//! - a live name is never taken by another key;
//! - a node's own certificate (`decode-0.decode.baton`) holds one name at a time; it may
//!   register that name again (a restarted node replaces its own lease);
//! - a pool certificate (`*.decode.baton`, one key shared by every pod) is admitted only
//!   when the operator opts in (`--pool-certificate-names N`), holds at most N names, and
//!   never replaces a live lease: the key cannot tell one pod from another, so a name it
//!   holds is freed only by its lease's end (expiry, or a deregistration that names the
//!   lease's random ID, which only the pod that registered it learnt).
//!
//! In plaintext mode there are no keys and no binding.

use baton_vocab::{ErrorKind, HasKind};

use super::Member;

/// The certificate asking for a name.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    /// SHA-256 of the certificate's public key.
    pub key: &'a [u8],
    /// A pool (wildcard) certificate.
    pub pool: bool,
}

/// Why a registration may not take the name it asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("node {name:?} is held by a live lease of another certificate")]
    HeldByAnotherKey { name: String },
    #[error("node {name:?} holds a live lease of this pool certificate; a pool certificate never replaces a live lease (it cannot tell its pods apart): wait for the lease to end")]
    PoolLeaseLive { name: String },
    #[error("this certificate already holds node {held:?}; one node certificate holds one name")]
    OneNamePerCertificate { held: String },
    #[error("pool (wildcard) certificates may not register nodes here; issue each node its own certificate, or opt in with --pool-certificate-names")]
    PoolNotAdmitted,
    #[error("this pool certificate already holds {held} names, the limit (--pool-certificate-names {limit})")]
    PoolLimit { held: usize, limit: usize },
}

impl HasKind for Refusal {
    fn kind(&self) -> ErrorKind {
        match self {
            Refusal::HeldByAnotherKey { .. } | Refusal::PoolLeaseLive { .. } => ErrorKind::Conflict,
            Refusal::OneNamePerCertificate { .. } | Refusal::PoolNotAdmitted => ErrorKind::PermissionDenied,
            Refusal::PoolLimit { .. } => ErrorKind::ResourceExhausted,
        }
    }
}

/// Whether `who` may register `name` now, given the live `members`; `pool_limit` is the
/// operator's `--pool-certificate-names` (0: pool certificates are refused).
pub fn check(members: &[Member], name: &str, who: Claimant<'_>, pool_limit: usize) -> Result<(), Refusal> {
    if who.pool && pool_limit == 0 {
        return Err(Refusal::PoolNotAdmitted);
    }
    if let Some(live) = members.iter().find(|m| m.id() == name) {
        if live.info.identity_key != who.key {
            return Err(Refusal::HeldByAnotherKey { name: name.to_string() });
        }
        if who.pool {
            return Err(Refusal::PoolLeaseLive { name: name.to_string() });
        }
    }
    let mut others = members.iter().filter(|m| m.id() != name && m.info.identity_key == who.key);
    if who.pool {
        let held = others.count();
        if held >= pool_limit {
            return Err(Refusal::PoolLimit { held, limit: pool_limit });
        }
    } else if let Some(m) = others.next() {
        return Err(Refusal::OneNamePerCertificate { held: m.id().to_string() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_proto::common::{NodeId, NodeInfo};

    fn member(name: &str, key: u8) -> Member {
        let info = NodeInfo { node_id: Some(NodeId { id: name.into() }), identity_key: vec![key; 32], ..Default::default() };
        Member { lease_id: 1, info }
    }

    fn own(key: &[u8]) -> Claimant<'_> {
        Claimant { key, pool: false }
    }

    fn pool(key: &[u8]) -> Claimant<'_> {
        Claimant { key, pool: true }
    }

    #[test]
    fn a_live_name_is_never_taken_by_another_key() {
        let live = [member("decode-0", 1)];
        assert_eq!(check(&live, "decode-0", own(&[2; 32]), 0), Err(Refusal::HeldByAnotherKey { name: "decode-0".into() }));
        assert_eq!(check(&live, "decode-0", pool(&[2; 32]), 8), Err(Refusal::HeldByAnotherKey { name: "decode-0".into() }));
        // The same key (a restarted node) may register again; a free name is free.
        assert_eq!(check(&live, "decode-0", own(&[1; 32]), 0), Ok(()));
        assert_eq!(check(&live, "decode-1", own(&[2; 32]), 0), Ok(()));
    }

    #[test]
    fn a_node_certificate_holds_one_name() {
        let live = [member("decode-0", 1)];
        assert_eq!(
            check(&live, "decode-0.decode.baton", own(&[1; 32]), 0),
            Err(Refusal::OneNamePerCertificate { held: "decode-0".into() })
        );
    }

    #[test]
    fn pool_certificates_are_an_opt_in_with_a_limit_and_never_replace_a_lease() {
        assert_eq!(check(&[], "a.decode.baton", pool(&[3; 32]), 0), Err(Refusal::PoolNotAdmitted));
        let live = [member("a.decode.baton", 3), member("b.decode.baton", 3)];
        assert_eq!(check(&live, "c.decode.baton", pool(&[3; 32]), 3), Ok(()));
        assert_eq!(check(&live, "c.decode.baton", pool(&[3; 32]), 2), Err(Refusal::PoolLimit { held: 2, limit: 2 }));
        // One pod of the pool cannot take another pod's live name, though their keys are one.
        assert_eq!(check(&live, "a.decode.baton", pool(&[3; 32]), 8), Err(Refusal::PoolLeaseLive { name: "a.decode.baton".into() }));
    }
}
