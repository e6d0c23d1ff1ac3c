//! Baton coordinator: membership, routing, fleet-wide eviction.
//!
//! - [`membership`]: nodes join with a lease and leave when it expires; in memory (the
//!   embedded default) or in etcd, behind one trait.
//! - [`routing`]: decode placement by consistent hashing with bounded loads on the
//!   routing key, prefill placement with prefix credit, conditional disaggregation, and
//!   a "why this node" record for every decision.
//! - [`evict`]: a conversation's KV dropped from every node, acknowledged.
//! - [`tombstones`]: deleted conversations not yet evicted everywhere (in memory, or in
//!   etcd for every replica), the nodes that may still hold them, and the rule that a
//!   (re)joining node evicts them before it serves.
//!
//! The service follows the crate shape every Baton service has: [`Args`] (clap, env
//! `BATON_*`), [`Config`] (`TryFrom<Args>`), and [`run`]. [`Coordinator::bind`] /
//! [`Coordinator::from_listeners`] plus [`Coordinator::serve`] let `baton up` start it in
//! process and learn its addresses first.

pub mod custody;
pub mod error;
pub mod evict;
mod http;
pub mod membership;
pub mod metrics;
pub mod placements;
pub mod routing;
mod service;
pub mod tombstones;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use baton_proto::coordinator::coordinator_server::CoordinatorServer;
use baton_identity::AdminKey;
use baton_proto::plane::{Plane, Role as IdRole};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use error::{Error, Result};
pub use evict::{EvictError, GrpcEvictor, NodeEvictor};
#[cfg(feature = "etcd")]
pub use membership::EtcdMembership;
pub use membership::{Lease, Member, Membership, MemoryMembership};
pub use service::CoordinatorService;

/// Where membership lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MembershipKind {
    /// Inside the coordinator (one coordinator; the embedded default).
    Memory,
    /// In etcd (leases and records shared by every coordinator).
    Etcd,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// `baton coordinator` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// gRPC listen address.
    #[arg(long, env = "BATON_COORDINATOR_LISTEN", default_value = "127.0.0.1:7100")]
    pub listen: SocketAddr,
    /// HTTP listen address (/healthz, /metrics; /debug/routing with the admin key). Keep
    /// it on a private network: /metrics needs no key.
    #[arg(long, env = "BATON_COORDINATOR_HTTP_LISTEN", default_value = "127.0.0.1:7101")]
    pub http_listen: SocketAddr,
    /// File holding the admin key that opens /debug/routing (or set BATON_ADMIN_KEY);
    /// without one, /debug/routing is off.
    #[arg(long, env = "BATON_ADMIN_KEY_FILE")]
    pub admin_key_file: Option<std::path::PathBuf>,
    /// Membership backend.
    #[arg(long, env = "BATON_MEMBERSHIP", value_enum, default_value = "memory")]
    pub membership: MembershipKind,
    /// etcd endpoints, comma-separated (with --membership etcd).
    #[arg(long, env = "BATON_ETCD_ENDPOINTS", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix for Baton's records in etcd.
    #[arg(long, env = "BATON_ETCD_PREFIX", default_value = "/baton/")]
    pub etcd_prefix: String,
    /// Lease TTL: a node that does not renew within it leaves.
    #[arg(long, env = "BATON_LEASE_TTL", default_value = "10s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// Virtual nodes per decode node on the hash ring.
    #[arg(long, env = "BATON_RING_VNODES", default_value_t = 160)]
    pub vnodes: u32,
    /// Bounded-load factor c: no decode node holds more than c times the mean.
    #[arg(long, env = "BATON_LOAD_FACTOR", default_value_t = 1.25)]
    pub load_factor: f64,
    /// Uncached tails shorter than this many tokens are prefilled on the decode node.
    #[arg(long, env = "BATON_LOCAL_PREFILL_THRESHOLD", default_value_t = 512)]
    pub local_prefill_threshold: u32,
    /// A prefill node with this many waiting sequences counts as saturated.
    #[arg(long, env = "BATON_PREFILL_MAX_WAITING", default_value_t = 8)]
    pub prefill_max_waiting: u32,
    /// Credit (in queued sequences) for a prefill node that holds the whole prefix.
    #[arg(long, env = "BATON_PREFILL_CACHE_CREDIT", default_value_t = 2.0)]
    pub prefill_cache_credit: f64,
    /// A conversation with no turn for this long stops counting as decode load.
    #[arg(long, env = "BATON_CONVERSATION_IDLE_TTL", default_value = "30m", value_parser = parse_duration)]
    pub conversation_idle_ttl: Duration,
    /// Routing decisions kept for /debug/routing and Explain.
    #[arg(long, env = "BATON_EXPLAIN_CAPACITY", default_value_t = 4096)]
    pub explain_capacity: usize,
    /// How long a node may take to acknowledge an eviction.
    #[arg(long, env = "BATON_EVICT_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub evict_timeout: Duration,
    /// How long a node that left the ring (lease expired, deregistered) still counts as
    /// possibly holding KV: evictions report it pending, so deleted conversations stay
    /// tombstoned until it re-joins (and evicts them) or this window passes.
    #[arg(long, env = "BATON_EVICT_DEPARTED_WINDOW", default_value = "1h", value_parser = parse_duration)]
    pub evict_departed_window: Duration,
    /// Folder with ca.pem and this coordinator's certificate and key (`baton certs`), for
    /// the internal plane's mutual TLS.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub certs_dir: std::path::PathBuf,
    /// File name of the certificate in --certs-dir (NAME.pem, NAME.key); it must name a
    /// coordinator identity (NAME.coordinator.baton).
    #[arg(long, env = "BATON_TLS_NAME", default_value = "coordinator")]
    pub tls_name: String,
    /// How many node names one pool (wildcard, `*.ROLE.baton`) certificate may hold; 0
    /// refuses pool certificates, so each node needs its own. A pool certificate's key is
    /// shared by every pod: opt in only where per-pod certificates cannot be issued.
    #[arg(long, env = "BATON_POOL_CERTIFICATE_NAMES", default_value_t = 0)]
    pub pool_certificate_names: usize,
    /// INSECURE: serve gRPC without TLS, identities or authorization; anyone who can reach
    /// the port may register nodes, route and evict. Only for a network of trusted processes.
    #[arg(long, env = "BATON_INSECURE_PLAINTEXT_INTERNAL")]
    pub insecure_plaintext_internal: bool,
}

