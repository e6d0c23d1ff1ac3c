//! The planner: a pure, synchronous core that turns what the cluster measures into prefill
//! and decode replica counts, every interval, with a reason for each.
//!
//! Each [`Planner::step`] takes one [`Signals`] (arrival rate and prompt/reply mix, prefill
//! queue and TTFT, decode ITL, KV occupancy, warm-hit rate, a node's observed tokens/s at
//! its observed batch) and returns a [`Decision`]:
//!
//! 1. **Measure**: the corrections of the cost model (observed step time over modelled at
//!    the observed batch; observed prefill rate over modelled) are smoothed in.
//! 2. **Predict**: the arrival rate is forecast ([`forecast`]) and the demand is the peak of
//!    the forecast over the next model load time plus one interval, so a node asked for
//!    now is serving before the ramp arrives.
//! 3. **Size**: [`sizing::CostModel`] (the `baton capacity` arithmetic) gives the nodes
//!    each pool needs for that demand at the SLO.
//! 4. **React**: a measured SLO breach (ITL or TTFT p95 above `headroom x` target, a prefill
//!    queue above its bound, KV nearly full) adds nodes in proportion, whatever the model says.
//! 5. **Protect**: each pool keeps `spare` nodes above its need (the failure headroom of
//!    the capacity program: losing a node while a replacement loads keeps the SLO) and stays
//!    within `[min, max]`.
//! 6. **Damp**: scale-up applies at once; scale-down only after the lower target has held
//!    for `scale_down_delay_s`, and then by at most `scale_down_step` of the pool per
//!    interval (hysteresis: a dip shorter than the delay never sheds a node).
//!
//! The planner holds no clock and does no I/O: `baton simulate --day` and `baton plan`
//! feed it the same way.

pub mod forecast;
pub mod metrics;
pub mod sizing;

use serde::Serialize;

pub use forecast::{DailyShape, Forecaster};
pub use sizing::{Corrections, CostModel, Demand, Need, Slo};

use crate::error::{invalid, BenchError};

/// One of the two pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    pub fn label(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }
}

/// Limits of one pool.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolLimits {
    pub min: u32,
    pub max: u32,
    /// Nodes kept above the need: the failure headroom.
    pub spare: u32,
}

/// Everything the planner's policy depends on.
#[derive(Debug, Clone, Serialize)]
pub struct PlannerConfig {
    pub cost: CostModel,
    pub prefill: PoolLimits,
    pub decode: PoolLimits,
    /// Seconds between decisions.
    pub interval_s: f64,
    /// Seconds from asking for a node to its serving (model load): the forecast horizon.
    pub load_time_s: f64,
    /// A lower target must hold this long before a node is shed.
    pub scale_down_delay_s: f64,
    /// Largest share of a pool shed in one interval (at least one node).
    pub scale_down_step: f64,
    /// Queued prefill turns per prefill node above which the pool grows.
    pub queue_per_node: f64,
    /// KV occupancy of the decode pool above which it grows.
    pub kv_high: f64,
    /// Measured decode batch per node (running plus waiting sequences) the pool is sized
    /// for: the batch a node was measured to serve within the ITL target. `None`:
    /// the cost model's batch alone (`baton plan`); `baton up --autoscale` sets it, as
    /// the cost model's GPU is not the machine it runs on.
    pub batch_high: Option<f64>,
    /// Smoothing weight of a new correction measurement.
    pub correction_alpha: f64,
    pub forecast_alpha: f64,
    pub forecast_beta: f64,
    pub shape: Option<DailyShape>,
    /// Size for the forecast peak over the load time plus an interval (true), or only for
    /// the smoothed current rate (false: a purely reactive loop, for comparison).
    pub predict: bool,
}

