//! The node shell: everything a node process does besides its role. It loads
//! the engine and the TLS identity, binds the listeners, starts the KV
//! transport, sets up the internal plane (mutual TLS on every gRPC connection
//! and the authorization table, here and nowhere else in a node), registers
//! with the coordinator and keeps the lease, serves `/healthz` and `/metrics`,
//! answers `NodeControl` (Evict, Drain) and stops on the shutdown signal.
//!
//! A role plugs in through [`NodeRole`]: it names its identity role and its
//! metrics, and builds its gRPC service from the [`Node`] the shell hands it
//! (and, through [`ControlHooks`], what an eviction or a drain must also do).

pub mod args;
mod control;
mod registration;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use baton_engine::Engine;
use baton_kv_transport::NodeTls;
use baton_proto::Coordinators;
use baton_proto::node::node_control_server::NodeControlServer;
use baton_proto::node::NodeStats;
use baton_proto::plane::{Plane, Role as IdRole};
use tokio::net::TcpListener;
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::Status;

pub use args::{parse_duration, Args, Config, NodeArgs, NodeConfig, RoleDefaults};
pub use control::ControlHooks;
pub use registration::load_report;

use crate::engine_metrics::{MetricsSpec, NodeRecorder};
use crate::in_flight::{CountedService, InFlight};
use crate::kv::{self, KvNode};

/// A node role: what it is called and what it serves. The type is also the
/// role's own flags (`clap::Args`), beside the shell's in [`Args`].
pub trait NodeRole: Send + 'static {
    /// The role its certificate must name; also its role in the coordinator's membership.
    const ROLE: IdRole;
    /// Its defaults of the shell's flags ([`node_role!`](crate::node_role)).
    type Defaults: RoleDefaults;
    /// Its series' prefix and histogram buckets.
    const METRICS: MetricsSpec;
    /// Checks the role's own flags.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// Builds the role's services over the started node.
    fn build(self, node: &Node) -> Result<RoleParts>;
}

/// What a role hands the shell.
pub struct RoleParts {
    /// The role's gRPC services; wrap the ones a drain waits for with [`Node::counted`].
    pub routes: Routes,
    /// What `NodeControl` does besides evicting from the engine and stopping work.
    pub hooks: Arc<dyn ControlHooks>,
}

/// A started node, as its role's services see it.
pub struct Node {
    pub config: NodeConfig,
    pub engine: Arc<Engine>,
    pub kv: Arc<KvNode>,
    /// How this node calls other nodes.
    pub plane: Plane,
    /// Every coordinator replica (`--coordinator`), over the plane, called with
    /// failover; `None` when serving alone.
    pub coordinator: Option<Arc<Coordinators>>,
    /// This node's gRPC address as others reach it.
    pub grpc_addr: String,
    /// Set by the first drain: the role refuses new work from then on.
    pub draining: Arc<AtomicBool>,
    /// The calls a drain waits for.
    pub in_flight: InFlight,
    /// The node's series; the role registers its own in it.
    pub metrics: Arc<NodeRecorder>,
}

impl Node {
    /// `svc` as a route whose calls count as in flight until their reply is written.
    pub fn counted<S>(&self, svc: S) -> Routes
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>, Error = std::convert::Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        Routes::new(CountedService::new(svc, self.in_flight.clone()))
    }
}

/// The `Stats` both roles answer; a role adds its own counters.
pub fn node_stats(engine: &Engine, kv: &KvNode) -> NodeStats {
    let st = engine.stats();
    NodeStats {
        kv_blocks_total: st.kv.total as u64,
        kv_blocks_free: st.kv.free as u64,
        kv_blocks_used: st.kv.used as u64,
        kv_blocks_cached: st.kv.cached as u64,
        running: st.running as u32,
        waiting: st.waiting as u32,
        live_reservations: kv.receiver.live_reservations() as u32,
        staging_blocks_used: kv.staging_used() as u64,
        ..Default::default()
    }
}

/// Runs a blocking engine call off the async workers.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|_| Status::internal("engine call panicked"))
}

/// What an in-process launcher hands [`serve`].
pub struct Parts {
    pub engine: Arc<Engine>,
    pub tls: NodeTls,
    pub grpc: TcpListener,
    pub http: TcpListener,
}

/// Where a started node listens (printed as `ROLE grpc=.. http=.. kv=..` by [`run`]).
#[derive(Clone, Debug)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub kv_endpoint: String,
}

/// Loads the engine and TLS identity, binds the listeners and serves `role` until
/// `shutdown` resolves. Prints the bound addresses as one line on stdout.
pub async fn run<R: NodeRole>(config: Config<R>, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let Config { node: config, role } = config;
    let setup = config.engine.clone();
    let engine = tokio::task::spawn_blocking(move || setup.start()).await.map_err(|e| Error::Server { what: "engine start", reason: e.to_string() })??;
    let tls = kv::load_tls(&config.certs_dir, &config.name)?;
    let grpc = TcpListener::bind(config.listen).await.map_err(Error::io(format!("binding {}", config.listen)))?;
    let http = TcpListener::bind(config.http_listen).await.map_err(Error::io(format!("binding {}", config.http_listen)))?;
    let print = |b: &Bound| println!("{} grpc={} http={} kv={}", R::ROLE.as_str(), b.grpc, b.http, b.kv_endpoint);
    let r = serve(Config { node: config, role }, Parts { engine: engine.clone(), tls, grpc, http }, print, shutdown).await;
    engine.shutdown();
    r
}

