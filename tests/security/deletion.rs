//! Deletion that no node can survive (docs/SECURITY.md, "Deletion"), against real
//! processes: a coordinator, two decode nodes and the gateway in front of them.
//!
//! The attack is patience: a user's conversation is cached on a node, the node drops
//! off the network (SIGSTOP: its lease expires, its KV stays in memory, as in a
//! partition), the user deletes the conversation, and the node comes back. Had the node
//! kept the deleted conversation's blocks, the same user's next conversation with the
//! same words would be served from them. It must not be: the gateway keeps a tombstone
//! (visible in /metrics) and retries, and the node evicts every tombstoned conversation
//! before the coordinator admits it again.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use baton_proto::coordinator as cpb;
use baton_proto::coordinator::coordinator_client::CoordinatorClient;

use crate::cluster_support::*;

/// Long enough to fill several KV blocks beyond the platform prefix.
const MESSAGE: &str = "Please describe, step by step and in plain words, how a river carves a canyon over \
     millions of years, which rocks resist the longest, why meanders form on flat plains, and what \
     happens to the sediment once it finally reaches the sea.";

/// The gateway process (it prints no address line); killed on drop.
pub(crate) struct Gateway(std::process::Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn baton(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(args).output().unwrap();
    assert!(out.status.success(), "baton {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A gateway process with `extra` flags: its API address and its admin listener (/metrics).
pub(crate) fn start_gateway(db: &Path, model: &Path, coordinator: &str, certs_dir: &str, extra: &[&str]) -> (Gateway, String, String) {
    let free = || format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let (addr, admin) = (free(), free());
    let child = gateway_command(&["--listen", &addr, "--admin-listen", &admin], coordinator, certs_dir, db, model)
        .args(["--evict-retry-min", "200ms", "--evict-retry-max", "1s"])
        .args(extra)
        .env("BATON_LOG", std::env::var("BATON_LOG").unwrap_or_else(|_| "warn".into()))
        .spawn()
        .unwrap();
    let g = Gateway(child);
    wait_healthy(&addr, Duration::from_secs(60));
    (g, addr, admin)
}

/// SIGSTOP or SIGCONT.
fn signal(p: &Proc, sig: &str) {
    let st = Command::new("kill").args([sig, &p.child.id().to_string()]).status().unwrap();
    assert!(st.success(), "kill {sig}");
}

/// The sum of a metric's series in the /metrics of `http` whose labels include `labels`
/// (each `name="value"`); 0 when there is none.
fn metric(http: &str, name: &str, labels: &[&str]) -> f64 {
    metrics(http)
        .lines()
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ' | b'{')))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .fold(0.0, |a, b| a + b)
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn members(cluster: &Cluster) -> Vec<String> {
    let mut c = CoordinatorClient::new(channel(&cluster.plane("operator"), &cluster.url()).await);
    let nodes = c.list_nodes(cpb::ListNodesRequest { role: 0 }).await.unwrap().into_inner().nodes;
    nodes.into_iter().filter_map(|n| n.node_id.map(|i| i.id)).collect()
}

async fn wait_members(cluster: &Cluster, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = members(cluster).await;
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "members {now:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The decode node a conversation lives on.
async fn home_of(cluster: &Cluster, conversation: &str) -> String {
    let mut c = CoordinatorClient::new(channel(&cluster.plane("gateway"), &cluster.url()).await);
    let ask = cpb::RouteDecodeRequest { routing_key: conversation.into(), owner: String::new(), prompt_tokens: 1, exclude: vec![] };
    c.route_decode(ask).await.unwrap().into_inner().node.unwrap().node_id.unwrap().id
}

async fn create(http: &reqwest::Client, gateway: &str, key: &str) -> String {
    let r = http.post(format!("http://{gateway}/v1/conversations")).bearer_auth(key).json(&serde_json::json!({})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    r.json::<serde_json::Value>().await.unwrap()["id"].as_str().unwrap().to_string()
}

/// One turn (not streamed); (prompt tokens, cached tokens).
async fn turn(http: &reqwest::Client, gateway: &str, key: &str, conversation: &str) -> (u64, u64) {
    let body = serde_json::json!({"message": MESSAGE, "max_tokens": 4, "temperature": 0, "stream": false});
    let r = http.post(format!("http://{gateway}/v1/conversations/{conversation}/turns")).bearer_auth(key).json(&body).send().await.unwrap();
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(status.is_success(), "turn failed: {status} {v}");
    (v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["cached_tokens"].as_u64().unwrap())
}

#[test]
fn a_node_away_during_a_delete_evicts_the_conversation_before_it_serves_again() {
    let Some(cluster) = Cluster::start("decode-0,decode-1", 512) else { return };
    let d0 = cluster.node("decode", "decode-0", &[]);
    let d1 = cluster.node("decode", "decode-1", &[]);
    let db = cluster.dir.path().join("gateway.db");
    let db_arg = db.to_str().unwrap();
    let alice = baton(&["keys", "--db", db_arg, "create", "--user", "alice"]);
    let bob = baton(&["keys", "--db", db_arg, "create", "--user", "bob"]);
    let (_gateway, gw, gw_admin) = start_gateway(&db, &cluster.model, &cluster.url(), cluster.certs_dir(), &[]);
    let tombstones = || metric(&gw_admin, "baton_gateway_eviction_tombstones", &[]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();

    // The victim: alice's conversation, warm on the node that served it.
    let doomed = rt.block_on(create(&http, &gw, &alice));
    rt.block_on(turn(&http, &gw, &alice, &doomed));
    let home = rt.block_on(home_of(&cluster, &doomed));
    let (away, other) = if home == "decode-0" { (&d0, d1) } else { (&d1, d0) };
    let other_name = if home == "decode-0" { "decode-1" } else { "decode-0" };
    let operator = cluster.plane("operator");
    let cached_blocks = || {
        rt.block_on(async {
            loop {
                let st = decode_stats(&operator, &away.addr("grpc")).await;
                if st.running == 0 && st.kv_blocks_used == 0 {
                    return st.kv_blocks_cached;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let warm = cached_blocks();
    assert!(warm > 0, "the conversation is cached on {home}");

    // The node drops off the network with the KV in memory; its lease runs out.
    signal(away, "-STOP");
    rt.block_on(wait_members(&cluster, &[other_name]));

    // The delete: the text goes at once; the KV is owed by the absent node, so the
    // answer is 202 and the tombstone is pending.
    let url = format!("http://{gw}/v1/conversations/{doomed}");
    let (status, body) = rt.block_on(async {
        let r = http.delete(&url).bearer_auth(&alice).send().await.unwrap();
        (r.status(), r.json::<serde_json::Value>().await.unwrap())
    });
    assert_eq!(status, 202, "the KV is not evicted everywhere yet: {body}");
    assert_eq!((body["deleted"].as_bool(), body["kv_evicted"].as_bool()), (Some(true), Some(false)), "{body}");
    let gone = rt.block_on(async { http.get(&url).bearer_auth(&alice).send().await.unwrap().status() });
    assert_eq!(gone, 404, "the conversation's text is deleted at once");
    assert_eq!(tombstones(), 1.0);
    // Retries run and keep the tombstone while the node is away.
    wait_for("a retry", Duration::from_secs(10), || {
        metric(&gw_admin, "baton_gateway_eviction_attempts_total", &["result=\"owed\"", "when=\"retry\""]) >= 1.0
    });
    assert_eq!(tombstones(), 1.0, "still owed by the absent node");

    // The node comes back: it re-registers, and the coordinator has it evict the
    // tombstoned conversation before admitting it; the next retry finds nothing owed.
    let coordinator_http = cluster.coordinator.addr("http");
    let joins = |result: &str| metric(&coordinator_http, "baton_coordinator_join_evictions_total", &[&format!("result=\"{result}\"")]);
    assert_eq!(joins("ok"), 0.0);
    signal(away, "-CONT");
    rt.block_on(wait_members(&cluster, &["decode-0", "decode-1"]));
    assert_eq!(joins("ok"), 1.0, "{home} evicted the tombstoned conversation while joining");
    let left = cached_blocks();
    assert!(left < warm, "{home} still caches {left} of {warm} blocks");
    wait_for("the tombstone to clear", Duration::from_secs(20), || tombstones() == 0.0);

    // Only the returned node serves from here on.
    drop(other);
    rt.block_on(wait_members(&cluster, &[home.as_str()]));
    // Bob's turn with the same words: only the platform prefix (the system prompt) is
    // shared, so this is what any user may find cached.
    let bobs = rt.block_on(create(&http, &gw, &bob));
    let (_, platform_cached) = rt.block_on(turn(&http, &gw, &bob, &bobs));
    // Alice again, same words, new conversation: nothing of the deleted one is left.
    let again = rt.block_on(create(&http, &gw, &alice));
    let (prompt, cached) = rt.block_on(turn(&http, &gw, &alice, &again));
    assert!(prompt >= platform_cached + 48, "the message spans blocks of its own: prompt {prompt}, platform {platform_cached}");
    assert_eq!(cached, platform_cached, "alice's new conversation hit the deleted conversation's blocks on {home}");
    assert!(metric(&gw_admin, "baton_gateway_eviction_acks_total", &[]) >= 2.0, "the live node's ack, then both");
}
