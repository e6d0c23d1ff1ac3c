//! Baton KV transport: moves a turn's KV blocks from the node that computed them into
//! blocks reserved for them on another node.
//!
//! - [`handoff`]: the transport-independent protocol (grants, frames, reservations,
//!   deadlines, installing). Start at [`KvReceiver`] and [`KvSender`].
//! - [`transport`]: links over QUIC ([`transport::quic`]), TLS over TCP
//!   ([`transport::tls_tcp`]), in-process channels ([`transport::inproc`]) and, with the
//!   `rdma` feature, RDMA (`transport::rdma`); [`transport::select`] picks a node's
//!   transport and falls back from RDMA to QUIC.
//! - [`pool`]: the [`BlockSink`]/[`BlockSource`] traits the engine's pool implements.
//! - [`certs`]: development cluster certificates and mutual-TLS configs.
//! - [`metrics`]: counters and their exported names.
//!
//! What this crate guarantees, whatever the peer does: reserved blocks are released exactly
//! once unless the transfer completes and the caller takes them; a transfer fails by its
//! deadline on both ends; a block is written only from a frame whose checksum, reservation,
//! epoch and coordinates were checked.

pub mod certs;
pub mod error;
pub mod handoff;
pub mod metrics;
pub mod pool;
pub mod transport;
pub mod types;

#[cfg(test)]
mod conformance;

pub use certs::{generate_dev_certs, DevCerts, NodeTls};
pub use error::{Error, Result, Side};
pub use handoff::{Grant, KvReceiver, KvSender, ReceiverConfig, Reservation, SenderConfig, Transfer};
pub use metrics::{StatsSnapshot, TransportStats};
pub use pool::{ArenaPool, BlockSink, BlockSource};
pub use transport::{Connector, Link, Listener, Peer};
pub use types::{BlockId, Epoch, KvDtype, KvLayout, ReservationId};
