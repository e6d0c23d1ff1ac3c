//! The prefill node's own series (names per STYLE.md), each named under the
//! role's prefix: `baton_prefill_` + the name given here. The recorder, the
//! engine- and transport-derived series (`baton_prefill_queue_depth`, ...)
//! and the `/metrics` endpoint are the node shell's
//! (`baton_node_common::engine_metrics`); docs/metrics.md lists every name.
//! Invariants: no labels.

use std::sync::Arc;

use ::metrics::{Counter, Histogram};
use baton_node_common::engine_metrics::NodeRecorder;

/// Buckets (seconds) of KV shipping.
pub const SHIP_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Buckets of this role's histograms besides TTFT (the shell's), by name under the prefix.
pub const BUCKETS: &[(&str, &[f64])] = &[("ship_seconds", SHIP_BUCKETS)];

/// Handles to the prefill node's own series.
pub struct Metrics {
    node: Arc<NodeRecorder>,
    /// `turns_total`: prefills received.
    pub turns: Counter,
    /// `pulled_prefixes_total`: prefixes pulled from a decode node.
    pub pulled: Counter,
    /// `failures_total`: prefills that failed.
    pub failures: Counter,
    /// `shipped_blocks_total`: KV blocks shipped to decode nodes.
    pub shipped: Counter,
    /// `generated_tokens_total`: first tokens sampled.
    pub generated: Counter,
    /// `time_to_first_token_seconds`: from receiving a prefill to its first token
    /// (compute, including any pull).
    pub ttft: Histogram,
    /// `ship_seconds`: from the first token until the decode node confirmed the tail's KV
    /// (pipelined: the part of the transfer that did not overlap the compute).
    pub ship: Histogram,
}

impl Metrics {
    /// Registers the prefill node's series in its recorder (made from the role's `MetricsSpec`).
    pub fn new(node: Arc<NodeRecorder>) -> Self {
        let n = &node;
        Metrics {
            turns: n.counter("turns_total", "Prefills received", &[]),
            pulled: n.counter("pulled_prefixes_total", "Prefixes pulled from a decode node", &[]),
            failures: n.counter("failures_total", "Prefills that failed", &[]),
            shipped: n.counter("shipped_blocks_total", "KV blocks shipped to decode nodes", &[]),
            generated: n.counter("generated_tokens_total", "First tokens sampled", &[]),
            ttft: n.histogram("time_to_first_token_seconds", "Time from receiving a prefill to its first token"),
            ship: n.histogram("ship_seconds", "Time from the first token until the decode node confirmed a tail's KV"),
            node: node.clone(),
        }
    }

    /// A pull brought `tokens` prompt tokens from a decode node.
    pub fn imported(&self, tokens: u64) {
        self.node.imported(tokens);
    }
}
