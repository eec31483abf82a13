//! The integer dot product: int8 / int4 / MXFP4 weight rows against activation rows quantised to
//! int8 in blocks of 32 — llama.cpp's Q8_0 × Q4_0 approach — defined once here and implemented
//! per ISA (AVX-512 VNNI, AVX-VNNI, AVX2, NEON) so that every implementation gives the same bits.
//!
//! **Activations** (`quantize_row`): per block `b` of 32 values (the last zero-padded),
//! `amax = max |x|`, `d_b = amax / 127`, `q = round_ties_even(x · (127 / amax))` (0 when
//! `amax = 0`); a block holding a NaN or an infinity gets `d_b = NaN` (so the result is NaN, never
//! a silently finite number).
//!
//! **Weights as integers**: int8 `q`; int4 `nibble − 8`; MXFP4 `2 · e2m1(nibble)` (±{0, 1, 2, 3,
//! 4, 6, 8, 12}). **Block factor** `f_b = ws_b · d_b` (one rounding), with `ws_b` = 1 for int8
//! (whose row scale multiplies the result), the group scale `s[32b / group]` for int4, and
//! `2^(e_b − 128)` for MXFP4 (the e8m0 scale halved, exactly).
//!
//! **The canonical order** over 32 f32 lanes:
//!
//! ```text
//! acc[l] = 0 for l in 0..32
//! for each block b, for j in 0..8:
//!     p = Σ_{t<4} w[32b + 4j + t] · q[32b + 4j + t]          (exact, in i32)
//!     acc[8·(b mod 4) + j] = fma(f_b, p, acc[8·(b mod 4) + j])
//! for s in [16, 8, 4, 2, 1]:   acc[l] = acc[l] + acc[l + s]   for l < s
//! result = acc[0]  (× the row scale for int8)
//! ```
//!
//! The integer partial sums are exact in any order, so ISAs are free in how they form them
//! (`vpdpbusd` with the activations offset to unsigned, `pmaddubsw` with the sign moved onto the
//! activations, `smull` and pairwise adds); the floating-point steps are the same everywhere. Eight partial sums of
//! four products per block are what one `vpdpbusd` gives, so no ISA reduces horizontally before
//! the end. `tests` below check every ISA the machine has against `qdot_scalar`, bit for bit.
//!
//! Must never: take f32/bf16/f16/fp8 weights (checkpoints run as they are keep `dot.rs`'s exact
//! path), reorder the floating-point steps, or depend on which other rows share a call.

use std::sync::OnceLock;

use shimmer_common::quant::MXFP4_GROUP;

use crate::dot::WeightRow;

/// Values per activation block (one scale each).
pub const QBLOCK: usize = 32;
/// Blocks per canonical lane group: a chunk of `CHUNK` values fills all 32 lanes once.
const BLOCKS_PER_CHUNK: usize = 4;
/// Values per chunk; quantised rows are padded to a multiple of it.
pub const CHUNK: usize = QBLOCK * BLOCKS_PER_CHUNK;
const QLANES: usize = 32;

/// Activation rows quantised to int8 per block of 32, laid out back to back: row `i` holds
/// `padded` bytes of `q + 128` (so `vpdpbusd` can take them as its unsigned side; padding is
/// 128, i.e. `q = 0`), `padded / 32` block scales (padding 0), and each scale again eight times
/// over (`scales8`: one per canonical lane, so vector code loads a block's factor instead of
/// broadcasting it).
#[derive(Debug, Default, Clone)]
pub struct QuantRows {
    n: usize,
    padded: usize,
    rows: usize,
    biased: Vec<u8>,
    scales: Vec<f32>,
    scales8: Vec<f32>,
}

/// One quantised activation row.
#[derive(Clone, Copy)]
pub struct QRow<'a> {
    n: usize,
    /// `q + 128`, `padded` bytes.
    biased: &'a [u8],
    /// `d_b`, `padded / 32` values.
    scales: &'a [f32],
    /// `d_b` eight times over, `padded / 4` values.
    scales8: &'a [f32],
}

impl QRow<'_> {
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The quantised value `q` of element `i` (0 beyond the row).
    #[inline]
    pub fn q(&self, i: usize) -> i8 {
        (self.biased[i] ^ 0x80) as i8
    }

    /// The scale `d_b` of block `b`.
    #[inline]
    pub fn scale(&self, b: usize) -> f32 {
        self.scales[b]
    }
}

