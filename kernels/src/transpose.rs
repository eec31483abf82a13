//! Transposing a product's weight-row-major results into activation-row-major outputs.
//!
//! Owns: `transpose_into` — the scalar definition, an AVX-512 path (blocks of up to 16 × 16
//! in registers, partial ones under masks) and an AVX one (blocks of 8 × 8), which move the same
//! values. Must never: change a value (it only moves floats), or read past `n` columns of a
//! source row (the rest of a strided row belongs to another output).

/// `out[i * rows + r] = t[r * stride + i]` for `r < rows`, `i < n`: the batched products give
/// each weight row's results over a prompt's rows; the caller wants them row by row. (Once a
/// scalar loop over 16 × 16 tiles: ~7 % of the demo model's prefill.)
pub fn transpose_into(t: &[f32], rows: usize, n: usize, stride: usize, out: &mut [f32]) {
    transpose_with(crate::dot::isa(), t, rows, n, stride, out)
}

/// `transpose_into` with `isa`'s instructions where it has a version (the scalar loop otherwise).
pub(crate) fn transpose_with(isa: crate::dot::Isa, t: &[f32], rows: usize, n: usize, stride: usize, out: &mut [f32]) {
    assert!(isa.available(), "{} is not available here", isa.name());
    assert!(stride >= n && out.len() >= rows * n, "transpose: output too short or stride below the width");
    assert!(rows == 0 || n == 0 || t.len() >= (rows - 1) * stride + n, "transpose: source too short");
    match isa {
        // SAFETY (both): the ISA is available (asserted: AVX-512 includes F, AVX2 includes AVX);
        // the bounds were checked above.
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx512 => unsafe { transpose_avx512(t, rows, n, stride, out) },
        #[cfg(target_arch = "x86_64")]
        crate::dot::Isa::Avx2 => unsafe { transpose_avx(t, rows, n, stride, out) },
        _ => transpose_scalar(t, rows, n, stride, out),
    }
}

