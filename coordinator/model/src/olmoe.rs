//! OLMoE (`OlmoeForCausalLM`): Llama-style names; QK-norm over the whole q/k projection and
//! `clip_qkv` come from the spec; softmax top-k without renormalisation unless `norm_topk_prob`.

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

use super::decoder::{Decoder, TensorNames};

pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec, &TensorNames::LLAMA)
}
