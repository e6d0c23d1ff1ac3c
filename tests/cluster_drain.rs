//! Conversations that change decode node keep their warm prefix, with real
//! processes on loopback:
//!
//! - Drain (`baton drain`, as a Kubernetes preStop hook runs it): the node stops
//!   taking turns and leaves the ring, and its warm conversation moves to the
//!   new owner over QUIC, so the next turn there starts warm and its greedy
//!   tokens still equal a single engine's. The moved blocks stay scoped to
//!   their owner, and nothing stays reserved on the new owner.
//! - Models: drain and join run over SmolLM2 and Gemma 3 (`over_models!`; on Gemma 3 the
//!   drained conversation, prefilled remotely, is longer than its 512-token sliding window).
//! - Join: a node that joins becomes the home of some conversations; the
//!   coordinator names their previous owner on the first turn after the move,
//!   and the new node pulls the warm prefix from it before prefilling.

mod cluster_support;

use std::io::{Read, Write};
use std::process::Command;

use std::time::{Duration, Instant};

use baton_coordinator::routing::decode::DecodeRouter;
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::{RouteDecodeRequest, RouteDecodeResponse};
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::PrefillPath;
use baton_proto::plane::Plane;
use cluster_support::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler. \
    When a visitor asks about physics, name the effect, say what causes it, and give one everyday example.";

/// Every tail is prefilled on the decode node (no prefill nodes here).
const THRESHOLD: usize = 100_000;

/// Tails of at least this many tokens go to the prefill node.
const REMOTE_THRESHOLD: usize = 48;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// RouteDecode as the gateway does it.
async fn route_full(gateway: &Plane, coordinator: &str, key: &str) -> RouteDecodeResponse {
    let mut c = CoordinatorClient::new(channel(gateway, coordinator).await);
    let ask = RouteDecodeRequest { routing_key: key.into(), owner: "alice".into(), prompt_tokens: 100, exclude: vec![] };
    c.route_decode(ask).await.unwrap().into_inner()
}

async fn route(gateway: &Plane, coordinator: &str, key: &str) -> String {
    route_full(gateway, coordinator, key).await.node.unwrap().node_id.unwrap().id
}

fn healthz_status(http: &str) -> String {
    let mut s = std::net::TcpStream::connect(http).unwrap();
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp.lines().next().unwrap_or_default().to_string()
}

over_models! {
    /// A drained node hands its warm conversation (prefilled remotely; on Gemma 3 longer
    /// than the sliding window, so its early blocks lack their local layers) to the new
    /// owner, whose next turn is warm and token-exact.
    fn drain_hands_a_warm_conversation_to_its_new_owner_token_exact(model) {
        // Turn 1 is prefilled remotely: on Gemma 3 the home node then holds blocks whose
        // local layers never arrived (before the window), and those are what moves.
        let cluster = Cluster::start_with(&model, "prefill-0,decode-0,decode-1", REMOTE_THRESHOLD);
        let _prefill = cluster.node("prefill", "prefill-0", &[]);
        let d0 = cluster.node("decode", "decode-0", &[]);
        let d1 = cluster.node("decode", "decode-1", &[]);
        let reference = reference_engine(&cluster.model);
        let rt = runtime();
        let coordinator = cluster.url();

        let owner_id = rt.block_on(route(&cluster.plane("gateway"), &coordinator, "conv-a"));
        let (owner, other) = if owner_id == "decode-0" { (&d0, &d1) } else { (&d1, &d0) };
        let (owner_grpc, other_grpc) = (owner.addr("grpc"), other.addr("grpc"));

        // Turn 1 on the conversation's home node.
        let turn1 = chat_past_the_window(&reference, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
        let (got1, fin1) = rt.block_on(generate(cluster.plane("gateway"), owner_grpc.clone(), generate_request(&turn1, "alice", "conv-a", 24)));
        assert_eq!(fin1.prefill_path, PrefillPath::Remote as i32, "turn 1 goes to the prefill node");
        let mut turn2 = turn1.clone();
        turn2.extend(&got1);
        turn2.extend(next_turn(&reference, "And why are sunsets red?"));
        let want2 = reference_tokens(&reference, &turn2, "alice-ref", 24);

        // Drain the home node the way a preStop hook does.
        let out = Command::new(env!("CARGO_BIN_EXE_baton")).args(["drain", "--node", &owner_grpc, "--timeout", "30s", "--certs-dir", cluster.certs_dir(), "--tls-name", "operator"]).output().unwrap();
        let report = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "baton drain failed: {report} {}", String::from_utf8_lossy(&out.stderr));
        assert!(report.contains("deregistered=true"), "{report}");
        assert!(report.contains("conversations_moved=1 conversations_failed=0"), "{report}");
        assert!(!report.contains("blocks_moved=0"), "{report}");

        // The drained node takes no turns and is not ready; the conversation now
        // routes to the other node.
        let refused = rt.block_on(async {
            let mut c = DecodeNodeClient::new(channel(&cluster.plane("gateway"), &owner_grpc).await);
            c.generate(generate_request(&turn2, "alice", "conv-a", 4)).await.err().map(|s| s.code())
        });
        assert_eq!(refused, Some(tonic::Code::Unavailable));
        assert!(healthz_status(&owner.addr("http")).contains("503"), "a drained node reports not ready");
        assert_eq!(rt.block_on(route(&cluster.plane("gateway"), &coordinator, "conv-a")), if owner_id == "decode-0" { "decode-1" } else { "decode-0" });

        // Turn 2 on the new owner: warm, and token-exact.
        let (got2, fin2) = rt.block_on(generate(cluster.plane("gateway"), other_grpc.clone(), generate_request(&turn2, "alice", "conv-a", 24)));
        let usage = fin2.usage.unwrap();
        let bt = reference.info.kv_layout.block_tokens;
        assert!(
            usage.cached_tokens as usize >= (turn1.len() + got1.len()) / bt * bt - bt,
            "turn 2 on the new owner reuses turn 1's moved prefix: cached {} of {}",
            usage.cached_tokens,
            turn1.len() + got1.len()
        );
        assert_eq!(got2, want2, "turn 2 after the move vs single engine");

        // The moved blocks are still alice's: the same tokens for another user hit nothing.
        let (_, fin_m) = rt.block_on(generate(cluster.plane("gateway"), other_grpc.clone(), generate_request(&turn2, "mallory", "conv-m", 2)));
        assert_eq!(fin_m.usage.unwrap().cached_tokens, 0, "another user must not read alice's moved prefix");

        rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), other_grpc.clone()))));
        reference.shutdown();
    }
}

