//! `baton up`: the whole cluster on this machine, in one process, with the embedded
//! defaults: a coordinator with in-memory membership, one prefill node and one decode
//! node (each with its own engine, real QUIC with mutual TLS between them,
//! or RDMA with `--kv-transport rdma` where a device is there, certificates
//! made fresh at start), and the API gateway with its SQLite store and web page in front
//! of the cluster. One Ctrl-C (or SIGTERM) stops every part; the decode node finishes
//! deregistering and the gateway stops accepting before the engines shut down.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use baton_api_gateway::generator::cluster::{ClusterConfig, ClusterGenerator};
use baton_engine::Engine;
use baton_identity::AdminKey;
use baton_kv_transport::transport::select::TransportChoice;
use baton_node_common::shell::NodeConfig;
use baton_proto::common::Role;
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::ListNodesRequest;
use baton_proto::plane::{Expect, Plane, Role as IdRole};
use clap::Args;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::core_split::CoreSplit;
use crate::engine_args::EngineArgs;

const DECODE_NAME: &str = "decode-0";
const PREFILL_NAME: &str = "prefill-0";
const COORDINATOR_NAME: &str = "coordinator";
const GATEWAY_NAME: &str = "gateway";
/// `baton up`'s own calls (waiting for the nodes to register).
const OPERATOR_NAME: &str = "operator";

/// Flags of `baton up`.
#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub gateway: baton_api_gateway::Args,
    /// The KV transport between the two nodes (`--kv-transport`, `--rdma-*`).
    #[command(flatten)]
    pub kv_transport: baton_node_common::kv::KvTransportArgs,
    /// The coordinator's gRPC address.
    #[arg(long, env = "BATON_COORDINATOR_LISTEN", default_value = "127.0.0.1:7100")]
    pub coordinator_listen: SocketAddr,
    /// The coordinator's HTTP address (/metrics, /debug/routing).
    #[arg(long, env = "BATON_COORDINATOR_HTTP_LISTEN", default_value = "127.0.0.1:7101")]
    pub coordinator_http_listen: SocketAddr,
    /// The decode node's HTTP address (/metrics, /healthz): a stable port to scrape.
    #[arg(long, env = "BATON_DECODE_HTTP_LISTEN", default_value = "127.0.0.1:7201")]
    pub decode_http_listen: SocketAddr,
    /// The prefill node's HTTP address (/metrics, /healthz): a stable port to scrape.
    #[arg(long, env = "BATON_PREFILL_HTTP_LISTEN", default_value = "127.0.0.1:7301")]
    pub prefill_http_listen: SocketAddr,
    /// Uncached prompt tails shorter than this many tokens are prefilled on the decode
    /// node; longer ones on the prefill node.
    #[arg(long, env = "BATON_LOCAL_PREFILL_THRESHOLD", default_value_t = 512)]
    pub local_prefill_threshold: u32,
    /// API key to accept (created for --user if new); without one a key is created
    /// and printed.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The local user the key belongs to.
    #[arg(long, env = "BATON_USER", default_value = "local")]
    pub user: String,
    /// Compute threads of the decode engine (CPU backend). Default: what --threads
    /// (the cores to divide) leaves after the prefill engine's share.
    #[arg(long, env = "BATON_DECODE_THREADS")]
    pub decode_threads: Option<usize>,
    /// Compute threads of the prefill engine (CPU backend). Default: a quarter of
    /// --threads, at least 1 (README, "Configuration").
    #[arg(long, env = "BATON_PREFILL_THREADS")]
    pub prefill_threads: Option<usize>,
    /// The planner in the loop (`--autoscale`, `--max-nodes`, `--autoscale-*`).
    #[command(flatten)]
    pub autoscale: crate::autoscale::AutoscaleArgs,
}

