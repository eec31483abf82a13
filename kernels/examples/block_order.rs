//! A trial of another canonical order for the 4-bit integer dot on AVX2, timed against the
//! kernels' own (`qdot.rs`): there each block's 32 products form eight exact sums of four, and
//! each sum takes a convert and an FMA in one of 32 lanes; here each block's products form two
//! exact sums of sixteen (one `vphaddd` makes them from `pmaddwd`'s eight), and a chunk of four
//! blocks takes one convert and one FMA into eight lanes. Fewer float steps a block and one
//! accumulator register a dot product instead of four, so one weight row can meet four
//! activation rows a pass on AVX2's sixteen registers. A measuring tool for a design decision
//! (`docs/benchmarks.md`, issue 18), not a kernel the engine uses: it has its own scalar
//! definition, checked bit for bit, and both are checked against an exact sum.
//!
//!     cargo run --release -p shimmer-kernels --example block_order [rows] [cols] [activation rows]
//!
//! The trial order, per chunk `c` of 128 values (blocks `4c .. 4c + 4`), for a weight row `w`
//! (int4 codes `nibble − 8`, a scale per block) and an activation row (int8 `q`, a scale `d` per
//! block): the half-block sum `H(b, t) = Σ w·q` over elements `32b + 16t .. 32b + 16t + 16`
//! (exact, i32), in lane `2·[0, 2, 1, 3][b mod 4] + t` (where `vphaddd` leaves it):
//! `acc[lane] = fma(ws_b · d_b, H(b, t), acc[lane])`; at the end `acc` reduced by 4, 2, 1.
#[path = "common/timing.rs"]
mod timing;

use shimmer_kernels::qdot::{self, QMatrix, QuantRows};
use timing::best_of_batches;

const CHUNK: usize = 128;
/// Lane of block `kb` of a chunk, half `t`: where `vphaddd` of the two 32-byte halves puts it.
const fn lane(kb: usize, t: usize) -> usize {
    2 * [0, 2, 1, 3][kb] + t
}

struct Acts {
    n: usize,
    /// Per row and 64 values: the 32 even elements' `q`, then the 32 odd ones' (the packed
    /// bytes' low and high nibbles).
    split: Vec<i8>,
    /// Per row and chunk, by lane: `−8 · Σ q` over the lane's sixteen elements.
    corr: Vec<i32>,
    /// Per row and chunk, by lane: its block's `d`.
    d8: Vec<f32>,
    /// The same for int8 weights' lanes (`lane8`).
    d8_int8: Vec<f32>,
    /// Plain: `q` and `d` by element and block (the scalar definition's).
    q: Vec<i8>,
    d: Vec<f32>,
}

fn acts(q: Vec<i8>, d: Vec<f32>, cols: usize) -> Acts {
    let n = q.len() / cols;
    let chunks = cols / CHUNK;
    let mut split = vec![0i8; q.len()];
    let (mut corr, mut d8, mut d8_int8) = (vec![0i32; n * chunks * 8], vec![0.0f32; n * chunks * 8], vec![0.0f32; n * chunks * 8]);
    for r in 0..n {
        for s in 0..cols / 64 {
            for t in 0..32 {
                split[r * cols + s * 64 + t] = q[r * cols + s * 64 + 2 * t];
                split[r * cols + s * 64 + 32 + t] = q[r * cols + s * 64 + 2 * t + 1];
            }
        }
        for c in 0..chunks {
            for kb in 0..4 {
                let b = 4 * c + kb;
                for t in 0..2 {
                    let start = r * cols + 32 * b + 16 * t;
                    let sum: i32 = q[start..start + 16].iter().map(|v| *v as i32).sum();
                    corr[(r * chunks + c) * 8 + lane(kb, t)] = -8 * sum;
                    d8[(r * chunks + c) * 8 + lane(kb, t)] = d[r * cols / 32 + b];
                    d8_int8[(r * chunks + c) * 8 + lane8(kb, t)] = d[r * cols / 32 + b];
                }
            }
        }
    }
    Acts { n, split, corr, d8, d8_int8, q, d }
}

