//! `baton`: one binary for every role of the Baton serving cluster.

mod autoscale;
mod bench_cluster;
mod bench_engine;
mod bench_responses;
mod certs;
mod chaos;
mod coordinator_cmd;
mod core_split;
mod engine_args;
mod gateway_cmd;
mod generate;
mod node_cmd;
mod process;
mod up;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "baton", version, about = "Disaggregated prefill/decode serving for chat models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole cluster on this machine: coordinator, prefill node, decode node and
    /// the gateway with its web chat page, with the embedded defaults.
    Up(Box<up::UpArgs>),
    /// Generate text from a prompt or chat messages, streaming to stdout.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Size a fleet: KV per token and per node, decode and prefill rates,
    /// nodes, concurrency (the seed's capacity arithmetic).
    Capacity(baton_bench::CapacityArgs),
    /// Simulate conversations over replicas with prefix caches: routing,
    /// second tier, prefill pools, failures.
    Simulate(baton_bench::SimulateArgs),
    /// The autoscaling planner over a running cluster's Prometheus metrics, as a dry
    /// run: prints the prefill and decode replica counts it would set, with reasons.
    Plan(baton_bench::PlanArgs),
    /// Create development certificates for the KV transport's mutual TLS.
    Certs(certs::CertsArgs),
    /// A prefill node: computes prompt tails and ships their KV to decode nodes.
    Prefill(baton_prefill_node::Args),
    /// A decode node: warm prefixes, continuous batching, token streams.
    Decode(baton_decode_node::Args),
    /// Drain a node before it stops: no new turns, leave the ring, and (decode
    /// nodes) hand warm conversations with their KV to the new owners.
    Drain(node_cmd::DrainArgs),
    /// The coordinator alone: membership, routing, fleet-wide eviction.
    Coordinator(baton_coordinator::Args),
    /// The API gateway (OpenAI-compatible API, conversations, web chat at /)
    /// in front of an in-process engine.
    Gateway(Box<gateway_cmd::GatewayArgs>),
    /// API keys of the gateway: create, list, revoke.
    Keys(gateway_cmd::KeysArgs),
    /// A terminal chat client of the gateway's conversations API.
    Chat(gateway_cmd::ChatArgs),
    /// The chaos suite: a multi-process cluster (2 coordinators over etcd, 2 gateways on
    /// PostgreSQL, prefill and decode nodes) under multi-turn load while processes are
    /// killed, frozen and the KV transport loses packets; fails when a turn is lost or
    /// stored twice or KV blocks leak.
    Chaos(chaos::ChaosArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput of the engine on this machine, beside
    /// llama.cpp's llama-bench when a build is present.
    Engine(bench_engine::BenchEngineArgs),
    /// Time to first token of a cold long turn and the warm next turn through the
    /// cluster (local and remote prefill) beside a single in-process engine.
    Cluster(bench_cluster::BenchClusterArgs),
    /// Multi-turn chat traffic against any OpenAI-compatible endpoint: TTFT, ITL,
    /// throughput, cached share and goodput per offered-load level.
    Load(baton_bench::LoadArgs),
    /// Time to first token of turns 2.. of a Responses API chain (previous_response_id)
    /// over a long history, beside the same turns sent statelessly to a cold cache.
    Responses(bench_responses::BenchResponsesArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("BATON_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs sent to files and collectors stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        Command::Up(a) => up::run(*a),
        Command::Generate(a) => generate::run(a),
        Command::Bench(BenchCommand::Engine(a)) => bench_engine::run(a),
        Command::Bench(BenchCommand::Load(a)) => baton_bench::load::run(a),
        Command::Bench(BenchCommand::Cluster(a)) => bench_cluster::run(a),
        Command::Bench(BenchCommand::Responses(a)) => bench_responses::run(a),
        Command::Capacity(a) => baton_bench::capacity::run(a),
        Command::Simulate(a) => baton_bench::simulate::run(a),
        Command::Plan(a) => baton_bench::plan::run(a),
        Command::Certs(a) => certs::run(a),
        Command::Prefill(a) => node_cmd::run_prefill(a),
        Command::Decode(a) => node_cmd::run_decode(a),
        Command::Drain(a) => node_cmd::run_drain(a),
        Command::Coordinator(a) => coordinator_cmd::run(a),
        Command::Gateway(a) => gateway_cmd::run_gateway(*a),
        Command::Keys(a) => gateway_cmd::run_keys(a),
        Command::Chat(a) => gateway_cmd::run_chat(a),
        Command::Chaos(a) => chaos::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
