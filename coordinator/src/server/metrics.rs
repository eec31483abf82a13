//! `/metrics` in Prometheus' text format. Request series follow vLLM's names (with the
//! `shimmer_` prefix) and buckets, so dashboards and autoscalers written for it carry over; the
//! expert store's series (accesses per tier, bytes, prefetch use, I/O wait, read errors, resident
//! and pinned experts) are shimmer's own, and so are the cluster's series
//! (per worker: up, request round-trip histogram, path RTT, bytes each way, round trips,
//! selections, errors, resident experts; overall: tokens through the MoE layers, network wait,
//! failovers), collected from the dispatcher's running totals by a `Collector` at each scrape.

use std::sync::Mutex;
use std::time::Duration;

use prometheus::core::Desc;
use prometheus::proto::{self, LabelPair, MetricType};
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use shimmer_cluster::{ClusterTelemetry, WorkerLink, RTT_BUCKETS};
use shimmer_store::StoreTelemetry;

use super::batcher::BatcherStats;

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
const ITL_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    ttft: Histogram,
    itl: Histogram,
    queue: Histogram,
    e2e: Histogram,
    running: IntGauge,
    waiting: IntGauge,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    expert_accesses: IntCounterVec,
    expert_bytes_read: IntCounter,
    kv_usage: prometheus::Gauge,
    prefix_hits: IntCounter,
    prefix_tokens: IntCounter,
    store: StoreSeries,
    gpu: GpuSeries,
    cluster: ClusterCollector,
    /// Counter values already exported (counters only go up; the sources are running totals).
    seen: Mutex<[u64; SEEN]>,
}

/// Running totals `render` turns into counter increments (see `seen`).
const SEEN: usize = 12;

/// The expert store's series beyond accesses and bytes: prefetch use, time the forward pass
/// waited for reads, failed reads, mirror fallbacks, and how many experts are resident and pinned.
#[derive(Clone)]
struct StoreSeries {
    prefetch_issued: IntCounter,
    prefetch_useful: IntCounter,
    io_wait: prometheus::Counter,
    read_errors: IntCounter,
    mirror_fallbacks: IntCounter,
    resident: IntGauge,
    pinned: IntGauge,
    capacity: IntGauge,
}

impl StoreSeries {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let s = StoreSeries {
            prefetch_issued: IntCounter::new("shimmer_expert_prefetch_issued_total", "Experts read ahead of need by the prefetcher")?,
            prefetch_useful: IntCounter::new("shimmer_expert_prefetch_useful_total", "Prefetched experts a later demand access used")?,
            io_wait: prometheus::Counter::new("shimmer_expert_io_wait_seconds_total", "Time the forward pass waited for expert reads")?,
            read_errors: IntCounter::new("shimmer_expert_read_errors_total", "Expert reads that failed (I/O errors, checksum mismatches)")?,
            mirror_fallbacks: IntCounter::new("shimmer_expert_mirror_fallbacks_total", "Expert reads served from the mirror after the primary copy failed")?,
            resident: IntGauge::new("shimmer_expert_resident", "Experts resident in RAM")?,
            pinned: IntGauge::new("shimmer_expert_pinned", "Experts pinned in RAM (never evicted)")?,
            capacity: IntGauge::new("shimmer_expert_cache_capacity", "Experts the RAM budget holds")?,
        };
        for c in [
            Box::new(s.prefetch_issued.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(s.prefetch_useful.clone()),
            Box::new(s.io_wait.clone()),
            Box::new(s.read_errors.clone()),
            Box::new(s.mirror_fallbacks.clone()),
            Box::new(s.resident.clone()),
            Box::new(s.pinned.clone()),
            Box::new(s.capacity.clone()),
        ] {
            registry.register(c)?;
        }
        Ok(s)
    }
}

