//! What the two stateless OpenAI endpoints (`/v1/chat/completions` in `openai.rs`,
//! `/v1/completions` in `completions.rs`) share: the sampling fields of both bodies,
//! reading and checking a request, the routing key from `X-Baton-Conversation`, the
//! response envelope, usage and finish reasons, and the SSE stream of chunks. Its own
//! module, so that neither handler module imports the other.

use crate::error::ApiError;
use crate::listen::read_body;
use crate::params::{check_max_tokens, Stop};
use crate::pipeline::{End, Piece, Reply, TokenInfo};
use crate::state::App;
use crate::{metrics, request_id};
use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use baton_text::sampling::SamplingParams;
use baton_vocab::{ConversationId, OwnerId};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;

/// Header naming the conversation a plain OpenAI request belongs to.
pub const CONVERSATION_HEADER: &str = "x-baton-conversation";
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
/// the owner, when the client sends one; else `derived()`. The one place a stateless
/// request's conversation becomes an ID (a header may still hold a character no ID may).
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
