//! A worker node's QUIC service (`shimmer worker`): authenticates each coordinator's connection
//! (the join token and/or operator certificates, `transport.rs`), then answers every stream's request frame with the partial
//! sums of the selections it was given, computed by its own expert dispatcher (its store), and
//! takes prefetch hints, and answers status questions (what it is, what it holds, whether it
//! loads experts it was not assigned). A bad frame gets an error frame on its stream; the
//! connection and everyone else's streams go on.
//!
//! A worker answers for the placement epochs of its `EpochWindow`: in static mode one; in a
//! cluster the active one, the one before it (so a request in flight finishes on its epoch) and
//! a proposed one it is preparing. The control plane moves the window and the assignment.
//!
//! Must never: compute for another model or an epoch outside its window, or let one stream's
//! failure end the process; serve an unassigned expert when told to serve its assignment only.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::{Bytes, BytesMut};

use shimmer_cluster::wire::{self, ErrorCode, Frame, Header, HEADER_LEN};
use shimmer_experts::{ExpertDispatch, MoeBatch, ELSEWHERE};
use shimmer_store::ExpertStore;

use crate::transport::{self, Credentials};

/// The placement epochs a worker answers requests for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EpochWindow {
    /// The epoch it reports (the active one).
    pub active: u64,
    /// The active epoch before it: requests in flight on it still finish.
    pub previous: Option<u64>,
    /// A proposed epoch this worker is part of.
    pub proposed: Option<u64>,
}

impl EpochWindow {
    pub fn only(epoch: u64) -> Self {
        EpochWindow { active: epoch, previous: None, proposed: None }
    }

    pub fn accepts(&self, epoch: u64) -> bool {
        epoch == self.active || self.previous == Some(epoch) || self.proposed == Some(epoch)
    }
}

/// The (layer, expert) pairs a placement gives a worker.
pub type Assigned = HashSet<(u32, u32)>;

pub struct WorkerState {
    pub dispatch: Arc<dyn ExpertDispatch>,
    /// The store behind `dispatch`, when it is one (its counters go into the status).
    pub store: Option<Arc<ExpertStore>>,
    /// 64-bit identity of the model served (`model_id`).
    pub model: u64,
    epochs: RwLock<EpochWindow>,
    pub creds: Credentials,
    pub hidden: usize,
    pub requests: AtomicU64,
    /// The worker's name in the placement ("" without one).
    pub name: String,
    /// The (layer, expert) pairs the placement gives this worker (`None`: no placement).
    assigned: RwLock<Option<Arc<Assigned>>>,
    /// Refuse selections outside `assigned` (a node whose disk or RAM is meant for its slice only).
    pub assigned_only: bool,
}

impl WorkerState {
    pub fn new(dispatch: Arc<dyn ExpertDispatch>, model: u64, epoch: u64, creds: Credentials, hidden: usize) -> Self {
        WorkerState {
            dispatch,
            store: None,
            model,
            epochs: RwLock::new(EpochWindow::only(epoch)),
            creds,
            hidden,
            requests: AtomicU64::new(0),
            name: String::new(),
            assigned: RwLock::new(None),
            assigned_only: false,
        }
    }

    pub fn epochs(&self) -> EpochWindow {
        *self.epochs.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_epochs(&self, window: EpochWindow) {
        *self.epochs.write().unwrap_or_else(|p| p.into_inner()) = window;
    }

    pub fn assigned(&self) -> Option<Arc<Assigned>> {
        self.assigned.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_assigned(&self, assigned: Option<Assigned>) {
        *self.assigned.write().unwrap_or_else(|p| p.into_inner()) = assigned.map(Arc::new);
    }

    /// A worker serving `store`'s experts.
    pub fn serving_store(store: Arc<ExpertStore>, model: u64, epoch: u64, creds: Credentials, hidden: usize) -> Self {
        WorkerState { store: Some(store.clone()), ..Self::new(store, model, epoch, creds, hidden) }
    }

    pub fn status(&self) -> WorkerStatus {
        let t = self.store.as_ref().map(|s| s.telemetry());
        WorkerStatus {
            name: self.name.clone(),
            epoch: self.epochs().active,
            assigned_experts: self.assigned().map_or(0, |a| a.len()),
            loads_unassigned: !self.assigned_only,
            budget_bytes: t.as_ref().map_or(0, |t| t.budget_bytes),
            expert_bytes: t.as_ref().map_or(0, |t| t.expert_bytes),
            capacity_experts: t.as_ref().map_or(0, |t| t.capacity_experts),
            resident_experts: t.as_ref().map_or(0, |t| t.resident_experts),
            requests: self.requests.load(Ordering::Relaxed),
            disk_reads: t.as_ref().map_or(0, |t| t.reads),
        }
    }
}

pub use shimmer_cluster::{model_id, WorkerStatus};

/// Serves connections until the endpoint closes.
pub async fn serve(endpoint: quinn::Endpoint, state: Arc<WorkerState>) {
    while let Some(incoming) = endpoint.accept().await {
        let state = state.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            if let Err(e) = transport::authenticate(&conn, &state.creds).await {
                tracing::warn!(peer = %conn.remote_address(), "refused: {e}");
                return;
            }
            while let Ok((send, recv)) = conn.accept_bi().await {
                let state = state.clone();
                tokio::spawn(async move { stream(send, recv, state).await });
            }
        });
    }
}

