//! gRPC definitions shared by Baton's services (tonic/prost), generated at build time
//! from `proto/*.proto` by protox (no system `protoc` needed).
//!
//! - [`common`]: node identity, role, capacity and load.
//! - [`coordinator`]: the coordinator service (membership, routing, eviction).
//! - [`node`]: the services nodes serve to each other and to the coordinator.
//! - [`plane`]: the internal plane's mutual TLS, connections and authorization table.
//! - [`client`]: [`client::MembershipClient`], the register + keep-alive loop nodes run.
//! - [`coordinators`]: [`coordinators::Coordinators`], every coordinator replica, called with failover.
//! - [`status()`] and [`kind_of`]: the one mapping between an error's [`baton_vocab::ErrorKind`]
//!   and a gRPC status, both ways.
//! - [`ids`]: the one place per ID where a wire string becomes a `baton-vocab` ID.
//! - [`kv_source`]: a turn's KV source (proof of transfer) as metric labels.

#[allow(clippy::all, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/baton_protos.rs"));
}

pub use generated::baton::{common, coordinator, node};

pub mod client;
pub mod coordinators;
pub mod error;
pub mod ids;
pub mod kv_source;
pub mod plane;
pub mod status;

pub use client::{MembershipClient, MembershipHandle, MembershipState};
pub use coordinators::{CallError, Coordinators};
pub use error::{Error, Result};
pub use status::{kind_of, status};
