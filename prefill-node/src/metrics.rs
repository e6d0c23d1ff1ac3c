//! The prefill node's own series (names per STYLE.md), each named under the
//! role's prefix: `baton_prefill_` + the name given here. The recorder, the
//! engine- and transport-derived series (`baton_prefill_queue_depth`, ...)
//! and the `/metrics` endpoint are the node shell's
//! (`baton_node_common::engine_metrics`); docs/metrics.md lists every name.
//! Invariants: no labels.

use std::sync::Arc;

use ::metrics::Histogram;
pub use baton_node_common::engine_metrics::Count;
use baton_node_common::engine_metrics::NodeRecorder;

/// Buckets (seconds) of KV shipping.
pub const SHIP_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Handles to the prefill node's own series.
pub struct Metrics {
    node: Arc<NodeRecorder>,
    /// `turns_total`: prefills received.
    pub turns: Count,
    /// `pulled_prefixes_total`: prefixes pulled from a decode node.
    pub pulled: Count,
    /// `failures_total`: prefills that failed.
    pub failures: Count,
    /// `shipped_blocks_total`: KV blocks shipped to decode nodes.
    pub shipped: Count,
    /// `generated_tokens_total`: first tokens sampled.
    pub generated: Count,
    /// `time_to_first_token_seconds`: from receiving a prefill to its first token
    /// (compute, including any pull).
    pub ttft: Histogram,
    /// `ship_seconds`: time to ship the computed tail to the decode node.
    pub ship: Histogram,
}

impl Metrics {
    /// Registers the prefill node's series in its recorder (made from the role's `MetricsSpec`).
    pub fn new(node: Arc<NodeRecorder>) -> Self {
        let n = &node;
        Metrics {
            turns: n.count("turns_total", "Prefills received"),
            pulled: n.count("pulled_prefixes_total", "Prefixes pulled from a decode node"),
            failures: n.count("failures_total", "Prefills that failed"),
            shipped: n.count("shipped_blocks_total", "KV blocks shipped to decode nodes"),
            generated: n.count("generated_tokens_total", "First tokens sampled"),
            ttft: n.histogram("time_to_first_token_seconds", "Time from receiving a prefill to its first token"),
            ship: n.histogram("ship_seconds", "Time to ship a computed tail to the decode node"),
            node: node.clone(),
        }
    }

    /// A pull brought `tokens` prompt tokens from a decode node.
    pub fn imported(&self, tokens: u64) {
        self.node.imported(tokens);
    }
}
