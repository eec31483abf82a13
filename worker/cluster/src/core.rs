//! The coordinator's cluster logic without I/O (quinn-proto's shape): the placement it routes by,
//! each worker's health, and — per MoE layer — the state machine that assigns every routed
//! selection to a worker, fails over, asks for redials and a newer placement, and merges the
//! fixed-point partial sums. Events and `now` go in; decisions (`Step`, `Action`) come out. The
//! driver (`shimmer-worker`'s `remote`) does the sending, dialling, waiting and reading of files.
//!
//! Per layer (`LayerDispatch::next`):
//! 1. Each pending selection goes to its first holder in the placement that is up and not yet
//!    tried for it; when none is left, to a worker whose status says it loads unassigned experts
//!    from its own disk (in name order). → `Step::Send`.
//! 2. The driver reports each answer (`answer`). Sums are added only when they answer the request
//!    sent: same id, model, placement epoch, layer and size, and at most once. An error frame
//!    leaves the worker up (the next holder tries); silence or a broken answer marks it down.
//! 3. A worker that answered `Moved` serves a newer placement: once per layer, `Step::Reload`
//!    asks the driver for it; adopted, everything not yet served is sent again under it.
//! 4. A selection nobody is left to serve: `Step::RedialNow` has the driver dial every worker
//!    that could serve it and is down, ignoring their backoff (each at most once per layer); if
//!    none comes back, the layer fails naming the layer, the expert and the workers tried.
//!
//! Must never: read a clock, open a socket or start a thread; add sums that are not the answer
//! to a request it sent (another model, epoch, layer, size, or a second answer); skip, substitute
//! or re-weight a selection (a selection nobody serves is an error, never a missing term).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use shimmer_experts::{DispatchError, ELSEWHERE};

use crate::links::Link;
use crate::placement::Placement;
use crate::status::WorkerStatus;
use crate::telemetry::{ClusterTelemetry, Exchange, WorkerLink};
use crate::wire::ErrorCode;

/// Rounds of failover one layer may take before it gives up (every round retires at least one
/// (selection, worker) pair, so a finite cluster ends long before this).
pub const MAX_ROUNDS: u32 = 64;

/// Background work the core asks of its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Dial `worker` at `addr` in the background and report with `Cluster::dial_result`.
    Dial { worker: String, addr: String },
    /// Close the connection to `worker` (it was marked down).
    Close { worker: String },
}

/// The cluster as this coordinator sees it.
pub struct Cluster {
    placement: Placement,
    /// Per worker: (layer, expert) pairs the placement lists it for, and those it is first for.
    placed: HashMap<String, (usize, usize)>,
    links: BTreeMap<String, Link>,
    local: Option<String>,
    model: u64,
    first_moe_layer: usize,
    next_id: u64,
    /// Whether the driver can look for a newer placement when a worker answers `Moved`.
    pub can_reload: bool,
    failovers: u64,
    tokens: u64,
    wait: Duration,
    actions: VecDeque<Action>,
}

