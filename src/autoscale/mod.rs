//! `baton up --autoscale`: the planner ([`baton_bench::planner`]) in the loop over the
//! local cluster.
//!
//! Several times per interval it samples the nodes' `/metrics` ([`scrape`]); every
//! interval it turns the samples into the planner's signals, takes its decision, prints it
//! with every reason, and makes the pools match ([`fleet`]): a pool below its target gets
//! node processes started, one above it has its newest started nodes drained (a decode
//! node hands its warm conversations and their KV to the new owners) and stopped. The
//! planner's hysteresis (`--autoscale-scale-down-delay`, at most 10% of a pool per
//! interval, never below `--autoscale-spare` nodes above the need) decides when a node
//! goes; `--max-nodes` caps each pool.
//!
//! The cost model is `baton capacity`'s for the served GGUF on its default GPU, which is
//! not this machine: locally the pools grow on what is measured (a decode batch per node
//! above `--autoscale-batch`, ITL or TTFT p95 above 0.9 x their targets, a prefill queue,
//! KV occupancy), as the reasons say.

pub mod fleet;
pub mod scrape;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use baton_bench::capacity::{Inputs, ModelShape};
use baton_bench::plan::serve::{self, SharedShown};
use baton_bench::planner::{CostModel, Decision, Planner, PlannerConfig, Pool, PoolLimits, Slo};
use tokio::sync::watch;

use crate::engine_args::EngineArgs;
use fleet::Fleet;
use scrape::Sampler;

/// Flags of `baton up --autoscale`.
#[derive(clap::Args, Debug, Clone)]
pub struct AutoscaleArgs {
    /// Let the planner size the prefill and decode pools: start node processes when the
    /// measured headroom falls below its target, drain them when it comes back.
    #[arg(long, env = "BATON_AUTOSCALE")]
    pub autoscale: bool,
    /// Most nodes per pool with --autoscale, counting `baton up`'s own (1 to 16).
    #[arg(long, env = "BATON_MAX_NODES", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub max_nodes: u32,
    /// Time between the planner's decisions (at least 1s).
    #[arg(id = "autoscale_interval", long = "autoscale-interval", env = "BATON_AUTOSCALE_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Decode batch per node (running plus waiting sequences, averaged over the interval)
    /// above which the decode pool grows: what one node of this machine serves within
    /// the ITL target.
    #[arg(id = "autoscale_batch", long = "autoscale-batch", env = "BATON_AUTOSCALE_BATCH", default_value_t = 4.0)]
    pub batch: f64,
    /// A lower target must hold this long before a node is drained.
    #[arg(id = "autoscale_scale_down_delay", long = "autoscale-scale-down-delay", env = "BATON_AUTOSCALE_SCALE_DOWN_DELAY", default_value = "30s", value_parser = humantime::parse_duration)]
    pub scale_down_delay: Duration,
    /// Nodes kept above the need in each pool: the failure headroom.
    #[arg(id = "autoscale_spare", long = "autoscale-spare", env = "BATON_AUTOSCALE_SPARE", default_value_t = 0)]
    pub spare: u32,
    /// TTFT target: the prefill pool grows while the p95 is above 0.9 x this.
    #[arg(id = "autoscale_ttft_target", long = "autoscale-ttft-target", env = "BATON_AUTOSCALE_TTFT_TARGET", default_value = "2s", value_parser = humantime::parse_duration)]
    pub ttft_target: Duration,
    /// ITL target: the decode pool grows while the p95 step time is above 0.9 x this.
    #[arg(id = "autoscale_itl_target", long = "autoscale-itl-target", env = "BATON_AUTOSCALE_ITL_TARGET", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub itl_target: Duration,
    /// Where the planner serves its decisions (`/metrics`, `/decisions`): read-only, no
    /// auth, so loopback unless only trusted peers reach the address (docs/SECURITY.md).
    #[arg(id = "autoscale_listen", long = "autoscale-listen", env = "BATON_AUTOSCALE_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Compute threads of each node the planner starts.
    #[arg(id = "autoscale_node_threads", long = "autoscale-node-threads", env = "BATON_AUTOSCALE_NODE_THREADS", default_value_t = 1)]
    pub node_threads: usize,
}

impl AutoscaleArgs {
    pub fn check(&self) -> Result<()> {
        if self.interval < Duration::from_secs(1) {
            bail!("--autoscale-interval must be at least 1s");
        }
        if !(self.batch > 0.0 && self.batch.is_finite()) {
            bail!("--autoscale-batch must be > 0");
        }
        if self.spare >= self.max_nodes {
            bail!("--autoscale-spare {} leaves no room under --max-nodes {}", self.spare, self.max_nodes);
        }
        if self.node_threads == 0 {
            bail!("--autoscale-node-threads must be at least 1");
        }
        Ok(())
    }

