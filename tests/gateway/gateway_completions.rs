//! `POST /v1/completions` end to end, in front of the real engine: a raw prompt gives
//! what the engine gives for `baton generate --prompt` (greedy, same tokens), streamed
//! or not, as a string or as token IDs; stop strings, legacy logprobs, usage with cached
//! tokens, the owner's cache scope, refusals, the input check, and Gemma 3 (a base
//! model, no chat template) served here while its chat requests get a clear 400.

use crate::common;

use baton_api_gateway::client::{Client, Method, StatusCode};
use baton_engine::kv::OwnerId;
use baton_engine::{Engine, Event, Request};
use baton_text::sampling::SamplingParams;
use serde_json::{json, Value};
use std::path::PathBuf;

const PROMPT: &str = "The capital of France is";

/// A prompt long enough to fill whole KV blocks, so that a warm resend reports cached tokens.
const LONG_PROMPT: &str = "Once upon a time, in a small village at the edge of a great forest, there lived an old \
    clockmaker who repaired every clock in the valley. One winter morning a stranger knocked on his door and said";

/// What the engine itself generates for a raw prompt, greedy: `baton generate --prompt`'s text.
async fn engine_text(engine: &Engine, prompt: &str, max_tokens: usize) -> String {
    let sampling = SamplingParams { temperature: 0.0, max_tokens, ..SamplingParams::default() }.validate().unwrap();
    let ids = engine.tokenizer.encode_prompt(prompt).unwrap();
    let mut stream = engine
        .submit(Request { prompt: ids, owner: OwnerId::parse("direct").unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: false })
        .unwrap();
    let mut text = String::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Event::Token(t) => text.push_str(&t.text),
            Event::Finished { trailing_text, .. } => {
                text.push_str(&trailing_text);
                return text;
            }
            Event::Failed(e) => panic!("engine failed: {e}"),
        }
    }
    panic!("the engine stream ended without finishing");
}

async fn complete(c: &Client, body: Value) -> (StatusCode, Value) {
    c.json(Method::POST, "/v1/completions", Some(&body)).await.unwrap()
}

