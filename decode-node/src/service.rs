//! The decode node's gRPC service: `DecodeNode` (Generate, ExportPrefix,
//! AdoptPrefix, CachedPrefix, Stats). `NodeControl` is the node shell's.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_engine::{Engine, Event, ImportUse, RequestStream, SubmitOptions};
use baton_kv_transport::Grant;
use baton_node_common::shell::{blocking, node_stats, Node};
use baton_proto::node as pb;
use baton_proto::node::decode_node_server::DecodeNode;
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::handoff::{adopt, remote_prefill, Route, Router};
use crate::kv_source::{classify, Facts, LocalWhy, Pull, Routed};
use crate::metrics::Metrics;
use crate::warm::{WarmConversation, WarmTable};
use baton_node_common::convert;
use baton_node_common::kv::{parse_endpoint, ExportSource, KvNode};
use baton_node_common::prefix_pull::{expect_caller, first_importable_block};
use baton_proto::plane::{Expect, Role as IdRole};

/// State shared by the node's services.
pub struct DecodeService {
    pub engine: Arc<Engine>,
    pub kv: Arc<KvNode>,
    /// How this node calls prefill nodes and other decode nodes.
    pub plane: baton_proto::plane::Plane,
    pub router: Router,
    pub metrics: Arc<Metrics>,
    /// This node's gRPC address as others reach it.
    pub grpc_addr: String,
    pub kv_deadline: Duration,
    pub draining: Arc<AtomicBool>,
    pub warm: Arc<WarmTable>,
}

