//! Per-user limits with token buckets: turns per minute, open streams,
//! prompt tokens per hour, output tokens per hour. A pure synchronous core
//! ([`Bucket`]) under one mutex; admission checks every limit before it
//! charges any, so a refused request costs nothing. Output tokens are
//! charged after the reply (the bucket may go into debt, which then blocks
//! the next turn until it refills). Conversation creates and lists have a
//! bucket of their own per owner ([`Limiter::admit_request`]): they cost no model
//! work, but without one a key could fill the store or page through it for free.
//!
//! Every count lives in this process: with several gateway replicas behind a
//! balancer, a user gets up to each limit on each replica (see docs/SECURITY.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
        if self.level >= n {
            Duration::ZERO
        } else if self.rate <= 0.0 {
            Duration::from_secs(3600)
        } else {
            Duration::from_secs_f64((n - self.level) / self.rate)
        }
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

/// A refusal: which limit and when to retry.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub limit: &'static str,
    pub retry_after: Duration,
}

/// Limits of every user.
pub struct Limiter {
    config: LimitConfig,
    users: Mutex<HashMap<String, UserState>>,
    /// Conversation creates and lists, per owner.
    requests: Mutex<HashMap<String, Bucket>>,
}

/// An admitted stream; dropping it closes the stream's slot.
pub struct Permit {
    limiter: Arc<Limiter>,
    user: String,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

impl Permit {
    /// Charges the reply's output tokens.
    pub fn charge_output(&self, tokens: usize) {
        let mut users = self.limiter.users.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = users.get_mut(&self.user) {
            u.output.charge(tokens as f64, Instant::now());
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut users = self.limiter.users.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = users.get_mut(&self.user) {
            u.open = u.open.saturating_sub(1);
        }
    }
}

impl Limiter {
    pub fn new(config: LimitConfig) -> Arc<Self> {
        Arc::new(Limiter { config, users: Mutex::new(HashMap::new()), requests: Mutex::new(HashMap::new()) })
    }

    /// Admits one conversation create or list of `owner`, or refuses it with
    /// `conversation_requests_per_minute`; a refused request is not counted.
    pub fn admit_request(&self, owner: &str) -> Result<(), Refused> {
        let now = Instant::now();
        let per_minute = self.config.conversation_requests_per_minute;
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        // Buckets that have refilled carry nothing: swept so idle owners cost no memory.
        if requests.len() >= 4096 {
            requests.retain(|_, b| !b.wait_for(b.capacity, now).is_zero());
        }
        let b = requests.entry(owner.to_string()).or_insert_with(|| Bucket::new(per_minute, Duration::from_secs(60), now));
        let w = b.wait_for(1.0, now);
        if !w.is_zero() {
            return Err(Refused { limit: "conversation_requests_per_minute", retry_after: w });
        }
        b.charge(1.0, now);
        Ok(())
    }

    /// Admits one turn with `prompt_tokens`, or says which limit refuses it.
    pub fn admit(self: &Arc<Self>, user: &str, prompt_tokens: usize) -> Result<Permit, Refused> {
        self.admit_with(user, prompt_tokens, None)
    }

