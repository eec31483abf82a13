use super::*;
use shimmer_common::quant::{dequantize, quantize_int4, quantize_int6, quantize_int8, quantize_mxfp4, Int6Matrix, QuantMatrix, E2M1};

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn row_of(q: &QuantMatrix, n: usize) -> WeightRow<'_> {
    match q {
        QuantMatrix::Int8 { q, scales, .. } => WeightRow::Int8 { q, scale: scales[0] },
        QuantMatrix::Int4 { packed, scales, group, .. } => WeightRow::Int4 { packed, scales, group: *group, n },
        QuantMatrix::Mxfp4 { packed, scales, .. } => WeightRow::Mxfp4 { packed, scales, n },
    }
}

fn int6_row(m: &Int6Matrix) -> WeightRow<'_> {
    WeightRow::Int6 { lo: &m.lo, hi: &m.hi, scales: &m.scales, group: m.group, n: m.cols }
}

fn quantized(x: &[f32]) -> QuantRows {
    let mut q = QuantRows::default();
    q.quantize(x, x.len());
    q
}

/// Every ISA against the scalar definition: alone, in batches of 2 and 4, two rows in one pass.
fn every_isa_agrees(name: &str, row: &WeightRow<'_>, acts: &[QRow<'_>]) {
    let want: Vec<u32> = acts.iter().map(|x| qdot_scalar(row, x).to_bits()).collect();
    for isa in IntIsa::all_available() {
        for (k, x) in acts.iter().enumerate() {
            assert_eq!(qdots_rows_with::<1, 1>(isa, [row], [x])[0][0].to_bits(), want[k], "{name} {isa:?} alone, row {k}");
        }
        let [two] = qdots_rows_with::<1, 2>(isa, [row], [&acts[1], &acts[0]]);
        assert_eq!(two.map(f32::to_bits), [want[1], want[0]], "{name} {isa:?} in a batch of two");
        let [four] = qdots_rows_with::<1, 4>(isa, [row], [&acts[0], &acts[1], &acts[2], &acts[3]]);
        assert_eq!(four.map(f32::to_bits), [want[0], want[1], want[2], want[3]], "{name} {isa:?} in a batch of four");
        let [a, b] = qdots_rows_with::<2, 4>(isa, [row, row], [&acts[3], &acts[2], &acts[1], &acts[0]]);
        assert_eq!(
            (a.map(f32::to_bits), b.map(f32::to_bits)),
            ([want[3], want[2], want[1], want[0]], [want[3], want[2], want[1], want[0]]),
            "{name} {isa:?} two rows"
        );
    }
}

#[test]
fn every_isa_gives_the_canonical_bits_for_every_format_and_shape() {
    assert!(IntIsa::all_available().contains(&int_isa()));
    assert!(IntIsa::all_available().contains(&matvec_isa()), "decode's ISA is one the machine has");
    for &n in &[1usize, 2, 5, 31, 32, 33, 64, 96, 127, 128, 129, 200, 255, 256, 257, 1000, 1024, 4099] {
        let w = values(n, n as u64, 1.5);
        let xs: Vec<Vec<f32>> = (0..4).map(|k| values(n, 1000 + k, 3.0)).collect();
        let qs: Vec<QuantRows> = xs.iter().map(|x| quantized(x)).collect();
        let acts: Vec<QRow<'_>> = qs.iter().map(|q| q.row(0)).collect();
        let mut formats = vec![quantize_int8(&w, 1, n), quantize_mxfp4(&w, 1, n)];
        for g in [32, 64, 128] {
            formats.push(quantize_int4(&w, 1, n, g));
        }
        let sixes: Vec<Int6Matrix> = [32, 64, 128].into_iter().map(|g| quantize_int6(&w, 1, n, g)).collect();
        let rows = formats
            .iter()
            .map(|q| (format!("{} n={n}", format!("{q:?}").chars().take(5).collect::<String>()), row_of(q, n), dequantize(q)))
            .chain(sixes.iter().map(|m| (format!("int6-g{} n={n}", m.group), int6_row(m), m.dequantize())));
        for (name, row, decoded) in rows {
            every_isa_agrees(&name, &row, &acts);
            // Close to the exact dot of what both sides stand for.
            for (x, a) in xs.iter().zip(&acts) {
                let got = qdot_scalar(&row, a) as f64;
                let xq: Vec<f64> = (0..n).map(|i| a.q(i) as f64 * a.scale(i / QBLOCK) as f64).collect();
                let exact: f64 = decoded.iter().zip(&xq).map(|(w, x)| *w as f64 * x).sum();
                let mag: f64 = decoded.iter().zip(&xq).map(|(w, x)| (*w as f64 * x).abs()).sum();
                assert!((got - exact).abs() <= 1e-6 * mag + 1e-30, "{name}: {got} vs {exact}");
                // And within the activation rounding of the f32-activation product.
                let f32_exact: f64 = decoded.iter().zip(x).map(|(w, x)| *w as f64 * *x as f64).sum();
                let step: f64 = (0..n).map(|i| (decoded[i] as f64).abs() * a.scale(i / QBLOCK) as f64 * 0.5).sum();
                assert!((got - f32_exact).abs() <= step * 1.001 + 1e-6 * mag, "{name}: {got} vs f32 activations {f32_exact}");
            }
        }
    }
}

