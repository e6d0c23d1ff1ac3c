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

use crate::kv::KvNode;

/// A node's metrics, rendered for a scrape.
pub trait RenderMetrics: Send + Sync + 'static {
    fn render(&self, engine: &Engine, kv: Option<&KvNode>) -> String;
}

/// What the HTTP endpoints read.
pub struct HttpState<M> {
    pub metrics: Arc<M>,
    pub engine: Arc<Engine>,
    pub kv: Option<Arc<KvNode>>,
    /// False until the node is registered (or runs without a coordinator).
    pub ready: Arc<AtomicBool>,
    /// What the node's gRPC server refused (appended to /metrics).
    pub plane: Arc<PlaneStats>,
}

// By hand: a derive would ask `M: Clone`, and only the `Arc`s are cloned.
impl<M> Clone for HttpState<M> {
    fn clone(&self) -> Self {
        HttpState {
            metrics: self.metrics.clone(),
            engine: self.engine.clone(),
            kv: self.kv.clone(),
            ready: self.ready.clone(),
            plane: self.plane.clone(),
        }
    }
}

pub fn router<M: RenderMetrics>(state: HttpState<M>) -> Router {
    Router::new().route("/healthz", get(healthz::<M>)).route("/metrics", get(scrape::<M>)).with_state(state)
}

async fn healthz<M: RenderMetrics>(State(s): State<HttpState<M>>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

async fn scrape<M: RenderMetrics>(State(s): State<HttpState<M>>) -> Response {
    let mut text = s.metrics.render(&s.engine, s.kv.as_deref());
    text.push_str(&s.plane.render());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
