//! `baton up` as a newcomer runs it: one process with the coordinator, a prefill node, a
//! decode node and the gateway. The test starts the real binary on loopback, reads the
//! addresses from its banner and checks the web page, the OpenAI API (plain and
//! streamed; chat, or legacy completions for a base model such as Gemma 3 270M), auth, that a long prompt is prefilled on the prefill node and its repeat is
//! served from the decode node's prefix cache with the same greedy reply, and that
//! SIGTERM stops everything cleanly; over SmolLM2 and Gemma 3 (`over_models!`).

mod cluster_support;

use cluster_support::over_models;

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
    /// The banner's example request (`curl -N URL ...`).
    example: String,
    _dir: tempfile::TempDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const KEY: &str = "up-test-key-0123456789";

fn start(model: &cluster_support::TestModel) -> Up {
    let dir = tempfile::tempdir().unwrap();
    let listeners = ["--listen", "127.0.0.1:0", "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", "127.0.0.1:0"];
    let mut child = cluster_support::up_command_with(&model.path, &listeners, &dir.path().join("gateway.db"), KEY)
        .args(["--decode-http-listen", "127.0.0.1:0", "--prefill-http-listen", "127.0.0.1:0"])
        .args(["--local-prefill-threshold", "64", "--threads", "1"])
        .spawn()
        .expect("start baton up");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Drained to the end, also once the test stopped listening: a closed pipe would
        // fail baton up's later writes.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut gateway, mut prefill_metrics, mut decode_metrics, mut coordinator_metrics, mut example) = (None, None, None, None, None);
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
            Some("curl") if example.is_none() => example = Some(line.clone()),
            _ => {}
        }
    }
    Up {
        child,
        gateway: gateway.unwrap(),
        prefill_metrics: prefill_metrics.unwrap(),
        coordinator_metrics: coordinator_metrics.unwrap(),
        decode_metrics: decode_metrics.unwrap(),
        example: example.expect("the banner shows an example request"),
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

/// How the test talks to the model: chat, or for a base model (no chat template, e.g.
/// Gemma 3 270M) the legacy completions of a raw prompt, which is how it is served.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Chat,
    Completions,
}

impl Api {
    fn of(model: &cluster_support::TestModel) -> Api {
        if model.has_chat_template() {
            Api::Chat
        } else {
            Api::Completions
        }
    }

    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    /// A prompt whose tail is over the local-prefill threshold.
    fn long_prompt(self) -> serde_json::Value {
        let text = "Rivers carry water from the mountains to the sea, and towns grow along their banks. ".repeat(12);
        let mut body = serde_json::json!({"model": "baton", "max_tokens": 12, "temperature": 0});
        match self {
            Api::Chat => body["messages"] = serde_json::json!([{"role": "user", "content": format!("{text}Name one river.")}]),
            Api::Completions => body["prompt"] = format!("{text}\nQuestion: Name one river.\nAnswer:").into(),
        }
        body
    }

    /// The reply of a whole response.
    fn reply(self, response: &serde_json::Value) -> Option<String> {
        self.choice_text(response, "message")
    }

    /// The text of one streamed chunk.
    fn delta(self, chunk: &serde_json::Value) -> Option<String> {
        self.choice_text(chunk, "delta")
    }

    /// The first choice's text: a chat answer keeps it in `chat_field`'s `content`, a
    /// completion in `text`.
    fn choice_text(self, value: &serde_json::Value, chat_field: &str) -> Option<String> {
        let choice = &value["choices"][0];
        let text = match self {
            Api::Chat => &choice[chat_field]["content"],
            Api::Completions => &choice["text"],
        };
        text.as_str().map(str::to_string)
    }
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0.0)
}