#[test]
fn activations_round_to_within_half_a_step_and_keep_their_sign() {
    let x: Vec<f32> = values(300, 9, 4.0).into_iter().chain([0.0, -0.0, 1e-30, -1e30]).collect();
    let q = quantized(&x);
    let r = q.row(0);
    for (i, v) in x.iter().enumerate() {
        let d = r.scale(i / QBLOCK);
        let back = r.q(i) as f32 * d;
        assert!((back - v).abs() <= d * 0.5 * (1.0 + 1e-6), "{i}: {v} → {} × {d}", r.q(i));
        assert!(r.q(i) >= -127, "−128 is never produced");
    }
    // The largest magnitude of a block maps to ±127 exactly.
    let block = &x[..QBLOCK];
    let (imax, _) = block.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
    assert_eq!(r.q(imax).unsigned_abs(), 127);
    // Padding is q = 0 with scale 0.
    assert_eq!((r.q(x.len()), r.scale(CHUNK * x.len().div_ceil(CHUNK) / QBLOCK - 1)), (0, 0.0));
}

#[test]
fn a_non_finite_activation_makes_the_result_nan_on_every_isa() {
    let n = 200;
    let w = values(n, 3, 1.0);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = values(n, 4, 1.0);
        x[150] = bad;
        let q = quantized(&x);
        let six = quantize_int6(&w, 1, n, 32);
        for fmt in [quantize_int8(&w, 1, n), quantize_int4(&w, 1, n, 64), quantize_mxfp4(&w, 1, n)] {
            for isa in IntIsa::all_available() {
                assert!(qdots_rows_with::<1, 1>(isa, [&row_of(&fmt, n)], [&q.row(0)])[0][0].is_nan(), "{bad} {isa:?}");
                assert!(qdots_rows_with::<1, 1>(isa, [&int6_row(&six)], [&q.row(0)])[0][0].is_nan(), "int6 {bad} {isa:?}");
            }
        }
    }
}

