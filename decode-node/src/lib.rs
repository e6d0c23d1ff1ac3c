//! Baton decode node: holds each conversation's warm prefix, admits turns,
//! decodes with continuous batching and streams tokens back over gRPC.
//!
//! A turn's uncached tail is prefilled here when it is short (or the prefill
//! pool is saturated), else by a prefill node the coordinator picks, which
//! ships the tail's KV over QUIC into staging blocks reserved here; the
//! engine then starts decoding from the prefill node's first token. A remote
//! prefill that fails for any reason falls back to local prefill.
//!
//! Exports the three things of every service crate: [`Args`], [`Config`]
//! (`TryFrom<Args>`) and [`run`]; plus [`serve`] for an in-process launcher
//! that brings its own listeners, TLS identity and engine.

pub mod drain;
pub mod handoff;
pub mod metrics;
mod service;
pub mod warm;
pub use baton_node_common::{convert, engine_args, kv};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use baton_engine::Engine;
use baton_node_common::in_flight::CountedService;
use baton_kv_transport::NodeTls;
use baton_proto::common::{LoadReport, NodeId, NodeInfo, Role};
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::node::decode_node_server::DecodeNodeServer;
use baton_proto::node::node_control_server::NodeControlServer;
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use tokio::net::TcpListener;

pub use baton_kv_transport::transport::select::{RdmaConfig, TransportChoice};
pub use engine_args::{EngineSetup, NodeEngineArgs};
pub use kv::{KvTransportArgs, KvTransportKind};
pub use handoff::Router;

fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// Flags of `baton decode`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// This node's ID in the cluster; also the name in its TLS certificate.
    #[arg(long, env = "BATON_NODE_NAME", default_value = "decode-0")]
    pub name: String,
    /// gRPC address (port 0: any free port).
    #[arg(long, env = "BATON_DECODE_LISTEN", default_value = "127.0.0.1:7200")]
    pub listen: SocketAddr,
    /// HTTP address of /healthz and /metrics.
    #[arg(long, env = "BATON_DECODE_HTTP_LISTEN", default_value = "127.0.0.1:7201")]
    pub http_listen: SocketAddr,
    /// UDP address of the KV transport (QUIC; with `--kv-transport rdma`, its control channel).
    #[arg(long, env = "BATON_DECODE_KV_LISTEN", default_value = "127.0.0.1:7202")]
    pub kv_listen: SocketAddr,
    /// Host other nodes reach this one at (default: the listen address's).
    #[arg(long, env = "BATON_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// The coordinator's gRPC URL, e.g. http://127.0.0.1:7100. Without one the
    /// node serves alone (and uses --prefill-addr for long tails).
    #[arg(long, env = "BATON_COORDINATOR")]
    pub coordinator: Option<String>,
    /// Without a coordinator: the prefill node's gRPC address for long tails.
    #[arg(long, env = "BATON_PREFILL_ADDR")]
    pub prefill_addr: Option<String>,
    /// Uncached tails shorter than this many tokens are prefilled here.
    #[arg(long, env = "BATON_LOCAL_PREFILL_THRESHOLD", default_value_t = 512)]
    pub local_prefill_threshold: usize,
    /// How long a remote prefill (compute plus KV transfer) may take before
    /// its reservation is released and the node prefills locally.
    #[arg(long, env = "BATON_KV_DEADLINE", default_value = "30s", value_parser = parse_duration)]
    pub kv_deadline: Duration,
    /// Staging memory for KV arriving from prefill nodes, MiB.
    #[arg(long, env = "BATON_KV_STAGING_MIB", default_value_t = 256)]
    pub kv_staging_mib: usize,
    /// How long a drain (`baton drain`, a preStop hook) may take when the
    /// request names no deadline: running turns finish, warm conversations move.
    #[arg(long, env = "BATON_DRAIN_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Conversations whose warm tokens the node remembers for a drain to hand
    /// over (least recently used forgotten first; also bounded to twice the
    /// tokens the KV tiers hold).
    #[arg(long, env = "BATON_WARM_CONVERSATIONS", default_value_t = 8192)]
    pub warm_conversations: usize,
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
}

