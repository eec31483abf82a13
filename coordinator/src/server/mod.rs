//! `shimmer run`: the OpenAI-compatible HTTP server (axum) in front of the batcher, on one port
//! (default 127.0.0.1:8080). Graceful shutdown on SIGINT/SIGTERM: stop admitting, cancel what is
//! queued or running (streams end with `finish_reason: "abort"`), persist usage statistics.
//!
//! Must never: run model math on an async worker thread (the batcher thread does all of it), or
//! let a request's failure take down the server.

pub mod anthropic;
pub mod batcher;
pub mod chat_format;
pub mod dashboard;
pub mod errors;
mod guard;
pub mod metrics;
pub mod openai;
pub mod prefix_cache;
pub mod tools;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::Engine;
use batcher::Batcher;
use errors::ApiError;
use metrics::Metrics;

pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_keys: Vec<String>,
    /// The key /metrics requires, if any (the API keys do not open it).
    pub metrics_api_key: Option<String>,
    /// Requests that may wait for a batch slot before new ones get 429.
    pub max_queue: usize,
    /// Sequences decoded together.
    pub max_batch: usize,
    /// KV bytes kept from finished requests for prefix reuse (`--kv-gb`; 0 turns reuse off).
    pub kv_budget_bytes: usize,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Connections served at once (`--max-connections`).
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers (and an idle keep-alive one is
    /// held).
    pub header_timeout: Duration,
    /// How long a client may take to send a body once its headers are in (408 beyond).
    pub body_timeout: Duration,
    /// The name `/v1/models` lists and requests must use.
    pub model_id: String,
    /// One routed expert's bytes (the dashboard's bytes-served tiers).
    pub expert_bytes: u64,
    /// The control plane, when this coordinator is a cluster member (its Raft series on `/metrics`).
    pub control: Option<Arc<shimmer_worker::control::ControlPlane>>,
}

pub struct AppState {
    pub engine: Arc<Engine>,
    pub batcher: Batcher,
    pub api_keys: Vec<String>,
    pub metrics_api_key: Option<String>,
    pub model_id: String,
    pub created: u64,
    pub metrics: Arc<Metrics>,
    pub dashboard: Arc<std::sync::Mutex<dashboard::Dashboard>>,
    pub control: Option<Arc<shimmer_worker::control::ControlPlane>>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    /// Bytes of request bodies being read or parsed at once, across connections
    /// (`BODY_BYTES_IN_FLIGHT`): a body waits for its share before it is read.
    pub bodies: Arc<tokio::sync::Semaphore>,
    /// The model's vocabulary as constrained decoding reads it, built by the first request that
    /// asks for a grammar (`compile_grammar`).
    pub vocabulary: std::sync::OnceLock<Result<Arc<crate::constraint::Vocabulary>, crate::constraint::GrammarError>>,
}

/// Compiles a request's grammar (`field` names where the request gave it) against the model's
/// vocabulary, off the async runtime: a large schema takes milliseconds, the first request also
/// builds the vocabulary's index. A grammar that cannot be compiled is the request's fault (400).
pub(crate) async fn compile_grammar(
    state: &Arc<AppState>,
    field: &'static str,
    grammar: crate::constraint::Grammar,
) -> Result<crate::constraint::Constraint, ApiError> {
    let st = state.clone();
    let compiled = tokio::task::spawn_blocking(move || {
        let vocabulary = st
            .vocabulary
            .get_or_init(|| {
                let tokens = st.engine.tokenizer.vocabulary().map_err(|e| crate::constraint::GrammarError(e.to_string()))?;
                crate::constraint::Vocabulary::new(&tokens, st.engine.spec.vocab_size, &st.engine.eos_ids).map(Arc::new)
            })
            .clone()
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("constrained decoding is unavailable for this model: {e}")).kind("server_error")
            })?;
        vocabulary.compile(&grammar).map_err(|e| ApiError::param(field, format!("invalid or unsupported grammar: {e}")).code("invalid_grammar"))
    })
    .await;
    compiled.unwrap_or_else(|e| Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("compiling the grammar failed: {e}")).kind("server_error")))
}

