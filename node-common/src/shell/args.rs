//! The flags every node process takes, and their validation. A role names its
//! own defaults (its name and ports, and their environment variables) through
//! [`RoleDefaults`]; its own flags are the role type itself, flattened into
//! [`Args`] beside the shell's.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use baton_kv_transport::transport::select::TransportChoice;

use super::NodeRole;
use crate::engine_args::{EngineSetup, NodeEngineArgs};
use crate::kv::KvTransportArgs;

/// A role's defaults of the flags that differ between roles.
pub trait RoleDefaults: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// `--name`'s default, e.g. `decode-0`.
    const NAME: &'static str;
    /// `--listen`'s environment variable and default.
    const LISTEN_ENV: &'static str;
    const LISTEN: &'static str;
    /// `--http-listen`'s environment variable and default.
    const HTTP_LISTEN_ENV: &'static str;
    const HTTP_LISTEN: &'static str;
    /// `--kv-listen`'s environment variable and default.
    const KV_LISTEN_ENV: &'static str;
    const KV_LISTEN: &'static str;
}

/// A duration flag (`30s`, `2m`).
pub fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// Flags of every node (`baton decode`, `baton prefill`).
#[derive(clap::Args, Clone, Debug)]
pub struct NodeArgs<D: RoleDefaults> {
    /// This node's ID in the cluster; also the name in its TLS certificate.
    #[arg(long, env = "BATON_NODE_NAME", default_value = D::NAME)]
    pub name: String,
    /// gRPC address (port 0: any free port).
    #[arg(long, env = D::LISTEN_ENV, default_value = D::LISTEN)]
    pub listen: SocketAddr,
    /// HTTP address of /healthz and /metrics.
    #[arg(long, env = D::HTTP_LISTEN_ENV, default_value = D::HTTP_LISTEN)]
    pub http_listen: SocketAddr,
    /// UDP address of the KV transport (QUIC; with `--kv-transport rdma`, its control
    /// channel): tails from prefill nodes, prefixes pulled from decode nodes.
    #[arg(long, env = D::KV_LISTEN_ENV, default_value = D::KV_LISTEN)]
    pub kv_listen: SocketAddr,
    /// Host other nodes reach this one at (default: the listen address's).
    #[arg(long, env = "BATON_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// The coordinator's gRPC URL, e.g. http://127.0.0.1:7100, or every replica's,
    /// comma-separated (none: serve alone). The node registers through any replica and
    /// renews its lease, with its load, with each.
    #[arg(long, env = "BATON_COORDINATOR", value_delimiter = ',')]
    pub coordinator: Vec<String>,
    /// How long a KV transfer between nodes may take (a remote prefill with its compute,
    /// a prefix pull) before its reservation is released and the work is done here.
    #[arg(long, env = "BATON_KV_DEADLINE", default_value = "30s", value_parser = parse_duration)]
    pub kv_deadline: Duration,
    /// Staging memory for KV arriving from other nodes, MiB.
    #[arg(long, env = "BATON_KV_STAGING_MIB", default_value_t = 256)]
    pub kv_staging_mib: usize,
    /// How long a drain (`baton drain`, a preStop hook) may take when the request names
    /// no deadline: running calls finish (and a decode node's warm conversations move).
    #[arg(long, env = "BATON_DRAIN_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Folder with ca.pem and NAME.pem/NAME.key (`baton certs`): the node's identity on
    /// the KV transport and the internal gRPC plane.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub certs_dir: PathBuf,
    /// INSECURE: serve and call gRPC without TLS, identities or authorization (the KV
    /// transport keeps its mutual TLS). Only for a network of trusted processes.
    #[arg(long, env = "BATON_INSECURE_PLAINTEXT_INTERNAL")]
    pub insecure_plaintext_internal: bool,
    #[command(flatten)]
    pub kv_transport: KvTransportArgs,
    #[command(flatten)]
    pub engine: NodeEngineArgs,
    #[arg(skip)]
    pub role: PhantomData<D>,
}

/// Flags of a node process (`baton decode`, `baton prefill`): the shell's, then the role's.
#[derive(clap::Args, Clone, Debug)]
pub struct Args<R: NodeRole + clap::Args + clap::FromArgMatches + Clone + std::fmt::Debug> {
    #[command(flatten)]
    pub node: NodeArgs<R::Defaults>,
    #[command(flatten)]
    pub role: R,
}

/// A validated node process configuration.
#[derive(Clone, Debug)]
pub struct Config<R> {
    pub node: NodeConfig,
    pub role: R,
}

impl<R: NodeRole + clap::Args + clap::FromArgMatches + Clone + std::fmt::Debug> TryFrom<Args<R>> for Config<R> {
    type Error = Error;
    fn try_from(a: Args<R>) -> Result<Self> {
        a.role.validate()?;
        Ok(Config { node: a.node.try_into()?, role: a.role })
    }
}

