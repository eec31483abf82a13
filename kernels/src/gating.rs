//! SiLU gating (`silu(gate) ⊙ up`) defined from correctly rounded operations only — add,
//! multiply, fused multiply-add and exact bit manipulation — so that every device with IEEE
//! binary32 arithmetic and a fused `fma` gives the same bits: this CPU code, each ISA it is
//! compiled for, and the GPU shaders (`shimmer-gpu`), which implement the same steps. A libm
//! `expf` or a hardware division would not do: their last bit differs between C libraries and
//! between GPUs, and an expert must give the same output wherever it is computed.
//!
//! **The definition** (binary32, round to nearest even, no contraction beyond the `fma`s named):
//!
//! ```text
//! exp(x):  x < EXP_MIN → 0 (results near and below the smallest normal are defined away)
//!          x > EXP_MAX → +inf;  NaN → NaN
//!          k = (x · LOG2E + ROUND) − ROUND          (x·log2 e rounded to an integer, ties even)
//!          r = fma(−k, LN2_HI, x);  r = fma(−k, LN2_LO, r)
//!          p = Horner over EXP_POLY with fma, from the highest degree: p = fma(p, r, c)
//!          exp = p · 2^k            (k ∈ [−126, 128]; 2^k from its bits, k = 128 as 2^127 · 2)
//! recip(d), d ≥ 1:  d > RECIP_MAX → 0; else y = bits⁻¹(RECIP_MAGIC − bits(d)), then three times
//!          e = fma(−d, y, 1);  y = fma(y, e, y)
//! silu(x) = x · recip(1 + exp(−x))
//! swiglu(g, u) = silu(g) · u
//! ```
//!
//! Accuracy against libm's `x / (1 + exp(−x))`: within a few units in the last place (the test
//! below measures it); well inside the oracle tolerances.
//!
//! Must never: call libm or use `/` on a value that reaches an output, or change a step without
//! the GPU shaders changing with it (their tests compare bits against this file).

/// Below this, `exp` is defined as 0 (e^x would be near or below the smallest normal, 2^−126 ≈
/// e^−87.34; from here on p · 2^k is normal).
pub const EXP_MIN: f32 = f32::from_bits(0xC2AE_0000); // −87
/// Above this, `exp` is +inf (e^x ≥ 2^128 · (1 − 2^−25)).
pub const EXP_MAX: f32 = f32::from_bits(0x42B1_7217); // 88.72283

// The constants are written as bit patterns, here and in the shaders, so that no compiler's
// decimal parsing or constant folding stands between them.

/// log2(e).
pub const LOG2E: f32 = f32::from_bits(0x3FB8_AA3B);
/// 1.5 · 2^23: adding it rounds a value of magnitude < 2^22 to an integer (ties to even).
pub const ROUND: f32 = f32::from_bits(0x4B40_0000);
/// ln 2 split so that `k · LN2_HI` is exact for |k| < 2^9.
pub const LN2_HI: f32 = f32::from_bits(0x3F31_7200);
pub const LN2_LO: f32 = f32::from_bits(0x35BF_BE8E);
/// Taylor coefficients of e^r, degree 7 down to 0 (|r| ≤ ln2/2 + ε: truncation < 2^−27).
pub const EXP_POLY: [f32; 8] = [
    f32::from_bits(0x3950_0D01), // 1/5040
    f32::from_bits(0x3AB6_0B61), // 1/720
    f32::from_bits(0x3C08_8889), // 1/120
    f32::from_bits(0x3D2A_AAAB), // 1/24
    f32::from_bits(0x3E2A_AAAB), // 1/6
    0.5,
    1.0,
    1.0,
];
/// The first guess of 1/d from d's bits (an approximation within ~12 %, refined by Newton steps).
pub const RECIP_MAGIC: u32 = 0x7EF3_11C3;
/// Above this, `recip` is defined as 0 (1/d near the smallest normal; the first guess's bit trick
/// needs d's exponent below the magic's).
pub const RECIP_MAX: f32 = f32::from_bits(0x7E00_0000); // 2^125

