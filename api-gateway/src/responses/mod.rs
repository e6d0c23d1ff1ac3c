//! OpenAI's Responses API over Baton's conversation store: `POST /v1/responses`,
//! `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and
//! `GET /v1/responses/{id}/input_items`.
//!
//! A response is one turn of a stored conversation (its ID names both, [`object`]), so
//! everything a conversation turn has applies: the owner check (another user's
//! response is a 404), per-user limits, input and output checks, idempotency
//! (`Idempotency-Key`), resumable streams, the SLO counters, deletion with tombstones
//! and KV eviction, retention. Without `previous_response_id` or `conversation` a
//! response starts a new conversation. `previous_response_id` naming the latest turn
//! of its conversation continues it: the prompt is the stored prompt and reply token
//! IDs plus the new message, and the routing key is the conversation, so the turn
//! reaches the decode node that holds the prefix warm. Naming an earlier turn forks: a
//! new conversation gets copies of the turns up to it (token-exact, so the owner's
//! cached prefix still serves it) and the original's history is never changed.

pub mod object;
pub mod request;

use crate::auth::AuthUser;
use crate::conv_common::{busy, delete_owned, follower_slot, owned, parse_conversation_id, parse_turn_id};
use crate::context::Prompt;
use crate::error::ApiError;
use crate::listen::read_body;
use crate::live::TurnEvent;
use crate::state::App;
use crate::store::{BeginTurn, Conversation, Turn, TurnEnd, TurnState};
use crate::{metrics, polled, request_id, turns};
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use baton_text::chat_template::ChatMessage;
use baton_vocab::{ConversationId, OwnerId, TurnId};
use futures::stream::BoxStream;
use futures::StreamExt;
use object::Meta;
use request::ResponseRequest;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::sync::Arc;

/// Where a new response's turn goes in its conversation.
enum Base {
    /// The conversation's first turn, or after its latest (the `conversation` field).
    Latest,
    /// After exactly this turn (`previous_response_id`); a 409 if another turn
    /// continued it meanwhile (a retry then branches).
    After(String),
}

fn short_hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    h.finalize()[..12].iter().map(|b| format!("{b:02x}")).collect()
}

/// The `Last-Event-ID` header: the sequence number a client resumes after.
fn last_event_id(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    match headers.get("last-event-id").map(|v| v.to_str().map(|s| s.trim().parse::<u64>())) {
        None => Ok(None),
        Some(Ok(Ok(n))) => Ok(Some(n)),
        _ => Err(ApiError::bad_request("Last-Event-ID must be a sequence number of this response")),
    }
}

/// The conversation, its turns and the turn a response ID names, if `owner` owns it.
async fn find(app: &App, owner: &OwnerId, id: &str) -> Result<(ConversationId, Conversation, Vec<Turn>, Turn), ApiError> {
    let (c, t) = object::parse_response_id(id)?;
    let conv = app.store.get_conversation(owner.as_str(), c.as_str()).await?.ok_or_else(|| ApiError::not_found("response"))?;
    let turns = app.store.list_turns(c.as_str()).await?;
    // A turn the client added as items was never a response.
    let turn = turns.iter().find(|x| x.turn_id == t.as_str() && !x.added_as_items()).cloned().ok_or_else(|| ApiError::not_found("response"))?;
    Ok((c, conv, turns, turn))
}

/// What the store says about a response (its metadata; the request's sampling fields
/// are not kept).
fn stored_meta(app: &App, conversation: &str, turns: &[Turn], t: &Turn) -> Meta {
    let previous = turns
        .iter()
        .rev()
        .find(|p| p.seq < t.seq && p.state.in_context())
        .filter(|p| !p.added_as_items())
        .map(|p| object::response_id(conversation, &p.turn_id));
    Meta {
        id: object::response_id(conversation, &t.turn_id),
        item_id: object::output_item_id(&t.turn_id),
        created_at: t.created_at,
        model: app.model_id.clone(),
        previous_response_id: previous,
        metadata: t.metadata.clone(),
        store: true,
        truncation: "disabled".into(),
        ..Meta::default()
    }
}

