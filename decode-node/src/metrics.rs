//! The decode node's own series (names per STYLE.md), each named under the
//! role's prefix: `baton_decode_` + the name given here. The recorder, the
//! engine- and transport-derived series (`baton_decode_queue_depth`, ...) and
//! the `/metrics` endpoint are the node shell's
//! (`baton_node_common::engine_metrics`); docs/metrics.md lists every name.
//! Invariants: labels are small fixed sets (outcome), never user,
//! conversation or turn IDs.

use std::sync::Arc;
use std::time::Duration;

use ::metrics::{Counter, Histogram};
pub use baton_node_common::engine_metrics::Count;
use baton_node_common::engine_metrics::NodeRecorder;

/// Latency buckets (seconds) around the 50 ms ITL target.
pub const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
/// Byte buckets of the KV a remote prefill left off the wire (64 KiB to 256 MiB).
pub const SKIPPED_BYTES_BUCKETS: &[f64] = &[0.0, 65_536.0, 262_144.0, 1_048_576.0, 4_194_304.0, 16_777_216.0, 67_108_864.0, 268_435_456.0];
/// Buckets of this role's histograms besides TTFT (the shell's), by name under the prefix.
pub const BUCKETS: &[(&str, &[f64])] = &[
    ("inter_token_latency_seconds", ITL_BUCKETS),
    ("kv_window_skipped_bytes", SKIPPED_BYTES_BUCKETS),
    ("kv_window_saved_bytes", SKIPPED_BYTES_BUCKETS),
];

/// Handles to the decode node's own series.
pub struct Metrics {
    node: Arc<NodeRecorder>,
    /// `turns_total`: turns received.
    pub turns: Counter,
    /// `remote_prefills_total`: turns whose tail a prefill node computed.
    pub remote_prefills: Count,
    /// `local_prefills_total`: turns prefilled on this node.
    pub local_prefills: Count,
    /// `prefill_fallbacks_total`: remote prefills that failed and were recomputed here.
    pub fallbacks: Count,
    /// `kv_source_total{outcome, reason}`: turns by where their prompt KV came from
    /// (`crate::kv_source`), counted at the first token.
    kv_source: Vec<((&'static str, &'static str), Counter)>,
    /// `generated_tokens_total`: tokens streamed to callers.
    pub generated: Counter,
    /// `time_to_first_token_seconds`: engine time from submission to the first token.
    pub ttft: Histogram,
    /// `inter_token_latency_seconds`: engine time between consecutive tokens of one reply.
    pub itl: Histogram,
    /// `kv_window_skipped_bytes`: per remote prefill (one turn), KV bytes not shipped
    /// because they lay before every later row's sliding window.
    pub window_skipped_bytes: Histogram,
    /// `kv_window_saved_bytes`: per turn, KV memory of sliding-window layers its blocks
    /// did not hold at its end (behind every later row's window: not received, or given
    /// back to other blocks).
    pub window_saved_bytes: Histogram,
    /// `drain_migrated_blocks_total`: KV blocks migrated away by a drain.
    drain_blocks: Counter,
    /// `adopted_prefixes_total`: prefixes adopted from a draining node.
    adopted_prefixes: Counter,
    /// `adopted_blocks_total`: KV blocks adopted from a draining node.
    adopted_blocks: Counter,
}

