//! The prefill node's gRPC service: `PrefillNode` (Prefill, Stats).
//! `NodeControl` is the node shell's.
//!
//! One prefill: match this node's own owner-scoped prefix cache; pull the
//! part of the decode node's cached prefix it lacks (ExportPrefix into a
//! staging reservation here); compute the rest in chunks, shipping each layer
//! of the tail's blocks into the decode node's grant as soon as it is written
//! (`export`; or all of them after the first token with `--kv-export
//! after-prefill`); answer with the first token once the KV is confirmed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::kv::OwnerId;
use baton_engine::{Engine, EngineError, Event, KvImport, SubmitOptions};
use baton_kv_transport::Grant;
use tokio::task::JoinHandle;
use baton_node_common::shell::{blocking, node_stats, Node};
use baton_proto::node as pb;
use baton_proto::node::prefill_node_server::PrefillNode;
use tonic::{Request, Response, Status};

use crate::export::{ship_layers, ship_whole, KvExportMode};
use crate::metrics::Metrics;
use baton_node_common::convert;
use baton_node_common::kv::{parse_endpoint, KvNode};
use baton_node_common::prefix_pull::{connect_decode_node, expect_caller, first_importable_block, pull_prefix};
use baton_proto::plane::Expect;

pub struct PrefillService {
    /// How this node pulls prefixes from decode nodes.
    pub plane: baton_proto::plane::Plane,
    pub engine: Arc<Engine>,
    pub kv: Arc<KvNode>,
    pub metrics: Arc<Metrics>,
    /// How long a prefix pull may take.
    pub pull_deadline: Duration,
    /// Test hook: pause after each layer shipped (to kill the node mid-transfer).
    pub layer_delay: Option<Duration>,
    /// Pipelined or after the prefill (`--kv-export`).
    pub export_mode: KvExportMode,
    pub draining: Arc<AtomicBool>,
}

impl PrefillService {
    pub fn new(node: &Node, metrics: Arc<Metrics>, layer_delay: Option<Duration>, export_mode: KvExportMode) -> Self {
        PrefillService {
            plane: node.plane.clone(),
            engine: node.engine.clone(),
            kv: node.kv.clone(),
            metrics,
            pull_deadline: node.config.kv_deadline,
            layer_delay,
            export_mode,
            draining: node.draining.clone(),
        }
    }
}

#[tonic::async_trait]
impl PrefillNode for PrefillService {
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        // In flight already: the server counts every call (`CountedService`).
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the node is draining"));
        }
        self.metrics.turns.increment(1);
        // A prefix is pulled only from the decode node that asked (`prefix_source` is
        // its address): a caller cannot point the pull at a node it chose.
        let holder = expect_caller(&request);
        let r = self.prefill_inner(request.into_inner(), holder).await;
        if r.is_err() {
            self.metrics.failures.increment(1);
        }
        r.map(Response::new)
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::NodeStats>, Status> {
        Ok(Response::new(node_stats(&self.engine, &self.kv)))
    }
}

