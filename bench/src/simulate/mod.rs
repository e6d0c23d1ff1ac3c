//! `baton simulate`: the fleet simulator.
//!
//! First it reproduces the seed's part-2 table (prefix-cache hit rate, random routing vs
//! conversation affinity, 4,000 conversations x 8 turns on 8 replicas with LRU caches of
//! 0.5/1/2/8 M tokens) and prints the seed's printed numbers beside it, hard-coded and
//! labelled as such. Then it goes beyond the seed on the same trace: consistent hashing
//! with and without bounded loads, a host-memory tier under each replica's HBM cache,
//! a prefill pool with local-vs-remote prefill by tail length, and node failures and joins
//! at given times; it reports hit rate (split by tier), spill rate, load imbalance and the
//! prefill tokens per second that caching saved.
//!
//! Configurations are independent and run in parallel (rayon); every random stream is
//! seeded, so a given seed prints the same table on any machine and thread count.

pub mod day;
pub mod fleet;
pub mod store;
pub mod wheel;
pub mod workload;

use std::time::Instant;

use clap::ValueEnum;
use rayon::prelude::*;
use serde::Serialize;

pub use fleet::{simulate, FleetChange, FleetConfig, FleetEvent, FleetStats, Routing};
pub use workload::{Trace, TurnEvent, Workload};

use crate::capacity::plan::thousands;
use crate::error::{invalid, BadValue, BenchError};

/// The seed's printed part-2 table (`python3 chat_capacity.py`): cache tokens per replica,
/// random-routing hit rate, conversation-affinity hit rate. A reference, not a result.
pub const SEED_REFERENCE: [(u64, f64, f64); 4] = [
    (500_000, 0.45, 0.68),
    (1_000_000, 0.48, 0.84),
    (2_000_000, 0.52, 0.95),
    (8_000_000, 0.59, 0.96),
];

/// Size presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Scale {
    /// The seed's part 2: 4,000 conversations x 8 turns on 8 replicas.
    Seed,
    /// The seed's "10x": 200,000 conversations x 8 turns on 200 replicas.
    #[value(name = "10x")]
    TenX,
}

