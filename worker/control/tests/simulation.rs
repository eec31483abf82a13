//! Deterministic simulation of the control plane: 3 and 5 `ControlNode`s over a seeded in-memory
//! network that loses, delays and reorders messages, partitions nodes, and crashes and restarts
//! them from their logs (kept across a crash as a disk would be) — raft-rs's own harness, with
//! our state machine, log and membership policy inside.
//!
//! Every node is also a worker with the model on disk: the leader places it over the nodes it
//! sees up and not draining, and each node says it is ready for a proposed epoch it is part of
//! (as a worker does once its experts are loaded), so placements are proposed, superseded and
//! activated under the same faults.
//!
//! Checked at every step: at most one leader per term; two nodes that applied up to the same
//! index hold the same state (so committed entries are never lost or reordered); a node's
//! applied index and the active and latest placement epochs it holds never go down, not even
//! across restarts; every active placement gives every expert a holder among the members; a
//! partitioned minority of the voters commits nothing beyond what a majority held when it was
//! cut off (crediting the minority with anything its leader can hand it); what a leader commits
//! is held by a majority of its voters.
//!
//! Clients read the placement (ReadIndex reads from any node); the history of reads and
//! activations is checked for linearizability (`check_register`, shown to reject known-bad
//! histories).
//!
//! The network, faults and proposals are seeded; raft-rs draws its randomised election timeouts
//! from its own thread RNG, so two runs of one seed may elect differently (the checks hold for
//! every interleaving; a failure prints the seed's schedule state to start from). At the
//! end, healed: every node converges to the same state, with the wanted number of voters and
//! the model placed over every node.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use shimmer_control::state::{Capacity, ClusterState, Command, Member, MemberChange, ModelOnDisk, ModelShape, NodeKind};
use shimmer_control::{ControlNode, NodeConfig, NodeError, Output, RaftLog, RaftMessage, StateRole};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn member(name: &str) -> Member {
    Member {
        name: name.into(),
        kind: NodeKind::Worker,
        control_addr: format!("{name}:7070"),
        data_addr: Some(format!("{name}:7070")),
        capacity: Capacity { vram: 0, ram: 1 << 30, disk: 1 << 40 },
        models: vec![ModelOnDisk { fingerprint: "m".into(), expert_bytes: 1 << 20, shape: Some(shape()) }],
        draining: false,
    }
}

fn shape() -> ModelShape {
    ModelShape { moe_layers: vec![1, 3], experts: 8, top_k: 2 }
}

/// One operation on a model's placement register as a client saw it: a ReadIndex read (invoked,
/// answered, the active epoch it returned), or a write (an epoch becoming active, timed when a
/// member first applied it — no later than it took effect anywhere).
#[derive(Debug, Clone, Copy)]
enum RegisterOp {
    Read { invoked: u64, answered: u64, epoch: u64 },
    Activated { at: u64, epoch: u64 },
}

/// Checks a history of the placement register (a max-register: epochs only grow) for
/// linearizability: every read returns at least every epoch activated before it was invoked and
/// every epoch an earlier read (answered before it was invoked) returned, and nothing activated
/// only after it was answered.
fn check_register(history: &[RegisterOp]) -> Result<(), String> {
    for op in history {
        let RegisterOp::Read { invoked, answered, epoch } = *op else { continue };
        for other in history {
            match *other {
                RegisterOp::Activated { at, epoch: e } if at < invoked && e > epoch => {
                    return Err(format!("a read invoked at {invoked} returned epoch {epoch}, but {e} was active from {at}"));
                }
                RegisterOp::Read { answered: a, epoch: e, .. } if a < invoked && e > epoch => {
                    return Err(format!("a read invoked at {invoked} returned epoch {epoch} after a read answered at {a} returned {e}"));
                }
                _ => {}
            }
        }
        let known = history.iter().filter_map(|o| match *o {
            RegisterOp::Activated { at, epoch: e } if at <= answered => Some(e),
            _ => None,
        });
        if epoch > known.max().unwrap_or(0) {
            return Err(format!("a read answered at {answered} returned epoch {epoch}, not active yet"));
        }
    }
    Ok(())
}

