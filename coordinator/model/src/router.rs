//! Routers: a row's MoE input → its (expert, weight) pairs, exactly as the model defines them.
//! One place for every family's routing semantics (DESIGN.md §1: never approximated).

use shimmer_common::spec::RouterScoring;
use shimmer_kernels::{ops, Matrix};

/// Rows from which a step's team shares the routers' choices (below it, as for a 16-sequence
/// batch's decode step, the claims cost what the split saves).
const PARALLEL_MIN_ROWS: usize = 32;

/// Some consecutive rows' raw scores and tokens, and what they chose.
struct Choices<'a> {
    scores: &'a mut [f32],
    tokens: &'a [u32],
    ids: Vec<u32>,
    weights: Vec<f32>,
    shared: Vec<f32>,
}

pub struct Router {
    pub weight: Matrix,
    /// `e_score_correction_bias`: shifts selection only, never the weights.
    pub bias: Option<Vec<f32>>,
    /// The router's linear bias, part of its logits (gpt-oss).
    pub logit_bias: Option<Vec<f32>>,
    pub scoring: RouterScoring,
    pub top_k: usize,
    /// A hash layer's fixed choice (DeepSeek-V4's `tid2eid`): `top_k` expert ids per token id,
    /// in place of a selection by score; the weights still come from the scores.
    pub hash: Option<Vec<u32>>,
    /// Multiplies every weight (Inkling's router `global_scale`; 1 elsewhere).
    pub global_scale: f32,
}

impl Router {
    /// Appends row `x`'s (of token `token`) `top_k` expert ids and weights; `scores` is scratch
    /// of `num_experts`. The token matters to a hash layer only (its table was checked against
    /// the vocabulary and the experts when loaded, and the decoder checks tokens before a pass).
    /// Shared experts the router weighs (Inkling) get their weights appended to `shared`.
    pub fn route_row(&self, x: &[f32], token: u32, scores: &mut Vec<f32>, ids: &mut Vec<u32>, weights: &mut Vec<f32>, shared: &mut Vec<f32>) {
        scores.resize(self.weight.rows, 0.0);
        self.weight.matvec(x, scores);
        self.select(scores, token, ids, weights, shared);
    }

    /// `route_row` for the rows of `x` (whole rows of the hidden size) paired with `tokens`, as
    /// many as both have: the scores of all rows in one product — a prompt's rows share each
    /// loaded router row, and the kernels give every row the bits it gets alone — then each
    /// row's choice.
    pub fn route_rows(&self, x: &[f32], tokens: &[u32], ids: &mut Vec<u32>, weights: &mut Vec<f32>, shared: &mut Vec<f32>) {
        let (e, cols) = (self.weight.rows, self.weight.cols);
        let n = (x.len() / cols.max(1)).min(tokens.len());
        let mut scores = vec![0.0f32; n * e];
        self.weight.matmul(&x[..n * cols], &mut scores);
        // A prompt's rows choose over the step's team (a prompt of 64 rows spent ~4 % of its
        // time choosing on one thread while the other waited); each row chooses exactly as alone,
        // and the parts join in row order.
        if let Some(per) = shimmer_kernels::team::piece_len(n, 1, PARALLEL_MIN_ROWS) {
            let mut parts: Vec<Choices<'_>> = scores
                .chunks_mut(per * e)
                .zip(tokens[..n].chunks(per))
                .map(|(scores, tokens)| Choices { scores, tokens, ids: Vec::new(), weights: Vec::new(), shared: Vec::new() })
                .collect();
            shimmer_kernels::team::each_mut(&mut parts, true, |p| {
                for (row, &token) in p.scores.chunks_exact_mut(e).zip(p.tokens) {
                    self.select(row, token, &mut p.ids, &mut p.weights, &mut p.shared);
                }
            });
            for p in parts {
                ids.extend(p.ids);
                weights.extend(p.weights);
                shared.extend(p.shared);
            }
            return;
        }
        for (row, &token) in scores.chunks_exact_mut(e).zip(tokens) {
            self.select(row, token, ids, weights, shared);
        }
    }

