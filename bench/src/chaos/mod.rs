//! What `baton chaos` needs that is not process wiring: the load (conversations with
//! turn IDs and retries, [`load`]), a fault-injecting UDP relay for the KV transport
//! ([`proxy`]), the report's arithmetic and gate ([`report`]), and the soak's ([`soak`]). The root crate's
//! `src/chaos/` starts the cluster, injects the faults and checks the store and nodes.

pub mod load;
pub mod proxy;
pub mod report;
pub mod soak;
