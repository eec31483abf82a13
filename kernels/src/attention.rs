//! Causal attention of query rows over a contiguous range of cached keys/values, with grouped
//! query heads (GQA: query head h reads kv head h / (heads / kv_heads)).

use crate::dot::{dot, WeightRow};
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
            // The canonical dot (`dot.rs`): vectorised, and the same bits on every ISA.
            *slot = dot(&WeightRow::F32(k), qh) * shape.scale;
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

/// Absorbed multi-head latent attention for one head: scores are `q_lat·c_j + q_rot·r_j` over
/// each position's latent `c_j` (`latents`, n × rank) and rotary key `r_j` (`rots`, n × rope),
/// scaled; the result is the probability-weighted sum of latents (`out`, rank long), which the
/// caller maps to the head's value with W_UV. Full keys and values are never formed.
pub fn attend_latent(q_lat: &[f32], q_rot: &[f32], latents: &[f32], rots: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let (rank, rope) = (q_lat.len(), q_rot.len());
    let n = latents.len() / rank;
    let s = &mut scores[..n];
    for (j, slot) in s.iter_mut().enumerate() {
        let c = &latents[j * rank..(j + 1) * rank];
        let r = &rots[j * rope..(j + 1) * rope];
        *slot = (dot(&WeightRow::F32(c), q_lat) + dot(&WeightRow::F32(r), q_rot)) * scale;
    }
    softmax_in_place(s);
    out.iter_mut().for_each(|v| *v = 0.0);
    for (j, p) in s.iter().enumerate() {
        for (o, c) in out.iter_mut().zip(&latents[j * rank..(j + 1) * rank]) {
            *o += p * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    #[test]
    fn latent_attention_equals_attention_over_concatenated_keys() {
        // q = [q_lat | q_rot], k_j = [c_j | r_j], v_j = c_j: the absorbed form is plain attention.
        let f = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 250.0 - 2.0;
        let (rank, rope, n) = (6, 4, 7);
        let q_lat: Vec<f32> = (0..rank).map(f).collect();
        let q_rot: Vec<f32> = (0..rope).map(|i| f(i + 50)).collect();
        let lat: Vec<f32> = (0..n * rank).map(|i| f(i + 100)).collect();
        let rot: Vec<f32> = (0..n * rope).map(|i| f(i + 500)).collect();
        let mut out = vec![0.0; rank];
        attend_latent(&q_lat, &q_rot, &lat, &rot, 0.3, &mut vec![0.0; n], &mut out);
        let q: Vec<f32> = q_lat.iter().chain(&q_rot).copied().collect();
        let keys: Vec<Vec<f32>> = (0..n).map(|j| lat[j * rank..(j + 1) * rank].iter().chain(&rot[j * rope..(j + 1) * rope]).copied().collect()).collect();
        let ks: Vec<&[f32]> = keys.iter().map(|k| k.as_slice()).collect();
        let vs: Vec<&[f32]> = (0..n).map(|j| &lat[j * rank..(j + 1) * rank]).collect();
        let want = reference::attend_head(&q, &ks, &vs, 0.3);
        for (a, b) in out.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

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
