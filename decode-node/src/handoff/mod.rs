//! Remote prefill, the decode node's side: ask the coordinator whether the
//! tail is prefilled here or remotely (it alone decides, short tails included), reserve
//! staging blocks for the uncached tail, ask a prefill node to compute and
//! ship it, and turn the received blocks plus the first token into an engine
//! import. Any failure (prefill node dead, deadline, bad data) ends in a
//! fallback to local prefill, and the reservation is released by the
//! transport (dropping the `Reservation` releases whatever was not taken).

pub mod adopt;

use baton_proto::plane::{Expect, Plane, Role as IdRole};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::{ImportedToken, KvImport, Request};
use baton_kv_transport::Reservation;
use baton_proto::coordinator::route_prefill_response::Choice;
use baton_proto::common::LoadReport;
use baton_proto::coordinator::RoutePrefillRequest;
use baton_proto::Coordinators;
use baton_proto::node::prefill_node_client::PrefillNodeClient;
use baton_proto::node::{PrefillRequest, Turn};

use baton_node_common::convert;
use baton_node_common::kv::KvNode;

pub use crate::error::Error as HandoffError;
pub use crate::kv_source::LocalWhy;

/// Where the tail of a turn is prefilled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Here, and why.
    Local(LocalWhy),
    /// A prefill node: its gRPC address, and its node name when the coordinator chose it
    /// (a static `--prefill-addr` has none).
    Remote {
        addr: String,
        node: Option<String>,
    },
}

/// Where the node learns whether to prefill locally or remotely.
#[derive(Clone, Debug)]
pub struct Router {
    /// The coordinator replicas, asked `RoutePrefill` for every tail (with failover): the
    /// one place the local-prefill policy (the short-tail threshold, a saturated pool) is
    /// decided. With none answering, the tail is prefilled here.
    pub coordinator: Option<Arc<Coordinators>>,
    /// Without a coordinator: this prefill node takes every tail.
    pub static_prefill: Option<String>,
    /// This node's ID, for the coordinator.
    pub node_id: String,
}

impl Router {
    /// Where `req`'s tail past `cached` tokens is prefilled; `load` is this node's
    /// load now (its ITL standing), for the coordinator's decision.
    pub async fn route(&self, req: &Request, cached: usize, load: LoadReport) -> Route {
        let tail = req.prompt.len() - cached;
        if tail == 0 {
            // Nothing to compute elsewhere (the engine recomputes the last token itself).
            return Route::Local(LocalWhy::NothingToPrefill);
        }
        if let Some(c) = &self.coordinator {
            let ask = RoutePrefillRequest {
                routing_key: req.conversation.as_ref().map(|c| c.as_str().to_string()).unwrap_or_default(),
                owner: req.owner.as_str().to_string(),
                prompt_tokens: req.prompt.len() as u32,
                cached_tokens: cached as u32,
                uncached_tokens: tail as u32,
                decode_node: Some(baton_proto::common::NodeId { id: self.node_id.clone() }),
                decode_load: Some(load),
            };
            let asked = c.call(|mut c| {
                let ask = ask.clone();
                async move { c.route_prefill(ask).await }
            });
            return match tokio::time::timeout(Duration::from_secs(2), asked).await {
                Ok(Ok(r)) => match r.choice {
                    Some(Choice::Remote(info)) => Route::Remote { node: info.node_id.map(|n| n.id), addr: info.grpc_addr },
                    _ => Route::Local(LocalWhy::Policy),
                },
                Ok(Err(e)) => {
                    tracing::warn!(code = ?e.status.code(), no_coordinator = e.unanswered, "RoutePrefill failed; prefilling locally");
                    Route::Local(LocalWhy::CoordinatorUnavailable)
                }
                Err(_) => Route::Local(LocalWhy::CoordinatorUnavailable),
            };
        }
        match &self.static_prefill {
            Some(a) => Route::Remote { addr: a.clone(), node: None },
            None => Route::Local(LocalWhy::NoPrefillPool),
        }
    }
}

