//! `shimmer routing`: expert-usage skew and next-layer predictability over a text.

use super::*;

#[derive(Args)]
pub(super) struct RoutingArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// A UTF-8 text file to route (e.g. held-out text).
    #[arg(long)]
    pub(super) text: PathBuf,
    /// Tokens per independent sequence (at most the model's context).
    #[arg(long, default_value_t = 256)]
    pub(super) chunk: usize,
    /// Stop after this many tokens.
    #[arg(long, default_value_t = 1 << 20)]
    pub(super) max_tokens: usize,
    #[arg(long)]
    pub(super) json: bool,
}

pub(super) fn routing(a: RoutingArgs) -> Result<ExitCode> {
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
