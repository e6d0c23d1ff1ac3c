//! The coordinator's HTTP port: `/healthz`, `/metrics` (Prometheus text) and
//! `/debug/routing?key=...&limit=...` (the explain log for one routing key, as JSON).

use std::sync::Arc;

use axum::extract::{Query, State as AxState};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use crate::service::State;

pub(crate) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/debug/routing", get(debug_routing))
        .with_state(state)
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> Response {
    // Refreshes the node gauges and membership changes (expiries show without traffic).
    let _ = state.members().await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.encode(),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct RoutingQuery {
    key: Option<String>,
    #[serde(default)]
    limit: usize,
}

async fn debug_routing(AxState(state): AxState<Arc<State>>, Query(q): Query<RoutingQuery>) -> Response {
    let Some(key) = q.key.filter(|k| !k.is_empty()) else {
        return (StatusCode::BAD_REQUEST, Json(serde_json::json!({"error": "missing query parameter: key"}))).into_response();
    };
    let records = state.explain(&key, q.limit);
    Json(serde_json::json!({ "key": key, "records": records })).into_response()
}
