//! [`ClusterGenerator`]: the gateway in front of the cluster. Each turn asks
//! the coordinator which decode node serves the conversation (`RouteDecode`)
//! and streams `DecodeNode.Generate` from it.
//!
//! The gateway knows every coordinator replica and fails over between them within the
//! turn ([`Coordinators::call`]). When none answers, the turn is routed on the last
//! known membership ([`LastKnown`], refreshed in the background) for at most
//! [`ClusterConfig::degraded_for`]; `/healthz` and `baton_gateway_routing_degraded` say so.
//!
//! A decode node that cannot be reached, or whose stream breaks, is
//! remembered for a short while and excluded from the next routing, so the
//! caller's retry lands on another node. HTTP/2 keep-alives bound how long a
//! silent dead node can hold a stream open (a killed process on a reachable
//! host is seen at once, from the connection reset). Dropping the returned
//! stream resets the gRPC stream, which cancels the sequence on the node.
//!
//! The decode node says on a turn's first token where its prompt KV came from (imported,
//! pulled, warm or recomputed, and why); the gateway counts it as
//! `baton_gateway_kv_source_total`, mapped to a fixed label set whatever the node sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use baton_text::{FinishReason, TokenOut, Usage};
use baton_proto::common::NodeId as WireNodeId;
use baton_proto::ids;
use baton_proto::common::{NodeInfo, Role as WireRole};
use baton_proto::coordinator::{EvictConversationRequest, ListNodesRequest, RouteDecodeRequest};
use baton_proto::Coordinators;
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use futures::StreamExt;
use baton_proto::plane::{Expect, Plane, Role};
use baton_vocab::{ConversationId, NodeId};
use tonic::transport::Channel;
use baton_vocab::ErrorKind;

use super::fallback::{LastKnown, NoFallback};
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
    /// How long after the last coordinator answer turns may still be routed on the last
    /// known membership (`--degraded-routing-for`).
    pub degraded_for: Duration,
    /// How often the decode nodes are listed in the background, for that membership.
    pub membership_refresh: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(2),
            degraded_for: Duration::from_secs(60),
            membership_refresh: Duration::from_secs(2),
        }
    }
}

/// A [`Generator`] over the cluster: coordinator routing plus decode-node streams.
pub struct ClusterGenerator {
    coordinators: Arc<Coordinators>,
    /// The membership and placements to route on when no coordinator answers.
    last_known: Arc<Mutex<LastKnown>>,
    /// True while no coordinator answers.
    degraded: Arc<AtomicBool>,
    /// The background membership refresh; stopped when the generator is dropped.
    refresher: Option<tokio::task::JoinHandle<()>>,
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
    /// Every coordinator replica's URL, like `http://127.0.0.1:7100`, reached over
    /// `plane` (the servers must hold a coordinator identity; decode nodes the identity
    /// they registered as). Connects lazily; inside a tokio runtime, starts listing the
    /// decode nodes in the background.
    pub fn new(coordinator_urls: &[String], config: ClusterConfig, plane: Plane) -> Result<Self, GenerateError> {
        let coordinators = Coordinators::connect_lazy(coordinator_urls, &plane, config.connect_timeout, Some(config.request_timeout))
            .map_err(|e| GenerateError::Internal(format!("bad coordinator URL: {e}")))?;
        if coordinators.is_empty() {
            return Err(GenerateError::Internal("no coordinator URL".into()));
        }
        let coordinators = Arc::new(coordinators);
        let last_known = Arc::new(Mutex::new(LastKnown::new(1 << 20)));
        let degraded = Arc::new(AtomicBool::new(false));
        let refresher = tokio::runtime::Handle::try_current().ok().map(|rt| {
            rt.spawn(refresh_membership(coordinators.clone(), Arc::downgrade(&last_known), degraded.clone(), config.membership_refresh))
        });
        Ok(ClusterGenerator { coordinators, last_known, degraded, refresher, config, plane, failed: Arc::default(), channels: Mutex::default() })
    }

