//! The transport conformance suite: one set of test bodies ([`cases`]) run over every
//! transport by the `suite!` macro at the bottom.
//!
//! Over RDMA (feature `rdma`) every case first checks for a device: without one it prints
//! `SKIPPED: no RDMA device (...)` and returns, or fails when `BATON_REQUIRE_RDMA=1`.
//!
//! Owns: [`Rig`], a receiver pool, a sender pool, a receiver, a sender and a listener wired
//! over one transport, and the checks every test ends with: both pools hold exactly the free
//! blocks they started with, nothing was released twice, and no reservation is left live.

use std::sync::Arc;
use std::time::Duration;

use crate::certs::{generate_dev_certs, NodeTls};
use crate::handoff::{KvReceiver, KvSender, ReceiverConfig, SenderConfig};
use crate::pool::{ArenaPool, BlockSink};
use crate::transport::inproc::InProcNetwork;
use crate::transport::quic::{QuicConnector, QuicListener, QuicTuning};
use crate::transport::tls_tcp::{TlsTcpConnector, TlsTcpListener};
use crate::transport::{Connector, Listener, Peer};
use crate::types::{BlockId, KvLayout};

mod cases;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    InProc,
    Quic,
    TlsTcp,
    #[cfg(feature = "rdma")]
    Rdma,
}

pub(crate) struct Rig {
    pub kind: Kind,
    pub dst: Arc<ArenaPool>,
    pub src: Arc<ArenaPool>,
    pub receiver: KvReceiver,
    pub sender: KvSender,
    pub connector: Arc<dyn Connector>,
    pub listener: Box<dyn Listener>,
    pub peer: Peer,
    net: Option<Arc<InProcNetwork>>,
    tls: Option<(NodeTls, NodeTls)>,
    dst_free: usize,
    src_free: usize,
}

const POOL_BLOCKS: usize = 256;

fn loopback() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 0))
}

impl Rig {
    pub async fn new(kind: Kind, layout: KvLayout) -> Rig {
        let dst = Arc::new(ArenaPool::new(layout, POOL_BLOCKS).unwrap());
        let src = Arc::new(ArenaPool::new(layout, POOL_BLOCKS).unwrap());
        let receiver = KvReceiver::new(
            dst.clone(),
            ReceiverConfig {
                linger: Duration::from_millis(500),
                ..ReceiverConfig::default()
            },
        )
        .unwrap();
        let (connector, listener, net, tls): (Arc<dyn Connector>, Box<dyn Listener>, _, _) =
            match kind {
                Kind::InProc => {
                    let net = InProcNetwork::new();
                    let l = net.listen("decode-0", receiver.clone()).unwrap();
                    (Arc::new(net.connector()), Box::new(l), Some(net), None)
                }
                Kind::Quic => {
                    let (server, client) = node_tls();
                    let tuning = QuicTuning::default();
                    let l = QuicListener::bind(loopback(), "decode-0", &server, &tuning, receiver.clone())
                        .unwrap();
                    let c = QuicConnector::new(&client, &tuning).unwrap();
                    (Arc::new(c), Box::new(l), None, Some((server, client)))
                }
                Kind::TlsTcp => {
                    let (server, client) = node_tls();
                    let l = TlsTcpListener::bind(loopback(), "decode-0", &server, receiver.clone())
                        .await
                        .unwrap();
                    let c = TlsTcpConnector::new(&client).unwrap();
                    (Arc::new(c), Box::new(l), None, Some((server, client)))
                }
                #[cfg(feature = "rdma")]
                Kind::Rdma => {
                    use crate::transport::rdma::{RdmaConnector, RdmaListener};
                    let (server, client) = node_tls();
                    let tuning = QuicTuning::default();
                    // Slots hold the suite's 64 KiB frames; rings cover its concurrent links.
                    let config = crate::transport::select::RdmaConfig {
                        slot_payload_bytes: 1 << 20,
                        slots: 4,
                        rings: 16,
                        ..Default::default()
                    };
                    let l = RdmaListener::bind(loopback(), "decode-0", &server, &tuning, &config, receiver.clone())
                        .unwrap();
                    let c = RdmaConnector::new(&config, &client, &tuning).unwrap();
                    (Arc::new(c), Box::new(l), None, Some((server, client)))
                }
            };
        // Small frames so that a layer spans several frames in the tests.
        let sender = KvSender::with_config(
            connector.clone(),
            SenderConfig {
                frame_bytes: 64 << 10,
            },
        );
        let peer = listener.peer();
        Rig {
            kind,
            dst_free: dst.free_blocks(),
            src_free: src.free_blocks(),
            dst,
            src,
            receiver,
            sender,
            connector,
            listener,
            peer,
            net,
            tls,
        }
    }

    /// `n` source blocks filled with data derived from `seed`.
    pub fn source_blocks(&self, n: usize, seed: u64) -> Vec<BlockId> {
        let blocks = self.src.reserve(n).unwrap();
        for (i, b) in blocks.iter().enumerate() {
            self.src.fill_block(*b, seed.wrapping_mul(1_000_003) + i as u64).unwrap();
        }
        blocks
    }

    /// Asserts `dst` holds exactly the contents of `src`, block by block.
    pub fn assert_same(&self, src: &[BlockId], dst: &[BlockId]) {
        assert_eq!(src.len(), dst.len());
        for (s, d) in src.iter().zip(dst) {
            assert!(
                self.src.read_block(*s).unwrap() == self.dst.read_block(*d).unwrap(),
                "block {d} differs from source block {s}"
            );
        }
    }

