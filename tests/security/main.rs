//! The attacks of the security issues (the internal plane's, and #39's from a stolen
//! node certificate or an anonymous client), each run against real processes or a real
//! gateway on loopback sockets; each must fail. docs/SECURITY.md, "Attacks and their
//! tests", names the test of every attack, here or where its code lives.
//!
//! Here, against real `baton` processes:
//! - a plaintext client, and a client whose certificate another CA signed, get no answer;
//! - a certificate without a role, or with the wrong role, cannot call a method its role
//!   is not granted (docs/SECURITY.md's table, row by row: [`every_row_of_the_table`]);
//! - a node cannot register, renew or leave under another node's name (fake registration);
//! - a decode node cannot steer a conversation to itself through `RouteDecode`'s exclude;
//! - a decode node cannot have another adopt a conversation it never held (`AdoptPrefix`
//!   needs the coordinator's `VouchAdoption`), nor answer a moved conversation's pull in
//!   the place of the node the coordinator named;
//! - only the gateway may say whose turn it is (owner spoofing on Generate, CachedPrefix,
//!   ExportPrefix from any other role);
//! - a server with the wrong identity is not trusted by a client (impersonation);
//! - connections that never finish their handshake do not keep a real caller out;
//! - refused connections and calls are counted in the serving role's `/metrics`;
//! - the coordinator's `/debug/routing` and the gateway's `/metrics` answer only to the
//!   admin key (the gateway's admin listener is the private way in);
//! - a node away while a conversation is deleted does not keep its KV ([`deletion`]).
//!
//! Against a real gateway in this process:
//! - anonymous and wrong-key floods, forged `X-Forwarded-For`, `logprobs` exfiltration,
//!   framing, secrets in `--help` ([`client_attacks`]);
//! - 10,000 half-open connections from 100 addresses ([`gateway_flood`]).

#[path = "../cluster_support/mod.rs"]
mod cluster_support;
// The gateway tests' start-up (a gateway on loopback over the real engine), and the
// throwaway PostgreSQL server it may use.
#[path = "../gateway/common.rs"]
mod common;
#[path = "../../api-gateway/tests/pg/mod.rs"]
mod pg;
// The exfiltration corpus, shared with api-gateway/tests/exfiltration_corpus.rs.
#[path = "../../api-gateway/tests/corpus/mod.rs"]
mod corpus;

mod client_attacks;
mod deletion;
mod gateway_flood;

use std::time::{Duration, Instant};

use baton_proto::common::{NodeId, NodeInfo, Role};
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator as cpb;
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::node_control_client::NodeControlClient;
use baton_proto::plane::authz::{Allow, RULES};
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use cluster_support::*;
use tonic::transport::Channel;
use tonic::Code;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Every identity the attacks use: the cluster's own, a node of each role, and a
/// certificate with no role (signed by the cluster CA all the same).
const IDENTITIES: &str = "prefill-0,decode-0,decode-1,kv-only";

/// A channel to `addr` as `plane`, trusting any server of the cluster CA.
async fn dial(plane: &Plane, addr: &str) -> Result<Channel, tonic::transport::Error> {
    let any = Expect::OneOf(vec![IdRole::Coordinator, IdRole::Decode, IdRole::Prefill]);
    plane.connect(&plane.endpoint(addr).unwrap().connect_timeout(Duration::from_secs(3)), any).await
}

fn decode_info(name: &str) -> NodeInfo {
    NodeInfo {
        node_id: Some(NodeId { id: name.into() }),
        role: Role::Decode as i32,
        grpc_addr: "127.0.0.1:9".into(),
        kv_endpoint: format!("{name}@127.0.0.1:9"),
        block_tokens: 16,
        kv_blocks_total: 1000,
        load: None,
        identity_key: Vec::new(),
    }
}

