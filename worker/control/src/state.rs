//! The replicated state: what every member agrees on once Raft has committed it — the cluster's
//! identity, its members (names, addresses, capacities, models on disk, draining) with their
//! Raft roles, and per model its placement under an epoch.
//!
//! A placement changes make-before-break: a new epoch is first *proposed*; each of its workers
//! says it is *ready* once it holds its experts; when all have, it becomes *active* (what
//! coordinators route by) and the one before it *previous* (still answered, so a request in
//! flight finishes on its epoch) until every coordinator routing the model says it has moved;
//! then the leader retires it and its holders drop what only it gave them.
//!
//! `apply` is a pure function of the state and one committed entry: every member applies the
//! same entries in the same order and so holds the same state, bit for bit. Liveness (up/down)
//! is deliberately absent: it is what the leader sees from heartbeats, served beside the state,
//! never written to the log.
//!
//! Must never: read a clock, a file or the network; accept an entry it cannot decode as anything
//! but a rejection recorded in the outcome (a committed entry is applied by everyone, so it must
//! not be able to make one member panic); let a placement epoch go down.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// A member's Raft id: derived from its name, so a restarted node and every peer agree on it
/// without coordination.
pub type NodeId = u64;

/// The largest encoded command or member change accepted (a placement of a 384-expert × 61-layer
/// model with three replicas is ~1 MiB of JSON).
pub const MAX_COMMAND_BYTES: usize = 8 << 20;
/// Bounds on what a member may say about itself.
pub const MAX_NAME_BYTES: usize = 255;
pub const MAX_MODELS_PER_MEMBER: usize = 64;
pub const MAX_MEMBERS: usize = 1024;

/// The Raft id of a member name: the first 8 bytes of SHA-256 of the name (never 0, which raft-rs
/// reserves for "nobody").
pub fn node_id(name: &str) -> NodeId {
    let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_le_bytes(b).max(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    Worker,
    Coordinator,
}

/// Bounds on a model's shape as a member reports it.
pub const MAX_MOE_LAYERS: usize = 4096;
pub const MAX_EXPERTS: u32 = 1 << 16;

/// A model a member has on its own disk, by fingerprint (the model directory's, as placements
/// name it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
pub struct ModelOnDisk {
    pub fingerprint: String,
    /// The bytes one routed expert takes (what a placement spreads over RAM).
    pub expert_bytes: u64,
    /// What the leader needs to place its experts without opening the model itself.
    #[serde(default)]
    pub shape: Option<ModelShape>,
}

/// The part of a model's shape a placement depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
pub struct ModelShape {
    pub moe_layers: Vec<u32>,
    pub experts: u32,
    pub top_k: u32,
}

impl ModelShape {
    fn validate(&self) -> Result<(), String> {
        if self.moe_layers.is_empty() || self.moe_layers.len() > MAX_MOE_LAYERS {
            return Err(format!("a model has 1 to {MAX_MOE_LAYERS} MoE layers, not {}", self.moe_layers.len()));
        }
        if self.experts == 0 || self.experts > MAX_EXPERTS || self.top_k == 0 || self.top_k > self.experts {
            return Err(format!("{} experts with top-{} is not a MoE shape (at most {MAX_EXPERTS} experts)", self.experts, self.top_k));
        }
        Ok(())
    }
}

/// Capacity per tier, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub vram: u64,
    pub ram: u64,
    pub disk: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// By default the node's `--listen` address as given.
    pub name: String,
    pub kind: NodeKind,
    /// The control plane's TCP address (HOST:PORT; hostnames resolve when dialled).
    pub control_addr: String,
    /// The data plane's QUIC address, for workers.
    pub data_addr: Option<String>,
    pub capacity: Capacity,
    pub models: Vec<ModelOnDisk>,
    pub draining: bool,
}

impl Member {
    pub fn id(&self) -> NodeId {
        node_id(&self.name)
    }

