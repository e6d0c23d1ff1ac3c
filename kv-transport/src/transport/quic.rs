//! QUIC transport (quinn, TLS 1.3 with mutual authentication): the default between nodes.
//!
//! Owns: [`QuicListener`], [`QuicConnector`] and [`QuicTuning`]. One QUIC connection per
//! peer is kept and reused; every transfer is one bidirectional stream on it, so transfers
//! never block each other's reservations and a handshake is paid once per peer.
//! Invariants: both ends authenticate against the cluster CA ([`NodeTls`]); a connection
//! that fails is dropped from the cache and redialled once; listener shutdown closes the
//! endpoint, so every peer learns at once instead of waiting for an idle timeout.
//!
//! Tuning (measured on loopback, see the crate benchmark): what matters is datagram size
//! and windows. [`QuicTuning::loopback`] lets MTU discovery climb to 64 KiB datagrams with
//! segmentation offload off (quinn's 10-datagram GSO batches of large datagrams exceed the
//! kernel's 64 KiB limit and vanish, which black-hole detection answers by dropping to 1200
//! bytes); stream and connection windows are sized for a whole turn, socket buffers are
//! 4 MiB, and 1 MiB frames are written as three chunks without copying the payload.

use baton_identity::Identity;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{IdleTimeout, MtuDiscoveryConfig, VarInt};
use tokio::task::JoinSet;

use crate::certs::NodeTls;
use crate::error::{Error, Result};
use crate::handoff::frame::{read_frame_within, Frame, FrameLimits};
use crate::handoff::KvReceiver;
use crate::transport::{BoxFuture, BudgetPermit, ConnBudget, Connector, Link, LinkRx, LinkTx, Listener, Peer, StreamLimits};

const NAME: &str = "quic";

/// Knobs of the QUIC transport. The defaults are tuned for bulk KV transfer.
#[derive(Clone, Debug)]
pub struct QuicTuning {
    /// MTU used before discovery; 1200 is safe on any path.
    pub initial_mtu: u16,
    /// MTU the path is known to carry: black-hole detection never goes below it, and
    /// Initial datagrams are padded to it. Keep 1200 unless every path is known.
    pub min_mtu: u16,
    /// Largest UDP payload MTU discovery may try. Above 6553 (10 datagrams per GSO batch
    /// would pass 64 KiB), `segmentation_offload` must be off.
    pub max_udp_payload: u16,
    /// Bytes a peer may send on one stream before it is read.
    pub stream_receive_window: u32,
    /// Bytes a peer may send on a connection before it is read.
    pub receive_window: u64,
    /// Bytes this end buffers for sending on a connection.
    pub send_window: u64,
    /// Kernel socket buffer size asked for (the kernel may cap it); 0 keeps the kernel's default.
    pub socket_buffer_bytes: usize,
    /// A connection with no traffic for this long is dead.
    pub idle_timeout: Duration,
    /// Keep-alive interval, well under `idle_timeout`.
    pub keep_alive: Duration,
    /// Congestion controller.
    pub congestion: QuicCongestion,
    /// Batch datagrams into one `sendmsg` (GSO). Only safe while 10 datagrams fit in 64 KiB.
    pub segmentation_offload: bool,
}

/// Which congestion controller quinn runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuicCongestion {
    Cubic,
    NewReno,
    /// quinn's BBR (v1, marked experimental upstream): does not back off on every loss.
    Bbr,
}

impl QuicTuning {
    /// For paths that carry datagrams larger than 1500 bytes (loopback, jumbo-frame fabrics):
    /// the handshake runs at 1200 bytes, then MTU discovery climbs to `max_udp_payload`.
    ///
    /// Segmentation offload (GSO) is turned off: quinn batches up to 10 datagrams per
    /// `sendmsg`, and a batch over 64 KiB is refused by the kernel and silently lost, which
    /// looks like a black hole and drops the MTU back to 1200 (what happened with the
    /// defaults here). Starting the handshake at a large MTU instead failed to connect in
    /// about a third of the attempts on the development VM, so discovery does the climbing.
    pub fn large_datagrams(max_udp_payload: u16) -> Self {
        QuicTuning {
            max_udp_payload: max_udp_payload.max(1200),
            segmentation_offload: false,
            ..QuicTuning::default()
        }
    }

