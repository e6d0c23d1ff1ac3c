//! The chaos suite's load: closed-loop multi-turn conversations through Baton's
//! conversations API, spread over every gateway replica. Each turn has an ID of its own;
//! a failed attempt (an error status, a broken connection, a stream that ends without
//! its final event, a final event that says `failed`) is retried with the same turn ID
//! through the next gateway, resuming after the last event seen (`Last-Event-ID`),
//! until the turn is acknowledged or its deadline passes.
//!
//! Every attempt is recorded with its time, so the report can say per fault window how
//! many turns failed, how many needed a retry, and when errors stopped. The load can be
//! paused (no new turns start; running ones finish) so that the harness can check the
//! nodes for leaks while nothing runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::load::conversation::{attempt_turn, create_conversation, TurnRequest};
use crate::load::{ConversationScript, TrafficShape, TurnError};

/// What the load offers.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Base URLs of the gateway replicas, each up to and including `/v1`.
    pub gateways: Vec<String>,
    pub api_key: String,
    /// Conversations open at once.
    pub conversations: usize,
    /// Turns of one conversation; then its user starts a new one (so histories stay
    /// within the model's context however long the run).
    pub turns_per_conversation: usize,
    /// Words of a user message.
    pub message_words: usize,
    pub max_tokens: usize,
    /// Mean think time between a conversation's turns.
    pub think_time: Duration,
    /// How long a turn keeps being retried before it counts as failed.
    pub turn_deadline: Duration,
    /// Per-request timeout (a frozen gateway or node must not hang an attempt forever).
    pub request_timeout: Duration,
    pub seed: u64,
}

/// One attempt at a turn.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// Which gateway (index into [`LoadConfig::gateways`]).
    pub gateway: usize,
    /// Seconds since the load started.
    pub start_s: f64,
    pub end_s: f64,
    /// `None`: acknowledged; otherwise a bounded label (`http_503`, `transport`,
    /// `cut` (the stream ended without a final event), `failed` (the final event said so)).
    pub error: Option<String>,
}

/// One turn as the client saw it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TurnRecord {
    pub conversation: String,
    pub turn_id: String,
    pub start_s: f64,
    pub end_s: f64,
    pub attempts: Vec<AttemptRecord>,
    /// The reply the gateway acknowledged (its final event), `None` if the turn failed.
    pub reply: Option<String>,
    /// Seconds from the turn's start to its first streamed token (any attempt).
    pub ttft_s: Option<f64>,
}

impl TurnRecord {
    pub fn acknowledged(&self) -> bool {
        self.reply.is_some()
    }

    /// Acknowledged, but only after a failed attempt.
    pub fn succeeded_on_retry(&self) -> bool {
        self.acknowledged() && self.attempts.iter().any(|a| a.error.is_some())
    }
}

/// A running load; [`Load::stop`] ends it.
pub struct Load {
    records: Arc<Mutex<Vec<TurnRecord>>>,
    paused: watch::Sender<bool>,
    stopped: watch::Sender<bool>,
    busy: Arc<AtomicUsize>,
    started: Instant,
    tasks: tokio::task::JoinSet<()>,
    /// Conversations that could not even be created (every gateway refused).
    pub setup_errors: Arc<Mutex<Vec<String>>>,
}

impl Load {
    /// Starts every conversation. Needs a Tokio runtime.
    pub fn start(config: LoadConfig) -> Result<Load, TurnError> {
        let http = reqwest::Client::builder().timeout(config.request_timeout).build()?;
        let (paused, _) = watch::channel(false);
        let (stopped, _) = watch::channel(false);
        let mut load = Load {
            records: Arc::default(),
            paused,
            stopped,
            busy: Arc::default(),
            started: Instant::now(),
            tasks: tokio::task::JoinSet::new(),
            setup_errors: Arc::default(),
        };
        let config = Arc::new(config);
        for index in 0..config.conversations {
            let c = Conversation {
                http: http.clone(),
                config: config.clone(),
                index,
                records: load.records.clone(),
                paused: load.paused.subscribe(),
                stopped: load.stopped.subscribe(),
                busy: load.busy.clone(),
                started: load.started,
                setup_errors: load.setup_errors.clone(),
            };
            load.tasks.spawn(c.run());
        }
        Ok(load)
    }

