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
use crate::listen::read_body;
use crate::params::{check_max_tokens, Stop};
use crate::pipeline::{End, Piece, Reply, TokenInfo};
use crate::state::App;
use crate::{metrics, request_id};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use baton_text::chat_template::ChatMessage;
use baton_text::sampling::SamplingParams;
use baton_vocab::{ConversationId, OwnerId};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::sync::Arc;

/// Header naming the conversation a plain OpenAI request belongs to.
pub const CONVERSATION_HEADER: &str = "x-baton-conversation";

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

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields chat and legacy completions share, flattened into both bodies.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct CommonFields {
    /// Ignored: one model is served.
    pub model: Option<String>,
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
}

/// What [`CommonFields::into_sampling`] makes of a body.
#[derive(Debug)]
pub struct CommonParams {
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

impl CommonFields {
    /// Refuses `n` other than 1, applies OpenAI's defaults and validates the sampling
    /// parameters. `max_tokens` is the endpoint's (chat also reads `max_completion_tokens`).
    pub fn into_sampling(self, max_tokens: usize, logprobs: bool, top_logprobs: usize) -> Result<CommonParams, ApiError> {
        if self.n.unwrap_or(1) != 1 {
            return Err(ApiError::bad_param("n", "only n = 1 is supported"));
        }
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            seed: self.seed,
            max_tokens,
            stop_strings: Stop::into_strings(self.stop),
            logprobs,
            top_logprobs,
            ..SamplingParams::default()
        };
        let sampling = sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?.into_inner();
        Ok(CommonParams { sampling, stream: self.stream, include_usage: self.stream_options.is_some_and(|o| o.include_usage) })
    }
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
    let format = ChatChunks { app: app.clone() };
    if chat.stream {
        return Ok(sse_response(reply, envelope.chunks("chat.completion.chunk"), chat.include_usage, format).into_response());
    }
    let (content, tokens, end) = collect_reply(&mut reply).await?;
    let logprobs = chat.sampling.logprobs.then(|| json!({"content": tokens.iter().filter_map(|t| logprob_entry(&app, t)).collect::<Vec<_>>()}));
    let choice = json!({
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason(&end),
    });
    Ok(Json(envelope.body(json!([choice]), Some(usage_json(&end)))).into_response())
}

/// What every stateless endpoint does first: count the request (`route` is its metric
/// label), read the body within the size and time limits, parse it, and refuse a
/// `max_tokens` above the operator's ceiling.
pub async fn read_request<T>(
    app: &App,
    route: &'static str,
    body: Body,
    parse: impl FnOnce(&[u8]) -> Result<T, ApiError>,
    max_tokens: impl FnOnce(&T) -> usize,
) -> Result<T, ApiError> {
    metrics::request(route);
    let body = read_body(body, app.config.max_body_bytes, app.config.connections.header_timeout).await?;
    let parsed = parse(&body)?;
    check_max_tokens(max_tokens(&parsed), app.config.max_tokens_ceiling)?;
    Ok(parsed)
}

/// The routing key of a stateless request: the `X-Baton-Conversation` header, scoped to
/// the owner, when the client sends one; else `derived()`.
/// The one place a stateless request's conversation becomes an ID (a header may still
/// hold a character no ID may).
pub fn routing_key_for(headers: &HeaderMap, owner: &OwnerId, derived: impl FnOnce() -> String) -> Result<ConversationId, ApiError> {
    let key = match headers.get(CONVERSATION_HEADER).and_then(|v| v.to_str().ok()) {
        Some(c) if !c.is_empty() && c.len() <= 128 => format!("{owner}/{c}"),
        Some(_) => return Err(ApiError::bad_request("X-Baton-Conversation must be 1 to 128 characters")),
        None => derived(),
    };
    ConversationId::parse(key).map_err(|e| ApiError::bad_request(format!("X-Baton-Conversation: {e}")))
}

/// The fields every response object and stream chunk of one request shares.
#[derive(Clone, Debug)]
pub struct Envelope {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    pub created: i64,
    pub model: String,
}

impl Envelope {
    pub fn new(app: &App, id_prefix: &str, object: &'static str) -> Self {
        Envelope { id: format!("{id_prefix}-{}", request_id()), object, created: crate::store::now_unix(), model: app.model_id.clone() }
    }

    /// The same request's stream chunks, whose object type may differ.
    pub fn chunks(self, object: &'static str) -> Self {
        Envelope { object, ..self }
    }

