//! `shimmer quant-eval`: quality of expert quantisation formats against the checkpoint's weights.

use super::*;

#[derive(Args)]
pub(super) struct QuantEvalArgs {
    /// A Hugging Face checkpoint directory (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// A UTF-8 text file (e.g. held-out text).
    #[arg(long)]
    pub(super) text: PathBuf,
    /// Formats to measure, comma-separated: int8, int4-g32, int4-g64, int4-g128, mxfp4 (`none`: only
    /// the --candidate models).
    #[arg(long, value_delimiter = ',', default_value = "int8,int4-g32,int4-g64,int4-g128,mxfp4")]
    pub(super) quant: Vec<String>,
    /// Also measure this model directory (e.g. a converted container, with int8 dense weights)
    /// against --model; repeatable.
    #[arg(long, value_name = "DIR")]
    pub(super) candidate: Vec<PathBuf>,
    /// Tokens per independent sequence.
    #[arg(long, default_value_t = 256)]
    pub(super) chunk: usize,
    /// Stop after this many tokens.
    #[arg(long, default_value_t = 16384)]
    pub(super) max_tokens: usize,
    /// The activations of the quantised experts' products: `int8` (what serving a container
    /// does), `f32` (the same weights against unquantised activations), or `both` — which also
    /// reports each format's int8 activations against its f32 ones.
    #[arg(long, default_value = "int8", value_parser = ["int8", "f32", "both"])]
    pub(super) activations: String,
    #[arg(long)]
    pub(super) json: bool,
}

pub(super) fn quant_eval(a: QuantEvalArgs) -> Result<ExitCode> {
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
    use shimmer_kernels::Activations;
    let kinds: &[(Activations, &str)] = match a.activations.as_str() {
        "f32" => &[(Activations::F32, "/f32-activations")],
        "both" => &[(Activations::Int8, ""), (Activations::F32, "/f32-activations")],
        _ => &[(Activations::Int8, "")],
    };
    // (label of the int8-activation run, label of the f32 one) per format, when both ran.
    let mut pairs = Vec::new();
    for scheme in schemes {
        for (activations, suffix) in kinds {
            // The experts quantised in memory: a measurement of the format, never the serving path.
            let model = ModelDir::open(&dir)?;
            let experts = model.in_process_experts(scheme, Some(*activations))?;
            let (dense, _) = model.dense()?;
            candidates.push((format!("{}{suffix}", scheme.name()), Engine::new(&model, dense, crate::engine::Experts::InProcess(Box::new(experts)))?));
        }
        if kinds.len() == 2 && scheme != shimmer_common::quant::QuantScheme::Bf16 {
            pairs.push((candidates.len() - 2, candidates.len() - 1));
        }
    }
    for c in &a.candidate {
        let engine = Engine::load(c).with_context(|| format!("cannot load model {}", c.display()))?;
        if engine.spec.vocab_size != v {
            bail!("{}: vocabulary {} differs from the reference's {v}", c.display(), engine.spec.vocab_size);
        }
        candidates.push((c.display().to_string(), engine));
    }
    let chunks: Vec<&[u32]> = ids.chunks(a.chunk).filter(|c| c.len() > 1).collect();
    let mut logits_of = Vec::with_capacity(candidates.len());
    for (label, q) in &candidates {
        let got: Vec<Vec<f32>> = chunks.iter().map(|c| q.logits_all(c)).collect::<Result<_, _>>()?;
        rows.push(compare(label, &reference_logits, &got, v));
        logits_of.push(got);
    }
    // What integer activations cost on their own: each format against itself on f32 activations.
    for (int8, f32a) in pairs {
        let label = format!("{} vs {}", candidates[int8].0, candidates[f32a].0);
        rows.push(compare(&label, &logits_of[f32a], &logits_of[int8], v));
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

/// Mean KL(reference ‖ candidate) and top-1 agreement over every position.
fn compare(label: &str, reference: &[Vec<f32>], candidate: &[Vec<f32>], v: usize) -> serde_json::Value {
    let (mut kl, mut agree, mut n) = (0.0f64, 0usize, 0usize);
    for (want, got) in reference.iter().zip(candidate) {
        for (p_row, q_row) in want.chunks_exact(v).zip(got.chunks_exact(v)) {
            kl += kl_divergence(p_row, q_row);
            agree += (crate::sampling::argmax(p_row) == crate::sampling::argmax(q_row)) as usize;
            n += 1;
        }
    }
    json!({"quant": label, "positions": n, "mean_kl_nats": kl / n.max(1) as f64, "top1_agreement": agree as f64 / n.max(1) as f64})
}

/// KL(p ‖ q) in nats between the softmax distributions of two logit rows.
pub(super) fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
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
