//! One user's slow turn never stalls another's: Alice's turn is held inside summarization
//! (the slowest part of admitting a turn) for as long as the test wants, and Bob's turns
//! must all finish while it is still held. The hold has no end of its own, so anything
//! Bob's turn waited on behind Alice's (a lock, a queue slot, a worker) shows up as a
//! timeout, not as a slowdown; the test does not compare wall-clock times, which other
//! tests in this binary share.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use baton_api_gateway::generator::{Eviction, GenerateError, GenerateRequest, Generator, GenerationStream};

/// Holds every summary generation (recognized by its `max_tokens`) until released, and
/// says when one is held.
struct HoldSummaries {
    inner: Arc<dyn Generator>,
    summary_max_tokens: usize,
    entered: Arc<tokio::sync::Notify>,
    release: tokio::sync::watch::Receiver<bool>,
}

#[async_trait::async_trait]
impl Generator for HoldSummaries {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        if req.sampling.max_tokens == self.summary_max_tokens {
            self.entered.notify_one();
            let mut release = self.release.clone();
            let _ = release.wait_for(|r| *r).await;
        }
        self.inner.generate(req).await
    }

    async fn evict_conversation(&self, conversation: &baton_vocab::ConversationId) -> Result<Eviction, GenerateError> {
        self.inner.evict_conversation(conversation).await
    }
}

/// Runs `n` turns by `key`, each the first turn of a new conversation of its own
/// (the path that takes a conversation's admission lock, as Alice's held turn does);
/// `tag` keeps the two series' messages distinct and equally long.
async fn bob_turns(base: &str, key: &str, tag: &str, n: usize) {
    // A turn stuck behind Alice's fails the test instead of hanging it.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    for i in 0..n {
        let created = http
            .post(format!("{base}/v1/conversations"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(r#"{"title":"bob"}"#);
        let created = crate::common::text_of(created).await;
        let created: serde_json::Value = serde_json::from_str(&created).unwrap();
        let conv = created["id"].as_str().unwrap();
        let body = serde_json::json!({"message": format!("Name a colour, please ({tag}{i})."), "max_tokens": 4, "temperature": 0, "stream": false});
        let r = http
            .post(format!("{base}/v1/conversations/{conv}/turns"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_held_in_summarization_does_not_stall_another_user() {
    const SUMMARY_MAX_TOKENS: usize = 7;
    let entered = Arc::new(tokio::sync::Notify::new());
    let (release_tx, release) = tokio::sync::watch::channel(false);
    let hold = {
        let entered = entered.clone();
        move |inner| -> Arc<dyn Generator> {
            Arc::new(HoldSummaries { inner, summary_max_tokens: SUMMARY_MAX_TOKENS, entered, release })
        }
    };
    let flags = ["--summary-threshold-tokens", "40", "--summary-max-tokens", "7", "--turns-per-minute", "1000"];
    let Some(server) = common::start_wrapped(&flags, hold).await else { return };
    let alice = server.client();
    // Alice's conversation passes the threshold on its first turn, so her second turn
    // begins with a summary.
    let (st, conv) = alice.json(reqwest::Method::POST, "/v1/conversations", Some(&serde_json::json!({"title": "long"}))).await.unwrap();
    assert_eq!(st, 201);
    let conv = conv["id"].as_str().unwrap().to_string();
    let turn = |message: &str| serde_json::json!({"message": message, "max_tokens": 4, "stream": false});
    let path = format!("/v1/conversations/{conv}/turns");
    let first = turn("Tell me about rivers, mountains, the sea and the towns along the banks of rivers.");
    let (st, _) = alice.json(reqwest::Method::POST, &path, Some(&first)).await.unwrap();
    assert_eq!(st, 200);

    // Bob's turns work at all before Alice's is held, so a failure below is the hold's.
    bob_turns(&server.base, &server.key2, "a", 2).await;
    let held_turn = {
        let (alice, path) = (server.client(), path.clone());
        tokio::spawn(async move { alice.json(reqwest::Method::POST, &path, Some(&turn("And the sea?"))).await.unwrap().0 })
    };
    tokio::time::timeout(Duration::from_secs(30), entered.notified()).await.expect("alice's turn reached its summary");
    bob_turns(&server.base, &server.key2, "b", 5).await;
    assert!(!held_turn.is_finished(), "alice's turn is still held in its summary while bob's turns finished");
    release_tx.send(true).unwrap();
    assert_eq!(held_turn.await.unwrap(), 200);
}
