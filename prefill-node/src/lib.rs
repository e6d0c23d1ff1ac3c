//! Baton prefill node: computes the uncached tail of a turn's prompt (with
//! its own owner-scoped prefix cache, pulling the prefix it lacks from the
//! decode node) and ships the tail's KV blocks over QUIC into the blocks the
//! decode node reserved, layer by layer; answers with the first token.
//!
//! Exports the three things of every service crate: [`Args`], [`Config`]
//! (`TryFrom<Args>`) and [`run`]; plus [`serve`] for an in-process launcher
//! that brings its own listeners, TLS identity and engine.

pub mod metrics;
mod service;
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
use baton_proto::node::prefill_node_server::PrefillNodeServer;
use baton_proto::node::node_control_server::NodeControlServer;
use baton_proto::plane::{Plane, Role as IdRole};
use tokio::net::TcpListener;

pub use baton_kv_transport::transport::select::{RdmaConfig, TransportChoice};
pub use engine_args::{EngineSetup, NodeEngineArgs};
pub use kv::{KvTransportArgs, KvTransportKind};

fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// Flags of `baton prefill`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// This node's ID in the cluster; also the name in its TLS certificate.
    #[arg(long, env = "BATON_NODE_NAME", default_value = "prefill-0")]
    pub name: String,
    /// gRPC address (port 0: any free port).
    #[arg(long, env = "BATON_PREFILL_LISTEN", default_value = "127.0.0.1:7300")]
    pub listen: SocketAddr,
    /// HTTP address of /healthz and /metrics.
    #[arg(long, env = "BATON_PREFILL_HTTP_LISTEN", default_value = "127.0.0.1:7301")]
    pub http_listen: SocketAddr,
    /// UDP address of the KV transport (QUIC; with `--kv-transport rdma`, its control
    /// channel), for prefixes pulled from decode nodes.
    #[arg(long, env = "BATON_PREFILL_KV_LISTEN", default_value = "127.0.0.1:7302")]
    pub kv_listen: SocketAddr,
    /// Host other nodes reach this one at (default: the listen address's).
    #[arg(long, env = "BATON_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// The coordinator's gRPC URL, e.g. http://127.0.0.1:7100 (none: serve alone).
    #[arg(long, env = "BATON_COORDINATOR")]
    pub coordinator: Option<String>,
    /// How long pulling a prefix from a decode node may take.
    #[arg(long, env = "BATON_KV_DEADLINE", default_value = "30s", value_parser = parse_duration)]
    pub kv_deadline: Duration,
    /// Staging memory for pulled prefixes, MiB.
    #[arg(long, env = "BATON_KV_STAGING_MIB", default_value_t = 256)]
    pub kv_staging_mib: usize,
    /// Folder with ca.pem and NAME.pem/NAME.key (`baton certs`): the node's identity on
    /// the KV transport and the internal gRPC plane.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub certs_dir: PathBuf,
    /// INSECURE: serve and call gRPC without TLS, identities or authorization (the KV
    /// transport keeps its mutual TLS). Only for a network of trusted processes.
    #[arg(long, env = "BATON_INSECURE_PLAINTEXT_INTERNAL")]
    pub insecure_plaintext_internal: bool,
    /// Testing only: pause this long after each layer shipped.
    #[arg(long, env = "BATON_KV_LAYER_DELAY", value_parser = parse_duration, hide = true)]
    pub kv_layer_delay: Option<Duration>,
    #[command(flatten)]
    pub kv_transport: KvTransportArgs,
    #[command(flatten)]
    pub engine: NodeEngineArgs,
}

/// A validated prefill node configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub kv_listen: SocketAddr,
    pub advertise_host: Option<String>,
    pub coordinator: Option<String>,
    pub kv_deadline: Duration,
    pub kv_staging_bytes: usize,
    pub certs_dir: PathBuf,
    /// gRPC without TLS (`--insecure-plaintext-internal`).
    pub insecure_plaintext_internal: bool,
    pub kv_layer_delay: Option<Duration>,
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
        Ok(Config {
            name: a.name,
            listen: a.listen,
            http_listen: a.http_listen,
            kv_listen: a.kv_listen,
            advertise_host: a.advertise_host,
            coordinator: a.coordinator,
            kv_deadline: a.kv_deadline,
            kv_staging_bytes: a.kv_staging_mib << 20,
            certs_dir: a.certs_dir,
            insecure_plaintext_internal: a.insecure_plaintext_internal,
            kv_layer_delay: a.kv_layer_delay,
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

/// Where a started node listens (printed as `prefill grpc=.. http=.. kv=..` by `baton prefill`).
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
        println!("prefill grpc={} http={} kv={}", b.grpc, b.http, b.kv_endpoint);
    }, shutdown)
    .await;
    engine.shutdown();
    r
}

/// Serves a prefill node on the given listeners and engine until `shutdown`.
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
    let plane = Plane::for_node(&tls, &config.name, IdRole::Prefill, config.insecure_plaintext_internal)?;
    let metrics = Arc::new(metrics::Metrics::default());
    let draining = Arc::new(AtomicBool::new(false));
    let in_flight = baton_node_common::in_flight::InFlight::default();
    let ready = Arc::new(AtomicBool::new(config.coordinator.is_none()));
    let svc = service::PrefillService {
        engine: engine.clone(),
        kv: kv.clone(),
        plane: plane.clone(),
        metrics: metrics.clone(),
        pull_deadline: config.kv_deadline,
        layer_delay: config.kv_layer_delay,
        draining: draining.clone(),
    };
    let membership_slot = Arc::new(tokio::sync::Mutex::new(None));
    let control = service::Control {
        engine: engine.clone(),
        draining: draining.clone(),
        ready: ready.clone(),
        membership: membership_slot.clone(),
        default_drain_deadline: Duration::from_secs(60),
        in_flight: in_flight.clone(),
    };
    on_bound(&bound);

    let membership = config.coordinator.as_ref().map(|url| {
        let info = NodeInfo {
            node_id: Some(NodeId { id: config.name.clone() }),
            role: Role::Prefill as i32,
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
        .add_service(CountedService::new(PrefillNodeServer::new(svc), in_flight))
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
