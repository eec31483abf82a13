//! The leader's placement decisions: which models need a new epoch now, and what it is. A pure
//! function of the replicated state and the leader's liveness view, so every leader given the
//! same state decides the same placement (the planner, `shimmer_cluster::placement::plan`, is
//! deterministic).
//!
//! A model is placed over the workers that should hold it — worker members that have it on disk
//! (with its shape), are up and are not draining. When that set differs from the workers of the
//! model's latest placement (proposed, else active), a new epoch is planned over it: so a join,
//! a leave (a worker down or removed) and a drain each re-plan at once.
//!
//! Every plan weighs experts by the model's merged routing heat. Between membership changes the
//! leader also *rebalances*: when the heat says a new plan would lower the busiest worker's
//! share of first-asked selections (its imbalance: that share over the mean) by at least
//! `rebalance_gain`, it is worth an epoch — the threshold is the hysteresis (small drifts of the
//! heat never move experts back and forth), and the node rate-limits how often it asks.
//!
//! Must never: read a clock or the network; place a model on a worker that does not have it on
//! disk; plan a placement with no workers (the last one going down keeps the placement it had).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use shimmer_cluster::placement::{plan, PlanInput, Worker};

use crate::state::{ClusterState, ModelOnDisk, ModelShape, NodeId, NodeKind, PlacementRecord};

/// What the leader plans with.
#[derive(Debug, Clone, Copy)]
pub struct PlacerConfig {
    /// Copies of every expert (fewer when there are fewer workers): 2 survives any one worker.
    pub replicas: usize,
    /// The drop in imbalance a rebalance must bring (0.15: the busiest worker's share over the
    /// mean falls by 0.15).
    pub rebalance_gain: f64,
}

/// What a rebalance would do for a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Rebalance {
    pub model: String,
    /// The busiest worker's first-asked share over the mean, under the merged heat: now, and
    /// with the new plan.
    pub imbalance_now: f64,
    pub imbalance_after: f64,
    /// The new placement (the next epoch), when it differs from the active one.
    pub record: Option<PlacementRecord>,
}

/// The busiest worker's share of first-asked selections over the mean, for `placement` under
/// `heat` (uniform when empty); 1.0 is perfectly even.
pub fn imbalance(placement: &shimmer_cluster::Placement, heat: &HashMap<(usize, usize), u64>) -> f64 {
    let mut load: BTreeMap<&str, f64> = placement.workers.iter().map(|w| (w.name.as_str(), 0.0)).collect();
    for l in &placement.layers {
        let total: u64 = (0..l.replicas.len()).map(|e| heat.get(&(l.layer, e)).copied().unwrap_or(0)).sum();
        for (e, holders) in l.replicas.iter().enumerate() {
            let share = if total == 0 { 1.0 / l.replicas.len() as f64 } else { heat.get(&(l.layer, e)).copied().unwrap_or(0) as f64 / total as f64 };
            if let Some(first) = holders.first().and_then(|h| load.get_mut(h.as_str())) {
                *first += share;
            }
        }
    }
    let n = load.len().max(1) as f64;
    let sum: f64 = load.values().sum();
    if sum <= 0.0 {
        return 1.0;
    }
    load.values().copied().fold(0.0, f64::max) / (sum / n)
}

/// What re-planning `model` over its active placement's workers under the merged heat would
/// bring (`None`: no active placement, or its workers no longer hold the model's shape).
pub fn rebalance(state: &ClusterState, model: &str, cfg: PlacerConfig) -> Option<Rebalance> {
    let placed = state.placements.get(model)?;
    let active = placed.active.as_ref()?;
    let disk = state.members.values().flat_map(|m| &m.models).find(|d| d.fingerprint == model)?;
    let shape = disk.shape.as_ref()?;
    let heat = state.heat.get(model).map(|h| h.as_map()).unwrap_or_default();
    let epoch = placed.latest_epoch() + 1;
    let planned = place(model, disk, shape, active.placement.workers.clone(), &heat, epoch, cfg).ok()?;
    let (now, after) = (imbalance(&active.placement, &heat), imbalance(&planned.placement, &heat));
    let same = planned.placement.layers == active.placement.layers;
    Some(Rebalance { model: model.to_string(), imbalance_now: now, imbalance_after: after, record: (!same).then_some(planned) })
}