#[test]
fn a_plaintext_client_and_a_foreign_ca_get_no_answer() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let rt = runtime();
    let url = cluster.url();
    rt.block_on(async {
        // Plaintext: the server speaks TLS only.
        let plain = Plane::insecure_plaintext();
        let r = match dial(&plain, &url).await {
            Err(_) => None,
            Ok(ch) => Some(CoordinatorClient::new(ch).list_nodes(cpb::ListNodesRequest { role: 0 }).await),
        };
        assert!(!matches!(r, Some(Ok(_))), "a plaintext ListNodes was answered: {r:?}");
        // A certificate from another CA, naming a gateway.
        let foreign = baton_kv_transport::generate_dev_certs("evil", &["gateway"]).unwrap();
        let evil = Plane::mtls(foreign.node_tls("gateway").unwrap()).unwrap();
        assert!(dial(&evil, &url).await.is_err(), "a foreign CA's certificate completed a handshake");
        // A certificate from the cluster CA that names no role gets no call through.
        let kv_only = Plane::mtls(baton_kv_transport::NodeTls::from_dir(cluster.dir.path(), "kv-only").unwrap());
        assert!(kv_only.is_err(), "a role-less certificate is not a plane identity");
    });
    // Both failed handshakes are in the coordinator's metrics. The server counts a
    // refusal when its side of the handshake ends, which can be after the client gave up,
    // so the count is read until it arrives (or the deadline says it never will).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = metrics(&cluster.coordinator.addr("http"));
        let refused = sample(&text, "baton_plane_connections_refused_total{reason=\"handshake\"}");
        if refused >= 2.0 {
            break;
        }
        assert!(Instant::now() < deadline, "refused handshakes counted: {refused}\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of the sample `series` (name and labels, as printed) in a Prometheus text.
fn sample(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

/// `GET path` on `addr` with an optional bearer token: the status and body.
fn http_get(addr: &str, path: &str, bearer: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let auth = bearer.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

#[test]
fn gateway_metrics_answer_only_the_admin_key_or_the_admin_listener() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    const KEY: &str = "security-test-gateway-admin-key";
    let key_file = cluster.dir.path().join("gateway-admin-key");
    std::fs::write(&key_file, KEY).unwrap();
    let db = cluster.dir.path().join("metrics.db");
    let user_key = deletion::baton(&["keys", "--db", db.to_str().unwrap(), "create", "--user", "carol"]);
    let flags = ["--admin-key-file", key_file.to_str().unwrap()];
    let (_gateway, api, admin) = deletion::start_gateway(&db, &cluster.model, &cluster.url(), cluster.certs_dir(), &flags);
    for bearer in [None, Some(user_key.as_str()), Some("security-test-gateway-admin-kez")] {
        let (status, body) = http_get(&api, "/metrics", bearer);
        assert_eq!(status, 401, "{bearer:?}: {body}");
        assert!(!body.contains("baton_gateway_"), "{body}");
    }
    let (status, body) = http_get(&api, "/metrics", Some(KEY));
    assert_eq!((status, body.contains("baton_gateway_")), (200, true), "{body}");
    let (status, body) = http_get(&admin, "/metrics", None);
    assert_eq!((status, body.contains("baton_gateway_")), (200, true), "{body}");
}

#[test]
fn debug_routing_answers_only_the_admin_key() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    // The cluster's coordinator has no admin key: the endpoint is off for everyone.
    let (status, body) = http_get(&cluster.coordinator.addr("http"), "/debug/routing?key=conv-a", None);
    assert_eq!(status, 403, "{body}");
    // A coordinator with one: no key, a wrong key, then the key.
    const KEY: &str = "security-test-admin-key-0123";
    let key_file = cluster.dir.path().join("admin-key");
    std::fs::write(&key_file, KEY).unwrap();
    let co = spawn(&[
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--certs-dir",
        cluster.certs_dir(),
        "--admin-key-file",
        key_file.to_str().unwrap(),
    ]);
    let http = co.addr("http");
    for bearer in [None, Some("security-test-admin-key-0124"), Some("")] {
        let (status, body) = http_get(&http, "/debug/routing?key=conv-a", bearer);
        assert_eq!(status, 401, "{bearer:?}: {body}");
        assert!(!body.contains("records"), "{body}");
    }
    let (status, body) = http_get(&http, "/debug/routing?key=conv-a", Some(KEY));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"records\""), "{body}");
}

