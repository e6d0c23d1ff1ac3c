//! Baton API gateway: OpenAI-compatible HTTP API, conversations, limits
//!
//! Not built yet: this crate is filled by issue 5. It exports nothing so
//! that nothing can depend on behaviour that does not exist.