impl Cluster {
    /// Every worker of `placement` starts unconnected (the driver dials them and reports);
    /// `local` names the placement worker this process is, whose experts it computes itself.
    pub fn new(placement: Placement, model: u64, local: Option<String>) -> Result<Self, String> {
        if let Some(name) = &local {
            if !placement.workers.iter().any(|w| &w.name == name) {
                return Err(format!("this node is to hold worker {name}'s experts, but the placement has no such worker"));
            }
        }
        let mut links = BTreeMap::new();
        for w in &placement.workers {
            let mut link = Link::new(w.addr.clone());
            if Some(&w.name) == local.as_ref() {
                link.local = true;
                link.status = Some(WorkerStatus { name: w.name.clone(), epoch: placement.epoch, loads_unassigned: true, ..WorkerStatus::default() });
            }
            links.insert(w.name.clone(), link);
        }
        let first_moe_layer = placement.layers.iter().map(|l| l.layer).min().unwrap_or(0);
        Ok(Cluster {
            placed: placed_counts(&placement),
            placement,
            links,
            local,
            model,
            first_moe_layer,
            next_id: 1,
            can_reload: false,
            failovers: 0,
            tokens: 0,
            wait: Duration::ZERO,
            actions: VecDeque::new(),
        })
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    pub fn model(&self) -> u64 {
        self.model
    }

    pub fn local(&self) -> Option<&str> {
        self.local.as_deref()
    }

    pub fn next_request_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Workers to dial (not this process, not connected), with their addresses, in name order.
    pub fn unconnected(&self) -> Vec<(String, String)> {
        self.links.iter().filter(|(_, l)| !l.local && !l.connected).map(|(n, l)| (n.clone(), l.addr.clone())).collect()
    }

    pub fn link(&self, name: &str) -> Option<&Link> {
        self.links.get(name)
    }

    /// Connected workers that are up (for status questions and hints).
    pub fn up_remote(&self) -> Vec<String> {
        self.links.iter().filter(|(_, l)| !l.local && l.is_up()).map(|(n, _)| n.clone()).collect()
    }

    pub fn dial_result(&mut self, name: &str, result: Result<Option<WorkerStatus>, ()>, now: Instant) {
        if let Some(l) = self.links.get_mut(name) {
            match result {
                Ok(status) => l.dial_succeeded(status),
                Err(()) => l.dial_failed(now),
            }
        }
    }

    /// The driver found `name`'s connection closed.
    pub fn connection_lost(&mut self, name: &str, now: Instant) {
        if let Some(l) = self.links.get_mut(name) {
            if l.connected {
                l.connection_lost(now);
            }
        }
    }

    pub fn mark_down(&mut self, name: &str, now: Instant) {
        if let Some(l) = self.links.get_mut(name) {
            if l.local {
                return;
            }
            let was_connected = l.connected;
            l.mark_down(now);
            if was_connected {
                self.actions.push_back(Action::Close { worker: name.to_string() });
            }
        }
    }

    pub fn set_status(&mut self, name: &str, status: WorkerStatus) {
        if let Some(l) = self.links.get_mut(name) {
            l.status = Some(status);
        }
    }

    pub fn record(&mut self, name: &str, exchange: Exchange, selections: usize, ok: bool) {
        if let Some(l) = self.links.get_mut(name) {
            l.counters.record(exchange, selections, ok);
        }
    }

    pub fn add_wait(&mut self, waited: Duration) {
        self.wait += waited;
    }

    pub fn network_wait(&self) -> Duration {
        self.wait
    }

    /// The next background action, if any (drain after every call that may queue one).
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether `name` may be sent work now. A worker whose connection is gone, or whose backoff
    /// has passed, is queued for a background redial (`Action::Dial`) and is not usable yet.
    pub fn usable(&mut self, name: &str, now: Instant) -> bool {
        let Some(l) = self.links.get_mut(name) else { return false };
        if l.is_up() {
            return true;
        }
        if !l.may_retry(now) {
            return false;
        }
        // Unconnected and not (or no longer) held back: down for a backoff while it is dialled.
        l.connection_lost(now);
        if !l.redialing {
            l.redialing = true;
            self.actions.push_back(Action::Dial { worker: name.to_string(), addr: l.addr.clone() });
        }
        false
    }

    /// Workers that are not `holders` but said they load unassigned experts, in name order.
    pub fn volunteers(&self, holders: &[String]) -> Vec<String> {
        self.links.iter().filter(|(n, l)| !holders.contains(n) && l.status.as_ref().is_some_and(|s| s.loads_unassigned)).map(|(n, _)| n.clone()).collect()
    }

    /// Routes by `placement` from now on: it must be newer and name this node's own worker if it
    /// holds one. Returns the workers it adds, for the driver to dial.
    pub fn set_placement(&mut self, placement: Placement) -> Result<Vec<(String, String)>, String> {
        let current = self.placement.epoch;
        if placement.epoch <= current {
            return Err(format!("placement epoch {} is not newer than {current}", placement.epoch));
        }
        if let Some(name) = &self.local {
            if !placement.workers.iter().any(|w| &w.name == name) {
                return Err(format!("the new placement drops this node's own worker {name}"));
            }
        }
        let mut fresh = Vec::new();
        for w in &placement.workers {
            if !self.links.contains_key(&w.name) {
                self.links.insert(w.name.clone(), Link::new(w.addr.clone()));
                fresh.push((w.name.clone(), w.addr.clone()));
            }
        }
        self.placed = placed_counts(&placement);
        self.first_moe_layer = placement.layers.iter().map(|l| l.layer).min().unwrap_or(0);
        self.placement = placement;
        Ok(fresh)
    }

    /// Hints for `layer`'s predicted experts, grouped by the worker that holds each first.
    pub fn prefetch_targets(&self, layer: usize, experts: &[u32]) -> Vec<(String, Vec<u32>)> {
        let mut per_worker: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for &e in experts {
            if let Some(h) = self.placement.holders(layer, e as usize).and_then(|h| h.first()) {
                per_worker.entry(h.clone()).or_default().push(e);
            }
        }
        per_worker.into_iter().collect()
    }

    /// Which worker first serves each expert of `layer` (an index into the placement's workers).
    pub fn first_holders(&self, layer: usize) -> Option<Vec<u16>> {
        let p = &self.placement;
        let l = p.layers.iter().find(|l| l.layer == layer)?;
        Some(l.replicas.iter().map(|h| h.first().and_then(|n| p.workers.iter().position(|w| &w.name == n)).map_or(u16::MAX, |i| i as u16)).collect())
    }

    /// Workers marked down now.
    pub fn down_workers(&self) -> Vec<String> {
        self.links.iter().filter(|(_, l)| !l.local && !l.is_up()).map(|(n, _)| n.clone()).collect()
    }

    /// Links, counters and statuses, in the placement's worker order; `path_rtt_ms` is the
    /// driver's measure of each connected link.
    pub fn telemetry(&self, path_rtt_ms: &dyn Fn(&str) -> Option<f64>) -> ClusterTelemetry {
        let workers = self
            .placement
            .workers
            .iter()
            .filter_map(|w| {
                let l = self.links.get(&w.name)?;
                let c = &l.counters;
                let (placed_experts, first_choice_experts) = self.placed.get(&w.name).copied().unwrap_or_default();
                Some(WorkerLink {
                    name: w.name.clone(),
                    addr: w.addr.clone(),
                    up: l.is_up(),
                    path_rtt_ms: if l.is_up() && !l.local { path_rtt_ms(&w.name) } else { None },
                    placed_experts,
                    first_choice_experts,
                    requests: c.requests,
                    selections: c.selections,
                    bytes_sent: c.bytes_sent,
                    bytes_received: c.bytes_received,
                    errors: c.errors,
                    rtt_buckets: c.rtt_buckets.to_vec(),
                    rtt_sum_s: c.rtt_sum,
                    status: l.status.clone(),
                })
            })
            .collect::<Vec<_>>();
        ClusterTelemetry {
            round_trips: workers.iter().map(|w| w.requests).sum(),
            workers,
            tokens: self.tokens,
            network_wait_s: self.wait.as_secs_f64(),
            failovers: self.failovers,
            placement_epoch: self.placement.epoch,
        }
    }

    /// Starts serving one MoE layer's batch: `experts` per (row, slot), `rows` rows, sums of
    /// `sums_len` fixed-point values.
    pub fn begin(&mut self, layer: usize, experts: &[u32], rows: usize, sums_len: usize) -> LayerDispatch {
        if layer == self.first_moe_layer {
            self.tokens += rows as u64;
        }
        let pending = (0..experts.len()).filter(|&s| experts[s] != ELSEWHERE).collect();
        LayerDispatch {
            layer,
            experts: experts.to_vec(),
            sums: vec![0; sums_len],
            tried: vec![BTreeSet::new(); experts.len()],
            pending,
            round: 0,
            reloaded: false,
            redialed: BTreeSet::new(),
            phase: Phase::Plan,
        }
    }
}

fn placed_counts(placement: &Placement) -> HashMap<String, (usize, usize)> {
    let mut placed: HashMap<String, (usize, usize)> = HashMap::new();
    for l in &placement.layers {
        for holders in &l.replicas {
            for (i, h) in holders.iter().enumerate() {
                let p = placed.entry(h.clone()).or_default();
                p.0 += 1;
                p.1 += usize::from(i == 0);
            }
        }
    }
    placed
}

/// One request the driver is to send (or, for `local`, compute in this process): the batch's
/// rows with the selections in `slots`, every other selection marked `ELSEWHERE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub worker: String,
    pub request_id: u64,
    pub epoch: u64,
    pub slots: Vec<usize>,
    pub local: bool,
}

