//! Causal attention of query rows over a contiguous range of cached keys/values, with grouped
//! query heads (GQA: query head h reads kv head h / (heads / kv_heads)).

use crate::ops::softmax_in_place;

pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// `out` (heads × head_dim) = softmax(q·Kᵀ·scale)·V over the positions in `keys`/`values`
/// (each position holds kv_heads × head_dim values). `scores` needs one slot per position.
pub fn attend(shape: &AttentionShape, q: &[f32], keys: &[f32], values: &[f32], scores: &mut [f32], out: &mut [f32]) {
    let d = shape.head_dim;
    let stride = shape.num_kv_heads * d;
    let n = keys.len() / stride;
    let group = shape.num_heads / shape.num_kv_heads;
    for h in 0..shape.num_heads {
        let kvh = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let s = &mut scores[..n];
        for (j, slot) in s.iter_mut().enumerate() {
            let k = &keys[j * stride + kvh * d..j * stride + (kvh + 1) * d];
            *slot = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * shape.scale;
        }
        softmax_in_place(s);
        let o = &mut out[h * d..(h + 1) * d];
        o.iter_mut().for_each(|v| *v = 0.0);
        for (j, p) in s.iter().enumerate() {
            let v = &values[j * stride + kvh * d..j * stride + (kvh + 1) * d];
            for (oi, vi) in o.iter_mut().zip(v) {
                *oi += p * vi;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    #[test]
    fn gqa_attention_matches_reference() {
        let shape = AttentionShape { num_heads: 6, num_kv_heads: 2, head_dim: 5, scale: 0.4 };
        let n = 9;
        let f = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 250.0 - 2.0;
        let q: Vec<f32> = (0..30).map(f).collect();
        let keys: Vec<f32> = (0..n * 10).map(|i| f(i + 77)).collect();
        let values: Vec<f32> = (0..n * 10).map(|i| f(i + 991)).collect();
        let mut out = vec![0.0; 30];
        attend(&shape, &q, &keys, &values, &mut vec![0.0; n], &mut out);
        for h in 0..6 {
            let kvh = h / 3;
            let ks: Vec<&[f32]> = (0..n).map(|j| &keys[j * 10 + kvh * 5..j * 10 + kvh * 5 + 5]).collect();
            let vs: Vec<&[f32]> = (0..n).map(|j| &values[j * 10 + kvh * 5..j * 10 + kvh * 5 + 5]).collect();
            let want = reference::attend_head(&q[h * 5..h * 5 + 5], &ks, &vs, 0.4);
            for (a, b) in out[h * 5..h * 5 + 5].iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "head {h}: {a} vs {b}");
            }
        }
    }
}