#[test]
fn extreme_scales_zero_rows_and_the_most_negative_int8_agree_across_isas() {
    let n = 300;
    let x = values(n, 5, 1.0);
    let tiny: Vec<f32> = x.iter().map(|v| v * 1e-38).collect();
    let huge: Vec<f32> = x.iter().map(|v| v * 1e37).collect();
    let acts: Vec<QuantRows> = [&x, &tiny, &huge, &vec![0.0; n]].iter().map(|v| quantized(v)).collect();
    let acts: Vec<QRow<'_>> = acts.iter().map(|q| q.row(0)).collect();
    // int8 with −128 (a file may hold it), zeros, and ±127.
    let q8: Vec<i8> = (0..n).map(|i| [-128, 127, -127, 0, 5][i % 5]).collect();
    every_isa_agrees("int8 -128", &WeightRow::Int8 { q: &q8, scale: 0.01 }, &acts);
    every_isa_agrees("int8 zero row", &WeightRow::Int8 { q: &vec![0; n], scale: 1.0 }, &acts);
    let packed: Vec<u8> = (0..n / 2).map(|i| (i * 29 % 256) as u8).collect();
    let big_scales = vec![0x7bffu16; n.div_ceil(32)];
    every_isa_agrees("int4 largest f16 scales", &WeightRow::Int4 { packed: &packed, scales: &big_scales, group: 32, n }, &acts);
    for group in [32, 64, 128] {
        let odd: Vec<u16> = (0..n.div_ceil(group)).map(|g| [0x0001u16, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0x1234, 0x2e66][g % 7]).collect();
        every_isa_agrees(&format!("int4-g{group} subnormal and mixed f16 scales"), &WeightRow::Int4 { packed: &packed, scales: &odd, group, n }, &acts);
    }
    let zero_scales = vec![0u16; n.div_ceil(64)];
    every_isa_agrees("int4 zero scales", &WeightRow::Int4 { packed: &packed, scales: &zero_scales, group: 64, n }, &acts);
    for e in [0u8, 1, 2, 127, 200, 254] {
        let sc = vec![e; n.div_ceil(32)];
        every_isa_agrees(&format!("mxfp4 e={e}"), &WeightRow::Mxfp4 { packed: &packed, scales: &sc, n }, &acts);
    }
    // int6: every byte pattern in both planes (so every code from −32 to 31, and top bits set in
    // the padding past the row), with the largest, subnormal and mixed f16 scales.
    let lo: Vec<u8> = (0..n.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect();
    let hi: Vec<u8> = (0..Int6Matrix::hi_bytes_per_row(n)).map(|i| (i * 53 % 256) as u8).collect();
    let all_ones = (vec![0xffu8; n.div_ceil(2)], vec![0xffu8; hi.len()], vec![0u8; n.div_ceil(2)], vec![0u8; hi.len()]);
    for group in [32, 64, 128] {
        let odd: Vec<u16> = (0..n.div_ceil(group)).map(|g| [0x0001u16, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0x1234, 0x2e66][g % 7]).collect();
        every_isa_agrees(&format!("int6-g{group} mixed"), &WeightRow::Int6 { lo: &lo, hi: &hi, scales: &odd, group, n }, &acts);
        let big = vec![0x7bffu16; n.div_ceil(group)];
        every_isa_agrees(&format!("int6-g{group} all 31"), &WeightRow::Int6 { lo: &all_ones.0, hi: &all_ones.1, scales: &big, group, n }, &acts);
        every_isa_agrees(&format!("int6-g{group} all -32"), &WeightRow::Int6 { lo: &all_ones.2, hi: &all_ones.3, scales: &big, group, n }, &acts);
    }
    // e = 255 is e8m0's NaN (refused on load): the result is NaN on every ISA, never a number.
    let mut sc = (0..n.div_ceil(32)).map(|b| [3u8, 130, 77][b % 3]).collect::<Vec<u8>>();
    sc[5] = 255;
    for isa in IntIsa::all_available() {
        assert!(qdots_rows_with::<1, 1>(isa, [&WeightRow::Mxfp4 { packed: &packed, scales: &sc, n }], [&acts[0]])[0][0].is_nan(), "{isa:?}");
    }
    every_isa_agrees(
        "mxfp4 mixed e",
        &WeightRow::Mxfp4 { packed: &packed, scales: &sc[..5].iter().chain(&sc[6..]).chain([&9u8]).copied().collect::<Vec<u8>>(), n },
        &acts,
    );
}

#[test]
fn the_integer_tables_are_the_formats() {
    for (i, v) in E2M1.iter().enumerate() {
        assert_eq!(E2M1_TWICE[i] as f32, 2.0 * v, "nibble {i}");
    }
    for e in 0..=254u8 {
        assert_eq!(half_e8m0(e), shimmer_common::quant::e8m0_to_f32(e) / 2.0, "e8m0 {e}");
    }
    assert!(half_e8m0(255).is_nan());
    // Only whole-block int4 groups take the integer path.
    let packed = [0u8; 24];
    let scales = [0x3c00u16; 1];
    assert!(is_integer(&WeightRow::Int4 { packed: &packed, scales: &scales, group: 64, n: 48 }));
    assert!(!is_integer(&WeightRow::Int4 { packed: &packed, scales: &scales, group: 48, n: 48 }));
    assert!(!is_integer(&WeightRow::F32(&[1.0])));
}

/// The loops over rows (`qmatvec`, `qmatvec_pair`, `qmatmul_t`, `qmatmul_pair_t`) give every
/// row exactly `qdot_scalar`'s result, from any first row, for odd row counts and any number of
/// activation rows (the 2 × 4 tiles and what is left over), on every ISA the machine has.
#[test]
fn the_row_loops_give_each_row_the_scalar_bits() {
    // 300: whole chunks and a partial one; 64 and below: rows of one partial chunk, which the
    // AVX2 4-bit loop reads as one 32-byte half; 224 and 100: a last chunk of three whole
    // blocks, and of three and a part.
    for cols in [300usize, 224, 100, 64, 63, 33, 32, 31, 1] {
        row_loops_match_the_scalar_bits(cols);
    }
}

fn row_loops_match_the_scalar_bits(cols: usize) {
    let rows = 7usize;
    let (wa, wb) = (values(rows * cols, 11, 1.0), values(rows * cols, 12, 1.0));
    // Up to 11 activation rows: the 4-bit loops' passes of eight, four and the rest.
    let xs: Vec<Vec<f32>> = (0..11).map(|k| values(cols, 20 + k, 2.0)).collect();
    let qs: Vec<QuantRows> = xs.iter().map(|x| quantized(x)).collect();
    let acts: Vec<QRow<'_>> = qs.iter().map(|q| q.row(0)).collect();
    let pairs = [
        (quantize_int8(&wa, rows, cols), quantize_int8(&wb, rows, cols)),
        (quantize_int4(&wa, rows, cols, 32), quantize_int4(&wb, rows, cols, 32)),
        (quantize_int4(&wa, rows, cols, 64), quantize_int4(&wb, rows, cols, 64)),
        (quantize_int4(&wa, rows, cols, 128), quantize_int4(&wb, rows, cols, 128)),
        (quantize_mxfp4(&wa, rows, cols), quantize_mxfp4(&wb, rows, cols)),
    ];
    fn view(q: &QuantMatrix, rows: usize, cols: usize) -> QMatrix<'_> {
        match q {
            QuantMatrix::Int8 { q, scales, .. } => QMatrix::int8(q, scales, rows, cols),
            QuantMatrix::Int4 { packed, scales, group, .. } => QMatrix::int4(packed, scales, *group, rows, cols),
            QuantMatrix::Mxfp4 { packed, scales, .. } => QMatrix::mxfp4(packed, scales, rows, cols),
        }
    }
    let sixes: Vec<(Int6Matrix, Int6Matrix)> =
        [32, 64, 128].into_iter().map(|g| (quantize_int6(&wa, rows, cols, g), quantize_int6(&wb, rows, cols, g))).collect();
    fn six_view(m: &Int6Matrix) -> QMatrix<'_> {
        QMatrix::int6(&m.lo, &m.hi, &m.scales, m.group, m.rows, m.cols)
    }
    let views: Vec<(String, QMatrix<'_>, QMatrix<'_>)> = pairs
        .iter()
        .map(|(qa, qb)| (format!("{qa:?}").chars().take(5).collect::<String>(), view(qa, rows, cols), view(qb, rows, cols)))
        .chain(sixes.iter().map(|(a, b)| (format!("int6-g{}", a.group), six_view(a), six_view(b))))
        .collect();
    for isa in IntIsa::all_available() {
        for (qa, a, b) in &views {
            let (a, b) = (*a, *b);
            let want = |m: &QMatrix<'_>, r: usize, x: &QRow<'_>| qdot_scalar(&m.row(r), x).to_bits();
            for first in [0, 1, 2] {
                let len = rows - first;
                let mut out = vec![0.0; len];
                qmatvec_with(isa, &a, &acts[0], first, &mut out);
                assert!(
                    out.iter().enumerate().all(|(i, v)| v.to_bits() == want(&a, first + i, &acts[0])),
                    "{isa:?} qmatvec {qa:?} from {first}, {cols} columns"
                );
                let (mut oa, mut ob) = (vec![0.0; len], vec![0.0; len]);
                qmatvec_pair_with(isa, &a, &b, &acts[1], first, &mut oa, &mut ob);
                for i in 0..len {
                    assert_eq!(
                        (oa[i].to_bits(), ob[i].to_bits()),
                        (want(&a, first + i, &acts[1]), want(&b, first + i, &acts[1])),
                        "{isa:?} qmatvec_pair row {i}"
                    );
                }
                for n in 1..=acts.len() {
                    let xs = &acts[..n];
                    let mut t = vec![0.0; len * n];
                    qmatmul_t_with(isa, &a, xs, first, &mut t);
                    let mut p = vec![0.0; len * 2 * n];
                    qmatmul_pair_t_with(isa, &a, &b, xs, first, &mut p);
                    for r in 0..len {
                        for (i, x) in xs.iter().enumerate() {
                            assert_eq!(t[r * n + i].to_bits(), want(&a, first + r, x), "{isa:?} qmatmul_t {cols} columns n={n} row {r} act {i}");
                            assert_eq!(p[r * 2 * n + i].to_bits(), want(&a, first + r, x), "{isa:?} qmatmul_pair_t A {cols} columns n={n} row {r} act {i}");
                            assert_eq!(p[r * 2 * n + n + i].to_bits(), want(&b, first + r, x), "{isa:?} qmatmul_pair_t B {cols} columns n={n} row {r} act {i}");
                        }
                    }
                }
            }
        }
    }
}

