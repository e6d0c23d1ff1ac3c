//! `baton plan`: the planner's control loop over a running cluster, as a dry run.
//!
//! Every interval it asks Prometheus (its HTTP query API) for the signals the planner needs
//! ([`QUERIES`]: arrival rate and prompt/reply mix from the decode nodes' counters, prefill
//! queue depth, TTFT and ITL p95 from the gateway's histograms, decode KV occupancy, the
//! decode batch and tokens/s per node), feeds them to [`crate::planner::Planner`], and
//! prints the prefill and decode replica counts it would set with every reason. It changes
//! nothing in the cluster.
//!
//! Security: it only reads, from the Prometheus URL it is given (HTTPS verified against
//! the system roots when the URL is `https`), and opens no listener. A query that fails or
//! returns no sample leaves that signal absent (the planner then relies on its model);
//! without an arrival rate an interval is skipped with the reason, never guessed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};

use crate::capacity::{CapacityArgs, Inputs};
use crate::planner::{CostModel, Decision, Planner, PlannerConfig, PoolLimits, Signals, Slo};
use crate::simulate::parse_seconds;

pub mod etcd_election;
pub mod kube;
pub mod lease;
pub mod serve;

/// What `baton plan` does with a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Apply {
    /// Print it (and serve it with --metrics-listen): a dry run.
    None,
    /// Also set the pools' replica counts through the Kubernetes API (in a pod; RBAC in
    /// deploy/k8s/planner/rbac.yaml).
    Kubernetes,
}

/// Flags of `baton plan`. The model and hardware flags are `baton capacity`'s (its
/// `--target-utilization` and `--spare-nodes` apply to each pool; its workload flags are
/// ignored: the workload is measured).
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Prometheus base URL, e.g. http://prometheus.monitoring:9090.
    #[arg(long, env = "BATON_PLAN_PROMETHEUS")]
    pub prometheus: String,
    /// Seconds between decisions.
    #[arg(long, env = "BATON_PLAN_INTERVAL", value_parser = parse_seconds, default_value = "30s")]
    pub interval: f64,
    /// Stop after this many decisions (default: run until stopped).
    #[arg(long, env = "BATON_PLAN_ITERATIONS")]
    pub iterations: Option<u64>,
    /// TTFT target of the SLO.
    #[arg(long, env = "BATON_PLAN_TTFT_TARGET", value_parser = parse_seconds, default_value = "1s")]
    pub ttft_target: f64,
    /// ITL target of the SLO, milliseconds.
    #[arg(long, env = "BATON_PLAN_ITL_TARGET_MS", default_value_t = 50.0)]
    pub itl_target_ms: f64,
    /// Time from asking for a node to its serving (model load): the forecast horizon.
    #[arg(long, env = "BATON_PLAN_LOAD_TIME", value_parser = parse_seconds, default_value = "300s")]
    pub load_time: f64,
    /// A lower target must hold this long before a node is shed.
    #[arg(long, env = "BATON_PLAN_SCALE_DOWN_DELAY", value_parser = parse_seconds, default_value = "10m")]
    pub scale_down_delay: f64,
    /// Most nodes per pool.
    #[arg(long, env = "BATON_PLAN_MAX_NODES", default_value_t = 64)]
    pub max_nodes: u32,
    /// Serve the decisions here: `/metrics` (the targets for an HPA or KEDA, reasons by
    /// label), `/decisions` (the last decisions with their reasons). Read-only, no auth:
    /// bind loopback, or an address only Prometheus reaches (docs/SECURITY.md).
    #[arg(long, env = "BATON_PLAN_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `none` (dry run) or `kubernetes`: patch the scale subresource of the pools'
    /// workloads with the service account's token, TLS verified against the cluster CA.
    #[arg(long, env = "BATON_PLAN_APPLY", value_enum, default_value_t = Apply::None)]
    pub apply: Apply,
    /// With --apply kubernetes: act only while holding the Lease `baton-planner` of the
    /// namespace (identity: $POD_NAME, else $HOSTNAME), so replicas never both patch.
    #[arg(long, env = "BATON_PLAN_LEADER_ELECTION")]
    pub leader_election: bool,
    /// With --leader-election: elect through this etcd (comma-separated endpoints, e.g. the
    /// coordinators' membership etcd) instead of the Kubernetes Lease; then any --apply.
    #[arg(long, env = "BATON_PLAN_ELECTION_ETCD", value_delimiter = ',')]
    pub election_etcd: Vec<String>,
    /// The decode pool's workload in the planner's namespace (with --apply kubernetes).
    #[arg(long, env = "BATON_PLAN_DECODE_WORKLOAD", default_value = "statefulset/baton-decode")]
    pub decode_workload: kube::Workload,
    /// The prefill pool's workload (with --apply kubernetes).
    #[arg(long, env = "BATON_PLAN_PREFILL_WORKLOAD", default_value = "deployment/baton-prefill")]
    pub prefill_workload: kube::Workload,
    #[command(flatten)]
    pub capacity: CapacityArgs,
}

