//! The integer dot (`qdot.rs`) on x86-64: AVX-512 VNNI keeps the 32 canonical lanes in two
//! registers (two blocks each), AVX2 and AVX-VNNI in four (one block each); both form each
//! block's eight partial sums exactly in i32 and then take the same floating-point steps.
//!
//! Must never: reduce partial sums horizontally before the end, or fuse `f_b`'s product into
//! the FMA (both would change the bits).

use super::{half_e8m0, tail_bytes, QRow, WeightRow, CHUNK, E2M1_TWICE, QBLOCK};
use crate::dot::x86::{reduce256, reduce512};
use crate::dot::Group;
use std::arch::x86_64::*;

/// 32 packed bytes → their 64 nibbles as bytes, in element order (low nibble first): each byte
/// widened to 16 bits holds its low nibble in its low byte and, shifted by 4, its high nibble in
/// its high byte.
#[inline(always)]
unsafe fn nibbles64(p: *const u8) -> __m512i {
    let x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
    _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi16::<4>(x)), _mm512_set1_epi16(0x0f0f))
}

/// 16 packed bytes → 32 nibbles as bytes, in element order.
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let x = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
    _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi16::<4>(x)), _mm256_set1_epi16(0x0f0f))
}

/// Lanes 0–7 `a`, lanes 8–15 `b`.
#[inline(always)]
unsafe fn pair(a: f32, b: f32) -> __m512 {
    _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
pub(super) unsafe fn qdots_avx512vnni<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let n = ws[0].len();
    let full = n / CHUNK;
    let mut acc = [[[_mm512_setzero_ps(); 2]; N]; M];
    let (zero, bias) = (_mm512_setzero_si512(), _mm512_set1_epi8(-128));
    let unit = matches!(ws[0], WeightRow::Int8 { .. });
    let ones = _mm512_set1_ps(1.0);
    // One chunk of row `m`: its 128 weights as bytes (two vectors) and its four block factors.
    // `Σ (q + 128)·w − 128·Σ w` is the signed sum `vpdpbusd` cannot take directly. int8's
    // factor is 1 (`1 · d = d` exactly); padding blocks have `d = 0` and zero weights.
    macro_rules! step {
        ($m:expr, $c:expr, $wv:expr, $wsv:expr) => {{
            // `wsv`: the weight factors of blocks 4c, 4c+1 | 4c+2, 4c+3, eight lanes each.
            let (m, c, wv, wsv): (usize, usize, [__m512i; 2], [__m512; 2]) = ($m, $c, $wv, $wsv);
            for h in 0..2 {
                let corr = _mm512_dpbusd_epi32(zero, bias, wv[h]);
                for k in 0..N {
                    let xb = _mm512_loadu_si512(xs[k].biased.as_ptr().add(c * CHUNK + 64 * h) as *const __m512i);
                    let p = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xb, wv[h]), corr);
                    let dv = _mm512_loadu_ps(xs[k].scales8.as_ptr().add(c * 32 + 16 * h));
                    let f = if unit { dv } else { _mm512_mul_ps(wsv[h], dv) };
                    acc[m][k][h] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(p), acc[m][k][h]);
                }
            }
        }};
    }
    match *ws[0] {
        WeightRow::Int8 { .. } => {
            let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
            for c in 0..full {
                for m in 0..M {
                    let base = q[m].add(c * CHUNK);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK));
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK + 64));
                    let wv = [_mm512_loadu_si512(base as *const __m512i), _mm512_loadu_si512(base.add(64) as *const __m512i)];
                    step!(m, c, wv, [ones; 2]);
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, _) = tail_bytes(ws[m], full * CHUNK);
                    let base = t.as_ptr();
                    let wv = [_mm512_loadu_si512(base as *const __m512i), _mm512_loadu_si512(base.add(64) as *const __m512i)];
                    step!(m, full, wv, [ones; 2]);
                }
            }
        }
        WeightRow::Int4 { group, .. } => {
            let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
            let per = Group::new(group);
            let eight = _mm512_set1_epi8(8);
            // The step's weight factors as two 16-lane vectors (blocks 4c, 4c+1 | 4c+2, 4c+3),
            // from memory without broadcasts for the common groups.
            let (lo, hi) =
                (_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
            for c in 0..full {
                for m in 0..M {
                    let base = p[m].add(c * CHUNK / 2);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK / 2) as *const i8);
                    let wv = [_mm512_sub_epi8(nibbles64(base), eight), _mm512_sub_epi8(nibbles64(base.add(32)), eight)];
                    let sm = s[m].as_ptr();
                    let wsv = match group {
                        32 => {
                            let v = _mm512_castps128_ps512(_mm_loadu_ps(sm.add(4 * c)));
                            [_mm512_permutexvar_ps(lo, v), _mm512_permutexvar_ps(hi, v)]
                        }
                        64 => [_mm512_set1_ps(*sm.add(2 * c)), _mm512_set1_ps(*sm.add(2 * c + 1))],
                        128 => [_mm512_set1_ps(*sm.add(c)); 2],
                        _ => {
                            let b = 4 * c;
                            [
                                pair(*sm.add(per.of(b * QBLOCK)), *sm.add(per.of((b + 1) * QBLOCK))),
                                pair(*sm.add(per.of((b + 2) * QBLOCK)), *sm.add(per.of((b + 3) * QBLOCK))),
                            ]
                        }
                    };
                    step!(m, c, wv, wsv);
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    let wv = [_mm512_sub_epi8(nibbles64(t.as_ptr()), eight), _mm512_sub_epi8(nibbles64(t.as_ptr().add(32)), eight)];
                    step!(m, full, wv, [pair(wf[0], wf[1]), pair(wf[2], wf[3])]);
                }
            }
        }
        WeightRow::Mxfp4 { .. } => {
            let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(E2M1_TWICE.as_ptr() as *const __m128i));
            for c in 0..full {
                for m in 0..M {
                    let base = p[m].add(c * CHUNK / 2);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK / 2) as *const i8);
                    let wv = [_mm512_shuffle_epi8(lut, nibbles64(base)), _mm512_shuffle_epi8(lut, nibbles64(base.add(32)))];
                    let e = s[m].as_ptr().add(4 * c);
                    let wf = [half_e8m0(*e), half_e8m0(*e.add(1)), half_e8m0(*e.add(2)), half_e8m0(*e.add(3))];
                    step!(m, c, wv, [pair(wf[0], wf[1]), pair(wf[2], wf[3])]);
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    let wv = [_mm512_shuffle_epi8(lut, nibbles64(t.as_ptr())), _mm512_shuffle_epi8(lut, nibbles64(t.as_ptr().add(32)))];
                    step!(m, full, wv, [pair(wf[0], wf[1]), pair(wf[2], wf[3])]);
                }
            }
        }
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            out[m][k] = super::finish(ws[m], reduce512(_mm512_add_ps(acc[m][k][0], acc[m][k][1])));
        }
    }
    out
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn qdots_avx2<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    qdots_ymm::<M, N, false>(ws, xs)
}

