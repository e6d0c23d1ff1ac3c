//! Membership through a real etcd: the conformance suite over `EtcdMembership`, and a
//! coordinator backed by etcd with nodes that join, die (lease expiry), and re-register
//! on their own after etcd restarts with its data lost.
//!
//! Each test starts its own `etcd` process on free loopback ports with a temporary data
//! directory. Without an `etcd` binary on PATH (or in `BATON_ETCD_BIN`) the tests are
//! skipped with a loud message; `.ci/run` installs Debian's `etcd-server` so CI runs them.

mod cluster_support;

use baton_proto::plane::{Expect, Plane, Role as IdRole};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_coordinator::membership::conformance;
use baton_coordinator::{Config, Coordinator, EtcdMembership, MembershipConfig};
use baton_proto::common::{NodeId, NodeInfo, Role};
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::{EvictConversationRequest, ListNodesRequest, RouteDecodeRequest};
use baton_proto::node::node_control_server::{NodeControl, NodeControlServer};
use baton_proto::node::{DrainRequest, DrainResponse, EvictRequest, EvictResponse};
use baton_proto::MembershipClient;
use cluster_support::etcd::Etcd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_passes_the_conformance_suite() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let m = EtcdMembership::connect(&[etcd.endpoint()], "/conformance/", Duration::from_secs(2)).await.unwrap();
    conformance::run(m).await;
}

fn node(id: &str, role: Role) -> NodeInfo {
    NodeInfo {
        node_id: Some(NodeId { id: id.into() }),
        role: role as i32,
        grpc_addr: format!("127.0.0.1:{}", 9000 + id.len()),
        kv_endpoint: "127.0.0.1:9999".into(),
        block_tokens: 16,
        kv_blocks_total: 1000,
        load: None,
        identity_key: Vec::new(),
    }
}

async fn node_ids(client: &mut CoordinatorClient<tonic::transport::Channel>) -> Vec<String> {
    let nodes = client.list_nodes(ListNodesRequest { role: 0 }).await.unwrap().into_inner().nodes;
    nodes.into_iter().map(|n| n.node_id.unwrap().id).collect()
}

