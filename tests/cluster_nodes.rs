//! The cluster with real processes on loopback: `baton coordinator`, `baton
//! prefill` and `baton decode`, QUIC between the nodes.
//!
//! - Disaggregation is invisible: greedy tokens through the cluster equal a
//!   single engine's, for a remote prefill, a remote prefill whose prefill
//!   node pulled the prefix from the decode node, and a local prefill.
//! - Multi-turn: the next turn reuses the conversation's prefix.
//! - Deletion: evicting a conversation frees its blocks on the decode and the prefill
//!   node, and its next turn hits nothing.
//! - Models: the tests of tokens, turns, deletion and isolation run over SmolLM2 and Gemma 3
//!   (`over_models!`; on Gemma 3 turn 1 is longer than its 512-token sliding window, and
//!   the local layers' out-of-window blocks are not shipped).
//! - Faults: the prefill node killed mid-transfer -> the decode node falls
//!   back to local prefill and releases its reservation, and the decode node and a
//!   gateway in front of it count the turn as `recomputed{transfer_failed}` (proof of
//!   transfer; the other turns as `imported` or `warm`); the decode node
//!   killed mid-stream -> the stream ends with an error within 5 s; a drained
//!   prefill node reports idle only once the KV it computed has arrived.
//! - Isolation: two users with the same system prompt share only its blocks;
//!   a user sending another's exact history hits nothing of theirs.
//! - After each test every live node is back to its block baseline.

mod cluster_support;

use std::time::{Duration, Instant};

use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::EvictConversationRequest;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use baton_proto::node::generate_event::Event as GenEv;
use baton_proto::node::PrefillPath;
use baton_proto::plane::Plane;
use cluster_support::*;

const SYSTEM: &str = "You are a careful assistant for a science museum. Answer in two or three sentences, with concrete facts and no filler. \
    When a visitor asks about physics, name the effect, say what causes it, and give one everyday example.";

/// Tails of at least this many tokens go to the prefill node.
const THRESHOLD: usize = 48;

/// The most bytes a transfer's frame headers and checksums add to its KV (a few per layer).
const FRAMING: u64 = 16 << 10;

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

