//! The chaos suite's cluster, as separate processes on loopback: a real etcd, two
//! coordinators over it, one PostgreSQL, two gateways on it, prefill and decode nodes,
//! and one fault-injecting UDP relay in front of each decode node's KV listener.
//!
//! Every process has fixed ports (free ones picked at start), so a process killed and
//! started again by [`ChaosCluster::restart`] comes back where the others expect it, as
//! under an operator's supervisor. Certificates come from a fresh cluster CA whose key is
//! dropped once they are written (as `baton up` makes them); every process checks its
//! peers' with mutual TLS as in production.
//!
//! A decode node's KV listener binds 127.0.0.2 and advertises 127.0.0.1 (the same port),
//! where its relay listens: every KV transfer to it, a prefill node's tail or another
//! node's prefix pull, crosses the relay. QUIC and its TLS run end to end through it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use baton::harness::etcd::Etcd;
use baton::harness::postgres::TempPostgres;
use baton::harness::{free_port, wait_ok, BatonProc, Spec};
use baton_bench::chaos::proxy::FaultProxy;

/// The KV listener's host behind a decode node's relay (loopback, not the advertised one).
const BEHIND_RELAY: &str = "127.0.0.2";

/// How big the cluster is and how its parts are tuned.
#[derive(Clone, Debug)]
pub struct Shape {
    pub coordinators: usize,
    pub gateways: usize,
    pub prefill: usize,
    pub decode: usize,
    pub model: PathBuf,
    /// Lease of a node in the coordinators' membership.
    pub lease_ttl: Duration,
    /// Tails at least this long are prefilled on a prefill node (so KV crosses the relays).
    pub local_prefill_threshold: u32,
    /// A gateway replica whose heartbeat is this old is dead (its turns can be taken over).
    pub replica_dead_after: Duration,
    /// How long a KV transfer may take before its reservation is released.
    pub kv_deadline: Duration,
    pub kv_memory_mib: u32,
}

/// What kind of process, for names, logs and faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Coordinator,
    Gateway,
    Prefill,
    Decode,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Coordinator => "coordinator",
            Kind::Gateway => "gateway",
            Kind::Prefill => "prefill",
            Kind::Decode => "decode",
        }
    }
}

/// One process the harness supervises: how to start it, and the running one.
pub struct Member {
    pub kind: Kind,
    pub name: String,
    pub spec: Spec,
    /// Its HTTP address (health, metrics): a node's or coordinator's HTTP listener, a
    /// gateway's API listener.
    pub http: String,
    pub proc: Option<BatonProc>,
}

impl Member {
    fn start(&mut self) -> Result<()> {
        let p = BatonProc::spawn(&self.spec).with_context(|| format!("starting {}", self.name))?;
        self.proc = Some(p);
        // A node is healthy once registered; the coordinator and gateway once serving.
        wait_ok(&self.http, "/healthz", Duration::from_secs(120)).with_context(|| format!("{} did not get healthy", self.name))
    }
}

/// The whole cluster; every process stops when it drops.
pub struct ChaosCluster {
    pub dir: tempfile::TempDir,
    pub etcd: Etcd,
    pub postgres: TempPostgres,
    pub members: Vec<Member>,
    /// One relay per decode node, in the order of the decode members.
    pub relays: Vec<FaultProxy>,
    pub api_key: String,
}

