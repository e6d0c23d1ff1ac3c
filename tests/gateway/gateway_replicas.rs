//! Two gateway replicas over one real PostgreSQL (a server the test starts,
//! api-gateway/tests/pg) in front of the real engine: a conversation never
//! forks, whichever replica a turn reaches.
//!
//! - Concurrent turns of one conversation through the two replicas: exactly one
//!   is accepted, the other is a 409, one turn is stored.
//! - A retry of a turn through the other replica attaches while the turn runs and
//!   replays it once finished, with the same events; stored once; another user's
//!   retry is a 404.
//! - A replica killed mid-turn (its runtime shut down: no more writes, no more
//!   heartbeat): the retry through the other replica takes the turn over once the
//!   heartbeat is stale and generates it again; stored once.
//! - The store fences a replica that was taken over: its late writes are dropped.
//!
//! Each replica runs on its own Tokio runtime, so killing one stops every task it
//! had (server, turn runner, heartbeat) at once, as a crash does.

use crate::common;

use baton_api_gateway::client::{Client, Method, Response, StatusCode};
use baton::local_generator::LocalGenerator;
use baton_api_gateway::generator::{
    Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator,
};
use baton_api_gateway::store::{ConversationStore, LogEntry, PostgresStore, TurnState};
use baton_api_gateway::auth;
use baton_engine::Engine;
use serde_json::{json, Value};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_stream::Stream;

/// Holds the engine's generations where a test wants them: before they start
/// (so that two replicas reach admission together) or after `free` tokens (so
/// that a turn stays in progress). Only delays; every token is the engine's.
#[derive(Clone)]
struct Gate {
    arrived: Arc<AtomicUsize>,
    start: watch::Sender<bool>,
    tokens: watch::Sender<bool>,
    free: usize,
}

impl Gate {
    fn new(start_open: bool, tokens_open: bool, free: usize) -> Self {
        Gate {
            arrived: Arc::new(AtomicUsize::new(0)),
            start: watch::channel(start_open).0,
            tokens: watch::channel(tokens_open).0,
            free,
        }
    }

    async fn wait_arrived(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.arrived.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "{n} generations never arrived");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn opened(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|open| *open).await;
}

struct Gated {
    inner: Arc<dyn Generator>,
    gate: Gate,
}

/// A generation whose events after the first `free` wait for the token gate.
struct Held {
    inner: GenerationStream,
    free: usize,
    gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Stream for Held {
    type Item = GenEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        if self.free == 0 {
            if let Some(g) = self.gate.as_mut() {
                if g.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.gate = None;
            }
        }
        let r = self.inner.as_mut().poll_next(cx);
        if matches!(r, Poll::Ready(Some(_))) {
            self.free = self.free.saturating_sub(1);
        }
        r
    }
}

// `Generator` is an `async_trait`; this is the signature that macro writes.
impl Generator for Gated {
    fn generate<'l, 'a>(
        &'l self,
        req: GenerateRequest,
    ) -> Pin<Box<dyn Future<Output = Result<GenerationStream, GenerateError>> + Send + 'a>>
    where
        'l: 'a,
        Self: 'a,
    {
        Box::pin(async move {
            self.gate.arrived.fetch_add(1, Ordering::SeqCst);
            opened(self.gate.start.subscribe()).await;
            let inner = self.inner.generate(req).await?;
            let gate: Pin<Box<dyn Future<Output = ()> + Send>> =
                Box::pin(opened(self.gate.tokens.subscribe()));
            Ok(Box::pin(Held {
                inner,
                free: self.gate.free,
                gate: Some(gate),
            }) as GenerationStream)
        })
    }

    fn evict_conversation<'l, 'c, 'a>(
        &'l self,
        conversation: &'c baton_vocab::ConversationId,
    ) -> Pin<Box<dyn Future<Output = Result<Eviction, GenerateError>> + Send + 'a>>
    where
        'l: 'a,
        'c: 'a,
        Self: 'a,
    {
        self.inner.evict_conversation(conversation)
    }
}

