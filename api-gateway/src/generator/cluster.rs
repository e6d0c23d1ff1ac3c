//! [`ClusterGenerator`]: the gateway in front of the cluster. Each turn asks
//! the coordinator which decode node serves the conversation (`RouteDecode`)
//! and streams `DecodeNode.Generate` from it.
//!
//! A decode node that cannot be reached, or whose stream breaks, is
//! remembered for a short while and excluded from the next routing, so the
//! caller's retry lands on another node. HTTP/2 keep-alives bound how long a
//! silent dead node can hold a stream open (a killed process on a reachable
//! host is seen at once, from the connection reset). Dropping the returned
//! stream resets the gRPC stream, which cancels the sequence on the node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_text::{FinishReason, TokenOut, Usage};
use baton_proto::common::NodeId as WireNodeId;
use baton_proto::ids;
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::{EvictConversationRequest, RouteDecodeRequest};
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use futures::StreamExt;
use baton_proto::plane::{Expect, Plane, Role};
use baton_vocab::{ConversationId, NodeId};
use tonic::transport::Channel;
use baton_vocab::ErrorKind;

use super::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};

/// How long a failed decode node stays excluded from routing.
const EXCLUDE_FOR: Duration = Duration::from_secs(10);

/// Timeouts of the generator's connections.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Connecting to the coordinator or a decode node.
    pub connect_timeout: Duration,
    /// Coordinator calls (routing, eviction).
    pub request_timeout: Duration,
    /// HTTP/2 keep-alive ping interval on decode-node connections; a node
    /// that does not answer within `keepalive_timeout` fails the stream.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(2),
        }
    }
}

/// A [`Generator`] over the cluster: coordinator routing plus decode-node streams.
pub struct ClusterGenerator {
    coordinator: CoordinatorClient<Channel>,
    config: ClusterConfig,
    plane: Plane,
    /// Decode nodes that failed recently, by node ID.
    failed: Arc<Mutex<HashMap<String, Instant>>>,
    /// One HTTP/2 connection per decode node (ID, address), reused by every turn routed
    /// there (a TLS handshake per turn would cost more than the routing); dropped when a
    /// turn finds the node unreachable.
    channels: Mutex<HashMap<(String, String), Channel>>,
}

