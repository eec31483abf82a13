//! The VRAM tier: which experts are resident on the device under a byte budget, which of a
//! layer's experts run there, and what happens when the device fails.
//!
//! The decisions are two small state machines that take events and time and return decisions
//! (`Residency`: hit, admit after evicting, or leave on the CPU; `Health`: usable now, or backing
//! off after a fault), tested by replaying sequences; `VramTier` carries them out on a `Device`.
//!
//! Every expert a call does not compute — unsupported format, over budget, device backing off,
//! a fault in its submission — comes back as `None`, and the caller computes it on the CPU:
//! the same bits, so a fault costs time, never a token.
//!
//! Must never: return an output for an expert whose submission failed; keep using a device in
//! back-off; hold more resident bytes than the budget.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shimmer_experts::Expert;

use crate::device::{Device, DeviceExpert, ExpertImage, GpuError, Job};

/// A routed expert: its layer and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: u32,
    pub expert: u32,
}

/// What `Residency` says about an expert a step wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Resident: compute it on the device.
    Hit,
    /// Upload it (after releasing `evict`, least recently used first), then compute it there.
    Admit { evict: Vec<ExpertKey> },
    /// Leave it on the CPU (larger than the budget, or only pinned experts to evict).
    Cpu,
}

/// Which experts are resident under a byte budget, and whether a newcomer is worth uploading.
/// Pure bookkeeping: events in (requests, uploads, measured costs), decisions out.
///
/// The policy: a resident expert is a hit. A newcomer is uploaded when the budget has room;
/// when room must be made, the least recently used unpinned experts are the victims, and the
/// newcomer is admitted only if it has been asked for more often (recently) than each of them —
/// a scan or a one-off does not flush the experts that keep coming back. And, once the costs
/// are measured, an upload must pay for itself: its time at most what computing the expert on
/// the CPU would cost over the uses its frequency predicts (else the CPU computes it). A pinned
/// expert skips both tests: its learned heat is the evidence, and it is never a victim.
#[derive(Debug, Clone)]
pub struct Residency {
    budget: u64,
    used: u64,
    clock: u64,
    /// Resident experts: bytes and last use.
    resident: HashMap<ExpertKey, (u64, u64)>,
    /// Experts never evicted (learned from heat by the store's policy).
    pinned: HashSet<ExpertKey>,
    /// Recent requests per expert, halved every `DECAY_EVERY` requests.
    frequency: HashMap<ExpertKey, u32>,
    costs: Costs,
}

/// Measured costs, as exponentially weighted averages (`None` until measured).
#[derive(Debug, Clone, Copy, Default)]
pub struct Costs {
    /// Seconds an upload takes per byte.
    pub upload_s_per_byte: Option<f64>,
    /// Seconds the CPU takes per expert byte and row.
    pub cpu_s_per_byte_row: Option<f64>,
    /// Seconds the device takes per expert byte and row (a submission's time over its jobs).
    pub device_s_per_byte_row: Option<f64>,
}

impl Costs {
    const WEIGHT: f64 = 0.2;

    fn blend(old: Option<f64>, new: f64) -> Option<f64> {
        Some(old.map_or(new, |o| o + Self::WEIGHT * (new - o)))
    }
}

impl Residency {
    /// Requests between halvings of every frequency.
    pub const DECAY_EVERY: u64 = 4096;

