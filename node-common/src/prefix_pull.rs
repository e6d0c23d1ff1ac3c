//! Pulling a warm prefix's KV blocks from the decode node that holds them.
//!
//! Both node kinds do it: a decode node adopting a conversation it now owns
//! (after a drain or a join) and a prefill node that would otherwise recompute
//! a prefix the decode node has cached. The puller reserves staging blocks,
//! asks the holder (`ExportPrefix`) to ship the blocks into that reservation
//! over the KV transport, and hands the received bytes to its engine as an
//! import. Every wait is bounded by the caller's deadline, and the
//! reservation releases itself if the holder never finishes.

use std::time::{Duration, Instant};

use baton_engine::kv::OwnerId;
use baton_engine::KvImport;
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::plane::{Expect, Plane, Role};
use tonic::transport::Channel;
use tonic::Status;

use crate::kv::KvNode;

/// A client of the decode node at `addr` (host:port or URL); over mutual TLS, the
/// server must hold a decode identity.
pub async fn connect_decode_node(plane: &Plane, addr: &str) -> Result<DecodeNodeClient<Channel>, Status> {
    let endpoint = plane.endpoint(addr).map_err(|e| Status::invalid_argument(e.to_string()))?.connect_timeout(Duration::from_secs(2));
    let channel = plane
        .connect(&endpoint, Expect::Role(Role::Decode))
        .await
        .map_err(|e| Status::unavailable(format!("cannot reach the decode node at {addr}: {e}")))?;
    Ok(DecodeNodeClient::new(channel))
}

/// Pulls prefix blocks `[start_block, prefix.len() / block_tokens)` from the
/// decode node behind `client` into staging here, as an engine import.
pub async fn pull_prefix(
    kv: &KvNode,
    client: &mut DecodeNodeClient<Channel>,
    prefix: &[u32],
    owner: &OwnerId,
    platform: usize,
    start_block: usize,
    deadline: Duration,
) -> Result<KvImport, Status> {
    let bt = kv.layout.block_tokens as usize;
    let blocks = prefix.len() / bt - start_block;
    // The puller's engine computes on from the end of the pulled blocks.
    let reservation = kv.reserve_tail(start_block, blocks, (start_block + blocks) * bt, deadline).map_err(|e| Status::resource_exhausted(e.to_string()))?;
    // The holder is a decode node; a KV link from any other role's certificate is refused.
    reservation.only_from(Expect::Role(Role::Decode));
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
