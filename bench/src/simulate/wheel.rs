//! A timing wheel of pending turn completions: "hand me every completion at or before `t`"
//! in O(1) amortized, where a binary heap costs O(log n) cache-missing steps per turn.
//!
//! Completions are released in no particular order; the simulator only needs all of them
//! applied before the next arrival, so order within a release does not matter. Times must
//! be pushed at or after the last release time (turns finish after they arrive). Entries
//! beyond the wheel's horizon wait in a small overflow heap.
//!
//! Invariant: every bucket before `cursor` is empty; an entry in the wheel has
//! `cursor <= tick(time) < cursor + BUCKETS`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const BUCKETS: usize = 1 << 13;
/// Buckets per simulated second: 8,192 buckets of 1/128 s cover 64 s.
const TICKS_PER_S: f64 = 128.0;

/// Pending completions: `(finish time, node)`.
#[derive(Debug)]
pub struct Wheel {
    buckets: Vec<Vec<(f64, u32)>>,
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

    #[inline]
    fn tick(t: f64) -> u64 {
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
            self.buckets[tick as usize % BUCKETS].push((time, node));
        } else {
            self.overflow.push(Reverse((time.to_bits(), node)));
        }
        self.len += 1;
    }

    /// Hand every completion with time `<= t` to `f`, in no particular order.
    #[inline]
    pub fn release(&mut self, t: f64, mut f: impl FnMut(u32)) {
        if self.len == 0 {
            if self.started {
                self.cursor = self.cursor.max(Self::tick(t));
            }
            return;
        }
        let target = Self::tick(t);
        while self.cursor < target {
            let b = &mut self.buckets[self.cursor as usize % BUCKETS];
            self.len -= b.len();
            for &(_, n) in b.iter() {
                f(n);
            }
            b.clear();
            self.cursor += 1;
        }
        let b = &mut self.buckets[self.cursor as usize % BUCKETS];
        let before = b.len();
        b.retain(|&(time, n)| {
            if time <= t {
                f(n);
                false
            } else {
                true
            }
        });
        self.len -= before - b.len();
        while let Some(&Reverse((bits, n))) = self.overflow.peek() {
            if f64::from_bits(bits) > t {
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
    fn releases_exactly_what_a_heap_would() {
        let mut rng = Xoshiro256pp::seed_from_u64(3);
        let mut wheel = Wheel::new();
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        let mut t = 5.0;
        for i in 0..20_000u32 {
            // Mostly a few seconds ahead, sometimes far beyond the 64 s horizon, sometimes
            // exactly now; sometimes the clock jumps far ahead.
            let ahead = match i % 50 {
                0 => 100.0 + rng.uniform(0.0, 500.0),
                1 => 0.0,
                _ => rng.uniform(0.0, 6.0),
            };
            wheel.push(t + ahead, i);
            heap.push(Reverse(((t + ahead).to_bits(), i)));
            t += if i % 997 == 0 {
                300.0
            } else {
                rng.exponential(0.01)
            };
            let mut got = Vec::new();
            wheel.release(t, |n| got.push(n));
            let mut want = Vec::new();
            while let Some(&Reverse((b, n))) = heap.peek() {
                if f64::from_bits(b) > t {
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
