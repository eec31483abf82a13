//! Starting a node from options — not flags: a worker (this machine's routed experts served over
//! QUIC), a coordinator (an engine whose experts are here or on a placement's workers, possibly
//! holding one worker's share itself: a node can be both). The `shimmer` verbs, the tests and
//! the container image's entrypoints all start nodes through here.
//!
//! Must never: parse a flag or print (the binary says what started, from what this returns);
//! serve for a placement it did not validate against the model.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shimmer_cluster::placement::Placement;
use shimmer_cluster::WorkerStatus;
use shimmer_common::spec::LayerMlp;
use shimmer_worker::server::WorkerState;
use shimmer_worker::transport::{Credentials, TransportError};
use shimmer_worker::{RemoteExperts, Timeouts};

use crate::engine::{Engine, EngineError, ExpertOptions, Experts};
use crate::model_dir::ModelDir;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Model(#[from] EngineError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A placement that does not fit the model or this node; `path` is the placement file.
    #[error("{}: {problem}", path.display())]
    Placement { path: PathBuf, problem: String },
    #[error("cannot start the network runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

fn placement_error(path: &Path, problem: impl Into<String>) -> NodeError {
    NodeError::Placement { path: path.to_path_buf(), problem: problem.into() }
}

fn moe_layers(model: &ModelDir) -> Vec<usize> {
    (0..model.spec.num_layers).filter(|l| model.spec.layers[*l] == LayerMlp::Moe).collect()
}

/// A placement file and what it says.
#[derive(Clone)]
pub struct PlacementFile {
    pub path: PathBuf,
    pub placement: Placement,
}

impl PlacementFile {
    pub fn read(path: &Path) -> Result<Self, NodeError> {
        Ok(PlacementFile { path: path.to_path_buf(), placement: Placement::read(path).map_err(EngineError::from)? })
    }
}

/// How a worker serves.
pub struct WorkerOptions {
    pub listen: SocketAddr,
    pub creds: Credentials,
    /// The placement it serves a slice of, if any.
    pub placement: Option<PlacementFile>,
    /// Its name in the placement (default: the worker whose address is `listen`).
    pub name: Option<String>,
    /// Refuse experts the placement gives others.
    pub assigned_only: bool,
    /// The placement epoch to serve (default: the placement's, else 1).
    pub epoch: Option<u64>,
    pub store: ExpertOptions,
}

/// A worker serving on a runtime of its own until dropped or `wait`ed out.
pub struct Worker {
    pub local_addr: SocketAddr,
    /// What it says about itself at start.
    pub status: WorkerStatus,
    pub epoch: u64,
    /// The model served (`shimmer_cluster::model_id` of its fingerprint).
    pub model_id: u64,
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
}

impl Worker {
    /// Opens the model's experts under `opts.store` (pinning the placement slice, if any), checks
    /// the placement against the model, and starts serving.
    pub fn start(dir: &Path, opts: WorkerOptions) -> Result<Worker, NodeError> {
        let model = ModelDir::open(dir)?;
        let moe = moe_layers(&model);
        let slice = match &opts.placement {
            Some(pf) => {
                let p = &pf.placement;
                let name = match &opts.name {
                    Some(n) => p
                        .workers
                        .iter()
                        .find(|w| &w.name == n)
                        .map(|w| w.name.clone())
                        .ok_or_else(|| placement_error(&pf.path, format!("no worker is named {n}")))?,
                    None => worker_in_placement(p, opts.listen).map_err(|e| placement_error(&pf.path, format!("{e}; name this worker")))?,
                };
                p.validate(&model.fingerprint, &moe, model.spec.moe.num_experts).map_err(|e| placement_error(&pf.path, e))?;
                let slice = p.slice(&name, &moe).map_err(|e| placement_error(&pf.path, e))?;
                Some((name, p.epoch, slice))
            }
            None => None,
        };
        let store_opts = ExpertOptions { assigned: slice.as_ref().map(|s| s.2.pins.clone()), ..opts.store.clone() };
        // A worker holds no dense weights: an `auto` budget may take all but the reserve.
        let store = model.expert_store(&store_opts, 0)?;
        let epoch = opts.epoch.or(slice.as_ref().map(|s| s.1)).unwrap_or(1);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("worker-net").enable_all().build()?;
        let endpoint = rt.block_on(async { shimmer_worker::transport::server(opts.listen, &opts.creds) })?;
        let local_addr = endpoint.local_addr()?;
        let mut state = WorkerState::serving_store(Arc::new(store), shimmer_cluster::model_id(&model.fingerprint), epoch, opts.creds, model.spec.hidden_size);
        if let Some((name, _, slice)) = slice {
            state.name = name;
            state.assigned = Some(slice.assigned);
            state.assigned_only = opts.assigned_only;
        }
        let status = state.status();
        let model_id = state.model;
        rt.spawn(shimmer_worker::server::serve(endpoint.clone(), Arc::new(state)));
        Ok(Worker { local_addr, status, epoch, model_id, rt, endpoint })
    }

    /// Serves until Ctrl-C or SIGTERM, then stops taking connections.
    pub fn serve_until_signal(self) {
        self.serve_until_signal_or(|| false);
    }

    /// Serves until Ctrl-C or SIGTERM, or until `failed` (polled twice a second) says a part of
    /// the node it depends on stopped; returns whether that was why.
    pub fn serve_until_signal_or(self, failed: impl Fn() -> bool) -> bool {
        let why = self.rt.block_on(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let watch = async {
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    if failed() {
                        return;
                    }
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => false,
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => false,
                _ = watch => true,
            }
        });
        self.endpoint.close(0u32.into(), b"worker stopping");
        why
    }
}

