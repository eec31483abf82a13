//! `shimmer convert`: a Hugging Face checkpoint into an expert container, or a llama.cpp GGUF
//! into a Hugging Face checkpoint (`shimmer_store::gguf_import`).

use super::*;

#[derive(Args)]
pub(super) struct ConvertArgs {
    /// The Hugging Face checkpoint directory (bf16/f16/f32, or fp8-e4m3 with 128×128 block
    /// scales), or a llama.cpp GGUF file (Qwen3-MoE, OLMoE, Mixtral) to import as a checkpoint.
    #[arg(long)]
    pub(super) from: PathBuf,
    /// The container directory to write (new or empty, or an interrupted conversion to resume);
    /// for a GGUF, the checkpoint directory (new or empty).
    #[arg(long)]
    pub(super) to: PathBuf,
    /// Routed experts' format: bf16, int8, int4-g32, int4-g64, int4-g128, mxfp4.
    #[arg(long)]
    pub(super) quant: Option<String>,
    /// Dense weights' format: bf16, int8, int4-g32/g64/g128 or int6-g32/g64/g128 (the layers'
    /// matrices; embedding and LM head int8).
    #[arg(long)]
    pub(super) dense_quant: Option<String>,
    /// The LM head's format where it should differ (the embedding's too where the model ties
    /// them): bf16, int8, int4-g32/g64/g128 or int6-g32/g64/g128 (llama.cpp's Q4_0 keeps a 6-bit
    /// head). Default: int8 with int8 or int4 dense weights, bf16 with bf16 (as llama-quantize's
    /// `--output-tensor-type`).
    #[arg(long)]
    pub(super) head_quant: Option<String>,
    /// A GGUF's tensors as: exact (F32/F16/BF16 kept, quantised types as f32, so every value is
    /// ggml's), or f32, f16, bf16 (rounded).
    #[arg(long)]
    pub(super) dtype: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub(super) quiet: bool,
}

/// Whether `path` is a GGUF file (by its magic, so a renamed file is still recognised).
pub(super) fn is_gguf(path: &std::path::Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file() && std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

fn progress_bar(quiet: bool) -> Result<indicatif::ProgressBar> {
    let bar = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(0) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>14} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .map_err(|e| anyhow::anyhow!("progress bar template: {e}"))?
            .progress_chars("=> "),
    );
    Ok(bar)
}

/// A GGUF file into a checkpoint directory; with `--quant`/`--dense-quant`/`--head-quant`, into a container in
/// one step: imported into a staging directory beside the target, converted, and the staging
/// directory removed.
fn import_gguf(a: ConvertArgs) -> Result<ExitCode> {
    use shimmer_store::gguf_import::{import, ImportDtype};
    let dtype = ImportDtype::parse(a.dtype.as_deref().unwrap_or("exact")).map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    let container = match (&a.quant, &a.dense_quant, &a.head_quant) {
        (None, None, None) => None,
        _ => Some(formats(&a)?),
    };
    let checkpoint = match &container {
        None => a.to.clone(),
        Some(_) => {
            // Checked before the import, which may take long: the conversion needs it empty.
            if std::fs::read_dir(&a.to).is_ok_and(|mut entries| entries.next().is_some()) {
                anyhow::bail!("{} is not empty: a GGUF is converted into a new or empty directory", a.to.display());
            }
            let name = a.to.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "container".into());
            let staging = a.to.with_file_name(format!("{name}.gguf-import"));
            if staging.exists() {
                anyhow::bail!("{} exists (left by an interrupted import of a GGUF into {}): delete it and run again", staging.display(), a.to.display());
            }
            staging
        }
    };
    let bar = progress_bar(a.quiet)?;
    bar.set_message("import");
    let report = import(&a.from, &checkpoint, dtype, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("cannot import {} into {}", a.from.display(), checkpoint.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "shimmer: wrote {} ({} checkpoint, from llama.cpp's `{}`: {} tensors, {:.1} MB in {} file{})",
        checkpoint.display(),
        report.family,
        report.architecture,
        report.tensors,
        report.bytes as f64 / 1e6,
        report.shards,
        if report.shards == 1 { "" } else { "s" }
    );
    if let Some(formats) = container {
        convert_checkpoint(&checkpoint, &a.to, formats, a.quiet)?;
        std::fs::remove_dir_all(&checkpoint).with_context(|| format!("cannot remove the staging directory {}", checkpoint.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `--quant`, `--dense-quant` and `--head-quant` parsed (bf16 where not given; the head as the
/// dense weights give it).
fn formats(a: &ConvertArgs) -> Result<shimmer_store::convert::ConvertOptions> {
    use shimmer_store::convert::DenseQuant;
    let expert_quant = shimmer_common::quant::QuantScheme::parse(a.quant.as_deref().unwrap_or("bf16")).map_err(|e| anyhow::anyhow!("--quant: {e}"))?;
    let dense_quant = DenseQuant::parse(a.dense_quant.as_deref().unwrap_or("bf16")).map_err(|e| anyhow::anyhow!("--dense-quant: {e}"))?;
    let head_quant = a.head_quant.as_deref().map(DenseQuant::parse).transpose().map_err(|e| anyhow::anyhow!("--head-quant: {e}"))?;
    Ok(shimmer_store::convert::ConvertOptions { expert_quant, dense_quant, head_quant })
}

pub(super) fn convert(a: ConvertArgs) -> Result<ExitCode> {
    if is_gguf(&a.from) {
        return import_gguf(a);
    }
    if a.dtype.is_some() {
        anyhow::bail!("--dtype applies to a GGUF import; {} is not a GGUF file", a.from.display());
    }
    convert_checkpoint(&a.from, &a.to, formats(&a)?, a.quiet)?;
    Ok(ExitCode::SUCCESS)
}

fn convert_checkpoint(from: &std::path::Path, to: &std::path::Path, options: shimmer_store::convert::ConvertOptions, quiet: bool) -> Result<()> {
    use shimmer_store::convert::ConvertEvent;
    let bar = progress_bar(quiet)?;
    let report = shimmer_store::convert::convert(from, to, options, &mut |ev| match ev {
        ConvertEvent::Start { total_bytes, done_bytes } => {
            bar.set_length(total_bytes);
            bar.set_position(done_bytes);
            bar.reset_eta();
        }
        ConvertEvent::Phase(p) => bar.set_message(p.to_string()),
        ConvertEvent::Advance(n) => bar.inc(n),
    })
    .with_context(|| format!("cannot convert {} into {}", from.display(), to.display()))?;
    bar.finish_and_clear();
    if report.already_done {
        eprintln!("shimmer: {} already holds this conversion ({} experts); nothing to do", to.display(), report.blobs);
    } else {
        eprintln!(
            "shimmer: wrote {}: {} experts as {} ({:.1} MB{}), dense weights as {} ({:.1} MB)",
            to.display(),
            report.blobs,
            options.expert_quant.name(),
            report.experts_bytes as f64 / 1e6,
            if report.resumed_blobs > 0 { format!(", {} kept from the interrupted run", report.resumed_blobs) } else { String::new() },
            options.dense_quant.manifest_name(options.head_quant),
            report.dense_bytes as f64 / 1e6
        );
    }
    Ok(())
}