    fn last_known(&self) -> std::sync::MutexGuard<'_, LastKnown> {
        self.last_known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A turn's node when no coordinator answers: see [`LastKnown::route`].
    fn route_without_coordinator(&self, req: &GenerateRequest, exclude: &[WireNodeId]) -> Result<NodeInfo, GenerateError> {
        let exclude: Vec<String> = exclude.iter().map(|n| n.id.clone()).collect();
        let window = self.config.degraded_for;
        let chosen = self.last_known().route(req.conversation.as_str(), &exclude, Instant::now(), window);
        set_degraded(&self.degraded, true);
        match chosen {
            Ok(node) => {
                crate::metrics::degraded_turn();
                tracing::warn!(node = ?node.node_id.as_ref().map(|n| &n.id), "no coordinator answers; routing on the last known membership");
                Ok(node)
            }
            Err(NoFallback::Stale) => Err(GenerateError::Unavailable(format!(
                "no coordinator answers, and the last known membership is older than {window:?}"
            ))),
            Err(NoFallback::NoNode) => Err(GenerateError::Unavailable("no coordinator answers, and no last known decode node is usable".into())),
        }
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
    /// conversation lived on before a join moved it and the name its certificate bears
    /// (its warm prefix is there).
    async fn route(&self, req: &GenerateRequest) -> Result<(NodeId, String, (String, String)), GenerateError> {
        let ask = RouteDecodeRequest {
            routing_key: req.conversation.as_str().to_string(),
            owner: req.owner.as_str().to_string(),
            prompt_tokens: req.prompt.len() as u32,
            exclude: self.excluded(),
        };
        let exclude = ask.exclude.clone();
        let routed = self
            .coordinators
            .call(|mut c| {
                let ask = ask.clone();
                async move { c.route_decode(ask).await }
            })
            .await;
        let (node, previous) = match routed {
            Ok(r) => {
                let node = r.node.ok_or_else(|| GenerateError::Unavailable("no decode node".into()))?;
                let mut known = self.last_known();
                known.heard(Instant::now());
                known.placed(req.conversation.as_str(), ids::node_name(&node));
                drop(known);
                set_degraded(&self.degraded, false);
                (node, r.previous)
            }
            Err(e) if e.unanswered => (self.route_without_coordinator(req, &exclude)?, None),
            Err(e) => return Err(status_error(e.status)),
        };
        // A coordinator that names no valid node is not the client's fault: unavailable.
        let id = ids::node(node.node_id.map(|n| n.id).unwrap_or_default())
            .map_err(|e| GenerateError::Unavailable(format!("the coordinator named no valid decode node: {}", e.message())))?;
        // Where the moved conversation's warm prefix is: the previous node's address and
        // the name its certificate must bear (the decode node pulls from no one else).
        let previous = previous.map(|p| (p.grpc_addr, p.node_id.map(|n| n.id).unwrap_or_default())).unwrap_or_default();
        Ok((id, node.grpc_addr, previous))
    }

    async fn open(&self, id: &NodeId, addr: &str, (prefix_source, prefix_source_node): (String, String), req: &GenerateRequest) -> Result<tonic::Streaming<pb::GenerateEvent>, GenerateError> {
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
            prefix_source_node,
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
                let next = s.next().await;
                if let Some(Ok(pb::GenerateEvent { kv_source: Some(k), .. })) = &next {
                    // Proof of transfer: a peer's claim, counted only under the fixed labels.
                    let (outcome, reason) = baton_proto::kv_source::labels(k);
                    crate::metrics::kv_source(outcome, reason);
                    tracing::debug!(node = %node, outcome, reason, "turn KV source");
                }
                match next {
                    Some(Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Token(t)), .. })) => {
                        let out = TokenOut {
                            id: t.id,
                            text: t.text,
                            logprob: t.logprob,
                            top_logprobs: t.top_logprobs.into_iter().map(|x| (x.id, x.logprob)).collect(),
                            elapsed: started.elapsed(),
                        };
                        Some((GenEvent::Token(out), Some(s)))
                    }
                    Some(Ok(pb::GenerateEvent { event: Some(pb::generate_event::Event::Finished(f)), .. })) => {
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
                    Some(Ok(pb::GenerateEvent { event: None, .. })) => {
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
        let r = self
            .coordinators
            .call(|mut c| {
                let ask = ask.clone();
                async move { c.evict_conversation(ask).await }
            })
            .await
            .map_err(|e| status_error(e.status))?;
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

    fn degraded(&self) -> Option<String> {
        if !self.degraded.load(Ordering::Relaxed) {
            return None;
        }
        let window = self.config.degraded_for;
        Some(match self.last_known().silent_for(Instant::now()) {
            Some(silent) if silent <= window => format!(
                "degraded: no coordinator answers; routing on the membership of {}s ago for at most {}s",
                silent.as_secs(),
                window.as_secs()
            ),
            _ => "degraded: no coordinator answers and the last known membership is too old to route on".to_string(),
        })
    }
}

impl Drop for ClusterGenerator {
    fn drop(&mut self) {
        if let Some(t) = self.refresher.take() {
            t.abort();
        }
    }
}

/// Flips the degraded state, and its gauge when it changes.
fn set_degraded(flag: &AtomicBool, degraded: bool) {
    if flag.swap(degraded, Ordering::Relaxed) != degraded {
        crate::metrics::routing_degraded(degraded);
        if degraded {
            tracing::warn!("no coordinator answers: routing on the last known membership");
        } else {
            tracing::info!("a coordinator answers again: routing through the coordinators");
        }
    }
}

/// Lists the decode nodes every `every` (one call in the background, never one per turn)
/// into `last_known`, until the generator is dropped.
async fn refresh_membership(coordinators: Arc<Coordinators>, last_known: Weak<Mutex<LastKnown>>, degraded: Arc<AtomicBool>, every: Duration) {
    loop {
        let listed = coordinators
            .call(|mut c| async move { c.list_nodes(ListNodesRequest { role: WireRole::Decode as i32 }).await })
            .await;
        let Some(known) = last_known.upgrade() else { return };
        {
            let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
            match listed {
                Ok(r) => {
                    known.set_decode_nodes(r.nodes, Instant::now());
                    set_degraded(&degraded, false);
                }
                Err(e) if e.unanswered => set_degraded(&degraded, true),
                Err(e) => {
                    known.heard(Instant::now());
                    tracing::warn!(code = ?e.status.code(), "listing the decode nodes failed");
                }
            }
        }
        drop(known);
        tokio::time::sleep(every).await;
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
