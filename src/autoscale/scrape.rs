//! What `baton up --autoscale` measures: the nodes' own `/metrics`, sampled several times
//! per decision, turned into the planner's [`Signals`].
//!
//! Gauges (running and waiting sequences, the prefill queue) are averaged over the samples
//! of the interval, so one instant between two turns does not read as an idle node.
//! Counters (turns, tokens, busy seconds, the TTFT histogram) are read as differences per
//! node between two decisions: a node that appeared or went away in between contributes
//! nothing to the rates rather than a counter reset.

use std::collections::HashMap;
use std::time::Duration;

use baton::harness::{http_get, metric_sum};
use baton_bench::planner::{Pool, Signals};

/// One node's counters at a decision.
#[derive(Debug, Clone, Default)]
struct Counters {
    turns: f64,
    prompt_tokens: f64,
    cached_tokens: f64,
    generated: f64,
    decode_tokens: f64,
    prefill_tokens: f64,
    prefill_busy_s: f64,
    /// TTFT histogram: (upper bound, cumulative count).
    ttft: Vec<(f64, f64)>,
}

/// A node the sampler reads.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub pool: Pool,
    /// Its HTTP listener (host:port), serving `/metrics` on loopback.
    pub http: String,
}

/// Samples since the last decision and the counters at it.
#[derive(Debug, Default)]
pub struct Sampler {
    /// Sum over samples of the decode pool's (running + waiting) per ready node.
    batch_sum: f64,
    queue_sum: f64,
    samples: u32,
    kv_used: f64,
    kv_total: f64,
    itl_p95: f64,
    last: HashMap<String, Counters>,
    now: HashMap<String, Counters>,
}

fn get(addr: &str) -> Option<String> {
    match http_get(addr, "/metrics", None, Duration::from_secs(2)) {
        Ok((200, body)) => Some(body),
        _ => None,
    }
}

/// `histogram_quantile` over the differences of two cumulative bucket lists.
fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lo);
            }
            let inside = count - below;
            let frac = if inside > 0.0 { (rank - below) / inside } else { 1.0 };
            return Some(lo + (le - lo) * frac);
        }
        (lo, below) = (le, count);
    }
    Some(lo)
}

fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut out: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let v: f64 = rest.rsplit_once(' ')?.1.trim().parse().ok()?;
            Some((le, v))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

impl Sampler {
    /// Reads every node once (blocking HTTP on loopback: call it off the async threads).
    pub fn sample(&mut self, targets: &[Target]) {
        let (mut batch, mut decode_nodes, mut queue) = (0.0, 0u32, 0.0);
        let (mut used, mut total, mut itl) = (0.0, 0.0, 0.0f64);
        let mut now = HashMap::new();
        for t in targets {
            let Some(text) = get(&t.http) else { continue };
            let m = |name: &str, labels: &[&str]| metric_sum(&text, name, labels).unwrap_or(0.0);
            let c = match t.pool {
                Pool::Decode => {
                    decode_nodes += 1;
                    batch += m("baton_decode_running_sequences", &[]) + m("baton_decode_queue_depth", &[]);
                    used += m("baton_decode_kv_blocks", &["tier=\"1\"", "state=\"used\""]);
                    total += m("baton_decode_kv_blocks", &["tier=\"1\""]);
                    itl = itl.max(m("baton_decode_decode_step_p95_seconds", &[]));
                    let prompt = m("baton_decode_prompt_tokens_total", &[]);
                    let cached = m("baton_decode_prompt_tokens_total", &["source=\"cached_tier1\""])
                        + m("baton_decode_prompt_tokens_total", &["source=\"cached_tier2\""]);
                    Counters {
                        turns: m("baton_decode_turns_total", &[]),
                        prompt_tokens: prompt,
                        cached_tokens: cached,
                        generated: m("baton_decode_generated_tokens_total", &[]),
                        decode_tokens: m("baton_decode_engine_tokens_total", &["phase=\"decode\""]),
                        ttft: buckets(&text, "baton_decode_time_to_first_token_seconds"),
                        ..Counters::default()
                    }
                }
                Pool::Prefill => {
                    queue += m("baton_prefill_queue_depth", &[]);
                    Counters {
                        prefill_tokens: m("baton_prefill_engine_tokens_total", &["phase=\"prefill\""]),
                        prefill_busy_s: m("baton_prefill_busy_seconds_total", &[]),
                        ..Counters::default()
                    }
                }
            };
            now.insert(t.name.clone(), c);
        }
        if decode_nodes > 0 {
            self.batch_sum += batch / decode_nodes as f64;
        }
        self.queue_sum += queue;
        self.samples += 1;
        (self.kv_used, self.kv_total, self.itl_p95) = (used, total, itl);
        self.now = now;
    }