#[test]
fn fake_registration_and_someone_elses_lease_are_refused() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let rt = runtime();
    let url = cluster.url();
    rt.block_on(async {
        let register = |who: &'static str, info: NodeInfo| {
            let plane = cluster.plane(who);
            let url = url.clone();
            async move {
                let mut c = CoordinatorClient::new(dial(&plane, &url).await.unwrap());
                c.register(cpb::RegisterRequest { node: Some(info) }).await
            }
        };
        // A gateway, or a decode node under another decode node's name, or as a prefill node.
        assert_eq!(register("gateway", decode_info("decode-0")).await.unwrap_err().code(), Code::PermissionDenied);
        assert_eq!(register("decode-1", decode_info("decode-0")).await.unwrap_err().code(), Code::PermissionDenied);
        let mut as_prefill = decode_info("decode-1");
        as_prefill.role = Role::Prefill as i32;
        assert_eq!(register("decode-1", as_prefill).await.unwrap_err().code(), Code::PermissionDenied);
        // Its own name: accepted.
        let lease = register("decode-0", decode_info("decode-0")).await.unwrap().into_inner().lease_id;

        // decode-1 may not renew or drop decode-0's lease, nor report load under its name.
        let mut c1 = CoordinatorClient::new(dial(&cluster.plane("decode-1"), &url).await.unwrap());
        let renew = cpb::KeepAliveRequest { lease_id: lease, node_id: Some(NodeId { id: "decode-1".into() }), load: None };
        assert_eq!(c1.keep_alive(renew).await.unwrap_err().code(), Code::PermissionDenied);
        let drop = cpb::DeregisterRequest { lease_id: lease, node_id: Some(NodeId { id: "decode-0".into() }) };
        assert_eq!(c1.deregister(drop.clone()).await.unwrap_err().code(), Code::PermissionDenied);
        // The real node still holds it, and may release it.
        let mut op = CoordinatorClient::new(dial(&cluster.plane("operator"), &url).await.unwrap());
        let ids: Vec<String> = op.list_nodes(cpb::ListNodesRequest { role: 0 }).await.unwrap().into_inner().nodes.into_iter().filter_map(|n| n.node_id.map(|i| i.id)).collect();
        assert_eq!(ids, vec!["decode-0".to_string()]);
        let mut c0 = CoordinatorClient::new(dial(&cluster.plane("decode-0"), &url).await.unwrap());
        assert!(c0.deregister(drop).await.unwrap().into_inner().removed);
    });
}

/// Issue #39, item 3: `RouteDecode` is open to decode nodes (a draining node asks where
/// its conversations go), and it honoured the caller's `exclude`: a node could exclude
/// every other node and so steer a conversation it knows to itself.
#[test]
fn a_decode_node_cannot_steer_a_conversation_to_itself() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let rt = runtime();
    let url = cluster.url();
    rt.block_on(async {
        for name in ["decode-0", "decode-1"] {
            let mut c = CoordinatorClient::new(dial(&cluster.plane(name), &url).await.unwrap());
            c.register(cpb::RegisterRequest { node: Some(decode_info(name)) }).await.unwrap();
        }
        let ask = |exclude: &[&str]| cpb::RouteDecodeRequest {
            routing_key: "conv-of-a-victim".into(),
            owner: "alice".into(),
            prompt_tokens: 10,
            exclude: exclude.iter().map(|n| NodeId { id: n.to_string() }).collect(),
        };
        let home = |r: cpb::RouteDecodeResponse| r.node.and_then(|n| n.node_id).map(|i| i.id).unwrap();
        let mut attacker = CoordinatorClient::new(dial(&cluster.plane("decode-1"), &url).await.unwrap());
        let e = attacker.route_decode(ask(&["decode-0"])).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        // Excluding itself (a drain) is what a decode node may do.
        assert_eq!(home(attacker.route_decode(ask(&["decode-1"])).await.unwrap().into_inner()), "decode-0");
        // The gateway's exclude (a node that just failed the turn) stands as sent.
        let mut gateway = CoordinatorClient::new(dial(&cluster.plane("gateway"), &url).await.unwrap());
        assert_eq!(home(gateway.route_decode(ask(&["decode-0"])).await.unwrap().into_inner()), "decode-1");
    });
}

