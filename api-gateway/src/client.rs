//! A small HTTP/1.1 client of the gateway's API (hyper): what `baton chat`
//! and the tests use. It parses server-sent events incrementally.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::Request;
pub use hyper::{Method, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;

/// One server-sent event.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// A client bound to one base URL and key.
#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    pub base: String,
    pub key: Option<String>,
}

/// A response whose body has not been read yet.
pub struct Response {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    body: Incoming,
    buf: Vec<u8>,
}

impl Client {
    pub fn new(base: impl Into<String>, key: Option<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Client { http: HyperClient::builder(TokioExecutor::new()).build(connector), base: base.into().trim_end_matches('/').to_string(), key }
    }

    /// Sends a request; `body` is sent as is with `content-type: application/json`.
    pub async fn send(&self, method: Method, path: &str, body: Option<Vec<u8>>, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
        let mut b = Request::builder().method(method).uri(format!("{}{}", self.base, path));
        if let Some(k) = &self.key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        if body.is_some() {
            b = b.header("content-type", "application/json");
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = self.http.request(req).await?;
        let (parts, body) = resp.into_parts();
        Ok(Response { status: parts.status, headers: parts.headers, body, buf: Vec::new() })
    }

    /// Sends JSON and reads the whole reply as JSON (`Null` if not JSON).
    pub async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<(StatusCode, serde_json::Value)> {
        let r = self.send(method, path, body.map(|b| b.to_string().into_bytes()), &[]).await?;
        let status = r.status;
        let bytes = r.bytes().await?;
        Ok((status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null)))
    }
}

impl Response {
    /// The whole body.
    pub async fn bytes(mut self) -> anyhow::Result<Vec<u8>> {
        let mut out = std::mem::take(&mut self.buf);
        out.extend_from_slice(&self.body.collect().await?.to_bytes());
        Ok(out)
    }

    /// The next server-sent event; `None` at the end of the body.
    pub async fn next_event(&mut self) -> anyhow::Result<Option<SseEvent>> {
        loop {
            if let Some(end) = find_event_end(&self.buf) {
                let block: Vec<u8> = self.buf.drain(..end.1).collect();
                let text = String::from_utf8_lossy(&block[..end.0]).into_owned();
                let mut ev = SseEvent::default();
                let mut data: Vec<&str> = Vec::new();
                for line in text.lines() {
                    if line.starts_with(':') {
                        continue;
                    }
                    let (k, v) = line.split_once(':').map(|(k, v)| (k, v.strip_prefix(' ').unwrap_or(v))).unwrap_or((line, ""));
                    match k {
                        "id" => ev.id = Some(v.to_string()),
                        "event" => ev.event = Some(v.to_string()),
                        "data" => data.push(v),
                        _ => {}
                    }
                }
                if data.is_empty() && ev.event.is_none() && ev.id.is_none() {
                    continue;
                }
                ev.data = data.join("\n");
                return Ok(Some(ev));
            }
            match self.body.frame().await {
                Some(f) => {
                    if let Ok(d) = f?.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
                None => return Ok(None),
            }
        }
    }
}

/// (end of the event's text, end including the blank line).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    for i in 0..buf.len() {
        if buf[i..].starts_with(b"\n\n") {
            return Some((i, i + 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, i + 4));
        }
    }
    None
}
