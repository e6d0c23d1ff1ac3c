//! The day simulator's cluster: a fluid model, one step per simulated second, of what a
//! disaggregated fleet does with a day of chat traffic, so that a sizing policy can be
//! judged by what its turns see.
//!
//! - **Traffic**: turns arrive Poisson at `peak x shape(t) x (1 + noise)`; the shape has two
//!   daily peaks and averages 40% of its peak (the seed's daily average); the noise is an
//!   AR(1) process (sigma 5%, ten-minute memory) no policy can know from the shape alone.
//! - **Prefill pool**: one FIFO of uncached prompt tokens served at the pool's real rate
//!   (the roofline times `prefill_efficiency`, which the planner has to measure). A turn's
//!   TTFT is the backlog ahead of it, its own tail, an M/M/n queueing term at the pool's
//!   utilisation (Sakasegawa's approximation, taken at 3x its mean as a p95-like bound) and a
//!   fixed KV hand-off.
//! - **Decode pool**: in-flight sequences spread evenly over ready nodes (bounded-load
//!   routing); a step at batch `b` takes the roofline time times `decode_slowdown`; a turn's
//!   ITL is the step time when it starts decoding; a node holds at most its KV room.
//! - **Warm KV**: a turn is warm unless its conversation's prefix was lost: a failed node
//!   loses its share of the open conversations, a joining node takes over its ring share
//!   (those turns start cold once), and a drained node hands its conversations over through
//!   the warm-KV migration (nothing lost). Idle histories beyond the HBM plus host tier of
//!   the ready decode nodes are cold too.
//! - **Nodes**: a started node serves after the model's load time and costs GPU time from
//!   its start; a drained node costs its drain time; a failed node is replaced by the
//!   controller (as a Deployment would) and the replacement loads like any other.
//!
//! It is a model, not a replay: every turn arriving in one second of one class (warm or
//! cold) sees the same TTFT and ITL.

use serde::Serialize;

use crate::planner::{CostModel, Signals};
use crate::rng::Xoshiro256pp;

/// The hardware as it really is (the planner's cost model does not know these).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Truth {
    /// Real decode step time over the roofline's.
    pub decode_slowdown: f64,
    /// Real prefill rate over the roofline's.
    pub prefill_efficiency: f64,
    /// KV hand-off and first-token overhead added to every TTFT, seconds.
    pub handoff_s: f64,
    /// Host-memory tier per decode node as a multiple of its HBM KV room.
    pub host_tier_ratio: f64,
    /// Seconds a drained node keeps costing while its conversations migrate.
    pub drain_s: f64,
}

/// One day's traffic.
#[derive(Debug, Clone, Serialize)]
pub struct DayTraffic {
    pub peak_turns_per_s: f64,
    pub prompt_tokens: f64,
    pub reply_tokens: f64,
    pub turn_gap_s: f64,
    /// Share of prompt tokens cached for a warm turn (history and system prompt) and for a
    /// cold one (system prompt only).
    pub warm_cached_share: f64,
    pub cold_cached_share: f64,
    pub noise_sigma: f64,
    /// Relative rate per minute of the day, peak 1 (without noise).
    pub shape: Vec<f64>,
    pub noise: Vec<f64>,
}

/// Relative rate by minute: a midday and an evening peak, scaled to peak 1 and mean `mean`.
pub fn day_shape(mean: f64) -> Vec<f64> {
    let bump = |h: f64, centre: f64, k: i32| {
        ((1.0 + (2.0 * std::f64::consts::PI * (h - centre) / 24.0).cos()) / 2.0).powi(k)
    };
    let raw: Vec<f64> = (0..1_440)
        .map(|m| {
            let h = m as f64 / 60.0;
            bump(h, 13.5, 2) + 0.8 * bump(h, 20.5, 6)
        })
        .collect();
    let max = raw.iter().copied().fold(0.0, f64::max);
    let mut rel: Vec<f64> = raw.iter().map(|r| r / max).collect();
    let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    // Sharpen the peaks until the raw mean is at most `mean`, so the affine step below only
    // lifts the night (never pushes it below zero).
    while avg(&rel) > mean {
        rel.iter_mut().for_each(|x| *x = x.powf(1.1));
    }
    let raw_mean = avg(&rel);
    // 1 - a (1 - x) keeps the peak at 1 and moves the mean to `mean`.
    let a = (1.0 - mean) / (1.0 - raw_mean);
    rel.iter().map(|x| (1.0 - a * (1.0 - x)).max(0.0)).collect()
}

