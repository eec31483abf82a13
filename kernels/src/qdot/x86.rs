//! The integer dot (`qdot.rs`) on x86-64. int8: AVX-512 VNNI keeps the 32 canonical lanes in
//! two registers, AVX2 and AVX-VNNI in four, each group's partial sum formed exactly in i32, the
//! weights meeting the activations offset to unsigned (`q + 128`, the offset's sum over the
//! weights taken back per vector) or, on AVX2, `|w|` meeting `q` with `w`'s sign. The 4-bit
//! formats: the weights are the unsigned side themselves (int4's nibble, int6's six bits,
//! MXFP4's `2·e2m1 + 12`), masked or shifted out of their bytes against the activations' even
//! and odd runs; a chunk's sums of eight elements are paired into its eight half-block sums
//! (`vphaddd` on 256-bit registers; on 512-bit ones two dot products' at once, by two `vpermt2d`
//! and an add), the offset's sums over the activations (`neg8`, `neg12`) added, and one convert
//! and one FMA go into one 256-bit accumulator a dot product (on AVX-512 two dot products share
//! a register's halves) — so an AVX2 pass takes a weight row against four activation rows.
//!
//! Must never: reduce the float lanes before the end, or fuse `f_b`'s product into the FMA
//! (both would change the bits).

use super::{Fmt, QMatrix, QRow, RawRow, CHUNK, E2M1_TWICE_PLUS12, NLANES, QBLOCK};
use crate::dot::x86::{reduce256, reduce512, PREFETCH_AHEAD};
use shimmer_common::quant::int4_scale;
use std::arch::x86_64::*;

/// The first `len` of 64 bytes (all of them from 64 on).
#[inline(always)]
fn byte_mask(len: usize) -> u64 {
    if len >= 64 {
        u64::MAX
    } else {
        (1u64 << len) - 1
    }
}

/// Four int4 scales (f16 bits) as f32, exactly as `quant::int4_scale` decodes each (`vcvtph2ps`
/// is exact for every f16, subnormals included, whatever MXCSR says).
#[inline(always)]
unsafe fn int4_scales4(p: *const u16) -> __m128 {
    _mm_cvtph_ps(_mm_loadl_epi64(p as *const __m128i))
}

/// A chunk's four block factors (one per block `kb`) in the 4-bit lanes' order: lane
/// `nibble_lane(kb, t)` takes block `kb`'s, i.e. `[f0, f0, f2, f2, f1, f1, f3, f3]`.
#[inline(always)]
unsafe fn by_lane(f: __m128) -> __m256 {
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3))
}

/// The four weight factors of 4-bit chunk `c`, by lane (`by_lane`), without scalar code for the
/// common groups.
#[inline(always)]
unsafe fn factors8(fmt: Fmt, row: &RawRow, c: usize) -> __m256 {
    match fmt {
        Fmt::Int4 { group: 32 } | Fmt::Int6 { group: 32 } => by_lane(int4_scales4((row.scales as *const u16).add(4 * c))),
        Fmt::Int4 { group: 64 } | Fmt::Int6 { group: 64 } => {
            // Blocks 0 and 1 take the first scale, 2 and 3 the second: [s0, s0, s1, s1] twice.
            let s = (row.scales as *const u16).add(2 * c);
            let (s0, s1) = (int4_scale(s.read_unaligned()), int4_scale(s.add(1).read_unaligned()));
            _mm256_setr_ps(s0, s0, s1, s1, s0, s0, s1, s1)
        }
        Fmt::Int4 { group: 128 } | Fmt::Int6 { group: 128 } => _mm256_set1_ps(int4_scale((row.scales as *const u16).add(c).read_unaligned())),
        Fmt::Mxfp4 => {
            // `half_e8m0` of the chunk's four e8m0 bytes at once: (e − 1) << 23, the subnormal
            // 1 << (21 + e) for e ≤ 1, NaN for 255.
            let e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((row.scales.add(4 * c) as *const i32).read_unaligned()));
            let normal = _mm_slli_epi32::<23>(_mm_sub_epi32(e, _mm_set1_epi32(1)));
            let subnormal = _mm_sllv_epi32(_mm_set1_epi32(1), _mm_add_epi32(e, _mm_set1_epi32(21)));
            let bits = _mm_blendv_epi8(normal, subnormal, _mm_cmplt_epi32(e, _mm_set1_epi32(2)));
            let bits = _mm_blendv_epi8(bits, _mm_set1_epi32(f32::NAN.to_bits() as i32), _mm_cmpeq_epi32(e, _mm_set1_epi32(255)));
            by_lane(_mm_castsi128_ps(bits))
        }
        _ => {
            let b = 4 * c;
            by_lane(_mm_setr_ps(row.factor(fmt, b), row.factor(fmt, b + 1), row.factor(fmt, b + 2), row.factor(fmt, b + 3)))
        }
    }
}

/// The factors of the row's last, partial chunk from `start`, by lane: 0 for blocks past the
/// row (`RawRow::tail_factors`), whose sums are 0 — `fma(0, 0, acc) = acc`, `acc` never −0.
#[inline(always)]
unsafe fn tail_factors8(fmt: Fmt, row: &RawRow, n: usize, start: usize) -> __m256 {
    let f = row.tail_factors(fmt, n, start);
    by_lane(_mm_setr_ps(f[0], f[1], f[2], f[3]))
}

/// `tail_factors8` with AVX-512's masked loads for the one-scale-a-block groups: the live
/// blocks' scales only (a row's scales end with them), 0 past them — in a row of one partial
/// chunk the factors were a fair part of the work.
#[inline(always)]
unsafe fn tail_factors8_avx512(fmt: Fmt, row: &RawRow, n: usize, start: usize) -> __m256 {
    let live = (n - start).div_ceil(QBLOCK).min(4);
    let scales = row.scales as *const u16;
    match fmt {
        Fmt::Int4 { group: 32 } | Fmt::Int6 { group: 32 } => {
            let bits = _mm512_maskz_loadu_epi16((1u32 << live) - 1, scales.add(start / QBLOCK) as *const i16);
            by_lane(_mm_cvtph_ps(_mm512_castsi512_si128(bits)))
        }
        // One scale the chunk (its first, the second only when blocks 2 and 3 are there),
        // kept in the live blocks' lanes.
        Fmt::Int4 { group: 128 } | Fmt::Int6 { group: 128 } => live_lanes(_mm256_set1_ps(int4_scale(scales.add(start / 128).read_unaligned())), live),
        Fmt::Int4 { group: 64 } | Fmt::Int6 { group: 64 } => {
            let s0 = int4_scale(scales.add(start / 64).read_unaligned());
            let s1 = if live > 2 { int4_scale(scales.add(start / 64 + 1).read_unaligned()) } else { 0.0 };
            live_lanes(_mm256_setr_ps(s0, s0, s1, s1, s0, s0, s1, s1), live)
        }
        _ => tail_factors8(fmt, row, n, start),
    }
}

/// `f`'s lanes of a chunk's first `live` blocks (`nibble_lane`'s order), 0 in the others.
#[inline(always)]
unsafe fn live_lanes(f: __m256, live: usize) -> __m256 {
    // Lane l's block is [0, 0, 2, 2, 1, 1, 3, 3][l]: live when below `live`.
    let blocks = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(live as i32), blocks);
    _mm256_and_ps(f, _mm256_castsi256_ps(keep))
}

