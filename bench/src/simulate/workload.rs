//! The simulated workload: conversations that open uniformly over an arrival window and
//! send a turn after an exponential pause (the seed's part 2), as one time-sorted trace.
//!
//! A conversation's prompt at turn `k` is `system + k * (message + reply) + message`
//! tokens, so the simulator keeps token counts, never token arrays. The trace is generated
//! once from its own random stream and shared read-only by every configuration, so routing
//! policies are compared on exactly the same arrivals.

use serde::Serialize;

use crate::error::{invalid, BenchError};
use crate::rng::Xoshiro256pp;

/// Shape of the simulated traffic.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Workload {
    pub conversations: u32,
    pub turns: u32,
    /// Conversations open uniformly in `[0, arrival_window_s)`.
    pub arrival_window_s: f64,
    /// Mean of the exponential pause between a conversation's turns.
    pub turn_gap_s: f64,
    /// Shared, platform-supplied system prompt: always cached everywhere.
    pub system_tokens: u32,
    pub message_tokens: u32,
    pub reply_tokens: u32,
    pub seed: u64,
}

impl Workload {
    /// The seed's part-2 workload: 4,000 conversations x 8 turns over 600 s, a pause of 60 s
    /// on average, 1,500-token system prompt, 150-token messages, 400-token replies.
    pub fn seed() -> Self {
        Self {
            conversations: 4_000,
            turns: 8,
            arrival_window_s: 600.0,
            turn_gap_s: 60.0,
            system_tokens: 1_500,
            message_tokens: 150,
            reply_tokens: 400,
            seed: 1,
        }
    }

    /// Prompt tokens of turn `k` (0-based).
    #[inline]
    pub fn prompt(&self, turn: u32) -> u32 {
        self.system_tokens + turn * (self.message_tokens + self.reply_tokens) + self.message_tokens
    }

    /// Check the values are usable and the longest prompt fits in u32.
    pub fn validate(&self) -> Result<(), BenchError> {
        if self.conversations == 0 || self.turns == 0 {
            return Err(invalid("workload", "conversations and turns must be > 0"));
        }
        if !(self.arrival_window_s >= 0.0 && self.turn_gap_s > 0.0) {
            return Err(invalid(
                "workload",
                "arrival window >= 0 and turn gap > 0 required",
            ));
        }
        let longest = self.system_tokens as u64
            + self.turns as u64 * (self.message_tokens as u64 + self.reply_tokens as u64);
        if longest > u32::MAX as u64 / 2 {
            return Err(invalid("workload", "conversations grow past 2^31 tokens"));
        }
        Ok(())
    }
}

/// One user turn arriving.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnEvent {
    pub t: f64,
    pub conv: u32,
    pub turn: u32,
}

/// All turns of a workload, sorted by arrival time (ties by conversation, then turn).
#[derive(Debug, Clone)]
pub struct Trace {
    pub workload: Workload,
    pub events: Vec<TurnEvent>,
}

impl Trace {
    pub fn generate(w: Workload) -> Result<Self, BenchError> {
        w.validate()?;
        let mut rng = Xoshiro256pp::seed_from_u64(w.seed ^ 0x776f_726b_6c6f_6164);
        let mut events = Vec::with_capacity(w.conversations as usize * w.turns as usize);
        for conv in 0..w.conversations {
            let mut t = rng.uniform(0.0, w.arrival_window_s);
            for turn in 0..w.turns {
                events.push(TurnEvent { t, conv, turn });
                t += rng.exponential(w.turn_gap_s);
            }
        }
        sort_by_time(&mut events);
        Ok(Self {
            workload: w,
            events,
        })
    }

    /// Seconds from the first turn to the last.
    pub fn span_s(&self) -> f64 {
        match (self.events.first(), self.events.last()) {
            (Some(a), Some(b)) => (b.t - a.t).max(f64::MIN_POSITIVE),
            _ => f64::MIN_POSITIVE,
        }
    }
}

