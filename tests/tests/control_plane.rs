//! The control plane with real `shimmer worker` processes on 127.0.0.x: one bootstraps, two join
//! by token; `shimmer cluster status --json` shows one leader and three voters up; kill -9 of the
//! leader → a new leader, and the killed node restarted on its `--data-dir` (no --join) rejoins;
//! a node with the wrong token cannot join, nor can an admin call with it; a corrupted or
//! truncated Raft log is refused with an error naming the file. And the cluster in use: three
//! workers and a coordinator member joined by token give the single box's tokens with no placement
//! file (the leader places the model by itself), a client `generate --join` too; kill -9 of the
//! leader mid-stream → the answer completes unchanged and the placement moves off the dead worker;
//! a fourth worker joins → an epoch with it, adopted by the coordinator between requests; SIGTERM
//! drains it (it stops only once no placement names it), and restarted it is placed again. One
//! set of flags for every node (`--bootstrap-on`, as a StatefulSet gives them) forms one cluster,
//! and the named node back without its data joins it instead of founding another.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const TOKEN: &str = "control-plane-test-token";
const LIMIT: Duration = shimmer_tests::COMMAND_LIMIT;

struct Node {
    child: Child,
    listen: String,
    dir: std::path::PathBuf,
    /// Where its /health, /ready and /metrics are.
    http: String,
    /// Its stderr so far.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
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
        .args(["--http-listen", &format!("{}:0", listen.rsplit_once(':').unwrap().0)])
        .args(extra)
        .env("SHIMMER_JOIN_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// Starts a member and waits for its control plane to listen.
fn start(dir: &std::path::Path, listen: &str, extra: &[&str]) -> Node {
    start_with(dir, listen, extra, TOKEN)
}

/// `start`, proving `token` ("": none).
fn start_with(dir: &std::path::Path, listen: &str, extra: &[&str], token: &str) -> Node {
    let mut child = worker_cmd(dir, listen, extra, token).spawn().unwrap();
    let lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    // Its stderr is read on a thread for as long as it runs (so it never blocks on a full pipe),
    // and the wait for its endpoints has a deadline (so a node that hangs fails the test).
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = log.clone();
    let (found, endpoints) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            if let Some((_, a)) = l.split_once("health, readiness and metrics on http://") {
                let _ = found.send(a.trim().to_string());
            }
            keep.lock().unwrap().push(l);
        }
    });
    let http = match endpoints.recv_timeout(LIMIT) {
        Ok(http) => http,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("worker {listen} did not start its control plane and endpoints ({e}):\n{}", log.lock().unwrap().join("\n"));
        }
    };
    let seen = log.lock().unwrap().clone();
    assert!(seen.iter().any(|l| l.contains("control plane on")), "{seen:?}");
    Node { child, listen: listen.to_string(), dir: dir.to_path_buf(), http, log }
}

