//! Live turns: the in-memory side of a turn while it streams, as plain data that
//! `turns` (the runner) writes and the handlers read.
//!
//! One [`LiveTurn`] per conversation at most, in the [`Registry`]. Any number of
//! clients follow its event list from any position: retries attach, and
//! `Last-Event-ID` resumes. When the last follower leaves, the turn is stopped
//! after a grace period (a reconnect within it resumes).

use crate::store::TurnState;
use baton_vocab::{ConversationId, TurnId};
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
    pub turn_id: TurnId,
    pub request_hash: String,
    events: Mutex<Vec<TurnEvent>>,
    count: watch::Sender<usize>,
    cancel: Notify,
    followers: AtomicUsize,
}

impl LiveTurn {
    pub(crate) fn new(turn_id: TurnId, request_hash: String) -> Self {
        let (count, _) = watch::channel(0);
        LiveTurn { turn_id, request_hash, events: Mutex::new(Vec::new()), count, cancel: Notify::new(), followers: AtomicUsize::new(0) }
    }

    /// Resolves when [`Self::stop`] was called (for the runner).
    pub(crate) async fn stopped(&self) {
        self.cancel.notified().await
    }

    pub(crate) fn push(&self, ev: TurnEvent) {
        let n = {
            let mut evs = self.events.lock().unwrap_or_else(|p| p.into_inner());
            evs.push(ev);
            evs.len()
        };
        self.count.send_replace(n);
    }

    /// Resolves once the end event is in the list, without counting as a follower (a
    /// watcher that acts after the turn, like deleting an unstored response, must not
    /// keep a turn whose clients left from being stopped).
    pub async fn ended(&self) {
        let mut rx = self.count.subscribe();
        loop {
            let done = matches!(self.events.lock().unwrap_or_else(|p| p.into_inner()).last(), Some(TurnEvent::End(_)));
            if done || rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Asks the runner to stop the reply now.
    pub fn stop(&self) {
        self.cancel.notify_one();
    }

    /// Events from position `from` on, ending after the end event.
    pub fn follow(self: &Arc<Self>, grace: Duration, from: usize) -> impl futures::Stream<Item = (usize, TurnEvent)> + Send + 'static {
        self.followers.fetch_add(1, Ordering::SeqCst);
        let guard = Follower { turn: self.clone(), grace };
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
    grace: Duration,
}

impl Drop for Follower {
    fn drop(&mut self) {
        if self.turn.followers.fetch_sub(1, Ordering::SeqCst) == 1 {
            let turn = self.turn.clone();
            let grace = self.grace;
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
    map: Mutex<HashMap<ConversationId, Arc<LiveTurn>>>,
}

impl Registry {
    pub fn get(&self, conversation: &ConversationId) -> Option<Arc<LiveTurn>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).get(conversation).cloned()
    }

    pub(crate) fn insert(&self, conversation: &ConversationId, t: Arc<LiveTurn>) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).insert(conversation.clone(), t);
    }

    pub(crate) fn remove(&self, conversation: &ConversationId) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).remove(conversation);
    }
}
