//! The planner's unit and property tests: reasons name the breach, scale-up is immediate,
//! scale-down waits and steps, the floor holds, measurements correct the model.

use proptest::prelude::*;

use super::*;
use crate::capacity::Inputs;

fn config() -> PlannerConfig {
    PlannerConfig {
        cost: CostModel::new(
            Inputs::seed(),
            Slo {
                ttft_s: 1.0,
                itl_s: 0.015,
                headroom: 0.9,
                target_utilization: 0.6,
            },
        )
        .unwrap(),
        prefill: PoolLimits {
            min: 1,
            max: 64,
            spare: 1,
        },
        decode: PoolLimits {
            min: 1,
            max: 64,
            spare: 1,
        },
        interval_s: 30.0,
        load_time_s: 300.0,
        scale_down_delay_s: 600.0,
        scale_down_step: 0.1,
        queue_per_node: 8.0,
        kv_high: 0.9,
        batch_high: None,
        correction_alpha: 0.2,
        forecast_alpha: 0.3,
        forecast_beta: 0.05,
        shape: None,
        predict: true,
    }
}

fn signals(t: f64, rate: f64) -> Signals {
    Signals {
        t_s: t,
        arrival_turns_per_s: rate,
        prompt_tokens_mean: 3_000.0,
        reply_tokens_mean: 400.0,
        cached_share: 0.8,
        ready_prefill: 4,
        ready_decode: 6,
        ..Signals::default()
    }
}

#[test]
fn itl_breach_adds_decode_nodes_with_its_reason() {
    let mut p = Planner::new(config()).unwrap();
    let quiet = p.step(&signals(0.0, 10.0)).unwrap();
    let mut s = signals(30.0, 10.0);
    s.itl_p95_s = Some(0.046);
    s.ready_decode = quiet.decode;
    let d = p.step(&s).unwrap();
    // 46 ms over a 13.5 ms budget: 3.4x the ready nodes.
    assert!(
        d.decode >= (quiet.decode as f64 * 0.046 / 0.0135).ceil() as u32,
        "{d:?}"
    );
    let why = d.reasons.iter().find(|r| r.kind == "itl").unwrap();
    assert_eq!(why.text, "why: decode ITL p95 46 ms > 0.9 x target 15 ms");
    assert!(d.explain().contains("decode -> "));
    // The prefill pool is not touched by a decode breach.
    assert_eq!(d.prefill, quiet.prefill);
}

#[test]
fn batch_above_the_measured_high_adds_decode_nodes_and_labels_are_known() {
    let mut cfg = config();
    cfg.batch_high = Some(2.0);
    cfg.decode.spare = 0;
    let mut p = Planner::new(cfg).unwrap();
    let mut s = signals(0.0, 0.001);
    s.ready_decode = 1;
    s.decode_batch_mean = Some(2.0);
    let d = p.step(&s).unwrap();
    assert!(d.reasons.iter().all(|r| r.kind != "batch"), "at the high, no breach: {d:?}");
    s.t_s = 30.0;
    s.decode_batch_mean = Some(5.0);
    let d = p.step(&s).unwrap();
    // 5 per node on 1 node over a high of 2: 3 nodes.
    assert_eq!(d.decode, 3, "{d:?}");
    let why = d.reasons.iter().find(|r| r.kind == "batch").unwrap();
    assert_eq!(why.text, "why: decode batch 5.0 on 1 node(s) = 5.0 per node; 3 keep it within 2 per node");
    // The measured batch holds the pool after the breach: 5 over 3 nodes still needs 3.
    s.t_s = 60.0;
    s.ready_decode = 3;
    s.decode_batch_mean = Some(5.0 / 3.0);
    assert_eq!(p.step(&s).unwrap().decode, 3);
    for r in &d.reasons {
        assert!(REASON_KINDS.contains(&r.kind), "{} is not in REASON_KINDS", r.kind);
    }
    let mut bad = config();
    bad.batch_high = Some(0.0);
    assert!(Planner::new(bad).is_err());
}