#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// `exp` as defined above.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Written with selects rather than early returns so that the vector builds stay branch-free.
    let k = (x * LOG2E + ROUND) - ROUND;
    let mut r = fma(-k, LN2_HI, x);
    r = fma(-k, LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = fma(p, r, *c);
    }
    // k is clamped for building 2^k only; out-of-range x are replaced below. 2^128 is not an
    // f32: k = 128 scales by 2^127, then by 2 (both exact, or the overflow to +inf e^x has).
    let kc = k.clamp(-126.0, 128.0) as i32;
    let scale = f32::from_bits(((kc.min(127) + 127) as u32) << 23);
    let v = p * scale;
    let v = if kc > 127 { v * 2.0 } else { v };
    let v = if x < EXP_MIN { 0.0 } else { v };
    let v = if x > EXP_MAX { f32::INFINITY } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// `recip` as defined above, for `d ≥ 1` (what SiLU needs); NaN → NaN.
#[inline(always)]
pub fn recip(d: f32) -> f32 {
    let mut y = f32::from_bits(RECIP_MAGIC.wrapping_sub(d.to_bits()));
    for _ in 0..3 {
        let e = fma(-d, y, 1.0);
        y = fma(y, e, y);
    }
    if d > RECIP_MAX {
        0.0
    } else {
        y
    }
}

/// `silu(x) = x · recip(1 + exp(−x))`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * recip(1.0 + exp(-x))
}

/// `gate = silu(gate) ⊙ up`, in place, with the best ISA the machine has (the same bits on every
/// one: each is this loop compiled with fused multiply-adds).
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    match crate::dot::isa() {
        // SAFETY: `isa` reports AVX-512F (and AVX2+FMA) only when the CPU has them.
        crate::dot::Isa::Avx512 => return unsafe { swiglu_avx512(gate, up) },
        // SAFETY: as above, AVX2 and FMA.
        crate::dot::Isa::Avx2 => return unsafe { swiglu_avx2(gate, up) },
        _ => {}
    }
    swiglu_scalar(gate, up)
}

