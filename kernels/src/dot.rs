//! The one dot product every matrix kernel computes, defined once and implemented per ISA so
//! that every implementation gives the same bits.
//!
//! **The canonical order.** For a weight row `w` (decoded to the exact f32 values the format
//! defines: bf16/f16 widened; int4 `(nibble − 8)·s_group`, each product rounded once, exactly as
//! `shimmer_common::quant::dequantize`; int8 rows use the integer `q` here and their one row scale
//! multiplies the reduced sum, `result = s · acc[0]`, which saves a multiply per weight) and an
//! activation row `x` of length `n`, both zero-padded to a multiple of 64:
//!
//! ```text
//! acc[l] = 0 for l in 0..64
//! for each chunk c, for each lane l:   acc[l] = fma(w[64c + l], x[64c + l], acc[l])
//! for s in [32, 16, 8, 4, 2, 1]:       acc[l] = acc[l] + acc[l + s]   for l < s
//! result = acc[0]
//! ```
//!
//! The scalar code below is that definition; AVX-512 keeps the 64 lanes in four registers, AVX2
//! in eight, and each reduces in the same tree. Sixty-four lanes (not 16) give each core four
//! independent FMA chains, so decode is not bound by FMA latency. So a row's result does not depend on the ISA, on
//! threads, or on which other rows share a call (a batch processes several activation rows per
//! pass over a weight row, each with its own accumulators) — batch invariance and cross-machine
//! bit-identity by construction, checked by `tests` below for every ISA the machine has.
//!
//! Must never: reorder a sum for speed, or quantise activations (both would change results).

use std::sync::OnceLock;

pub const LANES: usize = 64;

/// One weight row in its stored format.
#[derive(Clone, Copy)]
pub enum WeightRow<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    Int8 { q: &'a [i8], scale: f32 },
    /// `packed` holds `ceil(n/2)` bytes (low nibble first); `scales` one per `group` values.
    Int4 { packed: &'a [u8], scales: &'a [f32], group: usize, n: usize },
}

impl WeightRow<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightRow::F32(v) => v.len(),
            WeightRow::Bf16(v) | WeightRow::F16(v) => v.len(),
            WeightRow::Int8 { q, .. } => q.len(),
            WeightRow::Int4 { n, .. } => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as the dot product's lanes see it: the format's exact f32 value, except int8,
    /// whose lanes hold `q` (the row scale is applied once, after the reduction).
    #[inline]
    fn lane_value(&self, i: usize) -> f32 {
        match self {
            WeightRow::Int8 { q, .. } => q[i] as f32,
            _ => self.get(i),
        }
    }

    /// What multiplies the reduced sum: the row scale for int8, else 1.
    #[inline]
    fn row_scale(&self) -> Option<f32> {
        match self {
            WeightRow::Int8 { scale, .. } => Some(*scale),
            _ => None,
        }
    }

    /// Element `i` as the exact f32 the format defines.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            WeightRow::F32(v) => v[i],
            WeightRow::Bf16(v) => f32::from_bits((v[i] as u32) << 16),
            WeightRow::F16(v) => half::f16::from_bits(v[i]).to_f32(),
            WeightRow::Int8 { q, scale } => q[i] as f32 * scale,
            WeightRow::Int4 { packed, scales, group, .. } => {
                let byte = packed[i / 2];
                let nib = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                (nib as i32 - 8) as f32 * scales[i / group]
            }
        }
    }
}

/// The instruction sets the kernels can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512F (+ the above).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512f",
        }
    }

    /// Whether this machine can run it.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2.available() && std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every ISA this machine can run, best last.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()).collect()
    }
}

/// The ISA the kernels use: the best available, or `SHIMMER_ISA` (scalar, avx2, avx512) when it
/// names one the machine has. Chosen once per process.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let wanted = match std::env::var("SHIMMER_ISA").as_deref() {
            Ok("scalar") => Some(Isa::Scalar),
            Ok("avx2") => Some(Isa::Avx2),
            Ok("avx512") => Some(Isa::Avx512),
            _ => None,
        };
        match wanted {
            Some(i) if i.available() => i,
            _ => *Isa::all_available().last().unwrap_or(&Isa::Scalar),
        }
    })
}

/// `w · x` in the canonical order, with the process's ISA.
#[inline]
pub fn dot(w: &WeightRow<'_>, x: &[f32]) -> f32 {
    dots::<1>(w, [x])[0]
}

/// `w · xs[k]` for `N` activation rows in one pass over `w`; each result is exactly `dot(w, xs[k])`.
#[inline]
pub fn dots<const N: usize>(w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
    for x in &xs {
        assert!(x.len() >= w.len(), "activation row shorter than the weight row");
    }
    dots_checked::<N>(isa(), w, xs)
}