/// The placement's worker this one is: the one whose address is `listen`; else, listening on
/// every interface, the only one on its port whose IP address is this machine's (one it can bind).
pub fn worker_in_placement(p: &Placement, listen: SocketAddr) -> Result<String, String> {
    if let Some(w) = p.workers.iter().find(|w| w.addr.parse::<SocketAddr>().ok() == Some(listen)) {
        return Ok(w.name.clone());
    }
    if !listen.ip().is_unspecified() {
        return Err(format!("no worker of the placement has the address {listen}"));
    }
    let mine: Vec<_> = p
        .workers
        .iter()
        .filter(|w| w.addr.parse::<SocketAddr>().is_ok_and(|a| a.port() == listen.port() && std::net::UdpSocket::bind((a.ip(), 0)).is_ok()))
        .collect();
    match mine.as_slice() {
        [one] => Ok(one.name.clone()),
        [] => Err(format!("no worker of the placement is on port {} at an address of this machine", listen.port())),
        many => Err(format!(
            "{} workers of the placement are on port {} at addresses of this machine ({})",
            many.len(),
            listen.port(),
            many.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// How a coordinator reaches its workers.
pub struct ClusterOptions {
    pub placement: PlacementFile,
    pub creds: Credentials,
    pub timeouts: Timeouts,
    /// This node is also the placement's worker of this name, its experts held as the options say.
    pub hold: Option<(String, ExpertOptions)>,
}

/// Where a coordinator's routed experts are.
pub enum ExpertsAt {
    /// On this machine: all in memory, or in the tiered store, as the options say.
    Here(ExpertOptions),
    /// On a placement's workers.
    Cluster(Box<ClusterOptions>),
}

/// A coordinator's engine: the model's dense part here, its experts where `experts` says. On a
/// cluster, a worker answering for a newer placement epoch makes the coordinator read the
/// placement file again and adopt it.
pub fn coordinator(dir: &Path, experts: ExpertsAt) -> Result<Engine, NodeError> {
    let cluster = match experts {
        ExpertsAt::Here(opts) => return Ok(Engine::open(dir, &opts)?),
        ExpertsAt::Cluster(c) => *c,
    };
    let model = ModelDir::open(dir)?;
    let moe = moe_layers(&model);
    let ClusterOptions { placement: pf, creds, timeouts, hold } = cluster;
    let experts_per_layer = model.spec.moe.num_experts;
    pf.placement.validate(&model.fingerprint, &moe, experts_per_layer).map_err(|e| placement_error(&pf.path, e))?;
    let (dense, dense_bytes) = model.dense()?;
    let local = match hold {
        Some((name, opts)) => {
            let slice = pf.placement.slice(&name, &moe).map_err(|e| placement_error(&pf.path, format!("this node holds worker {name}'s experts: {e}")))?;
            // This process holds the dense weights too: an `auto` budget leaves them room.
            let store = model.expert_store(&ExpertOptions { assigned: Some(slice.pins), ..opts }, dense_bytes)?;
            Some((name, Box::new(store) as Box<dyn shimmer_experts::ExpertDispatch>))
        }
        None => None,
    };
    let remote = RemoteExperts::connect_with(pf.placement, shimmer_cluster::model_id(&model.fingerprint), &creds, timeouts, local)?;
    let (file, fingerprint) = (pf.path, model.fingerprint.clone());
    let remote = remote.with_reload(Box::new(move || {
        let p = Placement::read(&file).map_err(|e| e.to_string())?;
        p.validate(&fingerprint, &moe, experts_per_layer).map_err(|e| format!("{}: {e}", file.display()))?;
        Ok(p)
    }));
    Ok(Engine::new(&model, dense, Experts::Cluster(Box::new(remote)))?)
}
