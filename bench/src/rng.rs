//! Small deterministic pseudo-random numbers: splitmix64 for seeding and stateless
//! hashing (`mix64` hashes ring keys and virtual-node points), xoshiro256++ for streams,
//! both from `baton_text::rng`. Identical on every platform, so a simulation with a given
//! seed prints the same table everywhere.

pub use baton_text::rng::{mix64, splitmix64};
use baton_text::rng::{unit_f64, Xoshiro256};

/// xoshiro256++ (Blackman and Vigna), seeded through splitmix64: the text crate's
/// xoshiro256 state read with the `++` output function.
#[derive(Debug, Clone)]
pub struct Xoshiro256pp(Xoshiro256);

impl Xoshiro256pp {
    /// A generator whose whole state is derived from `seed`.
    pub fn seed_from_u64(seed: u64) -> Self {
        Self(Xoshiro256::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_plus_plus()
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// Uniform in `[lo, hi)`.
    #[inline]
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Exponentially distributed with the given mean (Python's `expovariate(1 / mean)`).
    #[inline]
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }

    /// Uniform integer in `[0, n)` (Lemire's multiply-shift; the bias is below 2^-32 for
    /// the fleet sizes simulated here). `n` must be positive.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_different_seed_different_stream() {
        let mut a = Xoshiro256pp::seed_from_u64(7);
        let mut b = Xoshiro256pp::seed_from_u64(7);
        let mut c = Xoshiro256pp::seed_from_u64(8);
        let xa: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let xc: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
    }

    #[test]
    fn distributions_have_the_right_moments() {
        let mut r = Xoshiro256pp::seed_from_u64(1);
        let n = 200_000;
        let mean_u: f64 = (0..n).map(|_| r.next_f64()).sum::<f64>() / n as f64;
        assert!((mean_u - 0.5).abs() < 0.005, "uniform mean {mean_u}");
        let mean_e: f64 = (0..n).map(|_| r.exponential(60.0)).sum::<f64>() / n as f64;
        assert!((mean_e - 60.0).abs() < 1.0, "exponential mean {mean_e}");
        let mut counts = [0u32; 8];
        for _ in 0..n {
            counts[r.below(8) as usize] += 1;
        }
        for c in counts {
            let share = c as f64 / n as f64;
            assert!((share - 0.125).abs() < 0.005, "below(8) share {share}");
        }
    }

    #[test]
    fn mix64_is_not_identity_and_spreads_neighbours() {
        assert_ne!(mix64(1), 1);
        assert_ne!(mix64(1) >> 56, mix64(2) >> 56);
    }
}
