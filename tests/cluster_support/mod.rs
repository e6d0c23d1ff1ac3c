//! Shared helpers of the cluster tests: real `baton` processes on loopback
//! (coordinator, prefill and decode nodes on port 0, addresses read from the
//! line each prints), readiness by polling `/healthz`, gRPC clients, and a
//! single in-process engine as the reference.
#![allow(dead_code)]

pub mod etcd;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use baton_engine::kv::OwnerId;
use baton_engine::model::load_gguf;
use baton_text::sampling::SamplingParams;
use baton_engine::{Engine, EngineConfig, Event, Request};
use baton_kernels::CpuBackend;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::generate_event::Event as GenEv;
use baton_proto::node::prefill_node_client::PrefillNodeClient;
use baton_proto::node::{self as pb, FinishedEvent};
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use baton_kv_transport::NodeTls;
use tonic::transport::Channel;

/// The default model, or `None` (the test says it is skipped).
pub fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BATON_MODEL") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: model not found at {}", p.display());
        None
    }
}

/// One `baton` child process (the harness's, shared with `baton chaos`); killed
/// (SIGKILL) when dropped.
pub use baton::harness::BatonProc as Proc;

/// Starts `baton ARGS` and waits for its address line (the first line on stdout).
pub fn spawn(args: &[&str]) -> Proc {
    let spec = baton::harness::Spec {
        bin: PathBuf::from(env!("CARGO_BIN_EXE_baton")),
        args: args.iter().map(|s| s.to_string()).collect(),
        log: None,
        prints_addresses: true,
    };
    Proc::spawn(&spec).unwrap_or_else(|e| panic!("baton {args:?}: {e:#}"))
}