/// Membership backend, validated.
#[derive(Debug, Clone, PartialEq)]
pub enum MembershipConfig {
    Memory,
    Etcd { endpoints: Vec<String>, prefix: String },
}

/// A validated coordinator configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub membership: MembershipConfig,
    pub lease_ttl: Duration,
    pub vnodes: u32,
    pub load_factor: f64,
    pub local_prefill_threshold: u32,
    pub prefill_max_waiting: u32,
    pub prefill_cache_credit: f64,
    pub conversation_idle_ttl: Duration,
    pub explain_capacity: usize,
    pub evict_timeout: Duration,
    pub evict_departed_window: Duration,
    /// Names one pool certificate may hold (0: pool certificates may not register).
    pub pool_certificate_names: usize,
    /// The internal plane: mutual TLS as this coordinator, or plaintext.
    pub plane: Plane,
    /// Opens /debug/routing; `None`: it is off.
    pub admin_key: Option<AdminKey>,
}

impl Config {
    /// The embedded defaults, on ephemeral loopback ports, serving on `plane` (there is
    /// no default plane: a caller chooses TLS or, by name, plaintext).
    pub fn with_defaults(plane: Plane) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            membership: MembershipConfig::Memory,
            lease_ttl: Duration::from_secs(10),
            vnodes: 160,
            load_factor: 1.25,
            local_prefill_threshold: 512,
            prefill_max_waiting: 8,
            prefill_cache_credit: 2.0,
            conversation_idle_ttl: Duration::from_secs(1800),
            explain_capacity: 4096,
            evict_timeout: Duration::from_secs(5),
            evict_departed_window: Duration::from_secs(3600),
            pool_certificate_names: 0,
            plane,
            admin_key: None,
        }
    }
}

impl TryFrom<Args> for Config {
    type Error = Error;

    fn try_from(a: Args) -> Result<Self> {
        let bad = |field, why: &str| Error::Config { field, why: why.to_string() };
        if a.vnodes == 0 {
            return Err(bad("vnodes", "must be at least 1"));
        }
        if !(a.load_factor.is_finite() && a.load_factor >= 1.0) {
            return Err(bad("load_factor", "must be a finite number >= 1"));
        }
        if a.lease_ttl < Duration::from_millis(100) {
            return Err(bad("lease_ttl", "must be at least 100ms"));
        }
        if !(a.prefill_cache_credit.is_finite() && a.prefill_cache_credit >= 0.0) {
            return Err(bad("prefill_cache_credit", "must be a finite number >= 0"));
        }
        if a.explain_capacity == 0 {
            return Err(bad("explain_capacity", "must be at least 1"));
        }
        let membership = match a.membership {
            MembershipKind::Memory => MembershipConfig::Memory,
            #[cfg(not(feature = "etcd"))]
            MembershipKind::Etcd => {
                return Err(bad("membership", "this build has no etcd membership (built without the `etcd` feature; `cargo build --release` has it)"));
            }
            #[cfg(feature = "etcd")]
            MembershipKind::Etcd => {
                let endpoints: Vec<String> = a.etcd_endpoints.into_iter().filter(|e| !e.is_empty()).collect();
                if endpoints.is_empty() {
                    return Err(bad("etcd_endpoints", "at least one endpoint is needed with --membership etcd"));
                }
                MembershipConfig::Etcd { endpoints, prefix: a.etcd_prefix }
            }
        };
        Ok(Self {
            listen: a.listen,
            http_listen: a.http_listen,
            membership,
            lease_ttl: a.lease_ttl,
            vnodes: a.vnodes,
            load_factor: a.load_factor,
            local_prefill_threshold: a.local_prefill_threshold,
            prefill_max_waiting: a.prefill_max_waiting,
            prefill_cache_credit: a.prefill_cache_credit,
            conversation_idle_ttl: a.conversation_idle_ttl,
            explain_capacity: a.explain_capacity,
            evict_timeout: a.evict_timeout,
            evict_departed_window: a.evict_departed_window,
            pool_certificate_names: a.pool_certificate_names,
            plane: Plane::from_flags(&a.certs_dir, &a.tls_name, IdRole::Coordinator, a.insecure_plaintext_internal)
                .map_err(|e| Error::Config { field: "certs_dir", why: e.to_string() })?,
            admin_key: AdminKey::from_env_or_file(a.admin_key_file.as_deref())
                .map_err(|e| Error::Config { field: "admin_key_file", why: e.to_string() })?,
        })
    }
}

