//! Weight quantisation formats of the expert container, with their plain scalar definitions.
//!
//! - `Int8PerRow`: each row r stores `q[r][c] = round(w / s_r)` in i8 with `s_r = max|w_r| / 127`
//!   (an all-zero row has `s_r = 0`); `w ≈ q · s_r`.
//! - `Int4 { group }`: each run of `group` consecutive values in a row (32, 64 or 128; the last run
//!   of a row may be shorter) stores `q = clamp(round(w / s), -8, 7)` as a nibble `q + 8`, two per
//!   byte (low nibble first), rows padded to a whole byte, and `s` as an IEEE half (f16, as Q4_0
//!   stores its scales: 4.5 bits a weight at 32 a group); `w ≈ q · s`. `s` is the best of a few
//!   grids (`int4_group_scale`), rounded to f16 before the codes are chosen against it.
//!
//! - `Mxfp4` (OCP Microscaling, as gpt-oss ships its experts): each run of 32 values in a row
//!   shares a power-of-two scale `2^(e−127)` stored as one e8m0 byte `e` (255 is NaN and refused);
//!   each value is an e2m1 nibble (`E2M1`: sign, 2 exponent bits, 1 mantissa bit — ±{0, ½, 1, 1½,
//!   2, 3, 4, 6}), two per byte, low nibble first, rows padded to a whole byte; `w ≈ e2m1 · 2^(e−127)`.
//!   Quantising picks `e = ⌊log2 max|w|⌋ − 2 + 127` (the OCP rule; an all-zero group gets e = 0)
//!   and each value's nearest e2m1 code (ties to the even code), saturating at ±6.
//!
//! Only groups of 32, 64 and 128 are valid for int4. int8 scales are f32, int4 scales f16 (finite,
//! not negative: a group whose scale would not fit in f16 — a weight of magnitude above ~4.6e5 —
//! fails `validate`, and a converter reports it; one whose scale is below f16's range, all its
//! weights under ~4e-7, quantises to zeros). Rounding is half away from zero (`f32::round`). Dequantisation is exact given
//! q and s, so every kernel that consumes these formats is held to `dequantize` here.

use crate::error::LoadError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    Bf16,
    Int8PerRow,
    Int4 { group: usize },
    Mxfp4,
}

impl QuantScheme {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(QuantScheme::Bf16),
            "int8" => Ok(QuantScheme::Int8PerRow),
            "int4-g32" => Ok(QuantScheme::Int4 { group: 32 }),
            "int4-g64" => Ok(QuantScheme::Int4 { group: 64 }),
            "int4-g128" => Ok(QuantScheme::Int4 { group: 128 }),
            "mxfp4" => Ok(QuantScheme::Mxfp4),
            other => Err(format!("unknown quantisation `{other}` (expected bf16, int8, int4-g32, int4-g64, int4-g128 or mxfp4)")),
        }
    }

    pub fn name(&self) -> String {
        match self {
            QuantScheme::Bf16 => "bf16".into(),
            QuantScheme::Int8PerRow => "int8".into(),
            QuantScheme::Int4 { group } => format!("int4-g{group}"),
            QuantScheme::Mxfp4 => "mxfp4".into(),
        }
    }
}

/// A quantised `rows × cols` matrix.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantMatrix {
    Int8 {
        rows: usize,
        cols: usize,
        q: Vec<i8>,
        scales: Vec<f32>,
    },
    /// `scales` are f16 bit patterns, one per `group` values of a row.
    Int4 {
        rows: usize,
        cols: usize,
        group: usize,
        packed: Vec<u8>,
        scales: Vec<u16>,
    },
    /// `scales` are e8m0 bytes, one per 32 values of a row.
    Mxfp4 {
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
    },
}

impl QuantMatrix {
    pub fn groups_per_row(cols: usize, group: usize) -> usize {
        cols.div_ceil(group)
    }
    pub fn bytes_per_row_int4(cols: usize) -> usize {
        cols.div_ceil(2)
    }
}

pub fn quantize_int8(w: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    let mut q = Vec::with_capacity(rows * cols);
    let mut scales = Vec::with_capacity(rows);
    for row in w.chunks_exact(cols) {
        let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = max / 127.0;
        scales.push(s);
        q.extend(row.iter().map(|v| if s == 0.0 { 0 } else { (v / s).round().clamp(-127.0, 127.0) as i8 }));
    }
    QuantMatrix::Int8 { rows, cols, q, scales }
}