async fn wait_nodes(client: &mut CoordinatorClient<tonic::transport::Channel>, want: &[&str], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let ids = node_ids(client).await;
        if ids == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "nodes {ids:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The cluster's identities: a coordinator, a gateway, and the nodes that join.
fn plane(name: &str) -> Plane {
    static PKI: std::sync::OnceLock<baton_kv_transport::DevCerts> = std::sync::OnceLock::new();
    let pki = PKI.get_or_init(|| {
        baton_kv_transport::generate_dev_certs("etcd-test", &["coordinator", "gateway", "decode:d1", "decode:d2", "prefill:p1"]).unwrap()
    });
    Plane::mtls(pki.node_tls(name).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_join_lease_expiry_and_reregistration_after_etcd_restart() {
    let Some(mut etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let config = Config {
        membership: MembershipConfig::Etcd { endpoints: vec![etcd.endpoint()], prefix: "/baton-test/".into() },
        lease_ttl: Duration::from_secs(2),
        ..Config::with_defaults(plane("coordinator"))
    };
    let coordinator = Coordinator::bind(config).await.unwrap();
    let url = format!("http://{}", coordinator.grpc_addr());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(coordinator.serve(async move {
        let _ = stop_rx.await;
    }));
    let gateway = plane("gateway");
    let mut client = CoordinatorClient::new(gateway.connect(&gateway.endpoint(&url).unwrap(), Expect::Role(IdRole::Coordinator)).await.unwrap());

    // Join.
    let d1 = MembershipClient::new(url.clone(), node("d1", Role::Decode), plane("d1")).spawn();
    let d2 = MembershipClient::new(url.clone(), node("d2", Role::Decode), plane("d2")).spawn();
    let p1 = MembershipClient::new(url.clone(), node("p1", Role::Prefill), plane("p1")).spawn();
    d1.wait_registered(1).await;
    d2.wait_registered(1).await;
    p1.wait_registered(1).await;
    wait_nodes(&mut client, &["d1", "d2", "p1"], Duration::from_secs(5)).await;

    // d2 dies without deregistering: its etcd lease expires and it leaves.
    d2.abort();
    wait_nodes(&mut client, &["d1", "p1"], Duration::from_secs(8)).await;

    // etcd is killed and comes back empty: the nodes hear "unknown lease" and register
    // again by themselves.
    etcd.restart_empty(1);
    etcd.ready().await;
    let d1_regs = tokio::time::timeout(Duration::from_secs(20), d1.wait_registered(2)).await;
    assert!(d1_regs.is_ok(), "d1 did not re-register: {:?}", d1.state());
    tokio::time::timeout(Duration::from_secs(20), p1.wait_registered(2)).await.expect("p1 re-registers");
    wait_nodes(&mut client, &["d1", "p1"], Duration::from_secs(10)).await;

    d1.shutdown().await;
    p1.shutdown().await;
    wait_nodes(&mut client, &[], Duration::from_secs(5)).await;
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}

/// Routes one turn of `conversation` through `client`, avoiding `exclude`; the node's ID.
async fn route(client: &mut CoordinatorClient<tonic::transport::Channel>, conversation: &str, exclude: &[&str]) -> String {
    let ask = RouteDecodeRequest {
        routing_key: conversation.to_string(),
        owner: "alice".into(),
        prompt_tokens: 64,
        exclude: exclude.iter().map(|id| NodeId { id: id.to_string() }).collect(),
    };
    client.route_decode(ask).await.unwrap().into_inner().node.unwrap().node_id.unwrap().id
}

/// Two coordinator replicas over one etcd answer the same decode node for a conversation,
/// whichever placed it, even where a replica's own view would place it elsewhere: a
/// conversation moved off its ring home (its node failed a turn) stays where it moved when
/// the next turn asks the other replica. Before placements were shared, the other replica
/// answered the ring home.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_over_one_etcd_route_a_conversation_to_the_same_decode_node() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let mut replicas = Replicas::start(&etcd, "/baton-replicas/", None).await;
    let urls = replicas.urls.clone();
    let clients = &mut replicas.clients;
    // The nodes know both replicas: they join through one and renew with each.
    let d1 = MembershipClient::replicas(urls.clone(), node("d1", Role::Decode), plane("d1")).spawn();
    let d2 = MembershipClient::replicas(urls.clone(), node("d2", Role::Decode), plane("d2")).spawn();
    d1.wait_registered(1).await;
    d2.wait_registered(1).await;
    for c in clients.iter_mut() {
        wait_nodes(c, &["d1", "d2"], Duration::from_secs(5)).await;
    }

    for i in 0..12 {
        let conversation = format!("conv-{i}");
        let (first, second) = if i % 2 == 0 { (0, 1) } else { (1, 0) };
        let home = route(&mut clients[first], &conversation, &[]).await;
        assert_eq!(route(&mut clients[second], &conversation, &[]).await, home, "{conversation}: the other replica agrees on a new placement");
        // Its node fails a turn: the gateway excludes it and the conversation moves.
        let moved = route(&mut clients[first], &conversation, &[home.as_str()]).await;
        assert_ne!(moved, home);
        // The other replica follows as soon as its watch delivers the record (milliseconds).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while route(&mut clients[second], &conversation, &[]).await != moved {
            assert!(tokio::time::Instant::now() < deadline, "{conversation}: the other replica does not follow the move to {moved}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for _ in 0..2 {
            assert_eq!(route(&mut clients[second], &conversation, &[]).await, moved, "{conversation}: the other replica stays with the move");
            assert_eq!(route(&mut clients[first], &conversation, &[]).await, moved, "{conversation}: and so does the first");
        }
    }

    d1.shutdown().await;
    d2.shutdown().await;
    replicas.stop().await;
}

/// Two coordinator replicas over one etcd (membership and tombstones under `prefix`), and a
/// gateway-identity client of each.
struct Replicas {
    urls: Vec<String>,
    clients: Vec<CoordinatorClient<tonic::transport::Channel>>,
    stops: Vec<(tokio::sync::oneshot::Sender<()>, Serving)>,
}

/// A replica's `serve` task.
type Serving = tokio::task::JoinHandle<Result<(), baton_coordinator::Error>>;

impl Replicas {
    async fn start(etcd: &Etcd, prefix: &str, evict_departed_window: Option<Duration>) -> Replicas {
        let (mut urls, mut stops, mut clients) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..2 {
            let defaults = Config::with_defaults(plane("coordinator"));
            let config = Config {
                membership: MembershipConfig::Etcd { endpoints: vec![etcd.endpoint()], prefix: prefix.into() },
                lease_ttl: Duration::from_secs(2),
                evict_departed_window: evict_departed_window.unwrap_or(defaults.evict_departed_window),
                ..defaults
            };
            let coordinator = Coordinator::bind(config).await.unwrap();
            urls.push(format!("http://{}", coordinator.grpc_addr()));
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            stops.push((stop_tx, tokio::spawn(coordinator.serve(async move {
                let _ = stop_rx.await;
            }))));
        }
        let gateway = plane("gateway");
        for url in &urls {
            clients.push(CoordinatorClient::new(gateway.connect(&gateway.endpoint(url).unwrap(), Expect::Role(IdRole::Coordinator)).await.unwrap()));
        }
        Replicas { urls, clients, stops }
    }

    async fn stop(self) {
        for (stop, server) in self.stops {
            let _ = stop.send(());
            server.await.unwrap().unwrap();
        }
    }
}

/// A node's control service that records the conversations it was told to evict.
struct EvictLog(Arc<Mutex<Vec<String>>>);

#[tonic::async_trait]
impl NodeControl for EvictLog {
    async fn evict(&self, req: tonic::Request<EvictRequest>) -> Result<tonic::Response<EvictResponse>, tonic::Status> {
        self.0.lock().unwrap().push(format!("{}/{}", req.get_ref().owner, req.get_ref().conversation));
        Ok(tonic::Response::new(EvictResponse { blocks_freed: 1 }))
    }

    async fn drain(&self, _: tonic::Request<DrainRequest>) -> Result<tonic::Response<DrainResponse>, tonic::Status> {
        Ok(tonic::Response::new(DrainResponse::default()))
    }
}

/// Serves `NodeControl` as node `id` (its certificate, the plane's authorization); the
/// node's record pointing at it, and the evictions it receives.
async fn control_node(id: &str) -> (NodeInfo, Arc<Mutex<Vec<String>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let plane = plane(id);
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(plane.authorize())
            .add_service(NodeControlServer::new(EvictLog(log.clone())))
            .serve_with_incoming(plane.incoming(l)),
    );
    (NodeInfo { grpc_addr: addr.to_string(), ..node(id, Role::Decode) }, log)
}

/// The attack on per-replica tombstones: a decode node is cut off (its lease runs out)
/// while a conversation is deleted through replica A, then comes back through replica B
/// only. B must make it evict the deleted conversation before admitting it, as A would:
/// otherwise the node serves (and lets prefill nodes pull) the deleted conversation's
/// cached prefix. With tombstones in one replica's memory, B knew of none and admitted
/// the node with nothing evicted. Then an answer that owes nothing (through B) clears the
/// tombstone for every replica, and a tombstone nobody clears goes away after the
/// departed window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_rejoins_through_the_other_replica_evicts_what_was_deleted_while_it_was_away() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let window = Duration::from_secs(6);
    let mut replicas = Replicas::start(&etcd, "/baton-tombstones/", Some(window)).await;
    let urls = replicas.urls.clone();
    let clients = &mut replicas.clients;
    let (d1_info, d1_evicted) = control_node("d1").await;
    let (d2_info, d2_evicted) = control_node("d2").await;
    let d1 = MembershipClient::replicas(urls.clone(), d1_info.clone(), plane("d1")).spawn();
    let d2 = MembershipClient::replicas(urls.clone(), d2_info, plane("d2")).spawn();
    d1.wait_registered(1).await;
    d2.wait_registered(1).await;
    for c in clients.iter_mut() {
        wait_nodes(c, &["d1", "d2"], Duration::from_secs(5)).await;
    }

    // d1 is cut off: it stops renewing and its lease expires (its KV, in a real node,
    // would still be in memory).
    d1.abort();
    for c in clients.iter_mut() {
        wait_nodes(c, &["d2"], Duration::from_secs(8)).await;
    }

    // The conversation is deleted through replica A: d2 evicts, d1 is owed.
    let delete = || EvictConversationRequest { routing_key: "conv-x".into(), owner: "user-9".into() };
    let r = clients[0].evict_conversation(delete()).await.unwrap().into_inner();
    assert!(r.acks.iter().all(|a| a.ok), "{r:?}");
    assert_eq!(r.pending.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(), vec!["d1"]);
    assert_eq!(*d2_evicted.lock().unwrap(), vec!["user-9/conv-x"]);

    // d1 comes back through replica B only: admitted only after evicting conv-x.
    let d1 = MembershipClient::new(urls[1].clone(), d1_info.clone(), plane("d1")).spawn();
    tokio::time::timeout(Duration::from_secs(10), d1.wait_registered(1)).await.expect("d1 re-joins through B");
    assert_eq!(*d1_evicted.lock().unwrap(), vec!["user-9/conv-x"], "d1 was admitted through B without evicting the conversation deleted through A");

    // The gateway's retry (through B) finds nothing owed, which clears the tombstone for
    // both replicas: a node joining through A now owes nothing.
    wait_nodes(&mut clients[1], &["d1", "d2"], Duration::from_secs(5)).await;
    let r = clients[1].evict_conversation(delete()).await.unwrap().into_inner();
    assert!(r.acks.iter().all(|a| a.ok) && r.pending.is_empty(), "{r:?}");
    d1.abort();
    wait_nodes(&mut clients[0], &["d2"], Duration::from_secs(8)).await;
    d1_evicted.lock().unwrap().clear();
    let d1 = MembershipClient::new(urls[0].clone(), d1_info.clone(), plane("d1")).spawn();
    tokio::time::timeout(Duration::from_secs(10), d1.wait_registered(1)).await.expect("d1 re-joins through A");
    assert!(d1_evicted.lock().unwrap().is_empty(), "a cleared tombstone is owed by nobody: {:?}", d1_evicted.lock().unwrap());

    // A tombstone that is never cleared (d1 away again, nobody retries) lasts the departed
    // window, not for ever: after it, a node joining through either replica owes nothing.
    d1.abort();
    for c in clients.iter_mut() {
        wait_nodes(c, &["d2"], Duration::from_secs(8)).await;
    }
    let r = clients[0].evict_conversation(EvictConversationRequest { routing_key: "conv-y".into(), owner: "user-9".into() }).await.unwrap().into_inner();
    assert_eq!(r.pending.len(), 1, "{r:?}");
    let d1 = MembershipClient::new(urls[1].clone(), d1_info.clone(), plane("d1")).spawn();
    tokio::time::timeout(Duration::from_secs(10), d1.wait_registered(1)).await.expect("d1 re-joins through B");
    assert_eq!(*d1_evicted.lock().unwrap(), vec!["user-9/conv-y"]);
    d1.abort();
    wait_nodes(&mut clients[1], &["d2"], Duration::from_secs(8)).await;
    d1_evicted.lock().unwrap().clear();
    // Nobody retries conv-y; past the window (and the store's slack) it is gone.
    tokio::time::sleep(window + Duration::from_secs(3)).await;
    let d1 = MembershipClient::new(urls[0].clone(), d1_info, plane("d1")).spawn();
    tokio::time::timeout(Duration::from_secs(10), d1.wait_registered(1)).await.expect("d1 re-joins through A");
    assert!(d1_evicted.lock().unwrap().is_empty(), "a tombstone outlived its window: {:?}", d1_evicted.lock().unwrap());

    d1.shutdown().await;
    d2.shutdown().await;
    replicas.stop().await;
}
