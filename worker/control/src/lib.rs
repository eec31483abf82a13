//! shimmer-control: the cluster's control plane without a network — the replicated state
//! (`state`), one member's Raft node over raft-rs (`node`), its durable log (`log_store`, redb
//! under `--data-dir`), and the join token (`token`). `shimmer-worker` drives it over tonic
//! gRPC; `tests/simulation.rs` drives several over a seeded in-memory network with crashes and
//! partitions.
//!
//! Raft messages are raft-rs's protobuf (the `protobuf` 2.x crate, which carries a RustSec
//! advisory for stack overflow on deeply nested input): they are decoded only from peers whose
//! connection proved the cluster's token (docs/cluster.md).
//!
//! Must never: read a clock, open a socket, or start a thread or runtime; apply an entry
//! differently on two members; drop an entry raft-rs was told is persisted.

pub mod envelope;
pub mod log_store;
pub mod node;
pub mod placer;
pub mod state;
pub mod token;

pub use log_store::{LogError, RaftLog};
pub use node::{ControlNode, NodeConfig, NodeError, NodeStatus, Output};
pub use raft::eraftpb::Message as RaftMessage;
pub use raft::StateRole;
pub use state::{ClusterState, Command, Member, MemberChange, ModelPlacement, NodeId, NodeKind, Outcome, PlacementRecord};
pub use token::ClusterToken;
