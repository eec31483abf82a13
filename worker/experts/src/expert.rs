//! One routed expert: a SwiGLU FFN, `down(silu(gate·x) ⊙ up·x)`.

use shimmer_kernels::{ops, Matrix};

pub struct Expert {
    /// `intermediate × hidden`.
    pub gate: Matrix,
    /// `intermediate × hidden`.
    pub up: Matrix,
    /// `hidden × intermediate`.
    pub down: Matrix,
}

/// Scratch for one FFN row, reused across rows and experts.
#[derive(Default)]
pub struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Expert {
    pub fn intermediate(&self) -> usize {
        self.gate.rows
    }

    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
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
        ops::swiglu_in_place(&mut scratch.gate, &scratch.up);
        self.down.matmul_on(&scratch.gate, out, parallel);
    }
}