/// A validated decode node configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub kv_listen: SocketAddr,
    pub advertise_host: Option<String>,
    pub coordinator: Option<String>,
    pub prefill_addr: Option<String>,
    pub local_prefill_threshold: usize,
    pub kv_deadline: Duration,
    pub kv_staging_bytes: usize,
    pub drain_timeout: Duration,
    pub warm_conversations: usize,
    pub certs_dir: PathBuf,
    /// gRPC without TLS (`--insecure-plaintext-internal`).
    pub insecure_plaintext_internal: bool,
    /// The KV transport asked for (`--kv-transport`); RDMA falls back to QUIC.
    pub kv_transport: TransportChoice,
    pub engine: EngineSetup,
}

impl TryFrom<Args> for Config {
    type Error = anyhow::Error;
    fn try_from(a: Args) -> Result<Self> {
        if a.name.is_empty() || a.name.contains('@') {
            anyhow::bail!("--name must be non-empty and without '@'");
        }
        if a.kv_deadline.is_zero() || a.kv_deadline > Duration::from_secs(600) {
            anyhow::bail!("--kv-deadline must be in (0, 600s]");
        }
        if a.kv_staging_mib == 0 {
            anyhow::bail!("--kv-staging-mib must be positive");
        }
        if a.drain_timeout.is_zero() || a.drain_timeout > Duration::from_secs(3600) {
            anyhow::bail!("--drain-timeout must be in (0, 1h]");
        }
        if a.warm_conversations == 0 {
            anyhow::bail!("--warm-conversations must be positive");
        }
        Ok(Config {
            name: a.name,
            listen: a.listen,
            http_listen: a.http_listen,
            kv_listen: a.kv_listen,
            advertise_host: a.advertise_host,
            coordinator: a.coordinator,
            prefill_addr: a.prefill_addr,
            local_prefill_threshold: a.local_prefill_threshold,
            kv_deadline: a.kv_deadline,
            kv_staging_bytes: a.kv_staging_mib << 20,
            drain_timeout: a.drain_timeout,
            warm_conversations: a.warm_conversations,
            certs_dir: a.certs_dir,
            insecure_plaintext_internal: a.insecure_plaintext_internal,
            kv_transport: a.kv_transport.try_into()?,
            engine: a.engine.try_into()?,
        })
    }
}

/// What an in-process launcher hands [`serve`].
pub struct Parts {
    pub engine: Arc<Engine>,
    pub tls: NodeTls,
    pub grpc: TcpListener,
    pub http: TcpListener,
}

/// Where a started node listens (printed as `decode grpc=.. http=.. kv=..` by `baton decode`).
#[derive(Clone, Debug)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub kv_endpoint: String,
}

/// Loads the engine and TLS identity, binds the listeners and serves until
/// `shutdown` resolves. Prints the bound addresses as one line on stdout.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let setup = config.engine.clone();
    let engine = tokio::task::spawn_blocking(move || setup.start()).await.context("engine start")??;
    let tls = kv::load_tls(&config.certs_dir, &config.name)?;
    let grpc = TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let http = TcpListener::bind(config.http_listen).await.with_context(|| format!("binding {}", config.http_listen))?;
    let r = serve(config, Parts { engine: engine.clone(), tls, grpc, http }, |b| {
        println!("decode grpc={} http={} kv={}", b.grpc, b.http, b.kv_endpoint);
    }, shutdown)
    .await;
    engine.shutdown();
    r
}

