//! The Conversations API's items over Baton's stored turns, shared by the handlers that
//! create conversations (`conversations.rs`) and those of the items
//! (`conversation_items.rs`).
//!
//! A conversation's items are its turns' messages in order: a turn's user message is
//! item `msgin_<turn>` and its reply `msg_<turn>` (the IDs the Responses API gives the
//! same messages), so an item's ID is stable for as long as it exists. Items a client
//! adds become turns of their own ([`crate::store::ITEM_PAIR`] and the like), encoded
//! into token IDs that continue the stored history exactly like a generated turn, so
//! the prefix cache keeps serving them.
//!
//! Deleting an item rewrites the history from that item's turn on (later turns keep
//! their IDs, their replies' exact token IDs, and their place) and, because the nodes
//! hold KV of the old history (including the deleted message), evicts the
//! conversation's KV everywhere through the same tombstone path as a deletion: the next
//! turn's prefill is cold once, and no node keeps the deleted text's KV.

use crate::auth::AuthUser;
use crate::conv_common::busy;
use crate::context::HistoryEnd;
use crate::error::ApiError;
use crate::state::App;
use crate::store::{Conversation, Replaced, Turn, TurnState, ITEM_ASSISTANT, ITEM_PAIR, ITEM_USER};
use baton_vocab::{ConversationId, TurnId};
use serde_json::{json, Value};

/// Items one request may add (the OpenAI API's limit).
pub const MAX_ITEMS_PER_REQUEST: usize = 20;

/// The user message's item ID of a turn.
pub fn user_item_id(turn: &str) -> String {
    format!("msgin_{turn}")
}

/// The reply's item ID of a turn.
pub fn reply_item_id(turn: &str) -> String {
    format!("msg_{turn}")
}

/// Which message of a turn an item is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    User,
    Reply,
}

/// The turn and message an item ID names; a malformed ID is a 404, like an unknown one.
pub fn parse_item_id(id: &str) -> Result<(TurnId, Part), ApiError> {
    let not_found = || ApiError::not_found("item");
    let (turn, part) = match (id.strip_prefix("msgin_"), id.strip_prefix("msg_")) {
        (Some(t), _) => (t, Part::User),
        (None, Some(t)) => (t, Part::Reply),
        _ => return Err(not_found()),
    };
    Ok((crate::conv_common::parse_turn_id(turn).map_err(|_| not_found())?, part))
}

/// A message's text as a string or a list of text parts (`input_text`; `output_text`
/// in an assistant message a client resends); anything else is a 400 naming `field`.
pub fn content_text(field: &'static str, i: usize, content: &Value) -> Result<String, ApiError> {
    let refuse = |why: String| ApiError::bad_param(field, format!("{field}: {why}"));
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => s.push_str(t),
                    (kind, _) => return Err(refuse(format!("{field}[{i}]: content part {} is not supported (text only)", kind.unwrap_or("without a type")))),
                }
            }
            Ok(s)
        }
        _ => Err(refuse(format!("{field}[{i}]: content must be a string or a list of text parts"))),
    }
}

/// One message a client adds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewItem {
    /// `true` for an assistant message, else a user message.
    pub assistant: bool,
    pub text: String,
}

/// Parses the `items` of a request: messages of role `user` or `assistant` with text
/// content, at most [`MAX_ITEMS_PER_REQUEST`]. System and developer messages are
/// refused: a conversation's system prompt is the platform's, or the `instructions`
/// of its first response.
pub fn parse_items(v: &Value) -> Result<Vec<NewItem>, ApiError> {
    let refuse = |why: String| ApiError::bad_param("items", format!("items: {why}"));
    let Value::Array(items) = v else { return Err(refuse("must be a list of message items".into())) };
    if items.len() > MAX_ITEMS_PER_REQUEST {
        return Err(refuse(format!("at most {MAX_ITEMS_PER_REQUEST} items per request")));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        if kind != "message" {
            return Err(refuse(format!("items[{i}]: items of type {kind} are not supported (messages only)")));
        }
        let assistant = match item.get("role").and_then(Value::as_str) {
            Some("user") => false,
            Some("assistant") => true,
            Some("system" | "developer") => {
                return Err(refuse(format!(
                    "items[{i}]: system and developer messages are not stored in a conversation (pass instructions to its first response)"
                )))
            }
            other => return Err(refuse(format!("items[{i}]: unsupported role {other:?}"))),
        };
        let text = content_text("items", i, item.get("content").unwrap_or(&Value::Null))?;
        out.push(NewItem { assistant, text });
    }
    Ok(out)
}