/// Serves `role` on the given listeners and engine until `shutdown`.
/// `on_bound` runs once everything listens (before registration).
pub async fn serve<R: NodeRole>(
    config: Config<R>,
    parts: Parts,
    on_bound: impl FnOnce(&Bound),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let Config { node: mut config, role } = config;
    let Parts { engine, tls, grpc, http } = parts;
    let layout = kv::transport_layout(&engine.info)?;
    // `--rdma-ring-memory device`: the rings in the engine's GPU memory (the config keeps it
    // alive for as long as the node serves).
    kv::supply_ring_memory(&mut config.kv_transport, &engine.info.backend, config.engine.gpu, layout);
    let staging_blocks = (config.kv_staging_bytes / layout.bytes_per_block()).max(1);
    // With the rings on the GPU, staging there too: a received block never visits the host.
    let staging_memory = kv::device_staging_memory(&config.kv_transport, config.engine.gpu, staging_blocks * layout.bytes_per_block());
    let mut kv_node = KvNode::start_staging_in(&config.name, config.kv_listen, &tls, &config.kv_transport, layout, staging_blocks, staging_memory)?
        .with_windows(engine.info.layer_windows.clone());
    // With the send rings on the GPU, an exported layer stays there until it is copied into
    // a send slot: no copy to the host behind each layer.
    if kv_node.sender.sends_from_device() {
        engine.keep_layer_exports_on_device(true).map_err(|e| Error::Server { what: "engine", reason: e.to_string() })?;
        tracing::info!("exported KV layers stay in GPU memory (RDMA send rings there)");
    }
    let grpc_local = grpc.local_addr().map_err(Error::io("the gRPC listener's address"))?;
    let host = config.advertise_host.clone().unwrap_or_else(|| advertise_ip(grpc_local));
    let grpc_addr = format!("{host}:{}", grpc_local.port());
    let kv_endpoint = kv::endpoint_string(&config.name, SocketAddr::new(host.parse().unwrap_or(kv_node.local_addr.ip()), kv_node.local_addr.port()));
    // Peers reach the KV listener where it is advertised, not where it is bound (0.0.0.0,
    // or an address behind a relay): the endpoint sent in every transfer request (a
    // remote prefill's, a prefix pull's) must be the advertised one, as in registration.
    kv_node.endpoint = kv_endpoint.clone();
    let kv = Arc::new(kv_node);
    let bound = Bound { grpc: grpc_local, http: http.local_addr().map_err(Error::io("the HTTP listener's address"))?, kv_endpoint: kv_endpoint.clone() };
    // The node's one plane: its certificate must name this role and this node.
    let plane = Plane::for_node(&tls, &config.name, R::ROLE, config.insecure_plaintext_internal)?;
    let coordinator = if config.coordinators.is_empty() {
        None
    } else {
        Some(Arc::new(Coordinators::connect_lazy(&config.coordinators, &plane, Duration::from_secs(2), None)?))
    };
    let node = Node {
        config,
        engine: engine.clone(),
        kv: kv.clone(),
        plane: plane.clone(),
        coordinator,
        grpc_addr,
        draining: Arc::new(AtomicBool::new(false)),
        in_flight: InFlight::default(),
        metrics: Arc::new(NodeRecorder::new(&R::METRICS)),
    };
    let RoleParts { routes, hooks } = role.build(&node)?;
    let ready = Arc::new(AtomicBool::new(node.config.coordinators.is_empty()));
    let membership = Arc::new(tokio::sync::Mutex::new(None));
    let control = control::Control::new(&node, hooks, ready.clone(), membership.clone());
    on_bound(&bound);
    *membership.lock().await = registration::register(&node, R::ROLE, &kv_endpoint, &ready);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let grpc_srv = tonic::transport::Server::builder()
        .layer(plane.authorize())
        .add_routes(routes.add_service(NodeControlServer::new(control)))
        .serve_with_incoming_shutdown(plane.incoming(grpc), stopped(stop_rx.clone()));
    let state = crate::http::HttpState { metrics: node.metrics.clone(), engine, kv: Some(kv.clone()), ready, plane: plane.stats() };
    let http_srv = axum::serve(http, crate::http::router(state)).with_graceful_shutdown(stopped(stop_rx));
    let (g, h) = tokio::join!(grpc_srv, http_srv);
    if let Some(m) = membership.lock().await.take() {
        m.shutdown().await;
    }
    kv.receiver.shutdown();
    g.map_err(|e| Error::Server { what: "gRPC server", reason: e.to_string() })?;
    h.map_err(Error::io("HTTP server"))?;
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