/// Where the parts of a started cluster listen.
struct Started {
    gateway_admin: SocketAddr,
    /// Where a generated admin key was written (`None`: the operator gave one).
    admin_key_file: Option<std::path::PathBuf>,
    coordinator: SocketAddr,
    coordinator_http: SocketAddr,
    decode_http: SocketAddr,
    prefill_http: SocketAddr,
    /// Each engine's backend as it describes itself (for the CPU: its threads).
    engines: String,
}

pub fn run(a: UpArgs) -> Result<()> {
    let model = a.engine.model_path();
    if !model.exists() {
        bail!("model {} not found; run `bash scripts/fetch-model.sh` or pass --model", model.display());
    }
    let gateway_config = baton_api_gateway::Config::try_from(a.gateway.clone())?;
    let kv_transport = TransportChoice::try_from(a.kv_transport.clone())?;
    let split = CoreSplit::divide(a.engine.threads, a.decode_threads, a.prefill_threads)?;
    if a.autoscale.autoscale {
        a.autoscale.check()?;
    }
    if split.oversubscribes(a.engine.threads) {
        tracing::warn!(threads = a.engine.threads, decode = split.decode, prefill = split.prefill, "the engines' threads exceed --threads: they will contend for cores");
    }
    crate::process::runtime()?.block_on(async move {
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            crate::process::shutdown_signal().await;
            eprintln!("baton up: shutting down");
            let _ = stop_tx.send(true);
        });
        let engines = start_engines(&a.engine, split).await?;
        let result = serve(&a, &model, gateway_config, kv_transport, engines.clone(), split, stop_rx).await;
        for e in [&engines.0, &engines.1] {
            e.shutdown();
        }
        result
    })
}

/// The decode node's and the prefill node's engines, loaded side by side, each with
/// its share of the compute threads.
pub(crate) async fn start_engines(args: &EngineArgs, split: CoreSplit) -> Result<(Arc<Engine>, Arc<Engine>)> {
    let (mut d, mut p) = (args.clone(), args.clone());
    d.threads = split.decode;
    p.threads = split.prefill;
    let decode = tokio::task::spawn_blocking(move || d.start());
    let prefill = tokio::task::spawn_blocking(move || p.start());
    let decode = Arc::new(decode.await.context("decode engine")?.context("starting the decode node's engine")?);
    let prefill = Arc::new(prefill.await.context("prefill engine")?.context("starting the prefill node's engine")?);
    Ok((decode, prefill))
}

/// Where the cluster's parts (without the gateway) listen, and what to bind.
pub(crate) struct ClusterSpec<'a> {
    pub engine: &'a EngineArgs,
    /// The engines' compute threads (as `start_engines` was given them).
    pub split: CoreSplit,
    pub model: &'a Path,
    pub coordinator_listen: SocketAddr,
    pub coordinator_http_listen: SocketAddr,
    pub decode_http_listen: SocketAddr,
    pub prefill_http_listen: SocketAddr,
    pub local_prefill_threshold: u32,
    /// The KV transport both nodes ask for (RDMA falls back to QUIC).
    pub kv_transport: TransportChoice,
    /// How the prefill node ships a tail's KV (pipelined unless a benchmark's baseline).
    pub kv_export: baton_prefill_node::KvExportMode,
    /// gRPC between the parts without TLS (`--insecure-plaintext-internal`; benchmarks).
    pub insecure_plaintext_internal: bool,
    /// Opens the coordinator's /debug/routing (`None`: off).
    pub admin_key: Option<AdminKey>,
    /// More identities from the same CA (the nodes `--autoscale` may start), and the
    /// private folder their certificates are written to (`None`: nothing is written).
    pub extra_names: Vec<String>,
    pub certs_out: Option<&'a Path>,
}

/// The coordinator, the decode node and the prefill node, serving in this
/// process until `stop`; the first task to end with an error is in `tasks`.
pub(crate) struct LocalCluster {
    pub coordinator: SocketAddr,
    pub coordinator_http: SocketAddr,
    pub coordinator_url: String,
    pub decode_grpc: SocketAddr,
    pub decode_http: SocketAddr,
    pub prefill_http: SocketAddr,
    /// How a gateway (or a client acting as one) calls the cluster.
    pub gateway_plane: Plane,
    /// `baton up`'s own identity (operator): waits for members, drains autoscaled nodes.
    pub operator_plane: Plane,
    pub tasks: tokio::task::JoinSet<Result<()>>,
}