/// The largest request body the API takes (a chat of a long document; 413 beyond).
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Request bodies read or parsed at once, in bytes, whatever the number of connections: 32
/// bodies of the largest size (docs/limits.md).
pub const BODY_BYTES_IN_FLIGHT: usize = 32 * MAX_BODY_BYTES;
/// What one connection's reads may add to its buffer (hyper's default is ~408 KiB): a head that
/// overflows it is refused (431), bodies stream through it in pieces.
pub const CONNECTION_BUFFER_BYTES: usize = 64 << 10;
/// The most `--max-connections` may say.
pub const MAX_CONNECTIONS_LIMIT: usize = 65_536;

pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    // The API's routes pass the guard (the key, then the body within its limit and deadline).
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/messages", post(anthropic::messages))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), guard::guard));
    Router::new()
        .merge(api)
        .route("/", get(|| async { static_file("text/html; charset=utf-8", include_str!("dashboard/index.html")) }))
        .route("/dashboard.js", get(|| async { static_file("text/javascript; charset=utf-8", include_str!("dashboard/dashboard.js")) }))
        .route("/dashboard.css", get(|| async { static_file("text/css; charset=utf-8", include_str!("dashboard/dashboard.css")) }))
        .route("/api/dashboard", get(dashboard_json))
        .route("/api/dashboard/events", get(dashboard_events))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    ([("content-type", content_type), ("cache-control", "no-cache")], body).into_response()
}

fn snapshot(state: &AppState) -> dashboard::Snapshot {
    let st = state.batcher.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let engine = state.engine.clone();
    let dash = state.dashboard.lock().unwrap_or_else(|e| e.into_inner());
    let mut snap =
        dash.snapshot(st.running, st.waiting, &|layer| engine.resident_experts(layer), engine.cluster_telemetry(), &|layer| engine.first_holders(layer));
    // The tier above RAM: experts the GPU holds are VRAM's, whatever RAM holds.
    for (i, layer) in snap.moe_layers.iter().enumerate() {
        if let Some(held) = engine.vram_experts(*layer) {
            for (e, _) in held.iter().enumerate().filter(|(_, h)| **h) {
                if let Some(t) = snap.tier.get_mut(i * snap.experts + e) {
                    *t = "vram";
                }
            }
        }
    }
    snap.control = state.control.as_ref().map(|c| c.local_status());
    snap
}

async fn dashboard_json(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = openai::authorize(&headers, &state.api_keys) {
        return e.into_response();
    }
    Json(snapshot(&state)).into_response()
}

/// The dashboard's live feed: a snapshot every half second, as server-sent events.
async fn dashboard_events(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = openai::authorize(&headers, &state.api_keys) {
        return e.into_response();
    }
    let stream = openai::async_stream(move |out: tokio::sync::mpsc::UnboundedSender<axum::response::sse::Event>| async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if state.batcher.is_closing() {
                return; // lets a graceful shutdown finish
            }
            let s = snapshot(&state);
            let Ok(json) = serde_json::to_string(&s) else { return };
            if out.send(axum::response::sse::Event::default().data(json)).is_err() {
                return;
            }
        }
    });
    use futures_util::StreamExt;
    axum::response::sse::Sse::new(stream.map(Ok::<_, std::convert::Infallible>)).into_response()
}

/// A known path asked with a method it does not take: the error in the API's shape (axum adds
/// the `allow` header).
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("{} does not take {method} (see docs/api.md)", uri.path())).code("method_not_allowed").into_response()
}

async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint (see docs/api.md)").code("not_found").into_response()
}

/// Liveness; with the model, queue and store details when the caller is authorised (or no keys
/// are set).
async fn health(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let mut body = json!({ "status": "ok" });
    if openai::authorize(&headers, &state.api_keys).is_ok() {
        let st = state.batcher.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        body["model"] = json!(state.model_id);
        body["running"] = json!(st.running);
        body["waiting"] = json!(st.waiting);
        body["generated_tokens"] = json!(st.generated_tokens);
        body["prefix_hits"] = json!(st.prefix_hits);
        body["prefix_reused_tokens"] = json!(st.prefix_reused_tokens);
        body["kv_bytes"] = json!(st.kv_bytes);
    }
    Json(body).into_response()
}

