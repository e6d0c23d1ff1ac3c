//! `baton prefill` and `baton decode`: one cluster node per process. Each
//! prints one line, `ROLE grpc=ADDR http=ADDR kv=NAME@ADDR`, once it listens, and stops
//! on Ctrl-C or SIGTERM.

use anyhow::Result;

/// Runs a decode node until a shutdown signal.
pub fn run_decode(a: baton_decode_node::Args) -> Result<()> {
    let config = baton_decode_node::Config::try_from(a)?;
    Ok(crate::process::runtime()?.block_on(baton_decode_node::run(config, crate::process::shutdown_signal()))?)
}

/// Runs a prefill node until a shutdown signal.
pub fn run_prefill(a: baton_prefill_node::Args) -> Result<()> {
    let config = baton_prefill_node::Config::try_from(a)?;
    Ok(crate::process::runtime()?.block_on(baton_prefill_node::run(config, crate::process::shutdown_signal()))?)
}

/// Flags of `baton drain`.
#[derive(clap::Args, Debug)]
pub struct DrainArgs {
    /// The node's gRPC address (host:port or URL), e.g. 127.0.0.1:7200.
    #[arg(long, env = "BATON_DRAIN_NODE", default_value = "127.0.0.1:7200")]
    pub node: String,
    /// How long the node may take: running turns finish, warm conversations move.
    #[arg(long, env = "BATON_DRAIN_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    /// Folder with ca.pem and the caller's certificate and key.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub certs_dir: std::path::PathBuf,
    /// File name of the caller's certificate in --certs-dir: an operator identity, or the
    /// node's own (a preStop hook; default: $BATON_NODE_NAME when set, else `operator`).
    #[arg(long, env = "BATON_TLS_NAME")]
    pub tls_name: Option<String>,
    /// INSECURE: call the node without TLS (it must run with the same flag).
    #[arg(long, env = "BATON_INSECURE_PLAINTEXT_INTERNAL")]
    pub insecure_plaintext_internal: bool,
}

/// Drains a node (a Kubernetes preStop hook, a rolling upgrade): it stops taking
/// turns and leaves the ring; a decode node also hands its warm conversations
/// to their new owners. Prints what moved; fails only when the node cannot be
/// asked.
pub fn run_drain(a: DrainArgs) -> Result<()> {
    use anyhow::Context;
    use baton_proto::node::node_control_client::NodeControlClient;
    use baton_proto::node::DrainRequest;
    use baton_proto::plane::{Expect, Plane, Role};
    let ms = u32::try_from(a.timeout.as_millis()).context("--timeout is too long")?;
    let name = a.tls_name.clone().or_else(|| std::env::var("BATON_NODE_NAME").ok()).unwrap_or_else(|| "operator".into());
    crate::process::runtime()?.block_on(async move {
        let plane = if a.insecure_plaintext_internal {
            Plane::insecure_plaintext()
        } else {
            Plane::mtls(baton_kv_transport::NodeTls::from_dir(&a.certs_dir, &name)?)?
        };
        let endpoint = plane
            .endpoint(&a.node)?
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(a.timeout + std::time::Duration::from_secs(5));
        // Any prefill or decode node: the address is the operator's choice.
        let channel = plane
            .connect(&endpoint, Expect::OneOf(vec![Role::Decode, Role::Prefill]))
            .await
            .with_context(|| format!("connecting to {}", a.node))?;
        let r = NodeControlClient::new(channel).drain(DrainRequest { deadline_ms: ms }).await.context("Drain")?.into_inner();
        println!(
            "drained {}: deregistered={} still_running={} conversations_moved={} conversations_failed={} blocks_moved={}",
            a.node, r.deregistered, r.running, r.conversations_moved, r.conversations_failed, r.blocks_moved
        );
        Ok(())
    })
}
