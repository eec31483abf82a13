//! A worker member following the cluster's placement of its model: the epochs it answers for,
//! the experts assigned to it, and its part in make-before-break — when a proposed epoch names
//! it, it reads its new share from its own disk and only then says it is ready, so the epoch
//! becomes active only once every holder holds what it is given.
//!
//! `view` is the decision (pure, tested here); `follow` is the loop that carries it out on a
//! thread of its own, polling the member's applied state.
//!
//! Once the cluster retires the epoch before the active one (every coordinator has moved off
//! it), the worker stops answering for it and drops from RAM the experts only it gave it — and
//! drops them again for a while after (`LINGER`): a request accepted under the old epoch just
//! before the window moved, or a prefetch hint sent under it, can read one back in after the drop.
//!
//! Must never: say ready before its share is read; drop an expert a share it still answers
//! for holds; answer for an epoch the cluster does not
//! (active, the one before it, or a proposed one naming it); block the data plane.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shimmer_control::state::Command;
use shimmer_control::{ModelPlacement, Outcome, PlacementRecord};

use super::ControlPlane;
use crate::server::{Assigned, EpochWindow, WorkerState};

const POLL: Duration = Duration::from_millis(200);
/// How soon a failed preparation (a read error, a proposal that timed out) is tried again.
const RETRY: Duration = Duration::from_secs(2);
/// How long the experts dropped with a retired epoch stay watched, each poll dropping again any
/// that work begun under that epoch read back in (and no share holds).
const LINGER: Duration = Duration::from_secs(5);

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

/// The shares of the epochs a worker answers for, and what to drop when an epoch leaves its
/// window: a worker keeps every share it answers for (so a coordinator still on the previous
/// epoch is served as before) and drops the experts only a retired epoch gave it.
#[derive(Debug, Default)]
pub struct Shares(BTreeMap<u64, Assigned>);

impl Shares {
    pub fn insert(&mut self, epoch: u64, share: Assigned) {
        self.0.entry(epoch).or_insert(share);
    }

    pub fn has(&self, epoch: u64) -> bool {
        self.0.contains_key(&epoch)
    }

    /// Forgets the shares of epochs outside `window`; returns the (layer, expert) pairs that no
    /// remaining share holds, sorted.
    pub fn retain(&mut self, window: &EpochWindow) -> Vec<(u32, u32)> {
        let gone: Vec<Assigned> = {
            let (keep, gone): (BTreeMap<u64, Assigned>, BTreeMap<u64, Assigned>) =
                std::mem::take(&mut self.0).into_iter().partition(|(e, _)| window.accepts(*e));
            self.0 = keep;
            gone.into_values().collect()
        };
        let held = self.union();
        let mut dropped: Vec<(u32, u32)> = gone.into_iter().flatten().filter(|p| !held.contains(p)).collect();
        dropped.sort_unstable();
        dropped.dedup();
        dropped
    }

    /// Every pair some share holds: what the worker is assigned.
    pub fn union(&self) -> Assigned {
        self.0.values().flatten().copied().collect()
    }
}

/// Follows `model`'s placements until `stop` is set: moves `state`'s epoch window and
/// assignment, prepares proposed epochs (reading the share from `state.store` when it has one)
/// before saying ready, and drops from RAM what only a retired epoch gave it.
pub fn follow(control: Arc<ControlPlane>, state: Arc<WorkerState>, model: String, moe_layers: Vec<usize>, stop: Arc<AtomicBool>) {
    let me = state.name.clone();
    let mut seen_version = 0;
    let mut shares = Shares::default();
    let mut retry_at: Option<Instant> = None;
    // The epoch it last said ready for: said once, unless saying it failed.
    let mut said_ready = None;
    // Pairs a retired epoch gave it, watched until the deadline.
    let mut lingering: Option<(Vec<(usize, usize)>, Instant)> = None;
    while !stop.load(Ordering::SeqCst) && !control.stopped() {
        if let (Some((pairs, until)), Some(store)) = (&mut lingering, state.store.as_ref()) {
            let held = shares.union();
            pairs.retain(|&(l, e)| !held.contains(&(l as u32, e as u32)));
            let again = store.release(pairs);
            if again > 0 {
                tracing::info!(again, "dropped experts of a retired placement epoch that work begun under it read back in");
            }
            if Instant::now() >= *until || pairs.is_empty() {
                lingering = None;
            }
        }
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
        for record in [placement.active.as_ref(), v.assignment].into_iter().flatten() {
            if shares.has(record.epoch) || !record.worker_names().contains(me.as_str()) {
                continue;
            }
            match record.placement.slice(&me, &moe_layers) {
                Ok(slice) => shares.insert(record.epoch, slice.assigned),
                Err(e) => tracing::warn!(epoch = record.epoch, "the cluster's placement does not fit this worker: {e}"),
            }
        }
        // Widen before narrowing: the assignment grows before the window takes a new epoch, and
        // shrinks only after the window has let the old one go.
        state.set_assigned(Some(shares.union()));
        state.set_epochs(v.window);
        let dropped = shares.retain(&v.window);
        state.set_assigned(Some(shares.union()));
        if !dropped.is_empty() {
            let pairs: Vec<(usize, usize)> = dropped.iter().map(|&(l, e)| (l as usize, e as usize)).collect();
            let released = state.store.as_ref().map_or(0, |s| s.release(&pairs));
            tracing::info!(epoch = v.window.active, no_longer_held = pairs.len(), released, "dropped what only a retired placement epoch gave it");
            let mut watched = lingering.take().map(|(p, _)| p).unwrap_or_default();
            watched.extend(pairs);
            lingering = Some((watched, Instant::now() + LINGER));
        }
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

    #[test]
    fn a_worker_keeps_every_share_it_answers_for_and_drops_only_what_a_retired_one_alone_held() {
        let share = |pairs: &[(u32, u32)]| pairs.iter().copied().collect::<Assigned>();
        let mut shares = Shares::default();
        shares.insert(1, share(&[(1, 0), (1, 1), (3, 2)]));
        shares.insert(2, share(&[(1, 1), (3, 5)]));
        shares.insert(2, share(&[(9, 9)]));
        assert_eq!(shares.union(), share(&[(1, 0), (1, 1), (3, 2), (3, 5)]), "a share, once taken, is not replaced");
        let moved = EpochWindow { active: 2, previous: Some(1), proposed: None };
        assert!(shares.retain(&moved).is_empty(), "epoch 1 is still answered");
        assert_eq!(shares.retain(&EpochWindow::only(2)), vec![(1, 0), (3, 2)], "(1, 1) is epoch 2's too");
        assert_eq!(shares.union(), share(&[(1, 1), (3, 5)]));
        assert!(!shares.has(1) && shares.has(2));
    }
}
