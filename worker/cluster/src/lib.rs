//! shimmer-cluster: the cluster's protocol core, without I/O.
//!
//! Owns: the data plane's frames (`wire`), placement files, epochs and the planner
//! (`placement`), what a worker says about itself (`status`), each worker's health and backoff
//! (`links`), the per-layer dispatch and failover state machine with the fixed-point merge
//! (`core`), and the counters the coordinator keeps (`telemetry`). Everything here takes events
//! and `now` and returns decisions; `shimmer-worker` is the quinn/tokio driver that carries them
//! out, and the tests drive the same machine with simulated workers and a fake clock.
//!
//! Must never: open a socket, read a clock, sleep or start a thread or runtime (`cargo tree -e
//! normal -p shimmer-cluster` shows no tokio, quinn or rustls); trust a length it did not check;
//! add sums that are not the answer to the request sent.

pub mod core;
pub mod links;
pub mod placement;
pub mod status;
pub mod telemetry;
pub mod wire;

pub use crate::core::{Action, Answer, Assignment, Cluster, LayerDispatch, Step};
pub use placement::Placement;
pub use status::{model_id, WorkerStatus};
pub use telemetry::{ClusterTelemetry, Exchange, WorkerLink, RTT_BUCKETS};