    /// Refuses what no member may say about itself: an empty or huge name, an address that is
    /// not HOST:PORT, too many models.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_NAME_BYTES {
            return Err(format!("member name must be 1 to {MAX_NAME_BYTES} bytes, got {}", self.name.len()));
        }
        for (what, addr) in [("control address", Some(&self.control_addr)), ("data address", self.data_addr.as_ref())] {
            if let Some(a) = addr {
                check_host_port(a).map_err(|e| format!("{}'s {what} {a:?}: {e}", self.name))?;
            }
        }
        if self.models.len() > MAX_MODELS_PER_MEMBER {
            return Err(format!("{} says it has {} models (limit {MAX_MODELS_PER_MEMBER})", self.name, self.models.len()));
        }
        for m in &self.models {
            if m.fingerprint.is_empty() || m.fingerprint.len() > MAX_NAME_BYTES {
                return Err(format!("{}: a model fingerprint is 1 to {MAX_NAME_BYTES} bytes", self.name));
            }
            if let Some(shape) = &m.shape {
                shape.validate().map_err(|e| format!("{}'s model {}: {e}", self.name, m.fingerprint))?;
            }
        }
        Ok(())
    }
}

/// HOST:PORT with a non-empty host of at most 253 bytes and a port number.
pub fn check_host_port(addr: &str) -> Result<(), String> {
    let (host, port) = addr.rsplit_once(':').ok_or("not HOST:PORT")?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.len() > 253 {
        return Err("the host must be 1 to 253 bytes".into());
    }
    port.parse::<u16>().map_err(|_| format!("`{port}` is not a port number"))?;
    Ok(())
}

/// A model's placement under its epoch (expert → ordered replicas).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacementRecord {
    pub epoch: u64,
    pub placement: shimmer_cluster::Placement,
}

impl PlacementRecord {
    pub fn worker_names(&self) -> BTreeSet<&str> {
        self.placement.workers.iter().map(|w| w.name.as_str()).collect()
    }
}

/// A model's routing heat: per MoE layer, per expert, selections counted by coordinators, each
/// report decaying what came before by `HEAT_DECAY` (so recent traffic weighs most).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelHeat {
    pub layers: BTreeMap<u32, Vec<u64>>,
    pub reports: u64,
}

/// Each heat report keeps this fraction of the counts before it (as `1 - 1/n`).
pub const HEAT_DECAY_DIVISOR: u64 = 16;
/// Entries in one heat report at most.
pub const MAX_HEAT_ENTRIES: usize = 1 << 20;

impl ModelHeat {
    /// The counts keyed by (model layer, expert), as the planner takes them.
    pub fn as_map(&self) -> std::collections::HashMap<(usize, usize), u64> {
        let mut m = std::collections::HashMap::new();
        for (&l, counts) in &self.layers {
            for (e, &c) in counts.iter().enumerate() {
                if c > 0 {
                    m.insert((l as usize, e), c);
                }
            }
        }
        m
    }
}

/// One model's placements: the active one, the one being prepared, and the epoch before.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelPlacement {
    /// What coordinators route by.
    pub active: Option<PlacementRecord>,
    /// The next epoch, while its workers load their experts.
    pub proposed: Option<PlacementRecord>,
    /// Workers of `proposed` that hold their experts.
    pub ready: BTreeSet<String>,
    /// The active epoch before this one: workers still answer for it, until every coordinator
    /// routing the model has moved (`Command::RetirePrevious`).
    pub previous: Option<u64>,
    /// Per member coordinator, the epoch it routes this model by with nothing in flight on an
    /// older one (what it last reported).
    #[serde(default)]
    pub routed: BTreeMap<String, u64>,
}

impl ModelPlacement {
    /// The active epoch (0: none yet).
    pub fn epoch(&self) -> u64 {
        self.active.as_ref().map_or(0, |r| r.epoch)
    }

    /// The highest epoch proposed or active: a new proposal must be above it.
    pub fn latest_epoch(&self) -> u64 {
        self.proposed.as_ref().map_or(0, |r| r.epoch).max(self.epoch())
    }

