//! What 2 MiB pages would be worth to resident experts: a decode-like walk (per layer, `top_k`
//! random experts of `experts`, each its gate/up pair then its down product, int4-g32, one
//! thread) over one buffer holding every expert's weights on 4 KiB pages, and over a copy moved
//! into huge pages (`huge_pages.rs`). Rounds alternate; each prints expert-weight GB/s.
//!
//!     cargo run --release -p shimmer-kernels --example expert_pages -- [hidden inter layers experts top_k]
//!
//! (Today each resident expert's matrices are separate ~300 KB allocations, which no huge page
//! can hold; this measures the walk as a slab per layer would give it.)

use shimmer_kernels::huge_pages::prefer_huge_pages;
use shimmer_kernels::qdot::{self, QMatrix, QuantRows};

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).filter_map(|v| v.parse().ok()).collect();
    let arg = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let (hidden, inter, layers, experts, top_k) = (arg(0, 1024), arg(1, 512), arg(2, 16), arg(3, 64), arg(4, 8));
    let group = 32;
    // Per matrix: packed nibbles, then (apart) f16 scales; gate, up (inter × hidden), down (hidden × inter).
    let packed_of = |rows: usize, cols: usize| rows * cols.div_ceil(2);
    let scales_of = |rows: usize, cols: usize| rows * cols.div_ceil(group);
    let per_expert = 2 * packed_of(inter, hidden) + packed_of(hidden, inter);
    let n = layers * experts;
    let mut s = 7u64;
    let mut byte = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 56) as u8
    };
    let packed: Vec<u8> = (0..n * per_expert).map(|_| byte()).collect();
    let scale_words = 2 * scales_of(inter, hidden) + scales_of(hidden, inter);
    let scales: Vec<u16> = (0..n * scale_words).map(|i| 0x2000 + (i % 512) as u16).collect();
    let x: Vec<f32> = (0..hidden).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
    let mut qx = QuantRows::default();
    qx.quantize_for(&x, hidden, true);
    let h: Vec<f32> = (0..inter).map(|i| ((i * 13) % 97) as f32 / 48.0 - 1.0).collect();
    let mut qh = QuantRows::default();
    qh.quantize_for(&h, inter, true);
    let (mut g, mut u, mut y) = (vec![0.0f32; inter], vec![0.0f32; inter], vec![0.0f32; hidden]);
    println!("{layers} layers × {experts} experts ({:.1} MB of weights), top {top_k}, one thread", (packed.len() + 2 * scales.len()) as f64 / 1e6);
    let mut walk = |packed: &[u8], scales: &[u16], seed: u64| -> f64 {
        let mut r = seed;
        let tokens = 64;
        let t = std::time::Instant::now();
        for _ in 0..tokens {
            for l in 0..layers {
                for _ in 0..top_k {
                    r = r.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let e = l * experts + (r >> 33) as usize % experts;
                    let (p, sc) = (&packed[e * per_expert..(e + 1) * per_expert], &scales[e * scale_words..(e + 1) * scale_words]);
                    let (gp, rest) = p.split_at(packed_of(inter, hidden));
                    let (up, dp) = rest.split_at(packed_of(inter, hidden));
                    let (gs, rest) = sc.split_at(scales_of(inter, hidden));
                    let (us, ds) = rest.split_at(scales_of(inter, hidden));
                    let (gate, upm) = (QMatrix::int4(gp, gs, group, inter, hidden), QMatrix::int4(up, us, group, inter, hidden));
                    qdot::qmatvec_pair(&gate, &upm, &qx.row(0), 0, &mut g, &mut u);
                    qdot::qmatvec(&QMatrix::int4(dp, ds, group, hidden, inter), &qh.row(0), 0, &mut y);
                }
            }
        }
        let bytes = (tokens * layers * top_k * (per_expert + 2 * scale_words)) as f64;
        bytes / t.elapsed().as_secs_f64() / 1e9
    };
    // The same weights twice, the second copy moved into huge pages; the walks alternate.
    let (packed2, scales2) = (packed.clone(), scales.clone());
    let moved = prefer_huge_pages(&packed2) & prefer_huge_pages(&scales2);
    let (mut small, mut huge) = (Vec::new(), Vec::new());
    for round in 0..5 {
        small.push(walk(&packed, &scales, round));
        huge.push(walk(&packed2, &scales2, round));
    }
    println!("4 KiB pages: {}", small.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(" / "));
    println!("2 MiB pages: {} GB/s (moved: {moved})", huge.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(" / "));
    std::hint::black_box((&g, &u, &y));
}
