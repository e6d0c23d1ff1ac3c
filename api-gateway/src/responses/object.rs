//! What the Responses API says, as the official OpenAI client parses it: response IDs
//! (a response is one turn of a stored conversation, so its ID names both), the
//! `response` object, its `usage`, the input item list, and a turn's events as the
//! typed stream (`response.created` ... `response.completed`) with `sequence_number`s.
//!
//! A stream's sequence numbers are a pure function of the turn's event positions (four
//! opening events, then one per turn event, then four closing ones), so a client that
//! resumes after sequence number `n` (`starting_after`, `Last-Event-ID`) gets exactly
//! the events it missed, from the live turn or from the store.

use crate::error::ApiError;
use crate::live::{TurnEvent, TurnResult};
use crate::store::TurnState;
use baton_vocab::{ConversationId, TurnId};
use serde_json::{json, Map, Value};

/// The response ID of turn `turn` of conversation `conversation`.
pub fn response_id(conversation: &str, turn: &str) -> String {
    format!("resp_{conversation}__{turn}")
}

/// The conversation and turn a response ID names; a malformed ID is a 404, exactly
/// like an unknown one (gateway-minted conversation IDs hold no `__`).
pub fn parse_response_id(id: &str) -> Result<(ConversationId, TurnId), ApiError> {
    let not_found = || ApiError::not_found("response");
    let rest = id.strip_prefix("resp_").ok_or_else(not_found)?;
    let (c, t) = rest.split_once("__").ok_or_else(not_found)?;
    let c = crate::conv_common::parse_conversation_id(c).map_err(|_| not_found())?;
    let t = crate::conv_common::parse_turn_id(t).map_err(|_| not_found())?;
    Ok((c, t))
}

/// The assistant message's item ID of a turn (unique within its conversation).
pub fn output_item_id(turn: &str) -> String {
    crate::conv_items::reply_item_id(turn)
}

/// The user message's item ID of a turn.
pub fn input_item_id(turn: &str) -> String {
    crate::conv_items::user_item_id(turn)
}

/// What a response object says beside its outcome: what the request asked for (known
/// when it is answered; a retrieved response reports what the store keeps).
#[derive(Clone, Debug, Default)]
pub struct Meta {
    pub id: String,
    pub item_id: String,
    pub created_at: i64,
    pub model: String,
    pub instructions: Option<String>,
    pub metadata: Map<String, Value>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_output_tokens: Option<u32>,
    pub previous_response_id: Option<String>,
    /// Set when the request named a conversation.
    pub conversation: Option<String>,
    pub store: bool,
    pub truncation: String,
}

/// `usage` of a response: `input_tokens_details.cached_tokens` is the prompt's prefix
/// that was already in the KV cache (a warm turn).
pub fn usage_json(prompt: i64, cached: i64, completion: i64) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    })
}

