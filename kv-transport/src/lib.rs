//! Baton KV transport: moving KV blocks between nodes
//!
//! Not built yet: this crate is filled by issue 3. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
