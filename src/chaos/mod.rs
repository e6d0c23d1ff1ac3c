//! `baton chaos`: the "no single point of failure" claim as a gate. It starts a
//! multi-process cluster (two coordinators over a real etcd, two gateways on one
//! PostgreSQL, prefill and decode nodes, a fault-injecting relay on each decode node's
//! KV listener; [`cluster`]), runs multi-turn conversations through it (turn IDs, retries
//! with the same ID through the other gateway), and injects one fault after another,
//! each followed by a recovery period:
//!
//! kill -9 of a coordinator, a gateway, a prefill node, a decode node (each restarted as
//! a supervisor would); an etcd restart; a decode node frozen (SIGSTOP) past its lease,
//! then thawed; added latency and packet loss on the KV transport.
//!
//! After each fault's window the load pauses, and the harness checks what PostgreSQL
//! holds against what clients were acknowledged ([`check::store_verdicts`]) and the KV
//! blocks every live node still holds ([`check::node_leaks`]). The report
//! (`baton_bench::chaos::report`) is printed as a table and written as JSON; the command
//! fails when a turn was lost or stored twice or a block leaked.

mod check;
mod cluster;
mod soak;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use baton_bench::chaos::load::{Load, LoadConfig, TurnRecord};
use baton_bench::chaos::proxy::Faults;
use baton_bench::chaos::report::{self, ChaosReport, NodeLeak, Stored, Window};
use clap::{Args, ValueEnum};

use cluster::{ChaosCluster, Kind, Shape};

/// One fault the suite can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// kill -9 of coordinator-0, restarted after --fault-period.
    KillCoordinator,
    /// kill -9 of gateway-0 (mid-stream turns retry through gateway-1), restarted.
    KillGateway,
    /// kill -9 of prefill-0, restarted.
    KillPrefill,
    /// kill -9 of decode-0 (its conversations move; warm KV is lost), restarted.
    KillDecode,
    /// kill -9 of etcd and a restart on the same data.
    RestartEtcd,
    /// SIGSTOP of decode-1 for longer than its lease (2 x --lease-ttl + 1 s at least), then SIGCONT.
    FreezeDecode,
    /// Added latency (--kv-delay) and loss (--kv-loss) on every decode node's KV relay.
    KvLoss,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Fault::KillCoordinator => "kill-coordinator",
            Fault::KillGateway => "kill-gateway",
            Fault::KillPrefill => "kill-prefill",
            Fault::KillDecode => "kill-decode",
            Fault::RestartEtcd => "restart-etcd",
            Fault::FreezeDecode => "freeze-decode",
            Fault::KvLoss => "kv-loss",
        }
    }
}

const ALL: [Fault; 7] = [Fault::KillCoordinator, Fault::KillGateway, Fault::KillPrefill, Fault::KillDecode, Fault::RestartEtcd, Fault::FreezeDecode, Fault::KvLoss];