    pub fn new(budget: u64) -> Self {
        Residency { budget, used: 0, clock: 0, resident: HashMap::new(), pinned: HashSet::new(), frequency: HashMap::new(), costs: Costs::default() }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.resident.len()
    }

    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }

    pub fn is_resident(&self, key: ExpertKey) -> bool {
        self.resident.contains_key(&key)
    }

    /// Keeps `keys` resident once admitted (pins replace the previous set).
    pub fn set_pins(&mut self, keys: impl IntoIterator<Item = ExpertKey>) {
        self.pinned = keys.into_iter().collect();
    }

    pub fn pins(&self) -> Vec<ExpertKey> {
        self.pinned.iter().copied().collect()
    }

    pub fn costs(&self) -> Costs {
        self.costs
    }

    /// An upload of `bytes` took `seconds`.
    pub fn uploaded_in(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 {
            self.costs.upload_s_per_byte = Costs::blend(self.costs.upload_s_per_byte, seconds / bytes as f64);
        }
    }

    /// The CPU computed experts of `byte_rows` (expert bytes × rows) in `seconds`.
    pub fn cpu_took(&mut self, byte_rows: u64, seconds: f64) {
        if byte_rows > 0 {
            self.costs.cpu_s_per_byte_row = Costs::blend(self.costs.cpu_s_per_byte_row, seconds / byte_rows as f64);
        }
    }

    /// The device computed experts of `byte_rows` (expert bytes × rows) in one submission of
    /// `seconds`.
    pub fn device_took(&mut self, byte_rows: u64, seconds: f64) {
        if byte_rows > 0 {
            self.costs.device_s_per_byte_row = Costs::blend(self.costs.device_s_per_byte_row, seconds / byte_rows as f64);
        }
    }

    /// The bytes a resident expert holds (as the CPU counts them).
    pub fn bytes_of(&self, key: ExpertKey) -> Option<u64> {
        self.resident.get(&key).map(|r| r.0)
    }

    fn frequency(&self, key: &ExpertKey) -> u32 {
        self.frequency.get(key).copied().unwrap_or(0)
    }

    /// A step wants `key` (of `bytes` bytes) computed over `rows` rows; `busy` are the experts
    /// the same step already placed on the device, which it must not evict.
    pub fn request(&mut self, key: ExpertKey, bytes: u64, rows: usize, busy: &[ExpertKey]) -> Decision {
        self.clock += 1;
        if self.clock.is_multiple_of(Self::DECAY_EVERY) {
            self.frequency.retain(|_, f| {
                *f /= 2;
                *f > 0
            });
        }
        let freq = {
            let f = self.frequency.entry(key).or_insert(0);
            *f = f.saturating_add(1);
            *f
        };
        if let Some(entry) = self.resident.get_mut(&key) {
            entry.1 = self.clock;
            return Decision::Hit;
        }
        if bytes > self.budget {
            return Decision::Cpu;
        }
        // An upload must pay for itself over the uses this expert's frequency predicts: the
        // upload and the device's time for those uses at most the CPU's time for them (a device
        // slower than this CPU gets no new experts) — unless the expert is pinned: its learned
        // heat already says it keeps coming back, and this run's few requests (and how fast the
        // CPU happens to be) must not keep a pin off the device.
        let pinned = self.pinned.contains(&key);
        if let (false, Some(up), Some(cpu)) = (pinned, self.costs.upload_s_per_byte, self.costs.cpu_s_per_byte_row) {
            let uses = (bytes * rows.max(1) as u64) as f64 * freq as f64;
            let device = self.costs.device_s_per_byte_row.unwrap_or(0.0);
            if up * bytes as f64 + device * uses > cpu * uses {
                return Decision::Cpu;
            }
        }
        let mut victims: Vec<(u64, ExpertKey, u64)> =
            self.resident.iter().filter(|(k, _)| !self.pinned.contains(k) && !busy.contains(k)).map(|(k, &(b, used))| (used, *k, b)).collect();
        victims.sort_unstable();
        let mut free = self.budget - self.used;
        let mut evict = Vec::new();
        for (_, k, b) in victims {
            if free >= bytes {
                break;
            }
            free += b;
            evict.push(k);
        }
        if free < bytes {
            return Decision::Cpu;
        }
        // Room made only for an expert asked for more often than each expert it displaces.
        if evict.iter().any(|v| self.frequency(v) >= freq && !pinned) {
            return Decision::Cpu;
        }
        Decision::Admit { evict }
    }

    /// Whether to upload `key` (of `bytes` bytes) ahead of its first use, at start: only a pin,
    /// only into room the budget has (warming evicts nothing), and it counts as no request (the
    /// frequencies and recency stay the routing's).
    pub fn warm(&self, key: ExpertKey, bytes: u64) -> Decision {
        if self.resident.contains_key(&key) {
            Decision::Hit
        } else if self.pinned.contains(&key) && bytes <= self.budget - self.used {
            Decision::Admit { evict: Vec::new() }
        } else {
            Decision::Cpu
        }
    }

    /// The upload `request` asked for is done.
    pub fn admitted(&mut self, key: ExpertKey, bytes: u64) {
        if self.resident.insert(key, (bytes, self.clock)).is_none() {
            self.used += bytes;
        }
        debug_assert!(self.used <= self.budget, "resident bytes {} exceed the budget {}", self.used, self.budget);
    }

    /// `key` left the device.
    pub fn evicted(&mut self, key: ExpertKey) {
        if let Some((bytes, _)) = self.resident.remove(&key) {
            self.used -= bytes;
        }
    }

    /// The device ran out of memory below the budget: the budget becomes what is resident now.
    pub fn shrink_to_used(&mut self) {
        self.budget = self.used;
    }
}

