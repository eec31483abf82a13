//! One member's Raft node: raft-rs's `RawNode` over the log, the replicated state it applies,
//! and the leader's membership decisions. It takes events with the time they happen (`now`, in
//! milliseconds of a monotonic clock the caller owns) and returns what to do: messages to send,
//! proposals and reads completed. The driver (`shimmer-worker`'s control service) carries them
//! out over gRPC; the simulation (`tests/simulation.rs`) over a seeded in-memory network.
//!
//! Must never: read a clock or open a socket (its only I/O is the log it was given); report a
//! proposal done before its entry was applied; let a read complete before the state it reads has
//! caught up with the leader's commit index at the time of the read.

use std::collections::{BTreeMap, HashMap};

use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeType, ConfState, Entry, EntryType, Message, Snapshot};
use raft::{RawNode, StateRole};

use crate::log_store::{AppliedState, LogError, RaftLog};
use crate::state::{self, ClusterState, Command, Member, MemberChange, NodeId, Outcome, Proposal};

/// Timing and sizes of a node. Ticks are the Raft clock: an election after `election_ticks`
/// without a leader, heartbeats every `heartbeat_ticks`.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub tick_ms: u64,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Voters wanted (the rest are learners): 1 to 7; 3 by default, 5 for more tolerance.
    pub max_voters: usize,
    /// A peer not heard from for this long is reported down.
    pub down_after_ms: u64,
    /// A voter down this long is replaced by promoting an up learner.
    pub replace_after_ms: u64,
    /// Entries applied between two snapshots of the state (which compact the log).
    pub snapshot_every: u64,
    /// Copies of every expert the leader's placements make (fewer with fewer workers).
    pub replicas: usize,
    /// The drop in imbalance (busiest worker's share over the mean) a rebalance must bring.
    pub rebalance_gain: f64,
    /// The least time between two rebalances of a model the leader starts by itself.
    pub rebalance_every_ms: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            tick_ms: 100,
            election_ticks: 10,
            heartbeat_ticks: 2,
            max_voters: 3,
            down_after_ms: 3000,
            replace_after_ms: 30_000,
            snapshot_every: 1000,
            replicas: 2,
            rebalance_gain: 0.15,
            rebalance_every_ms: 300_000,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("the Raft log holds a state snapshot that does not decode: {0}")]
    BadSnapshot(String),
    #[error("no leader is known yet; try again")]
    NoLeader,
    #[error("a membership change is in progress; try again")]
    ChangeInProgress,
    #[error("this node is not the leader (node {0} is)")]
    NotLeader(NodeId),
    #[error(
        "this node's Raft log ends at entry {last} but the leader knows it held entry {commit}: its log lost entries it had \
         acknowledged (was --data-dir restored from an older copy?); remove the data directory and start the node with --join \
         to rejoin as a new member"
    )]
    LogBehind { last: u64, commit: u64 },
}

/// What the caller should do after an event.
#[derive(Debug, Default)]
pub struct Output {
    /// Raft messages to deliver (each names its recipient in `to`).
    pub messages: Vec<Message>,
    /// This node's proposals that were applied, by sequence number, with how.
    pub done: Vec<(u64, Outcome)>,
    /// Reads (by the id given to `read`) that may now be answered from `state`.
    pub reads: Vec<u64>,
    /// The state changed (entries were applied or a snapshot installed).
    pub applied: bool,
    /// This node was removed from the cluster.
    pub removed: bool,
}

/// What a node says about its Raft state.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStatus {
    pub id: NodeId,
    pub leader: NodeId,
    pub term: u64,
    pub role: StateRole,
    pub commit: u64,
    pub applied: u64,
    pub last_index: u64,
}

/// The context of a proposed membership change: who asked, and what it means.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct ChangeContext {
    by: NodeId,
    seq: u64,
    change: MemberChange,
}