over_models! {
    /// `baton up --model <file>` serves each model through the gateway: chat for a model
    /// with a chat template, legacy completions (and a clear 400 for chat) for a base model.
    async fn baton_up_serves_chat_through_the_disaggregated_cluster(model) {
        let mut up = start(&model);
        let api = Api::of(&model);
        let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
        let url = format!("{}{}", up.gateway, api.path());

        // The banner's example is a request this model takes.
        assert!(up.example.contains(&url), "{}", up.example);

        let page = http.get(format!("{}/", up.gateway)).send().await.unwrap();
        assert!(page.status().is_success());
        assert!(page.text().await.unwrap().to_lowercase().contains("<html"));

        let unauthorized = http.post(&url).json(&api.long_prompt()).send().await.unwrap();
        assert_eq!(unauthorized.status(), 401);

        if api == Api::Completions {
            // A base model has no chat template: chat is refused, saying so.
            let chat = Api::Chat.long_prompt();
            let refused = http.post(format!("{}{}", up.gateway, Api::Chat.path())).bearer_auth(KEY).json(&chat).send().await.unwrap();
            assert_eq!(refused.status(), 400);
            let why = refused.text().await.unwrap();
            assert!(why.contains("no chat template"), "{why}");
        }

        // A long prompt: its tail is over the local-prefill threshold, so the prefill node
        // computes it and ships the KV over QUIC.
        let first: serde_json::Value = http.post(&url).bearer_auth(KEY).json(&api.long_prompt()).send().await.unwrap().json().await.unwrap();
        let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 64, "{first}");
        let reply = api.reply(&first).unwrap();
        assert!(!reply.is_empty(), "{first}");
        let metrics = http.get(&up.prefill_metrics).send().await.unwrap().text().await.unwrap();
        if counter(&metrics, "baton_prefill_turns_total") < 1.0 {
            panic!("the prefill node computed nothing:\n{}", routing_metrics(&http, &up).await);
        }

        // The same prompt again: served from the decode node's prefix cache (all but the
        // last partial block), with the same greedy reply.
        let again: serde_json::Value = http.post(&url).bearer_auth(KEY).json(&api.long_prompt()).send().await.unwrap().json().await.unwrap();
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(cached + 16 >= prompt_tokens, "cached {cached} of {prompt_tokens}");
        assert_eq!(api.reply(&again).unwrap(), reply);

        // Streamed: content chunks, a usage chunk, then [DONE].
        let mut body = api.long_prompt();
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
        let text = http.post(&url).bearer_auth(KEY).json(&body).send().await.unwrap().text().await.unwrap();
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        let streamed: String = data
            .iter()
            .filter(|d| **d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| api.delta(&v))
            .collect();
        assert_eq!(streamed, reply);

        // SIGTERM stops every part and the process exits cleanly.
        let status = terminate(&mut up.child);
        assert!(status.success(), "baton up exited with {status}");
    }
}

/// Sends SIGTERM and waits (at most 20 s) for the exit.
fn terminate(child: &mut Child) -> std::process::ExitStatus {
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "baton up did not stop within 20 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Nobody reading the banner (`baton up | true`, a closed pipe) does not take the cluster
/// down: the banner goes nowhere, the gateway serves, and SIGTERM still stops it cleanly
/// (a failed banner write used to panic and end the process).
#[test]
fn baton_up_keeps_serving_when_nobody_reads_its_stdout() {
    let Some(model) = cluster_support::TestModel::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let listeners = ["--listen", listen.as_str(), "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", "127.0.0.1:0"];
    let child = cluster_support::up_command_with(&model.path, &listeners, &dir.path().join("gateway.db"), KEY)
        .args(["--decode-http-listen", "127.0.0.1:0", "--prefill-http-listen", "127.0.0.1:0", "--threads", "1"])
        .spawn()
        .expect("start baton up");
    let mut up = Up { child, gateway: format!("http://{listen}"), prefill_metrics: String::new(), coordinator_metrics: String::new(), decode_metrics: String::new(), example: String::new(), _dir: dir };
    // The pipe's read end closes before the banner is written: every write of it fails.
    drop(up.child.stdout.take());

    cluster_support::wait_healthy(&listen, Duration::from_secs(60));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let status = rt.block_on(async {
        let body = serde_json::json!({"model": "baton", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]});
        reqwest::Client::new().post(format!("{}/v1/chat/completions", up.gateway)).bearer_auth(KEY).json(&body).send().await.unwrap().status()
    });
    assert!(status.is_success(), "{status}");
    assert!(up.child.try_wait().unwrap().is_none(), "baton up exited after its stdout closed");
    let exit = terminate(&mut up.child);
    assert!(exit.success(), "baton up exited with {exit}");
}
