//! Limits hold across gateway replicas (issue #39.10: every count lived in one process,
//! so N replicas behind a balancer gave a user each limit N times). Two real gateways
//! share one real PostgreSQL; the model is scripted (a short reply, or one held open
//! until the test releases it).

mod pg;
mod replicas;

use baton_api_gateway::generator::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_text::{FinishReason, TokenOut, Usage};
use replicas::request;
use serde_json::{json, Value};
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Replies two tokens; while `hold` is set, a reply waits after its first token.
struct Scripted {
    hold: Arc<AtomicBool>,
    started: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Generator for Scripted {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let (hold, prompt) = (self.hold.clone(), req.prompt.len());
        let stream = futures::stream::unfold(0usize, move |i| {
            let hold = hold.clone();
            async move {
                match i {
                    0 | 1 => {
                        if i == 1 {
                            while hold.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                        let t = TokenOut { id: 42, text: " ok".into(), logprob: None, top_logprobs: vec![], elapsed: Duration::ZERO };
                        Some((GenEvent::Token(t), i + 1))
                    }
                    2 => {
                        let usage = Usage { prompt_tokens: prompt, cached_tokens: 0, completion_tokens: 2 };
                        Some((GenEvent::Finished { reason: FinishReason::Length, usage, trailing_text: String::new() }, 3))
                    }
                    _ => None,
                }
            }
        });
        Ok(Box::pin(stream))
    }

    async fn evict_conversation(&self, _: &baton_vocab::ConversationId) -> Result<Eviction, GenerateError> {
        Ok(Eviction::default())
    }
}

struct Cluster {
    gateways: Vec<SocketAddr>,
    key: String,
    hold: Arc<AtomicBool>,
    started: Arc<AtomicUsize>,
    raw: tokio_postgres::Client,
    runtime: tokio::runtime::Runtime,
    _pg: pg::TempPostgres,
}

fn cluster(flags: &[&str]) -> Option<Cluster> {
    let tk = replicas::tokenizer()?;
    let pg = pg::TempPostgres::start()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (hold, started) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let url = pg.url();
    let (gateways, key, raw) = runtime.block_on(async {
        let generators: Vec<Arc<dyn Generator>> =
            (0..2).map(|_| Arc::new(Scripted { hold: hold.clone(), started: started.clone() }) as Arc<dyn Generator>).collect();
        let (gateways, key) = replicas::start(&url, flags, generators, tk).await;
        let (raw, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        (gateways, key, raw)
    });
    Some(Cluster { gateways, key, hold, started, raw, runtime, _pg: pg })
}

fn chat(addr: SocketAddr, key: &str) -> (u16, String) {
    let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    request(addr, "POST", "/v1/chat/completions", key, Some(&body))
}

fn limit_of(body: &str) -> String {
    serde_json::from_str::<Value>(body).map(|v| v["error"]["message"].as_str().unwrap_or_default().to_string()).unwrap_or_default()
}

#[test]
fn a_users_turns_per_minute_hold_across_replicas() {
    let Some(c) = cluster(&["--turns-per-minute", "4", "--conversation-requests-per-minute", "2"]) else { return };
    let (a, b) = (c.gateways[0], c.gateways[1]);
    for (i, gw) in [a, b, a, b].into_iter().enumerate() {
        let (status, body) = chat(gw, &c.key);
        assert_eq!(status, 200, "turn {i}: {body}");
    }
    // Each replica admitted two: alone, each would allow two more.
    for gw in [a, b] {
        let (status, body) = chat(gw, &c.key);
        assert_eq!(status, 429, "a fifth turn in the minute across two replicas: {body}");
        assert!(limit_of(&body).contains("turns_per_minute"), "{body}");
    }
    // Conversation creates share one bucket across replicas as well.
    for gw in [a, b] {
        let (status, body) = request(gw, "POST", "/v1/conversations", &c.key, Some(&json!({"title": "t"})));
        assert_eq!(status, 201, "{body}");
    }
    let (status, body) = request(a, "POST", "/v1/conversations", &c.key, Some(&json!({"title": "t"})));
    assert_eq!(status, 429, "a third create in the minute across two replicas: {body}");
    assert!(limit_of(&body).contains("conversation_requests_per_minute"), "{body}");
    drop(c.runtime);
}

#[test]
fn open_streams_hold_across_replicas_and_a_dead_replicas_streams_free_themselves() {
    let Some(c) = cluster(&["--open-streams", "1"]) else { return };
    let (a, b) = (c.gateways[0], c.gateways[1]);
    c.hold.store(true, Ordering::SeqCst);
    let key = c.key.clone();
    let streaming = std::thread::spawn(move || {
        let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true});
        let mut s = replicas::send(a, "POST", "/v1/chat/completions", &key, Some(&body));
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    });
    let t0 = Instant::now();
    while c.started.load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the held turn never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, body) = chat(b, &c.key);
    assert_eq!(status, 429, "a second open stream on the other replica: {body}");
    assert!(limit_of(&body).contains("open_streams"), "{body}");

    c.hold.store(false, Ordering::SeqCst);
    assert!(streaming.join().unwrap().contains("[DONE]"));
    // The slot is given back (its row deleted right after the reply).
    let t0 = Instant::now();
    loop {
        let (status, body) = chat(b, &c.key);
        if status == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the stream's slot was never given back: {status} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A stream held by an instance whose heartbeat is gone counts for nothing.
    c.runtime.block_on(async {
        let bucket: String = {
            use sha2::Digest;
            sha2::Sha256::digest(b"alice").iter().map(|b| format!("{b:02x}")).collect()
        };
        // The request just answered gives its slot back right after its reply, which
        // the client may have read first: wait for it.
        let t0 = Instant::now();
        while c.raw.query_one("SELECT count(*) FROM limit_streams WHERE bucket = $1", &[&bucket]).await.unwrap().get::<_, i64>(0) > 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "the last reply's slot was never given back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.raw
            .execute("INSERT INTO limit_streams (id, bucket, instance) VALUES ('crashed-stream', $1, 'crashed-instance')", &[&bucket])
            .await
            .unwrap();
        let live: i64 = c.raw.query_one("SELECT count(*) FROM limit_streams WHERE bucket = $1", &[&bucket]).await.unwrap().get(0);
        assert_eq!(live, 1, "the row is there (under the user's bucket)");
    });
    let (status, body) = chat(a, &c.key);
    assert_eq!(status, 200, "a dead replica's stream must not count: {body}");
    c.runtime.block_on(async {
        let n: i64 = c.raw.query_one("SELECT count(*) FROM limit_streams WHERE id = 'crashed-stream'", &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "and its row is cleaned up");
    });
    drop(c.runtime);
}
