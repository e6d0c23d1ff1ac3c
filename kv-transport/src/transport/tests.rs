//! Transport-specific tests that the conformance suite does not cover: mutual TLS refuses
//! peers outside the cluster CA, and the tuned QUIC presets carry a transfer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::certs::{generate_dev_certs, NodeTls};
use crate::handoff::{KvReceiver, KvSender, ReceiverConfig};
use crate::pool::{ArenaPool, BlockSink};
use crate::transport::quic::{QuicCongestion, QuicConnector, QuicListener, QuicTuning};
use crate::transport::tls_tcp::{TlsTcpConnector, TlsTcpListener};
use crate::transport::{Connector, Listener};
use crate::types::{KvDtype, KvLayout};

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    block_tokens: 16,
    kv_heads: 1,
    head_dim: 8,
    dtype: KvDtype::Bf16,
};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A client that trusts the cluster CA but presents a certificate from another CA.
fn impostor(cluster_ca_pem: &str) -> NodeTls {
    let other = generate_dev_certs("other", &["prefill-0"]).unwrap();
    let n = &other.nodes[0];
    NodeTls::from_pem(cluster_ca_pem, &n.cert_pem, &n.key_pem).unwrap()
}

/// A decode node listening on both TLS transports with `server`'s certificate: its
/// receiver over an 8-block pool, and an 8-block pool for the sending side.
struct Node {
    dst: Arc<ArenaPool>,
    src: Arc<ArenaPool>,
    receiver: KvReceiver,
    tuning: QuicTuning,
    quic: QuicListener,
    tcp: TlsTcpListener,
}

async fn node(server: &NodeTls) -> Node {
    let dst = Arc::new(ArenaPool::new(LAYOUT, 8).unwrap());
    let src = Arc::new(ArenaPool::new(LAYOUT, 8).unwrap());
    let receiver = KvReceiver::new(dst.clone(), ReceiverConfig::default()).unwrap();
    let tuning = QuicTuning::default();
    let quic = QuicListener::bind(loopback(), "decode-0", server, &tuning, receiver.clone()).unwrap();
    let tcp = TlsTcpListener::bind(loopback(), "decode-0", server, receiver.clone()).await.unwrap();
    Node { dst, src, receiver, tuning, quic, tcp }
}

async fn attempt(connector: Arc<dyn Connector>, listener: &dyn Listener, receiver: &KvReceiver, src: Arc<ArenaPool>) -> crate::Result<()> {
    let res = receiver.reserve(2, Some(Duration::from_secs(3))).unwrap();
    let blocks = src.reserve(2).unwrap();
    let r = KvSender::new(connector)
        .send(&listener.peer(), res.grant(), src.clone(), blocks.clone())
        .await;
    src.release(&blocks);
    if r.is_ok() {
        res.finished().await.map(|b| receiver_release(receiver, b))
    } else {
        drop(res);
        r
    }
}

fn receiver_release(_r: &KvReceiver, _b: Vec<crate::BlockId>) {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_clients_outside_the_cluster() {
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
    let server = certs.node_tls("decode-0").unwrap();
    let bad_client = impostor(&certs.ca_cert_pem);
    let untrusting = generate_dev_certs("other", &["prefill-0"]).unwrap().node_tls("prefill-0").unwrap();
    let Node { dst, src, receiver, tuning, quic, tcp } = node(&server).await;
    for client in [&bad_client, &untrusting] {
        let qc: Arc<dyn Connector> = Arc::new(QuicConnector::new(client, &tuning).unwrap());
        assert!(attempt(qc, &quic, &receiver, src.clone()).await.is_err());
        let tc: Arc<dyn Connector> = Arc::new(TlsTcpConnector::new(client).unwrap());
        assert!(attempt(tc, &tcp, &receiver, src.clone()).await.is_err());
    }
    assert_eq!(dst.layer_writes(), 0, "an unauthenticated peer wrote into the pool");
    assert_eq!(dst.free_blocks(), 8);
    assert_eq!(src.free_blocks(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tuned_quic_presets_carry_a_transfer() {
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
    let server = certs.node_tls("decode-0").unwrap();
    let client = certs.node_tls("prefill-0").unwrap();
    let bbr = QuicTuning {
        congestion: QuicCongestion::Bbr,
        ..QuicTuning::default()
    };
    let mut reno = QuicTuning::large_datagrams(8972);
    reno.congestion = QuicCongestion::NewReno;
    for tuning in [QuicTuning::loopback(), QuicTuning::default(), QuicTuning::quinn_defaults(), bbr, reno] {
        let dst = Arc::new(ArenaPool::new(LAYOUT, 64).unwrap());
        let src = Arc::new(ArenaPool::new(LAYOUT, 64).unwrap());
        let receiver = KvReceiver::new(dst.clone(), ReceiverConfig::default()).unwrap();
        let l = QuicListener::bind(loopback(), "decode-0", &server, &tuning, receiver.clone()).unwrap();
        let c: Arc<dyn Connector> = Arc::new(QuicConnector::new(&client, &tuning).unwrap());
        let res = receiver.reserve(64, Some(Duration::from_secs(20))).unwrap();
        let blocks = src.reserve(64).unwrap();
        for b in &blocks {
            src.fill_block(*b, u64::from(b.0)).unwrap();
        }
        let r = KvSender::new(c)
            .send(&l.peer(), res.grant(), src.clone(), blocks.clone())
            .await;
        assert!(r.is_ok(), "{tuning:?}: {r:?}");
        let got = res.finished().await.unwrap();
        for (s, d) in blocks.iter().zip(&got) {
            assert_eq!(src.read_block(*s).unwrap(), dst.read_block(*d).unwrap());
        }
        dst.release(&got);
        src.release(&blocks);
        assert_eq!(dst.free_blocks(), 64);
    }
}


#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_filled_only_by_the_node_it_was_issued_to() {
    use baton_identity::{Expect, Role};
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0", "prefill-1"]).unwrap();
    let server = certs.node_tls("decode-0").unwrap();
    let Node { dst, src, receiver, tuning, quic, tcp } = node(&server).await;
    let listeners: [&dyn Listener; 2] = [&quic, &tcp];
    for listener in listeners {
        let connector = |name: &str| -> Arc<dyn Connector> {
            let tls = certs.node_tls(name).unwrap();
            if listener.transport() == "quic" {
                Arc::new(QuicConnector::new(&tls, &tuning).unwrap())
            } else {
                Arc::new(TlsTcpConnector::new(&tls).unwrap())
            }
        };
        let res = receiver.reserve(2, Some(Duration::from_secs(5))).unwrap();
        res.only_from(Expect::Node { role: Role::Prefill, name: "prefill-0".into() });
        let blocks = src.reserve(2).unwrap();
        // Another prefill node of the same cluster holds the grant's bytes: refused, and
        // the reservation stays open for the node it was issued to.
        let writes = dst.layer_writes();
        let stolen = KvSender::new(connector("prefill-1")).send(&listener.peer(), res.grant(), src.clone(), blocks.clone()).await;
        assert!(stolen.is_err(), "{}: prefill-1 filled prefill-0's grant", listener.transport());
        assert_eq!(dst.layer_writes(), writes, "the refused sender wrote nothing");
        KvSender::new(connector("prefill-0")).send(&listener.peer(), res.grant(), src.clone(), blocks.clone()).await.unwrap();
        let got = res.finished().await.unwrap();
        dst.release(&got);
        src.release(&blocks);
    }
    assert_eq!(dst.free_blocks(), 8);
}