impl DayTraffic {
    pub fn new(peak: f64, mean_share: f64, noise_sigma: f64, seed: u64) -> Self {
        let mut rng = Xoshiro256pp::seed_from_u64(seed ^ 0x6461_795f_6e6f_6973);
        // AR(1) per second with a 600 s memory, stationary sigma `noise_sigma`.
        let phi: f64 = (-1.0f64 / 600.0).exp();
        let mut x = 0.0;
        let noise = (0..86_400)
            .map(|_| {
                x = phi * x + noise_sigma * (1.0 - phi * phi).sqrt() * normal(&mut rng);
                x
            })
            .collect();
        Self {
            peak_turns_per_s: peak,
            prompt_tokens: 3_000.0,
            reply_tokens: 400.0,
            turn_gap_s: 60.0,
            warm_cached_share: 0.8,
            cold_cached_share: 0.5,
            noise_sigma,
            shape: day_shape(mean_share),
            noise,
        }
    }

    /// The expected shape at second `t` of the day (no noise).
    pub fn shape_at(&self, t: f64) -> f64 {
        let m = t.rem_euclid(86_400.0) / 60.0;
        let i = m.floor() as usize % 1_440;
        let f = m - m.floor();
        self.shape[i] * (1.0 - f) + self.shape[(i + 1) % 1_440] * f
    }

    /// The day's highest arrival intensity.
    pub fn peak(&self) -> f64 {
        (0..86_400).map(|s| self.rate(s as f64)).fold(0.0, f64::max)
    }

    /// The day's mean arrival intensity.
    pub fn mean(&self) -> f64 {
        (0..86_400).map(|s| self.rate(s as f64)).sum::<f64>() / 86_400.0
    }

    /// The arrival intensity at second `t` (what an oracle knows).
    pub fn rate(&self, t: f64) -> f64 {
        let i = (t.max(0.0) as usize).min(86_399);
        (self.peak_turns_per_s * self.shape_at(t) * (1.0 + self.noise[i])).max(0.0)
    }
}

/// A standard normal deviate (Box-Muller).
pub fn normal(rng: &mut Xoshiro256pp) -> f64 {
    let u = 1.0 - rng.next_f64();
    let v = rng.next_f64();
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// A Poisson deviate: exact (Knuth) for small means, normal approximation above 30.
pub fn poisson(rng: &mut Xoshiro256pp, mean: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    if mean > 30.0 {
        return (mean + mean.sqrt() * normal(rng)).round().max(0.0);
    }
    let l = (-mean).exp();
    let (mut k, mut p) = (0.0, 1.0);
    loop {
        p *= rng.next_f64();
        if p <= l {
            return k;
        }
        k += 1.0;
    }
}

/// Nodes of one pool: serving, loading (ready at), draining (gone at).
#[derive(Debug, Clone, Default)]
pub struct PoolState {
    pub ready: u32,
    pub starting: Vec<f64>,
    pub draining: Vec<f64>,
}

impl PoolState {
    fn fixed(n: u32) -> Self {
        Self {
            ready: n,
            ..Self::default()
        }
    }

    /// Nodes that cost GPU time now.
    pub fn billed(&self) -> u32 {
        self.ready + self.starting.len() as u32 + self.draining.len() as u32
    }

    fn planned(&self) -> u32 {
        self.ready + self.starting.len() as u32
    }
}

/// Per-hour counters of one fleet.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Hour {
    pub turns: f64,
    pub good_turns: f64,
    pub warm_turns: f64,
    pub ttft_misses: f64,
    pub itl_misses: f64,
    pub lost_turns: f64,
    pub gpu_seconds: f64,
    pub prefill_node_seconds: f64,
    pub decode_node_seconds: f64,
}

