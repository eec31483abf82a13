//! Plain scalar references, written for obviousness (f64 accumulation, no tricks). Tests hold the
//! fast kernels to these.

pub fn matvec(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum::<f64>() as f32).collect()
}

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(weight).map(|(v, w)| (*v as f64 * inv) as f32 * w).collect()
}

pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = x.iter().map(|v| (*v as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| (v / s) as f32).collect()
}

pub fn silu(x: f32) -> f32 {
    (x as f64 / (1.0 + (-(x as f64)).exp())) as f32
}

/// Attention of one query head over `n` keys and values of one kv head.
pub fn attend_head(q: &[f32], keys: &[&[f32]], values: &[&[f32]], scale: f32) -> Vec<f32> {
    let scores: Vec<f32> = keys.iter().map(|k| (q.iter().zip(k.iter()).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64) as f32).collect();
    let p = softmax(&scores);
    let d = values.first().map_or(0, |v| v.len());
    (0..d).map(|i| p.iter().zip(values).map(|(w, v)| *w as f64 * v[i] as f64).sum::<f64>() as f32).collect()
}
