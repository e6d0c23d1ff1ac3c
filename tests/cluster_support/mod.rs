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

/// A model the cluster tests run over: SmolLM2 (the default model, every layer global)
/// and Gemma 3 270M (interleaved 512-token sliding-window and global layers, a
/// SentencePiece tokenizer, no chat template: a base model).
#[derive(Clone, Debug)]
pub struct TestModel {
    /// The name the parameterized tests carry (`smollm2`, `gemma3`).
    pub name: &'static str,
    pub path: PathBuf,
}

impl TestModel {
    /// The default model: `BATON_MODEL`, else the model cache; `None` (and a line saying
    /// the test is skipped) when absent.
    pub fn smollm2() -> Option<TestModel> {
        Self::find("smollm2", "BATON_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-model.sh")
    }

    /// Gemma 3 270M Q4_K_M: `BATON_GEMMA_MODEL`, else the model cache; `None` (and a line
    /// saying the test is skipped) when absent.
    pub fn gemma3() -> Option<TestModel> {
        Self::find("gemma3", "BATON_GEMMA_MODEL", "gemma-3-270m-q4_k_m.gguf", "scripts/fetch-model.sh gemma3")
    }

    /// Whether the file carries a chat template (else it is a base model, served by
    /// `/v1/completions`, and chat requests are refused).
    pub fn has_chat_template(&self) -> bool {
        let f = baton_text::gguf::GgufFile::open_header(&self.path).unwrap_or_else(|e| panic!("{}: {e}", self.path.display()));
        f.get("tokenizer.chat_template").is_some()
    }

    fn find(name: &'static str, var: &str, file: &str, fetch: &str) -> Option<TestModel> {
        if let Some(p) = std::env::var_os(var) {
            return Some(TestModel { name, path: PathBuf::from(p) });
        }
        let p = baton_text::model_cache::model_cache_dir()?.join(file);
        if p.exists() {
            Some(TestModel { name, path: p })
        } else {
            eprintln!("skipped: {name} not found at {} (run {fetch}, or set {var})", p.display());
            None
        }
    }
}