    /// The planner for this model and these flags.
    pub fn planner(&self, model: &Path) -> Result<Planner> {
        let shape = ModelShape::from_gguf(model).with_context(|| format!("reading the model shape of {}", model.display()))?;
        let base = Inputs { model: shape, gpus_per_node: 1, spare_nodes: 0, ..Inputs::seed() };
        let slo = Slo { ttft_s: self.ttft_target.as_secs_f64(), itl_s: self.itl_target.as_secs_f64(), headroom: 0.9, target_utilization: 0.6 };
        let cost = CostModel::new(base, slo)?;
        let limits = PoolLimits { min: 1, max: self.max_nodes, spare: self.spare };
        // The forecast's horizon: a node starts here within a few seconds.
        let load_time_s = 10.0;
        let mut cfg = PlannerConfig::tuned(cost, limits, self.interval.as_secs_f64(), load_time_s, self.scale_down_delay.as_secs_f64());
        cfg.batch_high = Some(self.batch);
        Ok(Planner::new(cfg)?)
    }
}

/// The engine flags of a started node: `baton up`'s, with its own thread count.
pub fn engine_flags(e: &EngineArgs, model: &Path, threads: usize) -> Vec<String> {
    let backend = clap::ValueEnum::to_possible_value(&e.backend).map(|v| v.get_name().to_string()).unwrap_or_else(|| "cpu".into());
    let mut f = vec![
        "--model".to_string(),
        model.to_string_lossy().into_owned(),
        "--backend".into(),
        backend,
        "--gpu".into(),
        e.gpu.to_string(),
        "--threads".into(),
        threads.to_string(),
        "--kv-memory-mib".into(),
        e.kv_memory_mib.to_string(),
        "--kv-tier2-mib".into(),
        e.kv_tier2_mib.to_string(),
        "--step-tokens".into(),
        e.step_tokens.to_string(),
        "--itl-target-ms".into(),
        e.itl_target_ms.to_string(),
    ];
    if let Some(c) = e.max_context {
        f.extend(["--max-context".to_string(), c.to_string()]);
    }
    f
}

/// One decision as printed: the targets beside the ready nodes, then every reason.
pub fn render(d: &Decision, t: f64, ready_prefill: u32, ready_decode: u32, batch: Option<f64>, rate: f64) -> String {
    let mut out = format!(
        "autoscale t={t:.0}s: decode {ready_decode} -> {}, prefill {ready_prefill} -> {} (measured {rate:.2} turns/s, decode batch {:.1}/node)",
        d.decode,
        d.prefill,
        batch.unwrap_or(0.0)
    );
    for r in &d.reasons {
        out.push_str(&format!("\n  {} [{}] {}", r.pool.label(), r.kind, r.text));
    }
    out
}

/// The loop, until `stop`; then every started node is stopped.
pub async fn run(mut planner: Planner, mut fleet: Fleet, interval: Duration, listen: std::net::SocketAddr, mut stop: watch::Receiver<bool>) -> Result<()> {
    let started = Instant::now();
    let shown = SharedShown::default();
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding --autoscale-listen {listen}"))?;
    eprintln!("autoscale: decisions at http://{}/metrics and /decisions", listener.local_addr()?);
    let server = tokio::spawn(serve::serve(listener, shown.clone()));
    let mut sampler = Sampler::default();
    // Five samples an interval.
    let mut tick = tokio::time::interval(interval / 5);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_decision = Instant::now();
    let result = loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break Ok(()),
        }
        if *stop.borrow() {
            break Ok(());
        }
        for name in fleet.reap() {
            eprintln!("autoscale: {name} exited on its own; removed from its pool");
        }
        let targets = fleet.targets();
        sampler = tokio::task::spawn_blocking(move || {
            sampler.sample(&targets);
            sampler
        })
        .await?;
        if last_decision.elapsed() < interval {
            continue;
        }
        let dt = last_decision.elapsed().as_secs_f64();
        last_decision = Instant::now();
        let t = started.elapsed().as_secs_f64();
        let (ready_p, ready_d) = (fleet.count(Pool::Prefill), fleet.count(Pool::Decode));
        let s = sampler.signals(t, dt, ready_p, ready_d);
        let d = match planner.step(&s) {
            Ok(d) => d,
            Err(e) => break Err(anyhow::anyhow!("the planner refused this interval's signals: {e}")),
        };
        let text = render(&d, t, ready_p, ready_d, s.decode_batch_mean, s.arrival_turns_per_s);
        eprintln!("{text}");
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        shown.lock().unwrap_or_else(|e| e.into_inner()).decided(&d, ready_p, ready_d, unix, text);
        if let Err(e) = reconcile(&mut fleet, &d).await {
            eprintln!("autoscale: {e:#}");
        }
    };
    server.abort();
    fleet.stop_all().await;
    result
}

/// Starts or drains nodes until each pool has its target.
async fn reconcile(fleet: &mut Fleet, d: &Decision) -> Result<()> {
    for pool in [Pool::Decode, Pool::Prefill] {
        let want = d.target(pool);
        while fleet.count(pool) < want {
            let n = fleet.start(pool).await?;
            eprintln!("autoscale: started {} (grpc {}, http {})", n.name, n.grpc, n.http);
        }
        while fleet.count(pool) > want {
            match fleet.drain_one(pool).await {
                Ok(Some(r)) => eprintln!(
                    "autoscale: drained {}: conversations moved {} failed {}, KV blocks moved {}, still running {}; stopped",
                    r.name, r.conversations_moved, r.conversations_failed, r.blocks_moved, r.still_running
                ),
                Ok(None) => break,
                Err(e) => eprintln!("autoscale: drain failed, node stopped anyway: {e:#}"),
            }
        }
    }
    Ok(())
}
