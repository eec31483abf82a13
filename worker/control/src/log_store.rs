//! Raft's log, hard state and snapshot: held in memory for raft-rs's `Storage` reads, and written
//! through to a durable `redb` database (`raft.redb` under `--data-dir`) before raft-rs is told
//! they are persisted. The simulation uses the same in-memory core without the database, kept
//! across simulated crashes as a disk would be.
//!
//! Every stored value carries an xxh3 checksum over its key and bytes, so a flipped byte or a
//! value moved to another key is found when the log is opened; the log must also be contiguous
//! and agree with its hard state. Either problem is an error naming the file and what is wrong.
//!
//! Must never: tell raft-rs something is persisted before the write is durable; open a log that
//! fails its checks; serve an entry below the snapshot.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, StorageError};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const HARD_STATE: &str = "hard_state";
const SNAPSHOT: &str = "snapshot";
const NODE: &str = "node";
const APPLIED: &str = "applied";
/// The file under the data directory.
pub const FILE_NAME: &str = "raft.redb";

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: {reason}")]
    Corrupt { path: String, reason: String },
    #[error("{path}: cannot write the Raft log: {reason}")]
    Write { path: String, reason: String },
    #[error("{path}: {reason}")]
    Open { path: String, reason: String },
}

/// What raft-rs reads, in memory: the hard state, the last snapshot (with its data) and the
/// entries after it.
#[derive(Default, Clone)]
pub struct LogCore {
    hard_state: HardState,
    snapshot: Snapshot,
    entries: Vec<Entry>,
    applied: Option<AppliedState>,
}

/// The state machine as of an applied index, with the Raft configuration at that index: stored
/// after every batch applied, so a restarted node resumes there instead of replaying the log
/// (and its configuration is never older than what it applied).
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedState {
    pub index: u64,
    pub conf_state: ConfState,
    pub state: Vec<u8>,
}

impl AppliedState {
    fn encode(&self) -> Result<Vec<u8>, protobuf::ProtobufError> {
        let conf = self.conf_state.write_to_bytes()?;
        let mut out = Vec::with_capacity(16 + conf.len() + self.state.len());
        out.extend_from_slice(&self.index.to_le_bytes());
        out.extend_from_slice(&(conf.len() as u64).to_le_bytes());
        out.extend_from_slice(&conf);
        out.extend_from_slice(&self.state);
        Ok(out)
    }

    fn decode(b: &[u8]) -> Option<AppliedState> {
        let index = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
        let n = usize::try_from(u64::from_le_bytes(b.get(8..16)?.try_into().ok()?)).ok()?;
        let conf = b.get(16..16usize.checked_add(n)?)?;
        let conf_state = ConfState::parse_from_bytes(conf).ok()?;
        Some(AppliedState { index, conf_state, state: b[16 + n..].to_vec() })
    }
}

impl LogCore {
    fn first_index(&self) -> u64 {
        self.snapshot.get_metadata().index + 1
    }

    fn last_index(&self) -> u64 {
        self.entries.last().map_or(self.snapshot.get_metadata().index, |e| e.index)
    }

    /// The configuration as of what was applied (raft-rs redelivers only later entries).
    fn conf_state(&self) -> ConfState {
        match &self.applied {
            Some(a) if a.index >= self.snapshot.get_metadata().index => a.conf_state.clone(),
            _ => self.snapshot.get_metadata().get_conf_state().clone(),
        }
    }

    fn append(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else { return };
        let keep = first.index.saturating_sub(self.first_index()) as usize;
        self.entries.truncate(keep);
        self.entries.extend_from_slice(entries);
    }

    fn apply_snapshot(&mut self, snapshot: &Snapshot) {
        let meta = snapshot.get_metadata();
        self.hard_state.term = self.hard_state.term.max(meta.term);
        self.hard_state.commit = self.hard_state.commit.max(meta.index);
        self.entries.retain(|e| e.index > meta.index);
        // Entries after a received snapshot that do not continue it are stale.
        if self.entries.first().is_some_and(|e| e.index != meta.index + 1) {
            self.entries.clear();
        }
        self.snapshot = snapshot.clone();
    }

