//! The integer dot product: int8 / int4 / int6 / MXFP4 weight rows against activation rows quantised to
//! int8 in blocks of 32 — llama.cpp's Q8_0 × Q4_0 approach — defined once here and implemented
//! per ISA (AVX-512 VNNI, AVX-VNNI, AVX2, NEON) so that every implementation gives the same bits.
//!
//! **Activations** (`quantize_row`): per block `b` of 32 values (the last zero-padded),
//! `amax = max |x|`, `d_b = amax / 127`, `q = round_ties_even(x · (127 / amax))` (0 when
//! `amax = 0`); a block holding a NaN or an infinity gets `d_b = NaN` (so the result is NaN, never
//! a silently finite number).
//!
//! **Weights as integers**: int8 `q`; int4 `nibble − 8`; int6 `(nibble | top << 4) − 32` (its
//! low nibbles stored as int4's, its top two bits in a plane beside them: `quant::Int6Matrix`);
//! MXFP4 `2 · e2m1(nibble)` (±{0, 1, 2, 3, 4, 6, 8, 12}). **Block factor** `f_b = ws_b · d_b`
//! (one rounding), with `ws_b` = 1 for int8 (whose row scale multiplies the result), the group
//! scale `s[32b / group]` for int4 and int6, and
//! `2^(e_b − 128)` for MXFP4 (the e8m0 scale halved, exactly).
//!
//! **The canonical order.** Each block's products form exact partial sums (in i32), each of
//! which takes one FMA with the block's factor into a lane; the lanes are then reduced in a fixed
//! tree:
//!
//! - **int8** (bytes in element order), 32 lanes: group `g < 8` of block `b` is elements
//!   `32b + 4g .. +4`, `p = Σ w·q` over it, `acc[8·(b mod 4) + g] = fma(f_b, p, acc[…])`; then
//!   `acc[l] += acc[l + s]` for `s` in 16, 8, 4, 2, 1; result `acc[0]` × the row scale.
//! - **4-bit formats** (int4, MXFP4, and int6 by its low nibbles: two elements a byte, the even
//!   one in the low nibble), 8 lanes: half `t ∈ {0, 1}` of block `b` is elements
//!   `32b + 16t .. +16`, `p = Σ w·q` over it, `acc[nibble_lane(b mod 4, t)] = fma(f_b, p, acc[…])`
//!   (`nibble_lane(kb, t) = 2·[0, 2, 1, 3][kb] + t`); then `s` in 4, 2, 1. Two sums a block
//!   instead of eight: on AVX2 the 4-bit products ran at about half the multiply-adds per second
//!   with eight (`kernels/examples/block_order.rs`, `docs/benchmarks.md`). The activations are
//!   laid out once per row (`QRow`): per chunk the even elements then the odd ones, so a vector
//!   of packed bytes masked to its low nibbles, or shifted to its high ones, meets them in place,
//!   and each lane's offset sum and factor in lane order.
//!
//! Within a lane the FMAs go block after block (`b`, `b + 4`, `b + 8`, …). The integer partial
//! sums are exact in any order, so ISAs are free in how they form them (`vpdpbusd` with the
//! activations offset to unsigned for int8, and with the 4-bit weights offset to unsigned and the
//! offset's sum over the activations taken back for int4, int6 and MXFP4 — int6's −32 is four
//! times int4's −8; `pmaddubsw`, `pmaddwd` and one `vphaddd` a chunk; `smull` and pairwise adds);
//! the floating-point steps are the same everywhere. `tests` below check every ISA the machine
//! has against `qdot_scalar`, bit for bit.
//!
//! Must never: take f32/bf16/f16/fp8 weights (checkpoints run as they are keep `dot.rs`'s exact
//! path), reorder the floating-point steps, or depend on which other rows share a call.

use std::sync::OnceLock;

use shimmer_common::quant::{int4_scale, int6_code, Int6Matrix, MXFP4_GROUP};

use crate::aligned::AlignedVec;
use crate::dot::WeightRow;

/// Values per activation block (one scale each).
pub const QBLOCK: usize = 32;
/// Blocks per canonical lane group: a chunk of `CHUNK` values fills all 32 lanes once.
const BLOCKS_PER_CHUNK: usize = 4;
/// Values per chunk; quantised rows are padded to a multiple of it.
pub const CHUNK: usize = QBLOCK * BLOCKS_PER_CHUNK;
const QLANES: usize = 32;
/// Lanes of the 4-bit formats' order: a chunk's eight half-block sums.
pub(crate) const NLANES: usize = 8;

/// The 4-bit formats' lane of half `t` of block `kb` of a chunk: `2·[0, 2, 1, 3][kb] + t`, where
/// one `vphaddd` of a chunk's two 32-byte halves leaves it on AVX2 (the other ISAs put their sums
/// there).
#[inline(always)]
pub(crate) const fn nibble_lane(kb: usize, t: usize) -> usize {
    2 * [0, 2, 1, 3][kb] + t
}

