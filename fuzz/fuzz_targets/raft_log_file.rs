#![no_main]
//! Bytes as `raft.redb` in a data directory → `RaftLog::open`: a damaged or foreign file is an
//! error naming it, never a panic; a log that opens yields its stored applied state, which must
//! decode or be refused with a reason. And the same bytes as a committed entry's command, applied
//! to a small state: applied or rejected, never a panic.
use libfuzzer_sys::fuzz_target;
use shimmer_control::state::{decode, Command};
use shimmer_control::{ClusterState, RaftLog};

fuzz_target!(|data: &[u8]| {
    if let Ok(dir) = tempfile::tempdir() {
        if std::fs::write(dir.path().join(shimmer_control::log_store::FILE_NAME), data).is_ok() {
            match RaftLog::open(dir.path()) {
                Ok((log, _record)) => {
                    let _ = raft::Storage::initial_state(&log);
                }
                Err(e) => assert!(e.to_string().contains(shimmer_control::log_store::FILE_NAME), "{e}"),
            }
        }
    }
    if let Ok(cmd) = decode::<Command>(data) {
        let mut state = ClusterState::default();
        let _ = state.apply_command(1, &cmd);
    }
    let _ = ClusterState::decode(data);
});