/// The new placements to propose, at most one per model, in fingerprint order.
pub fn decide(state: &ClusterState, up: &dyn Fn(NodeId) -> bool, cfg: PlacerConfig) -> Vec<Result<PlacementRecord, String>> {
    // fingerprint → (the model as its first holder by name reports it, holders by name)
    let mut models: BTreeMap<&str, (&ModelOnDisk, &ModelShape, BTreeMap<&str, Worker>)> = BTreeMap::new();
    let mut members: Vec<_> = state.members.values().filter(|m| m.kind == NodeKind::Worker).collect();
    members.sort_by(|a, b| a.name.cmp(&b.name));
    for m in members {
        let Some(addr) = &m.data_addr else { continue };
        let eligible = !m.draining && up(m.id());
        for disk in &m.models {
            let Some(shape) = &disk.shape else { continue };
            let entry = models.entry(disk.fingerprint.as_str()).or_insert_with(|| (disk, shape, BTreeMap::new()));
            // One shape per fingerprint: a member that disagrees with the first is left out.
            if eligible && entry.1 == shape && entry.0.expert_bytes == disk.expert_bytes {
                let ram_bytes = if m.capacity.ram == 0 { u64::MAX } else { m.capacity.ram };
                entry.2.insert(m.name.as_str(), Worker { name: m.name.clone(), addr: addr.clone(), ram_bytes });
            }
        }
    }
    let mut out = Vec::new();
    for (fingerprint, (disk, shape, holders)) in models {
        if holders.is_empty() {
            continue;
        }
        let placed = state.placements.get(fingerprint);
        let latest = placed.and_then(|p| p.proposed.as_ref().or(p.active.as_ref()));
        let current: BTreeSet<&str> = latest.map(|r| r.worker_names()).unwrap_or_default();
        let wanted: BTreeSet<&str> = holders.keys().copied().collect();
        if current == wanted {
            continue;
        }
        let epoch = placed.map_or(0, |p| p.latest_epoch()) + 1;
        let heat = state.heat.get(fingerprint).map(|h| h.as_map()).unwrap_or_default();
        out.push(place(fingerprint, disk, shape, holders.into_values().collect(), &heat, epoch, cfg));
    }
    out
}

