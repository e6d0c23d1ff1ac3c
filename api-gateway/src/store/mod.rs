//! The conversation store: API keys (hashed), conversations, turns with their
//! exact prompt and output token IDs, the durable token log that SSE resume
//! replays, and per-user metering counts. One trait, [`ConversationStore`],
//! with SQLite as the embedded default and PostgreSQL for several gateway
//! replicas ([`open`] picks one from the `--db` value); [`conformance`] is the
//! test suite every implementation must pass.
//!
//! Invariants: a turn ID is unique within its conversation (the idempotency
//! key); every row of a conversation (turns, token log, summary) goes with
//! it on delete, and the same transaction leaves a [`Tombstone`] (the ID
//! only, no text or owner) until every node that may hold the
//! conversation's KV acknowledged its eviction; metering rows hold counts,
//! never text.
//!
//! A conversation's history is its turns in order. Most turns were generated (a user
//! message and the model's reply); a turn the client added as items (the Conversations
//! API) is marked by its `finish_reason` ([`ITEM_PAIR`], [`ITEM_USER`],
//! [`ITEM_ASSISTANT`]: which of the two messages it holds), with its token IDs encoded
//! from the text rather than generated. Either way each turn's prompt IDs continue the
//! previous turn's prompt and output IDs, so the next prompt is always an extension of
//! the stored history.

pub mod conformance;
pub mod postgres;
pub mod sqlite;
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

use serde::Serialize;
use serde_json::{Map, Value};

/// `finish_reason` of a turn the client added as a user message and a reply (nothing
/// generated).
pub const ITEM_PAIR: &str = "item";
/// `finish_reason` of a turn the client added as a user message alone.
pub const ITEM_USER: &str = "item_user";
/// `finish_reason` of a turn the client added as an assistant message alone.
pub const ITEM_ASSISTANT: &str = "item_assistant";

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(String),
    #[error("{what} not found")]
    NotFound { what: &'static str },
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The database cannot be reached (down, connection lost); retrying later may work.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

impl StoreError {
    /// Stable label for logs.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Db(_) => "store",
            StoreError::NotFound { .. } => "not_found",
            StoreError::Corrupt(_) => "store_corrupt",
            StoreError::Unavailable(_) => "store_unavailable",
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// One API key as listed (never the key itself).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ApiKeyInfo {
    /// First characters of the key, to tell keys apart.
    pub prefix: String,
    pub user: String,
    pub label: String,
    pub created_at: i64,
    pub revoked: bool,
    /// The key's own limit overrides, if any.
    pub limits: Option<crate::limits::LimitOverrides>,
}

/// A conversation's header.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Conversation {
    pub id: String,
    #[serde(skip)]
    pub owner: String,
    pub title: String,
    pub system_prompt_version: u32,
    pub created_at: i64,
    pub updated_at: i64,
    /// Summary of the turns before the latest summary boundary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The client's key-value pairs (the Conversations API's `metadata`; validated by
    /// the handler: at most 16 string pairs).
    pub metadata: Map<String, Value>,
}

/// Where a turn stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnState {
    Streaming,
    Done,
    /// Stopped by the user, a disconnect or the output check; the partial
    /// reply is kept and is part of the next prompt.
    Stopped,
    /// Failed before it finished; not part of the context; a retry with the
    /// same turn ID generates again.
    Failed,
}

impl TurnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Streaming => "streaming",
            TurnState::Done => "done",
            TurnState::Stopped => "stopped",
            TurnState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> StoreResult<Self> {
        Ok(match s {
            "streaming" => TurnState::Streaming,
            "done" => TurnState::Done,
            "stopped" => TurnState::Stopped,
            "failed" => TurnState::Failed,
            other => return Err(StoreError::Corrupt(format!("turn state {other:?}"))),
        })
    }

    /// Whether the turn is part of the conversation's context.
    pub fn in_context(self) -> bool {
        matches!(self, TurnState::Done | TurnState::Stopped)
    }
}