/// Flags of `baton chaos`.
#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Faults to inject, in order (default: all of them).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub faults: Vec<Fault>,
    /// The model every node serves (and whose tokenizer the gateways use).
    #[arg(long, env = "BATON_MODEL")]
    pub model: Option<PathBuf>,
    /// Conversations open at once.
    #[arg(long, default_value_t = 4)]
    pub conversations: usize,
    /// Turns of one conversation before its user starts a new one.
    #[arg(long, default_value_t = 8)]
    pub turns_per_conversation: usize,
    /// Reply cap per turn.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Words of a user message.
    #[arg(long, default_value_t = 12)]
    pub message_words: usize,
    /// Mean think time between a conversation's turns.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub think_time: Duration,
    /// Load without faults before the first one (the TTFT baseline).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub baseline: Duration,
    /// How long a fault lasts: a killed process's time down, the KV relay's faulty time.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub fault_period: Duration,
    /// Load after the fault ended, before the load pauses for the checks.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub recovery: Duration,
    /// How long one turn is retried before it counts as failed.
    #[arg(long, default_value = "90s", value_parser = humantime::parse_duration)]
    pub turn_deadline: Duration,
    /// Nodes' membership lease (the coordinators' --lease-ttl).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// Added one-way latency on the KV relays during kv-loss.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub kv_delay: Duration,
    /// Share of datagrams the KV relays drop during kv-loss.
    #[arg(long, default_value_t = 0.05)]
    pub kv_loss: f64,
    #[arg(long, default_value_t = 2)]
    pub prefill_nodes: usize,
    #[arg(long, default_value_t = 3)]
    pub decode_nodes: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Go on with the next fault after one failed the gate (default: stop there).
    #[arg(long)]
    pub keep_going: bool,
    /// Seed of the conversations' messages and think times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Keep the processes' logs (the folder is printed) instead of deleting them.
    #[arg(long)]
    pub keep_logs: bool,
    /// Soak instead: the same cluster and load without faults for this long (e.g. 30m),
    /// sampling memory, descriptors, KV blocks and the store; fails when a process's RSS
    /// grows more than --max-rss-growth after warm-up.
    #[arg(long, value_parser = humantime::parse_duration, num_args = 0..=1, default_missing_value = "30m")]
    pub soak: Option<Duration>,
    /// The soak's warm-up, not judged (default: a quarter of the soak).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub soak_warmup: Option<Duration>,
    /// The soak's sampling period.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub sample_every: Duration,
    /// The largest RSS growth of any process after warm-up the soak accepts (0.05 = 5%).
    #[arg(long, default_value_t = 0.05)]
    pub max_rss_growth: f64,
    /// The soak's SVG chart (memory, descriptors, KV blocks, store over time).
    #[arg(long)]
    pub chart: Option<PathBuf>,
}

pub fn run(a: ChaosArgs) -> Result<()> {
    if a.conversations == 0 || a.max_tokens == 0 || a.turns_per_conversation == 0 {
        bail!("--conversations, --turns-per-conversation and --max-tokens must be positive");
    }
    if !(0.0..=1.0).contains(&a.kv_loss) {
        bail!("--kv-loss must be within [0, 1]");
    }
    if a.decode_nodes < 2 && (a.faults.contains(&Fault::FreezeDecode) || a.faults.is_empty()) {
        bail!("freeze-decode needs at least 2 decode nodes");
    }
    let model = a.model.clone().unwrap_or_else(crate::engine_args::default_model_path);
    if !model.exists() {
        bail!("model {} not found; run `bash scripts/fetch-model.sh` or pass --model", model.display());
    }
    let bin = std::env::current_exe().context("finding the baton binary")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if let Some(duration) = a.soak {
        return run_soak(&a, &bin, model, duration, &rt);
    }
    let report = rt.block_on(async {
        tokio::select! {
            r = suite(&a, &bin, model) => r,
            _ = crate::process::shutdown_signal() => bail!("interrupted; every process of the cluster was stopped"),
        }
    })?;
    print!("{}", report::table(&report));
    if let Some(path) = &a.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.passed() {
        bail!("the chaos gate failed: a turn was lost or stored twice, or KV blocks leaked (see the table)");
    }
    Ok(())
}

fn run_soak(a: &ChaosArgs, bin: &std::path::Path, model: PathBuf, duration: Duration, rt: &tokio::runtime::Runtime) -> Result<()> {
    let warmup = a.soak_warmup.unwrap_or(duration / 4);
    if warmup >= duration || a.sample_every.is_zero() {
        bail!("--soak-warmup must be shorter than the soak, and --sample-every positive");
    }
    let report = rt.block_on(async {
        tokio::select! {
            r = async {
                let (cluster, load) = start(a, bin, model).await?;
                soak::run(cluster, load, duration, warmup, a.sample_every, a.max_rss_growth, KV_DEADLINE + Duration::from_secs(10)).await
            } => r,
            _ = crate::process::shutdown_signal() => bail!("interrupted; every process of the cluster was stopped"),
        }
    })?;
    print!("{}", baton_bench::chaos::soak::table(&report));
    if let Some(path) = &a.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.chart {
        soak::chart(path, &report)?;
    }
    if !report.passed() {
        bail!("the soak failed: a process's memory grew past the bound, or a turn was lost or stored twice, or KV blocks leaked");
    }
    Ok(())
}

