//! What one engine step costs, learned from the engine's own steps, and the prefill
//! budget that cost implies under an inter-token latency (ITL) target.
//!
//! The model is linear in what a step computes:
//!
//! ```text
//! seconds ≈ a + b·decode_rows + c·prefill_tokens + d·attended_ktokens
//! ```
//!
//! `a` is the fixed cost (weights streamed once per step), `b` a decode row (its body
//! rows plus the output projection and sampling every decode row pays), `c` a prefill
//! token (body rows only: a chunk asks for logits once), `d` attention per thousand
//! attended positions summed over all rows (it grows with the context, the rest does
//! not).
//!
//! [`CostModel`] fits it by least squares over the last [`WINDOW`] steps, with two
//! guards:
//! - a ridge pull toward a prior worth about one step, so a coefficient the recent
//!   steps cannot pin down (no prefill seen yet, every step the same size) stays near
//!   the prior instead of swinging to any value that fits;
//! - Huber reweighting (a few rounds): steps far off the fit (a foreign process took
//!   the core, a page fault) count for little.
//!
//! Coefficients are clamped at zero (a negative cost would promise an unbounded
//! budget). Pure and deterministic: the same observations give the same fit; time
//! comes in as arguments, never read here.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Steps the fit looks back over: a few seconds of work, so the model follows a change
/// of load (another process on the cores) within seconds.
pub(crate) const WINDOW: usize = 256;

/// How many robust standard deviations of step time the budget keeps below the
/// target: the SLO judges a turn by its p95 gap, so a step planned at the target on
/// average would miss it half the time. 1.645 is the one-sided 95% point of a normal.
const SPREAD_Z: f64 = 1.645;

/// Weight of the prior, in steps of typical size.
const PRIOR_STEPS: f64 = 1.0;

/// A typical magnitude of each feature, to scale the prior's pull per coefficient.
const TYPICAL: [f64; 4] = [1.0, 8.0, 64.0, 4.0];

/// Huber's tuning constant (95% efficiency under normal noise).
const HUBER_K: f64 = 1.345;

/// Scatter below this share of the median step time is never down-weighted.
const NOISE_SHARE: f64 = 0.02;

/// Reweighting rounds after the plain fit: enough for the weights to settle on the
/// steps a stall stretched.
const HUBER_ROUNDS: usize = 3;

/// What one step computed, as the model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct StepShape {
    /// Rows that sampled a new token of a running stream.
    pub decode_rows: usize,
    /// Prompt (or recomputed) tokens in prefill chunks.
    pub prefill_tokens: usize,
    /// Positions attended, summed over every row of the step.
    pub attended: usize,
}

impl StepShape {
    fn features(&self) -> [f64; 4] {
        [1.0, self.decode_rows as f64, self.prefill_tokens as f64, self.attended as f64 / 1000.0]
    }
}

/// The four coefficients, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    /// Per step.
    pub fixed: f64,
    /// Per decode row.
    pub decode_row: f64,
    /// Per prefill token.
    pub prefill_token: f64,
    /// Per thousand attended positions.
    pub attended_kilotoken: f64,
}

impl StepCost {
    /// A CPU engine of a small model on a couple of cores: deliberately on the slow
    /// side, so the first steps (before any measurement) plan small chunks rather
    /// than break running streams. The fit replaces it within a few steps.
    pub const PRIOR: StepCost = StepCost { fixed: 0.005, decode_row: 0.001, prefill_token: 0.0008, attended_kilotoken: 0.0003 };

    fn as_array(&self) -> [f64; 4] {
        [self.fixed, self.decode_row, self.prefill_token, self.attended_kilotoken]
    }

    fn from_array(t: [f64; 4]) -> StepCost {
        StepCost { fixed: t[0], decode_row: t[1], prefill_token: t[2], attended_kilotoken: t[3] }
    }

    /// Predicted seconds of a step of `shape`.
    pub(crate) fn predict(&self, shape: StepShape) -> f64 {
        dot(&self.as_array(), &shape.features())
    }
}

