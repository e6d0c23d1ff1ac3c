//! What every long-running subcommand needs from the process: an async runtime and a
//! future that resolves on Ctrl-C or SIGTERM (what an orchestrator sends), so each role
//! shuts down gracefully the same way.

use anyhow::{Context, Result};

/// A multi-threaded tokio runtime with I/O and timers.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