/// Issue #39, "imported KV is never trusted more than its source": a decode identity
/// that never held a conversation asks another decode node to adopt it, from itself,
/// under an owner it names (KV it made up, planted in that owner's scope). Only the
/// coordinator's word counts (`VouchAdoption`: the gateway routed the conversation for
/// that owner, the source held it, the adopter is its node now): refused, nothing
/// published.
#[test]
fn a_decode_node_cannot_have_another_adopt_a_conversation_it_never_held() {
    let Some(cluster) = Cluster::start(IDENTITIES, 100_000) else { return };
    let d0 = cluster.node("decode", "decode-0", &[]);
    let d1 = cluster.node("decode", "decode-1", &[]);
    let rt = runtime();
    rt.block_on(async {
        // The gateway routes alice's conversation: the coordinator knows it as alice's.
        let mut gateway = CoordinatorClient::new(dial(&cluster.plane("gateway"), &cluster.url()).await.unwrap());
        let ask = cpb::RouteDecodeRequest { routing_key: "conv-v".into(), owner: "alice".into(), prompt_tokens: 100, exclude: vec![] };
        let home = gateway.route_decode(ask).await.unwrap().into_inner().node.unwrap().node_id.unwrap().id;
        let ((victim, _), (attacker, attacker_name)) =
            if home == "decode-0" { ((&d0, "decode-0"), (&d1, "decode-1")) } else { ((&d1, "decode-1"), (&d0, "decode-0")) };
        // The attacker's node holds KV under alice's scope (here a turn of another
        // conversation; a stolen node could compute anything).
        let prompt: Vec<u32> = (0..100).map(|i| 1000 + 7 * i).collect();
        generate(cluster.plane("gateway"), attacker.addr("grpc"), generate_request(&prompt, "alice", "conv-forged", 1)).await;
        let peek = pb::CachedPrefixRequest { tokens: prompt.clone(), owner: "alice".into(), platform_prefix_len: 0 };
        let mut on_attacker = DecodeNodeClient::new(dial(&cluster.plane("decode-1"), &attacker.addr("grpc")).await.unwrap());
        assert!(on_attacker.cached_prefix(peek.clone()).await.unwrap().into_inner().cached_tokens >= 64, "the forged KV is there to pull");

        let adopt = pb::AdoptPrefixRequest {
            turn: Some(pb::Turn { prompt: prompt.clone(), owner: "alice".into(), platform_prefix_len: 0, conversation: "conv-v".into() }),
            source: attacker.addr("grpc"),
        };
        let mut c = DecodeNodeClient::new(dial(&cluster.plane(attacker_name), &victim.addr("grpc")).await.unwrap());
        let e = c.adopt_prefix(adopt).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let mut on_victim = DecodeNodeClient::new(dial(&cluster.plane(attacker_name), &victim.addr("grpc")).await.unwrap());
        assert_eq!(on_victim.cached_prefix(peek).await.unwrap().into_inner().cached_tokens, 0, "nothing published under alice");
    });
}