/// Flags of `baton simulate`. Explicit sizes override the `--scale` preset.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Size preset: `seed` (4,000 conversations, 8 replicas) or `10x` (200,000, 200).
    #[arg(long, env = "BATON_SIMULATE_SCALE", value_enum, default_value_t = Scale::Seed)]
    pub scale: Scale,
    /// Conversations [default: from --scale].
    #[arg(long, env = "BATON_SIMULATE_CONVERSATIONS")]
    pub conversations: Option<u32>,
    /// Turns per conversation.
    #[arg(long, env = "BATON_SIMULATE_TURNS", default_value_t = 8)]
    pub turns: u32,
    /// Decode replicas, each with its own prefix cache [default: from --scale].
    #[arg(long, env = "BATON_SIMULATE_REPLICAS")]
    pub replicas: Option<u32>,
    /// HBM prefix-cache sizes per replica to compare, in tokens.
    #[arg(
        long,
        env = "BATON_SIMULATE_CACHE_TOKENS",
        value_delimiter = ',',
        default_value = "500000,1000000,2000000,8000000"
    )]
    pub cache_tokens: Vec<u64>,
    /// Routing policies for the beyond-the-seed table.
    #[arg(
        long,
        env = "BATON_SIMULATE_ROUTING",
        value_enum,
        value_delimiter = ',',
        default_value = "random,affinity,ring,bounded"
    )]
    pub routing: Vec<Routing>,
    /// Load bound factor c of bounded-load hashing: no node above ceil(c * mean).
    #[arg(long, env = "BATON_SIMULATE_LOAD_FACTOR", default_value_t = 1.25)]
    pub load_factor: f64,
    /// Virtual nodes per replica on the hash ring.
    #[arg(long, env = "BATON_SIMULATE_VNODES", default_value_t = 128)]
    pub vnodes: u32,
    /// Host-memory tier per replica as a multiple of its HBM cache (0 disables). A DGX
    /// H100 has 2 TB of host memory, about 3x its HBM.
    #[arg(long, env = "BATON_SIMULATE_HOST_TIER_RATIO", default_value_t = 3.0)]
    pub host_tier_ratio: f64,
    /// Prefill pool nodes (0: all prefill on decode nodes) [default: half the replicas].
    #[arg(long, env = "BATON_SIMULATE_PREFILL_NODES")]
    pub prefill_nodes: Option<u32>,
    /// An uncached tail shorter than this many tokens is prefilled on the decode node.
    #[arg(
        long,
        env = "BATON_SIMULATE_LOCAL_PREFILL_THRESHOLD",
        default_value_t = 512
    )]
    pub local_prefill_threshold: u32,
    /// Fail a decode node at a time: `NODE@TIME`, e.g. `3@400s`; repeat or comma-separate.
    #[arg(long, env = "BATON_SIMULATE_FAIL", value_delimiter = ',', value_parser = parse_fail)]
    pub fail: Vec<FleetEvent>,
    /// Add a fresh decode node at a time, e.g. `500s`; repeat or comma-separate.
    #[arg(long, env = "BATON_SIMULATE_JOIN", value_delimiter = ',', value_parser = parse_join)]
    pub join: Vec<FleetEvent>,
    /// Conversations open uniformly over this many seconds.
    #[arg(long, env = "BATON_SIMULATE_ARRIVAL_WINDOW_S", default_value_t = 600.0)]
    pub arrival_window_s: f64,
    /// Mean pause between a conversation's turns, seconds (exponential).
    #[arg(long, env = "BATON_SIMULATE_TURN_GAP_S", default_value_t = 60.0)]
    pub turn_gap_s: f64,
    /// Shared system prompt tokens (always cached).
    #[arg(long, env = "BATON_SIMULATE_SYSTEM_TOKENS", default_value_t = 1_500)]
    pub system_tokens: u32,
    /// New user message tokens per turn.
    #[arg(long, env = "BATON_SIMULATE_MESSAGE_TOKENS", default_value_t = 150)]
    pub message_tokens: u32,
    /// Reply tokens per turn.
    #[arg(long, env = "BATON_SIMULATE_REPLY_TOKENS", default_value_t = 400)]
    pub reply_tokens: u32,
    /// Decode step time in ms (a turn holds its node for reply x step after prefill).
    #[arg(long, env = "BATON_SIMULATE_DECODE_STEP_MS", default_value_t = 12.7)]
    pub decode_step_ms: f64,
    /// Prefill tokens/s of one node.
    #[arg(
        long,
        env = "BATON_SIMULATE_PREFILL_TOKENS_PER_S",
        default_value_t = 44_850.0
    )]
    pub prefill_tokens_per_s: f64,
    /// Seed of every random stream.
    #[arg(long, env = "BATON_SIMULATE_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Print the results as JSON instead of tables.
    #[arg(long, env = "BATON_SIMULATE_JSON")]
    pub json: bool,
    /// Instead of the cache tables: a day of traffic averaging 40% of its peak on the
    /// seed's fleet, with one decode-node failure, under the planner in the loop, fixed
    /// fleets sized for the peak and for the mean, and an oracle.
    #[arg(long, env = "BATON_SIMULATE_DAY")]
    pub day: bool,
    /// With --day: write an SVG chart of GPUs and SLO attainment over the day here.
    #[arg(long, env = "BATON_SIMULATE_CHART", requires = "day")]
    pub chart: Option<std::path::PathBuf>,
    /// With --day: seconds from asking for a node to its serving (model load).
    #[arg(long, env = "BATON_SIMULATE_LOAD_TIME", value_parser = parse_seconds, default_value = "300s")]
    pub load_time: f64,
    /// With --day: when a decode node fails (past 24h: never).
    #[arg(long, env = "BATON_SIMULATE_DAY_FAIL_AT", value_parser = parse_seconds, default_value = "13h")]
    pub day_fail_at: f64,
}

/// Parse `300`, `300s`, `2.5m` or `1h` as seconds.
pub fn parse_seconds(s: &str) -> Result<f64, BadValue> {
    let s = s.trim();
    let (num, mult) = match s.as_bytes().last() {
        Some(b's') => (&s[..s.len() - 1], 1.0),
        Some(b'm') => (&s[..s.len() - 1], 60.0),
        Some(b'h') => (&s[..s.len() - 1], 3600.0),
        _ => (s, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v * mult),
        _ => Err(BadValue::new(s, "a duration like 300s, 2.5m or 1h")),
    }
}

fn parse_fail(s: &str) -> Result<FleetEvent, BadValue> {
    let (node, t) = s
        .split_once('@')
        .ok_or_else(|| BadValue::new(s, "NODE@TIME, e.g. 3@400s"))?;
    let node = node
        .trim()
        .parse::<u32>()
        .map_err(|_| BadValue::new(node, "a node id"))?;
    Ok(FleetEvent {
        t: parse_seconds(t)?,
        change: FleetChange::Fail(node),
    })
}

