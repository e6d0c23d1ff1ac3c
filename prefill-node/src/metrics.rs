//! The prefill node's metrics (names per STYLE.md) and its HTTP endpoints
//! `/metrics` (Prometheus text) and `/healthz`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use baton_engine::Engine;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// `baton_prefill_turns_total`.
pub const TURNS: &str = "baton_prefill_turns";
/// `baton_prefill_pulled_prefixes_total`: prefixes pulled from a decode node.
pub const PULLED: &str = "baton_prefill_pulled_prefixes";
/// `baton_prefill_failures_total`.
pub const FAILURES: &str = "baton_prefill_failures";
/// `baton_prefill_shipped_blocks_total`.
pub const SHIPPED: &str = "baton_prefill_shipped_blocks";
/// `baton_prefill_generated_tokens_total`.
pub const GENERATED: &str = "baton_prefill_generated_tokens";
/// `baton_prefill_kv_blocks_free`.
pub const KV_FREE: &str = "baton_prefill_kv_blocks_free";
/// `baton_prefill_kv_blocks_used`.
pub const KV_USED: &str = "baton_prefill_kv_blocks_used";
/// `baton_prefill_running_sequences`.
pub const RUNNING: &str = "baton_prefill_running_sequences";

#[derive(Default)]
pub struct Metrics {
    pub turns: Counter,
    pub pulled: Counter,
    pub failures: Counter,
    pub shipped: Counter,
    pub generated: Counter,
    kv_free: Gauge,
    kv_used: Gauge,
    running: Gauge,
}

impl Metrics {
    fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register(TURNS, "Prefills received", self.turns.clone());
        r.register(PULLED, "Prefixes pulled from a decode node", self.pulled.clone());
        r.register(FAILURES, "Prefills that failed", self.failures.clone());
        r.register(SHIPPED, "KV blocks shipped to decode nodes", self.shipped.clone());
        r.register(GENERATED, "First tokens sampled", self.generated.clone());
        r.register(KV_FREE, "Free KV blocks", self.kv_free.clone());
        r.register(KV_USED, "KV blocks pinned by sequences", self.kv_used.clone());
        r.register(RUNNING, "Sequences running", self.running.clone());
        r
    }
}

/// What the HTTP endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub engine: Arc<Engine>,
    /// False until the node is registered (or runs without a coordinator).
    pub ready: Arc<AtomicBool>,
}

pub fn router(state: HttpState) -> Router {
    Router::new().route("/healthz", get(healthz)).route("/metrics", get(metrics)).with_state(state)
}

async fn healthz(State(s): State<HttpState>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

async fn metrics(State(s): State<HttpState>) -> Result<String, StatusCode> {
    let st = s.engine.stats();
    s.metrics.kv_free.set(st.kv.free as i64);
    s.metrics.kv_used.set(st.kv.used as i64);
    s.metrics.running.set(st.running as i64);
    let mut out = String::new();
    encode(&mut out, &s.metrics.registry()).map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(out)
}
