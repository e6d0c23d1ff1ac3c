//! `POST /v1/chat/completions` and `GET /v1/models`, compatible with the
//! official OpenAI clients: streaming (SSE, `data: [DONE]`) and not,
//! `max_tokens`/`max_completion_tokens`, `temperature`, `top_p`, `seed`,
//! `stop`, `logprobs` + `top_logprobs`, `stream_options.include_usage`, and
//! `usage.prompt_tokens_details.cached_tokens`.
//!
//! The request is stateless: the client resends the history. Its routing key
//! (the decode ring key and the KV tag) is the `X-Baton-Conversation` header
//! when present, else a hash of the owner, the system prompt and the first
//! user message, which every later turn of the same chat resends unchanged.

use crate::auth::AuthUser;
use crate::checks::ContentCheck;
use crate::error::ApiError;
use crate::pipeline::{End, TokenInfo};
use crate::state::App;
use crate::openai_common::{
    collect_reply, finish_reason, read_request, routing_key_for, sse_response, usage_json, ChunkFormat, CommonFields, Envelope,
};
use crate::metrics;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use baton_text::chat_template::ChatMessage;
use baton_text::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;


#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// The request body, as parsed (unknown fields are ignored, as OpenAI's
/// clients send some this server does not use).
#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
}

/// A request that passed validation.
#[derive(Debug)]
pub struct ValidChat {
    pub messages: Vec<ChatMessage>,
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// Parses and validates a body (pure: the fuzz and property tests call it).
pub fn parse_chat(body: &[u8], default_max_tokens: usize) -> Result<ValidChat, ApiError> {
    let req: ChatRequest = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_param("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in req.messages {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            _ => return Err(ApiError::bad_param("messages", format!("unsupported role {:?}", m.role))),
        };
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => s.push_str(&t),
                        _ => return Err(ApiError::bad_param("messages", "only text content parts are supported")),
                    }
                }
                s
            }
        };
        messages.push(ChatMessage::new(role, content));
    }
    if !messages.iter().any(|m| m.role == "user") {
        return Err(ApiError::bad_param("messages", "at least one user message is required"));
    }
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens).map(|v| v as usize).unwrap_or(default_max_tokens);
    let p = req.common.into_sampling(max_tokens, req.logprobs.unwrap_or(false), req.top_logprobs.unwrap_or(0) as usize)?;
    Ok(ValidChat { messages, sampling: p.sampling, stream: p.stream, include_usage: p.include_usage })
}

/// The input check on every message of a request: the client wrote all of
/// them (system, developer, user and assistant turns alike; the parser
/// refuses other roles and ignores `name`, which never reaches the prompt),
/// and all of them become prompt text.
pub fn check_messages(check: &dyn ContentCheck, messages: &[ChatMessage]) -> Result<(), ApiError> {
    for (i, m) in messages.iter().enumerate() {
        check.check_input(&m.content).map_err(|reason| ApiError {
            param: Some("messages"),
            ..ApiError::refused(format!("messages[{i}] ({}): {reason}", m.role))
        })?;
    }
    Ok(())
}

/// The routing key of a plain OpenAI request.
pub fn routing_key(owner: &str, messages: &[ChatMessage]) -> String {
    let mut h = Sha256::new();
    h.update(owner.as_bytes());
    h.update([0]);
    if let Some(s) = messages.iter().find(|m| m.role == "system") {
        h.update(s.content.as_bytes());
    }
    h.update([0]);
    if let Some(u) = messages.iter().find(|m| m.role == "user") {
        h.update(u.content.as_bytes());
    }
    let d = h.finalize();
    format!("oa-{}", d[..12].iter().map(|b| format!("{b:02x}")).collect::<String>())
}

