//! The one dot product every matrix kernel computes, defined once and implemented per ISA so
//! that every implementation gives the same bits.
//!
//! **The canonical order.** For a weight row `w` (decoded to the exact f32 values the format
//! defines: bf16/f16 widened; int4 `(nibble − 8)·s_group`, fp8-e4m3 `fp8(q)·s_block` and MXFP4
//! `e2m1(nibble)·2^(e−127)`, each product rounded once, exactly as `shimmer_common::quant`'s
//! dequantisers; int8 rows use the integer `q` here and their one row scale
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
//! in eight, NEON in sixteen, and each reduces in the same tree. Sixty-four lanes (not 16) give each core four
//! independent FMA chains, so decode is not bound by FMA latency. So a row's result does not depend on the ISA, on
//! threads, or on which other rows share a call (a batch processes several activation rows per
//! pass over a weight row, each with its own accumulators) — batch invariance and cross-machine
//! bit-identity by construction, checked by `tests` below for every ISA the machine has.
//!
//! Must never: reorder a sum for speed, or quantise activations (both would change results).

use std::sync::OnceLock;

use shimmer_common::quant;

pub const LANES: usize = 64;

/// One weight row in its stored format.
#[derive(Clone, Copy)]
pub enum WeightRow<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    Int8 {
        q: &'a [i8],
        scale: f32,
    },
    /// `packed` holds `ceil(n/2)` bytes (low nibble first); `scales` one f16 (bits) per `group`
    /// values.
    Int4 {
        packed: &'a [u8],
        scales: &'a [u16],
        group: usize,
        n: usize,
    },
    /// 6-bit codes (`shimmer_common::quant::Int6Matrix`'s row): `lo` the low nibbles as int4's
    /// `packed`, `hi` the top two bits (32 bytes per 128 values), one f16 scale per `group`.
    Int6 {
        lo: &'a [u8],
        hi: &'a [u8],
        scales: &'a [u16],
        group: usize,
        n: usize,
    },
    /// fp8-e4m3 bytes with one f32 scale per `group` columns (a block-scaled checkpoint's row).
    Fp8 {
        q: &'a [u8],
        scales: &'a [f32],
        group: usize,
    },
    /// MXFP4: e2m1 nibbles (low first, `ceil(n/2)` bytes) with one e8m0 scale per 32 values.
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        n: usize,
    },
}

impl WeightRow<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightRow::F32(v) => v.len(),
            WeightRow::Bf16(v) | WeightRow::F16(v) => v.len(),
            WeightRow::Int8 { q, .. } => q.len(),
            WeightRow::Int4 { n, .. } | WeightRow::Int6 { n, .. } | WeightRow::Mxfp4 { n, .. } => *n,
            WeightRow::Fp8 { q, .. } => q.len(),
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
                let nib = if i.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
                (nib as i32 - 8) as f32 * quant::int4_scale(scales[i / group])
            }
            WeightRow::Int6 { lo, hi, scales, group, .. } => quant::int6_code(lo, hi, i) as f32 * quant::int4_scale(scales[i / group]),
            WeightRow::Fp8 { q, scales, group } => quant::fp8_e4m3_to_f32(q[i]) * scales[i / group],
            WeightRow::Mxfp4 { packed, scales, .. } => {
                let byte = packed[i / 2];
                let nib = if i.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
                quant::E2M1[nib as usize] * quant::e8m0_to_f32(scales[i / quant::MXFP4_GROUP])
            }
        }
    }

    /// Whether two rows are stored alike (same format and grouping), so one pass can decode both.
    fn same_format(&self, other: &WeightRow<'_>) -> bool {
        use WeightRow::*;
        match (self, other) {
            (F32(_), F32(_)) | (Bf16(_), Bf16(_)) | (F16(_), F16(_)) | (Int8 { .. }, Int8 { .. }) | (Mxfp4 { .. }, Mxfp4 { .. }) => true,
            (Int4 { group: a, .. }, Int4 { group: b, .. }) | (Int6 { group: a, .. }, Int6 { group: b, .. }) | (Fp8 { group: a, .. }, Fp8 { group: b, .. }) => {
                a == b
            }
            _ => false,
        }
    }
}