/// Whether the device may be used now: after a fault it rests for a back-off that doubles with
/// each fault in a row (from `BASE` up to `MAX`), then gets one more try.
#[derive(Debug, Clone, Default)]
pub struct Health {
    faults_in_a_row: u32,
    resting_until: Option<Instant>,
}

impl Health {
    pub const BASE: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(60);

    pub fn usable(&self, now: Instant) -> bool {
        self.resting_until.is_none_or(|t| now >= t)
    }

    /// A fault at `now`; returns how long the device now rests.
    pub fn fault(&mut self, now: Instant) -> Duration {
        self.faults_in_a_row = self.faults_in_a_row.saturating_add(1);
        let rest = Self::BASE.saturating_mul(1 << (self.faults_in_a_row - 1).min(16)).min(Self::MAX);
        self.resting_until = Some(now + rest);
        rest
    }

    pub fn success(&mut self) {
        self.faults_in_a_row = 0;
        self.resting_until = None;
    }

    pub fn faults_in_a_row(&self) -> u32 {
        self.faults_in_a_row
    }
}

/// The tier's counters, for `/metrics` and the banner.
#[derive(Debug, Default)]
pub struct GpuCounters {
    faults: [AtomicU64; GpuError::KINDS.len()],
    pub uploads: AtomicU64,
    pub upload_bytes: AtomicU64,
    pub evictions: AtomicU64,
    /// Expert computations done on the device, and those handed back to the CPU.
    pub device_experts: AtomicU64,
    pub cpu_experts: AtomicU64,
    /// Of `device_experts`, those whose expert was resident already (the rest were uploaded).
    pub vram_hits: AtomicU64,
    pub resident_bytes: AtomicU64,
    pub resident_experts: AtomicU64,
}

impl GpuCounters {
    fn fault(&self, e: &GpuError) {
        if let Some(i) = GpuError::KINDS.iter().position(|k| *k == e.kind()) {
            self.faults[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Faults by kind, in `GpuError::KINDS`' order.
    pub fn faults(&self) -> Vec<(&'static str, u64)> {
        GpuError::KINDS.iter().zip(&self.faults).map(|(k, n)| (*k, n.load(Ordering::Relaxed))).collect()
    }

    pub fn total_faults(&self) -> u64 {
        self.faults.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }
}

/// What the tier holds and did, for the banner, `/metrics`, the dashboard and `--json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GpuTelemetry {
    pub device: String,
    pub budget_bytes: u64,
    pub resident_bytes: u64,
    pub resident_experts: u64,
    pub uploads: u64,
    pub upload_bytes: u64,
    pub evictions: u64,
    /// Expert computations done on the device, and those handed back to the CPU.
    pub device_experts: u64,
    pub cpu_experts: u64,
    /// Of `device_experts`, those whose expert was resident already (the rest were uploaded).
    pub vram_hits: u64,
    /// Faults by kind (`GpuError::KINDS`).
    pub faults: Vec<(String, u64)>,
}

/// One expert a step wants computed over its rows (`rows` is `n × hidden`).
pub struct TierJob<'a> {
    pub key: ExpertKey,
    /// Its weights, for an upload if it is not resident; `None`: compute it only if resident.
    pub expert: Option<&'a Expert>,
    pub rows: &'a [f32],
}

/// The devices of a node, the experts resident on each and the decisions above. Each expert
/// belongs to one device (`VramTier::owner`: a layer's experts spread over all of them), so
/// several GPUs hold several times the experts and compute a layer's share in parallel.
pub struct VramTier {
    parts: Vec<Part>,
    counters: GpuCounters,
    /// `SHIMMER_GPU_FAULT=N`: the N-th and every N-th later submission fails.
    fault_every: Option<u64>,
    submissions: AtomicU64,
}

/// One device and what it holds.
struct Part {
    device: Box<dyn Device>,
    state: Mutex<TierState>,
    /// This device's share of the tier's resident gauges.
    resident_bytes: AtomicU64,
    resident_experts: AtomicU64,
}

impl Part {
    fn new(device: Box<dyn Device>, budget: u64) -> Self {
        let budget = budget.min(device.memory_bytes());
        Part {
            device,
            state: Mutex::new(TierState {
                residency: Residency::new(budget),
                resident: HashMap::new(),
                health: Health::default(),
                unsupported: HashSet::new(),
                in_flight: Vec::new(),
                losses: 0,
            }),
            resident_bytes: AtomicU64::new(0),
            resident_experts: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct TierState {
    residency: Residency,
    resident: HashMap<ExpertKey, DeviceExpert>,
    health: Health,
    /// Experts the device cannot compute (their format): asked once, then left on the CPU.
    unsupported: HashSet<ExpertKey>,
    /// Experts of submissions running with the lock released (one entry per submission that
    /// holds one): never evicted meanwhile.
    in_flight: Vec<ExpertKey>,
    /// Counts losses of the device (every resident expert released): a submission that saw
    /// another value when it started discards its outputs.
    losses: u64,
}

/// Reads `SHIMMER_GPU_FAULT`: a positive integer, or an error naming the value.
pub fn fault_every_from_env() -> Result<Option<u64>, String> {
    match std::env::var("SHIMMER_GPU_FAULT") {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!("SHIMMER_GPU_FAULT={v:?} is not a positive integer (the N-th and every N-th later GPU submission fails)")),
        },
    }
}

impl VramTier {
    /// A tier on `device` holding at most `budget` bytes (capped at the device's memory).
    pub fn new(device: Box<dyn Device>, budget: u64, fault_every: Option<u64>) -> Self {
        Self::on_devices(vec![(device, budget)], fault_every)
    }

