//! What the prefill and decode nodes share, so each lives once: the engine
//! flags and model loading, the node's side of the KV transport, pulling a
//! warm prefix from a decode node, the `/healthz` and `/metrics` endpoints, conversions between `node.proto` and the
//! engine's types, and the engine's series in each node's metrics. A library
//! of the node crates, not a service.

pub mod convert;
pub mod engine_args;
pub mod engine_metrics;
pub mod http;
pub mod in_flight;
pub mod kv;
pub mod prefix_pull;