async fn metrics_text(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Some(key) = &state.metrics_api_key {
        if let Err(e) = openai::authorize(&headers, std::slice::from_ref(key)) {
            return e.into_response();
        }
    }
    let st = state.batcher.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let store = state.engine.store_telemetry();
    let cluster = state.engine.cluster_telemetry();
    let raft = state.control.as_ref().map(|c| metrics::render_raft(&c.metrics()));
    state.metrics.set_gpu(state.engine.gpu_telemetry().as_ref());
    match (state.metrics.render(&st, store.as_ref(), cluster.as_ref()), raft.transpose()) {
        (Ok(text), Ok(raft)) => ([("content-type", "text/plain; version=0.0.4")], text + &raft.unwrap_or_default()).into_response(),
        (Err(e), _) | (_, Err(e)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot render metrics: {e}")).kind("server_error").into_response()
        }
    }
}

/// The API's routes over `engine` with `cfg`'s keys and limits, and the batcher that runs its
/// requests (started here; `Batcher::shutdown` stops it). What `serve` serves, and what the
/// request fuzz target drives in-process.
pub fn app(engine: Engine, cfg: &ServerConfig) -> Result<(Router, Batcher)> {
    let engine = Arc::new(engine);
    let moe_layers: Vec<usize> = (0..engine.spec.num_layers).filter(|l| engine.spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    let dash = Arc::new(std::sync::Mutex::new(dashboard::Dashboard::new(cfg.model_id.clone(), moe_layers, engine.spec.moe.num_experts)));
    let metrics = Arc::new(Metrics::new()?);
    let batcher = Batcher::start(engine.clone(), cfg.max_batch, cfg.max_queue, cfg.kv_budget_bytes, dash.clone(), cfg.expert_bytes, metrics.clone());
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState {
        engine,
        batcher: batcher.clone(),
        api_keys: cfg.api_keys.clone(),
        metrics_api_key: cfg.metrics_api_key.clone(),
        model_id: cfg.model_id.clone(),
        created,
        metrics,
        dashboard: dash,
        control: cfg.control.clone(),
        max_body_bytes: cfg.max_body_bytes,
        body_timeout: cfg.body_timeout,
        vocabulary: std::sync::OnceLock::new(),
        bodies: Arc::new(tokio::sync::Semaphore::new(BODY_BYTES_IN_FLIGHT.max(cfg.max_body_bytes))),
    });
    Ok((router(state, cfg.max_body_bytes), batcher))
}

/// Serves until SIGINT or SIGTERM.
pub fn serve(engine: Engine, cfg: ServerConfig) -> Result<()> {
    let (app, batcher) = app(engine, &cfg)?;
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("http").enable_all().build().context("cannot start the async runtime")?;
    let addr: SocketAddr =
        format!("{}:{}", cfg.host, cfg.port).parse().with_context(|| format!("`{}:{}` is not a host:port to listen on", cfg.host, cfg.port))?;
    let b = batcher.clone();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        // Tests and scripts wait for this line.
        eprintln!("shimmer: serving {} on http://{local} (OpenAI API under /v1)", cfg.model_id);
        serve_connections(listener, app, cfg.header_timeout, cfg.max_connections, async move {
            shutdown_signal().await;
            eprintln!("shimmer: shutting down (cancelling running requests)");
            // Ends every stream, so the connections close and the server can stop.
            tokio::task::spawn_blocking(move || b.shutdown()).await.ok();
        })
        .await;
        anyhow::Ok(())
    })?;
    batcher.shutdown();
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}

/// A worker's endpoints' header deadline (`--header-timeout-s`'s default on the API).
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(20);

/// Serves `app` on `listener` until `stop` completes, then lets the connections finish (at most
/// `DRAIN` more). At most `max_connections` are served at once (the next is accepted when one
/// closes; until then it waits in the kernel's queue). Each connection has `header_timeout` for
/// a request's headers — idle keep-alive connections and slow senders are closed — and the API
/// guard bounds the body.
pub(crate) async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    max_connections: usize,
    stop: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    const DRAIN: Duration = Duration::from_secs(30);
    let (closing, closed) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    loop {
        let slot = tokio::select! {
            _ = &mut stop => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let (stream, _) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors and the like: wait a little rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut closed = closed.clone();
        connections.spawn(async move {
            let _slot = slot;
            // HTTP/1.1 (what the API and its clients speak); the header deadline runs from the
            // moment the connection (or a kept-alive one) waits for a request.
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(CONNECTION_BUFFER_BYTES)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { let _ = closed.wait_for(|c| *c).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
        // Reap finished connections as we go, so the set holds only live ones.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = closing.send(true);
    let _ = tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} }).await;
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
