//! Per-turn SLO attainment: did a reply's first token come within the TTFT target,
//! and was its own stream steady (the turn's p95 inter-token gap within the ITL target)?
//!
//! Owns: the targets (`--slo-ttft`, `--slo-itl`), the clock a reply keeps while it
//! streams, and the verdict at its end. A turn that misses both halves counts once, as
//! `missed_ttft`: the first token is what a user waits for first, and a late start
//! already broke the turn before its stream could. Only replies the server delivered
//! whole (`stop`, `length`) are judged; cancelled, filtered and failed replies are
//! counted by `baton_gateway_finished_total` instead.

use std::time::{Duration, Instant};

/// The service-level targets of one turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SloTargets {
    /// Request received to first token.
    pub ttft: Duration,
    /// The turn's own p95 gap between consecutive tokens.
    pub itl: Duration,
}

impl Default for SloTargets {
    /// The seed's SLO: first token within 1 s, p95 gap within 50 ms.
    fn default() -> Self {
        SloTargets {
            ttft: Duration::from_secs(1),
            itl: Duration::from_millis(50),
        }
    }
}

/// How a delivered turn fared; the label of `baton_gateway_turns_slo_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SloOutcome {
    Met,
    MissedTtft,
    MissedItl,
}

impl SloOutcome {
    pub const ALL: [SloOutcome; 3] = [
        SloOutcome::Met,
        SloOutcome::MissedTtft,
        SloOutcome::MissedItl,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SloOutcome::Met => "met",
            SloOutcome::MissedTtft => "missed_ttft",
            SloOutcome::MissedItl => "missed_itl",
        }
    }
}

/// Longest reply whose gaps are kept one by one; past it the p95 is taken over the
/// first this many gaps (a reply this long is far beyond any chat turn).
const MAX_GAPS: usize = 16_384;

/// The timing of one reply as the gateway receives its tokens.
#[derive(Debug)]
pub struct TurnClock {
    started: Instant,
    last: Option<Instant>,
    ttft: Option<Duration>,
    /// Gaps between consecutive tokens, in microseconds (4 bytes a token).
    gaps_us: Vec<u32>,
}

impl TurnClock {
    pub fn start(started: Instant) -> Self {
        TurnClock {
            started,
            last: None,
            ttft: None,
            gaps_us: Vec::new(),
        }
    }

    pub fn started(&self) -> Instant {
        self.started
    }

    /// A token arrived now: returns it as the TTFT (`Ok`) or as the gap since the
    /// previous token (`Err`), for the histograms.
    pub fn token(&mut self) -> Result<Duration, Duration> {
        self.token_at(Instant::now())
    }

    fn token_at(&mut self, now: Instant) -> Result<Duration, Duration> {
        let r = match self.last {
            None => {
                let ttft = now.saturating_duration_since(self.started);
                self.ttft = Some(ttft);
                Ok(ttft)
            }
            Some(prev) => {
                let gap = now.saturating_duration_since(prev);
                if self.gaps_us.len() < MAX_GAPS {
                    self.gaps_us
                        .push(u32::try_from(gap.as_micros()).unwrap_or(u32::MAX));
                }
                Err(gap)
            }
        };
        self.last = Some(now);
        r
    }

    /// Nearest-rank p95 of the gaps (zero for a reply of one token or none).
    pub fn p95_gap(&self) -> Duration {
        if self.gaps_us.is_empty() {
            return Duration::ZERO;
        }
        let mut v = self.gaps_us.clone();
        let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
        let (_, nth, _) = v.select_nth_unstable(rank - 1);
        Duration::from_micros(u64::from(*nth))
    }

    /// The verdict on a delivered reply. A reply with no token at all (an empty
    /// `stop`) had its answer at the end: that time stands in for the TTFT.
    pub fn outcome(&self, targets: SloTargets) -> SloOutcome {
        let ttft = self.ttft.unwrap_or_else(|| self.started.elapsed());
        if ttft > targets.ttft {
            SloOutcome::MissedTtft
        } else if self.p95_gap() > targets.itl {
            SloOutcome::MissedItl
        } else {
            SloOutcome::Met
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A clock whose tokens arrived `ttft` after the start and then `gaps` apart.
    fn clock(ttft: u64, gaps: &[u64]) -> TurnClock {
        let t0 = Instant::now();
        let mut c = TurnClock::start(t0);
        let mut at = t0 + ms(ttft);
        assert_eq!(c.token_at(at), Ok(ms(ttft)));
        for &g in gaps {
            at += ms(g);
            assert_eq!(c.token_at(at), Err(ms(g)));
        }
        c
    }

    #[test]
    fn each_half_of_the_slo_is_judged_and_ttft_takes_precedence() {
        let t = SloTargets::default();
        assert_eq!(clock(200, &[20; 10]).outcome(t), SloOutcome::Met);
        assert_eq!(clock(1500, &[20; 10]).outcome(t), SloOutcome::MissedTtft);
        assert_eq!(clock(200, &[90; 10]).outcome(t), SloOutcome::MissedItl);
        // Both missed: counted once, as the TTFT miss.
        assert_eq!(clock(1500, &[90; 10]).outcome(t), SloOutcome::MissedTtft);
        // A single token: no gaps, so only the TTFT can miss.
        assert_eq!(clock(200, &[]).outcome(t), SloOutcome::Met);
        assert_eq!(clock(200, &[]).p95_gap(), Duration::ZERO);
    }

    #[test]
    fn the_itl_half_uses_the_turns_own_p95_not_its_mean() {
        let t = SloTargets::default();
        // 20 gaps, one stutter: the 19th of 20 (p95's rank) is still 10 ms.
        let one = clock(100, &[[10u64; 19].as_slice(), &[200]].concat());
        assert_eq!(one.p95_gap(), ms(10));
        assert_eq!(one.outcome(t), SloOutcome::Met);
        // Two stutters reach the rank, though the mean (28.5 ms) is under the target.
        let two = clock(100, &[[10u64; 18].as_slice(), &[100, 100]].concat());
        assert_eq!(two.p95_gap(), ms(100));
        assert_eq!(two.outcome(t), SloOutcome::MissedItl);
        // Targets are inclusive.
        assert_eq!(clock(1000, &[50; 4]).outcome(t), SloOutcome::Met);
    }

    #[test]
    fn labels_are_the_documented_ones() {
        let labels: Vec<&str> = SloOutcome::ALL.iter().map(|o| o.label()).collect();
        assert_eq!(labels, ["met", "missed_ttft", "missed_itl"]);
    }
}