/// A turn's end as a response: status, `incomplete_details` and `error`.
fn outcome(r: &TurnResult) -> (&'static str, Value, Value) {
    match (r.state, r.finish_reason.as_str()) {
        (TurnState::Done, "length") => ("incomplete", json!({"reason": "max_output_tokens"}), Value::Null),
        (TurnState::Done, _) => ("completed", Value::Null, Value::Null),
        (TurnState::Stopped, "content_filter") => ("incomplete", json!({"reason": "content_filter"}), Value::Null),
        (TurnState::Stopped, _) => ("cancelled", Value::Null, Value::Null),
        (TurnState::Failed, why) => {
            ("failed", Value::Null, json!({"code": "server_error", "message": format!("the response failed ({why}); retry it")}))
        }
        (TurnState::Streaming, _) => ("in_progress", Value::Null, Value::Null),
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(meta: &Meta, status: &str, content: Vec<Value>) -> Value {
    json!({"id": meta.item_id, "type": "message", "role": "assistant", "status": status, "content": content})
}

/// The `response` object; `result` is the end (None while in progress, with no output yet).
pub fn response_json(meta: &Meta, result: Option<&TurnResult>) -> Value {
    let (status, incomplete, error, output, usage) = match result {
        None => ("in_progress", Value::Null, Value::Null, vec![], Value::Null),
        Some(r) => {
            let (status, incomplete, error) = outcome(r);
            let item_status = if status == "completed" { "completed" } else { "incomplete" };
            let output = if status == "failed" { vec![] } else { vec![message_item(meta, item_status, vec![text_part(&r.reply)])] };
            let u = &r.usage;
            (status, incomplete, error, output, usage_json(u.prompt_tokens, u.cached_tokens, u.completion_tokens))
        }
    };
    let mut v = json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "background": false,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": meta.instructions,
        "max_output_tokens": meta.max_output_tokens,
        "metadata": meta.metadata,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": false,
        "previous_response_id": meta.previous_response_id,
        "reasoning": null,
        "store": meta.store,
        "temperature": meta.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "none",
        "tools": [],
        "top_p": meta.top_p,
        "truncation": meta.truncation,
        "usage": usage,
    });
    if let Some(c) = &meta.conversation {
        v["conversation"] = json!({"id": c});
    }
    v
}