/// A coordinator bound to its ports, not yet serving.
#[derive(Debug)]
pub struct Coordinator {
    grpc: TcpListener,
    http: TcpListener,
    state: Arc<service::State>,
    plane: Plane,
    admin_key: Option<AdminKey>,
}

impl Coordinator {
    /// Binds `config.listen` and `config.http_listen` and builds the membership backend
    /// (connecting to etcd if configured). Must run inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Self> {
        let grpc = TcpListener::bind(config.listen).await.map_err(|source| Error::Bind { addr: config.listen, source })?;
        let http =
            TcpListener::bind(config.http_listen).await.map_err(|source| Error::Bind { addr: config.http_listen, source })?;
        Self::from_listeners(config, grpc, http).await
    }

    /// Uses listeners the caller bound (`config.listen`/`http_listen` are ignored).
    pub async fn from_listeners(config: Config, grpc: TcpListener, http: TcpListener) -> Result<Self> {
        let evictor = Arc::new(GrpcEvictor::new(config.plane.clone()));
        Self::with_evictor(config, grpc, http, evictor).await
    }

    /// As [`Coordinator::from_listeners`], with a custom eviction fan-out (tests).
    pub async fn with_evictor(
        config: Config,
        grpc: TcpListener,
        http: TcpListener,
        evictor: Arc<dyn NodeEvictor>,
    ) -> Result<Self> {
        type Stores = (Arc<dyn Membership>, Option<Arc<dyn placements::SharedPlacements>>, Arc<dyn tombstones::Tombstones>);
        let (membership, shared, tombstones): Stores = match &config.membership {
            MembershipConfig::Memory => (MemoryMembership::new(config.lease_ttl), None, Arc::new(tombstones::MemoryTombstones::default())),
            #[cfg(not(feature = "etcd"))]
            MembershipConfig::Etcd { .. } => {
                return Err(Error::Config { field: "membership", why: "this build has no etcd membership".into() });
            }
            #[cfg(feature = "etcd")]
            MembershipConfig::Etcd { endpoints, prefix } => {
                let membership = EtcdMembership::connect(endpoints, prefix, config.lease_ttl).await?;
                let shared = placements::EtcdPlacements::start(membership.client(), prefix, config.conversation_idle_ttl).await?;
                // Every replica's, so a node re-joining through any replica evicts them.
                let tombstones = Arc::new(tombstones::EtcdTombstones::new(membership.client(), prefix, config.evict_departed_window));
                (membership, Some(shared), tombstones)
            }
        };
        let state = Arc::new(service::State::new(&config, membership, shared, tombstones, evictor)?);
        Ok(Self { grpc, http, state, plane: config.plane, admin_key: config.admin_key })
    }

    /// The gRPC address (what nodes and gateways dial).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc.local_addr().expect("a bound listener has an address")
    }

    /// The HTTP address (/healthz, /metrics, /debug/routing).
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr().expect("a bound listener has an address")
    }

    /// Serves gRPC and HTTP until `shutdown` completes, then stops both gracefully.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        tracing::info!(
            grpc = %self.grpc_addr(),
            http = %self.http_addr(),
            membership = self.state.membership.backend(),
            "coordinator serving"
        );
        let svc = CoordinatorService { state: self.state.clone() };
        let grpc = tonic::transport::Server::builder()
            .layer(self.plane.authorize())
            .add_service(CoordinatorServer::new(svc))
            .serve_with_incoming_shutdown(self.plane.incoming(self.grpc), stopped(stop_rx.clone()));
        let http = axum::serve(self.http, http::router(http::HttpState { state: self.state.clone(), plane: self.plane.stats(), admin_key: self.admin_key.clone() })).with_graceful_shutdown(stopped(stop_rx));
        let (g, h) = tokio::join!(grpc, http);
        g.map_err(|e| Error::Serve(e.to_string()))?;
        h.map_err(|e| Error::Serve(e.to_string()))?;
        Ok(())
    }
}

/// Runs the coordinator until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    Coordinator::bind(config).await?.serve(shutdown).await
}
