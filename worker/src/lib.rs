//! shimmer-worker: the cluster's network, on quinn and tokio.
//!
//! Owns: QUIC endpoints with the join-token proof and operator mTLS (`transport`), a worker's
//! service that answers expert requests from its store (`server`, `shimmer worker`), and the
//! coordinator's driver of the sans-IO cluster core (`remote`: `RemoteExperts`, an
//! `ExpertDispatch` whose experts live on workers).
//!
//! Must never: decide what `shimmer-cluster` decides (who serves a selection, failover, backoff,
//! the merge of partial sums) — this crate carries decisions out and reports what happened; route,
//! skip, substitute or re-weight an expert; compute for another model or placement epoch.

pub mod control;
pub mod remote;
pub mod server;
pub mod transport;

pub use remote::{HeatCounter, PlacementFeed, RemoteExperts, RoundGate, Timeouts};
