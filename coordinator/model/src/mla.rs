//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) with the compressed latent KV cache.
//!
//! Per position and layer the cache holds only `kv_lora_rank` latent values (after
//! `kv_a_layernorm`) and the `qk_rope_head_dim` rotary key shared by all heads — 576 values for
//! DeepSeek-V3 instead of 128 heads × (192 + 128) for full keys and values. Attention runs in the
//! absorbed form for prefill and decode alike: each head's key up-projection W_UK is folded into
//! its query (q_lat = W_UKᵀ q_nope), scores are q_lat·c + q_rot·k_rot, and W_UV is applied to the
//! probability-weighted latent afterwards, so full keys and values are never materialised.
//!
//! With DeepSeek Sparse Attention (GLM-5) a lightning indexer picks, per query row, the `top_k`
//! earlier positions it may attend to (its keys cached in the layer's auxiliary slot); a
//! `shared` layer takes the choice the last full layer made for the same row.

use shimmer_common::spec::{IndexerSpec, MlaSpec, ModelSpec};
use shimmer_common::{Checkpoint, LoadError};
use shimmer_kernels::aligned::AlignedVec;
use shimmer_kernels::attention::{attend_latent_rows, attend_latent_selected};
use shimmer_kernels::{ops, Matrix};

use super::decoder::{linear, matrix, name, norm_rows, vector, Linear, SegmentRows};
use super::rope::Rope;

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` with the RMSNorm default, not the config's eps.
const LORA_NORM_EPS: f32 = 1e-6;
/// The indexer key's LayerNorm epsilon (fixed in transformers).
const INDEX_NORM_EPS: f32 = 1e-6;

/// A full layer's lightning indexer.
struct Indexer {
    shape: IndexerSpec,
    /// `heads·head_dim × q_lora_rank`, from the normalised low-rank query.
    wq_b: Matrix,
    /// `head_dim × hidden`.
    wk: Matrix,
    k_norm_weight: Vec<f32>,
    k_norm_bias: Vec<f32>,
    /// `heads × hidden`: each row's per-head weights.
    weights: Matrix,
}

/// Per row of a forward pass, the positions its attention sees (DSA), as the last full indexer
/// layer chose them.
pub(crate) type Selection = Option<Vec<Vec<usize>>>;

enum Query {
    Plain(Linear),
    LowRank { a: Linear, norm: Vec<f32>, b: Matrix },
}

pub struct Mla {
    dims: MlaSpec,
    heads: usize,
    q: Query,
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// kv_b_proj: per head, `qk_nope_head_dim` rows of W_UK then `v_head_dim` rows of W_UV.
    kv_b: Matrix,
    /// Per head, W_UKᵀ (`kv_lora_rank × qk_nope_head_dim`, f32) for absorbing into the query.
    uk_t: Vec<Matrix>,
    o: Linear,
    indexer: Option<Indexer>,
    /// Attention is sparse (a DSA model): this layer attends to the selection only.
    sparse: bool,
}

impl Mla {
    /// Weight bytes one token's pass reads (the absorbed W_UKᵀ copies included, kv_b's W_UV rows).
    pub fn bytes(&self) -> usize {
        let q = match &self.q {
            Query::Plain(l) => l.bytes(),
            Query::LowRank { a, b, .. } => a.bytes() + b.bytes(),
        };
        let indexer = self.indexer.as_ref().map_or(0, |ix| ix.wq_b.bytes() + ix.wk.bytes() + ix.weights.bytes());
        q + self.kv_a.bytes() + self.kv_b.bytes() + self.uk_t.iter().map(Matrix::bytes).sum::<usize>() + self.o.bytes() + indexer
    }

    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec, dims: &MlaSpec, l: usize) -> Result<Self, LoadError> {
        let (h, heads) = (spec.hidden_size, spec.num_heads);
        let bias = spec.attention.bias;
        let at = |t: &str| name(&format!("model.layers.{{L}}.self_attn.{t}"), l);
        let qk = dims.qk_head_dim();
        let q = match dims.q_lora_rank {
            None => Query::Plain(linear(ckpt, spec, &at("q_proj"), heads * qk, h, false)?),
            Some(r) => Query::LowRank {
                a: linear(ckpt, spec, &at("q_a_proj"), r, h, bias)?,
                norm: vector(ckpt, &at("q_a_layernorm.weight"), r)?,
                b: matrix(ckpt, spec, &at("q_b_proj.weight"), heads * qk, r)?,
            },
        };
        let (rank, nope, v) = (dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim);
        let kv_b = matrix(ckpt, spec, &at("kv_b_proj.weight"), heads * (nope + v), rank)?;
        let mut row = vec![0.0f32; rank];
        let uk_t = (0..heads)
            .map(|head| {
                let mut t = vec![0.0f32; rank * nope];
                for d in 0..nope {
                    kv_b.row_f32(head * (nope + v) + d, &mut row);
                    for (r, w) in row.iter().enumerate() {
                        t[r * nope + d] = *w;
                    }
                }
                Matrix::from_f32(rank, nope, t)
            })
            .collect();
        Ok(Mla {
            dims: dims.clone(),
            heads,
            q,
            kv_a: linear(ckpt, spec, &at("kv_a_proj_with_mqa"), rank + dims.qk_rope_head_dim, h, bias)?,
            kv_a_norm: vector(ckpt, &at("kv_a_layernorm.weight"), rank)?,
            kv_b,
            uk_t,
            o: linear(ckpt, spec, &at("o_proj"), h, heads * v, spec.attention.o_bias)?,
            indexer: match (&dims.indexer, dims.q_lora_rank) {
                (Some(ix), Some(r)) if ix.full[l] => Some(Indexer {
                    shape: ix.clone(),
                    wq_b: matrix(ckpt, spec, &at("indexer.wq_b.weight"), ix.heads * ix.head_dim, r)?,
                    wk: matrix(ckpt, spec, &at("indexer.wk.weight"), ix.head_dim, h)?,
                    k_norm_weight: vector(ckpt, &at("indexer.k_norm.weight"), ix.head_dim)?,
                    k_norm_bias: vector(ckpt, &at("indexer.k_norm.bias"), ix.head_dim)?,
                    weights: matrix(ckpt, spec, &at("indexer.weights_proj.weight"), ix.heads, h)?,
                }),
                (Some(_), None) => {
                    return Err(LoadError::Tensor {
                        path: ckpt.dir().to_path_buf(),
                        tensor: at("q_a_proj"),
                        problem: "a sparse-attention indexer needs q_lora_rank".into(),
                    })
                }
                _ => None,
            },
            sparse: dims.indexer.is_some(),
        })
    }

    /// Attention of every segment's rows (projections over all rows at once; rotary positions,
    /// cache and attention per segment), appending their latents to each segment's cache.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        spec: &ModelSpec,
        rope: &Rope,
        l: usize,
        x: &[f32],
        segments: &mut [SegmentRows<'_>],
        selection: &mut Selection,
        out: &mut [f32],
    ) {
        let d = &self.dims;
        let (rank, nope, rot, vd) = (d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim);
        let qk = nope + rot;
        let n = x.len() / spec.hidden_size;
        let mut q = vec![0.0f32; n * self.heads * qk];
        let mut q_resid = Vec::new();
        match &self.q {
            Query::Plain(p) => p.forward(x, &mut q),
            Query::LowRank { a, norm, b } => {
                let mut qa = vec![0.0f32; n * a.weight.rows];
                a.forward(x, &mut qa);
                let mut normed = vec![0.0f32; qa.len()];
                norm_rows(&qa, norm, LORA_NORM_EPS, &mut normed);
                b.matmul(&normed, &mut q);
                q_resid = normed;
            }
        }
        if let Some(ix) = &self.indexer {
            *selection = Some(self.select(ix, spec, rope, l, x, &q_resid, segments));
        }
        let mut ckv = vec![0.0f32; n * (rank + rot)];
        self.kv_a.forward(x, &mut ckv);
        let (mut latents, mut rots) = (vec![0.0f32; n * rank], vec![0.0f32; n * rot]);
        let (mut cos, mut sin) = (vec![0.0f32; rot / 2], vec![0.0f32; rot / 2]);
        let rotate = |v: &mut [f32], cos: &[f32], sin: &[f32]| {
            if spec.attention.no_rope {
                // No positional encoding (Kimi Linear): the "rotary" dims stay as projected.
            } else if spec.attention.rope_interleave {
                ops::rope_interleaved(v, cos, sin)
            } else {
                ops::rope_rotate_half(v, cos, sin)
            }
        };
        for seg in segments.iter() {
            for i in seg.rows.clone() {
                let row = &ckv[i * (rank + rot)..(i + 1) * (rank + rot)];
                ops::rms_norm(&row[..rank], &self.kv_a_norm, LORA_NORM_EPS, &mut latents[i * rank..(i + 1) * rank]);
                rots[i * rot..(i + 1) * rot].copy_from_slice(&row[rank..]);
                rope.cos_sin(seg.start + i - seg.rows.start, &mut cos, &mut sin);
                rotate(&mut rots[i * rot..(i + 1) * rot], &cos, &sin);
                for head in q[i * self.heads * qk..(i + 1) * self.heads * qk].chunks_exact_mut(qk) {
                    rotate(&mut head[nope..], &cos, &sin);
                }
            }
        }

        // Every (row, head) query in the latent space, then all of them through the latent cache
        // together (the heads share it), then each head's W_UV.
        let vectors = n * self.heads;
        // On 64-byte boundaries: attention loads each query once per key.
        let (mut q_lat, mut q_rot) = (AlignedVec::new(), AlignedVec::new());
        q_lat.resize(vectors * rank, 0.0f32);
        q_rot.resize(vectors * rot, 0.0f32);
        for v in 0..vectors {
            let qh = &q[v * qk..(v + 1) * qk];
            self.uk_t[v % self.heads].matvec(&qh[..nope], &mut q_lat[v * rank..(v + 1) * rank]);
            q_rot[v * rot..(v + 1) * rot].copy_from_slice(&qh[nope..]);
        }
        let mut o_lat = vec![0.0f32; vectors * rank];
        for seg in segments.iter_mut() {
            let (r, hs) = (seg.rows.clone(), self.heads);
            seg.cache.append(l, &latents[r.start * rank..r.end * rank], &rots[r.start * rot..r.end * rot]);
            let (lat, rts) = seg.cache.layer(l, 0..seg.start + r.len());
            let (v0, v1) = (r.start * hs, r.end * hs);
            match selection.as_ref().filter(|_| self.sparse) {
                Some(chosen) => attend_latent_selected(
                    &q_lat[v0 * rank..v1 * rank],
                    &q_rot[v0 * rot..v1 * rot],
                    (rank, rot),
                    hs,
                    &chosen[r.clone()],
                    lat,
                    rts,
                    spec.attention.scale,
                    &mut o_lat[v0 * rank..v1 * rank],
                ),
                None => attend_latent_rows(
                    &q_lat[v0 * rank..v1 * rank],
                    &q_rot[v0 * rot..v1 * rot],
                    (rank, rot),
                    hs,
                    seg.start,
                    lat,
                    rts,
                    spec.attention.scale,
                    &mut o_lat[v0 * rank..v1 * rank],
                ),
            }
        }
        let mut attn = vec![0.0f32; vectors * vd];
        for v in 0..vectors {
            let first = (v % self.heads) * (nope + vd) + nope;
            self.kv_b.matvec_rows(first..first + vd, &o_lat[v * rank..(v + 1) * rank], &mut attn[v * vd..(v + 1) * vd]);
        }
        self.o.forward(&attn, out);
    }

    /// The indexer's choice for every row: its keys appended to each segment's cache, then per
    /// row the `top_k` earlier positions by index score (the higher score first, the lower
    /// position on a tie), ascending; every position when there are no more than `top_k`.
    #[allow(clippy::too_many_arguments)]
    fn select(&self, ix: &Indexer, spec: &ModelSpec, rope: &Rope, l: usize, x: &[f32], q_resid: &[f32], segments: &mut [SegmentRows<'_>]) -> Vec<Vec<usize>> {
        let IndexerSpec { heads, head_dim: d, top_k, .. } = ix.shape;
        let rot = self.dims.qk_rope_head_dim;
        let n = x.len() / spec.hidden_size;
        let mut q = vec![0.0f32; n * heads * d];
        ix.wq_b.matmul(q_resid, &mut q);
        let mut k = vec![0.0f32; n * d];
        ix.wk.matmul(x, &mut k);
        let mut w = vec![0.0f32; n * heads];
        ix.weights.matmul(x, &mut w);
        let head_weight = (heads as f32).powf(-0.5);
        w.iter_mut().for_each(|v| *v *= head_weight);
        let scale = (d as f32).powf(-0.5);
        let (mut cos, mut sin) = (vec![0.0f32; rot / 2], vec![0.0f32; rot / 2]);
        let mut chosen = vec![Vec::new(); n];
        let mut scores = Vec::new();
        for seg in segments.iter_mut() {
            for i in seg.rows.clone() {
                layer_norm(&mut k[i * d..(i + 1) * d], &ix.k_norm_weight, &ix.k_norm_bias);
                rope.cos_sin(seg.start + i - seg.rows.start, &mut cos, &mut sin);
                ops::rope_interleaved(&mut k[i * d..i * d + rot], &cos, &sin);
                for head in q[i * heads * d..(i + 1) * heads * d].chunks_exact_mut(d) {
                    ops::rope_interleaved(&mut head[..rot], &cos, &sin);
                }
            }
            let r = seg.rows.clone();
            seg.cache.append_aux(l, &k[r.start * d..r.end * d]);
            let keys = seg.cache.aux(l, 0..seg.start + r.len());
            for i in r.clone() {
                let pos = seg.start + i - r.start;
                scores.clear();
                for key in keys[..(pos + 1) * d].chunks_exact(d) {
                    let mut total = 0.0f32;
                    for (qh, wh) in q[i * heads * d..(i + 1) * heads * d].chunks_exact(d).zip(&w[i * heads..(i + 1) * heads]) {
                        let dot: f32 = qh.iter().zip(key).map(|(a, b)| a * b).sum();
                        total += wh * (dot * scale).max(0.0);
                    }
                    scores.push(total);
                }
                chosen[i] = top_positions(&scores, top_k);
            }
        }
        chosen
    }
}

/// The positions of the `top_k` highest scores — the earlier position first on an exact tie —
/// in ascending order; every position when there are no more than `top_k`.
fn top_positions(scores: &[f32], top_k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    if order.len() > top_k {
        order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
        order.truncate(top_k);
        order.sort_unstable();
    }
    order
}

/// `x = (x − mean) / √(var + ε) · w + b` (torch's LayerNorm, population variance).
fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + INDEX_NORM_EPS).sqrt();
    for ((v, w), b) in x.iter_mut().zip(weight).zip(bias) {
        *v = (*v - mean) * inv * w + b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_indexer_keeps_the_best_scores_and_breaks_ties_toward_the_earlier_position() {
        // Two keys tie at 0.0 (relu zeroed both): the earlier one wins the last place.
        let scores = [0.5, 0.0, 2.0, 0.0, -1.0, 1.5];
        assert_eq!(top_positions(&scores, 3), [0, 2, 5]);
        assert_eq!(top_positions(&scores, 4), [0, 1, 2, 5]);
        // No more positions than top_k: all of them, in order.
        assert_eq!(top_positions(&scores[..3], 3), [0, 1, 2]);
        assert_eq!(top_positions(&scores[..2], 6), [0, 1]);
    }

    #[test]
    fn layer_norm_centres_scales_and_shifts() {
        let mut x = [1.0f32, 2.0, 3.0, 6.0];
        layer_norm(&mut x, &[1.0, 2.0, 1.0, 1.0], &[0.0, 0.0, 0.5, 0.0]);
        let (mean, var): (f64, f64) = (3.0, (4.0 + 1.0 + 0.0 + 9.0) / 4.0);
        let want = |v: f64, w: f64, b: f64| (v - mean) / (var + 1e-6).sqrt() * w + b;
        for (got, want) in x.iter().zip([want(1.0, 1.0, 0.0), want(2.0, 2.0, 0.0), want(3.0, 1.0, 0.5), want(6.0, 1.0, 0.0)]) {
            assert!((*got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        }
    }
}