over_models! {
    /// Remote prefill with the KV shipped (on Gemma 3 a turn longer than the 512-token
    /// window, whose local layers' out-of-window blocks stay off the wire), a warm second
    /// turn whose prefix the prefill node pulls from the decode node, a local third turn:
    /// every turn token-exact to a single engine.
    fn cluster_tokens_match_a_single_engine_remote_pulled_and_local(model) {
        let cluster = Cluster::start_with(&model, "prefill-0,decode-0", THRESHOLD);
        let prefill = cluster.node("prefill", "prefill-0", &[]);
        // No ITL target: where a tail goes is then its length alone. With one, a decode
        // step slower than 50 ms on a loaded machine makes the node "busy" and sends even
        // turn 3's short tail away (remote_decode_busy, the coordinator's own tests).
        let decode = cluster.node("decode", "decode-0", &["--itl-target-ms", "0"]);
        let reference = reference_engine(&cluster.model);
        let grpc = decode.addr("grpc");
        let pgrpc = prefill.addr("grpc");
        let rt = runtime();

        // Turn 1: nothing cached; the whole prompt is a long tail -> remote.
        let turn1 = chat_past_the_window(&reference, SYSTEM, "Why is the sky blue? Explain Rayleigh scattering to a curious child.");
        assert!(turn1.len() >= THRESHOLD);
        let want1 = reference_tokens(&reference, &turn1, "alice", 24);
        let (got1, fin1, source1) = rt.block_on(generate_traced(cluster.plane("gateway"), grpc.clone(), generate_request(&turn1, "alice", "conv-a", 24)));
        assert_eq!(fin1.prefill_path, PrefillPath::Remote as i32, "turn 1 goes to the prefill node");
        assert_eq!(source1, ("imported", "remote_prefill"), "turn 1's KV was shipped and used");
        assert_eq!(got1, want1, "turn 1: remote prefill vs single engine");
        // The local layers' blocks before the window were not shipped (none on a model
        // without sliding-window layers).
        let skipped = sample(&metrics(&decode.addr("http")), "baton_decode_kv_window_skipped_bytes_sum");
        let expected = window_skipped_bytes(&reference, turn1.len());
        assert_eq!(skipped, Some(expected as f64), "KV bytes left off the wire for a {}-token turn", turn1.len());
        assert_eq!(expected > 0, reference.info.layer_windows.iter().any(Option::is_some), "{} skips by its windows", model.name);
        // Nor does the decode node hold memory for them: at the turn's end its blocks
        // behind every window (the last 23 tokens computed here moved the window on)
        // have no window layers' memory.
        let saved = sample(&metrics(&decode.addr("http")), "baton_decode_kv_window_saved_bytes_sum");
        assert_eq!(saved, Some(window_saved_bytes(&reference, turn1.len() + 23) as f64), "KV memory saved by turn 1");
        assert!(window_saved_bytes(&reference, turn1.len() + 23) >= expected);
        // And the prefill node's link really carried that much less: every block of the
        // prompt but those block-layers, plus frame headers.
        let layout = reference.info.kv_layout;
        let payload = (turn1.len().div_ceil(layout.block_tokens) * layout.block_bytes()) as u64 - expected;
        let sent = sample(&metrics(&prefill.addr("http")), r#"baton_kv_transport_bytes_total{transport="quic",side="sender"}"#).unwrap_or(0.0) as u64;
        eprintln!("{}: turn 1 of {} tokens shipped remotely: {sent} bytes sent, {payload} of KV, {expected} left off the wire", model.name, turn1.len());
        assert!(sent >= payload && sent < payload + FRAMING, "{sent} bytes sent for {payload} bytes of KV");

        // Turn 2: the decode node holds turn 1 (prompt and reply); the prefill
        // node holds only turn 1's prompt and pulls the rest of the prefix.
        let mut turn2 = turn1.clone();
        turn2.extend(&got1);
        turn2.extend(next_turn(
            &reference,
            "Then why are sunsets red and orange instead of blue? Please explain what changes when the sun is low on the horizon, how far the light travels through the air then, which colours get scattered away on the way, and whether dust or smoke from fires makes the colours stronger.",
        ));
        let want2 = reference_tokens(&reference, &turn2, "alice-ref", 24);
        let (got2, fin2, source2) = rt.block_on(generate_traced(cluster.plane("gateway"), grpc.clone(), generate_request(&turn2, "alice", "conv-a", 24)));
        assert_eq!(source2, ("imported", "remote_prefill"), "turn 2's tail was shipped and used");
        let usage = fin2.usage.unwrap();
        let bt = reference.info.kv_layout.block_tokens;
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
        turn3.extend(next_turn(&reference, "Thanks!"));
        let want3 = reference_tokens(&reference, &turn3, "alice-ref3", 16);
        let (got3, fin3, source3) = rt.block_on(generate_traced(cluster.plane("gateway"), grpc.clone(), generate_request(&turn3, "alice", "conv-a", 16)));
        assert_eq!(fin3.prefill_path, PrefillPath::Local as i32, "a short tail stays local");
        assert_eq!(source3, ("warm", "prefix_cache"), "turn 3 found its prefix here");
        let text = metrics(&decode.addr("http"));
        for (pair, n) in [(r#"outcome="imported",reason="remote_prefill""#, 2.0), (r#"outcome="warm",reason="prefix_cache""#, 1.0)] {
            assert_eq!(sample(&text, &format!("baton_decode_kv_source_total{{{pair}}}")), Some(n), "{pair}");
        }
        assert_eq!(got3, want3, "turn 3: local prefill vs single engine");

        rt.block_on(async {
            assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))).await;
            assert_no_leaks(|| Box::pin(prefill_stats_owned(cluster.plane("operator"), pgrpc.clone()))).await;
        });
        reference.shutdown();
    }
}

