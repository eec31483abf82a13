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
}

#[derive(Args)]
struct WorkerArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The UDP address to listen on (port 0: any free port; the chosen one is printed).
    #[arg(long, default_value = "0.0.0.0:7070")]
    listen: String,
    #[command(flatten)]
    auth: ClusterAuthArgs,
    /// The placement this worker serves a slice of: its assigned experts are pinned and read at
    /// start (within --ram-gb); others it is asked for are read from its own disk on demand.
    #[arg(long, value_name = "FILE")]
    placement: Option<PathBuf>,
    /// This worker's name in the placement (default: the worker whose address is --listen; with
    /// --listen on 0.0.0.0, the only one on its port at an address of this machine).
    #[arg(long, requires = "placement")]
    name: Option<String>,
    /// Serve only the experts the placement assigns this worker (refuse failover for others).
    #[arg(long, requires = "placement")]
    assigned_only: bool,
    /// The placement epoch this worker serves (default: the placement's, else 1).
    #[arg(long)]
    epoch: Option<u64>,
    /// RAM for the expert cache in GB, or `auto`.
    #[arg(long, value_name = "GB|auto")]
    ram_gb: Option<String>,
    /// Read experts with O_DIRECT; needs a converted container.
    #[arg(long)]
    direct_io: bool,
    /// Where routing heat is learned and kept (default: shimmer-usage.json beside the model).
    #[arg(long, value_name = "FILE", conflicts_with = "no_usage")]
    usage: Option<PathBuf>,
    /// Neither read nor write routing heat.
    #[arg(long)]
    no_usage: bool,
}

#[derive(Args)]
struct PlanArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The workers' addresses (host:port), comma-separated; each is also its name.
    #[arg(long, value_delimiter = ',', required = true)]
    workers: Vec<String>,
    /// RAM each worker gives its expert cache, in GB (default: enough for all of its experts).
    #[arg(long)]
    ram_gb_per_worker: Option<f64>,
    /// Copies of each of the hottest experts (see --replicate-fraction).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The fraction of each layer's experts, hottest first, that get --replicas copies (1: every
    /// expert, so that any --replicas - 1 workers can fail).
    #[arg(long, default_value_t = shimmer_cluster::placement::HOT_FRACTION)]
    replicate_fraction: f64,
    /// Routing heat (default: shimmer-usage.json beside the model, if there is one; else uniform).
    #[arg(long)]
    usage: Option<PathBuf>,
    /// Where to write the placement file.
    #[arg(long)]
    out: PathBuf,
    /// The placement's epoch (default: one more than --out's, when it is a placement of this
    /// model; else 1).
    #[arg(long)]
    epoch: Option<u64>,
    /// Print the forecast as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct RunArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The address to serve on (default 127.0.0.1; 0.0.0.0 for `coordinator`).
    #[arg(long)]
    host: Option<String>,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this API key (repeatable; also SHIMMER_API_KEY). Without one, no key is needed.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
    /// Requests that may wait for a batch slot; beyond, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Sequences decoded together in one forward pass.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// GB of KV cache kept from finished requests, so a prompt that starts like an earlier one
    /// (the next chat turn) reuses it instead of prefilling again; 0 turns prefix reuse off.
    #[arg(long, default_value_t = 1.0)]
    kv_gb: f64,
    /// The model name clients use (default: the model directory's name; `shimmer-demo` for the demo).
    #[arg(long)]
    served_model_name: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(Args)]
struct BenchArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    gen_tokens: usize,
    /// A UTF-8 text the prompt and the decoded tokens are taken from (default: a built-in
    /// passage). Decode steps feed the text's next tokens, one per step.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Compute threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Read every expert the budget holds before timing (to benchmark a resident model, as
    /// llama-bench does after its warm-up).
    #[arg(long)]
    preload: bool,
    /// How much of the experts file the disk-bandwidth probe reads (MB, 10^6 bytes).
    #[arg(long, default_value_t = 1024)]
    disk_probe_mb: u64,
    #[command(flatten)]
    store: StoreArgs,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ConvertArgs {
    /// The Hugging Face checkpoint directory (bf16/f16/f32, or fp8-e4m3 with 128×128 block scales).
    #[arg(long)]
    from: PathBuf,
    /// The container directory to write (new or empty, or an interrupted conversion to resume).
    #[arg(long)]
    to: PathBuf,
    /// Routed experts' format: bf16, int8, int4-g32, int4-g64, int4-g128, mxfp4.
    #[arg(long, default_value = "bf16")]
    quant: String,
    /// Dense weights' format: bf16 or int8.
    #[arg(long, default_value = "bf16")]
    dense_quant: String,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// How the routed experts are held (docs/expert-store.md).
#[derive(Args, Clone)]
struct StoreArgs {
    /// RAM for the expert cache in GB (a float), or `auto` (what the machine can spare). Without
    /// it an unconverted checkpoint's experts all stay in memory and a container uses `auto`.
    #[arg(long, value_name = "GB|auto")]
    ram_gb: Option<String>,
    /// Read experts with O_DIRECT (past the page cache); needs a converted container.
    #[arg(long)]
    direct_io: bool,
    /// A second copy of the container (another drive): reads are spread over both, and a bad
    /// read or checksum on one is served from the other.
    #[arg(long, value_name = "DIR")]
    mirror: Option<PathBuf>,
    /// Turn off one-layer-ahead prefetch (and warming the learned pins at start).
    #[arg(long)]
    no_prefetch: bool,
    /// Expert reads in flight at once.
    #[arg(long, default_value_t = shimmer_store::DEFAULT_IO_DEPTH)]
    io_depth: usize,
    /// Where routing heat is learned and kept (default: shimmer-usage.json beside the model).
    #[arg(long, value_name = "FILE", conflicts_with = "no_usage")]
    usage: Option<PathBuf>,
    /// Neither read nor write routing heat.
    #[arg(long)]
    no_usage: bool,
    /// Reach the routed experts on workers placed by this file (`shimmer plan`; docs/cluster.md).
    #[arg(long, value_name = "FILE")]
    placement: Option<PathBuf>,
    /// The workers' addresses; when given, they must be the placement's.
    #[arg(long, value_delimiter = ',', requires = "placement")]
    workers: Vec<String>,
    #[command(flatten)]
    auth: ClusterAuthArgs,
    /// Seconds to wait for a worker's answer to one layer's request before failing over.
    #[arg(long, default_value_t = 30.0)]
    worker_timeout_s: f64,
    /// Seconds to wait for a worker's connection (at start, and when retrying a down one).
    #[arg(long, default_value_t = 3.0)]
    connect_timeout_s: f64,
    /// This node is also the placement's worker NAME: its experts are computed here (from this
    /// machine's disk, under the store flags) instead of over the network.
    #[arg(long, value_name = "NAME", requires = "placement")]
    hold: Option<String>,
}

/// How cluster nodes know each other (docs/cluster.md): a join token, operator certificates, or both.
#[derive(Args, Clone, Default)]
struct ClusterAuthArgs {
    /// The cluster's join token (also SHIMMER_JOIN_TOKEN).
    #[arg(long)]
    join_token: Option<String>,
    /// This node's certificate chain (PEM), for operator-managed mutual TLS.
    #[arg(long, value_name = "PEM", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The CA certificate(s) peers' certificates must chain to (PEM).
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
}

impl ClusterAuthArgs {
    fn given(&self) -> bool {
        self.join_token.is_some() || self.tls_cert.is_some()
    }

    /// The token from the flag or SHIMMER_JOIN_TOKEN, and the certificates if given.
    fn credentials(&self) -> Result<shimmer_worker::transport::Credentials> {
        use shimmer_worker::transport::{Credentials, JoinToken, OperatorCerts};
        let token = match self.join_token.clone().or_else(|| std::env::var("SHIMMER_JOIN_TOKEN").ok()).filter(|t| !t.is_empty()) {
            Some(t) => Some(JoinToken::new(&t).context("--join-token")?),
            None => None,
        };
        let certs = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(ca)) => Some(OperatorCerts::load(c, k, ca)?),
            _ => None,
        };
        Credentials::new(token, certs).context("give --join-token (or SHIMMER_JOIN_TOKEN), or --tls-cert, --tls-key and --tls-ca")
    }
}

