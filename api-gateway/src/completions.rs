//! `POST /v1/completions`: OpenAI's legacy completions, so that base models (no chat
//! template, e.g. Gemma 3 270M) are servable through the same path as chat: the same
//! keys, limits, input and output checks, prefix cache, metering and SSE framing
//! (the shared parts live in [`crate::openai_common`]).
//!
//! The prompt is one string, tokenized raw by [`Tokenizer::encode_prompt`] (exactly as
//! `baton generate --prompt` does), or one array of token IDs, checked against the
//! vocabulary. What is not served is refused with a 400 naming the field: several
//! prompts, `n` > 1, `best_of` > 1, `echo`, `suffix`, `logprobs` above 5.
//!
//! A completion has no platform prefix: every KV block of its prompt is the owner's.
//! Its routing key is the `X-Baton-Conversation` header when present, else a hash of
//! the owner and the prompt's first [`ROUTING_PREFIX_TOKENS`] tokens, which a client
//! resending a growing prompt resends unchanged, so it lands on the warm decode node.

use crate::auth::AuthUser;
use crate::context::Prompt;
use crate::error::ApiError;
use crate::openai_common::{
    collect_reply, finish_reason, read_request, routing_key_for, sse_response, usage_json, ChunkFormat, CommonFields, Envelope,
};
use crate::pipeline::{End, TokenInfo};
use crate::state::App;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use baton_text::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// OpenAI's `max_tokens` when a completions request does not say (chat's default is the
/// operator's `--default-max-tokens`; the legacy API has always defaulted to 16).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// The largest legacy `logprobs` (alternatives per token), as OpenAI.
pub const MAX_LOGPROBS: u32 = 5;

/// Prompt tokens the derived routing key hashes: enough to tell prompts apart, few
/// enough that a growing prompt keeps its key.
pub const ROUTING_PREFIX_TOKENS: usize = 64;

/// The request body, as parsed (unknown fields are ignored, as for chat).
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct CompletionRequest {
    pub prompt: Option<Value>,
    #[serde(flatten)]
    pub common: CommonFields,
    /// Legacy: the number of alternatives per token (0..=5), not a flag.
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
}

/// The prompt as the client sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// A request that passed validation (the prompt is checked against the model later).
#[derive(Debug)]
pub struct ValidCompletion {
    pub prompt: PromptInput,
    pub sampling: baton_text::sampling::SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

fn bad_prompt(message: impl Into<String>) -> ApiError {
    ApiError::bad_param("prompt", message)
}

/// One prompt: a string, an array of token IDs, or a one-element array of either.
fn parse_prompt(v: Option<Value>) -> Result<PromptInput, ApiError> {
    let v = v.ok_or_else(|| bad_prompt("prompt is required"))?;
    let prompt = match v {
        Value::String(s) => PromptInput::Text(s),
        Value::Array(items) if items.iter().all(Value::is_number) => PromptInput::Tokens(token_ids(&items)?),
        Value::Array(mut items) if items.len() == 1 => return parse_prompt(items.pop()),
        Value::Array(items) if items.len() > 1 && items.iter().all(|i| i.is_string() || i.is_array()) => {
            return Err(bad_prompt("one prompt per request: send each prompt as its own request"));
        }
        _ => return Err(bad_prompt("prompt must be a string or an array of token IDs")),
    };
    match &prompt {
        PromptInput::Text(s) if s.is_empty() => Err(bad_prompt("prompt must not be empty")),
        PromptInput::Tokens(ids) if ids.is_empty() => Err(bad_prompt("prompt must not be empty")),
        _ => Ok(prompt),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| bad_prompt(format!("prompt[{i}] is {v}, not a token ID")))
        })
        .collect()
}

