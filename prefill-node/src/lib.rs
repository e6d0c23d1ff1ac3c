//! Baton prefill node: computes the uncached prompt tail and ships its KV
//!
//! Not built yet: this crate is filled by issue 4. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
