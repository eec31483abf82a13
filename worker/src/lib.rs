//! shimmer-worker: owns experts.
//!
//! Owns: expert weights and their SwiGLU FFN, and the `ExpertDispatch` contract through which the
//! coordinator's dense forward hands each MoE layer's rows and (expert, weight) selections to
//! whoever holds the experts. Three dispatchers implement it: in-process (everything in RAM), the
//! tiered store (RAM/NVMe, prefetch), and `remote` (experts on workers over QUIC, whose service is
//! `server` over the same store); `wire`, `transport` and `placement` are the data plane's
//! frames, links and expert-to-worker map.
//!
//! Must never: route (the selections arrive decided), skip, substitute or re-weight an expert,
//! answer for an expert no node could compute (an error instead), or know a model family: tensor
//! names come from the spec's templates.

pub mod container;
pub mod convert;
pub mod dispatch;
pub mod expert;
pub mod placement;
pub mod policy;
pub mod remote;
pub mod server;
pub mod store;
pub mod trace_analysis;
pub mod transport;
pub mod usage;
pub mod weights;
pub mod wire;

pub use dispatch::{DispatchError, ExpertDispatch, InProcessExperts, MoeBatch};
pub use expert::Expert;
