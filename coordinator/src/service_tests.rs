//! Attacks by holders of node certificates on the coordinator's gRPC handlers: each
//! request carries the identity and key the TLS server would have read off the
//! handshake (`PeerInfo`, `Caller`), as in a real call.

use std::sync::Arc;
use std::time::Duration;

use baton_proto::common::{NodeId, NodeInfo, Role};
use baton_proto::coordinator as pb;
use baton_proto::coordinator::coordinator_server::Coordinator as _;
use baton_proto::plane::authz::Caller;
use baton_identity::Identity;
use baton_proto::plane::{PeerInfo, Plane, Role as IdRole};
use tonic::{Code, Request};

use super::{CoordinatorService, State};
use crate::membership::MemoryMembership;
use crate::tombstones::MemoryTombstones;
use crate::{Config, GrpcEvictor};

fn service(pool_names: usize) -> CoordinatorService {
    let config = Config { pool_certificate_names: pool_names, ..Config::with_defaults(Plane::insecure_plaintext()) };
    let membership = MemoryMembership::new(Duration::from_secs(30));
    let evictor = Arc::new(GrpcEvictor::new(Plane::insecure_plaintext()));
    let state = State::new(&config, membership, None, Arc::new(MemoryTombstones::default()), evictor).unwrap();
    CoordinatorService { state: Arc::new(state) }
}

/// A request from the holder of `role`/`name` with key `key`.
fn from<T>(role: IdRole, name: &str, key: u8, msg: T) -> Request<T> {
    let id = Identity::new(role, name).unwrap();
    let mut req = Request::new(msg);
    req.extensions_mut().insert(PeerInfo { remote: Some("10.0.0.7:4000".parse().unwrap()), identity: Some(id.clone()), key: Some([key; 32]) });
    req.extensions_mut().insert(Caller(id));
    req
}

fn decode(name: &str) -> NodeInfo {
    NodeInfo { node_id: Some(NodeId { id: name.into() }), role: Role::Decode as i32, grpc_addr: "127.0.0.1:9".into(), ..Default::default() }
}

fn register(name: &str) -> pb::RegisterRequest {
    pb::RegisterRequest { node: Some(decode(name)) }
}

async fn names(s: &CoordinatorService) -> Vec<(String, Vec<u8>)> {
    s.state.membership.members().await.unwrap().into_iter().map(|m| (m.id().to_string(), m.info.identity_key)).collect()
}

#[tokio::test]
async fn one_pod_of_a_pool_cannot_take_a_live_pods_name_or_drop_its_lease() {
    let s = service(8);
    // The victim pod registers; the attacker holds the same pool certificate (same key).
    let victim = s.register(from(IdRole::Decode, "*", 5, register("pod-a.decode.baton"))).await.unwrap().into_inner();
    let e = s.register(from(IdRole::Decode, "*", 5, register("pod-a.decode.baton"))).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    // Its own name is fine; renewing or dropping the victim's lease needs its random ID,
    // and naming the victim on its own lease is refused.
    let mine = s.register(from(IdRole::Decode, "*", 5, register("pod-b.decode.baton"))).await.unwrap().into_inner();
    assert_ne!(mine.lease_id.wrapping_sub(victim.lease_id), 1, "lease IDs are not sequential");
    let spoof = pb::KeepAliveRequest { lease_id: mine.lease_id, node_id: Some(NodeId { id: "pod-a.decode.baton".into() }), load: None };
    assert_eq!(s.keep_alive(from(IdRole::Decode, "*", 5, spoof)).await.unwrap_err().code(), Code::PermissionDenied);
    let guess = pb::DeregisterRequest { lease_id: victim.lease_id ^ 1, node_id: None };
    assert!(!s.deregister(from(IdRole::Decode, "*", 5, guess)).await.unwrap().into_inner().removed);
    let held = names(&s).await;
    assert_eq!(held.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["pod-a.decode.baton", "pod-b.decode.baton"]);
    assert!(held.iter().all(|(_, k)| k == &vec![5; 32]), "the key is the handshake's");
}