struct Sim {
    rng: Rng,
    now: u64,
    names: Vec<String>,
    ids: Vec<u64>,
    logs: Vec<RaftLog>,
    nodes: Vec<Option<ControlNode>>,
    next_tick: Vec<u64>,
    /// In flight: (deliver at, order, message).
    wire: Vec<(u64, u64, RaftMessage)>,
    order: u64,
    /// Node index → partition group; messages cross groups only when equal.
    group: Vec<u32>,
    loss: f64,
    max_delay: u64,
    cfg: NodeConfig,
    // What the checks remember.
    leader_of_term: HashMap<u64, u64>,
    state_at: HashMap<u64, String>,
    applied_floor: Vec<u64>,
    epoch_floor: Vec<(u64, u64)>,
    /// When each node last said it was ready for a proposed epoch.
    last_ready: Vec<u64>,
    activations: u64,
    /// The placement register's history, and reads in flight (id → node, invoked at).
    register: Vec<RegisterOp>,
    reads: HashMap<u64, (usize, u64)>,
    next_read: u64,
    /// The highest commit index already checked against the logs, under these voters.
    checked_commit: u64,
    checked_voters: BTreeSet<u64>,
    minority_commit: Option<(Vec<usize>, Vec<u64>)>,
    done: u64,
    delivered: u64,
    /// Nodes that stopped on a log that lost acknowledged entries, with the error they gave.
    rolled_back: Vec<(usize, String)>,
}

impl Sim {
    fn new(seed: u64, n: usize, max_voters: usize) -> Sim {
        let names: Vec<String> = (0..n).map(|i| format!("10.0.0.{}", i + 1)).collect();
        let ids = names.iter().map(|n| shimmer_control::state::node_id(n)).collect();
        let cfg = NodeConfig { max_voters, replace_after_ms: 4000, down_after_ms: 1500, snapshot_every: 40, ..NodeConfig::default() };
        let mut rng = Rng(seed);
        let next_tick = (0..n).map(|_| rng.below(100)).collect();
        Sim {
            rng,
            now: 0,
            names,
            ids,
            logs: (0..n).map(|_| RaftLog::in_memory()).collect(),
            nodes: (0..n).map(|_| None).collect(),
            next_tick,
            wire: Vec::new(),
            order: 0,
            group: vec![0; n],
            loss: 0.0,
            max_delay: 5,
            cfg,
            leader_of_term: HashMap::new(),
            state_at: HashMap::new(),
            applied_floor: vec![0; n],
            epoch_floor: vec![(0, 0); n],
            last_ready: vec![0; n],
            activations: 0,
            register: Vec::new(),
            reads: HashMap::new(),
            next_read: 0,
            checked_commit: 0,
            checked_voters: BTreeSet::new(),
            minority_commit: None,
            done: 0,
            delivered: 0,
            rolled_back: Vec::new(),
        }
    }

    fn index_of(&self, id: u64) -> Option<usize> {
        self.ids.iter().position(|&i| i == id)
    }

    fn route(&mut self, from: usize, out: Output) {
        self.done += out.done.len() as u64;
        for id in &out.reads {
            if let (Some((node, invoked)), Some(n)) = (self.reads.remove(id), self.nodes[from].as_ref()) {
                assert_eq!(node, from, "a read answered by another node");
                let epoch = n.state.placements.get("m").map_or(0, |p| p.epoch());
                self.register.push(RegisterOp::Read { invoked, answered: self.now, epoch });
            }
        }
        for m in out.messages {
            let Some(to) = self.index_of(m.to) else { continue };
            if self.group[from] != self.group[to] || self.rng.chance(self.loss) {
                continue;
            }
            let at = self.now + 1 + self.rng.below(self.max_delay);
            self.order += 1;
            self.wire.push((at, self.order, m));
        }
    }