fn status(addrs: &[&str], token: &str) -> Result<Value, String> {
    let out = shimmer_tests::output_within(
        Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "status", "--json", "--join", &addrs.join(","), "--join-token", token]),
        LIMIT,
    );
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
    let out =
        shimmer_tests::output_within(&mut worker_cmd(&tmp.path().join("stranger"), &stranger_listen, &["--join", addrs[0]], "not-the-cluster-token-9"), LIMIT);
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
    // An operator's drain, and its undoing, through any member.
    let drain = |extra: &[&str]| {
        let out = shimmer_tests::output_within(
            Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "drain", addrs[1], "--join", addrs[2], "--join-token", TOKEN]).args(extra),
            LIMIT,
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    let draining = |v: &Value| v["members"].as_array().unwrap().iter().find(|m| m["name"] == addrs[1]).map(|m| m["draining"] == true);
    drain(&[]);
    wait_status(&addrs, "the node marked draining", |v| draining(v) == Some(true));
    drain(&["--undo"]);
    wait_status(&addrs, "the mark taken off", |v| draining(v) == Some(false));
    let token =
        shimmer_tests::output_within(Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "token", "--join", addrs[0], "--join-token", TOKEN]), LIMIT);
    let token = String::from_utf8(token.stdout).unwrap();
    assert!(token.starts_with("SHM1") && token.trim_end().ends_with(&format!("::{TOKEN}")), "{token}");

    // A follower's data directory put back to an older copy (a restored backup): when the leader
    // remembers entries the node no longer has, the node refuses to go on, saying what to do;
    // when the cluster can bring it up to date instead, it does. It neither crashes unexplained
    // nor serves a shortened log.
    let v = wait_status(&addrs, "the restarted node caught up", |v| v["commit"] == v["applied"]);
    let leader = v["leader"].as_str().unwrap().to_string();
    let f = addrs.iter().position(|a| *a != leader).unwrap();
    let mut follower = nodes[f].take().unwrap();
    follower.child.kill().unwrap();
    follower.child.wait().unwrap();
    let older = std::fs::read(follower.dir.join("raft.redb")).unwrap();
    nodes[f] = Some(start(&follower.dir, &follower.listen, &[]));
    let target = addrs[(f + 1) % 3];
    let drain_via = |extra: &[&str]| {
        let out = shimmer_tests::output_within(
            Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "drain", target, "--join", addrs[f], "--join-token", TOKEN]).args(extra),
            LIMIT,
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    drain_via(&[]);
    drain_via(&["--undo"]);
    let draining_of = |v: &Value| v["members"].as_array().unwrap().iter().find(|m| m["name"] == target).map(|m| m["draining"] == true);
    let on_f = wait_status(&[addrs[f]], "the follower applying both changes", |v| draining_of(v) == Some(false) && v["commit"] == v["applied"]);
    assert!(on_f["applied"].as_u64() > v["applied"].as_u64(), "{on_f}");
    drop(nodes[f].take());
    std::fs::write(follower.dir.join("raft.redb"), &older).unwrap();
    let mut back = worker_cmd(&follower.dir, &follower.listen, &[], TOKEN).spawn().unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    let exited = loop {
        if let Some(code) = back.try_wait().unwrap() {
            break Some(code);
        }
        if Instant::now() > until {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    match exited {
        Some(code) => {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut back.stderr.take().unwrap(), &mut err).unwrap();
            assert!(!code.success() && !err.contains("panicked") && err.contains("restored from an older copy"), "{err}");
        }
        None => {
            // Or the cluster brought it up to date (a new leader, which never saw its
            // acknowledgements, or a snapshot): then it must hold everything it had held.
            let had = on_f["applied"].as_u64().unwrap();
            wait_status(&[follower.listen.as_str()], "the restored node back up to date", |v| v["applied"].as_u64().is_some_and(|a| a >= had));
            let _ = back.kill();
            let _ = back.wait();
        }
    }
    nodes[f] = Some(follower);

    // A stopped node's log, damaged: refused by name, never a panic or a silent fork.
    let mut last = nodes[2].take().unwrap();
    last.child.kill().unwrap();
    last.child.wait().unwrap();
    let log = last.dir.join("raft.redb");
    let bytes = std::fs::read(&log).unwrap();
    // Every copy of the member's name is flipped: redb leaves old versions in freed pages, and a
    // flip in one of those alone rightly goes unnoticed (the node then starts and serves; a
    // first-copy-only flip hung CI that way).
    let name = addrs[2].as_bytes();
    let copies: Vec<usize> = (0..bytes.len().saturating_sub(name.len())).filter(|&i| bytes[i..].starts_with(name)).collect();
    assert!(!copies.is_empty(), "the log holds the member's name");
    let mut flipped = bytes.clone();
    for at in copies {
        flipped[at] ^= 0x20;
    }
    for (what, damaged) in [("a flipped byte", flipped), ("a truncated file", bytes[..bytes.len() / 3].to_vec())] {
        std::fs::write(&log, &damaged).unwrap();
        let out = shimmer_tests::output_within(&mut worker_cmd(&last.dir, &last.listen, &[], TOKEN), LIMIT);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && out.status.code() != Some(101), "{what}: {err}");
        assert!(err.contains("raft.redb"), "{what}: the error names the log: {err}");
    }
    drop(last);
}

