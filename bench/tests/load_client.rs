//! The load generator against a minimal HTTP/1.1 server on loopback that speaks the
//! OpenAI streaming format byte for byte (chunked into odd pieces), so the client's SSE
//! handling, usage parsing, history growth and error accounting are checked over a real
//! socket. The end-to-end runs against Baton and llama-server are in
//! `scripts/bench-load-compare.sh`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_bench::load::{run_levels, LoadArgs};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: LoadArgs,
}

/// Reads one request: head plus `Content-Length` body.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<(String, String)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = sock.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).to_string();
            return Some((head, body));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_streaming_server_and_accounts_every_turn() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let chat_requests = Arc::new(AtomicUsize::new(0));
    let message_counts = Arc::new(Mutex::new(Vec::new()));
    let (seen, counts) = (chat_requests.clone(), message_counts.clone());
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let (seen, counts) = (seen.clone(), counts.clone());
            tokio::spawn(async move {
                let Some((head, body)) = read_request(&mut sock).await else { return };
                assert!(head.contains("authorization: Bearer k") || head.contains("Authorization: Bearer k"), "{head}");
                if head.starts_with("GET /v1/models") {
                    let json = r#"{"object":"list","data":[{"id":"tiny","object":"model"}]}"#;
                    let resp = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{json}", json.len());
                    let _ = sock.write_all(resp.as_bytes()).await;
                    return;
                }
                let req: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(req["model"], "tiny");
                assert_eq!(req["stream"], true);
                counts.lock().unwrap().push(req["messages"].as_array().unwrap().len());
                let n = seen.fetch_add(1, Ordering::SeqCst);
                if n == 2 {
                    let json = r#"{"error":{"message":"slow down","type":"rate_limited"}}"#;
                    let resp = format!("HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{json}", json.len());
                    let _ = sock.write_all(resp.as_bytes()).await;
                    return;
                }
                let mut events = String::new();
                for (i, word) in ["Hello", " there", "!"].iter().enumerate() {
                    events.push_str(&format!("id: {i}\ndata: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}}}}]}}\n\n"));
                }
                events.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n");
                events.push_str("data: [DONE]\n\n");
                let _ = sock.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n").await;
                // Odd-sized pieces with pauses: events split across reads.
                for piece in events.as_bytes().chunks(7) {
                    let _ = sock.write_all(piece).await;
                    let _ = sock.flush().await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
        }
    });

    let cli = Cli::parse_from([
        "load",
        "--url",
        &format!("http://{addr}/v1"),
        "--api-key",
        "k",
        "--levels",
        "2",
        "--turns",
        "3",
        "--think-time",
        "5ms",
        "--system-words",
        "5",
    ]);
    let report = run_levels(&cli.args).await.unwrap();
    assert_eq!(report.model, "tiny");
    let level = &report.levels[0];
    assert_eq!(level.conversations, 2);
    assert_eq!(level.turns + level.errors, 6);
    assert_eq!(level.errors, 1);
    assert_eq!(level.errors_by_kind["http_429"], 1);
    assert!((level.cached_share - 0.8).abs() < 1e-9, "{}", level.cached_share);
    assert!(level.ttft_ms.p50 > 0.0 && level.itl_ms.p50 > 0.0);
    // Each turn resends the history: system + (user, assistant) per earlier successful turn + user.
    let counts = message_counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 6);
    assert!(counts.iter().all(|&c| c % 2 == 0 && (2..=6).contains(&c)), "{counts:?}");
    assert_eq!(counts.iter().filter(|&&c| c == 6).count(), 1, "only the conversation without the failure reaches a third full turn: {counts:?}");
}
