//! `baton coordinator`: the coordinator alone, for a real deployment.
//!
//! Prints one line, `coordinator grpc=ADDR http=ADDR`, once both ports are bound (so a
//! script or test that passed port 0 learns them), then serves until Ctrl-C or SIGTERM.

use anyhow::{Context, Result};
use baton_coordinator::{Args, Config, Coordinator};

pub fn run(args: Args) -> Result<()> {
    let config = Config::try_from(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let coordinator = Coordinator::bind(config).await?;
        println!("coordinator grpc={} http={}", coordinator.grpc_addr(), coordinator.http_addr());
        coordinator.serve(shutdown_signal()).await?;
        Ok(())
    })
}

async fn shutdown_signal() {
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
