//! RDMA transport placeholder (cargo feature `rdma`).
//!
//! Owns: nothing yet. The `ibverbs` crate (ibverbs-sys 0.3.2, which vendors rdma-core and
//! runs bindgen) does not build on the development machines: after installing libnl and
//! libclang, bindgen still fails on rdma-core's generated `infiniband/verbs_api.h`. Until it
//! does, every entry point fails with [`Error::RdmaUnavailable`], so a node configured for
//! RDMA refuses to start instead of silently falling back.
//! Invariants: never returns a working link.

use crate::error::{Error, Result};
use crate::transport::{BoxFuture, Connector, Link, Peer};

const REASON: &str = "this build has no RDMA data path (the ibverbs crate does not build here)";

/// Would open RDMA queue pairs to peers; today it only reports why it cannot.
pub struct RdmaConnector {
    _private: (),
}

impl RdmaConnector {
    /// Always fails with [`Error::RdmaUnavailable`].
    pub fn new() -> Result<Self> {
        Err(Error::RdmaUnavailable {
            reason: REASON.to_string(),
        })
    }
}

impl Connector for RdmaConnector {
    fn transport(&self) -> &'static str {
        "rdma"
    }

    fn open<'a>(&'a self, _peer: &'a Peer) -> BoxFuture<'a, Result<Link>> {
        Box::pin(async {
            Err(Error::RdmaUnavailable {
                reason: REASON.to_string(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fails_with_a_clear_error() {
        let e = super::RdmaConnector::new().err().unwrap();
        assert_eq!(e.kind(), "rdma_unavailable");
        assert!(e.to_string().contains("RDMA"));
    }
}
