//! A timing wheel of pending turn completions: "hand me every completion before `t`" in
//! O(1) amortized, where a binary heap costs O(log n) cache-missing steps per turn.
//!
//! Time is cut into ticks of 1/128 s and a completion takes effect at the end of its tick
//! (at most 7.8 ms late, against turns that decode for seconds): releasing is then
//! draining whole buckets, with no sorting or scanning. Completions are released in no
//! particular order; the simulator only needs all of them applied before the next
//! arrival. Times must be pushed at or after the last release time (turns finish after
//! they arrive). Entries beyond the wheel's 32 s horizon wait in an overflow heap.
//!
//! Invariant: every bucket before `cursor` is empty; an entry in the wheel has
//! `cursor <= tick(time) < cursor + BUCKETS`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const BUCKETS: usize = 1 << 12;
/// Ticks per simulated second: 4,096 buckets of 1/128 s cover 32 s, more than a turn's
/// prefill (queueing included, unless the prefill pool is badly overloaded) plus decode,
/// and small enough to stay in the CPU cache.
pub const TICKS_PER_S: f64 = 128.0;

/// Pending completions, by tick, as the node each one frees.
#[derive(Debug)]
pub struct Wheel {
    buckets: Vec<Vec<u32>>,
    cursor: u64,
    started: bool,
    overflow: BinaryHeap<Reverse<(u64, u32)>>,
    len: usize,
}

impl Default for Wheel {
    fn default() -> Self {
        Self::new()
    }
}

impl Wheel {
    pub fn new() -> Self {
        Self {
            buckets: vec![Vec::new(); BUCKETS],
            cursor: 0,
            started: false,
            overflow: BinaryHeap::new(),
            len: 0,
        }
    }

    /// The tick a time falls in.
    #[inline]
    pub fn tick(t: f64) -> u64 {
        (t * TICKS_PER_S) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Add a completion at `time` (>= 0 and >= the last `release` time).
    #[inline]
    pub fn push(&mut self, time: f64, node: u32) {
        let tick = Self::tick(time);
        if !self.started {
            self.cursor = tick;
            self.started = true;
        }
        debug_assert!(tick >= self.cursor, "completion pushed into the past");
        let tick = tick.max(self.cursor);
        if tick - self.cursor < BUCKETS as u64 {
            self.buckets[tick as usize % BUCKETS].push(node);
        } else {
            self.overflow.push(Reverse((tick, node)));
        }
        self.len += 1;
    }

    /// Hand every completion whose tick ended at or before `t` (tick < tick(t)) to `f`.
    #[inline]
    pub fn release(&mut self, t: f64, mut f: impl FnMut(u32)) {
        let target = Self::tick(t);
        if self.len == 0 {
            self.cursor = self.cursor.max(target);
            return;
        }
        while self.cursor < target {
            let b = &mut self.buckets[self.cursor as usize % BUCKETS];
            self.len -= b.len();
            for &n in b.iter() {
                f(n);
            }
            b.clear();
            self.cursor += 1;
            if self.len == 0 {
                self.cursor = target;
            }
        }
        while let Some(&Reverse((tick, n))) = self.overflow.peek() {
            if tick >= target {
                break;
            }
            self.overflow.pop();
            self.len -= 1;
            f(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Xoshiro256pp;

    #[test]
    fn releases_what_a_heap_of_ticks_would() {
        let mut rng = Xoshiro256pp::seed_from_u64(3);
        let mut wheel = Wheel::new();
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        let mut t = 5.0;
        for i in 0..20_000u32 {
            // Mostly a few seconds ahead, sometimes far beyond the 32 s horizon, sometimes
            // exactly now; sometimes the clock jumps far ahead.
            let ahead = match i % 50 {
                0 => 100.0 + rng.uniform(0.0, 500.0),
                1 => 0.0,
                _ => rng.uniform(0.0, 6.0),
            };
            wheel.push(t + ahead, i);
            heap.push(Reverse((Wheel::tick(t + ahead), i)));
            t += if i % 997 == 0 {
                300.0
            } else {
                rng.exponential(0.01)
            };
            let mut got = Vec::new();
            wheel.release(t, |n| got.push(n));
            let mut want = Vec::new();
            while let Some(&Reverse((tick, n))) = heap.peek() {
                if tick >= Wheel::tick(t) {
                    break;
                }
                heap.pop();
                want.push(n);
            }
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "at t={t}");
            assert_eq!(wheel.len(), heap.len());
        }
    }
}