    /// A tier over several devices of one node, each holding at most its budget in bytes
    /// (capped at its memory). At least one device.
    pub fn on_devices(devices: Vec<(Box<dyn Device>, u64)>, fault_every: Option<u64>) -> Self {
        assert!(!devices.is_empty(), "a VRAM tier needs a device");
        VramTier {
            parts: devices.into_iter().map(|(d, budget)| Part::new(d, budget)).collect(),
            counters: GpuCounters::default(),
            fault_every,
            submissions: AtomicU64::new(0),
        }
    }

    /// The devices, named as the banner shows them.
    pub fn device_name(&self) -> String {
        self.parts.iter().map(|p| p.device.name()).collect::<Vec<_>>().join("; ")
    }

    pub fn devices(&self) -> usize {
        self.parts.len()
    }

    /// The bytes all devices together may hold.
    pub fn budget(&self) -> u64 {
        self.parts.iter().map(|p| p.state().residency.budget()).sum()
    }

    pub fn counters(&self) -> &GpuCounters {
        &self.counters
    }

    pub fn telemetry(&self) -> GpuTelemetry {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuTelemetry {
            device: self.device_name(),
            budget_bytes: self.budget(),
            resident_bytes: load(&c.resident_bytes),
            resident_experts: load(&c.resident_experts),
            uploads: load(&c.uploads),
            upload_bytes: load(&c.upload_bytes),
            evictions: load(&c.evictions),
            device_experts: load(&c.device_experts),
            cpu_experts: load(&c.cpu_experts),
            vram_hits: load(&c.vram_hits),
            faults: c.faults().into_iter().map(|(k, n)| (k.to_string(), n)).collect(),
        }
    }

    /// The device an expert belongs to: a layer's experts dealt out over the devices in turn,
    /// each layer starting one further on, so that every device holds a share of every layer.
    pub fn owner(&self, key: ExpertKey) -> usize {
        (key.layer as usize + key.expert as usize) % self.parts.len()
    }

    fn part(&self, key: ExpertKey) -> &Part {
        &self.parts[self.owner(key)]
    }

    /// Keeps `keys` resident once they are uploaded (the store's learned pins), each on the
    /// device it belongs to.
    pub fn set_pins(&self, keys: impl IntoIterator<Item = ExpertKey>) {
        let mut each: Vec<Vec<ExpertKey>> = vec![Vec::new(); self.parts.len()];
        for k in keys {
            each[self.owner(k)].push(k);
        }
        for (part, keys) in self.parts.iter().zip(each) {
            part.state().residency.set_pins(keys);
        }
    }

    /// What the first device's residency has measured: uploads, its compute and the CPU's.
    pub fn costs(&self) -> Costs {
        self.parts[0].state().residency.costs()
    }

    /// The pinned experts, in order.
    pub fn pins(&self) -> Vec<ExpertKey> {
        let mut pins: Vec<ExpertKey> = self.parts.iter().flat_map(|p| p.state().residency.pins()).collect();
        pins.sort_unstable();
        pins
    }