    /// Drops entries up to the snapshot's index, which replaces them.
    fn compact(&mut self, snapshot: &Snapshot) {
        let index = snapshot.get_metadata().index;
        self.entries.retain(|e| e.index > index);
        self.snapshot = snapshot.clone();
    }

    fn storage_entries(&self, low: u64, high: u64, max_size: Option<u64>) -> raft::Result<Vec<Entry>> {
        if low < self.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index() + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let offset = self.first_index();
        let mut out = Vec::new();
        let mut size = 0u64;
        for e in &self.entries[(low - offset) as usize..(high - offset) as usize] {
            size += u64::from(e.compute_size());
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let meta = self.snapshot.get_metadata();
        if idx == meta.index {
            return Ok(meta.term);
        }
        if idx < self.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > self.last_index() {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(self.entries[(idx - self.first_index()) as usize].term)
    }
}

/// The log raft-rs runs on: in memory alone (`durable: None`, the simulation) or written through
/// to a database file.
#[derive(Clone)]
pub struct RaftLog {
    core: Arc<RwLock<LogCore>>,
    durable: Option<Arc<Durable>>,
}

struct Durable {
    db: redb::Database,
    path: PathBuf,
}

impl RaftLog {
    /// An empty log in memory.
    pub fn in_memory() -> RaftLog {
        RaftLog { core: Arc::new(RwLock::new(LogCore::default())), durable: None }
    }

    /// Opens (or creates) `dir/raft.redb` and checks it: checksums, contiguity, hard state.
    /// Returns the log and the node record stored with it (what this node is; `None` if new).
    pub fn open(dir: &Path) -> Result<(RaftLog, Option<Vec<u8>>), LogError> {
        let path = dir.join(FILE_NAME);
        let name = path.display().to_string();
        let open_err = |reason: String| LogError::Open { path: name.clone(), reason };
        std::fs::create_dir_all(dir)
            .map_err(|e| LogError::Open { path: dir.display().to_string(), reason: format!("cannot create the data directory: {e}") })?;
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => open_err("already open by another shimmer process (one node per --data-dir)".into()),
            other => open_err(format!("not a readable Raft log: {other}")),
        })?;
        let corrupt = |reason: String| LogError::Corrupt { path: name.clone(), reason };
        let mut core = LogCore::default();
        let mut node = None;
        {
            let w = db.begin_write().map_err(|e| open_err(e.to_string()))?;
            w.open_table(ENTRIES).map_err(|e| open_err(e.to_string()))?;
            w.open_table(META).map_err(|e| open_err(e.to_string()))?;
            w.commit().map_err(|e| open_err(e.to_string()))?;
            let r = db.begin_read().map_err(|e| open_err(e.to_string()))?;
            let meta = r.open_table(META).map_err(|e| open_err(e.to_string()))?;
            let get = |key: &str| -> Result<Option<Vec<u8>>, LogError> {
                match meta.get(key).map_err(|e| corrupt(e.to_string()))? {
                    None => Ok(None),
                    Some(v) => unseal(key.as_bytes(), v.value()).map(Some).ok_or_else(|| corrupt(format!("the stored {key} fails its checksum"))),
                }
            };
            if let Some(b) = get(HARD_STATE)? {
                core.hard_state = HardState::parse_from_bytes(&b).map_err(|e| corrupt(format!("the stored hard state does not decode: {e}")))?;
            }
            if let Some(b) = get(SNAPSHOT)? {
                core.snapshot = Snapshot::parse_from_bytes(&b).map_err(|e| corrupt(format!("the stored snapshot does not decode: {e}")))?;
            }
            node = get(NODE)?.or(node);
            if let Some(b) = get(APPLIED)? {
                core.applied = Some(AppliedState::decode(&b).ok_or_else(|| corrupt("the stored applied state does not decode".into()))?);
            }
            let entries = r.open_table(ENTRIES).map_err(|e| open_err(e.to_string()))?;
            let mut expect = core.first_index();
            for item in entries.iter().map_err(|e| corrupt(e.to_string()))? {
                let (k, v) = item.map_err(|e| corrupt(e.to_string()))?;
                let index = k.value();
                if index < expect && expect == core.first_index() {
                    // Left below a snapshot by a compaction that did not get to delete it.
                    continue;
                }
                let bytes = unseal(&index.to_le_bytes(), v.value()).ok_or_else(|| corrupt(format!("entry {index} fails its checksum")))?;
                let e = Entry::parse_from_bytes(&bytes).map_err(|e| corrupt(format!("entry {index} does not decode: {e}")))?;
                if index != expect || e.index != index {
                    return Err(corrupt(format!("the log is not contiguous: expected entry {expect}, found {index} (holding {})", e.index)));
                }
                core.entries.push(e);
                expect += 1;
            }
        }
        if let Some(a) = core.applied.as_ref().filter(|a| a.index > core.hard_state.commit) {
            return Err(corrupt(format!("entry {} is applied but the hard state commits only {}", a.index, core.hard_state.commit)));
        }
        if core.hard_state.commit > core.last_index() {
            return Err(corrupt(format!("the hard state says entry {} is committed but the log ends at {}", core.hard_state.commit, core.last_index())));
        }
        Ok((RaftLog { core: Arc::new(RwLock::new(core)), durable: Some(Arc::new(Durable { db, path })) }, node))
    }

