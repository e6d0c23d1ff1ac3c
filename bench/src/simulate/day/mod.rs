//! `baton simulate --day`: the planner in the loop over a day of traffic, against fixed
//! fleets and an oracle.
//!
//! Four fleets see the same day ([`cluster::DayTraffic`], averaging 40% of its peak) on the
//! same hardware ([`cluster::Truth`], slower than the roofline in ways only measurement
//! reveals) with the same decode-node failure:
//!
//! - `peak`: fixed, sized by the capacity model for the day's highest rate, at the
//!   hardware's measured speed, plus the spare nodes (what an operator who measured buys);
//! - `mean`: fixed, sized the same way for the day's mean rate;
//! - `planner`: [`crate::planner::Planner`] every interval, fed the cluster's measurements
//!   and yesterday's daily shape (today's shifted by a quarter of an hour), actuating
//!   through starts that load for the model's load time and drains that migrate warm KV;
//! - `reactive`: the same planner without prediction (sized for the smoothed current rate
//!   and no daily shape): what the forecast's lead over the model load time is worth;
//! - `oracle`: knows today's traffic (noise included) and the hardware's true speed, and
//!   asks each interval for what the next load time plus interval will need, with the
//!   same spare nodes and no hysteresis: a floor for what any reactive policy can reach.
//!
//! Reports GPU-hours, SLO attainment (share of turns meeting both TTFT and ITL) per hour
//! and over the day, and the warm-hit rate.

pub mod cluster;
pub mod render;

use serde::Serialize;

use crate::capacity::Inputs;
use crate::error::{invalid, BenchError};
use crate::planner::{
    Corrections, CostModel, DailyShape, Demand, Planner, PlannerConfig, PoolLimits, Slo,
};
pub use cluster::{Cluster, DayTraffic, Hour, Truth};

/// Everything a day run depends on.
#[derive(Debug, Clone, Serialize)]
pub struct DayConfig {
    pub peak_turns_per_s: f64,
    /// The day's mean rate over its peak (the seed: 40%).
    pub mean_share: f64,
    pub noise_sigma: f64,
    /// When a decode node fails, seconds after midnight (past a day: never).
    pub fail_at_s: f64,
    /// How much earlier yesterday's shape ran than today's, seconds.
    pub yesterday_shift_s: f64,
    pub truth: Truth,
    pub planner: PlannerConfig,
    pub seed: u64,
}

impl DayConfig {
    /// The seed's fleet: its model and hardware, 20,000 open conversations at one turn a
    /// minute at peak, a 1 s TTFT and 15 ms ITL SLO, one spare node per pool, a five-minute
    /// model load, a 30 s interval, a node failure at the midday peak.
    pub fn seed() -> Self {
        let cost = CostModel::new(
            Inputs::seed(),
            Slo {
                ttft_s: 1.0,
                itl_s: 0.015,
                headroom: 0.9,
                target_utilization: 0.6,
            },
        )
        .expect("the seed's model fits its GPUs");
        let limits = PoolLimits {
            min: 1,
            max: 64,
            spare: 1,
        };
        Self {
            peak_turns_per_s: 20_000.0 / 60.0,
            mean_share: 0.4,
            noise_sigma: 0.05,
            fail_at_s: 13.0 * 3_600.0,
            yesterday_shift_s: 900.0,
            truth: Truth {
                decode_slowdown: 1.15,
                prefill_efficiency: 0.85,
                handoff_s: 0.05,
                host_tier_ratio: 3.0,
                drain_s: 60.0,
            },
            planner: PlannerConfig::tuned(cost, limits, 30.0, 300.0, 600.0),
            seed: 1,
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        if !(self.peak_turns_per_s > 0.0 && self.peak_turns_per_s.is_finite()) {
            return Err(invalid("peak turns/s", "must be > 0"));
        }
        if !(self.mean_share > 0.05 && self.mean_share < 1.0) {
            return Err(invalid("mean share", "must be in (0.05, 1)"));
        }
        if !(self.noise_sigma >= 0.0 && self.noise_sigma < 0.5) {
            return Err(invalid("noise sigma", "must be in [0, 0.5)"));
        }
        let t = &self.truth;
        if !(t.decode_slowdown > 0.0 && t.prefill_efficiency > 0.0 && t.drain_s >= 0.0) {
            return Err(invalid("truth", "slowdown and efficiency > 0, drain >= 0"));
        }
        if self.planner.interval_s < 1.0 || self.planner.interval_s.fract() != 0.0 {
            return Err(invalid(
                "interval",
                "must be a whole number of seconds >= 1",
            ));
        }
        Ok(())
    }
}

/// One of the compared fleets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Fleet {
    Peak,
    Mean,
    Planner,
    Reactive,
    Oracle,
}