    /// Both ends on one machine (single-machine clusters, the benchmark).
    pub fn loopback() -> Self {
        Self::large_datagrams(65_507)
    }

    /// quinn's own defaults, untuned: the baseline the benchmark measures the tuning
    /// against. Windows sized for 100 Mbit/s at 100 ms (1.25 MB a stream, 10 MB of send
    /// buffer), 1452-byte datagrams at most, and the kernel's socket buffers.
    pub fn quinn_defaults() -> Self {
        QuicTuning {
            stream_receive_window: 1_250_000,
            receive_window: (1 << 62) - 1,
            send_window: 10_000_000,
            socket_buffer_bytes: 0,
            ..QuicTuning::default()
        }
    }
}

impl Default for QuicTuning {
    fn default() -> Self {
        QuicTuning {
            initial_mtu: 1200,
            min_mtu: 1200,
            // Ethernet's 1500 less headers: safe with GSO (10 x 1452 < 64 KiB). Larger
            // datagrams need `large_datagrams`, which turns GSO off.
            max_udp_payload: 1452,
            stream_receive_window: 64 << 20,
            receive_window: 256 << 20,
            send_window: 256 << 20,
            socket_buffer_bytes: 4 << 20,
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            congestion: QuicCongestion::Cubic,
            segmentation_offload: true,
        }
    }
}

fn quic_err(what: &'static str) -> impl Fn(String) -> Error {
    move |detail| Error::Link {
        transport: NAME,
        detail: format!("{what}: {detail}"),
    }
}

pub(crate) fn transport_config(t: &QuicTuning) -> Result<quinn::TransportConfig> {
    let mut c = quinn::TransportConfig::default();
    c.stream_receive_window(VarInt::from_u32(t.stream_receive_window));
    c.receive_window(
        VarInt::from_u64(t.receive_window)
            .map_err(|e| quic_err("receive window")(e.to_string()))?,
    );
    c.send_window(t.send_window);
    c.enable_segmentation_offload(t.segmentation_offload);
    c.initial_mtu(t.initial_mtu);
    c.min_mtu(t.min_mtu);
    if t.max_udp_payload > t.initial_mtu {
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(t.max_udp_payload);
        c.mtu_discovery_config(Some(mtu));
    } else {
        c.mtu_discovery_config(None);
    }
    match t.congestion {
        QuicCongestion::Cubic => {}
        QuicCongestion::NewReno => {
            c.congestion_controller_factory(Arc::new(quinn::congestion::NewRenoConfig::default()));
        }
        QuicCongestion::Bbr => {
            c.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
        }
    }
    c.max_idle_timeout(Some(
        IdleTimeout::try_from(t.idle_timeout).map_err(|e| quic_err("idle timeout")(e.to_string()))?,
    ));
    c.keep_alive_interval(Some(t.keep_alive));
    c.max_concurrent_bidi_streams(VarInt::from_u32(1024));
    c.max_concurrent_uni_streams(VarInt::from_u32(0));
    c.datagram_receive_buffer_size(None);
    Ok(c)
}

pub(crate) fn endpoint(
    bind: SocketAddr,
    t: &QuicTuning,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |e| Error::io("binding a QUIC socket", e);
    let s = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP)).map_err(io)?;
    // Best effort: the kernel caps these at its maximum; smaller only costs throughput.
    if t.socket_buffer_bytes > 0 {
        let _ = s.set_recv_buffer_size(t.socket_buffer_bytes);
        let _ = s.set_send_buffer_size(t.socket_buffer_bytes);
    }
    s.bind(&bind.into()).map_err(io)?;
    let mut ec = quinn::EndpointConfig::default();
    ec.max_udp_payload_size(t.max_udp_payload)
        .map_err(|e| quic_err("max UDP payload")(e.to_string()))?;
    quinn::Endpoint::new(ec, server, s.into(), Arc::new(quinn::TokioRuntime))
        .map_err(io)
}

