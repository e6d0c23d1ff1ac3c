//! A real Prometheus server scrapes a running `baton up`: all four roles (gateway,
//! coordinator, decode node, prefill node) are up as targets, the documented series
//! exist, and the counters and histograms move when chat traffic flows.
//!
//! The test starts its own `prometheus` (Debian's package, or `BATON_PROMETHEUS_BIN`)
//! with its own configuration and TSDB in a temporary directory, on a free loopback
//! port. Without the binary it is skipped with a loud message; `.ci/run` installs it.

mod cluster_support;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const KEY: &str = "prom-test-key-0123456789";

fn prometheus_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BATON_PROMETHEUS_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("prometheus")).find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child process killed (SIGKILL) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Where the four roles serve `/metrics` (the gateway on its admin listener), and the API.
struct Targets {
    api: String,
    gateway: String,
    coordinator: String,
    decode: String,
    prefill: String,
}

impl Targets {
    fn all(&self) -> [(&'static str, &str); 4] {
        [("baton-gateway", &self.gateway), ("baton-coordinator", &self.coordinator), ("baton-decode", &self.decode), ("baton-prefill", &self.prefill)]
    }
}

fn start_up(dir: &Path) -> (Killed, Targets) {
    let t = Targets {
        api: format!("127.0.0.1:{}", free_port()),
        gateway: format!("127.0.0.1:{}", free_port()),
        coordinator: format!("127.0.0.1:{}", free_port()),
        decode: format!("127.0.0.1:{}", free_port()),
        prefill: format!("127.0.0.1:{}", free_port()),
    };
    let listeners = ["--listen", &t.api, "--admin-listen", &t.gateway, "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", &t.coordinator];
    let mut child = cluster_support::up_command(&listeners, &dir.join("gateway.db"), KEY)
        .args(["--decode-http-listen", &t.decode, "--prefill-http-listen", &t.prefill])
        .args(["--local-prefill-threshold", "64", "--threads", "1"])
        .spawn()
        .expect("start baton up");
    // Drain the banner so the child never blocks on a full pipe.
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || for _ in BufReader::new(stdout).lines().map_while(Result::ok) {});
    (Killed(child), t)
}

fn start_prometheus(bin: &Path, dir: &Path, targets: &Targets) -> (Killed, String) {
    let mut yml = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
    for (job, addr) in targets.all() {
        yml.push_str(&format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"));
    }
    let config = dir.join("prometheus.yml");
    std::fs::write(&config, yml).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={listen}"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    (Killed(child), format!("http://{listen}"))
}

fn prometheus_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
}

/// The value of an instant query that yields one number (a `sum(...)`), or `None`.
async fn query(http: &reqwest::Client, prom: &str, q: &str) -> Option<f64> {
    let v: serde_json::Value = http.get(format!("{prom}/api/v1/query")).query(&[("query", q)]).send().await.ok()?.json().await.ok()?;
    let r = v["data"]["result"].as_array()?.first()?.clone();
    r["value"][1].as_str()?.parse().ok()
}

/// How many series an instant query returns.
async fn series(http: &reqwest::Client, prom: &str, q: &str) -> usize {
    let v: Option<serde_json::Value> = async { http.get(format!("{prom}/api/v1/query")).query(&[("query", q)]).send().await.ok()?.json().await.ok() }.await;
    v.and_then(|v| v["data"]["result"].as_array().map(Vec::len)).unwrap_or(0)
}

fn long_prompt(stream: bool) -> serde_json::Value {
    let text = "Rivers carry water from the mountains to the sea, and towns grow along their banks. ".repeat(12);
    serde_json::json!({
        "model": "baton",
        "max_tokens": 12,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": format!("{text}Name one river.")}],
    })
}

/// Series every scrape must carry (histograms by their `_bucket`).
const EXPECTED: &[&str] = &[
    "baton_gateway_requests_total",
    "baton_gateway_tokens_total",
    "baton_gateway_time_to_first_token_seconds_bucket",
    "baton_gateway_inter_token_latency_seconds_bucket",
    "baton_gateway_user_turn_tokens_bucket",
    "baton_gateway_active_users",
    "baton_gateway_open_streams",
    "baton_gateway_turns_slo_total",
    "baton_coordinator_routing_decisions_total",
    "baton_coordinator_nodes",
    "baton_coordinator_membership_changes_total",
    "baton_decode_turns_total",
    "baton_decode_time_to_first_token_seconds_bucket",
    "baton_decode_inter_token_latency_seconds_bucket",
    "baton_decode_prompt_tokens_total",
    "baton_decode_prefix_cache_hit_tokens_total",
    "baton_decode_busy_seconds_total",
    "baton_decode_queue_depth",
    "baton_decode_running_sequences",
    "baton_decode_kv_blocks",
    "baton_decode_kv_block_bytes",
    "baton_decode_drain_migrations_total",
    "baton_prefill_turns_total",
    "baton_prefill_busy_seconds_total",
    "baton_prefill_queue_depth",
    "baton_prefill_kv_blocks",
    "baton_prefill_prompt_tokens_total",
    "baton_kv_transport_bytes_total",
    "baton_kv_transport_failures_total",
    "baton_kv_transport_reservations_live",
    "baton_kv_transport_transfer_duration_seconds_bucket",
];