pub struct ControlNode {
    raw: RawNode<RaftLog>,
    log: RaftLog,
    pub state: ClusterState,
    cfg: NodeConfig,
    id: NodeId,
    seq: u64,
    /// The leader's view: when each peer was last heard from.
    last_heard: HashMap<NodeId, u64>,
    leader_since: Option<u64>,
    last_leader: NodeId,
    /// Reads waiting for the leader's confirmation (read id → issued at), then for the state to
    /// reach an index (read id → index).
    reads_asked: BTreeMap<u64, u64>,
    reads_waiting: Vec<(u64, u64)>,
    pub leader_changes: u64,
    pub failed_proposals: u64,
    now: u64,
    /// The leader's view: peers it is sending a snapshot, since when.
    snapshot_since: HashMap<NodeId, u64>,
    /// When this leader last rebalanced each model (its rate limit; a new leader starts afresh).
    last_rebalance: HashMap<String, u64>,
}

fn raft_config(id: NodeId, applied: u64, cfg: &NodeConfig) -> raft::Config {
    raft::Config {
        id,
        election_tick: cfg.election_ticks,
        heartbeat_tick: cfg.heartbeat_ticks,
        applied,
        max_size_per_msg: 1 << 20,
        max_inflight_msgs: 256,
        // A leader that cannot reach a quorum steps down, so a minority never believes it leads.
        check_quorum: true,
        // A node back from a partition does not disrupt the cluster with a higher term.
        pre_vote: true,
        ..Default::default()
    }
}

fn logger() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

impl ControlNode {
    /// A new cluster of one: this node is its only voter, and the state names it.
    pub fn bootstrap(log: RaftLog, cfg: NodeConfig, me: Member, cluster_id: String) -> Result<ControlNode, NodeError> {
        let id = me.id();
        let mut st = ClusterState { cluster_id, ..Default::default() };
        st.apply_member_change(1, &MemberChange::Add { member: me }, &[id], &[]);
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 1;
        snap.mut_metadata().term = 1;
        snap.mut_metadata().mut_conf_state().voters = vec![id];
        snap.data = st.encode().into();
        log.persist(Some(&snap), &[], None)?;
        log.save_applied(AppliedState { index: 1, conf_state: snap.get_metadata().get_conf_state().clone(), state: st.encode() })?;
        Self::restart(log, cfg, id)
    }

