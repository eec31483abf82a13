//! The `shimmer` command line: `generate`, `score`, `chat`. Flags are a contract scripts rely on
//! (docs/cli.md); output with `--json` is exactly one JSON object on stdout.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use shimmer_common::chat_template::Message;

use crate::engine::{Engine, ExpertOptions, GenerateOptions, RamBudget, UsageFile};
use crate::model_dir::ModelDir;
use crate::sampling::SamplingParams;

mod bench;
mod chat;
mod cluster;
mod convert;
mod doctor;
mod flags;
mod generate;
mod plan;
mod probe;
mod quant_eval;
mod routing;
mod run;
mod score;
mod trace;
mod tune;
mod worker;

use bench::*;
use chat::*;
use cluster::*;
use convert::*;
use doctor::*;
use flags::*;
use generate::*;
use plan::*;
use probe::*;
use quant_eval::*;
use routing::*;
use run::*;
use score::*;
use trace::*;
use tune::*;
use worker::*;

#[derive(Parser)]
#[command(name = "shimmer", version, about = "Run Mixture-of-Experts language models whose experts do not fit in fast memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI and Anthropic APIs and the web dashboard on one port.
    Run(RunArgs),
    /// `run` with cluster defaults: the routed experts on the workers of --placement (required),
    /// the API on every interface (--host 0.0.0.0) so the LAN can reach it.
    Coordinator(RunArgs),
    /// Compute an expert placement over workers from routing heat, and forecast each worker's
    /// load per token.
    Plan(PlanArgs),
    /// Serve this machine's routed experts to coordinators over QUIC (docs/cluster.md).
    Worker(WorkerArgs),
    /// The cluster's admin verbs over its control plane (status, members, placement, drain,
    /// remove, token).
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Generate a continuation of a prompt, streaming text to stdout.
    Generate(GenerateArgs),
    /// Teacher-force a token sequence: argmax and log-probability at every position.
    Score(ScoreArgs),
    /// A streaming terminal chat (multi-turn; /reset clears; Ctrl-C stops an answer).
    Chat(ChatArgs),
    /// Routing analysis over a text: expert-usage skew per layer and next-layer predictability.
    Routing(RoutingArgs),
    /// Routing traces recorded with --trace.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Prefill and decode speed under a placement, against the disk's measured bandwidth and
    /// Belady's optimum for the expert cache, all from one run.
    Bench(BenchArgs),
    /// Convert a Hugging Face checkpoint into an expert container (one aligned blob per expert);
    /// resumable.
    Convert(ConvertArgs),
    /// Quality of an expert quantisation format against the checkpoint's own weights: KL
    /// divergence of next-token distributions and top-1 agreement over a text.
    QuantEval(QuantEvalArgs),
    /// What this machine offers a model — CPU and kernels, memory bandwidth, NUMA, disks
    /// (O_DIRECT, bandwidth by queue depth), GPUs — and the flags to run it with.
    Doctor(DoctorArgs),
    /// Measure the threads, I/O depth and expert memory that run a model best here, and write
    /// them to shimmer-tune.json beside it, which the other verbs read under their flags.
    Tune(TuneArgs),
    /// Exit 0 when an HTTP URL answers 2xx within a timeout: the health check of the container
    /// image, which has no curl.
    Probe(ProbeArgs),
    /// The chat-template sandbox (started by shimmer itself; see template_sandbox.rs).
    #[command(name = "render-sandbox", hide = true)]
    RenderSandbox {
        /// Its address space in MiB.
        memory_mib: u64,
    },
}