impl DecodeService {
    pub fn new(node: &Node, router: Router, metrics: Arc<Metrics>, warm: Arc<WarmTable>) -> Self {
        DecodeService {
            engine: node.engine.clone(),
            kv: node.kv.clone(),
            plane: node.plane.clone(),
            router,
            metrics,
            grpc_addr: node.grpc_addr.clone(),
            kv_deadline: node.config.kv_deadline,
            draining: node.draining.clone(),
            warm,
        }
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x5eed);
    h.finish()
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeNode for DecodeService {
    type GenerateStream = EventStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        // In flight already, until its last event is written: the server
        // counts every call (`CountedService`), so a drain waits for this turn.
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the node is draining"));
        }
        // With identities (mutual TLS), a moved conversation's prefix is pulled only from
        // the node the coordinator named; in plaintext mode any decode node answers.
        let identities = baton_proto::plane::authz::caller(&request).is_some();
        let r = request.into_inner();
        let prefix_source = r.prefix_source;
        let holder = match r.prefix_source_node.as_str() {
            "" if identities => None,
            "" => Some(Expect::Role(IdRole::Decode)),
            name => Some(Expect::Node { role: IdRole::Decode, name: baton_proto::ids::node(name.to_string())?.as_str().to_string() }),
        };
        let mut req = convert::request(r.turn, r.sampling)?;
        if !req.sampling.is_greedy() && req.sampling.seed.is_none() {
            // One seed for both nodes, so a remote first token continues here.
            let mut p = req.sampling.clone().into_inner();
            p.seed = Some(random_seed());
            req.sampling = p.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
        }
        self.metrics.turns.increment(1);
        let engine = self.engine.clone();
        let (prompt, owner, platform) = (req.prompt.clone(), req.owner.clone(), req.platform_prefix_len);
        let mut cached = blocking(move || engine.cached_prefix_tokens(&prompt, &owner, platform)).await?.map_err(|e| baton_proto::status(&e))?;
        // This node served the conversation's last turn, of which a whole block could be
        // cached for this prompt (the engine always computes the prompt's last token).
        let bt = self.kv.layout.block_tokens as usize;
        let shared = req.conversation.as_ref().map_or(0, |c| self.warm.shared_prefix(c, &req.prompt));
        let served_before = shared.min(req.prompt.len().saturating_sub(1)) >= bt;
        let mut pull = Pull::None;
        if let Some(holder) = holder.filter(|_| !prefix_source.is_empty() && prefix_source != self.grpc_addr && req.conversation.is_some()) {
            (cached, pull) = self.adopt_moved(&req, (&prefix_source, holder), cached).await;
        }
        let mut import = None;
        // A tail prefilled elsewhere is published here under the turn's scopes: one that
        // covers platform blocks would let a prefill node plant the KV every user's turn
        // reads. Until this node holds its platform prefix, it computes the turn itself.
        let platform_held = cached / bt >= first_importable_block(req.platform_prefix_len, bt);
        let route = if platform_held { self.router.route(&req, cached, baton_node_common::shell::load_report(&self.engine)).await } else { Route::Local(LocalWhy::Policy) };
        let routed = match route {
            Route::Local(why) => Routed::Local(why),
            Route::Remote { addr, node } => {
                match remote_prefill(&self.kv, &self.plane, &req, cached, (&addr, node.as_deref()), &self.grpc_addr, self.kv_deadline).await {
                    Ok(p) => {
                        import = Some(p.import);
                        self.metrics.window_skipped_bytes.record(p.window_skipped_bytes as f64);
                        self.metrics.imported(req.prompt.len().saturating_sub(cached) as u64);
                        Routed::Remote(Ok(()))
                    }
                    Err(e) => {
                        tracing::warn!(kind = e.label(), reason = ?e.reason(), error = %e, "remote prefill failed; prefilling locally");
                        Routed::Remote(Err(e.reason()))
                    }
                }
            }
        };
        let mut facts = Facts { cached, pull, served_before, routed };
        let warm = WarmConversation::of(&req).map(|w| (w, self.warm.clone()));
        let sub = match self.engine.submit_with(req.clone(), SubmitOptions { import, export_from_block: None }) {
            Ok(s) => s,
            Err(baton_engine::EngineError::BadImport { what }) => {
                tracing::warn!(what, "import refused; prefilling locally");
                facts.import_refused();
                self.engine.submit_with(req, SubmitOptions::default()).map_err(|e| baton_proto::status(&e))?
            }
            Err(e) => return Err(baton_proto::status(&e)),
        };
        let (tx, rx) = mpsc::channel(64);
        let source = Source { facts, import: sub.import };
        tokio::spawn(forward(sub.stream, tx, source, self.metrics.clone(), warm));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn export_prefix(&self, request: Request<pb::ExportPrefixRequest>) -> Result<Response<pb::ExportPrefixResponse>, Status> {
        let r = request.into_inner();
        let grant = Grant::from_bytes(&r.grant).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let peer = parse_endpoint(&r.kv_endpoint).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let engine = self.engine.clone();
        let (tokens, owner, platform, start) = (r.tokens, baton_proto::ids::owner(r.owner)?, r.platform_prefix_len as usize, r.start_block as usize);
        let export = blocking(move || engine.export_prefix(&tokens, &owner, platform, start)).await?.map_err(|e| baton_proto::status(&e))?;
        let n = grant.blocks.len();
        if export.blocks.len() < n {
            return Err(Status::failed_precondition(format!("only {} of {n} prefix blocks are cached here", export.blocks.len())));
        }
        let mut blocks = export.blocks;
        blocks.truncate(n);
        let source = Arc::new(ExportSource { layout: self.kv.layout, blocks });
        let ids = source.ids();
        self.kv.sender.send(&peer, &grant, source, ids).await.map_err(|e| Status::unavailable(format!("KV transfer failed: {e}")))?;
        Ok(Response::new(pb::ExportPrefixResponse { blocks: n as u32 }))
    }

