//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Llama-style names; per-head QK RMSNorm, explicit
//! `head_dim`, dense layers among MoE layers (`decoder_sparse_step`, `mlp_only_layers`) and the
//! optional sliding window all come from the spec.

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

use super::decoder::{Decoder, TensorNames};

pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec, &TensorNames::LLAMA)
}
