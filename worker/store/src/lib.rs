//! shimmer-store: where a node's routed experts live — a RAM tier under a byte budget over a
//! container's experts file or an unconverted checkpoint — and the container format itself.
//!
//! Owns: the tiered expert store (this file; DESIGN.md §4), reading and verifying blobs
//! (`source`), the accelerator's share of a layer on a thread of its own (`offload`), the
//! sans-IO cache policies and Belady's optimum (`policy`), routing-trace replay against them
//! (`trace_analysis`), the container's manifest (`container`) and the converter that writes it
//! (`convert`), and the routing-heat file pins are learned from (`usage`).
//!
//! Must never: open a socket or start an async runtime; change which expert a row uses or the
//! arithmetic applied to it; serve bytes whose checksum failed; let a failed read leave the
//! policy believing an expert is resident. The policy decides and sees no clock or file.
//!
//! The tiered expert store: routed experts live on storage (a container's experts
//! file, or an unconverted checkpoint) and a RAM cache of a fixed byte budget holds the ones the
//! policy keeps. It implements `ExpertDispatch`, so the decoder cannot tell it from experts held
//! in memory — only the speed differs.
//!
//! - The policy (`policy::LayerLru`: per-layer LRU, a pinned hot set learned from `usage.rs`,
//!   prefetch on lookahead hints) is sans-IO and decides; this module carries its decisions out.
//! - Reads (`io_depth` in flight) serve two queues. Demand reads always go first; at most half
//!   the reads in flight are prefetches, and a queued prefetch that a demand access catches up
//!   with is promoted to the demand queue — so a prefetch never delays a demand read. They reach
//!   the disk through `io_depth` reader threads or one io_uring ring (`uring`), whose thread
//!   submits each batch with one system call and hands large blobs to decoder threads.
//! - Batch-union: each expert a batch selects is read at most once and applied to every row that
//!   chose it; compute starts on resident experts while the missing ones are being read, and each
//!   read expert is computed as soon as it arrives. The experts an accelerator holds are
//!   computed meanwhile on its own thread (`offload`).
//!
//! Must never: change which expert a row uses or the arithmetic applied to it (the sums are the
//! same fixed-point accumulation as `dispatch.rs`), serve bytes whose checksum failed, or let a
//! failed read leave the policy believing an expert is resident.

pub mod container;
pub mod convert;
pub mod gguf_import;
mod offload;
pub mod policy;
pub mod probe;
pub mod source;
pub mod trace_analysis;
pub mod uncached;
#[cfg(target_os = "linux")]
pub mod uring;
pub mod usage;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use shimmer_common::spec::LayerMlp;
use shimmer_common::ModelSpec;

use crate::policy::{Decision, HintStep, Key, LayerLru};
use crate::usage::Usage;
use shimmer_experts::{Accelerator, DispatchError, Expert, ExpertDispatch, MoeBatch};
pub use source::Source;

pub const DEFAULT_IO_DEPTH: usize = 16;

/// `auto` reads through io_uring when a container's blobs are at most this large, with threads
/// above it. Measured on a two-core VM at a 10 % budget (docs/benchmarks.md, "io_uring"): the
/// ring decoded the demo's 28 KB experts 1.28× as fast as threads (medians of four pairs), and
/// m1b's 885 KB and the 30B shape's 2.65 MB experts 0.94× and 0.91× — where a blob's check and
/// copy, not the system calls, are what a read costs.
pub const AUTO_RING_MAX_BLOB: u64 = 256 << 10;

/// Bytes one routed expert of the model at `dir` takes in memory (its matrices and scales), as
/// the store counts them against a budget.
pub fn expert_bytes_of(dir: &std::path::Path, spec: &ModelSpec) -> Result<u64, shimmer_common::LoadError> {
    crate::container::Container::check_manifest_present(dir)?;
    if crate::container::Container::is_container(dir) {
        return Ok(crate::container::Container::open(dir, spec)?.expert_bytes());
    }
    Ok(Source::checkpoint(std::sync::Arc::new(shimmer_common::Checkpoint::open(dir)?), spec).expert_bytes())
}

pub struct StoreOptions {
    /// Bytes of RAM for resident experts (dense weights are accounted separately).
    pub budget_bytes: u64,
    pub prefetch: bool,
    /// Reads in flight at once (reader threads, or the ring's slots).
    pub io_depth: usize,
    /// How reads reach the disk.
    pub io_engine: IoEngine,
    /// Routing heat to learn pins from and to add this run's to.
    pub usage: Option<Usage>,
    /// Experts to pin and read at start, per MoE layer in order of importance (a worker's
    /// placement assignment); replaces the pins learned from `usage`. Capped so that top-k slots
    /// per layer stay free for the experts it is asked for beyond these.
    pub assigned: Option<Vec<Vec<u16>>>,
    /// The tier above RAM (a GPU's VRAM): experts it holds are computed there without being
    /// read; experts in RAM are offered to it (it may upload them).
    pub accelerator: Option<Arc<dyn Accelerator>>,
}

/// How the store's reads reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// io_uring where the kernel offers it and the experts come from a container of blobs no
    /// larger than `AUTO_RING_MAX_BLOB`; the reader threads otherwise.
    #[default]
    Auto,
    /// `io_depth` threads, each a blocking `pread` at a time (every platform, every source).
    Threads,
    /// One thread and an io_uring ring of `io_depth` reads, each batch one system call (Linux,
    /// containers).
    Uring,
}