    async fn adopt_prefix(&self, request: Request<pb::AdoptPrefixRequest>) -> Result<Response<pb::AdoptPrefixResponse>, Status> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the node is draining"));
        }
        // The source is the caller (a draining node hands over its own conversations):
        // an address naming another node is dialled, but only the caller is trusted there.
        let holder = expect_caller(&request);
        let source = adopt::source_of(&request)?;
        let r = request.into_inner();
        if r.source.is_empty() {
            return Err(Status::invalid_argument("source is empty"));
        }
        let req = adopt::request(r.turn)?;
        let warm = WarmConversation::of(&req).ok_or_else(|| Status::invalid_argument("an adopted prefix needs its conversation"))?;
        // Nothing is pulled on the caller's word alone: the coordinator must vouch that the
        // caller held the conversation for this owner and that it is routed here now.
        if let Some(source) = source {
            adopt::vouched(self.router.coordinator.as_deref(), &warm.conversation, &warm.owner, &source).await?;
        }
        let a = adopt::adopt(&self.engine, &self.kv, &self.plane, req, (r.source.as_str(), holder), self.kv_deadline).await?;
        if a.pulled_tokens > 0 {
            self.metrics.adopted((a.pulled_tokens / self.kv.layout.block_tokens as usize) as u64);
        }
        // Known warm here from now on, should this node drain in turn.
        self.warm.record(warm);
        Ok(Response::new(pb::AdoptPrefixResponse { had_tokens: a.had_tokens as u32, pulled_tokens: a.pulled_tokens as u32 }))
    }

    async fn cached_prefix(&self, request: Request<pb::CachedPrefixRequest>) -> Result<Response<pb::CachedPrefixResponse>, Status> {
        let r = request.into_inner();
        if r.platform_prefix_len as usize > r.tokens.len() {
            return Err(Status::invalid_argument("platform_prefix_len is past the tokens"));
        }
        let engine = self.engine.clone();
        let (tokens, owner, platform) = (r.tokens, baton_proto::ids::owner(r.owner)?, r.platform_prefix_len as usize);
        let cached = blocking(move || engine.cached_prefix_tokens(&tokens, &owner, platform)).await?.map_err(|e| baton_proto::status(&e))?;
        Ok(Response::new(pb::CachedPrefixResponse { cached_tokens: cached as u32 }))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::NodeStats>, Status> {
        let m = &self.metrics;
        let own = pb::NodeStats {
            remote_prefills: m.remote_prefills.get(),
            local_prefills: m.local_prefills.get(),
            fallbacks: m.fallbacks.get(),
            ..node_stats(&self.engine, &self.kv)
        };
        Ok(Response::new(own))
    }
}

impl DecodeService {
    /// The first turn of a conversation that moved here when this node joined:
    /// pulls the warm prefix from its previous owner. Returns the prompt tokens
    /// cached here now and what the pull did; on any failure the turn just computes
    /// more itself.
    async fn adopt_moved(&self, req: &baton_engine::Request, (source, holder): (&str, Expect), cached: usize) -> (usize, Pull) {
        // `source` and `holder` are the gateway's (the coordinator's previous node for this
        // conversation, by address and certificate name: only that node may answer there,
        // only the gateway may call Generate); no platform block is taken.
        match adopt::adopt(&self.engine, &self.kv, &self.plane, req.clone(), (source, holder), self.kv_deadline).await {
            Ok(a) if a.pulled_tokens > 0 => {
                self.metrics.adopted((a.pulled_tokens / self.kv.layout.block_tokens as usize) as u64);
                (cached.max(a.had_tokens + a.pulled_tokens), Pull::Pulled)
            }
            Ok(_) => (cached, Pull::None),
            Err(e) => {
                tracing::warn!(code = ?e.code(), message = e.message(), "pulling the moved conversation's prefix failed; computing it here");
                (cached, Pull::Failed)
            }
        }
    }
}

/// What decides a turn's KV source: the facts gathered before submission, and the
/// engine's word on the import (sent before the turn's first token).
struct Source {
    facts: Facts,
    import: Option<tokio::sync::oneshot::Receiver<ImportUse>>,
}

