//! Fixed-point accumulation of weighted expert outputs (DESIGN.md §1).
//!
//! Each row's Σ wₑ·FFNₑ(x) is summed as i64 at a scale of 2⁻³²: integer addition is associative,
//! so partial sums formed on different workers, in any order, merge into the same bit pattern as
//! one box summing everything. |value| must stay below 2³¹; beyond that the sum is refused rather
//! than saturated, because a clamped hidden state would silently be a different model.

/// Units per 1.0.
pub const FIXED_SCALE: f64 = 4294967296.0; // 2^32
const LIMIT: f64 = 2147483648.0; // 2^31: |acc| stays < 2^63 even after adding many terms
/// `LIMIT`'s bit pattern as an f32 (exact: a power of two).
#[cfg(target_arch = "x86_64")]
const LIMIT_F32_BITS: i32 = 0x4F00_0000;

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
    accumulate_weighted_with(crate::dot::isa(), acc, y, w)
}

/// `accumulate_weighted` with `isa`'s instructions where it has a version (the scalar loop
/// otherwise; AVX-512 without DQ takes the AVX2 one).
fn accumulate_weighted_with(isa: crate::dot::Isa, acc: &mut [i64], y: &[f32], w: f32) -> Result<(), FixedPointOverflow> {
    assert!(isa.available(), "{} is not available here", isa.name());
    match isa {
        // SAFETY: AVX-512 F and BW (available, asserted) and DQ (checked) are present.
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx512 if std::is_x86_feature_detected!("avx512dq") => unsafe { accumulate_weighted_avx512(acc, y, w) },
        // SAFETY: AVX2 is available (asserted; every AVX-512 machine has it too).
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx2 | crate::dot::Isa::Avx512 => unsafe { accumulate_weighted_avx2(acc, y, w) },
        _ => accumulate_weighted_scalar(acc, y, w),
    }
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

/// `accumulate_weighted_scalar` with 256-bit registers, which have no conversion between f64
/// and i64: the same f32 product, taken apart into its integer mantissa `m` (24 bits at most)
/// and exponent, so that `y · w · 2³²` is `m · 2^e` exactly and its ties-away rounding is
/// `m << e` for `e ≥ 0` and `(m + 2^(−e−1)) >> −e` otherwise (a shift of 64 or more gives 0,
/// as does any `−e ≥ 25`). The range check is on the bit pattern (`|f| < 2³¹` and not NaN is
/// `abs bits < bits(2³¹)`). A group of eight with a value out of range is left to the scalar
/// loop, as in the AVX-512 version.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn accumulate_weighted_avx2(acc: &mut [i64], y: &[f32], w: f32) -> Result<(), FixedPointOverflow> {
    use std::arch::x86_64::*;
    let n = acc.len().min(y.len());
    let wv = _mm256_set1_ps(w);
    let (abs_mask, limit_bits) = (_mm256_set1_epi32(0x7FFF_FFFF), _mm256_set1_epi32(LIMIT_F32_BITS));
    let (mantissa_mask, implicit, exp_mask) = (_mm256_set1_epi32(0x007F_FFFF), _mm256_set1_epi32(0x0080_0000), _mm256_set1_epi32(0xFF));
    // An f32 with biased exponent `b` (`b ≥ 1`) is `m · 2^(b − 150)`; times 2³² that is
    // `m · 2^(b − 118)`.
    let (bias, one, zero) = (_mm256_set1_epi32(118), _mm256_set1_epi64x(1), _mm256_setzero_si256());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, within both slices.
        let bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(y.as_ptr().add(i)), wv));
        let abs = _mm256_and_si256(bits, abs_mask);
        if _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(limit_bits, abs))) != 0xFF {
            return accumulate_weighted_scalar(&mut acc[i..n], &y[i..n], w);
        }
        let biased_exp = _mm256_and_si256(_mm256_srli_epi32::<23>(abs), exp_mask);
        // Subnormals (biased exponent 0) have no implicit bit and the exponent of 1.
        let normal = _mm256_cmpgt_epi32(biased_exp, zero);
        let m = _mm256_or_si256(_mm256_and_si256(abs, mantissa_mask), _mm256_and_si256(normal, implicit));
        let e = _mm256_sub_epi32(_mm256_max_epi32(biased_exp, _mm256_set1_epi32(1)), bias);
        let (left, right) = (_mm256_max_epi32(e, zero), _mm256_max_epi32(_mm256_sub_epi32(zero, e), zero));
        let negative = _mm256_srai_epi32::<31>(bits);
        let a = acc.as_mut_ptr().add(i);
        for half in 0..2 {
            let wide = |v: __m256i| _mm256_cvtepi32_epi64(if half == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) });
            let (m, left, right, sign) = (wide(m), wide(left), wide(right), wide(negative));
            // `1 << (right − 1)` as `(1 << right) >> 1`: 0 when `right` is 0, and past 63.
            let half_unit = _mm256_srli_epi64::<1>(_mm256_sllv_epi64(one, right));
            let magnitude = _mm256_sllv_epi64(_mm256_srlv_epi64(_mm256_add_epi64(m, half_unit), right), left);
            let value = _mm256_sub_epi64(_mm256_xor_si256(magnitude, sign), sign);
            let at = a.add(4 * half).cast::<__m256i>();
            _mm256_storeu_si256(at, _mm256_add_epi64(_mm256_loadu_si256(at), value));
        }
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
                    same_on_every_isa(&start, &y, w, &format!("len {len} scale {scale} w {w}"));
                }
            }
        }
        // Exact ties after scaling (k + 0.5 units), both signs.
        let y: Vec<f32> = (0..64).map(|k| (k as f32 - 32.0 + 0.5) / FIXED_SCALE as f32).collect();
        same_on_every_isa(&[0i64; 64], &y, 1.0, "ties");
        // Every exponent in range (subnormals, zeros and values just under 2^31 included): any
        // sign and mantissa, the biased exponent folded below 158 (2^31's).
        let y: Vec<f32> = (0..4096)
            .map(|_| {
                let bits = (next() >> 32) as u32;
                f32::from_bits((bits & 0x807F_FFFF) | (((bits >> 23) & 0xFF) % 158) << 23)
            })
            .collect();
        for chunk in y.chunks(64) {
            same_on_every_isa(&[7i64; 64], chunk, 1.0, "bit patterns");
            same_on_every_isa(&[7i64; 64], chunk, -0.5, "bit patterns, w −0.5");
        }
        for bad in [f32::NAN, f32::INFINITY, 3e9, 2147483648.0, -2147483648.0] {
            let mut y: Vec<f32> = (0..40).map(|k| k as f32 * 0.1).collect();
            y[21] = bad;
            let mut a = vec![5i64; 40];
            assert!(accumulate_weighted(&mut a, &y, 1.0).is_err(), "{bad}");
            same_on_every_isa(&[5i64; 40], &y, 1.0, &format!("partial sums before {bad}"));
        }
    }

    /// Every ISA's result, error and partial sums are the scalar loop's.
    fn same_on_every_isa(start: &[i64], y: &[f32], w: f32, what: &str) {
        let mut want = start.to_vec();
        let want_result = accumulate_weighted_scalar(&mut want, y, w);
        for isa in crate::dot::Isa::all_available() {
            let mut got = start.to_vec();
            let result = accumulate_weighted_with(isa, &mut got, y, w);
            assert_eq!(format!("{result:?}"), format!("{want_result:?}"), "{} {what}", isa.name());
            assert_eq!(got, want, "{} {what}", isa.name());
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