/// A validated node configuration (what [`NodeArgs`] say).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub name: String,
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub kv_listen: SocketAddr,
    pub advertise_host: Option<String>,
    /// Every coordinator replica's URL; empty: the node serves alone.
    pub coordinators: Vec<String>,
    pub kv_deadline: Duration,
    pub kv_staging_bytes: usize,
    pub drain_timeout: Duration,
    pub certs_dir: PathBuf,
    /// gRPC without TLS (`--insecure-plaintext-internal`).
    pub insecure_plaintext_internal: bool,
    /// The KV transport asked for (`--kv-transport`); RDMA falls back to QUIC.
    pub kv_transport: TransportChoice,
    pub engine: EngineSetup,
}

impl<D: RoleDefaults> TryFrom<NodeArgs<D>> for NodeConfig {
    type Error = Error;
    fn try_from(a: NodeArgs<D>) -> Result<Self> {
        if a.name.is_empty() || a.name.contains('@') {
            return Err(Error::config("--name must be non-empty and without '@'"));
        }
        if a.kv_deadline.is_zero() || a.kv_deadline > Duration::from_secs(600) {
            return Err(Error::config("--kv-deadline must be in (0, 600s]"));
        }
        if a.kv_staging_mib == 0 {
            return Err(Error::config("--kv-staging-mib must be positive"));
        }
        if a.drain_timeout.is_zero() || a.drain_timeout > Duration::from_secs(3600) {
            return Err(Error::config("--drain-timeout must be in (0, 1h]"));
        }
        Ok(NodeConfig {
            name: a.name,
            listen: a.listen,
            http_listen: a.http_listen,
            kv_listen: a.kv_listen,
            advertise_host: a.advertise_host,
            coordinators: a.coordinator.into_iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect(),
            kv_deadline: a.kv_deadline,
            kv_staging_bytes: a.kv_staging_mib << 20,
            drain_timeout: a.drain_timeout,
            certs_dir: a.certs_dir,
            insecure_plaintext_internal: a.insecure_plaintext_internal,
            kv_transport: a.kv_transport.try_into()?,
            engine: a.engine.try_into()?,
        })
    }
}

impl NodeConfig {
    /// The settings of a node started in-process (`baton up`, tests): loopback ports
    /// chosen by the system, the flags' defaults elsewhere.
    pub fn in_process(name: &str, coordinator: Option<String>, kv_transport: TransportChoice, engine: EngineSetup) -> NodeConfig {
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        NodeConfig {
            name: name.to_string(),
            listen: any_port,
            http_listen: any_port,
            kv_listen: any_port,
            advertise_host: None,
            coordinators: coordinator.into_iter().collect(),
            kv_deadline: Duration::from_secs(30),
            kv_staging_bytes: 256 << 20,
            drain_timeout: Duration::from_secs(60),
            certs_dir: PathBuf::new(),
            insecure_plaintext_internal: false,
            kv_transport,
            engine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Clone, Debug)]
    struct Test;
    impl RoleDefaults for Test {
        const NAME: &'static str = "test-0";
        const LISTEN_ENV: &'static str = "BATON_SHELL_TEST_LISTEN";
        const LISTEN: &'static str = "127.0.0.1:7900";
        const HTTP_LISTEN_ENV: &'static str = "BATON_SHELL_TEST_HTTP_LISTEN";
        const HTTP_LISTEN: &'static str = "127.0.0.1:7901";
        const KV_LISTEN_ENV: &'static str = "BATON_SHELL_TEST_KV_LISTEN";
        const KV_LISTEN: &'static str = "127.0.0.1:7902";
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs<Test>,
    }

    fn config(flags: &[&str]) -> Result<NodeConfig> {
        let args = ["node", "--model", "m.gguf"].iter().chain(flags);
        Cli::try_parse_from(args).map_err(|e| Error::Config(e.to_string()))?.node.try_into()
    }

    #[test]
    fn the_role_names_the_defaults_and_the_flags_override_them() {
        let c = config(&[]).unwrap();
        assert_eq!((c.name.as_str(), c.listen.port(), c.http_listen.port(), c.kv_listen.port()), ("test-0", 7900, 7901, 7902));
        assert_eq!((c.kv_deadline, c.drain_timeout, c.kv_staging_bytes), (Duration::from_secs(30), Duration::from_secs(60), 256 << 20));
        let c = config(&["--name", "n-1", "--listen", "0.0.0.0:1", "--drain-timeout", "2m"]).unwrap();
        assert_eq!((c.name.as_str(), c.listen.port(), c.drain_timeout), ("n-1", 1, Duration::from_secs(120)));
    }

    #[test]
    fn bad_flags_are_refused_with_their_name() {
        for (flags, flag) in [
            (&["--name", "a@b"][..], "--name"),
            (&["--kv-deadline", "0s"], "--kv-deadline"),
            (&["--kv-staging-mib", "0"], "--kv-staging-mib"),
            (&["--drain-timeout", "2h"], "--drain-timeout"),
        ] {
            let e = config(flags).unwrap_err().to_string();
            assert!(e.contains(flag), "{flags:?}: {e}");
        }
    }
}
