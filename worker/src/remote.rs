//! The coordinator's side of the data plane: an `ExpertDispatch` whose experts live on workers.
//! This is the driver of `shimmer_cluster::Cluster` (the sans-IO core that decides who serves
//! what, fails over and merges the sums): it owns the QUIC connections and a small tokio runtime,
//! sends each round's requests in parallel — one stream per request on the one connection per
//! worker — computes this node's own share while they are in flight, waits, and reports every
//! answer, dial and timeout back to the core with the time it happened.
//!
//! Background work the core asks for (`Action`): redials of down workers after their backoff (the
//! forward pass never waits on them) and closing connections to workers marked down. Every few
//! seconds each connected worker is asked for its status (the dashboard's view, and whether it
//! loads unassigned experts).
//!
//! Must never: decide anything the core decides (routing, failover, merging, backoff); block the
//! forward pass on a background redial; read more of an answer than the question can need.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use shimmer_cluster::wire::{self, Frame};
use shimmer_cluster::{Action, Answer, Cluster, ClusterTelemetry, Exchange, Placement, Step, WorkerStatus};
use shimmer_experts::{DispatchError, ExpertDispatch, MoeBatch, ELSEWHERE};

use crate::transport::{self, Credentials, TransportError};

const STATUS_EVERY: Duration = Duration::from_secs(5);

/// Bounds on waiting for workers.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// For a worker's answer to one layer's request.
    pub answer: Duration,
    /// For a connection and its credential check (at start and on re-admission).
    pub connect: Duration,
}

type Conns = Arc<Mutex<HashMap<String, quinn::Connection>>>;
type Core = Arc<Mutex<Cluster>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What dialling a worker takes: every dial goes through `Dialer::dial`.
#[derive(Clone)]
struct Dialer {
    endpoint: quinn::Endpoint,
    creds: Credentials,
    within: Duration,
    model: u64,
    ids: Arc<AtomicU64>,
}

type Dialled = Result<(quinn::Connection, Option<WorkerStatus>), TransportError>;

impl Dialer {
    /// A connection with its credentials checked, and the worker's status (if it answers).
    /// `addr` is HOST:PORT, looked up at every dial: a worker that comes back elsewhere under
    /// its name (a Kubernetes pod restarted with a new IP) is found there.
    async fn dial(self, addr: String, epoch: u64) -> Dialled {
        let within = self.within;
        // One budget for the lookup and the handshake together.
        let started = Instant::now();
        let addr = resolve(&addr, within).await?;
        let conn = tokio::time::timeout(within.saturating_sub(started.elapsed()), transport::connect(&self.endpoint, addr, &self.creds))
            .await
            .map_err(|_| TransportError::Connect { addr, reason: format!("no answer within {within:?}") })??;
        let status = ask_status(&conn, self.model, epoch, self.ids.fetch_add(1, Ordering::Relaxed), within).await;
        if let Some(reason) = conn.close_reason() {
            // With certificates alone, a worker that refuses ours says so only now, after the
            // client's side of the TLS 1.3 handshake finished.
            return Err(TransportError::Handshake { peer: addr, reason: transport::describe_close(&reason) });
        }
        Ok((conn, status))
    }

    /// Dials every `(name, addr)` in parallel, each bounded by the connect timeout; the results
    /// in the same order.
    fn dial_all(&self, rt: &tokio::runtime::Runtime, targets: &[(String, String)], epoch: u64) -> Vec<Dialled> {
        rt.block_on(async {
            let handles: Vec<_> = targets.iter().map(|(_, addr)| tokio::spawn(self.clone().dial(addr.clone(), epoch))).collect();
            let mut out = Vec::with_capacity(handles.len());
            for h in handles {
                out.push(h.await.unwrap_or_else(|e| Err(TransportError::Tls(e.to_string()))));
            }
            out
        })
    }
}

/// Where a newer placement comes from when a worker says the coordinator's is stale.
pub type Reload = Box<dyn Fn() -> Result<Placement, String> + Send + Sync>;

/// Routing counts per (model layer, expert) since they were last taken: what a coordinator
/// reports to the cluster as routing heat.
#[derive(Clone, Default)]
pub struct HeatCounter(Arc<Mutex<HashMap<(u32, u32), u64>>>);