/// One turn: the user's message and the reply, with the exact token IDs.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Turn {
    pub conversation: String,
    pub turn_id: String,
    /// Order within the conversation, from 0.
    pub seq: i64,
    /// Hash of the request body that created it (409 on a different body).
    #[serde(skip)]
    pub request_hash: String,
    pub user_text: String,
    pub reply_text: String,
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
    #[serde(skip)]
    pub output_ids: Vec<u32>,
    pub system_prompt_version: u32,
    pub state: TurnState,
    /// Why it ended: stop, length, cancelled, content_filter, or an error kind.
    pub finish_reason: Option<String>,
    pub prompt_tokens: i64,
    pub cached_tokens: i64,
    pub completion_tokens: i64,
    pub created_at: i64,
    /// The client's key-value pairs of a response (the Responses API's `metadata`;
    /// empty for other turns).
    pub metadata: Map<String, Value>,
}

impl Turn {
    /// Whether the client added this turn as items (nothing was generated).
    pub fn added_as_items(&self) -> bool {
        matches!(self.finish_reason.as_deref(), Some(ITEM_PAIR | ITEM_USER | ITEM_ASSISTANT))
    }

    /// Whether the turn holds a user message (every turn but an assistant item alone).
    pub fn has_user_message(&self) -> bool {
        self.finish_reason.as_deref() != Some(ITEM_ASSISTANT)
    }

    /// Whether the turn holds a reply (every turn but a user item alone): else its
    /// history ends inside a user message, and the next message is framed after it.
    pub fn has_reply(&self) -> bool {
        self.finish_reason.as_deref() != Some(ITEM_USER)
    }
}

/// What [`ConversationStore::replace_turns`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replaced {
    Done,
    /// No such conversation for this owner.
    NotFound,
    /// A turn streams, or the conversation's turns changed since the caller read them.
    Busy,
}

/// One entry of a turn's durable token log: the text the client was sent
/// as SSE event `index`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LogEntry {
    pub index: i64,
    pub text: String,
}

/// How a turn ended, to store it.
#[derive(Clone, Debug)]
pub struct TurnEnd {
    pub state: TurnState,
    pub reply_text: String,
    pub output_ids: Vec<u32>,
    pub finish_reason: String,
    pub prompt_tokens: i64,
    pub cached_tokens: i64,
    pub completion_tokens: i64,
}

/// What `begin_turn` found.
#[derive(Clone, Debug)]
pub enum BeginTurn {
    /// A new row in state streaming.
    Created,
    /// The turn ID was already used; here is its row (its state says whether
    /// it is still streaming).
    Existing(Box<Turn>),
    /// Another turn of the conversation was admitted first: it is streaming
    /// on a live replica, or it took this turn's place (`seq`) in the
    /// conversation. The database enforces it, so two gateway replicas can
    /// never fork a conversation (a 409 for the client).
    Busy,
}

/// Per-user token counts (metering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UsageCounts {
    pub requests: i64,
    pub prompt_tokens: i64,
    pub cached_tokens: i64,
    pub completion_tokens: i64,
}

/// A deleted conversation whose KV some node may still hold: kept until every
/// node acknowledged the eviction ([`crate::evictions`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tombstone {
    pub conversation: String,
    /// When the conversation was deleted (unix seconds).
    pub created_at: i64,
    /// Eviction attempts so far.
    pub attempts: u32,
    /// When the next attempt is due (unix milliseconds).
    pub next_attempt_ms: i64,
    /// The nodes that had not acknowledged at the last attempt (empty before the first).
    pub owed: Vec<String>,
}