/// int6's top bits of one chunk (the 32 bytes at `hi`) at bits 4–5 of the bytes its low nibbles
/// decode to (`quant::Int6Matrix`'s layout): the even elements' then the odd ones', each as the
/// 64 bytes of the chunk's packed nibbles hold them — bytes 0–31 the first 64 values, whose tops
/// sit at bits 0–1 (even) and 4–5 (odd), bytes 32–63 the next 64, at bits 2–3 and 6–7. Shifts
/// are per 16-bit word; the mask keeps only bits that came from the same byte.
#[inline(always)]
unsafe fn top_bits512(hi: *const u8) -> (__m512i, __m512i) {
    let h = _mm512_broadcast_i64x4(_mm256_loadu_si256(hi as *const __m256i));
    // Per-word counts: the low 256 bits (the first 64 values) one, the high 256 the other.
    const UPPER: __mmask32 = 0xFFFF_0000;
    let even_shift = _mm512_mask_blend_epi16(UPPER, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    let odd_shift = _mm512_mask_blend_epi16(UPPER, _mm512_setzero_si512(), _mm512_set1_epi16(2));
    let top = _mm512_set1_epi8(0x30);
    (_mm512_and_si512(_mm512_sllv_epi16(h, even_shift), top), _mm512_and_si512(_mm512_srlv_epi16(h, odd_shift), top))
}

/// `M` weight rows of one format and length `n` against `N` activation rows; every result is
/// exactly `qdot_scalar`'s. Inlined into its `target_feature` callers.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
unsafe fn core512<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    if fmt != Fmt::Int8 {
        return nibbles512::<M, N>(fmt, rows, n, xs);
    }
    let full = n / CHUNK;
    let mut acc = [[[_mm512_setzero_ps(); 2]; N]; M];
    let zero = _mm512_setzero_si512();
    {
        let bias = _mm512_set1_epi8(-128);
        // One chunk of row `m`: its 128 weights in two vectors, its blocks' factors `wsv` (1
        // for live blocks, 0 for padding; the whole chunks below take `d` itself, `1 · d = d`),
        // its first `halves` halves. `Σ (q + 128)·w − 128·Σ w` is the signed sum `vpdpbusd`
        // cannot take directly.
        macro_rules! step {
            ($m:expr, $c:expr, $wv:expr, $wsv:expr, $halves:expr) => {{
                let (m, c, wv, wsv): (usize, usize, [__m512i; 2], [__m512; 2]) = ($m, $c, $wv, $wsv);
                for h in 0..$halves {
                    let corr = _mm512_dpbusd_epi32(zero, bias, wv[h]);
                    for k in 0..N {
                        let xb = _mm512_loadu_si512(xs[k].biased.as_ptr().add(c * CHUNK + 64 * h) as *const __m512i);
                        let p = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xb, wv[h]), corr);
                        let dv = _mm512_loadu_ps(xs[k].scales8.as_ptr().add(c * 32 + 16 * h));
                        let f = _mm512_mul_ps(wsv[h], dv);
                        acc[m][k][h] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(p), acc[m][k][h]);
                    }
                }
            }};
        }
        for c in 0..full {
            // As the 4-bit formats' loop (`nibbles512`): every row's chunk (and its correction) first,
            // then each activation row loaded once for all of them; per (m, k) the same
            // operations in the same order as `step!`.
            let (mut wv, mut corr) = ([[zero; 2]; M], [[zero; 2]; M]);
            for m in 0..M {
                let base = rows[m].data.add(c * CHUNK);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK + 64) as *const i8);
                wv[m] = [_mm512_loadu_si512(base as *const __m512i), _mm512_loadu_si512(base.add(64) as *const __m512i)];
                corr[m] = [_mm512_dpbusd_epi32(zero, bias, wv[m][0]), _mm512_dpbusd_epi32(zero, bias, wv[m][1])];
            }
            for k in 0..N {
                for h in 0..2 {
                    let xb = _mm512_loadu_si512(xs[k].biased.as_ptr().add(c * CHUNK + 64 * h) as *const __m512i);
                    let dv = _mm512_loadu_ps(xs[k].scales8.as_ptr().add(c * 32 + 16 * h));
                    for m in 0..M {
                        let p = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xb, wv[m][h]), corr[m][h]);
                        acc[m][k][h] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(p), acc[m][k][h]);
                    }
                }
            }
        }
        if full * CHUNK < n {
            // The last, partial chunk read in place with masked loads (bytes past the row
            // read as 0 and never touched, so the row may end where its allocation does).
            let (start, len) = (full * CHUNK, n - full * CHUNK);
            let (k0, k1) = (byte_mask(len), byte_mask(len.saturating_sub(64)));
            // A chunk of at most 64 live bytes (the demo's down projection: 64 columns) has an
            // all-padding upper half: skipped, its accumulators stay +0, which is exactly what
            // the half would have added (weights and factors 0, `fma` into +0).
            let halves = if len > 64 { 2 } else { 1 };
            for m in 0..M {
                let base = rows[m].data.add(start);
                let wf = rows[m].tail_factors(fmt, n, start);
                // Padding blocks' factors are 0 (their weights are 0 and activations q = 0).
                let wsv = [
                    _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(wf[0]), _mm512_set1_ps(wf[1])),
                    _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(wf[2]), _mm512_set1_ps(wf[3])),
                ];
                step!(m, full, [_mm512_maskz_loadu_epi8(k0, base as *const i8), _mm512_maskz_loadu_epi8(k1, base.wrapping_add(64) as *const i8)], wsv, halves);
            }
        }
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            // s = 16: the second register's lanes meet the first's; then 8, 4, 2, 1.
            let r = reduce512(_mm512_add_ps(acc[m][k][0], acc[m][k][1]));
            out[m][k] = if fmt == Fmt::Int8 { rows[m].scale * r } else { r };
        }
    }
    out
}

/// One chunk's sixteen sums of eight products (dword `i`: elements `8i .. 8i + 8`) of weights
/// decoded to `lo` (even elements) and `hi` (odd) against the activations' split layout at `q`.
#[inline(always)]
unsafe fn sums8(q: *const i8, lo: __m512i, hi: __m512i) -> __m512i {
    let even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q as *const __m512i));
    _mm512_dpbusd_epi32(even, hi, _mm512_loadu_si512(q.add(64) as *const __m512i))
}

