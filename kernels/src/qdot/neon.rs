//! The integer dot (`qdot.rs`) on aarch64 Advanced SIMD: the 32 canonical lanes live in eight
//! 4-lane registers (register `i` holds lanes `4i .. 4i + 4`); each lane's four products are
//! formed exactly with `smull` and two pairwise adds on signed weights (no offset needed), then
//! the same floating-point steps as everywhere.
//!
//! Must never: reduce partial sums before the end, or fuse `f_b`'s product into the FMA.

use super::{Fmt, QRow, RawRow, CHUNK, E2M1_TWICE};
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
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
pub(super) unsafe fn qdots_neon<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let full = n / CHUNK;
    let mut acc = [[[vdupq_n_f32(0.0); 8]; N]; M];
    match fmt {
        Fmt::Int8 => {
            let bias = vdupq_n_u8(0x80);
            // Block `kb` of chunk `c` of row `m` (32 weights at `base`, factor `wf`): lanes
            // 8·kb .. 8·kb + 8, registers 2·kb and 2·kb + 1.
            for c in 0..full + usize::from(full * CHUNK < n) {
                for m in 0..M {
                    let tail = (c == full).then(|| rows[m].tail(fmt, n, c * CHUNK));
                    let base = tail.as_ref().map_or(rows[m].data.add(c * CHUNK), |t| t.0.as_ptr());
                    for kb in 0..4 {
                        let wf = tail.as_ref().map_or(1.0, |t| t.1[kb]);
                        let wv = [vld1q_s8(base.add(32 * kb) as *const i8), vld1q_s8(base.add(32 * kb + 16) as *const i8)];
                        let wfv = vdupq_n_f32(wf);
                        for k in 0..N {
                            let f = vmulq_f32(wfv, vld1q_f32(xs[k].scales8.as_ptr().add(c * 32 + 8 * kb)));
                            for h in 0..2 {
                                let q = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(xs[k].biased.as_ptr().add(c * CHUNK + 32 * kb + 16 * h)), bias));
                                let p = dot4x4(wv[h], q);
                                acc[m][k][2 * kb + h] = vfmaq_f32(acc[m][k][2 * kb + h], f, vcvtq_f32_s32(p));
                            }
                        }
                    }
                }
            }
        }
        Fmt::Int4 { .. } | Fmt::Int6 { .. } | Fmt::Mxfp4 => {
            // The 8-lane order (`qdot.rs`): block `kb` of a chunk is packed bytes 16·kb .. +16,
            // its low nibbles the even elements, its high ones the odd; `dot4x4` of both gives
            // four sums of eight elements, pairs of which are the block's half sums. Lanes 0–3
            // (one register) are blocks 0 and 2's halves, lanes 4–7 blocks 1 and 3's.
            let (mask, eight, top, thirty_two) = (vdupq_n_u8(0x0f), vdupq_n_s8(8), vdupq_n_u8(0x30), vdupq_n_s8(32));
            let lut = vld1q_s8(E2M1_TWICE.as_ptr());
            let (mx, i6) = (fmt == Fmt::Mxfp4, matches!(fmt, Fmt::Int6 { .. }));
            for c in 0..full + usize::from(full * CHUNK < n) {
                for m in 0..M {
                    let tail = (c == full).then(|| rows[m].tail(fmt, n, c * CHUNK));
                    let base = tail.as_ref().map_or(rows[m].data.add(c * CHUNK / 2), |t| t.0.as_ptr());
                    let wf: [f32; 4] = tail.as_ref().map_or_else(|| std::array::from_fn(|kb| rows[m].factor(fmt, 4 * c + kb)), |t| t.1);
                    let mut w = [[vdupq_n_s8(0); 2]; 4];
                    for (kb, wk) in w.iter_mut().enumerate() {
                        let v = vld1q_u8(base.add(16 * kb));
                        let (lo, hi) = (vandq_u8(v, mask), vshrq_n_u8::<4>(v));
                        *wk = if mx {
                            [vqtbl1q_s8(lut, lo), vqtbl1q_s8(lut, hi)]
                        } else if i6 {
                            // The top bits of these 16 bytes' elements (`quant::Int6Matrix`):
                            // bytes 0–31 of a chunk keep them at bits 0–1 (even) and 4–5 (odd),
                            // bytes 32–63 at 2–3 and 6–7.
                            let h = vld1q_u8(rows[m].hi.add(c * 32 + 16 * (kb % 2)));
                            let (even, odd) = if kb < 2 { (vshlq_n_u8::<4>(h), h) } else { (vshlq_n_u8::<2>(h), vshrq_n_u8::<2>(h)) };
                            let u = [vorrq_u8(lo, vandq_u8(even, top)), vorrq_u8(hi, vandq_u8(odd, top))];
                            [vsubq_s8(vreinterpretq_s8_u8(u[0]), thirty_two), vsubq_s8(vreinterpretq_s8_u8(u[1]), thirty_two)]
                        } else {
                            [vsubq_s8(vreinterpretq_s8_u8(lo), eight), vsubq_s8(vreinterpretq_s8_u8(hi), eight)]
                        };
                    }
                    let ws = [vld1q_f32([wf[0], wf[0], wf[2], wf[2]].as_ptr()), vld1q_f32([wf[1], wf[1], wf[3], wf[3]].as_ptr())];
                    for k in 0..N {
                        let q = xs[k].split.as_ptr().add(c * CHUNK);
                        let sums: [int32x4_t; 4] =
                            std::array::from_fn(|kb| vaddq_s32(dot4x4(w[kb][0], vld1q_s8(q.add(16 * kb))), dot4x4(w[kb][1], vld1q_s8(q.add(64 + 16 * kb)))));
                        let p = [vpaddq_s32(sums[0], sums[2]), vpaddq_s32(sums[1], sums[3])];
                        for (h, ph) in p.into_iter().enumerate() {
                            let d = vld1q_f32(xs[k].lane_scales.as_ptr().add(c * 8 + 4 * h));
                            acc[m][k][h] = vfmaq_f32(acc[m][k][h], vmulq_f32(ws[h], d), vcvtq_f32_s32(ph));
                        }
                    }
                }
            }
            let mut out = [[0.0f32; N]; M];
            for m in 0..M {
                for k in 0..N {
                    // s = 4 (the two registers), 2, 1.
                    let v4 = vaddq_f32(acc[m][k][0], acc[m][k][1]);
                    let pair = vadd_f32(vget_low_f32(v4), vget_high_f32(v4));
                    out[m][k] = vget_lane_f32::<0>(pair) + vget_lane_f32::<1>(pair);
                }
            }
            return out;
        }
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            let r = reduce(&acc[m][k]);
            out[m][k] = if fmt == Fmt::Int8 { rows[m].scale * r } else { r };
        }
    }
    out
}