/// Reads a streamed completion: its text, the chunks' logprobs objects, the finish reason, the usage chunk.
async fn complete_streaming(c: &Client, body: Value) -> (String, Vec<Value>, Value, Value) {
    let mut r = c.send(Method::POST, "/v1/completions", Some(body.to_string().into_bytes()), &[]).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let (mut text, mut lps, mut finish, mut usage, mut done) = (String::new(), vec![], Value::Null, Value::Null, false);
    while let Some(ev) = r.next_event().await.unwrap() {
        if ev.data == "[DONE]" {
            done = true;
            continue;
        }
        assert!(!done, "data after [DONE]");
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        assert_eq!(v["object"], "text_completion", "{v}");
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        match v["choices"].as_array().unwrap().first() {
            Some(ch) => {
                text.push_str(ch["text"].as_str().unwrap());
                if !ch["logprobs"].is_null() {
                    lps.push(ch["logprobs"].clone());
                }
                if !ch["finish_reason"].is_null() {
                    finish = ch["finish_reason"].clone();
                }
            }
            None => usage = v["usage"].clone(),
        }
    }
    assert!(done, "no [DONE]");
    (text, lps, finish, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raw_prompt_gives_the_engines_text_streamed_or_not_as_text_or_ids() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let want = engine_text(&s.engine, PROMPT, 12).await;
    assert!(!want.is_empty());

    let (st, v) = complete(&c, json!({"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "smollm2");
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"], want.as_str());
    assert!(choice["logprobs"].is_null());
    assert!(choice["finish_reason"] == "length" || choice["finish_reason"] == "stop", "{v}");
    let prompt_ids = s.engine.tokenizer.encode_prompt(PROMPT).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, prompt_ids.len());
    assert_eq!(v["usage"]["total_tokens"], v["usage"]["prompt_tokens"].as_u64().unwrap() + v["usage"]["completion_tokens"].as_u64().unwrap());

    let stream_body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (text, lps, finish, usage) = complete_streaming(&c, stream_body).await;
    assert_eq!(text, want);
    assert!(lps.is_empty());
    assert_eq!(finish, choice["finish_reason"]);
    assert_eq!(usage["completion_tokens"], v["usage"]["completion_tokens"], "{usage}");

    // The same prompt as token IDs, and as a one-element list of them.
    for prompt in [json!(prompt_ids), json!([prompt_ids])] {
        let (st, t) = complete(&c, json!({"prompt": prompt, "max_tokens": 12, "temperature": 0})).await;
        assert_eq!(st, StatusCode::OK, "{t}");
        assert_eq!(t["choices"][0]["text"], want.as_str());
        assert_eq!(t["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_prompt_is_warm_for_its_owner_only() {
    let Some(s) = common::start(&[]).await else { return };
    let body = json!({"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0});
    let (st, first) = complete(&s.client(), body.clone()).await;
    assert_eq!(st, StatusCode::OK, "{first}");
    let (_, again) = complete(&s.client(), body.clone()).await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0, "a resent prompt must hit the cache: {again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    // Bob sends alice's prompt: the cache is scoped to the owner (no platform prefix), so nothing of hers serves him.
    let (st, bob) = complete(&s.client2(), body).await;
    assert_eq!(st, StatusCode::OK, "{bob}");
    assert_eq!(bob["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{bob}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_strings_end_the_text_before_them() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let full = engine_text(&s.engine, PROMPT, 16).await;
    // A stop string from the middle of the greedy text: the reply is what comes before its first occurrence.
    let mid = full.char_indices().map(|(i, _)| i).find(|&i| i >= full.len() / 2).unwrap();
    let stop: String = full[mid..].chars().take(2).collect();
    let expected = &full[..full.find(&stop).unwrap()];
    for stop in [json!(stop), json!(["never-generated-zzz", stop])] {
        let (st, v) = complete(&c, json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop})).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["choices"][0]["text"], expected, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn legacy_logprobs_have_openais_shape() {
    let Some(s) = common::start(&[]).await else { return };
    let c = s.client();
    let (st, v) = complete(&c, json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), n);
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!((token_logprobs.len(), top.len(), offsets.len()), (n, n, n));
    let mut at = 0;
    for i in 0..n {
        let lp_i = token_logprobs[i].as_f64().unwrap();
        assert!(lp_i <= 0.0);
        let alternatives = top[i].as_object().unwrap();
        // Three alternatives plus the sampled token (greedy: it is among them); texts may coincide.
        assert!((1..=4).contains(&alternatives.len()), "{alternatives:?}");
        assert_eq!(alternatives[tokens[i]].as_f64().unwrap(), lp_i, "the sampled token's own logprob is in its map");
        assert_eq!(offsets[i], at);
        at += tokens[i].chars().count() as u64;
    }
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());

    // logprobs 0: the sampled tokens' logprobs, no alternatives but the token itself; streamed, one token per chunk.
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "stream": true});
    let (text, chunks, _, _) = complete_streaming(&c, body).await;
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(chunks.len(), n);
    for (i, ch) in chunks.iter().enumerate() {
        assert_eq!(ch["tokens"], json!([tokens[i]]));
        assert_eq!(ch["text_offset"], json!([offsets[i]]));
        assert_eq!(ch["top_logprobs"][0].as_object().unwrap().len(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_inputs_are_refused_naming_the_field() {
    let Some(s) = common::start(&["--max-tokens-ceiling", "100", "--default-max-tokens", "8"]).await else { return };
    let c = s.client();
    let vocab = s.engine.tokenizer.vocab_size();
    let cases = [
        (json!({"prompt": [1, vocab]}), "prompt", "vocabulary"),
        (json!({"prompt": ""}), "prompt", "empty"),
        (json!({"prompt": []}), "prompt", "empty"),
        (json!({"prompt": ["one", "two"]}), "prompt", "one prompt per request"),
        (json!({"prompt": "a", "n": 2}), "n", "n = 1"),
        (json!({"prompt": "a", "suffix": "b"}), "suffix", "suffix"),
        (json!({"prompt": "a", "echo": true}), "echo", "echo"),
        (json!({"prompt": "a", "logprobs": 6}), "logprobs", "0 to 5"),
        (json!({"prompt": "a", "max_tokens": 101}), "max_tokens", "at most 100"),
    ];
    for (body, param, says) in cases {
        let (st, v) = complete(&c, body.clone()).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{body} -> {v}");
    }
    let (st, v) = complete(&c, json!({"prompt": "a", "max_tokens": "many"})).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    // No key, no completion.
    let (st, _) = complete(&Client::new(s.base.clone(), None), json!({"prompt": "a"})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_phrase_is_refused_as_text_or_as_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.txt");
    std::fs::write(&rules, "input: forbidden thing\n").unwrap();
    let Some(s) = common::start(&["--check-rules", rules.to_str().unwrap()]).await else { return };
    let c = s.client();
    let text = "Tell me about the forbidden thing, please:";
    let ids = s.engine.tokenizer.encode_prompt(text).unwrap();
    for prompt in [json!(text), json!(ids)] {
        let (st, v) = complete(&c, json!({"prompt": prompt, "max_tokens": 4})).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["type"], "content_policy_violation", "{v}");
        assert_eq!(v["error"]["param"], "prompt");
    }
    let (st, v) = complete(&c, json!({"prompt": "Tell me about a permitted thing:", "max_tokens": 2})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

/// Gemma 3 270M is a base model: no chat template, BOS by its GGUF. Skipped when
/// `BATON_GEMMA_MODEL` is unset (CI sets it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gemma_is_served_by_completions_and_refused_by_chat() {
    let Some(model) = std::env::var_os("BATON_GEMMA_MODEL").map(PathBuf::from) else {
        eprintln!("skipped: BATON_GEMMA_MODEL is unset");
        return;
    };
    let s = common::start_model(&model, &[], |g| g).await;
    assert!(s.engine.tokenizer.add_bos(), "Gemma's GGUF asks for BOS");
    let c = s.client();
    let want = engine_text(&s.engine, PROMPT, 8).await;
    let (st, v) = complete(&c, json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    let ids = s.engine.tokenizer.encode_prompt(PROMPT).unwrap();
    assert_eq!(Some(ids[0]), s.engine.tokenizer.bos_id());
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
    let (text, _, _, _) = complete_streaming(&c, json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": true})).await;
    assert_eq!(text, want);

    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let (st, v) = c.json(Method::POST, "/v1/chat/completions", Some(&chat)).await.unwrap();
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("no chat template"), "{v}");
}
