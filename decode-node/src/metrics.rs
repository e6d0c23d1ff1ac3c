//! The decode node's metrics (names per STYLE.md) and its HTTP endpoints
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

/// `baton_decode_turns_total`.
pub const TURNS: &str = "baton_decode_turns";
/// `baton_decode_remote_prefills_total`.
pub const REMOTE_PREFILLS: &str = "baton_decode_remote_prefills";
/// `baton_decode_local_prefills_total`.
pub const LOCAL_PREFILLS: &str = "baton_decode_local_prefills";
/// `baton_decode_prefill_fallbacks_total`: remote prefills that failed and were recomputed here.
pub const FALLBACKS: &str = "baton_decode_prefill_fallbacks";
/// `baton_decode_generated_tokens_total`.
pub const GENERATED: &str = "baton_decode_generated_tokens";
/// `baton_decode_kv_blocks_free`.
pub const KV_FREE: &str = "baton_decode_kv_blocks_free";
/// `baton_decode_kv_blocks_used`.
pub const KV_USED: &str = "baton_decode_kv_blocks_used";
/// `baton_decode_running_sequences`.
pub const RUNNING: &str = "baton_decode_running_sequences";

#[derive(Default)]
pub struct Metrics {
    pub turns: Counter,
    pub remote_prefills: Counter,
    pub local_prefills: Counter,
    pub fallbacks: Counter,
    pub generated: Counter,
    kv_free: Gauge,
    kv_used: Gauge,
    running: Gauge,
}

impl Metrics {
    fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register(TURNS, "Turns received", self.turns.clone());
        r.register(REMOTE_PREFILLS, "Turns whose tail a prefill node computed", self.remote_prefills.clone());
        r.register(LOCAL_PREFILLS, "Turns prefilled on this node", self.local_prefills.clone());
        r.register(FALLBACKS, "Remote prefills that failed and were recomputed here", self.fallbacks.clone());
        r.register(GENERATED, "Tokens streamed", self.generated.clone());
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
