//! DeepSeek-V3 (`DeepseekV3ForCausalLM`; also Kimi K2 and other derivatives): multi-head latent
//! attention (`mla.rs`, with or without `q_lora_rank`, interleaved rotary by default, YaRN), the
//! first `first_k_dense_replace` layers dense, then sigmoid group-limited routing with
//! `e_score_correction_bias` and shared experts — all from the spec.

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

use super::decoder::{Decoder, TensorNames};

pub fn load(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec, &TensorNames::LLAMA)
}
