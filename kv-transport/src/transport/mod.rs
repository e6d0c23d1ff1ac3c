//! Transports: how frames get from a sender to a receiver.
//!
//! Owns: the [`Link`] abstraction (one bidirectional, ordered, reliable channel of frames per
//! transfer), [`Connector`] (the sender side of a transport: opens links to a [`Peer`]) and
//! [`Listener`] (the receiver side: accepts links and hands each to a
//! [`KvReceiver`](crate::KvReceiver)). Everything above a link (reservations, deadlines,
//! checksums) is transport-independent and lives in [`handoff`](crate::handoff).
//! Invariants: a link delivers frames in order or fails; a listener's shutdown ends every
//! link it accepted (and with them any reservation still attached to one).

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::handoff::frame::{Frame, FrameHeader, FrameLimits};
use crate::transport::device_memory::DeviceRange;
use crate::types::ReservationId;

pub mod device_memory;
pub mod inproc;
pub mod quic;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod select;
pub mod tls_tcp;

/// A boxed, sendable future: the trait objects below return these.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Sending half of a link.
pub trait LinkTx: Send {
    /// Sends one frame. Returns once the transport has taken it (it may still be in flight).
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>>;

    /// Sends a `Data` frame whose payload is in this node's device memory (`header` says
    /// its coordinates; `payload_len` is set from `payload`). A link whose send rings are
    /// in device memory (RDMA, [`Connector::sends_from_device`]) copies it there device to
    /// device and checksums it on the device; this default copies it to the host first
    /// (blocking the calling thread for that copy) and sends it as any frame.
    fn send_device(&mut self, header: FrameHeader, payload: DeviceRange) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let frame = host_frame(header, &payload)?;
            self.send(frame).await
        })
    }
}

/// The frame `header` + `payload` with its payload copied to the host.
pub(crate) fn host_frame(header: FrameHeader, payload: &DeviceRange) -> Result<Frame> {
    let mut bytes = vec![0u8; payload.len];
    payload.read_into(&mut bytes).map_err(|detail| Error::Link { transport: "any", detail: format!("copying a frame's payload off the device: {detail}") })?;
    Ok(Frame::new(header, bytes.into()))
}

/// Receiving half of a link.
pub trait LinkRx: Send {
    /// The next frame; `Ok(None)` when the peer closed the link cleanly.
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>>;
    /// Tightens what later frames may carry, checked before anything is allocated (the
    /// receiver calls it once a link opened a reservation: no data frame may exceed one
    /// layer of that reservation). Links that do not read from a byte stream ignore it.
    fn limit(&mut self, _limits: FrameLimits) {}
}

/// Which limits apply to a stream link's next frame: [`FrameLimits::OPENING`] until a
/// first frame arrived, then the link's own.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamLimits {
    opened: bool,
    limits: FrameLimits,
}

impl StreamLimits {
    pub(crate) fn new(limits: FrameLimits) -> Self {
        StreamLimits { opened: false, limits }
    }

    /// The limits for the next frame.
    pub(crate) fn next(&self) -> FrameLimits {
        if self.opened {
            self.limits
        } else {
            FrameLimits::OPENING
        }
    }

    /// What reading one frame under [`StreamLimits::next`] gave: a data payload before
    /// the link opened is the unexpected frame it is (refused before its payload was
    /// read), as a receiver fed whole frames would say.
    pub(crate) fn read<T>(&mut self, r: Result<Option<T>>) -> Result<Option<T>> {
        match r {
            Err(Error::FrameTooLarge { .. }) if !self.opened => {
                Err(Error::UnexpectedFrame { reservation: ReservationId(0), what: "data before open" })
            }
            Ok(Some(f)) => {
                self.opened = true;
                Ok(Some(f))
            }
            other => other,
        }
    }

    /// Tightens (never widens) the limits for later frames.
    pub(crate) fn tighten(&mut self, limits: FrameLimits) {
        self.limits.max_payload = self.limits.max_payload.min(limits.max_payload);
    }
}

