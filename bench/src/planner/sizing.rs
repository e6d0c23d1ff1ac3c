//! How many prefill and decode nodes a demand needs, from the cost model of `baton
//! capacity` ([`crate::capacity::plan`]) corrected by what the cluster measures.
//!
//! Decode: the largest batch whose step time (the capacity roofline, times the measured
//! correction) stays under `headroom x` the ITL target sets a node's useful rate; the
//! output tokens per second over that rate are the busy node-equivalents, and dividing by
//! the target utilisation gives nodes. Prefill: uncached prompt tokens per second over a
//! node's (corrected) rate, the same way; and enough nodes that a tail's queueing plus
//! compute stays under `headroom x` the TTFT target. The two pools are independent, so the
//! cheapest fleet meeting both SLOs is the smallest count of each.

use serde::Serialize;

use crate::capacity::plan::{plan, Inputs};
use crate::error::{invalid, BenchError};

/// The SLO and the sizing policy.
#[derive(Debug, Clone, Serialize)]
pub struct Slo {
    /// Time to first token a turn must meet, seconds.
    pub ttft_s: f64,
    /// Inter-token latency a turn must meet, seconds.
    pub itl_s: f64,
    /// Plan for this fraction of each target (e.g. 0.9), leaving room for noise.
    pub headroom: f64,
    /// Busy time per node the plan aims at (as `baton capacity --target-utilization`).
    pub target_utilization: f64,
}

/// What the traffic asks of the fleet over the planning horizon.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Demand {
    pub turns_per_s: f64,
    pub prompt_tokens: f64,
    pub reply_tokens: f64,
    /// Share of prompt tokens served from the prefix cache (the warm-hit rate in tokens).
    pub cached_share: f64,
}

/// Measured over modelled: a decode step's time and a prefill node's rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Corrections {
    /// Observed step time / the roofline's step time at the observed batch (> 1: slower).
    pub decode_step: f64,
    /// Observed prefill tokens/s of a busy node / the roofline's (< 1: slower).
    pub prefill_rate: f64,
}

impl Default for Corrections {
    fn default() -> Self {
        Self {
            decode_step: 1.0,
            prefill_rate: 1.0,
        }
    }
}

/// The nodes a demand needs, before the failure headroom is added.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Need {
    pub decode_nodes: u32,
    pub prefill_nodes: u32,
    pub decode_busy: f64,
    pub prefill_busy: f64,
    /// Largest batch per decode node within the ITL budget.
    pub max_batch: u64,
    /// Corrected step time at that batch, seconds.
    pub step_s: f64,
    /// Corrected prefill tokens/s of one node.
    pub prefill_tokens_per_s: f64,
}

/// The capacity model plus the SLO: a pure function from demand to nodes.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    /// The hardware and model half of `baton capacity`'s inputs (workload fields are
    /// replaced per call).
    pub base: Inputs,
    pub slo: Slo,
}

/// Decode batches the search considers.
const MAX_BATCH_LIMIT: u64 = 4_096;

impl CostModel {
    pub fn new(base: Inputs, slo: Slo) -> Result<Self, BenchError> {
        let ok = |v: f64| v > 0.0 && v.is_finite();
        if !(ok(slo.ttft_s) && ok(slo.itl_s)) {
            return Err(invalid("slo", "TTFT and ITL targets must be > 0"));
        }
        if !(ok(slo.headroom) && slo.headroom <= 1.0) {
            return Err(invalid("slo headroom", "must be in (0, 1]"));
        }
        if !(ok(slo.target_utilization) && slo.target_utilization <= 1.0) {
            return Err(invalid("target utilization", "must be in (0, 1]"));
        }
        let m = Self { base, slo };
        // Fails here, once, if the model does not fit the GPU at all.
        m.step_s(1, 1.0, 1.0, 1.0)?;
        Ok(m)
    }

    fn inputs(&self, d: &Demand, batch: u64) -> Inputs {
        Inputs {
            // One turn per second per "open conversation": the capacity model's request
            // rate is then exactly the demand's turn rate.
            open_conversations: d.turns_per_s,
            turn_gap_s: 1.0,
            prompt_tokens: d.prompt_tokens,
            output_tokens: d.reply_tokens,
            cached_share: d.cached_share.clamp(0.0, 1.0),
            max_batch: batch,
            target_utilization: self.slo.target_utilization,
            spare_nodes: 0,
            measured_decode_tokens_per_s: None,
            ..self.base.clone()
        }
    }

    /// The roofline step time at `batch` for the given context, times `correction`.
    pub fn step_s(
        &self,
        batch: u64,
        prompt_tokens: f64,
        reply_tokens: f64,
        correction: f64,
    ) -> Result<f64, BenchError> {
        let d = Demand {
            turns_per_s: 1.0,
            prompt_tokens,
            reply_tokens,
            cached_share: 0.0,
        };
        Ok(plan(&self.inputs(&d, batch.max(1)))?.decode_step_s * correction)
    }

    /// The roofline prefill tokens/s of one node (uncorrected).
    pub fn prefill_tokens_per_s(&self) -> Result<f64, BenchError> {
        let d = Demand {
            turns_per_s: 1.0,
            prompt_tokens: 1.0,
            reply_tokens: 1.0,
            cached_share: 0.0,
        };
        Ok(plan(&self.inputs(&d, 1))?.prefill_tokens_per_s_per_node)
    }