#[target_feature(enable = "avx2,fma,avxvnni")]
pub(super) unsafe fn qdots_avxvnni<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    qdots_ymm::<M, N, true>(ws, xs)
}

/// Both 256-bit paths; `VNNI` picks `vpdpbusd` over `pmaddubsw` + `pmaddwd` (inlined into each
/// caller, which gives it its target features).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
unsafe fn qdots_ymm<const M: usize, const N: usize, const VNNI: bool>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let n = ws[0].len();
    let full = n / CHUNK;
    let mut acc = [[[_mm256_setzero_ps(); 4]; N]; M];
    let (zero, bias, ones) = (_mm256_setzero_si256(), _mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    // Block `kb` of chunk `c` of row `m`: 32 weights as bytes and the block's weight factor.
    macro_rules! step {
        ($m:expr, $c:expr, $kb:expr, $wv:expr, $wf:expr) => {{
            let (m, c, kb, wv, wf): (usize, usize, usize, __m256i, f32) = ($m, $c, $kb, $wv, $wf);
            let (corr, wabs) = if VNNI { (_mm256_dpbusd_avx_epi32(zero, bias, wv), zero) } else { (zero, _mm256_abs_epi8(wv)) };
            let wfv = _mm256_set1_ps(wf);
            for k in 0..N {
                let xb = _mm256_loadu_si256(xs[k].biased.as_ptr().add(c * CHUNK + 32 * kb) as *const __m256i);
                let p = if VNNI {
                    _mm256_sub_epi32(_mm256_dpbusd_avx_epi32(zero, xb, wv), corr)
                } else {
                    // |w| · (q with w's sign): no pair of products reaches i16's limit (2 · 128 · 127).
                    let q = _mm256_xor_si256(xb, bias);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(q, wv)), ones)
                };
                let dv = _mm256_loadu_ps(xs[k].scales8.as_ptr().add(c * 32 + 8 * kb));
                let f = _mm256_mul_ps(wfv, dv);
                acc[m][k][kb] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), acc[m][k][kb]);
            }
        }};
    }
    match *ws[0] {
        WeightRow::Int8 { .. } => {
            let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
            for c in 0..full {
                for m in 0..M {
                    let base = q[m].add(c * CHUNK);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK));
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK + 64));
                    for kb in 0..4 {
                        step!(m, c, kb, _mm256_loadu_si256(base.add(32 * kb) as *const __m256i), 1.0);
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        step!(m, full, kb, _mm256_loadu_si256(t.as_ptr().add(32 * kb) as *const __m256i), wf[kb]);
                    }
                }
            }
        }
        WeightRow::Int4 { group, .. } => {
            let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
            let per = Group::new(group);
            let eight = _mm256_set1_epi8(8);
            for c in 0..full {
                for m in 0..M {
                    let base = p[m].add(c * CHUNK / 2);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK / 2) as *const i8);
                    for kb in 0..4 {
                        let wv = _mm256_sub_epi8(nibbles32(base.add(16 * kb)), eight);
                        step!(m, c, kb, wv, *s[m].get_unchecked(per.of((4 * c + kb) * QBLOCK)));
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        step!(m, full, kb, _mm256_sub_epi8(nibbles32(t.as_ptr().add(16 * kb)), eight), wf[kb]);
                    }
                }
            }
        }
        WeightRow::Mxfp4 { .. } => {
            let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
            let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_TWICE.as_ptr() as *const __m128i));
            for c in 0..full {
                for m in 0..M {
                    let base = p[m].add(c * CHUNK / 2);
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(8 * CHUNK / 2) as *const i8);
                    for kb in 0..4 {
                        let wv = _mm256_shuffle_epi8(lut, nibbles32(base.add(16 * kb)));
                        step!(m, c, kb, wv, half_e8m0(*s[m].get_unchecked(4 * c + kb)));
                    }
                }
            }
            if full * CHUNK < n {
                for m in 0..M {
                    let (t, wf) = tail_bytes(ws[m], full * CHUNK);
                    for kb in 0..4 {
                        step!(m, full, kb, _mm256_shuffle_epi8(lut, nibbles32(t.as_ptr().add(16 * kb))), wf[kb]);
                    }
                }
            }
        }
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            let a = &acc[m][k];
            // s = 16 (lanes of blocks 0, 1 meet those of 2, 3), then s = 8, then 4, 2, 1.
            let s16 = [_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])];
            out[m][k] = super::finish(ws[m], reduce256(_mm256_add_ps(s16[0], s16[1])));
        }
    }
    out
}