/// `core512` for the 4-bit formats (`qdot.rs`'s 8-lane order): per chunk, `vpdpbusd` of the low
/// nibbles (the even elements) and then of the high ones into sixteen sums of eight elements;
/// two dot products' sums (two activation rows against a weight row, or one against two weight
/// rows) are paired into their half-block sums in lane order by two `vpermt2d` and an add, the
/// offset's sums added, and one convert, one multiply (the factors) and one FMA serve both —
/// each lane's steps those of one dot product alone (`step`, for an odd one out: `vpsrlq` +
/// `vpaddd`, `vpmovqd`, `vpermq`). Before the pairing, the steps after the products were most of
/// a chunk's instructions (`docs/benchmarks.md`, 2026-12-07, third session).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
unsafe fn nibbles512<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let full = n / CHUNK;
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    // Pairs of activation rows share a 512-bit accumulator (`step_pair`), row `2j` in the low
    // half of `acc2[m][j]`; only the first `N / 2` are used.
    let mut acc2 = [[_mm512_setzero_ps(); N]; M];
    // And pairs of weight rows against the odd activation row (`step_rows_pair`).
    let mut accm = [[_mm512_setzero_ps(); N]; M];
    let rows_paired = full > 0;
    // Dword `i < 8` of a pair's half-block sums is lane `i` of the first row, `8 + i` of the
    // second (`vpermt2d`'s bit 4 picks the second source): lane `l` is block-major half
    // `[0, 1, 4, 5, 2, 3, 6, 7][l]`, the sum of sums `2·that` and `2·that + 1`.
    let even_sums = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 16, 18, 24, 26, 20, 22, 28, 30);
    let odd_sums = _mm512_add_epi32(even_sums, _mm512_set1_epi32(1));
    // `step_short_pair`'s: the first row's sums are dwords 0–7, the second's 8–15, and only
    // blocks 0 and 1 (lanes 0, 1, 4, 5 of each row) are there.
    const LIVE_SHORT: __mmask16 = 0x3333;
    let even_short = _mm512_setr_epi32(0, 2, 0, 0, 4, 6, 0, 0, 8, 10, 8, 8, 12, 14, 8, 8);
    let odd_short = _mm512_add_epi32(even_short, _mm512_set1_epi32(1));
    let zero = _mm512_setzero_si512();
    let mask = _mm512_set1_epi8(0x0f);
    let (mx, i6) = (fmt == Fmt::Mxfp4, matches!(fmt, Fmt::Int6 { .. }));
    let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(E2M1_TWICE_PLUS12.as_ptr() as *const __m128i));
    // The weights of chunk `c` of row `m` (its 64 packed bytes `x`), unsigned: the low nibbles
    // (even elements) and the high ones (odd); int6 adds each element's top bits at bits 4–5.
    macro_rules! decode {
        ($m:expr, $c:expr, $x:expr) => {{
            let x: __m512i = $x;
            let (mut lo, mut hi) = (_mm512_and_si512(x, mask), _mm512_and_si512(_mm512_srli_epi16::<4>(x), mask));
            if mx {
                (lo, hi) = (_mm512_shuffle_epi8(lut, lo), _mm512_shuffle_epi8(lut, hi));
            }
            if i6 {
                let (even, odd) = top_bits512(rows[$m].hi.add($c * 32));
                (lo, hi) = (_mm512_or_si512(lo, even), _mm512_or_si512(hi, odd));
            }
            (lo, hi)
        }};
    }
    // The offset's sums by lane: −8 (int4), −12 (MXFP4), −32 = 4 · −8 (int6).
    macro_rules! neg {
        ($k:expr, $c:expr) => {{
            let at = $c * NLANES;
            if mx {
                _mm256_loadu_si256(xs[$k].neg12.as_ptr().add(at) as *const __m256i)
            } else if i6 {
                _mm256_slli_epi32::<2>(_mm256_loadu_si256(xs[$k].neg8.as_ptr().add(at) as *const __m256i))
            } else {
                _mm256_loadu_si256(xs[$k].neg8.as_ptr().add(at) as *const __m256i)
            }
        }};
    }
    // Chunk `c` of row `m` (`lo`, `hi` decoded, `wsv` its factors by lane) against row `k`.
    macro_rules! step {
        ($m:expr, $k:expr, $c:expr, $lo:expr, $hi:expr, $wsv:expr) => {{
            let (m, k, c): (usize, usize, usize) = ($m, $k, $c);
            let v = sums8(xs[k].split.as_ptr().add(c * CHUNK), $lo, $hi);
            // Lanes 2j and 2j + 1 hold elements 16j .. 16j + 16: their sum is half-block j.
            let halves = _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64::<32>(v)));
            // Block-major (b0t0, b0t1, b1t0, …) to lane order: the middle quadwords swap.
            let p = _mm256_add_epi32(_mm256_permute4x64_epi64::<0b11_01_10_00>(halves), neg!(k, c));
            let f = _mm256_mul_ps($wsv, _mm256_loadu_ps(xs[k].lane_scales.as_ptr().add(c * NLANES)));
            acc[m][k] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), acc[m][k]);
        }};
    }
    // Chunk `c` of every row against rows `k` and `k + 1` at once: both rows' sixteen sums of
    // eight go through two `vpermt2d` (even sums, odd sums, each already in lane order) and one
    // add to both rows' eight half-block sums, and the offsets, factors, convert and FMA take
    // one 512-bit instruction for the two — per lane the very steps of `step`, half the
    // instructions after the products.
    // Activation rows `k` and `k + 1`'s offsets' sums and scales of chunk `c`, side by side.
    macro_rules! pair_of_rows {
        ($k:expr, $c:expr) => {{
            let (k, c): (usize, usize) = ($k, $c);
            let neg2 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(neg!(k, c)), neg!(k + 1, c));
            let ls = |k: usize| _mm256_castps_pd(_mm256_loadu_ps(xs[k].lane_scales.as_ptr().add(c * NLANES)));
            (neg2, _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(ls(k)), ls(k + 1))))
        }};
    }
    macro_rules! step_pair {
        ($k:expr, $c:expr, $lo:expr, $hi:expr, $wsv2:expr) => {{
            let (k, c): (usize, usize) = ($k, $c);
            let (neg2, ls2) = pair_of_rows!(k, c);
            for m in 0..M {
                let v0 = sums8(xs[k].split.as_ptr().add(c * CHUNK), $lo[m], $hi[m]);
                let v1 = sums8(xs[k + 1].split.as_ptr().add(c * CHUNK), $lo[m], $hi[m]);
                let halves = _mm512_add_epi32(_mm512_permutex2var_epi32(v0, even_sums, v1), _mm512_permutex2var_epi32(v0, odd_sums, v1));
                acc2[m][k / 2] = fma_pair(acc2[m][k / 2], $wsv2[m], ls2, halves, neg2);
            }
        }};
    }
    // `step_pair` for a last chunk of at most 64 values (the first two blocks; a row of 64, as
    // small experts' down projections have, is nothing else): its even and odd elements fill only
    // the low half of `lo` and `hi`, so the two activation rows share one register — the first's
    // 32 bytes, then the second's — against the weights' half twice over, and two `vpdpbusd`
    // form both rows' sums. The lanes of the absent blocks are 0, as in `step`.
    macro_rules! step_short_pair {
        ($k:expr, $c:expr, $lo:expr, $hi:expr, $wsv2:expr) => {{
            let (k, c): (usize, usize) = ($k, $c);
            let (qa, qb) = (xs[k].split.as_ptr().add(c * CHUNK), xs[k + 1].split.as_ptr().add(c * CHUNK));
            let join = |a: *const i8, b: *const i8| {
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i)), _mm256_loadu_si256(b as *const __m256i))
            };
            let (even_q, odd_q) = (join(qa, qb), join(qa.add(64), qb.add(64)));
            let (neg2, ls2) = pair_of_rows!(k, c);
            for m in 0..M {
                let (lo2, hi2) = (_mm512_shuffle_i64x2::<0b01_00_01_00>($lo[m], $lo[m]), _mm512_shuffle_i64x2::<0b01_00_01_00>($hi[m], $hi[m]));
                let v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo2, even_q), hi2, odd_q);
                let halves =
                    _mm512_add_epi32(_mm512_maskz_permutexvar_epi32(LIVE_SHORT, even_short, v), _mm512_maskz_permutexvar_epi32(LIVE_SHORT, odd_short, v));
                acc2[m][k / 2] = fma_pair(acc2[m][k / 2], $wsv2[m], ls2, halves, neg2);
            }
        }};
    }
    // `step_pair` turned around: weight rows `m` and `m + 1` against activation row `k`, into
    // `accm[m / 2][k]` (row `m` in the low half). A short last chunk (`step_short_pair`'s case)
    // puts both weight rows' halves in one register against the activations twice over.
    macro_rules! step_rows_pair {
        ($m:expr, $k:expr, $c:expr, $lo:expr, $hi:expr, $wsv:expr, $short:expr) => {{
            let (m, k, c): (usize, usize, usize) = ($m, $k, $c);
            let q = xs[k].split.as_ptr().add(c * CHUNK);
            let halves = if $short {
                let twice = |p: *const i8| _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
                let both = |a: __m512i, b: __m512i| _mm512_inserti64x4::<1>(a, _mm512_castsi512_si256(b));
                let v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, both($lo[m], $lo[m + 1]), twice(q)), both($hi[m], $hi[m + 1]), twice(q.add(64)));
                _mm512_add_epi32(_mm512_maskz_permutexvar_epi32(LIVE_SHORT, even_short, v), _mm512_maskz_permutexvar_epi32(LIVE_SHORT, odd_short, v))
            } else {
                let (v0, v1) = (sums8(q, $lo[m], $hi[m]), sums8(q, $lo[m + 1], $hi[m + 1]));
                _mm512_add_epi32(_mm512_permutex2var_epi32(v0, even_sums, v1), _mm512_permutex2var_epi32(v0, odd_sums, v1))
            };
            let neg2 = _mm512_broadcast_i64x4(neg!(k, c));
            let ls2 = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(xs[k].lane_scales.as_ptr().add(c * NLANES)))));
            let w2 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd($wsv[m])), _mm256_castps_pd($wsv[m + 1])));
            accm[m / 2][k] = fma_pair(accm[m / 2][k], w2, ls2, halves, neg2);
        }};
    }
    // Against every activation row: pairs, then the odd one out alone.
    macro_rules! chunk_against_all {
        ($c:expr, $lo:expr, $hi:expr, $wsv:expr, $short:expr) => {{
            let c: usize = $c;
            let wsv2: [__m512; M] = std::array::from_fn(|m| _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd($wsv[m]))));
            let mut k = 0;
            while k + 2 <= N {
                if $short {
                    step_short_pair!(k, c, $lo, $hi, wsv2);
                } else {
                    step_pair!(k, c, $lo, $hi, wsv2);
                }
                k += 2;
            }
            if k < N {
                // The odd activation row (a decode step's only one) against pairs of weight rows
                // — unless the row is one short chunk, where a row at a time ran faster on Zen 4.
                let mut m = 0;
                while rows_paired && m + 2 <= M {
                    step_rows_pair!(m, k, c, $lo, $hi, $wsv, $short);
                    m += 2;
                }
                for m in m..M {
                    step!(m, k, c, $lo[m], $hi[m], $wsv[m]);
                }
            }
        }};
    }
    for c in 0..full {
        let (mut lo, mut hi, mut wsv) = ([zero; M], [zero; M], [_mm256_setzero_ps(); M]);
        for m in 0..M {
            let base = rows[m].data.add(c * CHUNK / 2);
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK / 2) as *const i8);
            (lo[m], hi[m]) = decode!(m, c, _mm512_loadu_si512(base as *const __m512i));
            wsv[m] = factors8(fmt, &rows[m], c);
        }
        chunk_against_all!(c, lo, hi, wsv, false);
    }
    if full * CHUNK < n {
        // The last, partial chunk in place (bytes past the row read as 0, never touched; the
        // top bits are whole chunks).
        let start = full * CHUNK;
        let live = byte_mask(n.div_ceil(2) - start / 2);
        let (mut lo, mut hi, mut wsv) = ([zero; M], [zero; M], [_mm256_setzero_ps(); M]);
        for m in 0..M {
            (lo[m], hi[m]) = decode!(m, full, _mm512_maskz_loadu_epi8(live, rows[m].data.add(start / 2) as *const i8));
            wsv[m] = tail_factors8_avx512(fmt, &rows[m], n, start);
        }
        chunk_against_all!(full, lo, hi, wsv, n - start <= CHUNK / 2);
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        let mut j = 0;
        while j < N / 2 {
            // Two pairs' accumulators reduced at once; a lone pair with itself.
            let next = if j + 1 < N / 2 { j + 1 } else { j };
            let four = reduce_lanes8x4(acc2[m][j], acc2[m][next]);
            out[m][2 * j] = four[0];
            out[m][2 * j + 1] = four[1];
            if next > j {
                out[m][2 * j + 2] = four[2];
                out[m][2 * j + 3] = four[3];
            }
            j += 2;
        }
    }
    if N % 2 == 1 {
        let k = N - 1;
        let mut m = 0;
        while rows_paired && m + 4 <= M {
            let four = reduce_lanes8x4(accm[m / 2][k], accm[m / 2 + 1][k]);
            (0..4).for_each(|i| out[m + i][k] = four[i]);
            m += 4;
        }
        if rows_paired && m + 2 <= M {
            let two = reduce_lanes8x4(accm[m / 2][k], accm[m / 2][k]);
            (out[m][k], out[m + 1][k]) = (two[0], two[1]);
            m += 2;
        }
        for m in m..M {
            out[m][k] = reduce256(acc[m][k]);
        }
    }
    out
}

