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
    use shimmer_cluster::placement::Placement;
    let dir = model_dir(&a.model)?;
    let creds = a.auth.credentials()?;
    let addr: std::net::SocketAddr = a.listen.parse().with_context(|| format!("--listen: `{}` is not an address:port", a.listen))?;
    let spec = shimmer_common::ModelSpec::from_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let moe: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    // This worker's slice of the placement: its name, what it holds, what it pins.
    let placement = a.placement.as_ref().map(|p| Placement::read(p)).transpose()?;
    let slice = match (&a.placement, &placement) {
        (Some(path), Some(p)) => {
            let name = match &a.name {
                Some(n) => p
                    .workers
                    .iter()
                    .find(|w| &w.name == n)
                    .map(|w| w.name.clone())
                    .with_context(|| format!("--name {n}: {} has no such worker", path.display()))?,
                None => worker_in_placement(p, addr).with_context(|| format!("{}: say which worker this is with --name", path.display()))?,
            };
            let slice = p.slice(&name, &moe).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            Some((name, p.epoch, slice))
        }
        _ => None,
    };
    let opts = ExpertOptions { assigned: slice.as_ref().map(|s| s.2.pins.clone()), ..a.store.options()? };
    let model = ModelDir::open(&dir).with_context(|| format!("cannot open the experts of {}", dir.display()))?;
    // A worker holds no dense weights: an `auto` budget may take all but the reserve.
    let store = model.expert_store(&opts, 0).with_context(|| format!("cannot open the experts of {}", dir.display()))?;
    let (spec, fingerprint) = (model.spec.clone(), model.fingerprint.clone());
    if let (Some(path), Some(p)) = (&a.placement, &placement) {
        p.validate(&fingerprint, &moe, spec.moe.num_experts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    let epoch = a.epoch.or(slice.as_ref().map(|s| s.1)).unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("worker-net").enable_all().build()?;
    rt.block_on(async move {
        let endpoint = shimmer_worker::transport::server(addr, &creds)?;
        let local = endpoint.local_addr()?;
        let mut state = shimmer_worker::server::WorkerState::serving_store(
            std::sync::Arc::new(store),
            shimmer_cluster::model_id(&fingerprint),
            epoch,
            creds,
            spec.hidden_size,
        );
        if let Some((name, _, slice)) = slice {
            state.name = name;
            state.assigned = Some(slice.assigned);
            state.assigned_only = a.assigned_only;
        }
        let status = state.status();
        let state = std::sync::Arc::new(state);
        // Tests and scripts wait for this line.
        eprintln!("shimmer: worker serving {} on {local} (QUIC, ALPN shimmer/1)", dir.display());
        eprintln!(
            "shimmer: worker {}: {} experts assigned{}, RAM for {} experts of {:.1} MB ({:.3} GB), epoch {epoch}",
            if status.name.is_empty() { "(no placement)" } else { &status.name },
            status.assigned_experts,
            if a.assigned_only { " (serves only those)" } else { ", loads others from its disk on demand" },
            status.capacity_experts,
            status.expert_bytes as f64 / 1e6,
            status.budget_bytes as f64 / 1e9,
        );
        tokio::select! {
            _ = shimmer_worker::server::serve(endpoint, state) => {},
            _ = tokio::signal::ctrl_c() => eprintln!("shimmer: worker stopping"),
        }
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The placement's worker this one is: the one whose address is `listen`; else, listening on
/// every interface, the only one on its port whose IP address is this machine's (one it can bind).
pub(super) fn worker_in_placement(p: &shimmer_cluster::placement::Placement, listen: std::net::SocketAddr) -> Result<String> {
    if let Some(w) = p.workers.iter().find(|w| w.addr.parse::<std::net::SocketAddr>().ok() == Some(listen)) {
        return Ok(w.name.clone());
    }
    if !listen.ip().is_unspecified() {
        bail!("no worker of the placement has the address {listen}");
    }
    let mine: Vec<_> = p
        .workers
        .iter()
        .filter(|w| w.addr.parse::<std::net::SocketAddr>().is_ok_and(|a| a.port() == listen.port() && std::net::UdpSocket::bind((a.ip(), 0)).is_ok()))
        .collect();
    match mine.as_slice() {
        [one] => Ok(one.name.clone()),
        [] => bail!("no worker of the placement is on port {} at an address of this machine", listen.port()),
        many => bail!(
            "{} workers of the placement are on port {} at addresses of this machine ({})",
            many.len(),
            listen.port(),
            many.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    }
}
