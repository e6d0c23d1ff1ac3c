//! The prefill node's metrics (names per STYLE.md) and its HTTP endpoints
//! `/metrics` (Prometheus text) and `/healthz`.
//!
//! Owns: one `metrics-exporter-prometheus` recorder per node (never the process-wide
//! global one: `baton up` and the tests run several nodes in one process), the handles
//! registered in it, and the scrape-time refresh of the series derived from the
//! engine's and the KV transport's cumulative statistics.
//! Invariants: every name is a constant below; labels are small fixed sets (source,
//! state, tier, transport, side), never user, conversation or turn IDs.

use std::sync::atomic::{AtomicU64, Ordering};

use ::metrics::Histogram;
use baton_engine::Engine;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::kv::KvNode;
pub use baton_node_common::engine_metrics::Count;
use baton_node_common::engine_metrics::{histogram, EngineSeries};

/// Counter: prefills received.
pub const TURNS_TOTAL: &str = "baton_prefill_turns_total";
/// Counter: prefixes pulled from a decode node.
pub const PULLED_TOTAL: &str = "baton_prefill_pulled_prefixes_total";
/// Counter: prefills that failed.
pub const FAILURES_TOTAL: &str = "baton_prefill_failures_total";
/// Counter: KV blocks shipped to decode nodes.
pub const SHIPPED_BLOCKS_TOTAL: &str = "baton_prefill_shipped_blocks_total";
/// Counter: first tokens sampled.
pub const GENERATED_TOTAL: &str = "baton_prefill_generated_tokens_total";
/// Histogram: time from receiving a prefill to its first token (compute, including any pull).
pub const TTFT_SECONDS: &str = "baton_prefill_time_to_first_token_seconds";
/// Histogram: time to ship the computed tail to the decode node.
pub const SHIP_SECONDS: &str = "baton_prefill_ship_seconds";
/// Counter: prompt tokens by source (`cached_tier1`, `cached_tier2`, `imported`, `computed`).
pub const PROMPT_TOKENS_TOTAL: &str = "baton_prefill_prompt_tokens_total";
/// Counter: prefix-cache hit tokens by tier (`1`, `2`).
pub const PREFIX_HIT_TOKENS_TOTAL: &str = "baton_prefill_prefix_cache_hit_tokens_total";
/// Counter (float): seconds the engine spent computing steps.
pub const BUSY_SECONDS_TOTAL: &str = "baton_prefill_busy_seconds_total";
/// Counter: tokens the engine computed, by phase (`prefill`, `decode`).
pub const ENGINE_TOKENS_TOTAL: &str = "baton_prefill_engine_tokens_total";
/// Counter: sequences preempted to make room.
pub const PREEMPTIONS_TOTAL: &str = "baton_prefill_preemptions_total";
/// Counter: prefix-cache lookups that found another block under the same hash (refused: the
/// tokens or scope differed). Expected 0; anything else is a forgery or a weak hash.
pub const PREFIX_HASH_COLLISIONS_TOTAL: &str = "baton_prefill_prefix_hash_collisions_total";
/// Gauge: sequences waiting for admission. The autoscaler relies on this name.
pub const QUEUE_DEPTH: &str = "baton_prefill_queue_depth";
/// Gauge: sequences running.
pub const RUNNING: &str = "baton_prefill_running_sequences";
/// Gauge: sequences swapped out to the second tier.
pub const SWAPPED: &str = "baton_prefill_swapped_sequences";
/// Gauge: KV blocks by state (`free`, `used`, `cached`) and tier (`1`, `2`).
pub const KV_BLOCKS: &str = "baton_prefill_kv_blocks";
/// Gauge: bytes of one KV block (all layers, K and V); blocks x this = memory.
pub const KV_BLOCK_BYTES: &str = "baton_prefill_kv_block_bytes";
/// Gauge: staging blocks held by in-flight prefix pulls.
pub const STAGING_BLOCKS_USED: &str = "baton_prefill_kv_staging_blocks_used";

/// Latency buckets (seconds) around the 1 s TTFT target.
pub const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0];
/// Buckets (seconds) of KV shipping.
pub const SHIP_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];


/// This role's names of the engine-derived series.
const ENGINE_SERIES: EngineSeries = EngineSeries {
    prompt_tokens: PROMPT_TOKENS_TOTAL,
    prompt_tokens_help: "Prompt tokens by source: prefix cache (tier), pulled from a decode node, computed here",
    prefix_hit_tokens: PREFIX_HIT_TOKENS_TOTAL,
    busy_seconds: BUSY_SECONDS_TOTAL,
    engine_tokens: ENGINE_TOKENS_TOTAL,
    preemptions: PREEMPTIONS_TOTAL,
    hash_collisions: PREFIX_HASH_COLLISIONS_TOTAL,
    queue_depth: QUEUE_DEPTH,
    running: RUNNING,
    swapped: SWAPPED,
    kv_blocks: KV_BLOCKS,
    kv_block_bytes: KV_BLOCK_BYTES,
    staging_blocks_used: STAGING_BLOCKS_USED,
};

/// Handles to every series of one prefill node, and the recorder that renders them.
pub struct Metrics {
    recorder: PrometheusRecorder,
    pub turns: Count,
    pub pulled: Count,
    pub failures: Count,
    pub shipped: Count,
    pub generated: Count,
    pub ttft: Histogram,
    pub ship: Histogram,
    /// Prompt tokens pulled from decode nodes instead of computed.
    imported_tokens: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(TTFT_SECONDS.into()), TTFT_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(SHIP_SECONDS.into()), SHIP_BUCKETS))
            .expect("bucket lists are not empty")
            .build_recorder();
        let count = |name: &'static str, help: &'static str| Count::new(&recorder, name, help);
        Metrics {
            turns: count(TURNS_TOTAL, "Prefills received"),
            pulled: count(PULLED_TOTAL, "Prefixes pulled from a decode node"),
            failures: count(FAILURES_TOTAL, "Prefills that failed"),
            shipped: count(SHIPPED_BLOCKS_TOTAL, "KV blocks shipped to decode nodes"),
            generated: count(GENERATED_TOTAL, "First tokens sampled"),
            ttft: histogram(&recorder, TTFT_SECONDS, "Time from receiving a prefill to its first token"),
            ship: histogram(&recorder, SHIP_SECONDS, "Time to ship a computed tail to the decode node"),
            imported_tokens: AtomicU64::new(0),
            recorder,
        }
    }

    /// A pull brought `tokens` prompt tokens from a decode node.
    pub fn imported(&self, tokens: u64) {
        self.imported_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Refreshes the series derived from the engine and KV transport, then renders
    /// everything in the Prometheus text format.
    pub fn render(&self, engine: &Engine, kv: Option<&KvNode>) -> String {
        ENGINE_SERIES.render(&self.recorder, engine, kv, self.imported_tokens.load(Ordering::Relaxed))
    }
}

impl baton_node_common::http::RenderMetrics for Metrics {
    fn render(&self, engine: &Engine, kv: Option<&KvNode>) -> String {
        Metrics::render(self, engine, kv)
    }
}

/// The node's `/healthz` and `/metrics` (`baton_node_common::http`).
pub type HttpState = baton_node_common::http::HttpState<Metrics>;
pub use baton_node_common::http::router;
