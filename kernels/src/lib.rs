//! shimmer-kernels: the math, and nothing but the math.
//!
//! Owns: matrix-vector and matrix-matrix products over every weight format (f32 activations for
//! float and fp8 weights; int8-quantised activations and integer dot products for int8, int4 and
//! MXFP4 weights, `qdot`), RMSNorm, softmax,
//! SiLU, rotary embedding application, attention over a KV slice, and the fixed-point row
//! accumulator that makes expert sums independent of where and in what order they were formed,
//! and the transposes of batched products' results (`transpose`);
//! and the team of threads a forward step's small products are split over (`team`); and whether
//! this process can use AMX tiles (`amx`: detected and self-tested, used by no product).
//!
//! Invariants:
//! - Every kernel has a plain scalar reference (`reference` module) and a test against it.
//! - Batch invariance: a row's result is bit-identical whether it is computed alone or in a batch
//!   with any other rows (each row is computed by the same code with the same summation order).
//!
//! Must never: know a model family or a tensor name, read files, allocate on a per-row basis in
//! the hot loops beyond the output buffers the caller hands in.

pub mod aligned;
pub mod amx;
pub mod attention;
pub mod dot;
pub mod fixed;
pub mod gating;
pub mod huge_pages;
pub mod matrix;
pub mod ops;
pub mod qdot;
pub mod reference;
pub mod team;
pub mod transpose;
pub mod words;

pub use fixed::{FixedPointOverflow, FIXED_SCALE};
pub use matrix::{Activations, Matrix, WeightData};