    /// The choice from one row's raw scores (`scores`, of `num_experts`, used as scratch).
    fn select(&self, scores: &mut [f32], token: u32, ids: &mut Vec<u32>, weights: &mut Vec<f32>, shared: &mut Vec<f32>) {
        let e = scores.len();
        if let Some(b) = &self.logit_bias {
            scores.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        match self.scoring {
            RouterScoring::SoftmaxTopK { norm_topk_prob } => {
                ops::softmax_in_place(scores);
                let top = top_k(scores, self.top_k);
                let sum: f32 = top.iter().map(|&i| scores[i]).sum();
                for &i in &top {
                    ids.push(i as u32);
                    weights.push(if norm_topk_prob { scores[i] / sum } else { scores[i] });
                }
            }
            RouterScoring::SigmoidGrouped { n_group, topk_group, norm_topk_prob, routed_scaling_factor } => {
                scores.iter_mut().for_each(|s| *s = ops::sigmoid(*s));
                let choice: Vec<f32> = match &self.bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.to_vec(),
                };
                // Each group is scored by the sum of its two best biased scores; only the best
                // `topk_group` groups may contribute experts.
                let size = e / n_group;
                let group_scores: Vec<f32> = choice.chunks_exact(size).map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum()).collect();
                let groups = top_k(&group_scores, topk_group);
                let masked: Vec<f32> = choice.iter().enumerate().map(|(i, c)| if groups.contains(&(i / size)) { *c } else { f32::NEG_INFINITY }).collect();
                let top = top_k(&masked, self.top_k);
                let sum: f32 = top.iter().map(|&i| scores[i]).sum::<f32>() + 1e-20;
                for &i in &top {
                    ids.push(i as u32);
                    let w = if norm_topk_prob { scores[i] / sum } else { scores[i] };
                    weights.push(w * routed_scaling_factor);
                }
            }
            RouterScoring::SqrtSoftplus { routed_scaling_factor } => {
                scores.iter_mut().for_each(|s| *s = ops::softplus(*s).sqrt());
                let top: Vec<usize> = match &self.hash {
                    Some(table) => {
                        let at = token as usize * self.top_k;
                        table.get(at..at + self.top_k).map_or_else(Vec::new, |row| row.iter().map(|&e| e as usize).collect())
                    }
                    None => match &self.bias {
                        Some(b) => top_k(&scores.iter().zip(b).map(|(s, b)| s + b).collect::<Vec<_>>(), self.top_k),
                        None => top_k(scores, self.top_k),
                    },
                };
                let sum: f32 = top.iter().map(|&i| scores[i]).sum::<f32>() + 1e-20;
                for &i in &top {
                    ids.push(i as u32);
                    weights.push(scores[i] / sum * routed_scaling_factor);
                }
            }
            RouterScoring::LogSigmoidShared { route_scale, shared: n_shared } => {
                let routed = e - n_shared;
                let choice: Vec<f32> = match &self.bias {
                    Some(b) => scores[..routed].iter().zip(b).map(|(s, b)| ops::sigmoid(*s) + b).collect(),
                    None => scores[..routed].iter().map(|s| ops::sigmoid(*s)).collect(),
                };
                let top = top_k(&choice, self.top_k);
                let log_probs: Vec<f32> = top.iter().map(|&i| scores[i]).chain(scores[routed..].iter().copied()).map(log_sigmoid).collect();
                let m = log_probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = m + log_probs.iter().map(|l| (l - m).exp()).sum::<f32>().ln();
                let scale = route_scale * self.global_scale;
                for (j, l) in log_probs.iter().enumerate() {
                    let w = (l - lse).exp() * scale;
                    if j < top.len() {
                        ids.push(top[j] as u32);
                        weights.push(w);
                    } else {
                        shared.push(w);
                    }
                }
            }
            RouterScoring::TopKSoftmax => {
                let top = top_k(scores, self.top_k);
                let mut chosen: Vec<f32> = top.iter().map(|&i| scores[i]).collect();
                ops::softmax_in_place(&mut chosen);
                ids.extend(top.iter().map(|&i| i as u32));
                weights.extend(chosen);
            }
        }
    }
}

