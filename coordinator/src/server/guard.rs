//! What every API request passes before its handler: the API key first, then the body — read
//! whole, within the server's body limit and `--body-timeout-s`, once the server's budget for
//! bodies in flight (`BODY_BYTES_IN_FLIGHT`) has room for it — so an unauthenticated request
//! costs no body read, a slow sender cannot hold a connection and its buffer open, and many
//! connections at once cannot hold more body bytes than the budget.
//!
//! Must never: read a byte of the body of a request whose key is wrong; wait for a body (or for
//! room to read it) without a deadline; answer in another API's error shape (`/v1/messages` is
//! Anthropic's).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::AppState;

fn refuse(path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        super::anthropic::anthropic_error(e)
    } else {
        e.into_response()
    }
}

pub async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if let Err(e) = super::openai::authorize(req.headers(), &state.api_keys) {
        return refuse(&path, e);
    }
    let (parts, body) = req.into_parts();
    let too_large = || {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than the {} bytes this server accepts", state.max_body_bytes))
            .code("request_too_large")
    };
    // A declared length over the limit is refused before anything is read.
    let declared = parts.headers.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.max_body_bytes as u64) {
        return refuse(&path, too_large());
    }
    // Room for the body in the budget: its declared length, or the most it may be when it is
    // chunked (HTTP/1.1: no length and no transfer coding, no body). Held until the handler has
    // answered (its parsed request is dropped by then; a stream goes on without).
    let chunked = parts.headers.contains_key(axum::http::header::TRANSFER_ENCODING);
    let reserve = declared.map_or(if chunked { state.max_body_bytes } else { 0 }, |n| n as usize).min(state.max_body_bytes);
    let deadline = tokio::time::Instant::now() + state.body_timeout;
    let wanted = u32::try_from(reserve).unwrap_or(u32::MAX);
    let room = match tokio::time::timeout_at(deadline, state.bodies.clone().acquire_many_owned(wanted)).await {
        Ok(Ok(r)) => r,
        _ => {
            let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "too many request bodies are being read at once; retry shortly")
                .kind("server_error")
                .code("server_busy")
                .retry_after(1);
            return refuse(&path, e);
        }
    };
    let bytes = match tokio::time::timeout_at(deadline, axum::body::to_bytes(body, state.max_body_bytes)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) if is_length_limit(&e) => return refuse(&path, too_large()),
        Ok(Err(e)) => return refuse(&path, ApiError::bad_request(format!("cannot read the request body: {e}"))),
        Err(_) => {
            let e = ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {} s", state.body_timeout.as_secs_f64()))
                .code("request_timeout");
            return refuse(&path, e);
        }
    };
    let response = next.run(Request::from_parts(parts, Body::from(bytes))).await;
    drop(room);
    response
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}
