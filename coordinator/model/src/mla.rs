//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) with the compressed latent KV cache.
//!
//! Per position and layer the cache holds only `kv_lora_rank` latent values (after
//! `kv_a_layernorm`) and the `qk_rope_head_dim` rotary key shared by all heads — 576 values for
//! DeepSeek-V3 instead of 128 heads × (192 + 128) for full keys and values. Attention runs in the
//! absorbed form for prefill and decode alike: each head's key up-projection W_UK is folded into
//! its query (q_lat = W_UKᵀ q_nope), scores are q_lat·c + q_rot·k_rot, and W_UV is applied to the
//! probability-weighted latent afterwards, so full keys and values are never materialised.

use shimmer_common::spec::{MlaSpec, ModelSpec};
use shimmer_common::{Checkpoint, LoadError};
use shimmer_kernels::attention::attend_latent_rows;
use shimmer_kernels::{ops, Matrix};

use super::decoder::{linear, matrix, name, norm_rows, vector, Linear, SegmentRows};
use super::rope::Rope;

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` with the RMSNorm default, not the config's eps.
const LORA_NORM_EPS: f32 = 1e-6;

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
}

impl Mla {
    /// Weight bytes one token's pass reads (the absorbed W_UKᵀ copies included, kv_b's W_UV rows).
    pub fn bytes(&self) -> usize {
        let q = match &self.q {
            Query::Plain(l) => l.bytes(),
            Query::LowRank { a, b, .. } => a.bytes() + b.bytes(),
        };
        q + self.kv_a.bytes() + self.kv_b.bytes() + self.uk_t.iter().map(Matrix::bytes).sum::<usize>() + self.o.bytes()
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
        })
    }

    /// Attention of every segment's rows (projections over all rows at once; rotary positions,
    /// cache and attention per segment), appending their latents to each segment's cache.
    pub(crate) fn forward(&self, spec: &ModelSpec, rope: &Rope, l: usize, x: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let d = &self.dims;
        let (rank, nope, rot, vd) = (d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim);
        let qk = nope + rot;
        let n = x.len() / spec.hidden_size;
        let mut q = vec![0.0f32; n * self.heads * qk];
        match &self.q {
            Query::Plain(p) => p.forward(x, &mut q),
            Query::LowRank { a, norm, b } => {
                let mut qa = vec![0.0f32; n * a.weight.rows];
                a.forward(x, &mut qa);
                let mut normed = vec![0.0f32; qa.len()];
                norm_rows(&qa, norm, LORA_NORM_EPS, &mut normed);
                b.matmul(&normed, &mut q);
            }
        }
        let mut ckv = vec![0.0f32; n * (rank + rot)];
        self.kv_a.forward(x, &mut ckv);
        let (mut latents, mut rots) = (vec![0.0f32; n * rank], vec![0.0f32; n * rot]);
        let (mut cos, mut sin) = (vec![0.0f32; rot / 2], vec![0.0f32; rot / 2]);
        let rotate = |v: &mut [f32], cos: &[f32], sin: &[f32]| {
            if spec.attention.rope_interleave {
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
        let (mut q_lat, mut q_rot) = (vec![0.0f32; vectors * rank], vec![0.0f32; vectors * rot]);
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
            attend_latent_rows(
                &q_lat[v0 * rank..v1 * rank],
                &q_rot[v0 * rot..v1 * rot],
                (rank, rot),
                hs,
                seg.start,
                lat,
                rts,
                spec.attention.scale,
                &mut o_lat[v0 * rank..v1 * rank],
            );
        }
        let mut attn = vec![0.0f32; vectors * vd];
        for v in 0..vectors {
            let first = (v % self.heads) * (nope + vd) + nope;
            self.kv_b.matvec_rows(first..first + vd, &o_lat[v * rank..(v + 1) * rank], &mut attn[v * vd..(v + 1) * vd]);
        }
        self.o.forward(&attn, out);
    }
}