/// Two dot products' chunk into their shared accumulator: `halves` (both rows' half-block sums,
/// lane order) plus `neg2` (their offsets' sums), converted, times the factors `w2 · ls2`, added
/// — per lane `step`'s own steps.
#[inline(always)]
unsafe fn fma_pair(acc: __m512, w2: __m512, ls2: __m512, halves: __m512i, neg2: __m512i) -> __m512 {
    _mm512_fmadd_ps(_mm512_mul_ps(w2, ls2), _mm512_cvtepi32_ps(_mm512_add_epi32(halves, neg2)), acc)
}

/// `reduce256` of four 8-lane accumulators at once (`x` holds the first two, `y` the others):
/// each one's lanes `l` and `l + 4` are added, then `l` and `l + 2`, then 0 and 1 — the very
/// adds `reduce256` does one accumulator at a time, with a quarter of the instructions. A short
/// row's product (a small expert's down projection of 64 values) spent about as long reducing
/// its lanes as forming them.
#[inline(always)]
unsafe fn reduce_lanes8x4(x: __m512, y: __m512) -> [f32; 4] {
    // Each accumulator's lanes 0–3 (`low`) and 4–7 (`high`), one accumulator a 128-bit lane.
    let low = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    let high = _mm512_add_epi32(low, _mm512_set1_epi32(4));
    let s4 = _mm512_add_ps(_mm512_permutex2var_ps(x, low, y), _mm512_permutex2var_ps(x, high, y));
    let s2 = _mm512_add_ps(s4, _mm512_shuffle_ps::<0b11_10_11_10>(s4, s4));
    let s1 = _mm512_add_ps(s2, _mm512_shuffle_ps::<0b01_01_01_01>(s2, s2));
    let firsts = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s1);
    let mut out = [0.0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps128(firsts));
    out
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn qdots_avx512vnni<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    core512::<M, N>(fmt, rows, n, xs)
}

