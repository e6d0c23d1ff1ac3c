//! The shared vocabulary of Baton's crates.
//!
//! - [`ids`]: one newtype per identifier that crosses a crate boundary
//!   ([`ConversationId`], [`OwnerId`], [`NodeId`], [`TurnId`]). A string from the wire
//!   becomes one of these through its `parse`, which is the one place its rules live.
//! - [`ErrorKind`]: what kind of failure an error is, independent of protocol. Each
//!   crate has one error type with a `kind()`; one function per protocol (gRPC in
//!   `baton-proto`, HTTP in `baton-api-gateway`) maps a kind to a status code.

pub mod error;
pub mod ids;

pub use error::{ErrorKind, HasKind};
pub use ids::{ConversationId, IdError, NodeId, OwnerId, TurnId};
