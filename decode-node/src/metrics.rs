//! The decode node's metrics (names per STYLE.md) and its HTTP endpoints
//! `/metrics` (Prometheus text) and `/healthz`.
//!
//! Owns: one `metrics-exporter-prometheus` recorder per node (never the process-wide
//! global one: `baton up` and the tests run several nodes in one process), the handles
//! registered in it, and the scrape-time refresh of the series derived from the
//! engine's and the KV transport's cumulative statistics.
//! Invariants: every name is a constant below; labels are small fixed sets (source,
//! state, tier, outcome, transport, side), never user, conversation or turn IDs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use baton_engine::Engine;
use ::metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::kv::KvNode;
pub use baton_node_common::engine_metrics::Count;
use baton_node_common::engine_metrics::{counter, histogram, EngineSeries};

/// Counter: turns received.
pub const TURNS_TOTAL: &str = "baton_decode_turns_total";
/// Counter: turns ended, by outcome (`stop`, `length`, `cancelled`, `failed`).
pub const TURN_OUTCOMES_TOTAL: &str = "baton_decode_turn_outcomes_total";
/// Counter: turns whose tail a prefill node computed.
pub const REMOTE_PREFILLS_TOTAL: &str = "baton_decode_remote_prefills_total";
/// Counter: turns prefilled on this node.
pub const LOCAL_PREFILLS_TOTAL: &str = "baton_decode_local_prefills_total";
/// Counter: remote prefills that failed and were recomputed here.
pub const FALLBACKS_TOTAL: &str = "baton_decode_prefill_fallbacks_total";
/// Counter: tokens streamed to callers.
pub const GENERATED_TOTAL: &str = "baton_decode_generated_tokens_total";
/// Histogram: engine time from submission to the first token.
pub const TTFT_SECONDS: &str = "baton_decode_time_to_first_token_seconds";
/// Histogram: engine time between consecutive tokens of one reply.
pub const ITL_SECONDS: &str = "baton_decode_inter_token_latency_seconds";
/// Counter: prompt tokens by source (`cached_tier1`, `cached_tier2`, `imported`, `computed`).
pub const PROMPT_TOKENS_TOTAL: &str = "baton_decode_prompt_tokens_total";
/// Counter: prefix-cache hit tokens by tier (`1`, `2`).
pub const PREFIX_HIT_TOKENS_TOTAL: &str = "baton_decode_prefix_cache_hit_tokens_total";
/// Counter (float): seconds the engine spent computing steps.
pub const BUSY_SECONDS_TOTAL: &str = "baton_decode_busy_seconds_total";
/// Counter: tokens the engine computed, by phase (`prefill`, `decode`).
pub const ENGINE_TOKENS_TOTAL: &str = "baton_decode_engine_tokens_total";
/// Counter: sequences preempted (swapped out or recomputed) to make room.
pub const PREEMPTIONS_TOTAL: &str = "baton_decode_preemptions_total";
/// Counter: prefix-cache lookups that found another block under the same hash (refused: the
/// tokens or scope differed). Expected 0; anything else is a forgery or a weak hash.
pub const PREFIX_HASH_COLLISIONS_TOTAL: &str = "baton_decode_prefix_hash_collisions_total";
/// Gauge: sequences waiting for admission. The autoscaler relies on this name.
pub const QUEUE_DEPTH: &str = "baton_decode_queue_depth";
/// Gauge: sequences running.
pub const RUNNING: &str = "baton_decode_running_sequences";
/// Gauge: sequences swapped out to the second tier.
pub const SWAPPED: &str = "baton_decode_swapped_sequences";
/// Gauge: KV blocks by state (`free`, `used`, `cached`) and tier (`1`, `2`).
pub const KV_BLOCKS: &str = "baton_decode_kv_blocks";
/// Gauge: bytes of one KV block (all layers, K and V); blocks x this = memory.
pub const KV_BLOCK_BYTES: &str = "baton_decode_kv_block_bytes";
/// Gauge: staging blocks held by in-flight KV imports.
pub const STAGING_BLOCKS_USED: &str = "baton_decode_kv_staging_blocks_used";
/// Counter: drain migrations by outcome.
pub const DRAIN_MIGRATIONS_TOTAL: &str = "baton_decode_drain_migrations_total";
/// Counter: KV blocks migrated away by a drain.
pub const DRAIN_MIGRATED_BLOCKS_TOTAL: &str = "baton_decode_drain_migrated_blocks_total";
/// Counter: prefixes adopted from a draining node.
pub const ADOPTED_PREFIXES_TOTAL: &str = "baton_decode_adopted_prefixes_total";
/// Counter: KV blocks adopted from a draining node.
pub const ADOPTED_BLOCKS_TOTAL: &str = "baton_decode_adopted_blocks_total";

/// Latency buckets (seconds) around the 1 s TTFT target.
pub const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0];
/// Latency buckets (seconds) around the 50 ms ITL target.
pub const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];