    pub fn is_resident(&self, key: ExpertKey) -> bool {
        self.part(key).state().residency.is_resident(key)
    }

    /// Which of `experts` experts of `layer` are resident (the dashboard's Brain).
    pub fn resident_in_layer(&self, layer: usize, experts: usize) -> Vec<bool> {
        (0..experts).map(|e| self.is_resident(ExpertKey { layer: layer as u32, expert: e as u32 })).collect()
    }

    /// Computes what it can of `jobs` on the devices, each device its own experts at the same
    /// time as the others: for each job its outputs, or `None` for the caller to compute on the
    /// CPU.
    pub fn forward(&self, now: Instant, jobs: &[TierJob<'_>]) -> Vec<Option<Vec<f32>>> {
        if let [only] = self.parts.as_slice() {
            return self.forward_on(only, now, jobs);
        }
        let mut each: Vec<Vec<usize>> = vec![Vec::new(); self.parts.len()];
        for (i, job) in jobs.iter().enumerate() {
            each[self.owner(job.key)].push(i);
        }
        let run = |part: &Part, mine: &[usize]| {
            let subset: Vec<TierJob<'_>> = mine.iter().map(|&i| TierJob { key: jobs[i].key, expert: jobs[i].expert, rows: jobs[i].rows }).collect();
            self.forward_on(part, now, &subset)
        };
        let busy: Vec<(usize, &Part)> = self.parts.iter().enumerate().filter(|(d, _)| !each[*d].is_empty()).collect();
        let results: Vec<(usize, Vec<Option<Vec<f32>>>)> = match busy.as_slice() {
            [] => Vec::new(),
            [(d, part)] => vec![(*d, run(part, &each[*d]))],
            // Several devices: each submission from a thread of its own, so that they run together.
            _ => std::thread::scope(|s| {
                let (run, each) = (&run, &each);
                let handles: Vec<_> = busy.iter().map(|&(d, part)| (d, s.spawn(move || run(part, &each[d])))).collect();
                handles.into_iter().map(|(d, h)| (d, h.join().unwrap_or_else(|_| vec![None; each[d].len()]))).collect()
            }),
        };
        let mut out: Vec<Option<Vec<f32>>> = jobs.iter().map(|_| None).collect();
        for (d, outputs) in results {
            for (&i, ys) in each[d].iter().zip(outputs) {
                out[i] = ys;
            }
        }
        out
    }

    /// `forward` on one device, for jobs whose experts it owns.
    fn forward_on(&self, part: &Part, now: Instant, jobs: &[TierJob<'_>]) -> Vec<Option<Vec<f32>>> {
        let mut out: Vec<Option<Vec<f32>>> = jobs.iter().map(|_| None).collect();
        let mut state = part.state();
        if jobs.is_empty() || !state.health.usable(now) {
            self.counters.cpu_experts.fetch_add(jobs.len() as u64, Ordering::Relaxed);
            return out;
        }
        let mut on_device = Vec::new();
        let mut busy = Vec::new();
        let mut resident_before = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            let was_resident = state.residency.is_resident(job.key);
            if self.place(part, &mut state, now, job, &busy) {
                on_device.push(i);
                busy.push(job.key);
                resident_before.push(was_resident);
            }
            if !state.health.usable(now) {
                break;
            }
        }
        if !on_device.is_empty() && state.health.usable(now) {
            let n = self.submissions.fetch_add(1, Ordering::Relaxed) + 1;
            // The device runs the submission with the tier's lock released, so another thread
            // (the CPU's share of the same layer) can have its experts placed meanwhile; the
            // experts in flight cannot be evicted until it is done.
            let views: Vec<DeviceExpert> = on_device.iter().map(|&i| state.resident[&jobs[i].key].view()).collect();
            let losses = state.losses;
            state.in_flight.extend_from_slice(&busy);
            drop(state);
            let started = std::time::Instant::now();
            let result = if self.fault_every.is_some_and(|every| n.is_multiple_of(every)) {
                Err(GpuError::Injected)
            } else {
                let device_jobs: Vec<Job<'_>> = on_device.iter().zip(&views).map(|(&i, expert)| Job { expert, rows: jobs[i].rows }).collect();
                part.device.forward(&device_jobs)
            };
            let took = started.elapsed().as_secs_f64();
            state = part.state();
            for k in &busy {
                if let Some(at) = state.in_flight.iter().position(|f| f == k) {
                    state.in_flight.swap_remove(at);
                }
            }
            match result {
                // The device was lost meanwhile (its experts released): whatever this
                // submission returned is not trusted; the CPU computes these experts.
                _ if state.losses != losses => {}
                Ok(outputs) if outputs.len() == on_device.len() => {
                    state.health.success();
                    let rows = |i: usize, expert: &DeviceExpert| jobs[i].rows.len().checked_div(expert.hidden()).unwrap_or(1) as u64;
                    let byte_rows: u64 = on_device.iter().zip(&views).map(|(&i, x)| state.residency.bytes_of(jobs[i].key).unwrap_or(0) * rows(i, x)).sum();
                    state.residency.device_took(byte_rows, took);
                    for (&i, ys) in on_device.iter().zip(outputs) {
                        out[i] = Some(ys);
                    }
                    let hits = resident_before.iter().filter(|r| **r).count() as u64;
                    self.counters.vram_hits.fetch_add(hits, Ordering::Relaxed);
                }
                Ok(outputs) => self.fault(part, &mut state, now, GpuError::Device(format!("{} outputs for {} jobs", outputs.len(), on_device.len()))),
                Err(e) => self.fault(part, &mut state, now, e),
            }
        }
        let done = out.iter().filter(|o| o.is_some()).count() as u64;
        self.counters.device_experts.fetch_add(done, Ordering::Relaxed);
        self.counters.cpu_experts.fetch_add(jobs.len() as u64 - done, Ordering::Relaxed);
        out
    }

    /// Makes `job`'s expert resident if the policy says so; whether it is.
    fn place(&self, part: &Part, state: &mut TierState, now: Instant, job: &TierJob<'_>, busy: &[ExpertKey]) -> bool {
        if state.unsupported.contains(&job.key) {
            return false;
        }
        // Experts another submission is computing are as busy as this step's own.
        let with_flights: Vec<ExpertKey>;
        let busy = if state.in_flight.is_empty() {
            busy
        } else {
            with_flights = busy.iter().chain(&state.in_flight).copied().collect();
            &with_flights
        };
        let Some(expert) = job.expert else {
            // No weights at hand: only a resident expert can run (and counts as used).
            return state.residency.is_resident(job.key) && state.residency.request(job.key, 0, rows_of(job), busy) == Decision::Hit;
        };
        let bytes = expert.bytes() as u64;
        match state.residency.request(job.key, bytes, rows_of(job), busy) {
            Decision::Hit => true,
            Decision::Cpu => false,
            Decision::Admit { evict } => {
                for k in evict {
                    if let Some(e) = state.resident.remove(&k) {
                        part.device.release(e);
                    }
                    state.residency.evicted(k);
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                }
                self.upload(part, state, now, job.key, expert)
            }
        }
    }

    /// Uploads `expert` of `layer` ahead of its first use if it is one of the pins and fits
    /// beside what is resident (nothing is evicted for it); computes nothing. Whether it is
    /// resident now. A store warms its VRAM pins this way at start, so the first tokens find
    /// them on the device.
    pub fn warm(&self, now: Instant, key: ExpertKey, expert: &Expert) -> bool {
        let part = self.part(key);
        let mut state = part.state();
        if !state.health.usable(now) || state.unsupported.contains(&key) {
            return false;
        }
        match state.residency.warm(key, expert.bytes() as u64) {
            Decision::Hit => true,
            Decision::Admit { .. } => self.upload(part, &mut state, now, key, expert),
            Decision::Cpu => false,
        }
    }

    /// Uploads an expert the residency admitted (room already made); whether it is resident.
    fn upload(&self, part: &Part, state: &mut TierState, now: Instant, key: ExpertKey, expert: &Expert) -> bool {
        let bytes = expert.bytes() as u64;
        let image = match ExpertImage::of(expert) {
            Ok(image) => image,
            Err(e) => {
                tracing::debug!("expert {key:?} stays on the CPU: {e}");
                state.unsupported.insert(key);
                return false;
            }
        };
        let started = std::time::Instant::now();
        let uploaded = part.device.upload(&image);
        if uploaded.is_ok() {
            state.residency.uploaded_in(image.bytes.len() as u64, started.elapsed().as_secs_f64());
        }
        match uploaded {
            Ok(resident) => {
                // The residency counts the expert's bytes as the CPU holds them, which is what
                // the budget means to a user (`--vram-gb`).
                state.residency.admitted(key, bytes);
                state.resident.insert(key, resident);
                self.counters.uploads.fetch_add(1, Ordering::Relaxed);
                self.counters.upload_bytes.fetch_add(image.bytes.len() as u64, Ordering::Relaxed);
                self.publish(part, state);
                true
            }
            Err(GpuError::Unsupported(why)) => {
                tracing::debug!("expert {key:?} stays on the CPU: {why}");
                state.unsupported.insert(key);
                false
            }
            Err(e @ GpuError::OutOfMemory(_)) => {
                // The device holds less than the budget said: what fits now is the budget.
                self.counters.fault(&e);
                state.residency.shrink_to_used();
                tracing::warn!("the GPU ran out of memory at {} resident bytes; that is its budget from now on ({e})", state.residency.used());
                false
            }
            Err(e) => {
                self.fault(part, state, now, e);
                false
            }
        }
    }

    fn fault(&self, part: &Part, state: &mut TierState, now: Instant, e: GpuError) {
        self.counters.fault(&e);
        let rest = state.health.fault(now);
        tracing::warn!("GPU fault ({}): {e}; its experts run on the CPU, device retried in {rest:?}", e.kind());
        if matches!(e, GpuError::Lost(_)) {
            // A lost device's memory is gone: everything is uploaded again when it comes back.
            state.losses += 1;
            for (k, resident) in state.resident.drain() {
                part.device.release(resident);
                state.residency.evicted(k);
            }
            self.publish(part, state);
        }
    }

    /// One device's resident bytes and experts changed: the tier's gauges are the sum.
    fn publish(&self, part: &Part, state: &TierState) {
        part.resident_bytes.store(state.residency.used(), Ordering::Relaxed);
        part.resident_experts.store(state.residency.len() as u64, Ordering::Relaxed);
        let sum = |f: fn(&Part) -> &AtomicU64| self.parts.iter().map(|p| f(p).load(Ordering::Relaxed)).sum::<u64>();
        self.counters.resident_bytes.store(sum(|p| &p.resident_bytes), Ordering::Relaxed);
        self.counters.resident_experts.store(sum(|p| &p.resident_experts), Ordering::Relaxed);
    }
}

/// A job's activation rows.
fn rows_of(job: &TierJob<'_>) -> usize {
    let hidden = job.expert.map_or(0, |e| e.down.rows);
    job.rows.len().checked_div(hidden).unwrap_or(1)
}

impl std::fmt::Debug for VramTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VramTier").field("devices", &self.device_name()).field("budget", &self.budget()).finish()
    }
}

impl shimmer_experts::Accelerator for VramTier {
    fn holds(&self, layer: usize, expert: u32) -> bool {
        let state = self.part(ExpertKey { layer: layer as u32, expert }).state();
        state.health.usable(Instant::now()) && state.residency.is_resident(ExpertKey { layer: layer as u32, expert })
    }

