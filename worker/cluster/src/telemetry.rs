//! What the coordinator counts about its workers: per link round trips, bytes, selections,
//! errors and a histogram of request round-trip times; overall tokens, network wait, failovers and
//! the placement epoch. Plain data, serialisable for the dashboard and `generate --json`.

use std::time::Duration;

use serde::Serialize;

use crate::status::WorkerStatus;

/// Upper bounds (seconds) of the round-trip histogram's buckets; the last bucket is +Inf.
pub const RTT_BUCKETS: &[f64] = &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Running totals for one worker.
#[derive(Debug, Default, Clone)]
pub struct LinkCounters {
    pub requests: u64,
    pub selections: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub errors: u64,
    pub rtt_buckets: [u64; RTT_BUCKETS.len() + 1],
    pub rtt_sum: f64,
}

/// One request's exchange with a worker, as the driver measured it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Exchange {
    pub sent: usize,
    pub received: usize,
    pub took: Duration,
}

impl LinkCounters {
    pub fn record(&mut self, exchange: Exchange, selections: usize, ok: bool) {
        self.requests += 1;
        self.bytes_sent += exchange.sent as u64;
        self.bytes_received += exchange.received as u64;
        if ok {
            self.selections += selections as u64;
        } else {
            self.errors += 1;
        }
        let s = exchange.took.as_secs_f64();
        self.rtt_buckets[RTT_BUCKETS.iter().position(|b| s <= *b).unwrap_or(RTT_BUCKETS.len())] += 1;
        self.rtt_sum += s;
    }
}

/// One worker as the coordinator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerLink {
    pub name: String,
    pub addr: String,
    pub up: bool,
    /// QUIC's smoothed path RTT estimate (the network alone), when connected.
    pub path_rtt_ms: Option<f64>,
    /// (layer, expert) pairs the placement lists it for, and those it is first choice for.
    pub placed_experts: usize,
    pub first_choice_experts: usize,
    pub requests: u64,
    pub selections: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub errors: u64,
    /// Request round trips (network and the worker's compute) per `RTT_BUCKETS` bucket (not
    /// cumulative; the last is +Inf), and their sum.
    pub rtt_buckets: Vec<u64>,
    pub rtt_sum_s: f64,
    /// What the worker last said about itself.
    pub status: Option<WorkerStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClusterTelemetry {
    pub workers: Vec<WorkerLink>,
    /// Rows that went through the first MoE layer: tokens prefilled or decoded.
    pub tokens: u64,
    pub round_trips: u64,
    pub network_wait_s: f64,
    pub failovers: u64,
    pub placement_epoch: u64,
}
