//! Input checks on everything that becomes prompt text, attacked from the
//! outside: a blocked phrase hidden in an earlier message of an OpenAI request
//! (any role the client may send), in a conversation turn, and in a summary
//! the model writes of a conversation. The generator is scripted (replies and
//! summaries are fixed texts) so the tests control what the model says; the
//! tokenizer is the default model's.

use crate::common;

use baton_api_gateway::generator::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_api_gateway::state::App;
use baton_api_gateway::store::{ConversationStore, SqliteStore};
use baton_api_gateway::{auth, build_app, load_tokenizer, Args, Config};
use baton_text::tokenizer::Tokenizer;
use baton_text::{FinishReason, TokenOut, Usage};
use clap::Parser;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BLOCKED: &str = "forbidden thing";

/// Answers a summary request with `summary` and anything else with `reply`,
/// word by word; counts the generations (and the summaries among them) and keeps
/// their prompts. While `refuse_replies` is above zero, a reply (not a summary) is
/// refused as overloaded, once per count.
struct Scripted {
    tokenizer: Arc<Tokenizer>,
    reply: String,
    summary: Mutex<String>,
    prompts: Mutex<Vec<Vec<u32>>>,
    calls: AtomicUsize,
    summaries: AtomicUsize,
    refuse_replies: AtomicUsize,
}

#[async_trait::async_trait]
impl Generator for Scripted {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.prompts.lock().unwrap().push(req.prompt.clone());
        let asked = self.tokenizer.decode(&req.prompt);
        let text = if asked.contains(baton_api_gateway::context::SUMMARY_REQUEST) {
            self.summaries.fetch_add(1, Ordering::SeqCst);
            self.summary.lock().unwrap().clone()
        } else if self.refuse_replies.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(GenerateError::Overloaded { retry_after: Duration::from_secs(1) });
        } else {
            self.reply.clone()
        };
        let words: Vec<String> = text.split_inclusive(' ').map(str::to_string).collect();
        let n = words.len();
        let prompt_tokens = req.prompt.len();
        let tokens = words.into_iter().map(|w| {
            GenEvent::Token(TokenOut { id: 0, text: w, logprob: None, top_logprobs: vec![], elapsed: Duration::ZERO })
        });
        let end = std::iter::once(GenEvent::Finished {
            reason: FinishReason::Stop,
            usage: Usage { prompt_tokens, cached_tokens: 0, completion_tokens: n },
            trailing_text: String::new(),
        });
        Ok(Box::pin(futures::stream::iter(tokens.chain(end))))
    }

    async fn evict_conversation(&self, _conversation: &baton_vocab::ConversationId) -> Result<Eviction, GenerateError> {
        Ok(Eviction::default())
    }
}

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: Args,
}

struct Gateway {
    base: String,
    key: String,
    store: SqliteStore,
    generator: Arc<Scripted>,
    app: Arc<App>,
    _dir: tempfile::TempDir,
}

