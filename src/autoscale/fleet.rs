//! The node processes `baton up --autoscale` adds to the cluster, and their removal.
//!
//! A node is a `baton prefill` / `baton decode` child of this process, named from a
//! fixed set (`decode-1` .. `decode-{max-1}`, the same for prefill) whose certificates
//! `baton up` issued at start into a private folder (mode 0700, removed when it stops):
//! the in-memory CA's key is gone by then, so no name outside the set can ever join.
//! A node joins the coordinator like any other; one is removed by the node-control Drain
//! RPC (called as `baton up`'s operator identity over mutual TLS: it stops taking turns,
//! leaves the ring, and a decode node hands its warm conversations with their KV to the new
//! owners), and then SIGTERM. The in-process `decode-0` and `prefill-0` are never removed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use baton::harness::{signal, wait_ok, BatonProc, Spec};
use baton_bench::planner::Pool;
use baton_proto::node::node_control_client::NodeControlClient;
use baton_proto::node::DrainRequest;
use baton_proto::plane::{Expect, Plane, Role};

use super::scrape::Target;

/// One node of a pool.
pub struct Node {
    pub name: String,
    pub pool: Pool,
    pub grpc: String,
    pub http: String,
    /// `None`: `baton up`'s own in-process node.
    pub proc: Option<BatonProc>,
}

/// How to start a node process.
#[derive(Debug, Clone)]
pub struct NodeTemplate {
    pub bin: PathBuf,
    pub certs_dir: PathBuf,
    pub coordinator_url: String,
    /// Engine flags every started node gets (model, threads, KV memory, ...).
    pub engine_flags: Vec<String>,
    /// Where the nodes' logs go.
    pub log_dir: PathBuf,
}

/// Both pools: `baton up`'s own nodes and the started ones.
pub struct Fleet {
    pub nodes: Vec<Node>,
    template: NodeTemplate,
    max_nodes: u32,
    operator: Plane,
    drain_timeout: Duration,
}

/// The names `baton up` issues certificates for, beside its own parts'.
pub fn node_names(max_nodes: u32) -> Vec<String> {
    let mut out = Vec::new();
    for pool in [Pool::Decode, Pool::Prefill] {
        out.extend((1..max_nodes).map(|i| format!("{}-{i}", pool.label())));
    }
    out
}

/// What a finished drain did, for the log.
pub struct Drained {
    pub name: String,
    pub conversations_moved: u32,
    pub conversations_failed: u32,
    pub blocks_moved: u64,
    pub still_running: u32,
}

impl Fleet {
    pub fn new(template: NodeTemplate, max_nodes: u32, operator: Plane, own: Vec<Node>, drain_timeout: Duration) -> Fleet {
        Fleet { nodes: own, template, max_nodes, operator, drain_timeout }
    }

    pub fn count(&self, pool: Pool) -> u32 {
        self.nodes.iter().filter(|n| n.pool == pool).count() as u32
    }

    pub fn targets(&self) -> Vec<Target> {
        self.nodes.iter().map(|n| Target { name: n.name.clone(), pool: n.pool, http: n.http.clone() }).collect()
    }

    /// Started nodes that exited on their own: removed from the pool, named for the log.
    pub fn reap(&mut self) -> Vec<String> {
        let mut gone = Vec::new();
        self.nodes.retain_mut(|n| {
            let exited = n.proc.as_mut().is_some_and(|p| !p.alive());
            if exited {
                gone.push(n.name.clone());
            }
            !exited
        });
        gone
    }

