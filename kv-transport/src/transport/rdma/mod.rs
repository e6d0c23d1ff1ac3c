//! RDMA transport (cargo feature `rdma`): reliable-connected queue pairs through libibverbs,
//! set up over the QUIC control channel.
//!
//! Owns: [`RdmaConnector`] and [`RdmaListener`]. Each link is one QUIC stream (the control
//! channel: queue-pair exchange, credits, the receiver's replies, the goodbye; see
//! [`setup`]) plus one RC queue pair per end. The sender writes every frame (header,
//! payload, checksum) with one RDMA WRITE WITH IMMEDIATE into a slot of a ring on the
//! receiver; the completion's immediate data tells the receiver which frame landed.
//!
//! **Staging ring, not direct placement.** Frames land in a per-link ring of slots that the
//! listener registered once at start (one registration per ring, so a peer's rkey reaches
//! only its own ring), and the receiver copies each checked frame into the reserved blocks
//! through [`BlockSink`](crate::BlockSink) like every other transport. Writing straight
//! into reserved blocks would need the pool's memory registered for remote write; a
//! one-sided write cannot be refused by the receiver, so any peer holding that key could
//! overwrite blocks outside its reservation (including installed ones), which breaks the
//! handoff's rule that only checked frames for a live reservation touch the pool. Direct
//! placement needs memory windows bound per reservation; it is not done.
//!
//! **Receive rings in device memory** ([`RdmaConfig::ring_memory`], [`memory`]): the rings
//! may live in accelerator memory the node supplies ([`RingMemory`](crate::transport::device_memory::RingMemory),
//! a neutral description: this crate has no CUDA), registered with `ibv_reg_dmabuf_mr`
//! through its dma-buf ([`dmabuf`]), so the NIC writes frames straight into GPU memory.
//! Security is unchanged: still one registration per ring, each page-aligned, so a peer's
//! rkey reaches only its own ring and never the engine's KV arena. A `Data` frame stays
//! in its slot: its header and trailer come to the host (48 bytes), the checksum over header
//! and payload is computed by the GPU ([`DeviceCopy::checksum`](crate::transport::device_memory::DeviceCopy::checksum)),
//! and the frame carries a [`DevicePayload`](crate::transport::device_memory::DevicePayload)
//! that holds the slot. The receiver checks it like any frame ([`Frame::verify`](crate::handoff::frame::Frame::verify)
//! compares the device's checksum with the trailer) and installs it with a device-to-device
//! copy into a staging pool in the same GPU's memory ([`crate::ArenaPool::on_device`]), from
//! which the engine copies it into its arena on the device: no payload byte crosses to the
//! host. A sink in host memory gets the payload through the host. The slot's credit goes
//! back only when the frame is dropped (credits stay in order). Other frames (`Open`,
//! `Done`) are copied out and checked on the host. Where the registration is refused (no
//! `ibv_reg_dmabuf_mr` in this libibverbs, `EOPNOTSUPP` from the driver, a bad fd, memory
//! too small or unaligned) the rings go to host memory and [`RdmaListener::placement`] says
//! why.
//!
//! **Send rings in device memory** ([`RdmaConfig::send_ring_memory`]): the connector's
//! rings may live in GPU memory too, registered through its dma-buf for local access only
//! (their key never leaves the node). A layer the engine packed and kept on its GPU
//! ([`Transfer::send_device_blocks`](crate::Transfer::send_device_blocks)) is copied
//! device to device into a slot, behind a header written from the host; the GPU computes
//! the trailer's checksum over the slot's header and payload, and the NIC reads the frame
//! from the slot ([`send_slot`]): the payload never crosses to the host, on either end when
//! both rings are on GPUs. With host send rings a device payload is copied once, off the
//! device straight into its slot, and checksummed there; a host frame into a device slot is
//! one copy in. [`RdmaConnector::placement`] says where the send rings went and why.
//!
//! The connector registers its send rings once too. Without an RDMA device (no kernel
//! support, no device, port down) [`RdmaConnector::new`] and [`RdmaListener::bind`] fail
//! with [`Error::RdmaUnavailable`] naming the cause, and
//! [`bind_node_transport`](crate::transport::select::bind_node_transport) falls back to QUIC.
//! Invariants: see `link.rs` (sequence, credits, drop order) and [`ring`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::certs::NodeTls;
use crate::error::{Error, Result, KINDS};
use crate::handoff::frame::{HEADER_LEN, TRAILER_LEN};
use crate::handoff::KvReceiver;
use crate::transport::quic::{QuicConnector, QuicListener, QuicTuning, StreamHandler};
use crate::transport::select::{RdmaConfig, RingPlacement};
use crate::transport::{BoxFuture, Connector, Link, Listener, Peer};

