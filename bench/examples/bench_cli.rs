//! A stand-alone CLI over the bench crate, for trying `capacity` and `simulate` before (or
//! without) the main `baton` binary: `cargo run -p baton-bench --release --example
//! bench_cli -- simulate --scale 10x`.

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Size a chat fleet (the seed's part 1).
    Capacity(baton_bench::CapacityArgs),
    /// Simulate prefix-cache hit rates over a fleet (the seed's part 2 and beyond).
    Simulate(baton_bench::SimulateArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Capacity(a) => baton_bench::capacity::run(a),
        Cmd::Simulate(a) => baton_bench::simulate::run(a),
    }
}
