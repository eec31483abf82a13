//! One routed expert: a gated FFN, `down(act(gate·x, up·x))` — SwiGLU, or gpt-oss's clamped
//! SwiGLU with a bias after each projection.
//!
//! Must never: compute a row differently because of the rows beside it (every row's bits are
//! `forward`'s).

use shimmer_common::spec::ExpertActivation;
use shimmer_kernels::{gating, ops, Matrix};

pub struct Expert {
    /// `intermediate × hidden`.
    pub gate: Matrix,
    /// `intermediate × hidden`.
    pub up: Matrix,
    /// `hidden × intermediate`.
    pub down: Matrix,
    /// Biases added after each projection (gpt-oss); `None` for the families without.
    pub bias: Option<Box<ExpertBias>>,
    pub activation: ExpertActivation,
}

/// An expert's projection biases: `intermediate`, `intermediate` and `hidden` values.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertBias {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// Scratch for one FFN row, reused across rows and experts.
#[derive(Default)]
pub struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Expert {
    /// A SwiGLU expert without biases (every family but gpt-oss).
    pub fn new(gate: Matrix, up: Matrix, down: Matrix) -> Self {
        Expert { gate, up, down, bias: None, activation: ExpertActivation::Silu }
    }

    pub fn with_form(mut self, bias: Option<ExpertBias>, activation: ExpertActivation) -> Self {
        self.bias = bias.map(Box::new);
        self.activation = activation;
        self
    }

    /// Whether this is the plain form (SwiGLU, no biases) every accelerator kernel computes.
    pub fn is_plain_swiglu(&self) -> bool {
        self.bias.is_none() && self.activation == ExpertActivation::Silu
    }

    pub fn intermediate(&self) -> usize {
        self.gate.rows
    }

    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes() + self.bias.as_ref().map_or(0, |b| 4 * (b.gate.len() + b.up.len() + b.down.len()))
    }

    /// `out = FFN(x)` for one row.
    pub fn forward(&self, x: &[f32], scratch: &mut FfnScratch, out: &mut [f32]) {
        self.forward_rows(x, scratch, out, true)
    }

    /// `out[r] = FFN(xs[r])` for `n` rows back to back (`n × hidden` each side), reading each
    /// weight matrix once per group of rows; each row's result is exactly `forward`'s. On the
    /// calling thread only unless `parallel`.
    pub fn forward_rows(&self, xs: &[f32], scratch: &mut FfnScratch, out: &mut [f32], parallel: bool) {
        let (i, h) = (self.intermediate(), self.down.rows);
        let n = xs.len() / h.max(1);
        scratch.gate.resize(n * i, 0.0);
        scratch.up.resize(n * i, 0.0);
        // Gate and up in one pass over the input (same bits as two products).
        shimmer_kernels::matrix::matmul_pair(&self.gate, &self.up, xs, &mut scratch.gate, &mut scratch.up, parallel);
        if let Some(b) = &self.bias {
            add_rows(&mut scratch.gate, &b.gate);
            add_rows(&mut scratch.up, &b.up);
        }
        match self.activation {
            ExpertActivation::Silu => ops::swiglu_in_place(&mut scratch.gate, &scratch.up),
            ExpertActivation::ClampedSwiglu { alpha, limit } => gating::clamped_swiglu_in_place(&mut scratch.gate, &scratch.up, alpha, limit),
            ExpertActivation::ClampedSilu { limit } => gating::clamped_silu_in_place(&mut scratch.gate, &scratch.up, limit),
            ExpertActivation::SoftcappedSwiglu { gate_cap, up_cap } => gating::softcapped_swiglu_in_place(&mut scratch.gate, &scratch.up, gate_cap, up_cap),
        }
        self.down.matmul_on(&scratch.gate, out, parallel);
        if let Some(b) = &self.bias {
            add_rows(out, &b.down);
        }
    }
}

fn add_rows(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len().max(1)) {
        row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
    }
}
