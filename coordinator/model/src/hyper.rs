//! Manifold-constrained hyper-connections (DeepSeek-V4): the residual is `streams` parallel
//! copies of the hidden state. Before each sublayer (attention, MoE) a learned mix of the streams
//! gives three sets of weights per row — `pre` collapses the streams into the sublayer's input,
//! `post` spreads its output back over them, and `comb`, projected onto the doubly-stochastic
//! matrices by Sinkhorn iterations, recombines the streams themselves. The model's head collapses
//! the streams once more (`HyperHead`).
//!
//! Owns: those weights and the collapse and expand. Never: the sublayers, or any state between
//! tokens (each row's weights come from that row alone).

use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::{ops, Matrix};

use crate::decoder::{matrix, vector};

/// `x · rsqrt(mean(x²) + eps)` with no weight, as transformers' `DeepseekV4UnweightedRMSNorm`.
fn unweighted_rms_norm(x: &[f32], eps: f32, out: &mut [f32]) {
    let mean = ops::sum_of_squares(x) / x.len() as f32;
    let r = 1.0 / (mean + eps).sqrt();
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v * r);
}

/// One sublayer's hyper-connection (`hc_attn_*` or `hc_ffn_*`).
pub(crate) struct HyperConnection {
    /// `(2 + n)·n × n·hidden`: rows `0..n` give `pre`, `n..2n` `post`, the rest `comb` (n × n).
    mix: Matrix,
    base: Vec<f32>,
    /// Scales of the `pre`, `post` and `comb` logits.
    scale: [f32; 3],
    streams: usize,
    sinkhorn_iters: usize,
    eps: f32,
    norm_eps: f32,
}

/// Per row of a hyper-connected sublayer: how its output is spread (`post`, n) and the streams
/// recombined (`comb`, n × n, `comb[j][k]` from stream j into stream k).
#[derive(Default)]
pub(crate) struct Spread {
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
}

impl HyperConnection {
    /// `names`: the mix matrix, its bias and its three scales.
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec, names: [&str; 3], streams: usize, sinkhorn_iters: usize, eps: f32) -> Result<Self, LoadError> {
        let n = streams;
        let width = (2 + n) * n;
        let scale = vector(ckpt, names[2], 3)?;
        Ok(HyperConnection {
            mix: matrix(ckpt, spec, names[0], width, n * spec.hidden_size)?,
            base: vector(ckpt, names[1], width)?,
            scale: [scale[0], scale[1], scale[2]],
            streams: n,
            sinkhorn_iters,
            eps,
            norm_eps: spec.rms_norm_eps,
        })
    }

    pub fn bytes(&self) -> usize {
        self.mix.bytes() + self.base.len() * 4
    }

    /// For every row of `streams` (`rows × n × hidden`): its sublayer input (`collapsed`,
    /// `rows × hidden`) and how the output goes back (`spread`).
    pub fn collapse(&self, streams: &[f32], collapsed: &mut [f32], spread: &mut Spread) {
        let n = self.streams;
        let hidden = self.mix.cols / n;
        let rows = streams.len() / (n * hidden);
        let mut normed = vec![0.0f32; streams.len()];
        for (s, o) in streams.chunks_exact(n * hidden).zip(normed.chunks_exact_mut(n * hidden)) {
            unweighted_rms_norm(s, self.norm_eps, o);
        }
        let width = (2 + n) * n;
        let mut mixes = vec![0.0f32; rows * width];
        self.mix.matmul(&normed, &mut mixes);
        spread.post.resize(rows * n, 0.0);
        spread.comb.resize(rows * n * n, 0.0);
        for r in 0..rows {
            let m = &mixes[r * width..(r + 1) * width];
            let s = &streams[r * n * hidden..(r + 1) * n * hidden];
            let out = &mut collapsed[r * hidden..(r + 1) * hidden];
            out.fill(0.0);
            for i in 0..n {
                let pre = ops::sigmoid(m[i] * self.scale[0] + self.base[i]) + self.eps;
                out.iter_mut().zip(&s[i * hidden..(i + 1) * hidden]).for_each(|(o, v)| *o += pre * v);
            }
            for i in 0..n {
                spread.post[r * n + i] = 2.0 * ops::sigmoid(m[n + i] * self.scale[1] + self.base[n + i]);
            }
            let comb = &mut spread.comb[r * n * n..(r + 1) * n * n];
            for (j, row) in comb.chunks_exact_mut(n).enumerate() {
                for (k, c) in row.iter_mut().enumerate() {
                    *c = m[2 * n + j * n + k] * self.scale[2] + self.base[2 * n + j * n + k];
                }
                ops::softmax_in_place(row);
                row.iter_mut().for_each(|c| *c += self.eps);
            }
            sinkhorn(comb, n, self.sinkhorn_iters, self.eps);
        }
    }
}

