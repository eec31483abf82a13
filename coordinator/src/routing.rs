//! Routing analysis over real text: how skewed a model's expert usage is, how much consecutive
//! tokens share experts, and how well the free prefetch predictor — the next MoE layer's router
//! applied to this layer's MoE input (DESIGN.md §4) — recalls the next layer's true top-k.
//! Caches and prefetchers are judged against these figures.

use shimmer_common::ModelSpec;

use shimmer_model::MoeObserver;

#[derive(Debug, Clone, Default)]
struct LayerTally {
    counts: Vec<u64>,
    rows: u64,
    predicted_hits: u64,
    predicted_total: u64,
    repeat_hits: u64,
    repeat_total: u64,
    /// The last row's experts, for the consecutive-token overlap.
    last: Option<Vec<u32>>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerReport {
    pub layer: usize,
    pub selections: u64,
    /// Shannon entropy of the expert-usage distribution, in bits.
    pub entropy_bits: f64,
    /// log2(num_experts): the entropy of perfectly even usage.
    pub max_entropy_bits: f64,
    /// Share of all selections taken by the hottest ceil(10%) of experts (0.1 if even).
    pub hottest_10pct_share: f64,
    /// Share of the least-used half of the experts.
    pub coldest_half_share: f64,
    /// |predicted ∩ true| / k, where predicted = this layer's router on the previous MoE layer's
    /// input. `None` for the first MoE layer.
    pub next_layer_recall: Option<f64>,
    /// |experts(t) ∩ experts(t-1)| / k within a sequence: what an LRU of one token's experts keeps.
    pub consecutive_overlap: f64,
}

/// Counts what the forward pass reports: selections through `moe_layer`, and the decoder's own
/// one-layer-ahead prediction through `lookahead` (the same hook the trace recorder uses).
pub struct RoutingAnalysis {
    top_k: usize,
    tallies: Vec<LayerTally>,
    /// The prediction for the next MoE layer, waiting for that layer's real selections.
    pending: Option<(usize, Vec<u32>)>,
}

impl RoutingAnalysis {
    pub fn new(spec: &ModelSpec) -> Self {
        Self::with_shape(spec.num_layers, spec.moe.num_experts, spec.moe.top_k)
    }

    pub fn with_shape(num_layers: usize, num_experts: usize, top_k: usize) -> Self {
        let tally = LayerTally { counts: vec![0; num_experts], ..Default::default() };
        RoutingAnalysis { tallies: vec![tally; num_layers], top_k, pending: None }
    }

    /// Call between independent sequences so overlap is not counted across them.
    pub fn start_sequence(&mut self) {
        self.pending = None;
        for t in &mut self.tallies {
            t.last = None;
        }
    }

    pub fn report(&self) -> Vec<LayerReport> {
        self.tallies
            .iter()
            .enumerate()
            .filter(|(_, t)| t.rows > 0)
            .map(|(layer, t)| {
                let total: u64 = t.counts.iter().sum();
                let mut sorted = t.counts.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let e = sorted.len();
                let share = |n: usize, from_top: bool| {
                    let s: u64 = if from_top { sorted[..n].iter().sum() } else { sorted[e - n..].iter().sum() };
                    s as f64 / total as f64
                };
                let entropy = -t
                    .counts
                    .iter()
                    .filter(|c| **c > 0)
                    .map(|c| {
                        let p = *c as f64 / total as f64;
                        p * p.log2()
                    })
                    .sum::<f64>();
                LayerReport {
                    layer,
                    selections: total,
                    entropy_bits: entropy,
                    max_entropy_bits: (e as f64).log2(),
                    hottest_10pct_share: share(e.div_ceil(10), true),
                    coldest_half_share: share(e / 2, false),
                    next_layer_recall: (t.predicted_total > 0).then(|| t.predicted_hits as f64 / t.predicted_total as f64),
                    consecutive_overlap: if t.repeat_total > 0 { t.repeat_hits as f64 / t.repeat_total as f64 } else { 0.0 },
                }
            })
            .collect()
    }
}

fn overlap(a: &[u32], b: &[u32]) -> u64 {
    a.iter().filter(|e| b.contains(e)).count() as u64
}

impl MoeObserver for RoutingAnalysis {
    fn moe_layer(&mut self, layer: usize, _rows: &[f32], experts: &[u32], _weights: &[f32]) {
        let k = self.top_k;
        let t = &mut self.tallies[layer];
        for row in experts.chunks_exact(k) {
            for e in row {
                t.counts[*e as usize] += 1;
            }
            if let Some(last) = &t.last {
                t.repeat_hits += overlap(row, last);
                t.repeat_total += k as u64;
            }
            t.last = Some(row.to_vec());
            t.rows += 1;
        }
        if let Some((want_layer, predicted)) = self.pending.take() {
            if want_layer == layer {
                for (p, real) in predicted.chunks_exact(k).zip(experts.chunks_exact(k)) {
                    t.predicted_hits += overlap(p, real);
                    t.predicted_total += k as u64;
                }
            }
        }
    }

    fn wants_lookahead(&self) -> bool {
        true
    }

    fn lookahead(&mut self, _layer: usize, next_layer: usize, predicted: &[u32]) {
        self.pending = Some((next_layer, predicted.to_vec()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_match_a_hand_computed_trace() {
        // Layers: MoE, dense, MoE; 4 experts, top-2. The lookahead from layer 0 says {0, 1} for every row.
        let mut a = RoutingAnalysis::with_shape(3, 4, 2);
        let rows = [0.0f32; 3]; // three rows of hidden size 1
        a.start_sequence();
        a.moe_layer(0, &rows, &[0, 1, 0, 2, 0, 1], &[0.5; 6]);
        a.lookahead(0, 2, &[0, 1, 0, 1, 0, 1]);
        a.moe_layer(2, &rows, &[0, 1, 2, 3, 1, 2], &[0.5; 6]);
        let r = a.report();
        assert_eq!(r.len(), 2);
        // Layer 0 counts [3, 2, 1, 0] over 6 selections.
        let p = [0.5f64, 1.0 / 3.0, 1.0 / 6.0];
        let h: f64 = -p.iter().map(|x| x * x.log2()).sum::<f64>();
        assert!((r[0].entropy_bits - h).abs() < 1e-12);
        assert_eq!(r[0].max_entropy_bits, 2.0);
        assert!((r[0].hottest_10pct_share - 0.5).abs() < 1e-12); // ceil(0.4) = 1 expert
        assert!((r[0].coldest_half_share - 1.0 / 6.0).abs() < 1e-12);
        assert_eq!(r[0].next_layer_recall, None);
        // Consecutive rows {0,1}→{0,2}→{0,1}: overlaps 1 and 1 of 2 each.
        assert!((r[0].consecutive_overlap - 0.5).abs() < 1e-12);
        // Layer 2 is predicted from layer 0 (the dense layer is skipped): {0,1} vs {0,1},{2,3},{1,2}.
        assert!((r[1].next_layer_recall.unwrap() - (2.0 + 0.0 + 1.0) / 6.0).abs() < 1e-12);
        // A new sequence forgets the last row.
        a.start_sequence();
        a.moe_layer(0, &rows[..1], &[3, 2], &[0.5; 2]);
        assert!((a.report()[0].consecutive_overlap - 0.5).abs() < 1e-12);
    }
}