impl Fleet {
    pub const ALL: [Fleet; 5] = [
        Fleet::Peak,
        Fleet::Mean,
        Fleet::Planner,
        Fleet::Reactive,
        Fleet::Oracle,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fleet::Peak => "peak",
            Fleet::Mean => "mean",
            Fleet::Planner => "planner",
            Fleet::Reactive => "reactive",
            Fleet::Oracle => "oracle",
        }
    }
}

/// A planner decision that changed a target, with its reasons.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub t_s: f64,
    pub prefill: u32,
    pub decode: u32,
    pub why: Vec<String>,
}

/// What one fleet did over the day.
#[derive(Debug, Clone, Serialize)]
pub struct FleetResult {
    pub fleet: Fleet,
    pub gpu_hours: f64,
    pub turns: f64,
    pub good_turns: f64,
    pub warm_turns: f64,
    pub lost_turns: f64,
    pub hours: Vec<Hour>,
    /// (hour of day, prefill nodes billed, decode nodes billed) each minute.
    pub timeline: Vec<(f64, u32, u32)>,
    pub changes: Vec<Change>,
}

impl FleetResult {
    pub fn attainment(&self) -> f64 {
        ratio(self.good_turns, self.turns)
    }
    pub fn warm_hit_rate(&self) -> f64 {
        ratio(self.warm_turns, self.turns)
    }
    /// The worst hour's attainment.
    pub fn worst_hour(&self) -> f64 {
        self.hours
            .iter()
            .filter(|h| h.turns > 0.0)
            .map(|h| h.good_turns / h.turns)
            .fold(1.0, f64::min)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct DayReport {
    pub config: DayConfig,
    pub traffic_mean_turns_per_s: f64,
    pub traffic_peak_turns_per_s: f64,
    pub fleets: Vec<FleetResult>,
}

impl DayReport {
    pub fn fleet(&self, f: Fleet) -> &FleetResult {
        self.fleets
            .iter()
            .find(|r| r.fleet == f)
            .expect("every fleet runs")
    }
    /// GPU-hours the planner saves against the peak-sized fleet, as a share of the latter.
    pub fn savings_vs_peak(&self) -> f64 {
        1.0 - self.fleet(Fleet::Planner).gpu_hours / self.fleet(Fleet::Peak).gpu_hours
    }
    /// The planner's GPU-hours over the oracle's, minus one.
    pub fn over_oracle(&self) -> f64 {
        self.fleet(Fleet::Planner).gpu_hours / self.fleet(Fleet::Oracle).gpu_hours - 1.0
    }
}

fn demand(traffic: &DayTraffic, rate: f64) -> Demand {
    Demand {
        turns_per_s: rate,
        prompt_tokens: traffic.prompt_tokens,
        reply_tokens: traffic.reply_tokens,
        cached_share: traffic.warm_cached_share,
    }
}

/// A fixed fleet's or the oracle's nodes for `rate`, with the spare nodes.
fn sized(
    cfg: &DayConfig,
    traffic: &DayTraffic,
    rate: f64,
    c: &Corrections,
) -> Result<(u32, u32), BenchError> {
    let p = &cfg.planner;
    let n = p.cost.need(&demand(traffic, rate), c)?;
    let clamp = |v: u32, l: PoolLimits| v.max(l.min).min(l.max);
    Ok((
        clamp(n.prefill_nodes + p.prefill.spare, p.prefill),
        clamp(n.decode_nodes + p.decode.spare, p.decode),
    ))
}

/// Run one fleet over the day.
fn run_fleet(
    cfg: &DayConfig,
    traffic: &DayTraffic,
    fleet: Fleet,
) -> Result<FleetResult, BenchError> {
    let pc = &cfg.planner;
    let interval = pc.interval_s as u64;
    let truth_corr = Corrections {
        decode_step: cfg.truth.decode_slowdown,
        prefill_rate: cfg.truth.prefill_efficiency,
    };
    let horizon = pc.load_time_s + pc.interval_s;
    let oracle = |t: f64| -> Result<(u32, u32), BenchError> {
        let steps = (horizon / 10.0).ceil() as usize;
        let peak = (0..=steps)
            .map(|k| traffic.rate(t + horizon * k as f64 / steps as f64))
            .fold(0.0, f64::max);
        sized(cfg, traffic, peak, &truth_corr)
    };
    let fixed = match fleet {
        Fleet::Peak => Some(sized(cfg, traffic, traffic.peak(), &truth_corr)?),
        Fleet::Mean => Some(sized(cfg, traffic, traffic.mean(), &truth_corr)?),
        _ => None,
    };
    let mut planner = match fleet {
        Fleet::Reactive => {
            let mut c = pc.clone();
            c.predict = false;
            Some(Planner::new(c)?)
        }
        Fleet::Planner => {
            // Yesterday's shape: today's, a quarter of an hour earlier, every 10 minutes.
            let samples = (0..144)
                .map(|k| traffic.shape_at(k as f64 * 600.0 + cfg.yesterday_shift_s))
                .collect();
            let mut c = pc.clone();
            c.shape = Some(DailyShape::new(samples)?);
            Some(Planner::new(c)?)
        }
        _ => None,
    };
    // Every fleet has been running since yesterday: it starts the day at its own size for
    // midnight (the adaptive ones at the oracle's).
    let start = fixed.map_or_else(|| oracle(0.0), Ok)?;
    let mut cluster = Cluster::new(
        traffic,
        cfg.truth,
        &pc.cost,
        pc.load_time_s,
        start,
        cfg.seed,
    )?;
    let mut changes = Vec::new();
    let mut last = start;
    let mut failed = false;
    for s in 0..86_400u64 {
        let t = s as f64;
        if !failed && t >= cfg.fail_at_s {
            cluster.fail_decode_node(t);
            failed = true;
        }
        if s > 0 && s.is_multiple_of(interval) {
            let target = match (fixed, planner.as_mut()) {
                (Some(f), _) => f,
                (None, Some(p)) => {
                    let signals = cluster.signals(t);
                    let d = p.step(&signals)?;
                    let target = (d.prefill, d.decode);
                    if target != last {
                        changes.push(Change {
                            t_s: t,
                            prefill: d.prefill,
                            decode: d.decode,
                            why: d
                                .reasons
                                .iter()
                                .filter(|r| {
                                    r.kind != "forecast" || target.0 > last.0 || target.1 > last.1
                                })
                                .map(|r| format!("{}: {}", r.pool.label(), r.text))
                                .collect(),
                        });
                    }
                    target
                }
                (None, None) => oracle(t)?,
            };
            if planner.is_none() {
                // Only the planner reads the measurements; the others just start afresh.
                cluster.signals(t);
            }
            cluster.actuate(t, target);
            last = target;
        }
        cluster.tick(t);
    }
    let hours = cluster.hours.clone();
    let sum = |f: fn(&Hour) -> f64| hours.iter().map(f).sum::<f64>();
    Ok(FleetResult {
        fleet,
        gpu_hours: sum(|h| h.gpu_seconds) / 3_600.0,
        turns: sum(|h| h.turns),
        good_turns: sum(|h| h.good_turns),
        warm_turns: sum(|h| h.warm_turns),
        lost_turns: sum(|h| h.lost_turns),
        timeline: std::mem::take(&mut cluster.timeline),
        hours,
        changes,
    })
}

/// Run the four fleets (in parallel) over the same day.
pub fn execute(cfg: &DayConfig) -> Result<DayReport, BenchError> {
    use rayon::prelude::*;
    cfg.validate()?;
    let traffic = DayTraffic::new(
        cfg.peak_turns_per_s,
        cfg.mean_share,
        cfg.noise_sigma,
        cfg.seed,
    );
    let fleets = Fleet::ALL
        .par_iter()
        .map(|&f| run_fleet(cfg, &traffic, f))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DayReport {
        config: cfg.clone(),
        traffic_mean_turns_per_s: traffic.mean(),
        traffic_peak_turns_per_s: traffic.peak(),
        fleets,
    })
}

#[cfg(test)]
mod tests;
