//! Deletion that no node can survive: a deleted conversation's text goes at once, and
//! its tombstone (the ID only) stays in the store until every node that may hold the
//! conversation's KV acknowledged the eviction.
//!
//! The delete handler makes the first attempt itself; a background task retries the
//! tombstones that come due, with exponential backoff between [`Backoff::min`] and
//! [`Backoff::max`] and jitter (so retries of many tombstones, or of several gateway
//! replicas, do not fall in step). Which nodes "may hold" the KV is the coordinator's
//! answer (members that failed, and nodes that left the ring recently: see
//! `baton_coordinator::tombstones`); a tombstone clears only on an answer that owes
//! nothing. The tombstones live in the store, so a restarted gateway resumes them.
//!
//! A turn still streaming on another gateway replica when its conversation is deleted
//! would go on generating, and leave KV on its decode node behind an eviction made at
//! once. The store records such turns with the deletion (the store is the replicas'
//! shared truth); the replica running one finds its turn gone at its next token-log write,
//! stops it and acknowledges once its generation ended; no eviction of the conversation
//! is attempted while one is outstanding on a live replica
//! ([`ConversationStore::turns_stopping`]), and the delete waits up to [`STOP_WAIT`] for
//! them before its first attempt.
//!
//! [`Backoff`] is the pure core; [`Evictions`] is the shell over the store and the
//! generator.

use std::sync::Arc;
use std::time::Duration;

use baton_vocab::ConversationId;

use crate::generator::{Eviction, Generator};
use crate::metrics;
use crate::store::{now_unix_ms, ConversationStore, Tombstone};

/// Tombstones one pass of the retry task takes.
const BATCH: usize = 64;

/// How often a deletion looks whether other replicas' turns of it ended.
const STOP_POLL: Duration = Duration::from_millis(25);

/// How long a deletion waits for other replicas' turns of its conversation to end before
/// it answers (then 202: the retry task evicts once they did).
pub const STOP_WAIT: Duration = Duration::from_secs(10);

/// Delays between eviction attempts of one tombstone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// After the first failed attempt.
    pub min: Duration,
    /// The longest delay, however many attempts failed.
    pub max: Duration,
}

impl Backoff {
    /// The delay after `failed` failed attempts (at least 1): `min * 2^(failed - 1)`,
    /// capped at `max`, then scaled into [half of it, all of it] by `unit` in [0, 1).
    pub fn delay(&self, failed: u32, unit: f64) -> Duration {
        let doublings = failed.saturating_sub(1).min(31);
        let full = self.min.saturating_mul(1u32 << doublings).min(self.max);
        let unit = if unit.is_finite() { unit.clamp(0.0, 1.0) } else { 0.0 };
        full.mul_f64(0.5 + 0.5 * unit)
    }
}

/// The retry loop's state: where tombstones live and who evicts.
pub struct Evictions {
    store: Arc<dyn ConversationStore>,
    generator: Arc<dyn Generator>,
    backoff: Backoff,
}

impl Evictions {
    pub fn new(store: Arc<dyn ConversationStore>, generator: Arc<dyn Generator>, backoff: Backoff) -> Arc<Self> {
        Arc::new(Self { store, generator, backoff })
    }

    /// When a new tombstone's first retry is due (unix ms): should the first attempt
    /// never happen (a crash right after the delete), the retry task makes it.
    pub fn first_retry_ms(&self) -> i64 {
        now_unix_ms().saturating_add(self.backoff.min.as_millis() as i64)
    }