impl PlannerConfig {
    /// The planner's tuning as `baton plan` runs it (and the day simulator measures it):
    /// shed at most 10% of a pool an interval, grow prefill past 8 queued turns a node and
    /// decode past 90% KV occupancy, smooth corrections by 0.2 and the forecast by Holt's
    /// 0.3 / 0.02, no daily shape, sizing for the forecast peak.
    pub fn tuned(cost: CostModel, limits: PoolLimits, interval_s: f64, load_time_s: f64, scale_down_delay_s: f64) -> PlannerConfig {
        PlannerConfig {
            cost,
            prefill: limits,
            decode: limits,
            interval_s,
            load_time_s,
            scale_down_delay_s,
            scale_down_step: 0.1,
            queue_per_node: 8.0,
            kv_high: 0.9,
            batch_high: None,
            correction_alpha: 0.2,
            forecast_alpha: 0.3,
            forecast_beta: 0.02,
            shape: None,
            predict: true,
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        for (name, l) in [
            ("prefill limits", self.prefill),
            ("decode limits", self.decode),
        ] {
            if l.max == 0 || l.min > l.max {
                return Err(invalid(name, "need 0 <= min <= max and max >= 1"));
            }
        }
        let pos = |v: f64| v > 0.0 && v.is_finite();
        if !(pos(self.interval_s) && self.load_time_s >= 0.0 && self.scale_down_delay_s >= 0.0) {
            return Err(invalid(
                "planner timing",
                "interval > 0, load time and delay >= 0",
            ));
        }
        if !(pos(self.scale_down_step) && self.scale_down_step <= 1.0) {
            return Err(invalid("scale-down step", "must be in (0, 1]"));
        }
        if !(pos(self.queue_per_node) && pos(self.kv_high) && self.kv_high <= 1.0) {
            return Err(invalid(
                "planner bounds",
                "queue per node > 0, KV high in (0, 1]",
            ));
        }
        if self.batch_high.is_some_and(|b| !pos(b)) {
            return Err(invalid("batch high", "must be > 0"));
        }
        if !(pos(self.correction_alpha) && self.correction_alpha <= 1.0) {
            return Err(invalid("correction alpha", "must be in (0, 1]"));
        }
        Ok(())
    }
}

/// What the cluster measured over the last interval. Optional fields are absent when
/// nothing was measured (no turn finished, an idle pool).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Signals {
    /// End of the interval, seconds (any monotonic origin; the daily shape reads it as
    /// seconds since midnight).
    pub t_s: f64,
    pub arrival_turns_per_s: f64,
    pub prompt_tokens_mean: f64,
    pub reply_tokens_mean: f64,
    /// Share of prompt tokens served from prefix caches.
    pub cached_share: f64,
    /// Turns waiting for a prefill node.
    pub prefill_queue_turns: f64,
    pub ttft_p95_s: Option<f64>,
    pub itl_p95_s: Option<f64>,
    /// Used over total KV blocks of the decode pool.
    pub kv_occupancy: f64,
    /// Mean decode batch per node and that node's output tokens/s at it.
    pub decode_batch_mean: Option<f64>,
    pub decode_tokens_per_s_per_node: Option<f64>,
    /// Prefill tokens/s of a node while it was busy.
    pub prefill_tokens_per_s_busy: Option<f64>,
    pub ready_prefill: u32,
    pub ready_decode: u32,
}

impl Signals {
    fn validate(&self) -> Result<(), BenchError> {
        let nonneg = |v: f64| v >= 0.0 && v.is_finite();
        for (name, v) in [
            ("t_s", self.t_s),
            ("arrival_turns_per_s", self.arrival_turns_per_s),
            ("prompt_tokens_mean", self.prompt_tokens_mean),
            ("reply_tokens_mean", self.reply_tokens_mean),
            ("prefill_queue_turns", self.prefill_queue_turns),
            ("kv_occupancy", self.kv_occupancy),
        ] {
            if !nonneg(v) {
                return Err(invalid(name, format!("{v} must be a number >= 0")));
            }
        }
        if !(0.0..=1.0).contains(&self.cached_share) {
            return Err(invalid("cached_share", "must be between 0 and 1"));
        }
        for (name, v) in [
            ("ttft_p95_s", self.ttft_p95_s),
            ("itl_p95_s", self.itl_p95_s),
            ("decode_batch_mean", self.decode_batch_mean),
            (
                "decode_tokens_per_s_per_node",
                self.decode_tokens_per_s_per_node,
            ),
            ("prefill_tokens_per_s_busy", self.prefill_tokens_per_s_busy),
        ] {
            if let Some(v) = v {
                if !nonneg(v) {
                    return Err(invalid(name, format!("{v} must be a number >= 0")));
                }
            }
        }
        Ok(())
    }
}

/// Every [`Reason::kind`] (a metric label's whole set of values: bounded cardinality).
pub const REASON_KINDS: [&str; 10] = ["forecast", "itl", "ttft", "queue", "kv", "batch", "floor", "ceiling", "hold", "scale_down"];

/// One reason behind a pool's target.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reason {
    pub pool: Pool,
    /// A short stable label for metrics: one of [`REASON_KINDS`].
    pub kind: &'static str,
    /// For people: `why: decode ITL p95 46 ms > 0.9 x target 50 ms`.
    pub text: String,
}

/// The planner's answer for one interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub t_s: f64,
    pub prefill: u32,
    pub decode: u32,
    /// The arrival rate the fleet is sized for (forecast peak over the horizon).
    pub planned_turns_per_s: f64,
    pub need: Need,
    pub corrections: Corrections,
    pub reasons: Vec<Reason>,
}

