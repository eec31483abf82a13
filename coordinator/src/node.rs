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
use shimmer_worker::control::{AdminReply, AdminRequest, ControlPlane};
use shimmer_worker::server::WorkerState;
use shimmer_worker::transport::{Credentials, TransportError};
use shimmer_worker::{PlacementFeed, RemoteExperts, Timeouts};

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
    /// The cluster has no (usable) placement of this model.
    #[error("{0}")]
    Cluster(String),
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
    /// A cluster member: its name there (its epochs and assignment then follow the cluster).
    pub member: Option<String>,
}

/// A worker serving on a runtime of its own until dropped or `wait`ed out.
pub struct Worker {
    pub local_addr: SocketAddr,
    /// What it says about itself at start.
    pub status: WorkerStatus,
    pub epoch: u64,
    /// The model served (`shimmer_cluster::model_id` of its fingerprint).
    pub model_id: u64,
    /// The model's fingerprint and the shape a placement of it depends on.
    pub fingerprint: String,
    pub moe_layers: Vec<usize>,
    pub shape: shimmer_control::state::ModelShape,
    pub state: Arc<WorkerState>,
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
            state.set_assigned(Some(slice.assigned));
            state.assigned_only = opts.assigned_only;
        }
        if let Some(name) = &opts.member {
            // The cluster says which epochs it answers for once it has a placement.
            state.name = name.clone();
            state.set_epochs(shimmer_worker::server::EpochWindow::only(0));
        }
        let status = state.status();
        let model_id = state.model;
        let state = Arc::new(state);
        rt.spawn(shimmer_worker::server::serve(endpoint.clone(), state.clone()));
        let shape = shimmer_control::state::ModelShape {
            moe_layers: moe.iter().map(|&l| l as u32).collect(),
            experts: model.spec.moe.num_experts as u32,
            top_k: model.spec.moe.top_k as u32,
        };
        Ok(Worker { local_addr, status, epoch, model_id, fingerprint: model.fingerprint.clone(), moe_layers: moe, shape, state, rt, endpoint })
    }

    /// Follows the cluster's placement of this worker's model (on a thread of its own) until
    /// `stop` is set.
    pub fn follow(&self, control: Arc<ControlPlane>, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<()> {
        let (state, model, moe) = (self.state.clone(), self.fingerprint.clone(), self.moe_layers.clone());
        std::thread::spawn(move || shimmer_worker::control::follow::follow(control, state, model, moe, stop))
    }

    /// Serves until Ctrl-C or SIGTERM, or until `failed` (polled twice a second) says a part of
    /// the node it depends on stopped; says which.
    pub fn wait_for_signal_or(&self, failed: impl Fn() -> bool) -> Stopped {
        self.rt.block_on(async {
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
                _ = tokio::signal::ctrl_c() => Stopped::Interrupted,
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => Stopped::Terminated,
                _ = watch => Stopped::Failed,
            }
        })
    }

    /// Serves on until `done` (polled every 200 ms) or `within` passes; a Ctrl-C or another
    /// SIGTERM ends it at once. Says how it ended.
    pub fn serve_until(&self, done: impl Fn() -> bool, within: std::time::Duration) -> Drained {
        self.rt.block_on(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let watch = async {
                let deadline = tokio::time::Instant::now() + within;
                loop {
                    if done() {
                        return Drained::Done;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Drained::TimedOut;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => Drained::Stopped,
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => Drained::Stopped,
                d = watch => d,
            }
        })
    }

    /// The runtime the worker serves on (its HTTP endpoints run there too).
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.rt.handle().clone()
    }

    /// Stops taking connections.
    pub fn stop(self) {
        self.endpoint.close(0u32.into(), b"worker stopping");
    }
}

/// In a member's data directory while it drains on SIGTERM: the next start clears the draining
/// mark it set (an operator's `cluster drain` stays).
pub const DRAINING_ON_EXIT: &str = "draining-on-exit";

/// The most a drain waits for the cluster to move a worker's experts off it.
pub const DRAIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(120);
/// A drained worker serves on until coordinators sent it nothing for this long (requests in
/// flight on the previous epoch finish).
const DRAIN_QUIET: std::time::Duration = std::time::Duration::from_secs(2);

/// How a drain went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainOutcome {
    /// No placement names it any more and no request came for `DRAIN_QUIET`.
    Moved,
    /// Stopped before that: a second signal, or `within` passed (`why`).
    Cut(String),
}

