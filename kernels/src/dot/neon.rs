//! The canonical dot (`dot.rs`) on aarch64 Advanced SIMD: the 64 lanes live in sixteen 4-lane
//! registers and reduce in the same tree, so results equal the scalar definition bit for bit.
//! f16 weights (rare in MoE checkpoints) decode through `half` per chunk, as stable Rust has no
//! f16 vector conversion yet.
//!
//! Must never: reorder the sum, or fuse the format's `value · scale` product into the FMA.

use super::{tail_chunk, Group, WeightRow, LANES};
use shimmer_common::quant::{e8m0_to_f32, E2M1, MXFP4_GROUP};
use std::arch::aarch64::*;

const REGS: usize = LANES / 4;

/// Lanes 0–63 in sixteen registers → one f32, in the canonical tree.
#[inline(always)]
unsafe fn reduce(a: &[float32x4_t; REGS]) -> f32 {
    let mut r = *a;
    for s in [8, 4, 2, 1] {
        // Lane offset 4·s: register r[i] meets r[i + s].
        for i in 0..s {
            r[i] = vaddq_f32(r[i], r[i + s]);
        }
    }
    let pair = vadd_f32(vget_low_f32(r[0]), vget_high_f32(r[0])); // s = 2
    vget_lane_f32::<0>(pair) + vget_lane_f32::<1>(pair) // s = 1
}

/// 16 bytes of nibbles → 32 values as two byte vectors, in element order.
#[inline(always)]
pub(crate) unsafe fn nibbles32(p: *const u8) -> [uint8x16_t; 2] {
    let b = vld1q_u8(p);
    let lo = vandq_u8(b, vdupq_n_u8(0x0f));
    let hi = vshrq_n_u8::<4>(b);
    [vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)]
}

/// 16 byte values (0–255) → four vectors of u32.
#[inline(always)]
unsafe fn widen16(b: uint8x16_t) -> [uint32x4_t; 4] {
    let (lo, hi) = (vmovl_u8(vget_low_u8(b)), vmovl_u8(vget_high_u8(b)));
    [vmovl_u16(vget_low_u16(lo)), vmovl_u16(vget_high_u16(lo)), vmovl_u16(vget_low_u16(hi)), vmovl_u16(vget_high_u16(hi))]
}

/// Four fp8-e4m3 bytes (as u32 lanes) → f32: normals re-biased in the bit pattern, subnormals
/// `m · 2⁻⁹` (exact), `S.1111.111` NaN.
#[inline(always)]
unsafe fn fp8x4(b: uint32x4_t) -> float32x4_t {
    let mag = vandq_u32(b, vdupq_n_u32(0x7f));
    let normal = vaddq_u32(vshlq_n_u32::<20>(mag), vdupq_n_u32(120 << 23));
    let sub = vreinterpretq_u32_f32(vmulq_f32(vcvtq_f32_u32(mag), vdupq_n_f32(1.0 / 512.0)));
    let is_sub = vceqq_u32(vshrq_n_u32::<3>(mag), vdupq_n_u32(0));
    let v = vorrq_u32(vbslq_u32(is_sub, sub, normal), vshlq_n_u32::<24>(vandq_u32(b, vdupq_n_u32(0x80))));
    let nan = vceqq_u32(mag, vdupq_n_u32(0x7f));
    vreinterpretq_f32_u32(vbslq_u32(nan, vdupq_n_u32(f32::NAN.to_bits()), v))
}