impl StoreArgs {
    fn options(&self) -> Result<ExpertOptions> {
        let ram = match &self.ram_gb {
            Some(s) => Some(RamBudget::parse(s).map_err(|e| anyhow::anyhow!("--ram-gb: {e}"))?),
            None => None,
        };
        if self.io_depth == 0 || self.io_depth > 256 {
            bail!("--io-depth must be between 1 and 256");
        }
        let usage = match (&self.usage, self.no_usage) {
            (_, true) => UsageFile::Off,
            (Some(p), false) => UsageFile::File(p.clone()),
            (None, false) => UsageFile::BesideModel,
        };
        Ok(ExpertOptions {
            ram,
            direct_io: self.direct_io,
            mirror: self.mirror.clone(),
            prefetch: !self.no_prefetch,
            io_depth: self.io_depth,
            usage,
            assigned: None,
        })
    }
}

#[derive(Args)]
struct QuantEvalArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A UTF-8 text file (e.g. held-out text).
    #[arg(long)]
    text: PathBuf,
    /// Formats to measure, comma-separated: int8, int4-g32, int4-g64, int4-g128, mxfp4 (`none`: only
    /// the --candidate models).
    #[arg(long, value_delimiter = ',', default_value = "int8,int4-g32,int4-g64,int4-g128,mxfp4")]
    quant: Vec<String>,
    /// Also measure this model directory (e.g. a converted container, with int8 dense weights)
    /// against --model; repeatable.
    #[arg(long, value_name = "DIR")]
    candidate: Vec<PathBuf>,
    /// Tokens per independent sequence.
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Stop after this many tokens.
    #[arg(long, default_value_t = 16384)]
    max_tokens: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Replay a trace through the cache policies at one capacity: hit rates against Belady's optimum.
    Analyze(TraceAnalyzeArgs),
}

#[derive(Args)]
struct TraceAnalyzeArgs {
    /// A trace written by --trace.
    file: PathBuf,
    /// Experts the cache holds, across all MoE layers (split evenly per layer).
    #[arg(long, required_unless_present = "ram_gb", conflicts_with = "ram_gb")]
    capacity_experts: Option<usize>,
    /// Or a RAM budget in GB, turned into experts with --model's expert size.
    #[arg(long, requires = "model")]
    ram_gb: Option<f64>,
    /// The model (container or checkpoint) the trace was recorded on, for --ram-gb.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct SamplingArgs {
    /// Softmax temperature; 0 is greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens less likely than P times the most likely one.
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalise tokens already in the context (1.0: off).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed for sampling; the same seed gives the same output.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the output contains this string (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
}

impl SamplingArgs {
    fn params(&self, default_temperature: f32, default_top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(default_temperature),
            top_p: self.top_p.unwrap_or(default_top_p),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed: self.seed,
        }
    }
}

#[derive(Args)]
struct GenerateArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompt_ids", conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// The prompt as token ids, used exactly as given: 1,2,3
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as one user message with the model's chat template.
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Continue the conversation saved in FILE (token history and KV cache), and save it back.
    #[arg(long, value_name = "FILE")]
    session: Option<PathBuf>,
    #[command(flatten)]
    store: StoreArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

#[derive(Args)]
struct ScoreArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The token ids to score: 1,2,3
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: StoreArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

#[derive(Args)]
struct ChatArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long, conflicts_with = "url")]
    model: Option<PathBuf>,
    /// Chat with a running OpenAI-compatible server instead (e.g. http://127.0.0.1:8080).
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// The server's API key (also SHIMMER_API_KEY or OPENAI_API_KEY); with --url.
    #[arg(long, requires = "url")]
    api_key: Option<String>,
    /// The model to ask the server for (default: the first it lists); with --url.
    #[arg(long, requires = "url")]
    model_name: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Resume the conversation saved in FILE, and save it after every turn.
    #[arg(long, value_name = "FILE")]
    session: Option<PathBuf>,
    #[command(flatten)]
    store: StoreArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