#[test]
fn one_set_of_flags_for_every_node_bootstraps_one_cluster_and_a_node_back_without_its_data_joins_it() {
    // As a StatefulSet runs them: every node the same flags, started together; the one that
    // --bootstrap-on names starts the cluster once nobody answers, the others join it.
    let tmp = tempfile::tempdir().unwrap();
    let listens: Vec<String> = (2..=4).map(|i| format!("127.0.0.{i}:{}", free_port(&format!("127.0.0.{i}")))).collect();
    let addrs: Vec<&str> = listens.iter().map(String::as_str).collect();
    let seeds = addrs.join(",");
    let flags = ["--bootstrap-on", "127.0.0.2", "--join", seeds.as_str()];
    let dir = |i: usize| tmp.path().join(format!("node{i}"));
    let nodes: Vec<Node> = std::thread::scope(|s| {
        let (addrs, flags, dir) = (&addrs, &flags, &dir);
        let started: Vec<_> = (0..3).map(|i| s.spawn(move || start(&dir(i), addrs[i], flags))).collect();
        started.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let one_cluster = |v: &Value| members(v).len() == 3 && members(v).iter().all(|(_, role, up)| role == "voter" && *up == Some(true));
    let cluster_ids: Vec<String> = addrs
        .iter()
        .map(|a| wait_status(&[a], "every node a member of the same three-voter cluster", one_cluster)["cluster_id"].as_str().unwrap().to_string())
        .collect();
    assert!(cluster_ids.iter().all(|c| *c == cluster_ids[0]), "{cluster_ids:?}");

    // The bootstrap node killed and its data directory lost: back with the same flags, it finds
    // the running cluster and joins it rather than founding a second one.
    let mut nodes = nodes.into_iter();
    let first = nodes.next().unwrap();
    drop(first);
    std::fs::remove_dir_all(dir(0)).unwrap();
    let _back = start(&dir(0), addrs[0], &flags);
    let v = wait_status(&[addrs[0]], "the node back in the same cluster, every member up", one_cluster);
    assert_eq!(v["cluster_id"].as_str(), Some(cluster_ids[0].as_str()), "{v}");
    let others: Vec<Node> = nodes.collect();
    assert_eq!(others.len(), 2);

    // A node that is not the one named, with nobody to join, says what to do.
    let out = shimmer_tests::output_within(
        &mut worker_cmd(&tmp.path().join("alone"), &format!("127.0.0.5:{}", free_port("127.0.0.5")), &["--bootstrap-on", "127.0.0.2"], TOKEN),
        LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is not --bootstrap-on 127.0.0.2") && err.contains("--join"), "{err}");
}

/// A `shimmer coordinator` member, with its HTTP port; killed when dropped.
struct Coordinator {
    child: Child,
    http: u16,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_coordinator(dir: &std::path::Path, listen: &str, join: &str) -> Coordinator {
    let http = free_port("127.0.0.1");
    let mut child = Command::new(shimmer_tests::shimmer_bin())
        .args(["coordinator", "--model"])
        .arg(shimmer_tests::fixture("qwen3_moe"))
        .args(["--listen", listen, "--data-dir"])
        .arg(dir)
        .args(["--join", join, "--host", "127.0.0.1", "--port", &http.to_string(), "--no-usage", "--worker-timeout-s", "2", "--connect-timeout-s", "1"])
        .args(["--report-heat-every-s", "1"])
        .env("SHIMMER_JOIN_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = shimmer_tests::StderrLines::of(&mut child);
    if let Err(e) = lines.until(LIMIT, |l| l.contains("shimmer: serving")) {
        let _ = child.kill();
        panic!("the coordinator did not start serving: {e}");
    }
    Coordinator { child, http }
}

/// One HTTP/1.1 request to the coordinator; the response body. `on_first_data` runs once the
/// first server-sent event of a stream has arrived.
fn http(port: u16, method: &str, path: &str, body: &str, on_first_data: impl FnMut()) -> String {
    let (code, body) = http_at(&format!("127.0.0.1:{port}"), method, path, body, on_first_data);
    assert_eq!(code, 200, "{method} {path}: {body}");
    body
}

/// `http` to any address; the status code and body.
fn http_at(addr: &str, method: &str, path: &str, body: &str, mut on_first_data: impl FnMut()) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut fired = false;
    loop {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if !fired && got.windows(6).any(|w| w == b"data: ") {
            fired = true;
            on_first_data();
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, body.to_string())
}

/// The text of a streamed completion (chunked transfer encoding undone by keeping only the
/// events' JSON).
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect()
}

fn generate(extra: &[&str], prompt: &str, max_tokens: usize) -> Value {
    let mut out = Command::new(shimmer_tests::shimmer_bin());
    out.args(["generate", "--model"])
        .arg(shimmer_tests::fixture("qwen3_moe"))
        .args(["--prompt", prompt, "--max-tokens", &max_tokens.to_string(), "--json", "--no-usage"])
        .args(extra)
        .env("SHIMMER_JOIN_TOKEN", TOKEN);
    let out = shimmer_tests::output_within(&mut out, LIMIT);
    assert!(out.status.success(), "generate {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn request_of(prompt: &str, max_tokens: usize) -> String {
    serde_json::json!({"model": "qwen3_moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string()
}

fn placement_of(v: &Value) -> Option<(u64, Vec<String>)> {
    let p = v["placements"].as_array()?.first()?;
    let workers = p["workers"].as_array()?.iter().filter_map(|w| w.as_str().map(String::from)).collect();
    (p["proposed"].is_null()).then(|| (p["epoch"].as_u64().unwrap_or(0), workers))
}

#[test]
fn a_coordinator_and_three_workers_joined_by_token_keep_the_single_box_tokens_through_leader_loss_and_a_join() {
    let tmp = tempfile::tempdir().unwrap();
    let listens: Vec<String> = (2..=5).map(|i| format!("127.0.0.{i}:{}", free_port(&format!("127.0.0.{i}")))).collect();
    let addrs: Vec<&str> = listens.iter().map(String::as_str).collect();
    let dir = |i: usize| tmp.path().join(format!("node{i}"));
    let mut nodes: Vec<Option<Node>> = vec![Some(start(&dir(0), addrs[0], &["--bootstrap"]))];
    for i in 1..3 {
        nodes.push(Some(start(&dir(i), addrs[i], &["--join", addrs[0]])));
    }
    // No coordinator and no admin command: the leader places the model over the three.
    let three: Vec<String> = addrs[..3].iter().map(|s| s.to_string()).collect();
    let v = wait_status(&addrs[..3], "a placement over the three workers", |v| placement_of(v).is_some_and(|(e, w)| e >= 1 && w == three));
    let first_epoch = placement_of(&v).unwrap().0;
    // Each worker's endpoints: alive, ready once it answers for the active epoch, its series and Raft's.
    for node in nodes.iter().flatten() {
        assert_eq!(http_at(&node.http, "GET", "/health", "", || {}).0, 200);
        let until = Instant::now() + Duration::from_secs(10);
        let ready = loop {
            let (code, body) = http_at(&node.http, "GET", "/ready", "", || {});
            if code == 200 || Instant::now() > until {
                break (code, body);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(ready.0, 200, "{} not ready: {}", node.listen, ready.1);
        let (_, metrics) = http_at(&node.http, "GET", "/metrics", "", || {});
        for series in ["shimmer_raft_term ", "shimmer_raft_commit_index ", "shimmer_raft_members{role=\"voter\"} 3", "shimmer_worker_requests_total "] {
            assert!(metrics.contains(series), "{}: no {series} in\n{metrics}", node.listen);
        }
        assert!(metrics.contains(&format!("shimmer_worker_epoch {first_epoch}")), "{}: {metrics}", node.listen);
    }

    let coordinator_listen = format!("127.0.0.6:{}", free_port("127.0.0.6"));
    let coordinator = start_coordinator(&tmp.path().join("coordinator"), &coordinator_listen, addrs[1]);
    let v = wait_status(&addrs[..3], "the coordinator as a member", |v| {
        v["members"].as_array().unwrap().iter().any(|m| m["name"] == coordinator_listen.as_str() && m["kind"] == "coordinator" && m["up"] == true)
    });
    let leader = v["leader"].as_str().unwrap().to_string();

    let prompt = "The tide came in and";
    let max_tokens = 160;
    let single = generate(&[], prompt, max_tokens);
    let want = single["text"].as_str().unwrap().to_string();
    // A client of the cluster (not a member) gets the same tokens.
    let client = generate(&["--join", &addrs[..3].join(",")], prompt, max_tokens);
    assert_eq!(client["output_ids"], single["output_ids"], "generate --join");

    // kill -9 of the leader (a worker: every expert has another holder) while the coordinator
    // streams an answer: the answer completes, token for token the single box's.
    let k = addrs.iter().position(|a| *a == leader).unwrap();
    let mut killed = nodes[k].take().unwrap();
    let request = serde_json::json!({"model": "qwen3_moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true}).to_string();
    let body = http(coordinator.http, "POST", "/v1/completions", &request, || {
        killed.child.kill().unwrap();
        killed.child.wait().unwrap();
    });
    assert_eq!(streamed_text(&body), want, "the answer streamed across the leader's kill");
    let metrics = http(coordinator.http, "GET", "/metrics", "", || {});
    let failovers = metrics.lines().find_map(|l| l.strip_prefix("shimmer_expert_failovers_total ")).and_then(|n| n.trim().parse::<f64>().ok());
    assert!(failovers.is_some_and(|f| f > 0.0), "the kill landed after the answer was made (no failovers): {failovers:?}");
    assert!(metrics.contains("shimmer_raft_term ") && metrics.contains("shimmer_cluster_placement_epoch{"), "the coordinator member's Raft series: {metrics}");
    let survivors: Vec<&str> = addrs[..3].iter().copied().filter(|a| *a != leader).collect();
    // A new leader; the placement moves off the dead worker (an epoch up) by itself.
    let two: Vec<String> = survivors.iter().map(|s| s.to_string()).collect();
    let v = wait_status(&survivors, "a new leader and a placement without the dead worker", |v| {
        v["leader"].as_str().is_some_and(|l| l != leader) && placement_of(v).is_some_and(|(e, w)| e > first_epoch && w == two)
    });
    let after_loss = placement_of(&v).unwrap().0;

    let gauge = |http: &str, name: &str| -> u64 {
        let (_, metrics) = http_at(http, "GET", "/metrics", "", || {});
        metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|n| n.trim().parse().ok()).unwrap_or(u64::MAX)
    };
    let survivor_http: Vec<String> = nodes.iter().flatten().filter(|n| survivors.contains(&n.listen.as_str())).map(|n| n.http.clone()).collect();
    let assigned_before: Vec<u64> = survivor_http.iter().map(|h| gauge(h, "shimmer_worker_assigned_experts")).collect();

    // A fourth worker joins: the placement includes it (epoch up), the coordinator moves to it
    // between requests, and the tokens stay the single box's.
    nodes.push(Some(start(&dir(3), addrs[3], &["--join", survivors[0]])));
    let with_fourth: Vec<String> = survivors.iter().map(|s| s.to_string()).chain([addrs[3].to_string()]).collect();
    let v = wait_status(&survivors, "a placement including the fourth worker", |v| placement_of(v).is_some_and(|(e, w)| e > after_loss && w == with_fourth));
    let epoch = placement_of(&v).unwrap().0;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let request = serde_json::json!({"model": "qwen3_moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
        let body = http(coordinator.http, "POST", "/v1/completions", &request, || {});
        let text = serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["text"].as_str().unwrap().to_string();
        assert_eq!(text, want, "an answer during or after the move");
        let metrics = http(coordinator.http, "GET", "/metrics", "", || {});
        let routed = metrics.lines().find_map(|l| l.strip_prefix("shimmer_placement_epoch ")).and_then(|e| e.trim().parse::<u64>().ok());
        if routed == Some(epoch) {
            let fourth = metrics.lines().find(|l| l.starts_with("shimmer_worker_selections_total") && l.contains(addrs[3])).unwrap_or("");
            let served: f64 = fourth.rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0.0);
            assert!(served > 0.0, "the fourth worker served nothing: {fourth}");
            break;
        }
        assert!(Instant::now() < until, "the coordinator still routes by epoch {routed:?}, not {epoch}");
    }
    // Once the coordinator says it routes by the new epoch, the one before is retired, and the
    // old holders drop what only it gave them (their shares shrank with a third holder).
    wait_status(&survivors, "the epoch before retired once the coordinator moved", |v| {
        let p = &v["placements"][0];
        p["previous"].is_null() && p["routed"][coordinator_listen.as_str()].as_u64().is_some_and(|e| e >= epoch)
    });
    let until = Instant::now() + Duration::from_secs(10);
    for (http, before) in survivor_http.iter().zip(&assigned_before) {
        loop {
            let (assigned, resident) = (gauge(http, "shimmer_worker_assigned_experts"), gauge(http, "shimmer_worker_resident_experts"));
            if assigned < *before && resident <= assigned {
                break;
            }
            assert!(Instant::now() < until, "{http}: {assigned} assigned (before the join {before}), {resident} in RAM");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // The coordinator's routing heat reached the cluster: a rebalance by it, asked of any
    // member, says what it would do; forced, it moves experts with the answers unchanged.
    let rebalance = |extra: &[&str]| -> Value {
        let out = shimmer_tests::output_within(
            Command::new(shimmer_tests::shimmer_bin()).args(["cluster", "rebalance", "--json", "--join", survivors[1], "--join-token", TOKEN]).args(extra),
            LIMIT,
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    wait_status(&survivors, "the coordinator's routing heat merged", |v| v["placements"][0]["heat_reports"].as_u64().unwrap_or(0) > 0);
    let dry = rebalance(&["--dry-run"]);
    let m = &dry["models"][0];
    assert!(m["imbalance_now"].as_f64().unwrap() >= 1.0 && m["proposed"] == false, "{dry}");
    let forced = rebalance(&[]);
    let moved = forced["models"][0]["epoch"].as_u64();
    let v = wait_status(&survivors, "the rebalanced placement active", |v| placement_of(v).is_some_and(|(e, _)| moved.is_none_or(|m| e >= m)));
    let epoch = placement_of(&v).unwrap().0;
    let body = http(coordinator.http, "POST", "/v1/completions", &request_of(prompt, max_tokens), || {});
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["text"].as_str(), Some(want.as_str()), "an answer after the rebalance");

    // SIGTERM drains: the fourth worker marks itself draining, the leader places the model
    // without it, and it stops only once no placement names it — answers unchanged throughout.
    let mut fourth = nodes[3].take().unwrap();
    let pid = fourth.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let request = serde_json::json!({"model": "qwen3_moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
    let body = http(coordinator.http, "POST", "/v1/completions", &request, || {});
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["text"].as_str(), Some(want.as_str()), "an answer during the drain");
    // While it drains it says so (orchestrators stop counting on it).
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = http_at(&fourth.http, "GET", "/ready", "", || {});
        if code == 503 && body.contains("draining") {
            break;
        }
        assert!(Instant::now() < until && fourth.child.try_wait().unwrap().is_none(), "never unready while draining: {code} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let until = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(code) = fourth.child.try_wait().unwrap() {
            break code;
        }
        assert!(Instant::now() < until, "the drained worker did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(code.success(), "a drained worker exits 0: {code:?}");
    let v = status(&survivors, TOKEN).unwrap();
    let (after_drain, workers) = placement_of(&v).expect("no placement pending once it stopped");
    assert!(after_drain > epoch && workers == two, "it stopped while a placement still named it: {v}");
    assert!(v["members"].as_array().unwrap().iter().any(|m| m["name"] == addrs[3] && m["draining"] == true), "{v}");
    // Restarted on its data directory it is no longer draining, and is placed again.
    nodes[3] = Some(start(&fourth.dir, &fourth.listen, &[]));
    drop(fourth);
    wait_status(&survivors, "the restarted worker placed again", |v| {
        placement_of(v).is_some_and(|(e, w)| e > after_drain && w == with_fourth)
            && v["members"].as_array().unwrap().iter().any(|m| m["name"] == addrs[3] && m["draining"] == false)
    });
    drop(killed);
}

/// The effective user id is 0 (from `/proc/self/status`).
fn running_as_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1)).is_some_and(|euid| euid == "0")
}

/// A small tmpfs, unmounted when dropped.
struct SmallDisk(std::path::PathBuf);

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_stops_a_member_with_an_error_naming_its_log_and_it_resumes_once_there_is_room() {
    if !running_as_root() {
        eprintln!("skipped (not root, so no tmpfs of our own to fill)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("disk");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"]).arg(&mnt).status().unwrap();
    assert!(mounted.success(), "mount tmpfs as root");
    let _disk = SmallDisk(mnt.clone());
    let dir = mnt.join("data");
    let listen = format!("127.0.0.7:{}", free_port("127.0.0.7"));
    let mut node = start(&dir, &listen, &["--bootstrap", "--no-mdns"]);
    wait_status(&[&listen], "the node leading", |v| v["leader"] == listen.as_str());
    // Fill the disk, then make the log grow: the member stops with an error naming its log.
    let fill = std::fs::File::create(mnt.join("fill")).unwrap();
    let mut w = std::io::BufWriter::new(fill);
    while std::io::Write::write_all(&mut w, &[0u8; 65536]).is_ok() {}
    drop(w);
    let until = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(code) = node.child.try_wait().unwrap() {
            break code;
        }
        assert!(Instant::now() < until, "the member kept going on a full disk");
        for undo in [false, true] {
            let mut c = Command::new(shimmer_tests::shimmer_bin());
            c.args(["cluster", "drain", &listen, "--join", &listen, "--join-token", TOKEN]);
            if undo {
                c.arg("--undo");
            }
            shimmer_tests::output_within(&mut c, LIMIT);
        }
    };
    std::thread::sleep(Duration::from_millis(200));
    let err = node.log.lock().unwrap().join("\n");
    assert!(!code.success() && code.code() != Some(101), "a full disk: {code:?}\n{err}");
    assert!(err.contains("raft.redb") && err.contains("cannot write the Raft log"), "the error names the log:\n{err}");
    // With room again, it resumes from its log where it was (no fork, no loss).
    std::fs::remove_file(mnt.join("fill")).unwrap();
    drop(node);
    let node = start(&dir, &listen, &["--no-mdns"]);
    wait_status(&[&listen], "the node resumed and leading", |v| v["leader"] == listen.as_str() && v["members"].as_array().is_some_and(|m| m.len() == 1));
    drop(node);
}

/// Operator-managed mutual TLS on the control plane, without a join token: members joined by
/// their certificates alone are placed and serve a client the single box's tokens; admin
/// commands need a certificate from the operator's CA — one from another CA, or the join token
/// alone, is refused — and there is no join token to print.
#[test]
fn members_joined_by_operator_certificates_alone_serve_and_refuse_strangers() {
    let tmp = tempfile::tempdir().unwrap();
    let hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];
    let (ca, ours) = shimmer_tests::operator_ca(tmp.path(), "operator", &["w0", "w1", "admin"], &hosts);
    let (_, theirs) = shimmer_tests::operator_ca(tmp.path(), "elsewhere", &["stranger"], &hosts);
    let tls =
        |c: &(String, String), ca: &str| -> Vec<String> { ["--tls-cert", &c.0, "--tls-key", &c.1, "--tls-ca", ca].iter().map(|s| s.to_string()).collect() };
    let listens: Vec<String> = ["127.0.0.2", "127.0.0.3"].iter().map(|ip| format!("{ip}:{}", free_port(ip))).collect();
    let flags = |i: usize, how: &[&str]| -> Vec<String> { how.iter().map(|s| s.to_string()).chain(tls(&ours[i], &ca)).collect() };
    let f0 = flags(0, &["--bootstrap"]);
    let _w0 = start_with(&tmp.path().join("w0"), &listens[0], &f0.iter().map(String::as_str).collect::<Vec<_>>(), "");
    let f1 = flags(1, &["--join", &listens[0]]);
    let _w1 = start_with(&tmp.path().join("w1"), &listens[1], &f1.iter().map(String::as_str).collect::<Vec<_>>(), "");
    let cli = |args: &[&str], creds: &[String]| {
        shimmer_tests::output_within(Command::new(shimmer_tests::shimmer_bin()).args(args).args(creds).env_remove("SHIMMER_JOIN_TOKEN"), LIMIT)
    };
    let admin = tls(&ours[2], &ca);
    let join = listens.join(",");
    let until = Instant::now() + Duration::from_secs(60);
    let placed = loop {
        let out = cli(&["cluster", "status", "--json", "--join", &join], &admin);
        if out.status.success() {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            if placement_of(&v).is_some_and(|(e, w)| e >= 1 && w.len() == 2) {
                break v;
            }
        }
        assert!(Instant::now() < until, "no placement over the two members: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(placed["members"].as_array().unwrap().len(), 2, "{placed}");
    // A client of the cluster by certificate: the single box's tokens.
    let single = generate(&[], "The tide came in and", 24);
    let model = shimmer_tests::fixture("qwen3_moe");
    let mut args =
        vec!["generate", "--model", model.to_str().unwrap(), "--prompt", "The tide came in and", "--max-tokens", "24", "--json", "--no-usage", "--join", &join];
    args.extend(["--worker-timeout-s", "2"]);
    let out = cli(&args, &admin);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap()["output_ids"], single["output_ids"]);
    // Strangers are refused: another CA's certificate, the token alone, nothing at all.
    let status = ["cluster", "status", "--join", listens[0].as_str()];
    shimmer_tests::assert_clean_failure(&cli(&status, &tls(&theirs[0], &ca)), &["from another CA"]);
    shimmer_tests::assert_clean_failure(&cli(&status, &["--join-token".to_string(), TOKEN.to_string()]), &["operator certificates missing"]);
    shimmer_tests::assert_clean_failure(&cli(&status, &[]), &["--join-token", "--tls-cert"]);
    // Nor can a stranger join.
    let stranger_listen = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let fs: Vec<String> = ["--join", listens[0].as_str()].iter().map(|s| s.to_string()).chain(tls(&theirs[0], &ca)).collect();
    let out = shimmer_tests::output_within(
        &mut worker_cmd(&tmp.path().join("stranger"), &stranger_listen, &fs.iter().map(String::as_str).collect::<Vec<_>>(), ""),
        LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.status.code() != Some(101) && err.contains("refused this node"), "a stranger joined, or failed unclearly: {err}");
    // There is no join token to print, and `cluster token` says so.
    shimmer_tests::assert_clean_failure(&cli(&["cluster", "token", "--join", &join], &admin), &["no join token"]);
}