    /// Seconds since the load started (the time base of every record).
    pub fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// No new turns start until [`Load::resume`]; turns in progress finish.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    /// Waits until no turn is in progress (after [`Load::pause`]); false on timeout.
    pub async fn wait_idle(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.busy.load(Ordering::SeqCst) > 0 {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// Every turn finished so far.
    pub fn records(&self) -> Vec<TurnRecord> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Stops the load: turns in progress finish (or hit their deadline) first.
    pub async fn stop(mut self) -> Vec<TurnRecord> {
        self.stopped.send_replace(true);
        self.paused.send_replace(false);
        while self.tasks.join_next().await.is_some() {}
        self.records()
    }
}

struct Conversation {
    http: reqwest::Client,
    config: Arc<LoadConfig>,
    index: usize,
    records: Arc<Mutex<Vec<TurnRecord>>>,
    paused: watch::Receiver<bool>,
    stopped: watch::Receiver<bool>,
    busy: Arc<AtomicUsize>,
    started: Instant,
    setup_errors: Arc<Mutex<Vec<String>>>,
}

impl Conversation {
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    async fn run(mut self) {
        let shape = TrafficShape {
            system_words: 0,
            message_words: self.config.message_words,
            long_doc_probability: 0.0,
            long_doc_words: 0,
            turns: usize::MAX,
            think_time: self.config.think_time,
            seed: self.config.seed,
        };
        let mut script = ConversationScript::new(&shape, self.index as u64);
        let Some(mut conversation) = self.create().await else { return };
        let mut n = 0u64;
        tokio::time::sleep(script.think_time().mul_f64(0.5)).await;
        loop {
            // Wait while paused; end when stopped.
            loop {
                if *self.stopped.borrow() {
                    return;
                }
                if !*self.paused.borrow() {
                    break;
                }
                tokio::select! {
                    _ = self.paused.changed() => {}
                    _ = self.stopped.changed() => {}
                }
            }
            self.busy.fetch_add(1, Ordering::SeqCst);
            if n > 0 && n.is_multiple_of(self.config.turns_per_conversation.max(1) as u64) {
                match self.create().await {
                    Some(c) => conversation = c,
                    None => {
                        self.busy.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                }
            }
            let turn = TurnRequest { conversation: conversation.clone(), turn_id: format!("t{n}"), message: script.next_message(), max_tokens: self.config.max_tokens };
            let record = self.turn(&turn).await;
            if let Ok(mut r) = self.records.lock() {
                r.push(record);
            }
            self.busy.fetch_sub(1, Ordering::SeqCst);
            n += 1;
            let think = script.think_time();
            tokio::select! {
                _ = tokio::time::sleep(think) => {}
                _ = self.stopped.changed() => {}
            }
        }
    }

    /// Creates the conversation through any gateway, retrying for a turn's deadline.
    async fn create(&self) -> Option<String> {
        let deadline = Instant::now() + self.config.turn_deadline;
        let mut k = self.index;
        loop {
            let g = &self.config.gateways[k % self.config.gateways.len()];
            match create_conversation(&self.http, g, &self.config.api_key, &format!("chaos-{}", self.index)).await {
                Ok(id) => return Some(id),
                Err(e) if Instant::now() > deadline => {
                    if let Ok(mut s) = self.setup_errors.lock() {
                        s.push(format!("conversation {}: {e}", self.index));
                    }
                    return None;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
            k += 1;
        }
    }

    /// One turn, retried with the same ID through the next gateway until acknowledged or
    /// past its deadline.
    async fn turn(&self, turn: &TurnRequest) -> TurnRecord {
        let start = Instant::now();
        let start_s = self.now();
        let mut record = TurnRecord { conversation: turn.conversation.clone(), turn_id: turn.turn_id.clone(), start_s, end_s: start_s, attempts: Vec::new(), reply: None, ttft_s: None };
        let gateways = self.config.gateways.len();
        let mut last_event_id = None;
        let mut k = self.index;
        loop {
            let gateway = k % gateways;
            let at = self.now();
            let attempt_start = Instant::now();
            let result = attempt_turn(&self.http, &self.config.gateways[gateway], &self.config.api_key, turn, last_event_id).await;
            let (error, backoff) = match result {
                Ok(a) => {
                    if let (None, Some(t)) = (record.ttft_s, a.ttft) {
                        record.ttft_s = Some((attempt_start - start + t).as_secs_f64());
                    }
                    if a.acknowledged() {
                        record.reply = a.reply.clone();
                        (None, Duration::ZERO)
                    } else if a.state.is_some() {
                        // The gateway ended the turn as failed: a retry generates it again.
                        last_event_id = None;
                        (Some("failed".to_string()), Duration::from_millis(200))
                    } else {
                        last_event_id = a.last_event_id;
                        (Some("cut".to_string()), Duration::from_millis(100))
                    }
                }
                Err(e) => {
                    let backoff = match &e {
                        // Another turn of this conversation still runs (a dead replica's,
                        // until its heartbeat is stale): wait as the gateway asks.
                        TurnError::Status { status: 409, .. } | TurnError::Status { status: 429, .. } => Duration::from_millis(500),
                        // The request itself is refused (bad input, no such conversation):
                        // retrying cannot help; the turn fails now.
                        TurnError::Status { status, .. } if (400..500).contains(status) => {
                            record.attempts.push(AttemptRecord { gateway, start_s: at, end_s: self.now(), error: Some(e.label()) });
                            record.end_s = self.now();
                            return record;
                        }
                        _ => Duration::from_millis(200),
                    };
                    (Some(e.label()), backoff)
                }
            };
            let failed = error.is_some();
            record.attempts.push(AttemptRecord { gateway, start_s: at, end_s: self.now(), error });
            if !failed || start.elapsed() > self.config.turn_deadline {
                record.end_s = self.now();
                return record;
            }
            tokio::time::sleep(backoff).await;
            k += 1;
        }
    }
}
