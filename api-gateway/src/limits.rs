//! Per-user limits with token buckets: turns per minute, open streams,
//! prompt tokens per hour, output tokens per hour. A pure synchronous core
//! ([`Bucket`]) under one mutex; admission checks every limit before it
//! charges any, so a refused request costs nothing. Output tokens are
//! charged after the reply (the bucket may go into debt, which then blocks
//! the next turn until it refills). Conversation creates and lists have a
//! bucket of their own per owner ([`Limiter::admit_request`]): they cost no model
//! work, but without one a key could fill the store or page through it for free.
//!
//! Where the counts live: in this process ([`Limiter::new`], one replica: SQLite), or
//! in a [`LimitLedger`] every replica shares ([`Limiter::shared`]: the PostgreSQL
//! store's `limit_buckets` and `limit_streams`), so N replicas behind a balancer give a
//! user each limit once, not N times. The ledger keeps the same semantics (every limit
//! checked before any is charged; output charged after the reply, into debt), and an
//! open stream is a row of the replica that holds it, counted only while that
//! replica's heartbeat is live, so a crashed replica's streams free themselves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::StoreError;

/// Limits of one user.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitConfig {
    pub turns_per_minute: f64,
    pub open_streams: usize,
    pub prompt_tokens_per_hour: f64,
    pub output_tokens_per_hour: f64,
    /// Conversation creates and lists together, per owner (not overridable).
    pub conversation_requests_per_minute: f64,
}

/// Per-user overrides of the defaults (unset fields keep the default).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LimitOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns_per_minute: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_streams: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_per_hour: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_hour: Option<f64>,
}

impl LimitOverrides {
    /// These overrides with `top`'s set fields replacing them.
    pub fn under(&self, top: &LimitOverrides) -> LimitOverrides {
        LimitOverrides {
            turns_per_minute: top.turns_per_minute.or(self.turns_per_minute),
            open_streams: top.open_streams.or(self.open_streams),
            prompt_tokens_per_hour: top.prompt_tokens_per_hour.or(self.prompt_tokens_per_hour),
            output_tokens_per_hour: top.output_tokens_per_hour.or(self.output_tokens_per_hour),
        }
    }
}

impl LimitConfig {
    /// The defaults with `o` applied.
    pub fn with(&self, o: Option<&LimitOverrides>) -> LimitConfig {
        let Some(o) = o else { return self.clone() };
        LimitConfig {
            turns_per_minute: o.turns_per_minute.unwrap_or(self.turns_per_minute),
            open_streams: o.open_streams.unwrap_or(self.open_streams),
            prompt_tokens_per_hour: o.prompt_tokens_per_hour.unwrap_or(self.prompt_tokens_per_hour),
            output_tokens_per_hour: o.output_tokens_per_hour.unwrap_or(self.output_tokens_per_hour),
            conversation_requests_per_minute: self.conversation_requests_per_minute,
        }
    }
}

/// A bucket's level `elapsed` seconds after it was `level`, refilling `capacity`
/// every `per`, capped at `capacity` (what [`Bucket`] does, for a ledger that keeps
/// the level and its time as numbers).
pub fn refilled(level: f64, elapsed: f64, capacity: f64, per: Duration) -> f64 {
    (level + elapsed.max(0.0) * capacity / per.as_secs_f64()).min(capacity)
}

/// How long until a bucket at `level` holds `n` (zero if it does now).
pub fn wait_until(level: f64, n: f64, capacity: f64, per: Duration) -> Duration {
    wait_at_rate(level, n, capacity / per.as_secs_f64())
}

/// How long a bucket at `level` refilling `rate` a second takes to hold `n`.
fn wait_at_rate(level: f64, n: f64, rate: f64) -> Duration {
    if level >= n {
        Duration::ZERO
    } else if rate <= 0.0 {
        Duration::from_secs(3600)
    } else {
        Duration::from_secs_f64((n - level) / rate)
    }
}