/// The trial order in plain code: weight row `packed` (`cols / 2` bytes), its block scales.
fn dot_scalar(packed: &[u8], scales: &[f32], a: &Acts, k: usize, cols: usize) -> f32 {
    let mut acc = [0.0f32; 8];
    for c in 0..cols / CHUNK {
        for kb in 0..4 {
            let b = 4 * c + kb;
            let f = scales[b] * a.d[k * cols / 32 + b];
            for t in 0..2 {
                let mut h = 0i32;
                for i in 32 * b + 16 * t..32 * b + 16 * t + 16 {
                    let nib = if i % 2 == 0 { packed[i / 2] & 0x0f } else { packed[i / 2] >> 4 };
                    h += (nib as i32 - 8) * a.q[k * cols + i] as i32;
                }
                let l = lane(kb, t);
                acc[l] = f.mul_add(h as f32, acc[l]);
            }
        }
    }
    for s in [4, 2, 1] {
        for l in 0..s {
            acc[l] += acc[l + s];
        }
    }
    acc[0]
}

/// int8 weights (`q8`, a scale per row) in the trial order: the same half-block sums, in lane
/// `kb + 4t` (where two rounds of `vphaddd` over a chunk's four blocks leave them); the row scale
/// multiplies the reduced sum.
const fn lane8(kb: usize, t: usize) -> usize {
    kb + 4 * t
}