/// The definition, in tiles so that the strided reads stay within a few cache lines.
fn transpose_scalar(t: &[f32], rows: usize, n: usize, stride: usize, out: &mut [f32]) {
    const TILE: usize = 16;
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for i0 in (0..n).step_by(TILE) {
            let i1 = (i0 + TILE).min(n);
            for i in i0..i1 {
                for r in r0..r1 {
                    out[i * rows + r] = t[r * stride + i];
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_avx512(t: &[f32], rows: usize, n: usize, stride: usize, out: &mut [f32]) {
    for r0 in (0..rows).step_by(16) {
        for i0 in (0..n).step_by(16) {
            let (h, w) = ((rows - r0).min(16), (n - i0).min(16));
            // SAFETY: rows r0..r0+h of `t` have columns i0..i0+w (i0 + w <= n <= stride, and the
            // source length was checked for `rows` rows of `n`); rows i0..i0+w of `out` have
            // columns r0..r0+h.
            unsafe { block16(t.as_ptr().add(r0 * stride + i0), stride, out.as_mut_ptr().add(i0 * rows + r0), rows, h, w) };
        }
    }
}

/// One block of up to 16 × 16: `h` source rows of `w` floats in, `w` columns of `h` out, by the
/// usual rounds of shuffles (pairs of floats, pairs of doubles, then 128-bit lanes twice). A
/// partial block loads and stores under masks (experts' products have a handful of rows).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block16(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize, h: usize, w: usize) {
    use std::arch::x86_64::*;
    let lanes = |k: usize| -> __mmask16 { ((1u32 << k) - 1) as __mmask16 };
    let (load_mask, store_mask) = (lanes(w), lanes(h));
    // SAFETY (the whole body): the caller guarantees `w` readable floats at each of the `h`
    // source rows and `h` writable floats at each of the `w` destination rows; masked-off lanes
    // are neither read nor written.
    unsafe {
        let r: [__m512; 16] = std::array::from_fn(|k| if k < h { _mm512_maskz_loadu_ps(load_mask, src.add(k * src_stride)) } else { _mm512_setzero_ps() });
        // Round 1: floats of row pairs interleaved.
        let mut a = [_mm512_setzero_ps(); 16];
        for k in 0..8 {
            a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        // Round 2: float pairs of row quads; b[4q + c] holds, per 128-bit lane L, column 4L + c
        // of rows 4q..4q+4.
        let pd = _mm512_castps_pd;
        let mut b = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            let (x0, x1, x2, x3) = (a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
            b[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(x0), pd(x2)));
            b[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(x0), pd(x2)));
            b[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(x1), pd(x3)));
            b[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(x1), pd(x3)));
        }
        // Round 3: lanes of row quads 0 and 1 paired: c[col] holds columns col and col + 8 of
        // rows 0..8, c[4 + col] columns col + 4 and col + 12; c[8 + col] and c[12 + col] the same
        // of rows 8..16 (quads 2 and 3).
        let mut c = [_mm512_setzero_ps(); 16];
        for col in 0..4 {
            c[col] = _mm512_shuffle_f32x4::<0x88>(b[col], b[4 + col]);
            c[4 + col] = _mm512_shuffle_f32x4::<0xdd>(b[col], b[4 + col]);
            c[8 + col] = _mm512_shuffle_f32x4::<0x88>(b[8 + col], b[12 + col]);
            c[12 + col] = _mm512_shuffle_f32x4::<0xdd>(b[8 + col], b[12 + col]);
        }
        // Round 4: whole columns, each stored as one destination row.
        let store = |col: usize, v: __m512| {
            if col < w {
                _mm512_mask_storeu_ps(dst.add(col * dst_stride), store_mask, v);
            }
        };
        for col in 0..4 {
            store(col, _mm512_shuffle_f32x4::<0x88>(c[col], c[8 + col]));
            store(col + 4, _mm512_shuffle_f32x4::<0x88>(c[4 + col], c[12 + col]));
            store(col + 8, _mm512_shuffle_f32x4::<0xdd>(c[col], c[8 + col]));
            store(col + 12, _mm512_shuffle_f32x4::<0xdd>(c[4 + col], c[12 + col]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_avx(t: &[f32], rows: usize, n: usize, stride: usize, out: &mut [f32]) {
    for r0 in (0..rows).step_by(8) {
        for i0 in (0..n).step_by(8) {
            let (h, w) = ((rows - r0).min(8), (n - i0).min(8));
            // SAFETY: as in `transpose_avx512`, with blocks of 8.
            unsafe { block8(t.as_ptr().add(r0 * stride + i0), stride, out.as_mut_ptr().add(i0 * rows + r0), rows, h, w) };
        }
    }
}

/// One block of up to 8 × 8 with 256-bit registers: floats of row pairs interleaved, float pairs
/// of row quads, then 128-bit lanes of the two quads. A partial block loads and stores under
/// masks, as `block16`; a whole row or column moves without one, because `vmaskmovps` to memory
/// is microcoded on AMD's Zen cores (this function was 4.5 % of m1b's 4-bit prefill on a Zen 3,
/// its blocks nearly all whole).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn block8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize, h: usize, w: usize) {
    use std::arch::x86_64::*;
    let lanes = |k: usize| _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), _mm256_set1_ps(k as f32)));
    let (load_mask, store_mask) = (lanes(w), lanes(h));
    // SAFETY (the whole body): the caller guarantees `w` readable floats at each of the `h`
    // source rows and `h` writable floats at each of the `w` destination rows; masked-off lanes
    // are neither read nor written.
    unsafe {
        let load = |p: *const f32| if w == 8 { _mm256_loadu_ps(p) } else { _mm256_maskload_ps(p, load_mask) };
        let store = |p: *mut f32, v: __m256| if h == 8 { _mm256_storeu_ps(p, v) } else { _mm256_maskstore_ps(p, store_mask, v) };
        let r: [__m256; 8] = std::array::from_fn(|k| if k < h { load(src.add(k * src_stride)) } else { _mm256_setzero_ps() });
        let a: [__m256; 8] = std::array::from_fn(|k| {
            let (x, y) = (r[k & !1], r[k | 1]);
            if k & 1 == 0 {
                _mm256_unpacklo_ps(x, y)
            } else {
                _mm256_unpackhi_ps(x, y)
            }
        });
        // b[4q + c] holds, per 128-bit lane L, column 4L + c of rows 4q..4q+4.
        let mut b = [_mm256_setzero_ps(); 8];
        for q in 0..2 {
            let (x0, x1, x2, x3) = (a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
            b[4 * q] = _mm256_shuffle_ps::<0x44>(x0, x2);
            b[4 * q + 1] = _mm256_shuffle_ps::<0xEE>(x0, x2);
            b[4 * q + 2] = _mm256_shuffle_ps::<0x44>(x1, x3);
            b[4 * q + 3] = _mm256_shuffle_ps::<0xEE>(x1, x3);
        }
        for col in 0..4 {
            if col < w {
                store(dst.add(col * dst_stride), _mm256_permute2f128_ps::<0x20>(b[col], b[4 + col]));
            }
            if col + 4 < w {
                store(dst.add((col + 4) * dst_stride), _mm256_permute2f128_ps::<0x31>(b[col], b[4 + col]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path moves every value where the definition puts it, at widths and heights around
    /// the 16 × 16 blocks and with a stride wider than the width (paired products), and writes
    /// nothing else.
    #[test]
    fn every_path_is_the_definition() {
        for &(rows, n, extra) in
            &[(1, 1, 0), (16, 16, 0), (17, 33, 5), (64, 64, 64), (300, 17, 3), (15, 48, 1), (256, 8, 8), (32, 100, 0), (64, 5, 0), (7, 3, 2), (256, 15, 0)]
        {
            let stride = n + extra;
            let t: Vec<f32> = (0..rows * stride).map(|k| k as f32 + 0.5).collect();
            let mut want = vec![-1.0f32; rows * n + 7];
            transpose_scalar(&t, rows, n, stride, &mut want);
            for i in 0..n {
                for r in 0..rows {
                    assert_eq!(want[i * rows + r], t[r * stride + i]);
                }
            }
            let mut got = vec![-1.0f32; rows * n + 7];
            transpose_into(&t, rows, n, stride, &mut got);
            assert_eq!(got, want, "{rows} x {n}, stride {stride}");
            for isa in crate::dot::Isa::all_available() {
                let mut simd = vec![-1.0f32; rows * n + 7];
                transpose_with(isa, &t, rows, n, stride, &mut simd);
                assert_eq!(simd, want, "{} {rows} x {n}, stride {stride}", isa.name());
            }
        }
    }
}