/// Polls `GET /healthz` until it answers 200.
pub fn wait_healthy(http: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(http) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = write!(s, "GET /healthz HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n");
            let mut resp = String::new();
            let _ = s.read_to_string(&mut resp);
            if resp.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{http} not healthy within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET /metrics` as text.
pub fn metrics(http: &str) -> String {
    let mut s = std::net::TcpStream::connect(http).expect("connect metrics");
    let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n");
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp
}

/// The engine size of every test process: 64 MiB of KV, no second tier, 2,048 tokens
/// of context (the reference engine's settings).
pub const TEST_ENGINE: [&str; 6] = ["--kv-memory-mib", "64", "--kv-tier2-mib", "0", "--max-context", "2048"];

/// `baton up` over the gateway database `db` and the default model, with the test engine
/// size and `BATON_API_KEY` = `key`; stdout piped (the banner), stderr passed through.
/// `flags` are the test's listeners and settings. Not yet spawned.
pub fn up_command(flags: &[&str], db: &Path, key: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
    c.arg("up")
        .args(flags)
        .args(TEST_ENGINE)
        .arg("--db")
        .arg(db)
        .arg("--model")
        .arg(model_path().expect("the default model (scripts/fetch-model.sh)"))
        .env("BATON_API_KEY", key)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c
}

/// `baton gateway` in front of the cluster at `coordinator`, over the database `db` and the
/// model file `model`, stdout dropped; `flags` add its listeners. Not yet spawned.
pub fn gateway_command(flags: &[&str], coordinator: &str, certs_dir: &str, db: &Path, model: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
    c.arg("gateway")
        .args(flags)
        .args(["--coordinator", coordinator, "--certs-dir", certs_dir])
        .arg("--db")
        .arg(db)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

/// A coordinator on loopback (gRPC and HTTP on port 0) with the certificates in
/// `certs_dir`; `flags` add its policy and membership settings.
pub fn spawn_coordinator(certs_dir: &str, flags: &[&str]) -> Proc {
    let mut args = vec!["coordinator", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--certs-dir", certs_dir];
    args.extend_from_slice(flags);
    spawn(&args)
}

/// The body of a response to `request`, as text.
pub async fn text_of(request: reqwest::RequestBuilder) -> String {
    request.send().await.unwrap().text().await.unwrap()
}

/// Development certificates for the named nodes, plus `coordinator`, `gateway` and
/// `operator` (the identities the tests' own clients use), in a temporary folder.
pub fn certs(dir: &Path, nodes: &str) {
    let all = format!("coordinator,gateway,operator,{nodes}");
    let st = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["certs", "--out", dir.to_str().unwrap(), "--nodes", &all])
        .stdout(Stdio::null())
        .status()
        .expect("baton certs");
    assert!(st.success());
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub coordinator: Proc,
}

impl Cluster {
    /// Certificates for `nodes` and a coordinator whose local-prefill threshold is `threshold`.
    pub fn start(nodes: &str, threshold: usize) -> Option<Cluster> {
        let model = model_path()?;
        let dir = tempfile::tempdir().unwrap();
        certs(dir.path(), nodes);
        let threshold = threshold.to_string();
        let coordinator =
            spawn_coordinator(dir.path().to_str().unwrap(), &["--local-prefill-threshold", &threshold, "--lease-ttl", "2s"]);
        Some(Cluster { dir, model, coordinator })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.coordinator.addr("grpc"))
    }

    /// The folder with every certificate of the test.
    pub fn certs_dir(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }

    /// The internal plane as the process whose certificate is `name` (`gateway`,
    /// `operator`, a node's name).
    pub fn plane(&self, name: &str) -> Plane {
        plane(self.dir.path(), name)
    }

    fn node_args(&self, role: &str, name: &str, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = [
            role,
            "--name",
            name,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--kv-listen",
            "127.0.0.1:0",
            "--coordinator",
            &self.url(),
            "--certs-dir",
            self.dir.path().to_str().unwrap(),
            "--model",
            self.model.to_str().unwrap(),
            "--threads",
            "1",
            "--kv-memory-mib",
            "64",
            "--kv-tier2-mib",
            "0",
            "--kv-staging-mib",
            "32",
            "--max-context",
            "2048",
            "--step-tokens",
            "64",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts a node and waits until it is registered.
    /// Where its tails are prefilled is the coordinator's decision (`Cluster::start`'s threshold).
    pub fn node(&self, role: &str, name: &str, extra: &[&str]) -> Proc {
        let args = self.node_args(role, name, extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = spawn(&refs);
        wait_healthy(&p.addr("http"), Duration::from_secs(60));
        p
    }
}

/// A single in-process engine with the nodes' settings: the reference.
pub fn reference_engine(model: &Path) -> Engine {
    let backend = CpuBackend::new(1).unwrap();
    let loaded = load_gguf(&backend, model).unwrap();
    let config = EngineConfig { kv_memory_bytes: 64 << 20, tier2_bytes: 0, max_context: Some(2048), step_token_budget: 64, ..EngineConfig::default() };
    Engine::start(backend, loaded, config).unwrap()
}

/// Greedy tokens of one request on the reference engine (fresh cache each
/// time is not needed: the engine's own determinism tests cover cached vs not).
pub fn reference_tokens(engine: &Engine, prompt: &[u32], owner: &str, max_tokens: usize) -> Vec<u32> {
    let sampling = SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }.validate().unwrap();
    let req = Request { prompt: prompt.to_vec(), owner: OwnerId::parse(owner).unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: true };
    let mut s = engine.submit(req).unwrap();
    let mut out = Vec::new();
    loop {
        match s.blocking_next().unwrap() {
            Event::Token(t) => out.push(t.id),
            Event::Finished { .. } => return out,
            Event::Failed(e) => panic!("{e}"),
        }
    }
}

pub fn chat(engine: &Engine, system: &str, user: &str) -> Vec<u32> {
    use baton_text::chat_template::ChatMessage;
    let text = engine.template.render(&[ChatMessage::new("system", system), ChatMessage::new("user", user)], true).unwrap();
    engine.tokenizer.encode(&text, true).unwrap()
}

pub fn generate_request(prompt: &[u32], owner: &str, conversation: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        turn: Some(pb::Turn { prompt: prompt.to_vec(), owner: owner.into(), platform_prefix_len: 0, conversation: conversation.into() }),
        sampling: Some(pb::SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, top_p: 1.0, ..Default::default() }),
        prefix_source: String::new(),
    }
}

/// The internal plane as `name`, from the certificates in `dir`.
pub fn plane(dir: &Path, name: &str) -> Plane {
    Plane::mtls(NodeTls::from_dir(dir, name).unwrap()).unwrap()
}

/// A channel to `addr` over `plane`, to a server of any node role.
pub async fn channel(plane: &Plane, addr: &str) -> Channel {
    let endpoint = plane.endpoint(addr).unwrap();
    plane
        .connect(&endpoint, Expect::OneOf(vec![IdRole::Decode, IdRole::Prefill, IdRole::Coordinator]))
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}: {:?}", std::error::Error::source(&e)))
}

/// Runs one turn on a decode node, as the gateway; returns its tokens and final event.
pub async fn generate(gateway: Plane, grpc: String, req: pb::GenerateRequest) -> (Vec<u32>, FinishedEvent) {
    let mut c = DecodeNodeClient::new(channel(&gateway, &grpc).await);
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(GenEv::Token(t)) => tokens.push(t.id),
            Some(GenEv::Finished(f)) => return (tokens, f),
            None => panic!("empty event"),
        }
    }
    panic!("stream ended without a final event");
}

/// A decode node's stats, as an operator.
pub async fn decode_stats(operator: &Plane, grpc: &str) -> pb::NodeStats {
    let mut c = DecodeNodeClient::new(channel(operator, grpc).await);
    c.stats(pb::StatsRequest {}).await.unwrap().into_inner()
}

/// A prefill node's stats, as an operator.
pub async fn prefill_stats(operator: &Plane, grpc: &str) -> pb::NodeStats {
    let mut c = PrefillNodeClient::new(channel(operator, grpc).await);
    c.stats(pb::StatsRequest {}).await.unwrap().into_inner()
}

/// Waits until a node is idle, then checks nothing is pinned or reserved.
pub async fn assert_no_leaks(stats: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = pb::NodeStats>>>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = stats().await;
        let clean = st.running == 0 && st.waiting == 0 && st.kv_blocks_used == 0 && st.live_reservations == 0 && st.staging_blocks_used == 0;
        if clean {
            assert_eq!(st.kv_blocks_free + st.kv_blocks_cached, st.kv_blocks_total, "{st:?}");
            return;
        }
        assert!(Instant::now() < deadline, "node did not return to its baseline: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
