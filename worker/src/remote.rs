//! The coordinator's side of the data plane: an `ExpertDispatch` whose experts live on workers.
//! For each MoE layer, every involved worker gets — in parallel, each on its own QUIC stream of
//! the one connection per worker — all the batch's rows and, per row, the selections it serves
//! (the others marked `ELSEWHERE`); their fixed-point partial sums are added into the result,
//! which is therefore the single box's bits whatever the placement (DESIGN.md §1).
//!
//! Failure: a worker that does not answer in time, or whose connection is gone, is marked down
//! and its selections go to each expert's next holder in the placement, until every selection is
//! served or an expert has no reachable holder left (an error naming the layer, the expert and
//! the workers tried — never an answer from a different model). A down worker is retried after a
//! backoff (1 s, doubling to 30 s) and re-admitted when it answers the join-token handshake.
//!
//! Must never: use a worker the placement does not name for an expert, or add a reply that is
//! not the answer to the request sent (id, layer and size are checked).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::dispatch::{DispatchError, ExpertDispatch, MoeBatch, ELSEWHERE};
use crate::placement::Placement;
use crate::transport::{self, JoinToken, TransportError};
use crate::wire::{self, Frame};

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(2);

struct Link {
    addr: SocketAddr,
    conn: Option<quinn::Connection>,
    /// Down until this time, with the backoff that set it.
    down: Option<(Instant, Duration)>,
}

pub struct RemoteExperts {
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
    token: JoinToken,
    links: Mutex<HashMap<String, Link>>,
    placement: Placement,
    model: u64,
    next_id: AtomicU64,
    timeout: Duration,
    /// Selections served by a later holder than the placement's first (telemetry).
    pub failovers: AtomicU64,
}

impl RemoteExperts {
    /// Connects to the workers the placement names (proving the join token). A worker that cannot
    /// be reached now starts down (its experts' other holders serve); a refused token is an error.
    pub fn connect(placement: Placement, model: u64, token: &JoinToken, timeout: Duration) -> Result<Self, TransportError> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("remote-experts").enable_all().build().map_err(|e| TransportError::Tls(e.to_string()))?;
        let endpoint = rt.block_on(async { transport::client() })?;
        let mut links = HashMap::new();
        let mut reachable = 0;
        let mut errors = Vec::new();
        for w in &placement.workers {
            let addr: SocketAddr = w.addr.parse().map_err(|e| TransportError::Connect { addr: ([0, 0, 0, 0], 0).into(), reason: format!("worker {} address {:?}: {e}", w.name, w.addr) })?;
            let conn = match rt.block_on(async { tokio::time::timeout(timeout.min(Duration::from_secs(10)), transport::connect(&endpoint, addr, token)).await }) {
                Ok(Ok(c)) => {
                    reachable += 1;
                    Some(c)
                }
                Ok(Err(TransportError::Refused)) => return Err(TransportError::Refused),
                Ok(Err(e)) => {
                    errors.push(format!("{}: {e}", w.addr));
                    None
                }
                Err(_) => {
                    errors.push(format!("{}: timed out", w.addr));
                    None
                }
            };
            let down = conn.is_none().then(|| (Instant::now() + BACKOFF_START, BACKOFF_START));
            links.insert(w.name.clone(), Link { addr, conn, down });
        }
        if reachable == 0 {
            let first = links.values().next().map_or(([0, 0, 0, 0], 0).into(), |l: &Link| l.addr);
            return Err(TransportError::Connect { addr: first, reason: format!("no worker can be reached: {}", errors.join("; ")) });
        }
        Ok(RemoteExperts { rt, endpoint, token: token.clone(), links: Mutex::new(links), placement, model, next_id: AtomicU64::new(1), timeout, failovers: AtomicU64::new(0) })
    }

    /// Workers currently marked down.
    pub fn down_workers(&self) -> Vec<String> {
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = links.iter().filter(|(_, l)| l.down.is_some()).map(|(n, _)| n.clone()).collect();
        v.sort();
        v
    }

    /// A live connection to `name`, reconnecting a down worker whose backoff has passed.
    fn connection(&self, name: &str) -> Option<quinn::Connection> {
        let addr = {
            let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
            let l = links.get(name)?;
            match (&l.conn, l.down) {
                (Some(c), None) if c.close_reason().is_none() => return Some(c.clone()),
                (_, Some((until, _))) if Instant::now() < until => return None,
                _ => l.addr,
            }
        };
        let fresh = self.rt.block_on(async { tokio::time::timeout(RECONNECT_TIMEOUT, transport::connect(&self.endpoint, addr, &self.token)).await });
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let l = links.get_mut(name)?;
        match fresh {
            Ok(Ok(c)) => {
                tracing::info!(worker = name, "worker re-admitted");
                l.conn = Some(c.clone());
                l.down = None;
                Some(c)
            }
            _ => {
                let backoff = l.down.map_or(BACKOFF_START, |(_, b)| (b * 2).min(BACKOFF_MAX));
                l.conn = None;
                l.down = Some((Instant::now() + backoff, backoff));
                None
            }
        }
    }

    fn mark_down(&self, name: &str) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
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

    async fn ask(conn: &quinn::Connection, frame: Bytes, timeout: Duration) -> Result<Frame, String> {
        let work = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(&frame).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            let bytes = recv.read_to_end(wire::HEADER_LEN + wire::MAX_PAYLOAD as usize).await.map_err(|e| e.to_string())?;
            wire::decode(Bytes::from(bytes)).map_err(|e| e.to_string())
        };
        tokio::time::timeout(timeout, work).await.map_err(|_| format!("no answer within {timeout:?}"))?
    }
}