    fn run_node(&mut self, i: usize, f: impl FnOnce(&mut ControlNode, u64) -> Result<Output, NodeError>) {
        let now = self.now;
        let Some(node) = self.nodes[i].as_mut() else { return };
        match f(node, now) {
            Ok(out) => self.route(i, out),
            Err(NodeError::NoLeader) | Err(NodeError::ChangeInProgress) | Err(NodeError::NotLeader(_)) => {}
            Err(e @ NodeError::LogBehind { .. }) => {
                // The process exits with that error: the node is gone until an operator acts.
                self.rolled_back.push((i, e.to_string()));
                self.crash(i);
            }
            Err(e) => panic!("node {} failed: {e}", self.names[i]),
        }
    }

    fn start(&mut self, i: usize) {
        self.nodes[i] = Some(ControlNode::restart(self.logs[i].clone(), self.cfg.clone(), self.ids[i]).expect("restart from the log"));
    }

    fn crash(&mut self, i: usize) {
        self.nodes[i] = None;
        self.reads.retain(|_, (n, _)| *n != i);
        let id = self.ids[i];
        self.wire.retain(|(_, _, m)| m.to != id);
    }

    /// Advances time by `ms` in 1 ms steps: deliveries, ticks, checks.
    fn run(&mut self, ms: u64) {
        for _ in 0..ms {
            self.now += 1;
            let now = self.now;
            let mut due: Vec<(u64, u64, RaftMessage)> = Vec::new();
            self.wire.retain(|w| {
                if w.0 <= now {
                    due.push(w.clone());
                    false
                } else {
                    true
                }
            });
            due.sort_by_key(|w| (w.0, w.1));
            for (_, _, m) in due {
                if let Some(i) = self.index_of(m.to) {
                    let from = self.index_of(m.from);
                    assert!(from.is_none_or(|f| self.group[f] == self.group[i]), "crossed a partition: {m:?}");
                    self.delivered += 1;
                    self.run_node(i, |n, now| n.step(m, now));
                }
            }
            for i in 0..self.nodes.len() {
                if now >= self.next_tick[i] {
                    self.next_tick[i] += self.cfg.tick_ms;
                    self.run_node(i, |n, now| n.tick(now));
                    self.say_ready(i);
                }
            }
            self.check();
        }
    }

    fn check(&mut self) {
        for i in 0..self.nodes.len() {
            let Some(n) = &self.nodes[i] else { continue };
            let st = n.status();
            if st.role == StateRole::Leader {
                let prev = *self.leader_of_term.entry(st.term).or_insert(st.id);
                assert_eq!(prev, st.id, "two leaders in term {} at {} ms", st.term, self.now);
            }
            let applied = n.state.applied;
            assert!(applied >= self.applied_floor[i], "{} went back from applied {} to {applied}", self.names[i], self.applied_floor[i]);
            self.applied_floor[i] = applied;
            let digest = serde_json::to_string(&n.state).unwrap();
            let seen = self.state_at.entry(applied).or_insert_with(|| digest.clone());
            assert_eq!(*seen, digest, "{} holds a different state at applied index {applied}", self.names[i]);
            let epochs = n.state.placements.get("m").map_or((0, 0), |p| (p.epoch(), p.latest_epoch()));
            let floor = self.epoch_floor[i];
            assert!(epochs.0 >= floor.0 && epochs.1 >= floor.1, "{}: placement epochs went down from {floor:?} to {epochs:?}", self.names[i]);
            if epochs.0 > floor.0 {
                self.activations += 1;
                let seen = self.register.iter().any(|o| matches!(o, RegisterOp::Activated { epoch, .. } if *epoch == epochs.0));
                if !seen {
                    self.register.push(RegisterOp::Activated { at: self.now, epoch: epochs.0 });
                }
            }
            self.epoch_floor[i] = epochs;
            if let Some(active) = n.state.placements.get("m").and_then(|p| p.active.as_ref()) {
                let layers: Vec<usize> = shape().moe_layers.iter().map(|&l| l as usize).collect();
                active.placement.validate("m", &layers, shape().experts as usize).unwrap_or_else(|e| panic!("{}: active placement: {e}", self.names[i]));
            }
        }
        // What a leader commits is held by a majority of its voters. Entries a leader committed
        // just before a membership change took effect count under the old voters: the check
        // starts again above the leader's commit whenever its voter set changes.
        for i in 0..self.nodes.len() {
            let Some(n) = &self.nodes[i] else { continue };
            if !n.is_leader() {
                continue;
            }
            let commit = n.status().commit;
            if n.state.voters != self.checked_voters {
                self.checked_voters = n.state.voters.clone();
                self.checked_commit = commit;
                continue;
            }
            if commit > self.checked_commit {
                let held = self.held_by_majority(&n.state.voters, &[]);
                assert!(commit <= held, "{} committed {commit}, but a majority of the voters hold only up to {held}", self.names[i]);
                self.checked_commit = commit;
            }
        }
        if let Some((minority, commits)) = &self.minority_commit {
            for (k, &i) in minority.iter().enumerate() {
                if let Some(n) = &self.nodes[i] {
                    assert!(
                        n.status().commit <= commits[k],
                        "{} in a minority {minority:?} committed entry {} (the cluster had committed {}): {:?} voters {:?}",
                        self.names[i],
                        n.status().commit,
                        commits[k],
                        n.status(),
                        n.state.voters
                    );
                }
            }
        }
    }