/// What came back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<'a> {
    /// Partial sums, with the identity the worker stamped on them.
    Sums { request_id: u64, model: u64, epoch: u64, layer: u32, sums: &'a [i64] },
    /// An error frame: the worker is up but cannot serve this.
    Refused { code: Option<ErrorCode>, message: String },
    /// No answer in time, a closed connection, or something that is not an answer.
    Lost(String),
}

/// What the driver does next for this layer.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Send these requests, report each answer with `LayerDispatch::answer`, then call `next`.
    Send(Vec<Assignment>),
    /// Dial these (worker, address) now, ignoring their backoff, report each with
    /// `Cluster::dial_result`, then call `next`.
    RedialNow(Vec<(String, String)>),
    /// Look for a newer placement and adopt it (`Cluster::set_placement`), report with
    /// `LayerDispatch::reloaded`, then call `next`.
    Reload,
    /// Every selection is served: `LayerDispatch::sums` holds their merged partial sums.
    Done,
    Failed(String),
}

#[derive(Debug)]
struct Outstanding {
    assignment: Assignment,
    answered: bool,
}

#[derive(Debug)]
struct Failure {
    worker: String,
    slots: Vec<usize>,
    /// It did not answer (or answered nonsense): mark it down. An error frame leaves it up.
    down: bool,
}

