//! PostgreSQL implementation of [`ConversationStore`], for several gateway
//! replicas sharing one database. Same tables and semantics as the SQLite
//! store: token IDs as little-endian `u32` bytes (exact round trip), turns and
//! token log cascading with their conversation, ownership in every query.
//!
//! The schema is versioned (`schema`: [`MIGRATIONS`] recorded in
//! `baton_schema_migrations`) and migrated at connect under a transaction-scoped
//! advisory lock, so replicas starting together migrate once. Connections come
//! from a pool; when the server is unreachable or a connection drops, calls
//! fail with [`StoreError::Unavailable`] (a 503 for the client) and the pool
//! reconnects on the next call.
//!
//! Replicas see each other's turns, so "turns a crash left streaming" cannot
//! mean every streaming turn: each store instance records itself on the turns
//! it begins and keeps a heartbeat row (stamped with the database's clock, so
//! replicas' clocks need not agree); [`ConversationStore::fail_streaming_turns`]
//! fails only this instance's turns and those of instances whose heartbeat
//! stopped.
//!
//! Admission across replicas (`admission`) is the database's: two unique indexes (migration
//! 4) allow one turn per place (`seq`) in a conversation and one streaming turn
//! per conversation, so of two replicas racing on one conversation exactly one
//! insert commits and the other gets [`BeginTurn::Busy`]. Constraints rather than
//! a row or advisory lock because admission spans a model call (the summary,
//! the start of the reply): a lock would pin a pooled connection, and a dead
//! replica's lock, for that long; a constraint is checked at the insert and
//! holds nothing. A dead replica's streaming turn is taken over in
//! `begin_turn`, and its late writes are fenced: the token log and the end of
//! a turn are written only by the instance recorded on the row (a turn failed
//! for a dead replica is owned by nobody).

use super::*;
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::Row;

mod admission;
mod limits;
mod schema;
pub mod tls;

use admission::{beat, heartbeat, heartbeat_every, live_instances, BeginError, HeartbeatGuard};
use schema::migrate;
use tls::TlsPolicy;
pub use schema::MIGRATIONS;

/// An instance silent for this long is dead: its streaming turns may be failed
/// or taken over (`--replica-dead-after`).
pub const DEFAULT_DEAD_AFTER: Duration = Duration::from_secs(60);

/// How long a call waits for a connection (or for one to be made).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const TURN_COLS: &str = "conversation, turn_id, seq, request_hash, user_text, reply_text, prompt_ids, output_ids, \
     system_prompt_version, state, finish_reason, prompt_tokens, cached_tokens, completion_tokens, created_at, metadata";
const CONV_COLS: &str = "id, owner, title, system_prompt_version, created_at, updated_at, summary, metadata";

/// Whether `db` (the `--db` value) names a PostgreSQL server rather than a SQLite file.
pub fn is_postgres_url(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://")
}

/// `url` with any password replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(x) => x,
        None => return url.to_string(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// Whether a driver error means the server is out of reach (not a bad query).
fn is_unavailable(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        // Class 08: connection exception; 57P01-03: shutdown / cannot connect now.
        Some(c) => {
            c.code().starts_with("08")
                || *c == SqlState::ADMIN_SHUTDOWN
                || *c == SqlState::CRASH_SHUTDOWN
                || *c == SqlState::CANNOT_CONNECT_NOW
        }
        // No server error code: an I/O or protocol failure of the connection.
        None => e.as_db_error().is_none(),
    }
}

fn db(e: tokio_postgres::Error) -> StoreError {
    if is_unavailable(&e) {
        // The driver's message names only the step ("error performing TLS handshake");
        // the causes say why (a certificate for another name, an unknown issuer).
        let mut msg = format!("postgres: {e}");
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            msg.push_str(&format!(": {c}"));
            cause = c.source();
        }
        StoreError::Unavailable(msg)
    } else {
        let detail = e.as_db_error().map(|d| d.message().to_string()).unwrap_or_else(|| e.to_string());
        StoreError::Db(format!("postgres: {detail}"))
    }
}

fn pool_err(e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => db(e),
        other => StoreError::Unavailable(format!("postgres pool: {other}")),
    }
}

