//! The HTTP server: the router, the retention job, and serving (plain HTTP, or
//! HTTPS when the config has TLS) until shutdown. The one module that imports the
//! handler modules (`openai`, `completions`, `conversations`, `conversation_items`, `responses`); the state they share is
//! [`crate::state::App`].

use crate::error::ApiError;
use baton_vocab::ErrorKind;
use crate::generator::Generator;
use crate::state::App;
use crate::{completions, conversation_items, conversations, metrics, openai, responses};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

async fn metrics_text() -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], metrics::encode()).into_response()
}

/// `/metrics` on the public listener: only for the admin key. Series name no users, but
/// they show the service's load and errors to whoever reads them.
async fn public_metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let Some(admin) = &app.config.admin_key else {
        return ApiError::new(ErrorKind::NotFound, "/metrics is served on the admin listener (--admin-listen), or here with an admin key").into_response();
    };
    if !admin.admits(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())) {
        return ApiError::new(ErrorKind::Unauthenticated, "/metrics needs the admin key: Authorization: Bearer <key>").into_response();
    }
    metrics_text().await
}

/// The operators' listener: metrics and health, no key (bind it to a private address).
pub fn admin_router(generator: Arc<dyn Generator>) -> Router {
    Router::new().route("/metrics", get(metrics_text)).route("/healthz", get(admin_health)).fallback(fallback).with_state(generator)
}

/// `ok`, or why the gateway serves degraded (still 200: it serves).
fn health_text(generator: &dyn Generator) -> String {
    generator.degraded().unwrap_or_else(|| "ok".to_string())
}

async fn admin_health(State(generator): State<Arc<dyn Generator>>) -> String {
    health_text(generator.as_ref())
}

async fn health(State(app): State<Arc<App>>) -> String {
    health_text(app.generator.as_ref())
}

async fn fallback() -> ApiError {
    ApiError::new(ErrorKind::NotFound, "no such route")
}

/// The router over `app`.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(crate::page::index))
        .route("/healthz", get(health))
        .route("/metrics", get(public_metrics))
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/responses/{id}/input_items", get(responses::input_items))
        .route("/v1/conversations", post(conversations::create).get(conversations::list))
        .route("/v1/conversations/{id}", get(conversations::get).post(conversation_items::update).delete(conversations::delete))
        .route("/v1/conversations/{id}/items", get(conversation_items::list_items).post(conversation_items::create_items))
        .route("/v1/conversations/{id}/items/{item_id}", get(conversation_items::get_item).delete(conversation_items::delete_item))
        .route("/v1/conversations/{id}/turns", post(conversations::add_turn))
        .route("/v1/conversations/{id}/turns/{turn_id}/events", get(conversations::events))
        .route("/v1/conversations/{id}/turns/{turn_id}/stop", post(conversations::stop))
        .fallback(fallback)
        .method_not_allowed_fallback(|| async {
            ApiError::bad_request("method not allowed").with_status(StatusCode::METHOD_NOT_ALLOWED)
        })
        .with_state(app)
}

/// Deletes conversations past retention every hour; each leaves a tombstone due now,
/// so the eviction task evicts their KV.
async fn retention_job(app: Arc<App>) {
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    loop {
        tick.tick().await;
        let cutoff = crate::store::now_unix() - app.config.retention.as_secs() as i64;
        match app.store.delete_older_than(cutoff).await {
            Ok(ids) => {
                if !ids.is_empty() {
                    tracing::info!(deleted = ids.len(), "retention: expired conversations deleted");
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention job failed"),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` completes, under the connection limits of
/// its config ([`crate::listen`]), and the admin listener if the config names one.
pub async fn serve(listener: TcpListener, app: Arc<App>, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let admin = match app.config.admin_listen {
        Some(addr) => Some(TcpListener::bind(addr).await?),
        None => None,
    };
    serve_with_admin(listener, admin, app, shutdown).await
}

/// [`serve`], with the admin listener bound by the caller (`None`: no admin listener).
pub async fn serve_with_admin(
    listener: TcpListener,
    admin: Option<TcpListener>,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let job = tokio::spawn(retention_job(app.clone()));
    let evictions = tokio::spawn(app.evictions.clone().run());
    let tls = app.config.tls.as_ref().map(|t| {
        tracing::info!(cert = %t.cert.display(), "gateway serves HTTPS");
        t.acceptor()
    });
    let mut limits = app.config.connections;
    match crate::listen::raise_open_files_limit() {
        Ok(open_files) => {
            let fitted = limits.within(open_files);
            if fitted.max_connections < limits.max_connections {
                tracing::warn!(
                    asked = limits.max_connections,
                    allowed = fitted.max_connections,
                    open_files,
                    "--max-connections lowered to fit the open-files limit (raise the hard limit, e.g. LimitNOFILE or ulimit -Hn, for more)"
                );
            }
            limits = fitted;
        }
        Err(e) => tracing::warn!(error = %e, "could not read the open-files limit; --max-connections kept as given"),
    }
    // One shutdown for both listeners.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let admin = match admin {
        Some(l) => {
            tracing::info!(addr = %l.local_addr()?, "gateway admin listener (/metrics, /healthz)");
            Some(tokio::spawn(crate::listen::serve(l, admin_router(app.generator.clone()), None, limits, stopped())))
        }
        None => None,
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let r = crate::listen::serve(listener, router(app), tls, limits, stopped()).await;
    job.abort();
    evictions.abort();
    if let Some(admin) = admin {
        match admin.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the admin listener failed"),
            Err(e) => tracing::warn!(error = %e, "the admin listener panicked"),
            Ok(Ok(())) => {}
        }
    }
    r
}