/// `out[i] = row(first + i) · x`, four rows a step with the loop inside the ISA's code: what a
/// call costs besides its chunks is paid once per block of rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn qmatvec_avx512vnni(w: &QMatrix<'_>, x: &QRow<'_>, first: usize, out: &mut [f32]) {
    let (fmt, n) = (w.fmt, w.cols);
    let mut chunks = out.chunks_exact_mut(4);
    let mut r = first;
    for o in &mut chunks {
        let [a, b, c, d] = core512::<4, 1>(fmt, [w.raw(r), w.raw(r + 1), w.raw(r + 2), w.raw(r + 3)], n, [x]);
        o.copy_from_slice(&[a[0], b[0], c[0], d[0]]);
        r += 4;
    }
    for o in chunks.into_remainder() {
        *o = core512::<1, 1>(fmt, [w.raw(r)], n, [x])[0][0];
        r += 1;
    }
}

/// Two matrices' rows `first + i` against one activation row (gate and up): rows `r` and
/// `r + 1` of both in one pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn qmatvec_pair_avx512vnni(a: &QMatrix<'_>, b: &QMatrix<'_>, x: &QRow<'_>, first: usize, a_out: &mut [f32], b_out: &mut [f32]) {
    let (fmt, n) = (a.fmt, a.cols);
    let rows = a_out.len();
    let mut i = 0;
    while i + 2 <= rows {
        let r = first + i;
        let [ga, ua, gb, ub] = core512::<4, 1>(fmt, [a.raw(r), b.raw(r), a.raw(r + 1), b.raw(r + 1)], n, [x]);
        (a_out[i], b_out[i], a_out[i + 1], b_out[i + 1]) = (ga[0], ua[0], gb[0], ub[0]);
        i += 2;
    }
    if i < rows {
        let [g, u] = core512::<2, 1>(fmt, [a.raw(first + i), b.raw(first + i)], n, [x]);
        (a_out[i], b_out[i]) = (g[0], u[0]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn qdots_avx2<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    core256::<M, N, false>(fmt, rows, n, xs)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn qdots_avxvnni<const M: usize, const N: usize>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    core256::<M, N, true>(fmt, rows, n, xs)
}

/// The row loops (`qmatvec`, `qmatvec_pair`, `qmatmul_t`, `qmatmul_pair_t`) on 256-bit
/// registers, the loop inside the ISA's code as on AVX-512: a call per pair of rows cost as much
/// as a short row's chunks (`qdots_rows`' checks and dispatch each time). A pass takes one weight
/// row against one or two activation rows: four or eight accumulators and what a step needs fit
/// the sixteen registers. Two weight rows a pass (the 2 × 1 tile, what these loops did first)
/// left LLVM keeping the accumulators in memory, and on Zen 3 it ran slower than one row at a
/// time — whole-model decode of m1b rose 17–23 % without it (`docs/benchmarks.md`); a 2 × 4 tile
/// as on AVX-512 would spill outright. Every result is `core256`'s, so `qdot_scalar`'s.
macro_rules! rows256 {
    ($isa:literal, $vnni:literal, $matvec:ident, $matvec_pair:ident, $matmul_t:ident, $matmul_pair_t:ident) => {
        /// `out[i] = row(first + i) · x`, a row a pass.
        #[target_feature(enable = $isa)]
        pub(super) unsafe fn $matvec(w: &QMatrix<'_>, x: &QRow<'_>, first: usize, out: &mut [f32]) {
            let (fmt, n) = (w.fmt, w.cols);
            for (i, o) in out.iter_mut().enumerate() {
                *o = core256::<1, 1, $vnni>(fmt, [w.raw(first + i)], n, [x])[0][0];
            }
        }

        /// Two matrices' rows `first + i` (gate and up) against one activation row, a row a
        /// pass as in `$matvec`.
        #[target_feature(enable = $isa)]
        pub(super) unsafe fn $matvec_pair(a: &QMatrix<'_>, b: &QMatrix<'_>, x: &QRow<'_>, first: usize, a_out: &mut [f32], b_out: &mut [f32]) {
            let (fmt, n) = (a.fmt, a.cols);
            for (i, (oa, ob)) in a_out.iter_mut().zip(b_out.iter_mut()).enumerate() {
                *oa = core256::<1, 1, $vnni>(fmt, [a.raw(first + i)], n, [x])[0][0];
                *ob = core256::<1, 1, $vnni>(fmt, [b.raw(first + i)], n, [x])[0][0];
            }
        }

        /// `out[(r − first)·n + i] = W[r] · xs[i]` (weight-row major): each weight row against
        /// two activation rows a pass.
        #[target_feature(enable = $isa)]
        pub(super) unsafe fn $matmul_t(w: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
            let (fmt, cols, n) = (w.fmt, w.cols, xs.len());
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                row_against_rows256::<$vnni>(fmt, w.raw(first + r), cols, xs, o);
            }
        }

        /// Rows `first + r` of two matrices (gate and up) against every activation row: `out`
        /// holds, per row, A's `n` results then B's; each row against two activation rows a
        /// pass, as `$matmul_t` does. Both rows against one activation row (a 2 × 1 tile) ran
        /// 0.7–0.87× the multiply-adds per second of this on Zen 3 (`matvec_speed 512 1024`,
        /// int4-g32, 3 to 32 activation rows).
        #[target_feature(enable = $isa)]
        pub(super) unsafe fn $matmul_pair_t(a: &QMatrix<'_>, b: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
            let (fmt, cols, n) = (a.fmt, a.cols, xs.len());
            for (r, o) in out.chunks_exact_mut(2 * n).enumerate() {
                let (oa, ob) = o.split_at_mut(n);
                row_against_rows256::<$vnni>(fmt, a.raw(first + r), cols, xs, oa);
                row_against_rows256::<$vnni>(fmt, b.raw(first + r), cols, xs, ob);
            }
        }
    };
}