/// Activation rows quantised to int8 per block of 32, laid out back to back. Row `i` holds, for
/// int8 weights, `padded` bytes of `q + 128` (so `vpdpbusd` can take them as its unsigned side;
/// padding is 128, i.e. `q = 0`); for 4-bit weights, per chunk of 128 values, `q` of its 64 even
/// elements then of its 64 odd ones (the nibble layout; padding 0) and each 4-bit lane's `Σ q`
/// (over its sixteen elements) times −8 and −12 (the int4 and MXFP4 offsets taken back); the
/// `padded / 32` block scales (padding 0), each again eight times over (`scales8`: one per int8
/// lane) and by 4-bit lane (`lane_scales`: eight a chunk, `nibble_lane`'s order), so vector code
/// loads a block's factor instead of broadcasting it.
#[derive(Debug, Default, Clone)]
pub struct QuantRows {
    n: usize,
    padded: usize,
    rows: usize,
    biased: AlignedVec<u8>,
    split: AlignedVec<i8>,
    neg8: AlignedVec<i32>,
    neg12: AlignedVec<i32>,
    scales: Vec<f32>,
    scales8: AlignedVec<f32>,
    lane_scales: AlignedVec<f32>,
}

/// One quantised activation row.
#[derive(Clone, Copy)]
pub struct QRow<'a> {
    n: usize,
    /// `q + 128`, `padded` bytes, element order (int8 weights).
    biased: &'a [u8],
    /// `q` in the 4-bit layout: per chunk, the 64 even elements then the 64 odd ones.
    split: &'a [i8],
    /// Per 4-bit lane (eight a chunk, `nibble_lane`'s order), `−8 · Σ q` and `−12 · Σ q` over
    /// its sixteen elements (for `vpdpbusd`/`pmaddubsw`; NEON multiplies signed).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    neg8: &'a [i32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    neg12: &'a [i32],
    /// `d_b`, `padded / 32` values.
    scales: &'a [f32],
    /// `d_b` eight times over, `padded / 4` values.
    scales8: &'a [f32],
    /// `d_b` by 4-bit lane, eight a chunk (`padded / 16` values).
    lane_scales: &'a [f32],
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

    /// Whether the row carries the 4-bit layout (`quantize_for` with `nibbles`), which int4 and
    /// MXFP4 products read.
    pub fn has_nibbles(&self) -> bool {
        self.split.len() == self.biased.len()
    }

    /// The scale `d_b` of block `b`.
    #[inline]
    pub fn scale(&self, b: usize) -> f32 {
        self.scales[b]
    }
}

impl QuantRows {
    /// `xs` (whole rows of `n` values) quantised for every weight format, reusing this buffer's
    /// memory.
    pub fn quantize(&mut self, xs: &[f32], n: usize) {
        self.quantize_for(xs, n, true)
    }

    /// `quantize`, with the 4-bit layout only when `nibbles` (an int8 matrix's products do not
    /// read it; the 4-bit paths refuse rows without it).
    pub fn quantize_for(&mut self, xs: &[f32], n: usize, nibbles: bool) {
        let rows = xs.len().checked_div(n).unwrap_or(0);
        assert_eq!(rows * n, xs.len(), "activation input is not whole rows");
        let padded = n.div_ceil(CHUNK) * CHUNK;
        self.n = n;
        self.padded = padded;
        self.rows = rows;
        // Sized without clearing (what an earlier call left is overwritten below, and only the
        // padding is filled: the fills of whole buffers were a prompt's step's largest serial
        // cost after the products, `docs/benchmarks.md`, issue 18).
        self.biased.resize(rows * padded, 0x80);
        self.scales.resize(rows * padded / QBLOCK, 0.0);
        let written_scales = n.div_ceil(QBLOCK);
        for (r, x) in xs.chunks_exact(n.max(1)).enumerate().take(rows) {
            let (biased, scales) = (&mut self.biased[r * padded..(r + 1) * padded], &mut self.scales[r * padded / QBLOCK..(r + 1) * padded / QBLOCK]);
            quantize_row(x, biased, scales);
            biased[n..].fill(0x80);
            scales[written_scales..].fill(0.0);
        }
        // Filled in place: `extend` over a `flat_map` took ~7 % of a small product's time.
        self.scales8.resize(self.scales.len() * 8, 0.0);
        for (d, o) in self.scales.iter().zip(self.scales8.chunks_exact_mut(8)) {
            o.fill(*d);
        }
        if !nibbles {
            self.lane_scales.clear();
            self.split.clear();
            self.neg8.clear();
            self.neg12.clear();
            return;
        }
        // As above: sized, not cleared; every element is written below.
        self.lane_scales.resize(self.scales.len() * 2, 0.0);
        for (d, o) in self.scales.chunks_exact(BLOCKS_PER_CHUNK).zip(self.lane_scales.chunks_exact_mut(NLANES)) {
            for (kb, v) in d.iter().enumerate() {
                (o[nibble_lane(kb, 0)], o[nibble_lane(kb, 1)]) = (*v, *v);
            }
        }
        // The 4-bit layout: chunk by chunk, even elements then odd ones, and each lane's sum.
        self.split.resize(rows * padded, 0);
        self.neg8.resize(rows * padded / 16, 0);
        self.neg12.resize(rows * padded / 16, 0);
        nibble_layout_with(int_isa(), &self.biased, &mut self.split, &mut self.neg8, &mut self.neg12);
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn row(&self, r: usize) -> QRow<'_> {
        let p = self.padded;
        let (b, q, e) = (p / QBLOCK, p / 4, p / 16);
        // Without the 4-bit layout its slices are empty (`QRow::has_nibbles`).
        let part = |v: usize| if self.split.is_empty() { 0..0 } else { r * v..(r + 1) * v };
        QRow {
            n: self.n,
            biased: &self.biased[r * p..(r + 1) * p],
            split: &self.split[part(p)],
            neg8: &self.neg8[part(e)],
            neg12: &self.neg12[part(e)],
            scales: &self.scales[r * b..(r + 1) * b],
            scales8: &self.scales8[r * q..(r + 1) * q],
            lane_scales: &self.lane_scales[part(e)],
        }
    }
}

