//! A worker member following the cluster's placement of its model: the epochs it answers for,
//! the experts assigned to it, and its part in make-before-break — when a proposed epoch names
//! it, it reads its new share from its own disk and only then says it is ready, so the epoch
//! becomes active only once every holder holds what it is given.
//!
//! `view` is the decision (pure, tested here); `follow` is the loop that carries it out on a
//! thread of its own, polling the member's applied state.
//!
//! Must never: say ready before its share is read; answer for an epoch the cluster does not
//! (active, the one before it, or a proposed one naming it); block the data plane.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shimmer_control::state::Command;
use shimmer_control::{ModelPlacement, Outcome, PlacementRecord};

use super::ControlPlane;
use crate::server::{EpochWindow, WorkerState};

const POLL: Duration = Duration::from_millis(200);
/// How soon a failed preparation (a read error, a proposal that timed out) is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// What a worker does about its model's placements.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView<'a> {
    pub window: EpochWindow,
    /// The placement its assignment comes from: the proposed one naming it, else the active one
    /// if it names it.
    pub assignment: Option<&'a PlacementRecord>,
    /// A proposed epoch naming it that it has not said it is ready for.
    pub prepare: Option<u64>,
}

pub fn view<'a>(placement: &'a ModelPlacement, me: &str) -> WorkerView<'a> {
    let proposed = placement.proposed.as_ref().filter(|p| p.worker_names().contains(me));
    let active = placement.active.as_ref().filter(|a| a.worker_names().contains(me));
    WorkerView {
        window: EpochWindow { active: placement.epoch(), previous: placement.previous, proposed: proposed.map(|p| p.epoch) },
        assignment: proposed.or(active),
        prepare: proposed.filter(|_| !placement.ready.contains(me)).map(|p| p.epoch),
    }
}

/// Follows `model`'s placements until `stop` is set: moves `state`'s epoch window and
/// assignment, and prepares proposed epochs (reading the share from `state.store` when it has
/// one) before saying ready.
pub fn follow(control: Arc<ControlPlane>, state: Arc<WorkerState>, model: String, moe_layers: Vec<usize>, stop: Arc<AtomicBool>) {
    let me = state.name.clone();
    let mut seen_version = 0;
    let mut assigned_epoch = None;
    let mut retry_at: Option<Instant> = None;
    // The epoch it last said ready for: said once, unless saying it failed.
    let mut said_ready = None;
    while !stop.load(Ordering::SeqCst) && !control.stopped() {
        let (version, placement) = control.placement(&model);
        let due = retry_at.is_some_and(|t| Instant::now() >= t);
        if version == seen_version && !due {
            std::thread::sleep(POLL);
            continue;
        }
        seen_version = version;
        retry_at = None;
        let Some(placement) = placement else { continue };
        let v = view(&placement, &me);
        if let Some(record) = v.assignment {
            if assigned_epoch != Some(record.epoch) {
                match record.placement.slice(&me, &moe_layers) {
                    Ok(slice) => {
                        state.set_assigned(Some(slice.assigned));
                        assigned_epoch = Some(record.epoch);
                    }
                    Err(e) => tracing::warn!(epoch = record.epoch, "the cluster's placement does not fit this worker: {e}"),
                }
            }
        }
        state.set_epochs(v.window);
        let (Some(epoch), Some(record)) = (v.prepare, v.assignment) else { continue };
        if said_ready == Some(epoch) && !due {
            continue;
        }
        match prepare(&control, &state, record, &me, &moe_layers) {
            Ok(()) => {
                said_ready = Some(epoch);
                tracing::info!(epoch, "ready for placement epoch {epoch}");
            }
            Err(e) => {
                tracing::warn!(epoch, "not ready for placement epoch {epoch} yet: {e}");
                retry_at = Some(Instant::now() + RETRY);
            }
        }
    }
}

/// Reads this worker's share of `record` from its disk, then says it is ready.
fn prepare(control: &ControlPlane, state: &WorkerState, record: &PlacementRecord, me: &str, moe_layers: &[usize]) -> Result<(), String> {
    let slice = record.placement.slice(me, moe_layers)?;
    if let Some(store) = &state.store {
        let mut wanted: Vec<(usize, usize)> = slice.assigned.iter().map(|&(l, e)| (l as usize, e as usize)).collect();
        wanted.sort_unstable();
        let read = store.load(&wanted).map_err(|e| format!("cannot read its experts: {e}"))?;
        tracing::info!(epoch = record.epoch, read, assigned = wanted.len(), "read its share of a proposed placement");
    }
    let command = Command::PlacementReady { model: record.placement.model.clone(), epoch: record.epoch, worker: me.to_string() };
    match control.propose(command).map_err(|e| e.to_string())? {
        Outcome::Applied => Ok(()),
        // Superseded meanwhile: the next state says what to do instead.
        Outcome::Rejected(why) => {
            tracing::info!("ready for epoch {} no longer needed: {why}", record.epoch);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(epoch: u64, workers: &[&str]) -> PlacementRecord {
        PlacementRecord {
            epoch,
            placement: shimmer_cluster::Placement {
                format: shimmer_cluster::placement::FORMAT.into(),
                version: shimmer_cluster::placement::VERSION,
                model: "m".into(),
                epoch,
                workers: workers.iter().map(|w| shimmer_cluster::placement::Worker { name: w.to_string(), addr: w.to_string(), ram_bytes: 1 }).collect(),
                layers: vec![],
            },
        }
    }

    #[test]
    fn a_worker_prepares_a_proposed_epoch_naming_it_and_answers_for_active_previous_and_its_proposed() {
        let mut p = ModelPlacement { proposed: Some(record(1, &["a", "b"])), ..Default::default() };
        let v = view(&p, "a");
        assert_eq!(v.window, EpochWindow { active: 0, previous: None, proposed: Some(1) });
        assert_eq!((v.prepare, v.assignment.map(|r| r.epoch)), (Some(1), Some(1)));
        p.ready.insert("a".into());
        assert_eq!(view(&p, "a").prepare, None, "said ready already");
        // Active 1, previous none, 2 proposed without b: b keeps epoch 1's share and does not prepare.
        p = ModelPlacement { active: Some(record(1, &["a", "b"])), proposed: Some(record(2, &["a"])), ..Default::default() };
        let b = view(&p, "b");
        assert_eq!((b.window, b.prepare, b.assignment.map(|r| r.epoch)), (EpochWindow::only(1), None, Some(1)));
        let a = view(&p, "a");
        assert!(a.window.accepts(1) && a.window.accepts(2) && !a.window.accepts(3));
        // Once 2 is active, b still answers for 1 (requests in flight) and holds no assignment.
        p = ModelPlacement { active: Some(record(2, &["a"])), previous: Some(1), ..Default::default() };
        let b = view(&p, "b");
        assert!(b.window.accepts(1) && b.window.accepts(2) && b.assignment.is_none());
    }
}