/// The planner's signals as PromQL, by field. Rates over 2 minutes (several scrapes).
pub const QUERIES: [(&str, &str); 10] = [
    ("arrival_turns_per_s", "sum(rate(baton_decode_turns_total[2m]))"),
    (
        "prompt_tokens_mean",
        "sum(rate(baton_decode_prompt_tokens_total[2m])) / sum(rate(baton_decode_turns_total[2m]))",
    ),
    (
        "reply_tokens_mean",
        "sum(rate(baton_decode_generated_tokens_total[2m])) / sum(rate(baton_decode_turns_total[2m]))",
    ),
    (
        "cached_share",
        "sum(rate(baton_decode_prefix_cache_hit_tokens_total[2m])) / sum(rate(baton_decode_prompt_tokens_total[2m]))",
    ),
    ("prefill_queue_turns", "sum(baton_prefill_queue_depth)"),
    (
        "ttft_p95_s",
        "histogram_quantile(0.95, sum by (le) (rate(baton_gateway_time_to_first_token_seconds_bucket[2m])))",
    ),
    (
        "itl_p95_s",
        "histogram_quantile(0.95, sum by (le) (rate(baton_gateway_inter_token_latency_seconds_bucket[2m])))",
    ),
    (
        "kv_occupancy",
        "sum(baton_decode_kv_blocks{tier=\"1\",state=\"used\"}) / sum(baton_decode_kv_blocks{tier=\"1\"})",
    ),
    ("decode_batch_mean", "avg(baton_decode_running_sequences)"),
    (
        "decode_tokens_per_s_per_node",
        "sum(rate(baton_decode_engine_tokens_total{phase=\"decode\"}[2m])) / count(baton_decode_running_sequences)",
    ),
];

/// Ready nodes per pool: the nodes Prometheus scrapes.
const READY: [(&str, &str); 2] = [
    ("ready_prefill", "count(baton_prefill_queue_depth)"),
    ("ready_decode", "count(baton_decode_queue_depth)"),
];

/// Percent-encode a query parameter (RFC 3986 unreserved characters stay).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One instant query; `Ok(None)` when Prometheus has no (finite) sample.
async fn query(client: &reqwest::Client, base: &str, q: &str) -> Result<Option<f64>> {
    let url = format!(
        "{}/api/v1/query?query={}",
        base.trim_end_matches('/'),
        encode(q)
    );
    let v: serde_json::Value = client
        .get(&url)
        .send()
        .await
        .with_context(|| format!("asking Prometheus at {base}"))?
        .error_for_status()
        .with_context(|| format!("Prometheus refused {q}"))?
        .json()
        .await
        .context("reading Prometheus's answer")?;
    if v["status"] != "success" {
        bail!("Prometheus answered {} to {q}: {}", v["status"], v["error"]);
    }
    let Some(sample) = v["data"]["result"].get(0) else {
        return Ok(None);
    };
    let text = sample["value"][1]
        .as_str()
        .ok_or_else(|| anyhow!("Prometheus's answer to {q} has no value"))?;
    let x: f64 = text
        .parse()
        .map_err(|_| anyhow!("Prometheus's value {text:?} for {q} is not a number"))?;
    Ok(x.is_finite().then_some(x))
}