/// Parses and validates a body (pure: the property test calls it).
pub fn parse_completion(body: &[u8]) -> Result<ValidCompletion, ApiError> {
    let req: CompletionRequest = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if req.best_of.unwrap_or(1) != 1 {
        return Err(ApiError::bad_param("best_of", "only best_of = 1 is supported"));
    }
    if req.echo.unwrap_or(false) {
        return Err(ApiError::bad_param("echo", "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_param("suffix", "suffix (insertion) is not supported"));
    }
    if let Some(n) = req.logprobs.filter(|&n| n > MAX_LOGPROBS) {
        return Err(ApiError::bad_param("logprobs", format!("logprobs is {n}; it must be 0 to {MAX_LOGPROBS}")));
    }
    let prompt = parse_prompt(req.prompt)?;
    let max_tokens = req.common.max_tokens.map(|v| v as usize).unwrap_or(DEFAULT_MAX_TOKENS);
    let p = req.common.into_sampling(max_tokens, req.logprobs.is_some(), req.logprobs.unwrap_or(0) as usize)?;
    Ok(ValidCompletion { prompt, sampling: p.sampling, stream: p.stream, include_usage: p.include_usage })
}

/// The prompt's token IDs and its text (what the input check reads): a string is
/// tokenized raw; an array's IDs are checked against the vocabulary and decoded.
pub fn prompt_ids(tokenizer: &Tokenizer, prompt: PromptInput) -> Result<(Vec<u32>, String), ApiError> {
    match prompt {
        PromptInput::Text(text) => {
            let ids = tokenizer.encode_prompt(&text).map_err(|e| bad_prompt(e.to_string()))?;
            Ok((ids, text))
        }
        PromptInput::Tokens(ids) => {
            let vocab = tokenizer.vocab_size();
            if let Some((i, id)) = ids.iter().enumerate().find(|&(_, &id)| id as usize >= vocab) {
                return Err(bad_prompt(format!("prompt[{i}] is token ID {id}; the model's vocabulary has {vocab} tokens (IDs 0 to {})", vocab - 1)));
            }
            let text = tokenizer.decode(&ids);
            Ok((ids, text))
        }
    }
}

/// The routing key of a completion without the conversation header.
pub fn routing_key(owner: &str, ids: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(owner.as_bytes());
    h.update([0]);
    for id in &ids[..ids.len().min(ROUTING_PREFIX_TOKENS)] {
        h.update(id.to_le_bytes());
    }
    let d = h.finalize();
    format!("oc-{}", d[..12].iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// The handler: the key's user owns the generation, whatever the body says.
pub async fn completions(State(app): State<Arc<App>>, AuthUser(user, api_key): AuthUser, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let req = read_request(&app, "completions", body, parse_completion, |r| r.sampling.max_tokens).await?;
    let (ids, text) = prompt_ids(&app.context.tokenizer, req.prompt)?;
    app.checks.check_input(&text).map_err(|reason| ApiError {
        param: Some("prompt"),
        ..ApiError::refused(format!("prompt: {reason}"))
    })?;
    let key = routing_key_for(&headers, &user, || routing_key(user.as_str(), &ids))?;
    let envelope = Envelope::new(&app, "cmpl", "text_completion");
    tracing::info!(request = %envelope.id, user = %crate::auth::user_log_id(user.as_str()), prompt_tokens = ids.len(), "completion");
    let prompt = Prompt { ids, platform_prefix_len: 0 };
    let mut reply = app.start_reply(&user, &api_key, prompt, key, req.sampling.clone()).await?;
    let logprobs = req.sampling.logprobs;
    let mut format = TextChunks { logprobs, text_offset: 0 };
    if req.stream {
        return Ok(sse_response(reply, envelope, req.include_usage, format).into_response());
    }
    let (text, tokens, end) = collect_reply(&mut reply).await?;
    let mut lps = LegacyLogprobs::default();
    for t in &tokens {
        format.push_logprob(&mut lps, t);
    }
    let choice = json!({"text": text, "index": 0, "logprobs": logprobs.then(|| lps.into_json()), "finish_reason": finish_reason(&end)});
    Ok(Json(envelope.body(json!([choice]), Some(usage_json(&end)))).into_response())
}

/// The legacy `logprobs` object: parallel lists, one entry per token.
#[derive(Default, Debug)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Map<String, Value>>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn into_json(self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs, "text_offset": self.text_offset})
    }
}

/// Completions' choices: `text` deltas and legacy logprobs.
struct TextChunks {
    logprobs: bool,
    /// Characters of the completion's tokens so far (the next token's `text_offset`).
    text_offset: usize,
}

impl TextChunks {
    /// Appends a token's entry: its logprob, the top alternatives and, as OpenAI does,
    /// the sampled token among them even when it is not in the top.
    fn push_logprob(&mut self, lps: &mut LegacyLogprobs, t: &TokenInfo) {
        let Some(lp) = t.logprob else { return };
        // Filtered text only ([`TokenInfo`]); alternatives whose text is the same (e.g.
        // empty) keep the most likely one's log-probability.
        let text = t.text.clone();
        let mut top = Map::new();
        for a in &t.top_logprobs {
            top.entry(a.text.clone()).or_insert(json!(a.logprob));
        }
        top.entry(text.clone()).or_insert(json!(lp));
        lps.text_offset.push(self.text_offset);
        self.text_offset += text.chars().count();
        lps.tokens.push(text);
        lps.token_logprobs.push(lp);
        lps.top_logprobs.push(top);
    }
}

impl ChunkFormat for TextChunks {
    fn delta(&mut self, text: String, token: Option<&TokenInfo>) -> Option<Value> {
        let mut lps = LegacyLogprobs::default();
        if let (true, Some(t)) = (self.logprobs, token) {
            self.push_logprob(&mut lps, t);
        }
        if text.is_empty() && lps.tokens.is_empty() {
            return None;
        }
        let logprobs = (!lps.tokens.is_empty()).then(|| lps.into_json());
        Some(json!({"text": text, "index": 0, "logprobs": logprobs, "finish_reason": null}))
    }

    fn finish(&mut self, end: &End) -> Value {
        json!({"text": "", "index": 0, "logprobs": null, "finish_reason": finish_reason(end)})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn refused(body: &str, param: &str) {
        let e = parse_completion(body.as_bytes()).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(e.param, Some(param), "{body}: {}", e.message);
    }

    #[test]
    fn parses_the_prompt_forms_and_defaults() {
        let v = parse_completion(br#"{"prompt":"Once upon","stop":["."],"logprobs":2}"#).unwrap();
        assert_eq!(v.prompt, PromptInput::Text("Once upon".into()));
        assert_eq!(v.sampling.max_tokens, DEFAULT_MAX_TOKENS);
        assert_eq!(v.sampling.stop_strings, vec![".".to_string()]);
        assert!(v.sampling.logprobs);
        assert_eq!(v.sampling.top_logprobs, 2);
        let v = parse_completion(br#"{"prompt":[1,2,3],"max_tokens":4,"logprobs":0,"suffix":""}"#).unwrap();
        assert_eq!(v.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        assert_eq!(v.sampling.max_tokens, 4);
        assert!(v.sampling.logprobs);
        assert_eq!(v.sampling.top_logprobs, 0);
        assert_eq!(parse_completion(br#"{"prompt":["a"]}"#).unwrap().prompt, PromptInput::Text("a".into()));
        assert_eq!(parse_completion(br#"{"prompt":[[7]]}"#).unwrap().prompt, PromptInput::Tokens(vec![7]));
        assert!(!parse_completion(br#"{"prompt":"a"}"#).unwrap().sampling.logprobs);
    }

    #[test]
    fn refuses_what_is_not_served_naming_the_field() {
        refused(r#"{"prompt":"a","n":2}"#, "n");
        refused(r#"{"prompt":"a","best_of":3}"#, "best_of");
        refused(r#"{"prompt":"a","echo":true}"#, "echo");
        refused(r#"{"prompt":"a","suffix":"b"}"#, "suffix");
        refused(r#"{"prompt":"a","logprobs":6}"#, "logprobs");
        refused(r#"{"prompt":""}"#, "prompt");
        refused(r#"{"prompt":[]}"#, "prompt");
        refused(r#"{}"#, "prompt");
        refused(r#"{"prompt":["a","b"]}"#, "prompt");
        refused(r#"{"prompt":[[1],[2]]}"#, "prompt");
        refused(r#"{"prompt":[1,-2]}"#, "prompt");
        refused(r#"{"prompt":[1,4294967296]}"#, "prompt");
        refused(r#"{"prompt":{"a":1}}"#, "prompt");
        assert!(parse_completion(br#"{"prompt":"a","temperature":9}"#).is_err());
    }

    #[test]
    fn routing_key_keeps_a_growing_prompt_and_separates_owners() {
        let short: Vec<u32> = (0..100).collect();
        let longer: Vec<u32> = (0..300).collect();
        assert_eq!(routing_key("alice", &short), routing_key("alice", &longer));
        assert_ne!(routing_key("alice", &short), routing_key("bob", &short));
        assert_ne!(routing_key("alice", &short), routing_key("alice", &short[1..]));
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_bytes(body in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_completion(&body);
        }

        #[test]
        fn parser_never_panics_on_prompts(prompt in prop_oneof![
            "[a-z ]{0,8}".prop_map(Value::String),
            prop::collection::vec(any::<i64>(), 0..4).prop_map(|v| json!(v)),
            prop::collection::vec("[a-z]{0,3}", 0..3).prop_map(|v| json!(v)),
            prop::collection::vec(prop::collection::vec(any::<u32>(), 0..3), 0..3).prop_map(|v| json!(v)),
        ]) {
            if let Ok(ok) = parse_completion(json!({"prompt": prompt}).to_string().as_bytes()) {
                let nonempty = match ok.prompt { PromptInput::Text(s) => !s.is_empty(), PromptInput::Tokens(t) => !t.is_empty() };
                prop_assert!(nonempty);
            }
        }
    }
}
