//! GLM-4.5/4.6 MoE (`Glm4MoeForCausalLM`): GQA with partial rotary (`partial_rotary_factor`),
//! q/k/v biases but none on `o_proj`, optional per-head QK-norm, and the same sigmoid grouped
//! router with bias correction and shared experts as DeepSeek-V3 — all from the spec.

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

use super::decoder::{Decoder, TensorNames};

pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec, &TensorNames::LLAMA)
}