    /// The highest index at which a majority of `voters` hold the same entry (same term),
    /// counting the voters in `credited` as holding everything (a minority's leader can hand them
    /// any entry it has).
    fn held_by_majority(&self, voters: &BTreeSet<u64>, credited: &[usize]) -> u64 {
        let credited_ids: BTreeSet<u64> = credited.iter().map(|&i| self.ids[i]).filter(|id| voters.contains(id)).collect();
        let logs: Vec<&RaftLog> = voters.iter().filter(|id| !credited_ids.contains(id)).filter_map(|id| self.index_of(*id)).map(|i| &self.logs[i]).collect();
        let quorum = (voters.len() / 2 + 1).saturating_sub(credited_ids.len());
        let top = logs.iter().map(|l| raft::Storage::last_index(*l).unwrap_or(0)).max().unwrap_or(0);
        (1..=top)
            .rev()
            .find(|&i| {
                let mut terms: BTreeMap<u64, usize> = BTreeMap::new();
                for l in &logs {
                    if let Ok(t) = raft::Storage::term(*l, i) {
                        *terms.entry(t).or_default() += 1;
                    }
                }
                quorum == 0 || terms.values().any(|&c| c >= quorum)
            })
            .unwrap_or(0)
    }

    fn leader(&self) -> Option<usize> {
        (0..self.nodes.len()).find(|&i| self.nodes[i].as_ref().is_some_and(|n| n.is_leader()))
    }

    /// Proposes until applied somewhere (or gives up after `ms`).
    fn add_member(&mut self, i: usize) {
        let m = member(&self.names[i].clone());
        for _ in 0..100 {
            if let Some(l) = self.leader() {
                if self.nodes[l].as_ref().unwrap().state.members.contains_key(&self.ids[i]) {
                    return;
                }
                let change = MemberChange::Add { member: m.clone() };
                self.run_node(l, |n, _| n.propose_member_change(change).map(|(_, o)| o));
            }
            self.run(200);
        }
        let views: Vec<String> =
            self.nodes.iter().flatten().map(|n| format!("{:?} voters {:?} learners {:?}", n.status(), n.state.voters, n.state.learners)).collect();
        panic!("{} never joined: {views:#?}", self.names[i]);
    }

    fn propose_something(&mut self) {
        let i = self.rng.below(self.nodes.len() as u64) as usize;
        if self.nodes[i].is_none() {
            return;
        }
        // A linearizable read of the placement, from wherever the client happens to ask.
        self.next_read += 1;
        let id = self.next_read;
        self.reads.insert(id, (i, self.now));
        self.run_node(i, |n, now| n.read(id, now));
        let who = self.rng.below(self.names.len() as u64) as usize;
        let cmd = Command::SetDraining { name: self.names[who].clone(), draining: self.rng.chance(0.3) };
        self.run_node(i, |n, _| n.propose(cmd).map(|(_, o)| o));
    }

