//! `shimmer score`: teacher-forced argmax and log-probabilities.

use super::*;

#[derive(Args)]
pub(super) struct ScoreArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// The token ids to score: 1,2,3
    #[arg(long, value_delimiter = ',', required = true)]
    pub(super) ids: Vec<u32>,
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    pub(super) store: ExpertArgs,
    /// Record every token's expert routing to FILE (see `shimmer trace analyze`).
    #[arg(long, value_name = "FILE")]
    pub(super) trace: Option<PathBuf>,
}

pub(super) fn score(a: ScoreArgs) -> Result<ExitCode> {
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