/// `dots` with a given ISA (which must be available).
pub fn dots_with<const N: usize>(isa: Isa, w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
    for x in &xs {
        assert!(x.len() >= w.len(), "activation row shorter than the weight row");
    }
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    dots_checked(isa, w, xs)
}

/// Activation rows per pass over a weight row that keep every accumulator in registers.
pub fn batch_width() -> usize {
    match isa() {
        Isa::Avx512 => 4,
        _ => 2,
    }
}

#[inline]
fn dots_checked<const N: usize>(isa: Isa, w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only ISAs `Isa::available` confirmed reach here (`isa()` returns only those,
        // `dots_with` asserts it).
        Isa::Avx512 => unsafe { x86::dots_avx512::<N>(w, xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dots_avx2::<N>(w, xs) },
        _ => {
            let mut out = [0.0; N];
            for (o, x) in out.iter_mut().zip(xs) {
                *o = dot_scalar(w, x);
            }
            out
        }
    }
}

/// The definition, in plain code.
pub fn dot_scalar(w: &WeightRow<'_>, x: &[f32]) -> f32 {
    let n = w.len();
    let mut acc = [0.0f32; LANES];
    for c in 0..n.div_ceil(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            let (wi, xi) = if i < n { (w.lane_value(i), x[i]) } else { (0.0, 0.0) };
            *a = wi.mul_add(xi, *a);
        }
    }
    scaled(w, reduce(acc))
}

/// The reduced sum with the row scale (int8) applied.
#[inline]
fn scaled(w: &WeightRow<'_>, sum: f32) -> f32 {
    match w.row_scale() {
        Some(s) => s * sum,
        None => sum,
    }
}

#[inline]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    for s in [32, 16, 8, 4, 2, 1] {
        for l in 0..s {
            acc[l] += acc[l + s];
        }
    }
    acc[0]
}

