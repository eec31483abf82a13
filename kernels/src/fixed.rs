//! Fixed-point accumulation of weighted expert outputs (DESIGN.md §1).
//!
//! Each row's Σ wₑ·FFNₑ(x) is summed as i64 at a scale of 2⁻³²: integer addition is associative,
//! so partial sums formed on different workers, in any order, merge into the same bit pattern as
//! one box summing everything. |value| must stay below 2³¹; beyond that the sum is refused rather
//! than saturated, because a clamped hidden state would silently be a different model.

/// Units per 1.0.
pub const FIXED_SCALE: f64 = 4294967296.0; // 2^32
const LIMIT: f64 = 2147483648.0; // 2^31: |acc| stays < 2^63 even after adding many terms

#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("expert output {value} is outside the fixed-point accumulator's range (|x| < 2^31)")]
pub struct FixedPointOverflow {
    pub value: f32,
}

/// `acc[i] += round(y[i] · 2³²)`, where the caller has already formed y = w·FFN(x) in f32.
pub fn accumulate(acc: &mut [i64], y: &[f32]) -> Result<(), FixedPointOverflow> {
    for (a, v) in acc.iter_mut().zip(y) {
        let f = *v as f64;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // written so that NaN is refused too
        if !(f.abs() < LIMIT) {
            return Err(FixedPointOverflow { value: *v });
        }
        *a = a.wrapping_add(round_half_away(f * FIXED_SCALE));
    }
    Ok(())
}

/// `accumulate(acc, y · w)`: the product formed in f32 element by element, as the caller of
/// `accumulate` would, without a buffer for it.
pub fn accumulate_weighted(acc: &mut [i64], y: &[f32], w: f32) -> Result<(), FixedPointOverflow> {
    #[cfg(target_arch = "x86_64")]
    if crate::dot::isa() == crate::dot::Isa::Avx512 && std::is_x86_feature_detected!("avx512dq") {
        // SAFETY: AVX-512 F, BW (`isa`) and DQ (checked) are present.
        return unsafe { accumulate_weighted_avx512(acc, y, w) };
    }
    accumulate_weighted_scalar(acc, y, w)
}

/// `accumulate_weighted`'s definition; the vector version gives its bits and its errors.
pub fn accumulate_weighted_scalar(acc: &mut [i64], y: &[f32], w: f32) -> Result<(), FixedPointOverflow> {
    for (a, v) in acc.iter_mut().zip(y) {
        let weighted = v * w;
        let f = weighted as f64;
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // written so that NaN is refused too
        if !(f.abs() < LIMIT) {
            return Err(FixedPointOverflow { value: weighted });
        }
        *a = a.wrapping_add(round_half_away(f * FIXED_SCALE));
    }
    Ok(())
}

/// `accumulate_weighted_scalar`, eight values at a time: the same f32 product, widening, range
/// check, scaling and ties-away rounding (truncate, compare the exact remainder with ±0.5) in
/// 64-bit lanes. A group of eight with a value out of range is left to the scalar loop, which
/// adds the values before it and reports the same one.
///
/// # Safety
/// The CPU must have AVX-512 F and DQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn accumulate_weighted_avx512(acc: &mut [i64], y: &[f32], w: f32) -> Result<(), FixedPointOverflow> {
    use std::arch::x86_64::*;
    let n = acc.len().min(y.len());
    let (wv, scale, limit) = (_mm256_set1_ps(w), _mm512_set1_pd(FIXED_SCALE), _mm512_set1_pd(LIMIT));
    let (half, neg_half, one) = (_mm512_set1_pd(0.5), _mm512_set1_pd(-0.5), _mm512_set1_epi64(1));
    let abs_mask = _mm512_castsi512_pd(_mm512_set1_epi64(i64::MAX));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, within both slices.
        let f = _mm512_cvtps_pd(_mm256_mul_ps(_mm256_loadu_ps(y.as_ptr().add(i)), wv));
        // Ordered less-than: NaN fails it, as in the scalar test.
        if _mm512_cmp_pd_mask::<_CMP_LT_OQ>(_mm512_and_pd(f, abs_mask), limit) != 0xFF {
            return accumulate_weighted_scalar(&mut acc[i..n], &y[i..n], w);
        }
        let x = _mm512_mul_pd(f, scale);
        let t = _mm512_cvttpd_epi64(x);
        let frac = _mm512_sub_pd(x, _mm512_cvtepi64_pd(t));
        let up = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(frac, half);
        let down = _mm512_cmp_pd_mask::<_CMP_LE_OQ>(frac, neg_half);
        let r = _mm512_mask_sub_epi64(_mm512_mask_add_epi64(t, up, t, one), down, t, one);
        let a = acc.as_mut_ptr().add(i).cast::<__m512i>();
        _mm512_storeu_si512(a, _mm512_add_epi64(_mm512_loadu_si512(a), r));
        i += 8;
    }
    accumulate_weighted_scalar(&mut acc[i..n], &y[i..n], w)
}

/// `x.round() as i64` for |x| < 2^63 — ties away from zero — without `round`, which a baseline
/// x86-64 build calls in libm (a measurable share of a small model's decode: this runs for every
/// element of every expert's output). Truncation is one instruction, and `x - trunc(x)` is exact
/// in f64 for every such x (both have the same sign and exponent or the difference is below
/// 2^52), so comparing it with ±0.5 decides the tie exactly as `round` does.
#[inline(always)]
fn round_half_away(x: f64) -> i64 {
    let t = x as i64;
    let frac = x - t as f64;
    if frac >= 0.5 {
        t + 1
    } else if frac <= -0.5 {
        t - 1
    } else {
        t
    }
}