/// The input items of a response: its user message.
pub fn input_items_json(turn: &str, user_text: &str) -> Value {
    let id = input_item_id(turn);
    json!({
        "object": "list",
        "data": [{"id": id, "type": "message", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": user_text}]}],
        "first_id": id,
        "last_id": id,
        "has_more": false,
    })
}

/// Events before the turn's first event.
const OPENING: u64 = 4;

/// Events after the turn's end event's first one.
const CLOSING: u64 = 3;

/// The turn event position from which a stream resumed after sequence number
/// `starting_after` must follow the turn (then filtered to sequence numbers above it):
/// the end event spans `1 + CLOSING` numbers, so a resume inside them needs its position.
pub fn resume_position(starting_after: Option<u64>) -> usize {
    starting_after.map(|n| (n + 1).saturating_sub(OPENING + CLOSING) as usize).unwrap_or(0)
}

/// The stream events of turn event `ev` at position `pos` (with the opening events
/// before position 0), each with its sequence number.
pub fn stream_events(meta: &Meta, pos: usize, ev: &TurnEvent) -> Vec<(u64, Value)> {
    let mut out = Vec::new();
    let item = |status: &str, content: Vec<Value>| message_item(meta, status, content);
    let part = |text: &str| text_part(text);
    if pos == 0 {
        let r = response_json(meta, None);
        out.push(json!({"type": "response.created", "response": r}));
        out.push(json!({"type": "response.in_progress", "response": r}));
        out.push(json!({"type": "response.output_item.added", "output_index": 0, "item": item("in_progress", vec![])}));
        out.push(json!({"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": meta.item_id, "part": part("")}));
    }
    let first = if pos == 0 { 0 } else { OPENING + pos as u64 };
    let mut with_seq: Vec<(u64, Value)> = out.into_iter().enumerate().map(|(i, v)| (first + i as u64, v)).collect();
    let at = OPENING + pos as u64;
    match ev {
        TurnEvent::Delta(text) => with_seq.push((
            at,
            json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": meta.item_id, "delta": text, "logprobs": []}),
        )),
        // The output check's notice: the closing events say `content_filter`.
        TurnEvent::Moderation(_) => {}
        TurnEvent::End(r) => {
            let response = response_json(meta, Some(r));
            let status = response["status"].as_str().unwrap_or("failed").to_string();
            let item_status = if status == "completed" { "completed" } else { "incomplete" };
            let closing = [
                json!({"type": "response.output_text.done", "output_index": 0, "content_index": 0, "item_id": meta.item_id, "text": r.reply, "logprobs": []}),
                json!({"type": "response.content_part.done", "output_index": 0, "content_index": 0, "item_id": meta.item_id, "part": part(&r.reply)}),
                json!({"type": "response.output_item.done", "output_index": 0, "item": item(item_status, vec![part(&r.reply)])}),
                json!({"type": final_event(&status), "response": response}),
            ];
            with_seq.extend(closing.into_iter().enumerate().map(|(i, v)| (at + i as u64, v)));
        }
    }
    for (seq, v) in &mut with_seq {
        v["sequence_number"] = json!(*seq);
    }
    with_seq
}

/// The last event's type for a response's status (a cancelled response ends as
/// `response.incomplete`, whose `response.status` says `cancelled`).
fn final_event(status: &str) -> &'static str {
    match status {
        "completed" => "response.completed",
        "failed" => "response.failed",
        _ => "response.incomplete",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::UsageJson;

    fn end(state: TurnState, reason: &str) -> TurnEvent {
        TurnEvent::End(TurnResult {
            turn_id: "t".into(),
            state,
            finish_reason: reason.into(),
            reply: "ab".into(),
            usage: UsageJson { prompt_tokens: 10, cached_tokens: 6, completion_tokens: 2 },
        })
    }

    #[test]
    fn response_ids_round_trip_and_refuse_garbage() {
        let id = response_id("conv-1a2b", "r9f");
        let (c, t) = parse_response_id(&id).unwrap();
        assert_eq!((c.as_str(), t.as_str()), ("conv-1a2b", "r9f"));
        for bad in ["", "resp_", "resp_conv", "chatcmpl-1", "resp_a__b/c", "resp___t", "resp_c__"] {
            assert_eq!(parse_response_id(bad).unwrap_err().status, 404, "{bad}");
        }
    }

    #[test]
    fn stream_sequence_numbers_are_contiguous_and_resumable() {
        let meta = Meta { id: "resp_c__t".into(), item_id: "msg_t".into(), ..Meta::default() };
        let events = [TurnEvent::Delta("a".into()), TurnEvent::Delta("b".into()), end(TurnState::Done, "stop")];
        let all: Vec<(u64, Value)> = events.iter().enumerate().flat_map(|(p, e)| stream_events(&meta, p, e)).collect();
        let seqs: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, (0..all.len() as u64).collect::<Vec<_>>());
        let types: Vec<&str> = all.iter().map(|(_, v)| v["type"].as_str().unwrap()).collect();
        assert_eq!(types[..4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]);
        assert_eq!(types[types.len() - 1], "response.completed");
        assert!(all.iter().all(|(s, v)| v["sequence_number"] == json!(s)));
        let last = &all.last().unwrap().1["response"];
        assert_eq!(last["usage"]["input_tokens_details"]["cached_tokens"], 6);
        assert_eq!(last["output"][0]["content"][0]["text"], "ab");
        // Resuming after any sequence number follows from the position that holds the next one.
        for n in 0..all.len() as u64 {
            let from = resume_position(Some(n));
            let resumed: Vec<u64> =
                events.iter().enumerate().skip(from).flat_map(|(p, e)| stream_events(&meta, p, e)).map(|(s, _)| s).filter(|s| *s > n).collect();
            assert_eq!(resumed, (n + 1..all.len() as u64).collect::<Vec<_>>(), "after {n}");
        }
    }

    #[test]
    fn outcomes_map_to_statuses() {
        let meta = Meta::default();
        for (state, reason, status, event) in [
            (TurnState::Done, "stop", "completed", "response.completed"),
            (TurnState::Done, "length", "incomplete", "response.incomplete"),
            (TurnState::Stopped, "content_filter", "incomplete", "response.incomplete"),
            (TurnState::Stopped, "cancelled", "cancelled", "response.incomplete"),
            (TurnState::Failed, "unavailable", "failed", "response.failed"),
        ] {
            let evs = stream_events(&meta, 3, &end(state, reason));
            let (_, last) = evs.last().unwrap();
            assert_eq!(last["type"], event);
            assert_eq!(last["response"]["status"], status);
        }
    }
}