    /// Whether a worker answers requests made under `epoch`: the active one, the one before it
    /// (requests in flight finish), and a proposed one it is part of.
    pub fn answers(&self, worker: &str, epoch: u64) -> bool {
        epoch != 0
            && (epoch == self.epoch()
                || self.previous == Some(epoch)
                || self.proposed.as_ref().is_some_and(|p| p.epoch == epoch && p.worker_names().contains(worker)))
    }
}

/// What every member holds once the same entries are applied.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Chosen at bootstrap; a node refuses messages and joins for another cluster.
    pub cluster_id: String,
    pub members: BTreeMap<NodeId, Member>,
    pub voters: BTreeSet<NodeId>,
    pub learners: BTreeSet<NodeId>,
    /// Per model fingerprint, its placements.
    pub placements: BTreeMap<String, ModelPlacement>,
    /// Per model fingerprint, the routing heat coordinators reported (decayed counts).
    #[serde(default)]
    pub heat: BTreeMap<String, ModelHeat>,
    /// The index of the last entry applied.
    pub applied: u64,
}

/// A change to the state other than membership, carried in a normal Raft entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// A member says what it is now (addresses, capacity, models): only for a known member.
    UpdateMember {
        member: Member,
    },
    SetDraining {
        name: String,
        draining: bool,
    },
    /// A placement for a model, to become active once its workers are ready; refused unless its
    /// epoch is above every epoch of the model so far and its workers are members.
    ProposePlacement {
        record: PlacementRecord,
    },
    /// A coordinator's routing counts since its last report: (model layer, expert, count).
    ReportHeat {
        model: String,
        by: String,
        counts: Vec<(u32, u32, u64)>,
    },
    /// A worker of a proposed placement holds its experts.
    PlacementReady {
        model: String,
        epoch: u64,
        worker: String,
    },
    /// A member coordinator routes `model` by `epoch` (or a later one) with no request in flight
    /// on an older one.
    Routed {
        model: String,
        by: String,
        epoch: u64,
    },
    /// Workers stop answering for the epoch before `epoch` (the active one) and drop the experts
    /// only it gave them: the leader's decision once every coordinator has moved.
    RetirePrevious {
        model: String,
        epoch: u64,
    },
}

/// What a membership change (a Raft conf change) says about the member, in its context bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MemberChange {
    /// A new member, joining as a learner.
    Add {
        member: Member,
    },
    /// A learner becomes a voter.
    Promote {
        name: String,
    },
    /// A voter becomes a learner (it was gone too long, or there are more voters than wanted).
    Demote {
        name: String,
    },
    Remove {
        name: String,
    },
}

/// A normal entry's payload: the command, and who proposed it with which sequence number, so the
/// proposer learns when (and whether) it was applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    pub by: NodeId,
    pub seq: u64,
    pub command: Command,
}

/// The result of applying one entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Applied,
    /// A committed entry every member refuses the same way (e.g. an epoch that does not grow).
    Rejected(String),
}

