//! Gated DeltaNet, the linear-attention mixer of Qwen3-Next and Qwen3.5, and Kimi Delta
//! Attention, Kimi Linear's (`Mixer::GatedDeltaNet`): per value head a `key_dim × value_dim`
//! state `S`, which each token decays by `exp(g)` — one factor per head (Qwen), one per key
//! channel (Kimi) — and corrects by the delta rule (`S += k ⊗ β(v − Sᵀk)`) before the query
//! reads it (`o = Sᵀq`); queries, keys and values pass first through a depthwise causal
//! convolution and SiLU, and the output through an RMSNorm gated by `silu(z)` (Qwen) or
//! `σ(gate)` (Kimi).
//!
//! Tokens are taken strictly one after another — in prefill as in decode — so a prompt computed
//! in one pass, in chunks, or token by token gives the same bits (transformers' chunked prefill
//! is another evaluation order of the same sums; the oracle tolerance covers it). The state lives
//! in the sequence's `KvCache` (convolution inputs first, then each head's `S`).
//!
//! Must never: read or write another sequence's state, or let a row see a later token.

use shimmer_common::spec::{DeltaProjections, GatedDeltaSpec};
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::ops::{softplus, sum_of_squares};
use shimmer_kernels::{gating, Matrix};

use crate::decoder::{matrix, name, vector, SegmentRows};

pub(crate) struct GatedDelta {
    shape: GatedDeltaSpec,
    /// Grouped: `[in_proj_qkvz, in_proj_ba]`; separate: `[in_proj_qkv, in_proj_z, in_proj_b,
    /// in_proj_a]`; Kimi: `[q_proj, k_proj, v_proj, b_proj]`.
    projections: Vec<Matrix>,
    /// `conv_dim × conv_kernel`, oldest tap first.
    conv: Vec<f32>,
    /// Qwen: per value head; Kimi: per key channel.
    dt_bias: Vec<f32>,
    /// `−exp(A_log)`, per value head.
    neg_a: Vec<f32>,
    /// Kimi's low-rank forget gate `[f_a, f_b]` and output gate `[g_a, g_b]`.
    kimi_gates: Option<[Matrix; 4]>,
    norm: Vec<f32>,
    out: Matrix,
    eps: f32,
}