    fn capacity_bytes(&self) -> u64 {
        self.budget()
    }

    fn cpu_took(&self, byte_rows: u64, elapsed: std::time::Duration) {
        for part in &self.parts {
            part.state().residency.cpu_took(byte_rows, elapsed.as_secs_f64());
        }
    }

    fn pin(&self, experts: &[(usize, u32)]) {
        self.set_pins(experts.iter().map(|&(layer, expert)| ExpertKey { layer: layer as u32, expert }));
    }

    fn warm(&self, layer: usize, expert: u32, weights: &Expert) -> bool {
        VramTier::warm(self, Instant::now(), ExpertKey { layer: layer as u32, expert }, weights)
    }

    fn forward(&self, layer: usize, jobs: &[shimmer_experts::AccelJob<'_>]) -> Vec<Option<Vec<f32>>> {
        let jobs: Vec<TierJob<'_>> =
            jobs.iter().map(|j| TierJob { key: ExpertKey { layer: layer as u32, expert: j.expert }, expert: j.weights, rows: j.rows }).collect();
        VramTier::forward(self, Instant::now(), &jobs)
    }
}

impl Drop for VramTier {
    fn drop(&mut self) {
        for part in &self.parts {
            let resident: Vec<DeviceExpert> = part.state().resident.drain().map(|(_, e)| e).collect();
            for e in resident {
                part.device.release(e);
            }
        }
    }
}