/// `nibble_layout_scalar`'s layout built with `isa`'s instructions where it has a version (the
/// scalar one otherwise).
pub(crate) fn nibble_layout_with(isa: IntIsa, biased: &[u8], split: &mut [i8], neg8: &mut [i32], neg12: &mut [i32]) {
    assert!(isa.available(), "{} is not available here", isa.name());
    assert!(biased.len().is_multiple_of(CHUNK) && split.len() >= biased.len() && neg8.len() >= biased.len() / 16 && neg12.len() >= biased.len() / 16);
    match isa {
        // SAFETY (both): the ISA is available (asserted); the buffers are whole chunks (asserted).
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx512Vnni => {
            unsafe { x86::nibble_split_avx512vnni(biased, split) };
            nibble_lane_sums(biased, neg8, neg12);
        }
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 | IntIsa::AvxVnni => {
            unsafe { x86::nibble_split_avx2(biased, split) };
            nibble_lane_sums(biased, neg8, neg12);
        }
        _ => nibble_layout_scalar(biased, split, neg8, neg12),
    }
}

/// Each 4-bit lane's `Σ q` (sixteen consecutive elements: half `t` of block `kb`) times −8 and
/// −12, in `nibble_lane`'s order, from whole chunks of `q + 128` bytes.
fn nibble_lane_sums(biased: &[u8], neg8: &mut [i32], neg12: &mut [i32]) {
    for ((chunk, n8), n12) in biased.chunks_exact(CHUNK).zip(neg8.chunks_exact_mut(NLANES)).zip(neg12.chunks_exact_mut(NLANES)) {
        for (h, sixteen) in chunk.chunks_exact(16).enumerate() {
            let sum = sixteen.iter().map(|b| *b as i32).sum::<i32>() - 16 * 128;
            let l = nibble_lane(h / 2, h % 2);
            (n8[l], n12[l]) = (-8 * sum, -12 * sum);
        }
    }
}

/// The 4-bit layout of whole chunks of `q + 128` bytes (`QuantRows`): per chunk the 64 even
/// elements' `q`, then the 64 odd ones', and per 4-bit lane the sum of its sixteen `q` times −8
/// and −12. The definition the vector builds are held to (integers: exact either way).
pub(crate) fn nibble_layout_scalar(biased: &[u8], split: &mut [i8], neg8: &mut [i32], neg12: &mut [i32]) {
    for (chunk, split) in biased.chunks_exact(CHUNK).zip(split.chunks_exact_mut(CHUNK)) {
        for (k, pair) in chunk.chunks_exact(2).enumerate() {
            split[k] = (pair[0] ^ 0x80) as i8;
            split[CHUNK / 2 + k] = (pair[1] ^ 0x80) as i8;
        }
    }
    nibble_lane_sums(biased, neg8, neg12);
}

/// `xs` (whole rows of `n` values) quantised as every product of this module quantises them, in
/// the plainest layout — for devices that take the quantised activations from here (the GPU's
/// integer kernels): per row, `q` as `i8` for `⌈n / 32⌉ · 32` values (zero past `n`) and the
/// `⌈n / 32⌉` block scales `d_b`.
pub fn quantize_plain(xs: &[f32], n: usize, q: &mut Vec<i8>, scales: &mut Vec<f32>) {
    let rows = xs.len().checked_div(n).unwrap_or(0);
    assert_eq!(rows * n, xs.len(), "activation input is not whole rows");
    let blocks = n.div_ceil(QBLOCK);
    q.clear();
    q.resize(rows * blocks * QBLOCK, 0);
    scales.clear();
    scales.resize(rows * blocks, 0.0);
    let mut biased = vec![0x80u8; blocks * QBLOCK];
    for (r, x) in xs.chunks_exact(n.max(1)).enumerate() {
        biased.fill(0x80);
        quantize_row(x, &mut biased, &mut scales[r * blocks..(r + 1) * blocks]);
        for (o, b) in q[r * blocks * QBLOCK..(r + 1) * blocks * QBLOCK].iter_mut().zip(&biased) {
            *o = (b ^ 0x80) as i8;
        }
    }
}

/// One row quantised into `biased` (`q + 128`, at least `x.len()` rounded up to 32 bytes,
/// already holding 128 in its padding) and `scales` (one per block).
fn quantize_row(x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
    quantize_row_with(crate::dot::isa(), x, biased, scales)
}

/// `quantize_row` with `isa`'s instructions where it has a version (the scalar one otherwise).
pub(crate) fn quantize_row_with(isa: crate::dot::Isa, x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
    assert!(isa.available(), "{} is not available here", isa.name());
    assert!(biased.len() >= x.len() && scales.len() >= x.len().div_ceil(QBLOCK), "quantize_row: output too short");
    match isa {
        // SAFETY (both): the ISA is available (asserted; AVX-512 means F and BW, AVX2 means AVX2
        // and FMA); the slices are as `quantize_row_scalar` takes them (asserted).
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx512 => unsafe { x86::quantize_row_avx512(x, biased, scales) },
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx2 => unsafe { x86::quantize_row_avx2(x, biased, scales) },
        _ => quantize_row_scalar(x, biased, scales),
    }
}

/// The quantiser's definition: per block of `QBLOCK`, `d = amax / 127` and `q = round(x · 127 /
/// amax)` ties to even; a block with a NaN or infinity gets a NaN scale and zeros. Every vector
/// version gives these bits.
pub(crate) fn quantize_row_scalar(x: &[f32], biased: &mut [u8], scales: &mut [f32]) {
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
            let q = round_small_ties_even(v * inv).clamp(-127.0, 127.0) as i8;
            *o = (q as u8) ^ 0x80;
        }
    }
}