async fn decode_stats_owned(operator: Plane, grpc: String) -> baton_proto::node::NodeStats {
    decode_stats(&operator, &grpc).await
}

over_models! {
    /// A node that joins pulls the warm prefix of the conversations it takes over, on each model.
    fn a_joining_node_pulls_the_warm_prefix_of_the_conversations_it_takes_over(model) {
        let cluster = Cluster::start_with(&model, "decode-0,decode-1", THRESHOLD);
        // A conversation whose ring home, once decode-1 is a member, is decode-1
        // (the ring is a pure function of the node names; 160 points per node is
        // the coordinator's default).
        let conv = (0..)
            .map(|i| format!("conv-{i}"))
            .find(|k| {
                let mut r = DecodeRouter::new(160, 1.25, Duration::from_secs(600)).unwrap();
                r.set_members(["decode-0", "decode-1"]);
                r.route(&baton_vocab::ConversationId::parse(k.as_str()).unwrap(), &[], Instant::now()).unwrap().node == "decode-1"
            })
            .unwrap();
        let d0 = cluster.node("decode", "decode-0", &[]);
        let reference = reference_engine(&cluster.model);
        let rt = runtime();
        let coordinator = cluster.url();

        assert_eq!(rt.block_on(route(&cluster.plane("gateway"), &coordinator, &conv)), "decode-0", "decode-0 is the only node yet");
        let turn1 = chat(&reference, SYSTEM, "What makes a rainbow? Name the effect and its cause.");
        let (got1, _) = rt.block_on(generate(cluster.plane("gateway"), d0.addr("grpc"), generate_request(&turn1, "alice", &conv, 24)));
        let mut turn2 = turn1.clone();
        turn2.extend(&got1);
        turn2.extend(next_turn(&reference, "Why is it curved?"));
        let want2 = reference_tokens(&reference, &turn2, "alice-ref", 24);

        // decode-1 joins and becomes the conversation's home; the first routing
        // after the move names decode-0 as where the warm prefix is.
        let d1 = cluster.node("decode", "decode-1", &[]);
        let moved = rt.block_on(route_full(&cluster.plane("gateway"), &coordinator, &conv));
        assert_eq!(moved.node.as_ref().unwrap().node_id.as_ref().unwrap().id, "decode-1");
        let previous = moved.previous.expect("the first turn after the move names the previous owner");
        assert_eq!(previous.grpc_addr, d0.addr("grpc"));

        // The turn on decode-1, told where the prefix is, starts warm and is token-exact.
        let mut req = generate_request(&turn2, "alice", &conv, 24);
        req.prefix_source = previous.grpc_addr.clone();
        req.prefix_source_node = previous.node_id.as_ref().unwrap().id.clone();
        let (got2, fin2) = rt.block_on(generate(cluster.plane("gateway"), d1.addr("grpc"), req));
        let cached = fin2.usage.unwrap().cached_tokens as usize;
        let bt = reference.info.kv_layout.block_tokens;
        assert!(cached >= (turn1.len() + got1.len()) / bt * bt - bt, "pulled on join: cached {cached} of {}", turn1.len() + got1.len());
        assert_eq!(got2, want2, "turn 2 on the joined node vs single engine");
        assert!(rt.block_on(route_full(&cluster.plane("gateway"), &coordinator, &conv)).previous.is_none(), "named once");

        rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), d1.addr("grpc")))));
        rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), d0.addr("grpc")))));
        reference.shutdown();
    }
}
