//! The coordinator's side of the data plane: an `ExpertDispatch` whose experts live on workers.
//! For each MoE layer, every involved worker gets — in parallel, each on its own QUIC stream of
//! the one connection per worker — all the batch's rows and, per row, the selections it serves
//! (the others marked `ELSEWHERE`); their fixed-point partial sums are added into the result,
//! which is therefore the single box's bits whatever the placement (DESIGN.md §1).
//!
//! Failure: a worker that does not answer in time, or whose connection is gone, is marked down
//! and its selections go to each expert's next holder in the placement; when every holder has
//! failed, to any other worker that said (in its status) it loads unassigned experts from its own
//! disk; until every selection is served or an expert has nobody left (an error naming the layer,
//! the expert and the workers tried — never an answer from a different model). A down worker is
//! redialled in the background after a backoff (1 s, doubling to 30 s) — the forward pass never
//! waits on a reconnect — and re-admitted when its credentials check out.
//!
//! A node can be both: with a local holder (`connect_with`), the experts the placement gives one
//! named worker are computed in this process — while the requests to the others are in flight —
//! and that worker is never dialled.
//!
//! A new placement: a worker that answers `Moved` serves another epoch; the coordinator asks its
//! reload hook (the placement file again; Raft later) for a newer placement, adopts it — dialling
//! any new workers — and sends the rows again under it. Without a newer one, `Moved` is an error
//! like any other and the next holder serves.
//!
//! Telemetry: per worker, round trips, bytes each way, selections served, errors and a histogram
//! of request round-trip times; overall, tokens (rows through the first MoE layer) and the time the
//! forward pass waited on the network (`ClusterTelemetry`).
//!
//! Must never: send an expert to a worker the placement does not name for it unless that worker
//! said it loads unassigned experts; add a reply that is not the answer to the request sent (id,
//! layer and size are checked).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use crate::dispatch::{DispatchError, ExpertDispatch, MoeBatch, ELSEWHERE};
use crate::placement::Placement;
use crate::server::WorkerStatus;
use crate::transport::{self, Credentials, TransportError};
use crate::wire::{self, ErrorCode, Frame};

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const STATUS_EVERY: Duration = Duration::from_secs(5);
/// Upper bounds (seconds) of the round-trip histogram's buckets; the last bucket is +Inf.
pub const RTT_BUCKETS: &[f64] = &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Bounds on waiting for workers.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// For a worker's answer to one layer's request.
    pub answer: Duration,
    /// For a connection and its credential check (at start and on re-admission).
    pub connect: Duration,
}

#[derive(Default, Clone)]
struct LinkCounters {
    requests: u64,
    selections: u64,
    bytes_sent: u64,
    bytes_received: u64,
    errors: u64,
    rtt_buckets: [u64; RTT_BUCKETS.len() + 1],
    rtt_sum: f64,
}

struct Link {
    addr: SocketAddr,
    conn: Option<quinn::Connection>,
    /// Down until this time, with the backoff that set it.
    down: Option<(Instant, Duration)>,
    status: Option<WorkerStatus>,
    counters: LinkCounters,
    redialing: bool,
    /// Served in this process (`connect_with`'s local holder): never dialled, always up.
    local: bool,
}

/// One worker as the coordinator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerLink {
    pub name: String,
    pub addr: String,
    pub up: bool,
    /// QUIC's smoothed path RTT estimate (the network alone), when connected.
    pub path_rtt_ms: Option<f64>,
    /// (layer, expert) pairs the placement lists it for, and those it is first choice for.
    pub placed_experts: usize,
    pub first_choice_experts: usize,
    pub requests: u64,
    pub selections: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub errors: u64,
    /// Request round trips (network and the worker's compute) per `RTT_BUCKETS` bucket (not
    /// cumulative; the last is +Inf), and their sum.
    pub rtt_buckets: Vec<u64>,
    pub rtt_sum_s: f64,
    /// What the worker last said about itself.
    pub status: Option<WorkerStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClusterTelemetry {
    pub workers: Vec<WorkerLink>,
    /// Rows that went through the first MoE layer: tokens prefilled or decoded.
    pub tokens: u64,
    pub round_trips: u64,
    pub network_wait_s: f64,
    pub failovers: u64,
    pub placement_epoch: u64,
}

