//! The short-lived cache of API key hash -> user that spares a request its store read.
//! Plain data: the `auth` extractor reads and fills it; the gateway's state owns it.
//! Requests without a valid key are limited in [`crate::lookup_limits`].

/// The stored hash of the API key a request came with (its limits may differ
/// from its user's).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub String);

/// A short-lived cache of key hash -> user, so that a request costs no
/// database read; revocation takes effect within the TTL.
pub struct KeyCache {
    ttl: std::time::Duration,
    map: std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
}

impl KeyCache {
    pub fn new(ttl: std::time::Duration) -> Self {
        KeyCache { ttl, map: Default::default() }
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