/// A row whose last, partial chunk ends at the end of readable memory (a guard page after it)
/// gives the scalar bits on every ISA: the tail is read in place (masked loads on AVX-512)
/// without touching a byte past the row.
#[cfg(unix)]
#[test]
fn a_row_ending_at_a_guard_page_is_read_without_touching_it() {
    let page = 4096 * 16; // covers 4 KiB and 16 KiB pages
                          // SAFETY: a fresh private mapping of two pages, the second made unreadable; unmapped below.
    let base = unsafe {
        let p = libc::mmap(std::ptr::null_mut(), 2 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(libc::mprotect((p as *mut u8).add(page) as *mut libc::c_void, page, libc::PROT_NONE), 0);
        p as *mut u8
    };
    for n in [200usize, 333, 64, 1] {
        let w = values(n, 70 + n as u64, 1.0);
        let q = quantized(&values(n, 80 + n as u64, 2.0));
        let x = q.row(0);
        for fmt in [quantize_int8(&w, 1, n), quantize_int4(&w, 1, n, 32), quantize_mxfp4(&w, 1, n)] {
            let bytes: Vec<u8> = match &fmt {
                QuantMatrix::Int8 { q, .. } => q.iter().map(|v| *v as u8).collect(),
                QuantMatrix::Int4 { packed, .. } | QuantMatrix::Mxfp4 { packed, .. } => packed.clone(),
            };
            // SAFETY: `bytes.len()` ≤ one page, copied to end exactly at the guard page.
            let at_edge = unsafe {
                let dst = base.add(page - bytes.len());
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
                std::slice::from_raw_parts(dst, bytes.len())
            };
            let row = match &fmt {
                // SAFETY: i8 and u8 have one layout.
                QuantMatrix::Int8 { scales, .. } => {
                    WeightRow::Int8 { q: unsafe { std::slice::from_raw_parts(at_edge.as_ptr() as *const i8, n) }, scale: scales[0] }
                }
                QuantMatrix::Int4 { scales, group, .. } => WeightRow::Int4 { packed: at_edge, scales, group: *group, n },
                QuantMatrix::Mxfp4 { scales, .. } => WeightRow::Mxfp4 { packed: at_edge, scales, n },
            };
            let want = qdot_scalar(&row, &x).to_bits();
            for isa in IntIsa::all_available() {
                assert_eq!(qdots_rows_with::<1, 1>(isa, [&row], [&x])[0][0].to_bits(), want, "n={n} {isa:?}");
            }
        }
        // int6's low nibbles at the edge (its top bits are whole chunks, read whole).
        let six = quantize_int6(&w, 1, n, 32);
        // SAFETY: as above.
        let at_edge = unsafe {
            let dst = base.add(page - six.lo.len());
            std::ptr::copy_nonoverlapping(six.lo.as_ptr(), dst, six.lo.len());
            std::slice::from_raw_parts(dst, six.lo.len())
        };
        let row = WeightRow::Int6 { lo: at_edge, hi: &six.hi, scales: &six.scales, group: 32, n };
        let want = qdot_scalar(&row, &x).to_bits();
        for isa in IntIsa::all_available() {
            assert_eq!(qdots_rows_with::<1, 1>(isa, [&row], [&x])[0][0].to_bits(), want, "int6 n={n} {isa:?}");
        }
    }
    // SAFETY: the mapping made above, no longer borrowed.
    unsafe { libc::munmap(base as *mut libc::c_void, 2 * page) };
}

/// The quantiser's rounding is `round_ties_even` on every value a scaled activation can take:
/// every f32 in [−130, 130] whose fraction is a multiple of 2^-16 (ties at every half among them),
/// and random ones.
#[test]
fn the_quantisers_rounding_is_round_ties_even() {
    let mut s = 7u64;
    let steps = (-130i32 << 16..=130 << 16).map(|i| i as f32 / 65536.0);
    let random = (0..200_000).map(|_| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        f32::from_bits(((s >> 33) as u32 % 0x4304_0000) | (((s >> 20) as u32 & 1) << 31))
    });
    for y in steps.chain(random).chain([0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.49999, f32::MIN_POSITIVE, -0.0]) {
        assert_eq!(round_small_ties_even(y), y.round_ties_even(), "{y}");
    }
}

