//! Baton decode node: holds each conversation's warm prefix, admits turns,
//! decodes with continuous batching and streams tokens back over gRPC.
//!
//! Where a turn's uncached tail is prefilled is the coordinator's decision
//! (`RoutePrefill`): here, or by a prefill node it picks, which ships the
//! tail's KV over QUIC into staging blocks reserved here; the engine then
//! starts decoding from the prefill node's first token. A remote prefill that
//! fails for any reason falls back to local prefill.
//!
//! The process around the role (flags, listeners, the internal plane,
//! membership, `/healthz` and `/metrics`, Evict and Drain) is the node shell,
//! `baton_node_common::shell`; this crate is the `DecodeNode` service, the
//! warm table and what a drain hands over ([`Decode`]). Exports the three
//! things of every service crate: [`Args`], [`Config`] (`TryFrom<Args>`) and
//! [`run`]; plus [`serve`] for an in-process launcher that brings its own
//! listeners, TLS identity and engine.

pub mod drain;
pub mod error;
pub mod handoff;
pub mod kv_source;
pub mod metrics;
mod service;
pub mod warm;

use std::sync::Arc;

use baton_node_common::Result;
use baton_node_common::engine_metrics::MetricsSpec;
use baton_node_common::shell::{Node, NodeRole, RoleParts};
use baton_proto::node::decode_node_server::DecodeNodeServer;
use baton_proto::plane::Role as IdRole;

pub use baton_node_common::shell::{run, serve, Bound, Parts};
pub use error::Error;
pub use handoff::Router;

/// The decode node's series: their prefix, where its `imported` prompt tokens come from, its own histograms.
const METRICS: MetricsSpec = MetricsSpec::new("baton_decode", "imported from a prefill node", metrics::BUCKETS);

baton_node_common::node_role!(Decode, "decode", "DECODE", "72");

/// The decode role: its own flags, and what it serves in the node shell.
#[derive(clap::Args, Clone, Debug)]
pub struct Decode {
    /// Without a coordinator: the prefill node's gRPC address, which then prefills
    /// every turn's tail (without either, every tail is prefilled here).
    #[arg(long, env = "BATON_PREFILL_ADDR")]
    pub prefill_addr: Option<String>,
    /// Conversations whose warm tokens the node remembers for a drain to hand
    /// over (least recently used forgotten first; also bounded to twice the
    /// tokens the KV tiers hold).
    #[arg(long, env = "BATON_WARM_CONVERSATIONS", default_value_t = 8192)]
    pub warm_conversations: usize,
}

impl NodeRole for Decode {
    const ROLE: IdRole = IdRole::Decode;
    const METRICS: MetricsSpec = METRICS;
    type Defaults = Defaults;

    fn validate(&self) -> Result<()> {
        if self.warm_conversations == 0 {
            return Err(baton_node_common::Error::Config("--warm-conversations must be positive".into()));
        }
        Ok(())
    }

    fn build(self, node: &Node) -> Result<RoleParts> {
        let engine = &node.engine;
        let metrics = Arc::new(metrics::Metrics::new(node.metrics.clone()));
        // Remembering more tokens than the KV tiers can hold is pointless; twice that is slack.
        let warm_tokens = 2 * (engine.info.kv_blocks + engine.info.tier2_blocks) * engine.info.kv_layout.block_tokens;
        let warm = Arc::new(warm::WarmTable::new(self.warm_conversations, warm_tokens));
        let router = Router { coordinator: node.coordinator.clone(), static_prefill: self.prefill_addr, node_id: node.config.name.clone() };
        let svc = service::DecodeService::new(node, router, metrics.clone(), warm.clone());
        let hooks = drain::Drainer::new(node, warm, metrics);
        Ok(RoleParts { routes: node.counted(DecodeNodeServer::new(svc)), hooks: Arc::new(hooks) })
    }
}
