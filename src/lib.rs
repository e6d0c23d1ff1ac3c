//! The library half of the `baton` binary's crate: the pieces that wire the engine
//! into other crates' interfaces and that integration tests (`tests/gateway`) use, and
//! the harness of real processes that the tests and `baton chaos` share.

pub mod harness;
pub mod local_generator;