fn parse_join(s: &str) -> Result<FleetEvent, BadValue> {
    Ok(FleetEvent {
        t: parse_seconds(s)?,
        change: FleetChange::Join,
    })
}

/// Everything a run needs, validated.
#[derive(Debug, Clone, Serialize)]
pub struct SimulateConfig {
    pub workload: Workload,
    pub replicas: u32,
    pub cache_tokens: Vec<u64>,
    pub routing: Vec<Routing>,
    pub load_factor: f64,
    pub vnodes: u32,
    pub host_tier_ratio: f64,
    pub prefill_nodes: u32,
    pub local_prefill_threshold: u32,
    pub events: Vec<FleetEvent>,
    pub decode_step_s: f64,
    pub prefill_tokens_per_s: f64,
}

impl TryFrom<&SimulateArgs> for SimulateConfig {
    type Error = BenchError;

    fn try_from(a: &SimulateArgs) -> Result<Self, BenchError> {
        let (convs, replicas) = match a.scale {
            Scale::Seed => (4_000, 8),
            Scale::TenX => (200_000, 200),
        };
        let replicas = a.replicas.unwrap_or(replicas);
        let workload = Workload {
            conversations: a.conversations.unwrap_or(convs),
            turns: a.turns,
            arrival_window_s: a.arrival_window_s,
            turn_gap_s: a.turn_gap_s,
            system_tokens: a.system_tokens,
            message_tokens: a.message_tokens,
            reply_tokens: a.reply_tokens,
            seed: a.seed,
        };
        workload.validate()?;
        if a.cache_tokens.is_empty() || a.routing.is_empty() {
            return Err(invalid("cache-tokens/routing", "need at least one of each"));
        }
        if !(a.host_tier_ratio >= 0.0 && a.host_tier_ratio.is_finite()) {
            return Err(invalid("host-tier-ratio", "must be >= 0"));
        }
        let mut events = a.fail.clone();
        events.extend(a.join.iter().copied());
        events.sort_by(|x, y| x.t.total_cmp(&y.t));
        Ok(Self {
            workload,
            replicas,
            cache_tokens: a.cache_tokens.clone(),
            routing: a.routing.clone(),
            load_factor: a.load_factor,
            vnodes: a.vnodes,
            host_tier_ratio: a.host_tier_ratio,
            prefill_nodes: a.prefill_nodes.unwrap_or(replicas.div_ceil(2)),
            local_prefill_threshold: a.local_prefill_threshold,
            events,
            decode_step_s: a.decode_step_ms / 1e3,
            prefill_tokens_per_s: a.prefill_tokens_per_s,
        })
    }
}

impl SimulateConfig {
    /// Is this the seed's part-2 setting (so its printed table is a fair reference)?
    pub fn is_seed_setting(&self) -> bool {
        self.replicas == 8
            && Workload {
                seed: 1,
                ..self.workload
            } == Workload::seed()
    }

    fn base(&self, routing: Routing, cache_tokens: u64) -> FleetConfig {
        FleetConfig {
            replicas: self.replicas,
            routing,
            cache_tokens,
            host_tokens: 0,
            load_factor: self.load_factor,
            vnodes: self.vnodes,
            prefill_nodes: 0,
            local_prefill_threshold: self.local_prefill_threshold,
            decode_step_s: self.decode_step_s,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            events: Vec::new(),
            seed: self.workload.seed,
        }
    }

    /// The seed's configurations: random and affinity routing, HBM only, colocated.
    pub fn reproduction_configs(&self) -> Vec<FleetConfig> {
        self.cache_tokens
            .iter()
            .flat_map(|&c| [Routing::Random, Routing::Affinity].map(|r| self.base(r, c)))
            .collect()
    }

    /// The extended configurations: every routing x cache size with the host tier, the
    /// prefill pool and the fleet events.
    pub fn beyond_configs(&self) -> Vec<FleetConfig> {
        let mut out = Vec::new();
        for &c in &self.cache_tokens {
            for &r in &self.routing {
                let mut f = self.base(r, c);
                f.host_tokens = (c as f64 * self.host_tier_ratio) as u64;
                f.prefill_nodes = self.prefill_nodes;
                f.events = self.events.clone();
                out.push(f);
            }
        }
        out
    }
}

