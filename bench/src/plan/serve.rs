//! The planner's own read-only HTTP listener: `GET /metrics` (its decisions as
//! Prometheus series, [`PlannerMetrics`]), `GET /decisions` (the explain page: the last
//! decisions with every reason, newest first, as text) and `GET /healthz`.
//!
//! Who may use it: whoever can reach the address. It serves only what the planner decided
//! and why (replica counts, rates, latencies: no conversation, key or token), accepts no
//! input but the path, and changes nothing, like a node's `/metrics`; bind it to loopback
//! or an address only Prometheus reaches (docs/SECURITY.md). A request's head is read for
//! at most 5 s and 8 KiB, so a slow or huge request cannot hold the listener.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::planner::metrics::PlannerMetrics;
use crate::planner::Decision;

/// Decisions the explain page keeps.
pub const KEPT_DECISIONS: usize = 64;

/// What the listener shows; the loop updates it after every decision.
#[derive(Debug, Default)]
pub struct Shown {
    pub metrics: PlannerMetrics,
    /// Rendered decisions, newest last.
    pub recent: VecDeque<String>,
}

impl Shown {
    /// Records a decision and its rendering for the explain page.
    pub fn decided(&mut self, d: &Decision, ready_prefill: u32, ready_decode: u32, at: f64, text: String) {
        self.metrics.decided(d, ready_prefill, ready_decode, at);
        if self.recent.len() == KEPT_DECISIONS {
            self.recent.pop_front();
        }
        self.recent.push_back(text);
    }
}

pub type SharedShown = Arc<Mutex<Shown>>;

fn answer(shown: &SharedShown, path: &str) -> (&'static str, &'static str, String) {
    let s = shown.lock().unwrap_or_else(|e| e.into_inner());
    match path {
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", s.metrics.render()),
        "/decisions" => {
            let mut body = String::from("The planner's decisions, newest first, each with its reasons.\n\n");
            for d in s.recent.iter().rev() {
                body.push_str(d);
                body.push_str("\n\n");
            }
            ("200 OK", "text/plain; charset=utf-8", body)
        }
        "/healthz" => ("200 OK", "text/plain", "ok\n".into()),
        _ => ("404 Not Found", "text/plain", "not found: /metrics, /decisions, /healthz\n".into()),
    }
}

async fn one(mut sock: tokio::net::TcpStream, shown: SharedShown) {
    let mut buf = vec![0u8; 8192];
    let mut n = 0;
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") && n < buf.len() {
            match sock.read(&mut buf[n..]).await {
                Ok(0) | Err(_) => return false,
                Ok(k) => n += k,
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let mut first = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = if method == "GET" {
        answer(&shown, path)
    } else {
        ("405 Method Not Allowed", "text/plain", "only GET\n".into())
    };
    let resp = format!("HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    let _ = sock.write_all(resp.as_bytes()).await;
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, shown: SharedShown) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(one(sock, shown.clone()));
    }
}