#[test]
fn ttft_and_queue_breaches_add_prefill_nodes() {
    let mut p = Planner::new(config()).unwrap();
    let mut s = signals(0.0, 10.0);
    s.ttft_p95_s = Some(2.0);
    let d = p.step(&s).unwrap();
    assert!(d.prefill >= 5, "{d:?}");
    assert!(d
        .reasons
        .iter()
        .any(|r| r.text == "why: TTFT p95 2000 ms > 0.9 x target 1000 ms"));
    let mut s = signals(30.0, 10.0);
    s.prefill_queue_turns = 400.0;
    let d = p.step(&s).unwrap();
    assert_eq!(d.prefill, 50);
    assert!(d.reasons.iter().any(|r| r.kind == "queue"));
    let mut s = signals(60.0, 10.0);
    s.kv_occupancy = 0.95;
    let d = p.step(&s).unwrap();
    assert!(d.decode >= 7 && d.reasons.iter().any(|r| r.kind == "kv"));
}

#[test]
fn scale_down_waits_for_the_delay_then_steps() {
    let mut p = Planner::new(config()).unwrap();
    let high = p.step(&signals(0.0, 333.0)).unwrap();
    assert!(high.decode >= 12 && high.prefill >= 8, "{high:?}");
    let mut last = high.clone();
    let mut first_drop = None;
    for k in 1..80 {
        let t = k as f64 * 30.0;
        let d = p.step(&signals(t, 20.0)).unwrap();
        assert!(d.decode <= last.decode);
        if d.decode < last.decode {
            first_drop.get_or_insert(t);
            // At most 10% of the pool (at least one node) per interval.
            let shed = last.decode - d.decode;
            assert!(shed <= ((last.decode as f64 * 0.1) as u32).max(1), "{shed}");
            assert!(d.reasons.iter().any(|r| r.kind == "scale_down"));
        } else if d.decode > 2 && first_drop.is_none() {
            assert!(
                d.reasons.iter().any(|r| r.kind == "hold"),
                "{:?}",
                d.reasons
            );
        }
        last = d;
    }
    // The smoothed rate falls for a few intervals, then the delay runs: no shed before
    // 600 s after the first interval that wanted less.
    let t = first_drop.unwrap();
    assert!(t >= 630.0, "shed at {t}");
    assert!(last.decode < high.decode / 2);
    // A rise cancels the wait and applies at once (as far as the smoothed rate has risen).
    let d = p.step(&signals(80.0 * 30.0, 333.0)).unwrap();
    assert!(d.decode > last.decode);
    assert!(!d
        .reasons
        .iter()
        .any(|r| r.kind == "hold" && r.pool == Pool::Decode));
}

#[test]
fn forecast_scales_up_ahead_of_a_ramp() {
    // Traffic ramps 0.2 turns/s per second; the planner sizes for the rate a load time
    // ahead, so at each step its target covers the rate that will arrive 300 s later.
    let mut p = Planner::new(config()).unwrap();
    let cost = p.config().cost.clone();
    let mut ahead = Vec::new();
    for k in 0..60 {
        let t = k as f64 * 30.0;
        let d = p.step(&signals(t, 20.0 + 0.2 * t)).unwrap();
        let later = 20.0 + 0.2 * (t + 300.0);
        let need = cost
            .need(
                &Demand {
                    turns_per_s: later,
                    prompt_tokens: 3_000.0,
                    reply_tokens: 400.0,
                    cached_share: 0.8,
                },
                &Corrections::default(),
            )
            .unwrap();
        ahead.push(d.decode >= need.decode_nodes && d.prefill >= need.prefill_nodes);
    }
    // Holt needs a few minutes to learn the slope; after that it stays ahead.
    let first_late = ahead.iter().rposition(|&a| !a).map_or(0, |i| i + 1);
    assert!(
        first_late <= 20,
        "behind the ramp until interval {first_late}: {ahead:?}"
    );
}