/// SIGTERM on a member worker: marks it draining (the leader then places its model without it),
/// serves until no active or proposed placement names it, the epoch before is retired (every
/// coordinator has moved) and requests stopped coming, then
/// returns — within `within`; a Ctrl-C or second SIGTERM cuts it short.
pub fn drain(worker: &Worker, control: &Arc<ControlPlane>, data_dir: &Path, within: std::time::Duration) -> DrainOutcome {
    use std::sync::atomic::{AtomicBool, Ordering};
    let name = worker.state.name.clone();
    let _ = std::fs::write(data_dir.join(DRAINING_ON_EXIT), name.as_bytes());
    let marked = Arc::new(AtomicBool::new(false));
    let give_up = Arc::new(AtomicBool::new(false));
    {
        let (control, marked, give_up, name) = (control.clone(), marked.clone(), give_up.clone(), name.clone());
        std::thread::spawn(move || {
            while !give_up.load(Ordering::SeqCst) && !control.stopped() {
                match control.propose(shimmer_control::Command::SetDraining { name: name.clone(), draining: true }) {
                    Ok(shimmer_control::Outcome::Applied) => {
                        marked.store(true, Ordering::SeqCst);
                        return;
                    }
                    Ok(shimmer_control::Outcome::Rejected(why)) => {
                        tracing::warn!("cannot mark {name} draining: {why}");
                        return;
                    }
                    Err(e) => tracing::warn!("marking {name} draining, again: {e}"),
                }
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
        });
    }
    let names_me = |r: &Option<shimmer_control::PlacementRecord>| r.as_ref().is_some_and(|r| r.worker_names().contains(name.as_str()));
    let last_request = std::sync::Mutex::new((worker.state.requests.load(Ordering::Relaxed), std::time::Instant::now()));
    let nowhere = std::cell::Cell::new(false);
    let moved = || {
        if !marked.load(Ordering::SeqCst) {
            return false;
        }
        // With every other holder of the model draining too (the whole cluster is stopping),
        // its experts have nowhere to go: waiting would only delay the stop.
        let state = control.state();
        let others = state.members.values().filter(|m| {
            m.name != name && !m.draining && m.kind == shimmer_control::NodeKind::Worker && m.models.iter().any(|d| d.fingerprint == worker.fingerprint)
        });
        if others.count() == 0 {
            nowhere.set(true);
            return true;
        }
        let (_, placement) = control.placement(&worker.fingerprint);
        // Covered elsewhere, and no coordinator still routes by an epoch that named it.
        let covered = placement.is_none_or(|p| !names_me(&p.active) && !names_me(&p.proposed) && p.previous.is_none());
        let now = std::time::Instant::now();
        let mut last = last_request.lock().unwrap_or_else(|p| p.into_inner());
        let requests = worker.state.requests.load(Ordering::Relaxed);
        if requests != last.0 {
            *last = (requests, now);
        }
        covered && now.duration_since(last.1) >= DRAIN_QUIET
    };
    let outcome = match worker.serve_until(moved, within) {
        Drained::Done if nowhere.get() => DrainOutcome::Cut("no other worker with this model is left to take its experts".into()),
        Drained::Done => DrainOutcome::Moved,
        Drained::TimedOut => {
            DrainOutcome::Cut(format!("after {} s its experts still have no other holder, or coordinators still send it requests", within.as_secs()))
        }
        Drained::Stopped => DrainOutcome::Cut("stopped at once by a second signal".into()),
    };
    give_up.store(true, Ordering::SeqCst);
    outcome
}

/// A member restarted after draining on SIGTERM is no longer draining (in a thread, until the
/// cluster applied it).
pub fn undrain_after_restart(control: &Arc<ControlPlane>, name: &str, data_dir: &Path) {
    let marker = data_dir.join(DRAINING_ON_EXIT);
    if !marker.exists() {
        return;
    }
    let (control, name) = (control.clone(), name.to_string());
    std::thread::spawn(move || {
        while !control.stopped() {
            match control.propose(shimmer_control::Command::SetDraining { name: name.clone(), draining: false }) {
                Ok(_) => {
                    let _ = std::fs::remove_file(&marker);
                    return;
                }
                Err(e) => tracing::debug!("clearing {name}'s draining mark, again: {e}"),
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    });
}

/// Why a worker stopped serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    Interrupted,
    Terminated,
    /// A part it depends on (the control plane) stopped.
    Failed,
}

/// How serving on until something is done ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    Done,
    TimedOut,
    /// Ctrl-C or SIGTERM again.
    Stopped,
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

/// Where a coordinator's placement comes from.
pub enum PlacementSource {
    /// A file (`shimmer plan`), read again when a worker says it moved on.
    File(PlacementFile),
    /// This node's replicated state: it is a member of the cluster.
    Member(Arc<ControlPlane>),
    /// The cluster's members at these control addresses: this node is a client.
    Client { members: Vec<String>, trust: shimmer_worker::control::ControlTrust },
}

/// How long a coordinator waits at start for the cluster to place its model.
pub const PLACEMENT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl PlacementSource {
    /// What to call it in messages.
    pub fn describe(&self) -> String {
        match self {
            PlacementSource::File(f) => f.path.display().to_string(),
            PlacementSource::Member(c) => format!("cluster {} (this node is its member {})", c.cluster_id, c.name),
            PlacementSource::Client { members, .. } => format!("the cluster reached at {}", members.join(",")),
        }
    }
}

/// A model's active placement in the cluster, as a member has applied it or the members answer.
fn cluster_placement(source: &PlacementSource, fingerprint: &str) -> Result<Option<Placement>, String> {
    match source {
        PlacementSource::File(_) => Ok(None),
        PlacementSource::Member(c) => Ok(c.placement(fingerprint).1.and_then(|p| p.active).map(|r| r.placement)),
        PlacementSource::Client { members, trust } => {
            match shimmer_worker::control::admin_any(members, trust, &AdminRequest::Placement { model: fingerprint.to_string() }) {
                Ok(AdminReply::Placement { record }) => Ok(record.map(|r| r.placement)),
                Ok(AdminReply::Error { message }) => Err(message),
                Ok(_) => Err("unexpected answer to a placement request".into()),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// Waits (up to `PLACEMENT_WAIT`) for the cluster's first placement of the model.
fn first_cluster_placement(source: &PlacementSource, fingerprint: &str) -> Result<Placement, NodeError> {
    let deadline = std::time::Instant::now() + PLACEMENT_WAIT;
    let mut last_error = None;
    loop {
        match cluster_placement(source, fingerprint) {
            Ok(Some(p)) => return Ok(p),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if std::time::Instant::now() >= deadline {
            return Err(NodeError::Cluster(format!(
                "{} has not placed model {fingerprint} within {} s (do workers with this model on disk belong to it?){}",
                source.describe(),
                PLACEMENT_WAIT.as_secs(),
                last_error.map(|e| format!("; last error: {e}")).unwrap_or_default()
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// A member coordinator's routing counts, proposed to the cluster every `every` (merged there into
/// the model's heat, which placements weigh), on a thread of its own until the control plane stops.
fn report_heat(control: Arc<ControlPlane>, heat: shimmer_worker::HeatCounter, model: String, every: std::time::Duration) {
    std::thread::spawn(move || {
        let mut next = std::time::Instant::now() + every;
        while !control.stopped() {
            std::thread::sleep(std::time::Duration::from_millis(200).min(every));
            if std::time::Instant::now() < next {
                continue;
            }
            next += every;
            let counts = heat.take();
            if counts.is_empty() {
                continue;
            }
            let report = shimmer_control::Command::ReportHeat { model: model.clone(), by: control.name.clone(), counts };
            match control.propose(report) {
                Ok(shimmer_control::Outcome::Applied) => {}
                Ok(shimmer_control::Outcome::Rejected(why)) => tracing::warn!("the cluster refused this coordinator's routing heat: {why}"),
                Err(e) => tracing::warn!("routing heat not reported (dropped, the next report goes on): {e}"),
            }
        }
    });
}

/// A member coordinator's word on which epoch of `model` it routes by (once no layer round is in
/// flight on an older one), on a thread of its own until the control plane stops: the leader
/// retires an epoch's predecessor only once every coordinator has moved.
fn report_routed(control: Arc<ControlPlane>, rounds: shimmer_worker::RoundGate, model: String) {
    std::thread::spawn(move || {
        let mut reported = 0;
        while !control.stopped() {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let latest = control.placement(&model).1.map_or(0, |p| p.epoch());
            if latest <= reported || !rounds.settled_at(latest) {
                continue;
            }
            let command = shimmer_control::Command::Routed { model: model.clone(), by: control.name.clone(), epoch: latest };
            match control.propose(command) {
                Ok(shimmer_control::Outcome::Applied) => reported = latest,
                Ok(shimmer_control::Outcome::Rejected(why)) => {
                    tracing::warn!("the cluster refused this coordinator's routed epoch: {why}");
                    reported = latest;
                }
                Err(e) => tracing::debug!("routed epoch {latest} not reported yet: {e}"),
            }
        }
    });
}

/// Checks a placement against the model.
type PlacementCheck = Box<dyn Fn(&Placement) -> Result<(), String> + Send + Sync>;

/// A member's replicated state as the coordinator's feed of placements.
struct MemberFeed {
    control: Arc<ControlPlane>,
    fingerprint: String,
    check: PlacementCheck,
}

impl PlacementFeed for MemberFeed {
    fn version(&self) -> u64 {
        self.control.version()
    }

    fn latest(&self) -> Option<Result<Placement, String>> {
        let p = self.control.placement(&self.fingerprint).1?.active?.placement;
        Some((self.check)(&p).map(|()| p))
    }
}

/// How a coordinator reaches its workers.
pub struct ClusterOptions {
    pub placement: PlacementSource,
    pub creds: Credentials,
    pub timeouts: Timeouts,
    /// This node is also the placement's worker of this name, its experts held as the options say.
    pub hold: Option<(String, ExpertOptions)>,
    /// How often a member coordinator reports its routing counts to the cluster.
    pub report_heat_every: std::time::Duration,
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
    let ClusterOptions { placement: source, creds, timeouts, hold, report_heat_every } = cluster;
    let experts_per_layer = model.spec.moe.num_experts;
    let fingerprint = model.fingerprint.clone();
    let (placement, where_from) = match &source {
        PlacementSource::File(pf) => (pf.placement.clone(), pf.path.clone()),
        other => (first_cluster_placement(other, &fingerprint)?, PathBuf::from(other.describe())),
    };
    placement.validate(&fingerprint, &moe, experts_per_layer).map_err(|e| placement_error(&where_from, e))?;
    let (dense, dense_bytes) = model.dense()?;
    let local = match hold {
        Some((name, opts)) => {
            let slice = placement.slice(&name, &moe).map_err(|e| placement_error(&where_from, format!("this node holds worker {name}'s experts: {e}")))?;
            // This process holds the dense weights too: an `auto` budget leaves them room.
            let store = model.expert_store(&ExpertOptions { assigned: Some(slice.pins), ..opts }, dense_bytes)?;
            Some((name, Box::new(store) as Box<dyn shimmer_experts::ExpertDispatch>))
        }
        None => None,
    };
    let remote = RemoteExperts::connect_with(placement, shimmer_cluster::model_id(&fingerprint), &creds, timeouts, local)?;
    let check = {
        let (fingerprint, moe) = (fingerprint.clone(), moe.clone());
        move |p: &Placement| p.validate(&fingerprint, &moe, experts_per_layer)
    };
    let remote = match source {
        PlacementSource::File(pf) => {
            let file = pf.path;
            remote.with_reload(Box::new(move || {
                let p = Placement::read(&file).map_err(|e| e.to_string())?;
                check(&p).map_err(|e| format!("{}: {e}", file.display()))?;
                Ok(p)
            }))
        }
        PlacementSource::Member(control) => {
            let heat = shimmer_worker::HeatCounter::default();
            report_heat(control.clone(), heat.clone(), fingerprint.clone(), report_heat_every);
            report_routed(control.clone(), remote.rounds(), fingerprint.clone());
            let feed = MemberFeed { control: control.clone(), fingerprint: fingerprint.clone(), check: Box::new(check.clone()) };
            let reload_from = PlacementSource::Member(control);
            let fp = fingerprint.clone();
            remote.counting_heat(heat).with_feed(Box::new(feed)).with_reload(Box::new(move || {
                let p = cluster_placement(&reload_from, &fp)?.ok_or("the cluster has no placement of this model")?;
                check(&p).map(|()| p)
            }))
        }
        client @ PlacementSource::Client { .. } => {
            let fp = fingerprint.clone();
            remote.with_reload(Box::new(move || {
                let p = cluster_placement(&client, &fp)?.ok_or("the cluster has no placement of this model")?;
                check(&p).map(|()| p)
            }))
        }
    };
    Ok(Engine::new(&model, dense, Experts::Cluster(Box::new(remote)))?)
}