/// The instruction sets the kernels can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512F/BW (+ the above).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512f",
            Isa::Neon => "neon",
        }
    }

    /// Whether this machine can run it.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2.available() && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every ISA this machine can run, best last.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()).collect()
    }
}

/// The ISA the kernels use: the best available, or `SHIMMER_ISA` (scalar, avx2, avx512, neon)
/// when it names one the machine has. Chosen once per process.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let wanted = match std::env::var("SHIMMER_ISA").as_deref() {
            Ok("scalar") => Some(Isa::Scalar),
            Ok("avx2") => Some(Isa::Avx2),
            Ok("avx512") => Some(Isa::Avx512),
            Ok("neon") => Some(Isa::Neon),
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
    dots_rows::<1, N>([w], xs)[0]
}

/// `ws[m] · xs[k]` for `M` weight rows (of one length) and `N` activation rows in one pass:
/// each activation chunk is loaded once for all `M` rows (the expert FFN's gate and up). Every
/// result is exactly `dot(ws[m], xs[k])`.
#[inline]
pub fn dots_rows<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
    // `isa` returns only what `available` confirmed: no feature checks per call (they were a
    // measurable share of a small model's decode).
    dots_rows_unchecked_isa(isa(), ws, xs)
}

/// `dots` with a given ISA (which must be available).
pub fn dots_with<const N: usize>(isa: Isa, w: &WeightRow<'_>, xs: [&[f32]; N]) -> [f32; N] {
    dots_rows_with::<1, N>(isa, [w], xs)[0]
}

/// `dots_rows` with a given ISA (which must be available).
pub fn dots_rows_with<const M: usize, const N: usize>(isa: Isa, ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    dots_rows_unchecked_isa(isa, ws, xs)
}

/// `dots_rows_with` for an ISA known to be available.
#[inline]
fn dots_rows_unchecked_isa<const M: usize, const N: usize>(isa: Isa, ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
    let Some(first) = ws.first() else { return [[0.0; N]; M] };
    for w in &ws {
        assert_eq!(w.len(), first.len(), "weight rows of one pass differ in length");
    }
    for x in &xs {
        assert!(x.len() >= first.len(), "activation row shorter than the weight row");
    }
    if M > 1 && !ws.iter().all(|w| w.same_format(first)) {
        // Rows stored differently cannot share a decode; each goes alone (same bits).
        let mut out = [[0.0; N]; M];
        for (o, w) in out.iter_mut().zip(ws) {
            *o = dots_checked::<1, N>(isa, [w], xs)[0];
        }
        return out;
    }
    dots_checked(isa, ws, xs)
}

/// Activation rows per pass over a weight row that keep every accumulator in registers.
pub fn batch_width() -> usize {
    match isa() {
        Isa::Avx512 => 4,
        Isa::Avx2 => 2,
        _ => 1,
    }
}

/// Activation rows per fused pass over two weight rows (gate and up).
pub fn pair_batch_width() -> usize {
    match isa() {
        Isa::Avx512 => 2,
        _ => 1,
    }
}

