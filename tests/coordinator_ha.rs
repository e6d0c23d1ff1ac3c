//! Active-active coordinators and a gateway that rides out their loss, as processes: a
//! real etcd, two `baton coordinator` replicas over it, two decode nodes given both, and
//! the gateway's cluster generator (in this process) given both.
//!
//! - One coordinator is killed (SIGKILL) under a stream of turns: no turn fails (the
//!   gateway fails over inside the turn) and every conversation keeps its decode node
//!   (each later turn starts warm there, and the surviving replica answers that node).
//! - Then the other one too: turns of the existing conversations still complete on their
//!   decode nodes, routed on the last known membership, and the gateway says it is degraded.
//! - With every coordinator down, a new decode node cannot join (it stays unready for
//!   several lease periods) until one coordinator is back on its address; then it joins
//!   and is listed, while the existing conversations' turns completed meanwhile.

mod cluster_support;

use std::time::Duration;

use baton_api_gateway::generator::cluster::{ClusterConfig, ClusterGenerator};
use baton_api_gateway::generator::{GenEvent, GenerateRequest, Generator};
use baton_proto::common::NodeId;
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::RouteDecodeRequest;
use baton_proto::plane::Plane;
use baton_text::sampling::SamplingParams;
use baton_vocab::{ConversationId, OwnerId};
use cluster_support::etcd::Etcd;
use cluster_support::{certs, channel, model_path, spawn_coordinator, Cluster};
use futures::StreamExt;

const CONVERSATIONS: usize = 4;

/// The decode node a coordinator answers for `conversation`.
async fn placed(gateway: &Plane, coordinator: &str, conversation: &str) -> String {
    let mut c = CoordinatorClient::new(channel(gateway, coordinator).await);
    let ask = RouteDecodeRequest { routing_key: conversation.into(), owner: "alice".into(), prompt_tokens: 64, exclude: Vec::<NodeId>::new() };
    c.route_decode(ask).await.unwrap().into_inner().node.unwrap().node_id.unwrap().id
}

/// One turn: the prompt grows by the reply; `Err` names why the turn failed. Returns the
/// tokens of the prompt that were already cached on the node.
async fn turn(generator: &ClusterGenerator, conversation: &str, prompt: &mut Vec<u32>, user: u32) -> Result<usize, String> {
    prompt.extend((0..8).map(|k| 2000 + user * 8 + k));
    let sampling = SamplingParams { max_tokens: 6, temperature: 0.0, ..SamplingParams::default() };
    let req = GenerateRequest {
        prompt: prompt.clone(),
        owner: OwnerId::parse("alice").unwrap(),
        platform_prefix_len: 0,
        conversation: ConversationId::parse(conversation).unwrap(),
        sampling,
    };
    let mut stream = generator.generate(req).await.map_err(|e| e.to_string())?;
    while let Some(ev) = stream.next().await {
        match ev {
            GenEvent::Token(t) => prompt.push(t.id),
            GenEvent::Finished { usage, .. } => return Ok(usage.cached_tokens),
            GenEvent::Failed(e) => return Err(e.to_string()),
        }
    }
    Err("the stream ended without an end".into())
}

/// A round: one turn of every conversation, all at once. Returns each turn's cached tokens.
async fn round(generator: &ClusterGenerator, conversations: &[String], prompts: &mut [Vec<u32>], user: u32) -> Vec<Result<usize, String>> {
    let turns = conversations.iter().zip(prompts.iter_mut()).map(|(c, p)| turn(generator, c, p, user));
    futures::future::join_all(turns).await
}

