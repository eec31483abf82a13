//! Choosing the next token from logits: greedy, or sampled with repetition penalty, temperature,
//! top-k, top-p and min-p applied in that order (the order transformers applies its processors).
//! A seeded SplitMix64 stream makes sampling reproducible across runs and platforms.

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 0 disables.
    pub min_p: f32,
    /// 1.0 disables; >1 discourages tokens already in the context (prompt and output).
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Names the first parameter outside its range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let state = params.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { params, state }
    }

    fn next_unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token. `context` holds the ids the repetition penalty looks at.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in context {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        let l = &mut logits[t as usize];
                        *l = if *l < 0.0 { *l * p.repetition_penalty } else { *l / p.repetition_penalty };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits) as u32;
        }
        let mut cand: Vec<(usize, f32)> = logits.iter().map(|l| l / p.temperature).enumerate().collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (at least one token).
            let mut mass = 0.0;
            let mut keep = probs.len();
            for (i, x) in probs.iter().enumerate() {
                mass += x;
                if mass >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            let keep = probs.iter().take_while(|x| **x >= floor).count().max(1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.next_unit() * total;
        for (i, x) in probs.iter().enumerate() {
            if r < *x {
                return cand[i].0 as u32;
            }
            r -= x;
        }
        cand[probs.len() - 1].0 as u32
    }
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9]
    }

    #[test]
    fn greedy_is_argmax_and_seeded_sampling_repeats() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut logits(), &[]), 1);
        let params = SamplingParams { temperature: 1.0, seed: 42, ..Default::default() };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&mut logits(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(&params), run(&params));
        assert_ne!(run(&params), run(&SamplingParams { seed: 43, ..params.clone() }));
        let draws = run(&params);
        assert!(draws.iter().any(|t| *t != 1), "temperature 1 should not always pick the argmax");
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let draws = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&mut logits(), &[])).collect::<std::collections::BTreeSet<_>>()
        };
        let base = SamplingParams { temperature: 1.0, seed: 1, ..Default::default() };
        assert_eq!(draws(SamplingParams { top_k: 2, ..base.clone() }), [1, 5].into());
        // softmax of [3, 2.9, 2.5, ...]: the top one holds 0.37 of the mass, the top two 0.70; top_p 0.5 keeps two.
        assert_eq!(draws(SamplingParams { top_p: 0.5, ..base.clone() }), [1, 5].into());
        // min_p 0.7: keep tokens with p >= 0.7·p_max, i.e. logit >= 3 + ln 0.7 ≈ 2.64.
        assert_eq!(draws(SamplingParams { min_p: 0.7, ..base.clone() }), [1, 5].into());
        assert!(draws(base.clone()).len() >= 4);
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() });
        // Token 1 (3.0) becomes 1.5, so 5 (2.9) wins.
        assert_eq!(s.sample(&mut logits(), &[1, 1]), 5);
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
    }
}