/// Activations quantised without the 4-bit layout serve int8 weights with the same bits, and
/// 4-bit weights refuse them (the row loops would read the layout through raw pointers).
#[test]
fn rows_without_the_4bit_layout_serve_int8_and_are_refused_by_4bit_weights() {
    let (rows, cols) = (5usize, 300usize);
    let w = values(rows * cols, 31, 1.0);
    let x = values(cols, 32, 2.0);
    let (mut full, mut lean) = (QuantRows::default(), QuantRows::default());
    full.quantize(&x, cols);
    lean.quantize_for(&x, cols, false);
    assert!(full.row(0).has_nibbles() && !lean.row(0).has_nibbles());
    let q8 = quantize_int8(&w, rows, cols);
    let QuantMatrix::Int8 { q, scales, .. } = &q8 else { unreachable!() };
    let m = QMatrix::int8(q, scales, rows, cols);
    let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
    qmatvec(&m, &full.row(0), 0, &mut a);
    qmatvec(&m, &lean.row(0), 0, &mut b);
    assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    let q4 = quantize_int4(&w, rows, cols, 32);
    let QuantMatrix::Int4 { packed, scales, .. } = &q4 else { unreachable!() };
    let m4 = QMatrix::int4(packed, scales, 32, rows, cols);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| qmatvec(&m4, &lean.row(0), 0, &mut b)));
    assert!(refused.is_err(), "a 4-bit product took activations without their layout");
    let row = m4.row(0);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| qdots_rows::<1, 1>([&row], [&lean.row(0)])));
    assert!(refused.is_err());
}