/// torch's `logsigmoid`: `−softplus(−x)`, computed without overflow either side.
fn log_sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

/// Indices of the `k` largest values, largest first; equal values keep index order.
/// (A selection, not a sort: routers take 2–8 of 32–512 every row and layer.)
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    let mut top: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, v) in values.iter().enumerate() {
        // Most values fall short of the k-th kept: one comparison, the same answer as the search.
        if top.len() == k && top.last().is_none_or(|&j| values[j].total_cmp(v).is_ge()) {
            continue;
        }
        // Every index already kept is smaller than `i`, so it stays ahead of an equal value.
        let at = top.partition_point(|&j| values[j].total_cmp(v).is_ge());
        if at < k {
            top.insert(at, i);
            top.truncate(k);
        }
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(logits: &[f32], bias: Option<Vec<f32>>, scoring: RouterScoring, top_k: usize) -> (Vec<u32>, Vec<f32>) {
        // An identity-like weight: row i picks input i, so the logits are the input.
        let n = logits.len();
        let w: Vec<f32> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
        let r = Router { weight: Matrix::from_f32(n, n, w), bias, logit_bias: None, scoring, top_k, hash: None, global_scale: 1.0 };
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        r.route_row(logits, 0, &mut Vec::new(), &mut ids, &mut weights, &mut Vec::new());
        (ids, weights)
    }

    #[test]
    fn softmax_top_k_with_and_without_renormalisation() {
        let logits = [1.0, 3.0, 2.0, 0.0];
        let (ids, w) = router(&logits, None, RouterScoring::SoftmaxTopK { norm_topk_prob: false }, 2);
        assert_eq!(ids, [1, 2]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((w[0] - 3f32.exp() / z).abs() < 1e-6 && (w[1] - 2f32.exp() / z).abs() < 1e-6);
        let (_, w) = router(&logits, None, RouterScoring::SoftmaxTopK { norm_topk_prob: true }, 2);
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_then_softmax_over_the_chosen_logits_with_the_linear_bias() {
        // gpt-oss: the bias is part of the logits (it changes the choice and the weights).
        let logits = [1.0, 3.0, 2.0, 0.0];
        let w: Vec<f32> = (0..16).map(|i| if i / 4 == i % 4 { 1.0 } else { 0.0 }).collect();
        let r = Router {
            weight: Matrix::from_f32(4, 4, w),
            bias: None,
            logit_bias: Some(vec![0.0, 0.0, 0.0, 2.5]),
            scoring: RouterScoring::TopKSoftmax,
            top_k: 2,
            hash: None,
            global_scale: 1.0,
        };
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        r.route_row(&logits, 0, &mut Vec::new(), &mut ids, &mut weights, &mut Vec::new());
        assert_eq!(ids, [1, 3]);
        let z = 3f32.exp() + 2.5f32.exp();
        assert!((weights[0] - 3f32.exp() / z).abs() < 1e-6 && (weights[1] - 2.5f32.exp() / z).abs() < 1e-6, "{weights:?}");
    }

    #[test]
    fn grouped_sigmoid_selects_on_biased_scores_and_weighs_unbiased_ones() {
        // 8 experts in 4 groups of 2; the bias lifts expert 7's group above expert 0's.
        let logits = [3.0, 2.9, 0.0, 0.1, -1.0, -1.0, -2.0, 0.5];
        let bias = vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.9];
        let scoring = RouterScoring::SigmoidGrouped { n_group: 4, topk_group: 2, norm_topk_prob: false, routed_scaling_factor: 2.0 };
        let (ids, w) = router(&logits, Some(bias), scoring, 3);
        // Biased scores: σ = [.953 .948 .5 .525 .269 .269 .119 .622] + bias → experts 6, 7 at 1.019, 1.522.
        // Group sums of the two best: g0 1.900, g1 1.025, g2 0.538, g3 2.542 → groups 3 and 0;
        // among experts 0, 1, 6, 7 the three best biased scores are 7, 6, 0.
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert_eq!(ids, [7, 6, 0]);
        // Weights are the unbiased sigmoid scores times the routed scaling factor.
        for (id, wt) in ids.iter().zip(&w) {
            assert!((wt - 2.0 * s(logits[*id as usize])).abs() < 1e-6, "expert {id}");
        }
        // Renormalised: the k weights sum to the scaling factor.
        let scoring = RouterScoring::SigmoidGrouped { n_group: 4, topk_group: 2, norm_topk_prob: true, routed_scaling_factor: 2.0 };
        let (_, w) = router(&logits, Some(vec![0.0; 8]), scoring, 3);
        assert!((w.iter().sum::<f32>() - 2.0).abs() < 1e-5);
        // Without the bias, groups 0 and 1 win and expert 7 is out.
        let scoring = RouterScoring::SigmoidGrouped { n_group: 4, topk_group: 2, norm_topk_prob: false, routed_scaling_factor: 1.0 };
        let (ids, _) = router(&logits, None, scoring, 3);
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 1, 3]);
    }

    #[test]
    fn sqrt_softplus_selects_on_biased_scores_or_by_token_and_renormalises() {
        // DeepSeek-V4: scores √softplus(logit); selection on score + bias; weights the unbiased
        // scores over their sum, times the scaling factor.
        let logits = [1.0, 3.0, 2.0, -1.0];
        let score = |x: f32| (1.0 + x.exp()).ln().sqrt();
        let scoring = RouterScoring::SqrtSoftplus { routed_scaling_factor: 1.5 };
        let (ids, w) = router(&logits, Some(vec![0.0, 0.0, -2.0, 3.0]), scoring, 2);
        assert_eq!(ids, [3, 1]);
        let sum = score(-1.0) + score(3.0);
        assert!((w[0] - 1.5 * score(-1.0) / sum).abs() < 1e-6 && (w[1] - 1.5 * score(3.0) / sum).abs() < 1e-6, "{w:?}");
        // A hash layer takes the token's row of the table whatever the scores say.
        let n = logits.len();
        let eye: Vec<f32> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
        let r = Router {
            weight: Matrix::from_f32(n, n, eye),
            bias: None,
            logit_bias: None,
            scoring,
            top_k: 2,
            hash: Some(vec![0, 1, 3, 2, 2, 0]),
            global_scale: 1.0,
        };
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        r.route_row(&logits, 1, &mut Vec::new(), &mut ids, &mut weights, &mut Vec::new());
        assert_eq!(ids, [3, 2]);
        let sum = score(-1.0) + score(2.0);
        assert!((weights[0] - 1.5 * score(-1.0) / sum).abs() < 1e-6, "{weights:?}");
    }

    #[test]
    fn log_sigmoid_softmax_weighs_the_chosen_and_the_shared_experts_together() {
        // Inkling: 4 routed experts and 2 shared ones (the last rows); choice on routed sigmoid +
        // bias; weights softmax(logsigmoid([chosen, shared])) × route_scale × global_scale.
        let logits = [1.0, -2.0, 0.5, 3.0, 0.2, -0.7];
        let n = logits.len();
        let eye: Vec<f32> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
        let scoring = RouterScoring::LogSigmoidShared { route_scale: 2.0, shared: 2 };
        let r = Router {
            weight: Matrix::from_f32(n, n, eye),
            bias: Some(vec![0.0, 0.9, 0.0, 0.0]),
            logit_bias: None,
            scoring,
            top_k: 2,
            hash: None,
            global_scale: 0.5,
        };
        let (mut ids, mut weights, mut shared) = (Vec::new(), Vec::new(), Vec::new());
        r.route_row(&logits, 0, &mut Vec::new(), &mut ids, &mut weights, &mut shared);
        // σ + bias: [.731, .119 + .9 = 1.019, .622, .953] → experts 1 and 3.
        assert_eq!(ids, [1, 3]);
        let ls = |x: f64| -(1.0 + (-x).exp()).ln();
        let chosen = [-2.0, 3.0, 0.2, -0.7].map(ls);
        let z: f64 = chosen.iter().map(|l| l.exp()).sum();
        let want: Vec<f64> = chosen.iter().map(|l| l.exp() / z * 2.0 * 0.5).collect();
        let got: Vec<f64> = weights.iter().chain(&shared).map(|w| f64::from(*w)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        assert!((log_sigmoid(-100.0) + 100.0).abs() < 1e-3 && log_sigmoid(100.0).abs() < 1e-30 && log_sigmoid(100.0) <= 0.0);
    }

    /// The selection is the stable sort it replaced, truncated: ties (and −0 against +0, and
    /// NaNs, by `total_cmp`) keep index order.
    #[test]
    fn top_k_is_the_first_k_of_a_stable_descending_sort() {
        let mut seed = 0x9e37_79b9u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for case in 0..500 {
            let n = 1 + (next() % 70) as usize;
            let values: Vec<f32> = (0..n)
                .map(|_| match next() % 10 {
                    0 => f32::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    3 => f32::NEG_INFINITY,
                    _ => (next() % 9) as f32 - 4.0,
                })
                .collect();
            let mut sorted: Vec<usize> = (0..n).collect();
            sorted.sort_by(|a, b| values[*b].total_cmp(&values[*a]).then(a.cmp(b)));
            for k in [0, 1, 2, 4, 8, n, n + 3] {
                assert_eq!(top_k(&values, k), sorted[..k.min(n)].to_vec(), "case {case}, k {k}, values {values:?}");
            }
        }
    }

    /// A prompt's rows routed together — on one thread or over a step's team, which splits the
    /// choosing — choose and weigh exactly as each routed alone.
    #[test]
    fn rows_routed_together_match_each_routed_alone() {
        let (experts, hidden, rows) = (12, 40, 45);
        // Past the team's bound, in pieces of unequal length.
        const { assert!(45 >= PARALLEL_MIN_ROWS) };
        let w: Vec<f32> = (0..experts * hidden).map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 0.3).collect();
        let x: Vec<f32> = (0..rows * hidden).map(|i| ((i * 104_729 % 2003) as f32 / 2003.0 - 0.5) * 2.0).collect();
        let tokens: Vec<u32> = (0..rows as u32).collect();
        let bits = |v: &[f32]| v.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
        for scoring in
            [RouterScoring::SoftmaxTopK { norm_topk_prob: true }, RouterScoring::TopKSoftmax, RouterScoring::LogSigmoidShared { route_scale: 2.0, shared: 2 }]
        {
            let r =
                Router { weight: Matrix::from_f32(experts, hidden, w.clone()), bias: None, logit_bias: None, scoring, top_k: 3, hash: None, global_scale: 1.0 };
            let (mut one_ids, mut one_weights, mut one_shared) = (Vec::new(), Vec::new(), Vec::new());
            for (row, &t) in x.chunks_exact(hidden).zip(&tokens) {
                r.route_row(row, t, &mut Vec::new(), &mut one_ids, &mut one_weights, &mut one_shared);
            }
            for teamed in [false, true] {
                let route = || {
                    let (mut ids, mut weights, mut shared) = (Vec::new(), Vec::new(), Vec::new());
                    r.route_rows(&x, &tokens, &mut ids, &mut weights, &mut shared);
                    (ids, weights, shared)
                };
                let (ids, weights, shared) = if teamed { shimmer_kernels::team::with_team(2, route) } else { route() };
                assert_eq!(ids, one_ids, "{scoring:?}, team {teamed}");
                assert_eq!(bits(&weights), bits(&one_weights), "{scoring:?}, team {teamed}");
                assert_eq!(bits(&shared), bits(&one_shared), "{scoring:?}, team {teamed}");
            }
        }
    }
}
