//! shimmer-experts: the expert contract.
//!
//! Owns: `MoeBatch` (one MoE layer's rows and their routed selections), the `ExpertDispatch`
//! trait through which the dense model hands a batch to whoever holds the experts, the
//! in-process dispatcher (every expert in this process's RAM), the seam to an accelerator (a
//! GPU's VRAM tier) that computes some experts with the same bits, the SwiGLU expert FFN, and the one
//! loader of weight matrices in their stored precision (dense layers and experts share it).
//!
//! Must never: depend on an async runtime, a socket or a file-system policy (`cargo tree -e
//! normal -p shimmer-experts` shows no tokio, quinn or rustls); route (selections arrive
//! decided), skip, substitute or re-weight an expert; know a model family (tensor names come from
//! the spec's templates); carry telemetry on the trait (observers read concrete types).

pub mod accelerator;
pub mod dispatch;
pub mod expert;
pub mod weights;

pub use accelerator::{AccelJob, Accelerator};
pub use dispatch::{DispatchError, ExpertDispatch, InProcessExperts, MoeBatch, ELSEWHERE};
pub use expert::Expert;
