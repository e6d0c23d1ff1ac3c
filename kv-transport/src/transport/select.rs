//! Choosing a node's network transport, with the fallback from RDMA to QUIC.
//!
//! Owns: [`TransportChoice`], [`RdmaConfig`] (plain settings, present in every build so a
//! node's flags parse the same with or without the `rdma` feature) and
//! [`bind_node_transport`], which a node calls once at start.
//! Invariants: asking for RDMA never stops a node from starting: when this build has no
//! `rdma` feature or the machine no usable RDMA device, the node gets QUIC, a warning naming
//! the reason is logged, and [`NodeTransport::fallback`] carries that reason.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::certs::NodeTls;
use crate::error::{Error, Result};
use crate::handoff::frame::{HEADER_LEN, TRAILER_LEN};
use crate::handoff::KvReceiver;
use crate::transport::device_memory::RingMemory;
use crate::transport::quic::{QuicConnector, QuicListener, QuicTuning};
use crate::transport::{Connector, Listener};

/// Which transport a node asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    Quic,
    /// RDMA data path, QUIC control channel; falls back to QUIC without a device.
    Rdma(RdmaConfig),
}

impl TransportChoice {
    /// The transport's name (`quic`, `rdma`): the `requested` label of a node's metrics.
    pub fn name(&self) -> &'static str {
        match self {
            TransportChoice::Quic => "quic",
            TransportChoice::Rdma(_) => "rdma",
        }
    }
}

/// Settings of the RDMA transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Device name (`mlx5_0`); `None` for the first device found.
    pub device: Option<String>,
    /// Port number, from 1.
    pub port: u8,
    /// Index in the port's GID table (RoCE v2 is often 1 or 3; see `show_gids`).
    pub gid_index: u8,
    /// Largest frame payload a slot holds. Must be at least the sender's
    /// [`SenderConfig::frame_bytes`](crate::SenderConfig) and one block-layer (the listener
    /// raises it to one block-layer by itself).
    pub slot_payload_bytes: u32,
    /// Slots per link: how many frames may be in flight on one link.
    pub slots: u32,
    /// Links that may be open at once on one listener or connector; each has its own ring of
    /// `slots` slots, all registered once when the listener or connector is created.
    pub rings: u32,
    /// Where the listener's receive rings live: host memory, or device memory registered
    /// through its dma-buf (GPUDirect RDMA), which falls back to host memory with the
    /// reason in [`NodeTransport::ring_memory`] where it cannot be registered.
    pub ring_memory: RingMemory,
    /// Where the connector's send rings live: host memory, or device memory registered
    /// through its dma-buf for local access only, from which the NIC reads frames that were
    /// copied there device to device (a layer the engine left on its GPU never reaches the
    /// host); falls back to host memory with the reason in [`NodeTransport::send_ring_memory`].
    pub send_ring_memory: RingMemory,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: 0,
            slot_payload_bytes: 1 << 20,
            slots: 8,
            rings: 16,
            ring_memory: RingMemory::Host,
            send_ring_memory: RingMemory::Host,
        }
    }
}

/// What device memory for a listener's rings is rounded to per ring: a multiple of every
/// host page size, so each ring's dma-buf registration is page-aligned.
pub const DEVICE_RING_ALIGN: usize = 64 << 10;

impl RdmaConfig {
    /// Payload bytes of a listener's slot: at least one block-layer of `block_layer` bytes,
    /// the smallest frame a sender makes.
    pub fn receive_slot_payload(&self, block_layer: u32) -> u32 {
        self.slot_payload_bytes.max(block_layer)
    }

    /// Device memory a listener needs for its rings in device memory
    /// ([`RingMemory::Device`]) with block-layers of `block_layer` bytes: every ring rounded
    /// up to [`DEVICE_RING_ALIGN`]. `None` when it overflows.
    pub fn device_ring_bytes(&self, block_layer: u32) -> Option<usize> {
        let ring = self.ring_bytes(self.receive_slot_payload(block_layer))?.checked_next_multiple_of(DEVICE_RING_ALIGN)?;
        ring.checked_mul(self.rings as usize)
    }

    /// Device memory a connector needs for its send rings in device memory
    /// ([`RdmaConfig::send_ring_memory`]): every ring back to back, in whole
    /// [`DEVICE_RING_ALIGN`] units (they are one local registration). `None` on overflow.
    pub fn device_send_ring_bytes(&self) -> Option<usize> {
        self.ring_bytes(self.slot_payload_bytes)?.checked_mul(self.rings as usize)?.checked_next_multiple_of(DEVICE_RING_ALIGN)
    }

    /// One ring of `slots` slots holding frames of up to `payload` bytes of payload.
    fn ring_bytes(&self, payload: u32) -> Option<usize> {
        let slot = (payload as usize).checked_add(HEADER_LEN + TRAILER_LEN)?;
        slot.checked_mul(self.slots as usize)
    }
}

/// A node's bound transport.
pub struct NodeTransport {
    pub connector: Arc<dyn Connector>,
    pub listener: Box<dyn Listener>,
    /// Where the listener is reachable (the QUIC endpoint; for RDMA its control channel).
    pub local_addr: SocketAddr,
    /// Why RDMA was asked for and QUIC is used instead.
    pub fallback: Option<String>,
    /// With RDMA: where the receive rings live, and why not in device memory if that was
    /// asked for and refused.
    pub ring_memory: Option<RingPlacement>,
    /// With RDMA: the same for the send rings.
    pub send_ring_memory: Option<RingPlacement>,
}

