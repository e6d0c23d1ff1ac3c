//! `baton prefill` and `baton decode`: one cluster node per process. Each
//! prints one line, `ROLE grpc=ADDR http=ADDR kv=NAME@ADDR`, once it listens, and stops
//! on Ctrl-C or SIGTERM.

use anyhow::{Context, Result};

/// Runs a decode node until a shutdown signal.
pub fn run_decode(a: baton_decode_node::Args) -> Result<()> {
    let config = baton_decode_node::Config::try_from(a)?;
    runtime()?.block_on(baton_decode_node::run(config, shutdown_signal()))
}

/// Runs a prefill node until a shutdown signal.
pub fn run_prefill(a: baton_prefill_node::Args) -> Result<()> {
    let config = baton_prefill_node::Config::try_from(a)?;
    runtime()?.block_on(baton_prefill_node::run(config, shutdown_signal()))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