#[derive(Debug)]
enum Phase {
    Plan,
    Awaiting { outstanding: Vec<Outstanding>, failures: Vec<Failure>, moved: bool },
    Redialing { targets: Vec<String>, slot: usize },
    Reloading { failures: Vec<Failure>, adopted: Option<bool> },
    Finished,
}

/// One MoE layer's selections being served across the cluster (`Cluster::begin`).
#[derive(Debug)]
pub struct LayerDispatch {
    layer: usize,
    experts: Vec<u32>,
    sums: Vec<i64>,
    /// Per slot, the workers that failed it (not asked for it again in this layer).
    tried: Vec<BTreeSet<String>>,
    pending: Vec<usize>,
    round: u32,
    reloaded: bool,
    /// Workers dialled now (ignoring their backoff) for this layer already.
    redialed: BTreeSet<String>,
    phase: Phase,
}

impl LayerDispatch {
    /// The merged partial sums (complete once `next` has said `Done`).
    pub fn sums(&self) -> &[i64] {
        &self.sums
    }

    /// Reports what came back for `request_id` (one of the last `Step::Send`'s assignments).
    /// Sums count only if they answer that request: the id, model, epoch and layer stamped on
    /// them, and their size, must be the request's, and only its first answer counts; anything
    /// else is that worker failing. An `Err` ends the layer: the sums overflowed the fixed-point
    /// range, so no answer can be given.
    pub fn answer(&mut self, cluster: &mut Cluster, request_id: u64, answer: Answer<'_>, exchange: Exchange) -> Result<(), DispatchError> {
        let Phase::Awaiting { outstanding, failures, moved } = &mut self.phase else { return Ok(()) };
        let Some(o) = outstanding.iter_mut().find(|o| o.assignment.request_id == request_id && !o.answered) else { return Ok(()) };
        o.answered = true;
        let a = &o.assignment;
        let served = a.slots.len();
        match answer {
            Answer::Sums { request_id: stamped, model, epoch, layer, sums } => {
                let problem = if stamped != request_id {
                    Some(format!("answered request {stamped} to request {request_id}"))
                } else if model != cluster.model {
                    Some(format!("answered for model {model:016x}, not {:016x}", cluster.model))
                } else if epoch != a.epoch {
                    Some(format!("answered under placement epoch {epoch}, not {}", a.epoch))
                } else if layer as usize != self.layer {
                    Some(format!("answered for layer {layer}, not {}", self.layer))
                } else if sums.len() != self.sums.len() {
                    Some(format!("answered {} sums, not {}", sums.len(), self.sums.len()))
                } else {
                    None
                };
                if let Some(problem) = problem {
                    tracing::warn!(worker = %a.worker, "{problem}; its answer is not used");
                    cluster.record(&a.worker, exchange, served, false);
                    failures.push(Failure { worker: a.worker.clone(), slots: a.slots.clone(), down: !a.local });
                    return Ok(());
                }
                for (acc, s) in self.sums.iter_mut().zip(sums) {
                    *acc = acc
                        .checked_add(*s)
                        .ok_or_else(|| DispatchError::Remote(format!("layer {}: fixed-point overflow adding worker {}'s sums", self.layer, a.worker)))?;
                }
                cluster.record(&a.worker, exchange, served, true);
            }
            Answer::Refused { code, message } => {
                tracing::warn!(worker = %a.worker, ?code, "{message}");
                *moved |= code == Some(ErrorCode::Moved);
                cluster.record(&a.worker, exchange, served, false);
                failures.push(Failure { worker: a.worker.clone(), slots: a.slots.clone(), down: false });
            }
            Answer::Lost(reason) => {
                tracing::warn!(worker = %a.worker, "{reason}");
                cluster.record(&a.worker, exchange, served, false);
                failures.push(Failure { worker: a.worker.clone(), slots: a.slots.clone(), down: !a.local });
            }
        }
        Ok(())
    }