/// `y.round_ties_even()` for `|y| < 2^22` (a scaled activation is within ±127 and a bit): adding
/// and taking back 1.5 · 2^23 leaves the nearest integer, ties to even, in IEEE arithmetic — two
/// additions, where `round_ties_even` is a call into libm on a baseline x86-64 build.
#[inline(always)]
fn round_small_ties_even(y: f32) -> f32 {
    (y + ROUND_MAGIC) - ROUND_MAGIC
}

pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23

/// Whether the integer path takes this row: int8, MXFP4, and int4 and int6 whose groups are
/// whole blocks.
pub fn is_integer(w: &WeightRow<'_>) -> bool {
    match w {
        WeightRow::Int8 { .. } | WeightRow::Mxfp4 { .. } => true,
        WeightRow::Int4 { group, .. } | WeightRow::Int6 { group, .. } => *group > 0 && group.is_multiple_of(QBLOCK),
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

/// `2 · e2m1 + 12` by nibble: MXFP4's integers offset to unsigned (0..=24), for `vpdpbusd` and
/// `pmaddubsw`, whose unsigned side the weights then are (the offset is taken back with the
/// activations' `neg12`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const E2M1_TWICE_PLUS12: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (E2M1_TWICE[i] + 12) as u8;
        i += 1;
    }
    t
};

/// A weight format of the integer path, as the ISA code dispatches on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fmt {
    Int8,
    Int4 {
        group: usize,
    },
    /// Read as int4 (its low nibbles, the same lanes) with each element's top bits from `RawRow::hi`.
    Int6 {
        group: usize,
    },
    Mxfp4,
}

/// One weight row as the ISA code reads it: `data` its bytes (int8 values, or packed nibbles),
/// `scales` its group scales (int4, int6: f16 a group; MXFP4: e8m0 a block), `scale` int8's row
/// scale, `hi` int6's top bits (32 bytes per chunk, whole chunks; null for the other formats).
#[derive(Clone, Copy)]
pub(crate) struct RawRow {
    pub data: *const u8,
    pub scales: *const u8,
    pub scale: f32,
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    pub hi: *const u8,
}

/// `value / group` — by shift for the container's groups (powers of two): a `div` sat on the
/// path of every short row's dot product, where its tail finds the group scales (the demo's
/// 64-wide down projection is all tail).
#[inline(always)]
pub(crate) fn group_index(value: usize, group: usize) -> usize {
    if group.is_power_of_two() {
        value >> group.trailing_zeros()
    } else {
        value / group
    }
}

impl RawRow {
    /// `ws_b`, as `weight_factor` defines it.
    #[inline(always)]
    pub(crate) unsafe fn factor(&self, fmt: Fmt, b: usize) -> f32 {
        match fmt {
            Fmt::Int8 => 1.0,
            Fmt::Int4 { group } | Fmt::Int6 { group } => int4_scale((self.scales as *const u16).add(group_index(b * QBLOCK, group)).read_unaligned()),
            Fmt::Mxfp4 => half_e8m0(*self.scales.add(b * QBLOCK / MXFP4_GROUP)),
        }
    }

    /// The row's last, partial chunk from `start` as its stored bytes (int8 values, or packed
    /// nibbles in the first half — int6's low nibbles; its top bits are whole chunks, read in place) zero-padded to a whole chunk, so vector code decodes it as any
    /// other chunk, with the chunk's four weight factors (0 for blocks past the row). What the
    /// padding decodes to does not matter: the activations there are `q = 0` (their offset sums
    /// too), so its integer products are 0, and the padding blocks' factors are `0 · 0`
    /// (`fma(0, 0, acc) = acc`, as `acc` is never −0).
    #[inline(never)]
    pub(crate) unsafe fn tail(&self, fmt: Fmt, n: usize, start: usize) -> ([u8; CHUNK], [f32; BLOCKS_PER_CHUNK]) {
        let mut bytes = [0u8; CHUNK];
        let (from, len) = match fmt {
            Fmt::Int8 => (start, n - start),
            _ => (start / 2, n.div_ceil(2) - start / 2),
        };
        std::ptr::copy_nonoverlapping(self.data.add(from), bytes.as_mut_ptr(), len);
        (bytes, self.tail_factors(fmt, n, start))
    }

    /// The weight factors of the chunk from `start`, 0 for blocks past the row.
    #[inline(always)]
    pub(crate) unsafe fn tail_factors(&self, fmt: Fmt, n: usize, start: usize) -> [f32; BLOCKS_PER_CHUNK] {
        let mut factors = [0.0f32; BLOCKS_PER_CHUNK];
        for (k, f) in factors.iter_mut().enumerate() {
            let b = start / QBLOCK + k;
            if b * QBLOCK < n {
                *f = self.factor(fmt, b);
            }
        }
        factors
    }
}