struct QuicTx(quinn::SendStream);
struct QuicRx {
    recv: quinn::RecvStream,
    limits: StreamLimits,
    /// The connection's frame budget (a listener's links; None for a sender's replies).
    budget: Option<ConnBudget>,
    /// The last frame's bytes, held until the link asks for the next frame (by then the
    /// receiver installed it) or drops.
    held: Option<BudgetPermit>,
}

impl LinkTx for QuicTx {
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut chunks = [
                Bytes::copy_from_slice(&frame.header.encode()),
                frame.payload,
                Bytes::copy_from_slice(&frame.checksum.to_le_bytes()),
            ];
            self.0
                .write_all_chunks(&mut chunks)
                .await
                .map_err(|e| quic_err("write")(e.to_string()))
        })
    }
}

impl LinkRx for QuicRx {
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>> {
        Box::pin(async move {
            self.held = None;
            let read = read_frame_within(&mut self.recv, &self.limits.next(), self.budget.as_ref()).await;
            let frame = self.limits.read(read)?.map(|(frame, permit)| {
                self.held = permit;
                frame
            });
            Ok(frame)
        })
    }

    fn limit(&mut self, limits: FrameLimits) {
        self.limits.tighten(limits);
    }
}

fn link(send: quinn::SendStream, recv: quinn::RecvStream, limits: FrameLimits, peer: Option<Identity>, budget: Option<ConnBudget>) -> Link {
    Link {
        tx: Box::new(QuicTx(send)),
        rx: Box::new(QuicRx { recv, limits: StreamLimits::new(limits), budget, held: None }),
        transport: NAME,
        peer,
    }
}

/// Accepts QUIC connections and serves each stream as one transfer.
pub struct QuicListener {
    endpoint: quinn::Endpoint,
    peer: Peer,
    task: tokio::task::AbortHandle,
    conns: PeerConns,
}

/// QUIC application close code of a connection refused because its certificate already
/// holds the most live connections the listener allows.
pub const TOO_MANY_CONNECTIONS: u32 = 0x4b01;
const TOO_MANY_CONNECTIONS_REASON: &[u8] = b"too many connections from this certificate";

/// Live connections per peer identity (None: a certificate that names no identity, all
/// such counted together). Each connection reads frames under its own budget, so without
/// this count one certificate could multiply the memory it pins by dialling again.
#[derive(Clone)]
struct PeerConns {
    cap: u32,
    live: Arc<Mutex<HashMap<Option<Identity>, u32>>>,
}

/// One connection's place in [`PeerConns`], given back when the connection's task ends.
struct PeerConnSlot {
    conns: PeerConns,
    peer: Option<Identity>,
}

impl PeerConns {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Option<Identity>, u32>> {
        // Every critical section is a counter update that cannot panic half-way.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, peer: &Option<Identity>) -> u32 {
        self.lock().get(peer).copied().unwrap_or(0)
    }

    /// A place for one more connection of `peer`, or None when it holds `cap` already.
    fn claim(&self, peer: &Option<Identity>) -> Option<PeerConnSlot> {
        let mut live = self.lock();
        let n = live.entry(peer.clone()).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(PeerConnSlot { conns: self.clone(), peer: peer.clone() })
    }
}

impl Drop for PeerConnSlot {
    fn drop(&mut self) {
        let mut live = self.conns.lock();
        if let Some(n) = live.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.peer);
            }
        }
    }
}