pub fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    if let Command::RenderSandbox { memory_mib } = cli.command {
        crate::template_sandbox::serve(memory_mib)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Ok(exe) = std::env::current_exe() {
        crate::template_sandbox::enable(exe).map_err(anyhow::Error::msg)?;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SHIMMER_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    match cli.command {
        Command::Generate(a) => generate(a),
        Command::Score(a) => score(a),
        Command::Chat(a) => chat(a),
        Command::Run(a) => run_server(a, false),
        Command::Coordinator(a) => run_server(a, true),
        Command::Plan(a) => plan(a),
        Command::Worker(a) => worker(a),
        Command::Cluster(c) => cluster(c),
        Command::Routing(a) => routing(a),
        Command::Trace(TraceCommand::Analyze(a)) => trace_analyze(a),
        Command::Convert(a) => convert(a),
        Command::Bench(a) => bench(a),
        Command::QuantEval(a) => quant_eval(a),
        Command::Probe(a) => probe(a),
        Command::Doctor(a) => doctor(a),
        Command::Tune(a) => tune(a),
        Command::RenderSandbox { .. } => Ok(ExitCode::SUCCESS),
    }
}

/// The key /metrics requires, from `--metrics-api-key` or SHIMMER_METRICS_API_KEY (the flag wins).
fn metrics_api_key(flag: &Option<String>) -> Result<Option<String>> {
    let key = flag.clone().or_else(|| std::env::var("SHIMMER_METRICS_API_KEY").ok().filter(|k| !k.is_empty()));
    if let Some(k) = &key {
        if k.trim().is_empty() || k.len() > 4096 {
            bail!("--metrics-api-key must be 1 to 4096 characters and not blank");
        }
    }
    Ok(key)
}

/// A `--…-s` flag's value as a duration: seconds in (0, 3600].
fn seconds_flag(flag: &str, v: f64) -> Result<std::time::Duration> {
    if !(v > 0.0 && v <= 3600.0) {
        bail!("{flag} must be a number of seconds in (0, 3600], got {v}");
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

fn start_trace(engine: &Engine, path: &Option<PathBuf>) -> Result<()> {
    if let Some(p) = path {
        engine.record_trace(p)?;
    }
    Ok(())
}

/// The model directory to use: `--model`, or the bundled demo model (saying so on stderr).
fn model_dir(model: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = model {
        if convert::is_gguf(dir) {
            anyhow::bail!(
                "--model {}: a GGUF file; shimmer runs a checkpoint directory: import it once with `shimmer convert --from {} --to DIR`, then pass --model DIR",
                dir.display(),
                dir.display()
            );
        }
        if dir.is_file() {
            anyhow::bail!("--model {}: a file; give the model's directory (config.json, the safetensors, the tokenizer)", dir.display());
        }
        return Ok(dir.clone());
    }
    let dir = crate::demo::demo_model_dir()?;
    eprintln!("shimmer: no --model given, using the bundled demo model ({})", dir.display());
    Ok(dir)
}

fn load(dir: &std::path::Path) -> Result<Engine> {
    Engine::load(dir).with_context(|| format!("cannot load model {}", dir.display()))
}

/// Loads with the experts held as the store flags say, and (unless the output is JSON, which
/// carries it) says on stderr what the store holds.
fn open(dir: &std::path::Path, experts: &ExpertArgs, json: bool) -> Result<Engine> {
    open_as(dir, experts, json, None)
}

/// `open`, for a node that is a member of the cluster (`member`): its experts are placed by the
/// cluster's replicated state.
fn open_as(dir: &std::path::Path, experts: &ExpertArgs, json: bool, member: Option<std::sync::Arc<shimmer_worker::control::ControlPlane>>) -> Result<Engine> {
    use crate::node::PlacementSource;
    let (store, cluster) = (&experts.store, &experts.cluster);
    let source = match (&cluster.placement, member) {
        (_, Some(control)) => Some(PlacementSource::Member(control)),
        (Some(path), None) => {
            let placement = crate::node::PlacementFile::read(path)?;
            if !cluster.workers.is_empty() {
                let mut want: Vec<&str> = placement.placement.workers.iter().map(|w| w.addr.as_str()).collect();
                let mut got: Vec<&str> = cluster.workers.iter().map(String::as_str).collect();
                want.sort_unstable();
                got.sort_unstable();
                if want != got {
                    bail!("--workers {} are not the placement's workers ({})", got.join(","), want.join(","));
                }
            }
            Some(PlacementSource::File(placement))
        }
        (None, None) if !cluster.join.is_empty() => {
            shimmer_worker::control::discovery::parse_seeds(&cluster.join).map_err(|e| anyhow::anyhow!(e))?;
            let trust = cluster.auth.control_trust("--join reaches the cluster's members")?;
            Some(PlacementSource::Client { members: cluster.join.clone(), trust })
        }
        (None, None) => None,
    };
    if let Some(source) = source {
        let creds = cluster.auth.credentials()?;
        let secs = seconds_flag;
        let timeouts = shimmer_worker::remote::Timeouts {
            answer: secs("--worker-timeout-s", cluster.worker_timeout_s)?,
            connect: secs("--connect-timeout-s", cluster.connect_timeout_s)?,
        };
        let hold = match &cluster.hold {
            Some(name) => Some((name.clone(), store.options(dir)?)),
            None => None,
        };
        let described = source.describe();
        let is_file = matches!(source, PlacementSource::File(_));
        if !json && !is_file {
            eprintln!("shimmer: waiting for {described} to place the model's experts");
        }
        let engine = crate::node::coordinator(
            dir,
            crate::node::ExpertsAt::Cluster(Box::new(crate::node::ClusterOptions {
                placement: source,
                creds,
                timeouts,
                hold,
                report_heat_every: secs("--report-heat-every-s", cluster.report_heat_every_s)?,
            })),
        )
        .with_context(|| format!("cannot load model {} over the cluster", dir.display()))?;
        if !json {
            if is_file {
                eprintln!("shimmer: routed experts on the workers of {described}");
            } else {
                eprintln!("shimmer: routed experts on the workers of {described}, as it places them");
            }
        }
        return Ok(engine);
    }
    if cluster.auth.given() {
        bail!("--join-token and --tls-* are for a cluster: give --placement FILE or --join HOST:PORT too");
    }
    let engine =
        crate::node::coordinator(dir, crate::node::ExpertsAt::Here(store.options(dir)?)).with_context(|| format!("cannot load model {}", dir.display()))?;
    if let Some(t) = engine.store_telemetry().filter(|_| !json) {
        let all = engine.spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() * engine.spec.moe.num_experts;
        eprintln!(
            "shimmer: expert store: {:.3} GB for experts ({} of {all} experts, {} per layer, {} pinned), dense weights {:.3} GB, {}{}",
            t.budget_bytes as f64 / 1e9,
            t.capacity_experts.min(all as u64),
            t.slots_per_layer,
            t.pinned_experts,
            engine.dense_bytes.unwrap_or(0) as f64 / 1e9,
            if store.direct_io { "O_DIRECT" } else { "buffered reads" },
            if store.no_prefetch { ", no prefetch" } else { "" },
        );
    }
    if let Some(g) = engine.gpu_telemetry().filter(|_| !json) {
        eprintln!("shimmer: VRAM tier: {:.3} GB for experts on {}", g.budget_bytes as f64 / 1e9, g.device);
    }
    Ok(engine)
}

fn store_json(engine: &Engine) -> serde_json::Value {
    let mut out = match engine.store_telemetry() {
        Some(t) => json!({"dense_bytes": engine.dense_bytes, "experts": t}),
        None => serde_json::Value::Null,
    };
    if let Some(g) = engine.gpu_telemetry() {
        if out.is_null() {
            out = json!({});
        }
        out["vram"] = json!(g);
    }
    out
}

fn store_summary(engine: &Engine) {
    if let Some(g) = engine.gpu_telemetry() {
        let faults: u64 = g.faults.iter().map(|(_, n)| n).sum();
        eprintln!(
            "[vram: {} experts computed on the GPU, {} on the CPU; {} uploads ({:.1} MB), {} evictions; {} resident ({:.1} MB); {faults} faults]",
            g.device_experts,
            g.cpu_experts,
            g.uploads,
            g.upload_bytes as f64 / 1e6,
            g.evictions,
            g.resident_experts,
            g.resident_bytes as f64 / 1e6,
        );
    }
    if let Some(t) = engine.store_telemetry() {
        eprintln!(
            "[experts: {} RAM hits, {} joined in-flight reads, {} disk misses; {:.1} MB read at {:.2} GB/s; prefetch {} issued / {} used; waited {:.1} ms on I/O{}]",
            t.ram_hits,
            t.in_flight_hits,
            t.disk_misses,
            t.bytes_read as f64 / 1e6,
            t.read_gb_s,
            t.prefetch_issued,
            t.prefetch_useful,
            t.io_wait_ms,
            if t.mirror_fallbacks > 0 { format!("; {} reads served by the other copy", t.mirror_fallbacks) } else { String::new() }
        );
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
