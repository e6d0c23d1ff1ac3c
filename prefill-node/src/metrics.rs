//! The prefill node's metrics (names per STYLE.md) and its HTTP endpoints
//! `/metrics` (Prometheus text) and `/healthz`.
//!
//! Owns: one `metrics-exporter-prometheus` recorder per node (never the process-wide
//! global one: `baton up` and the tests run several nodes in one process), the handles
//! registered in it, and the scrape-time refresh of the series derived from the
//! engine's and the KV transport's cumulative statistics.
//! Invariants: every name is a constant below; labels are small fixed sets (source,
//! state, tier, transport, side), never user, conversation or turn IDs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ::metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use baton_engine::Engine;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::kv::KvNode;

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

const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// A counter exported through the recorder whose value the node can also read.
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
        let count = |name: &'static str, help: &'static str| Count { handle: counter(&recorder, name, help, &[]), value: AtomicU64::new(0) };
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
        let r = &self.recorder;
        let st = engine.stats();
        let bt = engine.info.kv_layout.block_tokens.max(1) as u64;
        let cached = st.cached_prompt_tokens;
        let tier2 = st.cached_tier2_prompt_tokens.min(cached);
        let imported = self.imported_tokens.load(Ordering::Relaxed).min(st.prompt_tokens - cached.min(st.prompt_tokens));
        let computed = st.prompt_tokens.saturating_sub(cached + imported);
        let help = "Prompt tokens by source: prefix cache (tier), pulled from a decode node, computed here";
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
