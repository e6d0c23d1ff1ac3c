//! The runner of a turn: it drives the reply of a [`LiveTurn`] (module `live`).
//!
//! One [`LiveTurn`] per conversation at most. A runner task owns the
//! [`Reply`], appends every sent piece to the live event list and, in
//! batches, to the durable token log, and stores the turn once when it ends
//! (before it publishes the end event and leaves the registry, so a retry
//! always finds either the live turn or the stored one). Any number of
//! clients follow the event list from any position: retries attach, and
//! `Last-Event-ID` resumes. When the last follower leaves, the turn is
//! cancelled after a grace period (a reconnect within it resumes).

use crate::live::{LiveTurn, TurnEvent, TurnResult, UsageJson};
use crate::metrics;
use crate::pipeline::{Piece, Reply};
use crate::state::App;
use crate::store::{LogEntry, TurnEnd, TurnState};
use baton_vocab::{ConversationId, TurnId};
use std::sync::Arc;
use std::time::Duration;

/// Log entries are written in batches of this many (and at the end).
const LOG_BATCH: usize = 16;

/// Registers a live turn and spawns its runner; returns the turn.
pub fn spawn(app: Arc<App>, conversation: ConversationId, turn_id: TurnId, request_hash: String, reply: Reply) -> Arc<LiveTurn> {
    let live = Arc::new(LiveTurn::new(turn_id.clone(), request_hash));
    app.live.insert(&conversation, live.clone());
    let l = live.clone();
    tokio::spawn(async move { run(app, l, conversation, turn_id, reply).await });
    live
}

async fn run(app: Arc<App>, live: Arc<LiveTurn>, conversation: ConversationId, turn_id: TurnId, mut reply: Reply) {
    let mut pending: Vec<LogEntry> = Vec::new();
    let mut pos: i64 = 0;
    let end = loop {
        let piece = tokio::select! {
            biased;
            _ = live.stopped() => reply.cancel(),
            p = reply.next() => p,
        };
        match piece {
            Some(Piece::Delta { text, .. }) => {
                if text.is_empty() {
                    continue;
                }
                pending.push(LogEntry { index: pos, text: text.clone() });
                live.push(TurnEvent::Delta(text));
                pos += 1;
                if pending.len() >= LOG_BATCH {
                    match app.store.append_log(conversation.as_str(), turn_id.as_str(), &pending).await {
                        Ok(true) => {}
                        // The conversation was deleted (perhaps on another replica) or the
                        // turn taken over: stop generating, so the deletion's eviction,
                        // which waits for this turn to end, leaves no KV behind.
                        Ok(false) => {
                            tracing::info!(conversation = %conversation, turn = %turn_id, "the turn is no longer stored; stopping it");
                            live.stop();
                        }
                        Err(e) => tracing::warn!(conversation = %conversation, turn = %turn_id, error = %e, "token log write failed"),
                    }
                    pending.clear();
                }
            }
            Some(Piece::End(end)) => break end,
            None => break crate::pipeline::End { finish_reason: "error", usage: Default::default(), blocked: None, error: None },
        }
    };
    if let Err(e) = app.store.append_log(conversation.as_str(), turn_id.as_str(), &pending).await {
        tracing::warn!(conversation = %conversation, turn = %turn_id, error = %e, "token log write failed");
    }
    let state = match end.finish_reason {
        "stop" | "length" => TurnState::Done,
        "cancelled" | "content_filter" => TurnState::Stopped,
        _ => TurnState::Failed,
    };
    let finish_reason = match &end.error {
        Some(e) => e.label().to_string(),
        None => end.finish_reason.to_string(),
    };
    let u = end.usage;
    let output_ids = app.context.visible_output(&reply.output_ids, &reply.text).unwrap_or_else(|e| {
        tracing::warn!(conversation = %conversation, turn = %turn_id, error = %e, "keeping the generated IDs");
        reply.output_ids.clone()
    });
    let stored = TurnEnd {
        state,
        reply_text: reply.text.clone(),
        output_ids,
        finish_reason: finish_reason.clone(),
        prompt_tokens: u.prompt_tokens as i64,
        cached_tokens: u.cached_tokens as i64,
        completion_tokens: u.completion_tokens as i64,
    };
    if let Err(e) = app.store.finish_turn(conversation.as_str(), turn_id.as_str(), &stored).await {
        tracing::error!(conversation = %conversation, turn = %turn_id, error = %e, "storing the turn failed");
    }
    metrics::turn(state.as_str());
    tracing::info!(conversation = %conversation, turn = %turn_id, state = state.as_str(), completion_tokens = u.completion_tokens, "turn ended");
    if let Some(reason) = end.blocked {
        live.push(TurnEvent::Moderation(reason));
    }
    live.push(TurnEvent::End(TurnResult {
        turn_id: turn_id.as_str().to_string(),
        state,
        finish_reason,
        reply: reply.text.clone(),
        usage: UsageJson {
            prompt_tokens: stored.prompt_tokens,
            cached_tokens: stored.cached_tokens,
            completion_tokens: stored.completion_tokens,
        },
    }));
    app.live.remove(&conversation);
    // Followers that wait for `changed` see the sender's last value; keep the
    // turn reachable through their Arc until they read the end.
    drop(reply);
    tokio::time::sleep(Duration::from_millis(0)).await;
}