/// Adds another partial sum (e.g. one worker's) into `acc`.
pub fn merge(acc: &mut [i64], other: &[i64]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a = a.wrapping_add(*b);
    }
}

pub fn to_f32(acc: &[i64], out: &mut [f32]) {
    for (o, a) in out.iter_mut().zip(acc) {
        *o = (*a as f64 / FIXED_SCALE) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector sum gives the scalar one's bits, and on a value out of range the same error
    /// and the same partial sums.
    #[test]
    fn the_vector_sum_gives_the_scalar_bits_and_errors() {
        let mut s = 11u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for len in [0usize, 1, 7, 8, 9, 31, 256, 1000] {
            for scale in [1e-12f32, 0.5, 3.0, 1e6, 1e9] {
                let y: Vec<f32> = (0..len).map(|_| ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale).collect();
                let start: Vec<i64> = (0..len).map(|_| (next() >> 8) as i64 - (1 << 55)).collect();
                for w in [0.25f32, -0.731, 1.0] {
                    let (mut a, mut b) = (start.clone(), start.clone());
                    let ra = accumulate_weighted(&mut a, &y, w);
                    let rb = accumulate_weighted_scalar(&mut b, &y, w);
                    assert_eq!(ra, rb, "len {len} scale {scale}");
                    assert_eq!(a, b, "len {len} scale {scale} w {w}");
                }
            }
        }
        // Exact ties after scaling (k + 0.5 units), both signs.
        let y: Vec<f32> = (0..64).map(|k| (k as f32 - 32.0 + 0.5) / FIXED_SCALE as f32).collect();
        let (mut a, mut b) = (vec![0i64; 64], vec![0i64; 64]);
        assert_eq!(accumulate_weighted(&mut a, &y, 1.0), accumulate_weighted_scalar(&mut b, &y, 1.0));
        assert_eq!(a, b);
        for bad in [f32::NAN, f32::INFINITY, 3e9] {
            let mut y: Vec<f32> = (0..40).map(|k| k as f32 * 0.1).collect();
            y[21] = bad;
            let (mut a, mut b) = (vec![5i64; 40], vec![5i64; 40]);
            let (ra, rb) = (accumulate_weighted(&mut a, &y, 1.0), accumulate_weighted_scalar(&mut b, &y, 1.0));
            assert!(ra.is_err());
            assert_eq!(format!("{ra:?}"), format!("{rb:?}"));
            assert_eq!(a, b, "partial sums before {bad}");
        }
    }

    #[test]
    fn rounding_matches_round_ties_away_everywhere_the_sum_reaches() {
        let mut xs = vec![0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999999999999994, -0.49999999999999994, 4503599627370495.5, -4503599627370495.5];
        xs.extend([2f64.powi(52), 2f64.powi(53) + 2.0, -(2f64.powi(62)), 2f64.powi(62) * 1.5, 9.2e18, -9.2e18]);
        let mut s = 0x9E3779B97F4A7C15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Every exponent from tiny to 2^62, both signs, with the units digit's neighbours.
            let e = (s % 64) as i32 - 2;
            let m = (s >> 11) as f64 / (1u64 << 53) as f64;
            let x = if s & 1 == 0 { m * 2f64.powi(e) } else { -m * 2f64.powi(e) };
            xs.extend([x, x.trunc() + 0.5, x.trunc() - 0.5]);
        }
        for x in xs {
            if x.abs() < 9.2e18 {
                assert_eq!(round_half_away(x), x.round() as i64, "{x:e}");
            }
        }
    }

    #[test]
    fn order_and_grouping_do_not_change_the_sum() {
        let terms: Vec<Vec<f32>> = (0..8).map(|e| (0..16).map(|i| ((e * 16 + i) as f32).sin() * 10f32.powi(e % 4 - 2)).collect()).collect();
        let mut one_box = vec![0i64; 16];
        for t in &terms {
            accumulate(&mut one_box, t).unwrap();
        }
        // "worker A" takes the odd experts in reverse, "worker B" the even ones; merge B then A.
        let (mut a, mut b) = (vec![0i64; 16], vec![0i64; 16]);
        for t in terms.iter().skip(1).step_by(2).rev() {
            accumulate(&mut a, t).unwrap();
        }
        for t in terms.iter().step_by(2) {
            accumulate(&mut b, t).unwrap();
        }
        let mut merged = vec![0i64; 16];
        merge(&mut merged, &b);
        merge(&mut merged, &a);
        assert_eq!(merged, one_box);
        let mut out = vec![0.0f32; 16];
        to_f32(&one_box, &mut out);
        for i in 0..16 {
            let exact: f64 = terms.iter().map(|t| t[i] as f64).sum();
            assert!((out[i] as f64 - exact).abs() < 1e-6 * exact.abs().max(1.0));
        }
    }

    #[test]
    fn weighted_accumulation_is_accumulation_of_the_f32_products() {
        let y: Vec<f32> = (0..64).map(|i| ((i * 37) as f32).sin() * 3.7).collect();
        for w in [0.3f32, 1.0, -0.77, 1e-7] {
            let (mut a, mut b) = (vec![5i64; 64], vec![5i64; 64]);
            accumulate(&mut a, &y.iter().map(|v| v * w).collect::<Vec<f32>>()).unwrap();
            accumulate_weighted(&mut b, &y, w).unwrap();
            assert_eq!(a, b, "w = {w}");
        }
        assert!(accumulate_weighted(&mut [0i64], &[2.0e9], 2.0).is_err());
    }

    #[test]
    fn out_of_range_values_are_refused_not_clamped() {
        let mut acc = vec![0i64; 2];
        assert!(accumulate(&mut acc, &[1.0, 3.0e9]).is_err());
        assert!(accumulate(&mut acc, &[f32::NAN, 0.0]).is_err());
    }
}