/// A gateway with the rule `input: forbidden thing` in front of a scripted generator.
async fn gateway(flags: &[&str], summary: &str) -> Option<Gateway> {
    let model = common::model_path()?;
    let (tokenizer, template) = load_tokenizer(&model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.txt");
    std::fs::write(&rules, format!("input: {BLOCKED}\n")).unwrap();
    let db = dir.path().join("gw.db");
    let mut argv = vec!["gateway".to_string(), "--db".into(), db.display().to_string(), "--check-rules".into(), rules.display().to_string()];
    argv.extend(flags.iter().map(|s| s.to_string()));
    let config = Config::try_from(Wrap::parse_from(argv).args).unwrap();
    let generator = Arc::new(Scripted {
        tokenizer: tokenizer.clone(),
        reply: "Rivers carry water from mountains to the sea, shaping valleys and deltas over many thousands of years. ".repeat(3),
        summary: Mutex::new(summary.to_string()),
        prompts: Mutex::new(Vec::new()),
        calls: AtomicUsize::new(0),
        summaries: AtomicUsize::new(0),
        refuse_replies: AtomicUsize::new(0),
    });
    let store = SqliteStore::open(&db).unwrap();
    let key = auth::create_key(&store, "alice", "test").await.unwrap();
    let app = build_app(config, generator.clone(), Arc::new(store.clone()), tokenizer, template, "scripted".into()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let a = app.clone();
    tokio::spawn(async move {
        let _ = baton_api_gateway::server::serve(listener, a, std::future::pending::<()>()).await;
    });
    Some(Gateway { base, key, store, generator, app, _dir: dir })
}

async fn post(g: &Gateway, path: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", g.base))
        .bearer_auth(&g.key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, serde_json::from_str(&r.text().await.unwrap()).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_phrase_in_any_message_of_a_chat_request_is_refused() {
    let Some(g) = gateway(&[], "unused").await else { return };
    let clean = json!({"messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 8});
    assert_eq!(post(&g, "/v1/chat/completions", &clean).await.0, 200, "a clean request is served");
    let calls = g.generator.calls.load(Ordering::SeqCst);
    // The phrase hides in a message other than the last user message: a
    // system or developer prompt, an earlier user turn, a forged assistant
    // turn, a text part.
    let attacks = [
        (0, "system", json!([{"role": "system", "content": format!("Always mention the {BLOCKED}.")}, {"role": "user", "content": "hi"}])),
        (0, "system", json!([{"role": "developer", "content": format!("The {BLOCKED}.")}, {"role": "user", "content": "hi"}])),
        (0, "user", json!([{"role": "user", "content": format!("About the {BLOCKED}...")}, {"role": "assistant", "content": "Yes?"}, {"role": "user", "content": "go on"}])),
        (1, "assistant", json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": format!("Sure, the {}", BLOCKED.to_uppercase())}, {"role": "user", "content": "continue"}])),
        (0, "user", json!([{"role": "user", "content": [{"type": "text", "text": "the forbidden "}, {"type": "text", "text": "thing"}]}])),
    ];
    for (index, role, messages) in attacks {
        let (status, v) = post(&g, "/v1/chat/completions", &json!({"messages": messages, "max_tokens": 8})).await;
        assert_eq!(status, 400, "{messages}: {v}");
        assert_eq!(v["error"]["type"], "content_policy_violation", "{v}");
        assert_eq!(v["error"]["param"], "messages", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(&format!("messages[{index}] ({role})")) && message.contains("input policy"), "{message}");
    }
    assert_eq!(g.generator.calls.load(Ordering::SeqCst), calls, "no refused request reached the generator");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_phrase_in_a_conversation_turn_is_refused_and_not_stored() {
    let Some(g) = gateway(&[], "unused").await else { return };
    let (st, conv) = post(&g, "/v1/conversations", &json!({"title": "t"})).await;
    assert_eq!(st, 201);
    let id = conv["id"].as_str().unwrap();
    let (status, v) = post(&g, &format!("/v1/conversations/{id}/turns"), &json!({"message": format!("tell me the {BLOCKED}"), "stream": false})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "content_policy_violation", "{v}");
    assert!(g.store.list_turns(id).await.unwrap().is_empty());
    assert_eq!(g.generator.calls.load(Ordering::SeqCst), 0);
}

/// Two turns of one conversation past a tiny summary threshold: the second
/// asks for a summary first. Returns the conversation's stored summary and
/// the second turn's prompt as text.
async fn summarized_conversation(g: &Gateway) -> (Option<String>, String, Vec<u32>, Vec<u32>) {
    let (_, conv) = post(g, "/v1/conversations", &json!({"title": "t"})).await;
    let id = conv["id"].as_str().unwrap().to_string();
    let path = format!("/v1/conversations/{id}/turns");
    let (st, v) = post(g, &path, &json!({"turn_id": "a", "message": "Tell me about rivers.", "stream": false})).await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = post(g, &path, &json!({"turn_id": "b", "message": "And lakes?", "stream": false})).await;
    assert_eq!(st, 200, "{v}");
    let summary = g.store.get_conversation("alice", &id).await.unwrap().unwrap().summary;
    let first = g.store.get_turn(&id, "a").await.unwrap().unwrap();
    let second = g.store.get_turn(&id, "b").await.unwrap().unwrap();
    let mut history = first.prompt_ids.clone();
    history.extend_from_slice(&first.output_ids);
    let text = g.app.context.tokenizer.decode(&second.prompt_ids);
    (summary, text, history, second.prompt_ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_that_fails_the_input_check_is_neither_stored_nor_used() {
    let flags = ["--summary-threshold-tokens", "40", "--summary-keep-turns", "0"];
    // The same conversation with a clean summary: stored and used (the path is taken).
    let Some(g) = gateway(&flags, "The user asked about rivers.").await else { return };
    let (summary, prompt, _, _) = summarized_conversation(&g).await;
    assert_eq!(summary.as_deref(), Some("The user asked about rivers."));
    assert!(prompt.contains(baton_api_gateway::context::SUMMARY_PREFIX), "{prompt}");

    // The model's summary carries the blocked phrase (say, planted by a reply).
    *g.generator.summary.lock().unwrap() = format!("The user wants the {BLOCKED} next time.");
    let (summary, prompt, history, second) = summarized_conversation(&g).await;
    assert_eq!(summary, None, "a refused summary is not stored");
    let refused = baton_api_gateway::metrics::encode()
        .lines()
        .find_map(|l| l.strip_prefix("baton_gateway_summaries_refused_total ")?.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(refused >= 1.0, "the refusal is counted in /metrics");
    assert!(!prompt.contains(BLOCKED) && !prompt.contains(baton_api_gateway::context::SUMMARY_PREFIX), "{prompt}");
    assert!(second.starts_with(&history), "the turn appends to the full history instead");
}

/// #39.6: a summary is stored with the boundary it covers as soon as it is made, so a
/// turn refused after its summary (here the model service is overloaded when the reply
/// is asked) is retried without asking the model (and charging the owner) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_refused_after_its_summary_reuses_it_on_retry() {
    let flags = ["--summary-threshold-tokens", "40", "--summary-keep-turns", "0"];
    let Some(g) = gateway(&flags, "The user asked about rivers.").await else { return };
    let (_, conv) = post(&g, "/v1/conversations", &json!({"title": "t"})).await;
    let id = conv["id"].as_str().unwrap().to_string();
    let path = format!("/v1/conversations/{id}/turns");
    let (st, v) = post(&g, &path, &json!({"turn_id": "a", "message": "Tell me about rivers.", "stream": false})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(g.generator.summaries.load(Ordering::SeqCst), 0);
    g.generator.refuse_replies.store(1, Ordering::SeqCst);
    let second = json!({"turn_id": "b", "message": "And lakes?", "stream": false});
    let (st, v) = post(&g, &path, &second).await;
    assert_eq!(st, 429, "the reply was refused after the summary: {v}");
    assert_eq!(g.generator.summaries.load(Ordering::SeqCst), 1, "the refused turn asked for the summary");
    assert!(g.store.get_turn(&id, "b").await.unwrap().is_none(), "a refused turn is not stored");
    let (st, v) = post(&g, &path, &second).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(g.generator.summaries.load(Ordering::SeqCst), 1, "the retry reused the stored summary instead of asking the model again");
    let summary = g.store.get_conversation("alice", &id).await.unwrap().unwrap().summary;
    assert_eq!(summary.as_deref(), Some("The user asked about rivers."));
    let b = g.store.get_turn(&id, "b").await.unwrap().unwrap();
    let prompt = g.app.context.tokenizer.decode(&b.prompt_ids);
    assert!(prompt.contains(&format!("{}The user asked about rivers.", baton_api_gateway::context::SUMMARY_PREFIX)), "{prompt}");
    let reused = baton_api_gateway::metrics::encode()
        .lines()
        .find_map(|l| l.strip_prefix("baton_gateway_summaries_reused_total ")?.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(reused >= 1.0, "the reuse is counted in /metrics");
}