    /// A response object or chunk holding `choices` (and `usage` when given).
    pub fn body(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn token_json(app: &App, id: u32, logprob: f32) -> Value {
    let bytes = app.context.tokenizer.token_bytes(id).unwrap_or_default();
    json!({"token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes})
}

fn logprob_entry(app: &App, t: &TokenInfo) -> Option<Value> {
    let lp = t.logprob?;
    let mut v = token_json(app, t.id, lp);
    v["top_logprobs"] = Value::Array(t.top_logprobs.iter().map(|&(id, lp)| token_json(app, id, lp)).collect());
    Some(v)
}

pub fn usage_json(end: &End) -> Value {
    let u = end.usage;
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}
    })
}

pub fn finish_reason(end: &End) -> &'static str {
    match end.finish_reason {
        "cancelled" => "stop",
        other => other,
    }
}

/// Reads a whole reply: its text, its tokens and how it ended; a failed reply is the error.
pub async fn collect_reply(reply: &mut Reply) -> Result<(String, Vec<TokenInfo>, End), ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let end = loop {
        match reply.next().await {
            Some(Piece::Delta { text: t, token }) => {
                text.push_str(&t);
                tokens.extend(token);
            }
            Some(Piece::End(end)) => break end,
            None => return Err(ApiError::internal()),
        }
    };
    if let Some(e) = end.error.clone() {
        metrics::turn("failed");
        return Err(e.into());
    }
    metrics::turn("completed");
    Ok((text, tokens, end))
}

/// How one endpoint spells the `choices[0]` of its stream chunks; [`sse_response`] does the rest.
pub trait ChunkFormat: Send + 'static {
    /// The choice of a chunk sent before any text (chat: the assistant role).
    fn opening(&mut self) -> Option<Value> {
        None
    }
    /// The choice of a chunk carrying `text` and the token it came from; `None` sends nothing.
    fn delta(&mut self, text: String, token: Option<&TokenInfo>) -> Option<Value>;
    /// The choice of the last chunk, which carries the finish reason.
    fn finish(&mut self, end: &End) -> Value;
}

/// Chat's chunks: a role delta first, then content deltas with `logprobs.content`.
struct ChatChunks {
    app: Arc<App>,
}

impl ChunkFormat for ChatChunks {
    fn opening(&mut self) -> Option<Value> {
        Some(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}))
    }

    fn delta(&mut self, text: String, token: Option<&TokenInfo>) -> Option<Value> {
        let lp = token.and_then(|t| logprob_entry(&self.app, t));
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

struct StreamState<F> {
    reply: Reply,
    envelope: Envelope,
    format: F,
    include_usage: bool,
    opened: bool,
    /// Events to send before reading the reply again.
    queue: std::collections::VecDeque<Event>,
    done: bool,
}

/// A reply as OpenAI's server-sent events: `format`'s chunks in `envelope`, the usage
/// chunk (`choices: []`) when asked for, an error object if the reply failed, then
/// `data: [DONE]`.
pub fn sse_response(reply: Reply, envelope: Envelope, include_usage: bool, format: impl ChunkFormat) -> impl IntoResponse {
    let state = StreamState { reply, envelope, format, include_usage, opened: false, queue: Default::default(), done: false };
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(ev) = s.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(ev), s));
            }
            if s.done {
                return None;
            }
            if !s.opened {
                s.opened = true;
                if let Some(choice) = s.format.opening() {
                    s.queue.push_back(Event::default().data(s.envelope.body(json!([choice]), None).to_string()));
                }
                continue;
            }
            match s.reply.next().await {
                Some(Piece::Delta { text, token }) => {
                    if let Some(choice) = s.format.delta(text, token.as_ref()) {
                        s.queue.push_back(Event::default().data(s.envelope.body(json!([choice]), None).to_string()));
                    }
                }
                Some(Piece::End(end)) => {
                    s.done = true;
                    if let Some(e) = &end.error {
                        metrics::turn("failed");
                        let err = ApiError::from(e.clone());
                        s.queue.push_back(Event::default().data(err.body().to_string()));
                    } else {
                        metrics::turn("completed");
                        let choice = s.format.finish(&end);
                        s.queue.push_back(Event::default().data(s.envelope.body(json!([choice]), None).to_string()));
                        if s.include_usage {
                            let v = s.envelope.body(json!([]), Some(usage_json(&end)));
                            s.queue.push_back(Event::default().data(v.to_string()));
                        }
                    }
                    s.queue.push_back(Event::default().data("[DONE]"));
                }
                None => {
                    s.done = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
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
