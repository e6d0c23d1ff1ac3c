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

use crate::error::{Error, Result};
use crate::handoff::frame::{Frame, FrameLimits};
use crate::types::ReservationId;

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