/// `o[i] = row · xs[i]`, two activation rows a pass — four for the 4-bit formats, whose dot
/// products take one accumulator register each (inlined into each caller, which gives it its
/// target features).
#[inline(always)]
unsafe fn row_against_rows256<const VNNI: bool>(fmt: Fmt, row: RawRow, cols: usize, xs: &[QRow<'_>], o: &mut [f32]) {
    let mut i = 0;
    if fmt != Fmt::Int8 {
        while i + 4 <= xs.len() {
            let [abcd] = core256::<1, 4, VNNI>(fmt, [row], cols, [&xs[i], &xs[i + 1], &xs[i + 2], &xs[i + 3]]);
            o[i..i + 4].copy_from_slice(&abcd);
            i += 4;
        }
    }
    let mut pairs = xs[i..].chunks_exact(2);
    for x in &mut pairs {
        let [ab] = core256::<1, 2, VNNI>(fmt, [row], cols, [&x[0], &x[1]]);
        o[i..i + 2].copy_from_slice(&ab);
        i += 2;
    }
    if let [x] = pairs.remainder() {
        o[i] = core256::<1, 1, VNNI>(fmt, [row], cols, [x])[0][0];
    }
}

rows256!("avx2,fma,f16c", false, qmatvec_avx2, qmatvec_pair_avx2, qmatmul_t_avx2, qmatmul_pair_t_avx2);
rows256!("avx2,fma,f16c,avxvnni", true, qmatvec_avxvnni, qmatvec_pair_avxvnni, qmatmul_t_avxvnni, qmatmul_pair_t_avxvnni);

/// The `len` (at most 32) bytes at `src` in a vector, zeros after them: a whole 32 read in
/// place, fewer from a zero-padded copy (so nothing past them is read).
///
/// # Safety
/// `src` must have `len` readable bytes; AVX must be available.
#[inline(always)]
unsafe fn load_up_to_32(src: *const u8, len: usize) -> __m256i {
    if len >= 32 {
        _mm256_loadu_si256(src as *const __m256i)
    } else {
        let mut bytes = [0u8; 32];
        std::ptr::copy_nonoverlapping(src, bytes.as_mut_ptr(), len);
        _mm256_loadu_si256(bytes.as_ptr() as *const __m256i)
    }
}

/// Both 256-bit paths; `VNNI` picks `vpdpbusd` over `pmaddubsw` + `pmaddwd` (inlined into each
/// caller, which gives it its target features).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
unsafe fn core256<const M: usize, const N: usize, const VNNI: bool>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    if fmt != Fmt::Int8 {
        return nibbles256::<M, N, VNNI>(fmt, rows, n, xs);
    }
    let full = n / CHUNK;
    let mut acc = [[[_mm256_setzero_ps(); 4]; N]; M];
    let (zero, ones) = (_mm256_setzero_si256(), _mm256_set1_epi16(1));
    {
        let bias = _mm256_set1_epi8(-128);
        // Block `kb` of chunk `c` of row `m`: 32 weights and the block's weight factor.
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
        for c in 0..full {
            for m in 0..M {
                let base = rows[m].data.add(c * CHUNK);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK + 64) as *const i8);
                for kb in 0..4 {
                    step!(m, c, kb, _mm256_loadu_si256(base.add(32 * kb) as *const __m256i), 1.0);
                }
            }
        }
        // The last, partial chunk: only its live blocks, whole ones read in place and a
        // partial one from a zero-padded copy. A block past the row would add
        // `fma(0 · d, 0, acc) = acc` (`RawRow::tail`; `acc` is never −0), so leaving it out
        // gives the same bits — a model's 64-wide down projection is all tail.
        let start = full * CHUNK;
        if start < n {
            let live = n - start;
            for m in 0..M {
                let src = rows[m].data.add(start);
                for kb in 0..live.div_ceil(32) {
                    step!(m, full, kb, load_up_to_32(src.add(32 * kb), live - 32 * kb), 1.0);
                }
            }
        }
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            let a = &acc[m][k];
            // s = 16 (lanes 0–15 meet 16–31), then s = 8, then 4, 2, 1.
            let s16 = [_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])];
            let r = reduce256(_mm256_add_ps(s16[0], s16[1]));
            out[m][k] = if fmt == Fmt::Int8 { rows[m].scale * r } else { r };
        }
    }
    out
}

/// `core256` for the 4-bit formats (`qdot.rs`'s 8-lane order): per chunk, the 32-byte halves'
/// low nibbles (even elements) and high ones (odd) against the activations' matching runs
/// (`pmaddubsw` + `pmaddwd`, or `vpdpbusd`), each half's eight sums of eight elements, and one
/// `vphaddd` of the two halves — which leaves the eight half-block sums in lane order — then the
/// offset's sums, one convert and one FMA into one accumulator a dot product.
#[inline(always)]
unsafe fn nibbles256<const M: usize, const N: usize, const VNNI: bool>(fmt: Fmt, rows: [RawRow; M], n: usize, xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    // The format a constant inside the loops (LLVM kept the tests of a runtime one in them).
    match fmt {
        Fmt::Mxfp4 => nibbles256_of::<M, N, VNNI, MXFP4>(fmt, rows, n, xs),
        Fmt::Int6 { .. } => nibbles256_of::<M, N, VNNI, INT6>(fmt, rows, n, xs),
        _ => nibbles256_of::<M, N, VNNI, INT4>(fmt, rows, n, xs),
    }
}

/// `nibbles256`'s kinds of 4-bit weights.
const INT4: u8 = 0;
const INT6: u8 = 1;
const MXFP4: u8 = 2;

#[inline(always)]
#[allow(clippy::needless_range_loop)] // m and k also index the accumulators
unsafe fn nibbles256_of<const M: usize, const N: usize, const VNNI: bool, const KIND: u8>(
    fmt: Fmt,
    rows: [RawRow; M],
    n: usize,
    xs: [&QRow<'_>; N],
) -> [[f32; N]; M] {
    let full = n / CHUNK;
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    let (zero, ones) = (_mm256_setzero_si256(), _mm256_set1_epi16(1));
    let mask = _mm256_set1_epi8(0x0f);
    let (mx, i6) = (KIND == MXFP4, KIND == INT6);
    let top = _mm256_set1_epi8(0x30);
    let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_TWICE_PLUS12.as_ptr() as *const __m128i));
    // `Σ a·b` over each run of eight bytes' products, `a` the unsigned weights of two vectors, `b`
    // the activations at `q` and `q + 64` (their even and odd elements): no pair of products
    // reaches i16's limit in `pmaddubsw` (2 · 63 · 127 at most, int6).
    macro_rules! sums {
        ($even:expr, $odd:expr, $q:expr) => {{
            let (even, odd, q): (__m256i, __m256i, *const i8) = ($even, $odd, $q);
            let (qe, qo) = (_mm256_loadu_si256(q as *const __m256i), _mm256_loadu_si256(q.add(64) as *const __m256i));
            if VNNI {
                _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(zero, even, qe), odd, qo)
            } else {
                _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(even, qe), ones), _mm256_madd_epi16(_mm256_maddubs_epi16(odd, qo), ones))
            }
        }};
    }
    // Chunk `c` of row `m`: `x` its packed bytes as two 32-byte halves (only the first when
    // `halves` is 1: a last chunk of at most 64 values, whose other half would add nothing —
    // its sums are 0 and its factors 0), `wsv` its factors by lane.
    macro_rules! step {
        ($m:expr, $c:expr, $x:expr, $wsv:expr, $halves:expr) => {{
            let (m, c, x, wsv, halves): (usize, usize, [__m256i; 2], __m256, usize) = ($m, $c, $x, $wsv, $halves);
            // w[2v] the even elements of half v, w[2v + 1] the odd ones.
            let mut w = [zero; 4];
            for v in 0..halves {
                (w[2 * v], w[2 * v + 1]) = (_mm256_and_si256(x[v], mask), _mm256_and_si256(_mm256_srli_epi16::<4>(x[v]), mask));
            }
            if mx {
                for v in &mut w {
                    *v = _mm256_shuffle_epi8(lut, *v);
                }
            }
            if i6 {
                // The chunk's top bits (whole chunks, read in place) to bits 4–5 of the bytes
                // above: the first 64 values' at bits 0–1 (even) and 4–5 (odd), the next 64's at
                // 2–3 and 6–7 (`quant::Int6Matrix`). Shifts are per 16-bit word; the mask keeps
                // only bits that came from the same byte.
                let h = _mm256_loadu_si256(rows[m].hi.add(c * 32) as *const __m256i);
                let tops = [_mm256_slli_epi16::<4>(h), h, _mm256_slli_epi16::<2>(h), _mm256_srli_epi16::<2>(h)];
                for (v, t) in w.iter_mut().zip(tops) {
                    *v = _mm256_or_si256(*v, _mm256_and_si256(t, top));
                }
            }
            for k in 0..N {
                let q = xs[k].split.as_ptr().add(c * CHUNK);
                let first = sums!(w[0], w[1], q);
                let second = if halves == 2 { sums!(w[2], w[3], q.add(32)) } else { zero };
                let at = c * NLANES;
                let neg = if mx {
                    _mm256_loadu_si256(xs[k].neg12.as_ptr().add(at) as *const __m256i)
                } else if i6 {
                    // int6's offset is 32 = 4 · int4's 8.
                    _mm256_slli_epi32::<2>(_mm256_loadu_si256(xs[k].neg8.as_ptr().add(at) as *const __m256i))
                } else {
                    _mm256_loadu_si256(xs[k].neg8.as_ptr().add(at) as *const __m256i)
                };
                let p = _mm256_add_epi32(_mm256_hadd_epi32(first, second), neg);
                let f = _mm256_mul_ps(wsv, _mm256_loadu_ps(xs[k].lane_scales.as_ptr().add(at)));
                acc[m][k] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), acc[m][k]);
            }
        }};
    }
    // (A macro, not a closure: a closure would not inherit the callers' target features.)
    macro_rules! load2 {
        ($base:expr) => {{
            let base: *const u8 = $base;
            [_mm256_loadu_si256(base as *const __m256i), _mm256_loadu_si256(base.add(32) as *const __m256i)]
        }};
    }
    for c in 0..full {
        for m in 0..M {
            let base = rows[m].data.add(c * CHUNK / 2);
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD * CHUNK / 2) as *const i8);
            step!(m, c, load2!(base), factors8(fmt, &rows[m], c), 2);
        }
    }
    let start = full * CHUNK;
    // Packed bytes the row has from `start`.
    let live = n.div_ceil(2).saturating_sub(start / 2);
    if start < n && live <= 32 {
        for m in 0..M {
            let x = load_up_to_32(rows[m].data.add(start / 2), live);
            step!(m, full, [x, zero], tail_factors8(fmt, &rows[m], n, start), 1);
        }
    } else if start < n {
        for m in 0..M {
            let (t, _) = rows[m].tail(fmt, n, start);
            step!(m, full, load2!(t.as_ptr()), tail_factors8(fmt, &rows[m], n, start), 2);
        }
    }
    let mut out = [[0.0f32; N]; M];
    for m in 0..M {
        for k in 0..N {
            out[m][k] = reduce256(acc[m][k]);
        }
    }
    out
}