/// One interval's measurements, accumulated per second.
#[derive(Debug, Default)]
struct Window {
    turns: f64,
    prompt_tokens: f64,
    cached_tokens: f64,
    ttft: Vec<(f64, f64)>,
    itl: Vec<(f64, f64)>,
    batch_sum: f64,
    decode_rate_sum: f64,
    seconds: f64,
    prefill_busy_s: f64,
    kv_sum: f64,
}

fn weighted_p95(v: &mut [(f64, f64)]) -> Option<f64> {
    let total: f64 = v.iter().map(|x| x.1).sum();
    if total <= 0.0 {
        return None;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut acc = 0.0;
    for &(x, w) in v.iter() {
        acc += w;
        if acc >= 0.95 * total {
            return Some(x);
        }
    }
    v.last().map(|x| x.0)
}

/// The simulated fleet under one policy.
pub struct Cluster<'a> {
    pub traffic: &'a DayTraffic,
    pub truth: Truth,
    pub cost: &'a CostModel,
    pub gpus_per_node: f64,
    pub load_time_s: f64,
    pub prefill: PoolState,
    pub decode: PoolState,
    /// Turns decoding now.
    inflight: f64,
    /// Uncached prompt tokens waiting for prefill.
    backlog: f64,
    /// Open conversations whose prefix is not on their decode node.
    cold: f64,
    /// Smoothed arrival rate, for open conversations (Little's law).
    rate_smooth: f64,
    kv_tokens_per_node: f64,
    prefill_rate: f64,
    rng: Xoshiro256pp,
    window: Window,
    pub hours: Vec<Hour>,
    /// (hour, prefill billed, decode billed) sampled every minute, for the chart.
    pub timeline: Vec<(f64, u32, u32)>,
}

impl<'a> Cluster<'a> {
    pub fn new(
        traffic: &'a DayTraffic,
        truth: Truth,
        cost: &'a CostModel,
        load_time_s: f64,
        start: (u32, u32),
        seed: u64,
    ) -> Result<Self, crate::error::BenchError> {
        let p = crate::capacity::plan(&cost.base)?;
        Ok(Self {
            traffic,
            truth,
            cost,
            gpus_per_node: cost.base.gpus_per_node as f64,
            load_time_s,
            prefill: PoolState::fixed(start.0),
            decode: PoolState::fixed(start.1),
            inflight: 0.0,
            backlog: 0.0,
            cold: 0.0,
            rate_smooth: traffic.rate(0.0),
            kv_tokens_per_node: p.kv_tokens_per_node,
            prefill_rate: cost.prefill_tokens_per_s()? * truth.prefill_efficiency,
            rng: Xoshiro256pp::seed_from_u64(seed ^ 0x636c_7573_7465_7221),
            window: Window::default(),
            hours: vec![Hour::default(); 24],
            timeline: Vec::new(),
        })
    }

    fn ctx(&self) -> f64 {
        self.traffic.prompt_tokens + self.traffic.reply_tokens / 2.0
    }

    fn open_conversations(&self) -> f64 {
        self.rate_smooth * self.traffic.turn_gap_s
    }

    /// The real step time at batch `b`.
    fn step_s(&self, b: f64) -> f64 {
        let t = self.traffic;
        let lo = b.floor().max(1.0) as u64;
        let step = |n| {
            self.cost
                .step_s(n, t.prompt_tokens, t.reply_tokens, 1.0)
                .unwrap_or(f64::MAX)
        };
        // The roofline is linear in the batch: interpolate between integers.
        let (a, c) = (step(lo), step(lo + 1));
        (a + (c - a) * (b - lo as f64).max(0.0)) * self.truth.decode_slowdown
    }