/// Issue #39, the same rule for a conversation that moved on a join: its first turn on
/// the new node pulls the warm prefix from the previous node the coordinator named
/// (`GenerateRequest.prefix_source`, relayed by the gateway), and only from the node whose
/// certificate bears that name: another decode node answering at that address (one that
/// took over the address) is not pulled from.
#[test]
fn a_moved_conversation_pulls_only_from_the_node_the_coordinator_named() {
    let Some(cluster) = Cluster::start(IDENTITIES, 100_000) else { return };
    let d0 = cluster.node("decode", "decode-0", &[]);
    let d1 = cluster.node("decode", "decode-1", &[]);
    let rt = runtime();
    rt.block_on(async {
        let turn = |prompt: &[u32], conversation: &str, source: &str| {
            let mut req = generate_request(prompt, "alice", conversation, 1);
            req.prefix_source = d1.addr("grpc");
            req.prefix_source_node = source.into();
            req
        };
        // decode-1 holds KV under alice's scope for both prompts.
        let forged: Vec<u32> = (0..100).map(|i| 1000 + 7 * i).collect();
        let named: Vec<u32> = (0..100).map(|i| 2000 + 5 * i).collect();
        for p in [&forged, &named] {
            generate(cluster.plane("gateway"), d1.addr("grpc"), generate_request(p, "alice", "conv-x", 1)).await;
        }
        // The coordinator named decode-2, at the address where decode-1 answers.
        let (_, fin) = generate(cluster.plane("gateway"), d0.addr("grpc"), turn(&forged, "conv-v", "decode-2")).await;
        assert_eq!(fin.usage.unwrap().cached_tokens, 0, "pulled from a node the coordinator did not name");
        // Named rightly, the pull is taken.
        let (_, fin) = generate(cluster.plane("gateway"), d0.addr("grpc"), turn(&named, "conv-w", "decode-1")).await;
        assert!(fin.usage.unwrap().cached_tokens >= 64, "the named node's prefix is pulled");
    });
}