/// The last, partial chunk of a row: weights decoded and both sides zero-padded, so every ISA
/// handles it with the same full-width step.
#[inline]
fn tail_chunk(w: &WeightRow<'_>, x: &[f32], start: usize, n: usize) -> ([f32; LANES], [f32; LANES]) {
    let (mut wt, mut xt) = ([0.0f32; LANES], [0.0f32; LANES]);
    for i in start..n {
        wt[i - start] = w.lane_value(i);
        xt[i - start] = x[i];
    }
    (wt, xt)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{tail_chunk, WeightRow, LANES};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn reduce256(v8: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
        _mm_cvtss_f32(v1)
    }

    #[inline(always)]
    unsafe fn reduce512(acc: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
        reduce256(_mm256_add_ps(lo, hi))
    }

    /// Lanes 0–63 in four registers → one f32, in the canonical tree.
    #[inline(always)]
    unsafe fn reduce512x4(a: &[__m512; 4]) -> f32 {
        let t0 = _mm512_add_ps(a[0], a[2]); // s = 32
        let t1 = _mm512_add_ps(a[1], a[3]);
        reduce512(_mm512_add_ps(t0, t1)) // s = 16, then 8, 4, 2, 1
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx512<const N: usize>(w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
        let n = w.len();
        let full = n / LANES;
        let mut acc = [[_mm512_setzero_ps(); 4]; N];
        // Weight bytes per 64-lane chunk, and where the row's bytes start: each chunk asks for
        // the line eight chunks ahead (rows are contiguous, so this runs on into the next row),
        // which keeps small matrices — an expert is ~1 MB — streaming at DRAM speed.
        let (base, chunk_bytes): (*const u8, usize) = match *w {
            WeightRow::F32(v) => (v.as_ptr() as *const u8, 256),
            WeightRow::Bf16(v) | WeightRow::F16(v) => (v.as_ptr() as *const u8, 128),
            WeightRow::Int8 { q, .. } => (q.as_ptr() as *const u8, 64),
            WeightRow::Int4 { packed, .. } => (packed.as_ptr(), 32),
        };
        macro_rules! run {
            ($i:ident => $decode:expr) => {
                for c in 0..full {
                    let ahead = base.wrapping_add((c + 8) * chunk_bytes);
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    if chunk_bytes > 64 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64) as *const i8);
                    }
                    for j in 0..4 {
                        let $i = c * LANES + j * 16;
                        let wv: __m512 = $decode;
                        for k in 0..N {
                            acc[k][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xs[k].as_ptr().add($i)), acc[k][j]);
                        }
                    }
                }
            };
        }
        match *w {
            WeightRow::F32(v) => run!(i => _mm512_loadu_ps(v.as_ptr().add(i))),
            WeightRow::Bf16(v) => run!(i => _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(v.as_ptr().add(i) as *const __m256i)), 16))),
            WeightRow::F16(v) => run!(i => _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(i) as *const __m256i))),
            WeightRow::Int8 { q, .. } => run!(i => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().add(i) as *const __m128i)))),
            WeightRow::Int4 { packed, scales, group, .. } => {
                // 64 nibbles (32 bytes) per chunk: split and interleave once, widen per 16.
                let eight = _mm512_set1_epi32(8);
                let mask = _mm256_set1_epi8(0x0f);
                for c in 0..full {
                    let b = _mm256_loadu_si256(packed.as_ptr().add(c * LANES / 2) as *const __m256i);
                    let lo = _mm256_and_si256(b, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
                    // Per 128-bit lane, unpacklo gives bytes 0–7 interleaved (elements 0–15 and
                    // 32–47), unpackhi bytes 8–15 (elements 16–31 and 48–63).
                    let i0 = _mm256_unpacklo_epi8(lo, hi);
                    let i1 = _mm256_unpackhi_epi8(lo, hi);
                    let parts = [_mm256_castsi256_si128(i0), _mm256_castsi256_si128(i1), _mm256_extracti128_si256(i0, 1), _mm256_extracti128_si256(i1, 1)];
                    for j in 0..4 {
                        let i = c * LANES + j * 16;
                        let q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(parts[j]), eight);
                        let wv = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(*scales.get_unchecked(i / group)));
                        for k in 0..N {
                            acc[k][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xs[k].as_ptr().add(i)), acc[k][j]);
                        }
                    }
                }
            }
        }
        if full * LANES < n {
            for k in 0..N {
                let (wt, xt) = tail_chunk(w, xs[k], full * LANES, n);
                for j in 0..4 {
                    acc[k][j] = _mm512_fmadd_ps(_mm512_loadu_ps(wt.as_ptr().add(j * 16)), _mm512_loadu_ps(xt.as_ptr().add(j * 16)), acc[k][j]);
                }
            }
        }
        let mut out = [0.0f32; N];
        for k in 0..N {
            out[k] = super::scaled(w, reduce512x4(&acc[k]));
        }
        out
    }

    /// Lanes 0–63 in eight registers → one f32, in the canonical tree.
    #[inline(always)]
    unsafe fn reduce256x8(a: &[__m256; 8]) -> f32 {
        let b = [_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[2], a[6]), _mm256_add_ps(a[3], a[7])]; // s = 32
        let c = [_mm256_add_ps(b[0], b[2]), _mm256_add_ps(b[1], b[3])]; // s = 16
        reduce256(_mm256_add_ps(c[0], c[1])) // s = 8, then 4, 2, 1
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx2<const N: usize>(w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
        let n = w.len();
        let full = n / LANES;
        let mut acc = [[_mm256_setzero_ps(); 8]; N];
        macro_rules! run {
            ($i:ident => $decode:expr) => {
                for c in 0..full {
                    for j in 0..8 {
                        let $i = c * LANES + j * 8;
                        let wv: __m256 = $decode;
                        for k in 0..N {
                            acc[k][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[k].as_ptr().add($i)), acc[k][j]);
                        }
                    }
                }
            };
        }
        match *w {
            WeightRow::F32(v) => run!(i => _mm256_loadu_ps(v.as_ptr().add(i))),
            WeightRow::Bf16(v) => run!(i => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i)), 16))),
            WeightRow::F16(v) => run!(i => _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i))),
            WeightRow::Int8 { q, .. } => run!(i => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q.as_ptr().add(i) as *const __m128i)))),
            WeightRow::Int4 { packed, scales, group, .. } => {
                let eight = _mm256_set1_epi32(8);
                let mask = _mm_set1_epi8(0x0f);
                run!(i => {
                    let b = _mm_cvtsi32_si128((packed.as_ptr().add(i / 2) as *const i32).read_unaligned());
                    let bytes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight)), _mm256_set1_ps(*scales.get_unchecked(i / group)))
                })
            }
        }
        if full * LANES < n {
            for k in 0..N {
                let (wt, xt) = tail_chunk(w, xs[k], full * LANES, n);
                for j in 0..8 {
                    acc[k][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wt.as_ptr().add(j * 8)), _mm256_loadu_ps(xt.as_ptr().add(j * 8)), acc[k][j]);
                }
            }
        }
        let mut out = [0.0f32; N];
        for k in 0..N {
            out[k] = super::scaled(w, reduce256x8(&acc[k]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shimmer_common::quant::{dequantize, quantize_int4, quantize_int8, QuantMatrix};

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_isa_gives_the_canonical_bits_for_every_format_and_shape() {
        for &n in &[1usize, 2, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 129, 257, 1000, 4099, 65_537] {
            let w = values(n, n as u64, 1.5);
            let xs: Vec<Vec<f32>> = (0..5).map(|k| values(n, 1000 + k, 3.0)).collect();
            let bf: Vec<u16> = w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let f16: Vec<u16> = w.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
            let mut quants = vec![quantize_int8(&w, 1, n)];
            for g in [32, 64, 128] {
                quants.push(quantize_int4(&w, 1, n, g));
            }
            let mut formats: Vec<(String, WeightRow<'_>, Vec<f32>)> = vec![
                ("f32".into(), WeightRow::F32(&w), w.clone()),
                ("bf16".into(), WeightRow::Bf16(&bf), bf.iter().map(|b| half::bf16::from_bits(*b).to_f32()).collect()),
                ("f16".into(), WeightRow::F16(&f16), f16.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect()),
            ];
            for q in &quants {
                let row = match q {
                    QuantMatrix::Int8 { q, scales, .. } => WeightRow::Int8 { q, scale: scales[0] },
                    QuantMatrix::Int4 { packed, scales, group, .. } => WeightRow::Int4 { packed, scales, group: *group, n },
                };
                let label = match q {
                    QuantMatrix::Int8 { .. } => "int8".to_string(),
                    QuantMatrix::Int4 { group, .. } => format!("int4-g{group}"),
                };
                formats.push((label, row, dequantize(q)));
            }
            for (name, row, decoded) in &formats {
                // The decoder is the format's definition (dequantize / widen).
                assert_eq!(bits(&(0..n).map(|i| row.get(i)).collect::<Vec<_>>()), bits(decoded), "{name} n={n}: decode");
                let want: Vec<f32> = xs.iter().map(|x| dot_scalar(row, x)).collect();
                // Close to an f64 dot of the decoded values.
                for (x, got) in xs.iter().zip(&want) {
                    let exact: f64 = decoded.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = decoded.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    assert!((*got as f64 - exact).abs() <= 1e-6 * mag + 1e-30, "{name} n={n}: {got} vs {exact}");
                }
                for isa in Isa::all_available() {
                    let one: Vec<f32> = xs.iter().map(|x| dots_with::<1>(isa, row, [x])[0]).collect();
                    assert_eq!(bits(&one), bits(&want), "{name} n={n} {isa:?} alone");
                    let four = dots_with::<4>(isa, row, [&xs[0], &xs[1], &xs[2], &xs[3]]);
                    assert_eq!(bits(&four), bits(&want[..4]), "{name} n={n} {isa:?} in a batch of four");
                    let two = dots_with::<2>(isa, row, [&xs[4], &xs[0]]);
                    assert_eq!(bits(&two), bits(&[want[4], want[0]]), "{name} n={n} {isa:?} in a batch of two");
                }
            }
        }
    }

    #[test]
    fn zero_and_extreme_scales_and_signed_zeros_agree_across_isas() {
        let n = 70;
        let zeros = vec![0.0f32; n];
        let negz = vec![-0.0f32; n];
        let x = values(n, 5, 1.0);
        let big: Vec<f32> = values(n, 6, 1e30);
        for isa in Isa::all_available() {
            for w in [&zeros, &negz, &big] {
                let row = WeightRow::F32(w);
                assert_eq!(dots_with::<1>(isa, &row, [&x])[0].to_bits(), dot_scalar(&row, &x).to_bits(), "{isa:?}");
                assert_eq!(dots_with::<1>(isa, &row, [&negz])[0].to_bits(), dot_scalar(&row, &negz).to_bits(), "{isa:?} -0");
            }
            let q = quantize_int4(&big, 1, n, 32);
            let QuantMatrix::Int4 { packed, scales, .. } = &q else { unreachable!() };
            let row = WeightRow::Int4 { packed, scales, group: 32, n };
            assert_eq!(dots_with::<1>(isa, &row, [&x])[0].to_bits(), dot_scalar(&row, &x).to_bits(), "{isa:?} extreme int4");
            // Scales near the top of f32's range.
            let huge: Vec<f32> = scales.iter().map(|_| f32::MAX / 7.0).collect();
            let row = WeightRow::Int4 { packed, scales: &huge, group: 32, n };
            let small_x: Vec<f32> = x.iter().map(|v| v * 1e-30).collect();
            assert_eq!(dots_with::<1>(isa, &row, [&small_x])[0].to_bits(), dot_scalar(&row, &small_x).to_bits(), "{isa:?} near-max int4 scale");
            let zero_scales = vec![0.0f32; scales.len()];
            let row = WeightRow::Int4 { packed, scales: &zero_scales, group: 32, n };
            assert_eq!(dots_with::<1>(isa, &row, [&x])[0], 0.0);
        }
    }
}