impl HeatCounter {
    fn count(&self, layer: usize, experts: &[u32]) {
        let mut h = lock(&self.0);
        for &e in experts.iter().filter(|&&e| e != ELSEWHERE) {
            *h.entry((layer as u32, e)).or_insert(0) += 1;
        }
    }

    /// The counts so far, sorted, and zero from now on.
    pub fn take(&self) -> Vec<(u32, u32, u64)> {
        let mut v: Vec<(u32, u32, u64)> = std::mem::take(&mut *lock(&self.0)).into_iter().map(|((l, e), c)| (l, e, c)).collect();
        v.sort_unstable();
        v
    }
}

/// The placement epochs of the layer rounds in flight: what a member coordinator looks at to say
/// which epoch it routes by with nothing in flight on an older one (the cluster retires the
/// epoch before once every coordinator has). A round takes its epoch under the gate's lock
/// after adopting the feed's newest placement, so a check under the same lock cannot miss it.
#[derive(Clone, Default)]
pub struct RoundGate(Arc<Mutex<BTreeMap<u64, usize>>>);

impl RoundGate {
    fn begin(&self, adopt: impl FnOnce() -> u64) -> Round<'_> {
        let mut in_flight = lock(&self.0);
        let epoch = adopt();
        *in_flight.entry(epoch).or_default() += 1;
        Round { gate: self, epoch }
    }

    /// Whether no round is in flight on an epoch below `epoch`. Asked after `epoch` became
    /// the feed's newest, a true answer means every round from now on routes by it or later.
    pub fn settled_at(&self, epoch: u64) -> bool {
        lock(&self.0).keys().next().is_none_or(|&oldest| oldest >= epoch)
    }
}

struct Round<'a> {
    gate: &'a RoundGate,
    epoch: u64,
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        let mut in_flight = lock(&self.gate.0);
        if let Some(n) = in_flight.get_mut(&self.epoch) {
            *n -= 1;
            if *n == 0 {
                in_flight.remove(&self.epoch);
            }
        }
    }
}

/// A source of placements that says when it has a new one (a member's replicated state): looked
/// at before each layer's round, so the coordinator moves to a new epoch between rounds, never
/// during one.
pub trait PlacementFeed: Send + Sync {
    /// Changes whenever `latest` may have (cheap).
    fn version(&self) -> u64;
    /// The newest placement, checked against the model.
    fn latest(&self) -> Option<Result<Placement, String>>;
}

/// Checks a worker's address is HOST:PORT (a hostname or an IP); it is looked up when dialled.
fn parse_addr(name: &str, addr: &str) -> Result<String, String> {
    shimmer_control::state::check_host_port(addr).map_err(|e| format!("worker {name} address {addr:?}: {e}"))?;
    Ok(addr.to_string())
}

/// The first address `addr` (HOST:PORT) stands for, within `within`: an IP literal as it is, a
/// name through the system's resolver.
async fn resolve(addr: &str, within: Duration) -> Result<SocketAddr, TransportError> {
    if let Ok(ip) = addr.parse::<SocketAddr>() {
        return Ok(ip);
    }
    let fail = |reason: String| TransportError::Resolve { addr: addr.to_string(), reason };
    let mut found = tokio::time::timeout(within, tokio::net::lookup_host(addr))
        .await
        .map_err(|_| fail(format!("no answer from the resolver within {within:?}")))?
        .map_err(|e| fail(e.to_string()))?;
    found.next().ok_or_else(|| fail("the name has no address".into()))
}

/// The driver's runtime. Whoever drops the last engine handle may be inside another runtime
/// (the HTTP server's, at shutdown), where tokio refuses to block on a runtime's shutdown; so the
/// connections are closed and the runtime shut down on a thread of its own, bounded in time.
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for OwnedRuntime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &Self::Target {
        // Some until Drop
        self.0.as_ref().expect("runtime present until drop")
    }
}

const CLOSE_WITHIN: Duration = Duration::from_millis(500);

