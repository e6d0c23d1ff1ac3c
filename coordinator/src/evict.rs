//! Fleet-wide eviction of one conversation: every registered node is asked, in parallel,
//! to drop the conversation's KV from every tier; the answer lists every node's ack and
//! the nodes that may hold the KV but were not asked ([`crate::tombstones`]). A joining
//! node evicts every tombstoned conversation first ([`NodeEvictor::evict_all`]).

use std::time::Duration;

use async_trait::async_trait;
use baton_proto::common::{NodeInfo, Role};
use futures::{StreamExt, TryStreamExt};
use tonic::transport::Channel;
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use baton_proto::node::node_control_client::NodeControlClient;
use baton_proto::node::EvictRequest;

/// Asks one node to evict one conversation.
#[async_trait]
pub trait NodeEvictor: Send + Sync + 'static {
    /// The number of KV blocks freed, or why the node could not evict.
    async fn evict(&self, node: &NodeInfo, conversation: &str, owner: &str) -> Result<u64, EvictError>;

    /// Evicts every `(conversation, owner)` on one node, each within `timeout`; the
    /// blocks freed in all, or the first failure.
    async fn evict_all(&self, node: &NodeInfo, conversations: &[(String, String)], timeout: Duration) -> Result<u64, EvictError> {
        let mut freed = 0;
        for (conversation, owner) in conversations {
            freed += tokio::time::timeout(timeout, self.evict(node, conversation, owner)).await.map_err(|_| EvictError::Timeout(timeout))??;
        }
        Ok(freed)
    }
}

/// Evictions one joining node runs at once.
const JOIN_EVICT_CONCURRENCY: usize = 8;

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

impl GrpcEvictor {
    async fn channel(&self, node: &NodeInfo) -> Result<Channel, EvictError> {
        let endpoint = self.plane.endpoint(&node.grpc_addr).map_err(|e| EvictError::Unreachable(e.to_string()))?.connect_timeout(Duration::from_secs(2));
        let role = if node.role == Role::Prefill as i32 { IdRole::Prefill } else { IdRole::Decode };
        let expect = Expect::Node { role, name: crate::membership::node_id_of(node).to_string() };
        self.plane.connect(&endpoint, expect).await.map_err(|e| EvictError::Unreachable(e.to_string()))
    }
}

async fn evict_on(channel: Channel, conversation: &str, owner: &str) -> Result<u64, EvictError> {
    let req = EvictRequest { conversation: conversation.to_string(), owner: owner.to_string() };
    let resp = NodeControlClient::new(channel)
        .evict(req)
        .await
        .map_err(|s| EvictError::Refused(format!("{:?}: {}", s.code(), s.message())))?;
    Ok(resp.into_inner().blocks_freed)
}

#[async_trait]
impl NodeEvictor for GrpcEvictor {
    async fn evict(&self, node: &NodeInfo, conversation: &str, owner: &str) -> Result<u64, EvictError> {
        evict_on(self.channel(node).await?, conversation, owner).await
    }

    /// One connection for all of them (a joining node may owe many).
    async fn evict_all(&self, node: &NodeInfo, conversations: &[(String, String)], timeout: Duration) -> Result<u64, EvictError> {
        if conversations.is_empty() {
            return Ok(0);
        }
        let channel = tokio::time::timeout(timeout, self.channel(node)).await.map_err(|_| EvictError::Timeout(timeout))??;
        let calls: Vec<_> = conversations
            .iter()
            .cloned()
            .map(|(conversation, owner)| {
                let channel = channel.clone();
                Box::pin(async move {
                    tokio::time::timeout(timeout, evict_on(channel, &conversation, &owner)).await.map_err(|_| EvictError::Timeout(timeout))?
                })
            })
            .collect();
        let freed: Vec<u64> = futures::stream::iter(calls).buffer_unordered(JOIN_EVICT_CONCURRENCY).try_collect().await?;
        Ok(freed.into_iter().sum())
    }
}
