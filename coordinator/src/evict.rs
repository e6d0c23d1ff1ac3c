//! Fleet-wide eviction of one conversation: every registered node is asked, in parallel,
//! to drop the conversation's KV from every tier; the answer lists every node's ack.

use std::time::Duration;

use async_trait::async_trait;
use baton_proto::common::{NodeInfo, Role};
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use baton_proto::node::node_control_client::NodeControlClient;
use baton_proto::node::EvictRequest;

/// Asks one node to evict one conversation.
#[async_trait]
pub trait NodeEvictor: Send + Sync + 'static {
    /// The number of KV blocks freed, or why the node could not evict.
    async fn evict(&self, node: &NodeInfo, conversation: &str, owner: &str) -> Result<u64, EvictError>;
}

/// Why one node did not acknowledge an eviction.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EvictError {
    #[error("cannot reach the node: {0}")]
    Unreachable(String),
    #[error("the node refused: {0}")]
    Refused(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// The real evictor: `NodeControl.Evict` over gRPC at the node's `grpc_addr`.
#[derive(Debug, Clone)]
pub struct GrpcEvictor {
    plane: Plane,
}

impl GrpcEvictor {
    /// Calls nodes over `plane` (each must hold the identity of the node it registered as).
    pub fn new(plane: Plane) -> Self {
        GrpcEvictor { plane }
    }
}

#[async_trait]
impl NodeEvictor for GrpcEvictor {
    async fn evict(&self, node: &NodeInfo, conversation: &str, owner: &str) -> Result<u64, EvictError> {
        let endpoint = self.plane.endpoint(&node.grpc_addr).map_err(|e| EvictError::Unreachable(e.to_string()))?.connect_timeout(Duration::from_secs(2));
        let role = if node.role == Role::Prefill as i32 { IdRole::Prefill } else { IdRole::Decode };
        let expect = Expect::Node { role, name: crate::membership::node_id_of(node).to_string() };
        let channel = self.plane.connect(&endpoint, expect).await.map_err(|e| EvictError::Unreachable(e.to_string()))?;
        let req = EvictRequest { conversation: conversation.to_string(), owner: owner.to_string() };
        let resp = NodeControlClient::new(channel)
            .evict(req)
            .await
            .map_err(|s| EvictError::Refused(format!("{:?}: {}", s.code(), s.message())))?;
        Ok(resp.into_inner().blocks_freed)
    }
}