/// The vector quantiser gives the scalar definition's bytes and scales: rows of every length
/// around a block, values of every magnitude, blocks with a NaN or an infinity, all-zero blocks,
/// and blocks so small that 127 / amax overflows (0 · ∞ is NaN there, which becomes 0).
#[test]
fn the_vector_quantiser_gives_the_scalar_bits() {
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for len in [1usize, 15, 16, 17, 31, 32, 33, 64, 100, 257] {
        rows.push(values(len, len as u64, 3.0));
        rows.push(values(len, 99 + len as u64, 1e-30));
        rows.push(vec![0.0; len]);
    }
    let mut odd = values(96, 5, 2.0);
    (odd[3], odd[40], odd[70]) = (f32::NAN, f32::INFINITY, f32::NEG_INFINITY);
    rows.push(odd);
    let mut tiny = vec![0.0f32; 40];
    (tiny[1], tiny[33]) = (f32::from_bits(1), -f32::from_bits(3)); // subnormal amax: 127/amax = ∞
    tiny[5] = 1e-38;
    rows.push(tiny);
    let mut s = 3u64;
    rows.push(
        (0..512)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                f32::from_bits((s >> 32) as u32) // any bit pattern: NaNs, infinities, subnormals
            })
            .collect(),
    );
    for x in &rows {
        let blocks = x.len().div_ceil(QBLOCK);
        let (mut want_q, mut want_d) = (vec![0x80u8; blocks * QBLOCK], vec![0.0f32; blocks]);
        quantize_row_scalar(x, &mut want_q, &mut want_d);
        for isa in crate::dot::Isa::all_available() {
            let (mut q, mut d) = (vec![0x80u8; blocks * QBLOCK], vec![0.0f32; blocks]);
            quantize_row_with(isa, x, &mut q, &mut d);
            let name = isa.name();
            assert_eq!(q, want_q, "{name}: bytes, row of {}", x.len());
            assert_eq!(
                d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want_d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{name}: scales, row of {}",
                x.len()
            );
        }
    }
}

