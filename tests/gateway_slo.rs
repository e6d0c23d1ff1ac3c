//! The gateway's SLO counters judge real turns: `baton gateway` in front of its
//! in-process engine, once with an inter-token target no real stream can meet (1 µs)
//! and once with generous targets. The same greedy turn of several tokens then counts
//! once as `missed_itl` and once as `met` in `baton_gateway_turns_slo_total`.

mod cluster_support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed (SIGKILL) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

fn create_key(db: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["keys", "--db"])
        .arg(db)
        .args(["create", "--user", "alice"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "baton keys create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `baton gateway` with the given SLO targets; returns it, its API and its admin address.
async fn start_gateway(
    http: &reqwest::Client,
    db: &Path,
    model: &Path,
    ttft: &str,
    itl: &str,
) -> (Killed, String, String) {
    let (api, admin) = (free_addr(), free_addr());
    let child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "gateway",
            "--listen",
            &api,
            "--admin-listen",
            &admin,
            "--slo-ttft",
            ttft,
            "--slo-itl",
            itl,
        ])
        .args(["--threads", "1"])
        .args(cluster_support::TEST_ENGINE)
        .arg("--db")
        .arg(db)
        .arg("--model")
        .arg(model)
        .env_remove("BATON_SLO_TTFT")
        .env_remove("BATON_SLO_ITL")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start baton gateway");
    let child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if matches!(http.get(format!("http://{admin}/healthz")).send().await, Ok(r) if r.status().is_success())
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not come up on {admin}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (child, api, admin)
}

/// `[met, missed_ttft, missed_itl]` from the gateway's /metrics.
async fn slo_counts(http: &reqwest::Client, admin: &str) -> [f64; 3] {
    let text = cluster_support::text_of(http.get(format!("http://{admin}/metrics"))).await;
    ["met", "missed_ttft", "missed_itl"].map(|outcome| {
        let prefix = format!("baton_gateway_turns_slo_total{{outcome=\"{outcome}\"}} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
        line[prefix.len()..].trim().parse().unwrap()
    })
}

/// What each test starts from: the default model, a fresh database with alice's key,
/// and an HTTP client.
struct Setup {
    model: PathBuf,
    _dir: tempfile::TempDir,
    db: PathBuf,
    key: String,
    http: reqwest::Client,
}

/// `None` (the test is skipped) without the default model.
fn setup() -> Option<Setup> {
    let model = cluster_support::model_path()?;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    let key = create_key(&db);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    Some(Setup { model, _dir: dir, db, key, http })
}

/// One streamed greedy turn; returns its completion tokens.
async fn turn(http: &reqwest::Client, api: &str, key: &str) -> u64 {
    let body = serde_json::json!({
        "model": "baton",
        "max_tokens": 12,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Count from one to twenty, separated by commas."}],
    });
    let r = http
        .post(format!("http://{api}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let text = r.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())
        .expect("usage in the stream")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_misses_its_itl_target_is_counted_as_missed_itl() {
    let Some(Setup { model, _dir, db, key, http }) = setup() else { return };

    // Every gap between two real tokens is longer than 1 µs; the first token is well
    // within 10 minutes.
    {
        let (_gw, api, admin) = start_gateway(&http, &db, &model, "10m", "1us").await;
        assert_eq!(
            slo_counts(&http, &admin).await,
            [0.0; 3],
            "the counters start at zero"
        );
        let tokens = turn(&http, &api, &key).await;
        assert!(
            tokens >= 3,
            "the turn needs several tokens (two gaps) to be judged on its ITL: {tokens}"
        );
        assert_eq!(
            slo_counts(&http, &admin).await,
            [0.0, 0.0, 1.0],
            "met, missed_ttft, missed_itl"
        );
    }
    // Generous targets: the same turn meets both.
    let (_gw, api, admin) = start_gateway(&http, &db, &model, "10m", "10m").await;
    let tokens = turn(&http, &api, &key).await;
    assert!(tokens >= 3, "{tokens}");
    assert_eq!(
        slo_counts(&http, &admin).await,
        [1.0, 0.0, 0.0],
        "met, missed_ttft, missed_itl"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_later_than_the_ttft_target_is_counted_once_as_missed_ttft() {
    let Some(Setup { model, _dir, db, key, http }) = setup() else { return };
    // Both targets at 1 µs: the turn misses both halves and counts once, as missed_ttft.
    let (_gw, api, admin) = start_gateway(&http, &db, &model, "1us", "1us").await;
    let tokens = turn(&http, &api, &key).await;
    assert!(tokens >= 3, "{tokens}");
    assert_eq!(
        slo_counts(&http, &admin).await,
        [0.0, 1.0, 0.0],
        "met, missed_ttft, missed_itl"
    );
}