/// Sort events by (time, conversation, turn) in O(n): a counting sort into one bucket per
/// event over the time range (times are spread evenly enough that buckets hold about one
/// event), then a comparison sort inside each bucket.
fn sort_by_time(events: &mut Vec<TurnEvent>) {
    let n = events.len();
    if n < 2 {
        return;
    }
    let max_t = events.iter().map(|e| e.t).fold(0.0f64, f64::max);
    if max_t <= 0.0 {
        events.sort_unstable_by(order);
        return;
    }
    let scale = (n - 1) as f64 / max_t;
    let bucket = |e: &TurnEvent| ((e.t * scale) as usize).min(n - 1);
    let mut starts = vec![0u32; n + 1];
    for e in events.iter() {
        starts[bucket(e) + 1] += 1;
    }
    for i in 0..n {
        starts[i + 1] += starts[i];
    }
    let mut next = starts.clone();
    let mut out = vec![
        TurnEvent {
            t: 0.0,
            conv: 0,
            turn: 0
        };
        n
    ];
    for e in events.iter() {
        let b = bucket(e);
        out[next[b] as usize] = *e;
        next[b] += 1;
    }
    for w in starts.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        match b - a {
            0 | 1 => {}
            // Buckets hold a handful of events: insertion sort beats the general sort's setup.
            2..=16 => {
                for i in a + 1..b {
                    let mut j = i;
                    while j > a && order(&out[j - 1], &out[j]).is_gt() {
                        out.swap(j - 1, j);
                        j -= 1;
                    }
                }
            }
            _ => out[a..b].sort_unstable_by(order),
        }
    }
    *events = out;
}

fn order(a: &TurnEvent, b: &TurnEvent) -> std::cmp::Ordering {
    a.t.total_cmp(&b.t)
        .then(a.conv.cmp(&b.conv))
        .then(a.turn.cmp(&b.turn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_is_sorted_complete_and_in_turn_order() {
        let w = Workload {
            conversations: 500,
            ..Workload::seed()
        };
        let tr = Trace::generate(w).unwrap();
        assert_eq!(tr.events.len(), 500 * 8);
        assert!(tr.events.windows(2).all(|p| p[0].t <= p[1].t));
        let mut next = vec![0u32; 500];
        for e in &tr.events {
            assert_eq!(
                e.turn, next[e.conv as usize],
                "turns of a conversation in order"
            );
            next[e.conv as usize] += 1;
        }
        let first: Vec<f64> = tr
            .events
            .iter()
            .filter(|e| e.turn == 0)
            .map(|e| e.t)
            .collect();
        assert!(first.iter().all(|&t| (0.0..600.0).contains(&t)));
        // 7 pauses of 60 s on average after an arrival at 300 s on average.
        let last_mean = tr
            .events
            .iter()
            .filter(|e| e.turn == 7)
            .map(|e| e.t)
            .sum::<f64>()
            / 500.0;
        assert!((last_mean - 720.0).abs() < 40.0, "{last_mean}");
    }

    #[test]
    fn bucket_sort_matches_a_comparison_sort() {
        let mut rng = Xoshiro256pp::seed_from_u64(5);
        let mut ev: Vec<TurnEvent> = (0..5_000u32)
            .map(|i| TurnEvent {
                // Clumps, ties and a long tail.
                t: if i % 7 == 0 {
                    3.0
                } else {
                    rng.exponential(100.0)
                },
                conv: i % 301,
                turn: i % 8,
            })
            .collect();
        let mut want = ev.clone();
        want.sort_by(order);
        sort_by_time(&mut ev);
        assert_eq!(ev, want);
        let mut zeros = vec![
            TurnEvent {
                t: 0.0,
                conv: 2,
                turn: 0,
            },
            TurnEvent {
                t: 0.0,
                conv: 1,
                turn: 0,
            },
        ];
        sort_by_time(&mut zeros);
        assert_eq!(zeros[0].conv, 1);
    }

    #[test]
    fn prompt_grows_by_message_and_reply() {
        let w = Workload::seed();
        assert_eq!(w.prompt(0), 1_650);
        assert_eq!(w.prompt(1), 2_200);
        assert_eq!(w.prompt(7), 5_500);
        assert!(Workload { turns: 0, ..w }.validate().is_err());
    }

    #[test]
    fn same_seed_same_trace() {
        let w = Workload {
            conversations: 100,
            ..Workload::seed()
        };
        let a = Trace::generate(w).unwrap();
        let b = Trace::generate(w).unwrap();
        let c = Trace::generate(Workload { seed: 2, ..w }).unwrap();
        assert_eq!(a.events, b.events);
        assert_ne!(a.events, c.events);
    }
}
