//! `baton up` as a newcomer runs it: one process with the coordinator, a prefill node, a
//! decode node and the gateway. The test starts the real binary on loopback, reads the
//! addresses from its banner and checks the web page, the OpenAI API (plain and
//! streamed), auth, that a long prompt is prefilled on the prefill node and its repeat is
//! served from the decode node's prefix cache with the same greedy reply, and that
//! SIGTERM stops everything cleanly.

mod cluster_support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The running cluster; killed if the test fails before stopping it.
struct Up {
    child: Child,
    gateway: String,
    prefill_metrics: String,
    /// The coordinator's and the decode node's metrics, shown (with the prefill node's) when a check fails.
    coordinator_metrics: String,
    decode_metrics: String,
    _dir: tempfile::TempDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const KEY: &str = "up-test-key-0123456789";

fn start() -> Up {
    let dir = tempfile::tempdir().unwrap();
    let listeners = ["--listen", "127.0.0.1:0", "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", "127.0.0.1:0"];
    let mut child = cluster_support::up_command(&listeners, &dir.path().join("gateway.db"), KEY)
        .args(["--decode-http-listen", "127.0.0.1:0", "--prefill-http-listen", "127.0.0.1:0"])
        .args(["--local-prefill-threshold", "64", "--threads", "1"])
        .spawn()
        .expect("start baton up");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (mut gateway, mut prefill_metrics, mut decode_metrics, mut coordinator_metrics) = (None, None, None, None);
    let deadline = Instant::now() + Duration::from_secs(120);
    while gateway.is_none() || prefill_metrics.is_none() || decode_metrics.is_none() || coordinator_metrics.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("baton up printed its banner in time");
        let mut urls = line.split_whitespace().filter(|w| w.starts_with("http://")).map(str::to_string);
        match line.split_whitespace().next() {
            Some("web") => gateway = urls.next().map(|u| u.trim_end_matches('/').to_string()),
            Some("prefill-0") => prefill_metrics = urls.next(),
            Some("decode-0") => decode_metrics = urls.next(),
            Some("coordinator") => coordinator_metrics = urls.find(|u| u.ends_with("/metrics")),
            _ => {}
        }
    }
    Up {
        child,
        gateway: gateway.unwrap(),
        prefill_metrics: prefill_metrics.unwrap(),
        coordinator_metrics: coordinator_metrics.unwrap(),
        decode_metrics: decode_metrics.unwrap(),
        _dir: dir,
    }
}

/// The routing, prefill and KV-pool lines of every part's metrics, for a failure message.
async fn routing_metrics(http: &reqwest::Client, up: &Up) -> String {
    let mut out = String::new();
    for url in [&up.coordinator_metrics, &up.decode_metrics, &up.prefill_metrics] {
        let text = http.get(url).send().await.unwrap().text().await.unwrap();
        out += &format!("{url}:\n");
        let wanted = ["routing_decisions", "coordinator_nodes", "prefills_total", "prefill_turns", "kv_blocks", "registrations"];
        for l in text.lines().filter(|l| !l.starts_with('#') && wanted.iter().any(|w| l.contains(w))) {
            out += &format!("  {l}\n");
        }
    }
    out
}

fn long_prompt() -> serde_json::Value {
    let text = "Rivers carry water from the mountains to the sea, and towns grow along their banks. ".repeat(12);
    serde_json::json!({
        "model": "baton",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": format!("{text}Name one river.")}],
    })
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baton_up_serves_chat_through_the_disaggregated_cluster() {
    let mut up = start();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let chat = format!("{}/v1/chat/completions", up.gateway);

    let page = http.get(format!("{}/", up.gateway)).send().await.unwrap();
    assert!(page.status().is_success());
    assert!(page.text().await.unwrap().to_lowercase().contains("<html"));

    let unauthorized = http.post(&chat).json(&long_prompt()).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);

    // A long prompt: its tail is over the local-prefill threshold, so the prefill node
    // computes it and ships the KV over QUIC.
    let first: serde_json::Value = http.post(&chat).bearer_auth(KEY).json(&long_prompt()).send().await.unwrap().json().await.unwrap();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 64, "{first}");
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!reply.is_empty(), "{first}");
    let metrics = http.get(&up.prefill_metrics).send().await.unwrap().text().await.unwrap();
    if counter(&metrics, "baton_prefill_turns_total") < 1.0 {
        panic!("the prefill node computed nothing:\n{}", routing_metrics(&http, &up).await);
    }

    // The same prompt again: served from the decode node's prefix cache (all but the
    // last partial block), with the same greedy reply.
    let again: serde_json::Value = http.post(&chat).bearer_auth(KEY).json(&long_prompt()).send().await.unwrap().json().await.unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached + 16 >= prompt_tokens, "cached {cached} of {prompt_tokens}");
    assert_eq!(again["choices"][0]["message"]["content"].as_str().unwrap(), reply);

    // Streamed: content chunks, a usage chunk, then [DONE].
    let mut body = long_prompt();
    body["stream"] = true.into();
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let text = http.post(&chat).bearer_auth(KEY).json(&body).send().await.unwrap().text().await.unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let streamed: String = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, reply);

    // SIGTERM stops every part and the process exits cleanly.
    let pid = up.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = up.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "baton up did not stop within 20 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "baton up exited with {status}");
}