pub fn quantize_int4(w: &[f32], rows: usize, cols: usize, group: usize) -> QuantMatrix {
    let bpr = QuantMatrix::bytes_per_row_int4(cols);
    let mut packed = vec![0u8; rows * bpr];
    let mut scales = Vec::with_capacity(rows * QuantMatrix::groups_per_row(cols, group));
    let mut q = Vec::with_capacity(group);
    for (r, row) in w.chunks_exact(cols).enumerate() {
        for (g, chunk) in row.chunks(group).enumerate() {
            let s = int4_group_scale(chunk, &mut q);
            for (i, &qi) in q.iter().enumerate() {
                let c = g * group + i;
                let nib = (qi + 8) as u8;
                let byte = &mut packed[r * bpr + c / 2];
                *byte |= if c.is_multiple_of(2) { nib } else { nib << 4 };
            }
            scales.push(s);
        }
    }
    QuantMatrix::Int4 { rows, cols, group, packed, scales }
}

/// One int4 group's scale as f16 bits, its values' codes in [-8, 7] left in `q`. Candidates: the
/// plain `max / 7`, and for each grid that puts the largest magnitude at 7, 7.25, 7.5, 7.75 or 8
/// steps (toward −8 on the side that has it) the least-squares scale of its rounded codes — each
/// rounded to f16 and judged by the squared error of its own nearest codes, so the stored scale is
/// the one measured and never worse than `max / 7`. A plain `max / 7` leaves the −8 code unused;
/// the grids are llama.cpp's refit (`make_qx_quants`) on the same format. Deterministic: the same
/// group always gets the same codes.
fn int4_group_scale(chunk: &[f32], q: &mut Vec<i32>) -> u16 {
    symmetric_group_scale(chunk, q, 7)
}

/// `int4_group_scale` for codes in [−top − 1, top]: the plain `max / top` and the grids at top,
/// top + ¼, top + ½, top + ¾ and top + 1 steps.
fn symmetric_group_scale(chunk: &[f32], q: &mut Vec<i32>, top: i32) -> u16 {
    let (hi, lo) = (top as f32, -(top as f32) - 1.0);
    let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let plain = f32_to_f16(max / hi);
    let mut best: Option<(f64, u16)> = None;
    // A zero group keeps scale 0; a non-finite one (which validation refuses) `max / top`.
    if max != 0.0 && max.is_finite() {
        let mut candidates = [plain; 6];
        for (slot, extra) in candidates[1..].iter_mut().zip([0.0f32, 0.25, 0.5, 0.75, 1.0]) {
            let inv = (hi + extra) / max;
            let (mut wq, mut qq) = (0.0f64, 0.0f64);
            for v in chunk {
                let c = (v * inv).round().clamp(lo, hi) as f64;
                wq += *v as f64 * c;
                qq += c * c;
            }
            if qq > 0.0 && wq > 0.0 {
                *slot = f32_to_f16((wq / qq) as f32);
            }
        }
        for bits in candidates {
            let s = f16_to_f32(bits);
            if !(s.is_finite() && s > 0.0) {
                continue;
            }
            let err: f64 = chunk.iter().map(|v| (*v as f64 - ((v / s).round().clamp(lo, hi) * s) as f64).powi(2)).sum();
            if best.is_none_or(|(e, _)| err < e) {
                best = Some((err, bits));
            }
        }
    }
    let bits = best.map_or(plain, |(_, b)| b);
    let s = f16_to_f32(bits);
    q.clear();
    q.extend(chunk.iter().map(|v| if s == 0.0 || !s.is_finite() { 0 } else { (v / s).round().clamp(lo, hi) as i32 }));
    bits
}

/// An f16 bit pattern's value (exact: every f16 is an f32).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// `v` rounded to the nearest f16 (ties to even), as bits; beyond f16's range, infinity.
#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// An int4 scale's value from its f16 bits, as every kernel decodes it: the bits moved into an
/// f32's place and scaled by 2¹¹², which is exact for every finite non-negative f16, subnormals
/// included (what `validate` lets through; other bits give garbage, never a panic). Vector
/// kernels may use the hardware's conversion (`vcvtph2ps`), exact too.
#[inline(always)]
pub fn int4_scale(bits: u16) -> f32 {
    f32::from_bits(((bits & 0x7fff) as u32) << 13) * F16_REBIAS
}