type Links = Arc<Mutex<HashMap<String, Link>>>;

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
    async fn dial(self, addr: SocketAddr, epoch: u64) -> Dialled {
        let within = self.within;
        let conn = tokio::time::timeout(within, transport::connect(&self.endpoint, addr, &self.creds))
            .await
            .map_err(|_| TransportError::Connect { addr, reason: format!("no answer within {within:?}") })??;
        let status = RemoteExperts::ask_status(&conn, self.model, epoch, self.ids.fetch_add(1, Ordering::Relaxed), within).await;
        if let Some(reason) = conn.close_reason() {
            // With certificates alone, a worker that refuses ours says so only now, after the
            // client's side of the TLS 1.3 handshake finished.
            return Err(TransportError::Handshake { peer: addr, reason: transport::describe_close(&reason) });
        }
        Ok((conn, status))
    }

    /// Dials every `(name, addr)` in parallel, each bounded by the connect timeout; the results
    /// in the same order.
    fn dial_all(&self, rt: &tokio::runtime::Runtime, targets: &[(String, SocketAddr)], epoch: u64) -> Vec<Dialled> {
        rt.block_on(async {
            let handles: Vec<_> = targets.iter().map(|(_, addr)| tokio::spawn(self.clone().dial(*addr, epoch))).collect();
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

/// The placement the coordinator routes by, with what is derived from it.
struct Routing {
    placement: Placement,
    /// Per worker: (layer, expert) pairs the placement lists it for, and those it is first for.
    placed: HashMap<String, (usize, usize)>,
}

impl Routing {
    fn new(placement: Placement) -> Arc<Self> {
        let mut placed: HashMap<String, (usize, usize)> = HashMap::new();
        for l in &placement.layers {
            for holders in &l.replicas {
                for (i, h) in holders.iter().enumerate() {
                    let p = placed.entry(h.clone()).or_default();
                    p.0 += 1;
                    p.1 += usize::from(i == 0);
                }
            }
        }
        Arc::new(Routing { placement, placed })
    }
}

fn lock(links: &Links) -> MutexGuard<'_, HashMap<String, Link>> {
    links.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct RemoteExperts {
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
    creds: Credentials,
    links: Links,
    routing: std::sync::RwLock<Arc<Routing>>,
    reload: Option<Reload>,
    first_moe_layer: usize,
    model: u64,
    next_id: Arc<AtomicU64>,
    timeouts: Timeouts,
    /// The placement worker this process is, and its experts.
    local: Option<(String, Box<dyn ExpertDispatch>)>,
    /// Selections served by another than the placement's first holder.
    pub failovers: AtomicU64,
    tokens: AtomicU64,
    wait_ns: AtomicU64,
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
        if let Some((name, _)) = &local {
            if !placement.workers.iter().any(|w| &w.name == name) {
                return Err(TransportError::NoWorkers(format!("this node is to hold worker {name}'s experts, but the placement has no such worker")));
            }
        }
        let local_name = local.as_ref().map(|l| l.0.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("remote-experts")
            .enable_all()
            .build()
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        let endpoint = rt.block_on(async { transport::client(creds) })?;
        let mut addrs = Vec::new();
        for w in placement.workers.iter().filter(|w| Some(&w.name) != local_name.as_ref()) {
            let addr: SocketAddr = w
                .addr
                .parse()
                .map_err(|e| TransportError::Connect { addr: ([0, 0, 0, 0], 0).into(), reason: format!("worker {} address {:?}: {e}", w.name, w.addr) })?;
            addrs.push((w.name.clone(), addr));
        }
        let next_id = Arc::new(AtomicU64::new(1));
        let dialer = Dialer { endpoint: endpoint.clone(), creds: creds.clone(), within: timeouts.connect, model, ids: next_id.clone() };
        let attempts = dialer.dial_all(&rt, &addrs, placement.epoch);
        let mut links = HashMap::new();
        let mut errors = Vec::new();
        for ((name, addr), attempt) in addrs.iter().zip(attempts) {
            let (conn, status) = match attempt {
                Ok((c, s)) => (Some(c), s),
                Err(TransportError::Refused) => return Err(TransportError::Refused),
                Err(e @ TransportError::Handshake { .. }) => return Err(e),
                Err(e) => {
                    errors.push(e.to_string());
                    (None, None)
                }
            };
            let down = conn.is_none().then(|| (Instant::now() + BACKOFF_START, BACKOFF_START));
            links.insert(name.clone(), Link { addr: *addr, conn, down, status, counters: LinkCounters::default(), redialing: false, local: false });
        }
        if links.values().all(|l| l.conn.is_none()) && local.is_none() {
            return Err(TransportError::NoWorkers(errors.join("; ")));
        }
        for e in errors {
            tracing::warn!("starting without a worker (its experts' other holders serve): {e}");
        }
        if let Some(name) = &local_name {
            let status = WorkerStatus { name: name.clone(), epoch: placement.epoch, loads_unassigned: true, ..WorkerStatus::default() };
            links.insert(
                name.clone(),
                Link {
                    addr: ([127, 0, 0, 1], 0).into(),
                    conn: None,
                    down: None,
                    status: Some(status),
                    counters: LinkCounters::default(),
                    redialing: false,
                    local: true,
                },
            );
        }
        let links: Links = Arc::new(Mutex::new(links));
        rt.spawn(Self::refresh_statuses(links.clone(), model, placement.epoch, next_id.clone(), timeouts.answer));
        let first_moe_layer = placement.layers.iter().map(|l| l.layer).min().unwrap_or(0);
        let routing = std::sync::RwLock::new(Routing::new(placement));
        Ok(RemoteExperts {
            rt,
            endpoint,
            creds: creds.clone(),
            links,
            routing,
            reload: None,
            first_moe_layer,
            model,
            next_id,
            timeouts,
            local,
            failovers: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
        })
    }

    /// Where to look for a newer placement when a worker answers `Moved`.
    pub fn with_reload(mut self, reload: Reload) -> Self {
        self.reload = Some(reload);
        self
    }

    fn routing(&self) -> Arc<Routing> {
        self.routing.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Routes by `placement` from now on: it must be newer than the current one and name this
    /// node's own worker if it holds one. Workers it adds are dialled now (in parallel, each
    /// bounded by the connect timeout; one that cannot be reached starts down).
    pub fn set_placement(&self, placement: Placement) -> Result<(), String> {
        let current = self.routing().placement.epoch;
        if placement.epoch <= current {
            return Err(format!("placement epoch {} is not newer than {current}", placement.epoch));
        }
        if let Some((name, _)) = &self.local {
            if !placement.workers.iter().any(|w| &w.name == name) {
                return Err(format!("the new placement drops this node's own worker {name}"));
            }
        }
        let known: HashSet<String> = lock(&self.links).keys().cloned().collect();
        let mut fresh = Vec::new();
        for w in placement.workers.iter().filter(|w| !known.contains(&w.name)) {
            fresh.push((w.name.clone(), w.addr.parse::<SocketAddr>().map_err(|e| format!("worker {} address {:?}: {e}", w.name, w.addr))?));
        }
        let attempts = self.dialer().dial_all(&self.rt, &fresh, placement.epoch);
        {
            let mut links = lock(&self.links);
            for ((name, addr), attempt) in fresh.into_iter().zip(attempts) {
                let (conn, status) = match attempt {
                    Ok((c, s)) => (Some(c), s),
                    Err(e) => {
                        tracing::warn!(worker = %name, "a worker of the new placement cannot be reached: {e}");
                        (None, None)
                    }
                };
                let down = conn.is_none().then(|| (Instant::now() + BACKOFF_START, BACKOFF_START));
                links.insert(name, Link { addr, conn, down, status, counters: LinkCounters::default(), redialing: false, local: false });
            }
        }
        tracing::info!(from = current, to = placement.epoch, "routing by a new placement");
        *self.routing.write().unwrap_or_else(|e| e.into_inner()) = Routing::new(placement);
        Ok(())
    }

    fn dialer(&self) -> Dialer {
        Dialer { endpoint: self.endpoint.clone(), creds: self.creds.clone(), within: self.timeouts.connect, model: self.model, ids: self.next_id.clone() }
    }

    async fn ask_status(conn: &quinn::Connection, model: u64, epoch: u64, id: u64, within: Duration) -> Option<WorkerStatus> {
        match Self::ask(conn, wire::encode_status_request(id, model, epoch), within, wire::HEADER_LEN + wire::MAX_STATUS as usize).await {
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
    async fn refresh_statuses(links: Links, model: u64, epoch: u64, ids: Arc<AtomicU64>, within: Duration) {
        loop {
            tokio::time::sleep(STATUS_EVERY).await;
            let conns: Vec<(String, quinn::Connection)> =
                lock(&links).iter().filter_map(|(n, l)| l.conn.clone().filter(|_| l.down.is_none()).map(|c| (n.clone(), c))).collect();
            // (The local holder has no connection: its status is what it was given.)
            for (name, conn) in conns {
                if let Some(s) = Self::ask_status(&conn, model, epoch, ids.fetch_add(1, Ordering::Relaxed), within).await {
                    if let Some(l) = lock(&links).get_mut(&name) {
                        l.status = Some(s);
                    }
                }
            }
        }
    }

    /// Workers currently marked down.
    pub fn down_workers(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.links).iter().filter(|(_, l)| l.down.is_some()).map(|(n, _)| n.clone()).collect();
        v.sort();
        v
    }

    /// Links, counters and statuses, in the placement's worker order.
    pub fn telemetry_snapshot(&self) -> ClusterTelemetry {
        let routing = self.routing();
        let links = lock(&self.links);
        let workers = routing
            .placement
            .workers
            .iter()
            .filter_map(|w| {
                let l = links.get(&w.name)?;
                let c = &l.counters;
                let (placed_experts, first_choice_experts) = routing.placed.get(&w.name).copied().unwrap_or_default();
                Some(WorkerLink {
                    name: w.name.clone(),
                    addr: w.addr.clone(),
                    up: l.local || (l.down.is_none() && l.conn.as_ref().is_some_and(|c| c.close_reason().is_none())),
                    path_rtt_ms: l.conn.as_ref().filter(|_| l.down.is_none()).map(|c| c.rtt().as_secs_f64() * 1e3),
                    placed_experts,
                    first_choice_experts,
                    requests: c.requests,
                    selections: c.selections,
                    bytes_sent: c.bytes_sent,
                    bytes_received: c.bytes_received,
                    errors: c.errors,
                    rtt_buckets: c.rtt_buckets.to_vec(),
                    rtt_sum_s: c.rtt_sum,
                    status: l.status.clone(),
                })
            })
            .collect::<Vec<_>>();
        ClusterTelemetry {
            round_trips: workers.iter().map(|w| w.requests).sum(),
            workers,
            tokens: self.tokens.load(Ordering::Relaxed),
            network_wait_s: self.wait_ns.load(Ordering::Relaxed) as f64 / 1e9,
            failovers: self.failovers.load(Ordering::Relaxed),
            placement_epoch: routing.placement.epoch,
        }
    }

    /// A live connection to `name`, or `None` while it is down. A closed connection, or a down
    /// worker whose backoff has passed, is redialled in the background.
    fn connection(&self, name: &str) -> Option<quinn::Connection> {
        let mut links = lock(&self.links);
        let l = links.get_mut(name)?;
        match (&l.conn, l.down) {
            (Some(c), None) if c.close_reason().is_none() => return Some(c.clone()),
            (_, Some((until, _))) if Instant::now() < until => return None,
            _ => {}
        }
        if l.down.is_none() {
            tracing::warn!(worker = name, "connection lost; worker marked down");
            l.down = Some((Instant::now() + BACKOFF_START, BACKOFF_START));
        }
        if !l.redialing {
            l.redialing = true;
            let dial = self.dialer().dial(l.addr, self.routing().placement.epoch);
            let (links, name) = (self.links.clone(), name.to_string());
            self.rt.spawn(async move {
                let fresh = dial.await;
                let mut links = lock(&links);
                let Some(l) = links.get_mut(&name) else { return };
                l.redialing = false;
                match fresh {
                    Ok((c, status)) => {
                        tracing::info!(worker = %name, "worker re-admitted");
                        l.conn = Some(c);
                        l.down = None;
                        l.status = status.or(l.status.take());
                    }
                    Err(_) => {
                        let backoff = l.down.map_or(BACKOFF_START, |(_, b)| (b * 2).min(BACKOFF_MAX));
                        l.conn = None;
                        l.down = Some((Instant::now() + backoff, backoff));
                    }
                }
            });
        }
        None
    }

    fn mark_down(&self, name: &str) {
        let mut links = lock(&self.links);
        if let Some(l) = links.get_mut(name) {
            if l.down.is_none() {
                tracing::warn!(worker = name, "worker marked down");
            }
            let backoff = l.down.map_or(BACKOFF_START, |(_, b)| (b * 2).min(BACKOFF_MAX));
            l.down = Some((Instant::now() + backoff, backoff));
            if let Some(c) = l.conn.take() {
                c.close(0u32.into(), b"marked down");
            }
        }
    }

    /// Dials, now and in parallel, those of `names` without a live connection (ignoring their
    /// backoff; bounded by the connect timeout); whether any came back.
    fn redial_now(&self, names: &[String]) -> bool {
        let targets: Vec<(String, SocketAddr)> = {
            let links = lock(&self.links);
            names
                .iter()
                .filter_map(|n| {
                    links
                        .get(n)
                        .filter(|l| !l.local && l.conn.as_ref().is_none_or(|c| c.close_reason().is_some() || l.down.is_some()))
                        .map(|l| (n.clone(), l.addr))
                })
                .collect()
        };
        if targets.is_empty() {
            return false;
        }
        let attempts = self.dialer().dial_all(&self.rt, &targets, self.routing().placement.epoch);
        let mut links = lock(&self.links);
        let mut any = false;
        for ((name, _), attempt) in targets.into_iter().zip(attempts) {
            if let (Some(l), Ok((c, status))) = (links.get_mut(&name), attempt) {
                tracing::info!(worker = %name, "worker re-admitted");
                l.conn = Some(c);
                l.down = None;
                l.status = status.or(l.status.take());
                any = true;
            }
        }
        any
    }

    /// Workers that are not `holders` but said they load unassigned experts, in name order.
    fn volunteers(&self, holders: &[String]) -> Vec<String> {
        let links = lock(&self.links);
        let mut v: Vec<String> =
            links.iter().filter(|(n, l)| !holders.contains(n) && l.status.as_ref().is_some_and(|s| s.loads_unassigned)).map(|(n, _)| n.clone()).collect();
        v.sort();
        v
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

    fn count(&self, name: &str, sent: usize, received: usize, selections: usize, took: Duration, ok: bool) {
        if let Some(l) = lock(&self.links).get_mut(name) {
            let c = &mut l.counters;
            c.requests += 1;
            c.bytes_sent += sent as u64;
            c.bytes_received += received as u64;
            if ok {
                c.selections += selections as u64;
            } else {
                c.errors += 1;
            }
            let s = took.as_secs_f64();
            c.rtt_buckets[RTT_BUCKETS.iter().position(|b| s <= *b).unwrap_or(RTT_BUCKETS.len())] += 1;
            c.rtt_sum += s;
        }
    }
}

impl ExpertDispatch for RemoteExperts {
    fn wants_lookahead(&self) -> bool {
        true
    }

    /// One-way hints: each worker hears the predicted experts it holds first.
    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let routing = self.routing();
        let mut per_worker: HashMap<String, Vec<u32>> = HashMap::new();
        for &e in experts {
            if let Some(h) = routing.placement.holders(layer, e as usize).and_then(|h| h.first()) {
                per_worker.entry(h.clone()).or_default().push(e);
            }
        }
        for (name, list) in per_worker {
            if let Some((_, local)) = self.local.as_ref().filter(|(n, _)| *n == name) {
                local.prefetch(layer, &list);
                continue;
            }
            let Some(conn) = lock(&self.links).get(&name).and_then(|l| l.conn.clone().filter(|_| l.down.is_none())) else { continue };
            let frame = wire::encode_hint(self.model, routing.placement.epoch, layer as u32, 1, &list);
            self.rt.spawn(async move {
                if let Ok((mut send, _recv)) = conn.open_bi().await {
                    let _ = send.write_all(&frame).await;
                    let _ = send.finish();
                }
            });
        }
    }

    fn cluster(&self) -> Option<ClusterTelemetry> {
        Some(self.telemetry_snapshot())
    }

    fn network_wait(&self) -> Option<Duration> {
        Some(Duration::from_nanos(self.wait_ns.load(Ordering::Relaxed)))
    }

    fn first_holders(&self, layer: usize) -> Option<Vec<u16>> {
        let p = &self.routing().placement;
        let l = p.layers.iter().find(|l| l.layer == layer)?;
        Some(l.replicas.iter().map(|h| h.first().and_then(|n| p.workers.iter().position(|w| &w.name == n)).map_or(u16::MAX, |i| i as u16)).collect())
    }

    fn end_turn(&self) -> Result<(), String> {
        self.local.as_ref().map_or(Ok(()), |(_, local)| local.end_turn())
    }

    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        let layer = batch.layer;
        if layer == self.first_moe_layer {
            self.tokens.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        }
        let rows_bytes: Bytes = batch.rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        let slots = batch.experts.len();
        // Per slot, the workers already tried; a slot is served once its answer is added.
        let mut tried: Vec<HashSet<String>> = vec![HashSet::new(); slots];
        let mut pending: Vec<usize> = (0..slots).collect();
        let mut round = 0;
        let mut routing = self.routing();
        let (mut reloaded, mut redialed) = (false, false);
        while !pending.is_empty() {
            round += 1;
            // Each pending slot to its first holder that is up and not yet tried; when none is
            // left, to a volunteer that loads it from its own disk.
            let mut per_worker: HashMap<String, Vec<usize>> = HashMap::new();
            let mut conns: HashMap<String, quinn::Connection> = HashMap::new();
            let mut stranded = None;
            for &slot in &pending {
                let e = batch.experts[slot];
                let holders = routing
                    .placement
                    .holders(layer, e as usize)
                    .ok_or_else(|| DispatchError::Remote(format!("the placement has no holder for layer {layer} expert {e}")))?;
                let local_name = self.local.as_ref().map(|l| &l.0);
                let mut usable = |h: &String, tried: &mut HashSet<String>| {
                    if tried.contains(h) {
                        return false;
                    }
                    if Some(h) == local_name {
                        return true;
                    }
                    if let Some(c) = conns.get(h) {
                        if c.close_reason().is_none() {
                            return true;
                        }
                        tried.insert(h.clone());
                        return false;
                    }
                    match self.connection(h) {
                        Some(c) => {
                            conns.insert(h.clone(), c);
                            true
                        }
                        None => {
                            tried.insert(h.clone());
                            false
                        }
                    }
                };
                let mut pick = holders.iter().find(|h| usable(h, &mut tried[slot])).cloned();
                if pick.is_none() {
                    pick = self.volunteers(holders).into_iter().find(|h| usable(h, &mut tried[slot]));
                }
                let Some(h) = pick else {
                    stranded = Some(slot);
                    break;
                };
                if h != holders[0] && round == 1 {
                    // Served by another than the first holder because that one is down.
                    self.failovers.fetch_add(1, Ordering::Relaxed);
                }
                per_worker.entry(h).or_default().push(slot);
            }
            if let Some(slot) = stranded {
                // Nobody left for this selection. Before failing the request, once, dial again
                // now every worker that could serve it (a restarted worker is back within a
                // connect timeout, not after its backoff).
                let e = batch.experts[slot];
                let holders = routing.placement.holders(layer, e as usize).unwrap_or_default();
                let candidates: Vec<String> =
                    holders.iter().cloned().chain(self.volunteers(holders)).chain(lock(&self.links).keys().filter(|n| !holders.contains(n)).cloned()).collect();
                if !redialed && self.redial_now(&candidates) {
                    redialed = true;
                    tried.iter_mut().for_each(HashSet::clear);
                    continue;
                }
                let mut names: Vec<&String> = tried[slot].iter().collect();
                names.sort();
                return Err(DispatchError::Remote(format!(
                    "layer {layer} expert {e}: no worker can serve it (tried {}; no other reachable worker loads it from its own disk)",
                    names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
            let mine_here = self.local.as_ref().and_then(|(name, _)| per_worker.remove(name));
            let requests: Vec<(String, u64, Vec<usize>, Bytes)> = per_worker
                .into_iter()
                .map(|(name, mine)| {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let mut selections = vec![(ELSEWHERE, 0.0f32); slots];
                    for &s in &mine {
                        selections[s] = (batch.experts[s], batch.weights[s]);
                    }
                    let req = wire::Request {
                        request_id: id,
                        model: self.model,
                        epoch: routing.placement.epoch,
                        layer: layer as u32,
                        hidden: batch.hidden as u32,
                        top_k: batch.top_k as u32,
                        rows: rows_bytes.clone(),
                        selections,
                    };
                    (name, id, mine, req.encode())
                })
                .collect();
            // A response is the sums, or an error frame.
            let max_answer = wire::HEADER_LEN + (acc.len() * 8).max(4 + wire::MAX_ERROR_MESSAGE);
            let handles: Vec<_> = requests
                .iter()
                .map(|(name, _, _, frame)| {
                    let conn = conns.get(name).cloned();
                    let (timeout, frame) = (self.timeouts.answer, frame.clone());
                    self.rt.spawn(async move {
                        let t0 = Instant::now();
                        let r = match conn {
                            Some(c) => Self::ask(&c, frame, timeout, max_answer).await,
                            None => Err("not connected".into()),
                        };
                        (r, t0.elapsed())
                    })
                })
                .collect();
            let mut failed = Vec::new();
            let mut moved = false;
            // This node's own selections, computed while the others' are in flight.
            if let (Some((name, local)), Some(mine)) = (&self.local, mine_here) {
                let t0 = Instant::now();
                let mut experts = vec![ELSEWHERE; slots];
                let mut weights = vec![0.0f32; slots];
                for &s in &mine {
                    experts[s] = batch.experts[s];
                    weights[s] = batch.weights[s];
                }
                let mut sums = vec![0i64; acc.len()];
                match local.dispatch(&MoeBatch { experts: &experts, weights: &weights, ..*batch }, &mut sums) {
                    Ok(()) => {
                        self.count(name, 0, 0, mine.len(), t0.elapsed(), true);
                        for (a, s) in acc.iter_mut().zip(&sums) {
                            *a = a
                                .checked_add(*s)
                                .ok_or_else(|| DispatchError::Remote(format!("fixed-point overflow adding this node's sums (worker {name})")))?;
                        }
                    }
                    Err(e) => {
                        self.count(name, 0, 0, mine.len(), t0.elapsed(), false);
                        tracing::warn!(worker = %name, "this node cannot serve its own experts: {e}");
                        failed.push((name.clone(), mine, false));
                    }
                }
            }
            let waited = Instant::now();
            let answers = self.rt.block_on(async {
                let mut out = Vec::with_capacity(handles.len());
                for h in handles {
                    out.push(h.await.unwrap_or_else(|e| (Err(e.to_string()), Duration::ZERO)));
                }
                out
            });
            self.wait_ns.fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for ((name, id, mine, frame), (answer, took)) in requests.into_iter().zip(answers) {
                let received = answer.as_ref().map_or(0, |a| a.1);
                match answer.map(|a| a.0) {
                    Ok(Frame::Response(r)) if r.request_id == id && r.layer as usize == layer && r.sums.len() == acc.len() => {
                        self.count(&name, frame.len(), received, mine.len(), took, true);
                        for (a, s) in acc.iter_mut().zip(&r.sums) {
                            *a = a.checked_add(*s).ok_or_else(|| DispatchError::Remote(format!("fixed-point overflow adding worker {name}'s sums")))?;
                        }
                    }
                    // A worker that answers with an error is up but cannot serve this: the next
                    // holder tries (it stays up); one that does not answer is marked down.
                    Ok(Frame::Error { code, message, .. }) => {
                        self.count(&name, frame.len(), received, mine.len(), took, false);
                        moved |= code == Some(ErrorCode::Moved);
                        tracing::warn!(worker = %name, ?code, "{message}");
                        failed.push((name, mine, false));
                    }
                    Ok(other) => return Err(DispatchError::Remote(format!("worker {name} answered request {id} with {other:?}"))),
                    Err(e) => {
                        self.count(&name, frame.len(), received, mine.len(), took, false);
                        tracing::warn!(worker = %name, "{e}");
                        failed.push((name, mine, true));
                    }
                }
            }
            pending.clear();
            // A worker on a newer placement: adopt it (once per layer) and send everything left
            // again under it, every worker a candidate again.
            if moved && !reloaded {
                if let Some(reload) = &self.reload {
                    reloaded = true;
                    match reload().and_then(|p| self.set_placement(p)) {
                        Ok(()) => {
                            routing = self.routing();
                            let mut again = Vec::new();
                            for (name, mine, down) in failed.drain(..) {
                                if down {
                                    self.mark_down(&name);
                                }
                                again.extend(mine);
                            }
                            tried.iter_mut().for_each(HashSet::clear);
                            pending.extend(again);
                            continue;
                        }
                        Err(e) => tracing::warn!("a worker serves another placement epoch, and no newer placement is at hand: {e}"),
                    }
                }
            }
            for (name, mine, down) in failed {
                if down {
                    self.mark_down(&name);
                }
                self.failovers.fetch_add(mine.len() as u64, Ordering::Relaxed);
                for s in mine {
                    tried[s].insert(name.clone());
                    pending.push(s);
                }
            }
            if round > 64 {
                return Err(DispatchError::Remote(format!("layer {layer}: gave up after {round} rounds of failover")));
            }
        }
        Ok(())
    }
}
