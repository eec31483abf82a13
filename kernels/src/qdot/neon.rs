//! The integer dot (`qdot.rs`) on aarch64 Advanced SIMD: the 32 canonical lanes live in eight
//! 4-lane registers (two per block); each lane's four products are formed exactly with `smull`
//! and two pairwise adds, then the same floating-point steps as everywhere.
//!
//! Must never: reduce partial sums before the end, or fuse `f_b`'s product into the FMA.

use super::{half_e8m0, tail_bytes, QRow, WeightRow, CHUNK, E2M1_TWICE, QBLOCK};
use crate::dot::neon::nibbles32;
use std::arch::aarch64::*;

/// Sixteen weights times sixteen activations → four sums of four consecutive products.
#[inline(always)]
unsafe fn dot4x4(w: int8x16_t, q: int8x16_t) -> int32x4_t {
    let lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(q)));
    let hi = vpaddlq_s16(vmull_high_s8(w, q));
    vpaddq_s32(lo, hi)
}

/// 32 lanes in eight registers → one f32, in the canonical tree.
#[inline(always)]
unsafe fn reduce(a: &[float32x4_t; 8]) -> f32 {
    let mut r = *a;
    for s in [4, 2, 1] {
        // Lane offset 4·s (s = 16, 8, 4): register r[i] meets r[i + s].
        for i in 0..s {
            r[i] = vaddq_f32(r[i], r[i + s]);
        }
    }
    let pair = vadd_f32(vget_low_f32(r[0]), vget_high_f32(r[0])); // s = 2
    vget_lane_f32::<0>(pair) + vget_lane_f32::<1>(pair) // s = 1
}

#[target_feature(enable = "neon")]
pub(super) unsafe fn qdots_neon<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let n = ws[0].len();
    let full = n / CHUNK;
    let mut acc = [[[vdupq_n_f32(0.0); 8]; N]; M];
    let bias = vdupq_n_u8(0x80);
    // Block `kb` of chunk `c` of row `m`: its 32 weights (two vectors) and its weight factor.
    macro_rules! step {
        ($m:expr, $c:expr, $kb:expr, $wv:expr, $wf:expr) => {{
            let (m, c, kb, wv, wf): (usize, usize, usize, [int8x16_t; 2], f32) = ($m, $c, $kb, $wv, $wf);
            let wfv = vdupq_n_f32(wf);
            for k in 0..N {
                let f = vmulq_f32(wfv, vld1q_f32(xs[k].scales8.as_ptr().add(c * 32 + 8 * kb)));
                for h in 0..2 {
                    let q = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(xs[k].biased.as_ptr().add(c * CHUNK + 32 * kb + 16 * h)), bias));
                    let p = dot4x4(wv[h], q);
                    acc[m][k][2 * kb + h] = vfmaq_f32(acc[m][k][2 * kb + h], f, vcvtq_f32_s32(p));
                }
            }
        }};
    }
    match *ws[0] {
        WeightRow::Int8 { .. } => {
            let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
            for c in 0..full {
                for m in 0..M {
                    for kb in 0..4 {
                        let base = q[m].add(c * CHUNK + 32 * kb);
                        step!(m, c, kb, [vld1q_s8(base), vld1q_s8(base.add(16))], 1.0);
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        let base = t.as_ptr().add(32 * kb) as *const i8;
                        step!(m, full, kb, [vld1q_s8(base), vld1q_s8(base.add(16))], wf[kb]);
                    }
                }
            }
        }
        WeightRow::Int4 { group, .. } => {
            let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
            let per = (group / QBLOCK).max(1);
            let eight = vdupq_n_s8(8);
            for c in 0..full {
                for m in 0..M {
                    for kb in 0..4 {
                        let [a, b] = nibbles32(p[m].add(c * CHUNK / 2 + 16 * kb));
                        let wv = [vsubq_s8(vreinterpretq_s8_u8(a), eight), vsubq_s8(vreinterpretq_s8_u8(b), eight)];
                        step!(m, c, kb, wv, *s[m].get_unchecked((4 * c + kb) / per));
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        let [a, b] = nibbles32(t.as_ptr().add(16 * kb));
                        step!(m, full, kb, [vsubq_s8(vreinterpretq_s8_u8(a), eight), vsubq_s8(vreinterpretq_s8_u8(b), eight)], wf[kb]);
                    }
                }
            }
        }
        WeightRow::Mxfp4 { .. } => {
            let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
            let lut = vld1q_s8(E2M1_TWICE.as_ptr());
            for c in 0..full {
                for m in 0..M {
                    for kb in 0..4 {
                        let [a, b] = nibbles32(p[m].add(c * CHUNK / 2 + 16 * kb));
                        step!(m, c, kb, [vqtbl1q_s8(lut, a), vqtbl1q_s8(lut, b)], half_e8m0(*s[m].get_unchecked(4 * c + kb)));
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        let [a, b] = nibbles32(t.as_ptr().add(16 * kb));
                        step!(m, full, kb, [vqtbl1q_s8(lut, a), vqtbl1q_s8(lut, b)], wf[kb]);
                    }
                }
            }
        }
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            out[m][k] = super::finish(ws[m], reduce(&acc[m][k]));
        }
    }
    out
}