/// Serves a decode node on the given listeners and engine until `shutdown`.
/// `on_bound` runs once everything listens (before registration).
pub async fn serve(config: Config, parts: Parts, on_bound: impl FnOnce(&Bound), shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let Parts { engine, tls, grpc, http } = parts;
    let layout = kv::transport_layout(&engine.info)?;
    let staging_blocks = (config.kv_staging_bytes / layout.bytes_per_block()).max(1);
    let kv = Arc::new(kv::KvNode::start(&config.name, config.kv_listen, &tls, &config.kv_transport, layout, staging_blocks)?);
    let grpc_local = grpc.local_addr()?;
    let host = config.advertise_host.clone().unwrap_or_else(|| advertise_ip(grpc_local));
    let grpc_addr = format!("{host}:{}", grpc_local.port());
    let kv_endpoint = kv::endpoint_string(&config.name, SocketAddr::new(host.parse().unwrap_or(kv.local_addr.ip()), kv.local_addr.port()));
    let bound = Bound { grpc: grpc_local, http: http.local_addr()?, kv_endpoint: kv_endpoint.clone() };
    let plane = Plane::for_node(&tls, &config.name, IdRole::Decode, config.insecure_plaintext_internal)?;
    let coordinator: Option<CoordinatorClient<tonic::transport::Channel>> = match &config.coordinator {
        Some(url) => {
            let endpoint = plane.endpoint(url)?.connect_timeout(Duration::from_secs(2));
            Some(CoordinatorClient::new(plane.connect_lazy(&endpoint, Expect::Role(IdRole::Coordinator))?))
        }
        None => None,
    };
    let metrics = Arc::new(metrics::Metrics::default());
    let draining = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(config.coordinator.is_none()));
    // Remembering more tokens than the KV tiers can hold is pointless; twice that is slack.
    let warm_tokens = 2 * (engine.info.kv_blocks + engine.info.tier2_blocks) * engine.info.kv_layout.block_tokens;
    let warm = Arc::new(warm::WarmTable::new(config.warm_conversations, warm_tokens));
    let in_flight = drain::InFlight::default();
    let membership_slot = Arc::new(tokio::sync::Mutex::new(None));
    let drainer = Arc::new(drain::Drainer {
        engine: engine.clone(),
        warm: warm.clone(),
        in_flight: in_flight.clone(),
        draining: draining.clone(),
        ready: ready.clone(),
        coordinator: coordinator.clone(),
        plane: plane.clone(),
        membership: membership_slot.clone(),
        node_id: config.name.clone(),
        grpc_addr: grpc_addr.clone(),
        metrics: metrics.clone(),
        default_deadline: config.drain_timeout,
        running: tokio::sync::Mutex::new(()),
    });
    let svc = service::DecodeService {
        engine: engine.clone(),
        kv: kv.clone(),
        plane: plane.clone(),
        router: Router {
            threshold: config.local_prefill_threshold,
            coordinator,
            static_prefill: config.prefill_addr.clone(),
            node_id: config.name.clone(),
        },
        metrics: metrics.clone(),
        grpc_addr: grpc_addr.clone(),
        kv_deadline: config.kv_deadline,
        draining: draining.clone(),
        warm: warm.clone(),
    };
    let control = service::Control { engine: engine.clone(), warm, drainer };
    on_bound(&bound);

    let membership = config.coordinator.as_ref().map(|url| {
        let info = NodeInfo {
            node_id: Some(NodeId { id: config.name.clone() }),
            role: Role::Decode as i32,
            grpc_addr: grpc_addr.clone(),
            kv_endpoint: kv_endpoint.clone(),
            block_tokens: layout.block_tokens,
            kv_blocks_total: engine.info.kv_blocks as u64,
            load: None,
        };
        let e = engine.clone();
        let handle = baton_proto::client::MembershipClient::new(url.clone(), info, plane.clone()).with_load(move || load_report(&e)).spawn();
        let mut watch = handle.watch();
        let (ready, draining) = (ready.clone(), draining.clone());
        tokio::spawn(async move {
            loop {
                let registered = watch.borrow_and_update().lease_id.is_some();
                ready.store(registered && !draining.load(Ordering::SeqCst), Ordering::SeqCst);
                if watch.changed().await.is_err() {
                    break;
                }
            }
        });
        handle
    });
    *membership_slot.lock().await = membership;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let grpc_srv = tonic::transport::Server::builder()
        .layer(plane.authorize())
        .add_service(CountedService::new(DecodeNodeServer::new(svc), in_flight))
        .add_service(NodeControlServer::new(control))
        .serve_with_incoming_shutdown(plane.incoming(grpc), stopped(stop_rx.clone()));
    let http_srv = axum::serve(http, metrics::router(metrics::HttpState { metrics, engine: engine.clone(), kv: Some(kv.clone()), ready, plane: plane.stats() })).with_graceful_shutdown(stopped(stop_rx));
    let (g, h) = tokio::join!(grpc_srv, http_srv);
    if let Some(m) = membership_slot.lock().await.take() {
        m.shutdown().await;
    }
    kv.receiver.shutdown();
    g.context("gRPC server")?;
    h.context("HTTP server")?;
    Ok(())
}

async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

fn advertise_ip(local: SocketAddr) -> String {
    if local.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        local.ip().to_string()
    }
}

/// The load a node reports with each keep-alive.
pub fn load_report(engine: &Engine) -> LoadReport {
    let st = engine.stats();
    LoadReport { kv_blocks_free: (st.kv.free + st.kv.cached) as u64, running: st.running as u32, waiting: st.waiting as u32 }
}
