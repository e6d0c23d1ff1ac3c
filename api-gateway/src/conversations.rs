//! The conversations API: create, list, get, delete, add a turn (idempotent
//! by turn ID), follow or resume a turn's events, stop a turn.
//!
//! Turn admission runs under the conversation's lock ([`crate::admission`]) so
//! that concurrent retries of a turn ID see one another: the first creates the
//! stored row and the live turn, the rest attach to it (same body) or get 409
//! (different body). A new turn while another streams in the same conversation
//! is a 409 as well. Other conversations' turns never wait on this lock.
//!
//! Across gateway replicas (one PostgreSQL) the store decides: `begin_turn`
//! admits one turn per place in the conversation and one streaming turn at a
//! time, so the loser of a race gets the same 409. A retry of a turn another
//! replica runs follows it through the store ([`crate::polled`]); a retry of a
//! turn whose replica died takes it over and generates it again.

use crate::auth::AuthUser;
use crate::conv_common::{busy, delete_owned, follower_slot, owned, parse_conversation_id, parse_turn_id};
use crate::error::ApiError;
use crate::listen::read_body;
use crate::polled::{self, stored_events};
use crate::state::App;
use crate::store::{BeginTurn, Conversation, Turn, TurnState};
use crate::live::{LiveTurn, TurnEvent};
use crate::turns;
use crate::{metrics, request_id};
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use baton_text::sampling::SamplingParams;
use baton_vocab::{ConversationId, OwnerId, TurnId};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::sync::Arc;

/// The body of `POST /v1/conversations`: Baton's (`title`) and OpenAI's (`items`,
/// `metadata`) in one; an unknown field is a 400 that names it.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    items: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    /// An end-user label for the operator's logs; never an identity (as in responses).
    #[serde(default)]
    #[allow(dead_code)]
    safety_identifier: Option<String>,
}

fn conv_json(c: &Conversation) -> Value {
    crate::conv_common::conversation_json(c)
}

/// `POST /v1/conversations`: a new conversation of the caller, with OpenAI's initial
/// `items` (stored as turns, checked like a turn's input) and `metadata`.
pub async fn create(State(app): State<Arc<App>>, auth: AuthUser, body: Body) -> Result<Response, ApiError> {
    let AuthUser(user, _) = auth.clone();
    metrics::request("conversations_create");
    crate::conv_common::admit_request(&app, &user).await?;
    let body = read_body(body, app.config.max_body_bytes, app.config.connections.header_timeout).await?;
    let b: CreateBody = if body.iter().all(u8::is_ascii_whitespace) {
        CreateBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
    };
    let now = crate::store::now_unix();
    let title: String = b.title.unwrap_or_default().chars().take(200).collect();
    let metadata = crate::conv_common::parse_metadata("metadata", b.metadata.as_ref())?;
    let mut items = match &b.items {
        None | Some(Value::Null) => vec![],
        Some(v) => crate::conv_items::parse_items(v)?,
    };
    crate::conv_items::check_items(&app, &mut items)?;
    let c = Conversation {
        id: parse_conversation_id(&format!("conv-{}", request_id()))?.into_string(),
        owner: user.as_str().to_string(),
        title,
        system_prompt_version: app.context.system_prompt_version,
        created_at: now,
        updated_at: now,
        summary: None,
        metadata,
    };
    app.store.create_conversation(&c).await?;
    if !items.is_empty() {
        let conversation = parse_conversation_id(&c.id)?;
        if let Err(e) = crate::conv_items::append_items(&app, &auth, &conversation, &c, &items).await {
            // All or nothing: a conversation whose items were refused is not kept.
            if let Err(d) = delete_owned(&app, &user, &conversation).await {
                tracing::warn!(conversation = %conversation, error = %d.message, "removing a conversation whose items were refused failed");
            }
            return Err(e);
        }
    }
    Ok((StatusCode::CREATED, Json(conv_json(&c))).into_response())
}

pub async fn list(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser) -> Result<Json<Value>, ApiError> {
    metrics::request("conversations_list");
    crate::conv_common::admit_request(&app, &user).await?;
    let cs = app.store.list_conversations(user.as_str()).await?;
    Ok(Json(json!({"object": "list", "data": cs.iter().map(conv_json).collect::<Vec<_>>()})))
}