impl ClusterState {
    pub fn role(&self, id: NodeId) -> Option<&'static str> {
        if self.voters.contains(&id) {
            Some("voter")
        } else if self.learners.contains(&id) {
            Some("learner")
        } else {
            None
        }
    }

    pub fn member_named(&self, name: &str) -> Option<&Member> {
        self.members.get(&node_id(name))
    }

    /// A model's shape as its first holder (by id) reports it.
    pub fn shape_of(&self, model: &str) -> Option<&ModelShape> {
        self.members.values().flat_map(|m| &m.models).find(|d| d.fingerprint == model).and_then(|d| d.shape.as_ref())
    }

    /// Applies a normal entry's command.
    pub fn apply_command(&mut self, index: u64, command: &Command) -> Outcome {
        self.applied = self.applied.max(index);
        match command {
            Command::UpdateMember { member } => {
                if let Err(e) = member.validate() {
                    return Outcome::Rejected(e);
                }
                match self.members.get_mut(&member.id()) {
                    Some(m) if m.name == member.name => {
                        let draining = m.draining;
                        *m = member.clone();
                        // Draining is changed only by its own command.
                        m.draining = draining;
                        Outcome::Applied
                    }
                    _ => Outcome::Rejected(format!("{} is not a member", member.name)),
                }
            }
            Command::SetDraining { name, draining } => match self.members.get_mut(&node_id(name)) {
                Some(m) if &m.name == name => {
                    m.draining = *draining;
                    Outcome::Applied
                }
                _ => Outcome::Rejected(format!("{name} is not a member")),
            },
            Command::ProposePlacement { record } => {
                if record.placement.epoch != record.epoch {
                    return Outcome::Rejected(format!("placement epoch {} differs from the record's {}", record.placement.epoch, record.epoch));
                }
                let model = &record.placement.model;
                let latest = self.placements.get(model).map_or(0, ModelPlacement::latest_epoch);
                if record.epoch <= latest {
                    return Outcome::Rejected(format!("epoch {} for model {model} is not above its latest {latest}", record.epoch));
                }
                if record.placement.workers.is_empty() {
                    return Outcome::Rejected(format!("a placement of model {model} with no workers"));
                }
                if let Some(w) = record.placement.workers.iter().find(|w| self.member_named(&w.name).is_none_or(|m| m.name != w.name)) {
                    return Outcome::Rejected(format!("the placement of model {model} names {}, which is not a member", w.name));
                }
                let entry = self.placements.entry(model.clone()).or_default();
                entry.proposed = Some(record.clone());
                entry.ready.clear();
                Outcome::Applied
            }
            Command::ReportHeat { model, by, counts } => {
                if counts.len() > MAX_HEAT_ENTRIES {
                    return Outcome::Rejected(format!("a heat report of {} entries (limit {MAX_HEAT_ENTRIES})", counts.len()));
                }
                if self.member_named(by).is_none_or(|m| &m.name != by) {
                    return Outcome::Rejected(format!("{by} is not a member"));
                }
                let Some(shape) = self.shape_of(model).cloned() else {
                    return Outcome::Rejected(format!("no member has model {model} on disk"));
                };
                if let Some(&(l, e, _)) = counts.iter().find(|(l, e, _)| !shape.moe_layers.contains(l) || *e >= shape.experts) {
                    return Outcome::Rejected(format!("layer {l} expert {e} is not a routed expert of model {model}"));
                }
                let heat = self.heat.entry(model.clone()).or_default();
                for layer in heat.layers.values_mut() {
                    for c in layer.iter_mut() {
                        *c -= *c / HEAT_DECAY_DIVISOR;
                    }
                }
                for &(l, e, n) in counts {
                    let layer = heat.layers.entry(l).or_insert_with(|| vec![0; shape.experts as usize]);
                    if let Some(c) = layer.get_mut(e as usize) {
                        *c = c.saturating_add(n);
                    }
                }
                heat.reports += 1;
                Outcome::Applied
            }
            Command::PlacementReady { model, epoch, worker } => {
                let Some(entry) = self.placements.get_mut(model) else {
                    return Outcome::Rejected(format!("model {model} has no placement"));
                };
                let Some(proposed) = entry.proposed.as_ref().filter(|p| p.epoch == *epoch) else {
                    return Outcome::Rejected(format!("epoch {epoch} of model {model} is not the proposed one"));
                };
                let workers: BTreeSet<String> = proposed.worker_names().into_iter().map(String::from).collect();
                if !workers.contains(worker) {
                    return Outcome::Rejected(format!("{worker} is not a worker of epoch {epoch} of model {model}"));
                }
                entry.ready.insert(worker.clone());
                if entry.ready == workers {
                    entry.previous = entry.active.as_ref().map(|a| a.epoch);
                    entry.active = entry.proposed.take();
                    entry.ready.clear();
                }
                Outcome::Applied
            }
            Command::Routed { model, by, epoch } => {
                if self.member_named(by).is_none_or(|m| &m.name != by || m.kind != NodeKind::Coordinator) {
                    return Outcome::Rejected(format!("{by} is not a coordinator of the cluster"));
                }
                let Some(entry) = self.placements.get_mut(model) else {
                    return Outcome::Rejected(format!("model {model} has no placement"));
                };
                if *epoch == 0 || *epoch > entry.epoch() {
                    return Outcome::Rejected(format!("{by} cannot route model {model} by epoch {epoch}: the active one is {}", entry.epoch()));
                }
                let routed = entry.routed.entry(by.clone()).or_default();
                *routed = (*routed).max(*epoch);
                Outcome::Applied
            }
            Command::RetirePrevious { model, epoch } => {
                let Some(entry) = self.placements.get_mut(model) else {
                    return Outcome::Rejected(format!("model {model} has no placement"));
                };
                if entry.epoch() != *epoch || entry.previous.is_none() {
                    return Outcome::Rejected(format!("model {model} has no epoch before an active {epoch} to retire"));
                }
                entry.previous = None;
                Outcome::Applied
            }
        }
    }

    /// The models whose previous epoch every up coordinator routing them has moved off, with
    /// their active epoch: what the leader retires. Coordinators that never said they route a
    /// model (they read the active placement when they start) and ones that are down do not hold
    /// it up; a client coordinator (not a member) that is still on it is told `Moved` and reads
    /// the placement again.
    pub fn retirable(&self, is_up: &dyn Fn(NodeId) -> bool) -> Vec<(String, u64)> {
        self.placements
            .iter()
            .filter(|(_, p)| p.previous.is_some())
            .filter(|(_, p)| {
                p.routed.iter().all(|(name, &epoch)| {
                    let member = self.member_named(name).filter(|m| &m.name == name);
                    epoch >= p.epoch() || member.is_none_or(|m| !is_up(m.id()))
                })
            })
            .map(|(model, p)| (model.clone(), p.epoch()))
            .collect()
    }

    /// Applies a committed membership change. `voters`/`learners` are the Raft configuration
    /// after it (raft-rs's `apply_conf_change`), recorded so every member reports the same roles.
    pub fn apply_member_change(&mut self, index: u64, change: &MemberChange, voters: &[NodeId], learners: &[NodeId]) -> Outcome {
        self.applied = self.applied.max(index);
        self.voters = voters.iter().copied().collect();
        self.learners = learners.iter().copied().collect();
        let outcome = match change {
            MemberChange::Add { member } => match member.validate() {
                Err(e) => Outcome::Rejected(e),
                Ok(()) => match self.members.get(&member.id()) {
                    Some(m) if m.name != member.name => Outcome::Rejected(format!("{} and {} have the same id; rename one", m.name, member.name)),
                    _ if self.members.len() >= MAX_MEMBERS && !self.members.contains_key(&member.id()) => {
                        Outcome::Rejected(format!("the cluster has {MAX_MEMBERS} members already"))
                    }
                    _ => {
                        self.members.insert(member.id(), member.clone());
                        Outcome::Applied
                    }
                },
            },
            MemberChange::Promote { .. } | MemberChange::Demote { .. } => Outcome::Applied,
            MemberChange::Remove { name } => {
                self.members.remove(&node_id(name));
                Outcome::Applied
            }
        };
        // A member is in the state exactly when Raft knows it.
        let known: BTreeSet<NodeId> = self.voters.union(&self.learners).copied().collect();
        self.members.retain(|id, _| known.contains(id));
        outcome
    }

    pub fn encode(&self) -> Vec<u8> {
        // Serialising plain data to a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<ClusterState, String> {
        if bytes.len() > 4 * MAX_COMMAND_BYTES {
            return Err(format!("a state snapshot of {} bytes is over the limit", bytes.len()));
        }
        serde_json::from_slice(bytes).map_err(|e| format!("not a cluster state: {e}"))
    }
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// Decodes a command or member change, bounded before it is parsed.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    if bytes.len() > MAX_COMMAND_BYTES {
        return Err(format!("{} bytes is over the {MAX_COMMAND_BYTES}-byte limit of an entry", bytes.len()));
    }
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn member(name: &str) -> Member {
        Member {
            name: name.into(),
            kind: NodeKind::Worker,
            control_addr: name.into(),
            data_addr: Some(name.into()),
            capacity: Capacity { vram: 0, ram: 1 << 30, disk: 1 << 40 },
            models: vec![],
            draining: false,
        }
    }

    #[test]
    fn members_follow_the_raft_configuration_and_commands_are_checked() {
        let mut s = ClusterState::default();
        let a = member("10.0.0.1:7070");
        let b = member("10.0.0.2:7070");
        assert_eq!(s.apply_member_change(1, &MemberChange::Add { member: a.clone() }, &[a.id()], &[]), Outcome::Applied);
        assert_eq!(s.apply_member_change(2, &MemberChange::Add { member: b.clone() }, &[a.id()], &[b.id()]), Outcome::Applied);
        assert_eq!(s.role(b.id()), Some("learner"));
        assert_eq!(s.apply_member_change(3, &MemberChange::Promote { name: b.name.clone() }, &[a.id(), b.id()], &[]), Outcome::Applied);
        assert_eq!(s.role(b.id()), Some("voter"));
        assert!(matches!(s.apply_command(4, &Command::SetDraining { name: "nobody:1".into(), draining: true }), Outcome::Rejected(_)));
        assert_eq!(s.apply_command(5, &Command::SetDraining { name: b.name.clone(), draining: true }), Outcome::Applied);
        assert!(s.members[&b.id()].draining);
        // An update keeps the draining flag; a bad address is refused.
        let mut b2 = b.clone();
        b2.capacity.ram = 5;
        assert_eq!(s.apply_command(6, &Command::UpdateMember { member: b2 }), Outcome::Applied);
        assert!(s.members[&b.id()].draining && s.members[&b.id()].capacity.ram == 5);
        let mut bad = b.clone();
        bad.control_addr = "no-port".into();
        assert!(matches!(s.apply_command(7, &Command::UpdateMember { member: bad }), Outcome::Rejected(_)));
        assert_eq!(s.apply_member_change(8, &MemberChange::Remove { name: b.name.clone() }, &[a.id()], &[]), Outcome::Applied);
        assert!(!s.members.contains_key(&b.id()));
        assert_eq!(s.applied, 8);
        assert_eq!(ClusterState::decode(&s.encode()).unwrap(), s);
    }

    fn placement_over(epoch: u64, workers: &[&str]) -> Command {
        let placement = shimmer_cluster::Placement {
            format: shimmer_cluster::placement::FORMAT.into(),
            version: shimmer_cluster::placement::VERSION,
            model: "m".into(),
            epoch,
            workers: workers.iter().map(|w| shimmer_cluster::placement::Worker { name: w.to_string(), addr: w.to_string(), ram_bytes: 1 }).collect(),
            layers: vec![],
        };
        Command::ProposePlacement { record: PlacementRecord { epoch, placement } }
    }

    fn ready(epoch: u64, worker: &str) -> Command {
        Command::PlacementReady { model: "m".into(), epoch, worker: worker.into() }
    }

    #[test]
    fn a_placement_becomes_active_when_all_its_workers_are_ready_and_epochs_only_grow() {
        let mut s = ClusterState::default();
        let (a, b) = (member("a:1"), member("b:1"));
        s.apply_member_change(1, &MemberChange::Add { member: a.clone() }, &[a.id()], &[]);
        s.apply_member_change(2, &MemberChange::Add { member: b.clone() }, &[a.id()], &[b.id()]);
        assert!(matches!(s.apply_command(3, &placement_over(1, &["a:1", "stranger:1"])), Outcome::Rejected(_)));
        assert!(matches!(s.apply_command(3, &placement_over(1, &[])), Outcome::Rejected(_)));
        assert_eq!(s.apply_command(3, &placement_over(2, &["a:1", "b:1"])), Outcome::Applied);
        assert_eq!(s.placements["m"].epoch(), 0, "proposed, not active");
        assert!(matches!(s.apply_command(4, &placement_over(2, &["a:1"])), Outcome::Rejected(_)), "not above the proposed epoch");
        assert!(matches!(s.apply_command(4, &ready(1, "a:1")), Outcome::Rejected(_)));
        assert_eq!(s.apply_command(4, &ready(2, "a:1")), Outcome::Applied);
        assert!(s.placements["m"].answers("a:1", 2) && !s.placements["m"].answers("x:1", 2));
        assert_eq!(s.placements["m"].epoch(), 0);
        assert_eq!(s.apply_command(5, &ready(2, "b:1")), Outcome::Applied);
        assert_eq!((s.placements["m"].epoch(), s.placements["m"].previous), (2, None));
        // The next epoch: while it is prepared, the active one stays; once active, the old one
        // is still answered.
        assert_eq!(s.apply_command(6, &placement_over(3, &["a:1"])), Outcome::Applied);
        assert_eq!(s.apply_command(7, &ready(3, "a:1")), Outcome::Applied);
        let m = &s.placements["m"];
        assert_eq!((m.epoch(), m.previous, m.proposed.is_none()), (3, Some(2), true));
        assert!(m.answers("b:1", 2) && m.answers("a:1", 3) && !m.answers("a:1", 1) && !m.answers("a:1", 4));
        assert!(matches!(s.apply_command(8, &placement_over(3, &["a:1"])), Outcome::Rejected(_)));
        // A superseded proposal forgets who was ready.
        assert_eq!(s.apply_command(9, &placement_over(4, &["a:1", "b:1"])), Outcome::Applied);
        assert_eq!(s.apply_command(10, &ready(4, "a:1")), Outcome::Applied);
        assert_eq!(s.apply_command(11, &placement_over(5, &["a:1", "b:1"])), Outcome::Applied);
        assert!(s.placements["m"].ready.is_empty());
        assert!(matches!(s.apply_command(12, &ready(4, "b:1")), Outcome::Rejected(_)));
        assert_eq!(s.placements["m"].epoch(), 3);
    }

    #[test]
    fn the_previous_epoch_is_retired_once_every_up_coordinator_routing_the_model_has_moved() {
        let mut s = ClusterState::default();
        let (a, mut c, mut d) = (member("a:1"), member("c:1"), member("d:1"));
        c.kind = NodeKind::Coordinator;
        d.kind = NodeKind::Coordinator;
        for (i, m) in [&a, &c, &d].into_iter().enumerate() {
            let ids: Vec<NodeId> = [&a, &c, &d][..=i].iter().map(|m| m.id()).collect();
            s.apply_member_change(i as u64 + 1, &MemberChange::Add { member: m.clone() }, &ids, &[]);
        }
        let routed = |by: &str, epoch| Command::Routed { model: "m".into(), by: by.into(), epoch };
        assert!(matches!(s.apply_command(4, &routed("c:1", 1)), Outcome::Rejected(_)), "no placement yet");
        s.apply_command(5, &placement_over(1, &["a:1"]));
        s.apply_command(6, &ready(1, "a:1"));
        assert!(matches!(s.apply_command(7, &routed("a:1", 1)), Outcome::Rejected(_)), "a worker does not route");
        assert!(matches!(s.apply_command(7, &routed("c:1", 2)), Outcome::Rejected(_)), "not the active epoch yet");
        assert_eq!(s.apply_command(7, &routed("c:1", 1)), Outcome::Applied);
        assert_eq!(s.apply_command(8, &routed("d:1", 1)), Outcome::Applied);
        s.apply_command(9, &placement_over(2, &["a:1"]));
        s.apply_command(10, &ready(2, "a:1"));
        let all_up = |_: NodeId| true;
        assert!(s.retirable(&all_up).is_empty(), "c and d still route by epoch 1");
        assert_eq!(s.apply_command(11, &routed("c:1", 2)), Outcome::Applied);
        assert_eq!(s.apply_command(12, &routed("c:1", 1)), Outcome::Applied, "a late report does not go back");
        assert_eq!(s.placements["m"].routed["c:1"], 2);
        assert!(s.retirable(&all_up).is_empty(), "d still routes by epoch 1");
        let d_down = |id: NodeId| id != d.id();
        assert_eq!(s.retirable(&d_down), vec![("m".to_string(), 2)], "a coordinator that is down holds nothing up");
        assert_eq!(s.apply_command(13, &routed("d:1", 2)), Outcome::Applied);
        assert_eq!(s.retirable(&all_up), vec![("m".to_string(), 2)]);
        let retire = |epoch| Command::RetirePrevious { model: "m".into(), epoch };
        assert!(matches!(s.apply_command(14, &retire(1)), Outcome::Rejected(_)), "1 is not the active epoch");
        assert_eq!(s.apply_command(14, &retire(2)), Outcome::Applied);
        let m = &s.placements["m"];
        assert!(m.previous.is_none() && !m.answers("a:1", 1) && m.answers("a:1", 2));
        assert!(matches!(s.apply_command(15, &retire(2)), Outcome::Rejected(_)), "nothing left to retire");
        assert!(s.retirable(&all_up).is_empty());
        assert_eq!(ClusterState::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn heat_reports_decay_what_came_before_and_are_checked_against_the_model() {
        let mut s = ClusterState::default();
        let mut w = member("w:1");
        w.models.push(ModelOnDisk { fingerprint: "m".into(), expert_bytes: 1, shape: Some(ModelShape { moe_layers: vec![1, 3], experts: 4, top_k: 2 }) });
        s.apply_member_change(1, &MemberChange::Add { member: w.clone() }, &[w.id()], &[]);
        let report = |counts: Vec<(u32, u32, u64)>| Command::ReportHeat { model: "m".into(), by: "w:1".into(), counts };
        assert_eq!(s.apply_command(2, &report(vec![(1, 0, 160), (3, 3, 16)])), Outcome::Applied);
        assert_eq!(s.apply_command(3, &report(vec![(1, 1, 10)])), Outcome::Applied);
        let h = &s.heat["m"];
        assert_eq!((h.layers[&1].clone(), h.layers[&3].clone(), h.reports), (vec![150, 10, 0, 0], vec![0, 0, 0, 15], 2));
        assert_eq!(h.as_map()[&(1, 0)], 150);
        assert!(matches!(s.apply_command(4, &report(vec![(2, 0, 1)])), Outcome::Rejected(_)), "layer 2 is dense");
        assert!(matches!(s.apply_command(4, &report(vec![(1, 4, 1)])), Outcome::Rejected(_)), "expert 4 of 4");
        let stranger = Command::ReportHeat { model: "m".into(), by: "x:1".into(), counts: vec![] };
        assert!(matches!(s.apply_command(4, &stranger), Outcome::Rejected(_)));
        let other = Command::ReportHeat { model: "other".into(), by: "w:1".into(), counts: vec![] };
        assert!(matches!(s.apply_command(4, &other), Outcome::Rejected(_)));
    }

    #[test]
    fn a_member_with_an_impossible_model_shape_is_refused() {
        let mut m = member("a:1");
        m.models.push(ModelOnDisk { fingerprint: "f".into(), expert_bytes: 1, shape: Some(ModelShape { moe_layers: vec![1], experts: 4, top_k: 8 }) });
        assert!(m.validate().unwrap_err().contains("top-8"));
        m.models[0].shape = Some(ModelShape { moe_layers: vec![0; MAX_MOE_LAYERS + 1], experts: 4, top_k: 2 });
        assert!(m.validate().is_err());
        m.models[0].shape = Some(ModelShape { moe_layers: vec![1, 3], experts: 4, top_k: 2 });
        assert!(m.validate().is_ok());
    }

    #[test]
    fn oversized_and_garbage_entries_are_refused() {
        assert!(decode::<Command>(b"{\"op\":\"nope\"}").is_err());
        assert!(decode::<Command>(&vec![b' '; MAX_COMMAND_BYTES + 1]).unwrap_err().contains("limit"));
        assert_ne!(node_id("a"), node_id("b"));
        assert!(node_id("") >= 1);
    }
}