/// Two weight rows against every activation row, four at a time: `o` gets the first row's `n`
/// results, then the second's (a GEMM tile of 2 × 4; each weight chunk is decoded once per four
/// activation rows).
#[inline(always)]
unsafe fn tile2(fmt: Fmt, ws: [RawRow; 2], cols: usize, xs: &[QRow<'_>], o: &mut [f32]) {
    let n = xs.len();
    let mut i = 0;
    // The 4-bit formats' accumulators take one register per two dot products, so eight
    // activation rows fit a pass (int8's two registers a dot product would not): each chunk's
    // weights decoded once per eight rows.
    while fmt != Fmt::Int8 && i + 8 <= n {
        let [a, b] = nibbles512::<2, 8>(fmt, ws, cols, std::array::from_fn(|k| &xs[i + k]));
        o[i..i + 8].copy_from_slice(&a);
        o[n + i..n + i + 8].copy_from_slice(&b);
        i += 8;
    }
    while i + 4 <= n {
        let [a, b] = core512::<2, 4>(fmt, ws, cols, [&xs[i], &xs[i + 1], &xs[i + 2], &xs[i + 3]]);
        o[i..i + 4].copy_from_slice(&a);
        o[n + i..n + i + 4].copy_from_slice(&b);
        i += 4;
    }
    // What is left (one to three rows) in one pass too: a batch's experts often get two or three
    // rows each, and every pass decodes the weights again.
    match n - i {
        3 => {
            let [a, b] = core512::<2, 3>(fmt, ws, cols, [&xs[i], &xs[i + 1], &xs[i + 2]]);
            o[i..i + 3].copy_from_slice(&a);
            o[n + i..n + i + 3].copy_from_slice(&b);
        }
        2 => {
            let [a, b] = core512::<2, 2>(fmt, ws, cols, [&xs[i], &xs[i + 1]]);
            o[i..i + 2].copy_from_slice(&a);
            o[n + i..n + i + 2].copy_from_slice(&b);
        }
        1 => {
            let [a, b] = core512::<2, 1>(fmt, ws, cols, [&xs[i]]);
            (o[i], o[n + i]) = (a[0], b[0]);
        }
        _ => {}
    }
}

/// `out[(r − first)·n + i] = W[r] · xs[i]` (weight-row major), two weight rows a pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn qmatmul_t_avx512vnni(w: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    let (fmt, cols, n) = (w.fmt, w.cols, xs.len());
    let rows = out.len() / n;
    let mut r = 0;
    while r + 2 <= rows {
        tile2(fmt, [w.raw(first + r), w.raw(first + r + 1)], cols, xs, &mut out[r * n..(r + 2) * n]);
        r += 2;
    }
    if r < rows {
        // The odd last row, four activation rows a pass.
        let (row, o) = (w.raw(first + r), &mut out[r * n..(r + 1) * n]);
        let mut i = 0;
        while i + 4 <= n {
            o[i..i + 4].copy_from_slice(&core512::<1, 4>(fmt, [row], cols, [&xs[i], &xs[i + 1], &xs[i + 2], &xs[i + 3]])[0]);
            i += 4;
        }
        for (slot, x) in o[i..].iter_mut().zip(&xs[i..]) {
            *slot = core512::<1, 1>(fmt, [row], cols, [x])[0][0];
        }
    }
}

/// Rows `first + r` of two matrices (gate and up) against every activation row: `out` holds,
/// per row, A's `n` results then B's.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn qmatmul_pair_t_avx512vnni(a: &QMatrix<'_>, b: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    let (fmt, cols, n) = (a.fmt, a.cols, xs.len());
    for (r, o) in out.chunks_exact_mut(2 * n).enumerate() {
        tile2(fmt, [a.raw(first + r), b.raw(first + r)], cols, xs, o);
    }
}

/// `nibble_layout_scalar`'s even/odd split with 512-bit registers: each half chunk's bytes
/// flipped to `q`, even and odd bytes of every 128-bit lane gathered by one shuffle, the halves'
/// even (odd) quadwords joined.
///
/// # Safety
/// AVX-512 F/BW must be available; `split` holds `biased.len()` bytes, `biased` being whole
/// chunks.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn nibble_split_avx512vnni(biased: &[u8], split: &mut [i8]) {
    assert!(biased.len().is_multiple_of(CHUNK) && split.len() >= biased.len());
    let flip = _mm512_set1_epi8(-128i8);
    let lanes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    let (evens, odds) = (_mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15));
    for c in 0..biased.len() / CHUNK {
        let src = biased.as_ptr().add(c * CHUNK);
        let a = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_loadu_si512(src as *const __m512i), flip), lanes);
        let b = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_loadu_si512(src.add(64) as *const __m512i), flip), lanes);
        let halves = [_mm512_permutex2var_epi64(a, evens, b), _mm512_permutex2var_epi64(a, odds, b)];
        for (h, q) in halves.into_iter().enumerate() {
            _mm512_storeu_si512(split.as_mut_ptr().add(c * CHUNK + 64 * h) as *mut __m512i, q);
        }
    }
}