/// Defines one test per model over the same body: `over_models! { fn name(model) { .. } }`
/// (or `async fn`, run on a two-thread runtime) makes module `name` with the tests
/// `smollm2` and `gemma3`, each calling the body with that [`TestModel`] or saying it is
/// skipped when the file is absent. `cargo test gemma3` runs every Gemma variant.
#[allow(unused_macros)]
macro_rules! over_models {
    ($(#[$attr:meta])* fn $name:ident($model:ident) $body:block) => {
        $(#[$attr])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($model: crate::cluster_support::TestModel) $body

            #[test]
            fn smollm2() {
                if let Some(m) = crate::cluster_support::TestModel::smollm2() {
                    body(m)
                }
            }

            #[test]
            fn gemma3() {
                if let Some(m) = crate::cluster_support::TestModel::gemma3() {
                    body(m)
                }
            }
        }
    };
    ($(#[$attr:meta])* async fn $name:ident($model:ident) $body:block) => {
        $(#[$attr])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn body($model: crate::cluster_support::TestModel) $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn smollm2() {
                if let Some(m) = crate::cluster_support::TestModel::smollm2() {
                    body(m).await
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn gemma3() {
                if let Some(m) = crate::cluster_support::TestModel::gemma3() {
                    body(m).await
                }
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use over_models;

/// The default model's file, or `None` (the test says it is skipped).
pub fn model_path() -> Option<PathBuf> {
    TestModel::smollm2().map(|m| m.path)
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
    up_command_with(&model_path().expect("the default model (scripts/fetch-model.sh)"), flags, db, key)
}

/// [`up_command`] over the model file `model`.
pub fn up_command_with(model: &Path, flags: &[&str], db: &Path, key: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
    c.arg("up")
        .args(flags)
        .args(TEST_ENGINE)
        .arg("--db")
        .arg(db)
        .arg("--model")
        .arg(model)
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
    /// Certificates for `nodes` and a coordinator whose local-prefill threshold is
    /// `threshold`; nodes serve the default model.
    pub fn start(nodes: &str, threshold: usize) -> Option<Cluster> {
        Some(Self::start_with(&TestModel::smollm2()?, nodes, threshold))
    }

    /// [`Cluster::start`] with nodes serving `model`.
    pub fn start_with(model: &TestModel, nodes: &str, threshold: usize) -> Cluster {
        let model = model.path.clone();
        let dir = tempfile::tempdir().unwrap();
        certs(dir.path(), nodes);
        let threshold = threshold.to_string();
        let coordinator =
            spawn_coordinator(dir.path().to_str().unwrap(), &["--local-prefill-threshold", &threshold, "--lease-ttl", "2s"]);
        Cluster { dir, model, coordinator }
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

/// The prompt of a conversation's first turn: in the model's own chat template, or for a
/// base model (no template, e.g. Gemma 3 270M, served by `/v1/completions`) as plain
/// text that the reply continues, tokenized as a raw prompt is.
pub fn chat(engine: &Engine, system: &str, user: &str) -> Vec<u32> {
    use baton_text::chat_template::ChatMessage;
    if !engine.template.is_present() {
        return engine.tokenizer.encode_prompt(&format!("{system}{}", plain_turn(user))).unwrap();
    }
    let text = engine.template.render(&[ChatMessage::new("system", system), ChatMessage::new("user", user)], true).unwrap();
    engine.tokenizer.encode(&text, true).unwrap()
}

/// A question and the start of its answer, as a base model's prompt goes on.
fn plain_turn(user: &str) -> String {
    format!("\n\nQuestion: {user}\nAnswer:")
}

/// What [`chat_past_the_window`] repeats before the user's question.
const FILLER: &str = "Museum note: the physics hall has a pendulum, a prism, a tesla coil and a cloud chamber; \
    guides answer one question at a time and point visitors to the exhibit that shows the effect.";

/// [`chat`], with `user` preceded by as many copies of [`FILLER`] as make the prompt longer
/// than the model's largest sliding window plus two blocks, so that its local layers'
/// leading blocks are out of every later row's window; a model without sliding-window
/// layers gets [`chat`]'s prompt unchanged.
pub fn chat_past_the_window(engine: &Engine, system: &str, user: &str) -> Vec<u32> {
    let Some(window) = engine.info.layer_windows.iter().flatten().copied().max() else { return chat(engine, system, user) };
    let want = window + 2 * engine.info.kv_layout.block_tokens;
    let mut text = String::new();
    loop {
        let prompt = chat(engine, system, &format!("{text}{user}"));
        if prompt.len() > want {
            return prompt;
        }
        text.push_str(FILLER);
        text.push(' ');
    }
}

/// The tokens that follow a reply to start the conversation's next turn: the end of the
/// reply, `user`'s message and the opening of the next reply, in the model's template
/// (what it renders after an assistant message, cut at the message's end), or for a base
/// model in [`chat`]'s plain text.
pub fn next_turn(engine: &Engine, user: &str) -> Vec<u32> {
    use baton_text::chat_template::ChatMessage;
    if !engine.template.is_present() {
        return engine.tokenizer.encode(&plain_turn(user), false).unwrap();
    }
    const REPLY: &str = "REPLY-MARKER-7f3a";
    let messages = [ChatMessage::new("user", "Hello."), ChatMessage::new("assistant", REPLY), ChatMessage::new("user", user)];
    let text = engine.template.render(&messages, true).unwrap();
    let (_, after) = text.split_once(REPLY).expect("the template renders the assistant's message");
    engine.tokenizer.encode(after, true).unwrap()
}

/// KV bytes a decode node does not take over the wire for a remote prefill of a whole
/// `prompt_len`-token prompt: on each sliding-window layer, the blocks wholly before the
/// window of the row at the start of the prompt's last block (0 without such layers).
pub fn window_skipped_bytes(engine: &Engine, prompt_len: usize) -> u64 {
    let layout = engine.info.kv_layout;
    let bt = layout.block_tokens;
    let last_block_start = prompt_len / bt * bt;
    let blocks: usize = engine.info.layer_windows.iter().flatten().map(|&w| (last_block_start + 1).saturating_sub(w) / bt).sum();
    (blocks * layout.block_layer_bytes()) as u64
}

/// KV memory a decode node's turn holds no sliding-window layers for at its end, when
/// its last computed row is at `computed - 1`: on every window layer, the blocks before
/// the window of the row at the start of `computed`'s block (the least over the
/// layers; 0 without such layers).
pub fn window_saved_bytes(engine: &Engine, computed: usize) -> u64 {
    let layout = engine.info.kv_layout;
    let bt = layout.block_tokens;
    let from = computed / bt * bt;
    let windows: Vec<usize> = engine.info.layer_windows.iter().flatten().copied().collect();
    let blocks = windows.iter().map(|&w| (from + 1).saturating_sub(w) / bt).min().unwrap_or(0);
    (blocks * windows.len() * layout.block_layer_bytes()) as u64
}

/// The value of the Prometheus sample `name` (its whole name with labels) in `text`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

pub fn generate_request(prompt: &[u32], owner: &str, conversation: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        turn: Some(pb::Turn { prompt: prompt.to_vec(), owner: owner.into(), platform_prefix_len: 0, conversation: conversation.into() }),
        sampling: Some(pb::SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, top_p: 1.0, ..Default::default() }),
        prefix_source: String::new(),
        prefix_source_node: String::new(),
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
    let (tokens, fin, _) = generate_traced(gateway, grpc, req).await;
    (tokens, fin)
}

/// [`generate`], also returning where the decode node said the turn's KV came from (the
/// labels of `GenerateEvent.kv_source`, which it must send exactly once, with the first
/// token).
pub async fn generate_traced(gateway: Plane, grpc: String, req: pb::GenerateRequest) -> (Vec<u32>, FinishedEvent, (&'static str, &'static str)) {
    let mut c = DecodeNodeClient::new(channel(&gateway, &grpc).await);
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    let mut source = None;
    while let Some(ev) = s.message().await.unwrap() {
        if let Some(k) = &ev.kv_source {
            assert!(source.is_none() && tokens.is_empty(), "kv_source comes once, on the first event");
            source = Some(baton_proto::kv_source::labels(k));
        }
        match ev.event {
            Some(GenEv::Token(t)) => tokens.push(t.id),
            Some(GenEv::Finished(f)) => return (tokens, f, source.expect("the turn said where its KV came from")),
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
