//! FP8 E4M3 (OCP "e4m3fn"): the KV cache's 1-byte element type.
//!
//! Sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, `0x7f` and
//! `0xff` are NaN, the largest finite value is 448. Encoding rounds to nearest
//! (ties to even) and saturates at ±448, as KV caches want: a large key is
//! clipped, never turned into NaN. `kernels/cuda/common.cuh` does the same
//! arithmetic, so both backends write identical bytes.

/// Every byte's value, built at compile time.
static DECODE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = decode_slow(b as u8);
        b += 1;
    }
    t
};

const fn decode_slow(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xf) as u32, (b & 7) as u32);
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    if e == 0 {
        return sign * m as f32 * (1.0 / 512.0); // subnormal: m x 2^-9
    }
    sign * f32::from_bits(((e + 120) << 23) | (m << 20))
}

/// The f32 value of an E4M3 byte (exact).
#[inline(always)]
pub fn decode(b: u8) -> f32 {
    DECODE[b as usize]
}

/// The nearest E4M3 byte to `f` (ties to even), saturating at ±448.
pub fn encode(f: f32) -> u8 {
    let sign = ((f.to_bits() >> 24) & 0x80) as u8;
    let a = f.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 0.015625 {
        // Below 2^-6: multiples of 2^-9 (the scaling is exact), rounded half to even;
        // 8 x 2^-9 is the smallest normal and encodes as 0x08, which is what 8 gives.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xff) - 120; // rebias 127 -> 7
    let mant = bits & 0x7f_ffff;
    let (mut r, rest) = (mant >> 20, mant & 0xf_ffff);
    if rest > 0x8_0000 || (rest == 0x8_0000 && r & 1 == 1) {
        r += 1;
    }
    let out = ((exp << 3) + r).min(0x7e); // a mantissa carry moves into the exponent
    sign | out as u8
}

/// Decodes a run of bytes.
#[inline]
pub fn decode_slice(src: &[u8], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = decode(b);
    }
}

/// Encodes a run of values.
#[inline]
pub fn encode_slice(src: &[f32], dst: &mut [u8]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = encode(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_byte_survives_a_round_trip() {
        for b in 0..=255u8 {
            if b & 0x7f == 0x7f {
                assert!(decode(b).is_nan());
                continue;
            }
            assert_eq!(encode(decode(b)), b, "byte {b:#04x} = {}", decode(b));
        }
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0x08), 0.015625);
        assert_eq!(decode(0x01), 1.0 / 512.0);
    }

    #[test]
    fn encoding_rounds_to_nearest_and_ties_to_even() {
        // Every value halfway between neighbours rounds to the one with an even mantissa;
        // anything off the midpoint rounds to the nearer neighbour.
        for b in 0..0x7du8 {
            let (lo, hi) = (decode(b), decode(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(encode(mid), even, "midpoint of {lo} and {hi}");
            assert_eq!(encode(mid - (mid - lo) / 4.0), b);
            assert_eq!(encode(mid + (hi - mid) / 4.0), b + 1);
            assert_eq!(encode(-mid), 0x80 | even);
        }
    }

    #[test]
    fn large_values_saturate_and_nan_stays_nan() {
        assert_eq!(encode(1e9), 0x7e);
        assert_eq!(encode(-1e9), 0xfe);
        assert_eq!(encode(f32::INFINITY), 0x7e);
        assert_eq!(encode(464.0), 0x7e); // 480 is not an E4M3 value: everything past 448 saturates
        assert!(decode(encode(f32::NAN)).is_nan());
        assert_eq!(encode(1e-9), 0);
    }
}