impl QuicListener {
    /// Binds `addr` (port 0 for any) and serves links with `receiver`. `server_name` is the
    /// name senders dial, which must be in this node's certificate. Needs a Tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        server_name: &str,
        tls: &NodeTls,
        tuning: &QuicTuning,
        receiver: KvReceiver,
    ) -> Result<Self> {
        let limits = receiver.frame_limits();
        let budget = Some((receiver.connection_budget(), receiver.frame_bytes_counter()));
        let per_peer = receiver.max_connections_per_peer();
        let handler: StreamHandler = Arc::new(move |send, recv, peer, budget| {
            let receiver = receiver.clone();
            Box::pin(async move { receiver.serve_link(link(send, recv, limits, peer, budget)).await })
        });
        Self::bind_streams(addr, server_name, tls, tuning, handler, budget, per_peer)
    }

    /// Like [`QuicListener::bind`], but every accepted stream goes to `handler` (the RDMA
    /// transport uses the streams as its control channel). With `budget` (bytes, and the
    /// receiver-wide count of bytes held), each connection's streams share one
    /// [`ConnBudget`] of that many bytes. One peer certificate holds at most `per_peer`
    /// live connections; the next is closed at once with [`TOO_MANY_CONNECTIONS`].
    pub(crate) fn bind_streams(
        addr: SocketAddr,
        server_name: &str,
        tls: &NodeTls,
        tuning: &QuicTuning,
        handler: StreamHandler,
        budget: Option<(u32, Arc<AtomicU64>)>,
        per_peer: u32,
    ) -> Result<Self> {
        let conns = PeerConns { cap: per_peer, live: Arc::default() };
        let crypto = QuicServerConfig::try_from(tls.server_config(crate::certs::ALPN)?)
            .map_err(|e| Error::Tls { detail: e.to_string() })?;
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        sc.transport_config(Arc::new(transport_config(tuning)?));
        let endpoint = endpoint(addr, tuning, Some(sc))?;
        let local = endpoint
            .local_addr()
            .map_err(|e| Error::io("reading the QUIC listener address", e))?;
        let ep = endpoint.clone();
        let listener_conns = conns.clone();
        let task = tokio::spawn(async move {
            let mut tasks = JoinSet::new();
            loop {
                tokio::select! {
                    incoming = ep.accept() => match incoming {
                        Some(incoming) => {
                            let budget = budget.as_ref().map(|(bytes, held)| ConnBudget::new(*bytes, held.clone()));
                            tasks.spawn(serve_connection(incoming, handler.clone(), budget, conns.clone()));
                        }
                        None => break,
                    },
                    Some(_) = tasks.join_next() => {}
                }
            }
        });
        Ok(QuicListener {
            endpoint,
            peer: Peer::Net {
                addr: local,
                server_name: server_name.to_string(),
            },
            task: task.abort_handle(),
            conns: listener_conns,
        })
    }

    /// Live connections whose client certificate names `peer`.
    pub fn live_connections(&self, peer: &Identity) -> u32 {
        self.conns.count(&Some(peer.clone()))
    }

    pub fn local_addr(&self) -> SocketAddr {
        match &self.peer {
            Peer::Net { addr, .. } => *addr,
            Peer::InProc { .. } => unreachable!("a QUIC listener has a network address"),
        }
    }
}

/// What a listener does with each accepted bidirectional stream, given the identity the
/// connection's client certificate names and the connection's frame budget.
pub(crate) type StreamHandler = Arc<
    dyn Fn(quinn::SendStream, quinn::RecvStream, Option<Identity>, Option<ConnBudget>) -> BoxFuture<'static, ()> + Send + Sync,
>;

/// The identity the connection's (already verified) client certificate names.
fn peer_identity(conn: &quinn::Connection) -> Option<Identity> {
    let certs = conn.peer_identity()?.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()?;
    Identity::from_cert_der(certs.first()?).ok()
}

async fn serve_connection(incoming: quinn::Incoming, handler: StreamHandler, budget: Option<ConnBudget>, conns: PeerConns) {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(error = %e, "QUIC handshake failed");
            return;
        }
    };
    let peer = peer_identity(&conn);
    // Held until this task ends, i.e. after the connection and all its streams are gone.
    let Some(_slot) = conns.claim(&peer) else {
        tracing::warn!(
            peer = %peer.as_ref().map_or_else(|| "unnamed".to_string(), |p| p.to_string()),
            cap = conns.cap,
            remote = %conn.remote_address(),
            "QUIC connection refused: too many connections from this certificate"
        );
        conn.close(VarInt::from_u32(TOO_MANY_CONNECTIONS), TOO_MANY_CONNECTIONS_REASON);
        return;
    };
    let mut streams = JoinSet::new();
    loop {
        tokio::select! {
            s = conn.accept_bi() => match s {
                Ok((send, recv)) => {
                    streams.spawn(handler(send, recv, peer.clone(), budget.clone()));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "QUIC connection ended");
                    break;
                }
            },
            Some(_) = streams.join_next() => {}
        }
    }
    // The connection is gone: the streams' links fail on their own; let them report.
    while streams.join_next().await.is_some() {}
}

