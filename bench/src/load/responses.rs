//! One streamed response of OpenAI's Responses API, timed from the client's side: the
//! time to the first `response.output_text.delta`, and what the final
//! `response.completed` (or `response.incomplete`) event reports: the response ID (to
//! chain the next one by `previous_response_id`), the text, and `usage` with
//! `input_tokens_details.cached_tokens`.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use super::client::{Endpoint, SseParser, TurnError, TurnResult};

/// An HTTP client for the load and benchmark calls.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::new()
}

/// What one response measured.
#[derive(Clone, Debug, Default)]
pub struct ResponseTurn {
    pub id: String,
    pub reply: String,
    pub ttft: Option<Duration>,
    /// Gaps between consecutive text deltas.
    pub itl: Vec<Duration>,
    pub total: Duration,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
}

impl From<ResponseTurn> for TurnResult {
    fn from(r: ResponseTurn) -> Self {
        TurnResult {
            reply: r.reply,
            ttft: r.ttft,
            itl: r.itl,
            total: r.total,
            prompt_tokens: r.input_tokens,
            cached_tokens: r.cached_tokens,
            completion_tokens: r.output_tokens,
        }
    }
}

/// Sends one streamed `POST /responses` with `input` (after `previous_response_id`
/// when given; `instructions` for a chain's first response) and times it.
pub async fn stream_response(
    http: &reqwest::Client,
    endpoint: &Endpoint,
    input: &str,
    previous_response_id: Option<&str>,
    instructions: Option<&str>,
) -> Result<ResponseTurn, TurnError> {
    let mut body = serde_json::json!({
        "model": endpoint.model,
        "input": input,
        "max_output_tokens": endpoint.max_tokens,
        "temperature": endpoint.temperature,
        "stream": true,
    });
    if let Some(p) = previous_response_id {
        body["previous_response_id"] = Value::String(p.to_string());
    }
    if let Some(i) = instructions {
        body["instructions"] = Value::String(i.to_string());
    }
    let url = format!("{}/responses", endpoint.base_url.trim_end_matches('/'));
    let start = Instant::now();
    let mut request = http.post(url).json(&body);
    if let Some(key) = &endpoint.api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(TurnError::Status { status: status.as_u16(), body: body.chars().take(300).collect() });
    }
    let mut out = ResponseTurn::default();
    let mut parser = SseParser::default();
    let mut stream = response.bytes_stream();
    let mut ended = false;
    let mut last_delta: Option<Instant> = None;
    while let Some(bytes) = stream.next().await {
        for data in parser.push(&bytes?) {
            let ev: Value = serde_json::from_str(&data).map_err(|e| TurnError::Protocol(format!("{e}: {data}")))?;
            match ev["type"].as_str() {
                Some("response.output_text.delta") => {
                    let text = ev["delta"].as_str().unwrap_or_default();
                    if text.is_empty() {
                        continue;
                    }
                    let now = Instant::now();
                    match last_delta {
                        None => out.ttft = Some(now - start),
                        Some(prev) => out.itl.push(now - prev),
                    }
                    last_delta = Some(now);
                    out.reply.push_str(text);
                }
                Some("response.completed" | "response.incomplete") => {
                    let r = &ev["response"];
                    out.id = r["id"].as_str().unwrap_or_default().to_string();
                    let u = &r["usage"];
                    out.input_tokens = u["input_tokens"].as_u64().unwrap_or(0);
                    out.cached_tokens = u["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                    out.output_tokens = u["output_tokens"].as_u64().unwrap_or(0);
                    ended = true;
                }
                Some("response.failed") => return Err(TurnError::Protocol(format!("response failed: {}", ev["response"]["error"]))),
                _ => {}
            }
        }
    }
    if !ended || out.id.is_empty() {
        return Err(TurnError::Protocol("stream ended without response.completed".into()));
    }
    out.total = start.elapsed();
    Ok(out)
}
