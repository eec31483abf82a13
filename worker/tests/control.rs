//! The control plane over real gRPC, TLS and token proofs, in one process: a node bootstraps,
//! two join (one with the pinned `SHM1` token), `status` agrees everywhere with three voters and
//! a leader; a node with the wrong token or a token pinning another CA cannot join; a node
//! restarted on its data directory resumes as the same member.

use std::time::{Duration, Instant};

use shimmer_control::state::{Capacity, Member, NodeKind};
use shimmer_control::{ClusterToken, NodeConfig};
use shimmer_worker::control::{admin_any, AdminReply, AdminRequest, ControlOptions, ControlPlane, ControlTrust, Start, StatusView};

const SECRET: &str = "the-cluster-secret-1";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn member(addr: &str) -> Member {
    Member {
        name: addr.into(),
        kind: NodeKind::Worker,
        control_addr: addr.into(),
        data_addr: Some(addr.into()),
        capacity: Capacity { vram: 0, ram: 1 << 30, disk: 0 },
        models: vec![],
        draining: false,
    }
}

fn start(dir: &std::path::Path, addr: &str, start: Start, token: &str) -> Result<ControlPlane, shimmer_worker::control::ControlError> {
    ControlPlane::start(ControlOptions {
        mdns: false,
        data_dir: dir.to_path_buf(),
        listen: addr.into(),
        member: member(addr),
        start,
        trust: ControlTrust::with_token(ClusterToken::parse(token).unwrap()),
        node: NodeConfig { down_after_ms: 1500, ..NodeConfig::default() },
    })
}

fn status(addrs: &[String]) -> StatusView {
    match admin_any(addrs, &ControlTrust::with_token(ClusterToken::parse(SECRET).unwrap()), &AdminRequest::Status { forwarded: false }) {
        Ok(AdminReply::Status { status }) => status,
        other => panic!("status: {other:?}"),
    }
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn three_nodes_join_by_token_and_agree_and_strangers_are_refused() {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let addrs: Vec<String> = (0..4).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let a = start(dirs[0].path(), &addrs[0], Start::Bootstrap, SECRET).unwrap();
    let pinned = a.token().expect("a member given a token prints one");
    assert!(pinned.starts_with("SHM1") && pinned.ends_with(SECRET), "{pinned}");
    let b = start(dirs[1].path(), &addrs[1], Start::Join(vec![addrs[0].clone()]), SECRET).unwrap();
    let c = start(dirs[2].path(), &addrs[2], Start::Join(vec!["127.0.0.1:1".into(), addrs[1].clone()]), &pinned).unwrap();
    let three = addrs[..3].to_vec();
    wait_for("three voters, all up", 30, || {
        let s = status(&three);
        s.members.len() == 3 && s.members.iter().all(|m| m.role == "voter" && m.up == Some(true))
    });
    let s = status(&three);
    assert!(s.leader.is_some());
    // Every member answers the same (a follower asks the leader who is up).
    for one in &three {
        let t = status(std::slice::from_ref(one));
        assert_eq!((t.leader.clone(), t.members.clone()), (s.leader.clone(), s.members.clone()), "asked {one}");
    }

    // The wrong secret is refused by the proof; a token pinning another CA by the TLS check.
    let wrong = start(dirs[3].path(), &addrs[3], Start::Join(vec![addrs[0].clone()]), "a-different-secret-2");
    let err = wrong.err().expect("joined with the wrong token").to_string();
    assert!(err.contains("did not prove the cluster's join token"), "{err}");
    let other_ca = format!("SHM1{}::{SECRET}", "ab".repeat(32));
    let err = start(dirs[3].path(), &addrs[3], Start::Join(vec![addrs[0].clone()]), &other_ca).err().expect("joined another cluster's CA").to_string();
    assert!(err.contains("CA"), "{err}");
    assert_eq!(status(&three).members.len(), 3);

    // A member restarted on its data directory resumes (no --join needed), and the cluster
    // keeps a leader meanwhile.
    drop(c);
    wait_for("the stopped member reported down", 20, || status(&addrs[..2]).members.iter().any(|m| m.name == addrs[2] && m.up == Some(false)));
    let c = start(dirs[2].path(), &addrs[2], Start::Bootstrap, SECRET).unwrap();
    wait_for("the restarted member up again", 20, || status(&three).members.iter().all(|m| m.up == Some(true)));
    assert_eq!(c.state().members.len(), 3);
    drop((a, b, c));
}