/// The VRAM tier's series: faults by kind, uploads, evictions, what is resident, and experts
/// computed from VRAM, resident already (`shimmer_expert_accesses_total{tier="vram"}`).
struct GpuSeries {
    faults: IntCounterVec,
    uploads: IntCounter,
    upload_bytes: IntCounter,
    evictions: IntCounter,
    resident_bytes: IntGauge,
    resident: IntGauge,
    budget_bytes: IntGauge,
    /// Running totals already exported, by series (kinds of fault included).
    seen: Mutex<std::collections::HashMap<String, u64>>,
}

impl GpuSeries {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let s = GpuSeries {
            faults: IntCounterVec::new(
                Opts::new("shimmer_gpu_faults_total", "GPU submissions that failed (their experts were recomputed on the CPU), by kind"),
                &["kind"],
            )?,
            uploads: IntCounter::new("shimmer_vram_uploads_total", "Experts uploaded to the GPU")?,
            upload_bytes: IntCounter::new("shimmer_vram_upload_bytes_total", "Expert bytes uploaded to the GPU")?,
            evictions: IntCounter::new("shimmer_vram_evictions_total", "Experts evicted from the GPU's memory")?,
            resident_bytes: IntGauge::new("shimmer_vram_resident_bytes", "Expert bytes resident in GPU memory")?,
            resident: IntGauge::new("shimmer_vram_resident_experts", "Experts resident in GPU memory")?,
            budget_bytes: IntGauge::new("shimmer_vram_budget_bytes", "GPU memory the VRAM tier may use for experts")?,
            seen: Mutex::new(Default::default()),
        };
        for c in [
            Box::new(s.faults.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(s.uploads.clone()),
            Box::new(s.upload_bytes.clone()),
            Box::new(s.evictions.clone()),
            Box::new(s.resident_bytes.clone()),
            Box::new(s.resident.clone()),
            Box::new(s.budget_bytes.clone()),
        ] {
            registry.register(c)?;
        }
        // Every kind from the start, at 0: an alert on a rate needs the series before the first fault.
        for kind in shimmer_gpu::GpuError::KINDS {
            s.faults.with_label_values(&[kind]);
        }
        Ok(s)
    }
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(Opts::new("shimmer_request_total", "Finished requests by outcome"), &["outcome"])?;
        let ttft = Histogram::with_opts(HistogramOpts::new("shimmer_time_to_first_token_seconds", "Time to first token").buckets(TTFT_BUCKETS.to_vec()))?;
        let itl = Histogram::with_opts(
            HistogramOpts::new("shimmer_inter_token_latency_seconds", "Time between a request's consecutive generated tokens").buckets(ITL_BUCKETS.to_vec()),
        )?;
        let queue = Histogram::with_opts(
            HistogramOpts::new("shimmer_request_queue_time_seconds", "Time a request waited for a batch slot").buckets(E2E_BUCKETS.to_vec()),
        )?;
        let e2e = Histogram::with_opts(HistogramOpts::new("shimmer_e2e_request_latency_seconds", "End-to-end request latency").buckets(E2E_BUCKETS.to_vec()))?;
        let running = IntGauge::new("shimmer_num_requests_running", "Requests in the running batch")?;
        let waiting = IntGauge::new("shimmer_num_requests_waiting", "Requests waiting for a batch slot")?;
        let prompt_tokens = IntCounter::new("shimmer_prompt_tokens_total", "Prompt tokens prefilled")?;
        let generation_tokens = IntCounter::new("shimmer_generation_tokens_total", "Tokens generated")?;
        let expert_accesses =
            IntCounterVec::new(Opts::new("shimmer_expert_accesses_total", "Routed-expert accesses by where they were served from"), &["tier", "result"])?;
        let expert_bytes_read = IntCounter::new("shimmer_expert_bytes_read_total", "Expert bytes read from storage")?;
        let kv_usage = prometheus::Gauge::new(
            "shimmer_kv_cache_usage_perc",
            "KV held (running requests and the prefix cache) as a fraction of the prefix cache's budget",
        )?;
        let prefix_hits = IntCounter::new("shimmer_prefix_cache_hits_total", "Requests that started from a cached prefix")?;
        let prefix_tokens = IntCounter::new("shimmer_prefix_cache_reused_tokens_total", "Prompt tokens not prefilled thanks to a cached prefix")?;
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(ttft.clone()),
            Box::new(itl.clone()),
            Box::new(queue.clone()),
            Box::new(e2e.clone()),
            Box::new(running.clone()),
            Box::new(waiting.clone()),
            Box::new(prompt_tokens.clone()),
            Box::new(generation_tokens.clone()),
            Box::new(expert_accesses.clone()),
            Box::new(expert_bytes_read.clone()),
            Box::new(kv_usage.clone()),
            Box::new(prefix_hits.clone()),
            Box::new(prefix_tokens.clone()),
        ] {
            registry.register(c)?;
        }
        let store = StoreSeries::new(&registry)?;
        let gpu = GpuSeries::new(&registry)?;
        let cluster = ClusterCollector::new()?;
        registry.register(Box::new(cluster.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            ttft,
            itl,
            queue,
            e2e,
            running,
            waiting,
            prompt_tokens,
            generation_tokens,
            expert_accesses,
            expert_bytes_read,
            kv_usage,
            prefix_hits,
            prefix_tokens,
            store,
            gpu,
            cluster,
            seen: Mutex::new([0; SEEN]),
        })
    }

    /// How long a request waited before the batcher admitted it.
    pub fn queued(&self, wait: Duration) {
        self.queue.observe(wait.as_secs_f64());
    }

    /// The gap between two consecutive tokens of one request (observed by the batcher).
    pub fn inter_token(&self, gap: Duration) {
        self.itl.observe(gap.as_secs_f64());
    }

    pub fn first_token(&self, after: Duration) {
        self.ttft.observe(after.as_secs_f64());
    }

    /// A request the client gave up on (it disconnected, or the handler was cancelled).
    pub fn request_cancelled(&self) {
        self.requests.with_label_values(&["cancelled"]).inc();
    }

    pub fn request_finished(&self, after: Duration, ok: bool) {
        self.e2e.observe(after.as_secs_f64());
        self.requests.with_label_values(&[if ok { "success" } else { "failure" }]).inc();
    }

    /// Brings the VRAM tier's series up to its running totals (before `render`).
    pub fn set_gpu(&self, g: Option<&shimmer_gpu::GpuTelemetry>) {
        let Some(g) = g else { return };
        let series = &self.gpu;
        let mut seen = series.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut bump = |name: &str, now: u64, c: &IntCounter| {
            let was = seen.entry(name.to_string()).or_insert(0);
            if now > *was {
                c.inc_by(now - *was);
                *was = now;
            }
        };
        bump("uploads", g.uploads, &series.uploads);
        bump("upload_bytes", g.upload_bytes, &series.upload_bytes);
        bump("evictions", g.evictions, &series.evictions);
        bump("vram_hits", g.vram_hits, &self.expert_accesses.with_label_values(&["vram", "hit"]));
        for (kind, n) in &g.faults {
            bump(&format!("fault:{kind}"), *n, &series.faults.with_label_values(&[kind.as_str()]));
        }
        series.resident_bytes.set(g.resident_bytes as i64);
        series.resident.set(g.resident_experts as i64);
        series.budget_bytes.set(g.budget_bytes as i64);
    }

    /// The text exposition, with the batcher's and the store's totals brought up to date.
    pub fn render(&self, st: &BatcherStats, store: Option<&StoreTelemetry>, cluster: Option<&ClusterTelemetry>) -> Result<String, prometheus::Error> {
        self.running.set(st.running as i64);
        self.waiting.set(st.waiting as i64);
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let now: [u64; SEEN] = [
                st.prompt_tokens,
                st.generated_tokens,
                store.map_or(0, |s| s.ram_hits),
                store.map_or(0, |s| s.disk_misses),
                store.map_or(0, |s| s.bytes_read),
                st.prefix_hits,
                st.prefix_reused_tokens,
                store.map_or(0, |s| s.in_flight_hits),
                store.map_or(0, |s| s.prefetch_issued),
                store.map_or(0, |s| s.prefetch_useful),
                store.map_or(0, |s| s.read_errors),
                store.map_or(0, |s| s.mirror_fallbacks),
            ];
            let bump = |i: usize, c: &IntCounter, seen: &mut [u64; SEEN]| {
                if now[i] > seen[i] {
                    c.inc_by(now[i] - seen[i]);
                    seen[i] = now[i];
                }
            };
            bump(0, &self.prompt_tokens, &mut seen);
            bump(1, &self.generation_tokens, &mut seen);
            bump(2, &self.expert_accesses.with_label_values(&["ram", "hit"]), &mut seen);
            bump(3, &self.expert_accesses.with_label_values(&["disk", "miss"]), &mut seen);
            bump(4, &self.expert_bytes_read, &mut seen);
            bump(5, &self.prefix_hits, &mut seen);
            bump(6, &self.prefix_tokens, &mut seen);
            // A demand access that joined a read already under way (usually a prefetch's).
            bump(7, &self.expert_accesses.with_label_values(&["in_flight", "hit"]), &mut seen);
            bump(8, &self.store.prefetch_issued, &mut seen);
            bump(9, &self.store.prefetch_useful, &mut seen);
            bump(10, &self.store.read_errors, &mut seen);
            bump(11, &self.store.mirror_fallbacks, &mut seen);
            if let Some(t) = store {
                let waited = t.io_wait_ms / 1e3;
                let exported = self.store.io_wait.get();
                if waited > exported {
                    self.store.io_wait.inc_by(waited - exported);
                }
                self.store.resident.set(t.resident_experts as i64);
                self.store.pinned.set(t.pinned_experts as i64);
                self.store.capacity.set(t.capacity_experts as i64);
            }
            self.kv_usage.set(if st.kv_budget_bytes > 0 { st.kv_bytes as f64 / st.kv_budget_bytes as f64 } else { 0.0 });
        }
        self.cluster.set(cluster);
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

