//! The cluster with real processes on loopback: `baton coordinator`, `baton
//! prefill` and `baton decode`, QUIC between the nodes.
//!
//! - Disaggregation is invisible: greedy tokens through the cluster equal a
//!   single engine's, for a remote prefill, a remote prefill whose prefill
//!   node pulled the prefix from the decode node, and a local prefill.
//! - Multi-turn: the next turn reuses the conversation's prefix.
//! - Faults: the prefill node killed mid-transfer -> the decode node falls
//!   back to local prefill and releases its reservation; the decode node
//!   killed mid-stream -> the stream ends with an error within 5 s; a drained
//!   prefill node reports idle only once the KV it computed has arrived.
//! - Isolation: two users with the same system prompt share only its blocks;
//!   a user sending another's exact history hits nothing of theirs.
//! - After each test every live node is back to its block baseline.

mod cluster_support;

use std::time::{Duration, Instant};

use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::generate_event::Event as GenEv;
use baton_proto::node::PrefillPath;
use baton_proto::plane::Plane;
use cluster_support::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler. \
    When a visitor asks about physics, name the effect, say what causes it, and give one everyday example.";

/// Tails of at least this many tokens go to the prefill node.
const THRESHOLD: usize = 48;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Waits until the prefill node sampled its first token: its engine is done
/// with the tail, and the KV is being shipped.
fn wait_until_prefill_sampled(prefill: &Proc) {
    let http = prefill.addr("http");
    let t0 = Instant::now();
    while !metrics(&http).contains("baton_prefill_generated_tokens_total 1") {
        assert!(t0.elapsed() < Duration::from_secs(60), "the prefill node never sampled");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cluster_tokens_match_a_single_engine_remote_pulled_and_local() {
    let Some(cluster) = Cluster::start("prefill-0,decode-0", THRESHOLD) else { return };
    let prefill = cluster.node("prefill", "prefill-0", &[]);
    let decode = cluster.node("decode", "decode-0", &[]);
    let reference = reference_engine(&cluster.model);
    let grpc = decode.addr("grpc");
    let pgrpc = prefill.addr("grpc");
    let rt = runtime();

    // Turn 1: nothing cached; the whole prompt is a long tail -> remote.
    let turn1 = chat(&reference, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
    assert!(turn1.len() >= THRESHOLD);
    let want1 = reference_tokens(&reference, &turn1, "alice", 24);
    let (got1, fin1) = rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&turn1, "alice", "conv-a", 24)));
    assert_eq!(fin1.prefill_path, PrefillPath::Remote as i32, "turn 1 goes to the prefill node");
    assert_eq!(got1, want1, "turn 1: remote prefill vs single engine");

    // Turn 2: the decode node holds turn 1 (prompt and reply); the prefill
    // node holds only turn 1's prompt and pulls the rest of the prefix.
    let mut turn2 = turn1.clone();
    turn2.extend(&got1);
    turn2.extend(
        reference
            .tokenizer
            .encode(
                "<|im_end|>\n<|im_start|>user\nThen why are sunsets red and orange instead of blue? Please explain what changes when the sun is low on the horizon, how far the light travels through the air then, which colours get scattered away on the way, and whether dust or smoke from fires makes the colours stronger.<|im_end|>\n<|im_start|>assistant\n",
                true,
            )
            .unwrap(),
    );
    let want2 = reference_tokens(&reference, &turn2, "alice-ref", 24);
    let (got2, fin2) = rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&turn2, "alice", "conv-a", 24)));
    let usage = fin2.usage.unwrap();
    let bt = 16;
    assert!(
        usage.cached_tokens as usize >= (turn1.len() + got1.len()) / bt * bt - bt,
        "turn 2 reuses turn 1's prompt and reply: cached {} of {}",
        usage.cached_tokens,
        turn1.len() + got1.len()
    );
    assert_eq!(fin2.prefill_path, PrefillPath::Remote as i32, "turn 2's tail goes to the prefill node");
    assert_eq!(got2, want2, "turn 2: pulled prefix + remote tail vs single engine");
    assert!(metrics(&prefill.addr("http")).contains("baton_prefill_pulled_prefixes_total 1"), "the prefill node pulled the prefix");

    // Turn 3: a short tail -> prefilled on the decode node.
    let mut turn3 = turn2.clone();
    turn3.extend(&got2);
    turn3.extend(reference.tokenizer.encode("<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n", true).unwrap());
    let want3 = reference_tokens(&reference, &turn3, "alice-ref3", 16);
    let (got3, fin3) = rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&turn3, "alice", "conv-a", 16)));
    assert_eq!(fin3.prefill_path, PrefillPath::Local as i32, "a short tail stays local");
    assert_eq!(got3, want3, "turn 3: local prefill vs single engine");

    rt.block_on(async {
        assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))).await;
        assert_no_leaks(|| Box::pin(prefill_stats_owned(cluster.plane("operator"), pgrpc.clone()))).await;
    });
    reference.shutdown();
}