    /// A node of a proposed placement says it is ready (at most every 300 ms while it waits).
    fn say_ready(&mut self, i: usize) {
        let Some(n) = &self.nodes[i] else { return };
        let name = &self.names[i];
        let Some(p) = n.state.placements.get("m").and_then(|p| p.proposed.as_ref().map(|r| (r, &p.ready))) else { return };
        if !p.0.worker_names().contains(name.as_str()) || p.1.contains(name) || self.now < self.last_ready[i] + 300 {
            return;
        }
        self.last_ready[i] = self.now;
        let cmd = Command::PlacementReady { model: "m".into(), epoch: p.0.epoch, worker: name.clone() };
        self.run_node(i, |n, _| n.propose(cmd).map(|(_, o)| o));
    }

    fn states(&self) -> BTreeSet<String> {
        self.nodes.iter().flatten().map(|n| serde_json::to_string(&n.state).unwrap()).collect()
    }
}

/// One seeded schedule: bootstrap, joins, then faults, then healing.
fn schedule(seed: u64, n: usize, max_voters: usize) -> (u64, u64) {
    let mut sim = Sim::new(seed, n, max_voters);
    sim.logs[0] = RaftLog::in_memory();
    sim.nodes[0] = Some(ControlNode::bootstrap(sim.logs[0].clone(), sim.cfg.clone(), member(&sim.names[0]), "sim".into()).unwrap());
    for i in 1..n {
        sim.start(i);
    }
    sim.run(2500);
    assert!(sim.leader() == Some(0), "seed {seed}: the bootstrap node leads a cluster of one");
    for i in 1..n {
        sim.add_member(i);
    }
    // Learners are promoted up to the wanted voter count.
    sim.run(3000);
    sim.loss = 0.05 + (seed % 4) as f64 * 0.05;
    sim.max_delay = 5 + seed % 40;
    let quorum = max_voters.min(n) / 2 + 1;
    for _round in 0..60 {
        match sim.rng.below(10) {
            0 => {
                // Crash a node, keeping enough voters for a quorum most of the time.
                let up = sim.nodes.iter().filter(|x| x.is_some()).count();
                if up > quorum {
                    let i = sim.rng.below(n as u64) as usize;
                    sim.crash(i);
                }
            }
            1 => {
                for i in 0..n {
                    if sim.nodes[i].is_none() {
                        sim.start(i);
                    }
                }
            }
            2 if sim.group.iter().all(|&g| g == 0) => {
                // Cut off a minority of the nodes (1 of 3, 1 or 2 of 5).
                let size = 1 + sim.rng.below(((n - 1) / 2) as u64) as usize;
                let mut minority = Vec::new();
                while minority.len() < size {
                    let i = sim.rng.below(n as u64) as usize;
                    if !minority.contains(&i) {
                        minority.push(i);
                    }
                }
                for &i in &minority {
                    sim.group[i] = 1;
                }
                sim.wire.clear();
                // A minority of the voters (with learners it may hold more nodes) may commit
                // nothing new: the commit index each had stays where it was. While a membership
                // change is under way the nodes know different voter sets (a lagging one the
                // old, the leader the new), so the cut nodes count as a minority only if they
                // are one in every set a node holds — a set where they are a majority may be the
                // committed one, under which their commits are legitimate.
                let mut sets: Vec<BTreeSet<u64>> = sim.nodes.iter().flatten().map(|x| x.state.voters.clone()).collect();
                sets.sort();
                sets.dedup();
                let is_minority = |voters: &BTreeSet<u64>| minority.iter().filter(|&&i| voters.contains(&sim.ids[i])).count() < voters.len() / 2 + 1;
                if !sets.is_empty() && sets.iter().all(is_minority) {
                    // What a majority of the voters held when cut off (the minority's leader may
                    // still count acks it had for it, and tell the others), and nothing beyond.
                    let live = sim.nodes.iter().flatten().map(|x| x.status().commit);
                    let persisted = sim.logs.iter().map(|l| l.hard_state().commit);
                    let held = sets.iter().map(|voters| sim.held_by_majority(voters, &minority)).max().unwrap_or(0);
                    let committed = live.chain(persisted).max().unwrap_or(0).max(held);
                    let commits = vec![committed; minority.len()];
                    sim.minority_commit = Some((minority, commits));
                }
            }
            3 => {
                sim.group = vec![0; n];
                sim.minority_commit = None;
            }
            _ => sim.propose_something(),
        }
        let ms = 100 + sim.rng.below(600);
        sim.run(ms);
    }
    // Heal: everyone back, no loss.
    sim.group = vec![0; n];
    sim.minority_commit = None;
    sim.loss = 0.0;
    for i in 0..n {
        if sim.nodes[i].is_none() {
            sim.start(i);
        }
    }
    sim.run(4000);
    for i in 0..n {
        let leader = sim.leader().unwrap_or(0);
        let cmd = Command::SetDraining { name: sim.names[i].clone(), draining: false };
        sim.run_node(leader, |node, _| node.propose(cmd).map(|(_, o)| o));
        sim.run(300);
    }
    sim.run(8000);
    let states = sim.states();
    if states.len() != 1 {
        for n in sim.nodes.iter().flatten() {
            let p = n.state.placements.get("m");
            eprintln!(
                "{:?} applied {} active {:?} proposed {:?} ready {:?} draining {:?}",
                n.status(),
                n.state.applied,
                p.map(|p| p.epoch()),
                p.and_then(|p| p.proposed.as_ref().map(|r| (r.epoch, r.worker_names()))),
                p.map(|p| &p.ready),
                n.state.members.values().filter(|m| m.draining).map(|m| &m.name).collect::<Vec<_>>()
            );
        }
    }
    assert_eq!(states.len(), 1, "seed {seed}: nodes did not converge: {} different states", states.len());
    let st: ClusterState = serde_json::from_str(states.iter().next().unwrap()).unwrap();
    assert_eq!(st.members.len(), n, "seed {seed}");
    assert_eq!(st.voters.len(), max_voters.min(n), "seed {seed}: voters {:?} learners {:?}", st.voters, st.learners);
    assert_eq!(st.voters.len() + st.learners.len(), n, "seed {seed}");
    let placed = &st.placements["m"];
    let everyone: BTreeSet<&str> = sim.names.iter().map(String::as_str).collect();
    assert!(placed.proposed.is_none(), "seed {seed}: a placement still waits: {placed:?}");
    assert_eq!(placed.active.as_ref().map(|a| a.worker_names()), Some(everyone), "seed {seed}: the model is not placed over every node");
    let leaders: BTreeMap<u64, u64> = sim.leader_of_term.iter().map(|(k, v)| (*k, *v)).collect();
    assert!(!leaders.is_empty());
    assert!(sim.activations > 0);
    let reads = sim.register.iter().filter(|o| matches!(o, RegisterOp::Read { .. })).count();
    assert!(reads > 0, "seed {seed}: no read was answered");
    check_register(&sim.register).unwrap_or_else(|e| panic!("seed {seed}: the placement register is not linearizable: {e}"));
    (sim.done, sim.delivered)
}

