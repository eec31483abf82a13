//! Rotary position embedding tables from the spec's `RopeSpec` (default, linear, llama3, YaRN),
//! computed as transformers computes `inv_freq` (f32) and cos/sin of `position · inv_freq`, times
//! the scaling's attention factor (YaRN's mscale).

use shimmer_common::spec::{RopeScaling, RopeSpec};

pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl Rope {
    /// Tables for the `head_dim` leading dims of a head that rotate.
    pub fn new(spec: &RopeSpec, head_dim: usize) -> Self {
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|j| {
                let exponent = (2 * j) as f32 / head_dim as f32;
                1.0f32 / (spec.theta.powf(exponent as f64) as f32)
            })
            .collect();
        let mut attention_factor = 1.0f32;
        match spec.scaling {
            RopeScaling::None => {}
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor: af, truncate, .. } => {
                let dim = head_dim as f64;
                let base = spec.theta;
                let correction_dim =
                    |rotations: f64| dim * (original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                for (j, f) in inv_freq.iter_mut().enumerate() {
                    let ramp = ((j as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let pos_freq = 1.0 / *f;
                    let interpolated = 1.0 / (factor as f32 * pos_freq);
                    *f = interpolated * (1.0 - extrapolation) + *f * extrapolation;
                }
                attention_factor = af as f32;
            }
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f as f64;
                    let scaled = if wavelen > low_wavelen { *f as f64 / factor } else { *f as f64 };
                    #[allow(clippy::neg_cmp_op_on_partial_ord)] // transformers' own expression, NaN included
                    let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                    *f = if medium {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                    } else {
                        scaled as f32
                    };
                }
            }
        }
        Rope { inv_freq, attention_factor }
    }

    /// cos and sin (each head_dim/2 long) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (j, f) in self.inv_freq.iter().enumerate() {
            let angle = (position as f32 * f) as f64;
            cos[j] = angle.cos() as f32 * self.attention_factor;
            sin[j] = angle.sin() as f32 * self.attention_factor;
        }
    }
}