#[inline]
fn dots_checked<const M: usize, const N: usize>(isa: Isa, ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only ISAs `Isa::available` confirmed reach here (`isa()` returns only those,
        // `dots_rows_with` asserts it); rows share one length and format, activations are long
        // enough (checked by the callers above).
        Isa::Avx512 => unsafe { x86::dots_avx512::<M, N>(ws, xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dots_avx2::<M, N>(ws, xs) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::dots_neon::<M, N>(ws, xs) },
        _ => {
            let mut out = [[0.0; N]; M];
            for (o, w) in out.iter_mut().zip(ws) {
                for (slot, x) in o.iter_mut().zip(xs) {
                    *slot = dot_scalar(w, x);
                }
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

/// Where a row's bytes start and how many bytes one 64-lane chunk spans (for prefetching).
#[allow(dead_code)]
fn stream(w: &WeightRow<'_>) -> (*const u8, usize) {
    match *w {
        WeightRow::F32(v) => (v.as_ptr() as *const u8, 256),
        WeightRow::Bf16(v) | WeightRow::F16(v) => (v.as_ptr() as *const u8, 128),
        WeightRow::Int8 { q, .. } => (q.as_ptr() as *const u8, 64),
        WeightRow::Fp8 { q, .. } => (q.as_ptr(), 64),
        WeightRow::Int4 { packed, .. } | WeightRow::Mxfp4 { packed, .. } => (packed.as_ptr(), 32),
        WeightRow::Int6 { lo, .. } => (lo.as_ptr(), 32),
    }
}

/// `L` lanes of `w` from element `start` (`start + L <= len`) as the lanes see them, decoded
/// one by one: for the formats whose f32-activation products are rare (the 6-bit head runs on
/// integer activations; `shimmer quant-eval`'s f32 comparison is what takes this).
#[allow(dead_code)]
#[inline]
fn decoded<const L: usize>(w: &WeightRow<'_>, start: usize) -> [f32; L] {
    std::array::from_fn(|l| w.lane_value(start + l))
}

/// `[f(0), f(1), f(2), f(3)]`, spelt out (`array::map` with a closure does not always inline
/// into the hot loop).
#[allow(unused_macros)]
macro_rules! quad {
    (|$j:ident| $e:expr) => {
        [
            {
                let $j = 0usize;
                $e
            },
            {
                let $j = 1usize;
                $e
            },
            {
                let $j = 2usize;
                $e
            },
            {
                let $j = 3usize;
                $e
            },
        ]
    };
}

/// Which scale group lane `i` falls in: a shift for the power-of-two groups every container uses
/// (an integer division per 16 lanes costs more than the multiply it feeds), a division otherwise.
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct Group {
    size: usize,
    shift: u32,
    pow2: bool,
}

#[allow(dead_code)]
impl Group {
    pub(crate) fn new(size: usize) -> Self {
        Group { size, shift: size.trailing_zeros(), pow2: size.is_power_of_two() }
    }

    #[inline(always)]
    pub(crate) fn of(self, i: usize) -> usize {
        if self.pow2 {
            i >> self.shift
        } else {
            i / self.size
        }
    }
}

/// The parts of `M` rows known to share a format (`same_format`), one array per field.
#[allow(unused_macros)]
macro_rules! fields {
    ($ws:expr, $pat:pat => $val:expr) => {
        $ws.map(|w| match *w {
            $pat => $val,
            _ => unreachable!("rows of one pass share a format"),
        })
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{decoded, stream, tail_chunk, Group, WeightRow, LANES};
    use shimmer_common::quant::{e8m0_to_f32, E2M1, MXFP4_GROUP};
    use std::arch::x86_64::*;

    /// How many chunks ahead of each weight row's step the row loops prefetch (here and in
    /// `qdot`'s integer loops: 4 KiB of int8, 2 KiB of 4-bit, 8 KiB of bf16). One core's misses
    /// to DRAM are bounded by its fill buffers, and rows are contiguous, so a distance shorter
    /// than a row mostly asks for what a tile's next row is already reading. At 8 chunks the m1b
    /// model decoded at 57 (int8), 85 (int4-g32) and 37 (bf16) tok/s on an Intel Xeon; at 32, at
    /// 74, 108 and 41 (`docs/benchmarks.md`, issue 18, 2026-12-06); on an AMD Zen 3 (the AVX2
    /// loops) 16, 32 and 64 decoded the same. Past a matrix's end the hint faults on nothing; it
    /// only wastes a few lines.
    pub(crate) const PREFETCH_AHEAD: usize = 32;

    #[inline(always)]
    pub(crate) unsafe fn reduce256(v8: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
        _mm_cvtss_f32(v1)
    }

    #[inline(always)]
    pub(crate) unsafe fn reduce512(acc: __m512) -> f32 {
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

    /// 32 packed bytes (64 nibbles, low first) → four vectors of 16 nibble values as bytes, in
    /// element order.
    #[inline(always)]
    unsafe fn nibbles64(p: *const u8) -> [__m128i; 4] {
        let b = _mm256_loadu_si256(p as *const __m256i);
        let mask = _mm256_set1_epi8(0x0f);
        let lo = _mm256_and_si256(b, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        // Per 128-bit lane, unpacklo gives bytes 0–7 interleaved (elements 0–15 and 32–47),
        // unpackhi bytes 8–15 (elements 16–31 and 48–63).
        let i0 = _mm256_unpacklo_epi8(lo, hi);
        let i1 = _mm256_unpackhi_epi8(lo, hi);
        [_mm256_castsi256_si128(i0), _mm256_castsi256_si128(i1), _mm256_extracti128_si256(i0, 1), _mm256_extracti128_si256(i1, 1)]
    }

    /// 16 fp8-e4m3 bytes → their f32 values: re-biased into f16 (which handles the subnormals
    /// exactly), widened, times 2⁸; `S.1111.111` (which lands on ±480) becomes NaN.
    #[inline(always)]
    unsafe fn fp8x16(p: *const u8) -> __m512 {
        let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        let h = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
        );
        let f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0));
        let nan = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(f), _mm512_set1_ps(480.0));
        _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(f32::NAN))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx512<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
        let n = ws[0].len();
        let full = n / LANES;
        let mut acc = [[[_mm512_setzero_ps(); 4]; N]; M];
        let streams = ws.map(stream);
        // `$decode` gives chunk `$c` of row `$m` as four vectors of 16 lanes. Each chunk asks
        // for the line `PREFETCH_AHEAD` chunks ahead (rows are contiguous, so this runs on into
        // the next row), which keeps small matrices — an expert is ~1 MB — streaming at DRAM
        // speed; the nibble formats run compute-bound and skip it.
        macro_rules! run {
            (|$m:ident, $c:ident| $decode:expr) => {
                for $c in 0..full {
                    for $m in 0..M {
                        let (base, chunk_bytes) = streams[$m];
                        if chunk_bytes >= 64 {
                            let ahead = base.wrapping_add(($c + PREFETCH_AHEAD) * chunk_bytes);
                            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                            if chunk_bytes > 64 {
                                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64) as *const i8);
                            }
                        }
                        let wv: [__m512; 4] = $decode;
                        for j in 0..4 {
                            for k in 0..N {
                                acc[$m][k][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(xs[k].as_ptr().add($c * LANES + j * 16)), acc[$m][k][j]);
                            }
                        }
                    }
                }
            };
        }
        match *ws[0] {
            WeightRow::F32(_) => {
                let v = fields!(ws, WeightRow::F32(v) => v.as_ptr());
                run!(|m, c| quad!(|j| _mm512_loadu_ps(v[m].add(c * LANES + j * 16))))
            }
            WeightRow::Bf16(_) => {
                let v = fields!(ws, WeightRow::Bf16(v) => v.as_ptr());
                run!(|m, c| quad!(|j| _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(v[m].add(c * LANES + j * 16) as *const __m256i)),
                    16
                ))))
            }
            WeightRow::F16(_) => {
                let v = fields!(ws, WeightRow::F16(v) => v.as_ptr());
                run!(|m, c| quad!(|j| _mm512_cvtph_ps(_mm256_loadu_si256(v[m].add(c * LANES + j * 16) as *const __m256i))))
            }
            WeightRow::Int8 { .. } => {
                let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
                run!(|m, c| quad!(|j| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q[m].add(c * LANES + j * 16) as *const __m128i)))))
            }
            WeightRow::Int4 { group, .. } => {
                let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
                let grp = Group::new(group);
                // `nibble − 8` as f32 by table lookup: one shuffle instead of subtract and convert.
                let lut = _mm512_setr_ps(-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
                run!(|m, c| {
                    let parts = nibbles64(p[m].add(c * LANES / 2));
                    quad!(|j| _mm512_mul_ps(
                        _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(parts[j]), lut),
                        _mm512_set1_ps(shimmer_common::quant::int4_scale(*s[m].get_unchecked(grp.of(c * LANES + j * 16))))
                    ))
                })
            }
            WeightRow::Fp8 { group, .. } => {
                let (q, s) = (fields!(ws, WeightRow::Fp8 { q, .. } => q.as_ptr()), fields!(ws, WeightRow::Fp8 { scales, .. } => scales));
                let grp = Group::new(group);
                run!(|m, c| quad!(|j| {
                    let i = c * LANES + j * 16;
                    _mm512_mul_ps(fp8x16(q[m].add(i)), _mm512_set1_ps(*s[m].get_unchecked(grp.of(i))))
                }))
            }
            WeightRow::Int6 { .. } => run!(|m, c| {
                let t = decoded::<LANES>(ws[m], c * LANES);
                quad!(|j| _mm512_loadu_ps(t.as_ptr().add(j * 16)))
            }),
            WeightRow::Mxfp4 { .. } => {
                let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
                let lut = _mm512_loadu_ps(E2M1.as_ptr());
                run!(|m, c| {
                    let parts = nibbles64(p[m].add(c * LANES / 2));
                    quad!(|j| {
                        let scale = e8m0_to_f32(*s[m].get_unchecked((c * LANES + j * 16) / MXFP4_GROUP));
                        _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(parts[j]), lut), _mm512_set1_ps(scale))
                    })
                })
            }
        }
        if full * LANES < n {
            for m in 0..M {
                for k in 0..N {
                    let (wt, xt) = tail_chunk(ws[m], xs[k], full * LANES, n);
                    #[allow(clippy::needless_range_loop)] // j also offsets the loads
                    for j in 0..4 {
                        acc[m][k][j] = _mm512_fmadd_ps(_mm512_loadu_ps(wt.as_ptr().add(j * 16)), _mm512_loadu_ps(xt.as_ptr().add(j * 16)), acc[m][k][j]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; N]; M];
        for m in 0..M {
            for k in 0..N {
                out[m][k] = super::scaled(ws[m], reduce512x4(&acc[m][k]));
            }
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

    /// Four packed bytes (eight nibbles, low first) → eight nibble values as i32 lanes.
    #[inline(always)]
    unsafe fn nibbles8(p: *const u8) -> __m256i {
        let mask = _mm_set1_epi8(0x0f);
        let b = _mm_cvtsi32_si128((p as *const i32).read_unaligned());
        _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask)))
    }

    /// Eight fp8-e4m3 bytes → f32, as `fp8x16`.
    #[inline(always)]
    unsafe fn fp8x8(p: *const u8) -> __m256 {
        let w = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
        let h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
        let f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0));
        let abs = _mm256_and_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
        let nan = _mm256_cmp_ps::<_CMP_EQ_OQ>(abs, _mm256_set1_ps(480.0));
        _mm256_blendv_ps(f, _mm256_set1_ps(f32::NAN), nan)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx2<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&[f32]; N]) -> [[f32; N]; M] {
        let n = ws[0].len();
        let full = n / LANES;
        let mut acc = [[[_mm256_setzero_ps(); 8]; N]; M];
        // `$decode` gives lanes `$i..$i + 8` of row `$m`.
        macro_rules! run {
            (|$m:ident, $i:ident| $decode:expr) => {
                for c in 0..full {
                    for $m in 0..M {
                        for j in 0..8 {
                            let $i = c * LANES + j * 8;
                            let wv: __m256 = $decode;
                            for k in 0..N {
                                acc[$m][k][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[k].as_ptr().add($i)), acc[$m][k][j]);
                            }
                        }
                    }
                }
            };
        }
        match *ws[0] {
            WeightRow::F32(_) => {
                let v = fields!(ws, WeightRow::F32(v) => v.as_ptr());
                run!(|m, i| _mm256_loadu_ps(v[m].add(i)))
            }
            WeightRow::Bf16(_) => {
                let v = fields!(ws, WeightRow::Bf16(v) => v.as_ptr());
                run!(|m, i| _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v[m].add(i) as *const __m128i)), 16)))
            }
            WeightRow::F16(_) => {
                let v = fields!(ws, WeightRow::F16(v) => v.as_ptr());
                run!(|m, i| _mm256_cvtph_ps(_mm_loadu_si128(v[m].add(i) as *const __m128i)))
            }
            WeightRow::Int8 { .. } => {
                let q = fields!(ws, WeightRow::Int8 { q, .. } => q.as_ptr());
                run!(|m, i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q[m].add(i) as *const __m128i))))
            }
            WeightRow::Int4 { group, .. } => {
                let (p, s) = (fields!(ws, WeightRow::Int4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Int4 { scales, .. } => scales));
                let grp = Group::new(group);
                let eight = _mm256_set1_epi32(8);
                run!(|m, i| _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_sub_epi32(nibbles8(p[m].add(i / 2)), eight)),
                    _mm256_set1_ps(shimmer_common::quant::int4_scale(*s[m].get_unchecked(grp.of(i))))
                ))
            }
            WeightRow::Fp8 { group, .. } => {
                let (q, s) = (fields!(ws, WeightRow::Fp8 { q, .. } => q.as_ptr()), fields!(ws, WeightRow::Fp8 { scales, .. } => scales));
                let grp = Group::new(group);
                run!(|m, i| _mm256_mul_ps(fp8x8(q[m].add(i)), _mm256_set1_ps(*s[m].get_unchecked(grp.of(i)))))
            }
            WeightRow::Int6 { .. } => run!(|m, i| _mm256_loadu_ps(decoded::<8>(ws[m], i).as_ptr())),
            WeightRow::Mxfp4 { .. } => {
                let (p, s) = (fields!(ws, WeightRow::Mxfp4 { packed, .. } => packed.as_ptr()), fields!(ws, WeightRow::Mxfp4 { scales, .. } => scales));
                // The eight magnitudes; the nibble's top bit is the sign.
                let lut = _mm256_loadu_ps(E2M1.as_ptr());
                run!(|m, i| {
                    let idx = nibbles8(p[m].add(i / 2));
                    let sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
                    let v = _mm256_or_ps(_mm256_permutevar8x32_ps(lut, idx), _mm256_castsi256_ps(sign));
                    _mm256_mul_ps(v, _mm256_set1_ps(e8m0_to_f32(*s[m].get_unchecked(i / MXFP4_GROUP))))
                })
            }
        }
        if full * LANES < n {
            for m in 0..M {
                for k in 0..N {
                    let (wt, xt) = tail_chunk(ws[m], xs[k], full * LANES, n);
                    #[allow(clippy::needless_range_loop)] // j also offsets the loads
                    for j in 0..8 {
                        acc[m][k][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wt.as_ptr().add(j * 8)), _mm256_loadu_ps(xt.as_ptr().add(j * 8)), acc[m][k][j]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; N]; M];
        for m in 0..M {
            for k in 0..N {
                out[m][k] = super::scaled(ws[m], reduce256x8(&acc[m][k]));
            }
        }
        out
    }
}

