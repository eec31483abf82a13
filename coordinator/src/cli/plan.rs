//! `shimmer plan`: place the experts over workers from routing heat, and forecast each worker's load.

use super::*;

#[derive(Args)]
pub(super) struct PlanArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// The workers' addresses (host:port), comma-separated; each is also its name.
    #[arg(long, value_delimiter = ',', required = true)]
    pub(super) workers: Vec<String>,
    /// RAM each worker gives its expert cache, in GB (default: enough for all of its experts).
    #[arg(long)]
    pub(super) ram_gb_per_worker: Option<f64>,
    /// Copies of each of the hottest experts (see --replicate-fraction).
    #[arg(long, default_value_t = 1)]
    pub(super) replicas: usize,
    /// The fraction of each layer's experts, hottest first, that get --replicas copies (1: every
    /// expert, so that any --replicas - 1 workers can fail).
    #[arg(long, default_value_t = shimmer_cluster::placement::HOT_FRACTION)]
    pub(super) replicate_fraction: f64,
    /// Routing heat (default: shimmer-usage.json beside the model, if there is one; else uniform).
    #[arg(long)]
    pub(super) usage: Option<PathBuf>,
    /// Where to write the placement file.
    #[arg(long)]
    pub(super) out: PathBuf,
    /// The placement's epoch (default: one more than --out's, when it is a placement of this
    /// model; else 1).
    #[arg(long)]
    pub(super) epoch: Option<u64>,
    /// Print the forecast as JSON.
    #[arg(long)]
    pub(super) json: bool,
}

pub(super) fn plan(a: PlanArgs) -> Result<ExitCode> {
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
