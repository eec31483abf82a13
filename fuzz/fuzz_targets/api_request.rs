#![no_main]
//! An HTTP request's body → the API's real router, in-process, over a fixture model: the guard,
//! the body parsers of `/v1/chat/completions`, `/v1/completions` and `/v1/messages` (sampling
//! parameters, messages, tools, response formats and their schema compiler, stop strings), the
//! chat template and the tokenizer, then the batcher. Whatever the body: a response, never a
//! panic or a 500; an error is the API's JSON error body.
//!
//! The first byte picks the endpoint and whether the body is sent as JSON; the rest is the body.
//! A body that parses as a JSON object gets its token limits clamped to 4 (and `stream` kept as
//! it is), so one input decodes a few tokens, not a context's worth.
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use shimmer_coordinator::engine::{ExpertOptions, UsageFile};
use shimmer_coordinator::server::{app, ServerConfig};
use shimmer_coordinator::Engine;
use tower::ServiceExt;

const ENDPOINTS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/messages"];
/// The most one response's body is read (a few tokens' stream is far less).
const MAX_RESPONSE_BYTES: usize = 1 << 20;

struct App {
    rt: tokio::runtime::Runtime,
    router: axum::Router,
}

fn the_app() -> &'static App {
    static APP: OnceLock<App> = OnceLock::new();
    APP.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe");
        let opts = ExpertOptions { usage: UsageFile::Off, ..ExpertOptions::default() };
        let engine = Engine::open(&dir, &opts).expect("the qwen3_moe fixture opens");
        let cfg = ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            api_keys: Vec::new(),
            metrics_api_key: None,
            max_queue: 64,
            max_batch: 4,
            kv_budget_bytes: 1 << 20,
            max_body_bytes: 1 << 20,
            max_connections: 16,
            header_timeout: Duration::from_secs(20),
            body_timeout: Duration::from_secs(30),
            model_id: "model".into(),
            expert_bytes: 0,
            control: None,
        };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime");
        let (router, _batcher) = rt.block_on(async { app(engine, &cfg) }).expect("the API starts");
        App { rt, router }
    })
}

fn clamp_token_limits(body: &[u8]) -> Vec<u8> {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(body) else { return body.to_vec() };
    for k in ["max_tokens", "max_completion_tokens"] {
        if let Some(v) = map.get_mut(k) {
            if v.as_u64().is_some_and(|n| n > 4) || v.as_f64().is_some_and(|n| n > 4.0) {
                *v = Value::from(4);
            }
        }
    }
    // Absent limits mean "up to the context" on the OpenAI endpoints.
    if !map.contains_key("max_tokens") && !map.contains_key("max_completion_tokens") {
        map.insert("max_tokens".into(), Value::from(4));
    }
    serde_json::to_vec(&Value::Object(map)).unwrap_or_else(|_| body.to_vec())
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else { return };
    let path = ENDPOINTS[pick as usize % ENDPOINTS.len()];
    let body = clamp_token_limits(body);
    let app = the_app();
    let mut request = Request::post(path);
    if pick & 0x80 == 0 {
        request = request.header("content-type", "application/json");
    }
    let request = request.body(Body::from(body)).expect("a request");
    let (status, bytes) = app.rt.block_on(async {
        let response = app.router.clone().oneshot(request).await.expect("the router answers");
        let status = response.status();
        let limited = http_body_util::Limited::new(response.into_body(), MAX_RESPONSE_BYTES);
        let bytes = tokio::time::timeout(Duration::from_secs(60), limited.collect())
            .await
            .expect("the response ends within 60 s")
            .expect("the response body is within 1 MiB")
            .to_bytes();
        (status, bytes)
    });
    assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "500: {}", String::from_utf8_lossy(&bytes));
    assert!(status.is_success() || status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE, "{status}");
    if !status.is_success() {
        let error: Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{status}: the error is not JSON ({e}): {}", String::from_utf8_lossy(&bytes)));
        assert!(error.get("error").is_some(), "{status}: no error object: {error}");
    }
});
