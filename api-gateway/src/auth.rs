//! API keys: generated here, stored only as SHA-256 hashes, mapped to user
//! IDs. The user of a request comes from its `Authorization: Bearer` key
//! (or `?key=` for browsers' EventSource), never from its body.

use crate::error::ApiError;
use crate::key_cache::KeyHash;
use crate::state::App;
use crate::store::{ConversationStore, StoreResult};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use rand::Rng;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use baton_vocab::OwnerId;

/// Hex SHA-256 of a key: what the store keeps.
pub fn hash_key(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// How a user appears in logs: 16 hex digits of SHA-256 over the user ID, so log lines of
/// one user can be correlated without the logs naming anyone.
pub fn user_log_id(user: &str) -> String {
    let d = Sha256::digest(format!("baton-log-user:{user}").as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// A new random key, `bk-` plus 40 hex digits (160 bits).
pub fn generate_key() -> String {
    let mut rng = rand::rng();
    let bytes: [u8; 20] = rng.random();
    format!("bk-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// The part of a key shown in listings.
pub fn key_prefix(key: &str) -> String {
    key.chars().take(10).collect()
}

/// Creates a key for `user` and stores its hash; returns the key (shown once).
pub async fn create_key(store: &dyn ConversationStore, user: &str, label: &str) -> StoreResult<String> {
    let key = generate_key();
    store.add_key(&hash_key(&key), &key_prefix(&key), user, label).await?;
    Ok(key)
}

/// For `baton up`: makes `key` (e.g. from `BATON_API_KEY`) valid for `user`,
/// creating it if new; without a key, creates one. Returns the key to print.
pub async fn ensure_key(store: &dyn ConversationStore, key: Option<String>, user: &str) -> StoreResult<String> {
    match key {
        Some(k) => {
            let h = hash_key(&k);
            if store.user_for_key(&h).await?.is_none() {
                store.add_key(&h, &key_prefix(&k), user, "BATON_API_KEY").await?;
            }
            Ok(k)
        }
        None => create_key(store, user, "created by baton").await,
    }
}

/// The authenticated user of a request and the key it came with. The owner is read
/// from the key's stored user here, the one place it enters the gateway as an
/// [`OwnerId`]; a client never names it.
#[derive(Clone, Debug)]
pub struct AuthUser(pub OwnerId, pub KeyHash);

/// The owner of a key's stored user. A user that is no valid owner ID (made outside
/// `baton gateway add-key`) cannot authenticate; the log says why.
fn owner_of(user: String) -> Result<OwnerId, ApiError> {
    OwnerId::parse(user).map_err(|e| {
        tracing::warn!(error = %e, "an API key's user is not a valid owner ID; refused");
        ApiError::unauthorized()
    })
}

/// The key of `Authorization: Bearer KEY`, and only there: a key in a URL ends up in
/// access logs, proxies and browser history.
fn bearer(parts: &Parts) -> Option<String> {
    let v = parts.headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok())?.trim();
    v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).map(|k| k.trim().to_string())
}

impl FromRequestParts<Arc<App>> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Self, ApiError> {
        let Some(key) = bearer(parts) else {
            // No key: the anonymous budget of the client's (real) address, which nothing a
            // keyed request needs draws on.
            let address = client_address(parts, app);
            return Err(match address.and_then(|a| app.lookups.anonymous(a)) {
                Some(wait) => refuse(wait),
                None => ApiError::unauthorized(),
            });
        };
        let h = hash_key(&key);
        if let Some(u) = app.key_cache.get(&h) {
            return Ok(AuthUser(owner_of(u)?, KeyHash(h)));
        }
        // A key that keeps failing waits before its next store read; so does a key never
        // valid here while failed lookups of everyone have spent the global budget.
        app.lookups.before_lookup(&h).map_err(refuse)?;
        match app.store.user_for_key(&h).await? {
            Some(u) => {
                app.lookups.valid(&h);
                app.key_cache.put(h.clone(), u.clone());
                Ok(AuthUser(owner_of(u)?, KeyHash(h)))
            }
            None => {
                app.lookups.failed(&h);
                Err(ApiError::unauthorized())
            }
        }
    }
}

/// The refusal of a request the lookup limits hold back (a 429 with Retry-After).
fn refuse(wait: crate::lookup_limits::Wait) -> ApiError {
    crate::metrics::rate_limited(wait.limit());
    ApiError::rate_limited(wait.limit(), wait.retry_after())
}

/// The client's address: the connection's peer, or behind a trusted proxy the client it
/// names ([`crate::proxy`]).
pub fn client_address(parts: &Parts, app: &App) -> Option<std::net::IpAddr> {
    let peer = parts.extensions.get::<crate::listen::ClientAddr>()?.0;
    Some(app.config.trusted_proxies.client_address(peer, &parts.headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_hashed() {
        let (a, b) = (generate_key(), generate_key());
        assert_ne!(a, b);
        assert!(a.starts_with("bk-") && a.len() == 43);
        assert_eq!(hash_key("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