#[test]
fn cluster_faults_prefill_killed_mid_transfer_and_decode_killed_mid_stream() {
    let Some(cluster) = Cluster::start("prefill-0,decode-0", THRESHOLD) else { return };
    // 30 layers at 150 ms each: the transfer takes several seconds.
    let mut prefill = cluster.node("prefill", "prefill-0", &["--kv-layer-delay", "150ms"]);
    let mut decode = cluster.node("decode", "decode-0", &["--kv-deadline", "20s"]);
    let reference = reference_engine(&cluster.model);
    let grpc = decode.addr("grpc");
    let rt = runtime();

    // The prefill node dies while shipping: the turn still completes, by
    // local prefill, with the same tokens, and nothing stays reserved.
    let prompt = chat(&reference, SYSTEM, "What makes a rainbow appear after rain? Describe refraction and dispersion in water droplets.");
    let want = reference_tokens(&reference, &prompt, "bob", 16);
    let turn = rt.spawn(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&prompt, "bob", "conv-b", 16)));
    wait_until_prefill_sampled(&prefill);
    prefill.kill9();
    let (got, fin) = rt.block_on(turn).unwrap();
    assert_eq!(fin.prefill_path, PrefillPath::Fallback as i32, "the decode node fell back to local prefill");
    assert_eq!(got, want, "fallback tokens vs single engine");
    rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))));

    // The decode node dies mid-stream: the caller sees an error within 5 s.
    let rx = rt.block_on(async {
        let mut c = DecodeNodeClient::new(channel(&cluster.plane("gateway"), &grpc).await);
        let mut s = c.generate(generate_request(&prompt, "bob", "conv-b", 1000)).await.unwrap().into_inner();
        // Wait for the first token so the kill lands mid-stream.
        match s.message().await.unwrap().and_then(|e| e.event) {
            Some(GenEv::Token(_)) => {}
            other => panic!("expected a token, got {other:?}"),
        }
        s
    });
    decode.kill9();
    let killed = Instant::now();
    let ended = rt.block_on(async move {
        let mut s = rx;
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.message().await {
                    Ok(Some(ev)) => assert!(!matches!(ev.event, Some(GenEv::Finished(_))), "a killed node cannot finish"),
                    Ok(None) | Err(_) => return,
                }
            }
        })
        .await
    });
    assert!(ended.is_ok(), "the stream did not end within 5 s of the kill");
    assert!(killed.elapsed() < Duration::from_secs(5));
    reference.shutdown();
}

