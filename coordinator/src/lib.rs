//! shimmer-coordinator: owns requests.
//!
//! Owns: requests — sampling and stopping, the engine (a dense model from `shimmer-model` and its
//! experts wherever they are), sessions, the HTTP API and dashboard (`server/`), and the `shimmer`
//! command line. Routed experts are reached only through `shimmer_experts::ExpertDispatch`.
//!
//! Must never: read or compute a routed expert directly, change routing because of where an
//! expert lives, or let a client's input reach a panic: bad input is an `EngineError` naming it.

pub mod bench;
pub mod cli;
pub mod constraint;
pub mod demo;
pub mod engine;
pub mod model_dir;
pub mod node;
pub mod node_http;
pub mod routing;
pub mod sampling;
pub mod server;
pub mod session_file;
pub mod template_sandbox;
pub mod trace_recorder;
pub mod tune_file;

pub use engine::{Engine, EngineError, FinishReason, GenerateOptions, Generation, Session};
