//! Routing: pure, synchronous decision structs (no runtime, time passed in).
//!
//! - [`ring`]: consistent hashing with bounded loads (shared with the simulator).
//! - [`decode`]: conversation placement on decode nodes.
//! - [`prefill`]: local-vs-remote prefill and the choice of prefill node.
//! - [`explain`]: the bounded "why this node" log.

pub mod decode;
pub mod explain;
pub mod prefill;
pub mod ring;
