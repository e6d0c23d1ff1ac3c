//! Baton prefill node: computes the uncached tail of a turn's prompt (with
//! its own owner-scoped prefix cache, pulling the prefix it lacks from the
//! decode node) and ships the tail's KV blocks over QUIC into the blocks the
//! decode node reserved, layer by layer while later layers compute
//! (`export`); answers with the first token.
//!
//! The process around the role (flags, listeners, the internal plane,
//! membership, `/healthz` and `/metrics`, Evict and Drain) is the node shell,
//! `baton_node_common::shell`; this crate is the `PrefillNode` service ([`Prefill`]).
//! Exports the three things of every service crate: [`Args`], [`Config`]
//! (`TryFrom<Args>`) and [`run`]; plus [`serve`] for an in-process launcher
//! that brings its own listeners, TLS identity and engine.

mod export;
pub mod metrics;
mod service;

pub use export::KvExportMode;

use std::sync::Arc;
use std::time::Duration;

use baton_node_common::Result;
use baton_node_common::engine_metrics::MetricsSpec;
use baton_node_common::shell::{parse_duration, ControlHooks, Node, NodeRole, RoleParts};
use baton_proto::node::prefill_node_server::PrefillNodeServer;
use baton_proto::plane::Role as IdRole;

pub use baton_node_common::shell::{run, serve, Bound, Parts};

/// The prefill node's series: their prefix, where its `imported` prompt tokens come from, its own histograms.
const METRICS: MetricsSpec = MetricsSpec::new("baton_prefill", "pulled from a decode node", metrics::BUCKETS);

baton_node_common::node_role!(Prefill, "prefill", "PREFILL", "73");

/// The prefill role: its own flags, and what it serves in the node shell.
#[derive(clap::Args, Clone, Debug)]
pub struct Prefill {
    /// Testing only: pause this long after each layer shipped.
    #[arg(long, env = "BATON_KV_LAYER_DELAY", value_parser = parse_duration, hide = true)]
    pub kv_layer_delay: Option<Duration>,
    /// How a tail's KV is shipped: `pipelined` (each layer as soon as it is computed, while
    /// later layers compute) or `after-prefill` (all blocks after the first token).
    #[arg(long, env = "BATON_KV_EXPORT", value_enum, default_value = "pipelined")]
    pub kv_export: KvExportMode,
}

/// A prefill node holds no conversation: a drain only refuses new prefills,
/// leaves the ring and lets the running ones (and their KV shipping) finish.
struct HoldsNothing;

impl ControlHooks for HoldsNothing {}

impl NodeRole for Prefill {
    const ROLE: IdRole = IdRole::Prefill;
    const METRICS: MetricsSpec = METRICS;
    type Defaults = Defaults;

    fn build(self, node: &Node) -> Result<RoleParts> {
        let metrics = Arc::new(metrics::Metrics::new(node.metrics.clone()));
        let svc = service::PrefillService::new(node, metrics, self.kv_layer_delay, self.kv_export);
        Ok(RoleParts { routes: node.counted(PrefillNodeServer::new(svc)), hooks: Arc::new(HoldsNothing) })
    }
}