/// `quantize_plain` gives the values and scales every product reads (`QRow::q`, `QRow::scale`),
/// with zeros past the row's end, for rows that do and do not fill their last block.
#[test]
fn the_plain_layout_holds_what_the_products_read() {
    for n in [1usize, 31, 32, 100, 257] {
        let xs: Vec<f32> = (0..3 * n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 * if i % 7 == 0 { 40.0 } else { 1.0 }).collect();
        let (mut q, mut d) = (Vec::new(), Vec::new());
        quantize_plain(&xs, n, &mut q, &mut d);
        let mut rows = QuantRows::default();
        rows.quantize(&xs, n);
        let blocks = n.div_ceil(QBLOCK);
        assert_eq!((q.len(), d.len()), (3 * blocks * QBLOCK, 3 * blocks));
        for r in 0..3 {
            let row = rows.row(r);
            for i in 0..blocks * QBLOCK {
                let want = if i < n { row.q(i) } else { 0 };
                assert_eq!(q[r * blocks * QBLOCK + i], want, "n {n}, row {r}, value {i}");
            }
            for b in 0..blocks {
                assert_eq!(d[r * blocks + b].to_bits(), row.scale(b).to_bits(), "n {n}, row {r}, block {b}");
            }
        }
    }
}

/// The vector 4-bit layout is the scalar one, byte for byte and lane for lane, over every byte
/// value (the extremes ±128 and ±127 included) and several chunks.
#[test]
fn the_nibble_layout_on_every_isa_is_the_scalar_layout() {
    let chunks = 5;
    let biased: Vec<u8> = (0..chunks * CHUNK).map(|i| if i % 97 == 3 { 0 } else { (i * 131 + i / 7) as u8 }).collect();
    let (mut split, mut neg8, mut neg12) = (vec![0i8; biased.len()], vec![0i32; biased.len() / 16], vec![0i32; biased.len() / 16]);
    nibble_layout_scalar(&biased, &mut split, &mut neg8, &mut neg12);
    assert_eq!(split[CHUNK / 2 + 1], (biased[3] ^ 0x80) as i8, "the odd half starts at element 1");
    assert!(neg8.iter().any(|v| *v != 0) && neg8.iter().zip(&neg12).all(|(a, b)| 3 * a == 2 * b));
    for isa in IntIsa::all_available() {
        let (mut s2, mut n8, mut n12) = (vec![1i8; biased.len()], vec![1i32; biased.len() / 16], vec![1i32; biased.len() / 16]);
        nibble_layout_with(isa, &biased, &mut s2, &mut n8, &mut n12);
        assert_eq!((&s2, &n8, &n12), (&split, &neg8, &neg12), "{}", isa.name());
    }
}

/// A reused `QuantRows` (the products keep one per thread) holds exactly what a fresh one would,
/// whatever shapes it held before: longer rows, more rows, a non-finite block, the 4-bit layout.
#[test]
fn a_reused_quantiser_gives_a_fresh_ones_bytes() {
    let bytes = |q: &QuantRows| {
        (
            q.n,
            q.padded,
            q.rows,
            q.biased.to_vec(),
            q.split.to_vec(),
            q.neg8.to_vec(),
            q.neg12.to_vec(),
            q.scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            q.scales8.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            q.lane_scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        )
    };
    let mut reused = QuantRows::default();
    let shapes = [(300usize, 5usize, true), (37, 3, false), (128, 2, true), (3, 7, true), (130, 9, true), (300, 1, false), (65, 4, true), (64, 2, true)];
    for (k, &(n, rows, nibbles)) in shapes.iter().enumerate() {
        let mut xs = values(n * rows, 11 + k as u64, 3.0);
        if k == 2 {
            xs[5] = f32::INFINITY;
        }
        let mut fresh = QuantRows::default();
        fresh.quantize_for(&xs, n, nibbles);
        reused.quantize_for(&xs, n, nibbles);
        assert!(bytes(&reused) == bytes(&fresh), "shape {k}: {n} × {rows}, nibbles {nibbles}");
    }
}