/// How long a KV transfer may take on the suite's nodes (their `--kv-deadline`).
const KV_DEADLINE: Duration = Duration::from_secs(10);

/// Starts the cluster and the load.
async fn start(a: &ChaosArgs, bin: &std::path::Path, model: PathBuf) -> Result<(ChaosCluster, Load)> {
    let shape = Shape {
        coordinators: 2,
        gateways: 2,
        prefill: a.prefill_nodes,
        decode: a.decode_nodes,
        model,
        lease_ttl: a.lease_ttl,
        // Every turn's tail is longer than this: the prefill nodes compute them and ship
        // their KV through the relays (the nodes' prefix caches keep later tails short).
        local_prefill_threshold: 16,
        replica_dead_after: Duration::from_secs(3),
        kv_deadline: KV_DEADLINE,
        kv_memory_mib: 64,
    };
    eprintln!("baton chaos: starting etcd, PostgreSQL and {} processes", 4 + shape.prefill + shape.decode);
    let cluster = ChaosCluster::start(bin, &shape).await?;
    if a.keep_logs {
        eprintln!("baton chaos: logs in {}", cluster.log_dir().display());
    }
    let load = Load::start(LoadConfig {
        gateways: cluster.gateway_urls(),
        api_key: cluster.api_key.clone(),
        conversations: a.conversations,
        turns_per_conversation: a.turns_per_conversation,
        message_words: a.message_words,
        max_tokens: a.max_tokens,
        think_time: a.think_time,
        turn_deadline: a.turn_deadline,
        request_timeout: Duration::from_secs(60),
        seed: a.seed,
    })
    .map_err(|e| anyhow::anyhow!("starting the load: {e}"))?;
    Ok((cluster, load))
}

async fn suite(a: &ChaosArgs, bin: &std::path::Path, model: PathBuf) -> Result<ChaosReport> {
    let faults: Vec<Fault> = if a.faults.is_empty() { ALL.to_vec() } else { a.faults.clone() };
    let (mut cluster, load) = start(a, bin, model).await?;
    let pg_url = cluster.postgres.url();

    let mut windows = vec![Window { fault: "baseline".into(), start_s: 0.0, end_s: 0.0 }];
    let mut leaks: Vec<Vec<NodeLeak>> = Vec::new();
    // Datagrams the KV relays forwarded and dropped per window: evidence that KV crossed
    // them (and that kv-loss dropped some).
    let mut relay_notes = Vec::new();
    let mut relayed = relay_counts(&cluster);
    tokio::time::sleep(a.baseline).await;
    // Leaks are measured with the load paused; reservations expire within the KV deadline.
    let settle = KV_DEADLINE + Duration::from_secs(10);
    quiesce(&load, &cluster, &mut windows, &mut leaks, settle, a.turn_deadline).await;
    relay_notes.push(relay_note(&cluster, &mut relayed));
    let mut failed_gate = false;
    for fault in faults {
        let start_s = load.now_s();
        windows.push(Window { fault: fault.label().into(), start_s, end_s: start_s });
        eprintln!("baton chaos: {} at {start_s:.1} s", fault.label());
        inject(fault, &mut cluster, a).await.with_context(|| format!("injecting {}", fault.label()))?;
        tokio::time::sleep(a.recovery).await;
        quiesce(&load, &cluster, &mut windows, &mut leaks, settle, a.turn_deadline).await;
        relay_notes.push(relay_note(&cluster, &mut relayed));
        let gate = gate_so_far(&pg_url, &load.records(), &windows, &leaks).await?;
        if !gate && !a.keep_going {
            eprintln!("baton chaos: {} failed the gate; stopping (--keep-going goes on)", fault.label());
            failed_gate = true;
            break;
        }
    }
    let duration_s = load.now_s();
    let records = load.stop().await;
    let verdicts = check::store_verdicts(&pg_url, &records).await?;
    let mut rows = report::rows(&windows, &records, &verdicts, &leaks);
    for (row, (forwarded, dropped)) in rows.iter_mut().zip(relay_notes) {
        (row.kv_relay_forwarded, row.kv_relay_dropped) = (forwarded, dropped);
    }
    if a.keep_logs || failed_gate {
        // Keep the logs of a failing run for whoever investigates.
        cluster.dir.disable_cleanup(true);
        eprintln!("baton chaos: process logs kept in {}", cluster.log_dir().display());
    }
    Ok(ChaosReport { rows, conversations: a.conversations, duration_s })
}