fn place(
    fingerprint: &str,
    disk: &ModelOnDisk,
    shape: &ModelShape,
    workers: Vec<Worker>,
    heat: &HashMap<(usize, usize), u64>,
    epoch: u64,
    cfg: PlacerConfig,
) -> Result<PlacementRecord, String> {
    let moe_layers: Vec<usize> = shape.moe_layers.iter().map(|&l| l as usize).collect();
    let (mut placement, _) = plan(&PlanInput {
        model: fingerprint,
        moe_layers: &moe_layers,
        experts: shape.experts as usize,
        expert_bytes: disk.expert_bytes,
        workers: &workers,
        heat,
        replicas: cfg.replicas.clamp(1, workers.len()),
        replicate_fraction: 1.0,
        top_k: shape.top_k as usize,
    })
    .map_err(|e| format!("cannot place model {fingerprint}: {e}"))?;
    placement.epoch = epoch;
    Ok(PlacementRecord { epoch, placement })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Capacity, Command, Member, MemberChange, Outcome};

    fn worker(name: &str, model: Option<&str>) -> Member {
        Member {
            name: name.into(),
            kind: NodeKind::Worker,
            control_addr: name.into(),
            data_addr: Some(name.into()),
            capacity: Capacity { vram: 0, ram: 1 << 30, disk: 0 },
            models: model
                .map(|f| ModelOnDisk { fingerprint: f.into(), expert_bytes: 1000, shape: Some(ModelShape { moe_layers: vec![1, 2], experts: 8, top_k: 2 }) })
                .into_iter()
                .collect(),
            draining: false,
        }
    }

    fn with_members(members: &[Member]) -> ClusterState {
        let mut s = ClusterState::default();
        let ids: Vec<NodeId> = members.iter().map(Member::id).collect();
        for (i, m) in members.iter().enumerate() {
            s.apply_member_change(i as u64 + 1, &MemberChange::Add { member: m.clone() }, &ids[..=i], &[]);
        }
        s
    }

    const CFG: PlacerConfig = PlacerConfig { replicas: 2, rebalance_gain: 0.15 };

    fn decide_all_up(s: &ClusterState) -> Vec<PlacementRecord> {
        decide(s, &|_| true, CFG).into_iter().map(|r| r.unwrap()).collect()
    }

    fn commit_and_activate(s: &mut ClusterState, r: PlacementRecord) {
        let model = r.placement.model.clone();
        let names: Vec<String> = r.placement.workers.iter().map(|w| w.name.clone()).collect();
        let epoch = r.epoch;
        assert_eq!(s.apply_command(100, &Command::ProposePlacement { record: r }), Outcome::Applied);
        for w in names {
            assert_eq!(s.apply_command(101, &Command::PlacementReady { model: model.clone(), epoch, worker: w }), Outcome::Applied);
        }
    }

    #[test]
    fn workers_holding_a_model_get_a_placement_and_every_change_of_holders_replans() {
        let mut s = with_members(&[worker("a:1", Some("m")), worker("b:1", Some("m")), worker("c:1", None)]);
        let first = decide_all_up(&s);
        assert_eq!(first.len(), 1);
        let r = &first[0];
        assert_eq!((r.epoch, r.placement.model.as_str()), (1, "m"));
        assert_eq!(r.worker_names(), BTreeSet::from(["a:1", "b:1"]), "c has no copy of the model");
        r.placement.validate("m", &[1, 2], 8).unwrap();
        assert!(r.placement.layers.iter().all(|l| l.replicas.iter().all(|h| h.len() == 2)), "two copies of every expert");
        // The same state decides the same placement; once proposed, nothing more.
        assert_eq!(decide_all_up(&s), first);
        commit_and_activate(&mut s, first[0].clone());
        assert!(decide_all_up(&s).is_empty());
        // A join re-plans (epoch 2 includes it) ...
        let d = worker("d:1", Some("m"));
        let ids: Vec<NodeId> = s.members.keys().copied().chain([d.id()]).collect();
        s.apply_member_change(200, &MemberChange::Add { member: d.clone() }, &ids, &[]);
        let next = decide_all_up(&s);
        assert_eq!((next[0].epoch, next[0].worker_names()), (2, BTreeSet::from(["a:1", "b:1", "d:1"])));
        commit_and_activate(&mut s, next[0].clone());
        // ... so do a drain and a worker down; with its last holder down a model keeps its placement.
        s.apply_command(300, &Command::SetDraining { name: "b:1".into(), draining: true });
        let drained = decide_all_up(&s);
        assert_eq!((drained[0].epoch, drained[0].worker_names()), (3, BTreeSet::from(["a:1", "d:1"])));
        let a_down = decide(&s, &|id| id != worker("a:1", None).id(), CFG);
        assert_eq!(a_down[0].as_ref().unwrap().worker_names(), BTreeSet::from(["d:1"]));
        assert!(decide(&s, &|_| false, CFG).is_empty());
    }

    #[test]
    fn a_pending_proposal_is_superseded_when_its_workers_change() {
        let mut s = with_members(&[worker("a:1", Some("m")), worker("b:1", Some("m"))]);
        let first = decide_all_up(&s).remove(0);
        s.apply_command(10, &Command::ProposePlacement { record: first });
        // b goes down before it is ready: the next epoch leaves it out.
        let b = worker("b:1", None).id();
        let next: Vec<_> = decide(&s, &|id| id != b, CFG).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!((next[0].epoch, next[0].worker_names()), (2, BTreeSet::from(["a:1"])));
        assert!(next[0].placement.layers.iter().all(|l| l.replicas.iter().all(|h| h == &["a:1".to_string()])));
    }

    #[test]
    fn skewed_heat_makes_a_rebalance_worth_it_and_even_heat_does_not() {
        let mut s = with_members(&[worker("a:1", Some("m")), worker("b:1", Some("m")), worker("c:1", Some("m"))]);
        let first = decide_all_up(&s).remove(0);
        commit_and_activate(&mut s, first);
        let even = rebalance(&s, "m", CFG).unwrap();
        assert!(even.imbalance_now < 1.2 && even.record.is_none(), "{even:?}");
        // Traffic lands on the experts the first worker is asked first for.
        let active = s.placements["m"].active.clone().unwrap();
        let mut counts = Vec::new();
        for l in &active.placement.layers {
            for (e, h) in l.replicas.iter().enumerate() {
                counts.push((l.layer as u32, e as u32, if h[0] == "a:1" { 1000 } else { 1 }));
            }
        }
        assert_eq!(s.apply_command(500, &Command::ReportHeat { model: "m".into(), by: "a:1".into(), counts }), Outcome::Applied);
        let skewed = rebalance(&s, "m", CFG).unwrap();
        assert!(skewed.imbalance_now > 2.5, "{skewed:?}");
        assert!(skewed.imbalance_now - skewed.imbalance_after >= CFG.rebalance_gain, "{skewed:?}");
        let record = skewed.record.unwrap();
        assert_eq!(record.epoch, 2);
        record.placement.validate("m", &[1, 2], 8).unwrap();
        // Once adopted, the same heat asks for nothing more (no moving back and forth).
        commit_and_activate(&mut s, record);
        let settled = rebalance(&s, "m", CFG).unwrap();
        assert!(settled.imbalance_now - settled.imbalance_after < CFG.rebalance_gain, "{settled:?}");
    }
}