/// Where an RDMA listener's receive rings or a connector's send rings ended up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingPlacement {
    /// `receive` or `send`.
    pub rings: &'static str,
    /// `host` or `device`.
    pub memory: &'static str,
    /// Why device memory was asked for and host memory is used instead.
    pub fallback: Option<String>,
}

impl RingPlacement {
    /// One line for a node's start-up log.
    pub fn describe(&self) -> String {
        match &self.fallback {
            None => format!("{} rings in {} memory", self.rings, self.memory),
            Some(why) => format!("{} rings in host memory (device memory refused: {why})", self.rings),
        }
    }
}

impl NodeTransport {
    /// Metric label of the transport in use.
    pub fn transport(&self) -> &'static str {
        self.listener.transport()
    }

    fn bound(local_addr: SocketAddr, listener: impl Listener + 'static, connector: impl Connector + 'static, fallback: Option<String>) -> Self {
        NodeTransport { local_addr, connector: Arc::new(connector), listener: Box::new(listener), fallback, ring_memory: None, send_ring_memory: None }
    }
}

/// Where and as whom a node's KV listener binds and its connector dials: what every
/// transport is bound with.
struct Endpoint<'a> {
    listen: SocketAddr,
    server_name: &'a str,
    tls: &'a NodeTls,
    tuning: &'a QuicTuning,
}

/// Binds the listener and creates the connector for `choice`, falling back to QUIC when
/// RDMA cannot be used. Needs a Tokio runtime.
pub fn bind_node_transport(
    choice: &TransportChoice,
    listen: SocketAddr,
    server_name: &str,
    tls: &NodeTls,
    tuning: &QuicTuning,
    receiver: KvReceiver,
) -> Result<NodeTransport> {
    let at = Endpoint { listen, server_name, tls, tuning };
    let fallback = match choice {
        TransportChoice::Quic => None,
        TransportChoice::Rdma(config) => {
            match bind_rdma(config, &at, receiver.clone()) {
                Ok(t) => return Ok(t),
                Err(Error::RdmaUnavailable { reason }) => {
                    tracing::warn!(%reason, "RDMA transport unavailable, falling back to QUIC");
                    Some(reason)
                }
                Err(e) => return Err(e),
            }
        }
    };
    let listener = QuicListener::bind(at.listen, at.server_name, at.tls, at.tuning, receiver)?;
    let connector = QuicConnector::new(at.tls, at.tuning)?;
    Ok(NodeTransport::bound(listener.local_addr(), listener, connector, fallback))
}

#[cfg(feature = "rdma")]
fn bind_rdma(config: &RdmaConfig, at: &Endpoint<'_>, receiver: KvReceiver) -> Result<NodeTransport> {
    use crate::transport::rdma::{RdmaConnector, RdmaListener};
    // The connector first: it opens the device, so a machine without one fails before any
    // socket is bound.
    let connector = RdmaConnector::new(config, at.tls, at.tuning)?;
    let listener = RdmaListener::bind(at.listen, at.server_name, at.tls, at.tuning, config, receiver)?;
    let placement = listener.placement().clone();
    let send_placement = connector.placement().clone();
    let mut t = NodeTransport::bound(listener.local_addr(), listener, connector, None);
    t.ring_memory = Some(placement);
    t.send_ring_memory = Some(send_placement);
    Ok(t)
}

#[cfg(not(feature = "rdma"))]
fn bind_rdma(_config: &RdmaConfig, _at: &Endpoint<'_>, _receiver: KvReceiver) -> Result<NodeTransport> {
    Err(Error::RdmaUnavailable {
        reason: "this build has no RDMA support (cargo feature `rdma` is off)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::generate_dev_certs;
    use crate::handoff::ReceiverConfig;
    use crate::pool::ArenaPool;
    use crate::types::KvLayout;

    const LAYOUT: KvLayout = crate::types::TEST_LAYOUT;

    /// A node's certificates, a receiver over a small pool and a loopback address.
    fn node() -> (NodeTls, KvReceiver, SocketAddr) {
        let certs = generate_dev_certs("test", &["decode-0"]).unwrap();
        let pool = Arc::new(ArenaPool::new(LAYOUT, 4).unwrap());
        let receiver = KvReceiver::new(pool, ReceiverConfig::default()).unwrap();
        (certs.node_tls("decode-0").unwrap(), receiver, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    #[tokio::test]
    async fn quic_is_used_as_asked() {
        let (tls, receiver, loopback) = node();
        let t = bind_node_transport(&TransportChoice::Quic, loopback, "decode-0", &tls, &QuicTuning::default(), receiver)
            .unwrap();
        assert_eq!(t.transport(), "quic");
        assert_eq!(t.fallback, None);
        assert_ne!(t.local_addr.port(), 0);
    }

    /// Without a device (or without the feature) asking for RDMA yields a working QUIC
    /// transport and the reason. Where a device exists the RDMA transport is used instead.
    #[tokio::test]
    async fn rdma_without_a_device_falls_back_to_quic() {
        let (tls, receiver, loopback) = node();
        let choice = TransportChoice::Rdma(RdmaConfig {
            rings: 2,
            slots: 2,
            slot_payload_bytes: 64 << 10,
            ..RdmaConfig::default()
        });
        let t = bind_node_transport(&choice, loopback, "decode-0", &tls, &QuicTuning::default(), receiver)
            .unwrap();
        match &t.fallback {
            Some(reason) => {
                assert_eq!(t.transport(), "quic");
                if cfg!(feature = "rdma") {
                    assert!(reason.contains("RDMA device"), "{reason}");
                } else {
                    assert!(reason.contains("feature `rdma` is off"), "{reason}");
                }
            }
            // Only a build with the feature, on a machine with a device, gets here.
            None => assert_eq!(t.transport(), "rdma"),
        }
    }
}