#[test]
fn measured_slowness_corrects_the_model() {
    let mut p = Planner::new(config()).unwrap();
    let cost = p.config().cost.clone();
    let step = cost.step_s(128, 3_000.0, 400.0, 1.0).unwrap();
    let before = p.step(&signals(0.0, 200.0)).unwrap();
    for k in 1..40 {
        let mut s = signals(k as f64 * 30.0, 200.0);
        // The node runs 30% slower than the roofline, and prefill at half its rate.
        s.decode_batch_mean = Some(128.0);
        s.decode_tokens_per_s_per_node = Some(128.0 / (step * 1.3));
        s.prefill_tokens_per_s_busy = Some(cost.prefill_tokens_per_s().unwrap() * 0.5);
        p.step(&s).unwrap();
    }
    let c = p.corrections();
    assert!((c.decode_step - 1.3).abs() < 0.01, "{c:?}");
    assert!((c.prefill_rate - 0.5).abs() < 0.01, "{c:?}");
    let after = p.step(&signals(40.0 * 30.0, 200.0)).unwrap();
    assert!(after.decode > before.decode && after.prefill > before.prefill);
}

#[test]
fn bad_inputs_are_refused() {
    let mut p = Planner::new(config()).unwrap();
    let mut s = signals(0.0, f64::NAN);
    assert!(p.step(&s).is_err());
    s.arrival_turns_per_s = 1.0;
    s.cached_share = 1.5;
    assert!(p.step(&s).is_err());
    s.cached_share = 0.5;
    s.itl_p95_s = Some(-1.0);
    assert!(p.step(&s).is_err());
    let mut c = config();
    c.decode.min = 70;
    assert!(Planner::new(c).is_err());
    let mut c = config();
    c.scale_down_step = 0.0;
    assert!(Planner::new(c).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever arrives, targets stay within [max(min, spare), max], never fall faster
    /// than the step allows, and every decision says why for both pools.
    #[test]
    fn targets_stay_in_bounds_and_fall_slowly(
        rates in prop::collection::vec(0.0f64..2_000.0, 1..60),
        itl in prop::collection::vec(prop::option::of(0.0f64..0.2), 60),
        queue in prop::collection::vec(0.0f64..500.0, 60),
        kv in prop::collection::vec(0.0f64..1.0, 60),
        spare in 0u32..4,
    ) {
        let mut c = config();
        c.decode.spare = spare;
        c.prefill.spare = spare;
        c.decode.min = 0;
        let mut p = Planner::new(c.clone()).unwrap();
        let mut last: Option<Decision> = None;
        for (k, &r) in rates.iter().enumerate() {
            let mut s = signals(k as f64 * 30.0, r);
            s.itl_p95_s = itl[k];
            s.prefill_queue_turns = queue[k];
            s.kv_occupancy = kv[k];
            let d = p.step(&s).unwrap();
            for (pool, l) in [(Pool::Prefill, c.prefill), (Pool::Decode, c.decode)] {
                let n = d.target(pool);
                prop_assert!(n >= l.min.max(l.spare) && n <= l.max, "{pool:?} {n}");
                prop_assert!(d.reasons.iter().any(|x| x.pool == pool && x.text.starts_with("why: ")));
                if let Some(prev) = &last {
                    let before = prev.target(pool);
                    if n < before {
                        prop_assert!(before - n <= ((before as f64 * 0.1) as u32).max(1));
                    }
                }
            }
            last = Some(d);
        }
    }

    /// More traffic never needs fewer nodes (the cost model is monotone).
    #[test]
    fn need_is_monotone_in_rate_and_misses(
        a in 0.0f64..1_000.0, b in 0.0f64..1_000.0, hit_a in 0.0f64..1.0, hit_b in 0.0f64..1.0,
    ) {
        let cost = config().cost;
        let (lo, hi) = (a.min(b), a.max(b));
        let (more_hits, fewer_hits) = (hit_a.max(hit_b), hit_a.min(hit_b));
        let d = |r, h| Demand { turns_per_s: r, prompt_tokens: 3_000.0, reply_tokens: 400.0, cached_share: h };
        let small = cost.need(&d(lo, more_hits), &Corrections::default()).unwrap();
        let big = cost.need(&d(hi, fewer_hits), &Corrections::default()).unwrap();
        prop_assert!(big.decode_nodes >= small.decode_nodes);
        prop_assert!(big.prefill_nodes >= small.prefill_nodes);
    }
}