#[test]
fn three_nodes_under_loss_partitions_and_crashes() {
    let mut done = 0;
    for seed in 0..24 {
        done += schedule(seed, 3, 3).0;
    }
    // Work got done: the checks above are not vacuous.
    assert!(done > 24 * 10, "only {done} proposals applied");
}

#[test]
fn five_nodes_under_loss_partitions_and_crashes() {
    let mut done = 0;
    for seed in 100..112 {
        done += schedule(seed, 5, 5).0;
    }
    assert!(done > 12 * 10, "only {done} proposals applied");
}

#[test]
fn five_members_with_three_voters_keep_two_learners() {
    for seed in 200..206 {
        schedule(seed, 5, 3);
    }
}

/// A voter that stays down is replaced: a learner is promoted and the dead voter demoted.
#[test]
fn a_voter_gone_too_long_is_replaced_by_a_learner() {
    let mut sim = Sim::new(7, 4, 3);
    sim.nodes[0] = Some(ControlNode::bootstrap(sim.logs[0].clone(), sim.cfg.clone(), member(&sim.names[0]), "sim".into()).unwrap());
    for i in 1..4 {
        sim.start(i);
    }
    sim.run(1500);
    for i in 1..4 {
        sim.add_member(i);
    }
    sim.run(3000);
    let st = sim.nodes[0].as_ref().unwrap().state.clone();
    assert_eq!(st.voters.len(), 3);
    let learner = *st.learners.iter().next().unwrap();
    // Kill a voter that is not the leader.
    let leader = sim.leader().unwrap();
    let victim = (0..4).find(|&i| i != leader && st.voters.contains(&sim.ids[i])).unwrap();
    sim.crash(victim);
    sim.run(sim.cfg.replace_after_ms + 4000);
    let st = sim.nodes[leader].as_ref().unwrap().state.clone();
    assert!(st.voters.contains(&learner), "the learner was not promoted: {st:?}");
    assert!(!st.voters.contains(&sim.ids[victim]) && st.learners.contains(&sim.ids[victim]), "the dead voter was not demoted");
    assert_eq!(st.voters.len(), 3);
}