fn loopback(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

impl ChaosCluster {
    /// Starts everything and waits until every process is healthy. `bin`: the `baton` binary.
    pub async fn start(bin: &Path, shape: &Shape) -> Result<ChaosCluster> {
        if shape.coordinators == 0 || shape.gateways == 0 || shape.prefill == 0 || shape.decode == 0 {
            bail!("the cluster needs at least one process of every kind");
        }
        let dir = tempfile::Builder::new().prefix("baton-chaos-").tempdir()?;
        let etcd = Etcd::start()?.context("no etcd binary on PATH or in BATON_ETCD_BIN (bash scripts/setup.sh test installs it)")?;
        etcd.wait_ready(Duration::from_secs(30))?;
        let postgres = tokio::task::block_in_place(TempPostgres::start).context("starting PostgreSQL (bash scripts/setup.sh test installs it)")?;
        let certs = dir.path().join("certs");
        let name = |k: Kind, i: usize| format!("{}-{i}", k.name());
        let mut names = Vec::new();
        for (k, n) in [(Kind::Coordinator, shape.coordinators), (Kind::Gateway, shape.gateways), (Kind::Prefill, shape.prefill), (Kind::Decode, shape.decode)] {
            names.extend((0..n).map(|i| name(k, i)));
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        baton::harness::write_certs(&certs, "baton-chaos", &refs)?;

        let certs_dir = certs.to_string_lossy().into_owned();
        let model = shape.model.to_string_lossy().into_owned();
        let log = |n: &str| Some(dir.path().join(format!("{n}.log")));
        let spec = |args: Vec<String>, n: &str, prints: bool| Spec { bin: bin.to_path_buf(), args, log: log(n), prints_addresses: prints };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
        let secs = |d: Duration| format!("{}ms", d.as_millis());

        let mut members = Vec::new();
        let mut coordinator_urls = Vec::new();
        for i in 0..shape.coordinators {
            let n = name(Kind::Coordinator, i);
            let (grpc, http) = (loopback(free_port()?), loopback(free_port()?));
            coordinator_urls.push(format!("http://{grpc}"));
            let mut args = s(&["coordinator", "--listen", &grpc, "--http-listen", &http, "--certs-dir", &certs_dir, "--tls-name", &n]);
            args.extend(s(&["--membership", "etcd", "--etcd-endpoints", &etcd.endpoint(), "--etcd-prefix", "/baton-chaos/"]));
            args.extend(s(&["--lease-ttl", &humantime::format_duration(shape.lease_ttl).to_string(), "--local-prefill-threshold", &shape.local_prefill_threshold.to_string()]));
            members.push(Member { kind: Kind::Coordinator, spec: spec(args, &n, true), name: n, http, proc: None });
        }
        let coordinators = coordinator_urls.join(",");
        let node_args = |role: &str, n: &str, grpc: &str, http: &str, kv: &str| {
            let mut a = s(&[role, "--name", n, "--listen", grpc, "--http-listen", http, "--kv-listen", kv, "--advertise-host", "127.0.0.1"]);
            a.extend(s(&["--coordinator", &coordinators, "--certs-dir", &certs_dir, "--model", &model, "--threads", "1"]));
            a.extend(s(&["--kv-memory-mib", &shape.kv_memory_mib.to_string(), "--kv-tier2-mib", "0", "--kv-staging-mib", "32", "--max-context", "2048"]));
            a.extend(s(&["--step-tokens", "64", "--kv-deadline", &secs(shape.kv_deadline)]));
            a
        };
        for i in 0..shape.prefill {
            let n = name(Kind::Prefill, i);
            let (grpc, http, kv) = (loopback(free_port()?), loopback(free_port()?), loopback(free_port()?));
            members.push(Member { kind: Kind::Prefill, spec: spec(node_args("prefill", &n, &grpc, &http, &kv), &n, true), name: n, http, proc: None });
        }
        let mut relays = Vec::new();
        for i in 0..shape.decode {
            let n = name(Kind::Decode, i);
            let (grpc, http, kv_port) = (loopback(free_port()?), loopback(free_port()?), free_port()?);
            let behind: SocketAddr = format!("{BEHIND_RELAY}:{kv_port}").parse()?;
            let front: SocketAddr = loopback(kv_port).parse()?;
            relays.push(FaultProxy::start(front, behind, 0x5eed + i as u64).await.with_context(|| format!("starting the KV relay of {n} on {front}"))?);
            members.push(Member { kind: Kind::Decode, spec: spec(node_args("decode", &n, &grpc, &http, &behind.to_string()), &n, true), name: n, http, proc: None });
        }

        // The store first (schema and the load's key), then the gateways on it.
        let store = baton_api_gateway::store::PostgresStore::connect(&postgres.url()).await.context("connecting to PostgreSQL")?;
        let api_key = baton_api_gateway::auth::create_key(&store, "chaos", "baton chaos").await.context("creating the load's API key")?;
        drop(store);
        for i in 0..shape.gateways {
            let n = name(Kind::Gateway, i);
            let http = loopback(free_port()?);
            let mut args = s(&["gateway", "--listen", &http, "--db", &postgres.url(), "--coordinator", &coordinators, "--certs-dir", &certs_dir, "--tls-name", &n]);
            args.extend(s(&["--model", &model, "--replica-dead-after", &secs(shape.replica_dead_after), "--resume-grace-seconds", "10"]));
            // The load is one user: per-user limits sized for it, not for a fleet's fairness.
            args.extend(s(&["--turns-per-minute", "100000", "--open-streams", "256"]));
            members.push(Member { kind: Kind::Gateway, spec: spec(args, &n, false), name: n, http, proc: None });
        }

        let mut cluster = ChaosCluster { dir, etcd, postgres, members, relays, api_key };
        tokio::task::block_in_place(|| -> Result<()> {
            for m in cluster.members.iter_mut() {
                m.start()?;
            }
            Ok(())
        })?;
        Ok(cluster)
    }

    /// Base URLs (`http://.../v1`) of the gateways.
    pub fn gateway_urls(&self) -> Vec<String> {
        self.of(Kind::Gateway).map(|m| format!("http://{}/v1", m.http)).collect()
    }

    pub fn of(&self, kind: Kind) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(move |m| m.kind == kind)
    }

    /// The `i`th member of `kind`.
    pub fn member(&mut self, kind: Kind, i: usize) -> Result<&mut Member> {
        self.members.iter_mut().filter(|m| m.kind == kind).nth(i).with_context(|| format!("no {} #{i}", kind.name()))
    }

    /// kill -9 of the `i`th member of `kind`.
    pub fn kill9(&mut self, kind: Kind, i: usize) -> Result<()> {
        let m = self.member(kind, i)?;
        if let Some(mut p) = m.proc.take() {
            p.kill9();
        }
        Ok(())
    }

    /// Starts it again (a supervisor's restart) and waits until it is healthy.
    pub fn restart(&mut self, kind: Kind, i: usize) -> Result<()> {
        let m = self.member(kind, i)?;
        if let Some(mut p) = m.proc.take() {
            p.kill9();
        }
        tokio::task::block_in_place(|| m.start())
    }

    /// Where the processes' logs are.
    pub fn log_dir(&self) -> &Path {
        self.dir.path()
    }
}
