//! KV transport benchmark: one run prints GB/s for 1 GiB of KV blocks over QUIC loopback
//! (Baton's tuning, and quinn's own defaults as the tuning's baseline), TLS over TCP
//! loopback (the baseline), the in-process transport and a plain memory copy (the
//! ceiling), then the time to ship one turn's KV for 150, 3,000 and 16,000 tokens of the
//! default model (SmolLM2-135M, f16).
//!
//! Run: `cargo bench -p baton-kv-transport --bench transport`
//! Env: `BATON_KVT_BENCH_MIB` (default 1024), `BATON_KVT_BENCH_ROUNDS` (default 3),
//! `BATON_KVT_BENCH_QUIC_CC` (`cubic`, default; `bbr`; `newreno`), `BATON_KVT_BENCH_ONLY`
//! (comma-separated subset of `quic,quic_dflt,tls_tcp,inproc`), `BATON_KVT_BENCH_SOCKET_MIB` (QUIC's UDP
//! socket buffers; the kernel caps them at `net.core.rmem_max` / `wmem_max`).
//!
//! Every number goes through the full handoff: reserve, grant, frames with checksums,
//! verification, install into the receiver's pool, completion both ways.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_kv_transport::certs::generate_dev_certs;
use baton_kv_transport::transport::inproc::InProcNetwork;
use baton_kv_transport::transport::quic::{QuicCongestion, QuicConnector, QuicListener, QuicTuning};
use baton_kv_transport::transport::tls_tcp::{TlsTcpConnector, TlsTcpListener};
use baton_kv_transport::{
    ArenaPool, BlockId, BlockSink, Connector, KvDtype, KvLayout, KvReceiver, KvSender, Listener,
    ReceiverConfig,
};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Bench {
    name: &'static str,
    sender: KvSender,
    receiver: KvReceiver,
    dst: Arc<ArenaPool>,
    src: Arc<ArenaPool>,
    src_blocks: Vec<BlockId>,
    listener: Box<dyn Listener>,
}

impl Bench {
    /// Ships `n` blocks once; returns the time from reservation to the receiver's completion.
    async fn ship(&self, n: usize) -> Duration {
        let started = Instant::now();
        let res = self
            .receiver
            .reserve(n, Some(Duration::from_secs(30)))
            .expect("reserve");
        self.sender
            .send(
                &self.listener.peer(),
                res.grant(),
                self.src.clone(),
                self.src_blocks[..n].to_vec(),
            )
            .await
            .expect("send");
        let blocks = res.finished().await.expect("finished");
        let took = started.elapsed();
        self.dst.release(&blocks);
        took
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn memcpy_gbps(bytes: usize, rounds: usize) -> f64 {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // fault the pages in
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed());
    }
    gbps(bytes, best)
}

