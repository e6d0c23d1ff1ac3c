//! A node's HTTP endpoints: `/healthz` (503 until the node is registered) and
//! `/metrics` (the node's own series, the engine's and the internal plane's refusals, in the
//! Prometheus text format).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use baton_engine::Engine;
use baton_proto::plane::PlaneStats;

use crate::engine_metrics::NodeRecorder;
use crate::kv::KvNode;

/// What the HTTP endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<NodeRecorder>,
    pub engine: Arc<Engine>,
    pub kv: Option<Arc<KvNode>>,
    /// False until the node is registered (or runs without a coordinator).
    pub ready: Arc<AtomicBool>,
    /// What the node's gRPC server refused (appended to /metrics).
    pub plane: Arc<PlaneStats>,
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
    let mut text = s.metrics.render(&s.engine, s.kv.as_deref());
    text.push_str(&s.plane.render());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
