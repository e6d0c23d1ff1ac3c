//! The gateway's tests that need a real engine (the default model) behind it. They
//! live in the root crate because `baton-api-gateway` does not depend on the engine;
//! one binary, so that the engine and the gateway are linked once.
//!
//! Each module keeps the name of the test binary it was in `api-gateway/tests/`.

mod common;
// The throwaway PostgreSQL server, shared with api-gateway/tests/gateway_store_postgres.rs.
#[path = "../../api-gateway/tests/pg/mod.rs"]
mod pg;

mod gateway_api;
mod gateway_browser;
mod gateway_checks;
mod gateway_completions;
mod gateway_isolation;
mod gateway_items;
mod gateway_postgres;
mod gateway_python;
mod gateway_replicas;
mod gateway_security;
mod gateway_tls;