fn dot(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The step cost model, fitted online (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct CostModel {
    prior: StepCost,
    steps: VecDeque<(StepShape, f64)>,
    fit: StepCost,
    /// Robust standard deviation of the measured around the fitted step times.
    spread: f64,
}

impl CostModel {
    pub fn new(prior: StepCost) -> Self {
        CostModel { prior, steps: VecDeque::with_capacity(WINDOW), fit: prior, spread: 0.0 }
    }

    /// The coefficients as fitted so far (the prior before any step).
    pub fn cost(&self) -> StepCost {
        self.fit
    }

    /// Robust standard deviation of step times around the fit, seconds.
    #[cfg(test)]
    pub fn spread(&self) -> f64 {
        self.spread
    }

    /// Predicted seconds of a step of `shape`.
    pub fn predict(&self, shape: StepShape) -> f64 {
        self.fit.predict(shape)
    }

    /// Records that a step of `shape` took `seconds`, and refits. Non-finite or
    /// negative times (a clock that jumped) are ignored.
    pub fn observe(&mut self, shape: StepShape, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        if self.steps.len() == WINDOW {
            self.steps.pop_front();
        }
        self.steps.push_back((shape, seconds));
        self.refit();
    }

    fn refit(&mut self) {
        let residuals = |fit: &StepCost| -> Vec<f64> { self.steps.iter().map(|(s, y)| y - fit.predict(*s)).collect() };
        let mut fit = self.solve(&vec![1.0; self.steps.len()]);
        let mut r = residuals(&fit);
        // A few rounds of iteratively reweighted least squares under Huber's loss:
        // each round's residuals set the next round's weights.
        // Scatter within a per cent or two of a typical step is timer noise, not a stall:
        // it is fitted as is.
        let mut times: Vec<f64> = self.steps.iter().map(|&(_, y)| y).collect();
        let noise = NOISE_SHARE * median(&mut times);
        for _ in 0..HUBER_ROUNDS {
            let scale = robust_scale(&r).max(noise);
            if scale <= 0.0 {
                // Every step on the fit (or a single step): nothing to down-weight.
                break;
            }
            let cut = HUBER_K * scale;
            let weights: Vec<f64> = r.iter().map(|r| if r.abs() <= cut { 1.0 } else { cut / r.abs() }).collect();
            fit = self.solve(&weights);
            r = residuals(&fit);
        }
        self.spread = robust_scale(&r);
        self.fit = fit;
    }

    /// Weighted ridge least squares toward the prior, one weight per kept step.
    fn solve(&self, weights: &[f64]) -> StepCost {
        let prior = self.prior.as_array();
        let mut m = [[0.0f64; 4]; 4];
        let mut v = [0.0f64; 4];
        for j in 0..4 {
            let lambda = PRIOR_STEPS * TYPICAL[j] * TYPICAL[j];
            m[j][j] += lambda;
            v[j] += lambda * prior[j];
        }
        for ((shape, y), w) in self.steps.iter().zip(weights) {
            let x = shape.features();
            for i in 0..4 {
                v[i] += w * x[i] * y;
                for j in 0..4 {
                    m[i][j] += w * x[i] * x[j];
                }
            }
        }
        // No coefficient may go negative, and clamping one after the fact would leave
        // the others fitted around it (collinear features: a too-large one beside a
        // negative one), so predictions would be biased. Instead a negative one is
        // held at zero and the rest refitted without it.
        let mut free = [true; 4];
        loop {
            let t = solve_at_zero(m, v, &free).unwrap_or(prior);
            let negative = (0..4).filter(|&j| free[j] && (t[j].is_nan() || t[j] < 0.0)).min_by(|&a, &b| t[a].total_cmp(&t[b]));
            match negative {
                Some(j) => free[j] = false,
                None => return StepCost::from_array(t),
            }
        }
    }

    /// The most prefill tokens (at most `cap`) a step may add beside `decode_rows`
    /// decode rows attending `decode_attended` positions in all, when each prefill
    /// token attends about `prefill_context` positions, so that the predicted step
    /// time plus [`SPREAD_Z`] spreads stays within `target`. 0 when the decode rows
    /// alone are predicted over it.
    pub fn prefill_budget(&self, target: Duration, decode_rows: usize, decode_attended: usize, prefill_context: usize, cap: usize) -> usize {
        let base = self.predict(StepShape { decode_rows, prefill_tokens: 0, attended: decode_attended });
        let room = target.as_secs_f64() - base - SPREAD_Z * self.spread;
        if room <= 0.0 {
            return 0;
        }
        let per_token = self.fit.prefill_token + self.fit.attended_kilotoken * prefill_context as f64 / 1000.0;
        if per_token <= 0.0 {
            return cap;
        }
        let n = (room / per_token).floor();
        if n >= cap as f64 {
            cap
        } else {
            n as usize
        }
    }
}

/// 1.4826 x the median absolute residual: the standard deviation of normal noise,
/// unmoved by a few wild values.
fn robust_scale(residuals: &[f64]) -> f64 {
    let mut abs: Vec<f64> = residuals.iter().map(|r| r.abs()).collect();
    1.4826 * median(&mut abs)
}

/// Median of `xs` (reordered); 0 for none.
fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Solves `m x = v` with `x[j] = 0` for every `j` not `free` (their columns and rows
/// taken out of the system). Indexed like the algebra it does.
#[allow(clippy::needless_range_loop)]
fn solve_at_zero(mut m: [[f64; 4]; 4], mut v: [f64; 4], free: &[bool; 4]) -> Option<[f64; 4]> {
    for j in (0..4).filter(|&j| !free[j]) {
        for i in 0..4 {
            m[i][j] = 0.0;
            m[j][i] = 0.0;
        }
        m[j][j] = 1.0;
        v[j] = 0.0;
    }
    solve4(m, v)
}

/// Solves `m x = v` by Gaussian elimination with partial pivoting; `None` when `m` is
/// singular (the ridge term keeps it from being so in practice). Indexed like the algebra.
#[allow(clippy::needless_range_loop)]
fn solve4(mut m: [[f64; 4]; 4], mut v: [f64; 4]) -> Option<[f64; 4]> {
    for col in 0..4 {
        let pivot = (col..4).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-300 {
            return None;
        }
        m.swap(col, pivot);
        v.swap(col, pivot);
        for row in col + 1..4 {
            let f = m[row][col] / m[col][col];
            for k in col..4 {
                m[row][k] -= f * m[col][k];
            }
            v[row] -= f * v[col];
        }
    }
    let mut x = [0.0; 4];
    for row in (0..4).rev() {
        let s: f64 = (row + 1..4).map(|k| m[row][k] * x[k]).sum();
        x[row] = (v[row] - s) / m[row][row];
    }
    Some(x)
}

/// Measured times of recent steps that carried decode rows, over a sliding period:
/// their p95 is what a running stream's inter-token gaps look like now, and what a
/// node reports to the coordinator as its ITL standing.
#[derive(Clone, Debug)]
pub(crate) struct RecentSteps {
    period: Duration,
    steps: VecDeque<(Instant, f64)>,
}

impl RecentSteps {
    pub fn new(period: Duration) -> Self {
        RecentSteps { period, steps: VecDeque::new() }
    }

    /// A decode step ended at `at` after `seconds`.
    pub fn push(&mut self, at: Instant, seconds: f64) {
        self.steps.push_back((at, seconds));
        self.expire(at);
    }

    /// Forgets steps older than the period before `now`.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&(t, _)) = self.steps.front() {
            if now.saturating_duration_since(t) > self.period {
                self.steps.pop_front();
            } else {
                break;
            }
        }
    }

    /// The 95th percentile (nearest rank) of the kept step times; 0 for none.
    pub fn p95(&self) -> f64 {
        if self.steps.is_empty() {
            return 0.0;
        }
        let mut xs: Vec<f64> = self.steps.iter().map(|&(_, s)| s).collect();
        xs.sort_by(f64::total_cmp);
        let rank = (0.95 * xs.len() as f64).ceil() as usize;
        xs[rank.clamp(1, xs.len()) - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUE: StepCost = StepCost { fixed: 0.004, decode_row: 0.0006, prefill_token: 0.0004, attended_kilotoken: 0.0002 };

    /// A deterministic spread of step shapes: decode-only, prefill-only and mixed.
    fn shapes(n: usize) -> Vec<StepShape> {
        (0..n)
            .map(|i| {
                let decode_rows = (i * 7) % 24;
                let prefill_tokens = if i % 3 == 0 { 0 } else { (i * 37) % 300 };
                let attended = decode_rows * (200 + (i * 13) % 500) + prefill_tokens * (100 + (i * 11) % 400);
                StepShape { decode_rows, prefill_tokens, attended }
            })
            .collect()
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    #[test]
    fn before_any_step_the_prior_is_the_fit() {
        let m = CostModel::new(StepCost::PRIOR);
        assert_eq!(m.cost(), StepCost::PRIOR);
        assert_eq!(m.spread(), 0.0);
    }

    #[test]
    fn exact_timings_recover_the_true_coefficients() {
        let mut m = CostModel::new(StepCost::PRIOR);
        for s in shapes(WINDOW) {
            m.observe(s, TRUE.predict(s));
        }
        let c = m.cost();
        // The prior's pull is worth a step out of 256, but the four features move
        // together (attention grows with the rows), so it can shift one coefficient
        // against another by a few per cent; the predictions stay within 3%.
        assert!(close(c.fixed, TRUE.fixed, 0.1), "{c:?}");
        assert!(close(c.decode_row, TRUE.decode_row, 0.1), "{c:?}");
        assert!(close(c.prefill_token, TRUE.prefill_token, 0.1), "{c:?}");
        assert!(close(c.attended_kilotoken, TRUE.attended_kilotoken, 0.1), "{c:?}");
        for s in shapes(50) {
            assert!(close(m.predict(s), TRUE.predict(s), 0.03), "{s:?}: {} vs {}", m.predict(s), TRUE.predict(s));
        }
    }

    #[test]
    fn stalled_steps_barely_move_the_fit() {
        // One step in ten took 20x as long (another process had the core).
        let mut clean = CostModel::new(StepCost::PRIOR);
        let mut noisy = CostModel::new(StepCost::PRIOR);
        for (i, s) in shapes(WINDOW).into_iter().enumerate() {
            clean.observe(s, TRUE.predict(s));
            noisy.observe(s, if i % 10 == 0 { 20.0 * TRUE.predict(s) } else { TRUE.predict(s) });
        }
        let probe = StepShape { decode_rows: 16, prefill_tokens: 64, attended: 16 * 400 + 64 * 300 };
        let (c, n) = (clean.predict(probe), noisy.predict(probe));
        // Plain least squares would predict about 3x the clean time here.
        assert!(close(n, c, 0.25), "noisy {n} vs clean {c}");
    }

    #[test]
    fn a_coefficient_the_steps_cannot_determine_stays_at_the_prior() {
        // Decode-only steps say nothing about the cost of a prefill token.
        let mut m = CostModel::new(StepCost::PRIOR);
        for s in shapes(WINDOW) {
            let s = StepShape { prefill_tokens: 0, attended: s.decode_rows * 300, ..s };
            m.observe(s, TRUE.predict(s));
        }
        assert!(close(m.cost().prefill_token, StepCost::PRIOR.prefill_token, 1e-9), "{:?}", m.cost());
    }

    #[test]
    fn the_fit_follows_a_change_of_speed_within_the_window() {
        let slow = StepCost { fixed: 2.0 * TRUE.fixed, decode_row: 2.0 * TRUE.decode_row, prefill_token: 2.0 * TRUE.prefill_token, attended_kilotoken: 2.0 * TRUE.attended_kilotoken };
        let mut m = CostModel::new(StepCost::PRIOR);
        for s in shapes(WINDOW) {
            m.observe(s, TRUE.predict(s));
        }
        for s in shapes(WINDOW) {
            m.observe(s, slow.predict(s));
        }
        let probe = StepShape { decode_rows: 8, prefill_tokens: 100, attended: 8 * 300 + 100 * 200 };
        assert!(close(m.predict(probe), slow.predict(probe), 0.05));
    }

    #[test]
    fn bad_times_are_ignored_and_coefficients_never_go_negative() {
        let mut m = CostModel::new(StepCost::PRIOR);
        m.observe(StepShape { decode_rows: 1, prefill_tokens: 0, attended: 10 }, f64::NAN);
        m.observe(StepShape { decode_rows: 1, prefill_tokens: 0, attended: 10 }, -1.0);
        assert_eq!(m.cost(), StepCost::PRIOR);
        // Bigger steps measured faster than small ones: a fit would go negative.
        for i in 0..100 {
            m.observe(StepShape { decode_rows: i % 10, prefill_tokens: i % 7 * 50, attended: i * 100 }, 0.05 - 0.0001 * i as f64);
        }
        let c = m.cost();
        for x in [c.fixed, c.decode_row, c.prefill_token, c.attended_kilotoken] {
            assert!(x >= 0.0, "{c:?}");
        }
    }

    #[test]
    fn a_coefficient_held_at_zero_leaves_the_others_fitted_without_bias() {
        // Big prefill chunks cost more than linearly (caches overflow): the best line
        // through these steps has a negative fixed cost. Clamping it to zero after
        // the fit would leave the other coefficients fitted around the negative value,
        // and every prediction too high.
        let time = |s: &StepShape| 0.003 * s.decode_rows as f64 + 2e-6 * (s.prefill_tokens * s.prefill_tokens) as f64;
        let mut m = CostModel::new(StepCost::PRIOR);
        for s in shapes(WINDOW) {
            m.observe(s, time(&s));
        }
        let measured: f64 = shapes(WINDOW).iter().map(time).sum();
        let predicted: f64 = shapes(WINDOW).into_iter().map(|s| m.predict(s)).sum();
        let c = m.cost();
        assert_eq!(c.fixed, 0.0, "{c:?}");
        assert!(close(predicted, measured, 0.05), "predicted {predicted} s for steps that took {measured} s: {c:?}");
    }

    #[test]
    fn the_budget_fills_the_target_and_no_more() {
        let mut m = CostModel::new(StepCost::PRIOR);
        for s in shapes(WINDOW) {
            m.observe(s, TRUE.predict(s));
        }
        let target = Duration::from_millis(50);
        let (rows, attended, ctx) = (16, 16 * 400, 300);
        let n = m.prefill_budget(target, rows, attended, ctx, 10_000);
        assert!(n > 0);
        let at = |n: usize| m.predict(StepShape { decode_rows: rows, prefill_tokens: n, attended: attended + n * ctx }) + SPREAD_Z * m.spread();
        assert!(at(n) <= 0.050 + 1e-9, "{n} tokens predicted at {}", at(n));
        assert!(at(n + 1) > 0.050, "{} tokens would still fit", n + 1);
        // The chunk cap bounds it; decode rows alone over the target leave nothing.
        assert_eq!(m.prefill_budget(target, rows, attended, ctx, 10), 10);
        assert_eq!(m.prefill_budget(Duration::from_millis(5), rows, attended, ctx, 10_000), 0);
        assert_eq!(m.prefill_budget(target, 200, 200 * 400, ctx, 10_000), 0);
    }

    #[test]
    fn noisy_steps_leave_a_margin_below_the_target() {
        let mut quiet = CostModel::new(StepCost::PRIOR);
        let mut noisy = CostModel::new(StepCost::PRIOR);
        for (i, s) in shapes(WINDOW).into_iter().enumerate() {
            quiet.observe(s, TRUE.predict(s));
            // +-3 ms of jitter around the true time.
            let jitter = [-0.003, 0.003, 0.0, 0.002, -0.002][i % 5];
            noisy.observe(s, TRUE.predict(s) + jitter);
        }
        assert!(noisy.spread() > 0.001, "{}", noisy.spread());
        let t = Duration::from_millis(50);
        assert!(noisy.prefill_budget(t, 8, 8 * 300, 300, 10_000) < quiet.prefill_budget(t, 8, 8 * 300, 300, 10_000));
    }

    #[test]
    fn recent_steps_report_their_p95_and_forget_old_ones() {
        let t0 = Instant::now();
        let mut r = RecentSteps::new(Duration::from_secs(5));
        assert_eq!(r.p95(), 0.0);
        for i in 1..=100 {
            r.push(t0 + Duration::from_millis(i), i as f64 / 1000.0);
        }
        assert_eq!(r.p95(), 0.095);
        r.push(t0 + Duration::from_millis(5_050), 0.010);
        assert_eq!(r.steps.len(), 52, "the steps more than 5 s old are gone");
        r.expire(t0 + Duration::from_secs(60));
        assert_eq!(r.p95(), 0.0);
    }
}
