//! What a worker says about itself (the status reply's JSON), and the 64-bit model identity
//! frames carry.

use serde::{Deserialize, Serialize};

/// What a worker says about itself (the status reply's JSON).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerStatus {
    pub name: String,
    pub epoch: u64,
    /// Experts the placement gives it.
    pub assigned_experts: usize,
    /// Whether it loads, from its own disk, experts the placement gives others (failover).
    pub loads_unassigned: bool,
    /// RAM for experts, one expert's bytes, and how many fit.
    pub budget_bytes: u64,
    pub expert_bytes: u64,
    pub capacity_experts: u64,
    /// Experts in RAM now.
    pub resident_experts: usize,
    pub requests: u64,
    pub disk_reads: u64,
}

/// The 64-bit model identity frames carry: the model fingerprint's checksum.
pub fn model_id(fingerprint: &str) -> u64 {
    shimmer_common::checksum::xxh3(fingerprint.as_bytes())
}
