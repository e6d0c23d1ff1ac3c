//! Limits on requests that present no valid API key, shaped so that they can never keep a
//! valid key out. Counting failed lookups per client address (as before issue #39) let
//! anyone behind the same NAT, load balancer or ingress as a user lock that user out with
//! about one anonymous request a second. Now:
//!
//! - a request with **no key** draws on the anonymous budget of its client address
//!   ([`ANONYMOUS_PER_MINUTE`]; past it the 401 becomes a 429). Nothing a keyed request
//!   needs is charged.
//! - a presented key whose lookup **failed** is charged to its own bucket, keyed by a
//!   64-bit prefix of the key's SHA-256 ([`FAILED_PER_KEY_PER_MINUTE`]): the same wrong
//!   key presented again waits without a store read; every other key is untouched, and
//!   nobody can aim at a valid key's bucket without knowing the key.
//! - failed lookups together draw on one **global** budget ([`GLOBAL_FAILED_PER_SECOND`],
//!   burst [`GLOBAL_FAILED_BURST`]), so a flood of distinct wrong keys costs the store a
//!   bounded rate. While it is spent, a key this replica has never seen valid waits (a
//!   429 with a Retry-After under a second); a key seen valid here within
//!   [`KNOWN_VALID_FOR`] is always looked up (the store still decides, so revocation
//!   holds), and a key in the key cache is never looked up at all.
//!
//! Plain data under mutexes: the `auth` extractor asks and reports; the state owns it.

use crate::limits::Bucket;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Requests without a key one client address may send per minute (each gets a 401)
/// before they get 429s instead.
pub const ANONYMOUS_PER_MINUTE: f64 = 60.0;
/// Failed lookups of one presented key per minute before that key waits.
pub const FAILED_PER_KEY_PER_MINUTE: f64 = 10.0;
/// Failed lookups per second, all keys together, in the long run.
pub const GLOBAL_FAILED_PER_SECOND: f64 = 100.0;
/// Failed lookups the global budget absorbs at once.
pub const GLOBAL_FAILED_BURST: f64 = 2000.0;
/// How long a key that was valid here counts as known (looked up even while the
/// global budget is spent).
pub const KNOWN_VALID_FOR: Duration = Duration::from_secs(24 * 3600);
/// Entries a per-address or per-key map holds before it is pruned.
const MAX_ENTRIES: usize = 100_000;
/// Known-valid keys remembered (8 bytes of hash and an instant each).
const MAX_KNOWN_VALID: usize = 1_000_000;

/// Why a request is refused before (or instead of) its key lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// The client address sent too many requests without a key.
    Anonymous(Duration),
    /// This very key failed too often.
    Key(Duration),
    /// Failed lookups of all clients spent the global budget, and this key was never
    /// valid here.
    Global(Duration),
}

impl Wait {
    /// The limit's name (the `limit` label of `baton_gateway_rate_limited_total`, and the
    /// error message).
    pub fn limit(&self) -> &'static str {
        match self {
            Wait::Anonymous(_) => "anonymous_requests",
            Wait::Key(_) => "failed_key_lookups",
            Wait::Global(_) => "failed_key_lookups_global",
        }
    }

    pub fn retry_after(&self) -> Duration {
        match *self {
            Wait::Anonymous(d) | Wait::Key(d) | Wait::Global(d) => d,
        }
    }
}

/// The 64-bit prefix of a key's hex SHA-256 that its buckets are keyed by.
fn prefix(key_hash: &str) -> u64 {
    key_hash.get(..16).and_then(|p| u64::from_str_radix(p, 16).ok()).unwrap_or(0)
}

/// The budgets of requests without a valid key (see the module docs).
pub struct LookupLimits {
    anonymous: Mutex<HashMap<IpAddr, Bucket>>,
    by_key: Mutex<HashMap<u64, Bucket>>,
    global: Mutex<Bucket>,
    known_valid: Mutex<HashMap<u64, Instant>>,
}