/// Read every signal. Fails only when the arrival rate is missing.
pub async fn read_signals(client: &reqwest::Client, base: &str, t_s: f64) -> Result<Signals> {
    let mut s = Signals {
        t_s,
        ..Signals::default()
    };
    for (field, q) in QUERIES.iter().chain(READY.iter()) {
        let v = match query(client, base, q).await {
            Ok(v) => v,
            Err(e) if *field == "arrival_turns_per_s" => return Err(e),
            Err(e) => {
                tracing::warn!(field, error = %e, "signal unavailable this interval");
                None
            }
        };
        match *field {
            "arrival_turns_per_s" => {
                s.arrival_turns_per_s = v.ok_or_else(|| {
                    anyhow!("no arrival rate: is Prometheus scraping the decode nodes?")
                })?
            }
            "prompt_tokens_mean" => s.prompt_tokens_mean = v.unwrap_or(0.0).max(0.0),
            "reply_tokens_mean" => s.reply_tokens_mean = v.unwrap_or(0.0).max(0.0),
            "cached_share" => s.cached_share = v.unwrap_or(0.0).clamp(0.0, 1.0),
            "prefill_queue_turns" => s.prefill_queue_turns = v.unwrap_or(0.0).max(0.0),
            "ttft_p95_s" => s.ttft_p95_s = v.filter(|x| *x >= 0.0),
            "itl_p95_s" => s.itl_p95_s = v.filter(|x| *x >= 0.0),
            "kv_occupancy" => s.kv_occupancy = v.unwrap_or(0.0).clamp(0.0, 1.0),
            "decode_batch_mean" => s.decode_batch_mean = v.filter(|x| *x >= 0.0),
            "decode_tokens_per_s_per_node" => {
                s.decode_tokens_per_s_per_node = v.filter(|x| *x >= 0.0)
            }
            "ready_prefill" => s.ready_prefill = v.unwrap_or(0.0).max(0.0) as u32,
            "ready_decode" => s.ready_decode = v.unwrap_or(0.0).max(0.0) as u32,
            _ => unreachable!("every query has a field"),
        }
    }
    Ok(s)
}

/// The planner for these flags (no daily shape: a dry run has no yesterday).
pub fn planner(a: &PlanArgs) -> Result<Planner> {
    let base = Inputs::try_from(&a.capacity)?;
    let cost = CostModel::new(
        base,
        Slo {
            ttft_s: a.ttft_target,
            itl_s: a.itl_target_ms / 1e3,
            headroom: 0.9,
            target_utilization: a.capacity.target_utilization,
        },
    )?;
    let spare = a.capacity.spare_nodes.min(u32::MAX as u64) as u32;
    let limits = PoolLimits {
        min: 1,
        max: a.max_nodes,
        spare,
    };
    Ok(Planner::new(PlannerConfig::tuned(cost, limits, a.interval, a.load_time, a.scale_down_delay))?)
}

/// One decision from the cluster's current metrics.
pub async fn decide(
    client: &reqwest::Client,
    a: &PlanArgs,
    p: &mut Planner,
    t_s: f64,
) -> Result<Decision> {
    let s = read_signals(client, &a.prometheus, t_s).await?;
    Ok(p.step(&s)?)
}

fn render(d: &Decision) -> String {
    format!(
        "plan t={:.0}: prefill {} decode {} (sized for {:.2} turns/s)\n{}\n",
        d.t_s,
        d.prefill,
        d.decode,
        d.planned_turns_per_s,
        d.explain()
            .lines()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    )
}

/// How planner replicas agree on the one that acts.
enum Election {
    /// The Kubernetes Lease `baton-planner` (`lease`).
    Lease(lease::Elector),
    /// A key under an etcd lease (`etcd_election`); boxed: its client is large.
    Etcd(Box<etcd_election::EtcdElector>),
}