    /// After `Step::Reload`: whether a newer placement was adopted.
    pub fn reloaded(&mut self, adopted: bool) {
        if let Phase::Reloading { adopted: a, .. } = &mut self.phase {
            *a = Some(adopted);
        }
    }

    /// The next thing to do for this layer, given what has been reported since the last step.
    pub fn next(&mut self, cluster: &mut Cluster, now: Instant) -> Step {
        loop {
            match std::mem::replace(&mut self.phase, Phase::Finished) {
                Phase::Finished => return Step::Failed(format!("layer {}: asked for a step after the layer ended", self.layer)),
                Phase::Plan => {
                    if self.pending.is_empty() {
                        return Step::Done;
                    }
                    self.round += 1;
                    if self.round > MAX_ROUNDS {
                        return Step::Failed(format!("layer {}: gave up after {MAX_ROUNDS} rounds of failover", self.layer));
                    }
                    return self.plan(cluster, now);
                }
                Phase::Awaiting { outstanding, mut failures, moved } => {
                    for o in outstanding.into_iter().filter(|o| !o.answered) {
                        // Never reported: the driver could not even send it.
                        failures.push(Failure { worker: o.assignment.worker, slots: o.assignment.slots, down: !o.assignment.local });
                    }
                    if moved && !self.reloaded && cluster.can_reload {
                        self.reloaded = true;
                        self.phase = Phase::Reloading { failures, adopted: None };
                        return Step::Reload;
                    }
                    self.fail_over(cluster, failures, now);
                    self.phase = Phase::Plan;
                }
                Phase::Reloading { failures, adopted } => {
                    if adopted == Some(true) {
                        // Everything left goes again under the new placement, every worker a
                        // candidate again.
                        for f in failures {
                            if f.down {
                                cluster.mark_down(&f.worker, now);
                            }
                            self.pending.extend(f.slots);
                        }
                        self.tried.iter_mut().for_each(BTreeSet::clear);
                    } else {
                        tracing::warn!("a worker serves another placement epoch, and no newer placement is at hand");
                        self.fail_over(cluster, failures, now);
                    }
                    self.phase = Phase::Plan;
                }
                Phase::Redialing { targets, slot } => {
                    if targets.iter().any(|t| cluster.link(t).is_some_and(Link::is_up)) {
                        self.tried.iter_mut().for_each(BTreeSet::clear);
                        self.phase = Phase::Plan;
                        continue;
                    }
                    return Step::Failed(self.stranded_message(cluster, slot));
                }
            }
        }
    }

