//! `/metrics` in Prometheus' text format. Request series follow vLLM's names (with the
//! `shimmer_` prefix) and buckets, so dashboards and autoscalers written for it carry over; the
//! expert store's hits, misses and bytes are shimmer's own, and so are the cluster's series
//! (per worker: up, request round-trip histogram, path RTT, bytes each way, round trips,
//! selections, errors, resident experts; overall: tokens through the MoE layers, network wait,
//! failovers), written straight from the dispatcher's running totals.

use std::sync::Mutex;
use std::time::Duration;

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};
use shimmer_worker::remote::{ClusterTelemetry, RTT_BUCKETS};
use shimmer_worker::store::StoreTelemetry;

use super::batcher::BatcherStats;

const TTFT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
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
    /// Counter values already exported (counters only go up; the sources are running totals).
    seen: Mutex<[u64; 7]>,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(Opts::new("shimmer_request_total", "Finished requests by outcome"), &["outcome"])?;
        let ttft = Histogram::with_opts(HistogramOpts::new("shimmer_time_to_first_token_seconds", "Time to first token").buckets(TTFT_BUCKETS.to_vec()))?;
        let itl = Histogram::with_opts(HistogramOpts::new("shimmer_inter_token_latency_seconds", "Time between a request's consecutive generated tokens").buckets(ITL_BUCKETS.to_vec()))?;
        let queue = Histogram::with_opts(HistogramOpts::new("shimmer_request_queue_time_seconds", "Time a request waited for a batch slot").buckets(E2E_BUCKETS.to_vec()))?;
        let e2e = Histogram::with_opts(HistogramOpts::new("shimmer_e2e_request_latency_seconds", "End-to-end request latency").buckets(E2E_BUCKETS.to_vec()))?;
        let running = IntGauge::new("shimmer_num_requests_running", "Requests in the running batch")?;
        let waiting = IntGauge::new("shimmer_num_requests_waiting", "Requests waiting for a batch slot")?;
        let prompt_tokens = IntCounter::new("shimmer_prompt_tokens_total", "Prompt tokens prefilled")?;
        let generation_tokens = IntCounter::new("shimmer_generation_tokens_total", "Tokens generated")?;
        let expert_accesses = IntCounterVec::new(Opts::new("shimmer_expert_accesses_total", "Routed-expert accesses by where they were served from"), &["tier", "result"])?;
        let expert_bytes_read = IntCounter::new("shimmer_expert_bytes_read_total", "Expert bytes read from storage")?;
        let kv_usage = prometheus::Gauge::new("shimmer_kv_cache_usage_perc", "KV held (running requests and the prefix cache) as a fraction of the prefix cache's budget")?;
        let prefix_hits = IntCounter::new("shimmer_prefix_cache_hits_total", "Requests that started from a cached prefix")?;
        let prefix_tokens = IntCounter::new("shimmer_prefix_cache_reused_tokens_total", "Prompt tokens not prefilled thanks to a cached prefix")?;
        for c in [Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>, Box::new(ttft.clone()), Box::new(itl.clone()), Box::new(queue.clone()), Box::new(e2e.clone()), Box::new(running.clone()), Box::new(waiting.clone()), Box::new(prompt_tokens.clone()), Box::new(generation_tokens.clone()), Box::new(expert_accesses.clone()), Box::new(expert_bytes_read.clone()), Box::new(kv_usage.clone()), Box::new(prefix_hits.clone()), Box::new(prefix_tokens.clone())] {
            registry.register(c)?;
        }
        Ok(Metrics { registry, requests, ttft, itl, queue, e2e, running, waiting, prompt_tokens, generation_tokens, expert_accesses, expert_bytes_read, kv_usage, prefix_hits, prefix_tokens, seen: Mutex::new([0; 7]) })
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

    pub fn request_finished(&self, after: Duration, ok: bool) {
        self.e2e.observe(after.as_secs_f64());
        self.requests.with_label_values(&[if ok { "success" } else { "failure" }]).inc();
    }

    /// The text exposition, with the batcher's and the store's totals brought up to date.
    pub fn render(&self, st: &BatcherStats, store: Option<&StoreTelemetry>, cluster: Option<&ClusterTelemetry>) -> Result<String, prometheus::Error> {
        self.running.set(st.running as i64);
        self.waiting.set(st.waiting as i64);
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let now = [st.prompt_tokens, st.generated_tokens, store.map_or(0, |s| s.ram_hits + s.in_flight_hits), store.map_or(0, |s| s.disk_misses), store.map_or(0, |s| s.bytes_read), st.prefix_hits, st.prefix_reused_tokens];
            let bump = |i: usize, c: &IntCounter, seen: &mut [u64; 7]| {
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
            self.kv_usage.set(if st.kv_budget_bytes > 0 { st.kv_bytes as f64 / st.kv_budget_bytes as f64 } else { 0.0 });
        }
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        let mut text = String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))?;
        if let Some(c) = cluster {
            render_cluster(&mut text, c);
        }
        Ok(text)
    }
}

