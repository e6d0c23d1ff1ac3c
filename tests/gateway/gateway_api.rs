//! The gateway end to end: an axum server on 127.0.0.1:0 in front of the
//! real engine with the default model, driven over HTTP.

use crate::common;

use baton_api_gateway::client::{Client, Method, StatusCode};
use baton_api_gateway::store::{ConversationStore, TurnState};
use serde_json::{json, Value};

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": "smollm2",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
        "max_tokens": 12, "temperature": 0, "seed": 1
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// Reads a conversation turn's SSE stream to its end: (event ids, text, done data).
async fn read_turn(mut r: baton_api_gateway::client::Response) -> (Vec<String>, String, Value) {
    assert_eq!(r.status, StatusCode::OK);
    let (mut ids, mut text) = (vec![], String::new());
    while let Some(ev) = r.next_event().await.unwrap() {
        ids.push(ev.id.clone().unwrap_or_default());
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        match ev.event.as_deref() {
            Some("delta") => text.push_str(v["text"].as_str().unwrap()),
            Some("done") => return (ids, text, v),
            _ => {}
        }
    }
    panic!("stream ended without a done event");
}

async fn new_conversation(c: &Client) -> String {
    let (st, v) = c.json(Method::POST, "/v1/conversations", Some(&json!({"title": "t"}))).await.unwrap();
    assert_eq!(st, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn turn(c: &Client, conv: &str, body: Value, headers: &[(&str, &str)]) -> baton_api_gateway::client::Response {
    c.send(Method::POST, &format!("/v1/conversations/{conv}/turns"), Some(body.to_string().into_bytes()), headers).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openai_chat_completions_streaming_and_not() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let (st, v) = c.json(Method::GET, "/v1/models", None).await.unwrap();
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], "smollm2");

    let (st, full) =
        c.json(Method::POST, "/v1/chat/completions", Some(&chat_body(json!({"logprobs": true, "top_logprobs": 2})))).await.unwrap();
    assert_eq!(st, StatusCode::OK, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let content = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!content.is_empty());
    let lps = full["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!lps.is_empty());
    assert_eq!(lps[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(lps[0]["logprob"].as_f64().unwrap() <= 0.0);
    let usage = &full["usage"];
    assert_eq!(usage["completion_tokens"].as_u64().unwrap() as usize, lps.len());

    // The same request streamed: same text (greedy), usage last, then [DONE];
    // the resent prompt hits the prefix cache.
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let mut r = c.send(Method::POST, "/v1/chat/completions", Some(body.to_string().into_bytes()), &[]).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let (mut text, mut saw_done, mut usage, mut finish) = (String::new(), false, Value::Null, Value::Null);
    while let Some(ev) = r.next_event().await.unwrap() {
        if ev.data == "[DONE]" {
            saw_done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(ch) = v["choices"].as_array().and_then(|a| a.first()) {
            if let Some(t) = ch["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if !ch["finish_reason"].is_null() {
                finish = ch["finish_reason"].clone();
            }
        } else {
            usage = v["usage"].clone();
        }
    }
    assert!(saw_done);
    assert_eq!(text, content);
    assert!(finish == "length" || finish == "stop");
    assert!(usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{usage}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_is_required_and_never_from_the_body() {
    let Some(s) = common::start(&[]).await else { return };
    let anon = Client::new(s.base.clone(), None);
    let (st, v) = anon.json(Method::GET, "/v1/models", None).await.unwrap();
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(v["error"]["type"], "authentication_error");
    let wrong = Client::new(s.base.clone(), Some("bk-wrong".into()));
    assert_eq!(wrong.json(Method::GET, "/v1/conversations", None).await.unwrap().0, StatusCode::UNAUTHORIZED);
    // A "user" field in the body changes nothing: the conversation is alice's.
    let c = s.client();
    let conv = new_conversation(&c).await;
    let (st, _) = s.client2().json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::NOT_FOUND, "bob must not see alice's conversation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn turns_append_token_ids_and_hit_the_cache() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let (_, t1, done1) =
        read_turn(turn(&c, &conv, json!({"turn_id": "a1", "message": "Hi! Who are you?", "max_tokens": 16, "temperature": 0}), &[]).await)
            .await;
    assert_eq!(done1["state"], "done");
    assert_eq!(done1["reply"].as_str().unwrap(), t1);
    let (st, v) = c
        .json(
            Method::POST,
            &format!("/v1/conversations/{conv}/turns"),
            Some(&json!({"turn_id": "a2", "message": "And what can you do?", "max_tokens": 8, "temperature": 0, "stream": false})),
        )
        .await
        .unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["usage"]["cached_tokens"].as_i64().unwrap() >= 16, "turn 2 must reuse turn 1's KV: {v}");
    let turns = s.store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 2);
    let mut expect = turns[0].prompt_ids.clone();
    expect.extend_from_slice(&turns[0].output_ids);
    assert!(turns[1].prompt_ids.starts_with(&expect), "turn 2's prompt must extend turn 1's prompt and reply token IDs exactly");
    let tail = s.engine.tokenizer.decode_with_special(&turns[1].prompt_ids[expect.len()..], true);
    assert!(tail.contains("And what can you do?") && tail.ends_with("<|im_start|>assistant\n"), "{tail:?}");
    let (st, v) = c.json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["turns"].as_array().unwrap().len(), 2);
    let (_, list) = c.json(Method::GET, "/v1/conversations", None).await.unwrap();
    assert!(list["data"].as_array().unwrap().iter().any(|x| x["id"] == conv.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn twenty_concurrent_retries_make_one_generation() {
    let Some(s) = common::start(&["--open-streams", "30"]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let before = s.engine.stats();
    let body = json!({"turn_id": "same", "message": "Tell me a short story.", "max_tokens": 24, "temperature": 0});
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (c, conv, body) = (c.clone(), conv.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                read_turn(turn(&c, &conv, body, &[]).await).await.1
            } else {
                // Half of them name the turn with the Idempotency-Key header instead.
                let mut b = body.clone();
                b.as_object_mut().unwrap().remove("turn_id");
                read_turn(turn(&c, &conv, b, &[("idempotency-key", "same")]).await).await.1
            }
        }));
    }
    let mut texts = Vec::new();
    for t in tasks {
        texts.push(t.await.unwrap());
    }
    assert!(!texts[0].is_empty());
    assert!(texts.iter().all(|t| *t == texts[0]), "every caller must see the same reply");
    let turns = s.store.list_turns(&conv).await.unwrap();
    assert_eq!(turns.len(), 1, "one stored reply");
    assert_eq!(turns[0].reply_text, texts[0]);
    // A later retry replays the stored reply.
    let (_, replay, _) = read_turn(turn(&c, &conv, body.clone(), &[]).await).await;
    assert_eq!(replay, texts[0]);
    let after = s.engine.stats();
    assert_eq!(after.finished + after.cancelled - before.finished - before.cancelled, 1, "one generation");
    // Same turn ID, different body: 409.
    let r = turn(&c, &conv, json!({"turn_id": "same", "message": "Something else"}), &[]).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(s.store.list_turns(&conv).await.unwrap().len() == 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopped_turn_next_prompt_holds_exactly_the_partial_reply() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let mut r = turn(
        &c,
        &conv,
        json!({"turn_id": "long", "message": "Write a long essay about the sea.", "max_tokens": 400, "temperature": 0}),
        &[],
    )
    .await;
    let mut seen = String::new();
    let mut n = 0;
    while n < 4 {
        let ev = r.next_event().await.unwrap().unwrap();
        if ev.event.as_deref() == Some("delta") {
            seen.push_str(serde_json::from_str::<Value>(&ev.data).unwrap()["text"].as_str().unwrap());
            n += 1;
        }
    }
    let (st, stopped) = c.json(Method::POST, &format!("/v1/conversations/{conv}/turns/long/stop"), None).await.unwrap();
    assert_eq!(st, StatusCode::OK, "{stopped}");
    assert_eq!(stopped["state"], "stopped");
    // The rest of the first stream ends with the same stopped reply.
    let mut rest = seen.clone();
    while let Some(ev) = r.next_event().await.unwrap() {
        match ev.event.as_deref() {
            Some("delta") => rest.push_str(serde_json::from_str::<Value>(&ev.data).unwrap()["text"].as_str().unwrap()),
            Some("done") => break,
            _ => {}
        }
    }
    let partial = stopped["reply"].as_str().unwrap().to_string();
    assert_eq!(rest, partial, "the stream and the stored reply agree");
    assert!(partial.starts_with(&seen));
    let t = s.store.get_turn(&conv, "long").await.unwrap().unwrap();
    assert_eq!(t.state, TurnState::Stopped);
    assert!(t.output_ids.len() < 400, "the sequence was cancelled");
    assert_eq!(s.engine.tokenizer.decode(&t.output_ids), partial, "stored token IDs are the reply the user saw");
    let (st, _) = c
        .json(
            Method::POST,
            &format!("/v1/conversations/{conv}/turns"),
            Some(&json!({"turn_id": "next", "message": "Go on.", "max_tokens": 4, "stream": false})),
        )
        .await
        .unwrap();
    assert_eq!(st, StatusCode::OK);
    let next = s.store.get_turn(&conv, "next").await.unwrap().unwrap();
    let mut expect = t.prompt_ids.clone();
    expect.extend_from_slice(&t.output_ids);
    assert!(next.prompt_ids.starts_with(&expect));
    let after = s.engine.tokenizer.decode_with_special(&next.prompt_ids[t.prompt_ids.len()..], true);
    assert!(after.starts_with(&format!("{partial}<|im_end|>\n<|im_start|>user\nGo on.")), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_string_leaves_the_next_prompt_with_only_the_text_shown() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let body = json!({"turn_id": "t", "message": "Count from one to twenty in words.", "max_tokens": 40, "temperature": 0});
    let (_, full, _) = read_turn(turn(&c, &new_conversation(&c).await, body.clone(), &[]).await).await;
    // Greedy decoding repeats the reply; stop in the middle of a word, which is
    // inside a token, so the stop string's first token is only partly shown.
    let words: Vec<(usize, &str)> = full.match_indices(|ch: char| ch.is_alphabetic()).map(|(i, _)| (i, &full[i..])).collect();
    let (cut, _) = words.iter().copied().find(|&(i, rest)| i > full.len() / 2 && rest.len() > 3 && full[..i].ends_with(|ch: char| ch.is_alphabetic())).expect("a word to cut");
    let stop = full[cut..].chars().take(3).collect::<String>();
    let shown_expected = &full[..full.find(&stop).unwrap()];
    let conv = new_conversation(&c).await;
    let mut b = body.clone();
    b["stop"] = json!([stop]);
    let (_, shown, done) = read_turn(turn(&c, &conv, b, &[]).await).await;
    assert_eq!(shown, shown_expected, "the reply ends before the stop string");
    assert_eq!(done["finish_reason"], "stop", "{done}");
    let t = s.store.get_turn(&conv, "t").await.unwrap().unwrap();
    assert_eq!(s.engine.tokenizer.decode(&t.output_ids), shown, "stored IDs spell exactly what was shown");
    let (st, _) = c
        .json(Method::POST, &format!("/v1/conversations/{conv}/turns"), Some(&json!({"turn_id": "n", "message": "Go on.", "max_tokens": 2, "stream": false})))
        .await
        .unwrap();
    assert_eq!(st, StatusCode::OK);
    let next = s.store.get_turn(&conv, "n").await.unwrap().unwrap();
    let after = s.engine.tokenizer.decode_with_special(&next.prompt_ids[t.prompt_ids.len()..], true);
    assert!(after.starts_with(&format!("{shown}<|im_end|>\n<|im_start|>user\nGo on.")), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sse_resume_with_last_event_id() {
    let Some(s) = common::start(&["--resume-grace-seconds", "30"]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let body = json!({"turn_id": "r1", "message": "Count from one to twenty in words.", "max_tokens": 48, "temperature": 0});
    let mut r = turn(&c, &conv, body.clone(), &[]).await;
    let mut first = Vec::new();
    while first.len() < 3 {
        let ev = r.next_event().await.unwrap().unwrap();
        assert_eq!(ev.event.as_deref(), Some("delta"));
        first.push((ev.id.unwrap(), serde_json::from_str::<Value>(&ev.data).unwrap()["text"].as_str().unwrap().to_string()));
    }
    assert_eq!(first.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), vec!["0", "1", "2"]);
    drop(r); // the connection drops mid-stream
    let resumed = c.send(Method::GET, &format!("/v1/conversations/{conv}/turns/r1/events"), None, &[("last-event-id", "2")]).await.unwrap();
    let (ids, rest, done) = read_turn(resumed).await;
    assert_eq!(ids[0], "3", "resume starts after the last event seen");
    let text: String = first.iter().map(|f| f.1.as_str()).collect::<String>() + &rest;
    assert_eq!(text, done["reply"].as_str().unwrap());
    // After the end, resume replays from the durable token log.
    let again = turn(&c, &conv, body, &[("last-event-id", "0")]).await;
    let (ids2, rest2, _) = read_turn(again).await;
    assert_eq!(ids2[0], "1");
    assert_eq!(first[0].1.clone() + &rest2, text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delete_leaves_no_row_and_no_kv_block() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let (st, _) = c.json(Method::POST, &format!("/v1/conversations/{conv}/turns"), Some(&json!({"turn_id": "d1", "message": "Describe a cat in detail, please, with many words.", "max_tokens": 40, "stream": false}))).await.unwrap();
    assert_eq!(st, StatusCode::OK);
    let (st, _) = s.client2().json(Method::DELETE, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::NOT_FOUND, "another user cannot delete it");
    let (st, v) = c.json(Method::DELETE, &format!("/v1/conversations/{conv}"), None).await.unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["kv_evicted"], json!(true), "the one engine acknowledged at once: {v}");
    assert_eq!(s.store.count_tombstones().await.unwrap(), 0, "no tombstone is left once evicted");
    assert!(s.store.get_conversation("alice", &conv).await.unwrap().is_none());
    assert!(s.store.list_turns(&conv).await.unwrap().is_empty());
    assert!(s.store.read_log(&conv, "d1", 0).await.unwrap().is_empty());
    assert_eq!(
        s.engine.evict_conversation(baton_engine::kv::ConversationId::parse(conv.clone()).unwrap()).unwrap(),
        0,
        "no KV block of the conversation is left"
    );
    assert_eq!(c.json(Method::GET, &format!("/v1/conversations/{conv}"), None).await.unwrap().0, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_answer_429_with_retry_after() {
    let Some(s) = common::start(&["--turns-per-minute", "2", "--open-streams", "1"]).await else { return };
    let c = s.client();
    let body = chat_body(json!({"max_tokens": 2}));
    // Open streams: a second stream while one is open.
    let r1 = c
        .send(
            Method::POST,
            "/v1/chat/completions",
            Some(chat_body(json!({"stream": true, "max_tokens": 200})).to_string().into_bytes()),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r1.status, StatusCode::OK);
    let r2 = c.send(Method::POST, "/v1/chat/completions", Some(body.to_string().into_bytes()), &[]).await.unwrap();
    assert_eq!(r2.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r2.headers.contains_key("retry-after"));
    let v: Value = serde_json::from_slice(&r2.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    drop(r1);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Turns per minute: the second turn passes, the third waits ~30 s.
    assert_eq!(c.json(Method::POST, "/v1/chat/completions", Some(&body)).await.unwrap().0, StatusCode::OK);
    let r3 = c.send(Method::POST, "/v1/chat/completions", Some(body.to_string().into_bytes()), &[]).await.unwrap();
    assert_eq!(r3.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r3.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((20..=31).contains(&retry), "retry-after {retry}");
    // Other users are not affected.
    assert_eq!(s.client2().json(Method::POST, "/v1/chat/completions", Some(&body)).await.unwrap().0, StatusCode::OK);

    // Per-key overrides: alice's batch key has its own, larger budget; her first key stays limited.
    let batch = baton_api_gateway::auth::create_key(&s.store, "alice", "batch").await.unwrap();
    let o = baton_api_gateway::limits::LimitOverrides { turns_per_minute: Some(600.0), ..Default::default() };
    assert_eq!(s.store.set_key_limits(&baton_api_gateway::auth::key_prefix(&batch), Some(&o)).await.unwrap(), 1);
    let batch_client = Client::new(s.base.clone(), Some(batch));
    for _ in 0..3 {
        assert_eq!(batch_client.json(Method::POST, "/v1/chat/completions", Some(&body)).await.unwrap().0, StatusCode::OK);
    }
    assert_eq!(c.send(Method::POST, "/v1/chat/completions", Some(body.to_string().into_bytes()), &[]).await.unwrap().status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_requests_get_the_right_status_and_store_nothing() {
    let Some(s) = common::start(&["--max-body-bytes", "4096"]).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let bob_conv = new_conversation(&s.client2()).await;
    let turns = format!("/v1/conversations/{conv}/turns");
    let cases: Vec<(&str, String, Vec<u8>, StatusCode)> = vec![
        ("not json", "/v1/chat/completions".into(), b"{nope".to_vec(), StatusCode::BAD_REQUEST),
        ("wrong type", "/v1/chat/completions".into(), br#"{"messages": "hi"}"#.to_vec(), StatusCode::BAD_REQUEST),
        ("empty messages", "/v1/chat/completions".into(), br#"{"messages": []}"#.to_vec(), StatusCode::BAD_REQUEST),
        (
            "bad role",
            "/v1/chat/completions".into(),
            br#"{"messages": [{"role": "wizard", "content": "x"}]}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "temperature",
            "/v1/chat/completions".into(),
            br#"{"messages": [{"role": "user", "content": "x"}], "temperature": 9}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "top_logprobs w/o logprobs",
            "/v1/chat/completions".into(),
            br#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "max_tokens negative",
            "/v1/chat/completions".into(),
            br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}"#.to_vec(),
            StatusCode::BAD_REQUEST,
        ),
        ("invalid utf-8", turns.clone(), b"{\"message\": \"\xff\xfe\"}".to_vec(), StatusCode::BAD_REQUEST),
        ("huge body", turns.clone(), format!("{{\"message\": \"{}\"}}", "a".repeat(10_000)).into_bytes(), StatusCode::PAYLOAD_TOO_LARGE),
        ("unknown field", turns.clone(), br#"{"message": "x", "user": "bob"}"#.to_vec(), StatusCode::BAD_REQUEST),
        ("missing message", turns.clone(), br#"{"turn_id": "x"}"#.to_vec(), StatusCode::BAD_REQUEST),
        ("bad turn id", turns.clone(), br#"{"message": "x", "turn_id": "a b/../c"}"#.to_vec(), StatusCode::BAD_REQUEST),
        ("unknown conversation", "/v1/conversations/conv-nope/turns".into(), br#"{"message": "x"}"#.to_vec(), StatusCode::NOT_FOUND),
        (
            "other user's conversation",
            format!("/v1/conversations/{bob_conv}/turns"),
            br#"{"message": "x"}"#.to_vec(),
            StatusCode::NOT_FOUND,
        ),
    ];
    for (name, path, body, status) in cases {
        let r = c.send(Method::POST, &path, Some(body), &[]).await.unwrap();
        let got = r.status;
        let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
        assert_eq!(got, status, "{name}: {v}");
        assert!(v["error"]["type"].is_string() && v["error"]["message"].is_string(), "{name}: OpenAI error shape: {v}");
    }
    assert!(s.store.list_turns(&conv).await.unwrap().is_empty(), "nothing stored");
    assert!(s.store.list_turns(&bob_conv).await.unwrap().is_empty(), "nothing stored");
    assert_eq!(s.store.usage("alice").await.unwrap().requests, 0, "nothing metered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn history_past_the_threshold_is_summarized_once_then_appended() {
    let flags = ["--summary-threshold-tokens", "120", "--summary-keep-turns", "0", "--summary-max-tokens", "40"];
    let Some(s) = common::start(&flags).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let path = format!("/v1/conversations/{conv}/turns");
    let send = |id: &str, msg: &str, max: u32| json!({"turn_id": id, "message": msg, "max_tokens": max, "temperature": 0, "stream": false});
    assert_eq!(c.json(Method::POST, &path, Some(&send("s1", "My name is Ada. Tell me about rivers.", 120))).await.unwrap().0, StatusCode::OK);
    let t1 = s.store.get_turn(&conv, "s1").await.unwrap().unwrap();
    assert!(t1.prompt_ids.len() + t1.output_ids.len() > 120, "the test needs turn 1 past the threshold");
    assert_eq!(c.json(Method::POST, &path, Some(&send("s2", "What is my name?", 8))).await.unwrap().0, StatusCode::OK);
    let summary = s.store.get_conversation("alice", &conv).await.unwrap().unwrap().summary.expect("a summary is stored");
    assert!(!summary.is_empty());
    let t2 = s.store.get_turn(&conv, "s2").await.unwrap().unwrap();
    let text = s.engine.tokenizer.decode_with_special(&t2.prompt_ids, true);
    assert!(text.contains(&format!("{}{}", baton_api_gateway::context::SUMMARY_PREFIX, summary)), "{text:?}");
    assert!(t2.prompt_ids.len() < t1.prompt_ids.len() + t1.output_ids.len(), "the rebuilt prompt is shorter");
    assert_eq!(c.json(Method::POST, &path, Some(&send("s3", "Thanks.", 4))).await.unwrap().0, StatusCode::OK);
    let t3 = s.store.get_turn(&conv, "s3").await.unwrap().unwrap();
    let mut expect = t2.prompt_ids.clone();
    expect.extend_from_slice(&t2.output_ids);
    assert!(t3.prompt_ids.starts_with(&expect), "after the summary, turns append again");
}

/// #39.6: a summary is model work for its owner, so it passes the owner's limits
/// before the model is asked. With two turns a minute, the first turn and the
/// summary before the second spend both: the second turn is refused, and its
/// retries are refused without generating (before the fix the summary was free,
/// and a user out of quota got a summary generated on every refused retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_summary_is_charged_to_its_owner_and_refused_over_the_limit() {
    let flags = ["--summary-threshold-tokens", "120", "--summary-keep-turns", "0", "--summary-max-tokens", "40", "--turns-per-minute", "2"];
    let Some(s) = common::start(&flags).await else { return };
    let c = s.client();
    let conv = new_conversation(&c).await;
    let path = format!("/v1/conversations/{conv}/turns");
    let send = |id: &str, msg: &str, max: u32| json!({"turn_id": id, "message": msg, "max_tokens": max, "temperature": 0, "stream": false});
    assert_eq!(c.json(Method::POST, &path, Some(&send("s1", "My name is Ada. Tell me about rivers.", 120))).await.unwrap().0, StatusCode::OK);
    let t1 = s.store.get_turn(&conv, "s1").await.unwrap().unwrap();
    assert!(t1.prompt_ids.len() + t1.output_ids.len() > 120, "the test needs turn 1 past the threshold");
    for _ in 0..3 {
        let (st, v) = c.json(Method::POST, &path, Some(&send("s2", "What is my name?", 8))).await.unwrap();
        assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "the summary spent the second turn of the minute: {v}");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    }
    assert!(s.store.get_turn(&conv, "s2").await.unwrap().is_none(), "a refused turn is not stored");
}

/// #39.10: creating and listing conversations is limited per owner, with the same
/// 429 as every other limit; another user is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conversation_create_and_list_are_limited_per_owner() {
    let Some(s) = common::start(&["--conversation-requests-per-minute", "3"]).await else { return };
    let c = s.client();
    new_conversation(&c).await;
    new_conversation(&c).await;
    assert_eq!(c.json(Method::GET, "/v1/conversations", None).await.unwrap().0, StatusCode::OK);
    for (method, body) in [(Method::POST, Some(json!({"title": "t"}))), (Method::GET, None)] {
        let r = c.send(method, "/v1/conversations", body.map(|b| b.to_string().into_bytes()), &[]).await.unwrap();
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=21).contains(&retry), "{retry}");
        let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    }
    assert_eq!(s.store.list_conversations("alice").await.unwrap().len(), 2, "the refused create stored nothing");
    let (st, _) = s.client2().json(Method::GET, "/v1/conversations", None).await.unwrap();
    assert_eq!(st, StatusCode::OK, "another owner has its own budget");
}
