//! The gateway over HTTP with the PostgreSQL store (a real server the test
//! starts, tests/pg) in front of the real engine: a multi-turn conversation
//! whose second prompt extends the first turn's token IDs exactly, the same
//! conversation seen by a second gateway replica sharing the database, and a
//! 503 (not a panic or a 500) while the database is down.

use crate::common;

use baton_api_gateway::client::{Client, Method, StatusCode};
use baton::local_generator::LocalGenerator;
use baton_api_gateway::store::ConversationStore;
use baton_api_gateway::auth;
use baton_engine::Engine;
use serde_json::{json, Value};
use std::sync::Arc;

/// A gateway replica on 127.0.0.1:0 over the store at `db`; returns its base URL.
async fn replica(db: &str, engine: &Arc<Engine>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let config = common::config(["gateway", "--db", db]);
    let store = baton_api_gateway::open_store(&config).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let generator = Arc::new(LocalGenerator::new(engine.clone()));
    let (_, base) = common::serve_local(config, generator, store, engine, async move {
        let _ = rx.await;
    })
    .await;
    (base, tx)
}

async fn turn(c: &Client, conv: &str, id: &str, message: &str) -> Value {
    let body = json!({"turn_id": id, "message": message, "max_tokens": 8, "temperature": 0, "stream": false});
    let (st, v) = c.json(Method::POST, &format!("/v1/conversations/{conv}/turns"), Some(&body)).await.unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multi_turn_conversation_over_postgres() {
    let Some((engine, mut pg)) = common::engine_and_postgres() else { return };
    let url = pg.url();
    let (base, _stop) = replica(&url, &engine).await;
    let (base2, _stop2) = replica(&url, &engine).await;
    let store = baton_api_gateway::store::PostgresStore::connect(&url).await.unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let bob = auth::create_key(&store, "bob", "test").await.unwrap();
    let c = Client::new(base.clone(), Some(key.clone()));

    let (st, v) = c.json(Method::POST, "/v1/conversations", Some(&json!({"title": "t"}))).await.unwrap();
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let conv = v["id"].as_str().unwrap().to_string();
    let r1 = turn(&c, &conv, "a1", "Hi! Who are you?").await;
    let r2 = turn(&c, &conv, "a2", "And what can you do?").await;
    // The same turn ID again is the stored reply, not a new generation.
    assert_eq!(turn(&c, &conv, "a2", "And what can you do?").await["reply"], r2["reply"]);

    let turns = store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[0].reply_text, r1["reply"].as_str().unwrap());
    let mut expect = turns[0].prompt_ids.clone();
    expect.extend_from_slice(&turns[0].output_ids);
    assert!(!turns[0].output_ids.is_empty());
    assert!(turns[1].prompt_ids.starts_with(&expect), "turn 2's prompt must extend turn 1's prompt and reply token IDs exactly");

    // Another replica over the same database serves the same history, to its owner only.
    let (st, v) = Client::new(base2.clone(), Some(key)).json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["turns"].as_array().unwrap().len(), 2);
    let (st, _) = Client::new(base2, Some(bob)).json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::NOT_FOUND, "another user's conversation must be invisible");

    // The database goes away: a clean 503 with the OpenAI error shape.
    pg.stop();
    let (st, v) = c.json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable");
    pg.spawn();
    engine.shutdown();
}