    /// A node resuming from its log (after a restart, or one that joined and waits for the
    /// leader to send it the state).
    pub fn restart(log: RaftLog, cfg: NodeConfig, id: NodeId) -> Result<ControlNode, NodeError> {
        let (applied, state) = match log.applied() {
            Some(a) => (a.index, ClusterState::decode(&a.state).map_err(NodeError::BadSnapshot)?),
            None => {
                let (index, data) = log.snapshot_data();
                let st = if data.is_empty() { ClusterState::default() } else { ClusterState::decode(&data).map_err(NodeError::BadSnapshot)? };
                (index, st)
            }
        };
        let raw = RawNode::new(&raft_config(id, applied, &cfg), log.clone(), &logger())?;
        Ok(ControlNode {
            raw,
            log,
            state,
            cfg,
            id,
            seq: 0,
            last_heard: HashMap::new(),
            leader_since: None,
            snapshot_since: HashMap::new(),
            last_rebalance: HashMap::new(),
            last_leader: 0,
            reads_asked: BTreeMap::new(),
            reads_waiting: Vec::new(),
            leader_changes: 0,
            failed_proposals: 0,
            now: 0,
        })
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    pub fn status(&self) -> NodeStatus {
        let r = &self.raw.raft;
        NodeStatus {
            id: self.id,
            leader: r.leader_id,
            term: r.term,
            role: r.state,
            commit: r.raft_log.committed,
            applied: self.state.applied,
            last_index: r.raft_log.last_index(),
        }
    }

    /// The leader's view of how far each peer's log matches its own (empty on a follower).
    pub fn matched(&self) -> BTreeMap<NodeId, u64> {
        if !self.is_leader() {
            return BTreeMap::new();
        }
        self.raw.raft.prs().iter().map(|(&id, p)| (id, p.matched)).collect()
    }

    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// The leader's view of who is up (this node always is); empty on a follower, which cannot
    /// know.
    pub fn liveness(&self) -> BTreeMap<NodeId, bool> {
        if !self.is_leader() {
            return BTreeMap::new();
        }
        self.state.members.keys().map(|&id| (id, self.is_up(id))).collect()
    }

    fn is_up(&self, id: NodeId) -> bool {
        id == self.id || self.last_heard.get(&id).is_some_and(|&t| self.now.saturating_sub(t) <= self.cfg.down_after_ms)
    }

    fn down_for(&self, id: NodeId) -> u64 {
        if id == self.id {
            return 0;
        }
        let since = self.last_heard.get(&id).copied().or(self.leader_since).unwrap_or(self.now);
        self.now.saturating_sub(since)
    }

    /// One Raft tick; the leader also makes its membership decisions.
    pub fn tick(&mut self, now: u64) -> Result<Output, NodeError> {
        self.now = now;
        self.raw.tick();
        let mut out = Output::default();
        self.expire_reads(now);
        if self.is_leader() {
            self.retry_lost_snapshots();
            self.manage_membership()?;
            self.manage_placement()?;
        }
        self.advance(&mut out)?;
        Ok(out)
    }

    /// A message from a peer.
    pub fn step(&mut self, msg: Message, now: u64) -> Result<Output, NodeError> {
        self.now = now;
        if msg.to != self.id {
            return Ok(Output::default());
        }
        self.last_heard.insert(msg.from, now);
        // A leader's heartbeat commits no further than what this node acknowledged; raft-rs
        // panics (its `fatal!`) if that is past the end of the log, which happens only when the
        // log lost acknowledged entries. That is this node's error, said before raft-rs sees it.
        let last = self.raw.raft.raft_log.last_index();
        if msg.get_msg_type() == raft::eraftpb::MessageType::MsgHeartbeat && msg.term >= self.raw.raft.term && msg.commit > last {
            return Err(NodeError::LogBehind { last, commit: msg.commit });
        }
        let mut out = Output::default();
        // raft-rs refuses messages it cannot use (from an unknown peer, a stale term): not ours
        // to fail on.
        let _ = self.raw.step(msg);
        self.advance(&mut out)?;
        Ok(out)
    }

    /// Proposes a command; its sequence number comes back in `Output::done` once applied.
    pub fn propose(&mut self, command: Command) -> Result<(u64, Output), NodeError> {
        let seq = self.append_proposal(command)?;
        let mut out = Output::default();
        self.advance(&mut out)?;
        Ok((seq, out))
    }

    /// Hands raft-rs a proposal; what it makes of it comes out of the next `advance`.
    fn append_proposal(&mut self, command: Command) -> Result<u64, NodeError> {
        if self.raw.raft.leader_id == 0 {
            self.failed_proposals += 1;
            return Err(NodeError::NoLeader);
        }
        self.seq += 1;
        let data = state::encode(&Proposal { by: self.id, seq: self.seq, command });
        if let Err(e) = self.raw.propose(vec![], data) {
            self.failed_proposals += 1;
            return Err(match e {
                raft::Error::ProposalDropped => NodeError::NoLeader,
                other => other.into(),
            });
        }
        Ok(self.seq)
    }

    /// Proposes a membership change (one at a time, cluster-wide).
    /// Only the leader takes them: a follower's would be forwarded and could be dropped
    /// silently (raft-rs turns a second pending change into an empty entry), so the caller
    /// asks the leader instead.
    pub fn propose_member_change(&mut self, change: MemberChange) -> Result<(u64, Output), NodeError> {
        let seq = self.append_member_change(change)?;
        let mut out = Output::default();
        self.advance(&mut out)?;
        Ok((seq, out))
    }

    fn append_member_change(&mut self, change: MemberChange) -> Result<u64, NodeError> {
        if !self.is_leader() {
            self.failed_proposals += 1;
            return Err(if self.raw.raft.leader_id == 0 { NodeError::NoLeader } else { NodeError::NotLeader(self.raw.raft.leader_id) });
        }
        if self.raw.raft.has_pending_conf() {
            return Err(NodeError::ChangeInProgress);
        }
        let name = match &change {
            MemberChange::Add { member } => member.name.clone(),
            MemberChange::Promote { name } | MemberChange::Demote { name } | MemberChange::Remove { name } => name.clone(),
        };
        let change_type = match &change {
            MemberChange::Add { .. } | MemberChange::Demote { .. } => ConfChangeType::AddLearnerNode,
            MemberChange::Promote { .. } => ConfChangeType::AddNode,
            MemberChange::Remove { .. } => ConfChangeType::RemoveNode,
        };
        self.seq += 1;
        let mut cc = ConfChange::default();
        cc.set_change_type(change_type);
        cc.node_id = state::node_id(&name);
        cc.context = state::encode(&ChangeContext { by: self.id, seq: self.seq, change }).into();
        if let Err(e) = self.raw.propose_conf_change(vec![], cc) {
            self.failed_proposals += 1;
            return Err(match e {
                raft::Error::ProposalDropped => NodeError::ChangeInProgress,
                other => other.into(),
            });
        }
        Ok(self.seq)
    }

    /// A linearizable read (ReadIndex): `id` comes back in `Output::reads` once `state` is at
    /// least as new as the leader's commit index when it was asked. raft-rs drops the request
    /// when there is no leader; the caller retries after `read_retry_ms`.
    pub fn read(&mut self, id: u64, now: u64) -> Result<Output, NodeError> {
        self.now = now;
        self.reads_asked.insert(id, now);
        self.raw.read_index(id.to_le_bytes().to_vec());
        let mut out = Output::default();
        self.advance(&mut out)?;
        Ok(out)
    }

    /// How long to wait for a read's confirmation before asking again.
    pub fn read_retry_ms(&self) -> u64 {
        self.cfg.tick_ms * self.cfg.election_ticks as u64
    }

    fn expire_reads(&mut self, now: u64) {
        let retry = self.read_retry_ms();
        let stale: Vec<u64> = self.reads_asked.iter().filter(|(_, &t)| now.saturating_sub(t) >= retry).map(|(&id, _)| id).collect();
        for id in stale {
            self.reads_asked.insert(id, now);
            self.raw.read_index(id.to_le_bytes().to_vec());
        }
    }

    /// Forgets a read the caller gave up on.
    pub fn cancel_read(&mut self, id: u64) {
        self.reads_asked.remove(&id);
        self.reads_waiting.retain(|(r, _)| *r != id);
    }

    /// The leader's membership decisions, one change at a time: promote an up, caught-up learner
    /// while there are fewer voters than wanted or a voter has been down longer than
    /// `replace_after_ms`; demote a down voter while there are more voters than wanted.
    fn manage_membership(&mut self) -> Result<(), NodeError> {
        if self.raw.raft.has_pending_conf() || self.raw.raft.raft_log.committed > self.state.applied {
            return Ok(());
        }
        let conf = self.raw.raft.prs().conf().to_conf_state();
        let want = self.cfg.max_voters.clamp(1, 7).min(self.state.members.len());
        let last = self.raw.raft.raft_log.last_index();
        let caught_up = |id: NodeId| self.raw.raft.prs().get(id).is_some_and(|p| p.matched > 0 && p.matched + 16 >= last);
        // Deterministic choices: the learner with the smallest name, the voter down longest.
        let mut learners: Vec<&Member> =
            conf.learners.iter().filter(|&&id| self.is_up(id) && caught_up(id)).filter_map(|id| self.state.members.get(id)).filter(|m| !m.draining).collect();
        learners.sort_by(|a, b| a.name.cmp(&b.name));
        let mut down_voters: Vec<(u64, NodeId)> = conf.voters.iter().filter(|&&id| !self.is_up(id)).map(|&id| (self.down_for(id), id)).collect();
        down_voters.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let change = if conf.voters.len() > want {
            // A down voter first; with all up (one came back after its replacement), the
            // voter with the largest name other than this leader.
            let mut up_voters: Vec<&Member> = conf.voters.iter().filter(|&&id| id != self.id).filter_map(|id| self.state.members.get(id)).collect();
            up_voters.sort_by(|a, b| b.name.cmp(&a.name));
            down_voters
                .first()
                .and_then(|(_, id)| self.state.members.get(id))
                .or(up_voters.first().copied())
                .map(|m| MemberChange::Demote { name: m.name.clone() })
        } else if conf.voters.len() < want || down_voters.first().is_some_and(|(t, _)| *t >= self.cfg.replace_after_ms) {
            learners.first().map(|m| MemberChange::Promote { name: m.name.clone() })
        } else {
            None
        };
        if let Some(change) = change {
            tracing::info!(?change, "membership");
            // Its messages go out with the tick's `advance`.
            match self.append_member_change(change) {
                Ok(_) | Err(NodeError::ChangeInProgress) | Err(NodeError::NoLeader) | Err(NodeError::NotLeader(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// raft-rs waits for a peer's answer to a snapshot before sending it anything else; a
    /// snapshot lost on the way (a dropped connection, a peer that crashed) would stall that peer
    /// for good. One unanswered for two election timeouts is reported failed, so it is sent again.
    fn retry_lost_snapshots(&mut self) {
        let now = self.now;
        let in_snapshot: Vec<NodeId> = self.raw.raft.prs().iter().filter(|(_, p)| p.state == raft::ProgressState::Snapshot).map(|(&id, _)| id).collect();
        self.snapshot_since.retain(|id, _| in_snapshot.contains(id));
        let patience = 2 * self.read_retry_ms();
        for id in in_snapshot {
            let since = *self.snapshot_since.entry(id).or_insert(now);
            if now.saturating_sub(since) >= patience {
                self.raw.report_snapshot(id, raft::SnapshotStatus::Failure);
                self.snapshot_since.remove(&id);
            }
        }
    }

    /// The leader's placement decisions (`placer`), once its liveness view is worth trusting
    /// (it has led for `down_after_ms`) and with nothing of its own still uncommitted or
    /// unapplied, so a decision is never made twice.
    fn manage_placement(&mut self) -> Result<(), NodeError> {
        let led_for = self.leader_since.map_or(0, |t| self.now.saturating_sub(t));
        if led_for < self.cfg.down_after_ms || self.raw.raft.raft_log.last_index() > self.state.applied {
            return Ok(());
        }
        for (model, epoch) in self.state.retirable(&|id| self.is_up(id)) {
            tracing::info!(%model, epoch, "every coordinator routes by epoch {epoch}: the one before it is retired");
            match self.append_proposal(Command::RetirePrevious { model, epoch }) {
                Ok(_) | Err(NodeError::NoLeader) => {}
                Err(e) => return Err(e),
            }
        }
        let cfg = self.placer_config();
        let decisions = crate::placer::decide(&self.state, &|id| self.is_up(id), cfg);
        if decisions.is_empty() {
            return self.rebalance_when_worth_it(cfg);
        }
        for decision in decisions {
            match decision {
                Ok(record) => {
                    tracing::info!(model = %record.placement.model, epoch = record.epoch, workers = record.placement.workers.len(), "placement proposed");
                    match self.append_proposal(Command::ProposePlacement { record }) {
                        Ok(_) | Err(NodeError::NoLeader) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(why) => tracing::warn!("{why}"),
            }
        }
        Ok(())
    }

    fn placer_config(&self) -> crate::placer::PlacerConfig {
        crate::placer::PlacerConfig { replicas: self.cfg.replicas, rebalance_gain: self.cfg.rebalance_gain }
    }

    /// A model whose heat says a new plan is worth `rebalance_gain`, and that this leader did
    /// not rebalance within `rebalance_every_ms`, gets the next epoch.
    fn rebalance_when_worth_it(&mut self, cfg: crate::placer::PlacerConfig) -> Result<(), NodeError> {
        let since = self.leader_since.unwrap_or(self.now);
        let models: Vec<String> = self.state.placements.iter().filter(|(_, p)| p.proposed.is_none()).map(|(m, _)| m.clone()).collect();
        for model in models {
            let last = self.last_rebalance.get(&model).copied().unwrap_or(since);
            if self.now.saturating_sub(last) < self.cfg.rebalance_every_ms {
                continue;
            }
            let Some(r) = crate::placer::rebalance(&self.state, &model, cfg) else { continue };
            let Some(record) = r.record.filter(|_| r.imbalance_now - r.imbalance_after >= cfg.rebalance_gain) else { continue };
            tracing::info!(%model, epoch = record.epoch, from = r.imbalance_now, to = r.imbalance_after, "rebalancing by routing heat");
            self.last_rebalance.insert(model, self.now);
            match self.append_proposal(Command::ProposePlacement { record }) {
                Ok(_) | Err(NodeError::NoLeader) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// What rebalancing every placed model now would do, whatever the threshold and the rate
    /// limit (`shimmer cluster rebalance`); unless `dry_run`, the leader proposes each new plan.
    pub fn rebalance_now(&mut self, dry_run: bool) -> Result<(Vec<crate::placer::Rebalance>, Output), NodeError> {
        if !self.is_leader() {
            return Err(if self.raw.raft.leader_id == 0 { NodeError::NoLeader } else { NodeError::NotLeader(self.raw.raft.leader_id) });
        }
        let cfg = self.placer_config();
        let models: Vec<String> = self.state.placements.keys().cloned().collect();
        let mut reports = Vec::new();
        for model in models {
            let Some(r) = crate::placer::rebalance(&self.state, &model, cfg) else { continue };
            if let (false, Some(record)) = (dry_run, r.record.clone()) {
                self.last_rebalance.insert(model.clone(), self.now);
                self.append_proposal(Command::ProposePlacement { record })?;
            }
            reports.push(r);
        }
        let mut out = Output::default();
        self.advance(&mut out)?;
        Ok((reports, out))
    }

    /// Handles every pending `Ready`: persist, then apply, then collect what to send.
    fn advance(&mut self, out: &mut Output) -> Result<(), NodeError> {
        while self.raw.has_ready() {
            let mut rd = self.raw.ready();
            if let Some(ss) = rd.ss() {
                if ss.leader_id != self.last_leader && ss.leader_id != 0 {
                    self.leader_changes += 1;
                    self.last_leader = ss.leader_id;
                }
                if ss.raft_state == StateRole::Leader {
                    // A peer is up once heard from; the replacement clock starts no earlier
                    // than this node's leadership.
                    self.leader_since = Some(self.now);
                }
            }
            out.messages.extend(rd.take_messages());
            let snapshot = (!rd.snapshot().is_empty()).then(|| rd.snapshot().clone());
            self.log.persist(snapshot.as_ref(), rd.entries(), rd.hs())?;
            if let Some(s) = &snapshot {
                self.state = ClusterState::decode(&s.data).map_err(NodeError::BadSnapshot)?;
                self.state.applied = s.get_metadata().index;
                self.save_applied(s.get_metadata().get_conf_state().clone())?;
                out.applied = true;
            }
            for rs in rd.take_read_states() {
                if let Ok(b) = <[u8; 8]>::try_from(rs.request_ctx.as_slice()) {
                    let id = u64::from_le_bytes(b);
                    if self.reads_asked.remove(&id).is_some() {
                        self.reads_waiting.push((id, rs.index));
                    }
                }
            }
            self.apply(rd.take_committed_entries(), out)?;
            out.messages.extend(rd.take_persisted_messages());
            let mut light = self.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                self.log.set_commit(commit)?;
            }
            out.messages.extend(light.take_messages());
            self.apply(light.take_committed_entries(), out)?;
            self.raw.advance_apply();
        }
        let applied = self.state.applied;
        self.reads_waiting.retain(|&(id, index)| {
            let ready = index <= applied;
            if ready {
                out.reads.push(id);
            }
            !ready
        });
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>, out: &mut Output) -> Result<(), NodeError> {
        let Some(last) = entries.last().map(|e| e.index) else { return Ok(()) };
        for e in entries {
            if e.index <= self.state.applied {
                continue;
            }
            match e.get_entry_type() {
                EntryType::EntryNormal if e.data.is_empty() => self.state.applied = e.index,
                EntryType::EntryNormal => match state::decode::<Proposal>(&e.data) {
                    Ok(p) => {
                        let outcome = self.state.apply_command(e.index, &p.command);
                        if let Outcome::Rejected(why) = &outcome {
                            tracing::warn!(index = e.index, "a committed command was refused: {why}");
                        }
                        if p.by == self.id {
                            out.done.push((p.seq, outcome));
                        }
                    }
                    Err(why) => {
                        tracing::warn!(index = e.index, "a committed entry does not decode: {why}");
                        self.state.applied = e.index;
                    }
                },
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    let cc = if e.get_entry_type() == EntryType::EntryConfChange { ConfChange::parse_from_bytes(&e.data).ok() } else { None };
                    let Some(cc) = cc else {
                        self.state.applied = e.index;
                        continue;
                    };
                    let conf = match self.raw.apply_conf_change(&cc) {
                        Ok(cs) => cs,
                        // Refused the same way by everyone (e.g. removing the last voter).
                        Err(_) => self.raw.raft.prs().conf().to_conf_state(),
                    };
                    match state::decode::<ChangeContext>(&cc.context) {
                        Ok(ctx) => {
                            let outcome = self.state.apply_member_change(e.index, &ctx.change, &conf.voters, &conf.learners);
                            if ctx.by == self.id {
                                out.done.push((ctx.seq, outcome));
                            }
                        }
                        Err(_) => {
                            self.state.apply_member_change(e.index, &MemberChange::Promote { name: String::new() }, &conf.voters, &conf.learners);
                        }
                    }
                    if cc.node_id == self.id && cc.get_change_type() == ConfChangeType::RemoveNode {
                        out.removed = true;
                    }
                }
            }
        }
        out.applied = true;
        let conf = self.raw.raft.prs().conf().to_conf_state();
        self.save_applied(conf.clone())?;
        if last >= self.log.snapshot_data().0 + self.cfg.snapshot_every {
            self.snapshot(conf)?;
        }
        Ok(())
    }

    fn save_applied(&self, conf_state: ConfState) -> Result<(), NodeError> {
        Ok(self.log.save_applied(AppliedState { index: self.state.applied, conf_state, state: self.state.encode() })?)
    }

    /// Replaces the applied part of the log by a snapshot of the state.
    fn snapshot(&mut self, conf: ConfState) -> Result<(), NodeError> {
        let index = self.state.applied;
        let term = raft::Storage::term(&self.log, index)?;
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = index;
        snap.mut_metadata().term = term;
        snap.mut_metadata().set_conf_state(conf);
        snap.data = self.state.encode().into();
        self.log.compact(&snap)?;
        Ok(())
    }

    /// Tells raft-rs a peer could not be reached (it then probes instead of streaming).
    pub fn report_unreachable(&mut self, id: NodeId) {
        self.raw.report_unreachable(id);
    }

    pub fn campaign(&mut self) -> Result<Output, NodeError> {
        self.raw.campaign()?;
        let mut out = Output::default();
        self.advance(&mut out)?;
        Ok(out)
    }
}