impl std::str::FromStr for IoEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(IoEngine::Auto),
            "threads" => Ok(IoEngine::Threads),
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            other => Err(format!("unknown I/O engine {other:?}: auto, threads or uring")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    IoEngine(String),
    #[error(
        "an expert budget of {budget_gb} GB holds {capacity} experts of {expert_mb} MB, fewer than one layer's working set (top-{top_k}); the minimum is {min_gb} GB"
    )]
    BudgetTooSmall { budget_gb: f64, capacity: u64, expert_mb: f64, top_k: usize, min_gb: f64 },
}

/// What the store did, for `--json` timings and metrics.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreTelemetry {
    pub budget_bytes: u64,
    pub expert_bytes: u64,
    pub capacity_experts: u64,
    pub slots_per_layer: usize,
    pub pinned_experts: usize,
    pub resident_experts: usize,
    /// Demand accesses served from RAM.
    pub ram_hits: u64,
    /// Demand accesses that joined a read already in flight (usually a prefetch).
    pub in_flight_hits: u64,
    /// Demand accesses that had to read from storage.
    pub disk_misses: u64,
    pub reads: u64,
    pub bytes_read: u64,
    /// Wall time with at least one read in flight, and the bandwidth over it.
    pub read_busy_s: f64,
    pub read_gb_s: f64,
    pub prefetch_issued: u64,
    /// Prefetched experts later used by a demand access.
    pub prefetch_useful: u64,
    /// Time the forward pass waited for reads.
    pub io_wait_ms: f64,
    pub mirror_fallbacks: u64,
    /// Reads that failed (an I/O error, a checksum that did not match): each one an expert this
    /// store could not serve.
    pub read_errors: u64,
    pub drives: Vec<(String, f64)>,
    /// "uring" or "threads": how the reads reached the disk.
    pub io_engine: String,
}

type ReadResult = Result<Arc<Expert>, String>;

struct Pending {
    result: Mutex<Option<ReadResult>>,
    done: Condvar,
}