    /// An in-memory copy of this log as it is now, sharing nothing with it: what a backup of the
    /// data directory holds (the simulation restores one to check that a rolled-back node says so).
    pub fn detached_copy(&self) -> RaftLog {
        RaftLog { core: Arc::new(RwLock::new(self.read().clone())), durable: None }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, LogCore> {
        self.core.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, LogCore> {
        self.core.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn path(&self) -> Option<&Path> {
        self.durable.as_deref().map(|d| d.path.as_path())
    }

    /// Whether the log holds anything (a restarted node resumes from it).
    pub fn is_initialized(&self) -> bool {
        let c = self.read();
        c.last_index() > 0 || c.hard_state.term > 0 || !c.snapshot.get_metadata().get_conf_state().voters.is_empty()
    }

    pub fn hard_state(&self) -> HardState {
        self.read().hard_state.clone()
    }

    pub fn snapshot_data(&self) -> (u64, Vec<u8>) {
        let c = self.read();
        (c.snapshot.get_metadata().index, c.snapshot.data.to_vec())
    }

    pub fn last_index(&self) -> u64 {
        self.read().last_index()
    }

    /// Writes what a `Ready` says must be persisted — a received snapshot, new entries, the hard
    /// state — in one durable transaction, then makes it visible to raft-rs.
    pub fn persist(&self, snapshot: Option<&Snapshot>, entries: &[Entry], hard_state: Option<&HardState>) -> Result<(), LogError> {
        if let Some(d) = &self.durable {
            let fail = |e: &dyn std::fmt::Display| LogError::Write { path: d.path.display().to_string(), reason: e.to_string() };
            let w = d.db.begin_write().map_err(|e| fail(&e))?;
            {
                let mut table = w.open_table(ENTRIES).map_err(|e| fail(&e))?;
                let mut meta = w.open_table(META).map_err(|e| fail(&e))?;
                if let Some(s) = snapshot {
                    let index = s.get_metadata().index;
                    table.retain(|k, _| k > index).map_err(|e| fail(&e))?;
                    meta.insert(SNAPSHOT, seal(SNAPSHOT.as_bytes(), &s.write_to_bytes().map_err(|e| fail(&e))?).as_slice()).map_err(|e| fail(&e))?;
                }
                if let Some(first) = entries.first() {
                    // Entries from `first` on are replaced (a new leader's log wins).
                    let from = first.index;
                    table.retain_in(from.., |_, _| false).map_err(|e| fail(&e))?;
                    for e in entries {
                        table.insert(e.index, seal(&e.index.to_le_bytes(), &e.write_to_bytes().map_err(|e| fail(&e))?).as_slice()).map_err(|e| fail(&e))?;
                    }
                }
                if let Some(hs) = hard_state {
                    meta.insert(HARD_STATE, seal(HARD_STATE.as_bytes(), &hs.write_to_bytes().map_err(|e| fail(&e))?).as_slice()).map_err(|e| fail(&e))?;
                }
            }
            w.commit().map_err(|e| fail(&e))?;
        }
        let mut c = self.write();
        if let Some(s) = snapshot {
            c.apply_snapshot(s);
        }
        c.append(entries);
        if let Some(hs) = hard_state {
            c.hard_state = hs.clone();
        }
        Ok(())
    }

    /// Records a newer commit index (from a `LightReady`).
    pub fn set_commit(&self, commit: u64) -> Result<(), LogError> {
        let mut hs = self.hard_state();
        if commit <= hs.commit {
            return Ok(());
        }
        hs.commit = commit;
        self.persist(None, &[], Some(&hs))
    }

    /// Replaces the entries up to `snapshot`'s index by it (a snapshot this node made of its own
    /// applied state).
    pub fn compact(&self, snapshot: &Snapshot) -> Result<(), LogError> {
        if let Some(d) = &self.durable {
            let fail = |e: &dyn std::fmt::Display| LogError::Write { path: d.path.display().to_string(), reason: e.to_string() };
            let index = snapshot.get_metadata().index;
            let w = d.db.begin_write().map_err(|e| fail(&e))?;
            {
                let mut meta = w.open_table(META).map_err(|e| fail(&e))?;
                meta.insert(SNAPSHOT, seal(SNAPSHOT.as_bytes(), &snapshot.write_to_bytes().map_err(|e| fail(&e))?).as_slice()).map_err(|e| fail(&e))?;
                let mut table = w.open_table(ENTRIES).map_err(|e| fail(&e))?;
                table.retain_in(..=index, |_, _| false).map_err(|e| fail(&e))?;
            }
            w.commit().map_err(|e| fail(&e))?;
        }
        self.write().compact(snapshot);
        Ok(())
    }

    /// What was applied when the node last stopped (`None`: start from the snapshot).
    pub fn applied(&self) -> Option<AppliedState> {
        let c = self.read();
        c.applied.clone().filter(|a| a.index >= c.snapshot.get_metadata().index)
    }

    /// Records the state machine after applying up to `applied.index`.
    pub fn save_applied(&self, applied: AppliedState) -> Result<(), LogError> {
        if let Some(d) = &self.durable {
            let fail = |e: &dyn std::fmt::Display| LogError::Write { path: d.path.display().to_string(), reason: e.to_string() };
            let w = d.db.begin_write().map_err(|e| fail(&e))?;
            {
                let mut meta = w.open_table(META).map_err(|e| fail(&e))?;
                meta.insert(APPLIED, seal(APPLIED.as_bytes(), &applied.encode().map_err(|e| fail(&e))?).as_slice()).map_err(|e| fail(&e))?;
            }
            w.commit().map_err(|e| fail(&e))?;
        }
        self.write().applied = Some(applied);
        Ok(())
    }

    /// Stores what this node is (its name and role, written once at bootstrap or join).
    pub fn set_node_record(&self, bytes: &[u8]) -> Result<(), LogError> {
        let Some(d) = &self.durable else { return Ok(()) };
        let fail = |e: &dyn std::fmt::Display| LogError::Write { path: d.path.display().to_string(), reason: e.to_string() };
        let w = d.db.begin_write().map_err(|e| fail(&e))?;
        {
            let mut meta = w.open_table(META).map_err(|e| fail(&e))?;
            meta.insert(NODE, seal(NODE.as_bytes(), bytes).as_slice()).map_err(|e| fail(&e))?;
        }
        w.commit().map_err(|e| fail(&e))
    }
}

impl raft::Storage for RaftLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let c = self.read();
        Ok(RaftState::new(c.hard_state.clone(), c.conf_state()))
    }

    fn entries(&self, low: u64, high: u64, max_size: impl Into<Option<u64>>, _context: GetEntriesContext) -> raft::Result<Vec<Entry>> {
        self.read().storage_entries(low, high, max_size.into())
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.read().term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.read().first_index())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.read().last_index())
    }

    /// A snapshot of the state as applied now, with the configuration at that index (a joining
    /// node must find itself in it).
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let c = self.read();
        let Some(a) = c.applied.as_ref().filter(|a| a.index >= request_index && a.index >= c.snapshot.get_metadata().index) else {
            return Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable));
        };
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = a.index;
        snap.mut_metadata().term = c.term(a.index)?;
        snap.mut_metadata().set_conf_state(a.conf_state.clone());
        snap.data = a.state.clone().into();
        Ok(snap)
    }
}

