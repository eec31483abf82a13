//! `shimmer probe URL`: an HTTP health check for images that carry nothing but `shimmer` (the
//! container image is `FROM scratch`: no curl, no shell). Exits 0 when the URL answers 2xx
//! within the timeout, 1 otherwise, saying why on stderr — what a `HEALTHCHECK`, a compose
//! `healthcheck` or a `helm test` pod needs. With `--chat` it asks the server at URL for one
//! short chat completion instead, and passes when an answer comes back.
//!
//! Must never: print a response body (a probe's output lands in orchestrators' logs), or wait
//! past its timeout.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};

#[derive(Args)]
pub(super) struct ProbeArgs {
    /// The URL to GET, e.g. http://127.0.0.1:8080/health or a worker's http://127.0.0.1:7080/ready;
    /// with --chat, the server's base URL (http://shimmer:8080).
    url: String,
    /// Ask for one chat completion (a few tokens, the server's first model) instead of a GET.
    #[arg(long)]
    chat: bool,
    /// The server's API key, with --chat (also SHIMMER_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Give up after this many seconds (connecting and answering together).
    #[arg(long, default_value_t = 3.0)]
    timeout_s: f64,
}

pub(super) fn probe(a: ProbeArgs) -> Result<ExitCode> {
    if !(a.url.starts_with("http://") || a.url.starts_with("https://")) {
        bail!("probe needs an http:// or https:// URL, not {:?}", a.url);
    }
    if !(a.timeout_s.is_finite() && a.timeout_s > 0.0 && a.timeout_s <= 3600.0) {
        bail!("--timeout-s must be in (0, 3600] seconds, not {}", a.timeout_s);
    }
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs_f64(a.timeout_s))).build().into();
    let outcome = if a.chat { chat(&agent, &a) } else { get(&agent, &a.url).map(|_| ()) };
    match outcome {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(why) => {
            eprintln!("shimmer probe: {why}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Bodies a probe reads at most (a model list, one short completion).
const MAX_BODY_BYTES: u64 = 1 << 20;

fn get(agent: &ureq::Agent, url: &str) -> Result<String, String> {
    finish(url, agent.get(url).call())
}

fn finish(url: &str, answer: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<String, String> {
    let resp = answer.map_err(|e| format!("{url} did not answer: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("{url} answered {status}"));
    }
    resp.into_body().with_config().limit(MAX_BODY_BYTES).read_to_string().map_err(|e| format!("{url}: cannot read the answer: {e}"))
}

fn chat(agent: &ureq::Agent, a: &ProbeArgs) -> Result<(), String> {
    let base = a.url.trim_end_matches('/').trim_end_matches("/v1");
    let api_key = a.api_key.clone().or_else(|| std::env::var("SHIMMER_API_KEY").ok().filter(|k| !k.is_empty()));
    let with_key = |req: ureq::RequestBuilder<ureq::typestate::WithoutBody>| match &api_key {
        Some(k) => req.header("authorization", &format!("Bearer {k}")),
        None => req,
    };
    let models_url = format!("{base}/v1/models");
    let models: Value =
        serde_json::from_str(&finish(&models_url, with_key(agent.get(&models_url)).call())?).map_err(|e| format!("{models_url} did not answer JSON: {e}"))?;
    let model = models["data"][0]["id"].as_str().ok_or(format!("{models_url} lists no model"))?;
    let url = format!("{base}/v1/chat/completions");
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4});
    let mut req = agent.post(&url).header("content-type", "application/json");
    if let Some(k) = &api_key {
        req = req.header("authorization", &format!("Bearer {k}"));
    }
    let answer: Value = serde_json::from_str(&finish(&url, req.send(body.to_string()))?).map_err(|e| format!("{url} did not answer JSON: {e}"))?;
    match answer["choices"][0]["message"]["content"].as_str() {
        Some(_) => Ok(()),
        None => Err(format!("{url} answered without a message")),
    }
}