    /// The largest batch whose corrected step meets `headroom x` the ITL target (at least
    /// 1: a node that cannot meet it at batch 1 still serves, and the planner says so).
    pub fn max_batch(&self, d: &Demand, c: &Corrections) -> Result<u64, BenchError> {
        let budget = self.slo.itl_s * self.slo.headroom;
        let fits = |b: u64| -> Result<bool, BenchError> {
            Ok(self.step_s(b, d.prompt_tokens, d.reply_tokens, c.decode_step)? <= budget)
        };
        if !fits(1)? {
            return Ok(1);
        }
        let (mut lo, mut hi) = (1u64, MAX_BATCH_LIMIT);
        if fits(hi)? {
            return Ok(hi);
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid)? {
                lo = mid
            } else {
                hi = mid
            }
        }
        Ok(lo)
    }

    /// The nodes `d` needs with the corrections applied.
    pub fn need(&self, d: &Demand, c: &Corrections) -> Result<Need, BenchError> {
        for (name, v) in [
            ("turns_per_s", d.turns_per_s),
            ("prompt_tokens", d.prompt_tokens),
            ("reply_tokens", d.reply_tokens),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(invalid(name, format!("{v} must be a number >= 0")));
            }
        }
        if !(c.decode_step > 0.0 && c.prefill_rate > 0.0) {
            return Err(invalid("corrections", "must be > 0"));
        }
        let batch = self.max_batch(d, c)?;
        let step = self.step_s(batch, d.prompt_tokens, d.reply_tokens, c.decode_step)?;
        let mut i = self.inputs(d, batch);
        i.measured_decode_tokens_per_s = Some(batch as f64 / step);
        let prefill_rate = self.prefill_tokens_per_s()? * c.prefill_rate;
        i.measured_prefill_tokens_per_s = Some(prefill_rate);
        let p = plan(&i)?;
        let u = self.slo.target_utilization;
        let decode_nodes = (p.decode_node_equivalents / u).ceil() as u32;
        let mut prefill_nodes = (p.prefill_node_equivalents / u).ceil() as u32;
        // A turn's own tail must fit the TTFT budget with its queueing: with n nodes at
        // utilisation rho a tail waits about service x rho / (n (1 - rho)) (M/M/n, light
        // traffic), so add nodes while tail + wait exceeds the budget.
        let tail_s = d.prompt_tokens * (1.0 - d.cached_share.clamp(0.0, 1.0)) / prefill_rate;
        let budget = self.slo.ttft_s * self.slo.headroom;
        while prefill_nodes < 100_000 && p.prefill_node_equivalents > 0.0 {
            let n = prefill_nodes.max(1) as f64;
            let rho = p.prefill_node_equivalents / n;
            if rho < 1.0 && tail_s * (1.0 + rho / (n * (1.0 - rho))) <= budget {
                break;
            }
            prefill_nodes += 1;
        }
        Ok(Need {
            decode_nodes,
            prefill_nodes,
            decode_busy: p.decode_node_equivalents,
            prefill_busy: p.prefill_node_equivalents,
            max_batch: batch,
            step_s: step,
            prefill_tokens_per_s: prefill_rate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn seed_model() -> CostModel {
        CostModel::new(
            Inputs::seed(),
            Slo {
                ttft_s: 1.0,
                itl_s: 0.01275 / 0.9,
                headroom: 0.9,
                target_utilization: 0.6,
            },
        )
        .unwrap()
    }

    fn seed_demand() -> Demand {
        Demand {
            turns_per_s: 20_000.0 / 60.0,
            prompt_tokens: 3_000.0,
            reply_tokens: 400.0,
            cached_share: 0.8,
        }
    }

    #[test]
    fn seed_workload_gives_the_seed_split() {
        // With an ITL budget of the seed's step at batch 256 (12.74 ms, printed as 12.7),
        // the batch is the seed's 256 and the busy split its 6.6 + 4.5 node-equivalents.
        let m = seed_model();
        let n = m.need(&seed_demand(), &Corrections::default()).unwrap();
        assert_eq!(n.max_batch, 256);
        assert_eq!(format!("{:.1}", n.decode_busy), "6.6");
        assert_eq!(format!("{:.1}", n.prefill_busy), "4.5");
        // 6.6 / 0.6 -> 12 and 4.46 / 0.6 -> 8: the seed's 20 nodes less its 1 spare, split.
        assert_eq!((n.decode_nodes, n.prefill_nodes), (12, 8));
    }

    #[test]
    fn slower_measured_steps_need_more_decode_nodes() {
        let m = seed_model();
        let d = seed_demand();
        let base = m.need(&d, &Corrections::default()).unwrap();
        let slow = m
            .need(
                &d,
                &Corrections {
                    decode_step: 1.3,
                    prefill_rate: 0.5,
                },
            )
            .unwrap();
        assert!(slow.max_batch < base.max_batch);
        assert!(slow.decode_nodes > base.decode_nodes);
        assert!((slow.prefill_busy - 2.0 * base.prefill_busy).abs() < 1e-9);
        assert_eq!(slow.prefill_nodes, (slow.prefill_busy / 0.6).ceil() as u32);
        let idle = m
            .need(
                &Demand {
                    turns_per_s: 0.0,
                    ..d
                },
                &Corrections::default(),
            )
            .unwrap();
        assert_eq!((idle.decode_nodes, idle.prefill_nodes), (0, 0));
        assert!(m
            .need(
                &Demand {
                    turns_per_s: f64::NAN,
                    ..d
                },
                &Corrections::default()
            )
            .is_err());
    }
}