/// `value` behind an 8-byte checksum over the key and the value, so the value cannot be moved to
/// another key unnoticed.
fn seal(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + value.len());
    out.extend_from_slice(&checksum(key, value).to_le_bytes());
    out.extend_from_slice(value);
    out
}

fn unseal(key: &[u8], stored: &[u8]) -> Option<Vec<u8>> {
    let (sum, value) = stored.split_at_checked(8)?;
    (u64::from_le_bytes(sum.try_into().ok()?) == checksum(key, value)).then(|| value.to_vec())
}

fn checksum(key: &[u8], value: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    h.update(value);
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage as _;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry { index, term, data: data.to_vec().into(), ..Default::default() }
    }

    #[test]
    fn the_log_survives_a_reopen_and_a_conflicting_append_replaces_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (log, node) = RaftLog::open(dir.path()).unwrap();
            assert!(node.is_none() && !log.is_initialized());
            let hs = HardState { term: 2, commit: 2, ..Default::default() };
            log.persist(None, &[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")], Some(&hs)).unwrap();
            // A new leader's entry 3 replaces ours.
            log.persist(None, &[entry(3, 2, b"C"), entry(4, 2, b"D")], None).unwrap();
            log.set_node_record(b"me").unwrap();
        }
        let (log, node) = RaftLog::open(dir.path()).unwrap();
        assert_eq!(node.as_deref(), Some(&b"me"[..]));
        assert_eq!(log.last_index(), 4);
        assert_eq!(log.term(3).unwrap(), 2);
        let es = log.entries(1, 5, None, GetEntriesContext::empty(false)).unwrap();
        assert_eq!(es.iter().map(|e| e.data.to_vec()).collect::<Vec<_>>(), vec![b"a".to_vec(), b"b".to_vec(), b"C".to_vec(), b"D".to_vec()]);
        assert_eq!(log.hard_state().commit, 2);
        // A snapshot at 3 replaces entries 1..=3.
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 3;
        snap.mut_metadata().term = 2;
        snap.data = b"state".to_vec().into();
        log.compact(&snap).unwrap();
        drop(log);
        let (log, _) = RaftLog::open(dir.path()).unwrap();
        assert_eq!(log.first_index().unwrap(), 4);
        assert_eq!(log.snapshot_data(), (3, b"state".to_vec()));
        assert!(matches!(log.entries(2, 4, None, GetEntriesContext::empty(false)), Err(raft::Error::Store(StorageError::Compacted))));
    }

    #[test]
    fn a_second_process_on_the_same_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_log, _) = RaftLog::open(dir.path()).unwrap();
        let err = RaftLog::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains(FILE_NAME) && err.contains("already open"), "{err}");
    }

    #[test]
    fn moved_or_flipped_values_fail_their_checksums() {
        let sealed = seal(b"k1", b"value");
        assert_eq!(unseal(b"k1", &sealed).as_deref(), Some(&b"value"[..]));
        assert_eq!(unseal(b"k2", &sealed), None);
        let mut flipped = sealed.clone();
        flipped[9] ^= 1;
        assert_eq!(unseal(b"k1", &flipped), None);
        assert_eq!(unseal(b"k1", &sealed[..4]), None);
    }
}
