//! The control plane with real `shimmer worker` processes on 127.0.0.x: one bootstraps, two join
//! by token; `shimmer cluster status --json` shows one leader and three voters up; kill -9 of the
//! leader → a new leader, and the killed node restarted on its `--data-dir` (no --join) rejoins;
//! a node with the wrong token cannot join, nor can an admin call with it; a corrupted or
//! truncated Raft log is refused with an error naming the file.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const TOKEN: &str = "control-plane-test-token";

struct Node {
    child: Child,
    listen: String,
    dir: std::path::PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free for both UDP (the data plane) and TCP (the control plane) on `ip`.
fn free_port(ip: &str) -> u16 {
    loop {
        let tcp = std::net::TcpListener::bind((ip, 0)).unwrap();
        let port = tcp.local_addr().unwrap().port();
        if std::net::UdpSocket::bind((ip, port)).is_ok() {
            return port;
        }
    }
}

fn worker_cmd(dir: &std::path::Path, listen: &str, extra: &[&str], token: &str) -> Command {
    let mut c = Command::new(shimmer_tests::shimmer_bin());
    c.args(["worker", "--model"])
        .arg(shimmer_tests::fixture("qwen3_moe"))
        .args(["--listen", listen, "--no-usage", "--data-dir"])
        .arg(dir)
        .args(extra)
        .env("SHIMMER_JOIN_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// Starts a member and waits for its control plane to listen.
fn start(dir: &std::path::Path, listen: &str, extra: &[&str]) -> Node {
    let mut child = worker_cmd(dir, listen, extra, TOKEN).spawn().unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        match lines.next() {
            Some(Ok(l)) => {
                let ready = l.contains("control plane on");
                seen.push(l);
                if ready {
                    break;
                }
            }
            _ => panic!("worker {listen} exited before its control plane started:\n{}", seen.join("\n")),
        }
    }
    // Keep draining stderr so the process never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Node { child, listen: listen.to_string(), dir: dir.to_path_buf() }
}

fn status(addrs: &[&str], token: &str) -> Result<Value, String> {
    let out =
        Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "status", "--json", "--join", &addrs.join(","), "--join-token", token]).output().unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim_end().lines().count(), 1, "status --json is one line: {text}");
    Ok(serde_json::from_str(&text).unwrap())
}

fn wait_status(addrs: &[&str], what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < until {
        match status(addrs, TOKEN) {
            Ok(v) if ok(&v) => return v,
            Ok(v) => last = v.to_string(),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out waiting for {what}; last status: {last}");
}

fn members(v: &Value) -> Vec<(String, String, Option<bool>)> {
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap().to_string(), m["role"].as_str().unwrap().to_string(), m["up"].as_bool()))
        .collect()
}

#[test]
fn members_join_by_token_and_a_killed_leader_is_replaced_and_rejoins() {
    let tmp = tempfile::tempdir().unwrap();
    let listens: Vec<String> = (2..=4).map(|i| format!("127.0.0.{i}:{}", free_port(&format!("127.0.0.{i}")))).collect();
    let addrs: Vec<&str> = listens.iter().map(String::as_str).collect();
    let dir = |i: usize| tmp.path().join(format!("node{i}"));
    let mut nodes: Vec<Option<Node>> = vec![Some(start(&dir(0), addrs[0], &["--bootstrap"]))];
    nodes.push(Some(start(&dir(1), addrs[1], &["--join", addrs[0]])));
    nodes.push(Some(start(&dir(2), addrs[2], &["--join", &format!("127.0.0.1:1,{}", addrs[1])])));
    let v = wait_status(&addrs, "three voters up", |v| members(v).len() == 3 && members(v).iter().all(|(_, role, up)| role == "voter" && *up == Some(true)));
    let leader = v["leader"].as_str().unwrap().to_string();
    assert!(addrs.contains(&leader.as_str()), "{v}");
    assert!(v["term"].as_u64().unwrap() >= 1 && v["placements"].is_array(), "{v}");
    for (m, addr) in v["members"].as_array().unwrap().iter().zip(&addrs) {
        assert_eq!(m["addr"].as_str(), Some(*addr), "addr is --listen as given: {v}");
    }

    // Nothing without the token: neither an admin call nor a join.
    let refused = status(&addrs, "not-the-cluster-token-9").unwrap_err();
    assert!(refused.contains("did not prove the cluster's join token"), "{refused}");
    let stranger_listen = format!("127.0.0.5:{}", free_port("127.0.0.5"));
    let out = worker_cmd(&tmp.path().join("stranger"), &stranger_listen, &["--join", addrs[0]], "not-the-cluster-token-9").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.status.code() != Some(101) && err.contains("did not prove the cluster's join token"), "{err}");

    // kill -9 of the leader: the others elect a new one and see it down.
    let k = addrs.iter().position(|a| *a == leader).unwrap();
    let mut killed = nodes[k].take().unwrap();
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let term = v["term"].as_u64().unwrap();
    let survivors: Vec<&str> = addrs.iter().copied().filter(|a| *a != leader).collect();
    let v = wait_status(&survivors, "a new leader that sees the old one down", |v| {
        v["leader"].as_str().is_some_and(|l| l != leader) && members(v).iter().any(|(n, _, up)| *n == leader && *up == Some(false))
    });
    assert!(v["term"].as_u64().unwrap() > term, "{v}");
    // Restarted on its data directory, with neither --bootstrap nor --join, it rejoins.
    nodes[k] = Some(start(&killed.dir, &killed.listen, &[]));
    drop(killed);
    wait_status(&addrs, "the restarted node up again", |v| members(v).iter().all(|(_, role, up)| role == "voter" && *up == Some(true)));
    let token = Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "token", "--join", addrs[0], "--join-token", TOKEN]).output().unwrap();
    let token = String::from_utf8(token.stdout).unwrap();
    assert!(token.starts_with("SHM1") && token.trim_end().ends_with(&format!("::{TOKEN}")), "{token}");

    // A stopped node's log, damaged: refused by name, never a panic or a silent fork.
    let mut last = nodes[2].take().unwrap();
    last.child.kill().unwrap();
    last.child.wait().unwrap();
    let log = last.dir.join("raft.redb");
    let bytes = std::fs::read(&log).unwrap();
    let name = addrs[2].as_bytes();
    let at = bytes.windows(name.len()).position(|w| w == name).expect("the log holds the member's name");
    let mut flipped = bytes.clone();
    flipped[at] ^= 0x20;
    for (what, damaged) in [("a flipped byte", flipped), ("a truncated file", bytes[..bytes.len() / 3].to_vec())] {
        std::fs::write(&log, &damaged).unwrap();
        let out = worker_cmd(&last.dir, &last.listen, &[], TOKEN).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && out.status.code() != Some(101), "{what}: {err}");
        assert!(err.contains("raft.redb"), "{what}: the error names the log: {err}");
    }
    drop(last);
}