over_models! {
    /// Deleting a conversation (the coordinator's `EvictConversation`, as the gateway calls
    /// it) evicts its KV on every node that computed or cached it: both nodes acknowledge,
    /// each frees exactly the blocks it cached, none is left, and the same turn again is
    /// computed from nothing with a single engine's tokens.
    fn deleting_a_conversation_evicts_its_kv_on_every_node(model) {
        let cluster = Cluster::start_with(&model, "prefill-0,decode-0", THRESHOLD);
        let prefill = cluster.node("prefill", "prefill-0", &[]);
        let decode = cluster.node("decode", "decode-0", &[]);
        let reference = reference_engine(&cluster.model);
        let (grpc, pgrpc) = (decode.addr("grpc"), prefill.addr("grpc"));
        let rt = runtime();
        let operator = cluster.plane("operator");
        // Cached blocks of a node once it is idle.
        let cached = |stats: &dyn Fn() -> baton_proto::node::NodeStats| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let st = stats();
                if st.running == 0 && st.kv_blocks_used == 0 && st.live_reservations == 0 {
                    return st.kv_blocks_cached;
                }
                assert!(Instant::now() < deadline, "the node did not become idle: {st:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        let decode_cached = || cached(&|| rt.block_on(decode_stats(&operator, &grpc)));
        let prefill_cached = || cached(&|| rt.block_on(prefill_stats(&operator, &pgrpc)));

        let prompt = chat(&reference, SYSTEM, "How does a lever lift a heavy stone? Name the principle and one tool that uses it.");
        let want = reference_tokens(&reference, &prompt, "dave-ref", 6);
        let (got, fin) = rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&prompt, "dave", "conv-d", 6)));
        assert_eq!(fin.prefill_path, PrefillPath::Remote as i32, "computed on the prefill node, cached on both");
        assert_eq!(got, want);
        let (on_decode, on_prefill) = (decode_cached(), prefill_cached());
        assert!(on_decode > 0 && on_prefill > 0, "both nodes cache the conversation: decode {on_decode}, prefill {on_prefill} blocks");

        let evicted = rt.block_on(async {
            let mut c = CoordinatorClient::new(channel(&cluster.plane("gateway"), &cluster.url()).await);
            c.evict_conversation(EvictConversationRequest { routing_key: "conv-d".into(), owner: "dave".into() }).await.unwrap().into_inner()
        });
        assert!(evicted.pending.is_empty(), "{evicted:?}");
        let freed = |node: &str| {
            let ack = evicted.acks.iter().find(|a| a.node_id.as_ref().is_some_and(|n| n.id == node)).unwrap_or_else(|| panic!("no ack from {node}: {evicted:?}"));
            assert!(ack.ok, "{ack:?}");
            ack.blocks_freed
        };
        assert_eq!((freed("decode-0"), freed("prefill-0")), (on_decode, on_prefill), "each node frees what it cached");
        assert_eq!((decode_cached(), prefill_cached()), (0, 0), "nothing of the conversation is left");

        // The same turn again: nothing to hit anywhere, and the same tokens.
        let (again, fin) = rt.block_on(generate(cluster.plane("gateway"), grpc.clone(), generate_request(&prompt, "dave", "conv-d", 6)));
        assert_eq!(fin.usage.unwrap().cached_tokens, 0, "a deleted conversation's prefix is gone");
        assert_eq!(again, want);
        rt.block_on(async {
            assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), grpc.clone()))).await;
            assert_no_leaks(|| Box::pin(prefill_stats_owned(cluster.plane("operator"), pgrpc.clone()))).await;
        });
        reference.shutdown();
    }
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

