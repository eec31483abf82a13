//! Replays a routing trace through the cache policies at one capacity and reports, per MoE layer
//! and overall: expert heat, next-layer predictability, and the demand hit rates of LRU, LFU,
//! LRU with learned pins, LRU with pins and one-layer-ahead prefetch, and Belady's optimum. The
//! gap to Belady is how every policy is judged.

use shimmer_common::trace::Trace;

use crate::policy::{belady, CachePolicy, Key, LayerLfu, LayerLru};

#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub hit_rate: f64,
    pub per_layer: Vec<f64>,
    /// Reads issued by prefetch (0 for demand-only policies).
    pub prefetch_reads: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceReport {
    pub tokens: usize,
    pub moe_layers: usize,
    pub experts: u32,
    pub top_k: u32,
    pub capacity_experts: usize,
    pub slots_per_layer: usize,
    /// Per layer: share of selections taken by the hottest ceil(10%) of experts.
    pub hottest_10pct_share: Vec<f64>,
    /// Per layer (from the second): recall@k of the previous layer's lookahead prediction.
    pub next_layer_recall: Vec<Option<f64>>,
    pub policies: Vec<PolicyResult>,
}

/// The hottest experts of each layer by selection count, hottest first.
pub fn heat_order(trace: &Trace) -> Vec<Vec<u16>> {
    let (l, e) = (trace.header.layers.len(), trace.header.experts as usize);
    let mut counts = vec![vec![0u64; e]; l];
    for t in &trace.tokens {
        for (layer, sel) in t.selected.iter().enumerate() {
            for x in sel {
                counts[layer][*x as usize] += 1;
            }
        }
    }
    counts
        .iter()
        .map(|c| {
            let mut order: Vec<u16> = (0..e as u16).collect();
            order.sort_by(|a, b| c[*b as usize].cmp(&c[*a as usize]).then(a.cmp(b)));
            order.retain(|x| c[*x as usize] > 0);
            order
        })
        .collect()
}

fn replay(trace: &Trace, policy: &mut dyn CachePolicy) -> PolicyResult {
    let layers = trace.header.layers.len();
    let (mut hits, mut total) = (vec![0u64; layers], vec![0u64; layers]);
    let mut prefetch_reads = 0;
    for t in &trace.tokens {
        for l in 0..layers {
            let mut keys: Vec<Key> = t.selected[l].iter().map(|e| (l as u16, *e)).collect();
            crate::policy::batch_order(policy, &mut keys);
            for key in keys {
                total[l] += 1;
                if policy.access(key) {
                    hits[l] += 1;
                }
            }
            if l + 1 < layers {
                for e in &t.predicted[l] {
                    if policy.hint(((l + 1) as u16, *e)) {
                        prefetch_reads += 1;
                    }
                }
            }
        }
    }
    summarize(policy.name(), &hits, &total, prefetch_reads)
}

fn summarize(policy: String, hits: &[u64], total: &[u64], prefetch_reads: u64) -> PolicyResult {
    let rate = |h: u64, t: u64| if t == 0 { 0.0 } else { h as f64 / t as f64 };
    PolicyResult {
        policy,
        hit_rate: rate(hits.iter().sum(), total.iter().sum()),
        per_layer: hits.iter().zip(total).map(|(h, t)| rate(*h, *t)).collect(),
        prefetch_reads,
    }
}