/// A matrix of integer rows as raw parts, for the loops over rows inside the ISA code. Built
/// only from slices whose lengths were checked against its shape.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub(crate) fmt: Fmt,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    data: *const u8,
    row_bytes: usize,
    scales: *const u8,
    /// Bytes of `scales` a row.
    row_scale_bytes: usize,
    int8_scales: *const f32,
    /// int6's top bits (`Int6Matrix::hi_bytes_per_row` a row); null for the other formats.
    hi: *const u8,
    row_hi_bytes: usize,
    _borrows: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> QMatrix<'a> {
    /// int8 rows `q` (`rows × cols`) with one scale a row.
    pub fn int8(q: &'a [i8], scales: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(q.len() >= rows * cols && scales.len() >= rows, "int8 matrix parts are shorter than its shape");
        let (data, int8_scales) = (q.as_ptr() as *const u8, scales.as_ptr());
        QMatrix {
            fmt: Fmt::Int8,
            rows,
            cols,
            data,
            row_bytes: cols,
            scales: std::ptr::null(),
            row_scale_bytes: 0,
            int8_scales,
            hi: std::ptr::null(),
            row_hi_bytes: 0,
            _borrows: Default::default(),
        }
    }

    /// int4 rows (`ceil(cols / 2)` packed bytes and `ceil(cols / group)` scales a row).
    pub fn int4(packed: &'a [u8], scales: &'a [u16], group: usize, rows: usize, cols: usize) -> Self {
        assert!(group > 0 && group.is_multiple_of(QBLOCK), "int4 groups of the integer path are whole blocks");
        let (bpr, gpr) = (cols.div_ceil(2), cols.div_ceil(group));
        assert!(packed.len() >= rows * bpr && scales.len() >= rows * gpr, "int4 matrix parts are shorter than its shape");
        let sc = scales.as_ptr() as *const u8;
        QMatrix {
            fmt: Fmt::Int4 { group },
            rows,
            cols,
            data: packed.as_ptr(),
            row_bytes: bpr,
            scales: sc,
            row_scale_bytes: 2 * gpr,
            int8_scales: std::ptr::null(),
            hi: std::ptr::null(),
            row_hi_bytes: 0,
            _borrows: Default::default(),
        }
    }

    /// int6 rows: int4's low nibbles and scales, and `Int6Matrix::hi_bytes_per_row(cols)` bytes
    /// of top bits a row.
    pub fn int6(lo: &'a [u8], hi: &'a [u8], scales: &'a [u16], group: usize, rows: usize, cols: usize) -> Self {
        assert!(group > 0 && group.is_multiple_of(QBLOCK), "int6 groups of the integer path are whole blocks");
        let hpr = Int6Matrix::hi_bytes_per_row(cols);
        assert!(hi.len() >= rows * hpr, "int6 top bits are shorter than its shape");
        let q = Self::int4(lo, scales, group, rows, cols);
        QMatrix { fmt: Fmt::Int6 { group }, hi: hi.as_ptr(), row_hi_bytes: hpr, ..q }
    }

    /// MXFP4 rows (`ceil(cols / 2)` packed bytes and `ceil(cols / 32)` e8m0 scales a row).
    pub fn mxfp4(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Self {
        let (bpr, gpr) = (cols.div_ceil(2), cols.div_ceil(MXFP4_GROUP));
        assert!(packed.len() >= rows * bpr && scales.len() >= rows * gpr, "MXFP4 matrix parts are shorter than its shape");
        QMatrix {
            fmt: Fmt::Mxfp4,
            rows,
            cols,
            data: packed.as_ptr(),
            row_bytes: bpr,
            scales: scales.as_ptr(),
            row_scale_bytes: gpr,
            int8_scales: std::ptr::null(),
            hi: std::ptr::null(),
            row_hi_bytes: 0,
            _borrows: Default::default(),
        }
    }

    /// Row `r`'s raw parts (`r < rows`, which the callers check once per call): the x86 row loops.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) unsafe fn raw(&self, r: usize) -> RawRow {
        let scale = if self.fmt == Fmt::Int8 { *self.int8_scales.add(r) } else { 1.0 };
        RawRow {
            data: self.data.add(r * self.row_bytes),
            scales: self.scales.wrapping_add(r * self.row_scale_bytes),
            scale,
            hi: self.hi.wrapping_add(r * self.row_hi_bytes),
        }
    }

    /// Every activation row is as long as a weight row and, for 4-bit weights, carries their
    /// layout (the row loops read it through raw pointers).
    fn check_activations(&self, xs: &[QRow<'_>]) {
        for x in xs {
            assert_eq!(x.n, self.cols, "activation row and weight rows differ in length");
            assert!(self.fmt == Fmt::Int8 || x.has_nibbles(), "4-bit weights need activations quantised with their layout");
        }
    }

    /// Whether the rows are 4-bit or int6 (their products read the activations' 4-bit layout).
    pub fn nibbles(&self) -> bool {
        self.fmt != Fmt::Int8
    }

    /// Row `r` as the dot kernels read it.
    pub fn row(&self, r: usize) -> WeightRow<'a> {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let (n, bpr) = (self.cols, self.row_bytes);
        // SAFETY: the constructors checked the slices cover `rows` rows of these sizes.
        unsafe {
            let data = std::slice::from_raw_parts(self.data.add(r * bpr), bpr);
            match self.fmt {
                Fmt::Int8 => WeightRow::Int8 { q: std::slice::from_raw_parts(data.as_ptr() as *const i8, n), scale: *self.int8_scales.add(r) },
                Fmt::Int4 { group } => {
                    let scales = std::slice::from_raw_parts(self.scales.add(r * self.row_scale_bytes) as *const u16, self.row_scale_bytes / 2);
                    WeightRow::Int4 { packed: data, scales, group, n }
                }
                Fmt::Int6 { group } => {
                    let scales = std::slice::from_raw_parts(self.scales.add(r * self.row_scale_bytes) as *const u16, self.row_scale_bytes / 2);
                    let hi = std::slice::from_raw_parts(self.hi.add(r * self.row_hi_bytes), self.row_hi_bytes);
                    WeightRow::Int6 { lo: data, hi, scales, group, n }
                }
                Fmt::Mxfp4 => {
                    WeightRow::Mxfp4 { packed: data, scales: std::slice::from_raw_parts(self.scales.add(r * self.row_scale_bytes), self.row_scale_bytes), n }
                }
            }
        }
    }
}

