//! What `baton chaos` needs that is not process wiring: the load (conversations with
//! turn IDs and retries, [`load`]), a fault-injecting UDP relay for the KV transport
//! ([`proxy`]), and the report's arithmetic and gate ([`report`]). The root crate's
//! `src/chaos/` starts the cluster, injects the faults and checks the store and nodes.

pub mod load;
pub mod proxy;
pub mod report;