/// `nibble_layout_scalar`'s even/odd split with 256-bit registers: each quarter chunk's bytes
/// flipped to `q` and its even and odd bytes gathered per 128-bit lane, quadwords reordered to
/// 16 even then 16 odd, two quarters' evens (odds) joined by a lane permute.
///
/// # Safety
/// AVX2 must be available; `split` holds `biased.len()` bytes, `biased` being whole chunks.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibble_split_avx2(biased: &[u8], split: &mut [i8]) {
    assert!(biased.len().is_multiple_of(CHUNK) && split.len() >= biased.len());
    let flip = _mm256_set1_epi8(-128i8);
    let lanes = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for c in 0..biased.len() / CHUNK {
        let src = biased.as_ptr().add(c * CHUNK);
        // Quarter k: [16 even q, 16 odd q] of elements 32k..32k+32.
        let quarter = |k: usize| {
            let v = _mm256_xor_si256(_mm256_loadu_si256(src.add(32 * k) as *const __m256i), flip);
            _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, lanes))
        };
        let (q0, q1, q2, q3) = (quarter(0), quarter(1), quarter(2), quarter(3));
        let parts = [
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x20>(q2, q3),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q2, q3),
        ];
        for (j, q) in parts.into_iter().enumerate() {
            _mm256_storeu_si256(split.as_mut_ptr().add(c * CHUNK + 32 * j) as *mut __m256i, q);
        }
    }
}

/// `quantize_row_scalar`'s bits with 256-bit registers, as `quantize_row_avx512` takes them
/// (finite check and maximum on bit patterns, the same IEEE multiply, magic rounding and clamp).
/// AVX2 has no truncating narrow, and its saturating packs would turn the NaN of `0 · ∞` into
/// −128 where the scalar's `NaN as i8` is 0: NaN lanes are zeroed before the clamp instead. A
/// block shorter than 32 is read from a zero-padded copy (zeros change neither the maximum nor
/// the finite check).
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_row_avx2(x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
    let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let finite_max = _mm256_set1_epi32(0x7F7F_FFFF);
    let magic = _mm256_set1_ps(super::ROUND_MAGIC);
    let (lo_q, hi_q) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let flip = _mm256_set1_epi8(-128i8);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    // Only the last block can be short: one zeroed copy serves it.
    let mut padded = [0.0f32; super::QBLOCK];
    for (b, block) in x.chunks(super::QBLOCK).enumerate() {
        let len = block.len();
        let p = if len == super::QBLOCK {
            block.as_ptr()
        } else {
            padded[..len].copy_from_slice(block);
            padded.as_ptr()
        };
        // SAFETY: `p` points at 32 readable floats (the block, or its padded copy).
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(p.add(8 * k)));
        let a: [__m256i; 4] = std::array::from_fn(|k| _mm256_and_si256(_mm256_castps_si256(v[k]), abs_mask));
        let out = &mut biased[b * super::QBLOCK..b * super::QBLOCK + len];
        let big = _mm256_or_si256(
            _mm256_or_si256(_mm256_cmpgt_epi32(a[0], finite_max), _mm256_cmpgt_epi32(a[1], finite_max)),
            _mm256_or_si256(_mm256_cmpgt_epi32(a[2], finite_max), _mm256_cmpgt_epi32(a[3], finite_max)),
        );
        if _mm256_testz_si256(big, big) == 0 {
            scales[b] = f32::NAN;
            out.fill(0x80);
            continue;
        }
        let m = _mm256_max_epu32(_mm256_max_epu32(a[0], a[1]), _mm256_max_epu32(a[2], a[3]));
        let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
        let amax = f32::from_bits(_mm_cvtsi128_si32(m) as u32);
        scales[b] = amax / 127.0;
        let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let q = |v: __m256| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, inv), magic), magic);
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_cvtps_epi32(_mm256_max_ps(lo_q, _mm256_min_ps(hi_q, r)))
        };
        // packs work per 128-bit lane: the dwords come out as a0 b0 c0 d0 a1 b1 c1 d1 (4 values
        // each), put back in order by one permute.
        let words = [_mm256_packs_epi32(q(v[0]), q(v[1])), _mm256_packs_epi32(q(v[2]), q(v[3]))];
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words[0], words[1]), order);
        let bytes = _mm256_xor_si256(bytes, flip);
        if len == super::QBLOCK {
            // A whole block: `out` is its 32 bytes.
            _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes);
        } else {
            let mut all = [0u8; super::QBLOCK];
            _mm256_storeu_si256(all.as_mut_ptr().cast(), bytes);
            out.copy_from_slice(&all[..len]);
        }
    }
}

/// `quantize_row_scalar`'s bits, a block of 32 at a time: the finite check and the absolute
/// maximum on the values' bit patterns (for finite non-negative floats the integer order is the
/// float order, so the maximum is exact), then the same multiply, magic-number rounding and clamp
/// as IEEE single operations.
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_row_avx512(x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
    let abs_mask = _mm512_set1_epi32(0x7FFF_FFFF);
    let inf_bits = _mm512_set1_epi32(0x7F80_0000);
    let magic = _mm512_set1_ps(super::ROUND_MAGIC);
    let (lo_q, hi_q) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let flip = _mm_set1_epi8(0x80u8 as i8);
    for (b, block) in x.chunks(super::QBLOCK).enumerate() {
        let len = block.len();
        let m0: __mmask16 = if len >= 16 { 0xFFFF } else { (1u16 << len) - 1 };
        let m1: __mmask16 = if len >= 32 {
            0xFFFF
        } else if len > 16 {
            (1u16 << (len - 16)) - 1
        } else {
            0
        };
        // SAFETY: masked loads read only the block's own elements.
        let v0 = _mm512_maskz_loadu_ps(m0, block.as_ptr());
        let v1 = _mm512_maskz_loadu_ps(m1, block.as_ptr().wrapping_add(16));
        let a0 = _mm512_and_si512(_mm512_castps_si512(v0), abs_mask);
        let a1 = _mm512_and_si512(_mm512_castps_si512(v1), abs_mask);
        let out = &mut biased[b * super::QBLOCK..b * super::QBLOCK + len];
        if _mm512_cmpge_epi32_mask(a0, inf_bits) | _mm512_cmpge_epi32_mask(a1, inf_bits) != 0 {
            scales[b] = f32::NAN;
            out.fill(0x80);
            continue;
        }
        let amax = f32::from_bits(_mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1)));
        scales[b] = amax / 127.0;
        let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let q = |v: __m512| {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inv), magic), magic);
            // NaN (0 · ∞, when 127 / amax overflows) passes through min and max with the NaN
            // second, converts to 0x8000_0000 and truncates to the byte 0 — the scalar's `NaN as
            // i8`.
            _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_max_ps(lo_q, _mm512_min_ps(hi_q, r)))), flip)
        };
        if len == super::QBLOCK {
            // A whole block straight to its place (a copy of a run-time length called memcpy
            // for every block).
            _mm_storeu_si128(out.as_mut_ptr().cast(), q(v0));
            _mm_storeu_si128(out.as_mut_ptr().add(16).cast(), q(v1));
        } else {
            let mut bytes = [0u8; 32];
            _mm_storeu_si128(bytes.as_mut_ptr().cast(), q(v0));
            _mm_storeu_si128(bytes.as_mut_ptr().wrapping_add(16).cast(), q(v1));
            out.copy_from_slice(&bytes[..len]);
        }
    }
}
