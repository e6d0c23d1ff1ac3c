//! Baton load generator, capacity planner and fleet simulator
//!
//! Not built yet: this crate is filled by issue 6. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