/// The definition, one element at a time (`mul_add` is a fused multiply-add on every target;
/// where the CPU lacks one it is a library call, slow but exact).
pub fn swiglu_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn swiglu_avx512(gate: &mut [f32], up: &[f32]) {
    // The compiler vectorises the same steps; every one is an IEEE operation, so the bits are
    // the scalar loop's.
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// The clamps gpt-oss and DeepSeek-V4 share, as torch's `clamp` makes them: the gate from above
/// only, `up` both ways; a NaN passes through.
#[inline(always)]
fn clamp_gate_up(gate: f32, up: f32, limit: f32) -> (f32, f32) {
    let g = if gate > limit { limit } else { gate };
    let u = if up > limit {
        limit
    } else if up < -limit {
        -limit
    } else {
        up
    };
    (g, u)
}

/// gpt-oss's clamped SwiGLU of one element, in transformers' order: `g = min(gate, limit)`,
/// `u = clamp(up, −limit, limit)`, `(u + 1) · (g · σ(α·g))`, with `σ(x) = recip(1 + exp(−x))`.
/// A NaN stays NaN (as torch's clamp keeps it).
#[inline(always)]
pub fn clamped_swiglu(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let (g, u) = clamp_gate_up(gate, up, limit);
    (u + 1.0) * (g * recip(1.0 + exp(-(g * alpha))))
}

/// `gate = clamped_swiglu(gate, up)`, in place, with the best ISA the machine has (the same bits
/// on every one, as `swiglu_in_place`).
pub fn clamped_swiglu_in_place(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    #[cfg(target_arch = "x86_64")]
    match crate::dot::isa() {
        // SAFETY: `isa` reports AVX-512F (and AVX2+FMA) only when the CPU has them.
        crate::dot::Isa::Avx512 => return unsafe { clamped_swiglu_avx512(gate, up, alpha, limit) },
        // SAFETY: as above, AVX2 and FMA.
        crate::dot::Isa::Avx2 => return unsafe { clamped_swiglu_avx2(gate, up, alpha, limit) },
        _ => {}
    }
    clamped_swiglu_scalar(gate, up, alpha, limit)
}

/// The definition, one element at a time.
pub fn clamped_swiglu_scalar(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_swiglu(*g, *u, alpha, limit);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn clamped_swiglu_avx512(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_swiglu(*g, *u, alpha, limit);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn clamped_swiglu_avx2(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_swiglu(*g, *u, alpha, limit);
    }
}

/// DeepSeek-V4's clamped SwiGLU of one element, in transformers' order: `g = min(gate, limit)`,
/// `u = clamp(up, −limit, limit)`, `silu(g) · u` (with `silu` as `swiglu_in_place` computes it).
/// A NaN stays NaN.
#[inline(always)]
pub fn clamped_silu(gate: f32, up: f32, limit: f32) -> f32 {
    let (g, u) = clamp_gate_up(gate, up, limit);
    silu(g) * u
}

/// `gate = clamped_silu(gate, up)`, in place, with the best ISA the machine has (the same bits
/// on every one).
pub fn clamped_silu_in_place(gate: &mut [f32], up: &[f32], limit: f32) {
    #[cfg(target_arch = "x86_64")]
    match crate::dot::isa() {
        // SAFETY: `isa` reports AVX-512F (and AVX2+FMA) only when the CPU has them.
        crate::dot::Isa::Avx512 => return unsafe { clamped_silu_avx512(gate, up, limit) },
        // SAFETY: as above, AVX2 and FMA.
        crate::dot::Isa::Avx2 => return unsafe { clamped_silu_avx2(gate, up, limit) },
        _ => {}
    }
    clamped_silu_scalar(gate, up, limit)
}

/// The definition, one element at a time.
pub fn clamped_silu_scalar(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_silu(*g, *u, limit);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn clamped_silu_avx512(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_silu(*g, *u, limit);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn clamped_silu_avx2(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = clamped_silu(*g, *u, limit);
    }
}

/// Inkling 2's softcapped SwiGLU of one element, in transformers' order: `c·tanh(x/c)` bounds
/// the gate's linear factor and `up`; the sigmoid sees the raw gate.
#[inline(always)]
pub fn softcapped_swiglu(gate: f32, up: f32, gate_cap: f32, up_cap: f32) -> f32 {
    let g = (gate / gate_cap).tanh() * gate_cap;
    let u = (up / up_cap).tanh() * up_cap;
    g * (1.0 / (1.0 + (-gate).exp())) * u
}

/// `gate = softcapped_swiglu(gate, up)`, in place (one scalar definition for every ISA).
pub fn softcapped_swiglu_in_place(gate: &mut [f32], up: &[f32], gate_cap: f32, up_cap: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = softcapped_swiglu(*g, *u, gate_cap, up_cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        let key = |v: f32| {
            let b = v.to_bits() as i64;
            if b & 0x8000_0000 != 0 {
                -(b & 0x7fff_ffff)
            } else {
                b
            }
        };
        (key(a) - key(b)).unsigned_abs() as u32
    }

    fn sweep() -> impl Iterator<Item = f32> {
        // Every 97th f32 bit pattern in [−100, 100] (≈ 22 million values), and the edges.
        let pos = (0u32..0x42C8_0000).step_by(97).map(f32::from_bits);
        pos.flat_map(|v| [v, -v]).chain([EXP_MIN, EXP_MAX, -EXP_MIN, -EXP_MAX, 0.0, -0.0])
    }

    #[test]
    fn exp_is_within_two_ulps_of_libm() {
        let mut worst = 0;
        for x in sweep() {
            let (ours, libm) = (exp(x), x.exp());
            if x < EXP_MIN {
                assert!(ours == 0.0 && libm < 1.7e-38, "exp({x}) = {ours}, libm {libm}");
                continue;
            }
            assert!(ours >= f32::MIN_POSITIVE, "exp({x}) = {ours} is subnormal");
            worst = worst.max(ulps(ours, libm));
        }
        eprintln!("exp: at most {worst} ulps from libm");
        assert!(worst <= 2, "exp is {worst} ulps from libm");
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn the_constants_are_what_their_comments_say() {
        assert_eq!(LOG2E, std::f32::consts::LOG2_E);
        assert_eq!((EXP_MIN, ROUND, RECIP_MAX), (-87.0, 1.5 * (1u32 << 23) as f32, 2f32.powi(125)));
        assert_eq!(EXP_MAX, 88.722_83);
        assert_eq!(EXP_POLY[..5], [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0]);
        assert!((LN2_HI as f64 + LN2_LO as f64 - std::f64::consts::LN_2).abs() < 1e-12);
        assert_eq!(LN2_HI.to_bits() & 0xFF, 0, "k · LN2_HI is exact for |k| < 2^9");
    }

    #[test]
    fn recip_is_within_one_ulp_of_division() {
        let mut worst = 0;
        for d in (0x3F80_0000u32..=RECIP_MAX.to_bits()).step_by(89).map(f32::from_bits) {
            worst = worst.max(ulps(recip(d), 1.0 / d));
        }
        eprintln!("recip: at most {worst} ulps from 1/d");
        assert!(worst <= 1, "recip is {worst} ulps from 1/d");
        assert_eq!(recip(1.0), 1.0);
        assert_eq!(recip(RECIP_MAX * 2.0), 0.0);
        assert_eq!(recip(f32::INFINITY), 0.0);
        assert!(recip(f32::NAN).is_nan());
    }

    #[test]
    fn silu_is_within_a_few_ulps_of_libm_and_keeps_the_edges() {
        let mut worst = 0;
        for x in sweep() {
            let libm = x / (1.0 + (-x).exp());
            let ours = silu(x);
            if x < -40.0 {
                // Very negative x: both are vanishingly small (ours is 0 · x below −87).
                assert!(ours.abs() <= libm.abs() * 1.001 && libm.abs() < 1e-15, "silu({x}) = {ours}, libm {libm}");
                continue;
            }
            worst = worst.max(ulps(ours, libm));
        }
        eprintln!("silu: at most {worst} ulps from libm");
        assert!(worst <= 4, "silu is {worst} ulps from libm");
        assert!(silu(f32::NAN).is_nan());
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert!(silu(f32::NEG_INFINITY).is_nan(), "−inf · 0, as −inf / inf is in libm");
        assert_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn every_isa_gives_the_scalar_bits() {
        let gate: Vec<f32> = sweep().step_by(1013).chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| ((i as f32) * 0.618).sin() * 3.0).collect();
        let mut want = gate.clone();
        swiglu_scalar(&mut want, &up);
        let mut got = gate.clone();
        swiglu_in_place(&mut got, &up);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        #[cfg(target_arch = "x86_64")]
        for isa in crate::dot::Isa::all_available() {
            let mut got = gate.clone();
            match isa {
                // SAFETY: `all_available` lists only ISAs this CPU has.
                crate::dot::Isa::Avx512 => unsafe { swiglu_avx512(&mut got, &up) },
                crate::dot::Isa::Avx2 => unsafe { swiglu_avx2(&mut got, &up) },
                _ => swiglu_scalar(&mut got, &up),
            }
            assert_eq!(bits(&got), bits(&want), "{isa:?}");
        }
    }

    #[test]
    fn softcapped_swiglu_is_its_definition() {
        for (g, u) in [(0.3f32, -0.7f32), (5.0, 40.0), (-6.0, 2.0), (0.0, 1.0)] {
            let (gd, ud) = (f64::from(g), f64::from(u));
            let want = (gd / 4.0).tanh() * 4.0 / (1.0 + (-gd).exp()) * (ud / 25.0).tanh() * 25.0;
            assert!((f64::from(softcapped_swiglu(g, u, 4.0, 25.0)) - want).abs() < 1e-5, "{g} {u}");
        }
        let mut gate = vec![0.3f32, 5.0];
        softcapped_swiglu_in_place(&mut gate, &[-0.7, 40.0], 4.0, 25.0);
        assert_eq!(gate, [softcapped_swiglu(0.3, -0.7, 4.0, 25.0), softcapped_swiglu(5.0, 40.0, 4.0, 25.0)]);
    }

    #[test]
    fn clamped_silu_clamps_as_transformers_does_and_every_isa_agrees() {
        let limit = 1.5f32;
        let gate: Vec<f32> = (0..67).map(|i| (i as f32 - 33.0) * 0.11).collect();
        let up: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut want = gate.clone();
        clamped_silu_scalar(&mut want, &up, limit);
        for ((w, g), u) in want.iter().zip(&gate).zip(&up) {
            // The definition: silu of the clamped gate times the clamped up, in f64 as a check.
            let (g, u) = (f64::from(g.min(limit)), f64::from(u.clamp(-limit, limit)));
            assert!((f64::from(*w) - g / (1.0 + (-g).exp()) * u).abs() < 1e-5);
        }
        assert_eq!(clamped_silu(9.0, 0.5, limit), clamped_silu(limit, 0.5, limit));
        assert_eq!(clamped_silu(-9.0, 0.5, limit), silu(-9.0) * 0.5, "the gate is clamped from above only");
        assert_eq!(clamped_silu(0.7, -9.0, limit), clamped_silu(0.7, -limit, limit));
        assert!(clamped_silu(f32::NAN, 0.5, limit).is_nan());
        let mut got = gate.clone();
        clamped_silu_in_place(&mut got, &up, limit);
        assert_eq!(got, want);
        #[cfg(target_arch = "x86_64")]
        {
            let mut got = gate.clone();
            match crate::dot::isa() {
                // SAFETY: only on a CPU that has the ISA.
                crate::dot::Isa::Avx512 => unsafe { clamped_silu_avx512(&mut got, &up, limit) },
                crate::dot::Isa::Avx2 => unsafe { clamped_silu_avx2(&mut got, &up, limit) },
                _ => clamped_silu_scalar(&mut got, &up, limit),
            }
            assert_eq!(got, want);
        }
    }

    #[test]
    fn clamped_swiglu_clamps_as_transformers_does_and_every_isa_agrees() {
        let (alpha, limit) = (1.702f32, 1.5f32);
        let libm = |g: f32, u: f32| {
            let (g, u) = (g.min(limit), u.clamp(-limit, limit));
            (u as f64 + 1.0) * (g as f64 / (1.0 + (-(g as f64) * alpha as f64).exp()))
        };
        let gate: Vec<f32> = sweep().step_by(4099).map(|x| x / 20.0).chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| ((i as f32) * 0.618).sin() * 3.0).collect();
        let mut want = gate.clone();
        clamped_swiglu_scalar(&mut want, &up, alpha, limit);
        for ((w, g), u) in want.iter().zip(&gate).zip(&up) {
            if g.is_nan() {
                assert!(w.is_nan());
            } else if g.is_finite() {
                let r = libm(*g, *u);
                assert!((*w as f64 - r).abs() <= 1e-6 * r.abs().max(1e-30) + 1e-37, "gate {g} up {u}: {w} vs {r}");
            }
        }
        // Above the limit the gate is the limit; the up side is clamped both ways.
        assert_eq!(clamped_swiglu(9.0, 0.5, alpha, limit), clamped_swiglu(limit, 0.5, alpha, limit));
        assert_eq!(clamped_swiglu(0.7, -9.0, alpha, limit), clamped_swiglu(0.7, -limit, alpha, limit));
        assert_eq!(clamped_swiglu(0.7, 9.0, alpha, limit), clamped_swiglu(0.7, limit, alpha, limit));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut got = gate.clone();
        clamped_swiglu_in_place(&mut got, &up, alpha, limit);
        assert_eq!(bits(&got), bits(&want));
        #[cfg(target_arch = "x86_64")]
        for isa in crate::dot::Isa::all_available() {
            let mut got = gate.clone();
            match isa {
                // SAFETY: `all_available` lists only ISAs this CPU has.
                crate::dot::Isa::Avx512 => unsafe { clamped_swiglu_avx512(&mut got, &up, alpha, limit) },
                crate::dot::Isa::Avx2 => unsafe { clamped_swiglu_avx2(&mut got, &up, alpha, limit) },
                _ => clamped_swiglu_scalar(&mut got, &up, alpha, limit),
            }
            assert_eq!(bits(&got), bits(&want), "{isa:?}");
        }
    }
}