impl QuantRows {
    /// `xs` (whole rows of `n` values) quantised, reusing this buffer's memory.
    pub fn quantize(&mut self, xs: &[f32], n: usize) {
        let rows = xs.len().checked_div(n).unwrap_or(0);
        assert_eq!(rows * n, xs.len(), "activation input is not whole rows");
        let padded = n.div_ceil(CHUNK) * CHUNK;
        self.n = n;
        self.padded = padded;
        self.rows = rows;
        self.biased.clear();
        self.biased.resize(rows * padded, 0x80);
        self.scales.clear();
        self.scales.resize(rows * padded / QBLOCK, 0.0);
        for (r, x) in xs.chunks_exact(n.max(1)).enumerate().take(rows) {
            quantize_row(x, &mut self.biased[r * padded..(r + 1) * padded], &mut self.scales[r * padded / QBLOCK..(r + 1) * padded / QBLOCK]);
        }
        self.scales8.clear();
        self.scales8.extend(self.scales.iter().flat_map(|d| [*d; 8]));
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn row(&self, r: usize) -> QRow<'_> {
        let p = self.padded;
        let (b, q) = (p / QBLOCK, p / 4);
        QRow { n: self.n, biased: &self.biased[r * p..(r + 1) * p], scales: &self.scales[r * b..(r + 1) * b], scales8: &self.scales8[r * q..(r + 1) * q] }
    }
}

/// One row quantised into `biased` (`q + 128`, at least `x.len()` rounded up to 32 bytes,
/// already holding 128 in its padding) and `scales` (one per block).
fn quantize_row(x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
    for (b, block) in x.chunks(QBLOCK).enumerate() {
        let finite = block.iter().all(|v| v.is_finite());
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let out = &mut biased[b * QBLOCK..b * QBLOCK + block.len()];
        if !finite {
            scales[b] = f32::NAN;
            out.fill(0x80);
            continue;
        }
        scales[b] = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (o, v) in out.iter_mut().zip(block) {
            let q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            *o = (q as u8) ^ 0x80;
        }
    }
}

/// Whether the integer path takes this row: int8, MXFP4, and int4 whose groups are whole blocks.
pub fn is_integer(w: &WeightRow<'_>) -> bool {
    match w {
        WeightRow::Int8 { .. } | WeightRow::Mxfp4 { .. } => true,
        WeightRow::Int4 { group, .. } => *group > 0 && group.is_multiple_of(QBLOCK),
        _ => false,
    }
}

/// 2 · e2m1 as integers, indexed by nibble (also the vector paths' lookup table).
pub(crate) const E2M1_TWICE: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut i = 0;
    while i < 16 {
        // E2M1 is const-evaluable only through its bit patterns; spell the magnitudes out.
        let mag = [0, 1, 2, 3, 4, 6, 8, 12][i & 7];
        t[i] = if i & 8 != 0 { -mag } else { mag };
        i += 1;
    }
    t
};

