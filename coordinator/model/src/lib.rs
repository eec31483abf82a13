//! shimmer-model: the dense model — everything of a forward pass but the routed experts.
//!
//! Owns: the one decoder every family shares, attention (GQA and MLA), RoPE tables, routers, the
//! KV cache, and the family files that say where each family's tensors live.
//!
//! Must never: link an async runtime, a socket or TLS (`cargo tree -e normal -p shimmer-model`
//! shows no tokio, quinn or rustls); touch a routed expert except through `ExpertDispatch`;
//! read a clock for anything but the phase timings it reports.
//!
//! `decoder.rs` is the one shared mechanism for decoder-only MoE transformers: GQA attention
//! (optional QK-norm, clip, biases, partial or interleaved rotary, sliding window) or multi-head
//! latent attention (`mla.rs`), RMSNorm, RoPE (`rope.rs`), dense SwiGLU MLPs, shared experts and
//! the routers (`router.rs`); a fix there reaches every family. Each family file only says where its tensors
//! live and which options it uses. Routed experts never pass through here: the decoder hands
//! each MoE layer's rows and selections to an `ExpertDispatch`.

pub mod decoder;
pub mod deepseek_v3;
pub mod glm4_moe;
pub mod kv_cache;
pub mod mixtral;
pub mod mla;
pub mod olmoe;
pub mod qwen3_moe;
pub mod rope;
pub mod router;

use shimmer_common::{Checkpoint, Family, LoadError, ModelSpec};

pub use decoder::{Decoder, ForwardError, Logits, MoeObserver, NoObserver, PhaseTimes, Segment, Tee};

/// Loads the dense part of the model the spec describes.
pub fn load_dense(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    match spec.family {
        Family::Olmoe => olmoe::load(ckpt, spec),
        Family::Qwen3Moe => qwen3_moe::load(ckpt, spec),
        Family::Mixtral => mixtral::load(ckpt, spec),
        Family::DeepseekV3 => deepseek_v3::load(ckpt, spec),
        Family::Glm4Moe => glm4_moe::load(ckpt, spec),
    }
}