/// Sinkhorn–Knopp as transformers runs it: columns normalised once, then `iters − 1` rounds of
/// rows then columns, each sum padded by `eps`.
fn sinkhorn(comb: &mut [f32], n: usize, iters: usize, eps: f32) {
    let columns = |c: &mut [f32]| {
        for k in 0..n {
            let sum: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + eps;
            (0..n).for_each(|j| c[j * n + k] /= sum);
        }
    };
    columns(comb);
    for _ in 1..iters.max(1) {
        for row in comb.chunks_exact_mut(n) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|c| *c /= sum);
        }
        columns(comb);
    }
}

/// `streams[k] = post_k · y + Σ_j comb[j][k] · streams[j]` for every row (`y`: the sublayer's
/// output, `rows × hidden`).
pub(crate) fn expand(streams: &mut [f32], y: &[f32], spread: &Spread, n: usize, hidden: usize) {
    let rows = y.len() / hidden.max(1);
    let mut mixed = vec![0.0f32; n * hidden];
    for r in 0..rows {
        let s = &mut streams[r * n * hidden..(r + 1) * n * hidden];
        let comb = &spread.comb[r * n * n..(r + 1) * n * n];
        let yr = &y[r * hidden..(r + 1) * hidden];
        for k in 0..n {
            let out = &mut mixed[k * hidden..(k + 1) * hidden];
            let post = spread.post[r * n + k];
            out.iter_mut().zip(yr).for_each(|(o, v)| *o = post * v);
            for j in 0..n {
                let c = comb[j * n + k];
                out.iter_mut().zip(&s[j * hidden..(j + 1) * hidden]).for_each(|(o, v)| *o += c * v);
            }
        }
        s.copy_from_slice(&mixed);
    }
}

/// The model's last collapse of the streams (`hc_head_*`), before the final norm.
pub(crate) struct HyperHead {
    mix: Matrix,
    base: Vec<f32>,
    scale: f32,
    streams: usize,
    eps: f32,
    norm_eps: f32,
}

impl HyperHead {
    pub fn load(ckpt: &Checkpoint, spec: &ModelSpec, names: [&str; 3], streams: usize, eps: f32) -> Result<Self, LoadError> {
        Ok(HyperHead {
            mix: matrix(ckpt, spec, names[0], streams, streams * spec.hidden_size)?,
            base: vector(ckpt, names[1], streams)?,
            scale: vector(ckpt, names[2], 1)?[0],
            streams,
            eps,
            norm_eps: spec.rms_norm_eps,
        })
    }

    pub fn bytes(&self) -> usize {
        self.mix.bytes()
    }

    /// One row's streams (`n × hidden`) → its hidden state.
    pub fn collapse(&self, streams: &[f32], out: &mut [f32]) {
        let n = self.streams;
        let hidden = out.len();
        let mut normed = vec![0.0f32; streams.len()];
        unweighted_rms_norm(streams, self.norm_eps, &mut normed);
        let mut mixes = vec![0.0f32; n];
        self.mix.matvec(&normed, &mut mixes);
        out.fill(0.0);
        for i in 0..n {
            let pre = ops::sigmoid(mixes[i] * self.scale + self.base[i]) + self.eps;
            out.iter_mut().zip(&streams[i * hidden..(i + 1) * hidden]).for_each(|(o, v)| *o += pre * v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_makes_a_positive_matrix_doubly_stochastic() {
        let n = 4;
        let mut c: Vec<f32> = (0..n * n).map(|i| 0.05 + ((i * 7919) % 13) as f32 / 10.0).collect();
        sinkhorn(&mut c, n, 20, 1e-6);
        for j in 0..n {
            let row: f32 = c[j * n..(j + 1) * n].iter().sum();
            let col: f32 = (0..n).map(|i| c[i * n + j]).sum();
            assert!((row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5, "row {row} col {col}");
        }
    }

    #[test]
    fn expand_adds_the_spread_output_to_the_recombined_streams() {
        let (n, hidden) = (2, 3);
        let mut streams = vec![1.0, 2.0, 3.0, 10.0, 20.0, 30.0];
        let spread = Spread { post: vec![0.5, 2.0], comb: vec![0.25, 0.75, 0.75, 0.25] };
        expand(&mut streams, &[1.0, 1.0, 1.0], &spread, n, hidden);
        // Stream 0 = 0.5·y + 0.25·s0 + 0.75·s1; stream 1 = 2·y + 0.75·s0 + 0.25·s1.
        assert_eq!(streams[..hidden], [0.5 + 0.25 + 7.5, 0.5 + 0.5 + 15.0, 0.5 + 0.75 + 22.5]);
        assert_eq!(streams[hidden..], [2.0 + 0.75 + 2.5, 2.0 + 1.5 + 5.0, 2.0 + 2.25 + 7.5]);
    }
}
