//! Rotary position embedding tables from the spec's `RopeSpec` (default, linear, llama3, YaRN),
//! computed as transformers computes `inv_freq` (f32) and cos/sin of `position · inv_freq`, times
//! the scaling's attention factor (YaRN's mscale).
//!
//! Owns: the frequencies and a table of cos/sin by position, filled block by block on first use
//! (every layer asks for the same positions; a decode step of the demo model spent ~1.5 % of its
//! time in `sincos`). Must never: give a position different values from the table than computed
//! (the table holds what `compute` gives, bit for bit).

use std::sync::OnceLock;

use shimmer_common::spec::{RopeScaling, RopeSpec};

/// Positions per block of the table.
const BLOCK: usize = 64;
/// Positions the table covers; beyond them cos/sin are computed per call. A position takes
/// `head_dim` floats (1 kB at 256), so the table stays under 32 MB however long the context.
const TABLE_POSITIONS: usize = 32 * 1024;

pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    /// Per block of `BLOCK` positions: each position's cos then its sin (`inv_freq.len()` each).
    blocks: Vec<OnceLock<Box<[f32]>>>,
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
        Rope { inv_freq, attention_factor, blocks: (0..TABLE_POSITIONS / BLOCK).map(|_| OnceLock::new()).collect() }
    }

    /// cos and sin (each head_dim/2 long) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.inv_freq.len();
        let Some(block) = self.blocks.get(position / BLOCK) else {
            return self.compute(position, cos, sin);
        };
        let table = block.get_or_init(|| {
            let mut t = vec![0.0f32; BLOCK * 2 * half];
            for (i, row) in t.chunks_exact_mut(2 * half).enumerate() {
                let (c, s) = row.split_at_mut(half);
                self.compute(position / BLOCK * BLOCK + i, c, s);
            }
            t.into_boxed_slice()
        });
        let row = &table[position % BLOCK * 2 * half..][..2 * half];
        cos[..half].copy_from_slice(&row[..half]);
        sin[..half].copy_from_slice(&row[half..]);
    }

    fn compute(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (j, f) in self.inv_freq.iter().enumerate() {
            let angle = (position as f32 * f) as f64;
            cos[j] = angle.cos() as f32 * self.attention_factor;
            sin[j] = angle.sin() as f32 * self.attention_factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table gives every position what computing it gives, in any order of first use, in
    /// and past the table.
    #[test]
    fn the_table_holds_what_is_computed() {
        let spec = RopeSpec { theta: 1e6, scaling: RopeScaling::Linear { factor: 4.0 } };
        let rope = Rope::new(&spec, 96);
        let half = 48;
        let positions = [TABLE_POSITIONS + 7, 0, 1, BLOCK - 1, BLOCK, 5 * BLOCK + 3, 1, TABLE_POSITIONS - 1, TABLE_POSITIONS, 1 << 40];
        for p in positions {
            let (mut c, mut s, mut want_c, mut want_s) = (vec![0.0f32; half], vec![0.0f32; half], vec![0.0f32; half], vec![0.0f32; half]);
            rope.cos_sin(p, &mut c, &mut s);
            rope.compute(p, &mut want_c, &mut want_s);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!((bits(&c), bits(&s)), (bits(&want_c), bits(&want_s)), "position {p}");
            if p > 0 && p < TABLE_POSITIONS {
                assert!(c.iter().zip(&s).any(|(c, s)| *c != 1.0 || *s != 0.0), "position {p} rotates");
            }
        }
        assert_eq!(rope.blocks.iter().filter(|b| b.get().is_some()).count(), 4, "only the blocks used are filled");
    }
}
