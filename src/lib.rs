//! The library half of the `baton` binary's crate: the pieces that wire the engine
//! into other crates' interfaces and that integration tests (`tests/gateway`) use.

pub mod local_generator;
