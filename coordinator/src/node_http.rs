//! A worker node's HTTP endpoints, for orchestrators and Prometheus: `/health` (the process
//! answers), `/ready` (it serves what it is given: as a cluster member, it belongs to a cluster
//! with a leader, answers for the active placement epoch that names it, and is not draining)
//! and `/metrics` (its own series, and Raft's when it is a member).
//!
//! Must never: change the node (every endpoint is a read), or serve the model's API.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use shimmer_worker::control::ControlPlane;
use shimmer_worker::server::WorkerState;

/// The port of `/health`, `/ready` and `/metrics` unless `--http-listen` says otherwise.
pub const DEFAULT_HTTP_PORT: u16 = 7080;
/// Connections a worker's endpoints serve at once (probes and scrapes: a few).
const PROBE_CONNECTIONS: usize = 256;

#[derive(Clone)]
struct Node {
    state: Arc<WorkerState>,
    fingerprint: String,
    control: Option<Arc<ControlPlane>>,
    /// The key /metrics requires, if any.
    metrics_key: Option<String>,
    /// The VRAM tier, when this worker computes experts on a GPU.
    vram: Option<Arc<shimmer_gpu::VramTier>>,
}

/// Starts the endpoints on `rt`; returns the address they listen on.
pub fn start(
    rt: &tokio::runtime::Handle,
    addr: &str,
    state: Arc<WorkerState>,
    fingerprint: String,
    control: Option<Arc<ControlPlane>>,
    metrics_key: Option<String>,
    vram: Option<Arc<shimmer_gpu::VramTier>>,
) -> Result<SocketAddr, String> {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| format!("cannot listen on {addr} (HTTP: /health, /ready, /metrics): {e}; choose another with --http-listen"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let app = Router::new().route("/health", get(|| async { "ok\n" })).route("/ready", get(ready)).route("/metrics", get(metrics)).with_state(Node {
        state,
        fingerprint,
        control,
        metrics_key,
        vram,
    });
    // The same connection handling as the API's (header deadline, idle keep-alive closed); it
    // serves until the runtime stops.
    rt.spawn(crate::server::serve_connections(listener, app, crate::server::HEADER_TIMEOUT, PROBE_CONNECTIONS, std::future::pending::<()>()));
    Ok(local)
}

/// Why the node is not ready, if it is not.
fn not_ready(node: &Node) -> Option<String> {
    let control = node.control.as_ref()?;
    if control.stopped() {
        return Some("its control plane stopped".into());
    }
    if !control.is_member_with_leader() {
        return Some("not yet a member of a cluster with a leader".into());
    }
    let me = &node.state.name;
    let (_, placement) = control.placement(&node.fingerprint);
    let placement = placement?;
    if placement.active.as_ref().is_some_and(|a| a.worker_names().contains(me.as_str())) && node.state.epochs().active != placement.epoch() {
        return Some(format!("still moving to placement epoch {}", placement.epoch()));
    }
    None
}

async fn ready(State(node): State<Node>) -> Response {
    let draining = node.control.as_ref().is_some_and(|c| c.state().member_named(&node.state.name).is_some_and(|m| m.draining));
    let why = not_ready(&node).or(draining.then(|| "draining".to_string()));
    let body = serde_json::json!({"ready": why.is_none(), "why": why});
    let code = if why.is_none() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, [("content-type", "application/json")], body.to_string() + "\n").into_response()
}

fn render(node: &Node) -> Result<String, prometheus::Error> {
    let status = node.state.status();
    let series = crate::server::metrics::Snapshot::new();
    series.counter("shimmer_worker_requests_total", "Expert requests this worker answered", status.requests)?;
    series.counter("shimmer_worker_disk_reads_total", "Experts read from disk", status.disk_reads)?;
    series.gauge("shimmer_worker_resident_experts", "Experts in RAM", status.resident_experts as i64)?;
    series.gauge("shimmer_worker_capacity_experts", "Experts the RAM budget holds", status.capacity_experts as i64)?;
    series.gauge("shimmer_worker_assigned_experts", "Experts the placement gives this worker", status.assigned_experts as i64)?;
    series.gauge("shimmer_worker_budget_bytes", "RAM given to the expert cache", status.budget_bytes as i64)?;
    series.gauge("shimmer_worker_epoch", "The placement epoch this worker reports (the active one)", status.epoch as i64)?;
    if let Some(g) = node.vram.as_ref().map(|t| t.telemetry()) {
        // The VRAM tier's series, named as on a coordinator (docs/api.md).
        let faults = prometheus::IntCounterVec::new(
            prometheus::Opts::new("shimmer_gpu_faults_total", "GPU submissions that failed (their experts were recomputed on the CPU), by kind"),
            &["kind"],
        )?;
        for (kind, n) in &g.faults {
            faults.with_label_values(&[kind.as_str()]).inc_by(*n);
        }
        series.register(Box::new(faults))?;
        series.counter("shimmer_worker_vram_hits_total", "Experts this worker computed on its GPU from VRAM", g.vram_hits)?;
        series.counter("shimmer_vram_uploads_total", "Experts uploaded to the GPU", g.uploads)?;
        series.counter("shimmer_vram_evictions_total", "Experts evicted from the GPU's memory", g.evictions)?;
        series.gauge("shimmer_vram_resident_bytes", "Expert bytes resident in GPU memory", g.resident_bytes as i64)?;
        series.gauge("shimmer_vram_budget_bytes", "GPU memory the VRAM tier may use for experts", g.budget_bytes as i64)?;
    }
    let mut text = series.render()?;
    if let Some(c) = &node.control {
        text += &crate::server::metrics::render_raft(&c.metrics())?;
    }
    Ok(text)
}

async fn metrics(State(node): State<Node>, headers: axum::http::HeaderMap) -> Response {
    if let Some(key) = &node.metrics_key {
        if let Err(e) = crate::server::openai::authorize(&headers, std::slice::from_ref(key)) {
            return e.into_response();
        }
    }
    match render(&node) {
        Ok(text) => ([("content-type", "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot render metrics: {e}\n")).into_response(),
    }
}