    /// One attempt to evict a tombstoned conversation that already failed `failed`
    /// times (`owed`: who owed it then). Clears the tombstone when nothing is owed,
    /// else schedules the next attempt. True when the tombstone cleared.
    pub async fn attempt(&self, conversation: &str, failed: u32, owed: &[String], when: &'static str) -> bool {
        // A turn of the conversation still generating on another replica would leave KV
        // behind an eviction made now: wait until every such turn ended.
        match self.store.turns_stopping(conversation).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(conversation, turns = n, "turns of the deleted conversation still run on other replicas");
                return self.reschedule(conversation, failed, owed, when, "in_flight").await;
            }
            Err(e) => {
                tracing::warn!(conversation, kind = e.label(), error = %e, "reading the turns still stopping failed");
                return self.reschedule(conversation, failed, owed, when, "store_error").await;
            }
        }
        let evicted = match ConversationId::parse(conversation) {
            Ok(id) => self.generator.evict_conversation(&id).await,
            // Every generation's conversation is a parsed ID, so no node holds KV under
            // a string that is none: nothing to evict.
            Err(_) => Ok(Eviction::default()),
        };
        let (result, owed) = match evicted {
            Ok(ev) => {
                metrics::eviction_acks(ev.acked.len());
                if ev.complete() {
                    match self.store.clear_tombstone(conversation).await {
                        Ok(_) => {
                            metrics::eviction_attempt(when, "complete");
                            tracing::info!(conversation, attempts = failed + 1, "conversation evicted on every node");
                            self.refresh_gauge().await;
                            return true;
                        }
                        Err(e) => {
                            // Evicted, but the tombstone stays: a later retry evicts again, harmlessly.
                            tracing::warn!(conversation, kind = e.label(), error = %e, "clearing a tombstone failed");
                            ("store_error", ev.owed)
                        }
                    }
                } else {
                    ("owed", ev.owed)
                }
            }
            Err(e) => {
                tracing::warn!(conversation, kind = e.label(), error = %e, "eviction attempt failed");
                ("error", owed.to_vec())
            }
        };
        self.reschedule(conversation, failed, &owed, when, result).await
    }

    /// Records a failed attempt and when the next is due. Always false (not cleared).
    async fn reschedule(&self, conversation: &str, failed: u32, owed: &[String], when: &'static str, result: &'static str) -> bool {
        metrics::eviction_attempt(when, result);
        let failed = failed.saturating_add(1);
        let delay = self.backoff.delay(failed, rand::random::<f64>());
        let next = now_unix_ms().saturating_add(delay.as_millis() as i64);
        tracing::info!(conversation, attempts = failed, owed = ?owed, retry_in_ms = delay.as_millis() as u64, "eviction not yet acknowledged by every node");
        if let Err(e) = self.store.tombstone_attempted(conversation, failed, next, owed).await {
            tracing::warn!(conversation, kind = e.label(), error = %e, "recording an eviction attempt failed");
        }
        self.refresh_gauge().await;
        false
    }

    /// Waits (at most `limit`) until no turn of the deleted `conversation` runs on another
    /// replica, polling the store; true when none does. A replica notices the deletion at
    /// its turn's next token-log write and acknowledges once its generation ended.
    pub async fn wait_turns_stopped(&self, conversation: &str, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match self.store.turns_stopping(conversation).await {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(conversation, kind = e.label(), error = %e, "reading the turns still stopping failed");
                    return false;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(STOP_POLL).await;
        }
    }

    /// Retries due tombstones until the task is dropped; each pass takes up to [`BATCH`].
    pub async fn run(self: Arc<Self>) {
        let poll = self.backoff.min.clamp(Duration::from_millis(100), Duration::from_secs(1));
        self.refresh_gauge().await;
        loop {
            match self.store.due_tombstones(now_unix_ms(), BATCH).await {
                Ok(due) => self.retry(due).await,
                Err(e) => tracing::warn!(kind = e.label(), error = %e, "reading due tombstones failed"),
            }
            tokio::time::sleep(poll).await;
        }
    }

    async fn retry(&self, due: Vec<Tombstone>) {
        for t in due {
            self.attempt(&t.conversation, t.attempts, &t.owed, "retry").await;
        }
    }

    /// Sets the pending-tombstones gauge from the store.
    pub async fn refresh_gauge(&self) {
        match self.store.count_tombstones().await {
            Ok(n) => metrics::set_tombstones(n),
            Err(e) => tracing::warn!(kind = e.label(), error = %e, "counting tombstones failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{GenerateError, GenerateRequest, GenerationStream};
    use crate::store::{now_unix, Conversation, SqliteStore};
    use std::collections::VecDeque;
    use std::sync::Mutex;

    #[test]
    fn backoff_doubles_caps_and_jitters_within_half() {
        let b = Backoff { min: Duration::from_secs(1), max: Duration::from_secs(30) };
        assert_eq!(b.delay(1, 0.999_999).as_millis(), 999);
        assert_eq!(b.delay(1, 0.0), Duration::from_millis(500));
        assert_eq!(b.delay(2, 0.0), Duration::from_secs(1));
        assert_eq!(b.delay(3, 0.0), Duration::from_secs(2));
        assert_eq!(b.delay(5, 0.0), Duration::from_secs(8));
        assert_eq!(b.delay(6, 0.0), Duration::from_secs(15), "capped at max before jitter");
        assert_eq!(b.delay(u32::MAX, 0.0), Duration::from_secs(15), "no overflow");
        for unit in [0.0, 0.3, 0.7, 0.99] {
            let d = b.delay(4, unit);
            assert!(d >= Duration::from_secs(4) && d <= Duration::from_secs(8), "{d:?}");
        }
        assert_eq!(b.delay(0, f64::NAN), Duration::from_millis(500), "nonsense jitter is the shortest");
    }

    /// A generator whose evictions answer from a script.
    struct Scripted(Mutex<VecDeque<Result<Eviction, GenerateError>>>);

    #[async_trait::async_trait]
    impl Generator for Scripted {
        async fn generate(&self, _req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
            Err(GenerateError::Unavailable("not in this test".into()))
        }

        async fn evict_conversation(&self, _conversation: &ConversationId) -> Result<Eviction, GenerateError> {
            self.0.lock().unwrap().pop_front().expect("an answer scripted for every attempt")
        }
    }

    fn owes(nodes: &[&str]) -> Result<Eviction, GenerateError> {
        Ok(Eviction { acked: vec!["decode-1".into()], owed: nodes.iter().map(|n| n.to_string()).collect() })
    }

    #[tokio::test]
    async fn a_tombstone_stays_until_an_attempt_owes_nothing() {
        let store = Arc::new(SqliteStore::in_memory().unwrap());
        let script = VecDeque::from([owes(&["decode-0"]), Err(GenerateError::Unavailable("coordinator down".into())), owes(&[])]);
        let generator = Arc::new(Scripted(Mutex::new(script)));
        let backoff = Backoff { min: Duration::from_millis(200), max: Duration::from_secs(60) };
        let ev = Evictions::new(store.clone(), generator, backoff);
        let c = Conversation { id: "c1".into(), owner: "alice".into(), title: String::new(), system_prompt_version: 1, created_at: now_unix(), updated_at: now_unix(), summary: None, metadata: Default::default() };
        store.create_conversation(&c).await.unwrap();
        assert!(store.delete_conversation("alice", "c1", ev.first_retry_ms()).await.unwrap());

        // decode-0 owes it: the tombstone records that and waits its backoff.
        let before = now_unix_ms();
        assert!(!ev.attempt("c1", 0, &[], "delete").await);
        let t = &store.due_tombstones(i64::MAX, 10).await.unwrap()[0];
        assert_eq!((t.attempts, t.owed.clone()), (1, vec!["decode-0".to_string()]));
        assert!(t.next_attempt_ms >= before + 100 && t.next_attempt_ms <= now_unix_ms() + 200, "{t:?}");
        assert!(store.due_tombstones(before, 10).await.unwrap().is_empty());

        // The coordinator is unreachable: still owed by whom it was owed, a longer wait.
        let before = now_unix_ms();
        assert!(!ev.attempt("c1", t.attempts, &t.owed, "retry").await);
        let t = &store.due_tombstones(i64::MAX, 10).await.unwrap()[0];
        assert_eq!((t.attempts, t.owed.clone()), (2, vec!["decode-0".to_string()]));
        assert!(t.next_attempt_ms >= before + 200, "the second wait is at least the first's longest: {t:?}");

        // Everyone acknowledged: gone.
        assert!(ev.attempt("c1", t.attempts, &t.owed, "retry").await);
        assert_eq!(store.count_tombstones().await.unwrap(), 0);
    }

    #[tokio::test]
    async fn the_retry_task_takes_due_tombstones_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gw.db");
        {
            let store = SqliteStore::open(&path).unwrap();
            let c = Conversation { id: "c2".into(), owner: "bob".into(), title: String::new(), system_prompt_version: 1, created_at: now_unix(), updated_at: now_unix(), summary: None, metadata: Default::default() };
            store.create_conversation(&c).await.unwrap();
            assert!(store.delete_conversation("bob", "c2", now_unix_ms()).await.unwrap());
        }
        // A new process: the tombstone is still there, and the task evicts it.
        let store = Arc::new(SqliteStore::open(&path).unwrap());
        assert_eq!(store.count_tombstones().await.unwrap(), 1);
        let generator = Arc::new(Scripted(Mutex::new(VecDeque::from([owes(&[])]))));
        let ev = Evictions::new(store.clone(), generator, Backoff { min: Duration::from_millis(100), max: Duration::from_secs(1) });
        let task = tokio::spawn(ev.run());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store.count_tombstones().await.unwrap() > 0 {
            assert!(std::time::Instant::now() < deadline, "the retry task did not clear the tombstone");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        task.abort();
    }
}
