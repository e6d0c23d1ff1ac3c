//! `baton prefill` and `baton decode`: one cluster node per process. Each
//! prints one line, `ROLE grpc=ADDR http=ADDR kv=NAME@ADDR`, once it listens, and stops
//! on Ctrl-C or SIGTERM.

use anyhow::Result;

/// Runs a decode node until a shutdown signal.
pub fn run_decode(a: baton_decode_node::Args) -> Result<()> {
    let config = baton_decode_node::Config::try_from(a)?;
    crate::process::runtime()?.block_on(baton_decode_node::run(config, crate::process::shutdown_signal()))
}

/// Runs a prefill node until a shutdown signal.
pub fn run_prefill(a: baton_prefill_node::Args) -> Result<()> {
    let config = baton_prefill_node::Config::try_from(a)?;
    crate::process::runtime()?.block_on(baton_prefill_node::run(config, crate::process::shutdown_signal()))
}
