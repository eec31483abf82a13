//! The coordinator's side of the data plane: an `ExpertDispatch` whose experts live on workers.
//! For each MoE layer, every involved worker gets — in parallel, each on its own QUIC stream of
//! the one connection per worker — all the batch's rows and, per row, the selections it holds
//! (the others marked `ELSEWHERE`); their fixed-point partial sums are added into the result,
//! which is therefore the single box's bits whatever the placement (DESIGN.md §1).
//!
//! Must never: use a worker the placement does not name for an expert, or add a reply that is
//! not the answer to the request sent (id, layer and size are checked).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::dispatch::{DispatchError, ExpertDispatch, MoeBatch, ELSEWHERE};
use crate::placement::Placement;
use crate::transport::{self, JoinToken, TransportError};
use crate::wire::{self, Frame};

pub struct RemoteExperts {
    rt: tokio::runtime::Runtime,
    _endpoint: quinn::Endpoint,
    /// Per worker name, its connection.
    conns: HashMap<String, quinn::Connection>,
    placement: Placement,
    model: u64,
    next_id: AtomicU64,
    timeout: Duration,
}

impl RemoteExperts {
    /// Connects to every worker the placement names (proving the join token).
    pub fn connect(placement: Placement, model: u64, token: &JoinToken, timeout: Duration) -> Result<Self, TransportError> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("remote-experts").enable_all().build().map_err(|e| TransportError::Tls(e.to_string()))?;
        let endpoint = rt.block_on(async { transport::client() })?;
        let mut conns = HashMap::new();
        for w in &placement.workers {
            let addr: SocketAddr = w.addr.parse().map_err(|e| TransportError::Connect { addr: ([0, 0, 0, 0], 0).into(), reason: format!("worker {} address {:?}: {e}", w.name, w.addr) })?;
            let conn = rt.block_on(transport::connect(&endpoint, addr, token))?;
            conns.insert(w.name.clone(), conn);
        }
        Ok(RemoteExperts { rt, _endpoint: endpoint, conns, placement, model, next_id: AtomicU64::new(1), timeout })
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
    fn dispatch(&self, batch: &MoeBatch<'_>, acc: &mut [i64]) -> Result<(), DispatchError> {
        let layer = batch.layer;
        let rows_bytes: Bytes = batch.rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        // Each selection goes to the first holder the placement lists.
        let mut per_worker: HashMap<&str, Vec<(u32, f32)>> = HashMap::new();
        for (slot, (&e, &w)) in batch.experts.iter().zip(batch.weights).enumerate() {
            let holders = self.placement.holders(layer, e as usize).ok_or_else(|| DispatchError::Remote(format!("the placement has no holder for layer {layer} expert {e}")))?;
            let first = holders[0].as_str();
            let sel = per_worker.entry(first).or_insert_with(|| vec![(ELSEWHERE, 0.0); batch.experts.len()]);
            sel[slot] = (e, w);
        }
        let requests: Vec<(&str, u64, Bytes)> = per_worker
            .into_iter()
            .map(|(name, selections)| {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let req = wire::Request { request_id: id, model: self.model, epoch: self.placement.epoch, layer: layer as u32, hidden: batch.hidden as u32, top_k: batch.top_k as u32, rows: rows_bytes.clone(), selections };
                (name, id, req.encode())
            })
            .collect();
        let answers = self.rt.block_on(async {
            let mut set = Vec::with_capacity(requests.len());
            for (name, id, frame) in &requests {
                let conn = self.conns.get(*name).cloned();
                let timeout = self.timeout;
                let frame = frame.clone();
                set.push(tokio::spawn(async move {
                    match conn {
                        Some(c) => Self::ask(&c, frame, timeout).await,
                        None => Err("not connected".into()),
                    }
                }));
                let _ = id;
            }
            let mut out = Vec::with_capacity(set.len());
            for h in set {
                out.push(h.await.map_err(|e| e.to_string()).and_then(|r| r));
            }
            out
        });
        for ((name, id, _), answer) in requests.iter().zip(answers) {
            match answer {
                Ok(Frame::Response(r)) if r.request_id == *id && r.layer as usize == layer && r.sums.len() == acc.len() => {
                    for (a, s) in acc.iter_mut().zip(&r.sums) {
                        *a = a.checked_add(*s).ok_or_else(|| DispatchError::Remote(format!("fixed-point overflow adding worker {name}'s sums")))?;
                    }
                }
                Ok(Frame::Error { code, message, .. }) => return Err(DispatchError::Remote(format!("worker {name}: {code:?}: {message}"))),
                Ok(other) => return Err(DispatchError::Remote(format!("worker {name} answered request {id} with {other:?}"))),
                Err(e) => return Err(DispatchError::Remote(format!("worker {name}: {e}"))),
            }
        }
        Ok(())
    }
}