#[target_feature(enable = "neon")]
pub(super) unsafe fn dots_neon<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
    let n = ws[0].len();
    let full = n / LANES;
    let mut acc = [[[vdupq_n_f32(0.0); REGS]; N]; M];
    // `$decode` gives chunk `$c` of row `$m` as sixteen vectors of four lanes.
    macro_rules! run {
        (|$m:ident, $c:ident| $decode:expr) => {
            for $c in 0..full {
                for $m in 0..M {
                    let wv: [float32x4_t; REGS] = $decode;
                    for j in 0..REGS {
                        for k in 0..N {
                            acc[$m][k][j] = vfmaq_f32(acc[$m][k][j], wv[j], vld1q_f32(xs[k].as_ptr().add($c * LANES + j * 4)));
                        }
                    }
                }
            }
        };
    }
    match *ws[0] {
        WeightRow::F32(_) => {
            let v = fields!(ws, WeightRow::F32(v) => v.as_ptr());
            run!(|m, c| std::array::from_fn(|j| vld1q_f32(v[m].add(c * LANES + j * 4))))
        }
        WeightRow::Bf16(_) => {
            let v = fields!(ws, WeightRow::Bf16(v) => v.as_ptr());
            run!(|m, c| std::array::from_fn(|j| vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(v[m].add(c * LANES + j * 4))))))
        }
        WeightRow::F16(_) => {
            let v = fields!(ws, WeightRow::F16(v) => v);
            run!(|m, c| {
                let mut t = [0.0f32; LANES];
                for (l, o) in t.iter_mut().enumerate() {
                    *o = half::f16::from_bits(*v[m].get_unchecked(c * LANES + l)).to_f32();
                }
                std::array::from_fn(|j| vld1q_f32(t.as_ptr().add(j * 4)))
            })
        }
        WeightRow::Int8 { .. } => {
            let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
            run!(|m, c| {
                let mut out = [vdupq_n_f32(0.0); REGS];
                for s in 0..4 {
                    let b = vld1q_s8(q[m].add(c * LANES + s * 16));
                    let (lo, hi) = (vmovl_s8(vget_low_s8(b)), vmovl_s8(vget_high_s8(b)));
                    let parts = [vmovl_s16(vget_low_s16(lo)), vmovl_s16(vget_high_s16(lo)), vmovl_s16(vget_low_s16(hi)), vmovl_s16(vget_high_s16(hi))];
                    for (t, p) in parts.into_iter().enumerate() {
                        out[s * 4 + t] = vcvtq_f32_s32(p);
                    }
                }
                out
            })
        }
        WeightRow::Int4 { group, .. } => {
            let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
            let grp = Group::new(group);
            run!(|m, c| {
                let mut out = [vdupq_n_f32(0.0); REGS];
                for half_chunk in 0..2 {
                    for (b, bytes) in nibbles32(p[m].add(c * LANES / 2 + half_chunk * 16)).into_iter().enumerate() {
                        for (t, u) in widen16(bytes).into_iter().enumerate() {
                            let r = half_chunk * 8 + b * 4 + t;
                            let q = vsubq_s32(vreinterpretq_s32_u32(u), vdupq_n_s32(8));
                            let scale = shimmer_common::quant::int4_scale(*s[m].get_unchecked(grp.of(c * LANES + r * 4)));
                            out[r] = vmulq_f32(vcvtq_f32_s32(q), vdupq_n_f32(scale));
                        }
                    }
                }
                out
            })
        }
        WeightRow::Fp8 { group, .. } => {
            let (q, s) = (fields!(ws, WeightRow::Fp8 { q, .. } => q.as_ptr()), fields!(ws, WeightRow::Fp8 { scales, .. } => scales));
            let grp = Group::new(group);
            run!(|m, c| {
                let mut out = [vdupq_n_f32(0.0); REGS];
                for sub in 0..4 {
                    for (t, u) in widen16(vld1q_u8(q[m].add(c * LANES + sub * 16))).into_iter().enumerate() {
                        let r = sub * 4 + t;
                        let scale = *s[m].get_unchecked(grp.of(c * LANES + r * 4));
                        out[r] = vmulq_f32(fp8x4(u), vdupq_n_f32(scale));
                    }
                }
                out
            })
        }
        WeightRow::Int6 { .. } => run!(|m, c| {
            let t = super::decoded::<LANES>(ws[m], c * LANES);
            std::array::from_fn(|j| vld1q_f32(t.as_ptr().add(j * 4)))
        }),
        WeightRow::Mxfp4 { .. } => {
            let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
            // Every e2m1 value's f32 bit pattern is zero below bit 16: look up its two top bytes.
            let (top, second): ([u8; 16], [u8; 16]) =
                (std::array::from_fn(|i| (E2M1[i].to_bits() >> 24) as u8), std::array::from_fn(|i| (E2M1[i].to_bits() >> 16) as u8));
            let (top, second) = (vld1q_u8(top.as_ptr()), vld1q_u8(second.as_ptr()));
            run!(|m, c| {
                let mut out = [vdupq_n_f32(0.0); REGS];
                for half_chunk in 0..2 {
                    for (b, idx) in nibbles32(p[m].add(c * LANES / 2 + half_chunk * 16)).into_iter().enumerate() {
                        let (hi, lo) = (vqtbl1q_u8(top, idx), vqtbl1q_u8(second, idx));
                        let words = [vreinterpretq_u16_u8(vzip1q_u8(lo, hi)), vreinterpretq_u16_u8(vzip2q_u8(lo, hi))];
                        for (w, word) in words.into_iter().enumerate() {
                            for (t, bits) in [vshll_n_u16::<16>(vget_low_u16(word)), vshll_n_u16::<16>(vget_high_u16(word))].into_iter().enumerate() {
                                let r = half_chunk * 8 + b * 4 + w * 2 + t;
                                let scale = e8m0_to_f32(*s[m].get_unchecked((c * LANES + r * 4) / MXFP4_GROUP));
                                out[r] = vmulq_f32(vreinterpretq_f32_u32(bits), vdupq_n_f32(scale));
                            }
                        }
                    }
                }
                out
            })
        }
    }
    if full * LANES < n {
        for m in 0..M {
            for k in 0..N {
                let (wt, xt) = tail_chunk(ws[m], xs[k], full * LANES, n);
                for (j, a) in acc[m][k].iter_mut().enumerate() {
                    *a = vfmaq_f32(*a, vld1q_f32(wt.as_ptr().add(j * 4)), vld1q_f32(xt.as_ptr().add(j * 4)));
                }
            }
        }
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            out[m][k] = super::scaled(ws[m], reduce(&acc[m][k]));
        }
    }
    out
}
