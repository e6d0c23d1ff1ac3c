//! SQLite implementation of [`ConversationStore`]: one file in WAL mode,
//! `synchronous=NORMAL` (a commit survives a process crash; a power loss may
//! lose the last commits), foreign keys with cascading deletes so a
//! conversation's turns and token log go with it. Calls run on the blocking
//! pool behind one connection mutex. A deletion leaves no byte of the deleted
//! text in any of the store's files: `secure_delete` zeroes it in the database's
//! pages and a truncating checkpoint (`erase_wal`) empties the WAL that still
//! held earlier versions of those pages.

use super::*;
use rusqlite::{params, Connection, OptionalExtension};
use std::path::Path;
use std::sync::{Arc, Mutex};

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY,
    prefix TEXT NOT NULL,
    user_id TEXT NOT NULL,
    label TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    title TEXT NOT NULL,
    system_prompt_version INTEGER NOT NULL,
    summary TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_owner ON conversations(owner, updated_at);
CREATE TABLE IF NOT EXISTS turns (
    conversation TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    turn_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    request_hash TEXT NOT NULL,
    user_text TEXT NOT NULL,
    reply_text TEXT NOT NULL,
    prompt_ids BLOB NOT NULL,
    output_ids BLOB NOT NULL,
    system_prompt_version INTEGER NOT NULL,
    state TEXT NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (conversation, turn_id)
);
CREATE TABLE IF NOT EXISTS token_log (
    conversation TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (conversation, turn_id, idx),
    FOREIGN KEY (conversation, turn_id) REFERENCES turns(conversation, turn_id) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS user_limits (
    user_id TEXT PRIMARY KEY,
    limits TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS key_limits (
    key_hash TEXT PRIMARY KEY REFERENCES api_keys(key_hash),
    limits TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS eviction_tombstones (
    conversation TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms INTEGER NOT NULL,
    owed TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS eviction_tombstones_due ON eviction_tombstones(next_attempt_ms);
CREATE TABLE IF NOT EXISTS usage (
    user_id TEXT PRIMARY KEY,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL
);
"#;

/// The embedded store.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
}

fn db(e: rusqlite::Error) -> StoreError {
    StoreError::Db(e.to_string())
}

fn ids_to_blob(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn blob_to_ids(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

const TURN_COLS: &str = "conversation, turn_id, seq, request_hash, user_text, reply_text, prompt_ids, output_ids, \
     system_prompt_version, state, finish_reason, prompt_tokens, cached_tokens, completion_tokens, created_at, metadata";

fn turn_from_row(r: &rusqlite::Row) -> rusqlite::Result<(Turn, String, String)> {
    let state: String = r.get(9)?;
    let metadata: String = r.get(15)?;
    let prompt: Vec<u8> = r.get(6)?;
    let output: Vec<u8> = r.get(7)?;
    Ok((
        Turn {
            conversation: r.get(0)?,
            turn_id: r.get(1)?,
            seq: r.get(2)?,
            request_hash: r.get(3)?,
            user_text: r.get(4)?,
            reply_text: r.get(5)?,
            prompt_ids: blob_to_ids(&prompt),
            output_ids: blob_to_ids(&output),
            system_prompt_version: r.get(8)?,
            state: TurnState::Streaming,
            finish_reason: r.get(10)?,
            prompt_tokens: r.get(11)?,
            cached_tokens: r.get(12)?,
            completion_tokens: r.get(13)?,
            created_at: r.get(14)?,
            metadata: Map::new(),
        },
        state,
        metadata,
    ))
}

fn finish_turn_row(row: (Turn, String, String)) -> StoreResult<Turn> {
    let (mut t, state, metadata) = row;
    t.state = TurnState::parse(&state)?;
    t.metadata = metadata_from_json(&metadata)?;
    Ok(t)
}

const CONV_COLS: &str = "id, owner, title, system_prompt_version, created_at, updated_at, summary, metadata";

/// Schema changes after the first release, by `PRAGMA user_version`: each runs once, in
/// order, in one transaction with the version bump (never edit one, append).
const MIGRATIONS: &[(i64, &str)] = &[
    (1, "ALTER TABLE conversations ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';"),
    (2, "ALTER TABLE turns ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';"),
    // The place of the last turn the summary covers (NULL: not reusable).
    (3, "ALTER TABLE conversations ADD COLUMN summary_through INTEGER;"),
];

fn migrate(conn: &mut Connection) -> StoreResult<()> {
    let tx = conn.transaction().map_err(db)?;
    let current: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(db)?;
    let latest = MIGRATIONS.last().map_or(0, |m| m.0);
    if current > latest {
        return Err(StoreError::Db(format!("the SQLite schema is at version {current}, newer than this gateway's {latest}: upgrade the gateway")));
    }
    for (v, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > current) {
        tx.execute_batch(sql).map_err(|e| StoreError::Db(format!("schema migration {v}: {e}")))?;
        tx.pragma_update(None, "user_version", v).map_err(db)?;
    }
    tx.commit().map_err(db)
}

/// Inserts one turn row as given, in state `state`.
fn insert_turn(tx: &Connection, t: &Turn, state: TurnState) -> StoreResult<()> {
    tx.run(
        &format!("INSERT INTO turns ({TURN_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)"),
        params![
            t.conversation,
            t.turn_id,
            t.seq,
            t.request_hash,
            t.user_text,
            t.reply_text,
            ids_to_blob(&t.prompt_ids),
            ids_to_blob(&t.output_ids),
            t.system_prompt_version,
            state.as_str(),
            t.finish_reason,
            t.prompt_tokens,
            t.cached_tokens,
            t.completion_tokens,
            t.created_at,
            metadata_to_json(&t.metadata)
        ],
    )
    .map_err(db)?;
    Ok(())
}

fn conv_from_row(r: &rusqlite::Row) -> rusqlite::Result<(Conversation, String)> {
    let metadata: String = r.get(7)?;
    Ok((Conversation {
        id: r.get(0)?,
        owner: r.get(1)?,
        title: r.get(2)?,
        system_prompt_version: r.get(3)?,
        created_at: r.get(4)?,
        updated_at: r.get(5)?,
        summary: r.get(6)?,
        metadata: Map::new(),
    }, metadata))
}

fn finish_conv_row(row: (Conversation, String)) -> StoreResult<Conversation> {
    let (mut c, metadata) = row;
    c.metadata = metadata_from_json(&metadata)?;
    Ok(c)
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> StoreResult<Self> {
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir).map_err(|e| StoreError::Db(format!("creating {}: {e}", dir.display())))?;
            }
        }
        // Conversations are user data: the file (and the WAL and shared-memory files SQLite
        // creates beside it with the same mode) is readable by this user only.
        #[cfg(unix)]
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let created = std::fs::OpenOptions::new().write(true).create(true).truncate(false).mode(0o600).open(path);
            created.map_err(|e| StoreError::Db(format!("creating {}: {e}", path.display())))?;
            let mode = std::fs::metadata(path).map_err(|e| StoreError::Db(format!("{}: {e}", path.display())))?.permissions().mode();
            if mode & 0o077 != 0 {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| StoreError::Db(format!("making {} private: {e}", path.display())))?;
            }
        }
        let conn = Connection::open(path).map_err(db)?;
        Self::init(conn)
    }

    /// A private in-memory database (tests).
    pub fn in_memory() -> StoreResult<Self> {
        Self::init(Connection::open_in_memory().map_err(db)?)
    }

    fn init(conn: Connection) -> StoreResult<Self> {
        conn.pragma_update(None, "journal_mode", "WAL").map_err(db)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(db)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(db)?;
        // Deleted conversations are overwritten with zeros, not left in free pages.
        conn.pragma_update(None, "secure_delete", "ON").map_err(db)?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(db)?;
        conn.execute_batch(SCHEMA).map_err(db)?;
        let mut conn = conn;
        migrate(&mut conn)?;
        conn.set_prepared_statement_cache_capacity(64);
        Ok(SqliteStore { conn: Arc::new(Mutex::new(conn)) })
    }

    async fn with<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> StoreResult<T> + Send + 'static,
    {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut c)
        })
        .await
        .map_err(|e| StoreError::Db(format!("store task: {e}")))?
    }
}

