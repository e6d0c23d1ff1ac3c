//! The limit ledger every gateway replica on this database shares
//! ([`crate::limits::LimitLedger`], migration 8): a bucket's levels are rows of
//! `limit_buckets` (one per limit kind, with the database-clock time of the level),
//! its open streams rows of `limit_streams` stamped with the instance that holds them.
//!
//! A decision reads and writes a bucket's rows in one transaction under a
//! transaction-scoped advisory lock of the bucket (rows may not exist yet, so a row
//! lock cannot serialize the first two requests), so replicas admitting the same user
//! at once see each other's charges. The lock is held for three short statements, never
//! across a model call. Open streams count only while the holding instance's heartbeat
//! is live (`live_instances`), so a crashed replica's streams stop counting after the
//! same staleness period that hands its turns over; their rows are deleted by the next
//! decision on that bucket.

use super::admission::live_instances;
use super::*;
use crate::limits::{refilled, wait_until, LimitConfig, LimitLedger, Refused, OUTPUT_PER, PROMPT_PER, REQUESTS_PER, TURNS_PER};

/// The database's clock in unix seconds with fractions (bucket levels refill by it).
const DB_CLOCK: &str = "extract(epoch FROM clock_timestamp())::float8";

/// The row key of the limiter's bucket name (a user ID, or a user and key hash joined
/// by NUL, which PostgreSQL text cannot hold): its SHA-256 in hex, which also keeps user
/// names out of this table.
fn row_key(bucket: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bucket.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The advisory-lock key of a bucket's row key: its first 16 hex digits (a collision only
/// serializes two buckets' decisions).
fn lock_key(row: &str) -> i64 {
    u64::from_str_radix(&row[..16], 16).expect("hex") as i64
}

/// One limit of a bucket: its kind (the row's key), capacity and refill window.
struct Kind {
    name: &'static str,
    capacity: f64,
    per: std::time::Duration,
}

fn kinds(c: &LimitConfig) -> [Kind; 3] {
    [
        Kind { name: "turns", capacity: c.turns_per_minute, per: TURNS_PER },
        Kind { name: "prompt", capacity: c.prompt_tokens_per_hour, per: PROMPT_PER },
        Kind { name: "output", capacity: c.output_tokens_per_hour, per: OUTPUT_PER },
    ]
}

/// Locks `bucket` for the transaction and returns the database's time and the current
/// (refilled) level of each of `kinds` (full when the bucket has no row yet).
async fn levels(tx: &deadpool_postgres::Transaction<'_>, bucket: &str, kinds: &[Kind]) -> Result<(f64, Vec<f64>), tokio_postgres::Error> {
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(bucket)]).await?;
    let now: f64 = tx.query_one(&format!("SELECT {DB_CLOCK}"), &[]).await?.get(0);
    let rows = tx.query("SELECT kind, level, at FROM limit_buckets WHERE bucket = $1", &[&bucket]).await?;
    let level = |k: &Kind| {
        rows.iter()
            .find(|r| r.get::<_, &str>(0) == k.name)
            .map_or(k.capacity, |r| refilled(r.get(1), now - r.get::<_, f64>(2), k.capacity, k.per))
    };
    Ok((now, kinds.iter().map(level).collect()))
}

/// Writes `levels` of `kinds` for `bucket` at time `now`.
async fn store_levels(tx: &deadpool_postgres::Transaction<'_>, bucket: &str, kinds: &[Kind], levels: &[f64], now: f64) -> Result<(), tokio_postgres::Error> {
    let upsert = tx
        .prepare_cached(
            "INSERT INTO limit_buckets (bucket, kind, level, at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (bucket, kind) DO UPDATE SET level = EXCLUDED.level, at = EXCLUDED.at",
        )
        .await?;
    for (k, level) in kinds.iter().zip(levels) {
        tx.execute(&upsert, &[&bucket, &k.name, level, &now]).await?;
    }
    Ok(())
}