pub mod dmabuf;
mod link;
pub mod memory;
pub mod ring;
mod send_slot;
pub mod setup;
pub mod verbs;

use link::{RecvArena, SendArena, NAME};
use ring::{RingGeometry, RingPool};
use setup::{read_msg, write_msg, Msg, RingInfo, SETUP_VERSION};
use memory::{RingRegion, Rings};
use verbs::{Device, QueuePair};

/// How long either end waits for the other's half of the set-up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens the device `config` names: what a node calls to learn whether RDMA is usable.
pub fn probe(config: &RdmaConfig) -> Result<String> {
    Device::open(config).map(|d| d.name.clone())
}

/// Slot size for `payload` bytes of frame payload.
fn slot_bytes(payload: u32) -> Result<u32> {
    payload
        .checked_add((HEADER_LEN + TRAILER_LEN) as u32)
        .ok_or(Error::InvalidArgument {
            what: "RDMA slot size overflows",
        })
}

/// Opens RDMA links to [`RdmaListener`]s.
pub struct RdmaConnector {
    quic: QuicConnector,
    device: Arc<Device>,
    arena: Arc<SendArena>,
    rings: RingPool,
    placement: RingPlacement,
}

impl RdmaConnector {
    /// Opens the device and registers the send rings (one local registration, in the
    /// memory `config.send_ring_memory` names, else host memory); the control channel is a
    /// QUIC connector with `tls` and `tuning`. Needs a Tokio runtime.
    pub fn new(config: &RdmaConfig, tls: &NodeTls, tuning: &QuicTuning) -> Result<Self> {
        let device = Device::open(config)?;
        let geometry = RingGeometry::new(config.rings, config.slots, slot_bytes(config.slot_payload_bytes)?)?;
        let (region, keys, placement) = RingRegion::register(&device, &config.send_ring_memory, Rings::Send, 1, geometry.region_bytes().unwrap_or(0))?;
        let arena = Arc::new(SendArena {
            region,
            lkey: keys[0].lkey,
            geometry,
        });
        Ok(RdmaConnector {
            quic: QuicConnector::new(tls, tuning)?,
            device,
            arena,
            rings: RingPool::new(config.rings),
            placement,
        })
    }

    /// Where the send rings live (and why not in device memory, if that was refused).
    pub fn placement(&self) -> &RingPlacement {
        &self.placement
    }

    async fn open_link(&self, peer: &Peer) -> Result<Link> {
        let refused = |detail: String| Error::Connect {
            transport: NAME,
            peer: peer.to_string(),
            detail,
        };
        let lease = self
            .rings
            .lease()
            .ok_or_else(|| refused("every RDMA send ring is in use".into()))?;
        let (mut send, mut recv) = self.quic.open_stream(peer).await?;
        let qp = QueuePair::create(&self.device, self.arena.geometry.slots, 1, false)?;
        write_msg(&mut send, &Msg::Hello { version: SETUP_VERSION, qp: qp.info() }).await?;
        let (remote_qp, ring) = match read_msg(&mut recv).await? {
            Some(Msg::Accept { qp, ring }) => (qp, ring),
            Some(Msg::Refuse { code }) => {
                let kind = KINDS.get(code as usize).copied().unwrap_or(KINDS[0]);
                return Err(refused(format!("the receiver refused the RDMA link ({kind})")));
            }
            Some(_) => return Err(refused("unexpected answer to the RDMA hello".into())),
            None => return Err(refused("the receiver closed the control stream".into())),
        };
        check_ring(&ring)?;
        qp.connect(&remote_qp)?;
        let (tx, rx) = link::sender_link(qp, lease, self.arena.clone(), ring, send, recv);
        Ok(Link {
            tx: Box::new(tx),
            rx: Box::new(rx),
            transport: NAME,
            peer: None,
        })
    }
}

fn check_ring(ring: &RingInfo) -> Result<()> {
    if ring.slots == 0 || (ring.slot_bytes as usize) < HEADER_LEN + TRAILER_LEN {
        return Err(Error::FrameMalformed {
            what: "the receiver's RDMA ring has no usable slots",
        });
    }
    Ok(())
}

impl Connector for RdmaConnector {
    fn transport(&self) -> &'static str {
        NAME
    }

    fn open<'a>(&'a self, peer: &'a Peer) -> BoxFuture<'a, Result<Link>> {
        Box::pin(self.open_link(peer))
    }

    fn sends_from_device(&self) -> bool {
        matches!(self.arena.region, RingRegion::Device { .. })
    }
}

/// Accepts RDMA links: a QUIC listener for the control channel, the device, and the rings
/// registered once for every link it will serve.
pub struct RdmaListener {
    quic: QuicListener,
    placement: RingPlacement,
}