/// Sums that must grow when chat traffic flows.
const MOVING: &[&str] = &[
    r#"sum(baton_gateway_tokens_total{kind="completion"})"#,
    r#"sum(baton_gateway_tokens_total{kind="cached"})"#,
    r#"sum(baton_gateway_time_to_first_token_seconds_count)"#,
    r#"sum(baton_gateway_inter_token_latency_seconds_count)"#,
    r#"sum(baton_decode_prompt_tokens_total{source="cached_tier1"})"#,
    r#"sum(baton_decode_prompt_tokens_total{source=~"imported|computed"})"#,
    r#"sum(baton_decode_generated_tokens_total)"#,
    r#"sum(baton_decode_inter_token_latency_seconds_count)"#,
    r#"sum(baton_decode_time_to_first_token_seconds_count)"#,
    r#"sum(baton_decode_busy_seconds_total)"#,
    r#"sum(baton_prefill_busy_seconds_total)"#,
    r#"sum(baton_prefill_turns_total)"#,
    r#"sum(baton_decode_remote_prefills_total)"#,
    r#"sum(baton_kv_transport_bytes_total{job="baton-decode",side="receiver"})"#,
    r#"sum(baton_kv_transport_bytes_total{job="baton-prefill",side="sender"})"#,
    r#"sum(baton_coordinator_routing_decisions_total{kind="decode"})"#,
    r#"sum(baton_coordinator_routing_decisions_total{kind="prefill"})"#,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_baton_up_and_sees_traffic() {
    let Some(bin) = prometheus_binary() else {
        eprintln!("\n!!!!! SKIPPED: no `prometheus` binary on PATH (apt-get install prometheus); the Prometheus scrape is NOT tested !!!!!\n");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_up, targets) = start_up(dir.path());
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();

    // Every role answers /metrics (the engines take a while to load).
    let deadline = Instant::now() + Duration::from_secs(180);
    for (job, addr) in targets.all() {
        loop {
            match http.get(format!("http://{addr}/metrics")).send().await {
                Ok(r) if r.status().is_success() => break,
                _ => {}
            }
            assert!(Instant::now() < deadline, "{job} did not serve /metrics on {addr}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let (_prom, prom) = start_prometheus(&bin, dir.path(), &targets);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v: Option<serde_json::Value> = async { http.get(format!("{prom}/api/v1/targets")).send().await.ok()?.json().await.ok() }.await;
        let active = v.as_ref().and_then(|v| v["data"]["activeTargets"].as_array().cloned()).unwrap_or_default();
        if active.len() == 4 && active.iter().all(|t| t["health"] == "up") {
            break;
        }
        assert!(Instant::now() < deadline, "targets not all up within 60 s: {active:?}\nprometheus log:\n{}", prometheus_log(dir.path()));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The documented series exist.
    let deadline = Instant::now() + Duration::from_secs(20);
    for name in EXPECTED {
        while series(&http, &prom, name).await == 0 {
            assert!(Instant::now() < deadline, "Prometheus has no {name}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    assert_eq!(series(&http, &prom, r#"baton_decode_kv_blocks{tier=~"1|2",state=~"free|used|cached"}"#).await, 6);
    assert_eq!(series(&http, &prom, r#"baton_decode_prompt_tokens_total"#).await, 4);
    // Every (kind, reason) pair is registered at start: 6 prefill reasons (with
    // remote_decode_busy), 3 decode.
    assert_eq!(series(&http, &prom, r#"baton_coordinator_routing_decisions_total"#).await, 9);
    let decode_nodes = query(&http, &prom, r#"sum(baton_coordinator_nodes{role="decode"})"#).await;
    assert_eq!(decode_nodes, Some(1.0));

    // Baselines, then traffic: a long prompt whose tail the prefill node computes, the
    // same prompt again (from the decode node's prefix cache), and a streamed one.
    let mut before = Vec::new();
    for q in MOVING {
        before.push(query(&http, &prom, q).await.unwrap_or(0.0));
    }
    let chat = format!("http://{}/v1/chat/completions", targets.api);
    for stream in [false, false, true] {
        let r = http.post(&chat).bearer_auth(KEY).json(&long_prompt(stream)).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        let _ = r.text().await.unwrap();
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    for (q, base) in MOVING.iter().zip(before) {
        loop {
            let now = query(&http, &prom, q).await.unwrap_or(0.0);
            if now > base {
                break;
            }
            assert!(Instant::now() < deadline, "{q} did not move: {base} -> {now}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    // The capacity picture's queries evaluate on real data.
    let p95 = query(&http, &prom, "histogram_quantile(0.95, sum by (le) (rate(baton_gateway_time_to_first_token_seconds_bucket[1m])))").await;
    assert!(p95.is_some_and(|v| v > 0.0), "p95 TTFT: {p95:?}");
    let share = query(&http, &prom, r#"sum(baton_decode_prompt_tokens_total{source=~"cached.*"}) / sum(baton_decode_prompt_tokens_total)"#).await;
    assert!(share.is_some_and(|v| v > 0.0 && v < 1.0), "cached share: {share:?}");
}
