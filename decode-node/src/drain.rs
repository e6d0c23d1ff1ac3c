//! Draining a decode node before it goes away (a rolling upgrade, a scale
//! down, a Kubernetes preStop hook): the node stops taking turns, leaves the
//! coordinator's ring, lets the running sequences finish, and hands every
//! warm conversation to its new owner, which pulls the prefix blocks over the
//! KV transport (`AdoptPrefix`). The conversation's next turn then starts
//! warm on the new owner instead of recomputing its whole history.
//!
//! Order matters: leaving the ring first means no new turn is routed here;
//! waiting for running sequences means their replies' blocks are published
//! before they are moved. The node shell does both (`NodeControl.Drain`) and
//! then calls [`Drainer::hand_over`]. Every step is bounded by the drain's
//! deadline; a conversation that could not move just starts cold, nothing is lost.

use std::sync::Arc;
use std::time::Instant;

use baton_engine::kv::ConversationId;
use baton_engine::Engine;
use baton_node_common::shell::{ControlHooks, Node};
use baton_proto::common::NodeId;
use baton_proto::Coordinators;
use baton_proto::coordinator::RouteDecodeRequest;
use baton_proto::node as pb;
use futures::StreamExt;
use tonic::Status;

use crate::metrics::Metrics;
use crate::warm::{WarmConversation, WarmTable};

/// Conversations moved at once.
const PARALLEL_MOVES: usize = 4;

/// What a drain hands over, and how; also forgets evicted conversations.
pub struct Drainer {
    engine: Arc<Engine>,
    warm: Arc<WarmTable>,
    coordinator: Option<Arc<Coordinators>>,
    /// How the drain reaches the conversations' new owners.
    plane: baton_proto::plane::Plane,
    node_id: String,
    /// This node's gRPC address as the new owners reach it (they pull from here).
    grpc_addr: String,
    metrics: Arc<Metrics>,
}

impl Drainer {
    pub fn new(node: &Node, warm: Arc<WarmTable>, metrics: Arc<Metrics>) -> Self {
        Drainer {
            engine: node.engine.clone(),
            warm,
            coordinator: node.coordinator.clone(),
            plane: node.plane.clone(),
            node_id: node.config.name.clone(),
            grpc_addr: node.grpc_addr.clone(),
            metrics,
        }
    }
}

#[tonic::async_trait]
impl ControlHooks for Drainer {
    fn evicting(&self, conversation: &ConversationId) {
        self.warm.remove(conversation);
    }

    /// Running turns get half the drain's deadline, moving the rest.
    fn hands_over(&self) -> bool {
        true
    }

    async fn hand_over(&self, out: &mut pb::DrainResponse, until: Instant) {
        let left = || until.saturating_duration_since(Instant::now());
        let Some(coordinator) = self.coordinator.clone() else {
            tracing::info!(warm = self.warm.len(), "drained without a coordinator: no new owners to hand conversations to");
            return;
        };
        let warm = self.warm.most_recent_first();
        tracing::info!(conversations = warm.len(), "handing warm conversations to their new owners");
        let moves = futures::stream::iter(warm)
            .map(|w| {
                let coordinator = coordinator.clone();
                let remaining = left();
                async move {
                    tokio::time::timeout(remaining, self.move_one(coordinator, w))
                        .await
                        .unwrap_or_else(|_| Err(Status::deadline_exceeded("drain deadline")))
                }
            })
            .buffer_unordered(PARALLEL_MOVES);
        futures::pin_mut!(moves);
        while let Some(r) = moves.next().await {
            match r {
                Ok(None) => {}
                Ok(Some(blocks)) => {
                    out.conversations_moved += 1;
                    out.blocks_moved += blocks;
                    self.metrics.migration("moved", blocks);
                }
                Err(e) => {
                    tracing::warn!(code = ?e.code(), message = e.message(), "a warm conversation could not move; its next turn starts cold");
                    out.conversations_failed += 1;
                    self.metrics.migration("failed", 0);
                }
            }
        }
        tracing::info!(moved = out.conversations_moved, failed = out.conversations_failed, blocks = out.blocks_moved, "drain done");
    }
}

impl Drainer {
    /// Moves one conversation; `None` when nothing of it is cached any more.
    async fn move_one(&self, coordinator: Arc<Coordinators>, w: WarmConversation) -> Result<Option<u64>, Status> {
        let engine = self.engine.clone();
        let (tokens, owner, platform) = (w.tokens.clone(), w.owner.clone(), w.platform_prefix_len.min(w.tokens.len()));
        let cached = baton_node_common::shell::blocking(move || engine.cached_prefix_tokens(&tokens, &owner, platform))
            .await?
            .map_err(|e| baton_proto::status(&e))?;
        if cached == 0 {
            return Ok(None);
        }
        let ask = RouteDecodeRequest {
            routing_key: w.conversation.as_str().to_string(),
            owner: w.owner.as_str().to_string(),
            prompt_tokens: (cached + 1) as u32,
            exclude: vec![NodeId { id: self.node_id.clone() }],
        };
        let routed = coordinator
            .call(|mut c| {
                let ask = ask.clone();
                async move { c.route_decode(ask).await }
            })
            .await?;
        let target = routed.node.ok_or_else(|| Status::unavailable("no decode node to move to"))?;
        if target.node_id.as_ref().is_some_and(|n| n.id == self.node_id) {
            return Err(Status::failed_precondition("the coordinator routed the conversation back to the draining node"));
        }
        // The node the coordinator chose, by its certificate, whatever its address says.
        let name = target.node_id.as_ref().map(|n| n.id.clone()).unwrap_or_default();
        let expect = baton_proto::plane::Expect::Node { role: baton_proto::plane::Role::Decode, name };
        let mut client = crate::handoff::adopt::connect(&self.plane, &target.grpc_addr, expect).await?;
        let adopt = pb::AdoptPrefixRequest {
            turn: Some(pb::Turn {
                prompt: w.tokens[..cached + 1].to_vec(),
                owner: w.owner.as_str().to_string(),
                platform_prefix_len: platform.min(cached + 1) as u32,
                conversation: w.conversation.as_str().to_string(),
            }),
            source: self.grpc_addr.clone(),
        };
        let r = client.adopt_prefix(adopt).await?.into_inner();
        let bt = self.engine.info.kv_layout.block_tokens as u64;
        Ok(Some(r.pulled_tokens as u64 / bt))
    }
}