/// 2¹¹²: f32's exponent bias less f16's.
const F16_REBIAS: f32 = f32::from_bits(0x7780_0000);

/// Whether an int4 scale's bits are a finite, non-negative f16.
#[inline]
pub fn int4_scale_ok(bits: u16) -> bool {
    bits & 0x8000 == 0 && bits & 0x7c00 != 0x7c00
}

/// A 6-bit matrix (the LM head's format at 4 bits, llama.cpp's Q6_K's place in its Q4_0 files:
/// `shimmer convert --head-quant int6-g32`). Code
/// `q = u − 32` in [−32, 31], `w ≈ q · s` with one f16 `s` per `group` values of a row (chosen as
/// int4's is, on the 6-bit grid). `u = lo | hi << 4` is split in two planes, laid out for the
/// integer products' 4-bit path:
/// - `lo`: the low four bits, exactly int4's `packed` layout (two a byte, low nibble first);
/// - `hi`: the top two bits, 32 bytes per chunk of 128 values of a row (the last chunk padded with
///   zeros). Within a chunk, value `e` is the even element `k = e / 2` or the odd one; with
///   `j = k mod 32` and `half = k / 32`, its two bits sit in byte `j` at bit `2·half` (even) or
///   `4 + 2·half` (odd). So one 32-byte load holds the top bits of the very values that a 32-byte
///   load of `lo` holds as nibbles (int4's even/odd split): `(hi << 4) & 0x30` and `hi & 0x30`
///   are the first 64 values' even and odd tops, already at the nibble's side, and `(hi << 2) & 0x30`
///   and `(hi >> 2) & 0x30` the second 64's.
#[derive(Debug, Clone, PartialEq)]
pub struct Int6Matrix {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub lo: Vec<u8>,
    pub hi: Vec<u8>,
    /// f16 bit patterns, one per `group` values of a row.
    pub scales: Vec<u16>,
}

/// Values per chunk of `Int6Matrix::hi` (32 bytes of top bits).
pub const INT6_CHUNK: usize = 128;

impl Int6Matrix {
    pub fn hi_bytes_per_row(cols: usize) -> usize {
        cols.div_ceil(INT6_CHUNK) * INT6_CHUNK / 4
    }

    /// Where value `c` of a row keeps its top two bits: (byte of the row's `hi`, bit shift).
    #[inline]
    pub fn hi_place(c: usize) -> (usize, u32) {
        let (chunk, e) = (c / INT6_CHUNK, c % INT6_CHUNK);
        let (k, odd) = (e / 2, e % 2);
        let (j, half) = (k % 32, k / 32);
        (chunk * 32 + j, (2 * half + 4 * odd) as u32)
    }

    /// The code `q` in [−32, 31] of value `c` of row `r`.
    pub fn code(&self, r: usize, c: usize) -> i32 {
        let (lpr, hpr) = (QuantMatrix::bytes_per_row_int4(self.cols), Self::hi_bytes_per_row(self.cols));
        int6_code(&self.lo[r * lpr..(r + 1) * lpr], &self.hi[r * hpr..(r + 1) * hpr], c)
    }

    pub fn dequantize(&self) -> Vec<f32> {
        let gpr = QuantMatrix::groups_per_row(self.cols, self.group);
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.code(r, c) as f32 * int4_scale(self.scales[r * gpr + c / self.group]))
            .collect()
    }

    /// Checks the buffers against the shape and every scale (for data read from a file).
    pub fn validate(&self, what: &str) -> Result<(), LoadError> {
        let ok = matches!(self.group, 32 | 64 | 128)
            && self.lo.len() == self.rows * QuantMatrix::bytes_per_row_int4(self.cols)
            && self.hi.len() == self.rows * Self::hi_bytes_per_row(self.cols)
            && self.scales.len() == self.rows * QuantMatrix::groups_per_row(self.cols, self.group)
            && self.scales.iter().all(|s| int4_scale_ok(*s));
        if ok {
            Ok(())
        } else {
            Err(LoadError::malformed(what, "quantised data does not match its shape, or a scale is negative or not finite"))
        }
    }
}

