//! `e^x` for softmax, eight lanes at a time, with the same bits on every path.
//!
//! The attention softmax takes one exponential per score: at 3,072 prompt
//! tokens that is over a billion calls per prefill, and the C library's
//! scalar `expf` was about half of prefill's time. This one is Cephes'
//! `expf` (Cody-Waite range reduction, a degree-5 polynomial; within 2 ulp
//! of the exact value): every step is one IEEE operation (no fused
//! multiply-add), so the portable loop and the AVX2 lanes give the same
//! bits, and a score's result does not depend on which path or lane ran it.

/// Below this `e^x` is under `f32::MIN_POSITIVE`; the result is 0.
const LOW: f32 = -87.336_54;
/// Above this `e^x` overflows; callers (softmax) only pass `x <= 0`.
const HIGH: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n * LN2_HI` is exact for every `n` this range can give.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (ties to even).
const ROUND: f32 = 12_582_912.0;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];

/// `e^x` for `x <= 88` (0 below about -87.34, and for `-inf`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // The comparisons are written as the AVX2 path's `max_ps`/`min_ps` and
    // `cmp_ps(LT)` behave, NaN included.
    let lo = if x > LOW { x } else { LOW };
    let c = if lo < HIGH { lo } else { HIGH };
    let n = (c * LOG2E + ROUND) - ROUND;
    let r = (c - n * LN2_HI) - n * LN2_LO;
    let z = r * r;
    let mut y = P[0];
    for p in &P[1..] {
        y = y * r + p;
    }
    let y = (y * z + r) + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < LOW {
        0.0
    } else {
        y * scale
    }
}

/// `s[j] = e^(s[j] - m)` for every `j`; each element exactly as [`exp`].
#[inline(always)]
pub fn exp_shifted(s: &mut [f32], m: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { avx2::exp_shifted(s, m) };
    }
    for v in s {
        *v = exp(*v - m);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::exp`] on eight lanes, operation for operation.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn exp8(x: __m256) -> __m256 {
        // max_ps/min_ps return the second operand when either is NaN,
        // like the portable comparisons.
        let lo = _mm256_max_ps(x, _mm256_set1_ps(LOW));
        let c = _mm256_min_ps(lo, _mm256_set1_ps(HIGH));
        let round = _mm256_set1_ps(ROUND);
        let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(LOG2E)), round), round);
        let r = _mm256_sub_ps(_mm256_sub_ps(c, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))), _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
        let z = _mm256_mul_ps(r, r);
        let mut y = _mm256_set1_ps(P[0]);
        for p in &P[1..] {
            y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(*p));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let v = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LOW));
        _mm256_andnot_ps(under, v)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn exp_shifted(s: &mut [f32], m: f32) {
        let mv = _mm256_set1_ps(m);
        let mut chunks = s.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv);
            _mm256_storeu_ps(c.as_mut_ptr(), exp8(x));
        }
        for v in chunks.into_remainder() {
            *v = exp(*v - m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two positive floats.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn within_two_ulp_of_the_exact_value_over_the_softmax_range() {
        let mut worst = 0;
        let mut x = 0f32;
        while x > -87.0 {
            let want = (x as f64).exp() as f32;
            let got = exp(x);
            if want >= f32::MIN_POSITIVE {
                worst = worst.max(ulps(got, want));
            }
            x -= 0.000_731;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!((exp(1.0) - std::f32::consts::E).abs() < 1e-6);
    }

    #[test]
    fn every_lane_equals_the_portable_result_bit_for_bit() {
        // Every float bit pattern from 0 down to -inf in strides, plus
        // the edges; the AVX2 path (when present) against the scalar one.
        let mut xs: Vec<f32> = (0..=0xff80_0000u32 - 0x8000_0000).step_by(997).map(|b| f32::from_bits(0x8000_0000 | b)).collect();
        xs.extend([0.0, -0.0, LOW, LOW - 1e-5, LOW + 1e-5, f32::NEG_INFINITY, -1e-30, 3.5, 88.0]);
        let mut fast = xs.clone();
        exp_shifted(&mut fast, 0.0);
        for (x, f) in xs.iter().zip(&fast) {
            assert_eq!(f.to_bits(), exp(*x).to_bits(), "x = {x:e}");
        }
        let mut shifted = vec![1.25f32, -3.0, 7.5, 2.0, 0.0, -80.0, 9.0, 1.0, 4.0, 6.5];
        let want: Vec<u32> = shifted.iter().map(|v| exp(v - 9.0).to_bits()).collect();
        exp_shifted(&mut shifted, 9.0);
        assert_eq!(shifted.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }
}
