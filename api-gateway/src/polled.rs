//! Following a turn that streams on another gateway replica (several replicas
//! over one PostgreSQL): that replica owns the reply, so this one reads the
//! turn's durable token log as it grows (written in batches, [`crate::turns`])
//! and its stored end. Event positions are the same as the owner's (a log
//! entry's index is its SSE `id`), so `Last-Event-ID` resumes across replicas.
//!
//! When the owner stops beating before the turn ends, the stream ends with a
//! `failed`/`interrupted` end event: the client's retry with the same turn ID
//! then takes the turn over (it generates again; nothing is stored twice).

use crate::state::App;
use crate::store::{StoreResult, Turn, TurnState};
use crate::live::{TurnEvent, TurnResult, UsageJson};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// How often the store is read while the turn streams elsewhere.
const POLL: Duration = Duration::from_millis(200);

struct Poll {
    app: Arc<App>,
    conversation: String,
    turn_id: String,
    /// Position of the next event to send.
    next: usize,
    queue: VecDeque<(usize, TurnEvent)>,
    ended: bool,
    first: bool,
}

/// The events of the stored turn from position `from` on, ending after its end
/// event (or when the turn is deleted, or the store fails).
pub fn follow(
    app: Arc<App>,
    conversation: String,
    turn_id: String,
    from: usize,
) -> impl futures::Stream<Item = (usize, TurnEvent)> + Send + 'static {
    let p = Poll { app, conversation, turn_id, next: from, queue: VecDeque::new(), ended: false, first: true };
    futures::stream::unfold(p, |mut p| async move {
        loop {
            if let Some(item) = p.queue.pop_front() {
                return Some((item, p));
            }
            if p.ended {
                return None;
            }
            if !p.first {
                tokio::time::sleep(POLL).await;
            }
            p.first = false;
            if let Err(e) = p.step().await {
                tracing::warn!(conversation = %p.conversation, turn = %p.turn_id, error = %e, "following a turn through the store failed");
                return None;
            }
        }
    })
}

impl Poll {
    async fn step(&mut self) -> StoreResult<()> {
        let store = &self.app.store;
        // The row first: once it is no longer streaming, its whole log is stored.
        let Some(t) = store.get_turn(&self.conversation, &self.turn_id).await? else {
            self.ended = true; // deleted
            return Ok(());
        };
        if t.state != TurnState::Streaming {
            let tail = stored_events(&self.app, &t, self.next).await?;
            self.queue.extend(tail);
            self.ended = true;
            return Ok(());
        }
        for e in store.read_log(&self.conversation, &self.turn_id, self.next as i64).await? {
            let pos = e.index as usize;
            self.queue.push_back((pos, TurnEvent::Delta(e.text)));
            self.next = pos + 1;
        }
        if self.queue.is_empty() && !store.turn_runs_elsewhere(&self.conversation, &self.turn_id).await? {
            // Its replica died: this attempt ends here; a retry takes it over.
            self.queue.push_back((
                self.next,
                TurnEvent::End(TurnResult {
                    turn_id: self.turn_id.clone(),
                    state: TurnState::Failed,
                    finish_reason: "interrupted".into(),
                    reply: String::new(),
                    usage: UsageJson { prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0 },
                }),
            ));
            self.ended = true;
        }
        Ok(())
    }
}

/// A stored turn's end as its final event and non-streaming answer.
pub fn stored_result(t: &Turn) -> TurnResult {
    TurnResult {
        turn_id: t.turn_id.clone(),
        state: t.state,
        finish_reason: t.finish_reason.clone().unwrap_or_default(),
        reply: t.reply_text.clone(),
        usage: UsageJson { prompt_tokens: t.prompt_tokens, cached_tokens: t.cached_tokens, completion_tokens: t.completion_tokens },
    }
}

/// A finished turn's events from position `from` on, as the live turn sent
/// them: its logged deltas, the moderation notice if the output check stopped
/// it, and the end event.
pub async fn stored_events(app: &App, t: &Turn, from: usize) -> StoreResult<Vec<(usize, TurnEvent)>> {
    let log = app.store.read_log(&t.conversation, &t.turn_id, from as i64).await?;
    let all = match log.last() {
        Some(e) => e.index as usize + 1,
        None => app.store.read_log(&t.conversation, &t.turn_id, 0).await?.len(),
    };
    let mut events: Vec<(usize, TurnEvent)> = log.into_iter().map(|e| (e.index as usize, TurnEvent::Delta(e.text))).collect();
    let mut pos = all;
    if t.finish_reason.as_deref() == Some("content_filter") {
        if pos >= from {
            events.push((pos, TurnEvent::Moderation("the reply was stopped by the output policy".into())));
        }
        pos += 1;
    }
    events.push((pos, TurnEvent::End(stored_result(t))));
    Ok(events)
}