/// The code `q` in [−32, 31] of value `c` of one row of an `Int6Matrix`, from the row's two
/// planes: the one decoding every reader shares.
#[inline]
pub fn int6_code(lo: &[u8], hi: &[u8], c: usize) -> i32 {
    let byte = lo[c / 2];
    let low = if c.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
    let (at, shift) = Int6Matrix::hi_place(c);
    let top = (hi[at] >> shift) & 3;
    (low | top << 4) as i32 - 32
}

/// `w` (`rows × cols`) in 6 bits: each group's scale by `int4_group_scale`'s search on the grid
/// [−32, 31].
pub fn quantize_int6(w: &[f32], rows: usize, cols: usize, group: usize) -> Int6Matrix {
    let (lpr, hpr) = (QuantMatrix::bytes_per_row_int4(cols), Int6Matrix::hi_bytes_per_row(cols));
    let (mut lo, mut hi) = (vec![0u8; rows * lpr], vec![0u8; rows * hpr]);
    let mut scales = Vec::with_capacity(rows * QuantMatrix::groups_per_row(cols, group));
    let mut q = Vec::with_capacity(group);
    for (r, row) in w.chunks_exact(cols).enumerate() {
        for (g, chunk) in row.chunks(group).enumerate() {
            scales.push(symmetric_group_scale(chunk, &mut q, 31));
            for (i, &qi) in q.iter().enumerate() {
                let (c, u) = (g * group + i, (qi + 32) as u8);
                lo[r * lpr + c / 2] |= if c.is_multiple_of(2) { u & 0x0f } else { (u & 0x0f) << 4 };
                let (at, shift) = Int6Matrix::hi_place(c);
                hi[r * hpr + at] |= (u >> 4) << shift;
            }
        }
    }
    Int6Matrix { rows, cols, group, lo, hi, scales }
}

/// Values per MXFP4 scale.
pub const MXFP4_GROUP: usize = 32;

/// The e2m1 values by nibble: magnitudes for 0–7, their negatives (−0 first) for 8–15.
pub static E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The tensor names that may hold the scales of a quantised weight `name`: `<name>_scale_inv`
/// (DeepSeek-V3, transformers) and, for `<stem>.weight`, `<stem>.scale` (DeepSeek-V4's release).
/// A converter moves them with the weight; a loader looks for them in this order.
pub fn scale_names(name: &str) -> Vec<String> {
    let mut names = vec![format!("{name}_scale_inv")];
    if let Some(stem) = name.strip_suffix(".weight") {
        names.push(format!("{stem}.scale"));
    }
    names
}

/// An e8m0 scale byte: `2^(e−127)` (exact in f32, 2⁻¹²⁷ being subnormal); 255 is NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    // Branch-free (kernels call it per 16 lanes): 0 → the subnormal 2⁻¹²⁷, 255 → the quiet NaN.
    let fix = ((e == 0) | (e == 255)) as u32 * 0x0040_0000;
    f32::from_bits(((e as u32) << 23) | fix)
}

pub fn quantize_mxfp4(w: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    let bpr = QuantMatrix::bytes_per_row_int4(cols);
    let mut packed = vec![0u8; rows * bpr];
    let mut scales = Vec::with_capacity(rows * QuantMatrix::groups_per_row(cols, MXFP4_GROUP));
    for (r, row) in w.chunks_exact(cols).enumerate() {
        for (g, chunk) in row.chunks(MXFP4_GROUP).enumerate() {
            let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let e = if max > 0.0 && max.is_finite() { (max.log2().floor() as i32 - 2 + 127).clamp(0, 254) as u8 } else { 0 };
            scales.push(e);
            let s = e8m0_to_f32(e);
            for (i, v) in chunk.iter().enumerate() {
                let x = (v / s).clamp(-6.0, 6.0);
                // The nearest of the eight magnitudes; ties go to the even code.
                let mut best = 0usize;
                for (k, m) in E2M1[..8].iter().enumerate() {
                    let (d, db) = ((x.abs() - m).abs(), (x.abs() - E2M1[best]).abs());
                    if d < db || (d == db && k % 2 == 0 && best % 2 == 1) {
                        best = k;
                    }
                }
                let nib = best as u8 | if x.is_sign_negative() && best != 0 { 8 } else { 0 };
                let c = g * MXFP4_GROUP + i;
                packed[r * bpr + c / 2] |= if c.is_multiple_of(2) { nib } else { nib << 4 };
            }
        }
    }
    QuantMatrix::Mxfp4 { rows, cols, packed, scales }
}

