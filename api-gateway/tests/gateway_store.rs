//! The conversation store's conformance suite over every implementation
//! (SQLite, in memory and on disk).

use baton_api_gateway::store::{conformance, SqliteStore};

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_in_memory_conforms() {
    conformance::run_all(&SqliteStore::in_memory().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_file_conforms_and_uses_wal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let store = SqliteStore::open(&path).unwrap();
    conformance::run_all(&store).await;
    assert!(dir.path().join("s.db-wal").exists(), "WAL mode");
    drop(store);
}

/// A database written before conversations and responses had metadata (schema version 0) is migrated
/// in place at open: its conversations keep their rows and gain empty metadata, and the
/// migration runs once.
#[tokio::test(flavor = "multi_thread")]
async fn sqlite_migrates_a_database_without_metadata() {
    use baton_api_gateway::store::ConversationStore;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE conversations (id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL, \
             system_prompt_version INTEGER NOT NULL, summary TEXT, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL);
             INSERT INTO conversations VALUES ('c-old', 'alice', 'before', 1, NULL, 5, 5);",
        )
        .unwrap();
    }
    let store = SqliteStore::open(&path).unwrap();
    let c = store.get_conversation("alice", "c-old").await.unwrap().expect("the old row must survive the migration");
    assert_eq!((c.title.as_str(), c.created_at), ("before", 5));
    assert!(c.metadata.is_empty());
    let mut m = serde_json::Map::new();
    m.insert("k".into(), "v".into());
    assert!(store.set_metadata("alice", "c-old", &m).await.unwrap());
    drop(store);
    // Opening again finds the schema current (no second ALTER, which would fail).
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.get_conversation("alice", "c-old").await.unwrap().unwrap().metadata, m);
    let v: i64 = rusqlite::Connection::open(&path).unwrap().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 2, "both migrations (conversation and response metadata) applied");
}