fn turn_json(t: &Turn) -> Value {
    json!({"turn_id": t.turn_id, "user": t.user_text, "reply": t.reply_text, "state": t.state, "finish_reason": t.finish_reason,
           "usage": {"prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens, "completion_tokens": t.completion_tokens},
           "created_at": t.created_at})
}

pub async fn get(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    metrics::request("conversations_get");
    let (_, c) = owned(&app, &user, &id).await?;
    let turns = app.store.list_turns(&id).await?;
    let mut v = conv_json(&c);
    v["turns"] = Value::Array(turns.iter().map(turn_json).collect());
    Ok(Json(v))
}

/// Deletes the conversation's text at once, leaving a tombstone, and tries to evict its
/// KV everywhere: 200 when every node acknowledged, 202 when some node still owes it
/// (the gateway retries until it acknowledges; `kv_evicted` says which).
pub async fn delete(State(app): State<Arc<App>>, AuthUser(user, _): AuthUser, Path(id): Path<String>) -> Result<Response, ApiError> {
    metrics::request("conversations_delete");
    let (conversation, _) = owned(&app, &user, &id).await?;
    let kv_evicted = delete_owned(&app, &user, &conversation).await?;
    let status = if kv_evicted { StatusCode::OK } else { StatusCode::ACCEPTED };
    Ok((status, Json(json!({"id": id, "object": "conversation.deleted", "deleted": true, "kv_evicted": kv_evicted}))).into_response())
}

/// The body of `POST /v1/conversations/{id}/turns`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct TurnBody {
    #[serde(default)]
    pub turn_id: Option<String>,
    pub message: String,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stop strings (one or a list, as in the OpenAI API); the reply ends before the first.
    #[serde(default)]
    pub stop: Option<crate::params::Stop>,
}

impl TurnBody {
    fn stop_strings(&self) -> Vec<String> {
        match &self.stop {
            None => vec![],
            Some(crate::params::Stop::One(s)) => vec![s.clone()],
            Some(crate::params::Stop::Many(v)) => v.clone(),
        }
    }
}

