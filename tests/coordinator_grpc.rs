//! The coordinator over real gRPC and HTTP on 127.0.0.1:0 (in-memory membership):
//! registration and keep-alive through `MembershipClient`, decode and prefill routing
//! with explanations, lease expiry, re-registration after a coordinator restart,
//! fleet-wide eviction over `NodeControl.Evict` (acks, departed nodes pending, a re-joining
//! node evicting tombstones first), and the `baton coordinator` binary.
//! Every call runs over the internal plane's mutual TLS, each party with its own identity.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_coordinator::{Config, Coordinator};
use baton_proto::common::{LoadReport, NodeId, NodeInfo, Role};
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::route_prefill_response::Choice;
use baton_proto::coordinator::{
    EvictConversationRequest, ExplainRequest, ListNodesRequest, Reason, RouteDecodeRequest, RoutePrefillRequest,
};
use baton_proto::node::node_control_server::{NodeControl, NodeControlServer};
use baton_proto::node::{DrainRequest, DrainResponse, EvictRequest, EvictResponse};
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use baton_proto::{MembershipClient, MembershipHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tonic::transport::Channel;

struct Running {
    grpc: SocketAddr,
    http: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<baton_coordinator::Result<()>>,
}

impl Running {
    async fn start(config: Config) -> Self {
        let c = Coordinator::bind(config).await.unwrap();
        let (grpc, http) = (c.grpc_addr(), c.http_addr());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(c.serve(async move {
            let _ = rx.await;
        }));
        Running { grpc, http, stop: Some(tx), task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// A client with the identity of certificate `name` (`gateway`, `operator`, a node).
    async fn client_as(&self, name: &str) -> CoordinatorClient<Channel> {
        let plane = plane(name);
        let endpoint = plane.endpoint(&self.url()).unwrap();
        CoordinatorClient::new(plane.connect(&endpoint, Expect::Role(IdRole::Coordinator)).await.unwrap())
    }

    /// The gateway's client (routing, listing, eviction).
    async fn client(&self) -> CoordinatorClient<Channel> {
        self.client_as("gateway").await
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

/// One cluster CA for the whole file, with every identity its tests use.
fn pki() -> &'static baton_kv_transport::DevCerts {
    static PKI: std::sync::OnceLock<baton_kv_transport::DevCerts> = std::sync::OnceLock::new();
    PKI.get_or_init(|| {
        let names = ["coordinator", "gateway", "operator", "decode:a", "decode:b", "prefill:p0"];
        let nodes = ["d0", "d1", "d2", "d3", "d9"].map(|n| format!("decode:{n}"));
        let all: Vec<&str> = names.iter().copied().chain(nodes.iter().map(String::as_str)).collect();
        baton_kv_transport::generate_dev_certs("coordinator-grpc-test", &all).unwrap()
    })
}

fn plane(name: &str) -> Plane {
    Plane::mtls(pki().node_tls(name).unwrap()).unwrap()
}

fn config(ttl_ms: u64) -> Config {
    Config { lease_ttl: Duration::from_millis(ttl_ms), ..Config::with_defaults(plane("coordinator")) }
}

fn node(id: &str, role: Role, grpc_addr: String) -> NodeInfo {
    NodeInfo {
        node_id: Some(NodeId { id: id.into() }),
        role: role as i32,
        grpc_addr,
        kv_endpoint: "127.0.0.1:1".into(),
        block_tokens: 16,
        kv_blocks_total: 1000,
        load: None,
        identity_key: Vec::new(),
    }
}

fn join(url: &str, id: &str, role: Role) -> MembershipHandle {
    MembershipClient::new(url, node(id, role, format!("127.0.0.1:{}", 10_000 + id.len())), plane(id))
        .with_load(|| LoadReport { kv_blocks_free: 900, running: 1, waiting: 0, ..LoadReport::default() })
        .spawn()
}

async fn node_ids(c: &mut CoordinatorClient<Channel>, role: Role) -> Vec<String> {
    let nodes = c.list_nodes(ListNodesRequest { role: role as i32 }).await.unwrap().into_inner().nodes;
    nodes.into_iter().map(|n| n.node_id.unwrap().id).collect()
}

async fn wait_nodes(c: &mut CoordinatorClient<Channel>, want: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ids = node_ids(c, Role::Unspecified).await;
        if ids == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "nodes {ids:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn route(c: &mut CoordinatorClient<Channel>, key: &str, exclude: &[&str]) -> (String, i32) {
    let r = c
        .route_decode(RouteDecodeRequest {
            routing_key: key.into(),
            owner: "user-1".into(),
            prompt_tokens: 100,
            exclude: exclude.iter().map(|id| NodeId { id: id.to_string() }).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    (r.node.unwrap().node_id.unwrap().id, r.explanation.unwrap().reason)
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_get_with(addr, path, "").await
}

/// GET with extra header lines (each ending in \r\n).
async fn http_get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let status = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_round_trip_with_explanations_metrics_and_health() {
    let admin = baton_identity::AdminKey::new("coordinator-test-admin-key").unwrap();
    let co = Running::start(Config { admin_key: Some(admin), ..config(2000) }).await;
    let mut c = co.client().await;
    let nodes: Vec<MembershipHandle> = ["d0", "d1", "d2", "d3"].iter().map(|id| join(&co.url(), id, Role::Decode)).collect();
    let p = join(&co.url(), "p0", Role::Prefill);
    for n in nodes.iter().chain([&p]) {
        n.wait_registered(1).await;
    }
    assert_eq!(node_ids(&mut c, Role::Decode).await, vec!["d0", "d1", "d2", "d3"]);
    assert_eq!(node_ids(&mut c, Role::Prefill).await, vec!["p0"]);

    // Same conversation, same node; the second turn is sticky.
    let (first, reason) = route(&mut c, "conv-a", &[]).await;
    assert!(reason == Reason::Home as i32 || reason == Reason::Spilled as i32);
    assert_eq!(route(&mut c, "conv-a", &[]).await, (first.clone(), Reason::Sticky as i32));
    // A retry that excludes the failed node lands elsewhere.
    let (other, reason) = route(&mut c, "conv-a", &[first.as_str()]).await;
    assert_ne!(other, first);
    assert_eq!(reason, Reason::Spilled as i32);

    // 1,000 conversations over 4 nodes: none above 1.25x the mean.
    let mut counts = std::collections::HashMap::<String, u32>::new();
    for i in 0..1000 {
        *counts.entry(route(&mut c, &format!("bulk-{i}"), &[]).await.0).or_default() += 1;
    }
    let max = *counts.values().max().unwrap();
    assert!(f64::from(max) <= 1.25 * 1001.0 / 4.0 + 1.0, "max {max} of {counts:?}");

    // Prefill: short tail local, long tail to the prefill node.
    let pre = |uncached| RoutePrefillRequest {
        routing_key: "conv-a".into(),
        owner: "user-1".into(),
        prompt_tokens: 3000,
        cached_tokens: 3000 - uncached,
        uncached_tokens: uncached,
        decode_node: Some(NodeId { id: first.clone() }),
        decode_load: None,
    };
    // RoutePrefill is the decode node's call; Explain the operator's.
    let mut as_decode = co.client_as(&first).await;
    let mut as_operator = co.client_as("operator").await;
    let r = as_decode.route_prefill(pre(100)).await.unwrap().into_inner();
    assert!(matches!(r.choice, Some(Choice::Local(_))));
    assert_eq!(r.explanation.unwrap().reason, Reason::LocalShortTail as i32);
    let r = as_decode.route_prefill(pre(2000)).await.unwrap().into_inner();
    match r.choice {
        Some(Choice::Remote(n)) => assert_eq!(n.node_id.unwrap().id, "p0"),
        other => panic!("expected a remote prefill, got {other:?}"),
    }

    // Explain: newest first, every decision about conv-a.
    let ex = as_operator.explain(ExplainRequest { routing_key: "conv-a".into(), limit: 0 }).await.unwrap().into_inner();
    assert_eq!(ex.records.len(), 5);
    assert_eq!(ex.records[0].reason, Reason::RemoteLeastLoaded as i32);
    assert_eq!(ex.records[4].candidates.len(), 4);
    assert!(ex.records.windows(2).all(|w| w[0].seq > w[1].seq));

    // HTTP: the same records as JSON (for the admin key only), metrics, health.
    let bearer = "Authorization: Bearer coordinator-test-admin-key\r\n";
    assert_eq!(http_get(co.http, "/debug/routing?key=conv-a").await.0, 401, "no key");
    assert_eq!(http_get_with(co.http, "/debug/routing?key=conv-a", "Authorization: Bearer coordinator-test-admin-kez\r\n").await.0, 401);
    let (status, body) = http_get_with(co.http, "/debug/routing?key=conv-a&limit=2", bearer).await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["records"].as_array().unwrap().len(), 2);
    assert_eq!(json["records"][0]["reason"], "remote_least_loaded");
    assert_eq!(json["records"][1]["chosen"], serde_json::Value::Null);
    assert_eq!(http_get_with(co.http, "/debug/routing", bearer).await.0, 400);
    let (status, metrics) = http_get(co.http, "/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("baton_coordinator_routing_decisions_total{kind=\"decode\",reason=\"sticky\"} 1"), "{metrics}");
    assert!(metrics.contains("baton_coordinator_nodes{role=\"decode\"} 4"), "{metrics}");
    assert_eq!(http_get(co.http, "/healthz").await, (200, "ok\n".to_string()));

    // A decode node whose steps are over its ITL target sends even a short tail to the
    // prefill node; with headroom it keeps it.
    let standing = |p95: f64, budget: u32| LoadReport {
        kv_blocks_free: 900,
        running: 20,
        waiting: 0,
        itl_target_seconds: 0.05,
        step_p95_seconds: p95,
        prefill_budget_tokens: budget,
    };
    let busy = RoutePrefillRequest { routing_key: "conv-b".into(), decode_load: Some(standing(0.07, 0)), ..pre(100) };
    let r = as_decode.route_prefill(busy).await.unwrap().into_inner();
    match r.choice {
        Some(Choice::Remote(n)) => assert_eq!(n.node_id.unwrap().id, "p0"),
        other => panic!("expected a remote prefill, got {other:?}"),
    }
    assert_eq!(r.explanation.unwrap().reason, Reason::RemoteDecodeBusy as i32);
    let calm = RoutePrefillRequest { routing_key: "conv-b".into(), decode_load: Some(standing(0.03, 64)), ..pre(100) };
    let r = as_decode.route_prefill(calm).await.unwrap().into_inner();
    assert!(matches!(r.choice, Some(Choice::Local(_))), "{r:?}");
    let (_, metrics) = http_get(co.http, "/metrics").await;
    assert!(metrics.contains("baton_coordinator_routing_decisions_total{kind=\"prefill\",reason=\"remote_decode_busy\"} 1"), "{metrics}");

    for n in nodes {
        n.shutdown().await;
    }
    p.shutdown().await;
    wait_nodes(&mut c, &[]).await;
    co.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_leaves_the_ring() {
    let co = Running::start(config(400)).await;
    let mut c = co.client().await;
    let a = join(&co.url(), "a", Role::Decode);
    let b = join(&co.url(), "b", Role::Decode);
    a.wait_registered(1).await;
    b.wait_registered(1).await;
    // Find a conversation that lives on b, then kill b.
    let mut key = String::new();
    for i in 0.. {
        key = format!("k{i}");
        if route(&mut c, &key, &[]).await.0 == "b" {
            break;
        }
    }
    b.abort();
    wait_nodes(&mut c, &["a"]).await;
    assert_eq!(route(&mut c, &key, &[]).await.0, "a");
    a.shutdown().await;
    co.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_register_again_after_the_coordinator_restarts() {
    let co = Running::start(config(300)).await;
    let (grpc, http) = (co.grpc, co.http);
    let a = join(&co.url(), "a", Role::Decode);
    a.wait_registered(1).await;
    co.stop().await;
    // A new coordinator on the same ports knows no lease: a hears "unknown lease" (or
    // cannot connect for a moment) and registers again.
    let co = Running::start(Config { listen: grpc, http_listen: http, ..config(300) }).await;
    tokio::time::timeout(Duration::from_secs(10), a.wait_registered(2)).await.expect("a re-registers");
    let mut c = co.client().await;
    wait_nodes(&mut c, &["a"]).await;
    a.shutdown().await;
    co.stop().await;
}

/// A node's control service that counts evictions, or refuses them.
struct FakeNode {
    evictions: Arc<AtomicU64>,
    refuse: bool,
}

#[tonic::async_trait]
impl NodeControl for FakeNode {
    async fn evict(&self, req: tonic::Request<EvictRequest>) -> Result<tonic::Response<EvictResponse>, tonic::Status> {
        if self.refuse {
            return Err(tonic::Status::internal("disk on fire"));
        }
        assert_eq!(req.get_ref().conversation, "conv-x");
        assert_eq!(req.get_ref().owner, "user-9");
        self.evictions.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(EvictResponse { blocks_freed: 3 }))
    }

    async fn drain(&self, _: tonic::Request<DrainRequest>) -> Result<tonic::Response<DrainResponse>, tonic::Status> {
        Ok(tonic::Response::new(DrainResponse::default()))
    }
}

/// A node's control service as node `id`, behind the plane's TLS and authorization.
async fn fake_node(id: &str, evictions: Arc<AtomicU64>, refuse: bool) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let plane = plane(id);
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(plane.authorize())
            .add_service(NodeControlServer::new(FakeNode { evictions, refuse }))
            .serve_with_incoming(plane.incoming(l)),
    );
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_reaches_every_node_and_reports_who_still_owes_it() {
    let co = Running::start(config(2000)).await;
    let mut c = co.client().await;
    let evictions = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for (id, role) in [("d0", Role::Decode), ("d1", Role::Decode), ("p0", Role::Prefill)] {
        let addr = fake_node(id, evictions.clone(), false).await;
        let h = MembershipClient::new(co.url(), node(id, role, addr.to_string()), plane(id)).spawn();
        h.wait_registered(1).await;
        handles.push(h);
    }
    let req = || EvictConversationRequest { routing_key: "conv-x".into(), owner: "user-9".into() };
    let r = c.evict_conversation(req()).await.unwrap().into_inner();
    assert_eq!(r.acks.len(), 3);
    assert!(r.acks.iter().all(|a| a.ok && a.blocks_freed == 3));
    assert!(r.pending.is_empty());
    assert_eq!(evictions.load(Ordering::SeqCst), 3);

    // One node refuses: its ack says so, the others still evicted, and the refusing
    // node leaves the ring (it may still serve the prefix) until it re-joins.
    let bad = fake_node("d9", evictions.clone(), true).await;
    let h9 = MembershipClient::new(co.url(), node("d9", Role::Decode, bad.to_string()), plane("d9")).spawn();
    h9.wait_registered(1).await;
    let r = c.evict_conversation(req()).await.unwrap().into_inner();
    assert_eq!(r.acks.len(), 4);
    let failed: Vec<&str> = r.acks.iter().filter(|a| !a.ok).map(|a| a.node_id.as_ref().unwrap().id.as_str()).collect();
    assert_eq!(failed, vec!["d9"]);
    assert!(r.acks.iter().find(|a| !a.ok).unwrap().error.contains("disk on fire"));
    assert_eq!(evictions.load(Ordering::SeqCst), 6);
    // Its re-registration must evict conv-x first, which it refuses: it stays out.
    wait_nodes(&mut c, &["d0", "d1", "p0"]).await;

    // d0 leaves: it may still hold the KV, so it is reported pending, not forgotten
    // (and so is d9, trying to re-join).
    let d0 = handles.remove(0);
    d0.shutdown().await;
    wait_nodes(&mut c, &["d1", "p0"]).await;
    let r = c.evict_conversation(req()).await.unwrap().into_inner();
    assert_eq!(r.pending.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(), vec!["d0", "d9"]);
    assert!(r.acks.iter().all(|a| a.ok));
    assert_eq!(evictions.load(Ordering::SeqCst), 8);

    // d0 re-joins: conv-x is still tombstoned, so d0 evicts it before it is admitted;
    // the next answer asks it like any member.
    let addr = fake_node("d0", evictions.clone(), false).await;
    let d0 = MembershipClient::new(co.url(), node("d0", Role::Decode, addr.to_string()), plane("d0")).spawn();
    d0.wait_registered(1).await;
    assert_eq!(evictions.load(Ordering::SeqCst), 9, "the joining node evicted the tombstone first");
    let r = c.evict_conversation(req()).await.unwrap().into_inner();
    assert_eq!(r.pending.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(), vec!["d9"]);
    assert_eq!(r.acks.iter().filter(|a| a.ok).count(), 3);
    handles.push(d0);

    // A node that cannot evict the tombstones is not admitted.
    let refusing = fake_node("d3", evictions.clone(), true).await;
    let d3 = MembershipClient::new(co.url(), node("d3", Role::Decode, refusing.to_string()), plane("d3")).spawn();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(d3.state().lease_id, None);
    assert!(!node_ids(&mut c, Role::Unspecified).await.contains(&"d3".to_string()));
    d3.shutdown().await;
    h9.shutdown().await;
    for h in handles {
        h.shutdown().await;
    }
    co.stop().await;
}

#[test]
fn baton_coordinator_binary_serves_and_reports_its_ports() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    pki().write_to_dir(dir.path(), false).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["coordinator", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--lease-ttl", "3s"])
        .arg("--certs-dir")
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let http: SocketAddr = line.trim().split("http=").nth(1).expect("ports line").parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let health = rt.block_on(http_get(http, "/healthz"));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(health, (200, "ok\n".to_string()));
    assert!(line.starts_with("coordinator grpc=127.0.0.1:"), "{line}");
}

#[test]
fn baton_coordinator_binary_refuses_to_start_without_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["coordinator", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .arg("--certs-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "a coordinator without its certificate must not serve plaintext");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("coordinator.pem"), "the error names the missing file: {err}");
}
