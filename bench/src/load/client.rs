//! One streamed chat turn against an OpenAI-compatible endpoint, timed from the client's
//! side: time to the first content token, the gaps between content chunks, and the
//! server's `usage` (including `prompt_tokens_details.cached_tokens` where the server
//! reports it).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

/// A chat message as the API takes it.
#[derive(Clone, Debug, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// What one turn measured.
#[derive(Clone, Debug, Default)]
pub struct TurnResult {
    /// The reply text, appended to the conversation's history.
    pub reply: String,
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    pub total: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// Why a turn failed; the label is bounded so it can key a table column.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("transport: {0}")]
    Transport(#[from] reqwest::Error),
    #[error("malformed stream: {0}")]
    Protocol(String),
}

impl TurnError {
    /// A bounded label (`http_429`, `transport`, `protocol`) for the results table.
    pub fn label(&self) -> String {
        match self {
            TurnError::Status { status, .. } => format!("http_{status}"),
            TurnError::Transport(_) => "transport".into(),
            TurnError::Protocol(_) => "protocol".into(),
        }
    }
}

/// Where and how to send requests.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Base URL up to and including `/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub model: String,
    pub max_tokens: usize,
    pub temperature: f32,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<ChunkUsage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Delta,
}

#[derive(Deserialize, Default)]
struct Delta {
    content: Option<String>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: u64,
}

/// Sends one streamed chat completion and times it.
pub async fn stream_turn(
    http: &reqwest::Client,
    endpoint: &Endpoint,
    messages: &[Message],
    conversation: Option<&str>,
) -> Result<TurnResult, TurnError> {
    let body = serde_json::json!({
        "model": endpoint.model,
        "messages": messages,
        "max_tokens": endpoint.max_tokens,
        "temperature": endpoint.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let url = format!("{}/chat/completions", endpoint.base_url.trim_end_matches('/'));
    let start = Instant::now();
    let mut request = http.post(url).json(&body);
    if let Some(key) = &endpoint.api_key {
        request = request.bearer_auth(key);
    }
    if let Some(id) = conversation {
        request = request.header("X-Baton-Conversation", id);
    }
    let response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(TurnError::Status { status: status.as_u16(), body: body.chars().take(300).collect() });
    }
    let mut out = TurnResult::default();
    let mut parser = SseParser::default();
    let mut last_chunk: Option<Instant> = None;
    let mut stream = response.bytes_stream();
    let mut done = false;
    while let Some(bytes) = stream.next().await {
        let bytes = bytes?;
        for data in parser.push(&bytes) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Chunk = serde_json::from_str(&data).map_err(|e| TurnError::Protocol(format!("{e}: {data}")))?;
            if let Some(u) = chunk.usage {
                out.prompt_tokens = u.prompt_tokens;
                out.completion_tokens = u.completion_tokens;
                out.cached_tokens = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
            }
            let text: String = chunk.choices.into_iter().filter_map(|c| c.delta.content).collect();
            if text.is_empty() {
                continue;
            }
            let now = Instant::now();
            match last_chunk {
                None => out.ttft = Some(now - start),
                Some(prev) => out.itl.push(now - prev),
            }
            last_chunk = Some(now);
            out.reply.push_str(&text);
        }
    }
    if !done {
        return Err(TurnError::Protocol("stream ended without [DONE]".into()));
    }
    out.total = start.elapsed();
    Ok(out)
}

/// Splits a server-sent-event byte stream into the `data` payloads of its events.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

/// One server-sent event: its `id`, `event` type and `data` (lines joined by `\n`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.push_events(bytes).into_iter().map(|e| e.data).filter(|d| !d.is_empty()).collect()
    }

    /// Feeds bytes; returns every event completed by them (comment-only blocks skipped).
    pub fn push_events(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&raw[..end]);
            let mut ev = SseEvent::default();
            let mut has_data = false;
            for line in text.lines() {
                let (field, value) = match line.split_once(':') {
                    Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                    None => (line, ""),
                };
                match field {
                    "data" => {
                        if has_data {
                            ev.data.push('\n');
                        }
                        ev.data.push_str(value);
                        has_data = true;
                    }
                    "id" => ev.id = Some(value.to_string()),
                    "event" => ev.event = Some(value.to_string()),
                    _ => {}
                }
            }
            if has_data || ev.event.is_some() {
                events.push(ev);
            }
        }
        events
    }
}

/// Index and separator length of the first blank line (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    for i in 0..buf.len() {
        if buf[i..].starts_with(b"\n\n") {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.push(b"id: 1\ndata: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DONE]\n\n"), vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.push(b": comment\r\n\r\ndata: x\r\n\r\n"), vec!["x".to_string()]);
    }

    #[test]
    fn sse_events_keep_id_and_type() {
        let mut p = SseParser::default();
        let evs = p.push_events(b"id: 3\nevent: delta\ndata: {\"text\":\"a\"}\n\n: keep-alive\n\n");
        assert_eq!(evs, vec![SseEvent { id: Some("3".into()), event: Some("delta".into()), data: "{\"text\":\"a\"}".into() }]);
    }
}