impl ClusterGenerator {
    /// `coordinator_url` like `http://127.0.0.1:7100`, reached over `plane` (the server
    /// must hold a coordinator identity; decode nodes the identity they registered as).
    /// Connects lazily.
    pub fn new(coordinator_url: &str, config: ClusterConfig, plane: Plane) -> Result<Self, GenerateError> {
        let endpoint = plane
            .endpoint(coordinator_url)
            .map_err(|e| GenerateError::Internal(format!("bad coordinator URL: {e}")))?
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout);
        let channel = plane.connect_lazy(&endpoint, Expect::Role(Role::Coordinator)).map_err(|e| GenerateError::Internal(e.to_string()))?;
        Ok(ClusterGenerator { coordinator: CoordinatorClient::new(channel), config, plane, failed: Arc::default(), channels: Mutex::default() })
    }

    /// The cached connection to decode node `id` at `addr`, or a new one.
    async fn decode_channel(&self, id: &str, addr: &str) -> Result<Channel, GenerateError> {
        let key = (id.to_string(), addr.to_string());
        if let Some(c) = self.channels.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(c.clone());
        }
        let endpoint = self
            .plane
            .endpoint(addr)
            .map_err(|e| GenerateError::Internal(format!("bad decode node address: {e}")))?
            .connect_timeout(self.config.connect_timeout)
            .http2_keep_alive_interval(self.config.keepalive_interval)
            .keep_alive_timeout(self.config.keepalive_timeout)
            .keep_alive_while_idle(true);
        let expect = Expect::Node { role: Role::Decode, name: id.to_string() };
        let channel = self
            .plane
            .connect(&endpoint, expect)
            .await
            .map_err(|e| GenerateError::Unavailable(format!("cannot reach the decode node: {e}: {:?}", std::error::Error::source(&e))))?;
        self.channels.lock().unwrap_or_else(|p| p.into_inner()).insert(key, channel.clone());
        Ok(channel)
    }

    fn forget_channel(&self, id: &str, addr: &str) {
        self.channels.lock().unwrap_or_else(|p| p.into_inner()).remove(&(id.to_string(), addr.to_string()));
    }

    fn excluded(&self) -> Vec<WireNodeId> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.retain(|_, at| at.elapsed() < EXCLUDE_FOR);
        failed.keys().map(|id| WireNodeId { id: id.clone() }).collect()
    }

    /// The chosen decode node's ID and address, and the address of the node the
    /// conversation lived on before a join moved it (its warm prefix is there).
    async fn route(&self, req: &GenerateRequest) -> Result<(NodeId, String, String), GenerateError> {
        let ask = RouteDecodeRequest {
            routing_key: req.conversation.as_str().to_string(),
            owner: req.owner.as_str().to_string(),
            prompt_tokens: req.prompt.len() as u32,
            exclude: self.excluded(),
        };
        let r = self.coordinator.clone().route_decode(ask).await.map_err(status_error)?.into_inner();
        let node = r.node.ok_or_else(|| GenerateError::Unavailable("no decode node".into()))?;
        // A coordinator that names no valid node is not the client's fault: unavailable.
        let id = ids::node(node.node_id.map(|n| n.id).unwrap_or_default())
            .map_err(|e| GenerateError::Unavailable(format!("the coordinator named no valid decode node: {}", e.message())))?;
        let previous = r.previous.map(|p| p.grpc_addr).unwrap_or_default();
        Ok((id, node.grpc_addr, previous))
    }

    async fn open(&self, id: &NodeId, addr: &str, prefix_source: String, req: &GenerateRequest) -> Result<tonic::Streaming<pb::GenerateEvent>, GenerateError> {
        let channel = self.decode_channel(id.as_str(), addr).await?;
        let s = &req.sampling;
        let wire = pb::GenerateRequest {
            turn: Some(pb::Turn {
                prompt: req.prompt.clone(),
                owner: req.owner.as_str().to_string(),
                platform_prefix_len: req.platform_prefix_len as u32,
                conversation: req.conversation.as_str().to_string(),
            }),
            sampling: Some(pb::SamplingParams {
                temperature: s.temperature,
                top_k: s.top_k as u32,
                top_p: s.top_p,
                seed: s.seed,
                max_tokens: s.max_tokens as u32,
                stop_token_ids: s.stop_token_ids.clone(),
                stop_strings: s.stop_strings.clone(),
                logprobs: s.logprobs,
                top_logprobs: s.top_logprobs as u32,
                ignore_eos: false,
            }),
            prefix_source,
        };
        match DecodeNodeClient::new(channel).generate(wire).await.map_err(status_error) {
            Ok(r) => Ok(r.into_inner()),
            Err(e) => {
                if matches!(e, GenerateError::Unavailable(_)) {
                    self.forget_channel(id.as_str(), addr);
                }
                Err(e)
            }
        }
    }

    fn mark_failed(failed: &Mutex<HashMap<String, Instant>>, id: &str) {
        if !id.is_empty() {
            failed.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string(), Instant::now());
        }
    }
}