fn dot8_scalar(w: &[i8], scale: f32, a: &Acts, k: usize, cols: usize) -> f32 {
    let mut acc = [0.0f32; 8];
    for c in 0..cols / CHUNK {
        for kb in 0..4 {
            let b = 4 * c + kb;
            let d = a.d[k * cols / 32 + b];
            for t in 0..2 {
                let h: i32 = (32 * b + 16 * t..32 * b + 16 * t + 16).map(|i| w[i] as i32 * a.q[k * cols + i] as i32).sum();
                let l = lane8(kb, t);
                acc[l] = d.mul_add(h as f32, acc[l]);
            }
        }
    }
    for s in [4, 2, 1] {
        for l in 0..s {
            acc[l] += acc[l + s];
        }
    }
    scale * acc[0]
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Acts, CHUNK};
    use std::arch::x86_64::*;

    /// One weight row against `N` activation rows `ks`, the trial order.
    #[inline(always)]
    unsafe fn row_against<const N: usize>(packed: *const u8, s8: *const f32, a: &Acts, ks: [usize; N], cols: usize) -> [f32; N] {
        let (mask, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
        let chunks = cols / CHUNK;
        let mut acc = [_mm256_setzero_ps(); N];
        for c in 0..chunks {
            let x0 = _mm256_loadu_si256(packed.add(c * 64) as *const __m256i);
            let x1 = _mm256_loadu_si256(packed.add(c * 64 + 32) as *const __m256i);
            let w = [
                _mm256_and_si256(x0, mask),
                _mm256_and_si256(_mm256_srli_epi16::<4>(x0), mask),
                _mm256_and_si256(x1, mask),
                _mm256_and_si256(_mm256_srli_epi16::<4>(x1), mask),
            ];
            let fw = _mm256_loadu_ps(s8.add(c * 8));
            for (j, k) in ks.iter().enumerate() {
                let q = a.split.as_ptr().add(k * cols + c * CHUNK);
                // (A macro, not a closure: a closure would not take the caller's target features.)
                macro_rules! pair {
                    ($lo:expr, $hi:expr, $at:expr) => {{
                        let e = _mm256_madd_epi16(_mm256_maddubs_epi16($lo, _mm256_loadu_si256(q.add($at) as *const __m256i)), ones);
                        let o = _mm256_madd_epi16(_mm256_maddubs_epi16($hi, _mm256_loadu_si256(q.add($at + 32) as *const __m256i)), ones);
                        _mm256_add_epi32(e, o)
                    }};
                }
                let h = _mm256_hadd_epi32(pair!(w[0], w[1], 0), pair!(w[2], w[3], 64));
                let at = (k * chunks + c) * 8;
                let p = _mm256_add_epi32(h, _mm256_loadu_si256(a.corr.as_ptr().add(at) as *const __m256i));
                let f = _mm256_mul_ps(fw, _mm256_loadu_ps(a.d8.as_ptr().add(at)));
                acc[j] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), acc[j]);
            }
        }
        let mut out = [0.0f32; N];
        for (o, v) in out.iter_mut().zip(acc) {
            *o = reduce8(v);
        }
        out
    }

    /// Eight lanes reduced by s = 4 (the halves), 2, 1.
    #[inline(always)]
    unsafe fn reduce8(v: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
    }

    /// int8: one weight row against `N` activation rows, `|w|` times `q` with `w`'s sign (no
    /// pair of products reaches i16's limit), two rounds of `vphaddd` a chunk.
    #[inline(always)]
    unsafe fn row8_against<const N: usize>(w: *const i8, scale: f32, a: &Acts, ks: [usize; N], cols: usize) -> [f32; N] {
        let ones = _mm256_set1_epi16(1);
        let chunks = cols / CHUNK;
        let mut acc = [_mm256_setzero_ps(); N];
        for c in 0..chunks {
            let at = |kb: usize| w.add(c * CHUNK + 32 * kb) as *const __m256i;
            let wv = [_mm256_loadu_si256(at(0)), _mm256_loadu_si256(at(1)), _mm256_loadu_si256(at(2)), _mm256_loadu_si256(at(3))];
            let wabs = [_mm256_abs_epi8(wv[0]), _mm256_abs_epi8(wv[1]), _mm256_abs_epi8(wv[2]), _mm256_abs_epi8(wv[3])];
            for (j, k) in ks.iter().enumerate() {
                let q = a.q.as_ptr().add(k * cols + c * CHUNK);
                macro_rules! block {
                    ($kb:expr) => {{
                        let x = _mm256_loadu_si256(q.add(32 * $kb) as *const __m256i);
                        _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[$kb], _mm256_sign_epi8(x, wv[$kb])), ones)
                    }};
                }
                let h = _mm256_hadd_epi32(_mm256_hadd_epi32(block!(0), block!(1)), _mm256_hadd_epi32(block!(2), block!(3)));
                let d = _mm256_loadu_ps(a.d8_int8.as_ptr().add((k * chunks + c) * 8));
                acc[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(h), acc[j]);
            }
        }
        let mut out = [0.0f32; N];
        for (o, v) in out.iter_mut().zip(acc) {
            *o = scale * reduce8(v);
        }
        out
    }

    /// `matmul_t` for int8 rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn matmul8_t(q8: &[i8], row_scales: &[f32], rows: usize, cols: usize, a: &Acts, out: &mut [f32]) {
        let n = a.n;
        for r in 0..rows {
            let (w, sc) = (q8.as_ptr().add(r * cols), row_scales[r]);
            let mut k = 0;
            while k + 4 <= n {
                out[r * n + k..r * n + k + 4].copy_from_slice(&row8_against::<4>(w, sc, a, [k, k + 1, k + 2, k + 3], cols));
                k += 4;
            }
            while k < n {
                out[r * n + k] = row8_against::<1>(w, sc, a, [k], cols)[0];
                k += 1;
            }
        }
    }

    /// `out[r · n + k] = row r · activation row k`, each weight row against four activation rows a
    /// pass.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn matmul_t(packed: &[u8], s8: &[f32], rows: usize, cols: usize, a: &Acts, out: &mut [f32]) {
        let n = a.n;
        for r in 0..rows {
            let (p, s) = (packed.as_ptr().add(r * cols / 2), s8.as_ptr().add(r * cols / CHUNK * 8));
            let mut k = 0;
            while k + 4 <= n {
                out[r * n + k..r * n + k + 4].copy_from_slice(&row_against::<4>(p, s, a, [k, k + 1, k + 2, k + 3], cols));
                k += 4;
            }
            while k < n {
                out[r * n + k] = row_against::<1>(p, s, a, [k], cols)[0];
                k += 1;
            }
        }
    }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (rows, cols, n) = (args.first().copied().unwrap_or(512), args.get(1).copied().unwrap_or(1024), args.get(2).copied().unwrap_or(16));
    assert!(cols.is_multiple_of(CHUNK) && n > 0, "cols a multiple of {CHUNK}, at least one activation row");
    let mut s = 7u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    // f16-representable scales, so the kernels' own int4 matrix holds the same weights.
    let scale_bits: Vec<u16> = (0..rows * cols / 32).map(|_| half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5).to_bits()).collect();
    let scales: Vec<f32> = scale_bits.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect();
    let xs: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut quant = QuantRows::default();
    quant.quantize(&xs, cols);
    let rowsq: Vec<_> = (0..n).map(|k| quant.row(k)).collect();
    let (q, d): (Vec<i8>, Vec<f32>) =
        ((0..n * cols).map(|i| rowsq[i / cols].q(i % cols)).collect(), (0..n * cols / 32).map(|i| rowsq[i / (cols / 32)].scale(i % (cols / 32))).collect());
    let a = acts(q, d, cols);
    // The weight scales by lane, per chunk.
    let s8: Vec<f32> = (0..rows * cols / CHUNK)
        .flat_map(|rc| {
            let (r, c) = (rc / (cols / CHUNK), rc % (cols / CHUNK));
            let mut v = [0.0f32; 8];
            for kb in 0..4 {
                for t in 0..2 {
                    v[lane(kb, t)] = scales[r * cols / 32 + 4 * c + kb];
                }
            }
            v
        })
        .collect();

    // The trial's scalar definition against an exact sum, and its AVX2 kernel bit for bit.
    let want: Vec<f32> = (0..rows * n).map(|i| dot_scalar(&packed[(i / n) * cols / 2..], &scales[(i / n) * cols / 32..], &a, i % n, cols)).collect();
    for (i, w) in want.iter().enumerate().step_by(97) {
        let (r, k) = (i / n, i % n);
        let terms: Vec<f64> = (0..cols)
            .map(|e| {
                let byte = packed[r * cols / 2 + e / 2];
                let nib = if e % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                (nib as f64 - 8.0) * scales[r * cols / 32 + e / 32] as f64 * a.q[k * cols + e] as f64 * a.d[k * cols / 32 + e / 32] as f64
            })
            .collect();
        let (exact, magnitude): (f64, f64) = (terms.iter().sum(), terms.iter().map(|t| t.abs()).sum());
        assert!((*w as f64 - exact).abs() <= 1e-6 * magnitude, "row {r} act {k}: {w} against {exact}");
    }
    let have_avx2 = cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    if !have_avx2 {
        println!("no AVX2 + FMA here: the trial's kernel is AVX2 only");
        return;
    }
    let mut out = vec![0.0f32; rows * n];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA were detected; the buffers cover `rows × cols` and `n` activation rows.
    let trial = |out: &mut [f32]| unsafe { avx2::matmul_t(&packed, &s8, rows, cols, &a, out) };
    #[cfg(not(target_arch = "x86_64"))]
    let trial = |_: &mut [f32]| {};
    trial(&mut out);
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "the AVX2 trial is not its scalar definition"
    );

    let m = QMatrix::int4(&packed, &scale_bits, 32, rows, cols);
    let mut base = vec![0.0f32; rows * n];
    let macs = (rows * cols * n) as f64;
    println!("{rows}×{cols} against {n} activation rows, one thread, GMAC/s (best of ten batches), five rounds alternating:");
    race("int4-g32", &m, &rowsq, &mut base, macs, || trial(&mut out));

    // int8 weights, the same way.
    let q8: Vec<i8> = (0..rows * cols).map(|_| ((next() % 255) as i32 - 127) as i8).collect();
    let row_scales: Vec<f32> = (0..rows).map(|_| 0.001 + (next() % 1000) as f32 * 1e-5).collect();
    let want8: Vec<f32> = (0..rows * n).map(|i| dot8_scalar(&q8[(i / n) * cols..], row_scales[i / n], &a, i % n, cols)).collect();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as above.
    let trial8 = |out: &mut [f32]| unsafe { avx2::matmul8_t(&q8, &row_scales, rows, cols, &a, out) };
    #[cfg(not(target_arch = "x86_64"))]
    let trial8 = |_: &mut [f32]| {};
    trial8(&mut out);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&want8), "the AVX2 int8 trial is not its scalar definition");
    let m8 = QMatrix::int8(&q8, &row_scales, rows, cols);
    race("int8", &m8, &rowsq, &mut base, macs, || trial8(&mut out));
}

/// Five rounds of the kernels' own product (`macs` multiply-adds a call) (`qmatvec` for one activation row, what decode runs;
/// `qmatmul_t` otherwise) against `trial`, alternating.
fn race(label: &str, m: &QMatrix<'_>, rows: &[qdot::QRow<'_>], out: &mut [f32], macs: f64, mut trial: impl FnMut()) {
    for round in 0..5 {
        let t_base = if rows.len() == 1 {
            best_of_batches(macs, || qdot::qmatvec(m, &rows[0], 0, out))
        } else {
            best_of_batches(macs, || qdot::qmatmul_t(m, rows, 0, out))
        };
        let t_trial = best_of_batches(macs, &mut trial);
        println!(
            "{label} round {round}: kernels' order ({}) {:6.2}   trial order (avx2, 1 × 4) {:6.2}",
            qdot::int_isa().name(),
            macs / t_base / 1e9,
            macs / t_trial / 1e9
        );
    }
}