/// A follower restarted on an older copy of its log (a restored backup) stops with an error
/// saying so when the leader — which knows what it acknowledged — commits past its end, instead
/// of raft-rs panicking; the others keep committing.
#[test]
fn a_follower_on_an_older_copy_of_its_log_stops_saying_so() {
    let mut sim = Sim::new(11, 3, 3);
    sim.nodes[0] = Some(ControlNode::bootstrap(sim.logs[0].clone(), sim.cfg.clone(), member(&sim.names[0]), "sim".into()).unwrap());
    for i in 1..3 {
        sim.start(i);
    }
    sim.run(1500);
    for i in 1..3 {
        sim.add_member(i);
    }
    sim.run(1000);
    let leader = sim.leader().unwrap();
    let f = (0..3).find(|&i| i != leader).unwrap();
    let backup = sim.logs[f].detached_copy();
    for _ in 0..20 {
        let cmd = Command::SetDraining { name: sim.names[leader].clone(), draining: true };
        sim.run_node(leader, |n, _| n.propose(cmd).map(|(_, o)| o));
        sim.run(50);
    }
    assert!(sim.logs[f].last_index() > backup.last_index() + 5, "the follower acknowledged more after the backup");
    sim.crash(f);
    sim.logs[f] = backup;
    sim.applied_floor[f] = 0;
    sim.epoch_floor[f] = (0, 0);
    sim.start(f);
    sim.run(1000);
    assert_eq!(sim.leader(), Some(leader), "the same leader (one that took over would simply bring the node up to date)");
    let [(who, err)] = sim.rolled_back.as_slice() else { panic!("expected the rolled-back node alone to stop: {:?}", sim.rolled_back) };
    assert_eq!(*who, f);
    assert!(err.contains("restored from an older copy") && err.contains("--join"), "{err}");
    let before = sim.nodes[leader].as_ref().unwrap().status().commit;
    let cmd = Command::SetDraining { name: sim.names[leader].clone(), draining: false };
    sim.run_node(leader, |n, _| n.propose(cmd).map(|(_, o)| o));
    sim.run(500);
    assert!(sim.nodes[leader].as_ref().unwrap().status().commit > before, "the other two kept committing");
}

#[test]
fn the_register_checker_rejects_stale_reads_and_reads_of_the_future() {
    use RegisterOp::*;
    let good = [
        Activated { at: 10, epoch: 1 },
        Read { invoked: 5, answered: 12, epoch: 0 },
        Read { invoked: 11, answered: 20, epoch: 1 },
        Activated { at: 30, epoch: 2 },
    ];
    check_register(&good).unwrap();
    // Invoked after epoch 2 was active, yet it says 1.
    assert!(check_register(&[Activated { at: 10, epoch: 2 }, Read { invoked: 11, answered: 12, epoch: 1 }]).is_err());
    // After an earlier read saw 2, a later one says 1.
    assert!(check_register(&[
        Activated { at: 1, epoch: 1 },
        Activated { at: 5, epoch: 2 },
        Read { invoked: 6, answered: 7, epoch: 2 },
        Read { invoked: 8, answered: 9, epoch: 1 }
    ])
    .is_err());
    // An epoch nobody had yet.
    assert!(check_register(&[Read { invoked: 1, answered: 2, epoch: 3 }, Activated { at: 5, epoch: 3 }]).is_err());
}
