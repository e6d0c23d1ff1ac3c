//! The handoff protocol: how a turn's KV blocks move from the node that computed them into
//! blocks reserved for them on another node. Transport-independent.
//!
//! 1. The receiver reserves blocks ([`KvReceiver::reserve`]) and gets a [`Reservation`]
//!    whose [`Grant`] (reservation ID, epoch, layout, layer range, block IDs, deadline)
//!    travels to the sender by whatever RPC the services use.
//! 2. The sender opens a link ([`KvSender::start`]) with an `Open` frame naming the
//!    reservation and its own layout, then sends `Data` frames layer by layer
//!    ([`Transfer::send_layer`]) while it computes later layers, then `Done`.
//! 3. The receiver checks every frame (checksum, reservation, epoch, coordinates, no
//!    duplicates) before writing it into the pool, and reports `Completed` or `Failed`.
//!
//! Fail-closed rules: any rejected frame ends the reservation and releases its blocks; the
//! link closing early does too; the deadline timer releases whatever is still open, exactly
//! once; cancel from either side releases at once. See [`receiver`] for the invariants.

pub mod buffers;
pub mod frame;
pub mod grant;
mod progress;
pub mod receiver;
pub mod sender;

pub use grant::Grant;
pub use receiver::{KvReceiver, ReceiverConfig, Reservation};
pub use sender::{KvSender, SenderConfig, Transfer};