    /// Starts one more node of `pool` and waits until it is registered (its `/healthz`).
    pub async fn start(&mut self, pool: Pool) -> Result<&Node> {
        if self.count(pool) >= self.max_nodes {
            bail!("{} pool is at --max-nodes {}", pool.label(), self.max_nodes);
        }
        let name = (1..self.max_nodes)
            .map(|i| format!("{}-{i}", pool.label()))
            .find(|n| self.nodes.iter().all(|x| &x.name != n))
            .context("no free node name")?;
        let t = &self.template;
        let mut args: Vec<String> = [pool.label(), "--name", &name, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--advertise-host", "127.0.0.1", "--coordinator", &t.coordinator_url].map(String::from));
        args.extend(["--certs-dir".to_string(), t.certs_dir.to_string_lossy().into_owned()]);
        args.extend(t.engine_flags.iter().cloned());
        let spec = Spec { bin: t.bin.clone(), args, log: Some(t.log_dir.join(format!("{name}.log"))), prints_addresses: true };
        let proc = tokio::task::spawn_blocking(move || -> Result<BatonProc> {
            let p = BatonProc::spawn(&spec)?;
            wait_ok(&p.try_addr("http")?, "/healthz", Duration::from_secs(120))?;
            Ok(p)
        })
        .await?
        .with_context(|| format!("starting {name}"))?;
        let (grpc, http) = (proc.try_addr("grpc")?, proc.try_addr("http")?);
        self.nodes.push(Node { name, pool, grpc, http, proc: Some(proc) });
        Ok(self.nodes.last().expect("just pushed"))
    }

    /// Drains the newest started node of `pool` and stops it; `None` when only `baton up`'s
    /// own node is left.
    pub async fn drain_one(&mut self, pool: Pool) -> Result<Option<Drained>> {
        let Some(i) = self.nodes.iter().rposition(|n| n.pool == pool && n.proc.is_some()) else {
            return Ok(None);
        };
        let node = self.nodes.remove(i);
        let result = self.drain(&node).await;
        // Stopped whatever the drain answered: the target says it goes.
        let mut proc = node.proc.expect("a started node");
        let pid = proc.pid();
        let stopped = tokio::task::spawn_blocking(move || {
            let _ = signal(pid, "TERM");
            let until = Instant::now() + Duration::from_secs(30);
            while proc.alive() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            if proc.alive() {
                proc.kill9();
            }
        });
        stopped.await?;
        result.map(|mut d| {
            d.name = node.name;
            Some(d)
        })
    }

    async fn drain(&self, node: &Node) -> Result<Drained> {
        let endpoint = self.operator.endpoint(&node.grpc)?.connect_timeout(Duration::from_secs(5)).timeout(self.drain_timeout + Duration::from_secs(5));
        let want = match node.pool {
            Pool::Decode => Role::Decode,
            Pool::Prefill => Role::Prefill,
        };
        let channel = self.operator.connect(&endpoint, Expect::Role(want)).await.with_context(|| format!("connecting to {}", node.name))?;
        let ms = u32::try_from(self.drain_timeout.as_millis()).unwrap_or(u32::MAX);
        let r = NodeControlClient::new(channel).drain(DrainRequest { deadline_ms: ms }).await.with_context(|| format!("draining {}", node.name))?.into_inner();
        Ok(Drained {
            name: String::new(),
            conversations_moved: r.conversations_moved,
            conversations_failed: r.conversations_failed,
            blocks_moved: r.blocks_moved,
            still_running: r.running,
        })
    }

    /// Stops every started node (SIGTERM: each deregisters), waiting up to 30 s.
    pub async fn stop_all(&mut self) {
        let (own, started): (Vec<Node>, Vec<Node>) = std::mem::take(&mut self.nodes).into_iter().partition(|n| n.proc.is_none());
        self.nodes = own;
        let procs: Vec<BatonProc> = started.into_iter().filter_map(|n| n.proc).collect();
        let _ = tokio::task::spawn_blocking(move || {
            let mut procs = procs;
            for p in &procs {
                let _ = signal(p.pid(), "TERM");
            }
            let until = Instant::now() + Duration::from_secs(30);
            while procs.iter_mut().any(|p| p.alive()) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            // Dropping a handle kills what is still running.
        })
        .await;
    }
}