impl OwnedRuntime {
    fn shut_down(&mut self, endpoint: &quinn::Endpoint) {
        let Some(rt) = self.0.take() else { return };
        endpoint.close(0u32.into(), b"coordinator stopping");
        let endpoint = endpoint.clone();
        let handed = Arc::new(Mutex::new(Some(rt)));
        let for_thread = handed.clone();
        let stopper = std::thread::Builder::new().name("remote-experts-stop".into()).spawn(move || {
            if let Some(rt) = lock(&for_thread).take() {
                // The close frames go out before the runtime that sends them stops.
                rt.block_on(async { tokio::time::timeout(CLOSE_WITHIN, endpoint.wait_idle()).await.ok() });
                rt.shutdown_timeout(CLOSE_WITHIN);
            }
        });
        match stopper {
            Ok(thread) => {
                let _ = thread.join();
            }
            Err(e) => {
                tracing::warn!("no thread to stop the remote-experts runtime on ({e}); stopping it without waiting");
                if let Some(rt) = lock(&handed).take() {
                    rt.shutdown_background();
                }
            }
        }
    }
}

pub struct RemoteExperts {
    rt: OwnedRuntime,
    dialer: Dialer,
    core: Core,
    conns: Conns,
    reload: Option<Reload>,
    feed: Option<(Box<dyn PlacementFeed>, AtomicU64)>,
    rounds: RoundGate,
    /// Routing counts, when someone reports them (a cluster member).
    heat: Option<HeatCounter>,
    timeouts: Timeouts,
    /// The placement worker this process is, and its experts.
    local: Option<(String, Box<dyn ExpertDispatch>)>,
}

impl Drop for RemoteExperts {
    fn drop(&mut self) {
        self.rt.shut_down(&self.dialer.endpoint);
    }
}

impl RemoteExperts {
    /// Connects to the workers the placement names, all at once (each bounded by the connect
    /// timeout), and asks each for its status. A worker that cannot be reached now starts down
    /// (its experts' other holders serve); refused credentials are an error.
    pub fn connect(placement: Placement, model: u64, creds: &Credentials, timeouts: Timeouts) -> Result<Self, TransportError> {
        Self::connect_with(placement, model, creds, timeouts, None)
    }

    /// `connect`, with this process holding the experts of the placement's worker `local.0`
    /// itself (computed by `local.1`; that worker is not dialled).
    pub fn connect_with(
        placement: Placement,
        model: u64,
        creds: &Credentials,
        timeouts: Timeouts,
        local: Option<(String, Box<dyn ExpertDispatch>)>,
    ) -> Result<Self, TransportError> {
        let mut cluster = Cluster::new(placement, model, local.as_ref().map(|l| l.0.clone())).map_err(TransportError::NoWorkers)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("remote-experts")
            .enable_all()
            .build()
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        let endpoint = rt.block_on(async { transport::client(creds) })?;
        let mut targets = Vec::new();
        for (name, addr) in cluster.unconnected() {
            let addr = parse_addr(&name, &addr).map_err(|reason| TransportError::Resolve { addr: addr.clone(), reason })?;
            targets.push((name, addr));
        }
        let dialer = Dialer { endpoint, creds: creds.clone(), within: timeouts.connect, model, ids: Arc::new(AtomicU64::new(1 << 62)) };
        let attempts = dialer.dial_all(&rt, &targets, cluster.placement().epoch);
        let mut conns = HashMap::new();
        let mut errors = Vec::new();
        let now = Instant::now();
        for ((name, _), attempt) in targets.iter().zip(attempts) {
            match attempt {
                Ok((c, status)) => {
                    cluster.dial_result(name, Ok(status), now);
                    conns.insert(name.clone(), c);
                }
                Err(TransportError::Refused) => return Err(TransportError::Refused),
                Err(e @ TransportError::Handshake { .. }) => return Err(e),
                Err(e) => {
                    cluster.dial_result(name, Err(()), now);
                    errors.push(e.to_string());
                }
            }
        }
        if conns.is_empty() && local.is_none() {
            return Err(TransportError::NoWorkers(errors.join("; ")));
        }
        for e in errors {
            tracing::warn!("starting without a worker (its experts' other holders serve): {e}");
        }
        let core: Core = Arc::new(Mutex::new(cluster));
        let conns: Conns = Arc::new(Mutex::new(conns));
        rt.spawn(refresh_statuses(core.clone(), conns.clone(), dialer.ids.clone(), timeouts.answer));
        Ok(RemoteExperts {
            rt: OwnedRuntime(Some(rt)),
            dialer,
            core,
            conns,
            reload: None,
            feed: None,
            rounds: RoundGate::default(),
            heat: None,
            timeouts,
            local,
        })
    }

