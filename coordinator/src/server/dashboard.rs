//! What the web dashboard shows, kept up to date by the batcher: live throughput, time to first
//! token and the queue; the last finished turn's time by phase; the bytes experts were served
//! from, by tier; and the Brain — every (MoE layer, expert) with its routing heat and whether
//! the last step routed to it; on a cluster, the nodes (up or down, the experts each holds and
//! serves, link RTTs, bytes per token) and, on a member coordinator, the control plane (leader,
//! term, each member's Raft role, the placement epochs). `GET /api/dashboard` returns it as JSON, `GET
//! /api/dashboard/events` streams it (docs/api.md).
//!
//! Must never: slow the forward pass beyond counting (the observer only increments counters).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

use shimmer_model::{MoeObserver, PhaseTimes};

/// Per-turn time by phase, in milliseconds: the forward passes' phases over the steps the
/// request took part in (a step's time counts fully for every request in it), plus sampling.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Breakdown {
    pub attention_ms: f64,
    pub router_ms: f64,
    pub expert_compute_ms: f64,
    pub expert_io_wait_ms: f64,
    pub sampling_ms: f64,
    pub other_ms: f64,
}

impl Breakdown {
    pub fn add_step(&mut self, p: &PhaseTimes, io_wait: Duration) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let io = ms(io_wait).min(ms(p.experts));
        self.attention_ms += ms(p.attention);
        self.router_ms += ms(p.router);
        self.expert_io_wait_ms += io;
        self.expert_compute_ms += ms(p.experts) - io;
        self.other_ms += (ms(p.total) - ms(p.attention) - ms(p.router) - ms(p.experts)).max(0.0);
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Tiers {
    pub vram_bytes: u64,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
    pub remote_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LastTurn {
    pub breakdown: Breakdown,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_ms: f64,
    pub decode_tok_s: f64,
}

/// The JSON the dashboard reads.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub model: String,
    pub running: usize,
    pub waiting: usize,
    /// Tokens generated per second over the last few seconds, all requests together.
    pub tok_s: f64,
    pub ttft_ms: Option<f64>,
    pub last_turn: Option<LastTurn>,
    pub tiers: Tiers,
    /// The MoE layers' indices (the Brain's rows) and experts per layer (its columns).
    pub moe_layers: Vec<usize>,
    pub experts: usize,
    /// Per (row, expert), row-major: routing heat in [0, 1] (decaying counts, scaled to the hottest).
    pub heat: Vec<f32>,
    /// Per (row, expert): routed in the latest step.
    pub routed: Vec<u8>,
    /// Per (row, expert): where it is served from (`ram` for all on one box without a store;
    /// the store's resident set `ram`, the rest `disk`).
    pub tier: Vec<&'static str>,
    pub generated_tokens: u64,
    /// The workers and the links to them, when the experts are on a cluster.
    pub cluster: Option<shimmer_cluster::ClusterTelemetry>,
    /// On a cluster, per (row, expert): the worker that first serves it (an index into
    /// `cluster.workers`); empty on a single box.
    pub node: Vec<u16>,
    /// On a member coordinator, the control plane as this member applied it: the leader, the
    /// term, each member's Raft role, each model's epochs (no ReadIndex: a view, not a read).
    pub control: Option<shimmer_worker::control::StatusView>,
}

/// Throughput window.
const WINDOW: Duration = Duration::from_secs(5);
/// Heat halves every this many steps.
const HEAT_HALF_LIFE_STEPS: f32 = 200.0;

pub struct Dashboard {
    pub model: String,
    moe_layers: Vec<usize>,
    experts: usize,
    heat: Vec<f32>,
    routed: Vec<u8>,
    recent: VecDeque<(Instant, u64)>,
    pub ttft_ms: Option<f64>,
    pub last_turn: Option<LastTurn>,
    pub tiers: Tiers,
    generated: u64,
}

impl Dashboard {
    pub fn new(model: String, moe_layers: Vec<usize>, experts: usize) -> Self {
        let cells = moe_layers.len() * experts;
        Dashboard {
            model,
            moe_layers,
            experts,
            heat: vec![0.0; cells],
            routed: vec![0; cells],
            recent: VecDeque::new(),
            ttft_ms: None,
            last_turn: None,
            tiers: Tiers::default(),
            generated: 0,
        }
    }