/// Durable state of the gateway. Implementations are shared behind an `Arc`.
#[async_trait::async_trait]
pub trait ConversationStore: Send + Sync + 'static {
    /// Stores a key hash for `user`. Re-adding an existing hash is a no-op.
    async fn add_key(&self, key_hash: &str, prefix: &str, user: &str, label: &str) -> StoreResult<()>;
    /// The user of a live (not revoked) key hash.
    async fn user_for_key(&self, key_hash: &str) -> StoreResult<Option<String>>;
    async fn list_keys(&self) -> StoreResult<Vec<ApiKeyInfo>>;
    /// Revokes every key whose prefix starts with `prefix`; returns how many.
    async fn revoke_keys(&self, prefix: &str) -> StoreResult<usize>;

    async fn create_conversation(&self, conv: &Conversation) -> StoreResult<()>;
    /// The conversation if it exists and belongs to `owner`.
    async fn get_conversation(&self, owner: &str, id: &str) -> StoreResult<Option<Conversation>>;
    async fn list_conversations(&self, owner: &str) -> StoreResult<Vec<Conversation>>;
    /// Stores the conversation's summary (replacing the previous one). `through`: the
    /// place (`seq`) of the last turn it covers, so the next turn summarizing at the same
    /// boundary reuses it ([`ConversationStore::summary_through`]); None for a summary
    /// copied without its turns (a fork), which is shown but never reused.
    async fn set_summary(&self, id: &str, summary: &str, through: Option<i64>) -> StoreResult<()>;
    /// The stored summary if it covers exactly the turns up to and including place
    /// `through`: made for a turn that was then refused or failed, reused by its retry
    /// instead of asking the model again. A history rewrite from a place it covers drops it.
    async fn summary_through(&self, id: &str, through: i64) -> StoreResult<Option<String>>;
    /// Replaces the conversation's metadata; false if it does not exist for `owner`.
    async fn set_metadata(&self, owner: &str, id: &str, metadata: &Map<String, Value>) -> StoreResult<bool>;
    /// Rewrites the conversation's history in one transaction: deletes its turns at
    /// places `from_seq` and later and inserts `turns` (finished rows, stored as given),
    /// only if the conversation is `owner`'s, no turn of it streams and its last place
    /// is still `last_seq` (what the caller read: a turn admitted meanwhile makes it
    /// [`Replaced::Busy`], never lost). With `evict_first_retry_ms` the same
    /// transaction leaves a tombstone due then: history the nodes hold KV of changed,
    /// so that KV is evicted everywhere like a deleted conversation's, while the
    /// conversation lives on.
    async fn replace_turns(
        &self,
        owner: &str,
        conversation: &str,
        last_seq: Option<i64>,
        from_seq: i64,
        turns: &[Turn],
        evict_first_retry_ms: Option<i64>,
    ) -> StoreResult<Replaced>;
    /// Deletes the conversation and every row that belongs to it, leaving a
    /// tombstone due at `first_retry_ms` (unix ms) in the same transaction;
    /// false (and no tombstone) if it did not exist for `owner`.
    async fn delete_conversation(&self, owner: &str, id: &str, first_retry_ms: i64) -> StoreResult<bool>;

    /// Inserts `turn` in state streaming unless its turn ID exists; a failed
    /// turn with the same ID (and body), or a streaming one whose replica
    /// died, is replaced by it with its token log (the retry generates again,
    /// nothing is stored twice). [`BeginTurn::Busy`] when another turn of the
    /// conversation streams on a live replica or already holds `turn.seq`; a
    /// dead replica's streaming turn of another ID is marked failed first.
    async fn begin_turn(&self, turn: &Turn) -> StoreResult<BeginTurn>;
    /// Whether the turn is streaming on another gateway replica that is alive
    /// (its heartbeat is fresh): a retry there attaches to the stored token
    /// log. False when it is not streaming, when this replica began it, or
    /// when its replica stopped beating (a retry takes it over). Always false
    /// for a single-process store.
    async fn turn_runs_elsewhere(&self, conversation: &str, turn_id: &str) -> StoreResult<bool>;
    /// Appends to the turn's token log while the turn is still this replica's. False when
    /// it is not (its conversation was deleted, on any replica, or another replica took
    /// the turn over): nothing was stored and the caller stops the turn.
    async fn append_log(&self, conversation: &str, turn_id: &str, entries: &[LogEntry]) -> StoreResult<bool>;
    /// Stores how the turn ended, if it is still this replica's. If it is not because
    /// its conversation was deleted while it streamed here, this acknowledges the stop
    /// the deleting replica waits for ([`ConversationStore::turns_stopping`]).
    async fn finish_turn(&self, conversation: &str, turn_id: &str, end: &TurnEnd) -> StoreResult<()>;
    /// Turns of the deleted `conversation` that were streaming on another live replica
    /// when it was deleted and have not ended there yet. A deletion evicts the
    /// conversation's KV only once this is 0, so no turn still generating elsewhere
    /// leaves KV behind the eviction. Always 0 for a single-process store (its own turns
    /// are stopped before the delete).
    async fn turns_stopping(&self, conversation: &str) -> StoreResult<u64>;
    /// Removes a turn that never started (the generator refused it).
    async fn discard_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<()>;
    async fn get_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<Option<Turn>>;
    /// Turns in order.
    async fn list_turns(&self, conversation: &str) -> StoreResult<Vec<Turn>>;
    /// Log entries with index >= `from`, in order.
    async fn read_log(&self, conversation: &str, turn_id: &str, from: i64) -> StoreResult<Vec<LogEntry>>;
    /// Marks turns left streaming by a crash as failed; returns how many.
    async fn fail_streaming_turns(&self) -> StoreResult<usize>;

    /// Deletes conversations not updated since `cutoff` (unix seconds), each
    /// leaving a tombstone due now (their KV is evicted by the retry task);
    /// returns their IDs.
    async fn delete_older_than(&self, cutoff: i64) -> StoreResult<Vec<String>>;

    /// Tombstones due at `now_ms` (unix ms), oldest due first, at most `limit`.
    async fn due_tombstones(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Tombstone>>;
    /// Records a failed attempt: the new attempt count, when the next is due and
    /// who still owes an ack. No-op if the tombstone is gone.
    async fn tombstone_attempted(&self, conversation: &str, attempts: u32, next_attempt_ms: i64, owed: &[String]) -> StoreResult<()>;
    /// Every node acknowledged: drops the tombstone; false if there was none.
    async fn clear_tombstone(&self, conversation: &str) -> StoreResult<bool>;
    /// Tombstones outstanding.
    async fn count_tombstones(&self) -> StoreResult<u64>;

    /// Sets (or with `None` clears) a user's limit overrides.
    async fn set_user_limits(&self, user: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<()>;
    async fn user_limits(&self, user: &str) -> StoreResult<Option<crate::limits::LimitOverrides>>;
    /// Sets (or with `None` clears) the limit overrides of the one live key
    /// whose prefix starts with `prefix`; returns how many keys changed (0
    /// when none or several match, so an ambiguous prefix changes nothing).
    async fn set_key_limits(&self, prefix: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<usize>;
    /// The limit overrides of a key (by hash).
    async fn key_limits(&self, key_hash: &str) -> StoreResult<Option<crate::limits::LimitOverrides>>;

    async fn add_usage(&self, user: &str, usage: UsageCounts) -> StoreResult<()>;
    async fn usage(&self, user: &str) -> StoreResult<UsageCounts>;

    /// The per-user limit counts every replica on this store shares, if it is shared
    /// (PostgreSQL); `None`: one replica's own store, whose process counts alone.
    fn limit_ledger(&self) -> Option<std::sync::Arc<dyn crate::limits::LimitLedger>> {
        None
    }
}

/// Opens the store `db` names: a `postgres://` or `postgresql://` URL
/// connects to PostgreSQL (migrating its schema); anything else is the path
/// of a SQLite file, created if missing.
pub async fn open(db: &std::path::Path) -> StoreResult<std::sync::Arc<dyn ConversationStore>> {
    open_with(db, postgres::DEFAULT_DEAD_AFTER).await
}

/// [`open`], with PostgreSQL's replica staleness: a replica whose heartbeat is
/// older than `dead_after` is dead, and its streaming turns may be taken over.
pub async fn open_with(db: &std::path::Path, dead_after: std::time::Duration) -> StoreResult<std::sync::Arc<dyn ConversationStore>> {
    match db.to_str() {
        Some(url) if postgres::is_postgres_url(url) => Ok(std::sync::Arc::new(PostgresStore::connect_with(url, dead_after).await?)),
        _ => Ok(std::sync::Arc::new(SqliteStore::open(db)?)),
    }
}

/// Seconds since the UNIX epoch.
pub fn now_unix() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Milliseconds since the UNIX epoch.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// The owed-node list as stored (a JSON array of node IDs).
fn owed_to_json(owed: &[String]) -> String {
    serde_json::to_string(owed).unwrap_or_else(|_| "[]".into())
}

/// Metadata as stored (a JSON object).
fn metadata_to_json(m: &Map<String, Value>) -> String {
    Value::Object(m.clone()).to_string()
}

fn metadata_from_json(j: &str) -> StoreResult<Map<String, Value>> {
    match serde_json::from_str(j) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(StoreError::Corrupt("conversation metadata is not a JSON object".into())),
    }
}

fn owed_from_json(j: &str) -> StoreResult<Vec<String>> {
    serde_json::from_str(j).map_err(|e| StoreError::Corrupt(format!("tombstone owed nodes: {e}")))
}