/// One gateway replica on its own runtime; [`Replica::kill`] stops all of it at once.
struct Replica {
    base: String,
    rt: Option<tokio::runtime::Runtime>,
}

impl Replica {
    async fn start(db: &str, engine: &Arc<Engine>, gate: Gate, flags: &[&str]) -> Replica {
        let mut argv = vec!["gateway", "--db", db, "--resume-grace-seconds", "30"];
        argv.extend_from_slice(flags);
        let config = common::config(argv);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let engine = engine.clone();
        let base = rt
            .spawn(async move {
                let store = baton_api_gateway::open_store(&config).await.unwrap();
                let generator = Arc::new(Gated {
                    inner: Arc::new(LocalGenerator::new(engine.clone())),
                    gate,
                });
                common::serve_local(config, generator, store, &engine, std::future::pending()).await.1
            })
            .await
            .unwrap();
        Replica { base, rt: Some(rt) }
    }

    fn client(&self, key: &str) -> Client {
        Client::new(self.base.clone(), Some(key.to_string()))
    }

    /// Every task of the replica stops where it is, as in a crash.
    fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn new_conversation(c: &Client) -> String {
    let (st, v) = c
        .json(
            Method::POST,
            "/v1/conversations",
            Some(&json!({"title": "t"})),
        )
        .await
        .unwrap();
    assert_eq!(st, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn turn_body(turn_id: &str, message: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"turn_id": turn_id, "message": message, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// Every SSE event of a turn as (id, event, data).
async fn events(
    c: &Client,
    conv: &str,
    body: &Value,
) -> (StatusCode, Vec<(String, String, Value)>) {
    let mut r = post_turn(c, &format!("/v1/conversations/{conv}/turns"), body, &[]).await;
    let status = r.status;
    if status != StatusCode::OK {
        return (status, Vec::new());
    }
    (status, read_events(&mut r).await)
}

/// Every SSE event left in `r` as (id, event, data); every event's data must be JSON.
async fn read_events(r: &mut Response) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    while let Some(ev) = r.next_event().await.unwrap() {
        out.push((
            ev.id.unwrap_or_default(),
            ev.event.unwrap_or_default(),
            serde_json::from_str::<Value>(&ev.data).unwrap(),
        ));
    }
    out
}

/// Posts a turn `body` to `path`, returning the response as it starts (status and headers read).
async fn post_turn(c: &Client, path: &str, body: &Value, headers: &[(&str, &str)]) -> Response {
    c.send(Method::POST, path, Some(body.to_string().into_bytes()), headers).await.unwrap()
}

/// Posts a JSON `body` to `path` and returns the status and JSON reply.
async fn post_json(c: &Client, path: &str, body: &Value) -> (StatusCode, Value) {
    c.json(Method::POST, path, Some(body)).await.unwrap()
}

/// The stored token log of a turn, through a separate store instance.
async fn log_of(store: &PostgresStore, conv: &str, turn: &str) -> Vec<LogEntry> {
    store.read_log(conv, turn, 0).await.unwrap()
}

/// The log is stored once: indices 0..n, and its text is the stored reply.
fn assert_stored_once(log: &[LogEntry], reply: &str) {
    assert!(
        log.iter().enumerate().all(|(i, e)| e.index == i as i64),
        "log indices must be 0..n once each: {log:?}"
    );
    assert_eq!(
        log.iter().map(|e| e.text.as_str()).collect::<String>(),
        reply,
        "the log must be the stored reply, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_turns_through_two_replicas_admit_one() {
    let Some((engine, pg)) = common::engine_and_postgres() else { return };
    let url = pg.url();
    let (g1, g2) = (Gate::new(false, true, 0), Gate::new(false, true, 0));
    let r1 = Replica::start(&url, &engine, g1.clone(), &[]).await;
    let r2 = Replica::start(&url, &engine, g2.clone(), &[]).await;
    let store = PostgresStore::connect(&url).await.unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let conv = new_conversation(&r1.client(&key)).await;

    // Both replicas admit their turn up to the model call, then both go on at once.
    let path = format!("/v1/conversations/{conv}/turns");
    let (c1, c2) = (r1.client(&key), r2.client(&key));
    let (p1, p2) = (path.clone(), path.clone());
    let a = tokio::spawn(async move { post_json(&c1, &p1, &turn_body("t-a", "Hi! Who are you?", 8, false)).await });
    let b = tokio::spawn(async move { post_json(&c2, &p2, &turn_body("t-b", "What is 2+2?", 8, false)).await });
    g1.wait_arrived(1).await;
    g2.wait_arrived(1).await;
    g1.start.send_replace(true);
    g2.start.send_replace(true);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::CONFLICT],
        "exactly one turn accepted: {a:?} {b:?}"
    );
    let (conflict, accepted) = if a.0 == StatusCode::CONFLICT {
        (&a.1, &b.1)
    } else {
        (&b.1, &a.1)
    };
    assert_eq!(conflict["error"]["type"], "conflict_error", "{conflict}");
    assert_eq!(accepted["state"], "done", "{accepted}");
    let turns = store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 1, "one turn stored: {turns:?}");
    assert_eq!(turns[0].turn_id, accepted["turn_id"].as_str().unwrap());

    // A new turn while another replica's turn is in progress is a 409 too (the one
    // before it finished, so the conversation is free again).
    g1.tokens.send_replace(false);
    let held = post_turn(&r1.client(&key), &path, &turn_body("t-c", "Tell me a story.", 16, true), &[]).await;
    assert_eq!(held.status, StatusCode::OK);
    let (st, v) = post_json(&r2.client(&key), &path, &turn_body("t-d", "And then?", 8, false)).await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["type"], "conflict_error", "{v}");
    g1.tokens.send_replace(true);
    held.bytes().await.unwrap();
    let turns = store.list_turns(&conv).await.unwrap();
    assert_eq!(
        turns
            .iter()
            .map(|t| t.turn_id.as_str())
            .collect::<Vec<_>>()
            .len(),
        2,
        "{turns:?}"
    );
    assert!(
        turns
            .iter()
            .all(|t| t.state == TurnState::Done || t.state == TurnState::Stopped),
        "{turns:?}"
    );
    drop((r1, r2));
    engine.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_through_the_other_replica_attaches_then_replays() {
    let Some((engine, pg)) = common::engine_and_postgres() else { return };
    let url = pg.url();
    let g1 = Gate::new(true, false, 0);
    let r1 = Replica::start(&url, &engine, g1.clone(), &[]).await;
    let r2 = Replica::start(&url, &engine, Gate::new(true, true, 0), &[]).await;
    let store = PostgresStore::connect(&url).await.unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let bob = auth::create_key(&store, "bob", "test").await.unwrap();
    let conv = new_conversation(&r1.client(&key)).await;
    let path = format!("/v1/conversations/{conv}/turns");
    let body = turn_body("a1", "Hi! Who are you?", 24, true);

    // The turn runs on replica 1 (held before its first token); its retry reaches replica 2.
    let mut first = post_turn(&r1.client(&key), &path, &body, &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    let mut retry = post_turn(&r2.client(&key), &path, &body, &[]).await;
    assert_eq!(
        retry.status,
        StatusCode::OK,
        "a retry while the turn runs elsewhere attaches"
    );
    // Another user cannot follow it, by retry or by its events.
    let (st, v) = post_json(&r2.client(&bob), &path, &body).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
    let (st, _) = r2
        .client(&bob)
        .json(Method::GET, &format!("{path}/a1/events"), None)
        .await
        .unwrap();
    assert_eq!(st, StatusCode::NOT_FOUND);
    g1.tokens.send_replace(true);
    let original = read_events(&mut first).await;
    let attached = read_events(&mut retry).await;
    let end = &original.last().unwrap().2;
    assert!(
        original.len() > 2 && (end["state"] == "done" || end["state"] == "stopped"),
        "{original:?}"
    );
    assert_eq!(
        attached, original,
        "the attached retry must send the same events"
    );

    // Finished: the retry through replica 2 replays it, whole or from Last-Event-ID.
    let (st, replayed) = events(&r2.client(&key), &conv, &body).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(replayed, original, "the replay must send the same events");
    let mut resumed = post_turn(&r2.client(&key), &path, &body, &[("last-event-id", "1")]).await;
    let tail = read_events(&mut resumed).await;
    assert_eq!(
        tail,
        original[2..].to_vec(),
        "resuming after event 1 sends the rest"
    );
    let (st, v) = post_json(&r2.client(&key), &path, &turn_body("a1", "Hi! Who are you?", 24, false)).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["reply"], end["reply"]);
    let (st, v) = post_json(&r2.client(&bob), &path, &body).await;
    assert_eq!(
        st,
        StatusCode::NOT_FOUND,
        "another user's turn must not replay: {v}"
    );

    let turns = store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 1, "stored once: {turns:?}");
    assert_stored_once(&log_of(&store, &conv, "a1").await, &turns[0].reply_text);
    assert_eq!(turns[0].reply_text, end["reply"].as_str().unwrap());
    drop((r1, r2));
    engine.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_replicas_turn_is_taken_over_by_the_retry() {
    let Some((engine, pg)) = common::engine_and_postgres() else { return };
    let url = pg.url();
    let stale = ["--replica-dead-after", "3s"];
    // Replica 1 streams 40 tokens of the turn, then is held until it is killed.
    let mut r1 = Replica::start(&url, &engine, Gate::new(true, false, 40), &stale).await;
    let r2 = Replica::start(&url, &engine, Gate::new(true, true, 0), &stale).await;
    let store = PostgresStore::connect(&url).await.unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let conv = new_conversation(&r1.client(&key)).await;
    let path = format!("/v1/conversations/{conv}/turns");
    let body = turn_body("a1", "Write a long poem about the sea.", 96, true);
    let first = post_turn(&r1.client(&key), &path, &body, &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    // Wait until part of the reply is in the token log, then kill replica 1 mid-turn.
    let deadline = Instant::now() + Duration::from_secs(120);
    while log_of(&store, &conv, "a1").await.is_empty() {
        assert!(Instant::now() < deadline, "no token log of the turn");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        store.get_turn(&conv, "a1").await.unwrap().unwrap().state,
        TurnState::Streaming
    );
    r1.kill();
    drop(first);

    // The retry through replica 2: it follows the turn until replica 1's heartbeat is
    // stale (that attempt ends "interrupted"), then a retry takes the turn over.
    let retry = turn_body("a1", "Write a long poem about the sea.", 96, false);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut interrupted = 0;
    let result = loop {
        assert!(Instant::now() < deadline, "the turn was never taken over");
        let (st, v) = post_json(&r2.client(&key), &path, &retry).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        match v["state"].as_str() {
            Some("failed") => {
                assert_eq!(v["finish_reason"], "interrupted", "{v}");
                interrupted += 1;
            }
            Some("done") | Some("stopped") => break v,
            other => panic!("unexpected state {other:?}: {v}"),
        }
    };
    assert!(
        interrupted <= 1,
        "at most the attempt attached before the heartbeat was stale ends interrupted"
    );
    let turns = store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 1, "stored once: {turns:?}");
    assert_eq!(turns[0].reply_text, result["reply"].as_str().unwrap());
    assert_stored_once(&log_of(&store, &conv, "a1").await, &turns[0].reply_text);
    // And the conversation goes on through replica 2.
    let (st, v) = post_json(&r2.client(&key), &path, &turn_body("a2", "Thanks!", 8, false)).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let turns = store.list_turns(&conv).await.unwrap();
    let mut expect = turns[0].prompt_ids.clone();
    expect.extend_from_slice(&turns[0].output_ids);
    assert!(
        turns[1].prompt_ids.starts_with(&expect),
        "the next turn extends the taken-over turn"
    );
    drop(r2);
    engine.shutdown();
}
