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
/// in place at open: its conversations keep their rows and gain empty metadata and no
/// summary range, and each migration runs once.
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
    assert_eq!(v, 3, "every migration (conversation and turn metadata, the summary's range) applied");
    assert_eq!(store.summary_through("c-old", 0).await.unwrap(), None, "an old row has no reusable summary");
}

/// Issue #39: a deleted conversation's text survived in the `-wal` file (every commit's
/// pages are appended there until a checkpoint, and `secure_delete` only zeroes the
/// database's own pages). While the store is still open, after a delete and after the
/// retention job's delete, no byte of the deleted text is left in the database, its
/// WAL or its shared-memory file; a conversation that was not deleted still is.
#[tokio::test(flavor = "multi_thread")]
async fn deleted_text_is_gone_from_every_file_of_the_database() {
    use baton_api_gateway::store::{conformance::streaming_turn, now_unix, ConversationStore, LogEntry, TurnEnd, TurnState};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gw.db");
    let store = SqliteStore::open(&path).unwrap();
    let files = || -> Vec<u8> {
        let mut bytes = Vec::new();
        for name in ["gw.db", "gw.db-wal", "gw.db-shm"] {
            bytes.extend(std::fs::read(dir.path().join(name)).unwrap_or_default());
        }
        bytes
    };
    let holds = |bytes: &[u8], marker: &str| bytes.windows(marker.len()).any(|w| w == marker.as_bytes());
    // One conversation per way of deleting it, and one that stays.
    let kept = "kept-walnut-5512";
    let mut written = Vec::new();
    for id in ["c-deleted", "c-expired", "c-kept"] {
        if id == "c-kept" {
            // Written after the deletions below, so the retention job cannot take it.
            continue;
        }
        let at = now_unix();
        let marker = format!("{id}-zebra-quartz-7781");
        let mut conv = conformance::conv(id, "alice", at);
        conv.title = marker.clone();
        store.create_conversation(&conv).await.unwrap();
        store.set_summary(id, &marker.repeat(40), None).await.unwrap();
        let turn = baton_api_gateway::store::Turn { user_text: marker.repeat(200), ..streaming_turn(id, "t1") };
        store.begin_turn(&turn).await.unwrap();
        let log: Vec<LogEntry> = (0..50).map(|i| LogEntry { index: i, text: format!("{marker} {i}") }).collect();
        store.append_log(id, "t1", &log).await.unwrap();
        let end = TurnEnd {
            state: TurnState::Done,
            reply_text: marker.repeat(100),
            output_ids: vec![1, 2],
            finish_reason: "stop".into(),
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: 2,
        };
        store.finish_turn(id, "t1", &end).await.unwrap();
        written.push(marker);
    }
    for marker in &written {
        assert!(holds(&files(), marker), "the test's text must be on disk before the delete");
    }
    assert!(store.delete_conversation("alice", "c-deleted", 0).await.unwrap());
    assert_eq!(store.delete_older_than(now_unix() + 10).await.unwrap(), vec!["c-expired".to_string()]);
    let bytes = files();
    for marker in &written {
        assert!(!holds(&bytes, marker), "{marker}: deleted text is still in the database's files");
    }
    // A conversation nobody deleted stays, in the files and in the store.
    let mut conv = conformance::conv("c-kept", "alice", now_unix());
    conv.title = kept.to_string();
    store.create_conversation(&conv).await.unwrap();
    assert!(holds(&files(), kept));
    assert!(store.get_conversation("alice", "c-kept").await.unwrap().is_some());
}
