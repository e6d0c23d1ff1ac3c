//! Pulling a warm prefix's KV blocks from the decode node that holds them.
//!
//! Both node kinds do it: a decode node adopting a conversation it now owns
//! (after a drain or a join) and a prefill node that would otherwise recompute
//! a prefix the decode node has cached. The puller reserves staging blocks,
//! asks the holder (`ExportPrefix`) to ship the blocks into that reservation
//! over the KV transport, and hands the received bytes to its engine as an
//! import. Every wait is bounded by the caller's deadline, and the
//! reservation releases itself if the holder never finishes.
//!
//! What a peer sends is trusted no further than its source: a pull goes only to
//! the node that asked for it (or that the coordinator named), and never covers
//! the platform prefix, whose blocks every user reads.

use std::time::{Duration, Instant};

use baton_engine::kv::OwnerId;
use baton_engine::KvImport;
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::plane::authz::caller;
use baton_proto::plane::{Expect, Plane, Role};
use tonic::transport::Channel;
use tonic::Status;

use crate::kv::KvNode;

/// The decode node that made `req`, as a client dialling it back expects it: a prefix
/// is pulled only from the node that asked for the pull (the caller of `Prefill` or
/// `AdoptPrefix`), whatever address the request names. A pool certificate names no one
/// node, so its holder is any decode node (pool certificates are an opt-in,
/// docs/SECURITY.md); plaintext mode has no identities.
pub fn expect_caller<T>(req: &tonic::Request<T>) -> Expect {
    match caller(req) {
        Some(id) if id.role() == Role::Decode && !id.is_pool() => Expect::Node { role: Role::Decode, name: id.name().to_string() },
        _ => Expect::Role(Role::Decode),
    }
}

/// The first block of a prompt that may be imported from another node: blocks wholly
/// inside the platform prefix get platform scope (every user's turns read them), so they
/// are only ever computed here, never taken from a peer (`baton_engine::kv::hash`).
pub fn first_importable_block(platform_prefix_len: usize, block_tokens: usize) -> usize {
    platform_prefix_len / block_tokens.max(1)
}

/// A client of the decode node at `addr` (host:port or URL); over mutual TLS, the
/// server must be the one `expect` names, whatever address was dialled.
pub async fn connect_decode_node(plane: &Plane, addr: &str, expect: Expect) -> Result<DecodeNodeClient<Channel>, Status> {
    let endpoint = plane.endpoint(addr).map_err(|e| Status::invalid_argument(e.to_string()))?.connect_timeout(Duration::from_secs(2));
    let channel = plane
        .connect(&endpoint, expect)
        .await
        .map_err(|e| Status::unavailable(format!("cannot reach the decode node at {addr}: {e}")))?;
    Ok(DecodeNodeClient::new(channel))
}

/// Pulls prefix blocks `[start_block, prefix.len() / block_tokens)` from the
/// decode node behind `client` (`holder`: the KV link must come from it too) into
/// staging here, as an engine import. Refused if any of those blocks lies inside the
/// platform prefix ([`first_importable_block`]).
#[allow(clippy::too_many_arguments)]
pub async fn pull_prefix(
    kv: &KvNode,
    client: &mut DecodeNodeClient<Channel>,
    holder: Expect,
    prefix: &[u32],
    owner: &OwnerId,
    platform: usize,
    start_block: usize,
    deadline: Duration,
) -> Result<KvImport, Status> {
    let bt = kv.layout.block_tokens as usize;
    if start_block < first_importable_block(platform, bt) {
        return Err(Status::failed_precondition("the platform prefix is computed here, never pulled from a peer"));
    }
    let blocks = (prefix.len() / bt).saturating_sub(start_block);
    if blocks == 0 {
        return Err(Status::invalid_argument("nothing to pull"));
    }
    // The puller's engine computes on from the end of the pulled blocks.
    let reservation = kv.reserve_tail(start_block, blocks, (start_block + blocks) * bt, deadline).map_err(|e| Status::resource_exhausted(e.to_string()))?;
    // Only the holder asked may fill it; a KV link from any other certificate is refused.
    reservation.only_from(holder);
    let ask = pb::ExportPrefixRequest {
        tokens: prefix.to_vec(),
        owner: owner.as_str().to_string(),
        platform_prefix_len: platform.min(prefix.len()) as u32,
        start_block: start_block as u32,
        grant: reservation.grant().to_bytes(),
        kv_endpoint: kv.endpoint.clone(),
    };
    let started = Instant::now();
    tokio::time::timeout(deadline, client.export_prefix(ask)).await.map_err(|_| Status::deadline_exceeded("prefix pull"))??;
    let ids = tokio::time::timeout(deadline.saturating_sub(started.elapsed()), reservation.finished())
        .await
        .map_err(|_| Status::deadline_exceeded("prefix pull"))?
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let bytes = kv.take_blocks(&ids).map_err(|e| Status::internal(e.to_string()))?;
    Ok(KvImport { start_block, blocks: bytes, first_token: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_identity::Identity;
    use baton_proto::plane::authz::Caller;

    fn from(role: Role, name: &str) -> tonic::Request<()> {
        let mut req = tonic::Request::new(());
        req.extensions_mut().insert(Caller(Identity::new(role, name).unwrap()));
        req
    }

    #[test]
    fn a_pull_goes_only_to_the_node_that_asked() {
        let want = Expect::Node { role: Role::Decode, name: "decode-1".into() };
        assert_eq!(expect_caller(&from(Role::Decode, "decode-1")), want);
        // Whoever answers at the address the request names must be decode-1.
        let other = Identity::new(Role::Decode, "decode-2").unwrap();
        assert!(!want.admits(&other));
        // A pool key names no one node; plaintext mode has no identities.
        assert_eq!(expect_caller(&from(Role::Decode, "*")), Expect::Role(Role::Decode));
        assert_eq!(expect_caller(&tonic::Request::new(())), Expect::Role(Role::Decode));
    }

    #[test]
    fn the_platform_prefix_is_never_imported() {
        // Blocks wholly inside the platform prefix have platform scope.
        assert_eq!(first_importable_block(0, 16), 0);
        assert_eq!(first_importable_block(15, 16), 0);
        assert_eq!(first_importable_block(16, 16), 1);
        assert_eq!(first_importable_block(40, 16), 2);
    }
}