/// One row of the reproduction table.
#[derive(Debug, Clone, Serialize)]
pub struct ReproRow {
    pub cache_tokens: u64,
    pub random: f64,
    pub affinity: f64,
    /// The seed's printed (random, affinity), when the setting is the seed's.
    pub seed_reference: Option<(f64, f64)>,
}

/// One row of the extended table.
#[derive(Debug, Clone, Serialize)]
pub struct BeyondRow {
    pub cache_tokens: u64,
    pub host_tokens: u64,
    pub routing: Routing,
    pub hit_rate: f64,
    pub hbm_hit_rate: f64,
    pub host_hit_rate: f64,
    pub spill_rate: f64,
    pub turn_imbalance: f64,
    pub inflight_imbalance: f64,
    pub saved_prefill_tokens_per_s: f64,
    pub remote_prefill_share: f64,
    pub mean_prefill_wait_s: f64,
    pub stats: FleetStats,
}

/// Results of a whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: SimulateConfig,
    pub reproduction: Vec<ReproRow>,
    pub beyond: Vec<BeyondRow>,
    pub simulated_turns: u64,
    pub threads: usize,
    pub elapsed_s: f64,
}

/// Generate the trace once and run every configuration in parallel.
pub fn execute(cfg: &SimulateConfig) -> Result<Report, BenchError> {
    let started = Instant::now();
    let trace = Trace::generate(cfg.workload)?;
    let repro = cfg.reproduction_configs();
    let beyond = cfg.beyond_configs();
    let all: Vec<&FleetConfig> = repro.iter().chain(&beyond).collect();
    let stats = all
        .par_iter()
        .map(|f| simulate(&trace, f))
        .collect::<Result<Vec<_>, _>>()?;
    let (rs, bs) = stats.split_at(repro.len());
    let seed_ref = cfg.is_seed_setting();
    let reproduction = cfg
        .cache_tokens
        .iter()
        .zip(rs.chunks(2))
        .map(|(&c, pair)| ReproRow {
            cache_tokens: c,
            random: pair[0].hit_rate(),
            affinity: pair[1].hit_rate(),
            seed_reference: SEED_REFERENCE
                .iter()
                .find(|r| seed_ref && r.0 == c)
                .map(|r| (r.1, r.2)),
        })
        .collect();
    let beyond = beyond
        .iter()
        .zip(bs)
        .map(|(f, s)| BeyondRow {
            cache_tokens: f.cache_tokens,
            host_tokens: f.host_tokens,
            routing: f.routing,
            hit_rate: s.hit_rate(),
            hbm_hit_rate: s.hbm_rate(),
            host_hit_rate: s.host_rate(),
            spill_rate: s.spill_rate(),
            turn_imbalance: s.turn_imbalance(),
            inflight_imbalance: s.inflight_imbalance(),
            saved_prefill_tokens_per_s: s.saved_prefill_tokens_per_s(),
            remote_prefill_share: s.remote_prefill_share(),
            mean_prefill_wait_s: s.mean_prefill_wait_s(),
            stats: s.clone(),
        })
        .collect();
    Ok(Report {
        config: cfg.clone(),
        reproduction,
        beyond,
        simulated_turns: stats.iter().map(|s| s.turns).sum(),
        threads: rayon::current_num_threads(),
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

fn cache_label(tokens: u64) -> String {
    let m = tokens as f64 / 1e6;
    if m >= 1.0 && m.fract() == 0.0 {
        format!("{m:.0} M tokens")
    } else {
        format!("{m} M tokens")
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn event_text(events: &[FleetEvent]) -> String {
    if events.is_empty() {
        return "none".into();
    }
    events
        .iter()
        .map(|e| match e.change {
            FleetChange::Fail(n) => format!("node {n} fails at {}s", e.t),
            FleetChange::Join => format!("a node joins at {}s", e.t),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The human-readable report.
pub fn render(r: &Report) -> String {
    let c = &r.config;
    let w = &c.workload;
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!(
        "fleet simulation: {} conversations x {} turns on {} replicas (seed {})",
        thousands(w.conversations as f64, 0),
        w.turns,
        c.replicas,
        w.seed
    ));
    line(String::new());
    line("seed reproduction: prefix-cache hit rate, HBM-only LRU per replica".into());
    line(
        "  baton = this simulator; seed = the seed document's printed table (hard-coded reference)"
            .into(),
    );
    line(format!(
        "  {:<16}{:>14}{:>8}{:>9}{:>16}{:>8}{:>9}",
        "cache/replica", "random baton", "seed", "diff", "affinity baton", "seed", "diff"
    ));
    let mut worst: Option<f64> = None;
    for row in &r.reproduction {
        let (sr, sa, dr, da) = match row.seed_reference {
            Some((sr, sa)) => {
                let (dr, da) = ((row.random - sr) * 100.0, (row.affinity - sa) * 100.0);
                worst = Some(worst.unwrap_or(0.0).max(dr.abs()).max(da.abs()));
                (
                    format!("{:.0}%", sr * 100.0),
                    format!("{:.0}%", sa * 100.0),
                    format!("{dr:+.1}pp"),
                    format!("{da:+.1}pp"),
                )
            }
            None => ("n/a".into(), "n/a".into(), String::new(), String::new()),
        };
        line(format!(
            "  {:<16}{:>14}{:>8}{:>9}{:>16}{:>8}{:>9}",
            cache_label(row.cache_tokens),
            pct(row.random),
            sr,
            dr,
            pct(row.affinity),
            sa,
            da
        ));
    }
    match worst {
        Some(d) => line(format!(
            "  largest difference from the seed: {d:.1} pp ({} the 3 pp tolerance)",
            if d <= 3.0 { "within" } else { "OUTSIDE" }
        )),
        None => line(
            "  (the seed's table applies only to its own setting: 4,000 x 8 turns on 8 replicas)"
                .into(),
        ),
    }
    line(String::new());
    line(
        "beyond the seed: same trace, second memory tier, prefill pool, bounded loads, events"
            .into(),
    );
    line(format!(
        "  host tier {}x HBM per replica; prefill pool {} nodes (tails >= {} tokens go remote); load factor {}; {} vnodes; events: {}",
        c.host_tier_ratio,
        c.prefill_nodes,
        c.local_prefill_threshold,
        c.load_factor,
        c.vnodes,
        event_text(&c.events)
    ));
    line(format!(
        "  {:<14}{:<10}{:>7}{:>7}{:>7}{:>7}{:>10}{:>10}{:>14}{:>9}{:>10}",
        "cache/replica",
        "routing",
        "hit",
        "hbm",
        "host",
        "spill",
        "turns",
        "in-flight",
        "saved prefill",
        "remote",
        "mean wait"
    ));
    line(format!(
        "  {:<14}{:<10}{:>7}{:>7}{:>7}{:>7}{:>10}{:>10}{:>14}{:>9}{:>10}",
        "", "", "", "", "", "", "max/mean", "peak/mean", "tok/s", "prefill", "ms"
    ));
    for b in &r.beyond {
        line(format!(
            "  {:<14}{:<10}{:>7}{:>7}{:>7}{:>7}{:>10.2}{:>10.2}{:>14}{:>9}{:>10.1}",
            cache_label(b.cache_tokens).replace(" tokens", ""),
            b.routing.label(),
            pct(b.hit_rate),
            pct(b.hbm_hit_rate),
            pct(b.host_hit_rate),
            pct(b.spill_rate),
            b.turn_imbalance,
            b.inflight_imbalance,
            thousands(b.saved_prefill_tokens_per_s, 0),
            pct(b.remote_prefill_share),
            b.mean_prefill_wait_s * 1e3
        ));
    }
    line("  hit = prompt tokens served from cache (hbm/host: by a conversation entry in that tier; the".into());
    line(
        "  rest by the shared system prompt); saved prefill = cached tokens per simulated second"
            .into(),
    );
    line(String::new());
    line(format!(
        "simulated {} turns in {} configurations in {:.2} s ({} threads)",
        thousands(r.simulated_turns as f64, 0),
        r.reproduction.len() * 2 + r.beyond.len(),
        r.elapsed_s,
        r.threads
    ));
    o
}

/// Entry point of `baton simulate`.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    if args.day {
        return run_day(&args);
    }
    let cfg = SimulateConfig::try_from(&args)?;
    let report = execute(&cfg)?;
    if args.json {
        crate::emit(&(serde_json::to_string_pretty(&report)? + "\n"))
    } else {
        crate::emit(&render(&report))
    }
}

fn run_day(args: &SimulateArgs) -> anyhow::Result<()> {
    let mut cfg = day::DayConfig::seed();
    cfg.seed = args.seed;
    cfg.planner.load_time_s = args.load_time;
    cfg.fail_at_s = args.day_fail_at;
    let report = day::execute(&cfg)?;
    if let Some(path) = &args.chart {
        day::render::chart(path, &report)?;
    }
    if args.json {
        crate::emit(&(serde_json::to_string_pretty(&report)? + "\n"))
    } else {
        crate::emit(&day::render::render(&report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimulateArgs,
    }

    fn config(extra: &[&str]) -> SimulateConfig {
        let mut v = vec!["simulate"];
        v.extend_from_slice(extra);
        SimulateConfig::try_from(&Cli::try_parse_from(v).unwrap().args).unwrap()
    }

    #[test]
    fn reproduces_the_seed_table_within_3_points() {
        let cfg = config(&["--routing", "bounded"]);
        assert!(cfg.is_seed_setting());
        let report = execute(&cfg).unwrap();
        assert_eq!(report.reproduction.len(), 4);
        for row in &report.reproduction {
            let (sr, sa) = row.seed_reference.expect("seed setting has a reference");
            assert!(
                (row.random - sr).abs() <= 0.03,
                "random {} vs seed {sr}",
                row.random
            );
            assert!(
                (row.affinity - sa).abs() <= 0.03,
                "affinity {} vs seed {sa}",
                row.affinity
            );
        }
        let text = render(&report);
        assert!(text.contains("within the 3 pp tolerance"), "{text}");
    }

    #[test]
    fn presets_flags_and_parsers() {
        let c = config(&["--scale", "10x"]);
        assert_eq!(
            (c.workload.conversations, c.replicas, c.prefill_nodes),
            (200_000, 200, 100)
        );
        assert!(!c.is_seed_setting());
        let c = config(&["--scale", "10x", "--conversations", "10", "--replicas", "3"]);
        assert_eq!(
            (c.workload.conversations, c.replicas, c.prefill_nodes),
            (10, 3, 2)
        );
        let c = config(&[
            "--fail",
            "3@2m,1@10",
            "--join",
            "90s",
            "--cache-tokens",
            "1000",
        ]);
        assert_eq!(c.events.len(), 3);
        assert_eq!(
            c.events[0],
            FleetEvent {
                t: 10.0,
                change: FleetChange::Fail(1)
            }
        );
        assert_eq!(c.events[1].change, FleetChange::Join);
        assert_eq!(c.events[2].t, 120.0);
        assert_eq!(c.cache_tokens, vec![1000]);
        assert!(Cli::try_parse_from(["s", "--fail", "3"]).is_err());
        assert!(Cli::try_parse_from(["s", "--routing", "least-loaded"]).is_err());
        assert!(Cli::try_parse_from(["s", "--scale", "100x"]).is_err());
        assert_eq!(parse_seconds("1.5h"), Ok(5400.0));
        assert!(parse_seconds("-3s").is_err());
    }

    #[test]
    fn small_run_renders_every_section_and_json() {
        let cfg = config(&[
            "--conversations",
            "300",
            "--replicas",
            "4",
            "--cache-tokens",
            "500000",
            "--fail",
            "1@300s",
            "--join",
            "400s",
        ]);
        let report = execute(&cfg).unwrap();
        assert_eq!(report.beyond.len(), 4);
        assert!(report.reproduction[0].seed_reference.is_none());
        let text = render(&report);
        for needle in [
            "seed reproduction",
            "n/a",
            "beyond the seed",
            "node 1 fails at 300s",
            "bounded",
            "simulated",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        let v = serde_json::to_value(&report).unwrap();
        assert_eq!(v["beyond"][3]["routing"], "bounded");
        assert!(v["beyond"][0]["stats"]["turns"].as_u64().unwrap() > 0);
    }

    #[test]
    fn day_flags() {
        let a = Cli::try_parse_from(["s", "--day", "--chart", "d.svg", "--load-time", "10m"])
            .unwrap()
            .args;
        assert!(a.day && a.chart.is_some());
        assert_eq!((a.load_time, a.day_fail_at), (600.0, 13.0 * 3_600.0));
        // A chart belongs to the day run.
        assert!(Cli::try_parse_from(["s", "--chart", "d.svg"]).is_err());
        assert!(Cli::try_parse_from(["s", "--day", "--load-time", "soon"]).is_err());
    }

    #[test]
    fn same_seed_same_report() {
        let cfg = config(&["--conversations", "200", "--cache-tokens", "200000"]);
        let a = execute(&cfg).unwrap();
        let b = execute(&cfg).unwrap();
        let key = |r: &Report| {
            r.beyond
                .iter()
                .map(|b| b.stats.cached_tokens)
                .collect::<Vec<_>>()
        };
        assert_eq!(key(&a), key(&b));
    }
}