#[async_trait::async_trait]
impl Generator for ClusterGenerator {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        req.sampling.clone().validate().map_err(|e| GenerateError::BadRequest(e.to_string()))?;
        let started = Instant::now();
        // One immediate retry on another node when the chosen one is unreachable.
        let mut last = None;
        let mut opened = None;
        for _ in 0..2 {
            let (id, addr, previous) = self.route(&req).await?;
            match self.open(&id, &addr, previous, &req).await {
                Ok(s) => {
                    opened = Some((id.into_string(), s));
                    break;
                }
                Err(e @ GenerateError::Unavailable(_)) => {
                    tracing::warn!(node = %id, "decode node unreachable; excluding it");
                    Self::mark_failed(&self.failed, id.as_str());
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        let Some((node, stream)) = opened else {
            return Err(last.unwrap_or_else(|| GenerateError::Unavailable("no decode node".into())));
        };
        let failed = self.failed.clone();
        let events = futures::stream::unfold(Some(stream), move |state| {
            let failed = failed.clone();
            let node = node.clone();
            async move {
                let mut s = state?;
                match s.next().await {
                    Some(Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Token(t)) })) => {
                        let out = TokenOut {
                            id: t.id,
                            text: t.text,
                            logprob: t.logprob,
                            top_logprobs: t.top_logprobs.into_iter().map(|x| (x.id, x.logprob)).collect(),
                            elapsed: started.elapsed(),
                        };
                        Some((GenEvent::Token(out), Some(s)))
                    }
                    Some(Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Finished(f)) })) => {
                        let u = f.usage.unwrap_or_default();
                        let usage = Usage {
                            prompt_tokens: u.prompt_tokens as usize,
                            cached_tokens: u.cached_tokens as usize,
                            completion_tokens: u.completion_tokens as usize,
                        };
                        let reason = match pb::FinishReason::try_from(f.reason) {
                            Ok(pb::FinishReason::Length) => FinishReason::Length,
                            Ok(pb::FinishReason::Cancelled) => FinishReason::Cancelled,
                            _ => FinishReason::Stop,
                        };
                        Some((GenEvent::Finished { reason, usage, trailing_text: f.trailing_text }, None))
                    }
                    Some(Ok(pb::GenerateEvent { event: None })) => {
                        Some((GenEvent::Failed(GenerateError::Internal("empty event from the decode node".into())), None))
                    }
                    Some(Err(status)) => {
                        let e = status_error(status);
                        if matches!(e, GenerateError::Unavailable(_)) {
                            Self::mark_failed(&failed, &node);
                        }
                        Some((GenEvent::Failed(e), None))
                    }
                    None => {
                        Self::mark_failed(&failed, &node);
                        Some((GenEvent::Failed(GenerateError::Unavailable("the decode node went away".into())), None))
                    }
                }
            }
        });
        Ok(Box::pin(events))
    }

    async fn evict_conversation(&self, conversation: &ConversationId) -> Result<Eviction, GenerateError> {
        let ask = EvictConversationRequest { routing_key: conversation.as_str().to_string(), owner: String::new() };
        let r = self.coordinator.clone().evict_conversation(ask).await.map_err(status_error)?.into_inner();
        let id = |n: Option<WireNodeId>| n.map(|n| n.id).unwrap_or_default();
        let mut out = Eviction::default();
        for a in r.acks {
            if a.ok {
                out.acked.push(id(a.node_id));
            } else {
                tracing::warn!(conversation = %conversation, node = ?a.node_id.as_ref().map(|n| &n.id), error = %a.error, "a node did not evict");
                out.owed.push(id(a.node_id));
            }
        }
        out.owed.extend(r.pending.into_iter().map(|n| n.id));
        Ok(out)
    }
}

/// The one place a gRPC status becomes a gateway error, by its kind
/// ([`baton_proto::kind_of`]): a dead, slow or cancelled call is the cluster being
/// unavailable (the client may retry), a kind the gateway cannot act on is internal.
fn status_error(s: tonic::Status) -> GenerateError {
    match baton_proto::kind_of(s.code()) {
        ErrorKind::InvalidArgument => GenerateError::BadRequest(s.message().to_string()),
        ErrorKind::ResourceExhausted => GenerateError::Overloaded { retry_after: Duration::from_secs(1) },
        ErrorKind::Unavailable | ErrorKind::DeadlineExceeded | ErrorKind::Cancelled => GenerateError::Unavailable(s.message().to_string()),
        _ => GenerateError::Internal(format!("{:?}: {}", s.code(), s.message())),
    }
}