impl Default for LookupLimits {
    fn default() -> Self {
        let now = Instant::now();
        let per = Duration::from_secs_f64(GLOBAL_FAILED_BURST / GLOBAL_FAILED_PER_SECOND);
        LookupLimits {
            anonymous: Default::default(),
            by_key: Default::default(),
            global: Mutex::new(Bucket::new(GLOBAL_FAILED_BURST, per, now)),
            known_valid: Default::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LookupLimits {
    /// Charges a request without a key from `address`; how long it must wait if that was
    /// one too many (it gets a 401 otherwise).
    pub fn anonymous(&self, address: IpAddr) -> Option<Wait> {
        let now = Instant::now();
        let mut m = lock(&self.anonymous);
        if m.len() > MAX_ENTRIES {
            m.retain(|_, b| b.wait_for(0.0, now) > Duration::ZERO);
            if m.len() > MAX_ENTRIES {
                m.clear();
            }
        }
        let b = m.entry(address).or_insert_with(|| Bucket::new(ANONYMOUS_PER_MINUTE, Duration::from_secs(60), now));
        b.charge(1.0, now);
        let wait = b.wait_for(0.0, now);
        (!wait.is_zero()).then_some(Wait::Anonymous(wait))
    }

    /// Whether the key with hash `key_hash` (not in the key cache) may be looked up now.
    pub fn before_lookup(&self, key_hash: &str) -> Result<(), Wait> {
        let now = Instant::now();
        let p = prefix(key_hash);
        if lock(&self.known_valid).get(&p).is_some_and(|at| now.saturating_duration_since(*at) < KNOWN_VALID_FOR) {
            return Ok(());
        }
        if let Some(b) = lock(&self.by_key).get_mut(&p) {
            let wait = b.wait_for(1.0, now);
            if !wait.is_zero() {
                return Err(Wait::Key(wait));
            }
        }
        let wait = lock(&self.global).wait_for(1.0, now);
        if !wait.is_zero() {
            return Err(Wait::Global(wait));
        }
        Ok(())
    }

    /// The lookup of `key_hash` found no valid key: charged to the key and the global budget.
    pub fn failed(&self, key_hash: &str) {
        let now = Instant::now();
        let p = prefix(key_hash);
        lock(&self.known_valid).remove(&p);
        {
            let mut m = lock(&self.by_key);
            if m.len() > MAX_ENTRIES {
                m.retain(|_, b| b.wait_for(FAILED_PER_KEY_PER_MINUTE, now) > Duration::ZERO);
                if m.len() > MAX_ENTRIES {
                    m.clear();
                }
            }
            let b = m.entry(p).or_insert_with(|| Bucket::new(FAILED_PER_KEY_PER_MINUTE, Duration::from_secs(60), now));
            b.charge(1.0, now);
        }
        lock(&self.global).charge(1.0, now);
    }

    /// The lookup of `key_hash` found a valid key: it is known here from now on.
    pub fn valid(&self, key_hash: &str) {
        let now = Instant::now();
        let mut m = lock(&self.known_valid);
        if m.len() >= MAX_KNOWN_VALID {
            m.retain(|_, at| now.saturating_duration_since(*at) < KNOWN_VALID_FOR);
            if m.len() >= MAX_KNOWN_VALID {
                m.clear();
            }
        }
        m.insert(prefix(key_hash), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::hash_key;

    #[test]
    fn a_wrong_key_waits_alone() {
        let l = LookupLimits::default();
        let bad = hash_key("bk-wrong");
        for _ in 0..FAILED_PER_KEY_PER_MINUTE as usize {
            assert_eq!(l.before_lookup(&bad), Ok(()));
            l.failed(&bad);
        }
        assert!(matches!(l.before_lookup(&bad), Err(Wait::Key(_))));
        // Any other key, never seen before, is still looked up.
        assert_eq!(l.before_lookup(&hash_key("bk-fresh")), Ok(()));
    }

    #[test]
    fn anonymous_requests_never_touch_keyed_ones() {
        let l = LookupLimits::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let refused = (0..1000).filter(|_| l.anonymous(a).is_some()).count();
        assert!(refused >= 1000 - ANONYMOUS_PER_MINUTE as usize - 1, "{refused}");
        assert_eq!(l.anonymous("10.0.0.2".parse().unwrap()), None, "per address");
        assert_eq!(l.before_lookup(&hash_key("bk-fresh")), Ok(()));
    }

    #[test]
    fn a_spent_global_budget_keeps_known_keys_in() {
        let l = LookupLimits::default();
        let known = hash_key("bk-known");
        l.valid(&known);
        for i in 0..(GLOBAL_FAILED_BURST as usize + 10) {
            l.failed(&hash_key(&format!("bk-guess-{i}")));
        }
        match l.before_lookup(&hash_key("bk-never-seen")) {
            Err(Wait::Global(d)) => assert!(d <= Duration::from_secs(1), "{d:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.before_lookup(&known), Ok(()), "a key valid here is always looked up");
        // A revoked key loses that standing at its first failed lookup.
        l.failed(&known);
        assert!(l.before_lookup(&known).is_err());
    }
}