    /// The interval's signals, `dt_s` after the previous decision; starts the next interval.
    pub fn signals(&mut self, t_s: f64, dt_s: f64, ready_prefill: u32, ready_decode: u32) -> Signals {
        let mut d = Counters::default();
        let mut ttft: Vec<(f64, f64)> = Vec::new();
        for (name, c) in &self.now {
            let Some(p) = self.last.get(name) else { continue };
            // A counter that went down is a restarted node: skip it this once.
            if c.turns < p.turns || c.prefill_tokens < p.prefill_tokens {
                continue;
            }
            d.turns += c.turns - p.turns;
            d.prompt_tokens += c.prompt_tokens - p.prompt_tokens;
            d.cached_tokens += c.cached_tokens - p.cached_tokens;
            d.generated += c.generated - p.generated;
            d.decode_tokens += c.decode_tokens - p.decode_tokens;
            d.prefill_tokens += c.prefill_tokens - p.prefill_tokens;
            d.prefill_busy_s += c.prefill_busy_s - p.prefill_busy_s;
            if c.ttft.len() == p.ttft.len() {
                if ttft.is_empty() {
                    ttft = c.ttft.iter().map(|&(le, _)| (le, 0.0)).collect();
                }
                if ttft.len() == c.ttft.len() {
                    for (i, (&(_, now), &(_, before))) in c.ttft.iter().zip(&p.ttft).enumerate() {
                        ttft[i].1 += now - before;
                    }
                }
            }
        }
        let samples = self.samples.max(1) as f64;
        let turns = d.turns.max(0.0);
        let per_turn = |x: f64| if turns > 0.0 { (x / turns).max(0.0) } else { 0.0 };
        let s = Signals {
            t_s,
            arrival_turns_per_s: turns / dt_s.max(1e-3),
            prompt_tokens_mean: per_turn(d.prompt_tokens),
            reply_tokens_mean: per_turn(d.generated),
            cached_share: if d.prompt_tokens > 0.0 { (d.cached_tokens / d.prompt_tokens).clamp(0.0, 1.0) } else { 0.0 },
            prefill_queue_turns: self.queue_sum / samples,
            ttft_p95_s: quantile(0.95, &ttft),
            itl_p95_s: (self.itl_p95 > 0.0).then_some(self.itl_p95),
            kv_occupancy: if self.kv_total > 0.0 { (self.kv_used / self.kv_total).clamp(0.0, 1.0) } else { 0.0 },
            decode_batch_mean: (self.samples > 0).then_some(self.batch_sum / samples),
            decode_tokens_per_s_per_node: (ready_decode > 0 && d.decode_tokens > 0.0)
                .then(|| d.decode_tokens / dt_s.max(1e-3) / ready_decode as f64),
            prefill_tokens_per_s_busy: (d.prefill_busy_s > 0.0).then(|| d.prefill_tokens / d.prefill_busy_s),
            ready_prefill,
            ready_decode,
        };
        self.last = std::mem::take(&mut self.now);
        self.now = self.last.clone();
        (self.batch_sum, self.queue_sum, self.samples) = (0.0, 0.0, 0);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_a_bucket() {
        let b = [(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (f64::INFINITY, 100.0)];
        let q = quantile(0.95, &b).unwrap();
        assert!((q - 0.95).abs() < 1e-9, "{q}");
        assert!((quantile(0.5, &b).unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(quantile(0.95, &[(1.0, 0.0), (f64::INFINITY, 0.0)]), None);
        // Everything above the last finite bound: that bound, never infinity.
        assert_eq!(quantile(0.95, &[(1.0, 0.0), (f64::INFINITY, 4.0)]), Some(1.0));
    }

    #[test]
    fn buckets_are_read_in_order() {
        let text = "x_bucket{le=\"+Inf\"} 3\nx_bucket{le=\"0.5\"} 1\nx_bucket{le=\"1\"} 2\nx_sum 2\nx_count 3\n";
        assert_eq!(buckets(text, "x"), vec![(0.5, 1.0), (1.0, 2.0), (f64::INFINITY, 3.0)]);
    }
}