/// Starts the cluster without its gateway and waits until both nodes are registered.
pub(crate) async fn start_cluster(spec: ClusterSpec<'_>, (decode_engine, prefill_engine): (Arc<Engine>, Arc<Engine>), stop: watch::Receiver<bool>) -> Result<LocalCluster> {
    // A fresh CA per start, in memory only: its key signs these five identities and is
    // then dropped, so nothing outside this process can join the cluster.
    let mut names = vec![DECODE_NAME, PREFILL_NAME, COORDINATOR_NAME, GATEWAY_NAME, OPERATOR_NAME];
    names.extend(spec.extra_names.iter().map(String::as_str));
    let certs = baton_kv_transport::generate_dev_certs("baton-up", &names).context("making the cluster's TLS certificates")?;
    if let Some(dir) = spec.certs_out {
        // Without the CA's key: the started nodes present these, they issue nothing.
        certs.write_to_dir(dir, false).with_context(|| format!("writing the nodes' certificates to {}", dir.display()))?;
    }
    let plane = |name: &str| -> Result<Plane> {
        if spec.insecure_plaintext_internal {
            Ok(Plane::insecure_plaintext())
        } else {
            Ok(Plane::mtls(certs.node_tls(name)?)?)
        }
    };
    let coordinator_config = baton_coordinator::Config {
        listen: spec.coordinator_listen,
        http_listen: spec.coordinator_http_listen,
        local_prefill_threshold: spec.local_prefill_threshold,
        admin_key: spec.admin_key.clone(),
        ..baton_coordinator::Config::with_defaults(plane(COORDINATOR_NAME)?)
    };
    let coordinator = baton_coordinator::Coordinator::bind(coordinator_config).await.context("starting the coordinator")?;
    let coordinator_addr = coordinator.grpc_addr();
    let coordinator_http = coordinator.http_addr();
    let coordinator_url = format!("http://{coordinator_addr}");
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn({
        let stop = stop.clone();
        async move { coordinator.serve(stopped(stop)).await.context("coordinator") }
    });
    let (model, a) = (spec.model, spec.engine);
    let node_engine = |threads: usize| baton_node_common::engine_args::EngineSetup { model: model.to_path_buf(), backend: a.backend, gpu: a.gpu, threads, config: a.engine_config() };
    let loopback = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));

    // Each engine's share of the cores (`CoreSplit`).
    let node_config = |name: &str, threads: usize| NodeConfig {
        insecure_plaintext_internal: spec.insecure_plaintext_internal,
        ..NodeConfig::in_process(name, Some(coordinator_url.clone()), spec.kv_transport.clone(), node_engine(threads))
    };
    // The coordinator alone decides where a tail is prefilled (`local_prefill_threshold` above).
    let decode_config = baton_decode_node::Config { node: node_config(DECODE_NAME, spec.split.decode), role: baton_decode_node::Decode { prefill_addr: None, warm_conversations: 8192 } };
    let decode_parts = baton_decode_node::Parts {
        engine: decode_engine.clone(),
        tls: certs.node_tls(DECODE_NAME)?,
        grpc: TcpListener::bind(loopback(0)).await?,
        http: TcpListener::bind(spec.decode_http_listen).await.with_context(|| format!("binding the decode node's HTTP to {}", spec.decode_http_listen))?,
    };
    let decode_http = decode_parts.http.local_addr()?;
    let decode_grpc = decode_parts.grpc.local_addr()?;
    tasks.spawn({
        let stop = stop.clone();
        async move { baton_decode_node::serve(decode_config, decode_parts, |_| {}, stopped(stop)).await.context("decode node") }
    });

    let prefill_config = baton_prefill_node::Config { node: node_config(PREFILL_NAME, spec.split.prefill), role: baton_prefill_node::Prefill { kv_layer_delay: None, kv_export: spec.kv_export } };
    let prefill_parts = baton_prefill_node::Parts {
        engine: prefill_engine.clone(),
        tls: certs.node_tls(PREFILL_NAME)?,
        grpc: TcpListener::bind(loopback(0)).await?,
        http: TcpListener::bind(spec.prefill_http_listen).await.with_context(|| format!("binding the prefill node's HTTP to {}", spec.prefill_http_listen))?,
    };
    let prefill_http = prefill_parts.http.local_addr()?;
    tasks.spawn({
        let stop = stop.clone();
        async move { baton_prefill_node::serve(prefill_config, prefill_parts, |_| {}, stopped(stop)).await.context("prefill node") }
    });

    let (gateway_plane, operator_plane) = (plane(GATEWAY_NAME)?, plane(OPERATOR_NAME)?);
    wait_for_members(&operator_plane, &coordinator_url, &mut tasks).await?;
    Ok(LocalCluster { coordinator: coordinator_addr, coordinator_http, coordinator_url, decode_grpc, decode_http, prefill_http, gateway_plane, operator_plane, tasks })
}