    /// Where to look for a newer placement when a worker answers `Moved`.
    pub fn with_reload(mut self, reload: Reload) -> Self {
        self.reload = Some(reload);
        lock(&self.core).can_reload = true;
        self
    }

    /// Follows `feed`: a newer placement it has is adopted before the next round.
    pub fn with_feed(mut self, feed: Box<dyn PlacementFeed>) -> Self {
        self.feed = Some((feed, AtomicU64::new(0)));
        self
    }

    /// The epochs of its rounds in flight (look at it from another thread).
    pub fn rounds(&self) -> RoundGate {
        self.rounds.clone()
    }

    /// Counts the selections it routes into `heat` (take them from another thread).
    pub fn counting_heat(mut self, heat: HeatCounter) -> Self {
        self.heat = Some(heat);
        self
    }

    fn follow_feed(&self) {
        let Some((feed, seen)) = &self.feed else { return };
        let version = feed.version();
        if seen.swap(version, Ordering::Relaxed) == version {
            return;
        }
        match feed.latest() {
            Some(Ok(p)) if p.epoch > lock(&self.core).placement().epoch => {
                if let Err(e) = self.set_placement(p) {
                    tracing::warn!("cannot route by the cluster's new placement: {e}");
                }
            }
            Some(Err(e)) => tracing::warn!("the cluster's placement does not fit this model: {e}"),
            _ => {}
        }
    }