pub async fn models(State(app): State<Arc<App>>, _user: AuthUser) -> Json<Value> {
    metrics::request("models");
    Json(json!({
        "object": "list",
        "data": [{"id": app.model_id, "object": "model", "created": 0, "owned_by": "baton"}]
    }))
}

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    AuthUser(user, api_key): AuthUser,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let chat = read_request(&app, "chat_completions", body, |b| parse_chat(b, app.config.default_max_tokens), |c| c.sampling.max_tokens).await?;
    check_messages(app.checks.as_ref(), &chat.messages)?;
    let prompt = app.context.encode_messages(&chat.messages).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let key = routing_key_for(&headers, &user, || routing_key(user.as_str(), &chat.messages))?;
    let envelope = Envelope::new(&app, "chatcmpl", "chat.completion");
    tracing::info!(request = %envelope.id, user = %crate::auth::user_log_id(user.as_str()), prompt_tokens = prompt.ids.len(), "chat completion");
    let mut reply = app.start_reply(&user, &api_key, prompt, key, chat.sampling.clone()).await?;
    let format = ChatChunks;
    if chat.stream {
        return Ok(sse_response(reply, envelope.chunks("chat.completion.chunk"), chat.include_usage, format).into_response());
    }
    let (content, tokens, end) = collect_reply(&mut reply).await?;
    let logprobs = chat.sampling.logprobs.then(|| json!({"content": tokens.iter().filter_map(logprob_entry).collect::<Vec<_>>()}));
    let choice = json!({
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason(&end),
    });
    Ok(Json(envelope.body(json!([choice]), Some(usage_json(&end)))).into_response())
}

/// One `logprobs.content` entry: the token's filtered text ([`TokenInfo`]), never the
/// tokenizer's spelling of its ID.
fn token_json(text: &str, logprob: f32) -> Value {
    json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
}

fn logprob_entry(t: &TokenInfo) -> Option<Value> {
    let lp = t.logprob?;
    let mut v = token_json(&t.text, lp);
    v["top_logprobs"] = Value::Array(t.top_logprobs.iter().map(|a| token_json(&a.text, a.logprob)).collect());
    Some(v)
}

/// Chat's chunks: a role delta first, then content deltas with `logprobs.content`.
struct ChatChunks;

impl ChunkFormat for ChatChunks {
    fn opening(&mut self) -> Option<Value> {
        Some(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}))
    }

    fn delta(&mut self, text: String, token: Option<&TokenInfo>) -> Option<Value> {
        let lp = token.and_then(logprob_entry);
        if text.is_empty() && lp.is_none() {
            return None;
        }
        let mut choice = json!({"index": 0, "delta": {"content": text}, "finish_reason": null});
        if let Some(l) = lp {
            choice["logprobs"] = json!({"content": [l]});
        }
        Some(choice)
    }

    fn finish(&mut self, end: &End) -> Value {
        json!({"index": 0, "delta": {}, "finish_reason": finish_reason(end)})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_strings_parts_and_stop_forms() {
        let v = parse_chat(br#"{"messages":[{"role":"developer","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"stop":"x","max_completion_tokens":3,"logprobs":true,"top_logprobs":2}"#, 9).unwrap();
        assert_eq!(v.messages[0].role, "system");
        assert_eq!(v.messages[1].content, "ab");
        assert_eq!(v.sampling.stop_strings, vec!["x".to_string()]);
        assert_eq!(v.sampling.max_tokens, 3);
        assert_eq!(v.sampling.top_logprobs, 2);
        assert!(parse_chat(br#"{"messages":[{"role":"user","content":"a"}],"n":2}"#, 9).is_err());
        assert!(parse_chat(br#"{"messages":[{"role":"assistant","content":"a"}]}"#, 9).is_err());
    }

    #[test]
    fn routing_key_ignores_later_turns() {
        let a = [ChatMessage::system("s"), ChatMessage::user("u1")];
        let b = [ChatMessage::system("s"), ChatMessage::user("u1"), ChatMessage::assistant("r"), ChatMessage::user("u2")];
        assert_eq!(routing_key("alice", &a), routing_key("alice", &b));
        assert_ne!(routing_key("alice", &a), routing_key("bob", &a));
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|n| json!(n)),
            "[a-z ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(
                    (
                        prop_oneof![
                            Just("messages".to_string()),
                            Just("role".to_string()),
                            Just("content".to_string()),
                            Just("max_tokens".to_string()),
                            Just("stop".to_string()),
                            Just("temperature".to_string()),
                            "[a-z]{1,6}".prop_map(|s| s)
                        ],
                        inner
                    ),
                    0..5
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_bytes(body in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_chat(&body, 16);
        }

        #[test]
        fn parser_never_panics_on_json(v in json_value()) {
            if let Ok(ok) = parse_chat(v.to_string().as_bytes(), 16) {
                prop_assert!(!ok.messages.is_empty());
                prop_assert!(ok.sampling.max_tokens >= 1);
            }
        }
    }
}