/// A new conversation for `owner`: with an idempotency key its ID comes from the owner
/// and the key, so a retry finds the one the first try made (`true`: it already existed).
async fn new_conversation(app: &App, owner: &OwnerId, idem: Option<&str>, like: Option<&Conversation>) -> Result<(ConversationId, Conversation, bool), ApiError> {
    let id = parse_conversation_id(&match idem {
        Some(k) => format!("conv-{}", short_hash(&[owner.as_str(), k])),
        None => format!("conv-{}", request_id()),
    })?;
    if let Some(c) = app.store.get_conversation(owner.as_str(), id.as_str()).await? {
        return Ok((id, c, true));
    }
    let now = crate::store::now_unix();
    let c = Conversation {
        id: id.as_str().to_string(),
        owner: owner.as_str().to_string(),
        title: like.map(|l| l.title.clone()).unwrap_or_default(),
        system_prompt_version: like.map(|l| l.system_prompt_version).unwrap_or(app.context.system_prompt_version),
        created_at: now,
        updated_at: now,
        summary: None,
        metadata: Default::default(),
    };
    app.store.create_conversation(&c).await?;
    Ok((id, c, false))
}

/// Copies `turns` up to and including `upto` (those in the context) into the new
/// conversation `into`, token-exact: the fork's next prompt is the same prefix.
async fn copy_history(app: &App, from: &Conversation, turns: &[Turn], upto: &Turn, into: &ConversationId) -> Result<(), ApiError> {
    let kept = turns.iter().filter(|t| t.state.in_context() && t.seq <= upto.seq);
    for (seq, t) in kept.enumerate() {
        let row = Turn {
            conversation: into.as_str().to_string(),
            seq: seq as i64,
            state: TurnState::Streaming,
            reply_text: String::new(),
            output_ids: vec![],
            finish_reason: None,
            ..t.clone()
        };
        if !matches!(app.store.begin_turn(&row).await?, BeginTurn::Created) {
            return Err(busy());
        }
        let end = TurnEnd {
            state: t.state,
            reply_text: t.reply_text.clone(),
            output_ids: t.output_ids.clone(),
            finish_reason: t.finish_reason.clone().unwrap_or_default(),
            prompt_tokens: t.prompt_tokens,
            cached_tokens: t.cached_tokens,
            completion_tokens: t.completion_tokens,
        };
        app.store.finish_turn(into.as_str(), &t.turn_id, &end).await?;
    }
    if let Some(s) = &from.summary {
        app.store.set_summary(into.as_str(), s, None).await?;
    }
    Ok(())
}

/// A first turn's prompt: `instructions` (or the input's leading system messages, or
/// else the platform's system prompt) as the system message, then the input items.
/// The stored user text is the last user message.
fn first_prompt(app: &App, req: &ResponseRequest) -> Result<(Prompt, String), ApiError> {
    let lead = req.messages.iter().take_while(|m| m.role == "system").count();
    let rest = &req.messages[lead..];
    if rest.iter().any(|m| m.role == "system") {
        return Err(ApiError::bad_param("input", "input: system and developer messages may only come first"));
    }
    let user_text = rest.iter().rev().find(|m| m.role == "user").map(|m| m.content.clone()).unwrap_or_default();
    let bad = |e: crate::context::ContextError| ApiError::bad_param("input", e.to_string());
    if req.instructions.is_none() && lead == 0 && rest.len() == 1 {
        return Ok((app.context.first_turn(&user_text).map_err(bad)?, user_text));
    }
    let mut system: Vec<&str> = req.instructions.iter().map(String::as_str).collect();
    system.extend(req.messages[..lead].iter().map(|m| m.content.as_str()));
    let system = if system.is_empty() { app.context.system_prompt.clone() } else { system.join("\n\n") };
    let mut msgs = vec![ChatMessage::system(system)];
    msgs.extend(rest.iter().cloned());
    Ok((app.context.encode_messages(&msgs).map_err(bad)?, user_text))
}