impl Pending {
    fn new() -> Arc<Self> {
        Arc::new(Pending { result: Mutex::new(None), done: Condvar::new() })
    }
    fn set(&self, r: ReadResult) {
        *lock(&self.result) = Some(r);
        self.done.notify_all();
    }
    fn try_get(&self) -> Option<ReadResult> {
        lock(&self.result).clone()
    }
    fn wait(&self) -> ReadResult {
        let mut g = lock(&self.result);
        loop {
            if let Some(r) = g.clone() {
                return r;
            }
            g = self.done.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

enum Slot {
    Ready(Arc<Expert>),
    Loading(Arc<Pending>),
}

struct Job {
    key: Key,
    layer: usize,
    expert: usize,
    pending: Arc<Pending>,
    prefetch: bool,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    running_prefetch: usize,
    /// Prefetches (hinted or warming pins) queued or running; hints stop at `io_depth` of them so
    /// stale hints do not pile up.
    hinted_outstanding: usize,
    shutdown: bool,
}

impl Queues {
    /// The job a free reader takes next: any demand read first; a prefetch only while fewer than
    /// `max_running_prefetch` prefetches are being read, so demand reads always find a reader.
    fn take(&mut self, max_running_prefetch: usize) -> Option<Job> {
        if let Some(j) = self.demand.pop_front() {
            return Some(j);
        }
        if self.running_prefetch < max_running_prefetch.max(1) {
            let j = self.prefetch.pop_front()?;
            self.running_prefetch += 1;
            return Some(j);
        }
        None
    }

    /// Queued prefetches of experts a demand access now waits for become demand reads.
    fn promote(&mut self, waiting: &[&Arc<Pending>]) {
        let mut i = 0;
        while i < self.prefetch.len() {
            if waiting.iter().any(|p| Arc::ptr_eq(p, &self.prefetch[i].pending)) {
                if let Some(mut j) = self.prefetch.remove(i) {
                    j.prefetch = false;
                    self.hinted_outstanding = self.hinted_outstanding.saturating_sub(1);
                    self.demand.push_back(j);
                }
            } else {
                i += 1;
            }
        }
    }
}

struct State {
    policy: LayerLru,
    slots: HashMap<Key, Slot>,
    prefetched_unused: HashSet<Key>,
    /// How many slots are `Ready`.
    ready: usize,
}

impl State {
    fn remove_slot(&mut self, key: &Key) -> Option<Slot> {
        let slot = self.slots.remove(key);
        self.ready -= usize::from(matches!(slot, Some(Slot::Ready(_))));
        slot
    }

    fn insert_ready(&mut self, key: Key, expert: Arc<Expert>) {
        let before = self.slots.insert(key, Slot::Ready(expert));
        self.ready += usize::from(!matches!(before, Some(Slot::Ready(_))));
    }
}

#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<Instant>,
    total: Duration,
}

#[derive(Default)]
struct Counters {
    ram_hits: AtomicU64,
    in_flight_hits: AtomicU64,
    disk_misses: AtomicU64,
    reads: AtomicU64,
    bytes_read: AtomicU64,
    prefetch_issued: AtomicU64,
    prefetch_useful: AtomicU64,
    io_wait_ns: AtomicU64,
    read_errors: AtomicU64,
}

struct Inner {
    source: Source,
    /// Model layer → position among MoE layers (the policy's layer index).
    moe_position: Vec<Option<u16>>,
    num_experts: usize,
    /// Experts each row selects: a hint of `top_k` experts is one row's prediction.
    top_k: usize,
    /// Experts of every MoE layer together.
    all_experts: usize,
    io_depth: usize,
    prefetch: bool,
    state: Mutex<State>,
    queues: Mutex<Queues>,
    work: Condvar,
    busy: Mutex<Busy>,
    counters: Counters,
    usage: Mutex<Option<Usage>>,
    telemetry_base: StoreTelemetry,
    accelerator: Option<Arc<dyn Accelerator>>,
    /// The accelerator's share of each layer, on a thread of its own.
    offload: Option<offload::Offload>,
    /// Wakes the ring's thread (when reads go through io_uring).
    #[cfg(target_os = "linux")]
    ring_waker: Option<uring::Waker>,
    /// Blobs the ring read, waiting for a decoder thread to verify and decode them.
    #[cfg(target_os = "linux")]
    to_decode: Mutex<DecodeQueue>,
    #[cfg(target_os = "linux")]
    decode_ready: Condvar,
}

/// Blobs larger than this are verified and decoded on decoder threads, so that the ring's thread
/// goes back to the kernel at once (a 3 MB expert takes about a millisecond to check and copy);
/// smaller ones on the ring's thread, where a hand-off would cost more than the work.
#[cfg(target_os = "linux")]
const INLINE_DECODE_BYTES: usize = 256 << 10;

#[cfg(target_os = "linux")]
#[derive(Default)]
struct DecodeQueue {
    blobs: VecDeque<(Job, source::AlignedBuf)>,
    /// The ring's thread has stopped: decoders leave once the queue is empty.
    ring_done: bool,
}

pub struct ExpertStore {
    inner: Arc<Inner>,
    readers: Vec<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ExpertStore {
    pub fn open(source: Source, spec: &ModelSpec, opts: StoreOptions) -> Result<Self, StoreError> {
        let expert_bytes = source.expert_bytes().max(1);
        let moe_layers = spec.layers.iter().filter(|k| **k == LayerMlp::Moe).count().max(1);
        let all_experts = (moe_layers * spec.moe.num_experts) as u64;
        let capacity = opts.budget_bytes / expert_bytes;
        let top_k = spec.moe.top_k;
        if capacity < top_k as u64 {
            // Six decimals of GB (kB resolution), the minimum rounded up so that it works as given.
            let gb = |b: u64| (b as f64 / 1e3).ceil() / 1e6;
            return Err(StoreError::BudgetTooSmall {
                budget_gb: (opts.budget_bytes as f64 / 1e3).round() / 1e6,
                capacity,
                expert_mb: (expert_bytes as f64 / 1e3).round() / 1e3,
                top_k,
                min_gb: gb(expert_bytes * top_k as u64),
            });
        }
        let slots_per_layer = ((capacity / moe_layers as u64) as usize).min(spec.moe.num_experts);
        let mut vram_pins: Vec<(usize, u32)> = Vec::new();
        let pins = match (&opts.assigned, &opts.usage) {
            (Some(a), _) => a.iter().map(|l| l.iter().copied().take(slots_per_layer.saturating_sub(top_k)).collect()).collect(),
            (None, Some(u)) => {
                // The tiers learned from heat: the hottest experts of each layer are pinned in the
                // tier above RAM (as many as half its capacity holds), the next ones in RAM.
                let above =
                    opts.accelerator.as_ref().map_or(0, |a| (a.capacity_bytes() / 2 / expert_bytes / moe_layers as u64) as usize).min(spec.moe.num_experts);
                let hottest = u.hottest(above + slots_per_layer / 2);
                let per_layer: Vec<(usize, Vec<u16>)> =
                    spec.layers.iter().zip(hottest).enumerate().filter(|(_, (k, _))| **k == LayerMlp::Moe).map(|(l, (_, p))| (l, p)).collect();
                if let Some(a) = opts.accelerator.as_ref().filter(|_| above > 0) {
                    // By rank, then layer: warming at start reaches every layer's hottest first.
                    let mut ranked: Vec<(usize, usize, u32)> =
                        per_layer.iter().flat_map(|(l, hot)| hot.iter().take(above).enumerate().map(move |(rank, e)| (rank, *l, *e as u32))).collect();
                    ranked.sort_unstable();
                    vram_pins = ranked.into_iter().map(|(_, l, e)| (l, e)).collect();
                    a.pin(&vram_pins);
                }
                per_layer.into_iter().map(|(_, hot)| hot.into_iter().skip(above).collect()).collect()
            }
            (None, None) => vec![Vec::new(); moe_layers],
        };
        let pinned_experts = pins.iter().map(Vec::len).sum();
        let mut policy = LayerLru::new(moe_layers, slots_per_layer).with_pins(pins);
        if opts.prefetch {
            policy = policy.with_prefetch(top_k);
        }
        let mut position = 0u16;
        let moe_position = spec
            .layers
            .iter()
            .map(|k| {
                (*k == LayerMlp::Moe).then(|| {
                    position += 1;
                    position - 1
                })
            })
            .collect();
        let telemetry_base = StoreTelemetry {
            budget_bytes: opts.budget_bytes,
            expert_bytes,
            capacity_experts: capacity.min(all_experts),
            slots_per_layer,
            pinned_experts,
            drives: source.drives().into_iter().map(|(p, w)| (p.display().to_string(), w)).collect(),
            ..Default::default()
        };
        let io_depth = opts.io_depth.clamp(1, 256);
        #[cfg(target_os = "linux")]
        let ring: Option<uring::Ring<Job>> = match opts.io_engine {
            IoEngine::Threads => None,
            IoEngine::Auto if !source.is_container() || source.largest_blob() > AUTO_RING_MAX_BLOB => None,
            IoEngine::Uring if !source.is_container() => return Err(StoreError::IoEngine(
                "--io-engine uring reads a container's experts file, and this model's experts come from a checkpoint: convert it, or use --io-engine threads"
                    .into(),
            )),
            IoEngine::Auto => uring::Ring::new(io_depth).map_err(|e| tracing::info!("io_uring unavailable ({e}): reading with threads")).ok(),
            IoEngine::Uring => {
                Some(uring::Ring::new(io_depth).map_err(|e| StoreError::IoEngine(format!("io_uring is not available here ({e}): use --io-engine threads")))?)
            }
        };
        #[cfg(target_os = "linux")]
        let ring = match ring {
            Some(r) => Some(r.failing_at_wait(uring::fault_from_env().map_err(StoreError::IoEngine)?)),
            None => None,
        };
        #[cfg(not(target_os = "linux"))]
        if opts.io_engine == IoEngine::Uring {
            return Err(StoreError::IoEngine("io_uring is Linux-only: use --io-engine threads".into()));
        }
        #[cfg(target_os = "linux")]
        let engine_name = if ring.is_some() { "uring" } else { "threads" };
        #[cfg(not(target_os = "linux"))]
        let engine_name = "threads";
        let telemetry_base = StoreTelemetry { io_engine: engine_name.to_string(), ..telemetry_base };
        let inner = Arc::new(Inner {
            source,
            moe_position,
            num_experts: spec.moe.num_experts,
            top_k: spec.moe.top_k,
            io_depth,
            prefetch: opts.prefetch,
            state: Mutex::new(State { policy, slots: HashMap::new(), prefetched_unused: HashSet::new(), ready: 0 }),
            all_experts: moe_layers * spec.moe.num_experts,
            queues: Mutex::new(Queues::default()),
            work: Condvar::new(),
            busy: Mutex::new(Busy::default()),
            counters: Counters::default(),
            usage: Mutex::new(opts.usage),
            telemetry_base,
            offload: opts.accelerator.clone().map(offload::Offload::start),
            accelerator: opts.accelerator,
            #[cfg(target_os = "linux")]
            ring_waker: ring.as_ref().map(uring::Ring::waker),
            #[cfg(target_os = "linux")]
            to_decode: Mutex::new(DecodeQueue::default()),
            #[cfg(target_os = "linux")]
            decode_ready: Condvar::new(),
        });
        #[cfg(target_os = "linux")]
        let readers = match ring {
            Some(ring) => {
                // The ring's thread first: dropping the store joins it before the decoders,
                // which leave once it has handed over its last blob.
                let ring_thread = {
                    let inner = inner.clone();
                    std::thread::Builder::new().name("expert-ring".into()).spawn(move || inner.ring_loop(ring)).expect("spawn the ring's thread")
                };
                // More decoders than cores: checking and copying a 3 MB blob is on the decode's
                // critical path, and on a two-core machine two decoders got too small a share
                // of the CPU beside the compute threads (q30 at 10 %: 22 tok/s against 28 with
                // eight; docs/benchmarks.md, "io_uring").
                let decoders = (io_depth / 2).max(1);
                std::iter::once(ring_thread)
                    .chain((0..decoders).map(|n| {
                        let inner = inner.clone();
                        std::thread::Builder::new().name(format!("expert-decode-{n}")).spawn(move || inner.decode_loop()).expect("spawn a decoder thread")
                    }))
                    .collect()
            }
            None => inner.spawn_readers(),
        };
        #[cfg(not(target_os = "linux"))]
        let readers = inner.spawn_readers();
        let mut store = ExpertStore { inner, readers };
        if opts.prefetch {
            store.warm_pins();
            if !vram_pins.is_empty() {
                let inner = store.inner.clone();
                let warming = std::thread::Builder::new().name("vram-warm".into()).spawn(move || inner.warm_vram_pins(&vram_pins));
                match warming {
                    Ok(handle) => store.readers.push(handle),
                    Err(e) => tracing::warn!("cannot start warming the VRAM pins ({e}): they are uploaded on first use"),
                }
            }
        }
        Ok(store)
    }

    /// Queues the learned pins for reading (low priority), so a warm start finds them resident.
    fn warm_pins(&self) {
        let inner = &self.inner;
        let mut jobs = Vec::new();
        {
            let mut st = lock(&inner.state);
            let pins: Vec<Key> = st.policy.pinned().iter().enumerate().flat_map(|(l, p)| p.iter().map(move |e| (l as u16, *e))).collect();
            for key in pins {
                if let Some(d) = st.policy.decide_hint(key, HintStep::Pins) {
                    if let Some(job) = inner.admit_prefetch(&mut st, key, d) {
                        jobs.push(job);
                    }
                }
            }
        }
        let mut q = lock(&inner.queues);
        // Counted like hint-issued prefetches: readers uncount every prefetch they finish.
        q.hinted_outstanding += jobs.len();
        q.prefetch.extend(jobs);
        inner.wake_all();
    }

    pub fn telemetry(&self) -> StoreTelemetry {
        self.inner.telemetry()
    }

    /// Which experts of `layer` are in RAM now.
    pub fn resident(&self, layer: usize) -> Option<Vec<bool>> {
        let state = lock(&self.inner.state);
        Some((0..self.inner.num_experts).map(|e| matches!(state.slots.get(&(layer as u16, e as u16)), Some(Slot::Ready(_)))).collect())
    }

    /// Reads every expert that fits the budget now (benchmarks of a resident model); returns how
    /// many were read.
    pub fn preload(&self) -> Result<usize, DispatchError> {
        let inner = &self.inner;
        let slots = inner.telemetry_base.slots_per_layer.min(inner.num_experts);
        let wanted: Vec<(usize, usize)> =
            inner.moe_position.iter().enumerate().filter(|(_, p)| p.is_some()).flat_map(|(layer, _)| (0..slots).map(move |e| (layer, e))).collect();
        self.load(&wanted)
    }

    /// Reads the given (layer, expert) pairs that are not in RAM now, as far as the cache policy
    /// keeps them, and waits for them (a worker taking on a new share of a placement); returns
    /// how many were read. Pairs that are not experts of this model are skipped.
    pub fn load(&self, wanted: &[(usize, usize)]) -> Result<usize, DispatchError> {
        let inner = &self.inner;
        let mut jobs = Vec::new();
        {
            let mut st = lock(&inner.state);
            for &(layer, e) in wanted {
                let Some(pos) = inner.moe_position.get(layer).copied().flatten() else { continue };
                if e >= inner.num_experts {
                    continue;
                }
                let key = (pos, e as u16);
                if st.slots.contains_key(&key) {
                    continue;
                }
                let d = st.policy.decide(key);
                if let Some(ev) = d.evicted {
                    st.remove_slot(&ev);
                }
                if d.kept {
                    let pending = Pending::new();
                    st.slots.insert(key, Slot::Loading(pending.clone()));
                    jobs.push(Job { key, layer, expert: e, pending, prefetch: false });
                }
            }
        }
        let pendings: Vec<(usize, usize, Arc<Pending>)> = jobs.iter().map(|j| (j.layer, j.expert, j.pending.clone())).collect();
        {
            let mut q = lock(&inner.queues);
            q.demand.extend(jobs);
            inner.wake_all();
        }
        for (layer, expert, p) in &pendings {
            p.wait().map_err(|message| DispatchError::Storage { layer: *layer, expert: *expert as u32, message })?;
        }
        Ok(pendings.len())
    }
}

impl ExpertStore {
    /// Drops the given (layer, expert) pairs from RAM (a worker whose share of a placement
    /// shrank, once no coordinator routes by the old one): their slots go back to the cache,
    /// a later access reads them again. A pair being read now loses its slot too: whoever waits
    /// for the read still gets it, but it does not become resident (a read that finished after
    /// the release used to leave the worker holding more than its share). Returns how many
    /// resident pairs were dropped.
    pub fn release(&self, pairs: &[(usize, usize)]) -> usize {
        let inner = &self.inner;
        let mut st = lock(&inner.state);
        let mut dropped = 0;
        for &(layer, e) in pairs {
            let Some(pos) = inner.moe_position.get(layer).copied().flatten() else { continue };
            let key = (pos, e.min(u16::MAX as usize) as u16);
            if let Some(slot) = st.remove_slot(&key) {
                st.policy.forget(key);
                st.prefetched_unused.remove(&key);
                dropped += usize::from(matches!(slot, Slot::Ready(_)));
            }
        }
        dropped
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        if let Some(o) = &self.inner.offload {
            o.stop();
        }
        lock(&self.inner.queues).shutdown = true;
        self.inner.wake_all();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

impl Inner {
    fn layer_of_position(&self, pos: u16) -> usize {
        self.moe_position.iter().position(|p| *p == Some(pos)).unwrap_or(0)
    }

    fn spawn_readers(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        (0..self.io_depth)
            .map(|n| {
                let inner = self.clone();
                std::thread::Builder::new().name(format!("expert-read-{n}")).spawn(move || inner.reader_loop()).expect("spawn a reader thread")
            })
            .collect()
    }

    /// `n` new jobs are queued: one reader each (waking every reader on every layer of every
    /// token, most finding nothing to do, costs more than the experts' compute on a small
    /// machine), or the ring's one thread.
    fn wake(&self, n: usize) {
        if n == 0 {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Some(w) = &self.ring_waker {
            w.wake();
        }
        // Also with a ring: a ring that failed left its thread reading on the condition variable.
        for _ in 0..n {
            self.work.notify_one();
        }
    }

    fn wake_all(&self) {
        #[cfg(target_os = "linux")]
        if let Some(w) = &self.ring_waker {
            w.wake();
        }
        self.work.notify_all();
    }

    /// The next job a reader may start, demand first (at most half the reads in flight are
    /// prefetches, so demand always finds room); `None` when there is none or the store shuts
    /// down.
    fn next_job(q: &mut Queues, io_depth: usize) -> Option<Job> {
        if q.shutdown {
            return None;
        }
        q.take(io_depth / 2)
    }

    fn reader_loop(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queues);
                loop {
                    if q.shutdown {
                        return;
                    }
                    if let Some(j) = Self::next_job(&mut q, self.io_depth) {
                        break j;
                    }
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.enter_read();
            let result = self.inner_read(job.layer, job.expert);
            self.leave_read();
            self.settle(job, result);
        }
    }

    /// The ring's thread: takes every job the queues allow into the ring's free slots, hands
    /// them to the kernel with one system call, and settles each read as it completes. A blob
    /// whose read or checksum failed is read again the plain way, which tries every copy.
    #[cfg(target_os = "linux")]
    fn ring_loop(&self, ring: uring::Ring<Job>) {
        self.run_ring(ring);
        lock(&self.to_decode).ring_done = true;
        self.decode_ready.notify_all();
    }

    #[cfg(target_os = "linux")]
    fn run_ring(&self, mut ring: uring::Ring<Job>) {
        loop {
            let (jobs, shutdown) = {
                let mut q = lock(&self.queues);
                let mut jobs = Vec::new();
                while jobs.len() < ring.free_slots() {
                    match Self::next_job(&mut q, self.io_depth) {
                        Some(j) => jobs.push(j),
                        None => break,
                    }
                }
                (jobs, q.shutdown)
            };
            if shutdown {
                // Reads in flight finish (their buffers are the kernel's until then); whoever
                // waits for them still gets their experts.
                match ring.drain() {
                    Ok(done) => done.into_iter().for_each(|(job, outcome)| self.route_ring_read(job, outcome)),
                    Err(e) => {
                        tracing::error!("the expert-read ring failed while shutting down: {e}");
                        for job in ring.abandon() {
                            self.leave_read();
                            self.settle(job, Err("the store shut down".into()));
                        }
                    }
                }
                return;
            }
            for job in jobs {
                self.enter_read();
                match self.source.blob_read(job.layer, job.expert) {
                    Some(read) => {
                        let buf = self.source.spare_buffer(read.len);
                        if let Err((job, why)) = ring.submit(read, buf, job) {
                            tracing::debug!("layer {} expert {}: {why}; read the plain way", job.layer, job.expert);
                            let result = self.inner_read(job.layer, job.expert);
                            self.leave_read();
                            self.settle(job, result);
                        }
                    }
                    None => {
                        let result = self.inner_read(job.layer, job.expert);
                        self.leave_read();
                        self.settle(job, result);
                    }
                }
            }
            match ring.wait() {
                Ok(done) => done.into_iter().for_each(|(job, outcome)| self.route_ring_read(job, outcome)),
                Err(e) => {
                    // The ring as a whole failed: what it held is read again the plain way
                    // (its buffers are leaked, the kernel may still write them), and this
                    // thread goes on as one reader thread.
                    tracing::error!("the expert-read ring failed ({e}): reading on this thread from now on");
                    for job in ring.abandon() {
                        let result = self.inner_read(job.layer, job.expert);
                        self.leave_read();
                        self.settle(job, result);
                    }
                    return self.reader_loop();
                }
            }
        }
    }

    /// A large blob goes to the decoders; a small one, or a failed read, is settled here.
    #[cfg(target_os = "linux")]
    fn route_ring_read(&self, job: Job, outcome: Result<source::AlignedBuf, String>) {
        match outcome {
            Ok(buf) if buf.len() > INLINE_DECODE_BYTES => {
                lock(&self.to_decode).blobs.push_back((job, buf));
                self.decode_ready.notify_one();
            }
            outcome => self.finish_ring_read(job, outcome),
        }
    }

    #[cfg(target_os = "linux")]
    fn decode_loop(&self) {
        loop {
            let (job, buf) = {
                let mut q = lock(&self.to_decode);
                loop {
                    if let Some(item) = q.blobs.pop_front() {
                        break item;
                    }
                    if q.ring_done {
                        return;
                    }
                    q = self.decode_ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.finish_ring_read(job, Ok(buf));
        }
    }

    #[cfg(target_os = "linux")]
    fn finish_ring_read(&self, job: Job, outcome: Result<source::AlignedBuf, String>) {
        let decoded = outcome.and_then(|buf| self.source.decode_blob(job.layer, job.expert, buf));
        let result = match decoded {
            Ok((expert, bytes)) => {
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_read.fetch_add(bytes, Ordering::Relaxed);
                Ok(Arc::new(expert))
            }
            Err(why) => {
                tracing::debug!("{why}; read again the plain way");
                self.inner_read(job.layer, job.expert)
            }
        };
        self.leave_read();
        self.settle(job, result);
    }

    /// A finished read: the prefetch accounting, the slot (resident, or forgotten when the read
    /// failed), then whoever waits for it.
    fn settle(&self, job: Job, result: ReadResult) {
        if job.prefetch {
            let mut q = lock(&self.queues);
            q.running_prefetch -= 1;
            q.hinted_outstanding = q.hinted_outstanding.saturating_sub(1);
            // A queued prefetch may have been waiting for this reader's prefetch slot.
            if !q.prefetch.is_empty() {
                self.wake(1);
            }
        }
        {
            let mut st = lock(&self.state);
            let ours = matches!(st.slots.get(&job.key), Some(Slot::Loading(p)) if Arc::ptr_eq(p, &job.pending));
            if ours {
                match &result {
                    Ok(e) => {
                        st.insert_ready(job.key, e.clone());
                    }
                    Err(_) => {
                        st.remove_slot(&job.key);
                        st.policy.forget(job.key);
                        st.prefetched_unused.remove(&job.key);
                    }
                }
            }
        }
        job.pending.set(result);
    }

    fn inner_read(&self, layer: usize, expert: usize) -> ReadResult {
        match self.source.read(layer, expert) {
            Ok((e, bytes)) => {
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_read.fetch_add(bytes, Ordering::Relaxed);
                Ok(Arc::new(e))
            }
            Err(e) => {
                self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                Err(e.to_string())
            }
        }
    }

    fn enter_read(&self) {
        let mut b = lock(&self.busy);
        if b.in_flight == 0 {
            b.since = Some(Instant::now());
        }
        b.in_flight += 1;
    }

    fn leave_read(&self) {
        let mut b = lock(&self.busy);
        b.in_flight -= 1;
        if b.in_flight == 0 {
            if let Some(s) = b.since.take() {
                b.total += s.elapsed();
            }
        }
    }

    /// Carries out a prefetch decision: the slot becomes Loading and a job is returned to queue.
    fn admit_prefetch(&self, st: &mut State, key: Key, d: Decision) -> Option<Job> {
        if let Some(ev) = d.evicted {
            st.remove_slot(&ev);
            st.prefetched_unused.remove(&ev);
        }
        if st.slots.contains_key(&key) {
            return None;
        }
        let pending = Pending::new();
        st.slots.insert(key, Slot::Loading(pending.clone()));
        st.prefetched_unused.insert(key);
        self.counters.prefetch_issued.fetch_add(1, Ordering::Relaxed);
        Some(Job { key, layer: self.layer_of_position(key.0), expert: key.1 as usize, pending, prefetch: true })
    }

    /// Reads each VRAM pin and hands it to the accelerator to upload, one at a time, so the first
    /// tokens find them on the device instead of uploading them on the way. Stops when the store
    /// shuts down or the accelerator declines one (full, backing off after a fault, or a format
    /// it cannot compute: the rest would be declined too). These reads are the tier's: they stay
    /// out of the RAM tier's slots and counters.
    fn warm_vram_pins(&self, pins: &[(usize, u32)]) {
        let Some(a) = self.accelerator.as_deref() else { return };
        for &(layer, expert) in pins {
            if lock(&self.queues).shutdown {
                return;
            }
            if a.holds(layer, expert) {
                continue;
            }
            match self.source.read(layer, expert as usize) {
                Ok((weights, _)) => {
                    if !a.warm(layer, expert, &weights) {
                        tracing::debug!("the accelerator declined pinned expert {expert} of layer {layer}: the rest are uploaded on first use");
                        return;
                    }
                }
                // Read again, with its error reported, when a step wants it.
                Err(e) => tracing::debug!("warming pinned expert {expert} of layer {layer}: {e}"),
            }
        }
    }

    fn telemetry(&self) -> StoreTelemetry {
        let c = &self.counters;
        let busy = {
            let b = lock(&self.busy);
            b.total + b.since.map_or(Duration::ZERO, |s| s.elapsed())
        };
        let bytes_read = c.bytes_read.load(Ordering::Relaxed);
        let read_busy_s = busy.as_secs_f64();
        StoreTelemetry {
            resident_experts: lock(&self.state).ready,
            ram_hits: c.ram_hits.load(Ordering::Relaxed),
            in_flight_hits: c.in_flight_hits.load(Ordering::Relaxed),
            disk_misses: c.disk_misses.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            bytes_read,
            read_busy_s,
            read_gb_s: if read_busy_s > 0.0 { bytes_read as f64 / read_busy_s / 1e9 } else { 0.0 },
            prefetch_issued: c.prefetch_issued.load(Ordering::Relaxed),
            prefetch_useful: c.prefetch_useful.load(Ordering::Relaxed),
            io_wait_ms: c.io_wait_ns.load(Ordering::Relaxed) as f64 / 1e6,
            mirror_fallbacks: self.source.mirror_fallbacks(),
            read_errors: c.read_errors.load(Ordering::Relaxed),
            ..self.telemetry_base.clone()
        }
    }
}

impl ExpertStore {
    /// Finds each of `keys` (one layer's experts) in RAM or in flight, or starts its read on
    /// demand: the resident ones go to `ready`, the rest to `waiting`.
    fn look_up(&self, layer: usize, mut keys: Vec<Key>, ready: &mut Vec<(usize, Arc<Expert>)>, waiting: &mut Vec<(usize, Arc<Pending>)>) {
        if keys.is_empty() {
            return;
        }
        let inner = &self.inner;
        let mut jobs = Vec::new();
        let first_waiting = waiting.len();
        {
            let mut st = lock(&inner.state);
            crate::policy::batch_order(&st.policy, &mut keys);
            for key in keys {
                let e = key.1 as usize;
                let d = st.policy.decide(key);
                if let Some(ev) = d.evicted {
                    st.remove_slot(&ev);
                    st.prefetched_unused.remove(&ev);
                }
                if st.prefetched_unused.remove(&key) {
                    inner.counters.prefetch_useful.fetch_add(1, Ordering::Relaxed);
                }
                match st.slots.get(&key) {
                    Some(Slot::Ready(x)) => {
                        inner.counters.ram_hits.fetch_add(1, Ordering::Relaxed);
                        ready.push((e, x.clone()));
                    }
                    Some(Slot::Loading(p)) => {
                        inner.counters.in_flight_hits.fetch_add(1, Ordering::Relaxed);
                        waiting.push((e, p.clone()));
                    }
                    None => {
                        inner.counters.disk_misses.fetch_add(1, Ordering::Relaxed);
                        let pending = Pending::new();
                        if d.kept {
                            st.slots.insert(key, Slot::Loading(pending.clone()));
                        }
                        jobs.push(Job { key, layer, expert: e, pending: pending.clone(), prefetch: false });
                        waiting.push((e, pending));
                    }
                }
            }
        }
        // Demand first; a queued prefetch this batch now needs is promoted to demand.
        let mut q = lock(&inner.queues);
        let pendings: Vec<&Arc<Pending>> = waiting[first_waiting..].iter().map(|(_, p)| p).collect();
        let before = q.demand.len();
        q.promote(&pendings);
        q.demand.extend(jobs);
        // One reader per new read: waking all of them on every layer of every token (most find
        // nothing to do) costs more than the experts' compute on a small machine.
        inner.wake(q.demand.len() - before);
    }
}

impl ExpertDispatch for ExpertStore {
    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        let inner = &self.inner;
        let layer = batch.layer;
        let pos = inner.moe_position.get(layer).copied().flatten().ok_or(DispatchError::NotMoeLayer { layer })?;
        let users = shimmer_experts::dispatch::expert_users(batch, inner.num_experts)?;
        if let Some(u) = lock(&inner.usage).as_mut() {
            for e in batch.experts {
                u.record(layer, *e as usize);
            }
        }
        // Resident experts, and those being read (by this batch or an earlier prefetch).
        let mut ready: Vec<(usize, Arc<Expert>)> = Vec::new();
        let mut waiting: Vec<(usize, Arc<Pending>)> = Vec::new();
        let accelerator = inner.accelerator.as_deref();
        let keys = users.iter().enumerate().filter(|(_, u)| !u.is_empty()).map(|(e, _)| (pos, e as u16));
        // The tier above RAM first: what the accelerator holds needs no RAM slot and no read.
        let (on_device, keys): (Vec<Key>, Vec<Key>) = keys.partition(|k| accelerator.is_some_and(|a| a.holds(layer, k.1 as u32)));
        let on_device: Vec<usize> = on_device.into_iter().map(|k| k.1 as usize).collect();
        self.look_up(layer, keys, &mut ready, &mut waiting);
        // The accelerator's share runs on its own thread while this one computes the CPU's (if
        // there is any): a layer split between VRAM and RAM takes the longer of the two.
        let mut device_share = match (&inner.offload, on_device.is_empty()) {
            (Some(o), false) => {
                let rows: Vec<Vec<f32>> = on_device.iter().map(|&e| shimmer_experts::dispatch::gather_rows(batch, &users[e])).collect();
                let overlap = !ready.is_empty() || !waiting.is_empty();
                Some(o.submit(layer, on_device.iter().map(|&e| e as u32).collect(), rows, overlap))
            }
            _ => None,
        };
        // Compute what is ready while the rest is read; then each read expert as it arrives;
        // then what the accelerator declined (a fault, or evicted meanwhile), from RAM or disk.
        loop {
            if !ready.is_empty() {
                let work: Vec<shimmer_experts::dispatch::Work<'_>> = ready.iter().map(|(e, x)| (*e as u32, x.as_ref(), users[*e].as_slice())).collect();
                shimmer_experts::dispatch::apply_experts(batch, &work, accelerator, acc)?;
                ready.clear();
            }
            if waiting.is_empty() {
                let Some(share) = device_share.take() else { return Ok(()) };
                let outputs = share.wait();
                let mut declined = Vec::new();
                for (i, &e) in on_device.iter().enumerate() {
                    match outputs.get(i).and_then(Option::as_ref) {
                        Some(ys) if ys.len() == users[e].len() * batch.hidden => shimmer_experts::dispatch::add_weighted(batch, &users[e], ys, acc)?,
                        _ => declined.push((pos, e as u16)),
                    }
                }
                self.look_up(layer, declined, &mut ready, &mut waiting);
                continue;
            }
            // Take everything already read; if nothing is, wait for the first outstanding read.
            let mut still = Vec::new();
            for (e, p) in waiting.drain(..) {
                match p.try_get() {
                    Some(r) => ready.push((e, r.map_err(|message| DispatchError::Storage { layer, expert: e as u32, message })?)),
                    None => still.push((e, p)),
                }
            }
            waiting = still;
            if ready.is_empty() {
                if let Some((e, p)) = waiting.first().cloned() {
                    let t = Instant::now();
                    let r = p.wait();
                    inner.counters.io_wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    ready.push((e, r.map_err(|message| DispatchError::Storage { layer, expert: e as u32, message })?));
                    waiting.remove(0);
                }
            }
        }
    }

    /// Not once every expert is in RAM (a budget that holds the whole model, after the first
    /// touches or a preload): predicting the next layer's choice then costs a router product
    /// and a sort a layer for nothing (~5 % of the demo model's decode).
    fn wants_lookahead(&self) -> bool {
        self.inner.prefetch && lock(&self.inner.state).ready < self.inner.all_experts
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let inner = &self.inner;
        let Some(pos) = inner.moe_position.get(layer).copied().flatten() else { return };
        // Experts the tier above RAM holds will not be read.
        let held = |e: u32| inner.accelerator.as_ref().is_some_and(|a| a.holds(layer, e));
        let mut unique: Vec<u32> = experts.iter().copied().filter(|e| (*e as usize) < inner.num_experts && !held(*e)).collect();
        unique.sort_unstable();
        unique.dedup();
        let cap = inner.io_depth;
        let step = HintStep::of_rows(experts.len() / inner.top_k.max(1));
        let mut jobs = Vec::new();
        {
            let mut q = lock(&inner.queues);
            let mut st = lock(&inner.state);
            for e in unique {
                let key = (pos, e as u16);
                if !st.slots.contains_key(&key) && q.hinted_outstanding + jobs.len() >= cap {
                    continue;
                }
                if let Some(d) = st.policy.decide_hint(key, step) {
                    if let Some(job) = inner.admit_prefetch(&mut st, key, d) {
                        jobs.push(job);
                    }
                }
            }
            q.hinted_outstanding += jobs.len();
            inner.wake(jobs.len());
            q.prefetch.extend(jobs);
        }
    }

    fn end_turn(&self) -> Result<(), String> {
        match lock(&self.inner.usage).as_mut() {
            Some(u) => u.save().map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(e: usize, prefetch: bool) -> Job {
        Job { key: (0, e as u16), layer: 0, expert: e, pending: Pending::new(), prefetch }
    }

    #[test]
    fn demand_reads_go_first_and_prefetches_never_take_every_reader() {
        let mut q = Queues::default();
        q.prefetch.extend((0..6).map(|e| job(e, true)));
        // With room for two running prefetches, two are taken, then readers wait for demand.
        assert!(q.take(2).is_some_and(|j| j.prefetch));
        assert!(q.take(2).is_some_and(|j| j.prefetch));
        assert!(q.take(2).is_none(), "a third reader must stay free for demand");
        q.demand.push_back(job(9, false));
        let j = q.take(2).unwrap();
        assert_eq!((j.expert, j.prefetch), (9, false), "demand goes past queued prefetches");
        // A queued prefetch that a demand access now waits for is promoted.
        let wanted = q.prefetch[2].pending.clone();
        q.promote(&[&wanted]);
        let j = q.take(2).unwrap();
        assert!(Arc::ptr_eq(&j.pending, &wanted) && !j.prefetch);
        assert_eq!(q.prefetch.len(), 3);
        q.running_prefetch = 0;
        assert!(q.take(2).is_some_and(|j| j.prefetch));
    }
}
