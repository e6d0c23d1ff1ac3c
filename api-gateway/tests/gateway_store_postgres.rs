//! The PostgreSQL conversation store against a real server each test starts
//! itself (tests/pg): the conformance suite, versioned idempotent migration,
//! concurrent replicas beginning the same turn, crash recovery that spares a
//! live replica's turns, and a lost connection answered as "unavailable"
//! (503) then recovered without a restart.

mod pg;

use baton_api_gateway::error::ApiError;
use baton_api_gateway::store::postgres::MIGRATIONS;
use baton_api_gateway::store::{
    conformance, now_unix, BeginTurn, Conversation, ConversationStore, PostgresStore, StoreError, TurnState,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn conv(id: &str) -> Conversation {
    conformance::conv(id, "alice", now_unix())
}

async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_conforms_and_migrates_once() {
    let Some(pg) = pg::TempPostgres::start() else { return };
    let store = PostgresStore::connect(&pg.url()).await.unwrap();
    conformance::run_all(&store).await;
    let latest = MIGRATIONS.last().unwrap().0;
    assert_eq!(store.schema_version().await.unwrap(), latest);
    // A second replica (or a restart) finds the schema current and keeps the data.
    let again = PostgresStore::connect(&pg.url()).await.unwrap();
    assert_eq!(again.schema_version().await.unwrap(), latest);
    assert!(again.get_conversation("alice", "c-own").await.unwrap().is_some(), "a restart must keep the data");
    let c = raw(&pg.url()).await;
    let n: i64 = c.query_one("SELECT count(*) FROM baton_schema_migrations", &[]).await.unwrap().get(0);
    assert_eq!(n, MIGRATIONS.len() as i64, "each migration is applied exactly once");
    // A schema newer than this gateway is refused with a clear error.
    c.execute("INSERT INTO baton_schema_migrations VALUES ($1, 0)", &[&(latest + 1)]).await.unwrap();
    let e = PostgresStore::connect(&pg.url()).await.err().expect("a newer schema must be refused");
    assert!(e.to_string().contains("newer than this gateway"), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_starting_together_migrate_once() {
    let Some(pg) = pg::TempPostgres::start() else { return };
    let url = pg.url();
    let stores = futures::future::join_all((0..4).map(|_| PostgresStore::connect(&url))).await;
    for s in &stores {
        assert!(s.is_ok(), "{:?}", s.as_ref().err());
    }
    let n: i64 = raw(&url).await.query_one("SELECT count(*) FROM baton_schema_migrations", &[]).await.unwrap().get(0);
    assert_eq!(n, MIGRATIONS.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replicas_create_a_turn_once() {
    let Some(pg) = pg::TempPostgres::start() else { return };
    let a: Arc<dyn ConversationStore> = Arc::new(PostgresStore::connect(&pg.url()).await.unwrap());
    let b: Arc<dyn ConversationStore> = Arc::new(PostgresStore::connect(&pg.url()).await.unwrap());
    a.create_conversation(&conv("c1")).await.unwrap();
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { s.begin_turn(&conformance::streaming_turn("c1", "t1")).await.unwrap() })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        match t.await.unwrap() {
            BeginTurn::Created => created += 1,
            BeginTurn::Existing(e) => assert_eq!(e.state, TurnState::Streaming),
            BeginTurn::Busy => panic!("the same turn ID is never busy with itself"),
        }
    }
    assert_eq!(created, 1, "20 concurrent begins of one turn ID over two replicas must create it once");
    assert_eq!(b.list_turns("c1").await.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarting_replica_spares_a_live_replicas_turns() {
    let Some(pg) = pg::TempPostgres::start() else { return };
    let live = PostgresStore::connect(&pg.url()).await.unwrap();
    live.create_conversation(&conv("c1")).await.unwrap();
    live.begin_turn(&conformance::streaming_turn("c1", "t1")).await.unwrap();
    let restarted = PostgresStore::connect(&pg.url()).await.unwrap();
    assert_eq!(restarted.fail_streaming_turns().await.unwrap(), 0, "another live replica's streaming turn must be left alone");
    assert_eq!(live.get_turn("c1", "t1").await.unwrap().unwrap().state, TurnState::Streaming);
    // Once that replica's heartbeat is stale, its turn was interrupted.
    raw(&pg.url()).await.execute("UPDATE gateway_instances SET seen_at = 0", &[]).await.unwrap();
    assert_eq!(restarted.fail_streaming_turns().await.unwrap(), 1);
    assert_eq!(live.get_turn("c1", "t1").await.unwrap().unwrap().state, TurnState::Failed);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_server_is_unavailable_then_recovers() {
    let Some(mut pg) = pg::TempPostgres::start() else { return };
    let store = PostgresStore::connect(&pg.url()).await.unwrap();
    store.create_conversation(&conv("c1")).await.unwrap();
    pg.stop();
    let t = Instant::now();
    let e = store.get_conversation("alice", "c1").await.expect_err("the server is down");
    assert!(matches!(e, StoreError::Unavailable(_)), "a lost connection must be Unavailable, got {e:?}");
    assert!(t.elapsed() < Duration::from_secs(15), "failing took {:?}", t.elapsed());
    let api = ApiError::from(e);
    assert_eq!(api.status.as_u16(), 503);
    assert_eq!(api.error_type, "service_unavailable");
    assert!(!api.message.contains("postgres"), "internal details must not reach the client: {}", api.message);

    pg.spawn();
    // The pool reconnects on its own; a connection that has not yet noticed
    // the restart may fail once more, and only as Unavailable.
    let mut got = None;
    for _ in 0..3 {
        match store.get_conversation("alice", "c1").await {
            Ok(c) => {
                got = c;
                break;
            }
            Err(e) => assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}"),
        }
    }
    assert_eq!(got.map(|c| c.id).as_deref(), Some("c1"), "the store must recover after the server is back");
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_failures_are_clear_and_hide_the_password() {
    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("postgres://baton:s3cret@127.0.0.1:{port}/baton");
    let e = PostgresStore::connect(&url).await.err().expect("no server");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    assert!(msg.contains("cannot connect to postgres://baton:***@127.0.0.1"), "{msg}");
    assert!(!msg.contains("s3cret"), "{msg}");
    let e = PostgresStore::connect("postgres://u@127.0.0.1:notaport/x").await.err().expect("bad URL");
    assert!(e.to_string().contains("invalid PostgreSQL URL"), "{e}");
}

/// A database at schema version 4 (before conversations had metadata) is migrated by
/// the next gateway: its conversations keep their rows and gain empty metadata, which
/// their owner (only) can then set.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_4_database_gains_metadata_and_keeps_its_rows() {
    let Some(pg) = pg::TempPostgres::start() else { return };
    let c = raw(&pg.url()).await;
    c.batch_execute("CREATE TABLE baton_schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)").await.unwrap();
    for (v, sql) in MIGRATIONS.iter().filter(|(v, _)| *v <= 4) {
        c.batch_execute(sql).await.unwrap();
        c.execute("INSERT INTO baton_schema_migrations VALUES ($1, 0)", &[v]).await.unwrap();
    }
    c.execute(
        "INSERT INTO conversations (id, owner, title, system_prompt_version, created_at, updated_at) VALUES ('c-old', 'alice', 'before', 1, 5, 5)",
        &[],
    )
    .await
    .unwrap();
    let store = PostgresStore::connect(&pg.url()).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), MIGRATIONS.last().unwrap().0);
    let got = store.get_conversation("alice", "c-old").await.unwrap().expect("the old row must survive the migration");
    assert_eq!((got.title.as_str(), got.created_at), ("before", 5));
    assert!(got.metadata.is_empty());
    let mut m = serde_json::Map::new();
    m.insert("k".into(), "v".into());
    assert!(!store.set_metadata("bob", "c-old", &m).await.unwrap(), "another user must not set metadata");
    assert!(store.set_metadata("alice", "c-old", &m).await.unwrap());
    assert_eq!(store.get_conversation("alice", "c-old").await.unwrap().unwrap().metadata, m);
}