/// Waits until the decode node has received KV frames of the turn: its reservation is
/// attached to the prefill node's link, so a kill now breaks a transfer that began. (The
/// prefill node's own sent-bytes counter is not enough: frames written to a connection
/// may never arrive, and then the decode node rightly sees a prefill node that went away.)
fn wait_until_kv_lands(decode: &Proc) {
    let http = decode.addr("http");
    let t0 = Instant::now();
    while sample(&metrics(&http), r#"baton_kv_transport_bytes_total{transport="quic",side="receiver"}"#).unwrap_or(0.0) == 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the decode node never received KV");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Proof of transfer when the handoff fails: a turn through a real gateway whose prefill
/// node is killed while shipping the KV is still answered (recomputed on the decode node),
/// and both the decode node and the gateway count it as `recomputed{transfer_failed}`,
/// nothing as imported.
#[test]
fn a_handoff_killed_mid_transfer_is_counted_as_recomputed_transfer_failed_and_answered() {
    let Some(cluster) = Cluster::start("prefill-0,decode-0", THRESHOLD) else { return };
    // 30 layers at 150 ms each: the transfer takes several seconds.
    let mut prefill = cluster.node("prefill", "prefill-0", &["--kv-layer-delay", "150ms"]);
    let decode = cluster.node("decode", "decode-0", &["--kv-deadline", "20s"]);
    let db = cluster.dir.path().join("gateway.db");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton")).args(["keys", "--db"]).arg(&db).args(["create", "--user", "alice"]).output().unwrap();
    assert!(out.status.success(), "baton keys create: {}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let port = |_| format!("127.0.0.1:{}", baton::harness::free_port().unwrap());
    let (api, admin) = (port(0), port(1));
    let gateway = gateway_command(&["--listen", &api, "--admin-listen", &admin], &cluster.url(), cluster.certs_dir(), &db, &cluster.model).spawn().unwrap();
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _gateway = Killed(gateway);
    wait_healthy(&admin, Duration::from_secs(60));
    let rt = runtime();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();

    // A prompt well past the local-prefill threshold: the coordinator sends it remote.
    let body = serde_json::json!({
        "model": "baton",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What makes a rainbow appear after rain? Describe refraction and dispersion in water droplets."},
        ],
    });
    let request = http.post(format!("http://{api}/v1/chat/completions")).bearer_auth(&key).json(&body);
    let turn = rt.spawn(async move {
        let r = request.send().await.unwrap();
        (r.status(), r.json::<serde_json::Value>().await.unwrap())
    });
    wait_until_kv_lands(&decode);
    prefill.kill9();
    let (status, v) = rt.block_on(turn).unwrap();
    assert!(status.is_success(), "the turn is still answered: {status} {v}");
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap_or_default().is_empty(), "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{v}");

    let failed = r#"{outcome="recomputed",reason="transfer_failed"}"#;
    let imported = r#"{outcome="imported",reason="remote_prefill"}"#;
    let node = metrics(&decode.addr("http"));
    assert_eq!(sample(&node, &format!("baton_decode_kv_source_total{failed}")), Some(1.0), "{node}");
    assert_eq!(sample(&node, &format!("baton_decode_kv_source_total{imported}")), Some(0.0));
    assert_eq!(sample(&node, "baton_decode_prefill_fallbacks_total"), Some(1.0));
    let edge = rt.block_on(text_of(http.get(format!("http://{admin}/metrics"))));
    assert_eq!(sample(&edge, &format!("baton_gateway_kv_source_total{failed}")), Some(1.0), "the gateway learned it from the node:\n{edge}");
    assert_eq!(sample(&edge, &format!("baton_gateway_kv_source_total{imported}")), Some(0.0));
    rt.block_on(assert_no_leaks(|| Box::pin(decode_stats_owned(cluster.plane("operator"), decode.addr("grpc")))));
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

over_models! {
    /// Users with the same system prompt share only its blocks, on each model.
    fn cluster_isolation_users_share_only_the_platform_blocks(model) {
        // Every tail local (no prefill node, and a threshold no tail reaches): isolation is
        // the decode node's prefix cache's business.
        let cluster = Cluster::start_with(&model, "decode-0", 100_000);
        let decode = cluster.node("decode", "decode-0", &[]);
        let reference = reference_engine(&cluster.model);
        let grpc = decode.addr("grpc");
        let rt = runtime();
        let bt = reference.info.kv_layout.block_tokens;

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
}

/// Owned-argument wrappers so the futures are `'static`.
async fn decode_stats_owned(operator: Plane, grpc: String) -> baton_proto::node::NodeStats {
    decode_stats(&operator, &grpc).await
}

async fn prefill_stats_owned(operator: Plane, grpc: String) -> baton_proto::node::NodeStats {
    prefill_stats(&operator, &grpc).await
}