async fn serve(
    a: &UpArgs,
    model: &Path,
    mut gateway_config: baton_api_gateway::Config,
    kv_transport: TransportChoice,
    engines: (Arc<Engine>, Arc<Engine>),
    split: CoreSplit,
    stop: watch::Receiver<bool>,
) -> Result<()> {
    let started = Instant::now();
    let engine_lines = format!("decode-0: {}; prefill-0: {}", engines.0.info.backend, engines.1.info.backend);
    let gateway_listener = TcpListener::bind(gateway_config.listen).await.with_context(|| format!("binding the gateway to {}", gateway_config.listen))?;
    // Operators' endpoints: the gateway's metrics on a loopback port of their own (or
    // --admin-listen), and one admin key (BATON_ADMIN_KEY, --admin-key-file, or a fresh
    // one in a 0600 file) for the coordinator's /debug/routing and the gateway's /metrics.
    let admin_addr = gateway_config.admin_listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
    let admin_listener = TcpListener::bind(admin_addr).await.with_context(|| format!("binding the gateway's admin listener to {admin_addr}"))?;
    let admin_key_file = match &gateway_config.admin_key {
        Some(_) => None,
        None => {
            let key = AdminKey::generate();
            let file = admin_key_path(&gateway_config.db);
            write_private(&file, key.reveal()).with_context(|| format!("writing the admin key to {}", file.display()))?;
            gateway_config.admin_key = Some(key);
            Some(file)
        }
    };
    // The started nodes' certificates and logs: a folder only this user can open (tempfile
    // makes it 0700), removed when `baton up` stops.
    let autoscale_dir = match a.autoscale.autoscale {
        true => Some(tempfile::Builder::new().prefix("baton-up-autoscale-").tempdir().context("making the autoscaler's private folder")?),
        false => None,
    };
    let spec = ClusterSpec {
        engine: &a.engine,
        split,
        model,
        coordinator_listen: a.coordinator_listen,
        coordinator_http_listen: a.coordinator_http_listen,
        decode_http_listen: a.decode_http_listen,
        prefill_http_listen: a.prefill_http_listen,
        local_prefill_threshold: a.local_prefill_threshold,
        kv_transport,
        kv_export: baton_prefill_node::KvExportMode::Pipelined,
        insecure_plaintext_internal: false,
        admin_key: gateway_config.admin_key.clone(),
        extra_names: if a.autoscale.autoscale { crate::autoscale::fleet::node_names(a.autoscale.max_nodes) } else { Vec::new() },
        certs_out: autoscale_dir.as_ref().map(|d| d.path()),
    };
    let LocalCluster { coordinator: coordinator_addr, coordinator_http, coordinator_url, decode_grpc, decode_http, prefill_http, gateway_plane, operator_plane, mut tasks, .. } =
        start_cluster(spec, engines, stop.clone()).await?;
    if let Some(dir) = &autoscale_dir {
        let fleet = autoscale_fleet(a, model, dir.path(), &coordinator_url, operator_plane, (decode_grpc, decode_http), prefill_http)?;
        let planner = a.autoscale.planner(model)?;
        let (interval, listen) = (a.autoscale.interval, a.autoscale.listen);
        eprintln!("autoscale: on, at most {} nodes per pool; started nodes log to {}", a.autoscale.max_nodes, dir.path().display());
        tasks.spawn({
            let stop = stop.clone();
            async move { crate::autoscale::run(planner, fleet, interval, listen, stop).await.context("autoscale") }
        });
    }

    // The gateway: the key first, so the banner can show it.
    let store = baton_api_gateway::open_store(&gateway_config).await?;
    let key = baton_api_gateway::ensure_key(store.as_ref(), a.api_key.clone(), &a.user).await.context("preparing the API key")?;
    let (tokenizer, template) = baton_api_gateway::load_tokenizer(gateway_config.tokenizer_model.as_deref().unwrap_or(model))?;
    let model_id = gateway_config.served_model_name.clone().unwrap_or_else(|| {
        model.file_stem().map_or_else(|| "baton".to_string(), |s| s.to_string_lossy().into_owned())
    });
    let generator = Arc::new(ClusterGenerator::new(std::slice::from_ref(&coordinator_url), ClusterConfig::default(), gateway_plane).map_err(|e| anyhow::anyhow!("{e}"))?);
    let tls = gateway_config.tls.is_some();
    let chat = template.is_present();
    let app = baton_api_gateway::build_app(gateway_config, generator, store, tokenizer, template, model_id)?;
    let gateway_addr = gateway_listener.local_addr()?;
    let gateway_admin = admin_listener.local_addr()?;
    tasks.spawn({
        let stop = stop.clone();
        async move { baton_api_gateway::server::serve_with_admin(gateway_listener, Some(admin_listener), app, stopped(stop)).await.context("gateway") }
    });
    print_banner(
        gateway_addr,
        tls,
        chat,
        &key,
        a.api_key.is_some(),
        &Started { coordinator: coordinator_addr, coordinator_http, decode_http, prefill_http, gateway_admin, admin_key_file, engines: engine_lines },
        started.elapsed(),
    );

    // The first part to stop (on shutdown, or on its own with an error) stops the rest.
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let result = joined.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(e) = result {
            eprintln!("baton up: {e:#}");
            first_error.get_or_insert(e);
            tasks.abort_all();
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// The pools as `baton up` started them, and how to start more.
fn autoscale_fleet(
    a: &UpArgs,
    model: &Path,
    dir: &Path,
    coordinator_url: &str,
    operator: Plane,
    (decode_grpc, decode_http): (SocketAddr, SocketAddr),
    prefill_http: SocketAddr,
) -> Result<crate::autoscale::fleet::Fleet> {
    use crate::autoscale::fleet::{Fleet, Node, NodeTemplate};
    use baton_bench::planner::Pool;
    let template = NodeTemplate {
        bin: std::env::current_exe().context("finding the baton binary to start nodes with")?,
        certs_dir: dir.to_path_buf(),
        coordinator_url: coordinator_url.to_string(),
        engine_flags: crate::autoscale::engine_flags(&a.engine, model, a.autoscale.node_threads),
        log_dir: dir.to_path_buf(),
    };
    let own = vec![
        Node { name: DECODE_NAME.into(), pool: Pool::Decode, grpc: decode_grpc.to_string(), http: decode_http.to_string(), proc: None },
        // Its gRPC address is not needed: `baton up`'s own nodes are never drained.
        Node { name: PREFILL_NAME.into(), pool: Pool::Prefill, grpc: String::new(), http: prefill_http.to_string(), proc: None },
    ];
    Ok(Fleet::new(template, a.autoscale.max_nodes, operator, own, Duration::from_secs(60)))
}

/// Waits until both nodes hold a lease, or fails if one of them stopped.
async fn wait_for_members(plane: &Plane, coordinator_url: &str, tasks: &mut tokio::task::JoinSet<Result<()>>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let endpoint = plane.endpoint(coordinator_url)?;
    let mut client = loop {
        if let Ok(c) = plane.connect(&endpoint, Expect::Role(IdRole::Coordinator)).await {
            break CoordinatorClient::new(c);
        }
        if Instant::now() > deadline {
            bail!("the coordinator at {coordinator_url} did not start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    loop {
        if let Some(joined) = tasks.try_join_next() {
            joined??;
            bail!("a part of the cluster stopped during start");
        }
        let nodes = client.list_nodes(ListNodesRequest { role: Role::Unspecified as i32 }).await?.into_inner().nodes;
        let has = |role: Role| nodes.iter().any(|n| n.role == role as i32);
        if has(Role::Decode) && has(Role::Prefill) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the nodes did not register with the coordinator within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `tls`: the gateway serves HTTPS (its URLs say so; `curl -k` for a self-signed certificate).
/// `chat`: the model has a chat template; a base model (e.g. Gemma 3 270M) refuses chat, so
/// the example it gets is a legacy completion.
/// The chat page, API base and key come last, where a newcomer looks.
fn print_banner(gateway: SocketAddr, tls: bool, chat: bool, key: &str, key_given: bool, s: &Started, took: Duration) {
    use std::io::Write;
    let key_line = if key_given { "the key from BATON_API_KEY".to_string() } else { key.to_string() };
    let g = format!("{}://{gateway}", if tls { "https" } else { "http" });
    let try_it = if chat {
        "/v1/chat/completions -H \"Authorization: Bearer {key}\" \\\n    -H 'Content-Type: application/json' \\\n    \
         -d '{\"model\":\"baton\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}]}'"
    } else {
        "/v1/completions -H \"Authorization: Bearer {key}\" \\\n    -H 'Content-Type: application/json' \\\n    \
         -d '{\"model\":\"baton\",\"stream\":true,\"prompt\":\"The capital of France is\",\"max_tokens\":16}'\n  \
         (this model has no chat template: chat requests get a 400; it takes raw prompts)"
    }
    .replace("{key}", if key_given { "$BATON_API_KEY" } else { key });
    let admin = match &s.admin_key_file {
        Some(f) => format!("\"Authorization: Bearer $(cat {})\"", f.display()),
        None => "\"Authorization: Bearer $BATON_ADMIN_KEY\"".to_string(),
    };
    // Errors ignored: a reader that went away (`baton up | head`) is no reason to panic
    // and take the cluster down with it.
    let _ = writeln!(
        std::io::stdout().lock(),
        "\n  engines      {}\n  metrics      gateway http://{}/metrics\n  coordinator  grpc {}  http http://{}/metrics\n  decode-0     http://{}/metrics\n  prefill-0    http://{}/metrics\n  routing      curl -H {admin} 'http://{}/debug/routing?key=CONVERSATION'\n\
         \nTry:\n  curl -N {g}{try_it}\n\
         \nCtrl-C stops the cluster.\n\
         \nBaton is up (the cluster started in {:.1} s).\n  web chat     {g}/\n  API          {g}/v1  (OpenAI-compatible)\n  API key      {key_line}",
        s.engines,
        s.gateway_admin,
        s.coordinator,
        s.coordinator_http,
        s.decode_http,
        s.prefill_http,
        s.coordinator_http,
        took.as_secs_f64(),
    );
}

/// Where `baton up` keeps a generated admin key: beside a SQLite store, else here.
fn admin_key_path(db: &Path) -> std::path::PathBuf {
    let dir = match db.to_string_lossy().contains("://") {
        true => Path::new("."),
        false => db.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")),
    };
    dir.join("baton-admin.key")
}

/// Writes `text` to `path`, readable by this user only (replacing an older file).
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    writeln!(f, "{text}")
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}
