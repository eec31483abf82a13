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
        let i = self.intermediate();
        scratch.gate.resize(i, 0.0);
        scratch.up.resize(i, 0.0);
        self.gate.matvec(x, &mut scratch.gate);
        self.up.matvec(x, &mut scratch.up);
        ops::swiglu_in_place(&mut scratch.gate, &scratch.up);
        self.down.matvec(&scratch.gate, out);
    }
}
