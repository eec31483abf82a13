//! Weight quantisation formats of the expert container, with their plain scalar definitions.
//!
//! - `Int8PerRow`: each row r stores `q[r][c] = round(w / s_r)` in i8 with `s_r = max|w_r| / 127`
//!   (an all-zero row has `s_r = 0`); `w ≈ q · s_r`.
//! - `Int4 { group }`: each run of `group` consecutive values in a row (32, 64 or 128; the last run
//!   of a row may be shorter) stores `q = clamp(round(w / s), -8, 7)` with `s = max|w| / 7`, as a
//!   nibble `q + 8`, two per byte (low nibble first), rows padded to a whole byte; `w ≈ q · s`.
//!
//! Only groups of 32, 64 and 128 are valid. Scales are f32. Rounding is half away from zero (`f32::round`). Dequantisation is exact given
//! q and s, so every kernel that consumes these formats is held to `dequantize` here.

use crate::error::LoadError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    Bf16,
    Int8PerRow,
    Int4 { group: usize },
}

impl QuantScheme {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(QuantScheme::Bf16),
            "int8" => Ok(QuantScheme::Int8PerRow),
            "int4-g32" => Ok(QuantScheme::Int4 { group: 32 }),
            "int4-g64" => Ok(QuantScheme::Int4 { group: 64 }),
            "int4-g128" => Ok(QuantScheme::Int4 { group: 128 }),
            other => Err(format!("unknown quantisation `{other}` (expected bf16, int8, int4-g32, int4-g64 or int4-g128)")),
        }
    }

    pub fn name(&self) -> String {
        match self {
            QuantScheme::Bf16 => "bf16".into(),
            QuantScheme::Int8PerRow => "int8".into(),
            QuantScheme::Int4 { group } => format!("int4-g{group}"),
        }
    }
}

/// A quantised `rows × cols` matrix.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantMatrix {
    Int8 { rows: usize, cols: usize, q: Vec<i8>, scales: Vec<f32> },
    Int4 { rows: usize, cols: usize, group: usize, packed: Vec<u8>, scales: Vec<f32> },
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
    for (r, row) in w.chunks_exact(cols).enumerate() {
        for (g, chunk) in row.chunks(group).enumerate() {
            let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = max / 7.0;
            scales.push(s);
            for (i, v) in chunk.iter().enumerate() {
                let q = if s == 0.0 { 0 } else { (v / s).round().clamp(-8.0, 7.0) as i32 };
                let c = g * group + i;
                let nib = (q + 8) as u8;
                let byte = &mut packed[r * bpr + c / 2];
                *byte |= if c % 2 == 0 { nib } else { nib << 4 };
            }
        }
    }
    QuantMatrix::Int4 { rows, cols, group, packed, scales }
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
                    out.push((nib as i32 - 8) as f32 * scales[r * gpr + c / group]);
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
            matches!(*group, 32 | 64 | 128) && packed.len() == rows * QuantMatrix::bytes_per_row_int4(*cols) && scales.len() == rows * QuantMatrix::groups_per_row(*cols, *group)
        }
    };
    if ok && match m { QuantMatrix::Int8 { scales, .. } | QuantMatrix::Int4 { scales, .. } => scales.iter().all(|s| s.is_finite() && *s >= 0.0) } {
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
    if q.len() != rows * cols {
        return Err(format!("fp8 data is {} bytes, the shape {rows}×{cols} needs {}", q.len(), rows * cols));
    }
    let (br, bc) = (rows.div_ceil(block), cols.div_ceil(block));
    if scale_inv.len() != br * bc {
        return Err(format!("block scales hold {} values, {rows}×{cols} in {block}×{block} blocks needs {br}×{bc}", scale_inv.len()));
    }
    if let Some(bad) = scale_inv.iter().find(|s| !s.is_finite()) {
        return Err(format!("a block scale is {bad}"));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let v = fp8_e4m3_to_f32(q[r * cols + c]);
            if v.is_nan() {
                return Err(format!("element ({r}, {c}) is an fp8 NaN"));
            }
            out.push(v * scale_inv[(r / block) * bc + c / block]);
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

    #[test]
    fn int4_round_trip_error_is_at_most_half_a_step_per_group() {
        for group in [32, 64, 128] {
            for &(rows, cols) in &[(1, 1), (2, 31), (3, 100), (4, 257)] {
                let w = data(rows, cols, group as u64);
                let m = quantize_int4(&w, rows, cols, group);
                validate(&m, "test").unwrap();
                let QuantMatrix::Int4 { scales, .. } = &m else { unreachable!() };
                let gpr = QuantMatrix::groups_per_row(cols, group);
                for (i, (a, b)) in w.iter().zip(dequantize(&m)).enumerate() {
                    let s = scales[(i / cols) * gpr + (i % cols) / group];
                    assert!((a - b).abs() <= s * 0.5 + 1e-6, "g{group} {rows}x{cols} #{i}: {a} vs {b}");
                }
            }
        }
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
        assert!(QuantScheme::parse("int3").unwrap_err().contains("int3"));
    }
}