/// `out[i] = W[first + i] · x` for every `i`; each result is exactly `qdot_scalar`'s.
pub fn qmatvec(w: &QMatrix<'_>, x: &QRow<'_>, first: usize, out: &mut [f32]) {
    qmatvec_with(matvec_isa(), w, x, first, out)
}

/// `qmatvec` on `isa` (available: the tests run every ISA the machine has).
pub(crate) fn qmatvec_with(isa: IntIsa, w: &QMatrix<'_>, x: &QRow<'_>, first: usize, out: &mut [f32]) {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    assert!(first + out.len() <= w.rows, "rows {first}..{} of {}", first + out.len(), w.rows);
    w.check_activations(std::slice::from_ref(x));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `int_isa` returns only what `available` confirmed; the rows are in the matrix.
        IntIsa::Avx512Vnni => unsafe { x86::qmatvec_avx512vnni(w, x, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qmatvec_avxvnni(w, x, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qmatvec_avx2(w, x, first, out) },
        _ => {
            let mut r = first;
            let mut rest = out;
            while rest.len() >= 2 {
                let (head, tail) = rest.split_at_mut(2);
                let [a, b] = qdots_checked::<2, 1>(isa, [&w.row(r), &w.row(r + 1)], [x]);
                head.copy_from_slice(&[a[0], b[0]]);
                (rest, r) = (tail, r + 2);
            }
            if let [last] = rest {
                *last = qdots_checked::<1, 1>(isa, [&w.row(r)], [x])[0][0];
            }
        }
    }
}

/// `qmatvec` of two matrices of one shape and format (gate and up) against one row.
pub fn qmatvec_pair(a: &QMatrix<'_>, b: &QMatrix<'_>, x: &QRow<'_>, first: usize, a_out: &mut [f32], b_out: &mut [f32]) {
    qmatvec_pair_with(matvec_isa(), a, b, x, first, a_out, b_out)
}

/// `qmatvec_pair` on `isa` (available).
pub(crate) fn qmatvec_pair_with(isa: IntIsa, a: &QMatrix<'_>, b: &QMatrix<'_>, x: &QRow<'_>, first: usize, a_out: &mut [f32], b_out: &mut [f32]) {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    assert!(a.fmt == b.fmt && a.rows == b.rows && a.cols == b.cols, "paired matrices differ in format or shape");
    assert_eq!(a_out.len(), b_out.len(), "paired outputs differ in length");
    assert!(first + a_out.len() <= a.rows, "rows {first}..{} of {}", first + a_out.len(), a.rows);
    a.check_activations(std::slice::from_ref(x));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `qmatvec`.
        IntIsa::Avx512Vnni => unsafe { x86::qmatvec_pair_avx512vnni(a, b, x, first, a_out, b_out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qmatvec_pair_avxvnni(a, b, x, first, a_out, b_out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qmatvec_pair_avx2(a, b, x, first, a_out, b_out) },
        _ => {
            for (i, (sa, sb)) in a_out.iter_mut().zip(b_out.iter_mut()).enumerate() {
                let [ra, rb] = qdots_checked::<2, 1>(isa, [&a.row(first + i), &b.row(first + i)], [x]);
                (*sa, *sb) = (ra[0], rb[0]);
            }
        }
    }
}

/// `out[(r − first)·n + i] = W[r] · xs[i]` for the rows `first ..` that `out` (whole groups of
/// `n = xs.len()`) covers: the transposed product, weight-row major. Every result is exactly
/// `qdot_scalar`'s.
pub fn qmatmul_t(w: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    qmatmul_t_with(int_isa(), w, xs, first, out)
}

/// `qmatmul_t` on `isa` (available).
pub(crate) fn qmatmul_t_with(isa: IntIsa, w: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    let n = xs.len();
    if n == 0 {
        return;
    }
    assert!(out.len().is_multiple_of(n) && first + out.len() / n <= w.rows, "rows {first}.. of {} for {} results", w.rows, out.len());
    w.check_activations(xs);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `qmatvec`.
        IntIsa::Avx512Vnni => unsafe { x86::qmatmul_t_avx512vnni(w, xs, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qmatmul_t_avxvnni(w, xs, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qmatmul_t_avx2(w, xs, first, out) },
        _ => {
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                tile_generic(isa, &w.row(first + r), xs, o);
            }
        }
    }
}

/// Rows `first ..` of two matrices of one shape and format (gate and up) against every
/// activation row: `out` holds, per row, A's `n` results then B's.
pub fn qmatmul_pair_t(a: &QMatrix<'_>, b: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    qmatmul_pair_t_with(int_isa(), a, b, xs, first, out)
}

/// `qmatmul_pair_t` on `isa` (available).
pub(crate) fn qmatmul_pair_t_with(isa: IntIsa, a: &QMatrix<'_>, b: &QMatrix<'_>, xs: &[QRow<'_>], first: usize, out: &mut [f32]) {
    assert!(isa.available(), "{} is not available on this machine", isa.name());
    let n = xs.len();
    if n == 0 {
        return;
    }
    assert!(a.fmt == b.fmt && a.rows == b.rows && a.cols == b.cols, "paired matrices differ in format or shape");
    assert!(out.len().is_multiple_of(2 * n) && first + out.len() / (2 * n) <= a.rows, "rows {first}.. of {} for {} results", a.rows, out.len());
    a.check_activations(xs);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `qmatvec`.
        IntIsa::Avx512Vnni => unsafe { x86::qmatmul_pair_t_avx512vnni(a, b, xs, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qmatmul_pair_t_avxvnni(a, b, xs, first, out) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qmatmul_pair_t_avx2(a, b, xs, first, out) },
        _ => {
            for (r, o) in out.chunks_exact_mut(2 * n).enumerate() {
                let (oa, ob) = o.split_at_mut(n);
                tile_generic(isa, &a.row(first + r), xs, oa);
                tile_generic(isa, &b.row(first + r), xs, ob);
            }
        }
    }
}

/// One weight row against every activation row, as many a pass as the ISA's registers allow.
fn tile_generic(isa: IntIsa, w: &WeightRow<'_>, xs: &[QRow<'_>], o: &mut [f32]) {
    let n = xs.len();
    let mut i = 0;
    while isa != IntIsa::Scalar && i + 2 <= n {
        o[i..i + 2].copy_from_slice(&qdots_checked::<1, 2>(isa, [w], [&xs[i], &xs[i + 1]])[0]);
        i += 2;
    }
    while i < n {
        o[i] = qdots_checked::<1, 1>(isa, [w], [&xs[i]])[0][0];
        i += 1;
    }
}

// SAFETY (for the raw pointers): a `QMatrix` only reads the slices it was built from.
unsafe impl Send for QMatrix<'_> {}
unsafe impl Sync for QMatrix<'_> {}

/// `w`'s format and raw parts (an integer row: `is_integer`).
pub(crate) fn raw_row(w: &WeightRow<'_>) -> (Fmt, RawRow) {
    match *w {
        WeightRow::Int8 { q, scale } => (Fmt::Int8, RawRow { data: q.as_ptr() as *const u8, scales: std::ptr::null(), scale, hi: std::ptr::null() }),
        WeightRow::Int4 { packed, scales, group, .. } => {
            (Fmt::Int4 { group }, RawRow { data: packed.as_ptr(), scales: scales.as_ptr() as *const u8, scale: 1.0, hi: std::ptr::null() })
        }
        WeightRow::Int6 { lo, hi, scales, group, n } => {
            assert!(hi.len() >= Int6Matrix::hi_bytes_per_row(n), "an int6 row's top bits are shorter than its length");
            (Fmt::Int6 { group }, RawRow { data: lo.as_ptr(), scales: scales.as_ptr() as *const u8, scale: 1.0, hi: hi.as_ptr() })
        }
        WeightRow::Mxfp4 { packed, scales, .. } => (Fmt::Mxfp4, RawRow { data: packed.as_ptr(), scales: scales.as_ptr(), scale: 1.0, hi: std::ptr::null() }),
        _ => unreachable!("the integer path takes int8, int4, int6 and MXFP4 rows only"),
    }
}

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
        WeightRow::Int6 { lo, hi, .. } => int6_code(lo, hi, i),
        WeightRow::Mxfp4 { packed, .. } => {
            let byte = packed[i / 2];
            let nib = if i.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
            E2M1_TWICE[nib as usize] as i32
        }
        _ => unreachable!("the integer path takes int8, int4, int6 and MXFP4 rows only"),
    }
}

