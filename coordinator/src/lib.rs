//! Baton coordinator: membership, routing, fleet-wide eviction
//!
//! Not built yet: this crate is filled by issue 4. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