/// A series without labels in the gateway's metrics (0 if absent).
fn metric(name: &str) -> f64 {
    let text = baton_api_gateway::metrics::encode();
    let line = text.lines().find(|l| l.split_whitespace().next() == Some(name));
    line.and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

#[test]
fn losing_one_then_every_coordinator_fails_no_turn_and_moves_no_conversation() {
    let Some(model) = model_path() else { return };
    let Some(etcd) = Etcd::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(etcd.ready());
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), "decode-0,decode-1");
    let endpoint = etcd.endpoint();
    let flags = ["--membership", "etcd", "--etcd-endpoints", &endpoint, "--etcd-prefix", "/ha/", "--lease-ttl", "2s", "--local-prefill-threshold", "100000"];
    let c0 = spawn_coordinator(dir.path().to_str().unwrap(), &flags);
    let mut c1 = spawn_coordinator(dir.path().to_str().unwrap(), &flags);
    let urls = vec![format!("http://{}", c0.addr("grpc")), format!("http://{}", c1.addr("grpc"))];
    let mut cluster = Cluster { dir, model, coordinator: c0 };
    // Each node is given both replicas (`--coordinator` twice adds to the list).
    let _d0 = cluster.node("decode", "decode-0", &["--coordinator", &urls[1]]);
    let _d1 = cluster.node("decode", "decode-1", &["--coordinator", &urls[1]]);
    let gateway = cluster.plane("gateway");

    rt.block_on(async {
        let config = ClusterConfig { membership_refresh: Duration::from_millis(200), ..ClusterConfig::default() };
        let generator = ClusterGenerator::new(&urls, config, gateway.clone()).unwrap();
        let conversations: Vec<String> = (0..CONVERSATIONS).map(|i| format!("ha-conv-{i}")).collect();
        // Prompts differ from their first token, so a cached prefix is the conversation's own.
        let mut prompts: Vec<Vec<u32>> = (0..CONVERSATIONS as u32).map(|i| (0..40).map(|k| 500 + i * 50 + k).collect()).collect();

        for r in round(&generator, &conversations, &mut prompts, 0).await {
            r.expect("first turns");
        }
        // Both replicas answer the same node for every conversation.
        let mut homes = Vec::new();
        for c in &conversations {
            let home = placed(&gateway, &urls[0], c).await;
            assert_eq!(placed(&gateway, &urls[1], c).await, home, "{c}: the replicas disagree");
            homes.push(home);
        }
        assert!(generator.degraded().is_none());

        // Kill the replica the gateway prefers, while a round of turns is in flight.
        let killer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            tokio::task::spawn_blocking(move || {
                cluster.coordinator.kill9();
                cluster
            })
            .await
            .unwrap()
        });
        let mut results = round(&generator, &conversations, &mut prompts, 1).await;
        let _cluster = killer.await.unwrap();
        for user in 2..4 {
            results.extend(round(&generator, &conversations, &mut prompts, user).await);
        }
        for (i, r) in results.iter().enumerate() {
            let cached = r.as_ref().unwrap_or_else(|e| panic!("turn {i} failed with one coordinator killed: {e}"));
            assert!(*cached >= 32, "turn {i} started cold ({cached} cached tokens): its conversation left its decode node");
        }
        for (c, home) in conversations.iter().zip(&homes) {
            assert_eq!(&placed(&gateway, &urls[1], c).await, home, "{c} moved");
        }
        assert!(generator.degraded().is_none(), "one replica still answers");

        // Every coordinator down: existing conversations keep completing on their nodes.
        c1.kill9();
        for user in 4..6 {
            for (i, r) in round(&generator, &conversations, &mut prompts, user).await.into_iter().enumerate() {
                let cached = r.unwrap_or_else(|e| panic!("{}: a turn failed with every coordinator down: {e}", conversations[i]));
                assert!(cached >= 32, "{}: started cold ({cached} cached tokens) on another node", conversations[i]);
            }
        }
        let health = generator.degraded().expect("the gateway reports that it routes without a coordinator");
        assert!(health.starts_with("degraded"), "{health}");
        let degraded_turns = metric("baton_gateway_degraded_turns_total");
        assert!(degraded_turns >= (2 * CONVERSATIONS) as f64, "{degraded_turns} degraded turns counted");
        assert_eq!(metric("baton_gateway_routing_degraded"), 1.0, "the degraded gauge is not set");
    });
}

/// A coordinator on fixed loopback ports (so a restart comes back where everyone looks).
fn coordinator_at(certs_dir: &str, grpc: &str, http: &str, etcd: &str) -> cluster_support::Proc {
    cluster_support::spawn(&[
        "coordinator", "--listen", grpc, "--http-listen", http, "--certs-dir", certs_dir,
        "--membership", "etcd", "--etcd-endpoints", etcd, "--etcd-prefix", "/ha-join/", "--lease-ttl", "2s", "--local-prefill-threshold", "100000",
    ])
}

