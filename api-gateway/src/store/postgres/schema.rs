//! The PostgreSQL store's versioned schema: [`MIGRATIONS`], recorded in
//! `baton_schema_migrations` and applied at connect under a transaction-scoped advisory
//! lock, so replicas starting together migrate once and a gateway older than the
//! database refuses to start.

use super::*;

/// The schema, one entry per version; never edit a released entry, append.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE TABLE api_keys (
    key_hash TEXT PRIMARY KEY,
    prefix TEXT COLLATE "C" NOT NULL,
    user_id TEXT NOT NULL,
    label TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    revoked BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE TABLE conversations (
    id TEXT COLLATE "C" PRIMARY KEY,
    owner TEXT NOT NULL,
    title TEXT NOT NULL,
    system_prompt_version BIGINT NOT NULL,
    summary TEXT,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX conversations_owner ON conversations (owner, updated_at);
CREATE INDEX conversations_updated ON conversations (updated_at);
CREATE TABLE turns (
    conversation TEXT COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    turn_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL,
    request_hash TEXT NOT NULL,
    user_text TEXT NOT NULL,
    reply_text TEXT NOT NULL,
    prompt_ids BYTEA NOT NULL,
    output_ids BYTEA NOT NULL,
    system_prompt_version BIGINT NOT NULL,
    state TEXT NOT NULL,
    finish_reason TEXT,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    cached_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    instance TEXT,
    PRIMARY KEY (conversation, turn_id)
);
CREATE INDEX turns_streaming ON turns (instance) WHERE state = 'streaming';
CREATE TABLE token_log (
    conversation TEXT COLLATE "C" NOT NULL,
    turn_id TEXT COLLATE "C" NOT NULL,
    idx BIGINT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (conversation, turn_id, idx),
    FOREIGN KEY (conversation, turn_id) REFERENCES turns (conversation, turn_id) ON DELETE CASCADE
);
CREATE TABLE user_limits (
    user_id TEXT PRIMARY KEY,
    limits TEXT NOT NULL
);
CREATE TABLE usage (
    user_id TEXT PRIMARY KEY,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL
);
CREATE TABLE gateway_instances (
    id TEXT PRIMARY KEY,
    seen_at BIGINT NOT NULL
);
"#,
    ),
    (
        2,
        r#"
CREATE TABLE key_limits (
    key_hash TEXT PRIMARY KEY REFERENCES api_keys(key_hash),
    limits TEXT NOT NULL
);
"#,
    ),
    (
        3,
        r#"
CREATE TABLE eviction_tombstones (
    conversation TEXT COLLATE "C" PRIMARY KEY,
    created_at BIGINT NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    next_attempt_ms BIGINT NOT NULL,
    owed TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX eviction_tombstones_due ON eviction_tombstones (next_attempt_ms);
"#,
    ),
    (
        4,
        r#"
-- Conversations that replicas forked before this version: renumber their turns
-- (order kept), and keep only the newest of several streaming turns streaming.
UPDATE turns t SET seq = r.n - 1 FROM (
    SELECT conversation, turn_id, row_number() OVER (PARTITION BY conversation ORDER BY seq, created_at, turn_id) AS n
    FROM turns WHERE conversation IN (SELECT conversation FROM turns GROUP BY conversation, seq HAVING count(*) > 1)
) r WHERE t.conversation = r.conversation AND t.turn_id = r.turn_id AND t.seq <> r.n - 1;
UPDATE turns t SET state = 'failed', finish_reason = 'interrupted' WHERE state = 'streaming'
    AND EXISTS (SELECT 1 FROM turns u WHERE u.conversation = t.conversation AND u.state = 'streaming' AND u.seq > t.seq);
CREATE UNIQUE INDEX turns_one_per_seq ON turns (conversation, seq);
CREATE UNIQUE INDEX turns_one_streaming ON turns (conversation) WHERE state = 'streaming';
"#,
    ),
    (
        5,
        r#"
-- The Conversations API's metadata (a JSON object of strings).
ALTER TABLE conversations ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
-- The Responses API's metadata of a response (a turn).
ALTER TABLE turns ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
"#,
    ),
    (
        6,
        r#"
-- Turns that were streaming on another live replica when their conversation was
-- deleted, until that replica ended them: the deletion evicts KV only after (no text).
CREATE TABLE turn_stops (
    conversation TEXT COLLATE "C" NOT NULL,
    turn_id TEXT COLLATE "C" NOT NULL,
    instance TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (conversation, turn_id)
);
"#,
    ),
    (
        7,
        r#"
-- The place of the last turn the summary covers (NULL: not reusable).
ALTER TABLE conversations ADD COLUMN summary_through BIGINT;
"#,
    ),
    (
        8,
        r#"
-- Per-user limits shared by every replica (store/postgres/limits.rs). A bucket is the
-- SHA-256 (hex) of the limiter's bucket name; `at` is the database clock (unix seconds)
-- at which `level` was true.
CREATE TABLE limit_buckets (
    bucket TEXT COLLATE "C" NOT NULL,
    kind TEXT NOT NULL,
    level DOUBLE PRECISION NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (bucket, kind)
);
-- Open streams, held by a gateway instance (counted while its heartbeat is live).
CREATE TABLE limit_streams (
    id TEXT PRIMARY KEY,
    bucket TEXT COLLATE "C" NOT NULL,
    instance TEXT NOT NULL
);
CREATE INDEX limit_streams_bucket ON limit_streams (bucket);
"#,
    ),
];

/// Key of the advisory lock that serializes migrations ("baton-gw").
const MIGRATION_LOCK: i64 = 0x6261_746f_6e2d_6777;

/// Brings the schema to the latest version; returns the version it found.
pub(super) async fn migrate(client: &mut deadpool_postgres::Client) -> StoreResult<i32> {
    let tx = client.transaction().await.map_err(db)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await.map_err(db)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS baton_schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)")
        .await
        .map_err(db)?;
    let r = tx.query_one("SELECT COALESCE(max(version), 0) FROM baton_schema_migrations", &[]).await.map_err(db)?;
    let current: i32 = get(&r, 0)?;
    let latest = MIGRATIONS.last().map_or(0, |m| m.0);
    if current > latest {
        return Err(StoreError::Db(format!(
            "the PostgreSQL schema is at version {current}, newer than this gateway's {latest}: upgrade the gateway"
        )));
    }
    for (v, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > current) {
        tx.batch_execute(sql).await.map_err(|e| StoreError::Db(format!("schema migration {v}: {}", db(e))))?;
        tx.execute("INSERT INTO baton_schema_migrations (version, applied_at) VALUES ($1, $2)", &[v, &now_unix()]).await.map_err(db)?;
    }
    tx.commit().await.map_err(db)?;
    Ok(current)
}