/// Analyses `trace` with room for `capacity_experts` experts in all (split evenly per layer for
/// the per-layer policies; Belady gets the same total).
pub fn analyze(trace: &Trace, capacity_experts: usize) -> TraceReport {
    let h = &trace.header;
    let layers = h.layers.len();
    let slots = capacity_experts / layers;
    let order = heat_order(trace);
    // Pins: the hottest experts of each layer fill half its slots; LRU manages the rest. Heat is
    // learned from this same trace, as a usage file from an earlier run of the workload would give.
    let pins: Vec<Vec<u16>> = order.iter().map(|o| o.iter().take(slots / 2).copied().collect()).collect();
    let mut policies = vec![
        replay(trace, &mut LayerLru::new(layers, slots)),
        replay(trace, &mut LayerLfu::new(layers, slots)),
        replay(trace, &mut LayerLru::new(layers, slots).with_pins(pins.clone())),
        replay(trace, &mut LayerLru::new(layers, slots).with_pins(pins).with_prefetch(h.top_k as usize)),
    ];
    let accesses: Vec<Key> =
        trace.tokens.iter().flat_map(|t| t.selected.iter().enumerate().flat_map(|(l, sel)| sel.iter().map(move |e| (l as u16, *e)))).collect();
    let flags = belady(&accesses, slots * layers);
    let (mut hits, mut total) = (vec![0u64; layers], vec![0u64; layers]);
    for (k, hit) in accesses.iter().zip(&flags) {
        total[k.0 as usize] += 1;
        hits[k.0 as usize] += *hit as u64;
    }
    policies.push(summarize("Belady (optimal)".into(), &hits, &total, 0));

    let k = h.top_k as usize;
    let hottest = (h.experts as usize).div_ceil(10);
    let hottest_10pct_share = (0..layers)
        .map(|l| {
            let mut counts = vec![0u64; h.experts as usize];
            for t in &trace.tokens {
                for e in &t.selected[l] {
                    counts[*e as usize] += 1;
                }
            }
            counts.sort_unstable_by(|a, b| b.cmp(a));
            let all: u64 = counts.iter().sum();
            if all == 0 {
                0.0
            } else {
                counts[..hottest].iter().sum::<u64>() as f64 / all as f64
            }
        })
        .collect();
    let next_layer_recall = (0..layers)
        .map(|l| {
            (l > 0).then(|| {
                let (mut hit, mut all) = (0u64, 0u64);
                for t in &trace.tokens {
                    hit += t.predicted[l - 1].iter().filter(|e| t.selected[l].contains(e)).count() as u64;
                    all += k as u64;
                }
                if all == 0 {
                    0.0
                } else {
                    hit as f64 / all as f64
                }
            })
        })
        .collect();
    TraceReport {
        tokens: trace.tokens.len(),
        moe_layers: layers,
        experts: h.experts,
        top_k: h.top_k,
        capacity_experts: slots * layers,
        slots_per_layer: slots,
        hottest_10pct_share,
        next_layer_recall,
        policies,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shimmer_common::trace::{TokenRecord, TraceHeader};

    #[test]
    fn a_replayed_trace_ranks_belady_first_and_prefetch_helps_when_predictions_are_right() {
        // Two layers, 16 experts, top-2; layer 1 always uses what layer 0's lookahead predicted.
        let mut s = 3u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u16
        };
        let tokens: Vec<TokenRecord> = (0..400)
            .map(|_| {
                let a = [next() % 16, next() % 16];
                let a = if a[0] == a[1] { [a[0], (a[0] + 1) % 16] } else { a };
                let b = [next() % 16, next() % 16];
                let b = if b[0] == b[1] { [b[0], (b[0] + 1) % 16] } else { b };
                TokenRecord { selected: vec![a.to_vec(), b.to_vec()], predicted: vec![b.to_vec(), vec![]] }
            })
            .collect();
        let trace = Trace { header: TraceHeader { layers: vec![0, 1], experts: 16, top_k: 2 }, tokens, dropped_bytes: 0 };
        let r = analyze(&trace, 8);
        assert_eq!((r.slots_per_layer, r.capacity_experts), (4, 8));
        let rate = |name: &str| r.policies.iter().find(|p| p.policy == name).unwrap().hit_rate;
        let opt = rate("Belady (optimal)");
        for p in &r.policies {
            if p.prefetch_reads == 0 {
                assert!(p.hit_rate <= opt + 1e-12, "{} beats Belady", p.policy);
            }
        }
        // Perfect lookahead: every layer-1 access was prefetched just before, once the layer's
        // first hints (judged unread) had proved right.
        let pf = r.policies.iter().find(|p| p.policy == "LRU+pins+prefetch").unwrap();
        assert!(pf.per_layer[1] > 0.97, "layer 1 hit rate {}", pf.per_layer[1]);
        assert!(pf.prefetch_reads > 0);
        assert_eq!(r.next_layer_recall, vec![None, Some(1.0)]);
    }
}