/// Weight element `i` as the integer the lanes multiply.
#[inline]
fn weight_int(w: &WeightRow<'_>, i: usize) -> i32 {
    match w {
        WeightRow::Int8 { q, .. } => q[i] as i32,
        WeightRow::Int4 { packed, .. } => {
            let byte = packed[i / 2];
            let nib = if i.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
            nib as i32 - 8
        }
        WeightRow::Mxfp4 { packed, .. } => {
            let byte = packed[i / 2];
            let nib = if i.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
            E2M1_TWICE[nib as usize] as i32
        }
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
}

/// `ws_b`: the weight's part of block `b`'s factor.
#[inline]
fn weight_factor(w: &WeightRow<'_>, b: usize) -> f32 {
    match w {
        WeightRow::Int8 { .. } => 1.0,
        WeightRow::Int4 { scales, group, .. } => scales[b * QBLOCK / group],
        // 2^(e − 128): e8m0 halved (e = 0 gives 2⁻¹²⁸, a subnormal, exactly).
        WeightRow::Mxfp4 { scales, .. } => half_e8m0(scales[b * QBLOCK / MXFP4_GROUP]),
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
}

#[inline]
pub(crate) fn half_e8m0(e: u8) -> f32 {
    if e <= 1 {
        f32::from_bits(1 << (21 + e as u32)) // 2^-128 and 2^-127 are subnormal
    } else if e == 255 {
        f32::NAN
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// The result with int8's row scale applied.
#[inline]
fn finish(w: &WeightRow<'_>, sum: f32) -> f32 {
    match w {
        WeightRow::Int8 { scale, .. } => scale * sum,
        _ => sum,
    }
}

fn reduce(mut acc: [f32; QLANES]) -> f32 {
    for s in [16, 8, 4, 2, 1] {
        for l in 0..s {
            acc[l] += acc[l + s];
        }
    }
    acc[0]
}

/// The definition, in plain code.
pub fn qdot_scalar(w: &WeightRow<'_>, x: &QRow<'_>) -> f32 {
    let n = w.len();
    assert_eq!(x.n, n, "activation row and weight row differ in length");
    let mut acc = [0.0f32; QLANES];
    for b in 0..n.div_ceil(QBLOCK) {
        let f = weight_factor(w, b) * x.scale(b);
        for j in 0..8 {
            let mut p = 0i32;
            for t in 0..4 {
                let i = b * QBLOCK + 4 * j + t;
                if i < n {
                    p += weight_int(w, i) * x.q(i) as i32;
                }
            }
            let l = 8 * (b % BLOCKS_PER_CHUNK) + j;
            acc[l] = f.mul_add(p as f32, acc[l]);
        }
    }
    finish(w, reduce(acc))
}

/// A weight row's last, partial chunk as its stored bytes (int8 values, or packed nibbles in the
/// first half) zero-padded to a whole chunk, so vector code decodes it as any other chunk, with
/// the chunk's four weight factors (0 for blocks past the row). What the padding decodes to does
/// not matter: the activations there are `q = 0`, so its integer products are 0, and the
/// padding blocks' factors are `0 · 0` (`fma(0, 0, acc) = acc`, as `acc` is never −0).
pub(crate) fn tail_bytes(w: &WeightRow<'_>, start: usize) -> ([u8; CHUNK], [f32; BLOCKS_PER_CHUNK]) {
    let n = w.len();
    let mut bytes = [0u8; CHUNK];
    match w {
        WeightRow::Int8 { q, .. } => {
            for (o, v) in bytes.iter_mut().zip(&q[start..n]) {
                *o = *v as u8;
            }
        }
        WeightRow::Int4 { packed, .. } | WeightRow::Mxfp4 { packed, .. } => {
            let tail = &packed[start / 2..n.div_ceil(2)];
            bytes[..tail.len()].copy_from_slice(tail);
        }
        _ => unreachable!("the integer path takes int8, int4 and MXFP4 rows only"),
    }
    let mut factors = [0.0f32; BLOCKS_PER_CHUNK];
    for (k, f) in factors.iter_mut().enumerate() {
        let b = start / QBLOCK + k;
        if b * QBLOCK < n {
            *f = weight_factor(w, b);
        }
    }
    (bytes, factors)
}

/// The instruction sets of the integer path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntIsa {
    Scalar,
    /// AVX2 `pmaddubsw` / `pmaddwd`.
    Avx2,
    /// AVX-VNNI: 256-bit `vpdpbusd` (Alder Lake and later, Sapphire Rapids, Zen 5).
    AvxVnni,
    /// AVX-512 VNNI: 512-bit `vpdpbusd` (Ice Lake and later, Zen 4 and later).
    Avx512Vnni,
    /// aarch64 Advanced SIMD: `smull` + pairwise adds (`sdot` needs an intrinsic stable Rust
    /// does not have yet).
    Neon,
}

impl IntIsa {
    pub fn name(self) -> &'static str {
        match self {
            IntIsa::Scalar => "scalar",
            IntIsa::Avx2 => "avx2",
            IntIsa::AvxVnni => "avxvnni",
            IntIsa::Avx512Vnni => "avx512vnni",
            IntIsa::Neon => "neon",
        }
    }

    pub fn available(self) -> bool {
        match self {
            IntIsa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            IntIsa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            IntIsa::AvxVnni => IntIsa::Avx2.available() && std::is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            IntIsa::Avx512Vnni => {
                IntIsa::Avx2.available()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            IntIsa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every integer ISA this machine can run, best last.
    pub fn all_available() -> Vec<IntIsa> {
        [IntIsa::Scalar, IntIsa::Neon, IntIsa::Avx2, IntIsa::AvxVnni, IntIsa::Avx512Vnni].into_iter().filter(|i| i.available()).collect()
    }

    /// Parses a `SHIMMER_INT_ISA` value.
    pub fn parse(s: &str) -> Option<IntIsa> {
        [IntIsa::Scalar, IntIsa::Avx2, IntIsa::AvxVnni, IntIsa::Avx512Vnni, IntIsa::Neon].into_iter().find(|i| i.name() == s)
    }
}

/// The integer ISA the kernels use: the best available; `SHIMMER_INT_ISA` names another the
/// machine has; `SHIMMER_ISA=scalar` makes it scalar too. Chosen once per process (the bits do
/// not depend on it).
pub fn int_isa() -> IntIsa {
    static ISA: OnceLock<IntIsa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let wanted = std::env::var("SHIMMER_INT_ISA").ok().and_then(|s| IntIsa::parse(&s));
        let scalar = std::env::var("SHIMMER_ISA").is_ok_and(|s| s == "scalar");
        match wanted {
            Some(i) if i.available() => i,
            _ if scalar => IntIsa::Scalar,
            _ => *IntIsa::all_available().last().unwrap_or(&IntIsa::Scalar),
        }
    })
}

/// `ws[m] · xs[k]` for `M` weight rows (one length and format) and `N` quantised activation rows
/// in one pass; every result is exactly `qdot_scalar(ws[m], xs[k])`.
#[inline]
pub fn qdots_rows<const M: usize, const N: usize>(ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    // `int_isa` returns only what `available` confirmed.
    qdots_checked(int_isa(), ws, xs)
}

/// `qdots_rows` with a given ISA (which must be available).
pub fn qdots_rows_with<const M: usize, const N: usize>(isa: IntIsa, ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    qdots_checked(isa, ws, xs)
}

/// `qdots_rows_with` for an ISA known to be available.
#[inline]
fn qdots_checked<const M: usize, const N: usize>(isa: IntIsa, ws: [&WeightRow<'_>; M], xs: [&QRow<'_>; N]) -> [[f32; N]; M] {
    let Some(first) = ws.first() else { return [[0.0; N]; M] };
    for w in &ws {
        assert!(is_integer(w), "the integer path takes int8, int4 and MXFP4 rows only");
        assert_eq!(w.len(), first.len(), "weight rows of one pass differ in length");
    }
    for x in &xs {
        // Equal, not just long enough: blocks past the weight row must not take part.
        assert_eq!(x.n, first.len(), "activation row and weight row differ in length");
    }
    let same = ws.iter().all(|w| match (w, first) {
        (WeightRow::Int8 { .. }, WeightRow::Int8 { .. }) | (WeightRow::Mxfp4 { .. }, WeightRow::Mxfp4 { .. }) => true,
        (WeightRow::Int4 { group: a, .. }, WeightRow::Int4 { group: b, .. }) => a == b,
        _ => false,
    });
    if M > 1 && !same {
        let mut out = [[0.0; N]; M];
        for (o, w) in out.iter_mut().zip(ws) {
            *o = qdots_checked::<1, N>(isa, [w], xs)[0];
        }
        return out;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` confirmed the ISA (asserted above); rows share one length and
        // format and the activation rows are at least as long, padded to whole chunks.
        IntIsa::Avx512Vnni => unsafe { x86::qdots_avx512vnni::<M, N>(ws, xs) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qdots_avxvnni::<M, N>(ws, xs) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qdots_avx2::<M, N>(ws, xs) },
        #[cfg(target_arch = "aarch64")]
        IntIsa::Neon => unsafe { neon::qdots_neon::<M, N>(ws, xs) },
        _ => {
            let mut out = [[0.0; N]; M];
            for (o, w) in out.iter_mut().zip(ws) {
                for (slot, x) in o.iter_mut().zip(xs) {
                    *slot = qdot_scalar(w, x);
                }
            }
            out
        }
    }
}

/// Activation rows per pass over a weight row that keep the accumulators in registers.
pub fn batch_width() -> usize {
    match int_isa() {
        IntIsa::Avx512Vnni => 4,
        IntIsa::Scalar => 1,
        _ => 2,
    }
}

/// Activation rows per fused pass over two weight rows (gate and up).
pub fn pair_batch_width() -> usize {
    match int_isa() {
        IntIsa::Avx512Vnni => 4,
        IntIsa::Scalar => 1,
        _ => 2,
    }
}

/// The parts of `M` rows known to share a format, one array per field.
macro_rules! fields {
    ($ws:expr, $pat:pat => $val:expr) => {
        $ws.map(|w| match *w {
            $pat => $val,
            _ => unreachable!("rows of one pass share a format"),
        })
    };
}

#[cfg(target_arch = "x86_64")]
#[path = "qdot/x86.rs"]
mod x86;

#[cfg(target_arch = "aarch64")]
#[path = "qdot/neon.rs"]
mod neon;

#[cfg(test)]
#[path = "qdot/tests.rs"]
mod tests;