/// The window each limit refills over.
pub const TURNS_PER: Duration = Duration::from_secs(60);
pub const PROMPT_PER: Duration = Duration::from_secs(3600);
pub const OUTPUT_PER: Duration = Duration::from_secs(3600);
pub const REQUESTS_PER: Duration = Duration::from_secs(60);

/// A token bucket: holds up to `capacity`, refills `rate` per second.
#[derive(Clone, Debug)]
pub struct Bucket {
    capacity: f64,
    rate: f64,
    level: f64,
    last: Instant,
}

impl Bucket {
    pub fn new(capacity: f64, per: Duration, now: Instant) -> Self {
        Bucket { capacity, rate: capacity / per.as_secs_f64(), level: capacity, last: now }
    }

    /// Changes capacity and rate, keeping the level (capped).
    fn reconfigure(&mut self, capacity: f64, per: Duration, now: Instant) {
        self.refill(now);
        self.capacity = capacity;
        self.rate = capacity / per.as_secs_f64();
        self.level = self.level.min(capacity);
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.capacity);
        self.last = now;
    }

    /// How long until `n` can be taken (zero if now).
    pub fn wait_for(&mut self, n: f64, now: Instant) -> Duration {
        self.refill(now);
        wait_at_rate(self.level, n, self.rate)
    }

    /// Takes `n`, possibly into debt.
    pub fn charge(&mut self, n: f64, now: Instant) {
        self.refill(now);
        self.level -= n;
    }
}

struct UserState {
    config: LimitConfig,
    turns: Bucket,
    prompt: Bucket,
    output: Bucket,
    open: usize,
}

impl UserState {
    fn new(config: LimitConfig, now: Instant) -> Self {
        UserState {
            turns: Bucket::new(config.turns_per_minute, TURNS_PER, now),
            prompt: Bucket::new(config.prompt_tokens_per_hour, PROMPT_PER, now),
            output: Bucket::new(config.output_tokens_per_hour, OUTPUT_PER, now),
            config,
            open: 0,
        }
    }
}

/// A refusal: which limit and when to retry.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub limit: &'static str,
    pub retry_after: Duration,
}

/// Why a request was not admitted: a limit, or the shared ledger could not be asked
/// (a turn could not have been stored either; the caller answers 503).
#[derive(Debug)]
pub enum LimitError {
    Refused(Refused),
    Ledger(StoreError),
}

impl LimitError {
    /// The refusal, if a limit refused (a test's view).
    pub fn refused(self) -> Refused {
        match self {
            LimitError::Refused(r) => r,
            LimitError::Ledger(e) => panic!("not a refusal: {e}"),
        }
    }
}

impl From<Refused> for LimitError {
    fn from(r: Refused) -> Self {
        LimitError::Refused(r)
    }
}

/// Counts shared by every gateway replica (the PostgreSQL store). Each call is one
/// serialized decision per bucket on the database, under the database's clock.
#[async_trait::async_trait]
pub trait LimitLedger: Send + Sync {
    /// With `prompt_tokens` (a turn): checks open streams, turns, prompt and output
    /// tokens of `bucket` under `config`, and only if all pass charges one turn and the
    /// prompt. Without (a follower): checks open streams only. Either way an admitted
    /// request opens a stream held by this replica; returns its ID.
    async fn admit(&self, bucket: &str, config: &LimitConfig, prompt_tokens: Option<usize>) -> Result<Result<String, Refused>, StoreError>;
    /// Closes stream `id` (opened by [`Self::admit`] on this replica).
    async fn close_stream(&self, id: &str) -> Result<(), StoreError>;
    /// Charges `tokens` of output to `bucket` (possibly into debt).
    async fn charge_output(&self, bucket: &str, config: &LimitConfig, tokens: usize) -> Result<(), StoreError>;
    /// One conversation create or list of `owner` at `per_minute`; refused ones cost nothing.
    async fn admit_request(&self, owner: &str, per_minute: f64) -> Result<Result<(), Refused>, StoreError>;
}