    /// The core, with every closed connection reported to it first.
    fn core(&self) -> MutexGuard<'_, Cluster> {
        let mut core = lock(&self.core);
        let now = Instant::now();
        let mut conns = lock(&self.conns);
        conns.retain(|name, c| {
            let open = c.close_reason().is_none();
            if !open {
                tracing::warn!(worker = %name, "connection lost; worker marked down");
                core.connection_lost(name, now);
            }
            open
        });
        core
    }

    /// Carries out what the core asked for in the background.
    fn run_actions(&self, core: &mut Cluster) {
        while let Some(action) = core.poll_action() {
            match action {
                Action::Close { worker } => {
                    tracing::warn!(worker = %worker, "worker marked down");
                    if let Some(c) = lock(&self.conns).remove(&worker) {
                        c.close(0u32.into(), b"marked down");
                    }
                }
                Action::Dial { worker, addr } => {
                    let Ok(addr) = parse_addr(&worker, &addr) else { continue };
                    let dial = self.dialer.clone().dial(addr, core.placement().epoch);
                    let (core, conns) = (self.core.clone(), self.conns.clone());
                    self.rt.spawn(async move {
                        let fresh = dial.await;
                        let mut core = lock(&core);
                        match fresh {
                            Ok((c, status)) => {
                                tracing::info!(worker = %worker, "worker re-admitted");
                                lock(&conns).insert(worker.clone(), c);
                                core.dial_result(&worker, Ok(status), Instant::now());
                            }
                            Err(_) => core.dial_result(&worker, Err(()), Instant::now()),
                        }
                    });
                }
            }
        }
    }

    /// Dials `targets` now, in parallel, and reports each to the core.
    fn dial_now(&self, targets: &[(String, String)]) {
        let parsed: Vec<(String, String)> = targets.iter().filter_map(|(n, a)| parse_addr(n, a).ok().map(|a| (n.clone(), a))).collect();
        let epoch = lock(&self.core).placement().epoch;
        let attempts = self.dialer.dial_all(&self.rt, &parsed, epoch);
        let mut core = lock(&self.core);
        let now = Instant::now();
        for ((name, _), attempt) in parsed.into_iter().zip(attempts) {
            match attempt {
                Ok((c, status)) => {
                    tracing::info!(worker = %name, "worker re-admitted");
                    lock(&self.conns).insert(name.clone(), c);
                    core.dial_result(&name, Ok(status), now);
                }
                Err(e) => {
                    tracing::warn!(worker = %name, "{e}");
                    core.dial_result(&name, Err(()), now);
                }
            }
        }
    }

    /// Routes by `placement` from now on: it must be newer than the current one and name this
    /// node's own worker if it holds one. Workers it adds are dialled now (in parallel, each
    /// bounded by the connect timeout; one that cannot be reached starts down).
    pub fn set_placement(&self, placement: Placement) -> Result<(), String> {
        for w in &placement.workers {
            parse_addr(&w.name, &w.addr)?;
        }
        let (from, to) = (lock(&self.core).placement().epoch, placement.epoch);
        let fresh = lock(&self.core).set_placement(placement)?;
        self.dial_now(&fresh);
        tracing::info!(from, to, "routing by a new placement");
        Ok(())
    }

    /// Workers currently marked down.
    pub fn down_workers(&self) -> Vec<String> {
        self.core().down_workers()
    }

    /// Links, counters and statuses, in the placement's worker order.
    pub fn telemetry_snapshot(&self) -> ClusterTelemetry {
        let core = self.core();
        let conns = lock(&self.conns);
        core.telemetry(&|name| conns.get(name).map(|c| c.rtt().as_secs_f64() * 1e3))
    }

    /// The time the forward pass has waited for workers' answers so far (cheap: the batcher
    /// reads it every step).
    pub fn network_wait(&self) -> Duration {
        lock(&self.core).network_wait()
    }

    /// Which worker first serves each expert of `layer` (an index into the placement's workers).
    pub fn first_holders(&self, layer: usize) -> Option<Vec<u16>> {
        lock(&self.core).first_holders(layer)
    }

    /// This node's own share of a round, computed while the others' requests are in flight.
    fn compute_locally(&self, batch: &MoeBatch<'_>, slots: &[usize], sums_len: usize) -> Result<Vec<i64>, DispatchError> {
        let Some((_, local)) = &self.local else { return Err(DispatchError::Remote("this node holds no experts".into())) };
        let mut experts = vec![ELSEWHERE; batch.experts.len()];
        let mut weights = vec![0.0f32; batch.experts.len()];
        for &s in slots {
            experts[s] = batch.experts[s];
            weights[s] = batch.weights[s];
        }
        let mut sums = vec![0i64; sums_len];
        local.dispatch(&MoeBatch { experts: &experts, weights: &weights, ..*batch }, &mut sums)?;
        Ok(sums)
    }
}

async fn ask_status(conn: &quinn::Connection, model: u64, epoch: u64, id: u64, within: Duration) -> Option<WorkerStatus> {
    match ask(conn, wire::encode_status_request(id, model, epoch), within, wire::HEADER_LEN + wire::MAX_STATUS as usize).await {
        Ok((Frame::StatusReply { request_id, json }, _)) if request_id == id => match serde_json::from_str(&json) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(peer = %conn.remote_address(), "unreadable status: {e}");
                None
            }
        },
        _ => None,
    }
}

/// Every few seconds, what each connected worker says about itself (the dashboard's view).
async fn refresh_statuses(core: Core, conns: Conns, ids: Arc<AtomicU64>, within: Duration) {
    loop {
        tokio::time::sleep(STATUS_EVERY).await;
        let (model, epoch, up) = {
            let c = lock(&core);
            (c.model(), c.placement().epoch, c.up_remote())
        };
        let targets: Vec<(String, quinn::Connection)> = {
            let conns = lock(&conns);
            up.into_iter().filter_map(|n| conns.get(&n).cloned().map(|c| (n, c))).collect()
        };
        for (name, conn) in targets {
            if let Some(s) = ask_status(&conn, model, epoch, ids.fetch_add(1, Ordering::Relaxed), within).await {
                lock(&core).set_status(&name, s);
            }
        }
    }
}