#[tokio::test]
async fn a_pool_certificate_holds_at_most_its_limit_and_none_without_the_opt_in() {
    let s = service(3);
    for i in 0..3 {
        s.register(from(IdRole::Decode, "*", 5, register(&format!("pod-{i}.decode.baton")))).await.unwrap();
    }
    let e = s.register(from(IdRole::Decode, "*", 5, register("pod-3.decode.baton"))).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let closed = service(0);
    let e = closed.register(from(IdRole::Decode, "*", 5, register("pod-0.decode.baton"))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(names(&closed).await.is_empty());
}

#[tokio::test]
async fn a_name_is_bound_to_its_key_and_a_node_certificate_holds_one_name() {
    let s = service(0);
    let first = s.register(from(IdRole::Decode, "decode-0", 1, register("decode-0"))).await.unwrap().into_inner();
    // Another key for the same name (a second certificate the CA issued): refused, the
    // live lease stays.
    let e = s.register(from(IdRole::Decode, "decode-0", 2, register("decode-0"))).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let renew = pb::KeepAliveRequest { lease_id: first.lease_id, node_id: Some(NodeId { id: "decode-0".into() }), load: None };
    assert_eq!(s.keep_alive(from(IdRole::Decode, "decode-0", 2, renew.clone())).await.unwrap_err().code(), Code::PermissionDenied);
    let drop = pb::DeregisterRequest { lease_id: first.lease_id, node_id: Some(NodeId { id: "decode-0".into() }) };
    assert_eq!(s.deregister(from(IdRole::Decode, "decode-0", 2, drop.clone())).await.unwrap_err().code(), Code::PermissionDenied);
    // The same certificate under its second spelling: one identity, one name.
    let e = s.register(from(IdRole::Decode, "decode-0", 1, register("decode-0.decode.baton"))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The real node renews, restarts (re-registers with its key) and leaves.
    assert_eq!(s.keep_alive(from(IdRole::Decode, "decode-0", 1, renew)).await.unwrap().into_inner().status, pb::KeepAliveStatus::Ok as i32);
    let again = s.register(from(IdRole::Decode, "decode-0", 1, register("decode-0"))).await.unwrap().into_inner();
    let drop = pb::DeregisterRequest { lease_id: again.lease_id, ..drop };
    assert!(s.deregister(from(IdRole::Decode, "decode-0", 1, drop)).await.unwrap().into_inner().removed);
}

#[tokio::test]
async fn a_decode_node_may_exclude_only_itself_from_routing() {
    let s = service(0);
    for (i, name) in ["decode-0", "decode-1", "decode-2"].into_iter().enumerate() {
        s.register(from(IdRole::Decode, name, i as u8 + 1, register(name))).await.unwrap();
    }
    let ask = |exclude: &[&str]| pb::RouteDecodeRequest {
        routing_key: "conv-victim".into(),
        owner: "alice".into(),
        prompt_tokens: 10,
        exclude: exclude.iter().map(|n| NodeId { id: n.to_string() }).collect(),
    };
    // Steering: decode-2 excludes everyone else so the conversation lands on it.
    let e = s.route_decode(from(IdRole::Decode, "decode-2", 3, ask(&["decode-0", "decode-1"]))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A drain: it excludes itself, and is routed elsewhere.
    let r = s.route_decode(from(IdRole::Decode, "decode-2", 3, ask(&["decode-2"]))).await.unwrap().into_inner();
    assert_ne!(r.node.unwrap().node_id.unwrap().id, "decode-2");
    // The gateway's exclude (a node that failed the turn) stands as sent.
    let r = s.route_decode(from(IdRole::Gateway, "gateway", 9, ask(&["decode-0", "decode-1"]))).await.unwrap().into_inner();
    assert_eq!(r.node.unwrap().node_id.unwrap().id, "decode-2");
}
