//! `shimmer worker`: serve this machine's routed experts to coordinators over QUIC.

use super::*;

#[derive(Args)]
pub(super) struct WorkerArgs {
    /// A checkpoint directory or container (default: the bundled demo model).
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// The UDP address to listen on (port 0: any free port; the chosen one is printed).
    #[arg(long, default_value = "0.0.0.0:7070")]
    pub(super) listen: String,
    #[command(flatten)]
    pub(super) auth: ClusterAuthArgs,
    /// The placement this worker serves a slice of: its assigned experts are pinned and read at
    /// start (within --ram-gb); others it is asked for are read from its own disk on demand.
    #[arg(long, value_name = "FILE")]
    pub(super) placement: Option<PathBuf>,
    /// This worker's name in the placement (default: the worker whose address is --listen; with
    /// --listen on 0.0.0.0, the only one on its port at an address of this machine).
    #[arg(long, requires = "placement")]
    pub(super) name: Option<String>,
    /// Serve only the experts the placement assigns this worker (refuse failover for others).
    #[arg(long, requires = "placement")]
    pub(super) assigned_only: bool,
    /// The placement epoch this worker serves (default: the placement's, else 1).
    #[arg(long)]
    pub(super) epoch: Option<u64>,
    /// How this worker holds its experts: its RAM budget, O_DIRECT, a mirror, prefetch, routing
    /// heat — the same flags as every verb that runs a model.
    #[command(flatten)]
    pub(super) store: StoreArgs,
}

pub(super) fn worker(a: WorkerArgs) -> Result<ExitCode> {
    let dir = model_dir(&a.model)?;
    let creds = a.auth.credentials()?;
    let listen: std::net::SocketAddr = a.listen.parse().with_context(|| format!("--listen: `{}` is not an address:port", a.listen))?;
    let placement = a.placement.as_deref().map(crate::node::PlacementFile::read).transpose()?;
    // Which worker of the placement this is, said in terms of the flags.
    let name = match &placement {
        Some(pf) => Some(match &a.name {
            Some(n) => pf
                .placement
                .workers
                .iter()
                .find(|w| &w.name == n)
                .map(|w| w.name.clone())
                .with_context(|| format!("--name {n}: {} has no such worker", pf.path.display()))?,
            None => crate::node::worker_in_placement(&pf.placement, listen)
                .map_err(|e| anyhow::anyhow!("{e}"))
                .with_context(|| format!("{}: say which worker this is with --name", pf.path.display()))?,
        }),
        None => None,
    };
    let opts = crate::node::WorkerOptions { listen, creds, placement, name, assigned_only: a.assigned_only, epoch: a.epoch, store: a.store.options()? };
    let worker = crate::node::Worker::start(&dir, opts).with_context(|| format!("cannot serve the experts of {}", dir.display()))?;
    let (status, epoch) = (&worker.status, worker.epoch);
    // Tests and scripts wait for this line.
    eprintln!("shimmer: worker serving {} on {} (QUIC, ALPN shimmer/1)", dir.display(), worker.local_addr);
    eprintln!(
        "shimmer: worker {}: {} experts assigned{}, RAM for {} experts of {:.1} MB ({:.3} GB), epoch {epoch}",
        if status.name.is_empty() { "(no placement)" } else { &status.name },
        status.assigned_experts,
        if a.assigned_only { " (serves only those)" } else { ", loads others from its disk on demand" },
        status.capacity_experts,
        status.expert_bytes as f64 / 1e6,
        status.budget_bytes as f64 / 1e9,
    );
    worker.serve_until_signal();
    eprintln!("shimmer: worker stopping");
    Ok(ExitCode::SUCCESS)
}
