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
    /// --listen on 0.0.0.0, the only one on its port at an address of this machine), or in the
    /// cluster with --data-dir (default: --listen as given).
    #[arg(long)]
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
    #[command(flatten)]
    pub(super) member: MemberArgs,
    /// Join the cluster through any of these members: HOST:PORT of their control plane (the
    /// address of their --listen unless they set --control-listen), `mdns` (the members on this
    /// LAN), `dns:NAME[:PORT]` (every address NAME resolves to, e.g. a headless service).
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...", requires = "data_dir")]
    pub(super) join: Vec<String>,
    /// Where `/health`, `/ready` and `/metrics` listen (HTTP; default: --listen's host, port
    /// 7080; port 0 picks one).
    #[arg(long, value_name = "HOST:PORT")]
    pub(super) http_listen: Option<String>,
    /// Require this key (`Authorization: Bearer KEY`) on /metrics (also
    /// SHIMMER_METRICS_API_KEY); /health and /ready stay open for orchestrators' probes.
    #[arg(long, value_name = "KEY")]
    pub(super) metrics_api_key: Option<String>,
    /// On SIGTERM a member drains (its experts move to other workers, requests in flight finish)
    /// for at most this many seconds before it stops.
    #[arg(long, default_value_t = crate::node::DRAIN_WITHIN.as_secs_f64())]
    pub(super) drain_timeout_s: f64,
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
    if a.name.is_some() && a.placement.is_none() && a.member.data_dir.is_none() {
        bail!("--name names this worker in a --placement or in the cluster (--data-dir)");
    }
    if !(a.drain_timeout_s >= 0.0 && a.drain_timeout_s <= 86_400.0) {
        bail!("--drain-timeout-s must be in [0, 86400], got {}", a.drain_timeout_s);
    }
    if a.member.data_dir.is_some() && a.placement.is_some() {
        bail!("a cluster member (--data-dir) serves the cluster's placement, not a --placement file");
    }
    // A member is named --name, else --listen as given (as others reach it when that is every
    // interface), and advertises where others reach it.
    let member = match &a.member.data_dir {
        Some(_) => {
            let trust = a.member.trust(&a.auth)?;
            let data_addr = a.member.reachable(&a.listen).context("--listen")?;
            let control_addr = a.member.control_addr(&a.listen).context("--control-listen")?;
            // `reachable` is --listen as given unless that is every interface.
            let name = a.name.clone().unwrap_or_else(|| data_addr.clone());
            Some((trust, name, data_addr, control_addr))
        }
        None => None,
    };
    let opts = crate::node::WorkerOptions {
        listen,
        creds,
        placement,
        name,
        assigned_only: a.assigned_only,
        epoch: a.epoch,
        store: a.store.options(&dir)?,
        member: member.as_ref().map(|m| m.1.clone()),
    };
    let vram = opts.store.vram.clone();
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
    if let Some(t) = &vram {
        eprintln!("shimmer: worker VRAM tier: {:.3} GB for experts on {}", t.budget() as f64 / 1e9, t.device_name());
    }
    let stop_following = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let control = match member {
        Some((trust, name, data_addr, control_addr)) => {
            let me = shimmer_control::Member {
                name,
                kind: shimmer_control::NodeKind::Worker,
                control_addr,
                data_addr: Some(data_addr),
                capacity: shimmer_control::state::Capacity { vram: vram.as_ref().map_or(0, |t| t.budget()), ram: status.budget_bytes, disk: 0 },
                models: vec![shimmer_control::state::ModelOnDisk {
                    fingerprint: worker.fingerprint.clone(),
                    expert_bytes: status.expert_bytes,
                    shape: Some(worker.shape.clone()),
                }],
                draining: false,
            };
            let control = std::sync::Arc::new(a.member.start(me, &a.listen, &a.join, trust)?);
            if let Some(dir) = &a.member.data_dir {
                crate::node::undrain_after_restart(&control, &worker.state.name, dir);
            }
            worker.follow(control.clone(), stop_following.clone());
            Some(control)
        }
        None => None,
    };
    let http_listen = a.http_listen.clone().unwrap_or_else(|| {
        let host = a.listen.rsplit_once(':').map_or("0.0.0.0", |(h, _)| h);
        format!("{host}:{}", crate::node_http::DEFAULT_HTTP_PORT)
    });
    let metrics_key = super::metrics_api_key(&a.metrics_api_key)?;
    let http = crate::node_http::start(&worker.runtime(), &http_listen, worker.state.clone(), worker.fingerprint.clone(), control.clone(), metrics_key, vram)
        .map_err(|e| anyhow::anyhow!(e))?;
    eprintln!("shimmer: worker health, readiness and metrics on http://{http}");
    let why = worker.wait_for_signal_or(|| control.as_ref().is_some_and(|c| c.stopped()));
    if let (crate::node::Stopped::Terminated, Some(c), Some(dir)) = (why, &control, &a.member.data_dir) {
        eprintln!("shimmer: worker draining: its experts move to other workers first (Ctrl-C or SIGTERM again stops at once)");
        let within = std::time::Duration::from_secs_f64(a.drain_timeout_s);
        match crate::node::drain(&worker, c, dir, within) {
            crate::node::DrainOutcome::Moved => eprintln!("shimmer: worker drained: no placement names it"),
            crate::node::DrainOutcome::Cut(why) => eprintln!("shimmer: worker stopping before it drained: {why}"),
        }
    }
    let failed = why == crate::node::Stopped::Failed;
    worker.stop();
    eprintln!("shimmer: worker stopping");
    stop_following.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(c) = control {
        c.stop().context("the control plane failed")?;
    }
    if failed {
        bail!("the control plane stopped");
    }
    Ok(ExitCode::SUCCESS)
}
