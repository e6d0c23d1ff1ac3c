//! Small deterministic pseudo-random numbers: splitmix64 for seeding and stateless
//! hashing, xoshiro256++ for streams. No dependency, identical on every platform, so a
//! simulation with a given seed prints the same table everywhere.

/// One splitmix64 step: advances `state` and returns a well-mixed 64-bit value.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    mix64(*state)
}

/// The splitmix64 finalizer: a bijective, avalanche-quality mix of one word. Used as the
/// stateless hash of ring keys and virtual-node points.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman and Vigna), seeded through splitmix64.
#[derive(Debug, Clone)]
pub struct Xoshiro256pp {
    s: [u64; 4],
}

impl Xoshiro256pp {
    /// A generator whose whole state is derived from `seed`.
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Self { s }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
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