/// `ws_b`: the weight's part of block `b`'s factor.
#[inline]
fn weight_factor(w: &WeightRow<'_>, b: usize) -> f32 {
    match w {
        WeightRow::Int8 { .. } => 1.0,
        WeightRow::Int4 { scales, group, .. } | WeightRow::Int6 { scales, group, .. } => int4_scale(scales[b * QBLOCK / group]),
        // 2^(e − 128): e8m0 halved (e = 0 gives 2⁻¹²⁸, a subnormal, exactly).
        WeightRow::Mxfp4 { scales, .. } => half_e8m0(scales[b * QBLOCK / MXFP4_GROUP]),
        _ => unreachable!("the integer path takes int8, int4, int6 and MXFP4 rows only"),
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
    if !matches!(w, WeightRow::Int8 { .. }) {
        // The 4-bit formats: two half-block sums of sixteen products a block.
        let mut acc = [0.0f32; NLANES];
        for b in 0..n.div_ceil(QBLOCK) {
            let f = weight_factor(w, b) * x.scale(b);
            for t in 0..2 {
                let start = b * QBLOCK + 16 * t;
                let p: i32 = (start..(start + 16).min(n)).map(|i| weight_int(w, i) * x.q(i) as i32).sum();
                let l = nibble_lane(b % BLOCKS_PER_CHUNK, t);
                acc[l] = f.mul_add(p as f32, acc[l]);
            }
        }
        for s in [4, 2, 1] {
            for l in 0..s {
                acc[l] += acc[l + s];
            }
        }
        return acc[0];
    }
    let mut acc = [0.0f32; QLANES];
    for b in 0..n.div_ceil(QBLOCK) {
        let f = weight_factor(w, b) * x.scale(b);
        // Group `g` is elements `32b + 4g .. +4`, lane `8·(b mod 4) + g`.
        for g in 0..8 {
            let start = b * QBLOCK + 4 * g;
            let p: i32 = (start..(start + 4).min(n)).map(|i| weight_int(w, i) * x.q(i) as i32).sum();
            let l = 8 * (b % BLOCKS_PER_CHUNK) + g;
            acc[l] = f.mul_add(p as f32, acc[l]);
        }
    }
    finish(w, reduce(acc))
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
            IntIsa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c"),
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

/// The integer ISA of one activation row against a matrix's rows (`qmatvec`, `qmatvec_pair`:
/// a decode step's products): `int_isa`'s, except AVX-512 on an AMD CPU while decode streams its
/// weights from memory (`set_decode_streams_from_memory`), where the 256-bit loops take them. On
/// Zen 4, whose 512-bit operations run as two 256-bit halves, the AVX2 loops (a weight row a
/// pass) decoded m1b (300 MB a token) 1.5× as fast as the AVX-512 ones (int8 87–102 against
/// 51–65 tok/s, int4-g32 127–145 against 84–94), and still 1.05–1.27× as fast as AVX-512 loops
/// changed to a row a pass; but the demo model, whose weights stay in the cache, decoded 1.2–1.8×
/// as fast on AVX-512, and a prompt's rows run 1.1–1.7× as fast on 512 bits
/// (`docs/benchmarks.md`, "Zen 4"). Intel keeps AVX-512 (not measured against AVX2 there yet).
/// The bits are the same on every ISA; `SHIMMER_INT_ISA` still names one for all.
pub fn matvec_isa() -> IntIsa {
    static AMD_AVX512: OnceLock<bool> = OnceLock::new();
    let isa = int_isa();
    let swap = *AMD_AVX512.get_or_init(|| {
        let named = std::env::var("SHIMMER_INT_ISA").is_ok_and(|s| IntIsa::parse(&s).is_some());
        isa == IntIsa::Avx512Vnni && !named && cpu_is_amd() && IntIsa::Avx2.available()
    });
    if swap && DECODE_STREAMS.load(std::sync::atomic::Ordering::Relaxed) {
        IntIsa::Avx2
    } else {
        isa
    }
}

static DECODE_STREAMS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says whether a decoded token's weights stream from memory — more bytes a token than the
/// last-level cache holds (`last_level_cache_bytes`) — which picks `matvec_isa`'s loops. One
/// setting for the process (the model loaded last); only speed depends on it.
pub fn set_decode_streams_from_memory(streams: bool) {
    DECODE_STREAMS.store(streams, std::sync::atomic::Ordering::Relaxed);
}

/// The last-level cache's size as Linux reports it for CPU 0 (32 MiB where it does not say).
pub fn last_level_cache_bytes() -> u64 {
    let read = |index: u32| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{index}/size")).ok();
    let parse = |s: String| {
        let s = s.trim();
        let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
        let n: u64 = digits.parse().ok()?;
        Some(match unit {
            "K" => n << 10,
            "M" => n << 20,
            "" => n,
            _ => return None,
        })
    };
    (0..8).rev().find_map(|i| read(i).and_then(parse)).unwrap_or(32 << 20)
}

#[cfg(target_arch = "x86_64")]
#[allow(unused_unsafe)] // `__cpuid` is safe to call on newer compilers
fn cpu_is_amd() -> bool {
    // SAFETY: leaf 0 (the vendor) exists on every x86-64 CPU.
    let r = unsafe { std::arch::x86_64::__cpuid(0) };
    let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|w| w.to_le_bytes()).collect();
    vendor == b"AuthenticAMD"
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_is_amd() -> bool {
    false
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
        assert!(is_integer(w), "the integer path takes int8, int4, int6 and MXFP4 rows only");
        assert_eq!(w.len(), first.len(), "weight rows of one pass differ in length");
    }
    let nibbles = !matches!(first, WeightRow::Int8 { .. });
    for x in &xs {
        // Equal, not just long enough: blocks past the weight row must not take part.
        assert_eq!(x.n, first.len(), "activation row and weight row differ in length");
        assert!(!nibbles || x.has_nibbles(), "4-bit weights need activations quantised with their layout");
    }
    let same = ws.iter().all(|w| match (w, first) {
        (WeightRow::Int8 { .. }, WeightRow::Int8 { .. }) | (WeightRow::Mxfp4 { .. }, WeightRow::Mxfp4 { .. }) => true,
        (WeightRow::Int4 { group: a, .. }, WeightRow::Int4 { group: b, .. }) | (WeightRow::Int6 { group: a, .. }, WeightRow::Int6 { group: b, .. }) => a == b,
        _ => false,
    });
    if M > 1 && !same {
        let mut out = [[0.0; N]; M];
        for (o, w) in out.iter_mut().zip(ws) {
            *o = qdots_checked::<1, N>(isa, [w], xs)[0];
        }
        return out;
    }
    let n = first.len();
    let fmt = raw_row(first).0;
    let rows = ws.map(|w| raw_row(w).1);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` confirmed the ISA (asserted above); rows share one length and
        // format and the activation rows are as long, padded to whole chunks.
        IntIsa::Avx512Vnni => unsafe { x86::qdots_avx512vnni::<M, N>(fmt, rows, n, xs) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::AvxVnni => unsafe { x86::qdots_avxvnni::<M, N>(fmt, rows, n, xs) },
        #[cfg(target_arch = "x86_64")]
        IntIsa::Avx2 => unsafe { x86::qdots_avx2::<M, N>(fmt, rows, n, xs) },
        #[cfg(target_arch = "aarch64")]
        IntIsa::Neon => unsafe { neon::qdots_neon::<M, N>(fmt, rows, n, xs) },
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

#[cfg(target_arch = "x86_64")]
#[path = "qdot/x86.rs"]
mod x86;

#[cfg(target_arch = "aarch64")]
#[path = "qdot/neon.rs"]
mod neon;

#[cfg(test)]
#[path = "qdot/tests.rs"]
mod tests;
