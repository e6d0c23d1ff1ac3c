//! The parts of OpenAI's Conversations API that Baton's own conversation API lacks, on
//! the same conversations: `POST /v1/conversations/{id}` (update the metadata) and the
//! items, `GET`/`POST /v1/conversations/{id}/items` and
//! `GET`/`DELETE /v1/conversations/{id}/items/{item_id}` (what items are and how a
//! deletion rewrites history and evicts KV: [`crate::conv_items`]). Create, retrieve
//! and delete of a conversation are `conversations.rs`, whose one answer shape serves
//! both APIs ([`crate::conv_common::conversation_json`]).
//!
//! Every call is the key owner's only: another user's conversation ID is a 404, as is
//! an item of it.

use crate::auth::AuthUser;
use crate::conv_common::{conversation_json, owned, parse_metadata};
use crate::conv_items;
use crate::error::ApiError;
use crate::listen::read_body;
use crate::metrics;
use crate::state::App;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

async fn json_body(app: &App, body: Body) -> Result<serde_json::Map<String, Value>, ApiError> {
    let raw = read_body(body, app.config.max_body_bytes, app.config.connections.header_timeout).await?;
    match serde_json::from_slice(&raw) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_request("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("invalid JSON body: {e}"))),
    }
}

/// Refuses any field but `allowed`, by name.
fn only(o: &serde_json::Map<String, Value>, allowed: &[&str]) -> Result<(), ApiError> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::bad_request(format!("{k}: unknown or unsupported field"))),
        None => Ok(()),
    }
}

/// `include` is accepted only empty: no includable detail exists for text messages.
fn no_include(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(_) => Err(ApiError::bad_param("include", "include: not supported (items are text messages)")),
    }
}

/// `POST /v1/conversations/{id}`: replaces the conversation's metadata.
pub async fn update(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>, body: Body) -> Result<Response, ApiError> {
    metrics::request("conversations_update");
    let o = json_body(&app, body).await?;
    only(&o, &["metadata"])?;
    if !o.contains_key("metadata") {
        return Err(ApiError::bad_param("metadata", "metadata: is required"));
    }
    let metadata = parse_metadata("metadata", o.get("metadata"))?;
    let (conversation, mut c) = owned(&app, &user, &id).await?;
    if !app.store.set_metadata(user.as_str(), conversation.as_str(), &metadata).await? {
        return Err(ApiError::not_found("conversation"));
    }
    c.metadata = metadata;
    Ok(Json(conversation_json(&c)).into_response())
}

/// `POST /v1/conversations/{id}/items`: appends messages (checked like a turn's input;
/// no generation) and answers with the items added.
pub async fn create_items(State(app): State<Arc<App>>, auth: AuthUser, Path(id): Path<String>, body: Body) -> Result<Response, ApiError> {
    metrics::request("conversation_items_create");
    let o = json_body(&app, body).await?;
    only(&o, &["items", "include"])?;
    no_include(o.get("include"))?;
    let mut items = conv_items::parse_items(o.get("items").ok_or_else(|| ApiError::bad_param("items", "items: is required"))?)?;
    if items.is_empty() {
        return Err(ApiError::bad_param("items", "items: at least one item is required"));
    }
    conv_items::check_items(&app, &mut items)?;
    let (conversation, c) = owned(&app, &auth.0, &id).await?;
    let added = conv_items::append_items(&app, &auth, &conversation, &c, &items).await?;
    Ok(Json(conv_items::list_json(&added, false)).into_response())
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    order: Option<String>,
    #[serde(default)]
    include: Option<String>,
}

/// `GET /v1/conversations/{id}/items`: the items in `order` (`desc` by default, as
/// OpenAI's), `limit` (1 to 100, default 20) at a time after the item `after`.
pub async fn list_items(
    State(app): State<Arc<App>>,
    AuthUser(user, _): AuthUser,
    Path(id): Path<String>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    metrics::request("conversation_items_list");
    let Query(q) = q.map_err(|e| ApiError::bad_request(format!("invalid query: {}", e.body_text())))?;
    if q.include.is_some() {
        return Err(ApiError::bad_param("include", "include: not supported (items are text messages)"));
    }
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_param("limit", "limit: 1 to 100"));
    }
    let desc = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(_) => return Err(ApiError::bad_param("order", "order: \"asc\" or \"desc\"")),
    };
    let (conversation, _) = owned(&app, &user, &id).await?;
    let turns = app.store.list_turns(conversation.as_str()).await?;
    let mut items = conv_items::items_of(&turns);
    if desc {
        items.reverse();
    }
    let start = match &q.after {
        None => 0,
        Some(a) => items.iter().position(|(i, _)| i == a).map(|p| p + 1).ok_or_else(|| ApiError::bad_param("after", "after: no such item"))?,
    };
    let page: Vec<Value> = items.iter().skip(start).take(limit).map(|(_, v)| v.clone()).collect();
    let has_more = items.len() > start + page.len();
    Ok(Json(conv_items::list_json(&page, has_more)).into_response())
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn get_item(
    State(app): State<Arc<App>>,
    AuthUser(user, _): AuthUser,
    Path((id, item)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    metrics::request("conversation_items_get");
    let (conversation, _) = owned(&app, &user, &id).await?;
    conv_items::parse_item_id(&item)?;
    let turns = app.store.list_turns(conversation.as_str()).await?;
    let found = conv_items::items_of(&turns).into_iter().find(|(i, _)| *i == item).map(|(_, v)| v);
    Ok(Json(found.ok_or_else(|| ApiError::not_found("item"))?).into_response())
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: answers with the conversation (and
/// `kv_evicted`: whether every node acknowledged the eviction of the old history's KV
/// already; else the gateway retries until they do).
pub async fn delete_item(
    State(app): State<Arc<App>>,
    auth: AuthUser,
    Path((id, item)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    metrics::request("conversation_items_delete");
    let (conversation, _) = owned(&app, &auth.0, &id).await?;
    let kv_evicted = conv_items::delete_item(&app, &auth, &conversation, &item).await?;
    let c = app.store.get_conversation(auth.0.as_str(), conversation.as_str()).await?.ok_or_else(|| ApiError::not_found("conversation"))?;
    let mut v = conversation_json(&c);
    v["kv_evicted"] = json!(kv_evicted);
    Ok(Json(v).into_response())
}
