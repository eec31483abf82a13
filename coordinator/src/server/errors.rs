//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with the
//! status that says whose fault it is (400 the request, 401 the key, 413 the size, 429 the queue,
//! 503 shutting down). Anthropic's shape is produced from the same value by its handlers.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind: "invalid_request_error", param: None, code: None, retry_after_s: None }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A generation that failed, with the status its cause calls for.
    pub fn from_fault(fault: super::batcher::Fault, message: impl Into<String>) -> Self {
        use super::batcher::Fault;
        match fault {
            Fault::Request => Self::bad_request(message),
            Fault::Unavailable => Self::new(StatusCode::SERVICE_UNAVAILABLE, message).kind("server_error"),
            Fault::Internal => Self::new(StatusCode::INTERNAL_SERVER_ERROR, message).kind("server_error"),
        }
    }

    /// A 400 about one parameter.
    pub fn param(name: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(name.to_string()), ..Self::bad_request(message) }
    }

    pub fn kind(mut self, kind: &'static str) -> Self {
        self.kind = kind;
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert("retry-after", v);
            }
        }
        r
    }
}
