//! shimmer-common: what every other crate agrees on about a model.
//!
//! Owns: model specs read from `config.json` (the family table), safetensors checkpoints read
//! through `memmap2` with every tensor checked against the spec, the tokenizer, chat templates and
//! the stop-token set.
//!
//! Must never: start an async runtime, choose an I/O policy (caching, prefetch, placement), do
//! model math, or know how a request arrived. Errors name the file and the problem; nothing here
//! panics on input.

pub mod chat_template;
pub mod checkpoint;
pub mod checksum;
pub mod error;
pub mod expert_blob;
pub mod families;
pub mod gguf;
pub mod json;
pub mod quant;
pub mod spec;
pub mod tiktoken;
pub mod tokenizer;
pub mod trace;

pub use checkpoint::{Checkpoint, DType, RawTensor, TensorView};
pub use error::LoadError;
pub use safetensors::tensor::Dtype as StDtype;
pub use spec::ModelSpec;