impl PostgresStore {
    async fn try_admit(&self, bucket: &str, c: &LimitConfig, prompt_tokens: Option<usize>) -> Result<Result<String, Refused>, StoreError> {
        let bucket = &row_key(bucket);
        let mut client = self.pool.get().await.map_err(pool_err)?;
        let tx = client.transaction().await.map_err(db)?;
        let kinds = kinds(c);
        let (now, mut levels) = levels(&tx, bucket, &kinds).await.map_err(db)?;
        // A dead instance's streams: no longer counted, and gone from here on.
        tx.execute(
            &format!("DELETE FROM limit_streams WHERE bucket = $1 AND instance NOT IN ({})", live_instances(2)),
            &[&bucket, &self.dead_after_secs],
        )
        .await
        .map_err(db)?;
        let open: i64 = tx.query_one("SELECT count(*) FROM limit_streams WHERE bucket = $1", &[&bucket]).await.map_err(db)?.get(0);
        if open as u64 >= c.open_streams as u64 {
            return Ok(Err(Refused { limit: "open_streams", retry_after: std::time::Duration::from_secs(1) }));
        }
        if let Some(prompt) = prompt_tokens {
            let needs = [1.0, prompt as f64, 1.0];
            let limits = ["turns_per_minute", "prompt_tokens_per_hour", "output_tokens_per_hour"];
            for ((k, level), (need, limit)) in kinds.iter().zip(&levels).zip(needs.iter().zip(limits)) {
                let w = wait_until(*level, *need, k.capacity, k.per);
                if !w.is_zero() {
                    return Ok(Err(Refused { limit, retry_after: w }));
                }
            }
            levels[0] -= 1.0;
            levels[1] -= prompt as f64;
            store_levels(&tx, bucket, &kinds, &levels, now).await.map_err(db)?;
        }
        let id = crate::request_id();
        tx.execute("INSERT INTO limit_streams (id, bucket, instance) VALUES ($1, $2, $3)", &[&id, &bucket, &self.instance]).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Ok(id))
    }
}

#[async_trait::async_trait]
impl LimitLedger for PostgresStore {
    async fn admit(&self, bucket: &str, config: &LimitConfig, prompt_tokens: Option<usize>) -> Result<Result<String, Refused>, StoreError> {
        self.try_admit(bucket, config, prompt_tokens).await
    }

    async fn close_stream(&self, id: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM limit_streams WHERE id = $1 AND instance = $2", &[&id, &self.instance]).await?;
        Ok(())
    }

    async fn charge_output(&self, bucket: &str, config: &LimitConfig, tokens: usize) -> Result<(), StoreError> {
        let bucket = &row_key(bucket);
        let mut client = self.pool.get().await.map_err(pool_err)?;
        let tx = client.transaction().await.map_err(db)?;
        let kinds = [Kind { name: "output", capacity: config.output_tokens_per_hour, per: OUTPUT_PER }];
        let (now, levels) = levels(&tx, bucket, &kinds).await.map_err(db)?;
        store_levels(&tx, bucket, &kinds, &[levels[0] - tokens as f64], now).await.map_err(db)?;
        tx.commit().await.map_err(db)
    }

    async fn admit_request(&self, owner: &str, per_minute: f64) -> Result<Result<(), Refused>, StoreError> {
        let mut client = self.pool.get().await.map_err(pool_err)?;
        let tx = client.transaction().await.map_err(db)?;
        // Its own bucket name: conversation requests never share a row with a user's turns.
        let bucket = row_key(&format!("requests\0{owner}"));
        let kinds = [Kind { name: "requests", capacity: per_minute, per: REQUESTS_PER }];
        let (now, levels) = levels(&tx, &bucket, &kinds).await.map_err(db)?;
        let w = wait_until(levels[0], 1.0, per_minute, REQUESTS_PER);
        if !w.is_zero() {
            return Ok(Err(Refused { limit: "conversation_requests_per_minute", retry_after: w }));
        }
        store_levels(&tx, &bucket, &kinds, &[levels[0] - 1.0], now).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Ok(()))
    }
}