/// Limits of every user.
pub struct Limiter {
    config: LimitConfig,
    /// Local counts, and the configuration each user last ran under (followers take it).
    users: Mutex<HashMap<String, UserState>>,
    /// Conversation creates and lists, per owner.
    requests: Mutex<HashMap<String, Bucket>>,
    /// Where the counts live when replicas share them.
    ledger: Option<Arc<dyn LimitLedger>>,
}

/// An admitted stream; dropping it closes the stream's slot.
pub struct Permit {
    slot: Slot,
}

enum Slot {
    Local { limiter: Arc<Limiter>, user: String },
    Shared { ledger: Arc<dyn LimitLedger>, stream: String, bucket: String, config: LimitConfig },
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

/// Runs `work` on the current runtime, logging a failure: a permit's charge and release
/// happen in `Drop` and after a reply, where nobody could wait for them.
fn spawn_ledger_call<F>(what: &'static str, work: F)
where
    F: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn(async move {
                if let Err(e) = work.await {
                    tracing::warn!(error = %e, "limit ledger: {what} failed");
                }
            });
        }
        // Only outside a runtime (never in the gateway); the stream's row then counts
        // until this replica's heartbeat stops.
        Err(_) => tracing::warn!("limit ledger: {what} dropped outside a runtime"),
    }
}

