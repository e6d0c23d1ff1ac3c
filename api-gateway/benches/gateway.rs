//! Load benchmark of the gateway alone: the engine is replaced by a fast
//! in-process token source (used only here), so what is measured is the
//! gateway's own cost: auth, parsing, context building, limits, the output
//! filter, SSE encoding, metering. Reports requests per second and the
//! latency per turn (request to first token) and per streamed token, p50/p99,
//! side by side with a baseline: a bare axum handler that streams the same
//! chunks with no gateway work, driven by the same client in the same process.
//! The difference is what the gateway adds.
//!
//! `cargo bench -p baton-api-gateway` (BENCH_CONCURRENCY, BENCH_REQUESTS,
//! BENCH_TOKENS tune it). Needs the default model's tokenizer.

use baton_api_gateway::client::{Client, Method};
use baton_api_gateway::generator::{GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_api_gateway::store::SqliteStore;
use baton_api_gateway::{auth, build_app, load_tokenizer, Args, Config};
use baton_text::{FinishReason, TokenOut, Usage};
use clap::Parser;
use std::sync::Arc;
use std::time::Instant;

/// Emits `max_tokens` tokens as fast as they are read.
struct FastTokens;

#[async_trait::async_trait]
impl Generator for FastTokens {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        let n = req.sampling.max_tokens;
        let prompt = req.prompt.len();
        let start = Instant::now();
        let tokens = (0..n).map(move |i| {
            GenEvent::Token(TokenOut {
                id: 1000 + i as u32,
                text: " word".into(),
                logprob: None,
                top_logprobs: vec![],
                elapsed: start.elapsed(),
            })
        });
        let end = std::iter::once(GenEvent::Finished {
            reason: FinishReason::Length,
            usage: Usage { prompt_tokens: prompt, cached_tokens: 0, completion_tokens: n },
            trailing_text: String::new(),
        });
        Ok(Box::pin(futures::stream::iter(tokens.chain(end))))
    }

    async fn evict_conversation(&self, _conversation: &baton_vocab::ConversationId) -> Result<baton_api_gateway::generator::Eviction, GenerateError> {
        Ok(Default::default())
    }
}

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: Args,
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let model = std::env::var_os("BATON_MODEL").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    if !model.exists() {
        eprintln!("skipped: model not found at {}; run scripts/fetch-model.sh", model.display());
        return;
    }
    let concurrency = env("BENCH_CONCURRENCY", 32);
    let requests = env("BENCH_REQUESTS", 2000);
    let tokens = env("BENCH_TOKENS", 64);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("bench.db");
        let argv = ["bench", "--db", db.to_str().unwrap(), "--turns-per-minute", "1e9", "--open-streams", "100000", "--prompt-tokens-per-hour", "1e12", "--output-tokens-per-hour", "1e12"];
        let config = Config::try_from(Wrap::parse_from(argv).args).unwrap();
        let (tok, tmpl) = load_tokenizer(&model).unwrap();
        let store = SqliteStore::open(&db).unwrap();
        let key = auth::create_key(&store, "bench", "").await.unwrap();
        let app = build_app(config, Arc::new(FastTokens), Arc::new(store), tok, tmpl, "bench".into()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = Client::new(format!("http://{}", listener.local_addr().unwrap()), Some(key.clone()));
        tokio::spawn(baton_api_gateway::server::serve(listener, app, std::future::pending()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let baseline = Client::new(format!("http://{}", listener.local_addr().unwrap()), Some(key));
        let bare = axum::Router::new().route("/v1/chat/completions", axum::routing::post(bare_stream));
        // TCP_NODELAY as the gateway sets it, or every small SSE frame waits for a delayed ACK.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(listener, bare).await });
        let body = serde_json::json!({
            "model": "bench", "stream": true, "max_tokens": tokens,
            "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Tell me about the sea and its creatures, please."}]
        })
        .to_string();
        println!("gateway load benchmark: {tokens} streamed tokens per request; baseline = bare axum SSE handler, same client");
        println!("{:>11}  {:<8}  {:>8}  {:>10}  {:>10}  {:>11}  {:>11}", "concurrent", "server", "req/s", "turn p50", "turn p99", "token p50", "token p99");
        let mut levels = vec![1, 4, concurrency];
        levels.dedup();
        for conc in levels {
            let requests = if conc == 1 { requests.min(500) } else { requests };
            for (name, client) in [("baseline", &baseline), ("gateway", &gateway)] {
                let r = phase(client, &body, conc, requests).await;
                println!(
                    "{conc:>11}  {name:<8}  {:>8.0}  {:>7.3} ms  {:>7.3} ms  {:>8.1} us  {:>8.1} us",
                    r.requests_per_s, r.turn_p50 * 1e3, r.turn_p99 * 1e3, r.token_p50 * 1e6, r.token_p99 * 1e6
                );
            }
        }
    });
}

/// The baseline: reads the body and streams `max_tokens` OpenAI-shaped chunks
/// and `[DONE]`, with none of the gateway's work.
async fn bare_stream(body: axum::body::Bytes) -> axum::response::Response {
    use axum::response::sse::{Event, Sse};
    use axum::response::IntoResponse;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let n = v["max_tokens"].as_u64().unwrap_or(16) as usize;
    let chunk = serde_json::json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " word"}}]}).to_string();
    let events = (0..n)
        .map(move |_| Ok::<_, std::convert::Infallible>(Event::default().data(chunk.clone())))
        .chain(std::iter::once(Ok(Event::default().data("[DONE]"))));
    Sse::new(futures::stream::iter(events)).into_response()
}

/// Seconds: per-turn (request to first token) and per-token percentiles.
struct PhaseResult {
    requests_per_s: f64,
    turn_p50: f64,
    turn_p99: f64,
    token_p50: f64,
    token_p99: f64,
}

async fn phase(client: &Client, body: &str, concurrency: usize, requests: usize) -> PhaseResult {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, body, next) = (client.clone(), body.to_string(), next.clone());
        tasks.push(tokio::spawn(async move {
            let (mut first, mut per_token) = (Vec::new(), Vec::new());
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                let t0 = Instant::now();
                let mut r = client.send(Method::POST, "/v1/chat/completions", Some(body.clone().into_bytes()), &[]).await.unwrap();
                assert_eq!(r.status, 200);
                let mut t_first = None;
                let mut n = 0usize;
                while let Some(ev) = r.next_event().await.unwrap() {
                    if ev.data.contains("\"content\":\" word\"") {
                        n += 1;
                        t_first.get_or_insert_with(|| t0.elapsed());
                    }
                }
                let total = t0.elapsed();
                let tf = t_first.unwrap_or(total);
                first.push(tf.as_secs_f64());
                if n > 1 {
                    per_token.push((total - tf).as_secs_f64() / (n - 1) as f64);
                }
            }
            (first, per_token)
        }));
    }
    let (mut first, mut per_token) = (Vec::new(), Vec::new());
    for t in tasks {
        let (f, p) = t.await.unwrap();
        first.extend(f);
        per_token.extend(p);
    }
    PhaseResult {
        requests_per_s: requests as f64 / started.elapsed().as_secs_f64(),
        turn_p50: pct(&mut first, 0.5),
        turn_p99: pct(&mut first, 0.99),
        token_p50: pct(&mut per_token, 0.5),
        token_p99: pct(&mut per_token, 0.99),
    }
}
