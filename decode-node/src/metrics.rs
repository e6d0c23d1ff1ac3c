//! The decode node's metrics (names per STYLE.md) and its HTTP endpoints
//! `/metrics` (Prometheus text) and `/healthz`.
//!
//! Owns: one `metrics-exporter-prometheus` recorder per node (never the process-wide
//! global one: `baton up` and the tests run several nodes in one process), the handles
//! registered in it, and the scrape-time refresh of the series derived from the
//! engine's and the KV transport's cumulative statistics.
//! Invariants: every name is a constant below; labels are small fixed sets (source,
//! state, tier, outcome, transport, side), never user, conversation or turn IDs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use baton_engine::Engine;
use ::metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::kv::KvNode;

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

const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// A counter exported through the recorder whose value the node can also read
/// (for its gRPC `Stats`).
pub struct Count {
    handle: Counter,
    value: AtomicU64,
}

impl Count {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
        self.handle.increment(n);
    }

    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

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
        let count = |name: &'static str, help: &'static str| Count { handle: c(name, help), value: AtomicU64::new(0) };
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
    pub fn finished(&self, reason: baton_engine::FinishReason, ttft: Option<Duration>) {
        use baton_engine::FinishReason as F;
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
        let r = &self.recorder;
        let st = engine.stats();
        let bt = engine.info.kv_layout.block_tokens.max(1) as u64;
        let cached = st.cached_prompt_tokens;
        let tier2 = st.cached_tier2_prompt_tokens.min(cached);
        let imported = self.imported_tokens.load(Ordering::Relaxed).min(st.prompt_tokens - cached.min(st.prompt_tokens));
        let computed = st.prompt_tokens.saturating_sub(cached + imported);
        let help = "Prompt tokens by source: prefix cache (tier), imported from a prefill node, computed here";
        for (source, n) in [("cached_tier1", cached - tier2), ("cached_tier2", tier2), ("imported", imported), ("computed", computed)] {
            counter(r, PROMPT_TOKENS_TOTAL, help, &[("source", source)]).absolute(n);
        }
        let help = "Prompt tokens matched in the prefix cache, by tier";
        counter(r, PREFIX_HIT_TOKENS_TOTAL, help, &[("tier", "1")]).absolute(st.kv.primary_hits * bt);
        counter(r, PREFIX_HIT_TOKENS_TOTAL, help, &[("tier", "2")]).absolute(st.kv.tier2_hits * bt);
        let help = "Tokens the engine computed, by phase";
        counter(r, ENGINE_TOKENS_TOTAL, help, &[("phase", "prefill")]).absolute(st.prefill_tokens);
        counter(r, ENGINE_TOKENS_TOTAL, help, &[("phase", "decode")]).absolute(st.decode_tokens);
        counter(r, PREEMPTIONS_TOTAL, "Sequences preempted to make room", &[]).absolute(st.preemptions);
        gauge(r, QUEUE_DEPTH, "Sequences waiting for admission", &[]).set(st.waiting as f64);
        gauge(r, RUNNING, "Sequences running", &[]).set(st.running as f64);
        gauge(r, SWAPPED, "Sequences swapped out to the second tier", &[]).set(st.swapped as f64);
        let k = &st.kv;
        let tier2_free = k.tier2_capacity.saturating_sub(k.tier2_blocks + k.swapped);
        for (state, tier, n) in [
            ("free", "1", k.free),
            ("used", "1", k.used),
            ("cached", "1", k.cached),
            ("free", "2", tier2_free),
            ("used", "2", k.swapped),
            ("cached", "2", k.tier2_blocks),
        ] {
            gauge(r, KV_BLOCKS, "KV blocks by state and tier", &[("state", state), ("tier", tier)]).set(n as f64);
        }
        gauge(r, KV_BLOCK_BYTES, "Bytes of one KV block (all layers, K and V)", &[]).set(engine.info.kv_layout.block_bytes() as f64);
        if let Some(kv) = kv {
            gauge(r, STAGING_BLOCKS_USED, "Staging blocks held by in-flight KV imports", &[]).set(kv.staging_used() as f64);
        }
        let mut out = r.handle().render();
        float_counter(&mut out, BUSY_SECONDS_TOTAL, "Seconds the engine spent computing steps", st.busy_seconds);
        if let Some(kv) = kv {
            let mut stats = kv.receiver.transport_stats();
            stats.push(kv.sender.stats().clone());
            baton_kv_transport::metrics::render_prometheus(&mut out, &stats, kv.receiver.stats());
        }
        out
    }
}

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    Key::from_parts(name, labels.iter().map(|(k, v)| Label::new(*k, *v)).collect::<Vec<_>>())
}

fn counter(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
    r.describe_counter(name.into(), None, help.into());
    r.register_counter(&key(name, labels), &META)
}

fn gauge(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
    r.describe_gauge(name.into(), None, help.into());
    r.register_gauge(&key(name, labels), &META)
}

fn histogram(r: &PrometheusRecorder, name: &'static str, help: &'static str) -> Histogram {
    r.describe_histogram(name.into(), None, help.into());
    r.register_histogram(&key(name, &[]), &META)
}

/// A counter with a fractional value (the `metrics` counters are integers).
fn float_counter(out: &mut String, name: &str, help: &str, value: f64) {
    use std::fmt::Write;
    let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n\n");
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

/// What the HTTP endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub engine: Arc<Engine>,
    pub kv: Option<Arc<KvNode>>,
    /// False until the node is registered (or runs without a coordinator).
    pub ready: Arc<AtomicBool>,
}

pub fn router(state: HttpState) -> Router {
    Router::new().route("/healthz", get(healthz)).route("/metrics", get(scrape)).with_state(state)
}

async fn healthz(State(s): State<HttpState>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

async fn scrape(State(s): State<HttpState>) -> Response {
    let text = s.metrics.render(&s.engine, s.kv.as_deref());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

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
        m.finished(baton_engine::FinishReason::Stop, Some(Duration::from_millis(100)));
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