/// One request's line on `shimmer_request_total`: `finish` says success or failure; dropped
/// without it — the client left mid-stream, or the handler's future was dropped with the
/// connection — it counts as `cancelled`, so every admitted request is counted once.
pub struct RequestTally {
    metrics: std::sync::Arc<Metrics>,
    since: std::time::Instant,
    done: bool,
}

impl RequestTally {
    pub fn new(metrics: std::sync::Arc<Metrics>) -> Self {
        RequestTally { metrics, since: std::time::Instant::now(), done: false }
    }

    pub fn finish(mut self, ok: bool) {
        self.metrics.request_finished(self.since.elapsed(), ok);
        self.done = true;
    }
}

impl Drop for RequestTally {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.request_cancelled();
        }
    }
}

/// A control-plane member's Raft series (`shimmer_raft_*`, and each model's active placement
/// epoch as the replicated state has it), in the text format. The coordinator's and the
/// worker's `/metrics` both append them.
pub fn render_raft(m: &shimmer_worker::control::RaftMetrics) -> Result<String, prometheus::Error> {
    let series = Snapshot::new();
    series.gauge("shimmer_raft_term", "The Raft term this member is in", m.term as i64)?;
    series.gauge("shimmer_raft_is_leader", "Whether this member leads the control plane", i64::from(m.is_leader))?;
    series.gauge("shimmer_raft_commit_index", "The highest log index this member knows committed", m.commit as i64)?;
    series.gauge("shimmer_raft_applied_index", "The highest log index this member applied", m.applied as i64)?;
    series.gauge("shimmer_raft_apply_lag", "Committed entries not applied yet", m.commit.saturating_sub(m.applied) as i64)?;
    series.counter("shimmer_raft_leader_changes_total", "Leader changes this member saw since it started", m.leader_changes)?;
    series.counter(
        "shimmer_raft_failed_proposals_total",
        "Proposals refused before they reached the log (no leader, a change in progress)",
        m.failed_proposals,
    )?;
    let members = IntGaugeVec::new(Opts::new("shimmer_raft_members", "Members of the control plane by Raft role"), &["role"])?;
    members.with_label_values(&["voter"]).set(m.voters as i64);
    members.with_label_values(&["learner"]).set(m.learners as i64);
    series.register(Box::new(members))?;
    let epochs = IntGaugeVec::new(Opts::new("shimmer_cluster_placement_epoch", "Each model's active placement epoch in the replicated state"), &["model"])?;
    for (model, epoch) in &m.placements {
        epochs.with_label_values(&[model.as_str()]).set(*epoch as i64);
    }
    series.register(Box::new(epochs))?;
    series.render()
}

