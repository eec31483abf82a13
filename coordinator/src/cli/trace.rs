//! `shimmer trace analyze`: replay a routing trace through the cache policies and Belady.

use super::*;

#[derive(Subcommand)]
pub(super) enum TraceCommand {
    /// Replay a trace through the cache policies at one capacity: hit rates against Belady's optimum.
    Analyze(TraceAnalyzeArgs),
}

#[derive(Args)]
pub(super) struct TraceAnalyzeArgs {
    /// A trace written by --trace.
    pub(super) file: PathBuf,
    /// Experts the cache holds, across all MoE layers (split evenly per layer).
    #[arg(long, required_unless_present = "ram_gb", conflicts_with = "ram_gb")]
    pub(super) capacity_experts: Option<usize>,
    /// Or a RAM budget in GB, turned into experts with --model's expert size.
    #[arg(long, requires = "model")]
    pub(super) ram_gb: Option<f64>,
    /// The model (container or checkpoint) the trace was recorded on, for --ram-gb.
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    #[arg(long)]
    pub(super) json: bool,
}

pub(super) fn trace_analyze(a: TraceAnalyzeArgs) -> Result<ExitCode> {
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
