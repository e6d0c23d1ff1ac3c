//! Summaries of a load level: latency percentiles, throughput, cached share, goodput and
//! errors, as a table row and as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::client::TurnResult;

/// Latency percentiles in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `samples` (empty gives zeros).
    pub fn of(samples: &mut [Duration]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_unstable();
        let at = |q: f64| {
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1].as_secs_f64() * 1e3
        };
        Percentiles { p50: at(0.50), p95: at(0.95), p99: at(0.99) }
    }
}

/// Service-level targets a turn must meet to count towards goodput (the seed's SLO:
/// first token within 1 s and a steady stream, per-turn p95 gap within 50 ms).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Targets {
    pub ttft_ms: f64,
    /// The turn's own p95 gap between content chunks.
    pub itl_ms: f64,
}

/// The summary of one offered-load level.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LevelReport {
    /// Conversations open at once.
    pub conversations: usize,
    pub wall_seconds: f64,
    pub turns: usize,
    pub turns_per_second: f64,
    pub prompt_tokens_per_second: f64,
    pub output_tokens_per_second: f64,
    /// Share of prompt tokens the server reported as cached.
    pub cached_share: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    /// Turns per second that met both targets.
    pub goodput_turns_per_second: f64,
    /// Share of the level's turns (failed ones included) that met both targets.
    #[serde(default)]
    pub goodput_share: f64,
    /// Turns that missed the TTFT target (whatever their ITL), and turns that met it but
    /// missed the ITL target.
    #[serde(default)]
    pub missed_ttft: usize,
    #[serde(default)]
    pub missed_itl: usize,
    pub errors: usize,
    pub errors_by_kind: BTreeMap<String, usize>,
}

impl LevelReport {
    /// Summarizes the turns (and failures) of one level that ran for `wall`.
    pub fn new(conversations: usize, wall: Duration, turns: &[TurnResult], errors: &[String], targets: Targets) -> Self {
        let secs = wall.as_secs_f64().max(1e-9);
        let prompt: u64 = turns.iter().map(|t| t.prompt_tokens).sum();
        let cached: u64 = turns.iter().map(|t| t.cached_tokens).sum();
        let output: u64 = turns.iter().map(|t| t.completion_tokens).sum();
        let mut ttft: Vec<Duration> = turns.iter().filter_map(|t| t.ttft).collect();
        let mut itl: Vec<Duration> = turns.iter().flat_map(|t| t.itl.iter().copied()).collect();
        let verdicts: Vec<Verdict> = turns.iter().map(|t| verdict(t, targets)).collect();
        let count = |v: Verdict| verdicts.iter().filter(|&&x| x == v).count();
        let good = count(Verdict::Met);
        let offered = turns.len() + errors.len();
        let mut errors_by_kind = BTreeMap::new();
        for e in errors {
            *errors_by_kind.entry(e.clone()).or_insert(0) += 1;
        }
        LevelReport {
            conversations,
            wall_seconds: secs,
            turns: turns.len(),
            turns_per_second: turns.len() as f64 / secs,
            prompt_tokens_per_second: prompt as f64 / secs,
            output_tokens_per_second: output as f64 / secs,
            cached_share: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            ttft_ms: Percentiles::of(&mut ttft),
            itl_ms: Percentiles::of(&mut itl),
            goodput_turns_per_second: good as f64 / secs,
            goodput_share: if offered == 0 { 0.0 } else { good as f64 / offered as f64 },
            missed_ttft: count(Verdict::MissedTtft),
            missed_itl: count(Verdict::MissedItl),
            errors: errors.len(),
            errors_by_kind,
        }
    }
}

/// How one turn fared against the targets; a turn that misses both counts as a TTFT
/// miss (the half the user sees first), as the gateway's counters do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Met,
    MissedTtft,
    MissedItl,
}

fn verdict(t: &TurnResult, targets: Targets) -> Verdict {
    let Some(ttft) = t.ttft else { return Verdict::MissedTtft };
    if ttft.as_secs_f64() * 1e3 > targets.ttft_ms {
        return Verdict::MissedTtft;
    }
    if turn_p95(&t.itl).as_secs_f64() * 1e3 > targets.itl_ms {
        return Verdict::MissedItl;
    }
    Verdict::Met
}

