//! `shimmer tune --model DIR`: measures what runs this model best on this machine — decode speed
//! at each thread count, the container's read bandwidth at each queue depth, the memory the
//! experts may take — and writes the choices to `shimmer-tune.json` beside the model, which every
//! verb that runs the model reads under its flags (`tune_file.rs`). colibri's `tune`.
//!
//! Must never: write anything but the tune file (through a temporary beside it), or keep a
//! choice outside the bounds of its flag.

use std::io::Write as _;

use crate::tune_file::{Measured, TuneFile, FILE_NAME, MAX_THREADS, VERSION};

use super::*;

#[derive(Args)]
pub(super) struct TuneArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens decoded per measurement.
    #[arg(long, default_value_t = 16)]
    gen_tokens: usize,
    /// How much of the container's expert file the disk measurement reads (MB, 10^6 bytes).
    #[arg(long, default_value_t = 256)]
    disk_probe_mb: u64,
    /// Where to write the choices (default: shimmer-tune.json beside the model, where the other
    /// verbs look).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

pub(super) fn tune(a: TuneArgs) -> Result<ExitCode> {
    if a.gen_tokens == 0 || a.gen_tokens > 4096 {
        bail!("--gen-tokens must be between 1 and 4096 (got {})", a.gen_tokens);
    }
    if a.disk_probe_mb > 65_536 {
        bail!("--disk-probe-mb must be at most 65536 (got {})", a.disk_probe_mb);
    }
    let dir = model_dir(&a.model)?;
    let out_path = a.out.clone().unwrap_or_else(|| TuneFile::path_beside(&dir));
    let model = crate::model_dir::ModelDir::open(&dir).with_context(|| format!("cannot open model {}", dir.display()))?;
    let (experts_bytes, dense_bytes) = model.sizes().with_context(|| format!("cannot size model {}", dir.display()))?;
    let available = crate::model_dir::proc_kb_field("/proc/meminfo", "MemAvailable");
    // The expert memory: nothing to choose when all experts fit beside the dense weights with a
    // reserve (a checkpoint keeps them in memory, a container's `auto` holds them all); else what
    // is available now less those (the `auto` budget, fixed at this measurement).
    let expert_ram = available.map(|m| m.saturating_sub(dense_bytes).saturating_sub(crate::model_dir::AUTO_RESERVE_BYTES));
    let ram_gb = expert_ram.filter(|b| *b > 0 && *b < experts_bytes).map(|b| (b as f64 / 1e9 * 1000.0).floor() / 1000.0).filter(|g| *g > 0.0);

    // Threads: powers of two up to the cores, and the core count itself.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
    let mut candidates: Vec<usize> = std::iter::successors(Some(1usize), |t| Some(t * 2)).take_while(|t| *t <= cores).collect();
    if candidates.last() != Some(&cores) {
        candidates.push(cores);
    }
    // No routing heat learned or written: tune writes nothing but its file.
    let opts = ExpertOptions { ram: ram_gb.map(RamBudget::Gb), usage: UsageFile::Off, ..ExpertOptions::default() };
    let bench = crate::bench::BenchOptions {
        prompt_tokens: 16,
        gen_tokens: a.gen_tokens,
        probe_mb: 1,
        text: None,
        preload: true,
        warmup: 0,
        parallel: 0,
        repetitions: 1,
    };
    let mut by_threads = Vec::new();
    for &t in &candidates {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().context("cannot set up a thread pool")?;
        let r = pool.install(|| crate::bench::run(&dir, &opts, &bench)).with_context(|| format!("cannot run {} with {t} threads", dir.display()))?;
        if !a.json {
            eprintln!("shimmer tune: {t} threads: {:.2} tok/s", r.decode_tok_s);
        }
        by_threads.push((t, r.decode_tok_s));
    }
    // The fewest threads within 3 % of the fastest: more threads than pay only contend.
    let threads = super::doctor::first_within(&by_threads, 0.97);

    let mut by_depth = Vec::new();
    if let Some((path, blobs)) = model.expert_blobs() {
        let blobs = shimmer_store::probe::shuffled_within(blobs, a.disk_probe_mb * 1_000_000);
        let direct = shimmer_store::probe::read_bandwidth(&path, &blobs[..blobs.len().min(1)], 1, true).is_ok();
        for depth in super::doctor::DEPTHS {
            let gbs = shimmer_store::probe::read_bandwidth(&path, &blobs, depth, direct).with_context(|| format!("cannot read {}", path.display()))?;
            by_depth.push((depth, gbs / 1e9));
        }
    }
    let io_depth = super::doctor::first_within(&by_depth, 0.9);

    let file = TuneFile {
        version: VERSION,
        cpu: super::doctor::cpu_model(),
        threads,
        io_depth,
        ram_gb,
        measured: Measured { decode_tok_s_by_threads: by_threads, disk_gb_s_by_depth: by_depth, experts_bytes, dense_bytes, available_memory_bytes: available },
    };
    file.check().map_err(|e| anyhow::anyhow!("a measured choice is out of bounds: {e}"))?;
    file.write_to(&out_path).with_context(|| format!("cannot write {}", out_path.display()))?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&file)?)?;
    } else {
        let show = |v: Option<String>| v.unwrap_or_else(|| "default".to_string());
        writeln!(
            out,
            "threads {}, io depth {}, ram {} GB → {}{}",
            show(file.threads.map(|t| t.to_string())),
            show(file.io_depth.map(|d| d.to_string())),
            show(file.ram_gb.map(|g| format!("{g:.3}"))),
            out_path.display(),
            if a.out.is_some() { format!(" (the other verbs read {FILE_NAME} beside the model)") } else { String::new() }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
