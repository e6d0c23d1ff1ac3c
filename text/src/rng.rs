//! Small deterministic pseudo-random numbers shared by the sampler and the load
//! generator: splitmix64 for seeding and stateless hashing, and the xoshiro256 state
//! (Blackman and Vigna) with both of its output functions. No dependency and fully
//! specified, so a seed means the same stream on every platform and release.

/// One splitmix64 step: advances `state` and returns a well-mixed 64-bit value.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    mix64(*state)
}

/// The splitmix64 finalizer: a bijective, avalanche-quality mix of one word.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The xoshiro256 state, seeded through splitmix64. xoshiro256** (the sampler's) and
/// xoshiro256++ (the load generator's) differ only in how a word is read off the state;
/// the state's step is this one.
#[derive(Debug, Clone)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    /// A generator whose whole state is derived from `seed`.
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Self { s }
    }

    /// The next word of xoshiro256**.
    #[inline]
    pub fn next_star_star(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        self.advance();
        result
    }

    /// The next word of xoshiro256++.
    #[inline]
    pub fn next_plus_plus(&mut self) -> u64 {
        let s = &self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        self.advance();
        result
    }

    #[inline]
    fn advance(&mut self) {
        let s = &mut self.s;
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
    }
}

/// Uniform in `[0, 1)` from the top 53 bits of a random word.
#[inline]
pub fn unit_f64(word: u64) -> f64 {
    (word >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