    /// Move the pools toward `target` (prefill, decode): start nodes that will load, or
    /// cancel loading ones and drain serving ones.
    pub fn actuate(&mut self, t: f64, target: (u32, u32)) {
        let (load, drain) = (self.load_time_s, self.truth.drain_s);
        for (pool, want) in [(&mut self.prefill, target.0), (&mut self.decode, target.1)] {
            while pool.planned() < want {
                pool.starting.push(t + load);
            }
            while pool.planned() > want {
                if pool.starting.pop().is_some() {
                    continue;
                }
                pool.ready -= 1;
                // A drained decode node migrates its warm conversations first: none go
                // cold, and it costs its drain time.
                pool.draining.push(t + drain);
            }
        }
    }

    /// Fail one serving decode node at `t`: its in-flight turns are lost and its
    /// conversations go cold; the controller starts a replacement.
    pub fn fail_decode_node(&mut self, t: f64) {
        if self.decode.ready == 0 {
            return;
        }
        let n = self.decode.ready as f64;
        let lost = self.inflight / n;
        self.inflight -= lost;
        // They were counted when they arrived; now they fail.
        let h = &mut self.hours[(t / 3_600.0) as usize % 24];
        h.lost_turns += lost;
        h.good_turns = (h.good_turns - lost).max(0.0);
        self.cold += (self.open_conversations() - self.cold).max(0.0) / n;
        self.decode.ready -= 1;
        self.decode.starting.push(t + self.load_time_s);
    }

    /// Advance one second: nodes become ready or leave, turns arrive, prefill and decode.
    pub fn tick(&mut self, t: f64) {
        let (open, ready_before) = (self.open_conversations(), self.decode.ready);
        for pool in [&mut self.prefill, &mut self.decode] {
            let before = pool.starting.len();
            pool.starting.retain(|&r| r > t);
            pool.ready += (before - pool.starting.len()) as u32;
            pool.draining.retain(|&d| d > t);
        }
        // A decode join takes over its ring share of conversations: they start cold once.
        for k in ready_before..self.decode.ready {
            self.cold += (open - self.cold).max(0.0) / (k + 1) as f64;
        }
        let tr = self.traffic;
        let rate = tr.rate(t);
        self.rate_smooth += (rate - self.rate_smooth) / tr.turn_gap_s;
        let n = poisson(&mut self.rng, rate);
        let open = self.open_conversations().max(1.0);
        let d = self.decode.ready as f64;
        let ctx = self.ctx();
        let room = d * self.kv_tokens_per_node * (1.0 + self.truth.host_tier_ratio);
        let fit = if open * ctx > 0.0 {
            (room / (open * ctx)).min(1.0)
        } else {
            1.0
        };
        self.cold = self.cold.clamp(0.0, open);
        let warm_p = fit * (1.0 - self.cold / open);
        let n_warm = n * warm_p;
        let n_cold = n - n_warm;
        // Turns that arrive cold leave their conversation warm.
        self.cold = (self.cold - n * self.cold / open).max(0.0);

        // Prefill.
        let tail_warm = tr.prompt_tokens * (1.0 - tr.warm_cached_share);
        let tail_cold = tr.prompt_tokens * (1.0 - tr.cold_cached_share);
        let uncached = n_warm * tail_warm + n_cold * tail_cold;
        let p = self.prefill.ready as f64;
        let cap = p * self.prefill_rate;
        self.backlog += uncached;
        let served = self.backlog.min(cap);
        self.backlog -= served;
        let (ttft_warm, ttft_cold) = if cap > 0.0 {
            let rho = (served / cap).min(0.99);
            let wait = self.backlog / cap;
            let q = |tail: f64| {
                let service = tail / self.prefill_rate;
                let wq = service * rho.powf((2.0 * (p + 1.0)).sqrt() - 1.0) / (p * (1.0 - rho));
                wait + service + 3.0 * wq + self.truth.handoff_s
            };
            (q(tail_warm), q(tail_cold))
        } else {
            (f64::INFINITY, f64::INFINITY)
        };

        // Decode.
        let kv_batch = self.kv_tokens_per_node / ctx;
        let (itl, admitted) = if d > 0.0 {
            self.inflight += n;
            let b = self.inflight / d;
            let step = self.step_s(b.min(kv_batch));
            let done = self
                .inflight
                .min(d * b.min(kv_batch) / step / tr.reply_tokens);
            self.inflight -= done;
            self.window.batch_sum += b;
            self.window.decode_rate_sum += b.min(kv_batch) / step;
            self.window.kv_sum += b * ctx / self.kv_tokens_per_node;
            (step, b <= kv_batch)
        } else {
            (f64::INFINITY, false)
        };

        let slo = &self.cost.slo;
        let itl_ok = itl <= slo.itl_s && admitted;
        let good = |ttft: f64, count: f64| {
            if ttft <= slo.ttft_s && itl_ok {
                count
            } else {
                0.0
            }
        };
        let h = &mut self.hours[(t / 3_600.0) as usize % 24];
        h.turns += n;
        h.good_turns += good(ttft_warm, n_warm) + good(ttft_cold, n_cold);
        h.warm_turns += n_warm;
        h.ttft_misses += if ttft_warm > slo.ttft_s { n_warm } else { 0.0 }
            + if ttft_cold > slo.ttft_s { n_cold } else { 0.0 };
        h.itl_misses += if itl_ok { 0.0 } else { n };
        h.gpu_seconds += (self.prefill.billed() + self.decode.billed()) as f64 * self.gpus_per_node;
        h.prefill_node_seconds += self.prefill.billed() as f64;
        h.decode_node_seconds += self.decode.billed() as f64;

        let w = &mut self.window;
        w.turns += n;
        w.prompt_tokens += n * tr.prompt_tokens;
        w.cached_tokens +=
            n_warm * (tr.prompt_tokens - tail_warm) + n_cold * (tr.prompt_tokens - tail_cold);
        w.ttft.push((ttft_warm.min(1e6), n_warm));
        w.ttft.push((ttft_cold.min(1e6), n_cold));
        w.itl.push((itl.min(1e6), n));
        w.seconds += 1.0;
        if served > 0.0 {
            w.prefill_busy_s += 1.0;
        }
        if (t as u64).is_multiple_of(60) {
            self.timeline
                .push((t / 3_600.0, self.prefill.billed(), self.decode.billed()));
        }
    }

