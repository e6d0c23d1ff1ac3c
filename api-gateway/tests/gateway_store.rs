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