impl Election {
    /// What the leader holds, for the log.
    fn what(&self) -> String {
        match self {
            Election::Lease(_) => format!("Lease {}", lease::LEASE),
            Election::Etcd(_) => format!("etcd key {}", etcd_election::KEY),
        }
    }
}

/// Entry point of `baton plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    if a.interval < 1.0 {
        bail!("--interval must be at least 1s");
    }
    let mut p = planner(&a)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    rt.block_on(async {
        let shown = serve::SharedShown::default();
        let scaler = match a.apply {
            Apply::Kubernetes => Some(kube::KubeScaler::in_cluster()?),
            Apply::None => None,
        };
        // Three intervals of silence before another replica takes over.
        let silence = Duration::from_secs_f64(a.interval * 3.0);
        let identity = || std::env::var("POD_NAME").or_else(|_| std::env::var("HOSTNAME")).context("--leader-election needs $POD_NAME or $HOSTNAME");
        let mut elector = match (a.leader_election, a.apply, a.election_etcd.is_empty()) {
            (false, _, true) => None,
            (false, _, false) => bail!("--election-etcd needs --leader-election"),
            (true, _, false) => Some(Election::Etcd(Box::new(etcd_election::EtcdElector::connect(&a.election_etcd, identity()?, silence).await?))),
            (true, Apply::None, true) => bail!("--leader-election needs --apply kubernetes (the Lease) or --election-etcd"),
            (true, Apply::Kubernetes, true) => Some(Election::Lease(lease::Elector::new(identity()?, silence)?)),
        };
        if let Some(addr) = a.metrics_listen {
            let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding --metrics-listen {addr}"))?;
            eprintln!("plan: decisions at http://{}/metrics and /decisions", l.local_addr()?);
            tokio::spawn(serve::serve(l, shown.clone()));
        }
        let mut tick = tokio::time::interval(Duration::from_secs_f64(a.interval));
        let mut done = 0u64;
        while a.iterations.is_none_or(|n| done < n) {
            tick.tick().await;
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
            let decided = match read_signals(&client, &a.prometheus, now).await {
                Ok(s) => p.step(&s).map(|d| (d, s)).map_err(anyhow::Error::from),
                Err(e) => Err(e),
            };
            match decided {
                Ok((d, s)) => {
                    let text = render(&d);
                    shown.lock().unwrap_or_else(|e| e.into_inner()).decided(&d, s.ready_prefill, s.ready_decode, now, text.clone());
                    if a.capacity.json {
                        crate::emit(&(serde_json::to_string(&d)? + "\n"))?
                    } else {
                        crate::emit(&text)?
                    }
                    let led = match (&mut elector, &scaler) {
                        (Some(Election::Lease(e)), Some(k)) => Some(e.lead(k).await),
                        (Some(Election::Etcd(e)), _) => Some(e.lead().await),
                        _ => None,
                    };
                    let leading = match led {
                        None => true,
                        Some(Ok(l)) => l,
                        Some(Err(e)) => {
                            eprintln!("plan: not leading: {e:#}");
                            false
                        }
                    };
                    if let Some(e) = &elector {
                        shown.lock().unwrap_or_else(|e| e.into_inner()).metrics.set_leader(Some(leading));
                        if !leading {
                            eprintln!("plan: standing by: another replica holds {}", e.what());
                        }
                    }
                    if let Some(k) = scaler.as_ref().filter(|_| leading) {
                        for (w, n) in [(&a.decode_workload, d.decode), (&a.prefill_workload, d.prefill)] {
                            match k.set(w, n).await {
                                Ok(Some(before)) => eprintln!("plan: scaled {w} {before} -> {n}"),
                                Ok(None) => {}
                                Err(e) => eprintln!("plan: {e:#}"),
                            }
                        }
                    }
                }
                Err(e) => {
                    shown.lock().unwrap_or_else(|e| e.into_inner()).metrics.skipped();
                    eprintln!("plan: interval skipped: {e:#}")
                }
            }
            done += 1;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests;