    /// [`Self::admit`] under the user's overrides.
    pub fn admit_with(self: &Arc<Self>, user: &str, prompt_tokens: usize, overrides: Option<&LimitOverrides>) -> Result<Permit, Refused> {
        let now = Instant::now();
        let c = &self.config.with(overrides);
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let u = users.entry(user.to_string()).or_insert_with(|| UserState {
            config: c.clone(),
            turns: Bucket::new(c.turns_per_minute, Duration::from_secs(60), now),
            prompt: Bucket::new(c.prompt_tokens_per_hour, Duration::from_secs(3600), now),
            output: Bucket::new(c.output_tokens_per_hour, Duration::from_secs(3600), now),
            open: 0,
        });
        if u.config != *c {
            u.turns.reconfigure(c.turns_per_minute, Duration::from_secs(60), now);
            u.prompt.reconfigure(c.prompt_tokens_per_hour, Duration::from_secs(3600), now);
            u.output.reconfigure(c.output_tokens_per_hour, Duration::from_secs(3600), now);
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
        Ok(Permit { limiter: self.clone(), user: user.to_string() })
    }

    /// A stream that follows a turn already running (a retry or a resume attaching to
    /// it): it takes one of the user's open-stream slots, as the turn itself does, so a
    /// user cannot hold more connections than the limit by attaching many followers.
    pub fn attach(self: &Arc<Self>, user: &str) -> Result<Permit, Refused> {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let Some(u) = users.get_mut(user) else {
            // No turn of this user was ever admitted here: nothing to attach to, no slot
            // counted yet; the default applies.
            if self.config.open_streams == 0 {
                return Err(Refused { limit: "open_streams", retry_after: Duration::from_secs(1) });
            }
            drop(users);
            return self.admit_slot_only(user);
        };
        if u.open >= u.config.open_streams {
            return Err(Refused { limit: "open_streams", retry_after: Duration::from_secs(1) });
        }
        u.open += 1;
        Ok(Permit { limiter: self.clone(), user: user.to_string() })
    }

    fn admit_slot_only(self: &Arc<Self>, user: &str) -> Result<Permit, Refused> {
        let now = Instant::now();
        let c = self.config.clone();
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let u = users.entry(user.to_string()).or_insert_with(|| UserState {
            turns: Bucket::new(c.turns_per_minute, Duration::from_secs(60), now),
            prompt: Bucket::new(c.prompt_tokens_per_hour, Duration::from_secs(3600), now),
            output: Bucket::new(c.output_tokens_per_hour, Duration::from_secs(3600), now),
            config: c,
            open: 0,
        });
        if u.open >= u.config.open_streams {
            return Err(Refused { limit: "open_streams", retry_after: Duration::from_secs(1) });
        }
        u.open += 1;
        Ok(Permit { limiter: self.clone(), user: user.to_string() })
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

    #[test]
    fn followers_take_open_stream_slots() {
        let l = Limiter::new(LimitConfig { open_streams: 2, ..cfg() });
        let turn = l.admit("a", 10).unwrap();
        let follower = l.attach("a").unwrap();
        assert_eq!(l.attach("a").unwrap_err().limit, "open_streams");
        assert_eq!(l.admit("a", 10).unwrap_err().limit, "open_streams");
        drop(follower);
        let again = l.attach("a").unwrap();
        drop((turn, again));
        // A user with no turn here yet still gets at most the limit.
        let (x, y) = (l.attach("b").unwrap(), l.attach("b").unwrap());
        assert!(l.attach("b").is_err());
        drop((x, y));
    }

    #[test]
    fn conversation_requests_are_limited_per_owner() {
        let l = Limiter::new(cfg());
        for _ in 0..3 {
            l.admit_request("a").unwrap();
        }
        let r = l.admit_request("a").unwrap_err();
        assert_eq!(r.limit, "conversation_requests_per_minute");
        assert!(r.retry_after > Duration::from_secs(15) && r.retry_after <= Duration::from_secs(20), "{r:?}");
        l.admit_request("b").expect("per owner");
        // Turns keep their own buckets.
        drop(l.admit("a", 1).unwrap());
    }

    #[test]
    fn bucket_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60.0, Duration::from_secs(60), t0);
        b.charge(60.0, t0);
        assert_eq!(b.wait_for(1.0, t0), Duration::from_secs(1));
        assert!(b.wait_for(1.0, t0 + Duration::from_secs(1)).is_zero());
    }

    #[test]
    fn each_limit_refuses_with_retry_after() {
        let l = Limiter::new(cfg());
        let p = l.admit("a", 10).unwrap();
        assert_eq!(l.admit("a", 10).unwrap_err().limit, "open_streams");
        drop(p);
        drop(l.admit("a", 10).unwrap());
        let r = l.admit("a", 10).unwrap_err();
        assert_eq!(r.limit, "turns_per_minute");
        assert!(r.retry_after > Duration::from_secs(25) && r.retry_after <= Duration::from_secs(30));
        let l = Limiter::new(cfg());
        assert_eq!(l.admit("b", 101).unwrap_err().limit, "prompt_tokens_per_hour");
        let p = l.admit("b", 1).unwrap();
        p.charge_output(80);
        drop(p);
        assert_eq!(l.admit("b", 1).unwrap_err().limit, "output_tokens_per_hour");
        assert!(l.admit("other", 1).is_ok(), "limits are per user");
    }

    #[test]
    fn overrides_replace_the_defaults() {
        let l = Limiter::new(cfg());
        let o = LimitOverrides { open_streams: Some(3), ..Default::default() };
        let held: Vec<_> = (0..2).map(|_| l.admit_with("vip", 1, Some(&o)).unwrap()).collect();
        assert_eq!(l.admit_with("vip", 1, Some(&o)).unwrap_err().limit, "turns_per_minute");
        drop(held);
        let o = LimitOverrides { turns_per_minute: Some(120.0), ..Default::default() };
        let r = l.admit_with("vip", 1, Some(&o)).unwrap_err();
        assert!(r.retry_after <= Duration::from_millis(500), "the new rate applies at once: {r:?}");
    }
}