    /// Folds in one step: its routing, the tokens it generated.
    pub fn step(&mut self, counts: &StepRouting, generated: u64, now: Instant) {
        let decay = 0.5f32.powf(1.0 / HEAT_HALF_LIFE_STEPS);
        for (h, r) in self.heat.iter_mut().zip(self.routed.iter_mut()) {
            *h *= decay;
            *r = 0;
        }
        for (cell, n) in counts.cells.iter().enumerate() {
            if *n > 0 && cell < self.heat.len() {
                self.heat[cell] += *n as f32;
                self.routed[cell] = 1;
            }
        }
        self.generated += generated;
        self.recent.push_back((now, generated));
        while self.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > WINDOW) {
            self.recent.pop_front();
        }
    }

    /// `resident(layer)`: which of the layer's experts are in RAM (`None`: all, unless `cluster`
    /// says they are on workers).
    pub fn snapshot(
        &self,
        running: usize,
        waiting: usize,
        resident: &dyn Fn(usize) -> Option<Vec<bool>>,
        cluster: Option<shimmer_cluster::ClusterTelemetry>,
        first_holders: &dyn Fn(usize) -> Option<Vec<u16>>,
    ) -> Snapshot {
        let now = Instant::now();
        let tokens: u64 = self.recent.iter().filter(|(t, _)| now.duration_since(*t) <= WINDOW).map(|(_, n)| n).sum();
        let span = self.recent.front().map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64()).max(1.0);
        let hottest = self.heat.iter().copied().fold(0.0f32, f32::max);
        let mut tier = Vec::with_capacity(self.heat.len());
        for l in &self.moe_layers {
            match resident(*l) {
                None if cluster.is_some() => tier.extend(std::iter::repeat_n("remote", self.experts)),
                None => tier.extend(std::iter::repeat_n("ram", self.experts)),
                Some(r) => tier.extend((0..self.experts).map(|e| if r.get(e).copied().unwrap_or(false) { "ram" } else { "disk" })),
            }
        }
        Snapshot {
            model: self.model.clone(),
            running,
            waiting,
            tok_s: tokens as f64 / span,
            ttft_ms: self.ttft_ms,
            last_turn: self.last_turn.clone(),
            tiers: self.tiers.clone(),
            moe_layers: self.moe_layers.clone(),
            experts: self.experts,
            heat: self.heat.iter().map(|h| if hottest > 0.0 { h / hottest } else { 0.0 }).collect(),
            routed: self.routed.clone(),
            tier,
            generated_tokens: self.generated,
            node: match &cluster {
                Some(_) => self
                    .moe_layers
                    .iter()
                    .flat_map(|l| {
                        first_holders(*l).unwrap_or_else(|| vec![u16::MAX; self.experts]).into_iter().chain(std::iter::repeat(u16::MAX)).take(self.experts)
                    })
                    .collect(),
                None => Vec::new(),
            },
            cluster,
            control: None,
        }
    }
}

/// The observer one step's forward pass reports to: (layer, expert) use counts and phase times.
pub struct StepRouting {
    row_of_layer: Vec<Option<usize>>,
    experts: usize,
    pub cells: Vec<u32>,
    /// Distinct experts used per MoE layer, summed (for the bytes served).
    pub distinct: u64,
    pub phases: PhaseTimes,
}

impl StepRouting {
    pub fn new(num_layers: usize, moe_layers: &[usize], experts: usize) -> Self {
        let mut row_of_layer = vec![None; num_layers];
        for (row, l) in moe_layers.iter().enumerate() {
            row_of_layer[*l] = Some(row);
        }
        StepRouting { row_of_layer, experts, cells: vec![0; moe_layers.len() * experts], distinct: 0, phases: PhaseTimes::default() }
    }
}

impl MoeObserver for StepRouting {
    fn moe_layer(&mut self, layer: usize, _rows: &[f32], experts: &[u32], _weights: &[f32]) {
        let Some(Some(row)) = self.row_of_layer.get(layer) else { return };
        for e in experts {
            if let Some(c) = self.cells.get_mut(row * self.experts + *e as usize) {
                if *c == 0 {
                    self.distinct += 1;
                }
                *c += 1;
            }
        }
    }

    fn phases(&mut self, times: &PhaseTimes) {
        self.phases = *times;
    }
}
