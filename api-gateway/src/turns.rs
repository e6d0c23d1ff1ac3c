//! Live turns: the in-memory side of a conversation turn while it streams.
//!
//! One [`LiveTurn`] per conversation at most. A runner task owns the
//! [`Reply`], appends every sent piece to the live event list and, in
//! batches, to the durable token log, and stores the turn once when it ends
//! (before it publishes the end event and leaves the registry, so a retry
//! always finds either the live turn or the stored one). Any number of
//! clients follow the event list from any position: retries attach, and
//! `Last-Event-ID` resumes. When the last follower leaves, the turn is
//! cancelled after a grace period (a reconnect within it resumes).

use crate::metrics;
use crate::pipeline::{Piece, Reply};
use crate::state::App;
use crate::store::{LogEntry, TurnEnd, TurnState};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// Token counts as the API reports them.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct UsageJson {
    pub prompt_tokens: i64,
    pub cached_tokens: i64,
    pub completion_tokens: i64,
}

/// The end of a turn as its final SSE event and non-streaming answer.
#[derive(Clone, Debug, Serialize)]
pub struct TurnResult {
    pub turn_id: String,
    pub state: TurnState,
    pub finish_reason: String,
    pub reply: String,
    pub usage: UsageJson,
}

/// One event of a turn; its position in the list is its SSE `id`.
#[derive(Clone, Debug)]
pub enum TurnEvent {
    Delta(String),
    Moderation(String),
    End(TurnResult),
}

/// A turn in progress.
pub struct LiveTurn {
    pub turn_id: String,
    pub request_hash: String,
    events: Mutex<Vec<TurnEvent>>,
    count: watch::Sender<usize>,
    cancel: Notify,
    followers: AtomicUsize,
}

impl LiveTurn {
    fn push(&self, ev: TurnEvent) {
        let n = {
            let mut evs = self.events.lock().unwrap_or_else(|p| p.into_inner());
            evs.push(ev);
            evs.len()
        };
        self.count.send_replace(n);
    }

    /// Asks the runner to stop the reply now.
    pub fn stop(&self) {
        self.cancel.notify_one();
    }

    /// Events from position `from` on, ending after the end event.
    pub fn follow(self: &Arc<Self>, app: Arc<App>, from: usize) -> impl futures::Stream<Item = (usize, TurnEvent)> + Send + 'static {
        self.followers.fetch_add(1, Ordering::SeqCst);
        let guard = Follower { turn: self.clone(), app };
        let rx = self.count.subscribe();
        futures::stream::unfold((guard, rx, from, false), |(guard, mut rx, pos, ended)| async move {
            if ended {
                return None;
            }
            loop {
                let next = {
                    let evs = guard.turn.events.lock().unwrap_or_else(|p| p.into_inner());
                    evs.get(pos).cloned()
                };
                if let Some(ev) = next {
                    let end = matches!(ev, TurnEvent::End(_));
                    return Some(((pos, ev), (guard, rx, pos + 1, end)));
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        })
    }
}

/// Counts a follower; the last one to leave starts the grace timer.
struct Follower {
    turn: Arc<LiveTurn>,
    app: Arc<App>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        if self.turn.followers.fetch_sub(1, Ordering::SeqCst) == 1 {
            let turn = self.turn.clone();
            let grace = self.app.config.resume_grace;
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    tokio::time::sleep(grace).await;
                    if turn.followers.load(Ordering::SeqCst) == 0 {
                        turn.stop();
                    }
                });
            }
        }
    }
}

/// Live turns by conversation ID.
#[derive(Default)]
pub struct Registry {
    map: Mutex<HashMap<String, Arc<LiveTurn>>>,
}

impl Registry {
    pub fn get(&self, conversation: &str) -> Option<Arc<LiveTurn>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).get(conversation).cloned()
    }

    fn insert(&self, conversation: &str, t: Arc<LiveTurn>) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).insert(conversation.to_string(), t);
    }

    fn remove(&self, conversation: &str) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).remove(conversation);
    }
}

/// Log entries are written in batches of this many (and at the end).
const LOG_BATCH: usize = 16;

/// Registers a live turn and spawns its runner; returns the turn.
pub fn spawn(app: Arc<App>, conversation: String, turn_id: String, request_hash: String, reply: Reply) -> Arc<LiveTurn> {
    let (count, _) = watch::channel(0);
    let live = Arc::new(LiveTurn {
        turn_id: turn_id.clone(),
        request_hash,
        events: Mutex::new(Vec::new()),
        count,
        cancel: Notify::new(),
        followers: AtomicUsize::new(0),
    });
    app.live.insert(&conversation, live.clone());
    let l = live.clone();
    tokio::spawn(async move { run(app, l, conversation, turn_id, reply).await });
    live
}

async fn run(app: Arc<App>, live: Arc<LiveTurn>, conversation: String, turn_id: String, mut reply: Reply) {
    let mut pending: Vec<LogEntry> = Vec::new();
    let mut pos: i64 = 0;
    let end = loop {
        let piece = tokio::select! {
            biased;
            _ = live.cancel.notified() => reply.cancel(),
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
                    if let Err(e) = app.store.append_log(&conversation, &turn_id, &pending).await {
                        tracing::warn!(conversation = %conversation, turn = %turn_id, error = %e, "token log write failed");
                    }
                    pending.clear();
                }
            }
            Some(Piece::End(end)) => break end,
            None => break crate::pipeline::End { finish_reason: "error", usage: Default::default(), blocked: None, error: None },
        }
    };
    if let Err(e) = app.store.append_log(&conversation, &turn_id, &pending).await {
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
    if let Err(e) = app.store.finish_turn(&conversation, &turn_id, &stored).await {
        tracing::error!(conversation = %conversation, turn = %turn_id, error = %e, "storing the turn failed");
    }
    metrics::turn(state.as_str());
    tracing::info!(conversation = %conversation, turn = %turn_id, state = state.as_str(), completion_tokens = u.completion_tokens, "turn ended");
    if let Some(reason) = end.blocked {
        live.push(TurnEvent::Moderation(reason));
    }
    live.push(TurnEvent::End(TurnResult {
        turn_id: turn_id.clone(),
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
