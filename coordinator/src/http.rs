//! The coordinator's HTTP port: `/healthz`, `/metrics` (Prometheus text, for a scraper on
//! the cluster's private network) and `/debug/routing?key=...&limit=...` (the explain log
//! for one routing key, as JSON). Routing records name conversations, so
//! `/debug/routing` answers only to the admin key and is off without one.

use std::sync::Arc;

use axum::extract::{Query, State as AxState};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use baton_identity::AdminKey;
use baton_proto::plane::PlaneStats;
use serde::Deserialize;

use crate::service::State;

/// What the HTTP endpoints read.
#[derive(Clone)]
pub(crate) struct HttpState {
    pub state: Arc<State>,
    /// The gRPC server's refusals, appended to /metrics.
    pub plane: Arc<PlaneStats>,
    /// Opens /debug/routing; `None`: it is off.
    pub admin_key: Option<AdminKey>,
}

pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/debug/routing", get(debug_routing))
        .with_state(state)
}

async fn metrics(AxState(s): AxState<HttpState>) -> Response {
    // Refreshes the node gauges and membership changes (expiries show without traffic).
    let _ = s.state.members().await;
    // Tombstones other replicas recorded or cleared (etcd) show without an eviction here.
    s.state.count_tombstones().await;
    let mut text = s.state.metrics.encode();
    text.push_str(&s.plane.render());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

#[derive(Debug, Deserialize)]
struct RoutingQuery {
    key: Option<String>,
    #[serde(default)]
    limit: usize,
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn debug_routing(AxState(s): AxState<HttpState>, headers: HeaderMap, Query(q): Query<RoutingQuery>) -> Response {
    let Some(admin) = &s.admin_key else {
        return error(StatusCode::FORBIDDEN, "/debug/routing is off: start the coordinator with BATON_ADMIN_KEY or --admin-key-file");
    };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if !admin.admits(given) {
        let mut r = error(StatusCode::UNAUTHORIZED, "/debug/routing needs the admin key: Authorization: Bearer <key>");
        r.headers_mut().insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("a valid header value"));
        return r;
    }
    let Some(key) = q.key.filter(|k| !k.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "missing query parameter: key");
    };
    let conversation = match baton_vocab::ConversationId::parse(key.as_str()) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("key: {e}")),
    };
    let records = s.state.explain(&conversation, q.limit);
    Json(serde_json::json!({ "key": key, "records": records })).into_response()
}
