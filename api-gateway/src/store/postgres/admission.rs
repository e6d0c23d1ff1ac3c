//! Admission across replicas: each store instance keeps a heartbeat row stamped with the
//! database's clock, so live and dead replicas are told apart without trusting their
//! clocks; a turn is begun in one transaction that takes over a dead replica's turn and
//! fences it from that replica's late writes, while the unique indexes of the schema
//! (one turn per place, one streaming turn per conversation) decide races.

use super::*;

/// How often an instance refreshes its heartbeat row: six beats per staleness
/// period, so a few slow beats never make a live replica look dead.
pub(super) fn heartbeat_every(dead_after: Duration) -> Duration {
    (dead_after / 6).clamp(Duration::from_millis(100), Duration::from_secs(10))
}

/// The database's clock in unix seconds (heartbeats and staleness use it alone).
const DB_NOW: &str = "extract(epoch FROM clock_timestamp())::bigint";

/// IDs of live instances: those whose heartbeat is at most `$n` seconds old.
pub(super) fn live_instances(n: usize) -> String {
    format!("SELECT id FROM gateway_instances WHERE seen_at >= {DB_NOW} - ${n}")
}

/// Runs `insert`, an INSERT of [`TURN_COLS`] and `instance` (`$1` to `$17`), for `t`
/// in `state`: the one place the turn's values are listed in the columns' order.
async fn insert_turn(tx: &deadpool_postgres::Transaction<'_>, insert: &tokio_postgres::Statement, t: &Turn, state: TurnState, instance: &str) -> Result<u64, tokio_postgres::Error> {
    tx.execute(
        insert,
        &[
            &t.conversation,
            &t.turn_id,
            &t.seq,
            &t.request_hash,
            &t.user_text,
            &t.reply_text,
            &ids_to_bytes(&t.prompt_ids),
            &ids_to_bytes(&t.output_ids),
            &i64::from(t.system_prompt_version),
            &state.as_str(),
            &t.finish_reason,
            &t.prompt_tokens,
            &t.cached_tokens,
            &t.completion_tokens,
            &t.created_at,
            &metadata_to_json(&t.metadata),
            &instance,
        ],
    )
    .await
}

/// Why `try_begin_turn` failed: the driver's error (a unique violation is
/// read by the caller) or a row that does not parse.
pub(super) enum BeginError {
    Pg(tokio_postgres::Error),
    Store(StoreError),
}

impl From<tokio_postgres::Error> for BeginError {
    fn from(e: tokio_postgres::Error) -> Self {
        BeginError::Pg(e)
    }
}

impl From<StoreError> for BeginError {
    fn from(e: StoreError) -> Self {
        BeginError::Store(e)
    }
}

/// Stops the heartbeat task when the last clone of the store goes.
pub(super) struct HeartbeatGuard(pub(super) tokio::task::JoinHandle<()>);

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) async fn beat(pool: &Pool, instance: &str) -> StoreResult<()> {
    let c = pool.get().await.map_err(pool_err)?;
    let st = c
        .prepare_cached(
            &format!("INSERT INTO gateway_instances (id, seen_at) VALUES ($1, {DB_NOW}) ON CONFLICT (id) DO UPDATE SET seen_at = EXCLUDED.seen_at"),
        )
        .await
        .map_err(db)?;
    c.execute(&st, &[&instance]).await.map_err(db)?;
    Ok(())
}

/// Beats every `every` from one period after the start: `connect` beats once itself
/// before it returns, and a first beat of this task arriving late (a loaded machine)
/// would otherwise refresh the row at an unpredictable moment after it.
pub(super) async fn heartbeat(pool: Pool, instance: String, every: Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = beat(&pool, &instance).await {
            tracing::warn!(kind = e.label(), error = %e, "postgres store heartbeat failed");
        }
    }
}