/// Messages grouped into turns: a user message with the assistant message right
/// after it is one turn; any other message is a turn alone.
pub fn group(items: &[NewItem]) -> Vec<(Option<&str>, Option<&str>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < items.len() {
        match (&items[i], items.get(i + 1)) {
            (u, Some(r)) if !u.assistant && r.assistant => {
                out.push((Some(u.text.as_str()), Some(r.text.as_str())));
                i += 2;
            }
            (m, _) if m.assistant => {
                out.push((None, Some(m.text.as_str())));
                i += 1;
            }
            (m, _) => {
                out.push((Some(m.text.as_str()), None));
                i += 1;
            }
        }
    }
    out
}

/// How a stored turn's history ends, for what comes after it.
pub fn history_end(t: &Turn) -> HistoryEnd {
    if t.has_reply() {
        HistoryEnd::Reply
    } else {
        HistoryEnd::User
    }
}

/// A message item as the API shows it.
pub fn item_json(turn: &str, part: Part, text: &str, status: &str) -> Value {
    match part {
        Part::User => json!({"id": user_item_id(turn), "type": "message", "role": "user", "status": status,
                              "content": [{"type": "input_text", "text": text}]}),
        Part::Reply => json!({"id": reply_item_id(turn), "type": "message", "role": "assistant", "status": status,
                               "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}),
    }
}

/// The items of the turns in the conversation's context, in order (a turn in progress
/// and a failed one are not part of it).
pub fn items_of(turns: &[Turn]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for t in turns.iter().filter(|t| t.state.in_context()) {
        if t.has_user_message() {
            out.push((user_item_id(&t.turn_id), item_json(&t.turn_id, Part::User, &t.user_text, "completed")));
        }
        if t.has_reply() {
            let status = if t.state == TurnState::Done { "completed" } else { "incomplete" };
            out.push((reply_item_id(&t.turn_id), item_json(&t.turn_id, Part::Reply, &t.reply_text, status)));
        }
    }
    out
}

/// A list of items as the API answers it.
pub fn list_json(items: &[Value], has_more: bool) -> Value {
    let id = |v: Option<&Value>| v.and_then(|v| v["id"].as_str()).map(str::to_string);
    json!({"object": "list", "data": items, "first_id": id(items.first()), "last_id": id(items.last()), "has_more": has_more})
}

fn item_row(conv: &Conversation, turn_id: &str, seq: i64, user: Option<&str>, reply: Option<&str>, ids: (Vec<u32>, Vec<u32>)) -> Turn {
    let reason = match (user, reply) {
        (Some(_), Some(_)) => ITEM_PAIR,
        (Some(_), None) => ITEM_USER,
        _ => ITEM_ASSISTANT,
    };
    Turn {
        conversation: conv.id.clone(),
        turn_id: turn_id.to_string(),
        seq,
        request_hash: String::new(),
        user_text: user.unwrap_or_default().to_string(),
        reply_text: reply.unwrap_or_default().to_string(),
        prompt_ids: ids.0,
        output_ids: ids.1,
        system_prompt_version: conv.system_prompt_version,
        state: TurnState::Done,
        finish_reason: Some(reason.to_string()),
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        created_at: crate::store::now_unix(),
        metadata: Default::default(),
    }
}

/// Checks the messages as a chat turn's input is checked, and sanitizes an assistant
/// message as a reply is: what is stored is what the model reads and the client sees.
pub fn check_items(app: &App, items: &mut [NewItem]) -> Result<(), ApiError> {
    for (i, it) in items.iter_mut().enumerate() {
        app.checks.check_input(&it.text).map_err(|r| ApiError { param: Some("items"), ..ApiError::refused(format!("items[{i}]: {}", r.reason)) })?;
        if it.assistant {
            it.text = crate::markdown::sanitize(&it.text, &app.links);
        }
    }
    Ok(())
}

/// Appends checked `items` to `owner`'s conversation (under its admission lock: no turn
/// may run meanwhile), charging their tokens to the caller's prompt-token limit like a
/// turn's prompt. Returns the items added, in order.
pub async fn append_items(app: &App, user: &AuthUser, conversation: &ConversationId, conv: &Conversation, items: &[NewItem]) -> Result<Vec<Value>, ApiError> {
    let AuthUser(owner, key) = user;
    let _admission = app.admission.lock(conversation.as_str()).await;
    if app.live.get(conversation).is_some() {
        return Err(busy());
    }
    let turns = app.store.list_turns(conversation.as_str()).await?;
    let last_seq = turns.iter().map(|t| t.seq).max();
    let mut prev = turns.iter().rev().find(|t| t.state.in_context()).map(|t| (t.prompt_ids.clone(), t.output_ids.clone(), history_end(t)));
    let mut rows = Vec::new();
    let mut added = 0usize;
    let stamp = crate::request_id();
    let bad = |e: crate::context::ContextError| ApiError::bad_param("items", format!("items: {e}"));
    for (k, (u, r)) in group(items).into_iter().enumerate() {
        let reply_ids = r.map(|r| app.context.encode_text(r)).transpose().map_err(bad)?;
        let after = prev.as_ref().map(|(p, o, e): &(Vec<u32>, Vec<u32>, HistoryEnd)| (p.as_slice(), o.as_slice(), *e));
        let (p, o) = app.context.item_turn(after, u, reply_ids.as_deref()).map_err(bad)?;
        added += (p.len() + o.len()).saturating_sub(prev.as_ref().map_or(0, |(p, o, _)| p.len() + o.len()));
        let turn_id = format!("i{stamp}-{k}");
        crate::conv_common::parse_turn_id(&turn_id)?;
        let seq = last_seq.map_or(0, |s| s + 1) + k as i64;
        let row = item_row(conv, &turn_id, seq, u, r, (p, o));
        prev = Some((row.prompt_ids.clone(), row.output_ids.clone(), history_end(&row)));
        rows.push(row);
    }
    app.charge_prompt_tokens(owner, key, added).await?;
    let from = last_seq.map_or(0, |s| s + 1);
    match app.store.replace_turns(owner.as_str(), conversation.as_str(), last_seq, from, &rows, None).await? {
        Replaced::Done => {}
        Replaced::NotFound => return Err(ApiError::not_found("conversation")),
        Replaced::Busy => return Err(busy()),
    }
    tracing::info!(conversation = %conversation, turns = rows.len(), tokens = added, "items added");
    Ok(items_of(&rows).into_iter().map(|(_, v)| v).collect())
}

/// Deletes one item of `owner`'s conversation: the history from its turn on is
/// rebuilt without it (later turns keep their IDs and their replies' exact tokens),
/// and the conversation's KV is evicted everywhere (a tombstone until every node
/// acknowledged). Whether every node acknowledged now.
pub async fn delete_item(app: &App, user: &AuthUser, conversation: &ConversationId, item: &str) -> Result<bool, ApiError> {
    let AuthUser(owner, _) = user;
    let (turn_id, part) = parse_item_id(item)?;
    let _admission = app.admission.lock(conversation.as_str()).await;
    if app.live.get(conversation).is_some() {
        return Err(busy());
    }
    let turns = app.store.list_turns(conversation.as_str()).await?;
    let at = turns
        .iter()
        .position(|t| t.turn_id == turn_id.as_str() && t.state.in_context() && if part == Part::User { t.has_user_message() } else { t.has_reply() })
        .ok_or_else(|| ApiError::not_found("item"))?;
    let first_in_context = turns.iter().position(|t| t.state.in_context());
    if first_in_context == Some(at) && !app.context.starts_with_platform_prompt(&turns[at].prompt_ids) {
        // Its prompt holds the first response's own instructions, which no item keeps.
        return Err(ApiError::bad_request(
            "this conversation began with its own instructions: an item of its first turn cannot be deleted (delete the conversation)",
        ));
    }
    let last_seq = turns.iter().map(|t| t.seq).max();
    let from = turns[at].seq;
    let mut prev = turns[..at].iter().rev().find(|t| t.state.in_context()).map(|t| (t.prompt_ids.clone(), t.output_ids.clone(), history_end(t)));
    let mut rows = Vec::new();
    let bad = |e: crate::context::ContextError| ApiError::bad_request(format!("the history cannot be rebuilt without this item: {e}"));
    for (i, t) in turns[at..].iter().enumerate() {
        let mut row = Turn { seq: from + rows.len() as i64, ..t.clone() };
        if !t.state.in_context() {
            rows.push(row); // a failed turn stays as it was (a retry rebuilds its prompt)
            continue;
        }
        let (mut user, mut reply) = (t.has_user_message().then_some(t.user_text.as_str()), t.has_reply().then_some(t.output_ids.as_slice()));
        if i == 0 {
            match part {
                Part::User => user = None,
                Part::Reply => reply = None,
            }
            if user.is_none() && reply.is_none() {
                continue; // the turn held only this item
            }
            row.finish_reason = Some(match (user, reply) {
                (Some(_), Some(_)) => ITEM_PAIR.to_string(),
                (Some(_), None) => ITEM_USER.to_string(),
                _ => ITEM_ASSISTANT.to_string(),
            });
            if reply.is_none() {
                row.reply_text.clear();
            }
            if user.is_none() {
                row.user_text.clear();
            }
        }
        let after = prev.as_ref().map(|(p, o, e): &(Vec<u32>, Vec<u32>, HistoryEnd)| (p.as_slice(), o.as_slice(), *e));
        let (p, o) = app.context.item_turn(after, user, reply).map_err(bad)?;
        row.prompt_ids = p;
        row.output_ids = o;
        prev = Some((row.prompt_ids.clone(), row.output_ids.clone(), history_end(&row)));
        rows.push(row);
    }
    match app.store.replace_turns(owner.as_str(), conversation.as_str(), last_seq, from, &rows, Some(app.evictions.first_retry_ms())).await? {
        Replaced::Done => {}
        Replaced::NotFound => return Err(ApiError::not_found("conversation")),
        Replaced::Busy => return Err(busy()),
    }
    let kv_evicted = app.evictions.attempt(conversation.as_str(), 0, &[], "delete").await;
    tracing::info!(conversation = %conversation, kv_evicted, "item deleted; history rebuilt");
    Ok(kv_evicted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(v: Value) -> Result<Vec<NewItem>, ApiError> {
        parse_items(&v)
    }

    #[test]
    fn item_ids_round_trip_and_refuse_garbage() {
        let (t, p) = parse_item_id(&user_item_id("r1")).unwrap();
        assert_eq!((t.as_str(), p), ("r1", Part::User));
        let (t, p) = parse_item_id(&reply_item_id("i9-0")).unwrap();
        assert_eq!((t.as_str(), p), ("i9-0", Part::Reply));
        for bad in ["", "msg_", "msgin_", "x_r1", "msg_a/b", "msg_a b"] {
            assert_eq!(parse_item_id(bad).unwrap_err().status, 404, "{bad}");
        }
    }

    #[test]
    fn items_parse_and_refuse_what_is_not_a_text_message() {
        let got = items(json!([{"type": "message", "role": "user", "content": "a"},
                               {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}]))
        .unwrap();
        assert_eq!(got, vec![NewItem { assistant: false, text: "a".into() }, NewItem { assistant: true, text: "b".into() }]);
        for bad in [
            json!("hi"),
            json!([{"role": "system", "content": "x"}]),
            json!([{"role": "developer", "content": "x"}]),
            json!([{"role": "tool", "content": "x"}]),
            json!([{"type": "function_call_output", "call_id": "c", "output": "x"}]),
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
            Value::Array((0..=MAX_ITEMS_PER_REQUEST).map(|_| json!({"role": "user", "content": "x"})).collect()),
        ] {
            let e = items(bad.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param), (400, Some("items")), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn messages_group_into_turns() {
        let m = |assistant: bool, t: &str| NewItem { assistant, text: t.into() };
        let all = [m(false, "u1"), m(true, "a1"), m(false, "u2"), m(false, "u3"), m(true, "a3"), m(true, "a4")];
        let got = group(&all);
        assert_eq!(got, vec![(Some("u1"), Some("a1")), (Some("u2"), None), (Some("u3"), Some("a3")), (None, Some("a4"))]);
        assert!(group(&[]).is_empty());
    }
}