/// This role's names of the engine-derived series.
const ENGINE_SERIES: EngineSeries = EngineSeries {
    prompt_tokens: PROMPT_TOKENS_TOTAL,
    prompt_tokens_help: "Prompt tokens by source: prefix cache (tier), imported from a prefill node, computed here",
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

/// Handles to every series of one decode node, and the recorder that renders them.
pub struct Metrics {
    recorder: PrometheusRecorder,
    pub turns: Count,
    pub remote_prefills: Count,
    pub local_prefills: Count,
    pub fallbacks: Count,
    pub generated: Count,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Prompt tokens a prefill node computed and shipped here (tails of remote prefills).
    imported_tokens: AtomicU64,
    drain_blocks: Counter,
    adopted_prefixes: Counter,
    adopted_blocks: Counter,
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
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ITL_SECONDS.into()), ITL_BUCKETS))
            .expect("bucket lists are not empty")
            .build_recorder();
        let c = |name: &'static str, help: &'static str| counter(&recorder, name, help, &[]);
        let count = |name: &'static str, help: &'static str| Count::new(&recorder, name, help);
        let m = Metrics {
            turns: count(TURNS_TOTAL, "Turns received"),
            remote_prefills: count(REMOTE_PREFILLS_TOTAL, "Turns whose tail a prefill node computed"),
            local_prefills: count(LOCAL_PREFILLS_TOTAL, "Turns prefilled on this node"),
            fallbacks: count(FALLBACKS_TOTAL, "Remote prefills that failed and were recomputed here"),
            generated: count(GENERATED_TOTAL, "Tokens streamed"),
            ttft: histogram(&recorder, TTFT_SECONDS, "Engine time from submission to the first token"),
            itl: histogram(&recorder, ITL_SECONDS, "Engine time between consecutive tokens of one reply"),
            imported_tokens: AtomicU64::new(0),
            drain_blocks: c(DRAIN_MIGRATED_BLOCKS_TOTAL, "KV blocks migrated to other decode nodes by a drain"),
            adopted_prefixes: c(ADOPTED_PREFIXES_TOTAL, "Warm prefixes adopted from a draining decode node"),
            adopted_blocks: c(ADOPTED_BLOCKS_TOTAL, "KV blocks adopted from a draining decode node"),
            recorder,
        };
        for outcome in ["stop", "length", "cancelled", "failed"] {
            m.outcome(outcome, 0);
        }
        for outcome in ["moved", "failed"] {
            let _ = m.migration_counter(outcome);
        }
        m
    }

    /// A turn ended with `outcome` (`stop`, `length`, `cancelled`, `failed`).
    pub fn outcome(&self, outcome: &'static str, n: u64) {
        counter(&self.recorder, TURN_OUTCOMES_TOTAL, "Turns ended, by outcome", &[("outcome", outcome)]).increment(n);
    }

    /// A reply finished: its outcome and, when a token was produced, its TTFT.
    pub fn finished(&self, reason: baton_text::FinishReason, ttft: Option<Duration>) {
        use baton_text::FinishReason as F;
        let outcome = match reason {
            F::Stop => "stop",
            F::Length => "length",
            F::Cancelled => "cancelled",
        };
        self.outcome(outcome, 1);
        if let Some(d) = ttft {
            self.ttft.record(d.as_secs_f64());
        }
    }

    /// A remote prefill shipped the computed tail of `tokens` prompt tokens here.
    pub fn imported(&self, tokens: u64) {
        self.imported_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    fn migration_counter(&self, outcome: &'static str) -> Counter {
        counter(&self.recorder, DRAIN_MIGRATIONS_TOTAL, "Conversations a drain tried to migrate, by outcome", &[("outcome", outcome)])
    }

    /// A drain migrated (or failed to migrate) one conversation's `blocks`.
    pub fn migration(&self, outcome: &'static str, blocks: u64) {
        self.migration_counter(outcome).increment(1);
        self.drain_blocks.increment(blocks);
    }

    /// This node adopted one warm prefix of `blocks` from a draining node.
    pub fn adopted(&self, blocks: u64) {
        self.adopted_prefixes.increment(1);
        self.adopted_blocks.increment(blocks);
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

/// Records the timings of one reply's tokens: `elapsed` is the time since submission.
pub struct TokenTimer<'a> {
    metrics: &'a Metrics,
    last: Option<Duration>,
}

impl<'a> TokenTimer<'a> {
    pub fn new(metrics: &'a Metrics) -> Self {
        TokenTimer { metrics, last: None }
    }

    pub fn token(&mut self, elapsed: Duration) {
        if let Some(prev) = self.last {
            self.metrics.itl.record(elapsed.saturating_sub(prev).as_secs_f64());
        }
        self.last = Some(elapsed);
    }
}

/// The node's `/healthz` and `/metrics` (`baton_node_common::http`).
pub type HttpState = baton_node_common::http::HttpState<Metrics>;
pub use baton_node_common::http::router;

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn token_timer_records_gaps_and_drain_series_render() {
        let m = Metrics::new();
        let mut t = TokenTimer::new(&m);
        for ms in [100, 120, 150] {
            t.token(Duration::from_millis(ms));
        }
        m.finished(baton_text::FinishReason::Stop, Some(Duration::from_millis(100)));
        m.migration("moved", 7);
        m.migration("failed", 0);
        m.adopted(3);
        let text = m.recorder.handle().render();
        assert_eq!(value(&text, "baton_decode_inter_token_latency_seconds_count"), Some(2.0), "{text}");
        assert_eq!(value(&text, "baton_decode_inter_token_latency_seconds_bucket{le=\"0.02\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_time_to_first_token_seconds_bucket{le=\"0.1\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_turn_outcomes_total{outcome=\"stop\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_drain_migrations_total{outcome=\"moved\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_drain_migrated_blocks_total"), Some(7.0), "{text}");
        assert_eq!(value(&text, "baton_decode_adopted_prefixes_total"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_adopted_blocks_total"), Some(3.0), "{text}");
    }
}