async fn stream(mut send: quinn::SendStream, mut recv: quinn::RecvStream, state: Arc<WorkerState>) {
    let reply = match read_frame(&mut recv).await {
        Err((id, code, msg)) => Some(wire::encode_error(id, code, &msg)),
        Ok(frame) => answer(frame, &state).await,
    };
    if let Some(bytes) = reply {
        let _ = send.write_all(&bytes).await;
    }
    let _ = send.finish();
}

/// Reads one frame: the header first (checked against the limits), then exactly its payload.
async fn read_frame(recv: &mut quinn::RecvStream) -> Result<Frame, (u64, ErrorCode, String)> {
    let mut head = [0u8; HEADER_LEN];
    recv.read_exact(&mut head).await.map_err(|e| (0, ErrorCode::Malformed, format!("short frame: {e}")))?;
    let h = Header::decode(&head).map_err(|e| (0, e.code(), e.to_string()))?;
    let mut buf = BytesMut::zeroed(HEADER_LEN + h.payload_len as usize);
    buf[..HEADER_LEN].copy_from_slice(&head);
    recv.read_exact(&mut buf[HEADER_LEN..]).await.map_err(|e| (h.request_id, ErrorCode::Malformed, format!("payload cut short: {e}")))?;
    wire::decode(buf.freeze()).map_err(|e| (h.request_id, e.code(), e.to_string()))
}

async fn answer(frame: Frame, state: &Arc<WorkerState>) -> Option<Bytes> {
    match frame {
        Frame::Request(req) => {
            if req.model != state.model {
                return Some(wire::encode_error(req.request_id, ErrorCode::WrongModel, "this worker serves another model"));
            }
            let window = state.epochs();
            if !window.accepts(req.epoch) {
                return Some(wire::encode_error(
                    req.request_id,
                    ErrorCode::Moved,
                    &format!("placement epoch {} is not one this worker answers for (its epoch is {})", req.epoch, window.active),
                ));
            }
            let epoch = req.epoch;
            if req.hidden as usize != state.hidden {
                return Some(wire::encode_error(
                    req.request_id,
                    ErrorCode::Malformed,
                    &format!("hidden size {} is not the model's {}", req.hidden, state.hidden),
                ));
            }
            if let (true, Some(mine)) = (state.assigned_only, state.assigned()) {
                if let Some((e, _)) = req.selections.iter().find(|(e, _)| *e != ELSEWHERE && !mine.contains(&(req.layer, *e))) {
                    return Some(wire::encode_error(
                        req.request_id,
                        ErrorCode::Unavailable,
                        &format!("worker {} serves only its assigned experts; layer {} expert {e} is not one", state.name, req.layer),
                    ));
                }
            }
            state.requests.fetch_add(1, Ordering::Relaxed);
            let id = req.request_id;
            let st = state.clone();
            let computed = tokio::task::spawn_blocking(move || {
                let rows = req.activations();
                let experts: Vec<u32> = req.selections.iter().map(|s| s.0).collect();
                let weights: Vec<f32> = req.selections.iter().map(|s| s.1).collect();
                let batch = MoeBatch {
                    layer: req.layer as usize,
                    hidden: req.hidden as usize,
                    rows: &rows,
                    top_k: req.top_k as usize,
                    experts: &experts,
                    weights: &weights,
                };
                let mut acc = vec![0i64; rows.len()];
                st.dispatch.dispatch(&batch, &mut acc).map(|_| wire::Response {
                    request_id: req.request_id,
                    model: st.model,
                    epoch,
                    layer: req.layer,
                    hidden: req.hidden,
                    sums: acc,
                })
            })
            .await;
            Some(match computed {
                Ok(Ok(resp)) => resp.encode(),
                Ok(Err(e)) => wire::encode_error(id, ErrorCode::Unavailable, &e.to_string()),
                Err(e) => wire::encode_error(id, ErrorCode::Internal, &e.to_string()),
            })
        }
        Frame::Hint { layer, experts } => {
            state.dispatch.prefetch(layer as usize, &experts);
            None
        }
        Frame::Status { request_id } => {
            let json = serde_json::to_string(&state.status()).unwrap_or_default();
            Some(
                wire::encode_status_reply(request_id, state.model, state.epochs().active, &json)
                    .unwrap_or_else(|| wire::encode_error(request_id, ErrorCode::Internal, "status too large")),
            )
        }
        Frame::StatusReply { request_id, .. } => Some(wire::encode_error(request_id, ErrorCode::Malformed, "a worker takes questions, not status replies")),
        Frame::Response(r) => Some(wire::encode_error(r.request_id, ErrorCode::Malformed, "a worker takes requests, not responses")),
        Frame::Error { request_id, .. } => Some(wire::encode_error(request_id, ErrorCode::Malformed, "a worker takes requests, not errors")),
    }
}