/// Nearest-rank p95 of one turn's gaps (zero for a turn of one chunk).
fn turn_p95(gaps: &[Duration]) -> Duration {
    if gaps.is_empty() {
        return Duration::ZERO;
    }
    let mut v = gaps.to_vec();
    v.sort_unstable();
    let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The table the command prints: one row per level.
pub fn table(label: &str, levels: &[LevelReport], targets: Targets) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{label}: goodput counts turns with TTFT <= {:.0} ms and the turn's own p95 ITL <= {:.0} ms (share of all turns, failed included; rate in turns/s)",
        targets.ttft_ms, targets.itl_ms
    );
    let _ = writeln!(
        s,
        "{:>5} {:>6} {:>7} {:>9} {:>8} {:>7} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>9} {:>6} {:>6} {:>6}",
        "conv", "turns", "turns/s", "prompt/s", "output/s", "cached", "ttft p50", "ttft p95", "ttft p99", "itl p50", "itl p95",
        "itl p99", "in slo", "good/s", "x ttft", "x itl", "errors"
    );
    for l in levels {
        let _ = writeln!(
            s,
            "{:>5} {:>6} {:>7.2} {:>9.1} {:>8.1} {:>6.1}% {:>7.0}ms {:>7.0}ms {:>7.0}ms {:>6.1}ms {:>6.1}ms {:>6.1}ms {:>6.1}% {:>9.2} {:>6} {:>6} {:>6}",
            l.conversations,
            l.turns,
            l.turns_per_second,
            l.prompt_tokens_per_second,
            l.output_tokens_per_second,
            l.cached_share * 100.0,
            l.ttft_ms.p50,
            l.ttft_ms.p95,
            l.ttft_ms.p99,
            l.itl_ms.p50,
            l.itl_ms.p95,
            l.itl_ms.p99,
            l.goodput_share * 100.0,
            l.goodput_turns_per_second,
            l.missed_ttft,
            l.missed_itl,
            l.errors
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<Duration> = (1..=100).map(ms).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!((p.p50, p.p95, p.p99), (50.0, 95.0, 99.0));
        assert_eq!(Percentiles::of(&mut []).p99, 0.0);
    }

    #[test]
    fn goodput_counts_turns_within_both_targets() {
        let turn = |ttft, gap| TurnResult {
            ttft: Some(ms(ttft)),
            itl: vec![ms(gap); 4],
            prompt_tokens: 100,
            cached_tokens: 50,
            completion_tokens: 5,
            ..Default::default()
        };
        // One stutter of 90 ms among 20 gaps is beyond the p95 rank (19th of 20): still met;
        // two are not. A mean would hide both.
        let mut one_stutter = turn(200, 20);
        one_stutter.itl = [vec![ms(10); 19], vec![ms(90)]].concat();
        let mut two_stutters = turn(200, 20);
        two_stutters.itl = [vec![ms(10); 18], vec![ms(90); 2]].concat();
        let turns = [turn(200, 20), turn(2000, 20), turn(200, 90), turn(2000, 90), one_stutter, two_stutters];
        let r = LevelReport::new(2, Duration::from_secs(2), &turns, &["http_429".into()], Targets { ttft_ms: 1000.0, itl_ms: 50.0 });
        assert_eq!(r.turns, 6);
        assert!((r.goodput_turns_per_second - 1.0).abs() < 1e-9, "{}", r.goodput_turns_per_second);
        assert!((r.goodput_share - 2.0 / 7.0).abs() < 1e-9, "{}", r.goodput_share);
        assert_eq!((r.missed_ttft, r.missed_itl), (2, 2));
        assert!((r.cached_share - 0.5).abs() < 1e-9);
        assert_eq!(r.errors_by_kind["http_429"], 1);
        assert!(table("x", &[r], Targets { ttft_ms: 1000.0, itl_ms: 50.0 }).contains("goodput"));
    }
}