impl PrefillService {
    async fn prefill_inner(&self, r: pb::PrefillRequest, holder: Expect) -> Result<pb::PrefillResponse, Status> {
        let started = Instant::now();
        let mut req = convert::request(r.turn, r.sampling)?;
        let grant = Grant::from_bytes(&r.grant).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let peer = parse_endpoint(&r.kv_endpoint).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let bt = self.kv.layout.block_tokens as usize;
        let n = req.prompt.len();
        let k = r.cached_tokens as usize;
        if !k.is_multiple_of(bt) || k >= n {
            return Err(Status::invalid_argument("cached_tokens must be whole blocks shorter than the prompt"));
        }
        let start_block = k / bt;
        if grant.blocks.len() != n.div_ceil(bt) - start_block || grant.layout != self.kv.layout {
            return Err(Status::invalid_argument("the grant does not match the prompt's tail"));
        }
        let mut p = req.sampling.clone().into_inner();
        p.max_tokens = 1;
        req.sampling = p.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;

        // What this node holds of the prefix; pull the rest from the decode node.
        let engine = self.engine.clone();
        let (prompt, owner, platform) = (req.prompt.clone(), req.owner.clone(), req.platform_prefix_len);
        let have = blocking(move || engine.cached_prefix_tokens(&prompt, &owner, platform)).await?.map_err(|e| baton_proto::status(&e))?.min(k);
        let mut pulled = None;
        // The platform prefix is never pulled (its blocks are every user's): without it
        // here, this node computes the prefix itself.
        if have < k && !r.prefix_source.is_empty() && have / bt >= first_importable_block(req.platform_prefix_len, bt) {
            match self.pull_prefix(&req.prompt[..k], &req.owner, req.platform_prefix_len, have / bt, (r.prefix_source.as_str(), holder)).await {
                Ok(i) => {
                    self.metrics.pulled.increment(1);
                    pulled = Some(i);
                }
                Err(e) => {
                    tracing::warn!(code = ?e.code(), message = e.message(), "prefix pull failed; computing the prefix here")
                }
            }
        }
        let pulled_tokens = pulled.as_ref().map(|i| i.blocks.len() * bt).unwrap_or(0);
        self.metrics.imported(pulled_tokens as u64);
        let pipelined = self.export_mode == KvExportMode::Pipelined;
        let submit = |import: Option<KvImport>| -> Result<_, EngineError> {
            if pipelined {
                let (sub, layers) = self.engine.submit_exporting_layers(req.clone(), import, start_block)?;
                Ok((sub, Some(layers)))
            } else {
                Ok((self.engine.submit_with(req.clone(), SubmitOptions { import, export_from_block: Some(start_block) })?, None))
            }
        };
        let (sub, layers) = match submit(pulled) {
            Ok(s) => s,
            Err(EngineError::BadImport { what }) => {
                tracing::warn!(what, "pulled prefix refused; computing it here");
                submit(None).map_err(|e| baton_proto::status(&e))?
            }
            Err(e) => return Err(baton_proto::status(&e)),
        };
        // The pipelined export ships while the engine computes; aborted (its transfer
        // dropped, so the decode node releases the grant) if this call ends first.
        let shipping_task = layers.map(|layers| AbortOnDrop(tokio::spawn(ship_layers(self.kv.clone(), peer.clone(), grant.clone(), start_block, layers, self.layer_delay))));
        let mut stream = sub.stream;
        let mut first = None;
        loop {
            match stream.next().await {
                Some(Event::Token(t)) => first = Some(convert::token(&t)),
                Some(Event::Finished { .. }) => break,
                Some(Event::Failed(e)) => return Err(baton_proto::status(&e)),
                None => return Err(Status::unavailable("the engine has stopped")),
            }
        }
        let first = first.ok_or_else(|| Status::internal("no first token"))?;
        self.metrics.generated.increment(1);
        let compute = started.elapsed();
        self.metrics.ttft.record(compute.as_secs_f64());
        // From the first token on: what shipping adds to the turn (all of the transfer
        // after the prefill; the tail still in flight when pipelined).
        let shipping = Instant::now();
        let n_blocks = match (shipping_task, sub.export) {
            (Some(mut task), _) => (&mut task.0).await.map_err(|_| Status::internal("the KV export task failed"))??,
            (None, Some(export)) => {
                let export = export.await.map_err(|_| Status::internal("the export was not produced"))?;
                ship_whole(&self.kv, &peer, &grant, export, self.layer_delay).await?
            }
            (None, None) => return Err(Status::internal("no export")),
        };
        self.metrics.shipped.increment(n_blocks as u64);
        self.metrics.ship.record(shipping.elapsed().as_secs_f64());
        Ok(pb::PrefillResponse {
            first_token: Some(first),
            local_cached_tokens: have as u32,
            pulled_tokens: pulled_tokens as u32,
            compute_us: compute.as_micros() as u64,
            transfer_us: shipping.elapsed().as_micros() as u64,
        })
    }

    /// Pulls prefix blocks `[start_block, prefix.len() / bt)` from the decode node at `source`.
    async fn pull_prefix(&self, prefix: &[u32], owner: &OwnerId, platform: usize, start_block: usize, (source, holder): (&str, Expect)) -> Result<KvImport, Status> {
        let started = Instant::now();
        let mut client = tokio::time::timeout(self.pull_deadline, connect_decode_node(&self.plane, source, holder.clone()))
            .await
            .map_err(|_| Status::deadline_exceeded("prefix pull"))??;
        let left = self.pull_deadline.saturating_sub(started.elapsed());
        pull_prefix(&self.kv, &mut client, holder, prefix, owner, platform, start_block, left).await
    }
}

/// Aborts a spawned task when dropped (the call that started it ended).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
