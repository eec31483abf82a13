//! Timing shared by the kernels' measuring examples.

use std::time::Instant;

/// Seconds per call of `f`: the best of ten batches of about 0.1 G multiply-adds each, so a
/// neighbour's burst on a shared machine costs a batch, not the figure.
pub fn best_of_batches(macs_per_call: f64, mut f: impl FnMut()) -> f64 {
    f();
    let reps = (1e8 / macs_per_call).ceil().max(2.0) as usize;
    (0..10)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .fold(f64::INFINITY, f64::min)
}