/// What identifies a turn's content for idempotency (everything but the
/// turn ID and the response mode).
fn request_hash(b: &TurnBody) -> String {
    let mut canon = json!({"m": b.message, "max": b.max_tokens, "t": b.temperature, "p": b.top_p, "s": b.seed});
    // Added only when set, so that turns stored before stop strings keep their hash.
    if b.stop.is_some() {
        canon["stop"] = json!(b.stop_strings());
    }
    let d = Sha256::digest(canon.to_string().as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn last_event_id(headers: &HeaderMap) -> Result<Option<usize>, ApiError> {
    match headers.get("last-event-id").map(|v| v.to_str().map(|s| s.trim().parse::<usize>())) {
        None => Ok(None),
        Some(Ok(Ok(n))) => Ok(Some(n)),
        _ => Err(ApiError::bad_request("Last-Event-ID must be an event id of this turn")),
    }
}

pub async fn add_turn(
    State(app): State<Arc<App>>,
    AuthUser(user, key): AuthUser,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    metrics::request("turns_create");
    let raw = read_body(body, app.config.max_body_bytes, app.config.connections.header_timeout).await?;
    let body: TurnBody = serde_json::from_slice(&raw).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let (conversation, conv) = owned(&app, &user, &id).await?;
    let header_id = headers.get("idempotency-key").map(|v| v.to_str().map(str::to_string));
    let turn_id = match (&body.turn_id, header_id) {
        (Some(t), _) => t.clone(),
        (None, Some(Ok(h))) => h,
        (None, Some(Err(_))) => return Err(ApiError::bad_request("Idempotency-Key must be ASCII")),
        (None, None) => format!("turn-{}", request_id()),
    };
    let turn_id = parse_turn_id(&turn_id)?;
    let from = last_event_id(&headers)?.map(|n| n + 1).unwrap_or(0);
    let stream = body.stream.unwrap_or(true);
    let hash = request_hash(&body);
    let max_tokens = body.max_tokens.map(|v| v as usize).unwrap_or(app.config.default_max_tokens);
    crate::params::check_max_tokens(max_tokens, app.config.max_tokens_ceiling)?;
    let mut sampling = SamplingParams {
        max_tokens,
        temperature: body.temperature.unwrap_or(0.7),
        top_p: body.top_p.unwrap_or(1.0),
        seed: body.seed,
        stop_strings: body.stop_strings(),
        ..SamplingParams::default()
    };
    sampling = sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?.into_inner();

    let admission = app.admission.lock(&id).await;
    if let Some(live) = app.live.get(&conversation) {
        if live.turn_id != turn_id {
            return Err(busy());
        }
        if live.request_hash != hash {
            return Err(ApiError::conflict("this turn ID was used with a different request body"));
        }
        drop(admission);
        let slot = follower_slot(&app, &user).await?;
        metrics::turn("attached");
        return Ok(respond_live(app, live, from, stream, Some(slot)).await);
    }
    let turns = app.store.list_turns(&id).await?;
    if let Some(t) = turns.iter().find(|t| t.turn_id == turn_id.as_str()) {
        if t.request_hash != hash {
            return Err(ApiError::conflict("this turn ID was used with a different request body"));
        }
        match t.state {
            TurnState::Failed => {} // generated again below
            // Not this replica's (those are in `app.live`): follow it where it runs;
            // if its replica died, take it over below.
            TurnState::Streaming => {
                if app.store.turn_runs_elsewhere(&id, turn_id.as_str()).await? {
                    drop(admission);
                    return attach_stored(app, &user, conversation, turn_id, from, stream).await;
                }
            }
            TurnState::Done | TurnState::Stopped => {
                drop(admission);
                metrics::turn("replayed");
                return respond_stored(app, t.clone(), from, stream).await;
            }
        }
    }
    // Another replica's turn in progress: refused before the model is asked (the
    // store would refuse it too); a dead replica's turn does not block.
    for other in turns.iter().filter(|t| t.state == TurnState::Streaming && t.turn_id != turn_id.as_str()) {
        if app.store.turn_runs_elsewhere(&id, &other.turn_id).await? {
            return Err(busy());
        }
    }
    app.checks.check_input(&body.message).map_err(|r| ApiError::refused(r.reason))?;
    let prev = turns.iter().rev().find(|t| t.state.in_context() && t.turn_id != turn_id.as_str());
    let threshold = app.config.summary_threshold_tokens;
    let prompt = match prev {
        Some(p) if threshold > 0 && p.prompt_ids.len() + p.output_ids.len() > threshold => {
            // A turn boundary past the threshold: summarize, store the summary,
            // and rebuild the prompt once; later turns append to it. A summary
            // the input check refuses is neither stored nor used: the turn
            // appends to the full history as below the threshold, and the next
            // turn tries again. The summary is stored with its boundary as soon as
            // it is made, before this turn can be refused (limits, a busy
            // conversation) or fail: its retry, at the same boundary, reuses it
            // instead of asking (and charging for) the model again.
            let summary = match app.store.summary_through(&id, p.seq).await? {
                Some(stored) => {
                    metrics::summary_reused();
                    Some(stored)
                }
                None => {
                    let made = summarize(&app, &user, &key, &conversation, p).await?;
                    if let Some(summary) = &made {
                        app.store.set_summary(&id, summary, Some(p.seq)).await?;
                    }
                    made
                }
            };
            match summary {
                Some(summary) => {
                    let in_context: Vec<&Turn> = turns.iter().filter(|t| t.state.in_context() && t.turn_id != turn_id.as_str()).collect();
                    let keep = app.config.summary_keep_turns.min(in_context.len());
                    let recent: Vec<(&str, &[u32])> =
                        in_context[in_context.len() - keep..].iter().map(|t| (t.user_text.as_str(), t.output_ids.as_slice())).collect();
                    tracing::info!(conversation = %id, kept_turns = keep, "history summarized");
                    app.context.with_summary(&summary, &recent, &body.message)
                }
                None => app.context.continue_prompt(&p.prompt_ids, &p.output_ids, crate::conv_items::history_end(p), &body.message),
            }
        }
        Some(p) => app.context.continue_prompt(&p.prompt_ids, &p.output_ids, crate::conv_items::history_end(p), &body.message),
        None => app.context.first_turn(&body.message),
    }
    .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let seq = turns.iter().map(|t| t.seq + 1).max().unwrap_or(0);
    let row = Turn {
        conversation: id.clone(),
        turn_id: turn_id.as_str().to_string(),
        seq,
        request_hash: hash.clone(),
        user_text: body.message.clone(),
        reply_text: String::new(),
        prompt_ids: prompt.ids.clone(),
        output_ids: vec![],
        system_prompt_version: conv.system_prompt_version,
        state: TurnState::Streaming,
        finish_reason: None,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        created_at: crate::store::now_unix(),
        metadata: Default::default(),
    };
    let reply = app.start_reply(&user, &key, prompt, conversation.clone(), sampling).await?;
    match app.store.begin_turn(&row).await? {
        BeginTurn::Created => {}
        // Another replica began (or took over) this very turn since we looked: follow it.
        BeginTurn::Existing(t) if t.request_hash == hash && t.state == TurnState::Streaming => {
            drop((reply, admission));
            return attach_stored(app, &user, conversation, turn_id, from, stream).await;
        }
        BeginTurn::Existing(_) => return Err(ApiError::conflict("this turn ID is already in use")),
        BeginTurn::Busy => return Err(busy()),
    }
    tracing::info!(conversation = %id, turn = %turn_id, prompt_tokens = row.prompt_ids.len(), "turn started");
    let live = turns::spawn(app.clone(), conversation, turn_id, hash, reply);
    drop(admission);
    metrics::turn("started");
    Ok(respond_live(app, live, from, stream, None).await)
}

/// Follows a turn that another gateway replica runs, through the store.
async fn attach_stored(app: Arc<App>, owner: &OwnerId, id: ConversationId, turn_id: TurnId, from: usize, stream: bool) -> Result<Response, ApiError> {
    let slot = follower_slot(&app, owner).await?;
    metrics::turn("attached");
    let events = polled::follow(app, id.into_string(), turn_id.into_string(), from);
    Ok(respond_events(events, stream, Some(slot)).await)
}

/// Asks the model for a summary of the history up to and including `last`
/// (greedy, appended to that turn's tokens so the prefix cache serves it).
/// The summary becomes prompt text of every later turn, so it passes the
/// input check like a client's message; `None` when the check refuses it.
/// It is model work done for the owner, so it passes the owner's limits like a
/// turn before the model is asked (429 without generating when over) and its
/// tokens are charged to them: retrying a refused turn cannot buy free generation.
async fn summarize(
    app: &Arc<App>,
    owner: &OwnerId,
    key: &crate::key_cache::KeyHash,
    conversation: &ConversationId,
    last: &Turn,
) -> Result<Option<String>, ApiError> {
    let prompt = app
        .context
        .continue_prompt(&last.prompt_ids, &last.output_ids, crate::conv_items::history_end(last), crate::context::SUMMARY_REQUEST)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let sampling = SamplingParams { temperature: 0.0, max_tokens: app.config.summary_max_tokens, ..SamplingParams::default() };
    let permit = app.admit_generation(owner, key, prompt.ids.len()).await?;
    let mut generated = 0usize;
    let mut events = app
        .generator
        .generate(crate::generator::GenerateRequest {
            prompt: prompt.ids,
            owner: owner.clone(),
            platform_prefix_len: prompt.platform_prefix_len,
            conversation: conversation.clone(),
            sampling,
        })
        .await?;
    let mut text = String::new();
    while let Some(ev) = events.next().await {
        match ev {
            crate::generator::GenEvent::Token(t) => {
                generated += 1;
                text.push_str(&t.text);
            }
            crate::generator::GenEvent::Finished { trailing_text, .. } => {
                text.push_str(&trailing_text);
                break;
            }
            crate::generator::GenEvent::Failed(e) => {
                permit.charge_output(generated);
                return Err(e.into());
            }
        }
    }
    permit.charge_output(generated);
    drop(permit);
    let summary = text.trim().to_string();
    if app.checks.check_input(&summary).is_err() {
        tracing::warn!(conversation = %conversation, "summary refused by the input check; not stored, history kept");
        metrics::summary_refused();
        return Ok(None);
    }
    Ok(Some(summary))
}

fn sse_event(pos: usize, ev: &TurnEvent) -> Event {
    match ev {
        TurnEvent::Delta(t) => Event::default().id(pos.to_string()).event("delta").data(json!({"text": t}).to_string()),
        TurnEvent::Moderation(r) => Event::default().id(pos.to_string()).event("moderation").data(json!({"reason": r}).to_string()),
        TurnEvent::End(r) => Event::default().id(pos.to_string()).event("done").data(serde_json::to_string(r).unwrap_or_default()),
    }
}

/// Answers with a live turn's events; `slot`, a follower's open-stream slot, is held
/// until the response ends.
async fn respond_live(app: Arc<App>, live: Arc<LiveTurn>, from: usize, stream: bool, slot: Option<crate::limits::Permit>) -> Response {
    respond_events(live.follow(app.config.resume_grace, from), stream, slot).await
}

/// Answers with a turn's events: as SSE, or the end event's result as JSON.
async fn respond_events(
    events: impl futures::Stream<Item = (usize, TurnEvent)> + Send + 'static,
    stream: bool,
    slot: Option<crate::limits::Permit>,
) -> Response {
    if stream {
        let s = events.map(move |(pos, ev)| {
            let _held = &slot;
            Ok::<Event, Infallible>(sse_event(pos, &ev))
        });
        return Sse::new(s).keep_alive(KeepAlive::default()).into_response();
    }
    let mut events = Box::pin(events);
    while let Some((_, ev)) = events.next().await {
        if let TurnEvent::End(r) = ev {
            return Json(r).into_response();
        }
    }
    ApiError::internal().into_response()
}

async fn respond_stored(app: Arc<App>, t: Turn, from: usize, stream: bool) -> Result<Response, ApiError> {
    if !stream {
        return Ok(Json(polled::stored_result(&t)).into_response());
    }
    let events = stored_events(&app, &t, from).await?;
    let s = futures::stream::iter(events.into_iter().map(|(pos, ev)| Ok::<Event, Infallible>(sse_event(pos, &ev))));
    Ok(Sse::new(s).into_response())
}

#[derive(Deserialize)]
pub struct EventsQuery {
    #[serde(default)]
    after: Option<usize>,
}

/// `GET /v1/conversations/{id}/turns/{turn_id}/events`: follow or resume.
pub async fn events(
    State(app): State<Arc<App>>,
    AuthUser(user, _): AuthUser,
    Path((id, turn_id)): Path<(String, String)>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    metrics::request("turns_events");
    let (id, _) = owned(&app, &user, &id).await?;
    let turn_id = parse_turn_id(&turn_id)?;
    let from = last_event_id(&headers)?.or(q.after).map(|n| n + 1).unwrap_or(0);
    if let Some(live) = app.live.get(&id).filter(|l| l.turn_id == turn_id) {
        let slot = follower_slot(&app, &user).await?;
        return Ok(respond_live(app, live, from, true, Some(slot)).await);
    }
    let t = app.store.get_turn(id.as_str(), turn_id.as_str()).await?.ok_or_else(|| ApiError::not_found("turn"))?;
    if t.state == TurnState::Streaming {
        // Another replica runs it (or ran it until it died: the stream then says so).
        return attach_stored(app, &user, id, turn_id, from, true).await;
    }
    respond_stored(app, t, from, true).await
}

/// `POST /v1/conversations/{id}/turns/{turn_id}/stop`: stops the turn and
/// answers with what was stored.
pub async fn stop(
    State(app): State<Arc<App>>,
    AuthUser(user, _): AuthUser,
    Path((id, turn_id)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    metrics::request("turns_stop");
    let (id, _) = owned(&app, &user, &id).await?;
    let turn_id = parse_turn_id(&turn_id)?;
    if let Some(live) = app.live.get(&id).filter(|l| l.turn_id == turn_id) {
        live.stop();
        let mut events = Box::pin(live.follow(app.config.resume_grace, 0));
        while let Some((_, ev)) = events.next().await {
            if let TurnEvent::End(r) = ev {
                return Ok(Json(serde_json::to_value(r).unwrap_or_default()));
            }
        }
    }
    let t = app.store.get_turn(id.as_str(), turn_id.as_str()).await?.ok_or_else(|| ApiError::not_found("turn"))?;
    Ok(Json(serde_json::to_value(polled::stored_result(&t)).unwrap_or_default()))
}