/// Statements through the connection's prepared-statement cache, so that a
/// request's SQL is parsed once per connection rather than on every call.
trait CachedSql {
    fn run<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl CachedSql for Connection {
    fn run<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

/// After a deletion committed: copies the WAL into the database and truncates it to
/// zero bytes. `secure_delete` zeroes the freed cells, but only in the page versions the
/// deletion wrote; every earlier version of those pages, the deleted text included, stays
/// in the `-wal` file until a checkpoint, and a plain checkpoint leaves the file's bytes
/// in place for reuse. One connection serves the store (behind its mutex), so no reader
/// holds the WAL open and the checkpoint completes. If something else does (an
/// operator's `sqlite3` on the file), the deletion has committed all the same: it is logged
/// as an error (the text stays in the WAL until a later deletion's checkpoint gets through)
/// rather than answered as a failure the client would retry into a 404.
/// The `-shm` file holds only page numbers and hashes, never row text.
fn erase_wal(c: &Connection) -> StoreResult<()> {
    let (busy, log, done): (i64, i64, i64) = c
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .map_err(db)?;
    if busy != 0 {
        tracing::error!(frames = log, checkpointed = done, "the WAL could not be truncated after a deletion: another process holds the database open");
    }
    Ok(())
}

fn get_turn_sync(c: &Connection, conversation: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
    let row = c
        .row(
            &format!("SELECT {TURN_COLS} FROM turns WHERE conversation = ?1 AND turn_id = ?2"),
            params![conversation, turn_id],
            turn_from_row,
        )
        .optional()
        .map_err(db)?;
    row.map(finish_turn_row).transpose()
}

#[async_trait::async_trait]
impl ConversationStore for SqliteStore {
    async fn add_key(&self, key_hash: &str, prefix: &str, user: &str, label: &str) -> StoreResult<()> {
        let (h, p, u, l) = (key_hash.to_string(), prefix.to_string(), user.to_string(), label.to_string());
        self.with(move |c| {
            c.run(
                "INSERT OR IGNORE INTO api_keys (key_hash, prefix, user_id, label, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![h, p, u, l, now_unix()],
            )
            .map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn user_for_key(&self, key_hash: &str) -> StoreResult<Option<String>> {
        let h = key_hash.to_string();
        self.with(move |c| {
            c.row("SELECT user_id FROM api_keys WHERE key_hash = ?1 AND revoked = 0", params![h], |r| r.get(0)).optional().map_err(db)
        })
        .await
    }

    async fn list_keys(&self) -> StoreResult<Vec<ApiKeyInfo>> {
        self.with(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT k.prefix, k.user_id, k.label, k.created_at, k.revoked, l.limits FROM api_keys k \
                     LEFT JOIN key_limits l ON l.key_hash = k.key_hash ORDER BY k.created_at, k.prefix",
                )
                .map_err(db)?;
            let rows = st
                .query_map([], |r| {
                    let info = ApiKeyInfo {
                        prefix: r.get(0)?,
                        user: r.get(1)?,
                        label: r.get(2)?,
                        created_at: r.get(3)?,
                        revoked: r.get::<_, i64>(4)? != 0,
                        limits: None,
                    };
                    Ok((info, r.get::<_, Option<String>>(5)?))
                })
                .map_err(db)?;
            rows.map(|row| {
                let (mut info, limits) = row.map_err(db)?;
                info.limits = limits.as_deref().map(parse_limits).transpose()?;
                Ok(info)
            })
            .collect()
        })
        .await
    }

    async fn revoke_keys(&self, prefix: &str) -> StoreResult<usize> {
        let p = prefix.to_string();
        self.with(move |c| {
            c.run("UPDATE api_keys SET revoked = 1 WHERE revoked = 0 AND substr(prefix, 1, length(?1)) = ?1", params![p]).map_err(db)
        })
        .await
    }

    async fn create_conversation(&self, conv: &Conversation) -> StoreResult<()> {
        let cv = conv.clone();
        self.with(move |c| {
            c.run(
                "INSERT INTO conversations (id, owner, title, system_prompt_version, created_at, updated_at, metadata) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![cv.id, cv.owner, cv.title, cv.system_prompt_version, cv.created_at, cv.updated_at, metadata_to_json(&cv.metadata)],
            )
            .map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn get_conversation(&self, owner: &str, id: &str) -> StoreResult<Option<Conversation>> {
        let (o, i) = (owner.to_string(), id.to_string());
        self.with(move |c| {
            let row = c
                .row(&format!("SELECT {CONV_COLS} FROM conversations WHERE id = ?1 AND owner = ?2"), params![i, o], conv_from_row)
                .optional()
                .map_err(db)?;
            row.map(finish_conv_row).transpose()
        })
        .await
    }

    async fn list_conversations(&self, owner: &str) -> StoreResult<Vec<Conversation>> {
        let o = owner.to_string();
        self.with(move |c| {
            let mut st =
                c.prepare_cached(&format!("SELECT {CONV_COLS} FROM conversations WHERE owner = ?1 ORDER BY updated_at DESC, id")).map_err(db)?;
            let rows = st.query_map(params![o], conv_from_row).map_err(db)?;
            rows.map(|r| r.map_err(db).and_then(finish_conv_row)).collect()
        })
        .await
    }

    async fn set_summary(&self, id: &str, summary: &str, through: Option<i64>) -> StoreResult<()> {
        let (i, sm) = (id.to_string(), summary.to_string());
        self.with(move |c| {
            c.run("UPDATE conversations SET summary = ?2, summary_through = ?3 WHERE id = ?1", params![i, sm, through]).map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn summary_through(&self, id: &str, through: i64) -> StoreResult<Option<String>> {
        let i = id.to_string();
        self.with(move |c| {
            let s: Option<Option<String>> = c
                .row("SELECT summary FROM conversations WHERE id = ?1 AND summary_through = ?2", params![i, through], |r| r.get(0))
                .optional()
                .map_err(db)?;
            Ok(s.flatten())
        })
        .await
    }

    async fn set_metadata(&self, owner: &str, id: &str, metadata: &Map<String, Value>) -> StoreResult<bool> {
        let (o, i, m) = (owner.to_string(), id.to_string(), metadata_to_json(metadata));
        self.with(move |c| {
            let n = c
                .run("UPDATE conversations SET metadata = ?3, updated_at = ?4 WHERE id = ?1 AND owner = ?2", params![i, o, m, now_unix()])
                .map_err(db)?;
            Ok(n > 0)
        })
        .await
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
        let (o, i, ts) = (owner.to_string(), conversation.to_string(), turns.to_vec());
        self.with(move |c| {
            let tx = c.transaction().map_err(db)?;
            let found: Option<i64> =
                tx.row("SELECT 1 FROM conversations WHERE id = ?1 AND owner = ?2", params![i, o], |r| r.get(0)).optional().map_err(db)?;
            if found.is_none() {
                return Ok(Replaced::NotFound);
            }
            let (last, streaming): (Option<i64>, i64) = tx
                .row(
                    "SELECT max(seq), coalesce(sum(state = 'streaming'), 0) FROM turns WHERE conversation = ?1",
                    params![i],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .map_err(db)?;
            if streaming > 0 || last != last_seq {
                return Ok(Replaced::Busy);
            }
            tx.run("DELETE FROM turns WHERE conversation = ?1 AND seq >= ?2", params![i, from_seq]).map_err(db)?;
            // A summary of turns being rewritten no longer says what they say.
            tx.run(
                "UPDATE conversations SET summary = NULL, summary_through = NULL WHERE id = ?1 AND summary_through >= ?2",
                params![i, from_seq],
            )
            .map_err(db)?;
            for t in &ts {
                insert_turn(&tx, t, t.state)?;
            }
            if let Some(due) = evict_first_retry_ms {
                tx.run(
                    "INSERT INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) VALUES (?1, ?2, 0, ?3, '[]') \
                     ON CONFLICT (conversation) DO UPDATE SET next_attempt_ms = min(next_attempt_ms, excluded.next_attempt_ms)",
                    params![i, now_unix(), due],
                )
                .map_err(db)?;
            }
            tx.run("UPDATE conversations SET updated_at = ?2 WHERE id = ?1", params![i, now_unix()]).map_err(db)?;
            tx.commit().map_err(db)?;
            Ok(Replaced::Done)
        })
        .await
    }

    async fn delete_conversation(&self, owner: &str, id: &str, first_retry_ms: i64) -> StoreResult<bool> {
        let (o, i) = (owner.to_string(), id.to_string());
        self.with(move |c| {
            let tx = c.transaction().map_err(db)?;
            let n = tx.run("DELETE FROM conversations WHERE id = ?1 AND owner = ?2", params![i, o]).map_err(db)?;
            if n > 0 {
                tx.run(
                    "INSERT OR IGNORE INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) \
                     VALUES (?1, ?2, 0, ?3, '[]')",
                    params![i, now_unix(), first_retry_ms],
                )
                .map_err(db)?;
            }
            tx.commit().map_err(db)?;
            if n > 0 {
                erase_wal(c)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn begin_turn(&self, turn: &Turn) -> StoreResult<BeginTurn> {
        let t = turn.clone();
        self.with(move |c| {
            let tx = c.transaction().map_err(db)?;
            if let Some(existing) = get_turn_sync(&tx, &t.conversation, &t.turn_id)? {
                if existing.state != TurnState::Failed || existing.request_hash != t.request_hash {
                    return Ok(BeginTurn::Existing(Box::new(existing)));
                }
                tx.run("DELETE FROM turns WHERE conversation = ?1 AND turn_id = ?2", params![t.conversation, t.turn_id]).map_err(db)?;
            }
            // One process holds the only connection, so this check and the insert
            // below are atomic: no second streaming turn, no second turn at `seq`.
            let busy: Option<i64> = tx
                .query_row(
                    "SELECT 1 FROM turns WHERE conversation = ?1 AND turn_id <> ?2 AND (state = 'streaming' OR seq = ?3) LIMIT 1",
                    params![t.conversation, t.turn_id, t.seq],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db)?;
            if busy.is_some() {
                return Ok(BeginTurn::Busy);
            }
            insert_turn(&tx, &t, TurnState::Streaming)?;
            tx.run("UPDATE conversations SET updated_at = ?2 WHERE id = ?1", params![t.conversation, now_unix()]).map_err(db)?;
            tx.commit().map_err(db)?;
            Ok(BeginTurn::Created)
        })
        .await
    }

    async fn turn_runs_elsewhere(&self, _conversation: &str, _turn_id: &str) -> StoreResult<bool> {
        // One process: its streaming turns are in its own registry of live turns.
        Ok(false)
    }

    async fn append_log(&self, conversation: &str, turn_id: &str, entries: &[LogEntry]) -> StoreResult<bool> {
        let (cv, t, es) = (conversation.to_string(), turn_id.to_string(), entries.to_vec());
        self.with(move |c| {
            let tx = c.transaction().map_err(db)?;
            // One process: a turn is gone only when its conversation was deleted.
            let exists = tx
                .row("SELECT 1 FROM turns WHERE conversation = ?1 AND turn_id = ?2", params![cv, t], |_| Ok(()))
                .optional()
                .map_err(db)?
                .is_some();
            if !exists {
                return Ok(false);
            }
            {
                let mut st = tx
                    .prepare_cached("INSERT OR REPLACE INTO token_log (conversation, turn_id, idx, text) VALUES (?1, ?2, ?3, ?4)")
                    .map_err(db)?;
                for e in &es {
                    st.execute(params![cv, t, e.index, e.text]).map_err(db)?;
                }
            }
            tx.commit().map_err(db)?;
            Ok(true)
        })
        .await
    }

    async fn turns_stopping(&self, _conversation: &str) -> StoreResult<u64> {
        Ok(0)
    }

    async fn finish_turn(&self, conversation: &str, turn_id: &str, end: &TurnEnd) -> StoreResult<()> {
        let (cv, t, e) = (conversation.to_string(), turn_id.to_string(), end.clone());
        self.with(move |c| {
            let n = c
                .run(
                    "UPDATE turns SET state = ?3, reply_text = ?4, output_ids = ?5, finish_reason = ?6, prompt_tokens = ?7, \
                     cached_tokens = ?8, completion_tokens = ?9 WHERE conversation = ?1 AND turn_id = ?2",
                    params![
                        cv,
                        t,
                        e.state.as_str(),
                        e.reply_text,
                        ids_to_blob(&e.output_ids),
                        e.finish_reason,
                        e.prompt_tokens,
                        e.cached_tokens,
                        e.completion_tokens
                    ],
                )
                .map_err(db)?;
            if n == 0 {
                // The conversation was deleted while the turn streamed: nothing to keep.
                return Ok(());
            }
            Ok(())
        })
        .await
    }

    async fn discard_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<()> {
        let (cv, t) = (conversation.to_string(), turn_id.to_string());
        self.with(move |c| {
            c.run("DELETE FROM turns WHERE conversation = ?1 AND turn_id = ?2", params![cv, t]).map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn get_turn(&self, conversation: &str, turn_id: &str) -> StoreResult<Option<Turn>> {
        let (cv, t) = (conversation.to_string(), turn_id.to_string());
        self.with(move |c| get_turn_sync(c, &cv, &t)).await
    }

    async fn list_turns(&self, conversation: &str) -> StoreResult<Vec<Turn>> {
        let cv = conversation.to_string();
        self.with(move |c| {
            let mut st = c.prepare_cached(&format!("SELECT {TURN_COLS} FROM turns WHERE conversation = ?1 ORDER BY seq")).map_err(db)?;
            let rows = st.query_map(params![cv], turn_from_row).map_err(db)?;
            let rows = rows.collect::<Result<Vec<_>, _>>().map_err(db)?;
            rows.into_iter().map(finish_turn_row).collect()
        })
        .await
    }

    async fn read_log(&self, conversation: &str, turn_id: &str, from: i64) -> StoreResult<Vec<LogEntry>> {
        let (cv, t) = (conversation.to_string(), turn_id.to_string());
        self.with(move |c| {
            let mut st = c
                .prepare_cached("SELECT idx, text FROM token_log WHERE conversation = ?1 AND turn_id = ?2 AND idx >= ?3 ORDER BY idx")
                .map_err(db)?;
            let rows = st.query_map(params![cv, t, from], |r| Ok(LogEntry { index: r.get(0)?, text: r.get(1)? })).map_err(db)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(db)
        })
        .await
    }

    async fn fail_streaming_turns(&self) -> StoreResult<usize> {
        self.with(|c| {
            c.run("UPDATE turns SET state = 'failed', finish_reason = 'interrupted' WHERE state = 'streaming'", []).map_err(db)
        })
        .await
    }

    async fn delete_older_than(&self, cutoff: i64) -> StoreResult<Vec<String>> {
        self.with(move |c| {
            let tx = c.transaction().map_err(db)?;
            let ids = {
                let mut st = tx.prepare_cached("SELECT id FROM conversations WHERE updated_at < ?1").map_err(db)?;
                let rows = st.query_map(params![cutoff], |r| r.get::<_, String>(0)).map_err(db)?;
                rows.collect::<Result<Vec<_>, _>>().map_err(db)?
            };
            tx.run(
                "INSERT OR IGNORE INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) \
                 SELECT id, ?2, 0, ?3, '[]' FROM conversations WHERE updated_at < ?1",
                params![cutoff, now_unix(), now_unix_ms()],
            )
            .map_err(db)?;
            tx.run("DELETE FROM conversations WHERE updated_at < ?1", params![cutoff]).map_err(db)?;
            tx.commit().map_err(db)?;
            if !ids.is_empty() {
                erase_wal(c)?;
            }
            Ok(ids)
        })
        .await
    }

    async fn due_tombstones(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Tombstone>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.with(move |c| {
            let mut st = c
                .prepare_cached(
                    "SELECT conversation, created_at, attempts, next_attempt_ms, owed FROM eviction_tombstones \
                     WHERE next_attempt_ms <= ?1 ORDER BY next_attempt_ms, conversation LIMIT ?2",
                )
                .map_err(db)?;
            let rows = st
                .query_map(params![now_ms, limit], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?, r.get::<_, String>(4)?))
                })
                .map_err(db)?;
            rows.map(|row| {
                let (conversation, created_at, attempts, next_attempt_ms, owed) = row.map_err(db)?;
                Ok(Tombstone {
                    conversation,
                    created_at,
                    attempts: u32::try_from(attempts).map_err(|_| StoreError::Corrupt(format!("tombstone attempts {attempts}")))?,
                    next_attempt_ms,
                    owed: owed_from_json(&owed)?,
                })
            })
            .collect()
        })
        .await
    }

    async fn tombstone_attempted(&self, conversation: &str, attempts: u32, next_attempt_ms: i64, owed: &[String]) -> StoreResult<()> {
        let (cv, owed) = (conversation.to_string(), owed_to_json(owed));
        self.with(move |c| {
            c.run(
                "UPDATE eviction_tombstones SET attempts = ?2, next_attempt_ms = ?3, owed = ?4 WHERE conversation = ?1",
                params![cv, attempts, next_attempt_ms, owed],
            )
            .map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn clear_tombstone(&self, conversation: &str) -> StoreResult<bool> {
        let cv = conversation.to_string();
        self.with(move |c| Ok(c.run("DELETE FROM eviction_tombstones WHERE conversation = ?1", params![cv]).map_err(db)? > 0)).await
    }

    async fn count_tombstones(&self) -> StoreResult<u64> {
        self.with(|c| {
            let n: i64 = c.row("SELECT count(*) FROM eviction_tombstones", [], |r| r.get(0)).map_err(db)?;
            Ok(n as u64)
        })
        .await
    }

    async fn set_user_limits(&self, user: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<()> {
        let user = user.to_string();
        let json = limits.map(|l| serde_json::to_string(l).unwrap_or_default());
        self.with(move |c| {
            match json {
                Some(j) => c.run(
                    "INSERT INTO user_limits (user_id, limits) VALUES (?1, ?2) ON CONFLICT(user_id) DO UPDATE SET limits = ?2",
                    params![user, j],
                ),
                None => c.run("DELETE FROM user_limits WHERE user_id = ?1", params![user]),
            }
            .map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn user_limits(&self, user: &str) -> StoreResult<Option<crate::limits::LimitOverrides>> {
        let user = user.to_string();
        self.with(move |c| {
            let j: Option<String> =
                c.row("SELECT limits FROM user_limits WHERE user_id = ?1", params![user], |r| r.get(0)).optional().map_err(db)?;
            j.map(|j| serde_json::from_str(&j).map_err(|e| StoreError::Corrupt(format!("user limits: {e}")))).transpose()
        })
        .await
    }

    async fn set_key_limits(&self, prefix: &str, limits: Option<&crate::limits::LimitOverrides>) -> StoreResult<usize> {
        let p = prefix.to_string();
        let json = limits.map(|l| serde_json::to_string(l).unwrap_or_default());
        self.with(move |c| {
            // Only when exactly one live key matches: an ambiguous prefix changes nothing.
            const ONE_LIVE_KEY: &str = "revoked = 0 AND substr(prefix, 1, length(?1)) = ?1 \
                 AND (SELECT count(*) FROM api_keys WHERE revoked = 0 AND substr(prefix, 1, length(?1)) = ?1) = 1";
            match json {
                Some(j) => c.run(
                    &format!(
                        "INSERT INTO key_limits (key_hash, limits) SELECT key_hash, ?2 FROM api_keys WHERE {ONE_LIVE_KEY} \
                         ON CONFLICT(key_hash) DO UPDATE SET limits = excluded.limits"
                    ),
                    params![p, j],
                ),
                None => c.run(&format!("DELETE FROM key_limits WHERE key_hash IN (SELECT key_hash FROM api_keys WHERE {ONE_LIVE_KEY})"), params![p]),
            }
            .map_err(db)
        })
        .await
    }

    async fn key_limits(&self, key_hash: &str) -> StoreResult<Option<crate::limits::LimitOverrides>> {
        let h = key_hash.to_string();
        self.with(move |c| {
            let j: Option<String> =
                c.row("SELECT limits FROM key_limits WHERE key_hash = ?1", params![h], |r| r.get(0)).optional().map_err(db)?;
            j.as_deref().map(parse_limits).transpose()
        })
        .await
    }

    async fn add_usage(&self, user: &str, u: UsageCounts) -> StoreResult<()> {
        let user = user.to_string();
        self.with(move |c| {
            c.run(
                "INSERT INTO usage (user_id, requests, prompt_tokens, cached_tokens, completion_tokens) VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT(user_id) DO UPDATE SET requests = requests + ?2, prompt_tokens = prompt_tokens + ?3, \
                 cached_tokens = cached_tokens + ?4, completion_tokens = completion_tokens + ?5",
                params![user, u.requests, u.prompt_tokens, u.cached_tokens, u.completion_tokens],
            )
            .map_err(db)?;
            Ok(())
        })
        .await
    }

    async fn usage(&self, user: &str) -> StoreResult<UsageCounts> {
        let user = user.to_string();
        self.with(move |c| {
            Ok(c.row(
                "SELECT requests, prompt_tokens, cached_tokens, completion_tokens FROM usage WHERE user_id = ?1",
                params![user],
                |r| {
                    Ok(UsageCounts {
                        requests: r.get(0)?,
                        prompt_tokens: r.get(1)?,
                        cached_tokens: r.get(2)?,
                        completion_tokens: r.get(3)?,
                    })
                },
            )
            .optional()
            .map_err(db)?
            .unwrap_or_default())
        })
        .await
    }
}

fn parse_limits(j: &str) -> StoreResult<crate::limits::LimitOverrides> {
    serde_json::from_str(j).map_err(|e| StoreError::Corrupt(format!("limits: {e}")))
}