#[cfg(target_arch = "aarch64")]
#[path = "dot/neon.rs"]
pub(crate) mod neon;

#[cfg(test)]
mod tests {
    use super::*;
    use shimmer_common::quant::{dequantize, quantize_int4, quantize_int8, quantize_mxfp4, QuantMatrix};

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
            let mut quants = vec![quantize_int8(&w, 1, n), quantize_mxfp4(&w, 1, n)];
            for g in [32, 64, 128] {
                quants.push(quantize_int4(&w, 1, n, g));
            }
            let sixes: Vec<_> = [32, 64, 128].into_iter().map(|g| shimmer_common::quant::quantize_int6(&w, 1, n, g)).collect();
            // fp8: every code but NaN in turn, with block scales of 128 and of an awkward 48.
            let fp8: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).map(|b| if b & 0x7f == 0x7f { b - 1 } else { b }).collect();
            let fp8_scales: Vec<Vec<f32>> = [128usize, 48, 32, 16].iter().map(|g| values(n.div_ceil(*g), 77 + *g as u64, 0.01)).collect();
            let mut formats: Vec<(String, WeightRow<'_>, Vec<f32>)> = vec![
                ("f32".into(), WeightRow::F32(&w), w.clone()),
                ("bf16".into(), WeightRow::Bf16(&bf), bf.iter().map(|b| half::bf16::from_bits(*b).to_f32()).collect()),
                ("f16".into(), WeightRow::F16(&f16), f16.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect()),
            ];
            for q in &quants {
                let row = match q {
                    QuantMatrix::Int8 { q, scales, .. } => WeightRow::Int8 { q, scale: scales[0] },
                    QuantMatrix::Int4 { packed, scales, group, .. } => WeightRow::Int4 { packed, scales, group: *group, n },
                    QuantMatrix::Mxfp4 { packed, scales, .. } => WeightRow::Mxfp4 { packed, scales, n },
                };
                let label = match q {
                    QuantMatrix::Int8 { .. } => "int8".to_string(),
                    QuantMatrix::Int4 { group, .. } => format!("int4-g{group}"),
                    QuantMatrix::Mxfp4 { .. } => "mxfp4".to_string(),
                };
                formats.push((label, row, dequantize(q)));
            }
            for m in &sixes {
                formats.push((format!("int6-g{}", m.group), WeightRow::Int6 { lo: &m.lo, hi: &m.hi, scales: &m.scales, group: m.group, n }, m.dequantize()));
            }
            for (g, scales) in [128usize, 48, 32, 16].iter().zip(&fp8_scales) {
                let decoded = shimmer_common::quant::dequantize_fp8_blocks(&fp8, 1, n, scales, *g).unwrap_or_else(|e| panic!("{e}"));
                formats.push((format!("fp8-b{g}"), WeightRow::Fp8 { q: &fp8, scales, group: *g }, decoded));
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
                    // Two weight rows in one pass (gate and up), each result as if alone.
                    let [a, b] = dots_rows_with::<2, 2>(isa, [row, row], [&xs[1], &xs[2]]);
                    assert_eq!((bits(&a), bits(&b)), (bits(&want[1..3]), bits(&want[1..3])), "{name} n={n} {isa:?} two rows");
                    let [a, b] = dots_rows_with::<2, 1>(isa, [row, &formats[0].1], [&xs[3]]);
                    assert_eq!(
                        (a[0].to_bits(), b[0].to_bits()),
                        (want[3].to_bits(), dot_scalar(&formats[0].1, &xs[3]).to_bits()),
                        "{name} n={n} {isa:?} rows of two formats"
                    );
                }
            }
        }
    }

    #[test]
    fn the_vector_isa_of_the_architecture_is_found() {
        #[cfg(target_arch = "aarch64")]
        assert!(Isa::all_available().contains(&Isa::Neon), "aarch64 always has Advanced SIMD");
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            Isa::Avx2.available(),
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
        );
        assert!(Isa::all_available().contains(&isa()));
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
            // f16 scales at the top of their range, subnormal, and mixed.
            for pattern in [&[0x7bffu16][..], &[0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0x1234]] {
                let odd: Vec<u16> = (0..scales.len()).map(|g| pattern[g % pattern.len()]).collect();
                let row = WeightRow::Int4 { packed, scales: &odd, group: 32, n };
                assert_eq!(dots_with::<1>(isa, &row, [&x])[0].to_bits(), dot_scalar(&row, &x).to_bits(), "{isa:?} int4 scales {pattern:?}");
            }
            // fp8: NaN codes give NaN, subnormal codes their exact values, on every ISA.
            let codes: Vec<u8> = (0..n).map(|i| [0x7f, 0x01, 0x87, 0x00, 0x80, 0xff, 0x07, 0x08][i % 8]).collect();
            let ones = vec![1.0f32; 1];
            let row = WeightRow::Fp8 { q: &codes, scales: &ones, group: n };
            assert!(dots_with::<1>(isa, &row, [&x])[0].is_nan(), "{isa:?} fp8 NaN");
            let tame: Vec<u8> = codes.iter().map(|b| if b & 0x7f == 0x7f { 0x06 } else { *b }).collect();
            let row = WeightRow::Fp8 { q: &tame, scales: &ones, group: n };
            assert_eq!(dots_with::<1>(isa, &row, [&x])[0].to_bits(), dot_scalar(&row, &x).to_bits(), "{isa:?} fp8 subnormals");
            // MXFP4 with the smallest and largest scales.
            let nibbles: Vec<u8> = (0..n.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect();
            for e in [0u8, 1, 127, 254] {
                let sc = vec![e; n.div_ceil(32)];
                let row = WeightRow::Mxfp4 { packed: &nibbles, scales: &sc, n };
                assert_eq!(dots_with::<1>(isa, &row, [&x])[0].to_bits(), dot_scalar(&row, &x).to_bits(), "{isa:?} mxfp4 scale {e}");
            }
            let zero_scales = vec![0u16; scales.len()];
            let row = WeightRow::Int4 { packed, scales: &zero_scales, group: 32, n };
            assert_eq!(dots_with::<1>(isa, &row, [&x])[0], 0.0);
        }
    }
}