/// A label value in the text format: backslash, quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn render_cluster(out: &mut String, c: &ClusterTelemetry) {
    use std::fmt::Write;
    let mut family = |name: &str, kind: &str, help: &str, samples: &mut dyn Iterator<Item = (String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let per_worker = |f: &dyn Fn(&shimmer_worker::remote::WorkerLink) -> f64| -> Vec<(String, f64)> { c.workers.iter().map(|w| (format!("{{worker=\"{}\"}}", label(&w.name)), f(w))).collect() };
    family("shimmer_worker_up", "gauge", "Whether the coordinator has a live, authenticated connection to the worker", &mut per_worker(&|w| f64::from(u8::from(w.up))).into_iter());
    family("shimmer_worker_path_rtt_seconds", "gauge", "QUIC's smoothed round-trip time estimate of the link (the network alone)", &mut c.workers.iter().filter_map(|w| w.path_rtt_ms.map(|ms| (format!("{{worker=\"{}\"}}", label(&w.name)), ms / 1e3))));
    family("shimmer_network_round_trips_total", "counter", "Expert requests sent to the worker (one round trip each)", &mut per_worker(&|w| w.requests as f64).into_iter());
    family("shimmer_network_bytes_sent_total", "counter", "Bytes of expert requests sent to the worker", &mut per_worker(&|w| w.bytes_sent as f64).into_iter());
    family("shimmer_network_bytes_received_total", "counter", "Bytes of answers received from the worker", &mut per_worker(&|w| w.bytes_received as f64).into_iter());
    family("shimmer_worker_selections_total", "counter", "Routed (token, expert) selections the worker computed", &mut per_worker(&|w| w.selections as f64).into_iter());
    family("shimmer_worker_errors_total", "counter", "Requests the worker failed or did not answer in time", &mut per_worker(&|w| w.errors as f64).into_iter());
    family("shimmer_worker_resident_experts", "gauge", "Experts in the worker's RAM, as it last said", &mut c.workers.iter().filter_map(|w| w.status.as_ref().map(|s| (format!("{{worker=\"{}\"}}", label(&w.name)), s.resident_experts as f64))));
    family("shimmer_cluster_tokens_total", "counter", "Tokens (prefilled or decoded) whose MoE layers went to workers: divide the network series by it for per-token figures", &mut std::iter::once((String::new(), c.tokens as f64)));
    family("shimmer_network_wait_seconds_total", "counter", "Time the forward pass waited for workers' answers", &mut std::iter::once((String::new(), c.network_wait_s)));
    family("shimmer_placement_epoch", "gauge", "The epoch of the placement the coordinator routes by", &mut std::iter::once((String::new(), c.placement_epoch as f64)));
    family("shimmer_expert_failovers_total", "counter", "Selections served by another worker than the placement's first holder", &mut std::iter::once((String::new(), c.failovers as f64)));
    let name = "shimmer_worker_request_rtt_seconds";
    let _ = writeln!(out, "# HELP {name} Round trip of one layer's expert request: network and the worker's compute\n# TYPE {name} histogram");
    for w in &c.workers {
        let l = label(&w.name);
        let mut cumulative = 0u64;
        for (i, n) in w.rtt_buckets.iter().enumerate() {
            cumulative += n;
            let le = RTT_BUCKETS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{worker=\"{l}\",le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{worker=\"{l}\"}} {}\n{name}_count{{worker=\"{l}\"}} {cumulative}", w.rtt_sum_s);
    }
}