/// Series whose values are read once per scrape (running totals, current figures): each scrape
/// builds a registry of them and renders it.
pub struct Snapshot {
    registry: Registry,
}

impl Snapshot {
    pub fn new() -> Self {
        Snapshot { registry: Registry::new() }
    }

    pub fn gauge(&self, name: &str, help: &str, v: i64) -> Result<(), prometheus::Error> {
        let g = IntGauge::new(name, help)?;
        g.set(v);
        self.registry.register(Box::new(g))
    }

    /// A counter at the running total `v`.
    pub fn counter(&self, name: &str, help: &str, v: u64) -> Result<(), prometheus::Error> {
        let c = IntCounter::new(name, help)?;
        c.inc_by(v);
        self.registry.register(Box::new(c))
    }

    pub fn register(&self, c: Box<dyn prometheus::core::Collector>) -> Result<(), prometheus::Error> {
        self.registry.register(c)
    }

    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

impl Default for Snapshot {
    fn default() -> Self {
        Self::new()
    }
}

/// The cluster's series, collected from the remote dispatcher's telemetry when Prometheus
/// scrapes: a `prometheus` `Collector`, so the text encoder escapes, orders and types them like
/// every other series.
#[derive(Clone)]
struct ClusterCollector {
    descs: std::sync::Arc<Vec<Desc>>,
    latest: std::sync::Arc<Mutex<Option<ClusterTelemetry>>>,
}

/// Name, help and type of every cluster series; each `per_worker` one has the label `worker`.
const CLUSTER_SERIES: &[(&str, &str, MetricType, bool)] = &[
    ("shimmer_worker_up", "Whether the coordinator has a live, authenticated connection to the worker", MetricType::GAUGE, true),
    ("shimmer_worker_path_rtt_seconds", "QUIC's smoothed round-trip time estimate of the link (the network alone)", MetricType::GAUGE, true),
    ("shimmer_network_round_trips_total", "Expert requests sent to the worker (one round trip each)", MetricType::COUNTER, true),
    ("shimmer_network_bytes_sent_total", "Bytes of expert requests sent to the worker", MetricType::COUNTER, true),
    ("shimmer_network_bytes_received_total", "Bytes of answers received from the worker", MetricType::COUNTER, true),
    ("shimmer_worker_selections_total", "Routed (token, expert) selections the worker computed", MetricType::COUNTER, true),
    ("shimmer_worker_errors_total", "Requests the worker failed or did not answer in time", MetricType::COUNTER, true),
    ("shimmer_worker_resident_experts", "Experts in the worker's RAM, as it last said", MetricType::GAUGE, true),
    ("shimmer_worker_request_rtt_seconds", "Round trip of one layer's expert request: network and the worker's compute", MetricType::HISTOGRAM, true),
    (
        "shimmer_cluster_tokens_total",
        "Tokens (prefilled or decoded) whose MoE layers went to workers: divide the network series by it for per-token figures",
        MetricType::COUNTER,
        false,
    ),
    ("shimmer_network_wait_seconds_total", "Time the forward pass waited for workers' answers", MetricType::COUNTER, false),
    ("shimmer_placement_epoch", "The epoch of the placement the coordinator routes by", MetricType::GAUGE, false),
    ("shimmer_expert_failovers_total", "Selections served by another worker than the placement's first holder", MetricType::COUNTER, false),
];

impl ClusterCollector {
    fn new() -> Result<Self, prometheus::Error> {
        let descs = CLUSTER_SERIES
            .iter()
            .map(|(name, help, _, per_worker)| {
                let labels = if *per_worker { vec!["worker".to_string()] } else { vec![] };
                Desc::new(name.to_string(), help.to_string(), labels, Default::default())
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ClusterCollector { descs: std::sync::Arc::new(descs), latest: Default::default() })
    }

    fn set(&self, telemetry: Option<&ClusterTelemetry>) {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = telemetry.cloned();
    }
}

fn worker_label(name: &str) -> Vec<LabelPair> {
    let mut pair = LabelPair::default();
    pair.set_name("worker".to_string());
    pair.set_value(name.to_string());
    vec![pair]
}

fn sample(labels: Vec<LabelPair>, kind: MetricType, value: f64) -> proto::Metric {
    let mut m = proto::Metric::default();
    m.set_label(labels);
    if kind == MetricType::COUNTER {
        let mut c = proto::Counter::default();
        c.set_value(value);
        m.set_counter(c);
    } else {
        let mut g = proto::Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
    }
    m
}

/// A worker's request round trips as a histogram: `RTT_BUCKETS` are the finite upper bounds and
/// the telemetry's last bucket counts what exceeded them (the encoder writes `+Inf` from the count).
fn rtt_histogram(w: &WorkerLink) -> proto::Metric {
    let mut buckets = Vec::with_capacity(RTT_BUCKETS.len());
    let mut cumulative = 0u64;
    for (i, n) in w.rtt_buckets.iter().enumerate() {
        cumulative += n;
        if let Some(bound) = RTT_BUCKETS.get(i) {
            let mut b = proto::Bucket::default();
            b.set_upper_bound(*bound);
            b.set_cumulative_count(cumulative);
            buckets.push(b);
        }
    }
    let mut h = proto::Histogram::default();
    h.set_bucket(buckets);
    h.set_sample_count(cumulative);
    h.set_sample_sum(w.rtt_sum_s);
    let mut m = proto::Metric::default();
    m.set_label(worker_label(&w.name));
    m.set_histogram(h);
    m
}

impl prometheus::core::Collector for ClusterCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = latest.as_ref() else { return Vec::new() };
        let per_worker = |kind: MetricType, value: &dyn Fn(&WorkerLink) -> Option<f64>| -> Vec<proto::Metric> {
            c.workers.iter().filter_map(|w| value(w).map(|v| sample(worker_label(&w.name), kind, v))).collect()
        };
        CLUSTER_SERIES
            .iter()
            .map(|(name, help, kind, _)| {
                let kind = *kind;
                let metrics = match *name {
                    "shimmer_worker_up" => per_worker(kind, &|w| Some(f64::from(u8::from(w.up)))),
                    "shimmer_worker_path_rtt_seconds" => per_worker(kind, &|w| w.path_rtt_ms.map(|ms| ms / 1e3)),
                    "shimmer_network_round_trips_total" => per_worker(kind, &|w| Some(w.requests as f64)),
                    "shimmer_network_bytes_sent_total" => per_worker(kind, &|w| Some(w.bytes_sent as f64)),
                    "shimmer_network_bytes_received_total" => per_worker(kind, &|w| Some(w.bytes_received as f64)),
                    "shimmer_worker_selections_total" => per_worker(kind, &|w| Some(w.selections as f64)),
                    "shimmer_worker_errors_total" => per_worker(kind, &|w| Some(w.errors as f64)),
                    "shimmer_worker_resident_experts" => per_worker(kind, &|w| w.status.as_ref().map(|s| s.resident_experts as f64)),
                    "shimmer_worker_request_rtt_seconds" => c.workers.iter().map(rtt_histogram).collect(),
                    "shimmer_cluster_tokens_total" => vec![sample(vec![], kind, c.tokens as f64)],
                    "shimmer_network_wait_seconds_total" => vec![sample(vec![], kind, c.network_wait_s)],
                    "shimmer_placement_epoch" => vec![sample(vec![], kind, c.placement_epoch as f64)],
                    _ => vec![sample(vec![], kind, c.failovers as f64)],
                };
                let mut family = proto::MetricFamily::default();
                family.set_name(name.to_string());
                family.set_help(help.to_string());
                family.set_field_type(kind);
                family.set_metric(metrics);
                family
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::batcher::BatcherStats;

    fn link(name: &str, rtts: &[u64]) -> WorkerLink {
        let mut rtt_buckets = vec![0; RTT_BUCKETS.len() + 1];
        rtt_buckets[..rtts.len()].copy_from_slice(rtts);
        WorkerLink {
            name: name.into(),
            addr: "127.0.0.2:7070".into(),
            up: true,
            path_rtt_ms: Some(0.5),
            placed_experts: 3,
            first_choice_experts: 2,
            requests: 7,
            selections: 11,
            bytes_sent: 1000,
            bytes_received: 2000,
            errors: 1,
            rtt_buckets,
            rtt_sum_s: 0.25,
            status: None,
        }
    }

    #[test]
    fn raft_series_are_rendered_with_roles_and_epochs() {
        let m = shimmer_worker::control::RaftMetrics {
            term: 4,
            is_leader: true,
            leader: Some("a:1".into()),
            commit: 12,
            applied: 10,
            leader_changes: 2,
            failed_proposals: 1,
            voters: 3,
            learners: 1,
            placements: vec![("m\"x".into(), 3)],
        };
        let text = render_raft(&m).unwrap();
        for line in [
            "shimmer_raft_term 4",
            "shimmer_raft_is_leader 1",
            "shimmer_raft_apply_lag 2",
            "shimmer_raft_leader_changes_total 2",
            "shimmer_raft_members{role=\"learner\"} 1",
            "shimmer_cluster_placement_epoch{model=\"m\\\"x\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
    }

    #[test]
    fn every_request_is_counted_once_and_one_never_finished_as_cancelled() {
        let m = std::sync::Arc::new(Metrics::new().unwrap());
        RequestTally::new(m.clone()).finish(true);
        RequestTally::new(m.clone()).finish(false);
        drop(RequestTally::new(m.clone()));
        drop(RequestTally::new(m.clone()));
        let text = m.render(&BatcherStats::default(), None, None).unwrap();
        for line in
            ["shimmer_request_total{outcome=\"success\"} 1", "shimmer_request_total{outcome=\"failure\"} 1", "shimmer_request_total{outcome=\"cancelled\"} 2"]
        {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
        assert!(text.lines().any(|l| l == "shimmer_e2e_request_latency_seconds_count 2"), "cancelled requests have no end-to-end latency");
    }

    #[test]
    fn the_gpu_series_follow_the_tiers_running_totals_with_every_fault_kind() {
        let m = Metrics::new().unwrap();
        let stats = BatcherStats::default();
        let before = m.render(&stats, None, None).unwrap();
        assert!(before.lines().any(|l| l == "shimmer_gpu_faults_total{kind=\"timeout\"} 0"), "{before}");
        let mut g = shimmer_gpu::GpuTelemetry {
            device: "test".into(),
            budget_bytes: 1000,
            resident_bytes: 600,
            resident_experts: 3,
            uploads: 5,
            upload_bytes: 1000,
            evictions: 2,
            device_experts: 50,
            cpu_experts: 4,
            vram_hits: 40,
            faults: vec![("injected".into(), 2), ("lost".into(), 1)],
        };
        m.set_gpu(Some(&g));
        g.faults[0].1 = 3;
        g.vram_hits = 41;
        m.set_gpu(Some(&g));
        let text = m.render(&stats, None, None).unwrap();
        for line in [
            "shimmer_gpu_faults_total{kind=\"injected\"} 3",
            "shimmer_gpu_faults_total{kind=\"lost\"} 1",
            "shimmer_gpu_faults_total{kind=\"timeout\"} 0",
            "shimmer_expert_accesses_total{result=\"hit\",tier=\"vram\"} 41",
            "shimmer_vram_uploads_total 5",
            "shimmer_vram_evictions_total 2",
            "shimmer_vram_resident_bytes 600",
            "shimmer_vram_resident_experts 3",
            "shimmer_vram_budget_bytes 1000",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
    }

    #[test]
    fn the_store_series_follow_its_running_totals_per_tier() {
        let m = Metrics::new().unwrap();
        let stats = BatcherStats::default();
        let mut t = StoreTelemetry {
            ram_hits: 10,
            in_flight_hits: 3,
            disk_misses: 4,
            prefetch_issued: 6,
            prefetch_useful: 5,
            io_wait_ms: 1500.0,
            read_errors: 1,
            mirror_fallbacks: 2,
            resident_experts: 7,
            pinned_experts: 2,
            capacity_experts: 9,
            ..Default::default()
        };
        m.render(&stats, Some(&t), None).unwrap();
        t.ram_hits = 12;
        t.io_wait_ms = 2000.0;
        let text = m.render(&stats, Some(&t), None).unwrap();
        for line in [
            "shimmer_expert_accesses_total{result=\"hit\",tier=\"ram\"} 12",
            "shimmer_expert_accesses_total{result=\"hit\",tier=\"in_flight\"} 3",
            "shimmer_expert_accesses_total{result=\"miss\",tier=\"disk\"} 4",
            "shimmer_expert_prefetch_issued_total 6",
            "shimmer_expert_prefetch_useful_total 5",
            "shimmer_expert_io_wait_seconds_total 2",
            "shimmer_expert_read_errors_total 1",
            "shimmer_expert_mirror_fallbacks_total 2",
            "shimmer_expert_resident 7",
            "shimmer_expert_pinned 2",
            "shimmer_expert_cache_capacity 9",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
    }

    #[test]
    fn the_cluster_series_are_exported_through_the_registry_with_escaped_labels_and_cumulative_buckets() {
        let m = Metrics::new().unwrap();
        let stats = BatcherStats::default();
        let without = m.render(&stats, None, None).unwrap();
        assert!(!without.contains("shimmer_worker_up"), "no cluster, no cluster series");
        let mut slow = link("w\"2\\", &[]);
        *slow.rtt_buckets.last_mut().unwrap() = 4; // beyond every finite bound
        slow.up = false;
        slow.path_rtt_ms = None;
        let c = ClusterTelemetry {
            workers: vec![link("w1", &[1, 2, 0, 3]), slow],
            tokens: 42,
            round_trips: 9,
            network_wait_s: 1.5,
            failovers: 2,
            placement_epoch: 3,
        };
        let text = m.render(&stats, None, Some(&c)).unwrap();
        for line in [
            "# TYPE shimmer_worker_up gauge",
            "shimmer_worker_up{worker=\"w1\"} 1",
            "shimmer_worker_up{worker=\"w\\\"2\\\\\"} 0",
            "shimmer_worker_path_rtt_seconds{worker=\"w1\"} 0.0005",
            "# TYPE shimmer_network_round_trips_total counter",
            "shimmer_network_bytes_received_total{worker=\"w1\"} 2000",
            "shimmer_worker_errors_total{worker=\"w1\"} 1",
            "# TYPE shimmer_worker_request_rtt_seconds histogram",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w1\",le=\"0.0001\"} 1",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w1\",le=\"0.00025\"} 3",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w1\",le=\"0.001\"} 6",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w1\",le=\"+Inf\"} 6",
            "shimmer_worker_request_rtt_seconds_count{worker=\"w1\"} 6",
            "shimmer_worker_request_rtt_seconds_sum{worker=\"w1\"} 0.25",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w\\\"2\\\\\",le=\"10\"} 0",
            "shimmer_worker_request_rtt_seconds_bucket{worker=\"w\\\"2\\\\\",le=\"+Inf\"} 4",
            "shimmer_cluster_tokens_total 42",
            "shimmer_network_wait_seconds_total 1.5",
            "shimmer_placement_epoch 3",
            "shimmer_expert_failovers_total 2",
        ] {
            assert!(text.lines().any(|l| l == line), "missing `{line}` in:\n{text}");
        }
        assert!(!text.contains("shimmer_worker_path_rtt_seconds{worker=\"w\\\"2"), "a down link has no path RTT");
        assert!(!text.contains("shimmer_worker_resident_experts"), "no status, no resident count");
    }
}