#[tokio::main]
async fn main() {
    let layout = KvLayout::smollm2_135m(KvDtype::F16);
    let total = env_usize("BATON_KVT_BENCH_MIB", 1024) << 20;
    let rounds = env_usize("BATON_KVT_BENCH_ROUNDS", 3).max(1);
    let blocks = total / layout.bytes_per_block();
    let bytes = blocks * layout.bytes_per_block();
    let turns = [150usize, 3_000, 16_000];
    let max_turn_blocks = layout.blocks_for_tokens(16_000);
    let pool_blocks = blocks.max(max_turn_blocks);

    println!(
        "baton-kv-transport benchmark: SmolLM2-135M layout, f16, {} bytes/token, {} bytes/block, {} blocks ({:.2} GiB)",
        layout.bytes_per_token(),
        layout.bytes_per_block(),
        blocks,
        bytes as f64 / (1u64 << 30) as f64
    );

    let src = Arc::new(ArenaPool::new(layout, pool_blocks).expect("source pool"));
    let src_blocks = src.reserve(pool_blocks).expect("source blocks");
    for (i, b) in src_blocks.iter().enumerate() {
        src.fill_block(*b, i as u64).expect("fill");
    }
    let certs = generate_dev_certs("bench", &["decode-0", "prefill-0"]).expect("certs");
    let server = certs.node_tls("decode-0").expect("tls");
    let client = certs.node_tls("prefill-0").expect("tls");
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let mut tuning = QuicTuning::loopback();
    tuning.congestion = match std::env::var("BATON_KVT_BENCH_QUIC_CC").as_deref() {
        Ok("bbr") => QuicCongestion::Bbr,
        Ok("newreno") => QuicCongestion::NewReno,
        _ => QuicCongestion::Cubic,
    };
    if let Ok(mib) = std::env::var("BATON_KVT_BENCH_SOCKET_MIB") {
        tuning.socket_buffer_bytes = mib.parse::<usize>().expect("BATON_KVT_BENCH_SOCKET_MIB: MiB") << 20;
    }
    let net = InProcNetwork::new();

    let mut results = Vec::new();
    let only = std::env::var("BATON_KVT_BENCH_ONLY").unwrap_or_default();
    for name in ["quic", "quic_dflt", "tls_tcp", "inproc"] {
        if !only.is_empty() && !only.split(',').any(|o| o == name) {
            continue;
        }
        let dst = Arc::new(ArenaPool::new(layout, pool_blocks).expect("receiver pool"));
        let receiver = KvReceiver::new(dst.clone(), ReceiverConfig::default()).expect("receiver");
        let mut quic_connector = None;
        let (connector, listener): (Arc<dyn Connector>, Box<dyn Listener>) = match name {
            "quic" | "quic_dflt" => {
                let tuning = if name == "quic" { tuning.clone() } else { QuicTuning::quinn_defaults() };
                let c = Arc::new(QuicConnector::new(&client, &tuning).expect("connector"));
                quic_connector = Some(c.clone());
                let l = QuicListener::bind(loopback, "decode-0", &server, &tuning, receiver.clone()).expect("listener");
                (c, Box::new(l))
            }
            "tls_tcp" => (
                Arc::new(TlsTcpConnector::new(&client).expect("connector")),
                Box::new(
                    TlsTcpListener::bind(loopback, "decode-0", &server, receiver.clone())
                        .await
                        .expect("listener"),
                ),
            ),
            _ => (
                Arc::new(net.connector()),
                Box::new(net.listen("decode-0", receiver.clone()).expect("listener")),
            ),
        };
        let b = Bench {
            name,
            sender: KvSender::new(connector),
            receiver,
            dst,
            src: src.clone(),
            src_blocks: src_blocks.clone(),
            listener,
        };
        // Warm up: connection, MTU discovery, congestion window, page faults in the pool.
        for _ in 0..2 {
            b.ship(blocks.min(512)).await;
        }
        b.ship(blocks).await;
        let mut best = Duration::MAX;
        for _ in 0..rounds {
            best = best.min(b.ship(blocks).await);
        }
        let mut turn_times = Vec::new();
        for tokens in turns {
            let n = layout.blocks_for_tokens(tokens);
            let mut ts = Vec::new();
            for _ in 0..5 {
                ts.push(b.ship(n).await);
            }
            turn_times.push(median(ts));
        }
        println!("  {:<8} {:>6.2} GB/s", b.name, gbps(bytes, best));
        if let Some(c) = &quic_connector {
            for (addr, s) in c.connection_stats() {
                println!(
                    "           quic path to {addr}: mtu {} rtt {:?} lost packets {} congestion events {} udp datagrams tx {} mtu probes {} lost {} black holes {}",
                    s.path.current_mtu, s.path.rtt, s.path.lost_packets, s.path.congestion_events, s.udp_tx.datagrams,
                    s.path.sent_plpmtud_probes, s.path.lost_plpmtud_probes, s.path.black_holes_detected
                );
            }
        }
        results.push((b.name, gbps(bytes, best), turn_times));
    }
    let copy = memcpy_gbps(bytes, rounds);
    println!("  {:<8} {:>6.2} GB/s (ceiling)", "memcpy", copy);

    println!();
    println!("1 GiB of KV blocks, best of {rounds}:");
    for (name, g, _) in &results {
        println!("  {name:<8} {g:>6.2} GB/s");
    }
    println!("  {:<8} {copy:>6.2} GB/s", "memcpy");
    let quic = results.iter().find(|r| r.0 == "quic").map_or(0.0, |r| r.1);
    let dflt = results.iter().find(|r| r.0 == "quic_dflt").map_or(0.0, |r| r.1);
    let tcp = results.iter().find(|r| r.0 == "tls_tcp").map_or(0.0, |r| r.1);
    if quic > 0.0 && dflt > 0.0 {
        println!("  quic / quic_dflt = {:.2} (the tuning against quinn's defaults)", quic / dflt);
    }
    if quic > 0.0 && tcp > 0.0 {
        println!(
            "  quic / tls_tcp = {:.2} (TLS over TCP is {:.2}x QUIC)",
            quic / tcp,
            tcp / quic
        );
    }
    println!();
    println!("Time to ship one turn's KV (reserve -> completed), median of 5:");
    print!("  {:>7} {:>7} {:>10}", "tokens", "blocks", "MB");
    for (name, _, _) in &results {
        print!(" {name:>10}");
    }
    println!();
    for (i, tokens) in turns.iter().enumerate() {
        let n = layout.blocks_for_tokens(*tokens);
        print!(
            "  {:>7} {:>7} {:>10.1}",
            tokens,
            n,
            (n * layout.bytes_per_block()) as f64 / 1e6
        );
        for (_, _, t) in &results {
            print!(" {:>8.2}ms", t[i].as_secs_f64() * 1e3);
        }
        println!();
    }
}
