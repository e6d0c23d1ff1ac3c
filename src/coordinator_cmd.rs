//! `baton coordinator`: the coordinator alone, for a real deployment.
//!
//! Prints one line, `coordinator grpc=ADDR http=ADDR`, once both ports are bound (so a
//! script or test that passed port 0 learns them), then serves until Ctrl-C or SIGTERM.

use anyhow::Result;
use baton_coordinator::{Args, Config, Coordinator};

pub fn run(args: Args) -> Result<()> {
    let config = Config::try_from(args)?;
    crate::process::runtime()?.block_on(async move {
        let coordinator = Coordinator::bind(config).await?;
        println!("coordinator grpc={} http={}", coordinator.grpc_addr(), coordinator.http_addr());
        coordinator.serve(crate::process::shutdown_signal()).await?;
        Ok(())
    })
}