impl Decision {
    /// The reasons as lines, pool first.
    pub fn explain(&self) -> String {
        self.reasons
            .iter()
            .map(|r| format!("{} -> {}: {}", r.pool.label(), self.target(r.pool), r.text))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn target(&self, pool: Pool) -> u32 {
        match pool {
            Pool::Prefill => self.prefill,
            Pool::Decode => self.decode,
        }
    }
}

/// Per-pool state of the hysteresis.
#[derive(Debug, Clone, Default, Serialize)]
struct Damper {
    target: Option<u32>,
    /// Since when the wanted count has been below the target.
    below_since: Option<f64>,
}

/// The control loop's state between intervals.
#[derive(Debug, Clone, Serialize)]
pub struct Planner {
    cfg: PlannerConfig,
    forecast: Forecaster,
    corr: Corrections,
    prefill: Damper,
    decode: Damper,
}

fn ms(s: f64) -> String {
    format!("{:.0} ms", s * 1e3)
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Result<Self, BenchError> {
        cfg.validate()?;
        let forecast = Forecaster::new(cfg.forecast_alpha, cfg.forecast_beta, cfg.shape.clone())?;
        Ok(Self {
            cfg,
            forecast,
            corr: Corrections::default(),
            prefill: Damper::default(),
            decode: Damper::default(),
        })
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    pub fn corrections(&self) -> Corrections {
        self.corr
    }

    /// Fold in this interval's measurements of the node rates.
    fn correct(&mut self, s: &Signals) -> Result<(), BenchError> {
        let a = self.cfg.correction_alpha;
        if let (Some(b), Some(rate)) = (s.decode_batch_mean, s.decode_tokens_per_s_per_node) {
            // Below a batch of 1 or a trickle the ratio is noise, not a measurement.
            if b >= 1.0 && rate > 0.0 && s.prompt_tokens_mean > 0.0 {
                let observed = b / rate;
                let model = self.cfg.cost.step_s(
                    b.round() as u64,
                    s.prompt_tokens_mean,
                    s.reply_tokens_mean,
                    1.0,
                )?;
                let k = (observed / model).clamp(0.25, 4.0);
                self.corr.decode_step += a * (k - self.corr.decode_step);
            }
        }
        if let Some(rate) = s.prefill_tokens_per_s_busy {
            if rate > 0.0 {
                let model = self.cfg.cost.prefill_tokens_per_s()?;
                let k = (rate / model).clamp(0.25, 4.0);
                self.corr.prefill_rate += a * (k - self.corr.prefill_rate);
            }
        }
        Ok(())
    }

    /// One interval: measurements in, targets and reasons out.
    pub fn step(&mut self, s: &Signals) -> Result<Decision, BenchError> {
        s.validate()?;
        self.correct(s)?;
        self.forecast.observe(s.t_s, s.arrival_turns_per_s);
        let horizon = self.cfg.load_time_s + self.cfg.interval_s;
        let planned = if self.cfg.predict {
            self.forecast.peak_within(horizon).max(self.forecast.now())
        } else {
            self.forecast.now()
        };
        let demand = Demand {
            turns_per_s: planned,
            prompt_tokens: s.prompt_tokens_mean,
            reply_tokens: s.reply_tokens_mean,
            cached_share: s.cached_share,
        };
        let need = self.cfg.cost.need(&demand, &self.corr)?;
        let slo = self.cfg.cost.slo.clone();
        let mut reasons = Vec::new();
        let forecast_text = |pool: &str, nodes: u32, busy: f64, spare: u32| {
            format!(
                "why: forecast {planned:.1} turns/s within {horizon:.0} s (load {:.0} s + interval): \
                 {pool} {busy:.2} busy node-eq / {:.2} utilisation = {nodes} + {spare} spare",
                self.cfg.load_time_s, slo.target_utilization
            )
        };

        // Decode: model, then the measured breaches.
        let dl = self.cfg.decode;
        let mut want_d = need.decode_nodes + dl.spare;
        reasons.push(Reason {
            pool: Pool::Decode,
            kind: "forecast",
            text: forecast_text("decode", need.decode_nodes, need.decode_busy, dl.spare),
        });
        let ready_d = s.ready_decode.max(1);
        if let Some(itl) = s.itl_p95_s {
            let budget = slo.itl_s * slo.headroom;
            if itl > budget {
                let w = ((ready_d as f64 * itl / budget).ceil() as u32).max(s.ready_decode + 1);
                want_d = want_d.max(w);
                reasons.push(Reason {
                    pool: Pool::Decode,
                    kind: "itl",
                    text: format!(
                        "why: decode ITL p95 {} > {} x target {}",
                        ms(itl),
                        slo.headroom,
                        ms(slo.itl_s)
                    ),
                });
            }
        }
        if s.kv_occupancy > self.cfg.kv_high {
            want_d = want_d.max(s.ready_decode + 1);
            reasons.push(Reason {
                pool: Pool::Decode,
                kind: "kv",
                text: format!(
                    "why: decode KV occupancy {:.0}% > {:.0}%",
                    s.kv_occupancy * 100.0,
                    self.cfg.kv_high * 100.0
                ),
            });
        }

        // Measured sizing: the running batch over the batch a node serves within the ITL.
        // It holds the pool while the load lasts (not only at a breach), so a node added
        // for it is not shed the moment the batch per node is back under the bound.
        if let (Some(high), Some(batch)) = (self.cfg.batch_high, s.decode_batch_mean) {
            let total = batch * ready_d as f64;
            let w = (total / high).ceil() as u32;
            if w > want_d {
                want_d = w;
                reasons.push(Reason {
                    pool: Pool::Decode,
                    kind: "batch",
                    text: format!(
                        "why: decode batch {total:.1} on {ready_d} node(s) = {batch:.1} per node; {w} keep it within {high} per node"
                    ),
                });
            }
        }

        // Prefill.
        let pl = self.cfg.prefill;
        let mut want_p = need.prefill_nodes + pl.spare;
        reasons.push(Reason {
            pool: Pool::Prefill,
            kind: "forecast",
            text: forecast_text("prefill", need.prefill_nodes, need.prefill_busy, pl.spare),
        });
        let ready_p = s.ready_prefill.max(1);
        if let Some(ttft) = s.ttft_p95_s {
            let budget = slo.ttft_s * slo.headroom;
            if ttft > budget {
                let w = ((ready_p as f64 * ttft / budget).ceil() as u32).max(s.ready_prefill + 1);
                want_p = want_p.max(w);
                reasons.push(Reason {
                    pool: Pool::Prefill,
                    kind: "ttft",
                    text: format!(
                        "why: TTFT p95 {} > {} x target {}",
                        ms(ttft),
                        slo.headroom,
                        ms(slo.ttft_s)
                    ),
                });
            }
        }
        let per_node = s.prefill_queue_turns / ready_p as f64;
        if per_node > self.cfg.queue_per_node {
            let w = (s.prefill_queue_turns / self.cfg.queue_per_node).ceil() as u32;
            want_p = want_p.max(w.max(s.ready_prefill + 1));
            reasons.push(Reason {
                pool: Pool::Prefill,
                kind: "queue",
                text: format!(
                    "why: prefill queue {per_node:.1} turns per node > {}",
                    self.cfg.queue_per_node
                ),
            });
        }

        let decode = self.damp(Pool::Decode, want_d, s.t_s, &mut reasons);
        let prefill = self.damp(Pool::Prefill, want_p, s.t_s, &mut reasons);
        Ok(Decision {
            t_s: s.t_s,
            prefill,
            decode,
            planned_turns_per_s: planned,
            need,
            corrections: self.corr,
            reasons,
        })
    }

    /// Clamp to the pool's limits, then apply the hysteresis.
    fn damp(&mut self, pool: Pool, want: u32, t: f64, reasons: &mut Vec<Reason>) -> u32 {
        let (limits, delay, step) = (
            match pool {
                Pool::Prefill => self.cfg.prefill,
                Pool::Decode => self.cfg.decode,
            },
            self.cfg.scale_down_delay_s,
            self.cfg.scale_down_step,
        );
        let floor = limits.min.max(limits.spare);
        let mut why = |kind, text: String| reasons.push(Reason { pool, kind, text });
        let want = if want < floor {
            why(
                "floor",
                format!(
                    "why: {} is below the floor {floor} (min and failure headroom)",
                    want
                ),
            );
            floor
        } else if want > limits.max {
            why(
                "ceiling",
                format!("why: {want} capped at the pool's max {}", limits.max),
            );
            limits.max
        } else {
            want
        };
        let d = match pool {
            Pool::Prefill => &mut self.prefill,
            Pool::Decode => &mut self.decode,
        };
        let current = *d.target.get_or_insert(want);
        let next = if want >= current {
            d.below_since = None;
            want
        } else {
            let since = *d.below_since.get_or_insert(t);
            if t - since < delay {
                why(
                    "hold",
                    format!(
                        "why: hold {current}: {want} wanted for {:.0} s of the {delay:.0} s scale-down delay",
                        t - since
                    ),
                );
                current
            } else {
                let shed = ((current as f64 * step).floor() as u32).max(1);
                let next = current.saturating_sub(shed).max(want);
                why(
                    "scale_down",
                    format!(
                        "why: {want} wanted for {:.0} s >= {delay:.0} s: shed {} (at most {:.0}% per interval)",
                        t - since,
                        current - next,
                        step * 100.0
                    ),
                );
                // The next shed waits a whole delay again only if demand rises in between.
                next
            }
        };
        d.target = Some(next);
        next
    }
}

#[cfg(test)]
mod tests;
