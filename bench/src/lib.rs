//! Baton's bench crate: the capacity planner and the fleet simulator.
//!
//! - [`capacity`] sizes a chat fleet from a model shape (flags, an HF `config.json` or a
//!   GGUF header), a GPU profile and a workload, reproducing the seed design's part-1
//!   arithmetic; measured per-node rates can replace the roofline estimates.
//! - [`simulate`] replays conversations over replicas that each hold an LRU prefix cache
//!   (the seed's part 2) and goes beyond it: bounded-load consistent hashing, a host-memory
//!   tier, prefill/decode pools with local-vs-remote prefill, node failure and join.
//! - [`ring`] is the consistent-hash ring with bounded loads, a pure synchronous struct the
//!   coordinator can reuse; [`lru`] is a plain O(1) token-bounded LRU (slab + intrusive
//!   list) that defines, and tests, the cache semantics of the simulator's faster
//!   per-conversation store ([`simulate::store`]).
//!
//! - [`chaos`] is what `baton chaos` measures with: its load, a fault-injecting UDP relay
//!   and the report's arithmetic.
//!
//! The main binary wires `baton capacity` to [`capacity::run`] with [`CapacityArgs`] and
//! `baton simulate` to [`simulate::run`] with [`SimulateArgs`].

pub mod capacity;
pub mod chaos;
pub mod error;
pub mod hardware;
pub mod load;
pub mod lru;
pub mod plan;
pub mod planner;
pub mod ring;
pub mod rng;
pub mod simulate;

pub use capacity::CapacityArgs;
pub use error::{BenchError, Error, Result};
pub use load::LoadArgs;
pub use plan::PlanArgs;
pub use simulate::SimulateArgs;

/// Write a command's output to stdout. A closed pipe (`baton simulate | head`) ends the
/// output quietly instead of panicking as `print!` would.
pub(crate) fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}