impl Metrics {
    /// Registers the decode node's series in its recorder (made from the role's `MetricsSpec`).
    pub fn new(node: Arc<NodeRecorder>) -> Self {
        let n = &node;
        let m = Metrics {
            turns: n.counter("turns_total", "Turns received", &[]),
            remote_prefills: n.count("remote_prefills_total", "Turns whose tail a prefill node computed"),
            local_prefills: n.count("local_prefills_total", "Turns prefilled on this node"),
            fallbacks: n.count("prefill_fallbacks_total", "Remote prefills that failed and were recomputed here"),
            kv_source: baton_proto::kv_source::PAIRS
                .iter()
                .map(|&(outcome, reason)| {
                    let c = n.counter("kv_source_total", "Turns by where their prompt KV came from", &[("outcome", outcome), ("reason", reason)]);
                    ((outcome, reason), c)
                })
                .collect(),
            generated: n.counter("generated_tokens_total", "Tokens streamed", &[]),
            ttft: n.histogram("time_to_first_token_seconds", "Engine time from submission to the first token"),
            itl: n.histogram("inter_token_latency_seconds", "Engine time between consecutive tokens of one reply"),
            window_skipped_bytes: n.histogram(
                "kv_window_skipped_bytes",
                "KV bytes a remote prefill did not ship, per turn: sliding-window layers' blocks before every later row's window",
            ),
            window_saved_bytes: n.histogram(
                "kv_window_saved_bytes",
                "KV memory a turn's blocks did not hold at its end, per turn: sliding-window layers behind every later row's window",
            ),
            drain_blocks: n.counter("drain_migrated_blocks_total", "KV blocks migrated to other decode nodes by a drain", &[]),
            adopted_prefixes: n.counter("adopted_prefixes_total", "Warm prefixes adopted from a draining decode node", &[]),
            adopted_blocks: n.counter("adopted_blocks_total", "KV blocks adopted from a draining decode node", &[]),
            node: node.clone(),
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
        self.node.counter("turn_outcomes_total", "Turns ended, by outcome", &[("outcome", outcome)]).increment(n);
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

    /// One turn's KV source (proof of transfer); a pair outside the fixed set is not counted.
    pub fn kv_source(&self, source: &baton_proto::node::KvSource) {
        let labels = baton_proto::kv_source::labels(source);
        if let Some((_, c)) = self.kv_source.iter().find(|(l, _)| *l == labels) {
            c.increment(1);
        }
    }

    /// A remote prefill shipped the computed tail of `tokens` prompt tokens here.
    pub fn imported(&self, tokens: u64) {
        self.node.imported(tokens);
    }

    fn migration_counter(&self, outcome: &'static str) -> Counter {
        self.node.counter("drain_migrations_total", "Conversations a drain tried to migrate, by outcome", &[("outcome", outcome)])
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

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn token_timer_records_gaps_and_drain_series_render() {
        let node = Arc::new(NodeRecorder::new(&crate::METRICS));
        let m = Metrics::new(node.clone());
        let mut t = TokenTimer::new(&m);
        for ms in [100, 120, 150] {
            t.token(Duration::from_millis(ms));
        }
        m.finished(baton_text::FinishReason::Stop, Some(Duration::from_millis(100)));
        m.migration("moved", 7);
        m.migration("failed", 0);
        m.adopted(3);
        use baton_proto::node::{KvOutcome, KvReason, KvSource};
        m.kv_source(&KvSource { outcome: KvOutcome::Recomputed as i32, reason: KvReason::TransferFailed as i32 });
        m.kv_source(&KvSource { outcome: 42, reason: 0 });
        m.window_skipped_bytes.record(3_000_000.0);
        m.window_saved_bytes.record(200_000.0);
        let text = node.render_own();
        assert_eq!(value(&text, "baton_decode_inter_token_latency_seconds_count"), Some(2.0), "{text}");
        assert_eq!(value(&text, "baton_decode_inter_token_latency_seconds_bucket{le=\"0.02\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_time_to_first_token_seconds_bucket{le=\"0.1\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_turn_outcomes_total{outcome=\"stop\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_drain_migrations_total{outcome=\"moved\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_drain_migrated_blocks_total"), Some(7.0), "{text}");
        assert_eq!(value(&text, "baton_decode_adopted_prefixes_total"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_adopted_blocks_total"), Some(3.0), "{text}");
        assert_eq!(value(&text, "baton_decode_kv_source_total{outcome=\"recomputed\",reason=\"transfer_failed\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_kv_source_total{outcome=\"imported\",reason=\"remote_prefill\"}"), Some(0.0), "every pair is exported from the start: {text}");
        assert!(!text.contains("unknown"), "a pair outside the set is not a series: {text}");
        assert_eq!(value(&text, "baton_decode_kv_window_skipped_bytes_sum"), Some(3_000_000.0), "{text}");
        assert_eq!(value(&text, "baton_decode_kv_window_skipped_bytes_bucket{le=\"4194304\"}"), Some(1.0), "{text}");
        assert_eq!(value(&text, "baton_decode_kv_window_saved_bytes_bucket{le=\"262144\"}"), Some(1.0), "{text}");
    }
}