/// Bytes of frame payload one connection may hold allocated at once (issue #39). A
/// multiplexed transport (QUIC) carries many links on one connection, each of which, once
/// opened, may announce a payload of one layer of its reservation; the receiver allocates
/// a payload when its header arrives, so a peer that announces frames on every stream and
/// then stalls would pin one layer's bytes per stream. Each connection gets one budget:
/// a payload is allocated only after its bytes were taken from the budget (a frame
/// waits for room, holding nothing), and they go back when the link asks for its next
/// frame or ends in any way (the permit is dropped with the link: done, reset, failed,
/// deadline, dead peer, listener shutdown). One peer's stalled frames therefore hold at
/// most its own budget and delay only its own connection's other streams.
#[derive(Clone)]
pub(crate) struct ConnBudget {
    room: Arc<Semaphore>,
    total: u32,
    /// The receiver-wide count of bytes held under every connection's budget.
    held: Arc<AtomicU64>,
}

/// Bytes taken from a [`ConnBudget`], returned on drop.
pub(crate) struct BudgetPermit {
    _room: OwnedSemaphorePermit,
    bytes: u32,
    held: Arc<AtomicU64>,
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        self.held.fetch_sub(u64::from(self.bytes), Ordering::Relaxed);
    }
}

impl ConnBudget {
    pub(crate) fn new(total: u32, held: Arc<AtomicU64>) -> Self {
        ConnBudget { room: Arc::new(Semaphore::new(total as usize)), total, held }
    }

    /// Takes `bytes` from the budget, waiting until the connection's earlier frames gave
    /// enough back. A frame larger than the whole budget could never fit: refused.
    pub(crate) async fn take(&self, bytes: u32) -> Result<BudgetPermit> {
        if bytes > self.total {
            return Err(Error::FrameTooLarge { len: u64::from(bytes), max: u64::from(self.total) });
        }
        let room = self.room.clone().acquire_many_owned(bytes).await.map_err(|_| Error::Link {
            transport: "any",
            detail: "the connection's frame budget was closed".into(),
        })?;
        self.held.fetch_add(u64::from(bytes), Ordering::Relaxed);
        Ok(BudgetPermit { _room: room, bytes, held: self.held.clone() })
    }
}

/// One transfer's channel of frames in both directions.
pub struct Link {
    pub tx: Box<dyn LinkTx>,
    pub rx: Box<dyn LinkRx>,
    /// Name of the transport that carries it (metric label).
    pub transport: &'static str,
    /// The identity the remote end's certificate names, as the handshake authenticated it
    /// (None in process, or for a certificate without a Baton identity). A receiver
    /// compares it with the sender a reservation was issued for.
    pub peer: Option<baton_identity::Identity>,
}

/// Where a receiver listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A network address and the name its certificate must carry.
    Net {
        addr: SocketAddr,
        server_name: String,
    },
    /// A listener registered on an [`inproc::InProcNetwork`].
    InProc { name: String },
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Net { addr, server_name } => write!(f, "{server_name}@{addr}"),
            Peer::InProc { name } => write!(f, "inproc:{name}"),
        }
    }
}

/// The sender side of a transport.
pub trait Connector: Send + Sync {
    /// Short stable name, used as the metric label (`inproc`, `quic`, `tls_tcp`, `rdma`).
    fn transport(&self) -> &'static str;
    /// Opens a new link to `peer`.
    fn open<'a>(&'a self, peer: &'a Peer) -> BoxFuture<'a, Result<Link>>;
    /// Whether its links send a device payload ([`LinkTx::send_device`]) without bringing
    /// it to the host (send rings in device memory): what makes a node keep its exported
    /// KV on the GPU. False for every transport but RDMA with device send rings.
    fn sends_from_device(&self) -> bool {
        false
    }
}

/// The receiver side of a transport: accepts links until shut down.
pub trait Listener: Send + Sync {
    /// Short stable name, used as the metric label.
    fn transport(&self) -> &'static str;
    /// Where senders reach this listener.
    fn peer(&self) -> Peer;
    /// Stops accepting and drops every open link.
    fn shutdown(&self);
}

#[cfg(test)]
mod tests;