/// The exact f32 values a quantised matrix stands for.
pub fn dequantize(m: &QuantMatrix) -> Vec<f32> {
    match m {
        QuantMatrix::Int8 { cols, q, scales, .. } => q.iter().enumerate().map(|(i, v)| *v as f32 * scales[i / cols]).collect(),
        QuantMatrix::Int4 { rows, cols, group, packed, scales } => {
            let (bpr, gpr) = (QuantMatrix::bytes_per_row_int4(*cols), QuantMatrix::groups_per_row(*cols, *group));
            let mut out = Vec::with_capacity(rows * cols);
            for r in 0..*rows {
                for c in 0..*cols {
                    let byte = packed[r * bpr + c / 2];
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    out.push((nib as i32 - 8) as f32 * int4_scale(scales[r * gpr + c / group]));
                }
            }
            out
        }
        QuantMatrix::Mxfp4 { rows, cols, packed, scales } => {
            let (bpr, gpr) = (QuantMatrix::bytes_per_row_int4(*cols), QuantMatrix::groups_per_row(*cols, MXFP4_GROUP));
            let mut out = Vec::with_capacity(rows * cols);
            for r in 0..*rows {
                for c in 0..*cols {
                    let byte = packed[r * bpr + c / 2];
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    out.push(E2M1[nib as usize] * e8m0_to_f32(scales[r * gpr + c / MXFP4_GROUP]));
                }
            }
            out
        }
    }
}

/// Checks a quantised matrix's buffers against its shape (for data read from a file).
pub fn validate(m: &QuantMatrix, what: &str) -> Result<(), LoadError> {
    let ok = match m {
        QuantMatrix::Int8 { rows, cols, q, scales } => q.len() == rows * cols && scales.len() == *rows,
        QuantMatrix::Int4 { rows, cols, group, packed, scales } => {
            matches!(*group, 32 | 64 | 128)
                && packed.len() == rows * QuantMatrix::bytes_per_row_int4(*cols)
                && scales.len() == rows * QuantMatrix::groups_per_row(*cols, *group)
        }
        QuantMatrix::Mxfp4 { rows, cols, packed, scales } => {
            packed.len() == rows * QuantMatrix::bytes_per_row_int4(*cols) && scales.len() == rows * QuantMatrix::groups_per_row(*cols, MXFP4_GROUP)
        }
    };
    let scales_ok = match m {
        QuantMatrix::Int8 { scales, .. } => scales.iter().all(|s| s.is_finite() && *s >= 0.0),
        QuantMatrix::Int4 { scales, .. } => scales.iter().all(|s| int4_scale_ok(*s)),
        QuantMatrix::Mxfp4 { scales, .. } => !scales.contains(&255),
    };
    if ok && scales_ok {
        Ok(())
    } else {
        Err(LoadError::malformed(what, "quantised data does not match its shape, or a scale is negative or not finite"))
    }
}

/// One fp8-e4m3 ("e4m3fn", as torch's `float8_e4m3fn`) value: sign, 4 exponent bits with bias 7,
/// 3 mantissa bits; exponent 0 is subnormal; `S.1111.111` is NaN; there are no infinities.
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// DeepSeek-style block-scaled fp8: `w[r][c] = fp8(q[r][c]) × scale_inv[r / block][c / block]`
/// (computed in f32, as DeepSeek's reference `weight_dequant` does), `scale_inv` being
/// `⌈rows/block⌉ × ⌈cols/block⌉`. Errors name what does not fit.
pub fn dequantize_fp8_blocks(q: &[u8], rows: usize, cols: usize, scale_inv: &[f32], block: usize) -> Result<Vec<f32>, String> {
    dequantize_fp8_tiles(q, rows, cols, scale_inv, block, block)
}