/// Calls `method` as `who` with an empty request; the status code only.
async fn call_as(cluster: &Cluster, who: &str, addr: &str, method: &str) -> Code {
    let channel = dial(&cluster.plane(who), addr).await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let path = method.parse().unwrap();
    match grpc.unary(tonic::Request::new(()), path, codec).await {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Each row of the authorization table, against the real server that serves it: every
/// role the row does not grant is refused with PermissionDenied before the handler runs;
/// a granted role gets past the check (whatever the handler then says of an empty
/// request, it is not PermissionDenied).
#[test]
fn every_row_of_the_table() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let prefill = cluster.node("prefill", "prefill-0", &[]);
    let decode = cluster.node("decode", "decode-0", &[]);
    let rt = runtime();
    let who_is = [("gateway", IdRole::Gateway), ("coordinator", IdRole::Coordinator), ("prefill-0", IdRole::Prefill), ("decode-1", IdRole::Decode), ("operator", IdRole::Operator)];
    rt.block_on(async {
        for rule in RULES {
            let addr = match rule.method.split('/').nth(1).unwrap() {
                "baton.coordinator.Coordinator" => cluster.url(),
                "baton.node.PrefillNode" => prefill.addr("grpc"),
                // NodeControl is served by both node kinds; the decode node's answers here.
                _ => decode.addr("grpc"),
            };
            for (who, role) in who_is {
                // Drain and Deregister would change the cluster under the other rows.
                if rule.method.ends_with("/Drain") || rule.method.ends_with("/Deregister") {
                    continue;
                }
                let granted = rule.allow.contains(&Allow::Role(role));
                let code = call_as(&cluster, who, &addr, rule.method).await;
                if granted {
                    assert_ne!(code, Code::PermissionDenied, "{who} ({role}) is granted {}", rule.method);
                } else {
                    assert_eq!(code, Code::PermissionDenied, "{who} ({role}) called {}", rule.method);
                }
            }
        }
        // Drain and Deregister: refused to every role they do not grant.
        for (who, _) in who_is.iter().filter(|(_, r)| !matches!(r, IdRole::Coordinator | IdRole::Operator)) {
            assert_eq!(call_as(&cluster, who, &decode.addr("grpc"), "/baton.node.NodeControl/Drain").await, Code::PermissionDenied, "{who} drained");
        }
        for who in ["gateway", "coordinator", "operator"] {
            assert_eq!(call_as(&cluster, who, &cluster.url(), "/baton.coordinator.Coordinator/Deregister").await, Code::PermissionDenied, "{who}");
        }
        // Owner spoofing: no role but the gateway may name a turn's owner to the decode node.
        let spoof = generate_request(&[1, 2, 3, 4], "alice", "conv-a", 1);
        for who in ["prefill-0", "decode-1", "coordinator", "operator"] {
            let mut c = DecodeNodeClient::new(dial(&cluster.plane(who), &decode.addr("grpc")).await.unwrap());
            let code = c.generate(spoof.clone()).await.map(|_| ()).unwrap_err().code();
            assert_eq!(code, Code::PermissionDenied, "{who} ran a turn as alice");
        }
        let peek = pb::CachedPrefixRequest { tokens: vec![1; 64], owner: "alice".into(), platform_prefix_len: 0 };
        let mut as_gateway = DecodeNodeClient::new(dial(&cluster.plane("gateway"), &decode.addr("grpc")).await.unwrap());
        assert_eq!(as_gateway.cached_prefix(peek).await.unwrap_err().code(), Code::PermissionDenied, "the cache oracle");
        // Eviction of a user's conversation on a node: the coordinator's alone.
        let mut ctl = NodeControlClient::new(dial(&cluster.plane("gateway"), &decode.addr("grpc")).await.unwrap());
        let evict = pb::EvictRequest { conversation: "conv-a".into(), owner: "alice".into() };
        assert_eq!(ctl.evict(evict).await.unwrap_err().code(), Code::PermissionDenied);
    });
    // The refusals are in each serving role's metrics, by method and caller role.
    let refused = |http: &str, method: &str, role: &str| {
        sample(&metrics(http), &format!("baton_plane_calls_refused_total{{method=\"{method}\",caller_role=\"{role}\"}}"))
    };
    assert!(refused(&decode.addr("http"), "/baton.node.DecodeNode/Generate", "prefill") >= 2.0);
    assert!(refused(&decode.addr("http"), "/baton.node.NodeControl/Evict", "gateway") >= 2.0);
    assert!(refused(&prefill.addr("http"), "/baton.node.PrefillNode/Prefill", "gateway") >= 1.0);
    assert!(refused(&cluster.coordinator.addr("http"), "/baton.coordinator.Coordinator/Register", "gateway") >= 1.0);
    // No prefix-cache lookup met a forged block (the counter exists, at 0).
    let text = metrics(&decode.addr("http"));
    assert!(text.lines().any(|l| l == "baton_decode_prefix_hash_collisions_total 0"), "{text}");
}

#[test]
fn a_client_does_not_trust_a_server_with_the_wrong_identity() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let rt = runtime();
    rt.block_on(async {
        // The coordinator's address, but the client expects a decode node (a hijacked
        // address or DNS name): the handshake fails on the client's side.
        let gw = cluster.plane("gateway");
        let endpoint = gw.endpoint(&cluster.url()).unwrap().connect_timeout(Duration::from_secs(3));
        assert!(gw.connect(&endpoint, Expect::Role(IdRole::Decode)).await.is_err());
        assert!(gw.connect(&endpoint, Expect::Node { role: IdRole::Coordinator, name: "coordinator".into() }).await.is_ok());
        assert!(gw.connect(&endpoint, Expect::Node { role: IdRole::Coordinator, name: "other".into() }).await.is_err());
    });
}

#[test]
fn idle_connections_do_not_keep_a_real_caller_out() {
    let Some(cluster) = Cluster::start(IDENTITIES, 512) else { return };
    let addr = cluster.coordinator.addr("grpc");
    // 300 connections that never send a byte (each holds one of the coordinator's
    // handshake slots until its timeout, or is refused at once past MAX_PENDING).
    let idle: Vec<std::net::TcpStream> = (0..300).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    let rt = runtime();
    let took = rt.block_on(async {
        let started = Instant::now();
        let mut c = CoordinatorClient::new(dial(&cluster.plane("operator"), &cluster.url()).await.unwrap());
        c.list_nodes(cpb::ListNodesRequest { role: 0 }).await.unwrap();
        started.elapsed()
    });
    assert!(took < Duration::from_secs(1), "a real call took {took:?} behind 300 idle connections");
    drop(idle);
}