fn ids_to_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn bytes_to_ids(b: &[u8]) -> StoreResult<Vec<u32>> {
    let chunks = b.chunks_exact(4);
    if !chunks.remainder().is_empty() {
        return Err(StoreError::Corrupt(format!("token ID column of {} bytes", b.len())));
    }
    Ok(chunks.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn version(v: i64) -> StoreResult<u32> {
    u32::try_from(v).map_err(|_| StoreError::Corrupt(format!("system prompt version {v}")))
}

fn get<'a, T: tokio_postgres::types::FromSql<'a>>(r: &'a Row, i: usize) -> StoreResult<T> {
    r.try_get(i).map_err(|e| StoreError::Corrupt(format!("column {i}: {e}")))
}

fn turn_from_row(r: &Row) -> StoreResult<Turn> {
    Ok(Turn {
        conversation: get(r, 0)?,
        turn_id: get(r, 1)?,
        seq: get(r, 2)?,
        request_hash: get(r, 3)?,
        user_text: get(r, 4)?,
        reply_text: get(r, 5)?,
        prompt_ids: bytes_to_ids(get(r, 6)?)?,
        output_ids: bytes_to_ids(get(r, 7)?)?,
        system_prompt_version: version(get(r, 8)?)?,
        state: TurnState::parse(get(r, 9)?)?,
        finish_reason: get(r, 10)?,
        prompt_tokens: get(r, 11)?,
        cached_tokens: get(r, 12)?,
        completion_tokens: get(r, 13)?,
        created_at: get(r, 14)?,
        metadata: metadata_from_json(get(r, 15)?)?,
    })
}

fn conv_from_row(r: &Row) -> StoreResult<Conversation> {
    Ok(Conversation {
        id: get(r, 0)?,
        owner: get(r, 1)?,
        title: get(r, 2)?,
        system_prompt_version: version(get(r, 3)?)?,
        created_at: get(r, 4)?,
        updated_at: get(r, 5)?,
        summary: get(r, 6)?,
        metadata: metadata_from_json(get(r, 7)?)?,
    })
}

/// The shared store.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// Random ID of this store instance (one per gateway process).
    instance: String,
    /// Seconds of silence after which another instance is dead.
    dead_after_secs: i64,
    _heartbeat: Arc<HeartbeatGuard>,
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user:password@host:port/db`, TLS as its
    /// `sslmode` and `sslrootcert` say: [`tls`]), migrates
    /// the schema to the latest version and starts the heartbeat. Fails with
    /// a clear error if the server cannot be reached or the schema is newer
    /// than this gateway.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, DEFAULT_DEAD_AFTER).await
    }

    /// [`connect`](Self::connect), counting another replica dead after
    /// `dead_after` without a heartbeat (whole seconds, at least one).
    pub async fn connect_with(url: &str, dead_after: Duration) -> StoreResult<Self> {
        let shown = redact_url(url);
        let tls = TlsPolicy::from_url(url).map_err(|e| StoreError::Db(format!("invalid PostgreSQL URL {shown}: {e}")))?;
        let mut cfg: tokio_postgres::Config = tls.url.parse().map_err(|e| StoreError::Db(format!("invalid PostgreSQL URL {shown}: {e}")))?;
        cfg.ssl_mode(tls.driver_mode());
        if cfg.get_connect_timeout().is_none() {
            cfg.connect_timeout(CONNECT_TIMEOUT);
        }
        cfg.keepalives_idle(Duration::from_secs(30));
        if cfg.get_application_name().is_none() {
            cfg.application_name("baton-gateway");
        }
        let mgr = Manager::from_config(cfg, tls.connector()?, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(mgr)
            .max_size(16)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .recycle_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| StoreError::Db(format!("postgres pool: {e}")))?;
        let mut client = pool.get().await.map_err(|e| match pool_err(e) {
            StoreError::Unavailable(m) => StoreError::Unavailable(format!("cannot connect to {shown}: {m}")),
            other => StoreError::Db(format!("cannot connect to {shown}: {other}")),
        })?;
        let from = migrate(&mut client).await?;
        let to = MIGRATIONS.last().map_or(0, |m| m.0);
        if from != to {
            tracing::info!(from, to, "postgres store schema migrated");
        }
        drop(client);
        let instance = crate::request_id();
        let task = tokio::spawn(heartbeat(pool.clone(), instance.clone(), heartbeat_every(dead_after)));
        let dead_after_secs = dead_after.as_secs().max(1) as i64;
        let store = PostgresStore { pool, instance, dead_after_secs, _heartbeat: Arc::new(HeartbeatGuard(task)) };
        store.beat().await?;
        Ok(store)
    }

    /// The schema version the database is at.
    pub async fn schema_version(&self) -> StoreResult<i32> {
        let c = self.client().await?;
        let r = c.query_one("SELECT COALESCE(max(version), 0) FROM baton_schema_migrations", &[]).await.map_err(db)?;
        get(&r, 0)
    }

    async fn client(&self) -> StoreResult<deadpool_postgres::Client> {
        self.pool.get().await.map_err(pool_err)
    }

    async fn beat(&self) -> StoreResult<()> {
        beat(&self.pool, &self.instance).await
    }

    /// Runs one statement (prepared once per connection) and returns the rows it changed.
    async fn exec(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> StoreResult<u64> {
        let c = self.client().await?;
        let st = c.prepare_cached(sql).await.map_err(db)?;
        c.execute(&st, params).await.map_err(db)
    }

    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> StoreResult<Vec<Row>> {
        let c = self.client().await?;
        let st = c.prepare_cached(sql).await.map_err(db)?;
        c.query(&st, params).await.map_err(db)
    }

    async fn query_opt(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> StoreResult<Option<Row>> {
        let c = self.client().await?;
        let st = c.prepare_cached(sql).await.map_err(db)?;
        c.query_opt(&st, params).await.map_err(db)
    }

}



#[async_trait::async_trait]
impl ConversationStore for PostgresStore {
    async fn add_key(&self, key_hash: &str, prefix: &str, user: &str, label: &str) -> StoreResult<()> {
        self.exec(
            "INSERT INTO api_keys (key_hash, prefix, user_id, label, created_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (key_hash) DO NOTHING",
            &[&key_hash, &prefix, &user, &label, &now_unix()],
        )
        .await?;
        Ok(())
    }

    async fn user_for_key(&self, key_hash: &str) -> StoreResult<Option<String>> {
        let r = self.query_opt("SELECT user_id FROM api_keys WHERE key_hash = $1 AND NOT revoked", &[&key_hash]).await?;
        r.map(|r| get(&r, 0)).transpose()
    }

    async fn list_keys(&self) -> StoreResult<Vec<ApiKeyInfo>> {
        let rows = self
            .query(
                "SELECT k.prefix, k.user_id, k.label, k.created_at, k.revoked, l.limits FROM api_keys k \
                 LEFT JOIN key_limits l ON l.key_hash = k.key_hash ORDER BY k.created_at, k.prefix",
                &[],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let limits: Option<String> = get(r, 5)?;
                Ok(ApiKeyInfo {
                    prefix: get(r, 0)?,
                    user: get(r, 1)?,
                    label: get(r, 2)?,
                    created_at: get(r, 3)?,
                    revoked: get(r, 4)?,
                    limits: limits.as_deref().map(parse_limits).transpose()?,
                })
            })
            .collect()
    }

    async fn revoke_keys(&self, prefix: &str) -> StoreResult<usize> {
        let n = self.exec("UPDATE api_keys SET revoked = TRUE WHERE NOT revoked AND left(prefix, length($1)) = $1", &[&prefix]).await?;
        Ok(n as usize)
    }

    async fn create_conversation(&self, conv: &Conversation) -> StoreResult<()> {
        self.exec(
            "INSERT INTO conversations (id, owner, title, system_prompt_version, created_at, updated_at, metadata) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &conv.id,
                &conv.owner,
                &conv.title,
                &i64::from(conv.system_prompt_version),
                &conv.created_at,
                &conv.updated_at,
                &metadata_to_json(&conv.metadata),
            ],
        )
        .await?;
        Ok(())
    }

    async fn get_conversation(&self, owner: &str, id: &str) -> StoreResult<Option<Conversation>> {
        let r = self.query_opt(&format!("SELECT {CONV_COLS} FROM conversations WHERE id = $1 AND owner = $2"), &[&id, &owner]).await?;
        r.as_ref().map(conv_from_row).transpose()
    }

    async fn list_conversations(&self, owner: &str) -> StoreResult<Vec<Conversation>> {
        let rows =
            self.query(&format!("SELECT {CONV_COLS} FROM conversations WHERE owner = $1 ORDER BY updated_at DESC, id"), &[&owner]).await?;
        rows.iter().map(conv_from_row).collect()
    }

    async fn set_summary(&self, id: &str, summary: &str, through: Option<i64>) -> StoreResult<()> {
        self.exec("UPDATE conversations SET summary = $2, summary_through = $3 WHERE id = $1", &[&id, &summary, &through]).await?;
        Ok(())
    }

    async fn summary_through(&self, id: &str, through: i64) -> StoreResult<Option<String>> {
        let rows = self.query("SELECT summary FROM conversations WHERE id = $1 AND summary_through = $2", &[&id, &through]).await?;
        match rows.first() {
            Some(r) => get(r, 0),
            None => Ok(None),
        }
    }

    async fn set_metadata(&self, owner: &str, id: &str, metadata: &Map<String, Value>) -> StoreResult<bool> {
        let n = self
            .exec(
                "UPDATE conversations SET metadata = $3, updated_at = $4 WHERE id = $1 AND owner = $2",
                &[&id, &owner, &metadata_to_json(metadata), &now_unix()],
            )
            .await?;
        Ok(n > 0)
    }

    async fn replace_turns(
        &self,
        owner: &str,
        conversation: &str,
        last_seq: Option<i64>,
        from_seq: i64,
        turns: &[Turn],
        evict_first_retry_ms: Option<i64>,
    ) -> StoreResult<Replaced> {
        let mut c = self.client().await?;
        match self.try_replace_turns(&mut c, owner, conversation, last_seq, from_seq, turns, evict_first_retry_ms).await {
            Err(BeginError::Pg(e)) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => Ok(Replaced::Busy),
            Err(BeginError::Pg(e)) => Err(db(e)),
            Err(BeginError::Store(e)) => Err(e),
            Ok(r) => Ok(r),
        }
    }

    async fn delete_conversation(&self, owner: &str, id: &str, first_retry_ms: i64) -> StoreResult<bool> {
        // Turns and the token log go with it (ON DELETE CASCADE); one statement leaves
        // the tombstone, so there is never a deleted conversation without one, and
        // records every turn streaming on another live replica: that replica stops it
        // when its next write finds the turn gone, and clears the record once its
        // generation ended (`finish_turn`); the eviction waits for that (`turns_stopping`).
        let rows = self
            .query(
                &format!(
                    "WITH stops AS (INSERT INTO turn_stops (conversation, turn_id, instance, created_at) \
                     SELECT t.conversation, t.turn_id, t.instance, $3 FROM turns t JOIN conversations c ON c.id = t.conversation \
                     WHERE t.conversation = $1 AND c.owner = $2 AND t.state = 'streaming' AND t.instance <> $5 \
                     AND t.instance IN ({}) ON CONFLICT DO NOTHING), \
                     gone AS (DELETE FROM conversations WHERE id = $1 AND owner = $2 RETURNING id) \
                     INSERT INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) \
                     SELECT id, $3, 0, $4, '[]' FROM gone \
                     ON CONFLICT (conversation) DO UPDATE SET next_attempt_ms = EXCLUDED.next_attempt_ms RETURNING conversation",
                    live_instances(6)
                ),
                &[&id, &owner, &now_unix(), &first_retry_ms, &self.instance, &self.dead_after_secs],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    async fn begin_turn(&self, t: &Turn) -> StoreResult<BeginTurn> {
        let mut c = self.client().await?;
        match self.try_begin_turn(&mut c, t).await {
            // Another replica's insert won a unique index (this turn ID, its place, or
            // the conversation's one streaming turn): the row it left says which.
            Err(BeginError::Pg(e)) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => match self.get_turn(&t.conversation, &t.turn_id).await? {
                Some(existing) => Ok(BeginTurn::Existing(Box::new(existing))),
                None => Ok(BeginTurn::Busy),
            },
            Err(BeginError::Pg(e)) => Err(db(e)),
            Err(BeginError::Store(e)) => Err(e),
            Ok(b) => Ok(b),
        }
    }

    async fn turn_runs_elsewhere(&self, conversation: &str, turn_id: &str) -> StoreResult<bool> {
        let r = self
            .query_opt(
                &format!(
                    "SELECT 1 FROM turns WHERE conversation = $1 AND turn_id = $2 AND state = 'streaming' \
                     AND instance <> $3 AND instance IN ({})",
                    live_instances(4)
                ),
                &[&conversation, &turn_id, &self.instance, &self.dead_after_secs],
            )
            .await?;
        Ok(r.is_some())
    }

    async fn append_log(&self, conversation: &str, turn_id: &str, entries: &[LogEntry]) -> StoreResult<bool> {
        if entries.is_empty() {
            let r = self
                .query_opt("SELECT 1 FROM turns WHERE conversation = $1 AND turn_id = $2 AND instance = $3", &[&conversation, &turn_id, &self.instance])
                .await?;
            return Ok(r.is_some());
        }
        let idx: Vec<i64> = entries.iter().map(|e| e.index).collect();
        let text: Vec<&str> = entries.iter().map(|e| e.text.as_str()).collect();
        // One statement, so the batch is stored whole or not at all; only while
        // this instance holds the turn (a replica that took it over owns its log, and a
        // deleted conversation has no turn). Zero rows: the turn is no longer ours.
        let stored = self
            .exec(
                "INSERT INTO token_log (conversation, turn_id, idx, text) \
                 SELECT $1, $2, u.i, u.t FROM unnest($3::BIGINT[], $4::TEXT[]) AS u(i, t) \
                 WHERE EXISTS (SELECT 1 FROM turns WHERE conversation = $1 AND turn_id = $2 AND instance = $5) \
                 ON CONFLICT (conversation, turn_id, idx) DO UPDATE SET text = EXCLUDED.text",
                &[&conversation, &turn_id, &idx, &text, &self.instance],
            )
            .await;
        match stored {
            Ok(n) => Ok(n > 0),
            // The deletion committed between the check and the insert's key check.
            Err(StoreError::Db(m)) if m.contains("foreign key") => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn finish_turn(&self, conversation: &str, turn_id: &str, e: &TurnEnd) -> StoreResult<()> {
        // Zero rows when the conversation was deleted while the turn streamed (nothing
        // to keep), or when another replica took the turn over (its run is the one kept).
        let n = self
            .exec(
                "UPDATE turns SET state = $3, reply_text = $4, output_ids = $5, finish_reason = $6, prompt_tokens = $7, \
                 cached_tokens = $8, completion_tokens = $9 WHERE conversation = $1 AND turn_id = $2 AND instance = $10",
                &[
                    &conversation,
                    &turn_id,
                    &e.state.as_str(),
                    &e.reply_text,
                    &ids_to_bytes(&e.output_ids),
                    &e.finish_reason,
                    &e.prompt_tokens,
                    &e.cached_tokens,
                    &e.completion_tokens,
                    &self.instance,
                ],
            )
            .await?;
        if n == 0 {
            // The turn has ended here (its generation dropped): the replica that deleted
            // its conversation may evict the KV now.
            self.exec("DELETE FROM turn_stops WHERE conversation = $1 AND turn_id = $2 AND instance = $3", &[&conversation, &turn_id, &self.instance])
                .await?;
        }
        Ok(())
    }

    async fn turns_stopping(&self, conversation: &str) -> StoreResult<u64> {
        let r = self
            .query_opt(
                &format!("SELECT count(*) FROM turn_stops WHERE conversation = $1 AND instance IN ({})", live_instances(2)),
                &[&conversation, &self.dead_after_secs],
            )
            .await?;
        let n: i64 = match r {
            Some(r) => get(&r, 0)?,
            None => 0,
        };
        Ok(n as u64)
    }

    async fn discard_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<()> {
        self.exec("DELETE FROM turns WHERE conversation = $1 AND turn_id = $2", &[&conversation, &turn_id]).await?;
        Ok(())
    }

    async fn get_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
        let r = self
            .query_opt(&format!("SELECT {TURN_COLS} FROM turns WHERE conversation = $1 AND turn_id = $2"), &[&conversation, &turn_id])
            .await?;
        r.as_ref().map(turn_from_row).transpose()
    }

    async fn list_turns(&self, conversation: &str) -> StoreResult<Vec<Turn>> {
        let rows = self.query(&format!("SELECT {TURN_COLS} FROM turns WHERE conversation = $1 ORDER BY seq"), &[&conversation]).await?;
        rows.iter().map(turn_from_row).collect()
    }

    async fn read_log(&self, conversation: &str, turn_id: &str, from: i64) -> StoreResult<Vec<LogEntry>> {
        let rows = self
            .query(
                "SELECT idx, text FROM token_log WHERE conversation = $1 AND turn_id = $2 AND idx >= $3 ORDER BY idx",
                &[&conversation, &turn_id, &from],
            )
            .await?;
        rows.iter().map(|r| Ok(LogEntry { index: get(r, 0)?, text: get(r, 1)? })).collect()
    }

    async fn fail_streaming_turns(&self) -> StoreResult<usize> {
        // Only turns nobody is streaming any more: this instance's, and those
        // of instances whose heartbeat stopped (another live replica's stay).
        let n = self
            .exec(
                &format!(
                    "UPDATE turns SET state = 'failed', finish_reason = 'interrupted', instance = NULL WHERE state = 'streaming' \
                     AND (instance IS NULL OR instance = $1 OR instance NOT IN ({}))",
                    live_instances(2)
                ),
                &[&self.instance, &self.dead_after_secs],
            )
            .await?;
        Ok(n as usize)
    }

    async fn delete_older_than(&self, cutoff: i64) -> StoreResult<Vec<String>> {
        let rows = self
            .query(
                "WITH gone AS (DELETE FROM conversations WHERE updated_at < $1 RETURNING id) \
                 INSERT INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) \
                 SELECT id, $2, 0, $3, '[]' FROM gone ON CONFLICT (conversation) DO UPDATE SET next_attempt_ms = EXCLUDED.next_attempt_ms \
                 RETURNING conversation",
                &[&cutoff, &now_unix(), &now_unix_ms()],
            )
            .await?;
        let mut ids = rows.iter().map(|r| get::<String>(r, 0)).collect::<StoreResult<Vec<_>>>()?;
        ids.sort();
        // Heartbeat rows of instances long gone, and the stops they never acknowledged.
        self.exec("DELETE FROM gateway_instances WHERE seen_at < $1", &[&cutoff]).await?;
        self.exec("DELETE FROM turn_stops WHERE instance NOT IN (SELECT id FROM gateway_instances)", &[]).await?;
        Ok(ids)
    }

    async fn due_tombstones(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Tombstone>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .query(
                "SELECT conversation, created_at, attempts, next_attempt_ms, owed FROM eviction_tombstones \
                 WHERE next_attempt_ms <= $1 ORDER BY next_attempt_ms, conversation LIMIT $2",
                &[&now_ms, &limit],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let attempts: i64 = get(r, 2)?;
                Ok(Tombstone {
                    conversation: get(r, 0)?,
                    created_at: get(r, 1)?,
                    attempts: u32::try_from(attempts).map_err(|_| StoreError::Corrupt(format!("tombstone attempts {attempts}")))?,
                    next_attempt_ms: get(r, 3)?,
                    owed: owed_from_json(get(r, 4)?)?,
                })
            })
            .collect()
    }

    async fn tombstone_attempted(&self, conversation: &str, attempts: u32, next_attempt_ms: i64, owed: &[String]) -> StoreResult<()> {
        self.exec(
            "UPDATE eviction_tombstones SET attempts = $2, next_attempt_ms = $3, owed = $4 WHERE conversation = $1",
            &[&conversation, &i64::from(attempts), &next_attempt_ms, &owed_to_json(owed)],
        )
        .await?;
        Ok(())
    }

    async fn clear_tombstone(&self, conversation: &str) -> StoreResult<bool> {
        Ok(self.exec("DELETE FROM eviction_tombstones WHERE conversation = $1", &[&conversation]).await? > 0)
    }

    async fn count_tombstones(&self) -> StoreResult<u64> {
        let r = self.query_opt("SELECT count(*) FROM eviction_tombstones", &[]).await?;
        let n: i64 = match r {
            Some(r) => get(&r, 0)?,
            None => 0,
        };
        Ok(n as u64)
    }

    async fn set_user_limits(&self, user: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<()> {
        match limits {
            Some(l) => {
                let j = serde_json::to_string(l).map_err(|e| StoreError::Db(format!("user limits: {e}")))?;
                self.exec(
                    "INSERT INTO user_limits (user_id, limits) VALUES ($1, $2) ON CONFLICT (user_id) DO UPDATE SET limits = EXCLUDED.limits",
                    &[&user, &j],
                )
                .await?
            }
            None => self.exec("DELETE FROM user_limits WHERE user_id = $1", &[&user]).await?,
        };
        Ok(())
    }

    async fn user_limits(&self, user: &str) -> StoreResult<Option<crate::limits::LimitOverrides>> {
        let r = self.query_opt("SELECT limits FROM user_limits WHERE user_id = $1", &[&user]).await?;
        r.map(|r| {
            let j: String = get(&r, 0)?;
            serde_json::from_str(&j).map_err(|e| StoreError::Corrupt(format!("user limits: {e}")))
        })
        .transpose()
    }

    async fn set_key_limits(&self, prefix: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<usize> {
        // Only when exactly one live key matches: an ambiguous prefix changes nothing.
        const ONE_LIVE_KEY: &str = "NOT revoked AND left(prefix, length($1)) = $1 \
             AND (SELECT count(*) FROM api_keys WHERE NOT revoked AND left(prefix, length($1)) = $1) = 1";
        let n = match limits {
            Some(l) => {
                let j = serde_json::to_string(l).map_err(|e| StoreError::Db(format!("key limits: {e}")))?;
                self.exec(
                    &format!(
                        "INSERT INTO key_limits (key_hash, limits) SELECT key_hash, $2::text FROM api_keys WHERE {ONE_LIVE_KEY} \
                         ON CONFLICT (key_hash) DO UPDATE SET limits = EXCLUDED.limits"
                    ),
                    &[&prefix, &j],
                )
                .await?
            }
            None => {
                self.exec(&format!("DELETE FROM key_limits WHERE key_hash IN (SELECT key_hash FROM api_keys WHERE {ONE_LIVE_KEY})"), &[&prefix])
                    .await?
            }
        };
        Ok(n as usize)
    }

    async fn key_limits(&self, key_hash: &str) -> StoreResult<Option<crate::limits::LimitOverrides>> {
        let r = self.query_opt("SELECT limits FROM key_limits WHERE key_hash = $1", &[&key_hash]).await?;
        r.map(|r| parse_limits(&get::<String>(&r, 0)?)).transpose()
    }

    async fn add_usage(&self, user: &str, u: UsageCounts) -> StoreResult<()> {
        self.exec(
            "INSERT INTO usage (user_id, requests, prompt_tokens, cached_tokens, completion_tokens) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (user_id) DO UPDATE SET requests = usage.requests + EXCLUDED.requests, \
             prompt_tokens = usage.prompt_tokens + EXCLUDED.prompt_tokens, \
             cached_tokens = usage.cached_tokens + EXCLUDED.cached_tokens, \
             completion_tokens = usage.completion_tokens + EXCLUDED.completion_tokens",
            &[&user, &u.requests, &u.prompt_tokens, &u.cached_tokens, &u.completion_tokens],
        )
        .await?;
        Ok(())
    }

    async fn usage(&self, user: &str) -> StoreResult<UsageCounts> {
        let r = self
            .query_opt("SELECT requests, prompt_tokens, cached_tokens, completion_tokens FROM usage WHERE user_id = $1", &[&user])
            .await?;
        match r {
            Some(r) => Ok(UsageCounts {
                requests: get(&r, 0)?,
                prompt_tokens: get(&r, 1)?,
                cached_tokens: get(&r, 2)?,
                completion_tokens: get(&r, 3)?,
            }),
            None => Ok(UsageCounts::default()),
        }
    }

    fn limit_ledger(&self) -> Option<Arc<dyn crate::limits::LimitLedger>> {
        Some(Arc::new(self.clone()))
    }
}

fn parse_limits(j: &str) -> StoreResult<crate::limits::LimitOverrides> {
    serde_json::from_str(j).map_err(|e| StoreError::Corrupt(format!("limits: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_select_postgres_and_hide_passwords() {
        assert!(is_postgres_url("postgres://u@h/db"));
        assert!(is_postgres_url("postgresql://u@h/db"));
        assert!(!is_postgres_url("baton-gateway.db"));
        assert!(!is_postgres_url("/var/lib/postgres/x.db"));
        assert_eq!(redact_url("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }

    #[test]
    fn token_ids_round_trip_and_reject_torn_columns() {
        let ids = vec![0, 1, u32::MAX, 100_000];
        assert_eq!(bytes_to_ids(&ids_to_bytes(&ids)).unwrap(), ids);
        assert!(matches!(bytes_to_ids(&[1, 2, 3]), Err(StoreError::Corrupt(_))));
    }

    #[test]
    fn migrations_are_ordered() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(MIGRATIONS[0].0, 1);
    }
}
