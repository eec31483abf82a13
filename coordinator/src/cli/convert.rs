//! `shimmer convert`: a Hugging Face checkpoint into an expert container.

use super::*;

#[derive(Args)]
pub(super) struct ConvertArgs {
    /// The Hugging Face checkpoint directory (bf16/f16/f32, or fp8-e4m3 with 128×128 block scales).
    #[arg(long)]
    pub(super) from: PathBuf,
    /// The container directory to write (new or empty, or an interrupted conversion to resume).
    #[arg(long)]
    pub(super) to: PathBuf,
    /// Routed experts' format: bf16, int8, int4-g32, int4-g64, int4-g128, mxfp4.
    #[arg(long, default_value = "bf16")]
    pub(super) quant: String,
    /// Dense weights' format: bf16 or int8.
    #[arg(long, default_value = "bf16")]
    pub(super) dense_quant: String,
    /// No progress bar.
    #[arg(long)]
    pub(super) quiet: bool,
}

pub(super) fn convert(a: ConvertArgs) -> Result<ExitCode> {
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