/// `POST /v1/responses`.
pub async fn create(State(app): State<Arc<App>>, AuthUser(user, key): AuthUser, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    metrics::request("responses_create");
    let raw = read_body(body, app.config.max_body_bytes, app.config.connections.header_timeout).await?;
    let req = request::parse(&raw, app.config.default_max_tokens)?;
    crate::params::check_max_tokens(req.sampling.max_tokens, app.config.max_tokens_ceiling)?;
    if let Some(i) = &req.instructions {
        app.checks.check_input(i).map_err(|r| ApiError { param: Some("instructions"), ..ApiError::refused(r.reason) })?;
    }
    for (i, m) in req.messages.iter().enumerate() {
        app.checks.check_input(&m.content).map_err(|r| ApiError { param: Some("input"), ..ApiError::refused(format!("input[{i}]: {}", r.reason)) })?;
    }
    let idem = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| ApiError::bad_request("Idempotency-Key must be ASCII"))?.to_string()),
    };
    let turn_id = parse_turn_id(&match &idem {
        Some(k) => format!("idem-{}", short_hash(&[k])),
        None => format!("r{}", request_id()),
    })?;
    let starting_after = last_event_id(&headers)?;
    let mut meta = Meta {
        created_at: crate::store::now_unix(),
        model: app.model_id.clone(),
        instructions: req.instructions.clone(),
        metadata: req.metadata.clone(),
        temperature: Some(req.sampling.temperature),
        top_p: Some(req.sampling.top_p),
        max_output_tokens: req.max_output_tokens,
        previous_response_id: req.previous_response_id.clone(),
        conversation: None,
        store: req.store,
        truncation: req.truncation.clone(),
        ..Meta::default()
    };
    let not_found_prev = |e: ApiError| if e.status == StatusCode::NOT_FOUND { ApiError { param: Some("previous_response_id"), ..e } } else { e };
    // Where the turn goes, and whether its conversation is this request's own (made for
    // it: only then may `store: false` delete it afterwards).
    let (conversation, conv, base, own) = if let Some(prev) = &req.previous_response_id {
        let (c, conv, turns, t) = find(&app, &user, prev).await.map_err(not_found_prev)?;
        match t.state {
            TurnState::Failed => return Err(ApiError::bad_param("previous_response_id", "previous_response_id names a failed response")),
            TurnState::Streaming => return Err(busy()),
            TurnState::Done | TurnState::Stopped => {}
        }
        let latest = turns.iter().rev().find(|x| x.state.in_context() && x.turn_id != turn_id.as_str());
        let retry = turns.iter().any(|x| x.turn_id == turn_id.as_str());
        if retry || latest.is_some_and(|l| l.turn_id == t.turn_id) {
            if !req.store {
                return Err(ApiError::bad_param("store", "store: false only for a response that starts (or branches into) a new conversation"));
            }
            (c, conv, Base::After(t.turn_id.clone()), false)
        } else {
            let (fork, fconv, existed) = new_conversation(&app, &user, idem.as_deref(), Some(&conv)).await?;
            if !existed {
                copy_history(&app, &conv, &turns, &t, &fork).await?;
                tracing::info!(from = %c, fork = %fork, "response branches into a new conversation");
            }
            (fork, fconv, Base::After(t.turn_id.clone()), true)
        }
    } else if let Some(cid) = &req.conversation {
        let (c, conv) = owned(&app, &user, cid).await.map_err(|e| ApiError { param: Some("conversation"), ..e })?;
        if !req.store {
            return Err(ApiError::bad_param("store", "store: false only for a response that starts (or branches into) a new conversation"));
        }
        meta.conversation = Some(c.as_str().to_string());
        (c, conv, Base::Latest, false)
    } else {
        let (c, conv, _) = new_conversation(&app, &user, idem.as_deref(), None).await?;
        (c, conv, Base::Latest, true)
    };
    meta.id = object::response_id(conversation.as_str(), turn_id.as_str());
    meta.item_id = object::output_item_id(turn_id.as_str());
    let delete_after = own && !req.store;
    run_turn(app, user, key, conversation, conv, base, req, turn_id, meta, starting_after, delete_after).await
}