    /// What the cluster's metrics would say about the interval just ended; starts the next.
    pub fn signals(&mut self, t: f64) -> Signals {
        let w = std::mem::take(&mut self.window);
        let secs = w.seconds.max(1.0);
        let mut ttft = w.ttft;
        let mut itl = w.itl;
        let d = self.decode.ready;
        let p = self.prefill.ready;
        let tail = self.traffic.prompt_tokens * (1.0 - self.traffic.warm_cached_share);
        Signals {
            t_s: t,
            arrival_turns_per_s: w.turns / secs,
            prompt_tokens_mean: self.traffic.prompt_tokens,
            reply_tokens_mean: self.traffic.reply_tokens,
            cached_share: if w.prompt_tokens > 0.0 {
                (w.cached_tokens / w.prompt_tokens).clamp(0.0, 1.0)
            } else {
                self.traffic.warm_cached_share
            },
            prefill_queue_turns: self.backlog / tail,
            ttft_p95_s: weighted_p95(&mut ttft),
            itl_p95_s: weighted_p95(&mut itl),
            kv_occupancy: (w.kv_sum / secs).min(1.0),
            decode_batch_mean: (d > 0).then_some(w.batch_sum / secs),
            decode_tokens_per_s_per_node: (d > 0).then_some(w.decode_rate_sum / secs),
            prefill_tokens_per_s_busy: (p > 0 && w.prefill_busy_s > 0.0)
                .then_some(self.prefill_rate),
            ready_prefill: p,
            ready_decode: d,
        }
    }
}
