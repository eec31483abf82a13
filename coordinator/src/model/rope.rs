//! Rotary position embedding tables from the spec's `RopeSpec` (default, linear, llama3), computed
//! as transformers computes `inv_freq` (f32) and cos/sin of `position · inv_freq`.

use shimmer_common::spec::{RopeScaling, RopeSpec};

pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(spec: &RopeSpec, head_dim: usize) -> Self {
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|j| {
                let exponent = (2 * j) as f32 / head_dim as f32;
                1.0f32 / (spec.theta.powf(exponent as f64) as f32)
            })
            .collect();
        match spec.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f as f64;
                    let scaled = if wavelen > low_wavelen { *f as f64 / factor } else { *f as f64 };
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
        Rope { inv_freq }
    }

    /// cos and sin (each head_dim/2 long) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (j, f) in self.inv_freq.iter().enumerate() {
            let angle = (position as f32 * f) as f64;
            cos[j] = angle.cos() as f32;
            sin[j] = angle.sin() as f32;
        }
    }
}
