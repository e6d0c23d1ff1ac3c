//! One attempt at a turn of Baton's conversations API (`POST
//! /v1/conversations/{id}/turns`), streamed: the client names the turn (`turn_id`), so a
//! retry of the same turn, through any gateway replica, attaches to it, replays it, or
//! resumes after the last event it saw (`Last-Event-ID`) instead of making a second turn.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Deserialize;

use super::client::{SseParser, TurnError};

/// What a client asks for in one turn; the same for every retry of it (the gateway
/// refuses a turn ID reused with another body).
#[derive(Clone, Debug)]
pub struct TurnRequest {
    pub conversation: String,
    pub turn_id: String,
    pub message: String,
    pub max_tokens: usize,
}

/// How one attempt ended when the server answered with a stream.
#[derive(Clone, Debug, Default)]
pub struct Attempt {
    /// Event ID of the last event received (to resume from with `Last-Event-ID`).
    pub last_event_id: Option<u64>,
    /// Text of the `delta` events received in this attempt.
    pub text: String,
    /// From the first byte of the request to the first delta of this attempt.
    pub ttft: Option<Duration>,
    /// The final event's `state` (`done`, `stopped`, `failed`); `None`: the stream ended
    /// without one (the gateway died, the connection broke).
    pub state: Option<String>,
    /// The final event's `reply`: the whole reply as the gateway stored it.
    pub reply: Option<String>,
    pub finish_reason: Option<String>,
}

impl Attempt {
    /// The turn is acknowledged: the gateway said it is done (or stopped) and sent its reply.
    pub fn acknowledged(&self) -> bool {
        matches!(self.state.as_deref(), Some("done") | Some("stopped")) && self.reply.is_some()
    }
}

#[derive(Deserialize)]
struct Done {
    state: Option<String>,
    reply: Option<String>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    text: String,
}

/// Creates a conversation; returns its ID.
pub async fn create_conversation(http: &reqwest::Client, base_url: &str, api_key: &str, title: &str) -> Result<String, TurnError> {
    let url = format!("{}/conversations", base_url.trim_end_matches('/'));
    let resp = http.post(url).bearer_auth(api_key).json(&serde_json::json!({"title": title})).send().await?;
    let status = resp.status();
    let body = resp.text().await?;
    if !status.is_success() {
        return Err(TurnError::Status { status: status.as_u16(), body: body.chars().take(300).collect() });
    }
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| TurnError::Protocol(format!("{e}: {body}")))?;
    v["id"].as_str().map(str::to_string).ok_or_else(|| TurnError::Protocol(format!("no conversation id in {body}")))
}

/// One attempt at `turn` through the gateway at `base_url` (up to and including `/v1`),
/// resuming after `last_event_id` when given. An HTTP error status or a broken
/// connection before any event is an `Err`; a stream that breaks later is an `Ok`
/// whose `state` is `None`, keeping what arrived (so the retry can resume after it).
pub async fn attempt_turn(
    http: &reqwest::Client,
    base_url: &str,
    api_key: &str,
    turn: &TurnRequest,
    last_event_id: Option<u64>,
) -> Result<Attempt, TurnError> {
    let url = format!("{}/conversations/{}/turns", base_url.trim_end_matches('/'), turn.conversation);
    let body = serde_json::json!({
        "turn_id": turn.turn_id,
        "message": turn.message,
        "max_tokens": turn.max_tokens,
        "temperature": 0,
        "stream": true,
    });
    let start = Instant::now();
    let mut request = http.post(url).bearer_auth(api_key).json(&body);
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id.to_string());
    }
    let response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(TurnError::Status { status: status.as_u16(), body: body.chars().take(300).collect() });
    }
    let mut out = Attempt { last_event_id, ..Attempt::default() };
    let mut parser = SseParser::default();
    let mut stream = response.bytes_stream();
    while let Some(bytes) = stream.next().await {
        let Ok(bytes) = bytes else { return Ok(out) };
        for ev in parser.push_events(&bytes) {
            if let Some(id) = ev.id.as_deref().and_then(|i| i.parse().ok()) {
                out.last_event_id = Some(id);
            }
            match ev.event.as_deref() {
                Some("delta") => {
                    let d: Delta = serde_json::from_str(&ev.data).map_err(|e| TurnError::Protocol(format!("{e}: {}", ev.data)))?;
                    if out.ttft.is_none() && !d.text.is_empty() {
                        out.ttft = Some(start.elapsed());
                    }
                    out.text.push_str(&d.text);
                }
                Some("done") => {
                    let d: Done = serde_json::from_str(&ev.data).map_err(|e| TurnError::Protocol(format!("{e}: {}", ev.data)))?;
                    out.state = d.state;
                    out.reply = d.reply;
                    out.finish_reason = d.finish_reason;
                    return Ok(out);
                }
                _ => {}
            }
        }
    }
    Ok(out)
}
