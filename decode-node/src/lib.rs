//! Baton decode node: warm prefixes, continuous batching, token streams
//!
//! Not built yet: this crate is filled by issue 4. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
