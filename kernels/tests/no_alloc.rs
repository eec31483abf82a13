//! The decode path of the kernels allocates nothing: one token's matrix-vector products (every
//! format), its paired gate/up product and its attention over the KV cache run with the heap
//! untouched. A counting global allocator proves it (this test binary only).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
use shimmer_kernels::attention::{attend_latent_rows, attend_rows, AttentionShape};
use shimmer_kernels::matrix::matmul_pair;
use shimmer_kernels::Matrix;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_during(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    f();
    ALLOCATIONS.load(Ordering::SeqCst) - before
}

#[test]
fn one_tokens_kernels_allocate_nothing() {
    let (rows, cols) = (96, 200);
    let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let mats = [
        Matrix::from_f32(rows, cols, w.clone()),
        Matrix::from_quant(quantize_int8(&w, rows, cols)),
        Matrix::from_quant(quantize_int4(&w, rows, cols, 32)),
        Matrix::from_quant(quantize_mxfp4(&w, rows, cols)),
        Matrix::from_fp8_blocks(rows, cols, (0..rows * cols).map(|i| (i % 120) as u8).collect(), vec![0.01; rows.div_ceil(128) * cols.div_ceil(128)], 128)
            .unwrap(),
    ];
    let (mut out, mut out2) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    // The shape of a GQA layer with 300 cached positions, and of an MLA layer's latent cache.
    let shape = AttentionShape { num_heads: 8, num_kv_heads: 2, head_dim: 64, scale: 0.125 };
    let n = 300;
    let keys: Vec<f32> = (0..n * 128).map(|i| ((i * 31) % 97) as f32 / 97.0).collect();
    let values: Vec<f32> = (0..n * 128).map(|i| ((i * 17) % 89) as f32 / 89.0).collect();
    let q: Vec<f32> = (0..512).map(|i| (i % 11) as f32 / 11.0).collect();
    let mut attn = vec![0.0f32; 512];
    let (rank, rope, heads) = (64, 16, 4);
    let (q_lat, q_rot) = (vec![0.1f32; heads * rank], vec![0.2f32; heads * rope]);
    let (lat, rot) = (vec![0.3f32; n * rank], vec![0.4f32; n * rope]);
    let mut o_lat = vec![0.0f32; heads * rank];
    // Warm up once (thread pools, lazily initialised state), then count.
    let run = |out: &mut [f32], out2: &mut [f32], attn: &mut [f32], o_lat: &mut [f32]| {
        for m in &mats {
            m.matvec_on(&x, out, false);
            matmul_pair(m, m, &x, out, out2, false);
        }
        attend_rows(&shape, &q, n - 1, &keys, &values, None, None, attn);
        attend_rows(&shape, &q, n - 1, &keys, &values, Some(128), None, attn);
        attend_latent_rows(&q_lat, &q_rot, (rank, rope), heads, n - 1, &lat, &rot, 0.1, o_lat);
    };
    run(&mut out, &mut out2, &mut attn, &mut o_lat);
    let count = allocations_during(|| run(&mut out, &mut out2, &mut attn, &mut o_lat));
    assert_eq!(count, 0, "the decode kernels allocated {count} times");
    // The counter sees allocations (the test can fail).
    assert!(allocations_during(|| drop(std::hint::black_box(vec![1u8; 10]))) > 0);
}