    /// The failed requests' selections go back to pending, each worker recorded as tried for them.
    fn fail_over(&mut self, cluster: &mut Cluster, failures: Vec<Failure>, now: Instant) {
        for f in failures {
            if f.down {
                cluster.mark_down(&f.worker, now);
            }
            cluster.failovers += f.slots.len() as u64;
            for s in f.slots {
                self.tried[s].insert(f.worker.clone());
                self.pending.push(s);
            }
        }
    }

    fn stranded_message(&self, cluster: &Cluster, slot: usize) -> String {
        let e = self.experts[slot];
        let failed: Vec<&str> = self.tried[slot].iter().map(String::as_str).collect();
        let holders = cluster.placement.holders(self.layer, e as usize).unwrap_or_default();
        let down: Vec<&str> =
            holders.iter().map(String::as_str).filter(|h| !self.tried[slot].contains(*h) && !cluster.link(h).is_some_and(Link::is_up)).collect();
        let list = |v: &[&str]| if v.is_empty() { "none".to_string() } else { v.join(", ") };
        format!(
            "layer {} expert {e}: no worker can serve it (failed: {}; down: {}; no other reachable worker loads it from its own disk)",
            self.layer,
            list(&failed),
            list(&down)
        )
    }

    fn plan(&mut self, cluster: &mut Cluster, now: Instant) -> Step {
        let layer = self.layer;
        let mut per_worker: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let pending = std::mem::take(&mut self.pending);
        for (i, &slot) in pending.iter().enumerate() {
            let e = self.experts[slot];
            let Some(holders) = cluster.placement.holders(layer, e as usize).map(<[String]>::to_vec) else {
                return Step::Failed(format!("the placement has no holder for layer {layer} expert {e}"));
            };
            // A worker that failed this selection is not asked again for it in this layer; one that
            // is down now may be picked in a later round, once it is back.
            let tried = &self.tried[slot];
            let mut pick = holders.iter().find(|h| !tried.contains(*h) && cluster.usable(h, now)).cloned();
            if pick.is_none() {
                pick = cluster.volunteers(&holders).into_iter().find(|v| !tried.contains(v) && cluster.usable(v, now));
            }
            let Some(worker) = pick else {
                // Nobody left for this selection. Before failing, once, dial again now every
                // worker that could serve it (a restarted worker is back within a connect
                // timeout, not after its backoff).
                self.pending = pending[i..].to_vec();
                for slots in per_worker.into_values() {
                    self.pending.extend(slots);
                }
                let candidates: Vec<(String, String)> = holders
                    .iter()
                    .cloned()
                    .chain(cluster.volunteers(&holders))
                    .chain(cluster.links.keys().filter(|n| !holders.contains(n)).cloned())
                    .filter(|n| !self.redialed.contains(n))
                    .filter_map(|n| cluster.links.get(&n).filter(|l| !l.local && !l.is_up()).map(|l| (n.clone(), l.addr.clone())))
                    .fold(Vec::new(), |mut acc, t| {
                        if !acc.contains(&t) {
                            acc.push(t);
                        }
                        acc
                    });
                if !candidates.is_empty() {
                    self.redialed.extend(candidates.iter().map(|(n, _)| n.clone()));
                    self.phase = Phase::Redialing { targets: candidates.iter().map(|(n, _)| n.clone()).collect(), slot };
                    return Step::RedialNow(candidates);
                }
                self.phase = Phase::Finished;
                return Step::Failed(self.stranded_message(cluster, slot));
            };
            if self.round == 1 && holders.first() != Some(&worker) {
                // Served by another than the first holder because that one is down.
                cluster.failovers += 1;
            }
            per_worker.entry(worker).or_default().push(slot);
        }
        let epoch = cluster.placement.epoch;
        let local = cluster.local.clone();
        let assignments: Vec<Assignment> = per_worker
            .into_iter()
            .map(|(worker, slots)| Assignment { local: Some(&worker) == local.as_ref(), request_id: cluster.next_request_id(), epoch, worker, slots })
            .collect();
        self.phase = Phase::Awaiting {
            outstanding: assignments.iter().map(|a| Outstanding { assignment: a.clone(), answered: false }).collect(),
            failures: Vec::new(),
            moved: false,
        };
        Step::Send(assignments)
    }
}
