//! Deletion waits for in-flight turns on every replica (issue #39: a turn still streaming
//! on another gateway replica went on generating after the delete answered, so its decode
//! node kept the conversation's KV behind the eviction). Two real gateways (router,
//! store, turn runner) share one real PostgreSQL; the model is a scripted generator that
//! streams slowly and records when a generation's stream is dropped (what cancels the
//! turn on a decode node) and when an eviction is asked for.
//!
//! A delete on replica A while a turn streams on replica B: the delete answers only after
//! B's generation stopped, the eviction comes after that stop, and none of the turn's
//! text is stored after the delete answered.

mod pg;
mod replicas;

use baton_api_gateway::generator::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_text::{FinishReason, TokenOut, Usage};
use replicas::request;
use serde_json::{json, Value};
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MARKER: &str = "zebra";

/// What the scripted model saw, with times.
#[derive(Default)]
struct Log {
    started: Option<Instant>,
    dropped: Option<Instant>,
    evicted: Vec<Instant>,
}

/// Streams `MARKER` tokens every 20 ms for 20 s (far longer than the test), and notes
/// when the stream is dropped.
struct Slow {
    log: Arc<Mutex<Log>>,
    token: u32,
}

struct DropNote(Arc<Mutex<Log>>);

impl Drop for DropNote {
    fn drop(&mut self) {
        self.0.lock().unwrap().dropped = Some(Instant::now());
    }
}

#[async_trait::async_trait]
impl Generator for Slow {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        self.log.lock().unwrap().started = Some(Instant::now());
        let note = DropNote(self.log.clone());
        let (id, prompt) = (self.token, req.prompt.len());
        let stream = futures::stream::unfold((0usize, note), move |(i, note)| async move {
            if i == 1000 {
                let usage = Usage { prompt_tokens: prompt, cached_tokens: 0, completion_tokens: i };
                return Some((GenEvent::Finished { reason: FinishReason::Length, usage, trailing_text: String::new() }, (i + 1, note)));
            }
            if i > 1000 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let t = TokenOut { id, text: format!(" {MARKER}"), logprob: None, top_logprobs: vec![], elapsed: Duration::ZERO };
            Some((GenEvent::Token(t), (i + 1, note)))
        });
        Ok(Box::pin(stream))
    }

    async fn evict_conversation(&self, _: &baton_vocab::ConversationId) -> Result<Eviction, GenerateError> {
        self.log.lock().unwrap().evicted.push(Instant::now());
        Ok(Eviction::default())
    }
}

#[test]
fn a_delete_on_one_replica_waits_for_the_turn_streaming_on_another() {
    let Some(tk) = replicas::tokenizer() else { return };
    let Some(pg) = pg::TempPostgres::start() else { return };
    let token = tk.0.encode(&format!(" {MARKER}"), false).unwrap()[0];
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let log = Arc::new(Mutex::new(Log::default()));
    let url = pg.url();
    let (a, b, key, raw) = runtime.block_on(async {
        let generators: Vec<Arc<dyn Generator>> = (0..2).map(|_| Arc::new(Slow { log: log.clone(), token }) as Arc<dyn Generator>).collect();
        let (gateways, key) = replicas::start(&url, &[], generators, tk).await;
        let (raw, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        (gateways[0], gateways[1], key, raw)
    });
    let (status, body) = request(a, "POST", "/v1/conversations", &key, Some(&json!({"title": "t"})));
    assert_eq!(status, 201, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"].as_str().unwrap().to_string();

    // The turn streams on replica B; wait until its text reached the client (and so the
    // token log).
    let (turn_key, turn_id) = (key.clone(), id.clone());
    let streaming = std::thread::spawn(move || {
        let body = json!({"message": "tell me about zebras", "stream": true, "max_tokens": 2000});
        let mut s = replicas::send(b, "POST", &format!("/v1/conversations/{turn_id}/turns"), &turn_key, Some(&body));
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        seen
    });
    let wait_stored = Instant::now();
    loop {
        let n: i64 = runtime
            .block_on(raw.query_one("SELECT count(*) FROM token_log WHERE conversation = $1", &[&id]))
            .unwrap()
            .get(0);
        if n >= 32 {
            break;
        }
        assert!(wait_stored.elapsed() < Duration::from_secs(20), "the turn on replica B never wrote its log");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(log.lock().unwrap().dropped.is_none(), "the turn is still generating");

    let (status, body) = request(a, "DELETE", &format!("/v1/conversations/{id}"), &key, None);
    let answered = Instant::now();
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["kv_evicted"], true, "{body}");
    let (dropped, evicted) = {
        let l = log.lock().unwrap();
        (l.dropped, l.evicted.clone())
    };
    let dropped = dropped.expect("the delete answered while the turn was still generating on replica B");
    assert!(dropped <= answered);
    assert!(!evicted.is_empty() && evicted.iter().all(|&e| e >= dropped), "the eviction must come after the turn stopped");

    // Nothing of the turn is stored after the answer, even once replica B finished it.
    let client_saw = streaming.join().unwrap();
    assert!(client_saw.contains(MARKER), "the client on B was streamed the turn");
    std::thread::sleep(Duration::from_millis(300));
    runtime.block_on(async {
        for table in ["conversations WHERE id", "turns WHERE conversation", "token_log WHERE conversation", "turn_stops WHERE conversation"] {
            let n: i64 = raw.query_one(&format!("SELECT count(*) FROM {table} = $1"), &[&id]).await.unwrap().get(0);
            assert_eq!(n, 0, "{table}: rows left after the delete answered");
        }
        let n: i64 = raw
            .query_one("SELECT count(*) FROM token_log WHERE text LIKE $1", &[&format!("%{MARKER}%")])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "the turn's text is stored after the delete answered");
    });
    drop(runtime);
}