struct Shared {
    device: Arc<Device>,
    arena: Arc<RecvArena>,
    rings: RingPool,
    receiver: KvReceiver,
}

impl RdmaListener {
    /// Opens the device, registers `config.rings` rings and binds the control channel on
    /// `addr`. Needs a Tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        server_name: &str,
        tls: &NodeTls,
        tuning: &QuicTuning,
        config: &RdmaConfig,
        receiver: KvReceiver,
    ) -> Result<Self> {
        let device = Device::open(config)?;
        // A slot must hold at least one block-layer, the smallest frame a sender makes.
        let block_layer = u32::try_from(receiver.layout().bytes_per_block_layer()).map_err(|_| {
            Error::InvalidArgument {
                what: "a block-layer is larger than an RDMA slot can be",
            }
        })?;
        let payload = config.receive_slot_payload(block_layer);
        let geometry = RingGeometry::new(config.rings, config.slots, slot_bytes(payload)?)?;
        let (region, keys, placement) = RingRegion::register(&device, &config.ring_memory, Rings::Receive, config.rings, geometry.ring_bytes())?;
        let per_peer = receiver.max_connections_per_peer();
        let shared = Arc::new(Shared {
            device,
            arena: Arc::new(RecvArena {
                region,
                rkeys: keys.iter().map(|k| k.rkey).collect(),
                geometry,
            }),
            rings: RingPool::new(config.rings),
            receiver,
        });
        // Control frames only (the blocks move by RDMA): no payload budget.
        let handler: StreamHandler = Arc::new(move |send, recv, peer, _budget| {
            let shared = shared.clone();
            Box::pin(async move { serve_stream(shared, send, recv, peer).await })
        });
        Ok(RdmaListener {
            quic: QuicListener::bind_streams(addr, server_name, tls, tuning, handler, None, per_peer)?,
            placement,
        })
    }

    /// Where the receive rings live (and why not in device memory, if that was refused).
    pub fn placement(&self) -> &RingPlacement {
        &self.placement
    }

    /// The control channel's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.quic.local_addr()
    }
}

/// Sets up one link on an accepted control stream, then serves it like any other link.
async fn serve_stream(shared: Arc<Shared>, mut send: quinn::SendStream, mut recv: quinn::RecvStream, peer: Option<baton_identity::Identity>) {
    let hello = match tokio::time::timeout(SETUP_TIMEOUT, read_msg(&mut recv)).await {
        Ok(Ok(Some(Msg::Hello { qp, .. }))) => qp,
        Ok(Ok(None)) => return,
        other => {
            tracing::info!(?other, "RDMA control stream did not start with a hello");
            let code = match other {
                Ok(Err(e)) => e.code(),
                _ => Error::FrameMalformed { what: "" }.code(),
            };
            let _ = write_msg(&mut send, &Msg::Refuse { code }).await;
            return;
        }
    };
    let Some(lease) = shared.rings.lease() else {
        tracing::warn!("every RDMA ring is in use; refusing a link");
        let busy = Error::PoolExhausted { requested: 1, free: 0 };
        let _ = write_msg(&mut send, &Msg::Refuse { code: busy.code() }).await;
        return;
    };
    let g = shared.arena.geometry;
    let setup = || -> Result<QueuePair> {
        let qp = QueuePair::create(&shared.device, 1, g.slots, true)?;
        qp.connect(&hello)?;
        for i in 0..g.slots {
            qp.post_recv_empty(u64::from(i))?;
        }
        Ok(qp)
    };
    let qp = match setup() {
        Ok(qp) => qp,
        Err(e) => {
            tracing::warn!(error = %e, kind = e.label(), "RDMA link set-up failed");
            let _ = write_msg(&mut send, &Msg::Refuse { code: e.code() }).await;
            return;
        }
    };
    let accept = Msg::Accept {
        qp: qp.info(),
        ring: shared.arena.ring_info(lease.index),
    };
    if let Err(e) = write_msg(&mut send, &accept).await {
        tracing::info!(error = %e, "RDMA peer left during set-up");
        return;
    }
    let limits = shared.receiver.frame_limits();
    let (tx, rx) = link::receiver_link(qp, lease, shared.arena.clone(), limits, send, recv);
    shared
        .receiver
        .serve_link(Link {
            tx: Box::new(tx),
            rx: Box::new(rx),
            transport: NAME,
            peer,
        })
        .await;
}

impl Listener for RdmaListener {
    fn transport(&self) -> &'static str {
        NAME
    }
    fn peer(&self) -> Peer {
        self.quic.peer()
    }
    fn shutdown(&self) {
        self.quic.shutdown();
    }
}

#[cfg(test)]
pub(crate) mod tests;
