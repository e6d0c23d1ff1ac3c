//! The short-lived cache of API key hash -> user that spares a request its store read,
//! and the per-address count of failed lookups that slows down key guessing. Plain
//! data: the `auth` extractor reads and fills it; the gateway's state owns it.

/// The stored hash of the API key a request came with (its limits may differ
/// from its user's).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub String);

/// Failed key lookups a client address may make per minute before it must wait.
pub const FAILED_LOOKUPS_PER_MINUTE: f64 = 20.0;

/// A short-lived cache of key hash -> user, so that a request costs no
/// database read; revocation takes effect within the TTL.
pub struct KeyCache {
    ttl: std::time::Duration,
    map: std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
    /// Failed lookups per client address (a token bucket each).
    failures: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, crate::limits::Bucket>>,
}

impl KeyCache {
    pub fn new(ttl: std::time::Duration) -> Self {
        KeyCache { ttl, map: Default::default(), failures: Default::default() }
    }

    /// Records a failed lookup from `address`; how long it must wait if that was one too many.
    pub(crate) fn failed(&self, address: std::net::IpAddr) -> Option<std::time::Duration> {
        let now = std::time::Instant::now();
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() > 100_000 {
            f.clear();
        }
        let b = f.entry(address).or_insert_with(|| crate::limits::Bucket::new(FAILED_LOOKUPS_PER_MINUTE, std::time::Duration::from_secs(60), now));
        b.charge(1.0, now);
        let wait = b.wait_for(0.0, now);
        (!wait.is_zero()).then(|| {
            crate::metrics::rate_limited("failed_key_lookups");
            wait
        })
    }

    /// How long `address` must still wait after too many failed lookups.
    pub(crate) fn blocked(&self, address: std::net::IpAddr) -> Option<std::time::Duration> {
        let now = std::time::Instant::now();
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let wait = f.get_mut(&address)?.wait_for(0.0, now);
        (!wait.is_zero()).then_some(wait)
    }
    pub(crate) fn get(&self, h: &str) -> Option<String> {
        let m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        m.get(h).filter(|(_, at)| at.elapsed() < self.ttl).map(|(u, _)| u.clone())
    }
    pub(crate) fn put(&self, h: String, u: String) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 100_000 {
            m.clear();
        }
        m.insert(h, (u, std::time::Instant::now()));
    }
}