/// What a remote prefill brought.
#[derive(Debug)]
pub struct Prefilled {
    /// The tail's blocks and first token, for the engine.
    pub import: KvImport,
    /// KV bytes the prefill node did not ship: sliding-window layers' blocks that no row
    /// this node computes reads (the grant skipped them).
    pub window_skipped_bytes: u64,
}

/// Has the prefill node at `addr` compute `req`'s tail past `cached` tokens
/// and ship it into staging blocks here; returns the engine import.
pub async fn remote_prefill(
    kv: &KvNode,
    plane: &Plane,
    req: &Request,
    cached: usize,
    (addr, node): (&str, Option<&str>),
    self_grpc: &str,
    deadline: Duration,
) -> Result<Prefilled, HandoffError> {
    let bt = kv.layout.block_tokens as usize;
    let start_block = cached / bt;
    let end = req.prompt.len().div_ceil(bt);
    let started = Instant::now();
    // The engine continues at the prompt's end (the imported first token): local layers'
    // blocks before that row's window are not shipped.
    let reservation: Reservation = kv.reserve_tail(start_block, end - start_block, req.prompt.len(), deadline).map_err(HandoffError::Reserve)?;
    let window_skipped_bytes = reservation.grant().skipped_bytes();
    // Only the prefill node asked may fill it: the grant travels inside the request, and a
    // KV link from any other certificate is refused.
    let expect = match node {
        Some(name) => Expect::Node { role: IdRole::Prefill, name: name.to_string() },
        None => Expect::Role(IdRole::Prefill),
    };
    reservation.only_from(expect.clone());
    let ask = PrefillRequest {
        turn: Some(Turn {
            prompt: req.prompt.clone(),
            owner: req.owner.as_str().to_string(),
            platform_prefix_len: req.platform_prefix_len as u32,
            conversation: req.conversation.as_ref().map(|c| c.as_str().to_string()).unwrap_or_default(),
        }),
        sampling: Some(convert::sampling_to_wire(req)),
        cached_tokens: (start_block * bt) as u32,
        grant: reservation.grant().to_bytes(),
        kv_endpoint: kv.endpoint.clone(),
        prefix_source: self_grpc.to_string(),
    };
    let call = async {
        let endpoint = plane.endpoint(addr).map_err(|e| HandoffError::Connect(e.to_string()))?.connect_timeout(Duration::from_secs(2));
        let channel = plane.connect(&endpoint, expect).await.map_err(|e| HandoffError::Connect(e.to_string()))?;
        PrefillNodeClient::new(channel).prefill(ask).await.map_err(HandoffError::Prefill)
    };
    let resp = match tokio::time::timeout(deadline, call).await {
        Err(_) => return Err(HandoffError::Deadline(deadline)),
        // The node had begun shipping here: the transfer is what broke.
        Ok(Err(HandoffError::Prefill(s))) if reservation.transfer_began() => return Err(HandoffError::Shipping(s)),
        Ok(r) => r?.into_inner(),
    };
    let first = resp.first_token.ok_or(HandoffError::NoFirstToken)?;
    let left = deadline.saturating_sub(started.elapsed());
    let blocks =
        tokio::time::timeout(left, reservation.finished()).await.map_err(|_| HandoffError::Deadline(deadline))?.map_err(HandoffError::Transfer)?;
    let import = KvImport {
        start_block,
        blocks: kv.take_blocks(&blocks).map_err(HandoffError::Transfer)?,
        first_token: Some(ImportedToken {
            id: first.id,
            logprob: first.logprob.unwrap_or(0.0),
            top_logprobs: first.top_logprobs.iter().map(|t| (t.id, t.logprob)).collect(),
        }),
    };
    Ok(Prefilled { import, window_skipped_bytes })
}
