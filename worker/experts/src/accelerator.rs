//! The seam to a faster place to compute experts than this CPU — a GPU's VRAM tier
//! (`shimmer-gpu`) — consulted by every dispatcher that computes experts (`apply_experts`, the
//! store), so a model family or a tier never learns which device computed what.
//!
//! The contract: an accelerator computes an expert with the CPU's bits or not at all. Whatever it
//! does not compute (`None`) is computed on the CPU by the caller; the outputs of both are added
//! by the same fixed-point sum. So an accelerator changes speed, never a token.
//!
//! Must never: return an output it did not compute in full; block on anything but its own device.

use crate::Expert;

/// One expert a step wants computed over the rows that chose it.
pub struct AccelJob<'a> {
    pub expert: u32,
    /// Its weights in RAM; `None` when the caller relies on the accelerator holding it
    /// (`Accelerator::holds`) and has no copy at hand.
    pub weights: Option<&'a Expert>,
    /// `n × hidden`, row-major.
    pub rows: &'a [f32],
}

pub trait Accelerator: Send + Sync {
    /// Whether `expert` of `layer` is held there now (a caller may then skip reading it).
    fn holds(&self, layer: usize, expert: u32) -> bool;

    /// Each job's outputs (`n × hidden`), or `None` for the caller to compute on the CPU.
    fn forward(&self, layer: usize, jobs: &[AccelJob<'_>]) -> Vec<Option<Vec<f32>>>;

    /// Bytes of experts it may hold (a store splits its learned pins by it: the hottest here).
    fn capacity_bytes(&self) -> u64 {
        0
    }

    /// Keep these (layer, expert) pairs once they are uploaded: the hottest by learned heat.
    fn pin(&self, _experts: &[(usize, u32)]) {}

    /// Uploads `expert` of `layer` (one of the pins) ahead of its first use, if it fits beside
    /// what is held; computes nothing. Whether it is held now.
    fn warm(&self, _layer: usize, _expert: u32, _weights: &Expert) -> bool {
        false
    }

    /// The CPU computed experts it declined, of `byte_rows` (expert bytes × rows), in `elapsed`:
    /// what it weighs an upload against.
    fn cpu_took(&self, _byte_rows: u64, _elapsed: std::time::Duration) {}
}