/// Admits the turn under the conversation's lock (retries attach or replay, a busy
/// conversation is a 409) and answers with it.
#[allow(clippy::too_many_arguments)]
async fn run_turn(
    app: Arc<App>,
    user: OwnerId,
    key: crate::key_cache::KeyHash,
    conversation: ConversationId,
    conv: Conversation,
    base: Base,
    req: ResponseRequest,
    turn_id: TurnId,
    meta: Meta,
    starting_after: Option<u64>,
    delete_after: bool,
) -> Result<Response, ApiError> {
    let from = object::resume_position(starting_after);
    let admission = app.admission.lock(conversation.as_str()).await;
    if let Some(live) = app.live.get(&conversation) {
        if live.turn_id != turn_id {
            return Err(busy());
        }
        if live.request_hash != req.hash {
            return Err(ApiError::conflict("this Idempotency-Key was used with a different request body"));
        }
        drop(admission);
        let slot = follower_slot(&app, &user).await?;
        metrics::turn("attached");
        let events = live.follow(app.config.resume_grace, from).boxed();
        return Ok(respond(events, meta, req.stream, starting_after, Some(slot)).await);
    }
    let turns = app.store.list_turns(conversation.as_str()).await?;
    if let Some(t) = turns.iter().find(|t| t.turn_id == turn_id.as_str()) {
        if t.request_hash != req.hash {
            return Err(ApiError::conflict("this Idempotency-Key was used with a different request body"));
        }
        match t.state {
            TurnState::Failed => {} // generated again below
            TurnState::Streaming => {
                if app.store.turn_runs_elsewhere(conversation.as_str(), turn_id.as_str()).await? {
                    drop(admission);
                    let slot = follower_slot(&app, &user).await?;
                    let events = polled::follow(app.clone(), conversation.into_string(), turn_id.into_string(), from).boxed();
                    return Ok(respond(events, meta, req.stream, starting_after, Some(slot)).await);
                }
            }
            TurnState::Done | TurnState::Stopped => {
                drop(admission);
                metrics::turn("replayed");
                let meta = Meta { created_at: t.created_at, ..meta };
                let events = polled::stored_events(&app, t, from).await?;
                return Ok(respond(futures::stream::iter(events).boxed(), meta, req.stream, starting_after, None).await);
            }
        }
    }
    for other in turns.iter().filter(|t| t.state == TurnState::Streaming && t.turn_id != turn_id.as_str()) {
        if app.store.turn_runs_elsewhere(conversation.as_str(), &other.turn_id).await? {
            return Err(busy());
        }
    }
    let prev = turns.iter().rev().find(|t| t.state.in_context() && t.turn_id != turn_id.as_str());
    if let Base::After(p) = &base {
        if prev.map(|t| t.turn_id.as_str()) != Some(p.as_str()) {
            return Err(ApiError {
                retry_after: Some(std::time::Duration::from_secs(1)),
                param: Some("previous_response_id"),
                ..ApiError::conflict("another response continued previous_response_id meanwhile; retry to branch from it")
            });
        }
    }
    let (prompt, user_text) = match prev {
        Some(p) => {
            if req.instructions.is_some() {
                return Err(ApiError::bad_param(
                    "instructions",
                    "instructions: a continued conversation keeps the instructions of its first response (start a new one to change them)",
                ));
            }
            let message = req.single_user_message()?;
            let end = crate::conv_items::history_end(p);
            let prompt =
                app.context.continue_prompt(&p.prompt_ids, &p.output_ids, end, message).map_err(|e| ApiError::bad_param("input", e.to_string()))?;
            (prompt, message.to_string())
        }
        None => first_prompt(&app, &req)?,
    };
    let row = Turn {
        conversation: conversation.as_str().to_string(),
        turn_id: turn_id.as_str().to_string(),
        seq: turns.iter().map(|t| t.seq + 1).max().unwrap_or(0),
        request_hash: req.hash.clone(),
        user_text,
        reply_text: String::new(),
        prompt_ids: prompt.ids.clone(),
        output_ids: vec![],
        system_prompt_version: conv.system_prompt_version,
        state: TurnState::Streaming,
        finish_reason: None,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        created_at: meta.created_at,
        metadata: req.metadata.clone(),
    };
    let reply = app.start_reply(&user, &key, prompt, conversation.clone(), req.sampling.clone()).await?;
    match app.store.begin_turn(&row).await? {
        BeginTurn::Created => {}
        BeginTurn::Existing(t) if t.request_hash == req.hash && t.state == TurnState::Streaming => {
            drop((reply, admission));
            let slot = follower_slot(&app, &user).await?;
            let events = polled::follow(app.clone(), conversation.into_string(), turn_id.into_string(), from).boxed();
            return Ok(respond(events, meta, req.stream, starting_after, Some(slot)).await);
        }
        BeginTurn::Existing(_) => return Err(ApiError::conflict("this Idempotency-Key is already in use")),
        BeginTurn::Busy => return Err(busy()),
    }
    tracing::info!(conversation = %conversation, turn = %turn_id, prompt_tokens = row.prompt_ids.len(), "response started");
    let live = turns::spawn(app.clone(), conversation.clone(), turn_id, req.hash.clone(), reply);
    drop(admission);
    metrics::turn("started");
    if delete_after {
        // `store: false`: the response is answered, then its conversation goes the way
        // every deletion goes (rows, tombstone, KV eviction everywhere).
        let (app, live, conversation, user) = (app.clone(), live.clone(), conversation.clone(), user.clone());
        tokio::spawn(async move {
            live.ended().await;
            if let Err(e) = delete_owned(&app, &user, &conversation).await {
                tracing::warn!(conversation = %conversation, error = %e.message, "deleting an unstored response failed; retention deletes it");
            }
        });
    }
    let events = live.follow(app.config.resume_grace, from).boxed();
    Ok(respond(events, meta, req.stream, starting_after, None).await)
}