/// Pauses the load, waits for running turns to end, measures every node's leaks for the
/// window just ended, and resumes.
async fn quiesce(load: &Load, cluster: &ChaosCluster, windows: &mut [Window], leaks: &mut Vec<Vec<NodeLeak>>, settle: Duration, turn_deadline: Duration) {
    if let Some(w) = windows.last_mut() {
        w.end_s = load.now_s();
    }
    load.pause();
    if !load.wait_idle(turn_deadline + Duration::from_secs(30)).await {
        eprintln!("baton chaos: turns still running after their deadline");
    }
    let measured = tokio::task::block_in_place(|| check::node_leaks(cluster, settle));
    leaks.push(measured);
    load.resume();
}

/// Datagrams forwarded and dropped by every KV relay so far.
fn relay_counts(cluster: &ChaosCluster) -> (u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    cluster.relays.iter().fold((0, 0), |(f, d), r| (f + r.counters.forwarded.load(Relaxed), d + r.counters.dropped.load(Relaxed)))
}

/// Datagrams the relays forwarded and dropped since `last` (which it advances).
fn relay_note(cluster: &ChaosCluster, last: &mut (u64, u64)) -> (u64, u64) {
    let now = relay_counts(cluster);
    let delta = (now.0 - last.0, now.1 - last.1);
    *last = now;
    delta
}

/// Whether the windows so far pass the gate.
async fn gate_so_far(url: &str, records: &[TurnRecord], windows: &[Window], leaks: &[Vec<NodeLeak>]) -> Result<bool> {
    let verdicts: Vec<Option<Stored>> = check::store_verdicts(url, records).await?;
    let rows = report::rows(windows, records, &verdicts, leaks);
    Ok(ChaosReport { rows, conversations: 0, duration_s: 0.0 }.passed())
}

/// Injects `fault` and ends it after `--fault-period` (restarts, thaws, heals).
async fn inject(fault: Fault, cluster: &mut ChaosCluster, a: &ChaosArgs) -> Result<()> {
    let period = a.fault_period;
    let kill_and_restart = |cluster: &mut ChaosCluster, kind: Kind| -> Result<()> {
        cluster.kill9(kind, 0)?;
        std::thread::sleep(period);
        cluster.restart(kind, 0)
    };
    match fault {
        Fault::KillCoordinator => tokio::task::block_in_place(|| kill_and_restart(cluster, Kind::Coordinator)),
        Fault::KillGateway => tokio::task::block_in_place(|| kill_and_restart(cluster, Kind::Gateway)),
        Fault::KillPrefill => tokio::task::block_in_place(|| kill_and_restart(cluster, Kind::Prefill)),
        Fault::KillDecode => tokio::task::block_in_place(|| kill_and_restart(cluster, Kind::Decode)),
        Fault::RestartEtcd => tokio::task::block_in_place(|| {
            cluster.etcd.kill();
            std::thread::sleep(period.min(a.lease_ttl / 2));
            cluster.etcd.start_again()?;
            cluster.etcd.wait_ready(Duration::from_secs(30))
        }),
        Fault::FreezeDecode => {
            let m = cluster.member(Kind::Decode, 1)?;
            let p = m.proc.as_mut().context("decode-1 is not running")?;
            p.sigstop()?;
            tokio::time::sleep(period.max(a.lease_ttl * 2 + Duration::from_secs(1))).await;
            p.sigcont();
            Ok(())
        }
        Fault::KvLoss => {
            for r in &cluster.relays {
                r.set(Faults { delay: a.kv_delay, loss: a.kv_loss });
            }
            tokio::time::sleep(period.max(Duration::from_secs(10))).await;
            for r in &cluster.relays {
                r.set(Faults::default());
            }
            Ok(())
        }
    }
}