/// fp8-e4m3 with one scale per tile of `row_block × col_block` values (row-major tiles): DeepSeek's
/// 128 × 128 blocks, or one row's groups (1 × 32 for MXFP8, 1 × 16 for NVFP4 held as fp8) —
/// `w[r][c] = fp8(q[r][c]) · scales[r / row_block][c / col_block]`, one rounding. The definition
/// every fp8 kernel is held to.
pub fn dequantize_fp8_tiles(q: &[u8], rows: usize, cols: usize, scales: &[f32], row_block: usize, col_block: usize) -> Result<Vec<f32>, String> {
    if row_block == 0 || col_block == 0 {
        return Err(format!("fp8 scale tiles of {row_block}×{col_block}"));
    }
    if q.len() != rows * cols {
        return Err(format!("fp8 data is {} bytes, the shape {rows}×{cols} needs {}", q.len(), rows * cols));
    }
    let (br, bc) = (rows.div_ceil(row_block), cols.div_ceil(col_block));
    if scales.len() != br * bc {
        return Err(format!("block scales hold {} values, {rows}×{cols} in {row_block}×{col_block} blocks needs {br}×{bc}", scales.len()));
    }
    if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
        return Err(format!("a block scale is {bad}"));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let v = fp8_e4m3_to_f32(q[r * cols + c]);
            if v.is_nan() {
                return Err(format!("element ({r}, {c}) is an fp8 NaN"));
            }
            out.push(v * scales[(r / row_block) * bc + c / col_block]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn int8_round_trip_error_is_at_most_half_a_step() {
        for &(rows, cols) in &[(1, 1), (3, 7), (16, 33), (5, 256)] {
            let w = data(rows, cols, 11);
            let m = quantize_int8(&w, rows, cols);
            validate(&m, "test").unwrap();
            let QuantMatrix::Int8 { scales, .. } = &m else { unreachable!() };
            for (i, (a, b)) in w.iter().zip(dequantize(&m)).enumerate() {
                assert!((a - b).abs() <= scales[i / cols] * 0.5 + 1e-6, "{a} vs {b}");
            }
        }
    }

    /// Each value gets the nearest code its group's scale has (clamped to [-8, 7]), and no group's
    /// squared error exceeds that of the plain `max / 7` grid.
    #[test]
    fn int4_codes_are_nearest_and_groups_never_worse_than_max_over_seven() {
        let mut improved = 0;
        for group in [32, 64, 128] {
            for &(rows, cols) in &[(1, 1), (2, 31), (3, 100), (4, 257)] {
                let w = data(rows, cols, group as u64);
                let m = quantize_int4(&w, rows, cols, group);
                validate(&m, "test").unwrap();
                let QuantMatrix::Int4 { scales, .. } = &m else { unreachable!() };
                let gpr = QuantMatrix::groups_per_row(cols, group);
                let back = dequantize(&m);
                for (r, row) in w.chunks(cols).enumerate() {
                    for (g, chunk) in row.chunks(group).enumerate() {
                        let s = f16_to_f32(scales[r * gpr + g]);
                        let start = r * cols + g * group;
                        let (mut err, mut plain_err) = (0.0f64, 0.0f64);
                        let plain = f16_to_f32(f32_to_f16(chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 7.0));
                        for (i, &a) in chunk.iter().enumerate() {
                            let b = back[start + i];
                            assert_eq!(b, (a / s).round().clamp(-8.0, 7.0) * s, "g{group} {rows}x{cols} row {r} #{i}: nearest code");
                            err += ((a - b) as f64).powi(2);
                            let p = if plain == 0.0 { 0.0 } else { (a / plain).round().clamp(-8.0, 7.0) * plain };
                            plain_err += ((a - p) as f64).powi(2);
                        }
                        assert!(err <= plain_err, "g{group} {rows}x{cols} row {r} group {g}: {err} > {plain_err}");
                        improved += usize::from(err < plain_err * 0.999);
                    }
                }
            }
        }
        assert!(improved > 10, "the refit improved only {improved} groups");
    }

    /// Every int6 code is the nearest on its group's grid ([−32, 31]), no group is worse than the
    /// plain `max / 31`, and the error is far below int4's on the same values.
    #[test]
    fn int6_codes_are_nearest_and_groups_never_worse_than_max_over_31() {
        for group in [32, 64, 128] {
            for &(rows, cols) in &[(1, 1), (2, 31), (3, 100), (4, 257), (2, 384)] {
                let w = data(rows, cols, 3 + group as u64);
                let m = quantize_int6(&w, rows, cols, group);
                m.validate("test").unwrap();
                let gpr = QuantMatrix::groups_per_row(cols, group);
                let back = m.dequantize();
                let four = dequantize(&quantize_int4(&w, rows, cols, group));
                let (mut err6, mut err4) = (0.0f64, 0.0f64);
                for (r, row) in w.chunks(cols).enumerate() {
                    for (g, chunk) in row.chunks(group).enumerate() {
                        let s = f16_to_f32(m.scales[r * gpr + g]);
                        let plain = f16_to_f32(f32_to_f16(chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0));
                        let (mut err, mut plain_err) = (0.0f64, 0.0f64);
                        for (i, &a) in chunk.iter().enumerate() {
                            let at = r * cols + g * group + i;
                            let b = back[at];
                            assert_eq!(b, (a / s).round().clamp(-32.0, 31.0) * s, "g{group} {rows}x{cols} row {r} #{i}: nearest code");
                            err += ((a - b) as f64).powi(2);
                            let p = if plain == 0.0 { 0.0 } else { (a / plain).round().clamp(-32.0, 31.0) * plain };
                            plain_err += ((a - p) as f64).powi(2);
                            err4 += ((a - four[at]) as f64).powi(2);
                        }
                        assert!(err <= plain_err, "g{group} {rows}x{cols} row {r} group {g}: {err} > {plain_err}");
                        err6 += err;
                    }
                }
                assert!(err6 * 10.0 < err4 || cols == 1, "g{group} {rows}x{cols}: int6 error {err6} against int4's {err4}");
            }
        }
    }

    /// The two planes hold every code bit where the layout says: each value of a 300-wide row,
    /// set alone to one of four codes among neighbours of another, decodes from exactly its nibble
    /// and its two top bits, and the top bits of a 128-value chunk's first and second 64 values
    /// are at the shifts the layout names.
    #[test]
    fn int6_planes_place_each_bit_where_the_layout_says() {
        let cols = 300;
        for c in 0..cols {
            for u in [0u8, 21, 42, 63] {
                let mut m =
                    Int6Matrix { rows: 1, cols, group: 32, lo: vec![0x88; 150], hi: vec![0xAA; Int6Matrix::hi_bytes_per_row(cols)], scales: vec![0x3c00; 10] };
                // Every other value is u = 0b10_1000 = 40 (code 8); value c is set to u.
                m.lo[c / 2] = if c % 2 == 0 { (m.lo[c / 2] & 0xf0) | (u & 0x0f) } else { (m.lo[c / 2] & 0x0f) | (u << 4) };
                let (at, shift) = Int6Matrix::hi_place(c);
                m.hi[at] = (m.hi[at] & !(3 << shift)) | ((u >> 4) << shift);
                for d in 0..cols {
                    assert_eq!(m.code(0, d), if d == c { u as i32 - 32 } else { 8 }, "value {d} with value {c} set to {u}");
                }
            }
        }
        // The chunk's first 64 values: even at bits 0–1, odd at 4–5; the second 64: 2–3 and 6–7.
        assert_eq!(Int6Matrix::hi_place(0), (0, 0));
        assert_eq!(Int6Matrix::hi_place(1), (0, 4));
        assert_eq!(Int6Matrix::hi_place(62), (31, 0));
        assert_eq!(Int6Matrix::hi_place(64), (0, 2));
        assert_eq!(Int6Matrix::hi_place(65), (0, 6));
        assert_eq!(Int6Matrix::hi_place(128 + 127), (32 + 31, 6));
        assert_eq!(Int6Matrix::hi_bytes_per_row(129), 64);
    }

    #[test]
    fn int6_extremes_and_bad_buffers() {
        // The largest magnitude maps to ±31 or −32 steps; zeros stay zeros; a scale past f16's
        // range, a short plane or a negative scale is refused.
        let m = quantize_int6(&[31.0, -32.0, 0.0, 1.0], 1, 4, 32);
        m.validate("t").unwrap();
        assert_eq!(m.dequantize(), vec![31.0, -32.0, 0.0, 1.0]);
        assert_eq!(quantize_int6(&[0.0; 64], 2, 32, 32).dequantize(), vec![0.0; 64]);
        assert!(quantize_int6(&[1e7, 1.0], 1, 2, 32).validate("t").is_err());
        let mut short = quantize_int6(&data(2, 40, 9), 2, 40, 32);
        short.validate("t").unwrap();
        short.hi.pop();
        assert!(short.validate("t").is_err());
        let mut negative = quantize_int6(&data(1, 40, 9), 1, 40, 32);
        negative.scales[0] |= 0x8000;
        assert!(negative.validate("t").is_err());
    }

    #[test]
    fn int4_scales_decode_as_the_f16_they_are() {
        for bits in (0..=0x7fffu16).filter(|b| int4_scale_ok(*b)) {
            assert_eq!(int4_scale(bits).to_bits(), f16_to_f32(bits).to_bits(), "{bits:#06x}");
        }
        assert_eq!(int4_scale(0x0001), 2f32.powi(-24));
        assert_eq!(int4_scale(0x7bff), 65504.0);
    }

    #[test]
    fn mxfp4_round_trip_picks_the_nearest_code_on_the_ocp_scale() {
        for &(rows, cols) in &[(1, 1), (2, 31), (3, 100), (4, 257)] {
            let w = data(rows, cols, 5);
            let m = quantize_mxfp4(&w, rows, cols);
            validate(&m, "test").unwrap();
            let QuantMatrix::Mxfp4 { scales, .. } = &m else { unreachable!() };
            let gpr = QuantMatrix::groups_per_row(cols, MXFP4_GROUP);
            let back = dequantize(&m);
            for (i, (a, b)) in w.iter().zip(&back).enumerate() {
                let s = e8m0_to_f32(scales[(i / cols) * gpr + (i % cols) / MXFP4_GROUP]);
                // No representable value is nearer than the chosen one.
                let best = E2M1.iter().map(|v| (a - v * s).abs()).fold(f32::INFINITY, f32::min);
                assert_eq!((a - b).abs(), best, "{rows}x{cols} #{i}: {a} -> {b} (scale {s})");
            }
        }
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert!(e8m0_to_f32(255).is_nan());
        // A group's maximum lands in [4, 8) · scale, so 6 saturates the top; zeros stay zeros.
        let m = quantize_mxfp4(&[7.0, -1.0, 0.0, 0.25], 1, 4);
        assert_eq!(dequantize(&m), vec![6.0, -1.0, 0.0, 0.0]);
        let bad = QuantMatrix::Mxfp4 { rows: 1, cols: 4, packed: vec![0, 0], scales: vec![255] };
        assert!(validate(&bad, "t").is_err());
    }

    #[test]
    fn fp8_e4m3_decodes_every_class() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // exponent 7 = bias
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
        // Blocks: a 3×5 matrix in 2×2 blocks has 2×3 scales.
        let q = vec![0x38u8; 15];
        let s = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = dequantize_fp8_blocks(&q, 3, 5, &s, 2).unwrap();
        assert_eq!(&w[..5], &[1.0, 1.0, 2.0, 2.0, 3.0]);
        assert_eq!(&w[10..], &[4.0, 4.0, 5.0, 5.0, 6.0]);
        assert!(dequantize_fp8_blocks(&q, 3, 5, &s[..5], 2).unwrap_err().contains("block scales"));
        assert!(dequantize_fp8_blocks(&[0x7f; 15], 3, 5, &s, 2).unwrap_err().contains("NaN"));
    }

    #[test]
    fn zeros_and_extremes_survive() {
        let w = vec![0.0f32; 64];
        assert_eq!(dequantize(&quantize_int4(&w, 2, 32, 32)), w);
        assert_eq!(dequantize(&quantize_int8(&w, 2, 32)), w);
        // The largest magnitude of a group maps exactly to ±7 (int4) and ±127 (int8).
        let w = vec![1e30f32, -1e30, 0.5, 0.0];
        let back = dequantize(&quantize_int8(&w, 1, 4));
        assert!((back[0] / 1e30 - 1.0).abs() < 1e-6 && (back[1] / -1e30 - 1.0).abs() < 1e-6);
        assert_eq!(QuantScheme::parse("int4-g64"), Ok(QuantScheme::Int4 { group: 64 }));
        // int4 scales are f16: a group whose scale is past f16's range is refused by validation,
        // one below it quantises to zeros, and stored scales are exactly what the codes used.
        assert!(validate(&quantize_int4(&[1e6, 1.0], 1, 2, 32), "t").is_err());
        assert_eq!(dequantize(&quantize_int4(&[1e-9, -1e-9], 1, 2, 32)), vec![0.0, 0.0]);
        let m = quantize_int4(&[448.0, -1.0, 0.1], 1, 3, 32);
        validate(&m, "t").unwrap();
        assert_eq!(dequantize(&m)[0], 448.0);
        let bad = QuantMatrix::Int4 { rows: 1, cols: 2, group: 32, packed: vec![0], scales: vec![0x8001] };
        assert!(validate(&bad, "t").is_err(), "a negative f16 scale");
        assert!(QuantScheme::parse("int3").unwrap_err().contains("int3"));
    }
}
