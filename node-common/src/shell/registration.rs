//! A node's membership: registration with the coordinator, the lease kept
//! alive with its load, and `/healthz`'s readiness following it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use baton_engine::Engine;
use baton_proto::client::{MembershipClient, MembershipHandle};
use baton_proto::common::{LoadReport, NodeId, NodeInfo, Role};
use baton_proto::plane::Role as IdRole;

use super::Node;

/// Registers the node when it has a coordinator; it is ready while registered
/// and not draining.
pub(super) fn register(node: &Node, role: IdRole, kv_endpoint: &str, ready: &Arc<AtomicBool>) -> Option<MembershipHandle> {
    if node.config.coordinators.is_empty() {
        return None;
    }
    let role = match role {
        IdRole::Decode => Role::Decode,
        IdRole::Prefill => Role::Prefill,
        other => unreachable!("a node is a decode or a prefill node, not {other}"),
    };
    let info = NodeInfo {
        node_id: Some(NodeId { id: node.config.name.clone() }),
        role: role as i32,
        grpc_addr: node.grpc_addr.clone(),
        kv_endpoint: kv_endpoint.to_string(),
        block_tokens: node.kv.layout.block_tokens,
        kv_blocks_total: node.engine.info.kv_blocks as u64,
        load: None,
        identity_key: Vec::new(),
    };
    let e = node.engine.clone();
    let handle = MembershipClient::replicas(node.config.coordinators.clone(), info, node.plane.clone()).with_load(move || load_report(&e)).spawn();
    let mut watch = handle.watch();
    let (ready, draining) = (ready.clone(), node.draining.clone());
    tokio::spawn(async move {
        loop {
            let registered = watch.borrow_and_update().lease_id.is_some();
            ready.store(registered && !draining.load(Ordering::SeqCst), Ordering::SeqCst);
            if watch.changed().await.is_err() {
                break;
            }
        }
    });
    Some(handle)
}

/// The load a node reports with each keep-alive (and a decode node with each
/// `RoutePrefill`), its ITL standing included.
pub fn load_report(engine: &Engine) -> LoadReport {
    let st = engine.stats();
    LoadReport {
        kv_blocks_free: st.kv.allocatable as u64,
        running: st.running as u32,
        waiting: st.waiting as u32,
        itl_target_seconds: engine.info.itl_target.map_or(0.0, |t| t.as_secs_f64()),
        step_p95_seconds: st.step_p95_seconds,
        prefill_budget_tokens: u32::try_from(st.prefill_budget_tokens).unwrap_or(u32::MAX),
    }
}