#[derive(Args)]
struct RoutingArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A UTF-8 text file to route (e.g. held-out text).
    #[arg(long)]
    text: PathBuf,
    /// Tokens per independent sequence (at most the model's context).
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Stop after this many tokens.
    #[arg(long, default_value_t = 1 << 20)]
    max_tokens: usize,
    #[arg(long)]
    json: bool,
}

pub fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
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
        Command::Routing(a) => routing(a),
        Command::Trace(TraceCommand::Analyze(a)) => trace_analyze(a),
        Command::Convert(a) => convert(a),
        Command::Bench(a) => bench(a),
        Command::QuantEval(a) => quant_eval(a),
    }
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
fn open(dir: &std::path::Path, store: &StoreArgs, json: bool) -> Result<Engine> {
    if let Some(path) = &store.placement {
        let placement = shimmer_cluster::placement::Placement::read(path)?;
        if !store.workers.is_empty() {
            let mut want: Vec<&str> = placement.workers.iter().map(|w| w.addr.as_str()).collect();
            let mut got: Vec<&str> = store.workers.iter().map(String::as_str).collect();
            want.sort_unstable();
            got.sort_unstable();
            if want != got {
                bail!("--workers {} are not the placement's workers ({})", got.join(","), want.join(","));
            }
        }
        let creds = store.auth.credentials()?;
        let secs = |flag: &str, v: f64| -> Result<std::time::Duration> {
            if !(v > 0.0 && v <= 3600.0) {
                bail!("{flag} must be a number of seconds in (0, 3600], got {v}");
            }
            Ok(std::time::Duration::from_secs_f64(v))
        };
        let timeouts = shimmer_worker::remote::Timeouts {
            answer: secs("--worker-timeout-s", store.worker_timeout_s)?,
            connect: secs("--connect-timeout-s", store.connect_timeout_s)?,
        };
        let engine = (|| -> Result<Engine> {
            let model = ModelDir::open(dir)?;
            let (spec, fingerprint) = (&model.spec, &model.fingerprint);
            let moe: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
            placement.validate(fingerprint, &moe, spec.moe.num_experts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let (dense, dense_bytes) = model.dense()?;
            let local = match &store.hold {
                Some(name) => {
                    let slice = placement.slice(name, &moe).map_err(|e| anyhow::anyhow!("--hold {name}: {e}"))?;
                    let opts = ExpertOptions { assigned: Some(slice.pins), ..store.options()? };
                    // This process holds the dense weights too: an `auto` budget leaves them room.
                    let experts = model.expert_store(&opts, dense_bytes)?;
                    Some((name.clone(), Box::new(experts) as Box<dyn shimmer_experts::ExpertDispatch>))
                }
                None => None,
            };
            let remote = shimmer_worker::remote::RemoteExperts::connect_with(placement, shimmer_cluster::model_id(fingerprint), &creds, timeouts, local)?;
            // When workers move to a newer placement, the file is read again.
            let (file, fingerprint, experts) = (path.clone(), fingerprint.to_string(), spec.moe.num_experts);
            let remote = remote.with_reload(Box::new(move || {
                let p = shimmer_cluster::placement::Placement::read(&file).map_err(|e| e.to_string())?;
                p.validate(&fingerprint, &moe, experts).map_err(|e| format!("{}: {e}", file.display()))?;
                Ok(p)
            }));
            Ok(Engine::new(&model, dense, crate::engine::Experts::Cluster(Box::new(remote)))?)
        })()
        .with_context(|| format!("cannot load model {} over the cluster", dir.display()))?;
        if !json {
            eprintln!("shimmer: routed experts on the workers of {}", path.display());
        }
        return Ok(engine);
    }
    if store.auth.given() {
        bail!("--join-token and --tls-* are for a cluster: give --placement FILE too");
    }
    let engine = Engine::open(dir, &store.options()?).with_context(|| format!("cannot load model {}", dir.display()))?;
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
    Ok(engine)
}

fn store_json(engine: &Engine) -> serde_json::Value {
    match engine.store_telemetry() {
        Some(t) => json!({"dense_bytes": engine.dense_bytes, "experts": t}),
        None => serde_json::Value::Null,
    }
}

fn store_summary(engine: &Engine) {
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

fn generate(a: GenerateArgs) -> Result<ExitCode> {
    let engine = open(&model_dir(&a.model)?, &a.store, a.json)?;
    start_trace(&engine, &a.trace)?;
    let saved = match &a.session {
        Some(path) => crate::session_file::load(path, &engine)?,
        None => None,
    };
    let (mut session, mut history, mut messages) = match saved {
        Some(s) => (s.session, s.history, s.messages),
        None => (engine.new_session(), Vec::new(), Vec::new()),
    };
    // With a session, the prompt continues the saved conversation: plain prompts are appended to
    // its token history, chat prompts become its next user message.
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => history.iter().chain(ids).copied().collect(),
        (Some(text), None) if a.chat => {
            messages.push(Message::new("user", text));
            engine.encode_chat(&messages)?
        }
        (Some(text), None) => {
            // Tokenizer special tokens (a BOS) only start a conversation, never continue one.
            let ids = engine.tokenizer.encode(text, history.is_empty())?;
            history.iter().chain(&ids).copied().collect()
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampling: a.sampling.params(0.0, 1.0), stop: a.sampling.stop.clone() };
    if let Some(path) = &a.session {
        let reused = session.tokens.iter().zip(&prompt_ids).take_while(|(x, y)| x == y).count();
        eprintln!("shimmer: session {}: {reused} cached positions reused, {} to prefill", path.display(), prompt_ids.len().saturating_sub(reused));
    }
    let mut stdout = std::io::stdout().lock();
    let json_mode = a.json;
    let gen = engine.generate(&mut session, &prompt_ids, &opts, |piece| {
        if !json_mode {
            // A closed stdout (e.g. `| head`) ends generation instead of failing it.
            return stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).is_ok();
        }
        true
    })?;
    if let Some(path) = &a.session {
        history = prompt_ids.iter().chain(&gen.output_ids).copied().collect();
        if a.chat {
            messages.push(Message::new("assistant", &gen.text));
        }
        crate::session_file::save(path, &engine, &session, &history, &messages)?;
    }
    engine.finish_trace()?;
    let decode_tok_s = if gen.decode_ms > 0.0 { gen.decode_tokens as f64 / (gen.decode_ms / 1e3) } else { 0.0 };
    if a.json {
        let out = json!({
            "prompt_ids": prompt_ids,
            "output_ids": gen.output_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason.as_str(),
            "timings": {"load_ms": round2(engine.load_ms), "prefill_ms": round2(gen.prefill_ms), "decode_ms": round2(gen.decode_ms), "decode_tokens": gen.decode_tokens, "decode_tok_s": round2(decode_tok_s), "store": store_json(&engine), "cluster": engine.cluster_telemetry()},
        });
        writeln!(stdout, "{out}")?;
    } else {
        let _ = writeln!(stdout);
        eprintln!(
            "[{} tokens, {}; load {:.0} ms, prefill {:.1} ms, decode {:.1} tok/s]",
            gen.output_ids.len(),
            gen.finish_reason.as_str(),
            engine.load_ms,
            gen.prefill_ms,
            decode_tok_s
        );
        store_summary(&engine);
    }
    Ok(ExitCode::SUCCESS)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn score(a: ScoreArgs) -> Result<ExitCode> {
    let engine = open(&model_dir(&a.model)?, &a.store, a.json)?;
    start_trace(&engine, &a.trace)?;
    let s = engine.score(&a.ids)?;
    engine.finish_trace()?;
    let mut stdout = std::io::stdout().lock();
    if a.json {
        writeln!(
            stdout,
            "{}",
            json!({"argmax": s.argmax, "logprobs": s.logprobs, "timings": {"load_ms": round2(engine.load_ms), "store": store_json(&engine)}})
        )?;
    } else {
        writeln!(stdout, "pos\tid\targmax\tlogprob(next)")?;
        for (i, id) in a.ids.iter().enumerate() {
            let lp = s.logprobs.get(i).map_or(String::from("-"), |l| format!("{l:.4}"));
            writeln!(stdout, "{i}\t{id}\t{}\t{lp}", s.argmax[i])?;
        }
        store_summary(&engine);
    }
    Ok(ExitCode::SUCCESS)
}

fn worker(a: WorkerArgs) -> Result<ExitCode> {
    use shimmer_cluster::placement::Placement;
    let dir = model_dir(&a.model)?;
    let creds = a.auth.credentials()?;
    let addr: std::net::SocketAddr = a.listen.parse().with_context(|| format!("--listen: `{}` is not an address:port", a.listen))?;
    let ram = match &a.ram_gb {
        Some(s) => Some(RamBudget::parse(s).map_err(|e| anyhow::anyhow!("--ram-gb: {e}"))?),
        None => None,
    };
    let spec = shimmer_common::ModelSpec::from_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let moe: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    // This worker's slice of the placement: its name, what it holds, what it pins.
    let placement = a.placement.as_ref().map(|p| Placement::read(p)).transpose()?;
    let slice = match (&a.placement, &placement) {
        (Some(path), Some(p)) => {
            let name = match &a.name {
                Some(n) => p
                    .workers
                    .iter()
                    .find(|w| &w.name == n)
                    .map(|w| w.name.clone())
                    .with_context(|| format!("--name {n}: {} has no such worker", path.display()))?,
                None => worker_in_placement(p, addr).with_context(|| format!("{}: say which worker this is with --name", path.display()))?,
            };
            let slice = p.slice(&name, &moe).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            Some((name, p.epoch, slice))
        }
        _ => None,
    };
    let usage = match (&a.usage, a.no_usage) {
        (_, true) => UsageFile::Off,
        (Some(p), false) => UsageFile::File(p.clone()),
        (None, false) => UsageFile::BesideModel,
    };
    let opts = ExpertOptions { ram, direct_io: a.direct_io, usage, assigned: slice.as_ref().map(|s| s.2.pins.clone()), ..ExpertOptions::default() };
    let model = ModelDir::open(&dir).with_context(|| format!("cannot open the experts of {}", dir.display()))?;
    // A worker holds no dense weights: an `auto` budget may take all but the reserve.
    let store = model.expert_store(&opts, 0).with_context(|| format!("cannot open the experts of {}", dir.display()))?;
    let (spec, fingerprint) = (model.spec.clone(), model.fingerprint.clone());
    if let (Some(path), Some(p)) = (&a.placement, &placement) {
        p.validate(&fingerprint, &moe, spec.moe.num_experts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    let epoch = a.epoch.or(slice.as_ref().map(|s| s.1)).unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("worker-net").enable_all().build()?;
    rt.block_on(async move {
        let endpoint = shimmer_worker::transport::server(addr, &creds)?;
        let local = endpoint.local_addr()?;
        let mut state = shimmer_worker::server::WorkerState::serving_store(
            std::sync::Arc::new(store),
            shimmer_cluster::model_id(&fingerprint),
            epoch,
            creds,
            spec.hidden_size,
        );
        if let Some((name, _, slice)) = slice {
            state.name = name;
            state.assigned = Some(slice.assigned);
            state.assigned_only = a.assigned_only;
        }
        let status = state.status();
        let state = std::sync::Arc::new(state);
        // Tests and scripts wait for this line.
        eprintln!("shimmer: worker serving {} on {local} (QUIC, ALPN shimmer/1)", dir.display());
        eprintln!(
            "shimmer: worker {}: {} experts assigned{}, RAM for {} experts of {:.1} MB ({:.3} GB), epoch {epoch}",
            if status.name.is_empty() { "(no placement)" } else { &status.name },
            status.assigned_experts,
            if a.assigned_only { " (serves only those)" } else { ", loads others from its disk on demand" },
            status.capacity_experts,
            status.expert_bytes as f64 / 1e6,
            status.budget_bytes as f64 / 1e9,
        );
        tokio::select! {
            _ = shimmer_worker::server::serve(endpoint, state) => {},
            _ = tokio::signal::ctrl_c() => eprintln!("shimmer: worker stopping"),
        }
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The placement's worker this one is: the one whose address is `listen`; else, listening on
/// every interface, the only one on its port whose IP address is this machine's (one it can bind).
fn worker_in_placement(p: &shimmer_cluster::placement::Placement, listen: std::net::SocketAddr) -> Result<String> {
    if let Some(w) = p.workers.iter().find(|w| w.addr.parse::<std::net::SocketAddr>().ok() == Some(listen)) {
        return Ok(w.name.clone());
    }
    if !listen.ip().is_unspecified() {
        bail!("no worker of the placement has the address {listen}");
    }
    let mine: Vec<_> = p
        .workers
        .iter()
        .filter(|w| w.addr.parse::<std::net::SocketAddr>().is_ok_and(|a| a.port() == listen.port() && std::net::UdpSocket::bind((a.ip(), 0)).is_ok()))
        .collect();
    match mine.as_slice() {
        [one] => Ok(one.name.clone()),
        [] => bail!("no worker of the placement is on port {} at an address of this machine", listen.port()),
        many => bail!(
            "{} workers of the placement are on port {} at addresses of this machine ({})",
            many.len(),
            listen.port(),
            many.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn plan(a: PlanArgs) -> Result<ExitCode> {
    use shimmer_cluster::placement::{self, PlanInput, Worker};
    let dir = model_dir(&a.model)?;
    let model = ModelDir::open(&dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let (spec, fingerprint) = (model.spec.clone(), model.fingerprint.clone());
    let moe_layers: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    let experts = spec.moe.num_experts;
    let expert_bytes = shimmer_store::expert_bytes_of(&dir, &spec)?;
    let mut seen = std::collections::HashSet::new();
    for w in &a.workers {
        if w.parse::<std::net::SocketAddr>().is_err() && !w.contains(':') {
            bail!("--workers: `{w}` is not a host:port address");
        }
        if !seen.insert(w) {
            bail!("--workers: `{w}` is listed twice");
        }
    }
    let ram_bytes = match a.ram_gb_per_worker {
        Some(gb) if gb > 0.0 && gb.is_finite() => (gb * 1e9) as u64,
        Some(gb) => bail!("--ram-gb-per-worker must be a positive number of GB, got {gb}"),
        None => u64::MAX,
    };
    let workers: Vec<Worker> = a.workers.iter().map(|w| Worker { name: w.clone(), addr: w.clone(), ram_bytes }).collect();
    let usage_path = a.usage.clone().or_else(|| Some(dir.join(shimmer_store::usage::USAGE_FILE)).filter(|p| p.exists()));
    let mut heat = std::collections::HashMap::new();
    if let Some(p) = &usage_path {
        let shape: Vec<usize> = spec.layers.iter().map(|k| if *k == shimmer_common::spec::LayerMlp::Moe { experts } else { 0 }).collect();
        let usage = shimmer_store::usage::Usage::open(p, &fingerprint, &shape)?;
        for (l, counts) in usage.base.iter().enumerate() {
            for (e, c) in counts.iter().enumerate() {
                if *c > 0 {
                    heat.insert((l, e), *c);
                }
            }
        }
    }
    let (mut placement, forecast) = placement::plan(&PlanInput {
        model: &fingerprint,
        moe_layers: &moe_layers,
        experts,
        expert_bytes,
        workers: &workers,
        heat: &heat,
        replicas: a.replicas,
        replicate_fraction: a.replicate_fraction,
        top_k: spec.moe.top_k,
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    // A new plan over an old one for the same model is its successor: the next epoch, which
    // running coordinators adopt when their workers move to it.
    placement.epoch = match a.epoch {
        Some(e) => e,
        None => placement::Placement::read(&a.out).ok().filter(|old| old.model == fingerprint).map_or(1, |old| old.epoch + 1),
    };
    let text = serde_json::to_string_pretty(&placement)?;
    std::fs::write(&a.out, text + "\n").with_context(|| format!("cannot write {}", a.out.display()))?;
    // Per token: top-k selections in each MoE layer.
    let per_token = spec.moe.top_k as f64 * moe_layers.len() as f64;
    if a.json {
        let rows: Vec<serde_json::Value> = forecast
            .iter()
            .map(|f| serde_json::json!({ "worker": f.name, "experts_held": f.experts_held, "experts_in_ram": f.experts_in_ram, "selections_per_token": f.selections_per_token, "bytes_per_token": f.bytes_per_token, "round_trips_per_token": f.round_trips_per_token }))
            .collect();
        println!("{}", serde_json::json!({ "out": a.out, "heat": usage_path, "selections_per_token": per_token, "workers": rows }));
    } else {
        println!(
            "placement for {} over {} workers → {} ({})",
            dir.display(),
            workers.len(),
            a.out.display(),
            if usage_path.is_some() { "routing heat from the usage file" } else { "uniform heat: no usage file" }
        );
        println!("{:24} {:>8} {:>8} {:>16} {:>14} {:>18}", "worker", "experts", "in RAM", "selections/token", "MB/token", "round trips/token");
        for f in &forecast {
            println!(
                "{:24} {:>8} {:>8} {:>16.2} {:>14.2} {:>18.2}",
                f.name,
                f.experts_held,
                f.experts_in_ram,
                f.selections_per_token,
                f.bytes_per_token / 1e6,
                f.round_trips_per_token
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run_server(a: RunArgs, coordinator: bool) -> Result<ExitCode> {
    if coordinator && a.store.placement.is_none() {
        bail!("shimmer coordinator needs --placement FILE (write one with `shimmer plan`; docs/cluster.md)");
    }
    let host = a.host.clone().unwrap_or_else(|| if coordinator { "0.0.0.0" } else { "127.0.0.1" }.into());
    let dir = model_dir(&a.model)?;
    let engine = open(&dir, &a.store, false)?;
    let mut api_keys = a.api_keys.clone();
    if let Ok(k) = std::env::var("SHIMMER_API_KEY") {
        if !k.is_empty() {
            api_keys.push(k);
        }
    }
    let model_id = match (&a.served_model_name, &a.model) {
        (Some(n), _) => n.clone(),
        (None, None) => "shimmer-demo".into(),
        (None, Some(_)) => {
            std::fs::canonicalize(&dir).ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "model".into())
        }
    };
    if a.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    if !(a.kv_gb >= 0.0 && a.kv_gb.is_finite()) {
        bail!("--kv-gb must be a number of GB >= 0, got {}", a.kv_gb);
    }
    let expert_bytes = match engine.store_telemetry() {
        Some(t) => t.expert_bytes,
        None => shimmer_store::expert_bytes_of(&dir, &engine.spec)?,
    };
    crate::server::serve(
        engine,
        crate::server::ServerConfig {
            host,
            port: a.port,
            api_keys,
            max_queue: a.max_queue,
            max_batch: a.max_batch.max(1),
            kv_budget_bytes: (a.kv_gb * 1e9) as usize,
            max_body_bytes: 4 << 20,
            model_id,
            expert_bytes,
        },
    )?;
    Ok(ExitCode::SUCCESS)
}

fn chat(a: ChatArgs) -> Result<ExitCode> {
    if let Some(url) = &a.url {
        for (set, flag) in [
            (a.session.is_some(), "--session"),
            (a.trace.is_some(), "--trace"),
            (a.store.ram_gb.is_some() || a.store.direct_io, "the expert-store flags"),
            (a.store.placement.is_some(), "--placement"),
        ] {
            if set {
                bail!("{flag} applies to a local model, not to --url");
            }
        }
        let api_key =
            a.api_key.clone().or_else(|| std::env::var("SHIMMER_API_KEY").ok()).or_else(|| std::env::var("OPENAI_API_KEY").ok()).filter(|k| !k.is_empty());
        let p = a.sampling.params(0.7, 0.9);
        crate::remote_chat::RemoteChat {
            url: url.clone(),
            api_key,
            model: a.model_name.clone(),
            max_tokens: a.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            seed: Some(p.seed),
            stop: a.sampling.stop.clone(),
        }
        .run()?;
        return Ok(ExitCode::SUCCESS);
    }
    let dir = model_dir(&a.model)?;
    let engine = open(&dir, &a.store, false)?;
    start_trace(&engine, &a.trace)?;
    if engine.chat.template.is_none() {
        bail!("{}: the model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)", dir.display());
    }
    let (interrupted, generating) = crate::remote_chat::chat_interrupt()?;
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampling: a.sampling.params(0.7, 0.9), stop: a.sampling.stop.clone() };
    eprintln!("shimmer chat · {} · /reset clears the conversation, Ctrl-C stops an answer, Ctrl-D leaves", dir.display());
    let (mut session, mut messages) = match &a.session {
        Some(path) => match crate::session_file::load(path, &engine)? {
            Some(saved) => {
                eprintln!("(resumed {}: {} messages, {} cached positions)", path.display(), saved.messages.len(), saved.session.cache.len());
                (saved.session, saved.messages)
            }
            None => (engine.new_session(), Vec::new()),
        },
        None => (engine.new_session(), Vec::new()),
    };
    let save = |session: &crate::engine::Session, messages: &[Message]| -> Result<()> {
        if let Some(path) = &a.session {
            crate::session_file::save(path, &engine, session, &session.tokens, messages)?;
        }
        Ok(())
    };
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut line = String::new();
    loop {
        print!("› ");
        stdout.flush()?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            engine.finish_trace()?;
            return Ok(ExitCode::SUCCESS);
        }
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => {
                engine.finish_trace()?;
                return Ok(ExitCode::SUCCESS);
            }
            "/reset" => {
                messages.clear();
                session = engine.new_session();
                save(&session, &messages)?;
                println!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", input));
        let ids = match engine.encode_chat(&messages) {
            Ok(ids) => ids,
            Err(e) => {
                messages.pop();
                eprintln!("error: {e}");
                continue;
            }
        };
        interrupted.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let result = engine.generate(&mut session, &ids, &opts, |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
            !interrupted.load(Ordering::SeqCst)
        });
        generating.store(false, Ordering::SeqCst);
        println!();
        match result {
            Ok(gen) => {
                messages.push(Message::new("assistant", &gen.text));
                save(&session, &messages)?;
            }
            Err(e) => {
                messages.pop();
                eprintln!("error: {e} (use /reset to start over)");
            }
        }
    }
}

fn routing(a: RoutingArgs) -> Result<ExitCode> {
    let engine = load(&model_dir(&a.model)?)?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("cannot read {}", a.text.display()))?;
    if a.chunk < 2 || a.chunk > engine.spec.max_position_embeddings {
        bail!("--chunk must be between 2 and the model's context ({})", engine.spec.max_position_embeddings);
    }
    let ids = engine.tokenizer.encode(&text, false)?;
    let ids = &ids[..ids.len().min(a.max_tokens)];
    if ids.len() < 2 {
        bail!("{}: the text is too short to analyse", a.text.display());
    }
    let mut analysis = crate::routing::RoutingAnalysis::new(&engine.spec);
    for chunk in ids.chunks(a.chunk) {
        analysis.start_sequence();
        engine.observe(chunk, &mut analysis)?;
    }
    let report = analysis.report();
    let mut stdout = std::io::stdout().lock();
    if a.json {
        writeln!(stdout, "{}", json!({"tokens": ids.len(), "experts": engine.spec.moe.num_experts, "top_k": engine.spec.moe.top_k, "layers": report}))?;
    } else {
        writeln!(stdout, "{} tokens, {} experts, top-{}", ids.len(), engine.spec.moe.num_experts, engine.spec.moe.top_k)?;
        writeln!(stdout, "layer\tentropy (bits, max)\thottest 10%\tcoldest 50%\tnext-layer recall@k\tconsecutive overlap")?;
        for r in &report {
            let recall = r.next_layer_recall.map_or("-".to_string(), |x| format!("{:.3}", x));
            writeln!(
                stdout,
                "{}\t{:.2} ({:.2})\t{:.3}\t{:.3}\t{}\t{:.3}",
                r.layer, r.entropy_bits, r.max_entropy_bits, r.hottest_10pct_share, r.coldest_half_share, recall, r.consecutive_overlap
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn trace_analyze(a: TraceAnalyzeArgs) -> Result<ExitCode> {
    let trace = shimmer_common::trace::Trace::read(&a.file)?;
    if trace.tokens.is_empty() {
        bail!("{}: the trace holds no complete token", a.file.display());
    }
    let layers = trace.header.layers.len();
    let capacity = match (a.capacity_experts, a.ram_gb, &a.model) {
        (Some(n), _, _) => n,
        (None, Some(gb), Some(dir)) => {
            if !(gb.is_finite() && gb > 0.0) {
                bail!("--ram-gb must be a positive number of GB");
            }
            let spec = shimmer_common::ModelSpec::from_dir(dir)?;
            let expert_bytes = shimmer_store::expert_bytes_of(dir, &spec)?;
            ((gb * 1e9) as u64 / expert_bytes.max(1)) as usize
        }
        _ => bail!("give --capacity-experts, or --ram-gb with --model"),
    };
    if capacity < layers {
        bail!("a capacity of {capacity} experts is less than one expert per MoE layer ({layers} layers)");
    }
    if trace.dropped_bytes > 0 {
        eprintln!("shimmer: {}: ignored a partial last record ({} bytes)", a.file.display(), trace.dropped_bytes);
    }
    let all = layers * trace.header.experts as usize;
    let r = shimmer_store::trace_analysis::analyze(&trace, capacity.min(all));
    let mut stdout = std::io::stdout().lock();
    if a.json {
        writeln!(stdout, "{}", serde_json::to_string(&r)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        stdout,
        "{} tokens, {} MoE layers × {} experts, top-{}; capacity {} experts ({} per layer)",
        r.tokens, r.moe_layers, r.experts, r.top_k, r.capacity_experts, r.slots_per_layer
    )?;
    write!(stdout, "policy")?;
    for l in 0..r.moe_layers {
        write!(stdout, "\tL{l}")?;
    }
    writeln!(stdout, "\toverall\tprefetch reads")?;
    for p in &r.policies {
        write!(stdout, "{}", p.policy)?;
        for h in &p.per_layer {
            write!(stdout, "\t{:.3}", h)?;
        }
        writeln!(stdout, "\t{:.3}\t{}", p.hit_rate, p.prefetch_reads)?;
    }
    write!(stdout, "hottest 10%")?;
    for h in &r.hottest_10pct_share {
        write!(stdout, "\t{:.3}", h)?;
    }
    writeln!(stdout)?;
    write!(stdout, "next-layer recall")?;
    for h in &r.next_layer_recall {
        match h {
            Some(x) => write!(stdout, "\t{:.3}", x)?,
            None => write!(stdout, "\t-")?,
        }
    }
    writeln!(stdout)?;
    Ok(ExitCode::SUCCESS)
}

fn quant_eval(a: QuantEvalArgs) -> Result<ExitCode> {
    let dir = model_dir(&a.model)?;
    let schemes = a
        .quant
        .iter()
        .filter(|q| q.as_str() != "none")
        .map(|q| shimmer_common::quant::QuantScheme::parse(q).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let reference = load(&dir)?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("cannot read {}", a.text.display()))?;
    if a.chunk < 2 || a.chunk > reference.spec.max_position_embeddings {
        bail!("--chunk must be between 2 and the model's context ({})", reference.spec.max_position_embeddings);
    }
    let ids = reference.tokenizer.encode(&text, false)?;
    let ids = &ids[..ids.len().min(a.max_tokens)];
    let v = reference.spec.vocab_size;
    let reference_logits: Vec<Vec<f32>> = ids.chunks(a.chunk).filter(|c| c.len() > 1).map(|c| reference.logits_all(c)).collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut candidates: Vec<(String, Engine)> = Vec::new();
    for scheme in schemes {
        // The experts quantised in memory: a measurement of the format, never the serving path.
        let model = ModelDir::open(&dir)?;
        let experts = model.in_process_experts(scheme)?;
        let (dense, _) = model.dense()?;
        candidates.push((scheme.name(), Engine::new(&model, dense, crate::engine::Experts::InProcess(Box::new(experts)))?));
    }
    for c in &a.candidate {
        let engine = Engine::load(c).with_context(|| format!("cannot load model {}", c.display()))?;
        if engine.spec.vocab_size != v {
            bail!("{}: vocabulary {} differs from the reference's {v}", c.display(), engine.spec.vocab_size);
        }
        candidates.push((c.display().to_string(), engine));
    }
    for (label, q) in candidates {
        let (mut kl, mut agree, mut n) = (0.0f64, 0usize, 0usize);
        for (chunk, want) in ids.chunks(a.chunk).filter(|c| c.len() > 1).zip(&reference_logits) {
            let got = q.logits_all(chunk)?;
            for (p_row, q_row) in want.chunks_exact(v).zip(got.chunks_exact(v)) {
                kl += kl_divergence(p_row, q_row);
                agree += (crate::sampling::argmax(p_row) == crate::sampling::argmax(q_row)) as usize;
                n += 1;
            }
        }
        rows.push(json!({"quant": label, "positions": n, "mean_kl_nats": kl / n as f64, "top1_agreement": agree as f64 / n as f64}));
    }
    let mut stdout = std::io::stdout().lock();
    if a.json {
        writeln!(stdout, "{}", json!({"tokens": ids.len(), "formats": rows}))?;
    } else {
        writeln!(
            stdout,
            "{} tokens; formats: experts quantised in memory, dense as stored; candidates: as loaded\nformat\tmean KL (nats)\ttop-1 agreement",
            ids.len()
        )?;
        for r in &rows {
            writeln!(
                stdout,
                "{}\t{:.5}\t{:.4}",
                r["quant"].as_str().unwrap_or(""),
                r["mean_kl_nats"].as_f64().unwrap_or(0.0),
                r["top1_agreement"].as_f64().unwrap_or(0.0)
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// KL(p ‖ q) in nats between the softmax distributions of two logit rows.
fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let lse = |row: &[f32]| {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        row.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln() + m
    };
    let (lp, lq) = (lse(p_logits), lse(q_logits));
    p_logits
        .iter()
        .zip(q_logits)
        .map(|(a, b)| {
            let lpa = *a as f64 - lp;
            lpa.exp() * (lpa - (*b as f64 - lq))
        })
        .sum()
}

fn convert(a: ConvertArgs) -> Result<ExitCode> {
    use shimmer_store::convert::{ConvertEvent, ConvertOptions, DenseQuant};
    let expert_quant = shimmer_common::quant::QuantScheme::parse(&a.quant).map_err(|e| anyhow::anyhow!("--quant: {e}"))?;
    let dense_quant = DenseQuant::parse(&a.dense_quant).map_err(|e| anyhow::anyhow!("--dense-quant: {e}"))?;
    let bar = if a.quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(0) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>14} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .map_err(|e| anyhow::anyhow!("progress bar template: {e}"))?
            .progress_chars("=> "),
    );
    let report = shimmer_store::convert::convert(&a.from, &a.to, ConvertOptions { expert_quant, dense_quant }, &mut |ev| match ev {
        ConvertEvent::Start { total_bytes, done_bytes } => {
            bar.set_length(total_bytes);
            bar.set_position(done_bytes);
            bar.reset_eta();
        }
        ConvertEvent::Phase(p) => bar.set_message(p.to_string()),
        ConvertEvent::Advance(n) => bar.inc(n),
    })
    .with_context(|| format!("cannot convert {} into {}", a.from.display(), a.to.display()))?;
    bar.finish_and_clear();
    if report.already_done {
        eprintln!("shimmer: {} already holds this conversion ({} experts); nothing to do", a.to.display(), report.blobs);
    } else {
        eprintln!(
            "shimmer: wrote {}: {} experts as {} ({:.1} MB{}), dense weights as {} ({:.1} MB)",
            a.to.display(),
            report.blobs,
            expert_quant.name(),
            report.experts_bytes as f64 / 1e6,
            if report.resumed_blobs > 0 { format!(", {} kept from the interrupted run", report.resumed_blobs) } else { String::new() },
            dense_quant.name(),
            report.dense_bytes as f64 / 1e6
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn bench(a: BenchArgs) -> Result<ExitCode> {
    if let Some(t) = a.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().context("cannot set up the thread pool")?;
    }
    let dir = model_dir(&a.model)?;
    let text = match &a.text {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?),
        None => None,
    };
    let r = crate::bench::run(
        &dir,
        &a.store.options()?,
        &crate::bench::BenchOptions { prompt_tokens: a.prompt_tokens, gen_tokens: a.gen_tokens, probe_mb: a.disk_probe_mb, text, preload: a.preload },
    )?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "machine  {} cores, {} threads, {} kernels, memory {:.1} GB/s (copy)",
        r.machine.cores, r.machine.threads, r.machine.isa, r.machine.memory_gb_s
    )?;
    writeln!(out, "model {} (experts {})", r.model, r.experts_format)?;
    writeln!(out, "prefill  {} tokens  {:.1} ms  {:.1} tok/s", r.prompt_tokens, r.prefill_ms, r.prefill_tok_s)?;
    writeln!(
        out,
        "decode   {} tokens  {:.1} ms  {:.2} tok/s  (TTFT {:.1} ms, peak RSS {:.0} MB)",
        r.gen_tokens,
        r.decode_ms,
        r.decode_tok_s,
        r.ttft_ms,
        r.peak_rss_bytes.unwrap_or(0) as f64 / 1e6
    )?;
    writeln!(
        out,
        "roofline {:.1} MB read per token → {:.1} tok/s at the measured bandwidth; decode reached {:.3} of it",
        r.active_bytes_per_token as f64 / 1e6,
        r.roofline_tok_s,
        r.fraction_of_roofline
    )?;
    if let Some(t) = &r.store {
        writeln!(
            out,
            "store    {:.4} GB budget, {} experts ({} per layer, {} pinned), decode hit rate {:.3}",
            t.budget_bytes as f64 / 1e9,
            t.capacity_experts,
            t.slots_per_layer,
            t.pinned_experts,
            r.decode_hit_rate
        )?;
        writeln!(
            out,
            "reads    {:.2} MB per decoded token; decode waited on I/O {:.1}% of its time; prefetch {} issued / {} used",
            r.decode_read_bytes_per_token / 1e6,
            r.decode_io_wait_fraction * 100.0,
            t.prefetch_issued,
            t.prefetch_useful
        )?;
    }
    if let Some(d) = r.disk_gb_s_at_depth {
        writeln!(
            out,
            "disk     {:.2} GB/s with {} reads in flight, {:.2} GB/s one at a time (O_DIRECT, whole blobs)",
            d,
            r.io_depth,
            r.disk_gb_s_depth1.unwrap_or(0.0)
        )?;
    }
    if let (Some(limit), Some(frac)) = (r.disk_limit_tok_s, r.fraction_of_disk_limit) {
        writeln!(out, "limit    {:.2} tok/s if decode only waited for the disk; achieved {:.3} of it", limit, frac)?;
    }
    for (policy, rate) in &r.replay {
        writeln!(out, "replay   {policy:<22} {rate:.3}")?;
    }
    Ok(ExitCode::SUCCESS)
}