impl Listener for QuicListener {
    fn transport(&self) -> &'static str {
        NAME
    }
    fn peer(&self) -> Peer {
        self.peer.clone()
    }
    fn shutdown(&self) {
        self.endpoint.close(VarInt::from_u32(0), b"shutdown");
        self.task.abort();
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens streams to QUIC listeners, one cached connection per peer.
pub struct QuicConnector {
    endpoint: quinn::Endpoint,
    conns: Mutex<HashMap<(SocketAddr, String), quinn::Connection>>,
}

impl QuicConnector {
    /// A connector on an IPv4 ephemeral port. Needs a Tokio runtime.
    pub fn new(tls: &NodeTls, tuning: &QuicTuning) -> Result<Self> {
        Self::bind(SocketAddr::from(([0, 0, 0, 0], 0)), tls, tuning)
    }

    /// A connector bound to `bind`.
    pub fn bind(bind: SocketAddr, tls: &NodeTls, tuning: &QuicTuning) -> Result<Self> {
        let crypto = QuicClientConfig::try_from(tls.client_config(crate::certs::ALPN)?)
            .map_err(|e| Error::Tls { detail: e.to_string() })?;
        let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
        cc.transport_config(Arc::new(transport_config(tuning)?));
        let mut endpoint = endpoint(bind, tuning, None)?;
        endpoint.set_default_client_config(cc);
        Ok(QuicConnector {
            endpoint,
            conns: Mutex::new(HashMap::new()),
        })
    }

    /// quinn's statistics of every cached connection (path MTU, RTT, losses, congestion
    /// events): what to look at when QUIC throughput disappoints.
    pub fn connection_stats(&self) -> Vec<(SocketAddr, quinn::ConnectionStats)> {
        self.cache()
            .iter()
            .map(|((addr, _), c)| (*addr, c.stats()))
            .collect()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<(SocketAddr, String), quinn::Connection>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn connection(&self, addr: SocketAddr, name: &str) -> Result<quinn::Connection> {
        let key = (addr, name.to_string());
        if let Some(c) = self.cache().get(&key) {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        let refused = |detail: String| Error::Connect {
            transport: NAME,
            peer: format!("{name}@{addr}"),
            detail,
        };
        let conn = self
            .endpoint
            .connect(addr, name)
            .map_err(|e| refused(e.to_string()))?
            .await
            .map_err(|e| refused(e.to_string()))?;
        self.cache().insert(key, conn.clone());
        Ok(conn)
    }
}

impl Connector for QuicConnector {
    fn transport(&self) -> &'static str {
        NAME
    }

    fn open<'a>(&'a self, peer: &'a Peer) -> BoxFuture<'a, Result<Link>> {
        Box::pin(async move {
            let (send, recv) = self.open_stream(peer).await?;
            // Replies are control frames: no payload larger than the default cap.
            Ok(link(send, recv, FrameLimits { max_payload: 0 }, None, None))
        })
    }
}

impl QuicConnector {
    /// Opens one bidirectional stream to `peer` on the cached connection (redialled once if
    /// it died). The RDMA transport uses it as its control channel.
    pub(crate) async fn open_stream(
        &self,
        peer: &Peer,
    ) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        let Peer::Net { addr, server_name } = peer else {
            return Err(Error::InvalidArgument {
                what: "the QUIC transport needs a network peer",
            });
        };
        let mut last = None;
        for _ in 0..2 {
            let conn = self.connection(*addr, server_name).await?;
            match conn.open_bi().await {
                Ok(streams) => return Ok(streams),
                Err(e) => {
                    // A dead cached connection: forget it and dial again once.
                    self.cache().remove(&(*addr, server_name.clone()));
                    last = Some(e);
                }
            }
        }
        Err(Error::Connect {
            transport: NAME,
            peer: peer.to_string(),
            detail: last.map_or_else(String::new, |e| e.to_string()),
        })
    }
}
