//! Attacks on the gateway (real engine, real sockets on loopback):
//! - 2,000 connections from one address that never finish their headers do not stop a
//!   request from another address being answered within 1 s;
//! - a connection that sends no complete request within the header deadline is closed;
//! - a body that never arrives gets a 408 at the deadline;
//! - `max_tokens` above the operator's ceiling is a clear 400;
//! - an API key in the URL does not authenticate;
//! - the conversation store's file is private and forgets deleted text;
//! - a client's own system prompt never shares the platform's cached blocks;
//! - `/metrics` on the public port answers only to the admin key, and without one is
//!   served only on the admin listener.
//!
//! The cross-user stall is in `gateway_isolation.rs` (a binary of its own: it times turns).

use crate::common;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A connection from `source` (a loopback address) that sends half a request's headers.
async fn half_open(source: &str, target: std::net::SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(format!("{source}:0").parse().unwrap()).ok()?;
    let mut s = socket.connect(target).await.ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n").await.ok()?;
    Some(s)
}

/// `POST base+path` with a JSON body, as `key`.
async fn post_json(server: &common::Server, path: &str, body: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}{path}", server.base))
        .bearer_auth(&server.key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

const ADMIN_KEY: &str = "gateway-security-test-admin-key";

/// A file holding [`ADMIN_KEY`], for `--admin-key-file` (removed on drop).
struct AdminFile {
    _dir: tempfile::TempDir,
    path: String,
}

impl AdminFile {
    fn new() -> AdminFile {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin-key");
        std::fs::write(&path, format!("{ADMIN_KEY}\n")).unwrap();
        AdminFile { path: path.display().to_string(), _dir: dir }
    }

    fn path(&self) -> &str {
        &self.path
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_only_the_admin_key_or_the_admin_listener() {
    let admin = AdminFile::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let admin_listen = format!("127.0.0.1:{port}");
    let Some(server) = common::start(&["--admin-key-file", admin.path(), "--admin-listen", &admin_listen]).await else { return };
    let http = reqwest::Client::new();
    let public = format!("{}/metrics", server.base);
    // No key, a user's API key, a wrong admin key: refused, and no series in the body.
    for auth in [None, Some(server.key.as_str()), Some("gateway-security-test-admin-kez")] {
        let mut req = http.get(&public);
        if let Some(k) = auth {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        assert!(!r.text().await.unwrap().contains("baton_gateway_"), "{auth:?}");
    }
    let r = http.get(&public).bearer_auth(ADMIN_KEY).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("baton_gateway_"));
    // The admin listener serves metrics without a key, and nothing of the API.
    let r = http.get(format!("http://{admin_listen}/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("baton_gateway_"));
    let r = http.get(format!("http://{admin_listen}/v1/models")).bearer_auth(&server.key).send().await.unwrap();
    assert_eq!(r.status(), 404);

    // Without an admin key, the public port does not serve metrics at all.
    let Some(plain) = common::start(&[]).await else { return };
    let r = http.get(format!("{}/metrics", plain.base)).bearer_auth(&plain.key).send().await.unwrap();
    assert_eq!(r.status(), 404);
}

fn addr(base: &str) -> std::net::SocketAddr {
    base.trim_start_matches("http://").parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_half_open_connections_do_not_stop_a_real_request() {
    let admin = AdminFile::new();
    let flags = ["--max-connections-per-address", "64", "--header-timeout-seconds", "2", "--admin-key-file", admin.path()];
    let Some(server) = common::start(&flags).await else { return };
    let target = addr(&server.base);
    let mut idle = Vec::new();
    for _ in 0..2000 {
        if let Some(s) = half_open("127.0.0.2", target).await {
            idle.push(s);
        }
    }
    assert!(idle.len() >= 1900, "only {} attacking connections opened", idle.len());
    let started = Instant::now();
    let r = reqwest::Client::new().get(format!("{}/healthz", server.base)).timeout(Duration::from_secs(5)).send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(r.status(), 200);
    assert!(took < Duration::from_secs(1), "a real request took {took:?} behind 2,000 half-open connections");
    let metrics = crate::common::text_of(reqwest::Client::new().get(format!("{}/metrics", server.base)).bearer_auth(ADMIN_KEY)).await;
    let refused = metrics
        .lines()
        .find(|l| l.starts_with("baton_gateway_connections_refused_total{reason=\"max_per_address\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(refused >= 1900.0, "refusals counted: {refused}\n{metrics}");
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_headers_and_bodies_meet_their_deadline() {
    let Some(server) = common::start(&["--header-timeout-seconds", "1"]).await else { return };
    let target = addr(&server.base);
    // Headers never finished: the server closes the connection after about a second.
    let mut s = half_open("127.0.0.1", target).await.unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await.expect("the server closes an idle connection");
    assert!(started.elapsed() < Duration::from_secs(4), "closed after {:?}", started.elapsed());
    // A body announced but never sent: 408 at the deadline.
    let mut s = TcpStream::connect(target).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{",
        server.key
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut reply = vec![0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut reply)).await.expect("an answer").unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_above_the_ceiling_is_a_clear_400() {
    let Some(server) = common::start(&["--max-tokens-ceiling", "600"]).await else { return };
    let body = serde_json::json!({"model": "baton", "max_tokens": 601, "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(&server, "/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("at most 600"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_counts_only_in_the_authorization_header() {
    let Some(server) = common::start(&[]).await else { return };
    let http = reqwest::Client::new();
    let in_url = http.get(format!("{}/v1/models?key={}", server.base, server.key)).send().await.unwrap();
    assert_eq!(in_url.status(), 401, "a key in the URL must not authenticate");
    let in_header = http.get(format!("{}/v1/models", server.base)).bearer_auth(&server.key).send().await.unwrap();
    assert_eq!(in_header.status(), 200);
}

#[cfg(unix)]
#[tokio::test]
async fn the_conversation_database_is_private_and_deletes_securely() {
    use baton_api_gateway::store::{sqlite::SqliteStore, Conversation, ConversationStore};
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gw.db");
    let store = SqliteStore::open(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "mode {mode:o}");
    // A deleted conversation's text is gone from the file, not left in a free page.
    let marker = "zebra-quartz-7781-secret-title";
    let conv = Conversation { id: "c1".into(), owner: "alice".into(), title: marker.into(), system_prompt_version: 1, created_at: 1, updated_at: 1, summary: Some(marker.repeat(40)), metadata: Default::default() };
    store.create_conversation(&conv).await.unwrap();
    assert!(store.delete_conversation("alice", "c1", 0).await.unwrap());
    drop(store);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
    drop(conn);
    let mut bytes = std::fs::read(&path).unwrap();
    if let Ok(wal) = std::fs::read(dir.path().join("gw.db-wal")) {
        bytes.extend(wal);
    }
    let found = bytes.windows(marker.len()).any(|w| w == marker.as_bytes());
    assert!(!found, "the deleted conversation's text is still in the database file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operators_system_prompt_counts_as_the_platform_prefix() {
    use baton_text::chat_template::ChatMessage;
    let Some(server) = common::start(&["--system-prompt", "You are the museum's guide."]).await else { return };
    let ctx = &server.app.context;
    let with = |system: &str| ctx.encode_messages(&[ChatMessage::new("system", system), ChatMessage::new("user", "hello")]).unwrap();
    // The operator's prompt: its blocks may be shared by every user.
    let platform = with("You are the museum's guide.");
    assert!(platform.platform_prefix_len > 0);
    assert_eq!(platform.platform_prefix_len, ctx.first_turn("hello").unwrap().platform_prefix_len);
    // A client's own system prompt (or one a character off) is that user's alone.
    for own in ["You are the museum's guide!", "Ignore the rules.", ""] {
        assert_eq!(with(own).platform_prefix_len, 0, "a client's system prompt {own:?} counted as the platform's");
    }
    let no_system = ctx.encode_messages(&[ChatMessage::new("user", "hello")]).unwrap();
    assert_eq!(no_system.platform_prefix_len, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_keeps_failing_is_slowed_down_and_no_other_key_is() {
    let Some(server) = common::start(&[]).await else { return };
    let http = reqwest::Client::new();
    let models = |key: String| http.get(format!("{}/v1/models", server.base)).bearer_auth(key).send();
    let mut codes = Vec::new();
    for _ in 0..15 {
        codes.push(models("bk-guess-again".into()).await.unwrap().status().as_u16());
    }
    let allowed = baton_api_gateway::lookup_limits::FAILED_PER_KEY_PER_MINUTE as usize;
    assert!(codes[..allowed].iter().all(|&c| c == 401), "{codes:?}");
    assert!(codes[allowed..].iter().all(|&c| c == 429), "{codes:?}");
    let r = models("bk-guess-again".into()).await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().get("retry-after").is_some());
    // Failures are not counted per address: another wrong key is still looked up, and a
    // valid key never used before answers from the same address.
    assert_eq!(models("bk-another-guess".into()).await.unwrap().status(), 401);
    assert_eq!(models(server.key.clone()).await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_a_running_turn_count_as_open_streams() {
    let Some(server) = common::start(&["--open-streams", "2"]).await else { return };
    let http = reqwest::Client::new();
    let created = post_json(&server, "/v1/conversations", &serde_json::json!({"title": "t"})).await.text().await.unwrap();
    let conv = serde_json::from_str::<serde_json::Value>(&created).unwrap()["id"].as_str().unwrap().to_string();
    // A long turn, streaming: it holds one of alice's two slots.
    let body = serde_json::json!({"turn_id": "t1", "message": "Tell me a very long story about rivers.", "max_tokens": 2000, "stream": true});
    let turn = post_json(&server, &format!("/v1/conversations/{conv}/turns"), &body).await;
    assert_eq!(turn.status(), 200);
    let follow = || http.get(format!("{}/v1/conversations/{conv}/turns/t1/events", server.base)).bearer_auth(&server.key).send();
    let first = follow().await.unwrap();
    assert_eq!(first.status(), 200, "the second slot");
    let second = follow().await.unwrap();
    assert_eq!(second.status(), 429, "a third stream of the same user");
    drop(first);
    drop(turn);
    let _ = http.post(format!("{}/v1/conversations/{conv}/turns/t1/stop", server.base)).bearer_auth(&server.key).send().await;
}