impl GatedDelta {
    pub(crate) fn load(ckpt: &Checkpoint, spec: &ModelSpec, shape: &GatedDeltaSpec, layer: usize) -> Result<Self, LoadError> {
        let p = name(spec.dense_names.linear_attn, layer);
        let h = spec.hidden_size;
        let (kd, vd, nv) = (shape.key_heads * shape.key_dim, shape.value_heads * shape.value_dim, shape.value_heads);
        let projections = match shape.projections {
            DeltaProjections::Grouped => {
                vec![
                    matrix(ckpt, spec, &format!("{p}.in_proj_qkvz.weight"), 2 * kd + 2 * vd, h)?,
                    matrix(ckpt, spec, &format!("{p}.in_proj_ba.weight"), 2 * nv, h)?,
                ]
            }
            DeltaProjections::Separate => vec![
                matrix(ckpt, spec, &format!("{p}.in_proj_qkv.weight"), 2 * kd + vd, h)?,
                matrix(ckpt, spec, &format!("{p}.in_proj_z.weight"), vd, h)?,
                matrix(ckpt, spec, &format!("{p}.in_proj_b.weight"), nv, h)?,
                matrix(ckpt, spec, &format!("{p}.in_proj_a.weight"), nv, h)?,
            ],
            DeltaProjections::Kimi => vec![
                matrix(ckpt, spec, &format!("{p}.q_proj.weight"), kd, h)?,
                matrix(ckpt, spec, &format!("{p}.k_proj.weight"), kd, h)?,
                matrix(ckpt, spec, &format!("{p}.v_proj.weight"), vd, h)?,
                matrix(ckpt, spec, &format!("{p}.b_proj.weight"), nv, h)?,
            ],
        };
        let k = shape.conv_kernel;
        if shape.projections == DeltaProjections::Kimi {
            // The published checkpoint keeps one convolution per projection: together they are
            // the convolution over (queries, keys, values).
            let mut conv = ckpt.get(&format!("{p}.q_conv1d.weight"), &[kd, 1, k])?.to_f32();
            conv.extend(ckpt.get(&format!("{p}.k_conv1d.weight"), &[kd, 1, k])?.to_f32());
            conv.extend(ckpt.get(&format!("{p}.v_conv1d.weight"), &[vd, 1, k])?.to_f32());
            let a_log = ckpt.get(&format!("{p}.A_log"), &[1, 1, nv, 1])?.to_f32();
            let d = shape.key_dim;
            return Ok(GatedDelta {
                shape: shape.clone(),
                projections,
                conv,
                dt_bias: vector(ckpt, &format!("{p}.dt_bias"), kd)?,
                neg_a: a_log.iter().map(|x| -x.exp()).collect(),
                kimi_gates: Some([
                    matrix(ckpt, spec, &format!("{p}.f_a_proj.weight"), d, h)?,
                    matrix(ckpt, spec, &format!("{p}.f_b_proj.weight"), kd, d)?,
                    matrix(ckpt, spec, &format!("{p}.g_a_proj.weight"), shape.value_dim, h)?,
                    matrix(ckpt, spec, &format!("{p}.g_b_proj.weight"), vd, shape.value_dim)?,
                ]),
                norm: vector(ckpt, &format!("{p}.o_norm.weight"), shape.value_dim)?,
                out: matrix(ckpt, spec, &format!("{p}.o_proj.weight"), h, vd)?,
                eps: spec.rms_norm_eps,
            });
        }
        let conv = ckpt.get(&format!("{p}.conv1d.weight"), &[shape.conv_dim(), 1, k])?.to_f32();
        let a_log = vector(ckpt, &format!("{p}.A_log"), nv)?;
        Ok(GatedDelta {
            shape: shape.clone(),
            projections,
            conv,
            dt_bias: vector(ckpt, &format!("{p}.dt_bias"), nv)?,
            neg_a: a_log.iter().map(|x| -x.exp()).collect(),
            kimi_gates: None,
            norm: vector(ckpt, &format!("{p}.norm.weight"), shape.value_dim)?,
            out: matrix(ckpt, spec, &format!("{p}.out_proj.weight"), h, vd)?,
            eps: spec.rms_norm_eps,
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        let gates = self.kimi_gates.as_ref().map_or(0, |g| g.iter().map(Matrix::bytes).sum());
        self.projections.iter().map(Matrix::bytes).sum::<usize>()
            + gates
            + self.out.bytes()
            + 4 * (self.conv.len() + self.dt_bias.len() + self.neg_a.len() + self.norm.len())
    }

    /// Every segment's rows, each sequence's tokens in order over its own state; `out` gets the
    /// layer's output (`n × hidden`).
    pub(crate) fn forward(&self, layer: usize, x: &[f32], segments: &mut [SegmentRows<'_>], out: &mut [f32]) {
        let g = &self.shape;
        let hidden = self.out.rows;
        let n = x.len() / hidden;
        let (kd, vd, nv, r) = (g.key_heads * g.key_dim, g.value_heads * g.value_dim, g.value_heads, g.value_heads / g.key_heads);
        let projected: Vec<Vec<f32>> = self
            .projections
            .iter()
            .map(|m| {
                let mut y = vec![0.0f32; n * m.rows];
                m.matmul(x, &mut y);
                y
            })
            .collect();
        // Kimi: the forget gate's pre-activation per key channel and the output gate, per row.
        let low_rank = |a: &Matrix, b: &Matrix| {
            let mut mid = vec![0.0f32; n * a.rows];
            a.matmul(x, &mut mid);
            let mut y = vec![0.0f32; n * b.rows];
            b.matmul(&mid, &mut y);
            y
        };
        let (forget, out_gate) = match &self.kimi_gates {
            Some([f_a, f_b, g_a, g_b]) => (low_rank(f_a, f_b), low_rank(g_a, g_b)),
            None => (Vec::new(), Vec::new()),
        };
        let kimi = self.kimi_gates.is_some();
        let conv_dim = g.conv_dim();
        let taps = g.conv_kernel - 1;
        let mut mixed = vec![0.0f32; conv_dim];
        let mut z = vec![0.0f32; vd];
        let (mut b, mut a) = (vec![0.0f32; nv], vec![0.0f32; nv]);
        let mut conv_out = vec![0.0f32; conv_dim];
        let mut o = vec![0.0f32; vd];
        let mut kv_mem = vec![0.0f32; g.value_dim];
        let mut heads_out = vec![0.0f32; n * vd];
        for seg in segments.iter_mut() {
            let state = seg.cache.state_to_advance(layer);
            let (conv_state, s_all) = state.split_at_mut(conv_dim * taps);
            for i in seg.rows.clone() {
                self.unpack(&projected, i, (kd, vd, nv, r), &mut mixed, &mut z, &mut b, &mut a);
                if kimi {
                    z.copy_from_slice(&out_gate[i * vd..(i + 1) * vd]);
                }
                // The depthwise causal convolution over (the last `taps` inputs, this one), SiLU.
                for c in 0..conv_dim {
                    let w = &self.conv[c * g.conv_kernel..(c + 1) * g.conv_kernel];
                    let past = &mut conv_state[c * taps..(c + 1) * taps];
                    let mut acc = 0.0f32;
                    for (wj, xj) in w.iter().zip(past.iter().chain(std::iter::once(&mixed[c]))) {
                        acc += wj * xj;
                    }
                    conv_out[c] = gating::silu(acc);
                    if taps > 0 {
                        past.rotate_left(1);
                        past[taps - 1] = mixed[c];
                    }
                }
                let (q_all, rest) = conv_out.split_at_mut(kd);
                let (k_all, v_all) = rest.split_at_mut(kd);
                let root = (g.key_dim as f32).sqrt();
                for (qh, kh) in q_all.chunks_exact_mut(g.key_dim).zip(k_all.chunks_exact_mut(g.key_dim)) {
                    l2_normalise(qh, kimi);
                    l2_normalise(kh, kimi);
                    qh.iter_mut().for_each(|x| *x /= root);
                }
                for h in 0..nv {
                    let (q, k) = (&q_all[(h / r) * g.key_dim..(h / r + 1) * g.key_dim], &k_all[(h / r) * g.key_dim..(h / r + 1) * g.key_dim]);
                    let v = &v_all[h * g.value_dim..(h + 1) * g.value_dim];
                    let beta = sigmoid(b[h]);
                    let s = &mut s_all[h * g.key_dim * g.value_dim..(h + 1) * g.key_dim * g.value_dim];
                    if kimi {
                        // One decay per key channel (a row of S).
                        let f = &forget[i * kd + h * g.key_dim..i * kd + (h + 1) * g.key_dim];
                        let dt = &self.dt_bias[h * g.key_dim..(h + 1) * g.key_dim];
                        for ((row, fi), di) in s.chunks_exact_mut(g.value_dim).zip(f).zip(dt) {
                            let decay = (self.neg_a[h] * softplus(fi + di)).exp();
                            row.iter_mut().for_each(|x| *x *= decay);
                        }
                    } else {
                        let decay = (self.neg_a[h] * softplus(a[h] + self.dt_bias[h])).exp();
                        s.iter_mut().for_each(|x| *x *= decay);
                    }
                    kv_mem.iter_mut().for_each(|m| *m = 0.0);
                    for (row, ki) in s.chunks_exact(g.value_dim).zip(k) {
                        kv_mem.iter_mut().zip(row).for_each(|(m, sij)| *m += sij * ki);
                    }
                    let oh = &mut o[h * g.value_dim..(h + 1) * g.value_dim];
                    oh.iter_mut().for_each(|x| *x = 0.0);
                    for ((row, ki), qi) in s.chunks_exact_mut(g.value_dim).zip(k).zip(q) {
                        for (((sij, vj), mj), oj) in row.iter_mut().zip(v).zip(&kv_mem).zip(oh.iter_mut()) {
                            *sij += ki * ((vj - mj) * beta);
                            *oj += *sij * qi;
                        }
                    }
                }
                // Per head: RMSNorm (plain weights), then the gate: silu(z), or Kimi's σ(gate).
                let row = &mut heads_out[i * vd..(i + 1) * vd];
                for ((oh, zh), dst) in o.chunks_exact(g.value_dim).zip(z.chunks_exact(g.value_dim)).zip(row.chunks_exact_mut(g.value_dim)) {
                    let var = sum_of_squares(oh) / g.value_dim as f32;
                    let inv = 1.0 / (var + self.eps).sqrt();
                    for (((d, x), w), zj) in dst.iter_mut().zip(oh).zip(&self.norm).zip(zh) {
                        *d = w * (x * inv) * if kimi { sigmoid(*zj) } else { gating::silu(*zj) };
                    }
                }
            }
        }
        self.out.matmul(&heads_out, out);
    }

    /// Row `i`'s convolution input (queries, keys, values), gates `z`, and `b`, `a` per value head,
    /// from the stored projections' layout.
    #[allow(clippy::too_many_arguments)]
    fn unpack(
        &self,
        projected: &[Vec<f32>],
        i: usize,
        (kd, vd, nv, r): (usize, usize, usize, usize),
        mixed: &mut [f32],
        z: &mut [f32],
        b: &mut [f32],
        a: &mut [f32],
    ) {
        let g = &self.shape;
        match g.projections {
            DeltaProjections::Grouped => {
                let qkvz = &projected[0][i * (2 * kd + 2 * vd)..(i + 1) * (2 * kd + 2 * vd)];
                let ba = &projected[1][i * 2 * nv..(i + 1) * 2 * nv];
                let (dk, rv) = (g.key_dim, r * g.value_dim);
                for (grp, block) in qkvz.chunks_exact(2 * dk + 2 * rv).enumerate() {
                    mixed[grp * dk..(grp + 1) * dk].copy_from_slice(&block[..dk]);
                    mixed[kd + grp * dk..kd + (grp + 1) * dk].copy_from_slice(&block[dk..2 * dk]);
                    mixed[2 * kd + grp * rv..2 * kd + (grp + 1) * rv].copy_from_slice(&block[2 * dk..2 * dk + rv]);
                    z[grp * rv..(grp + 1) * rv].copy_from_slice(&block[2 * dk + rv..]);
                }
                for (grp, block) in ba.chunks_exact(2 * r).enumerate() {
                    b[grp * r..(grp + 1) * r].copy_from_slice(&block[..r]);
                    a[grp * r..(grp + 1) * r].copy_from_slice(&block[r..]);
                }
            }
            DeltaProjections::Kimi => {
                mixed[..kd].copy_from_slice(&projected[0][i * kd..(i + 1) * kd]);
                mixed[kd..2 * kd].copy_from_slice(&projected[1][i * kd..(i + 1) * kd]);
                mixed[2 * kd..].copy_from_slice(&projected[2][i * vd..(i + 1) * vd]);
                b.copy_from_slice(&projected[3][i * nv..(i + 1) * nv]);
            }
            DeltaProjections::Separate => {
                let w = 2 * kd + vd;
                mixed.copy_from_slice(&projected[0][i * w..(i + 1) * w]);
                z.copy_from_slice(&projected[1][i * vd..(i + 1) * vd]);
                b.copy_from_slice(&projected[2][i * nv..(i + 1) * nv]);
                a.copy_from_slice(&projected[3][i * nv..(i + 1) * nv]);
            }
        }
    }
}

/// `x · rsqrt(Σx² + 1e-6)` (transformers' Qwen L2 norm), or `x / √(Σx² + 1e-6)` (its Kimi one).
fn l2_normalise(x: &mut [f32], divide: bool) {
    let root = (sum_of_squares(x) + 1e-6).sqrt();
    if divide {
        x.iter_mut().for_each(|v| *v /= root);
    } else {
        let inv = 1.0 / root;
        x.iter_mut().for_each(|v| *v *= inv);
    }
}

fn sigmoid(x: f32) -> f32 {
    gating::recip(1.0 + gating::exp(-x))
}