/// One request and its answer (at most `max_answer` bytes: what the question can need, so a
/// worker cannot make the coordinator buffer more) on a fresh stream; the answer's size comes
/// back for telemetry.
async fn ask(conn: &quinn::Connection, frame: Bytes, timeout: Duration, max_answer: usize) -> Result<(Frame, usize), String> {
    let work = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(&frame).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        let bytes = recv.read_to_end(max_answer).await.map_err(|e| e.to_string())?;
        let n = bytes.len();
        wire::decode(Bytes::from(bytes)).map(|f| (f, n)).map_err(|e| e.to_string())
    };
    tokio::time::timeout(timeout, work).await.map_err(|_| format!("no answer within {timeout:?}"))?
}

impl ExpertDispatch for RemoteExperts {
    fn wants_lookahead(&self) -> bool {
        true
    }

    /// One-way hints: each worker hears the predicted experts it holds first.
    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let (targets, model, epoch) = {
            let core = lock(&self.core);
            let targets: Vec<(String, Vec<u32>, bool)> =
                core.prefetch_targets(layer, experts).into_iter().map(|(n, list)| (n.clone(), list, core.link(&n).is_some_and(|l| l.is_up()))).collect();
            (targets, core.model(), core.placement().epoch)
        };
        for (name, list, up) in targets {
            if let Some((_, local)) = self.local.as_ref().filter(|(n, _)| *n == name) {
                local.prefetch(layer, &list);
                continue;
            }
            let Some(conn) = lock(&self.conns).get(&name).cloned().filter(|_| up) else { continue };
            let frame = wire::encode_hint(model, epoch, layer as u32, 1, &list);
            self.rt.spawn(async move {
                if let Ok((mut send, _recv)) = conn.open_bi().await {
                    let _ = send.write_all(&frame).await;
                    let _ = send.finish();
                }
            });
        }
    }

    fn end_turn(&self) -> Result<(), String> {
        self.local.as_ref().map_or(Ok(()), |(_, local)| local.end_turn())
    }

    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        let _round = self.rounds.begin(|| {
            self.follow_feed();
            lock(&self.core).placement().epoch
        });
        if let Some(heat) = &self.heat {
            heat.count(batch.layer, batch.experts);
        }
        let rows_bytes: Bytes = batch.rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        let mut layer = self.core().begin(batch.layer, batch.experts, batch.num_rows(), acc.len());
        // A response is the sums, or an error frame.
        let max_answer = wire::HEADER_LEN + (acc.len() * 8).max(4 + wire::MAX_ERROR_MESSAGE);
        loop {
            let step = {
                let mut core = self.core();
                let step = layer.next(&mut core, Instant::now());
                self.run_actions(&mut core);
                step
            };
            match step {
                Step::Done => {
                    for (a, s) in acc.iter_mut().zip(layer.sums()) {
                        *a = a
                            .checked_add(*s)
                            .ok_or_else(|| DispatchError::Remote(format!("layer {}: fixed-point overflow adding the workers' sums", batch.layer)))?;
                    }
                    return Ok(());
                }
                Step::Failed(message) => return Err(DispatchError::Remote(message)),
                Step::RedialNow(targets) => self.dial_now(&targets),
                Step::Reload => {
                    let adopted = match self.reload.as_ref().map(|r| r()) {
                        Some(Ok(p)) => match self.set_placement(p) {
                            Ok(()) => true,
                            Err(e) => {
                                tracing::warn!("{e}");
                                false
                            }
                        },
                        Some(Err(e)) => {
                            tracing::warn!("cannot read a newer placement: {e}");
                            false
                        }
                        None => false,
                    };
                    layer.reloaded(adopted);
                }
                Step::Send(assignments) => {
                    let model = self.dialer.model;
                    let mut remote = Vec::new();
                    let mut mine = None;
                    for a in assignments {
                        if a.local {
                            mine = Some(a);
                            continue;
                        }
                        let mut selections = vec![(ELSEWHERE, 0.0f32); batch.experts.len()];
                        for &s in &a.slots {
                            selections[s] = (batch.experts[s], batch.weights[s]);
                        }
                        let frame = wire::Request {
                            request_id: a.request_id,
                            model,
                            epoch: a.epoch,
                            layer: batch.layer as u32,
                            hidden: batch.hidden as u32,
                            top_k: batch.top_k as u32,
                            rows: rows_bytes.clone(),
                            selections,
                        }
                        .encode();
                        let conn = lock(&self.conns).get(&a.worker).cloned();
                        let (timeout, sent) = (self.timeouts.answer, frame.clone());
                        let handle = self.rt.spawn(async move {
                            let t0 = Instant::now();
                            let r = match conn {
                                Some(c) => ask(&c, sent, timeout, max_answer).await,
                                None => Err("not connected".into()),
                            };
                            (r, t0.elapsed())
                        });
                        remote.push((a.request_id, frame.len(), handle));
                    }
                    // This node's own selections, computed while the others' are in flight.
                    let local_answer = mine.map(|a| {
                        let t0 = Instant::now();
                        let r = self.compute_locally(batch, &a.slots, acc.len());
                        (a, r, t0.elapsed())
                    });
                    let waited = Instant::now();
                    let answers = self.rt.block_on(async {
                        let mut out = Vec::with_capacity(remote.len());
                        for (id, sent, h) in remote {
                            let (r, took) = h.await.unwrap_or_else(|e| (Err(e.to_string()), Duration::ZERO));
                            out.push((id, sent, r, took));
                        }
                        out
                    });
                    let mut core = self.core();
                    core.add_wait(waited.elapsed());
                    if let Some((a, r, took)) = local_answer {
                        let exchange = Exchange { sent: 0, received: 0, took };
                        let answer = match &r {
                            Ok(sums) => Answer::Sums { request_id: a.request_id, model, epoch: a.epoch, layer: batch.layer as u32, sums },
                            Err(e) => Answer::Refused { code: None, message: format!("this node cannot serve its own experts: {e}") },
                        };
                        layer.answer(&mut core, a.request_id, answer, exchange)?;
                    }
                    for (id, sent, r, took) in answers {
                        let exchange = Exchange { sent, received: r.as_ref().map_or(0, |a| a.1), took };
                        let answer = match r {
                            Ok((Frame::Response(resp), _)) => {
                                let wire::Response { request_id, model, epoch, layer: l, sums, .. } = resp;
                                layer.answer(&mut core, id, Answer::Sums { request_id, model, epoch, layer: l, sums: &sums }, exchange)?;
                                continue;
                            }
                            Ok((Frame::Error { code, message, .. }, _)) => Answer::Refused { code, message },
                            Ok((other, _)) => Answer::Lost(format!("answered request {id} with {other:?}")),
                            Err(e) => Answer::Lost(e),
                        };
                        layer.answer(&mut core, id, answer, exchange)?;
                    }
                    self.run_actions(&mut core);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_addresses_are_names_or_ips_looked_up_when_dialled() {
        assert_eq!(parse_addr("w", "worker-0.shimmer-worker.llm.svc.cluster.local:7070").as_deref(), Ok("worker-0.shimmer-worker.llm.svc.cluster.local:7070"));
        assert!(parse_addr("w", "10.0.0.1").unwrap_err().contains("worker w address \"10.0.0.1\""));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let within = Duration::from_secs(5);
        assert_eq!(rt.block_on(resolve("10.1.2.3:7070", within)).unwrap(), "10.1.2.3:7070".parse::<SocketAddr>().unwrap());
        assert!(rt.block_on(resolve("localhost:7070", within)).unwrap().ip().is_loopback());
        let err = rt.block_on(resolve("no-such-worker.invalid:7070", within)).unwrap_err().to_string();
        assert!(err.contains("cannot find worker address no-such-worker.invalid:7070"), "{err}");
    }

    #[test]
    fn the_round_gate_is_settled_at_an_epoch_once_no_round_is_in_flight_on_an_older_one() {
        let gate = RoundGate::default();
        assert!(gate.settled_at(5), "nothing in flight: every next round adopts the newest first");
        let old = gate.begin(|| 1);
        assert!(gate.settled_at(1) && !gate.settled_at(2));
        let new = gate.begin(|| 2);
        let again = gate.begin(|| 2);
        assert!(!gate.settled_at(2), "a round on epoch 1 is still in flight");
        drop(old);
        assert!(gate.settled_at(2) && !gate.settled_at(3));
        drop(new);
        assert!(!gate.settled_at(3), "one round on epoch 2 remains");
        drop(again);
        assert!(gate.settled_at(3));
    }
}
