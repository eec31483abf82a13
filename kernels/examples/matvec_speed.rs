//! Micro-benchmark of one matrix-vector product per format, single-threaded and with the rayon
//! pool: GB/s of weights streamed. A measuring tool, not a test.
//!
//!     cargo run --release -p shimmer-kernels --example matvec_speed [rows] [cols]
#[path = "common/timing.rs"]
mod timing;

use timing::best_of_batches;

use shimmer_common::quant::{quantize_int4, quantize_int6, quantize_int8, quantize_mxfp4};
use shimmer_kernels::{Activations, Matrix, WeightData};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (rows, cols) = (args.first().copied().unwrap_or(8192), args.get(1).copied().unwrap_or(4096));
    let mut s = 1u64;
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
    let formats = [
        ("bf16", Matrix::new(rows, cols, WeightData::Bf16(w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect()))),
        ("int8", Matrix::from_quant(quantize_int8(&w, rows, cols))),
        ("int8/f32a", Matrix::from_quant(quantize_int8(&w, rows, cols)).with_activations(Activations::F32)),
        ("int4-g32", Matrix::from_quant(quantize_int4(&w, rows, cols, 32))),
        ("int4-g128", Matrix::from_quant(quantize_int4(&w, rows, cols, 128))),
        ("int4/f32a", Matrix::from_quant(quantize_int4(&w, rows, cols, 32)).with_activations(Activations::F32)),
        ("int6-g32", Matrix::from_int6(quantize_int6(&w, rows, cols, 32))),
        ("mxfp4", Matrix::from_quant(quantize_mxfp4(&w, rows, cols))),
        ("mxfp4/f32a", Matrix::from_quant(quantize_mxfp4(&w, rows, cols)).with_activations(Activations::F32)),
        ("fp8-b128", fp8(&w, rows, cols)),
    ];
    println!(
        "{rows}×{cols}, kernels: {} (f32 activations), {} (int8 activations; `/f32a`: the same weights on f32 activations)",
        shimmer_kernels::dot::isa().name(),
        shimmer_kernels::qdot::int_isa().name()
    );
    // `MATVEC_ONLY=int4-g32` (say) times one format only, for a profiler.
    let only = std::env::var("MATVEC_ONLY").ok();
    // `HUGE_PAGES=1`: the weights moved into 2 MiB pages first, as a loaded model's large ones are.
    if std::env::var("HUGE_PAGES").is_ok_and(|v| v == "1") {
        formats.iter().for_each(|(_, m)| m.prefer_huge_pages());
    }
    for (name, m) in formats.iter().filter(|(name, _)| only.as_deref().is_none_or(|o| o == *name)) {
        let mut out = vec![0.0f32; rows];
        for parallel in [false, true] {
            let dt = best_of_batches((rows * cols) as f64, || m.matvec_on(&x, &mut out, parallel));
            println!("{name:10} {:8} {:7.2} ms  {:6.2} GB/s", if parallel { "pool" } else { "1 thread" }, dt * 1e3, m.bytes() as f64 / dt / 1e9);
        }
        // Prefill-like: 16 activation rows per product, one thread; multiply-adds per second.
        // `MATMUL_ROWS=4` (say) for another batch; the activations' footprint grows with it.
        let n = std::env::var("MATMUL_ROWS").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(16);
        let xs: Vec<f32> = (0..n * cols).map(|i| (i % 7) as f32 * 0.1).collect();
        let (mut outs, mut outs2) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
        let macs = (rows * cols * n) as f64;
        let dt = best_of_batches(macs, || m.matmul_on(&xs, &mut outs, false));
        println!("{name:10} matmul×{n} 1 thread {:7.2} ms  {:6.2} GMAC/s", dt * 1e3, macs / dt / 1e9);
        // The experts' gate and up projections: two matrices against the same rows.
        let dt = best_of_batches(2.0 * macs, || shimmer_kernels::matrix::matmul_pair(m, m, &xs, &mut outs, &mut outs2, false));
        println!("{name:10} pair×{n} 1 thread   {:7.2} ms  {:6.2} GMAC/s", dt * 1e3, 2.0 * macs / dt / 1e9);
    }
}

/// `w` as block-scaled fp8 (128×128 blocks, each scaled so its largest value is 448).
fn fp8(w: &[f32], rows: usize, cols: usize) -> Matrix {
    let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
    let mut scales = vec![0.0f32; br * bc];
    for (i, v) in w.iter().enumerate() {
        let s = &mut scales[(i / cols / 128) * bc + (i % cols) / 128];
        *s = s.max(v.abs() / 448.0);
    }
    // Nearest fp8 code by search: a benchmark fixture, not a quantiser.
    let table: Vec<(f32, u8)> = (0u8..=255).filter(|b| b & 0x7f != 0x7f).map(|b| (shimmer_common::quant::fp8_e4m3_to_f32(b), b)).collect();
    let q = w
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let s = scales[(i / cols / 128) * bc + (i % cols) / 128];
            let t = if s > 0.0 { v / s } else { 0.0 };
            table.iter().min_by(|a, b| (a.0 - t).abs().total_cmp(&(b.0 - t).abs())).map_or(0, |x| x.1)
        })
        .collect();
    Matrix::from_fp8_blocks(rows, cols, q, scales, 128).expect("valid fp8 fixture")
}