impl Source {
    /// The turn's KV source and prefill path, once the engine has admitted it (at its first
    /// token); counted here, once per turn.
    fn settle(&mut self, metrics: &Metrics) -> (pb::KvSource, pb::PrefillPath) {
        let import = self.import.as_mut().and_then(|rx| rx.try_recv().ok());
        let source = classify(&self.facts, import);
        let path = if source.outcome == pb::KvOutcome::Imported as i32 {
            metrics.remote_prefills.inc();
            pb::PrefillPath::Remote
        } else if self.facts.went_remote() {
            metrics.fallbacks.inc();
            pb::PrefillPath::Fallback
        } else {
            pb::PrefillPath::Local
        };
        if path != pb::PrefillPath::Remote {
            metrics.local_prefills.inc();
        }
        metrics.kv_source(&source);
        let (outcome, reason) = baton_proto::kv_source::labels(&source);
        tracing::debug!(outcome, reason, "turn KV source");
        (source, path)
    }
}

/// Streams engine events to the caller; a caller that goes away cancels the
/// sequence at once (dropping the engine stream cancels it at the next step).
/// A finished turn's prompt and reply become the conversation's warm tokens.
async fn forward(
    mut stream: RequestStream,
    tx: mpsc::Sender<Result<pb::GenerateEvent, Status>>,
    mut source: Source,
    metrics: Arc<Metrics>,
    mut warm: Option<(WarmConversation, Arc<WarmTable>)>,
) {
    use pb::generate_event::Event as E;
    let mut timer = crate::metrics::TokenTimer::new(&metrics);
    // Settled at the first token (or at a finish without one).
    let mut path = None;
    loop {
        let ev = tokio::select! {
            _ = tx.closed() => {
                stream.cancel();
                metrics.outcome("cancelled", 1);
                return;
            }
            ev = stream.next() => ev,
        };
        let out = match ev {
            Some(Event::Token(t)) => {
                metrics.generated.increment(1);
                timer.token(t.elapsed);
                if let Some((w, _)) = warm.as_mut() {
                    w.tokens.push(t.id);
                }
                let kv_source = match path {
                    None => {
                        let (k, p) = source.settle(&metrics);
                        path = Some(p);
                        Some(k)
                    }
                    Some(_) => None,
                };
                Ok(pb::GenerateEvent { event: Some(E::Token(convert::token(&t))), kv_source })
            }
            Some(Event::Finished { reason, usage, ttft, trailing_text, window_saved_bytes, .. }) => {
                metrics.finished(reason, ttft);
                // A finish without a token settles the source here (and says it here).
                let (kv_source, path) = match path {
                    Some(p) => (None, p),
                    None => {
                        let (k, p) = source.settle(&metrics);
                        (Some(k), p)
                    }
                };
                metrics.window_saved_bytes.record(window_saved_bytes as f64);
                let fin = pb::FinishedEvent {
                    reason: convert::finish_reason(reason) as i32,
                    usage: Some(pb::Usage {
                        prompt_tokens: usage.prompt_tokens as u32,
                        cached_tokens: usage.cached_tokens as u32,
                        completion_tokens: usage.completion_tokens as u32,
                    }),
                    trailing_text,
                    prefill_path: path as i32,
                    ttft_us: ttft.map(|d| d.as_micros() as u64).unwrap_or(0),
                };
                if let Some((w, table)) = warm.take() {
                    table.record(w);
                }
                let _ = tx.send(Ok(pb::GenerateEvent { event: Some(E::Finished(fin)), kv_source })).await;
                return;
            }
            Some(Event::Failed(e)) => {
                metrics.outcome("failed", 1);
                let _ = tx.send(Err(baton_proto::status(&e))).await;
                return;
            }
            None => {
                let _ = tx.send(Err(Status::unavailable("the engine has stopped"))).await;
                return;
            }
        };
        if tx.send(out).await.is_err() {
            return;
        }
    }
}
