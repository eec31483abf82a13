//! `shimmer probe URL`: an HTTP health check for images that carry nothing but `shimmer` (the
//! container image is `FROM scratch`: no curl, no shell). Exits 0 when the URL answers 2xx
//! within the timeout, 1 otherwise, saying why on stderr — what a `HEALTHCHECK`, a compose
//! `healthcheck` or a systemd `ExecStartPost` needs.
//!
//! Must never: print the response body (a probe's output lands in orchestrators' logs), or wait
//! past its timeout.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args)]
pub(super) struct ProbeArgs {
    /// The URL to GET, e.g. http://127.0.0.1:8080/health or a worker's http://127.0.0.1:7080/ready.
    url: String,
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
    match agent.get(&a.url).call() {
        Ok(resp) if resp.status().is_success() => Ok(ExitCode::SUCCESS),
        Ok(resp) => {
            eprintln!("shimmer probe: {} answered {}", a.url, resp.status());
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            eprintln!("shimmer probe: {} did not answer: {e}", a.url);
            Ok(ExitCode::FAILURE)
        }
    }
}
