//! The topology of `deploy/docker/compose.yaml` as plain processes on loopback:
//! etcd, a coordinator with etcd membership, two prefill nodes, two decode
//! nodes and the gateway in front of them. A multi-turn conversation runs
//! through the gateway; then a rolling restart of the conversation's decode
//! node (drain, stop, start again under the same name) must keep every next
//! turn warm: on the interim owner (the drain pushed the KV there) and back on
//! the restarted home (it pulls the KV from the interim owner). A decode node
//! killed outright must not fail the next turn: the gateway routes around it.

mod cluster_support;

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::RouteDecodeRequest;
use cluster_support::etcd::{free_port, Etcd};
use baton_proto::plane::Plane;
use cluster_support::*;

/// Tails of at least this many tokens go to a prefill node.
const THRESHOLD: usize = 48;

/// A child process killed on drop (the gateway prints no address line).
struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn baton(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(args).output().unwrap();
    assert!(out.status.success(), "baton {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn start_gateway(db: &Path, model: &Path, coordinator: &str, certs_dir: &str) -> (Gateway, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let child = gateway_command(&["--listen", &addr], coordinator, certs_dir, db, model).spawn().unwrap();
    let g = Gateway(child);
    wait_healthy(&addr, Duration::from_secs(60));
    (g, addr)
}

async fn owner_of(gateway: &Plane, coordinator: &str, conversation: &str) -> String {
    let mut c = CoordinatorClient::new(channel(gateway, coordinator).await);
    let ask = RouteDecodeRequest { routing_key: conversation.into(), owner: "alice".into(), prompt_tokens: 1, exclude: vec![] };
    c.route_decode(ask).await.unwrap().into_inner().node.unwrap().node_id.unwrap().id
}

/// One turn through the conversations API (not streamed); returns (prompt, cached, reply).
async fn turn(http: &reqwest::Client, gateway: &str, key: &str, conv: &str, message: &str) -> (u64, u64, String) {
    let body = serde_json::json!({"message": message, "max_tokens": 16, "temperature": 0, "stream": false});
    let r = http.post(format!("http://{gateway}/v1/conversations/{conv}/turns")).bearer_auth(key).json(&body).send().await.unwrap();
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(status.is_success(), "turn failed: {status} {v}");
    let u = &v["usage"];
    (u["prompt_tokens"].as_u64().unwrap(), u["cached_tokens"].as_u64().unwrap(), v["reply"].as_str().unwrap_or_default().to_string())
}

#[test]
fn compose_topology_keeps_a_conversation_warm_across_a_rolling_restart() {
    let Some(model) = model_path() else { return };
    let Some(etcd) = Etcd::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(etcd.ready());

    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), "prefill-0,prefill-1,decode-0,decode-1");
    let (endpoint, threshold) = (etcd.endpoint(), THRESHOLD.to_string());
    let coordinator = spawn_coordinator(
        dir.path().to_str().unwrap(),
        &["--membership", "etcd", "--etcd-endpoints", &endpoint, "--etcd-prefix", "/topology/", "--lease-ttl", "2s", "--local-prefill-threshold", &threshold],
    );
    let cluster = Cluster { dir, model: model.clone(), coordinator };
    let url = cluster.url();
    let _p0 = cluster.node("prefill", "prefill-0", &[]);
    let _p1 = cluster.node("prefill", "prefill-1", &[]);
    let mut decodes = vec![cluster.node("decode", "decode-0", &[]), cluster.node("decode", "decode-1", &[])];

    let db = cluster.dir.path().join("gateway.db");
    let key = baton(&["keys", "--db", db.to_str().unwrap(), "create", "--user", "alice"]).trim().to_string();
    let (_gateway, gateway) = start_gateway(&db, &model, &url, cluster.certs_dir());
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();

    rt.block_on(async {
        let created: serde_json::Value =
            http.post(format!("http://{gateway}/v1/conversations")).bearer_auth(&key).json(&serde_json::json!({"title": "rivers"})).send().await.unwrap().json().await.unwrap();
        let conv = created["id"].as_str().unwrap().to_string();

        // Three turns: the first prompt is long enough for a prefill node; each next
        // turn reuses the conversation's prefix on its decode node.
        turn(&http, &gateway, &key, &conv, "Tell me about the Danube: where it rises, which capitals it passes and where it meets the sea.").await;
        let (_, cached2, _) = turn(&http, &gateway, &key, &conv, "And the Rhine?").await;
        assert!(cached2 > 0, "turn 2 reuses turn 1's prefix");
        let (prompt3, cached3, reply3) = turn(&http, &gateway, &key, &conv, "Which of the two is longer?").await;
        assert!(cached3 > cached2, "turn 3 reuses turns 1 and 2");
        assert!(!reply3.is_empty());

        // Rolling restart of the conversation's decode node, as a StatefulSet
        // does it: drain (the preStop hook), stop, start again under the same name.
        let home = owner_of(&cluster.plane("gateway"), &url, &conv).await;
        let i = decodes.iter().position(|p| p.addr("kv").starts_with(&format!("{home}@"))).expect("the home node is one of ours");
        let report = baton(&["drain", "--node", &decodes[i].addr("grpc"), "--timeout", "30s", "--certs-dir", cluster.certs_dir(), "--tls-name", "operator"]);
        assert!(report.contains("conversations_moved=1"), "{report}");
        decodes.remove(i).kill9();

        // Turn 4 lands on the other node and starts warm: everything up to turn 3's
        // reply was pushed there by the drain, though that node never served it.
        let (prompt4, cached4, reply4) = turn(&http, &gateway, &key, &conv, "Thanks. One more fact about the Rhine, please.").await;
        let interim = owner_of(&cluster.plane("gateway"), &url, &conv).await;
        assert_ne!(interim, home);
        assert!(cached4 + 32 >= prompt3, "turn 4 starts warm on {interim}: cached {cached4}, turn 3's prompt was {prompt3}");
        assert!(!reply4.is_empty());

        // The restarted node is the conversation's ring home again: the conversation
        // moves back, and its first turn there pulls the warm prefix from the interim owner.
        decodes.push(cluster.node("decode", &home, &[]));
        let (_, cached5, _) = turn(&http, &gateway, &key, &conv, "Where does the Rhine reach the sea?").await;
        assert_eq!(owner_of(&cluster.plane("gateway"), &url, &conv).await, home);
        assert!(cached5 + 32 >= prompt4, "turn 5 starts warm back on {home}: cached {cached5}, turn 4's prompt was {prompt4}");

        // The home node now dies outright (no drain): the next turn still
        // completes, on the live node.
        let j = decodes.iter().position(|p| p.addr("kv").starts_with(&format!("{home}@"))).unwrap();
        decodes.remove(j).kill9();
        let (_, _, reply6) = turn(&http, &gateway, &key, &conv, "Summarise both rivers in one sentence.").await;
        assert!(!reply6.is_empty());
        let survivor = decodes[0].addr("grpc");
        let operator = cluster.plane("operator");
        assert_no_leaks(|| {
            let (s, op) = (survivor.clone(), operator.clone());
            Box::pin(async move { decode_stats(&op, &s).await })
        })
        .await;
    });
}
