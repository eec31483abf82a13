//! Mixtral (`MixtralForCausalLM`): its router lives under `block_sparse_moe` (the experts' `w1/w3/w2`
//! names are in the spec entry); no QK-norm; sliding-window attention when the config sets it.

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

use super::decoder::{Decoder, TensorNames};

pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec, &TensorNames::LLAMA)
}