impl ExpertDispatch for RemoteExperts {
    fn wants_lookahead(&self) -> bool {
        true
    }

    /// One-way hints: each worker hears the predicted experts it holds first.
    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let mut per_worker: HashMap<String, Vec<u32>> = HashMap::new();
        for &e in experts {
            if let Some(h) = self.placement.holders(layer, e as usize).and_then(|h| h.first()) {
                per_worker.entry(h.clone()).or_default().push(e);
            }
        }
        for (name, list) in per_worker {
            let Some(conn) = self.links.lock().unwrap_or_else(|e| e.into_inner()).get(&name).and_then(|l| l.conn.clone().filter(|_| l.down.is_none())) else { continue };
            let frame = wire::encode_hint(self.model, self.placement.epoch, layer as u32, 1, &list);
            self.rt.spawn(async move {
                if let Ok((mut send, _recv)) = conn.open_bi().await {
                    let _ = send.write_all(&frame).await;
                    let _ = send.finish();
                }
            });
        }
    }

    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        let layer = batch.layer;
        let rows_bytes: Bytes = batch.rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        let slots = batch.experts.len();
        // Per slot, the holders not yet tried; a slot is served once its answer is added.
        let mut tried: Vec<HashSet<String>> = vec![HashSet::new(); slots];
        let mut pending: Vec<usize> = (0..slots).collect();
        let mut round = 0;
        while !pending.is_empty() {
            round += 1;
            // Each pending slot to its first holder that is up and not yet tried.
            let mut per_worker: HashMap<String, Vec<usize>> = HashMap::new();
            let mut conns: HashMap<String, quinn::Connection> = HashMap::new();
            for &slot in &pending {
                let e = batch.experts[slot];
                let holders = self.placement.holders(layer, e as usize).ok_or_else(|| DispatchError::Remote(format!("the placement has no holder for layer {layer} expert {e}")))?;
                let pick = holders.iter().find(|h| {
                    if tried[slot].contains(*h) {
                        return false;
                    }
                    if let Some(c) = conns.get(*h) {
                        return c.close_reason().is_none();
                    }
                    match self.connection(h) {
                        Some(c) => {
                            conns.insert((*h).clone(), c);
                            true
                        }
                        None => {
                            tried[slot].insert((*h).clone());
                            false
                        }
                    }
                });
                let Some(h) = pick else {
                    let mut names: Vec<&String> = tried[slot].iter().collect();
                    names.sort();
                    return Err(DispatchError::Remote(format!("layer {layer} expert {e}: no holder can be reached (tried {})", names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "))));
                };
                if h != &holders[0] && round == 1 {
                    // Served by a later holder because an earlier one is down.
                    self.failovers.fetch_add(1, Ordering::Relaxed);
                }
                per_worker.entry(h.clone()).or_default().push(slot);
            }
            let requests: Vec<(String, u64, Vec<usize>, Bytes)> = per_worker
                .into_iter()
                .map(|(name, mine)| {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let mut selections = vec![(ELSEWHERE, 0.0f32); slots];
                    for &s in &mine {
                        selections[s] = (batch.experts[s], batch.weights[s]);
                    }
                    let req = wire::Request { request_id: id, model: self.model, epoch: self.placement.epoch, layer: layer as u32, hidden: batch.hidden as u32, top_k: batch.top_k as u32, rows: rows_bytes.clone(), selections };
                    (name, id, mine, req.encode())
                })
                .collect();
            let answers = self.rt.block_on(async {
                let mut handles = Vec::with_capacity(requests.len());
                for (name, _, _, frame) in &requests {
                    let conn = conns.get(name).cloned();
                    let (timeout, frame) = (self.timeout, frame.clone());
                    handles.push(tokio::spawn(async move {
                        match conn {
                            Some(c) => Self::ask(&c, frame, timeout).await,
                            None => Err("not connected".into()),
                        }
                    }));
                }
                let mut out = Vec::with_capacity(handles.len());
                for h in handles {
                    out.push(h.await.map_err(|e| e.to_string()).and_then(|r| r));
                }
                out
            });
            let mut failed = Vec::new();
            for ((name, id, mine, _), answer) in requests.into_iter().zip(answers) {
                match answer {
                    Ok(Frame::Response(r)) if r.request_id == id && r.layer as usize == layer && r.sums.len() == acc.len() => {
                        for (a, s) in acc.iter_mut().zip(&r.sums) {
                            *a = a.checked_add(*s).ok_or_else(|| DispatchError::Remote(format!("fixed-point overflow adding worker {name}'s sums")))?;
                        }
                    }
                    // A worker that answers with an error is up but cannot serve this: the next
                    // holder tries (it stays up); one that does not answer is marked down.
                    Ok(Frame::Error { code, message, .. }) => {
                        tracing::warn!(worker = %name, ?code, "{message}");
                        failed.push((name, mine, false));
                    }
                    Ok(other) => return Err(DispatchError::Remote(format!("worker {name} answered request {id} with {other:?}"))),
                    Err(e) => {
                        tracing::warn!(worker = %name, "{e}");
                        failed.push((name, mine, true));
                    }
                }
            }
            pending.clear();
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
