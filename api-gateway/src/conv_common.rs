//! What the two stateful APIs (`conversations.rs`, Baton's own, and `responses.rs`,
//! OpenAI's Responses API over the same store) share: where a client-named ID becomes
//! an ID, the owner check that makes another user's conversation a 404, the 409 of a
//! busy conversation, a follower's open-stream slot, and deletion (stop the live turn,
//! delete every row with a tombstone, evict the KV everywhere). Its own module, so that
//! neither handler module imports the other.

use crate::error::ApiError;
use crate::live::TurnEvent;
use crate::state::App;
use crate::store::Conversation;
use baton_vocab::{ConversationId, OwnerId, TurnId};
use futures::StreamExt;

/// The API's rule for IDs a client names (narrower than an ID's own rules: these
/// also appear in URLs), checked before the ID's own `parse`.
pub fn check_id(id: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > 128 || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(ApiError::bad_request("IDs are 1 to 128 characters of [A-Za-z0-9_-]"));
    }
    Ok(())
}

/// A conversation ID from a path (or one the gateway minted): where it becomes an ID.
pub fn parse_conversation_id(id: &str) -> Result<ConversationId, ApiError> {
    check_id(id)?;
    ConversationId::parse(id).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// A turn ID from a path, a body or a header: where it becomes an ID.
pub fn parse_turn_id(id: &str) -> Result<TurnId, ApiError> {
    check_id(id)?;
    TurnId::parse(id).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// The conversation `id` names, if `owner` owns it; another owner's is a 404, exactly
/// like one that does not exist.
pub async fn owned(app: &App, owner: &OwnerId, id: &str) -> Result<(ConversationId, Conversation), ApiError> {
    let conversation = parse_conversation_id(id)?;
    let c = app.store.get_conversation(owner.as_str(), conversation.as_str()).await?.ok_or_else(|| ApiError::not_found("conversation"))?;
    Ok((conversation, c))
}

/// The 409 for a turn while another of the same conversation is admitted or streams.
pub fn busy() -> ApiError {
    ApiError { retry_after: Some(std::time::Duration::from_secs(1)), ..ApiError::conflict("another turn of this conversation is in progress") }
}

/// An open-stream slot for a client that follows a turn already running.
pub async fn follower_slot(app: &App, owner: &OwnerId) -> Result<crate::limits::Permit, ApiError> {
    Ok(app.limiter.attach(owner.as_str()).await?)
}

/// Counts one conversation create or list against `owner`'s
/// `conversation_requests_per_minute` (429 above it, like every other limit).
pub async fn admit_request(app: &App, owner: &OwnerId) -> Result<(), ApiError> {
    Ok(app.limiter.admit_request(owner.as_str()).await?)
}

/// Deletes `owner`'s conversation: stops a turn in progress and waits until it is
/// stored (so nothing is written or cached for it after the delete), deletes every row
/// leaving a tombstone, waits for its turns on other replicas to end, then evicts its KV
/// everywhere. Whether every node acknowledged
/// the eviction now (else the tombstone's retries finish it).
pub async fn delete_owned(app: &App, owner: &OwnerId, conversation: &ConversationId) -> Result<bool, ApiError> {
    let id = conversation.as_str();
    let _admission = app.admission.lock(id).await;
    if let Some(live) = app.live.get(conversation) {
        live.stop();
        let mut events = Box::pin(live.follow(app.config.resume_grace, 0));
        while let Some((_, ev)) = events.next().await {
            if matches!(ev, TurnEvent::End(_)) {
                break;
            }
        }
    }
    if !app.store.delete_conversation(owner.as_str(), id, app.evictions.first_retry_ms()).await? {
        return Err(ApiError::not_found("conversation")); // a concurrent delete won
    }
    // A turn of it streaming on another replica stops at its next write; its KV is
    // evicted only after it ended there (else the retry task evicts later: 202).
    app.evictions.wait_turns_stopped(id, crate::evictions::STOP_WAIT).await;
    let kv_evicted = app.evictions.attempt(id, 0, &[], "delete").await;
    tracing::info!(conversation = %id, kv_evicted, "conversation deleted");
    Ok(kv_evicted)
}

/// A conversation as both APIs show it: OpenAI's Conversation object (`id`, `object`,
/// `created_at`, `metadata`) with Baton's fields beside it, so one shape answers the
/// official client and Baton's own.
pub fn conversation_json(c: &Conversation) -> serde_json::Value {
    serde_json::json!({"id": c.id, "object": "conversation", "created_at": c.created_at, "metadata": c.metadata, "title": c.title,
                       "system_prompt_version": c.system_prompt_version, "updated_at": c.updated_at, "summary": c.summary})
}

/// OpenAI's metadata rule: at most 16 pairs, keys up to 64 characters, string values up
/// to 512 (`null` is none); anything else is a 400 naming `field`.
pub fn parse_metadata(field: &'static str, v: Option<&serde_json::Value>) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    use serde_json::Value;
    let refuse = || ApiError::bad_param(field, format!("{field}: at most 16 pairs, keys up to 64 characters, string values up to 512"));
    let m = match v {
        None | Some(Value::Null) => return Ok(serde_json::Map::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(ApiError::bad_param(field, format!("{field}: must be an object of strings"))),
    };
    if m.len() > 16 || m.iter().any(|(k, v)| k.chars().count() > 64 || v.as_str().is_none_or(|s| s.chars().count() > 512)) {
        return Err(refuse());
    }
    Ok(m.clone())
}
