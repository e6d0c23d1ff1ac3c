//! The planner's decisions as Prometheus series, for `baton plan --metrics-listen` and
//! `baton up --autoscale`: the targets an external autoscaler (an HPA through
//! prometheus-adapter, or KEDA) scales the pools to, the nodes ready beside them, and how
//! often each reason decided a pool.
//!
//! Every label value comes from a fixed set (`pool`: the two pools; `reason`:
//! [`REASON_KINDS`]), so the series are bounded whatever the cluster does. The exposition
//! is written here rather than through a recorder: the planner holds a handful of values,
//! all replaced at once per decision.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{Decision, Pool, REASON_KINDS};

/// Replicas the planner wants per pool (`pool`).
pub const TARGET_NODES: &str = "baton_planner_target_nodes";
/// Nodes ready per pool when the planner decided (`pool`).
pub const READY_NODES: &str = "baton_planner_ready_nodes";
/// Reasons behind the pools' targets, by pool and reason (`pool`, `reason`).
pub const REASONS_TOTAL: &str = "baton_planner_reasons_total";
/// Decisions taken.
pub const DECISIONS_TOTAL: &str = "baton_planner_decisions_total";
/// Intervals skipped (the signals could not be read).
pub const SKIPPED_TOTAL: &str = "baton_planner_skipped_intervals_total";
/// Arrival rate the fleet is sized for (the forecast's peak over the horizon).
pub const PLANNED_TURNS: &str = "baton_planner_planned_turns_per_second";
/// Unix time of the last decision.
pub const LAST_DECISION: &str = "baton_planner_last_decision_timestamp_seconds";
/// 1 while this planner holds the Lease and acts, 0 while it stands by.
pub const LEADER: &str = "baton_planner_leader";

const POOLS: [Pool; 2] = [Pool::Prefill, Pool::Decode];

/// The last decision and the counts so far.
#[derive(Debug, Clone, Default)]
pub struct PlannerMetrics {
    last: Option<(Decision, u32, u32, f64)>,
    reasons: BTreeMap<(&'static str, &'static str), u64>,
    decisions: u64,
    skipped: u64,
    leader: Option<bool>,
}

impl PlannerMetrics {
    /// A decision taken at unix time `at` with `ready_prefill` and `ready_decode` nodes.
    pub fn decided(&mut self, d: &Decision, ready_prefill: u32, ready_decode: u32, at: f64) {
        self.decisions += 1;
        for r in &d.reasons {
            // Reason kinds are the planner's own constants; anything else is not counted.
            if let Some(k) = REASON_KINDS.iter().find(|k| **k == r.kind) {
                *self.reasons.entry((r.pool.label(), k)).or_default() += 1;
            }
        }
        self.last = Some((d.clone(), ready_prefill, ready_decode, at));
    }

    pub fn skipped(&mut self) {
        self.skipped += 1;
    }

    /// Whether this replica leads (`None`: no election, the series is absent).
    pub fn set_leader(&mut self, leader: Option<bool>) {
        self.leader = leader;
    }

    /// The last decision, if any.
    pub fn last(&self) -> Option<&Decision> {
        self.last.as_ref().map(|l| &l.0)
    }

    /// Prometheus text exposition (version 0.0.4).
    pub fn render(&self) -> String {
        let mut o = String::new();
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        if let Some((d, rp, rd, at)) = &self.last {
            head(&mut o, TARGET_NODES, "gauge", "Replicas the planner wants per pool.");
            for p in POOLS {
                let _ = writeln!(o, "{TARGET_NODES}{{pool=\"{}\"}} {}", p.label(), d.target(p));
            }
            head(&mut o, READY_NODES, "gauge", "Nodes ready per pool at the last decision.");
            for (p, n) in [(Pool::Prefill, rp), (Pool::Decode, rd)] {
                let _ = writeln!(o, "{READY_NODES}{{pool=\"{}\"}} {n}", p.label());
            }
            head(&mut o, PLANNED_TURNS, "gauge", "Arrival rate the fleet is sized for.");
            let _ = writeln!(o, "{PLANNED_TURNS} {}", d.planned_turns_per_s);
            head(&mut o, LAST_DECISION, "gauge", "Unix time of the last decision.");
            let _ = writeln!(o, "{LAST_DECISION} {at}");
        }
        head(&mut o, REASONS_TOTAL, "counter", "Reasons behind the pools' targets.");
        for p in POOLS {
            for k in REASON_KINDS {
                let n = self.reasons.get(&(p.label(), k)).copied().unwrap_or(0);
                let _ = writeln!(o, "{REASONS_TOTAL}{{pool=\"{}\",reason=\"{k}\"}} {n}", p.label());
            }
        }
        head(&mut o, DECISIONS_TOTAL, "counter", "Decisions taken.");
        let _ = writeln!(o, "{DECISIONS_TOTAL} {}", self.decisions);
        head(&mut o, SKIPPED_TOTAL, "counter", "Intervals skipped: the signals could not be read.");
        let _ = writeln!(o, "{SKIPPED_TOTAL} {}", self.skipped);
        if let Some(l) = self.leader {
            head(&mut o, LEADER, "gauge", "1 while this planner holds the Lease and acts, 0 while it stands by.");
            let _ = writeln!(o, "{LEADER} {}", u8::from(l));
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{Corrections, Need, Reason};

    #[test]
    fn series_are_bounded_and_carry_the_targets() {
        let need = Need { decode_nodes: 2, prefill_nodes: 1, decode_busy: 1.0, prefill_busy: 0.5, max_batch: 8, step_s: 0.01, prefill_tokens_per_s: 1e4 };
        let d = Decision {
            t_s: 1.0,
            prefill: 2,
            decode: 3,
            planned_turns_per_s: 1.5,
            need,
            corrections: Corrections::default(),
            reasons: vec![
                Reason { pool: Pool::Decode, kind: "itl", text: "why".into() },
                Reason { pool: Pool::Decode, kind: "not-a-kind", text: "why".into() },
            ],
        };
        let mut m = PlannerMetrics::default();
        assert!(!m.render().contains(TARGET_NODES), "no targets before a decision");
        m.decided(&d, 1, 2, 1700000000.0);
        m.decided(&d, 1, 2, 1700000030.0);
        assert!(!m.render().contains(LEADER), "no election, no leader series");
        m.set_leader(Some(true));
        let text = m.render();
        assert!(text.contains("baton_planner_target_nodes{pool=\"decode\"} 3"), "{text}");
        assert!(text.contains("baton_planner_target_nodes{pool=\"prefill\"} 2"));
        assert!(text.contains("baton_planner_ready_nodes{pool=\"decode\"} 2"));
        assert!(text.contains("baton_planner_reasons_total{pool=\"decode\",reason=\"itl\"} 2"));
        assert!(text.contains("baton_planner_decisions_total 2"));
        assert!(text.contains("baton_planner_leader 1"));
        assert!(!text.contains("not-a-kind"));
        // Every sample line's labels come from the fixed sets: 2 pools x 10 reasons.
        let reason_lines = text.lines().filter(|l| l.starts_with(REASONS_TOTAL)).count();
        assert_eq!(reason_lines, 2 * REASON_KINDS.len());
    }
}