impl Permit {
    /// Charges the reply's output tokens.
    pub fn charge_output(&self, tokens: usize) {
        match &self.slot {
            Slot::Local { limiter, user } => {
                let mut users = limiter.users.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(u) = users.get_mut(user) {
                    u.output.charge(tokens as f64, Instant::now());
                }
            }
            Slot::Shared { ledger, bucket, config, .. } => {
                let (ledger, bucket, config) = (ledger.clone(), bucket.clone(), config.clone());
                spawn_ledger_call("charge output", async move { ledger.charge_output(&bucket, &config, tokens).await });
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        match &self.slot {
            Slot::Local { limiter, user } => {
                let mut users = limiter.users.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(u) = users.get_mut(user) {
                    u.open = u.open.saturating_sub(1);
                }
            }
            Slot::Shared { ledger, stream, .. } => {
                let (ledger, stream) = (ledger.clone(), stream.clone());
                spawn_ledger_call("close stream", async move { ledger.close_stream(&stream).await });
            }
        }
    }
}

impl Limiter {
    /// Counts kept in this process (one replica).
    pub fn new(config: LimitConfig) -> Arc<Self> {
        Arc::new(Limiter { config, users: Mutex::new(HashMap::new()), requests: Mutex::new(HashMap::new()), ledger: None })
    }

    /// Counts kept in `ledger`, shared with every other replica that uses it.
    pub fn shared(config: LimitConfig, ledger: Arc<dyn LimitLedger>) -> Arc<Self> {
        Arc::new(Limiter { config, users: Mutex::new(HashMap::new()), requests: Mutex::new(HashMap::new()), ledger: Some(ledger) })
    }

    /// Whether the counts are shared between replicas.
    pub fn is_shared(&self) -> bool {
        self.ledger.is_some()
    }

    /// Admits one conversation create or list of `owner`, or refuses it with
    /// `conversation_requests_per_minute`; a refused request is not counted.
    pub async fn admit_request(&self, owner: &str) -> Result<(), LimitError> {
        let per_minute = self.config.conversation_requests_per_minute;
        if let Some(ledger) = &self.ledger {
            return Ok(ledger.admit_request(owner, per_minute).await.map_err(LimitError::Ledger)??);
        }
        let now = Instant::now();
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        // Buckets that have refilled carry nothing: swept so idle owners cost no memory.
        if requests.len() >= 4096 {
            requests.retain(|_, b| !b.wait_for(b.capacity, now).is_zero());
        }
        let b = requests.entry(owner.to_string()).or_insert_with(|| Bucket::new(per_minute, REQUESTS_PER, now));
        let w = b.wait_for(1.0, now);
        if !w.is_zero() {
            return Err(Refused { limit: "conversation_requests_per_minute", retry_after: w }.into());
        }
        b.charge(1.0, now);
        Ok(())
    }

    /// Admits one turn with `prompt_tokens`, or says which limit refuses it.
    pub async fn admit(self: &Arc<Self>, user: &str, prompt_tokens: usize) -> Result<Permit, LimitError> {
        self.admit_with(user, prompt_tokens, None).await
    }

    /// [`Self::admit`] under the user's overrides.
    pub async fn admit_with(self: &Arc<Self>, user: &str, prompt_tokens: usize, overrides: Option<&LimitOverrides>) -> Result<Permit, LimitError> {
        let c = self.config.with(overrides);
        if let Some(ledger) = &self.ledger {
            self.remember_config(user, &c);
            let stream = ledger.admit(user, &c, Some(prompt_tokens)).await.map_err(LimitError::Ledger)??;
            return Ok(Permit { slot: Slot::Shared { ledger: ledger.clone(), stream, bucket: user.to_string(), config: c } });
        }
        Ok(self.admit_local(user, prompt_tokens, &c)?)
    }

    fn admit_local(self: &Arc<Self>, user: &str, prompt_tokens: usize, c: &LimitConfig) -> Result<Permit, Refused> {
        let now = Instant::now();
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let u = users.entry(user.to_string()).or_insert_with(|| UserState::new(c.clone(), now));
        if u.config != *c {
            u.turns.reconfigure(c.turns_per_minute, TURNS_PER, now);
            u.prompt.reconfigure(c.prompt_tokens_per_hour, PROMPT_PER, now);
            u.output.reconfigure(c.output_tokens_per_hour, OUTPUT_PER, now);
            u.config = c.clone();
        }
        if u.open >= c.open_streams {
            return Err(Refused { limit: "open_streams", retry_after: Duration::from_secs(1) });
        }
        let w = u.turns.wait_for(1.0, now);
        if !w.is_zero() {
            return Err(Refused { limit: "turns_per_minute", retry_after: w });
        }
        let w = u.prompt.wait_for(prompt_tokens as f64, now);
        if !w.is_zero() {
            return Err(Refused { limit: "prompt_tokens_per_hour", retry_after: w });
        }
        let w = u.output.wait_for(1.0, now);
        if !w.is_zero() {
            return Err(Refused { limit: "output_tokens_per_hour", retry_after: w });
        }
        u.turns.charge(1.0, now);
        u.prompt.charge(prompt_tokens as f64, now);
        u.open += 1;
        Ok(Permit { slot: Slot::Local { limiter: self.clone(), user: user.to_string() } })
    }

    /// Notes the configuration `user` runs under (what a follower's slot is checked
    /// against), without counting anything.
    fn remember_config(&self, user: &str, c: &LimitConfig) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        match users.get_mut(user) {
            Some(u) => u.config = c.clone(),
            None => {
                users.insert(user.to_string(), UserState::new(c.clone(), Instant::now()));
            }
        }
    }

    /// A stream that follows a turn already running (a retry or a resume attaching to
    /// it): it takes one of the user's open-stream slots, as the turn itself does, so a
    /// user cannot hold more connections than the limit by attaching many followers.
    pub async fn attach(self: &Arc<Self>, user: &str) -> Result<Permit, LimitError> {
        if let Some(ledger) = &self.ledger {
            // The configuration the user's last turn here ran under, else the default.
            let c = {
                let users = self.users.lock().unwrap_or_else(|p| p.into_inner());
                users.get(user).map_or_else(|| self.config.clone(), |u| u.config.clone())
            };
            let stream = ledger.admit(user, &c, None).await.map_err(LimitError::Ledger)??;
            return Ok(Permit { slot: Slot::Shared { ledger: ledger.clone(), stream, bucket: user.to_string(), config: c } });
        }
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        // No turn of this user was ever admitted here: nothing to attach to, no slot
        // counted yet; the default applies.
        let u = users.entry(user.to_string()).or_insert_with(|| UserState::new(self.config.clone(), Instant::now()));
        if u.open >= u.config.open_streams {
            return Err(Refused { limit: "open_streams", retry_after: Duration::from_secs(1) }.into());
        }
        u.open += 1;
        Ok(Permit { slot: Slot::Local { limiter: self.clone(), user: user.to_string() } })
    }
}

/// Whose limit overrides a cache entry holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LimitSubject {
    User(String),
    /// The stored hash of an API key.
    Key(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LimitConfig {
        LimitConfig {
            turns_per_minute: 2.0,
            open_streams: 1,
            prompt_tokens_per_hour: 100.0,
            output_tokens_per_hour: 50.0,
            conversation_requests_per_minute: 3.0,
        }
    }

    #[tokio::test]
    async fn followers_take_open_stream_slots() {
        let l = Limiter::new(LimitConfig { open_streams: 2, ..cfg() });
        let turn = l.admit("a", 10).await.unwrap();
        let follower = l.attach("a").await.unwrap();
        assert_eq!(l.attach("a").await.unwrap_err().refused().limit, "open_streams");
        assert_eq!(l.admit("a", 10).await.unwrap_err().refused().limit, "open_streams");
        drop(follower);
        let again = l.attach("a").await.unwrap();
        drop((turn, again));
        // A user with no turn here yet still gets at most the limit.
        let (x, y) = (l.attach("b").await.unwrap(), l.attach("b").await.unwrap());
        assert!(l.attach("b").await.is_err());
        drop((x, y));
    }

    #[tokio::test]
    async fn conversation_requests_are_limited_per_owner() {
        let l = Limiter::new(cfg());
        for _ in 0..3 {
            l.admit_request("a").await.unwrap();
        }
        let r = l.admit_request("a").await.unwrap_err().refused();
        assert_eq!(r.limit, "conversation_requests_per_minute");
        assert!(r.retry_after > Duration::from_secs(15) && r.retry_after <= Duration::from_secs(20), "{r:?}");
        l.admit_request("b").await.expect("per owner");
        // Turns keep their own buckets.
        drop(l.admit("a", 1).await.unwrap());
    }

    #[test]
    fn bucket_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60.0, Duration::from_secs(60), t0);
        b.charge(60.0, t0);
        assert_eq!(b.wait_for(1.0, t0), Duration::from_secs(1));
        assert!(b.wait_for(1.0, t0 + Duration::from_secs(1)).is_zero());
    }

    #[tokio::test]
    async fn each_limit_refuses_with_retry_after() {
        let l = Limiter::new(cfg());
        let p = l.admit("a", 10).await.unwrap();
        assert_eq!(l.admit("a", 10).await.unwrap_err().refused().limit, "open_streams");
        drop(p);
        drop(l.admit("a", 10).await.unwrap());
        let r = l.admit("a", 10).await.unwrap_err().refused();
        assert_eq!(r.limit, "turns_per_minute");
        assert!(r.retry_after > Duration::from_secs(25) && r.retry_after <= Duration::from_secs(30));
        let l = Limiter::new(cfg());
        assert_eq!(l.admit("b", 101).await.unwrap_err().refused().limit, "prompt_tokens_per_hour");
        let p = l.admit("b", 1).await.unwrap();
        p.charge_output(80);
        drop(p);
        assert_eq!(l.admit("b", 1).await.unwrap_err().refused().limit, "output_tokens_per_hour");
        assert!(l.admit("other", 1).await.is_ok(), "limits are per user");
    }

    #[tokio::test]
    async fn overrides_replace_the_defaults() {
        let l = Limiter::new(cfg());
        let o = LimitOverrides { open_streams: Some(3), ..Default::default() };
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(l.admit_with("vip", 1, Some(&o)).await.unwrap());
        }
        assert_eq!(l.admit_with("vip", 1, Some(&o)).await.unwrap_err().refused().limit, "turns_per_minute");
        drop(held);
        let o = LimitOverrides { turns_per_minute: Some(120.0), ..Default::default() };
        let r = l.admit_with("vip", 1, Some(&o)).await.unwrap_err().refused();
        assert!(r.retry_after <= Duration::from_millis(500), "the new rate applies at once: {r:?}");
    }
}