/// Answers with a turn's events: as the typed SSE stream (after `starting_after`), or
/// the response object once the turn ends. `slot`, a follower's open-stream slot, is
/// held until the answer ends.
async fn respond(
    events: BoxStream<'static, (usize, TurnEvent)>,
    meta: Meta,
    stream: bool,
    starting_after: Option<u64>,
    slot: Option<crate::limits::Permit>,
) -> Response {
    if stream {
        let s = events.flat_map(move |(pos, ev)| {
            let _held = &slot;
            let out: Vec<Result<Event, Infallible>> = object::stream_events(&meta, pos, &ev)
                .into_iter()
                .filter(|(seq, _)| starting_after.is_none_or(|n| *seq > n))
                .map(|(seq, v)| Ok(Event::default().id(seq.to_string()).event(v["type"].as_str().unwrap_or_default()).data(v.to_string())))
                .collect();
            futures::stream::iter(out)
        });
        return Sse::new(s).keep_alive(KeepAlive::default()).into_response();
    }
    let mut events = events;
    while let Some((_, ev)) = events.next().await {
        if let TurnEvent::End(r) = ev {
            return Json(object::response_json(&meta, Some(&r))).into_response();
        }
    }
    ApiError::internal().into_response()
}

#[derive(Deserialize, Default)]
pub struct RetrieveQuery {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    starting_after: Option<u64>,
}

/// `GET /v1/responses/{id}`: the response; with `?stream=true` its events (after
/// `starting_after` or `Last-Event-ID`), following it live while it runs.
pub async fn retrieve(
    State(app): State<Arc<App>>,
    AuthUser(user, _): AuthUser,
    Path(id): Path<String>,
    Query(q): Query<RetrieveQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    metrics::request("responses_get");
    let (c, _, turns, t) = find(&app, &user, &id).await?;
    let meta = stored_meta(&app, c.as_str(), &turns, &t);
    let live = app.live.get(&c).filter(|l| l.turn_id.as_str() == t.turn_id);
    if q.stream != Some(true) {
        let result = (t.state != TurnState::Streaming).then(|| polled::stored_result(&t));
        return Ok(Json(object::response_json(&meta, result.as_ref())).into_response());
    }
    let starting_after = last_event_id(&headers)?.or(q.starting_after);
    let from = object::resume_position(starting_after);
    let slot = follower_slot(&app, &user).await?;
    let events = match live {
        Some(l) => l.follow(app.config.resume_grace, from).boxed(),
        None if t.state == TurnState::Streaming => polled::follow(app.clone(), c.into_string(), t.turn_id.clone(), from).boxed(),
        None => futures::stream::iter(polled::stored_events(&app, &t, from).await?).boxed(),
    };
    Ok(respond(events, meta, true, starting_after, Some(slot)).await)
}

/// `DELETE /v1/responses/{id}`. A response is a turn of its conversation, and every
/// later turn was answered from it: deleting it deletes that conversation (every
/// response of its chain; a branch is a conversation of its own and stays), with the
/// store's tombstone and KV eviction everywhere.
pub async fn delete(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>) -> Result<Response, ApiError> {
    metrics::request("responses_delete");
    let (c, _, _, _) = find(&app, &user, &id).await?;
    let kv_evicted = delete_owned(&app, &user, &c).await?;
    let status = if kv_evicted { StatusCode::OK } else { StatusCode::ACCEPTED };
    Ok((status, Json(json!({"id": id, "object": "response.deleted", "deleted": true, "conversation": c.as_str(), "kv_evicted": kv_evicted}))).into_response())
}

/// `POST /v1/responses/{id}/cancel`: stops the response if it is running (what was
/// shown is stored, as the stop button does) and answers with it.
pub async fn cancel(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>) -> Result<Response, ApiError> {
    metrics::request("responses_cancel");
    let (c, _, turns, t) = find(&app, &user, &id).await?;
    let meta = stored_meta(&app, c.as_str(), &turns, &t);
    if let Some(live) = app.live.get(&c).filter(|l| l.turn_id.as_str() == t.turn_id) {
        live.stop();
        let mut events = Box::pin(live.follow(app.config.resume_grace, 0));
        while let Some((_, ev)) = events.next().await {
            if let TurnEvent::End(r) = ev {
                return Ok(Json(object::response_json(&meta, Some(&r))).into_response());
            }
        }
    }
    let t = app.store.get_turn(c.as_str(), &t.turn_id).await?.ok_or_else(|| ApiError::not_found("response"))?;
    let result = (t.state != TurnState::Streaming).then(|| polled::stored_result(&t));
    Ok(Json(object::response_json(&meta, result.as_ref())).into_response())
}

/// `GET /v1/responses/{id}/input_items`: the user message the response answered.
pub async fn input_items(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>) -> Result<Response, ApiError> {
    metrics::request("responses_input_items");
    let (_, _, _, t) = find(&app, &user, &id).await?;
    Ok(Json(object::input_items_json(&t.turn_id, &t.user_text)).into_response())
}