/// `GET /healthz` of a node answers 200 (it is registered).
fn healthy(http: &str) -> bool {
    matches!(baton::harness::http_get(http, "/healthz", None, Duration::from_secs(2)), Ok((200, _)))
}

#[test]
fn with_every_coordinator_down_turns_complete_but_a_new_node_joins_only_once_one_is_back() {
    let Some(model) = model_path() else { return };
    let Some(etcd) = Etcd::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(etcd.ready());
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), "decode-0,decode-1");
    let certs_dir = dir.path().to_str().unwrap().to_string();
    let port = cluster_support::etcd::free_port;
    let addrs: Vec<(String, String)> = (0..2).map(|_| (format!("127.0.0.1:{}", port()), format!("127.0.0.1:{}", port()))).collect();
    let c0 = coordinator_at(&certs_dir, &addrs[0].0, &addrs[0].1, &etcd.endpoint());
    let mut c1 = coordinator_at(&certs_dir, &addrs[1].0, &addrs[1].1, &etcd.endpoint());
    let urls: Vec<String> = addrs.iter().map(|(g, _)| format!("http://{g}")).collect();
    let mut cluster = Cluster { dir, model, coordinator: c0 };
    let _d0 = cluster.node("decode", "decode-0", &["--coordinator", &urls[1]]);
    let gateway = cluster.plane("gateway");

    rt.block_on(async {
        let config = ClusterConfig { membership_refresh: Duration::from_millis(200), ..ClusterConfig::default() };
        let generator = ClusterGenerator::new(&urls, config, gateway.clone()).unwrap();
        let conversations: Vec<String> = (0..2).map(|i| format!("join-conv-{i}")).collect();
        let mut prompts: Vec<Vec<u32>> = (0..2u32).map(|i| (0..40).map(|k| 700 + i * 50 + k).collect()).collect();
        for r in round(&generator, &conversations, &mut prompts, 0).await {
            r.expect("first turns");
        }

        // Every coordinator down.
        cluster.coordinator.kill9();
        c1.kill9();
        for user in 1..3 {
            for (i, r) in round(&generator, &conversations, &mut prompts, user).await.into_iter().enumerate() {
                r.unwrap_or_else(|e| panic!("{}: a turn failed with every coordinator down: {e}", conversations[i]));
            }
        }
        assert!(generator.degraded().is_some(), "the gateway routes degraded");
    });

    // A new node started now cannot join: it stays unready (no lease), for several
    // lease periods.
    let d1 = {
        let mut args = vec!["decode", "--name", "decode-1", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0"];
        let owned = [cluster.model.to_str().unwrap().to_string(), certs_dir.clone(), urls.join(",")];
        args.extend(["--model", &owned[0], "--certs-dir", &owned[1], "--coordinator", &owned[2]]);
        args.extend(["--threads", "1", "--kv-memory-mib", "64", "--kv-tier2-mib", "0", "--kv-staging-mib", "32", "--max-context", "2048"]);
        cluster_support::spawn(&args)
    };
    let d1_http = d1.addr("http");
    let until = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < until {
        assert!(!healthy(&d1_http), "decode-1 became ready with no coordinator up");
        std::thread::sleep(Duration::from_millis(200));
    }

    // One coordinator back (same address): decode-1 joins, and the coordinator lists it.
    let _c0 = coordinator_at(&certs_dir, &addrs[0].0, &addrs[0].1, &etcd.endpoint());
    cluster_support::wait_healthy(&d1_http, Duration::from_secs(30));
    rt.block_on(async {
        let mut c = CoordinatorClient::new(channel(&gateway, &urls[0]).await);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let nodes = c.list_nodes(baton_proto::coordinator::ListNodesRequest { role: 0 }).await.unwrap().into_inner().nodes;
            if nodes.iter().any(|n| n.node_id.as_ref().map(|i| i.id.as_str()) == Some("decode-1")) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "decode-1 is not listed: {nodes:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