#[test]
fn a_drained_prefill_node_finishes_shipping_before_it_reports_idle() {
    let Some(cluster) = Cluster::start("prefill-0,decode-0", THRESHOLD) else { return };
    // 30 layers at 100 ms each: shipping outlasts the engine's work by seconds.
    let mut prefill = cluster.node("prefill", "prefill-0", &["--kv-layer-delay", "100ms"]);
    let decode = cluster.node("decode", "decode-0", &["--kv-deadline", "20s"]);
    let reference = reference_engine(&cluster.model);
    let grpc = decode.addr("grpc");
    let rt = runtime();
    let prompt = chat(&reference, SYSTEM, "Why is the sky blue at noon? Explain Rayleigh scattering by air molecules.");
    let want = reference_tokens(&reference, &prompt, "carol", 12);
    let turn = rt.spawn(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&prompt, "carol", "conv-c", 12)));
    wait_until_prefill_sampled(&prefill);
    // The engine is done; the KV is still on its way. A drain (a preStop hook)
    // must wait for it, and the node may then be killed without harm.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["drain", "--node", &prefill.addr("grpc"), "--timeout", "30s", "--certs-dir", cluster.certs_dir(), "--tls-name", "operator"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "baton drain failed: {report} {}", String::from_utf8_lossy(&out.stderr));
    assert!(report.contains("still_running=0"), "{report}");
    prefill.kill9();
    let (got, fin) = rt.block_on(turn).unwrap();
    assert_eq!(fin.prefill_path, PrefillPath::Remote as i32, "the tail arrived before the drained node went away");
    assert_eq!(got, want, "remote prefill tokens vs single engine");
    rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))));
    reference.shutdown();
}

#[test]
fn cluster_isolation_users_share_only_the_platform_blocks() {
    // Every tail local (no prefill node, and a threshold no tail reaches): isolation is
    // the decode node's prefix cache's business.
    let Some(cluster) = Cluster::start("decode-0", 100_000) else { return };
    let decode = cluster.node("decode", "decode-0", &[]);
    let reference = reference_engine(&cluster.model);
    let grpc = decode.addr("grpc");
    let rt = runtime();
    let bt = 16;

    let alice = chat(&reference, SYSTEM, "Why does ice float on water? Explain the hydrogen bonds.");
    let bob = chat(&reference, SYSTEM, "How do magnets attract iron? Explain the domains.");
    // The platform prefix: what the two prompts share (the platform's system prompt).
    let platform = alice.iter().zip(&bob).take_while(|(a, b)| a == b).count();
    assert!(platform >= 2 * bt, "the system prompt spans whole blocks ({platform} tokens)");
    let turn = |prompt: &[u32], owner: &str, conv: &str| {
        let mut req = generate_request(prompt, owner, conv, 8);
        req.turn.as_mut().unwrap().platform_prefix_len = platform as u32;
        rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), req))
    };

    let (_, fin) = turn(&alice, "alice", "conv-a");
    assert_eq!(fin.usage.unwrap().cached_tokens, 0, "a cold node");
    // Bob shares alice's system prompt: he hits its whole blocks and nothing else.
    let (_, fin) = turn(&bob, "bob", "conv-b");
    assert_eq!(fin.usage.unwrap().cached_tokens as usize, platform / bt * bt, "bob hits only the platform blocks");
    // Mallory sends alice's exact history: still only the platform blocks, and the
    // reply is what a fresh engine gives.
    let want = reference_tokens(&reference, &alice, "mallory-ref", 8);
    let (got, fin) = turn(&alice, "mallory", "conv-m");
    assert_eq!(fin.usage.unwrap().cached_tokens as usize, platform / bt * bt, "mallory must not hit alice's blocks");
    assert_eq!(got, want);
    // Alice herself hits all of her prompt but the last partial block.
    let (_, fin) = turn(&alice, "alice", "conv-a");
    assert!(fin.usage.unwrap().cached_tokens as usize >= (alice.len() - 1) / bt * bt, "alice reuses her own prefix");

    rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))));
    reference.shutdown();
}

/// Owned-argument wrappers so the futures are `'static`.
async fn decode_stats_owned(operator: Plane, grpc: String) -> baton_proto::node::NodeStats {
    decode_stats(&operator, &grpc).await
}

async fn prefill_stats_owned(operator: Plane, grpc: String) -> baton_proto::node::NodeStats {
    prefill_stats(&operator, &grpc).await
}

