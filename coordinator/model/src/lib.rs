//! shimmer-model: the dense model — everything of a forward pass but the routed experts.
//!
//! Owns: the one decoder every family shares, attention (GQA, MLA, DeepSeek-V4's compressed
//! attention) and the linear mixers, hyper-connections, RoPE tables, routers and the KV cache. A family is data here (`ModelSpec`, from its file in `shimmer_common::families`):
//! this crate names none.
//!
//! Must never: link an async runtime, a socket or TLS (`cargo tree -e normal -p shimmer-model`
//! shows no tokio, quinn or rustls); touch a routed expert except through `ExpertDispatch`;
//! read a clock for anything but the phase timings it reports.
//!
//! `decoder.rs` is the one shared mechanism for decoder-only MoE transformers: GQA attention
//! (optional QK-norm, clip, biases, partial or interleaved rotary, sliding window) or multi-head
//! latent attention (`mla.rs`), RMSNorm, RoPE (`rope.rs`), dense SwiGLU MLPs, shared experts and
//! the routers (`router.rs`); a fix there reaches every family. Where a family's tensors live and
//! which options it uses come from its spec. Routed experts never pass through here: the decoder
//! hands each MoE layer's rows and selections to an `ExpertDispatch`.

mod compressed;
pub mod decoder;
mod gated_delta;
mod hyper;
pub mod kv_cache;
pub mod mla;
mod relative;
pub mod rope;
pub mod router;

use shimmer_common::{Checkpoint, LoadError, ModelSpec};

pub use decoder::{Decoder, ForwardError, Logits, MoeObserver, NoObserver, PhaseTimes, Segment, Tee};

/// Loads the dense part of the model the spec describes (its tensor names are in the spec).
pub fn load_dense(ckpt: &Checkpoint, spec: &ModelSpec) -> Result<Decoder, LoadError> {
    Decoder::load(ckpt, spec)
}
