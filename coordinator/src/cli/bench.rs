//! `shimmer bench`: prefill and decode speed under a placement, against the disk and Belady.

use super::*;

#[derive(Args)]
pub(super) struct BenchArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub(super) prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    pub(super) gen_tokens: usize,
    /// A UTF-8 text the prompt and the decoded tokens are taken from (default: a built-in
    /// passage). Decode steps feed the text's next tokens, one per step.
    #[arg(long)]
    pub(super) text: Option<PathBuf>,
    /// Read every expert the budget holds before timing (to benchmark a resident model, as
    /// llama-bench does after its warm-up).
    #[arg(long)]
    pub(super) preload: bool,
    /// Run the prompt and the decode steps this many times on a throwaway sequence before timing
    /// (llama-bench's warm-up run); 0 keeps a streaming run cold. At most 16.
    #[arg(long, default_value_t = 0)]
    pub(super) warmup: usize,
    /// Timed runs of the prompt and decode steps, each on a fresh sequence (llama-bench's `-r`);
    /// speeds are their medians, every run's in the JSON (`prefill_tok_s_runs`,
    /// `decode_tok_s_runs`). 1 to 64.
    #[arg(long, default_value_t = 1)]
    pub(super) repetitions: usize,
    /// How much of the experts file the disk-bandwidth probe reads (MB, 10^6 bytes).
    #[arg(long, default_value_t = 1024)]
    pub(super) disk_probe_mb: u64,
    /// Also decode this many sequences together and report their aggregate speed (as
    /// llama-batched-bench's `-npl`); 0: not measured.
    #[arg(long, default_value_t = 0)]
    pub(super) parallel: usize,
    #[command(flatten)]
    pub(super) store: StoreArgs,
    #[arg(long)]
    pub(super) json: bool,
}

pub(super) fn bench(a: BenchArgs) -> Result<ExitCode> {
    // Each sequence holds a whole KV cache: bounded before any is allocated.
    if a.parallel > 256 {
        bail!("--parallel must be at most 256 sequences (got {})", a.parallel);
    }
    if a.warmup > 16 {
        bail!("--warmup must be at most 16 runs (got {})", a.warmup);
    }
    if !(1..=64).contains(&a.repetitions) {
        bail!("--repetitions must be 1 to 64 timed runs (got {})", a.repetitions);
    }
    let dir = model_dir(&a.model)?;
    let store = a.store.options(&dir)?;
    let text = match &a.text {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?),
        None => None,
    };
    let r = crate::bench::run(
        &dir,
        &store,
        &crate::bench::BenchOptions {
            prompt_tokens: a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            probe_mb: a.disk_probe_mb,
            text,
            preload: a.preload,
            warmup: a.warmup,
            parallel: a.parallel,
            repetitions: a.repetitions,
        },
    )?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "machine  {} cores, {} threads, {} kernels ({} integer, {} for one row), memory {:.1} GB/s (copy), {:.1} GB/s (read)",
        r.machine.cores, r.machine.threads, r.machine.isa, r.machine.int_isa, r.machine.int_isa_one_row, r.machine.memory_gb_s, r.machine.memory_read_gb_s
    )?;
    writeln!(out, "model {} (experts {})", r.model, r.experts_format)?;
    writeln!(out, "prefill  {} tokens  {:.1} ms  {:.1} tok/s", r.prompt_tokens, r.prefill_ms, r.prefill_tok_s)?;
    if r.prefill_tok_s_runs.len() > 1 {
        let spread = |v: &[f64]| v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" ");
        writeln!(
            out,
            "runs     {} (medians above); prefill tok/s {}; decode tok/s {}",
            r.prefill_tok_s_runs.len(),
            spread(&r.prefill_tok_s_runs),
            spread(&r.decode_tok_s_runs)
        )?;
    }
    writeln!(
        out,
        "decode   {} tokens  {:.1} ms  {:.2} tok/s  (TTFT {:.1} ms, peak RSS {:.0} MB)",
        r.gen_tokens,
        r.decode_ms,
        r.decode_tok_s,
        r.ttft_ms,
        r.peak_rss_bytes.unwrap_or(0) as f64 / 1e6
    )?;
    if let Some(b) = &r.batched {
        writeln!(out, "batched  {} sequences: prefill {:.1} tok/s, decode {:.2} tok/s (all sequences)", b.sequences, b.prefill_tok_s, b.decode_tok_s)?;
    }
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
            "reads    {:.2} MB per decoded token ({:.2} MB of them unused prefetches); decode waited on I/O {:.1}% of its time, reads were in flight {:.1}% of it at {:.2} GB/s; prefetch {} issued / {} used",
            r.decode_read_bytes_per_token / 1e6,
            r.decode_unused_prefetch_bytes_per_token / 1e6,
            r.decode_io_wait_fraction * 100.0,
            r.decode_disk_busy_fraction * 100.0,
            r.decode_read_gb_s_while_busy,
            t.prefetch_issued,
            t.prefetch_useful
        )?;
    }
    if let Some(d) = r.disk_gb_s_at_depth {
        writeln!(
            out,
            "disk     {:.2} GB/s with {} reads in flight (threads {}, io_uring {}), {:.2} GB/s one at a time (O_DIRECT, whole blobs); the store read with {}",
            d,
            r.io_depth,
            r.disk_gb_s_threads.map_or("-".to_string(), |g| format!("{g:.2}")),
            r.disk_gb_s_ring.map_or("-".to_string(), |g| format!("{g:.2}")),
            r.disk_gb_s_depth1.unwrap_or(0.0),
            r.io_engine
        )?;
    }
    if let (Some(limit), Some(frac)) = (r.disk_limit_tok_s, r.fraction_of_disk_limit) {
        writeln!(out, "limit    {:.2} tok/s if decode only waited for the disk's needed reads; achieved {:.3} of it", limit, frac)?;
    }
    for (policy, rate) in &r.replay {
        writeln!(out, "replay   {policy:<22} {rate:.3}")?;
    }
    Ok(ExitCode::SUCCESS)
}