    /// Returns test-held blocks and checks the pools are as they started.
    pub fn finish(&self, src: &[BlockId], dst: &[BlockId]) {
        self.src.release(src);
        self.dst.release(dst);
        self.assert_restored();
    }

    pub fn assert_restored(&self) {
        self.assert_receiver_restored();
        assert_eq!(self.src.free_blocks(), self.src_free, "sender pool leaked blocks");
        assert_eq!(self.src.double_releases(), 0, "a block was released twice");
    }

    /// The receiver's pool is back to where it started (the sender's may still be in use).
    pub fn assert_receiver_restored(&self) {
        assert_eq!(self.dst.free_blocks(), self.dst_free, "receiver pool leaked blocks");
        assert_eq!(self.dst.double_releases(), 0, "a block was released twice");
        assert_eq!(self.receiver.live_reservations(), 0);
        assert_eq!(
            self.receiver.stats().snapshot().reservations_live,
            0,
            "live gauge out of step"
        );
    }

    /// A peer that accepts links on this transport and never reads or answers.
    pub async fn silent_peer(&self) -> (Peer, Box<dyn std::any::Any + Send>) {
        match self.kind {
            Kind::InProc => {
                let net = self.net.as_ref().unwrap();
                let mut incoming = net.register("silent").unwrap();
                let task = tokio::spawn(async move {
                    let mut held = Vec::new();
                    while let Some(link) = incoming.recv().await {
                        held.push(link);
                    }
                });
                (Peer::InProc { name: "silent".into() }, Box::new(AbortOnDrop(task)))
            }
            // An RDMA peer that never answers is a control channel that never answers.
            #[cfg(feature = "rdma")]
            Kind::Rdma => self.silent_quic_peer(),
            Kind::Quic => self.silent_quic_peer(),
            Kind::TlsTcp => {
                let l = tokio::net::TcpListener::bind(loopback()).await.unwrap();
                let addr = l.local_addr().unwrap();
                let task = tokio::spawn(async move {
                    let mut held = Vec::new();
                    while let Ok((s, _)) = l.accept().await {
                        held.push(s);
                    }
                });
                (
                    Peer::Net { addr, server_name: "decode-0".into() },
                    Box::new(AbortOnDrop(task)),
                )
            }
        }
    }

    fn silent_quic_peer(&self) -> (Peer, Box<dyn std::any::Any + Send>) {
        let (server, _) = self.tls.as_ref().unwrap();
        let tuning = QuicTuning::default();
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(server.server_config(crate::certs::ALPN).unwrap())
                .unwrap();
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        sc.transport_config(Arc::new(
            crate::transport::quic::transport_config(&tuning).unwrap(),
        ));
        let ep = crate::transport::quic::endpoint(loopback(), &tuning, Some(sc)).unwrap();
        let addr = ep.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(inc) = ep.accept().await {
                if let Ok(conn) = inc.await {
                    while let Ok(s) = conn.accept_bi().await {
                        held.push(s);
                    }
                }
            }
        });
        (
            Peer::Net { addr, server_name: "decode-0".into() },
            Box::new(AbortOnDrop(task)),
        )
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn node_tls() -> (NodeTls, NodeTls) {
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
    (
        certs.node_tls("decode-0").unwrap(),
        certs.node_tls("prefill-0").unwrap(),
    )
}

macro_rules! per_transport {
    ($module:ident, $kind:expr, [$($name:ident),*]) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::conformance::cases::$name($kind).await
                }
            )*
        }
    };
}

/// Over RDMA each case runs only where a device exists, and says so when it does not.
#[cfg(feature = "rdma")]
macro_rules! per_rdma {
    ([$($name:ident),*]) => {
        mod rdma {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if !crate::transport::rdma::tests::device_available(
                        concat!("conformance::rdma::", stringify!($name)),
                    ) {
                        return;
                    }
                    crate::conformance::cases::$name(crate::conformance::Kind::Rdma).await
                }
            )*
        }
    };
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        per_transport!(inproc, crate::conformance::Kind::InProc, [$($name),*]);
        per_transport!(quic, crate::conformance::Kind::Quic, [$($name),*]);
        per_transport!(tls_tcp, crate::conformance::Kind::TlsTcp, [$($name),*]);
        #[cfg(feature = "rdma")]
        per_rdma!([$($name),*]);
    };
}

suite!(
    round_trip_bit_exact,
    layer_by_layer_arrival,
    pipelined_layer_runs_land_bit_exact,
    pipelined_device_layer_runs_land_bit_exact,
    pipelined_missing_layer_is_never_adopted,
    partial_layer_range,
    skipped_block_layers_stay_off_the_wire,
    corrupted_payload_is_detected_and_not_installed,
    unknown_or_stale_reservation_is_rejected,
    expired_reservation_is_released_once_and_rejects_late_frames,
    silent_sender_is_released_at_deadline,
    sender_dropped_mid_transfer_releases,
    sender_task_aborted_mid_transfer_releases,
    receiver_gone_sender_fails_within_deadline,
    silent_receiver_sender_fails_by_deadline,
    cancel_from_receiver,
    cancel_from_sender,
    incomplete_transfer_is_rejected,
    hostile_frames_are_rejected,
    concurrent_transfers_are_isolated,
    a_first_frame_cannot_make_the_receiver_allocate,
);