impl PostgresStore {
    /// [`ConversationStore::begin_turn`] in one transaction; a unique violation
    /// is the caller's to read.
    pub(super) async fn try_begin_turn(&self, c: &mut deadpool_postgres::Client, t: &Turn) -> Result<BeginTurn, BeginError> {
        let tx = c.transaction().await?;
        // Column 16: whether a live replica holds the row (this one, or one whose heartbeat is fresh).
        let select = tx
            .prepare_cached(&format!(
                "SELECT {TURN_COLS}, instance IS NOT NULL AND (instance = $3 OR instance IN ({})) \
                 FROM turns WHERE conversation = $1 AND turn_id = $2 FOR UPDATE",
                live_instances(4)
            ))
            .await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&t.conversation, &t.turn_id, &self.instance, &self.dead_after_secs];
        if let Some(row) = tx.query_opt(&select, &params).await? {
            let existing = turn_from_row(&row)?;
            let held: bool = get(&row, 16)?;
            let retry = existing.request_hash == t.request_hash
                && (existing.state == TurnState::Failed || (existing.state == TurnState::Streaming && !held));
            if !retry {
                return Ok(BeginTurn::Existing(Box::new(existing)));
            }
            // A retry of a failed turn, or of one whose replica died, generates
            // again: drop the old row and its log in this transaction.
            if existing.state == TurnState::Streaming {
                tracing::warn!(conversation = %t.conversation, turn = %t.turn_id, "taking over a turn whose replica stopped");
            }
            let del = tx.prepare_cached("DELETE FROM turns WHERE conversation = $1 AND turn_id = $2").await?;
            tx.execute(&del, &[&t.conversation, &t.turn_id]).await?;
        }
        // A dead replica's turn of another ID no longer blocks the conversation; owned
        // by nobody, it is fenced from that replica's late writes too.
        let orphans = tx
            .prepare_cached(&format!(
                "UPDATE turns SET state = 'failed', finish_reason = 'interrupted', instance = NULL WHERE conversation = $1 \
                 AND turn_id <> $2 AND state = 'streaming' AND (instance IS NULL OR (instance <> $3 AND instance NOT IN ({})))",
                live_instances(4)
            ))
            .await?;
        tx.execute(&orphans, &params).await?;
        let insert = tx
            .prepare_cached(&format!(
                "INSERT INTO turns ({TURN_COLS}, instance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) \
                 ON CONFLICT (conversation, turn_id) DO NOTHING"
            ))
            .await?;
        let inserted = insert_turn(&tx, &insert, t, TurnState::Streaming, &self.instance).await?;
        if inserted == 0 {
            // Another replica inserted the same turn ID after our SELECT; its row wins.
            let row = tx.query_one(&select, &params).await?;
            return Ok(BeginTurn::Existing(Box::new(turn_from_row(&row)?)));
        }
        let touch = tx.prepare_cached("UPDATE conversations SET updated_at = $2 WHERE id = $1").await?;
        tx.execute(&touch, &[&t.conversation, &now_unix()]).await?;
        tx.commit().await?;
        Ok(BeginTurn::Created)
    }

    /// [`ConversationStore::replace_turns`] in one transaction that locks the
    /// conversation's row; a unique violation (another replica's turn took a place
    /// meanwhile) is the caller's to read as busy.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn try_replace_turns(
        &self,
        c: &mut deadpool_postgres::Client,
        owner: &str,
        conversation: &str,
        last_seq: Option<i64>,
        from_seq: i64,
        turns: &[Turn],
        evict_first_retry_ms: Option<i64>,
    ) -> Result<Replaced, BeginError> {
        let tx = c.transaction().await?;
        let found = tx.prepare_cached("SELECT 1 FROM conversations WHERE id = $1 AND owner = $2 FOR UPDATE").await?;
        if tx.query_opt(&found, &[&conversation, &owner]).await?.is_none() {
            return Ok(Replaced::NotFound);
        }
        let state = tx.prepare_cached("SELECT max(seq), count(*) FILTER (WHERE state = 'streaming') FROM turns WHERE conversation = $1").await?;
        let row = tx.query_one(&state, &[&conversation]).await?;
        let (last, streaming): (Option<i64>, i64) = (get(&row, 0)?, get(&row, 1)?);
        if streaming > 0 || last != last_seq {
            return Ok(Replaced::Busy);
        }
        let del = tx.prepare_cached("DELETE FROM turns WHERE conversation = $1 AND seq >= $2").await?;
        tx.execute(&del, &[&conversation, &from_seq]).await?;
        // A summary of turns being rewritten no longer says what they say.
        let drop_summary = tx
            .prepare_cached("UPDATE conversations SET summary = NULL, summary_through = NULL WHERE id = $1 AND summary_through >= $2")
            .await?;
        tx.execute(&drop_summary, &[&conversation, &from_seq]).await?;
        let insert = tx
            .prepare_cached(&format!(
                "INSERT INTO turns ({TURN_COLS}, instance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)"
            ))
            .await?;
        for t in turns {
            insert_turn(&tx, &insert, t, t.state, &self.instance).await?;
        }
        if let Some(due) = evict_first_retry_ms {
            let tomb = tx
                .prepare_cached(
                    "INSERT INTO eviction_tombstones (conversation, created_at, attempts, next_attempt_ms, owed) VALUES ($1, $2, 0, $3, '[]') \
                     ON CONFLICT (conversation) DO UPDATE SET next_attempt_ms = LEAST(eviction_tombstones.next_attempt_ms, EXCLUDED.next_attempt_ms)",
                )
                .await?;
            tx.execute(&tomb, &[&conversation, &now_unix(), &due]).await?;
        }
        let touch = tx.prepare_cached("UPDATE conversations SET updated_at = $2 WHERE id = $1").await?;
        tx.execute(&touch, &[&conversation, &now_unix()]).await?;
        tx.commit().await?;
        Ok(Replaced::Done)
    }
}
