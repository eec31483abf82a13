//! Micro-benchmark of decode attention: one query row (all heads) over `positions` cached keys,
//! one thread, µs a call and GB/s of keys and values read. A measuring tool, not a test.
//!
//!     cargo run --release -p shimmer-kernels --example attention_speed [heads] [kv_heads] [head_dim] [positions] [caches]
//!
//! With `caches` > 1 the calls cycle over that many separate caches, as a batch's sequences and
//! layers do (16 sequences × 6 layers of the demo model: 96), so they are read from wherever
//! that many caches fit rather than from L1.
//!     cargo run --release -p shimmer-kernels --example attention_speed mla [heads] [rank] [rope] [positions]
use std::time::Instant;

use shimmer_kernels::attention::{attend_latent_rows, attend_rows, AttentionShape};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if std::env::args().nth(1).as_deref() == Some("mla") {
        return mla(&args);
    }
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (heads, kv, d, positions, caches) = (arg(0, 16), arg(1, 4), arg(2, 64), arg(3, 512), arg(4, 1).max(1));
    let value = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
    let q: Vec<f32> = (0..heads * d).map(value).collect();
    let keys: Vec<Vec<f32>> = (0..caches).map(|c| (0..positions * kv * d).map(|i| value(i + 11 + c)).collect()).collect();
    let values: Vec<Vec<f32>> = (0..caches).map(|c| (0..positions * kv * d).map(|i| value(i + 997 + c)).collect()).collect();
    let shape = AttentionShape { num_heads: heads, num_kv_heads: kv, head_dim: d, scale: 1.0 / (d as f32).sqrt() };
    let mut out = vec![0.0f32; heads * d];
    let reps = (2_000_000_000 / (positions * heads * d)).max(20);
    attend_rows(&shape, &q, positions - 1, &keys[0], &values[0], None, None, &mut out);
    let t = Instant::now();
    for r in 0..reps {
        attend_rows(&shape, &q, positions - 1, &keys[r % caches], &values[r % caches], None, None, &mut out);
    }
    let dt = t.elapsed().as_secs_f64() / reps as f64;
    let bytes = 2.0 * (positions * kv * d * 4) as f64;
    println!(
        "{heads} heads / {kv} kv heads × {d}, {positions} positions, {caches} caches: {:.2} µs a call, {:.1} ns a position, {:.2} GB/s of keys and values",
        dt * 1e6,
        dt * 1e9 / positions as f64,
        bytes / dt / 1e9
    );
}

/// Absorbed MLA decode: one row's heads over `positions` latents (DeepSeek-V3: 128 heads, rank
/// 512, rope 64).
fn mla(args: &[usize]) {
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (heads, rank, rope, positions) = (arg(0, 128), arg(1, 512), arg(2, 64), arg(3, 512));
    let value = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
    let q_lat: Vec<f32> = (0..heads * rank).map(value).collect();
    let q_rot: Vec<f32> = (0..heads * rope).map(|i| value(i + 3)).collect();
    let lat: Vec<f32> = (0..positions * rank).map(|i| value(i + 11)).collect();
    let rot: Vec<f32> = (0..positions * rope).map(|i| value(i + 997)).collect();
    let mut out = vec![0.0f32; heads * rank];
    let reps = (2_000_000_000 / (positions * heads * (rank + rope))).max(5);
    attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, positions - 1, &lat, &rot, 0.05, &mut out);
    let t = Instant::now();
    for _ in 0..reps {
        attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, positions - 1, &lat, &rot, 0.05, &mut out);
    }
    let dt = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "MLA {heads} heads, rank {rank} + rope {rope}, {positions} positions: {:.1} µs a call, {:.1} ns a position",
        dt * 1e6,
        dt * 1e9 / positions as f64
    );
}
