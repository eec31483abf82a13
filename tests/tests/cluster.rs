//! The data plane over real QUIC and TLS: in-process workers (for logits bit for bit and failure
//! injection) and `shimmer worker` processes on 127.0.0.x (for tokens): a coordinator whose
//! experts live on three workers gives the single box's results under placements that spread each
//! layer's experts differently; failover to replicas and to workers that load experts from their
//! own disk; errors naming the expert when nobody can serve it; join-token and operator-mTLS
//! refusals; garbage frames from a raw QUIC client. (The API-level cluster tests with SIGKILL are
//! in tests/api/test_cluster.py; the namespace LAN in lan.rs.)

use std::sync::Arc;
use std::time::Duration;

use shimmer_cluster::model_id;
use shimmer_cluster::placement::{Placement, Worker, FORMAT, VERSION};
use shimmer_common::{Checkpoint, ModelSpec};
use shimmer_coordinator::Engine;
use shimmer_experts::{ExpertDispatch, InProcessExperts};
use shimmer_tests::{fixture, oracle};
use shimmer_worker::remote::{RemoteExperts, Timeouts};
use shimmer_worker::server::{serve, WorkerState};
use shimmer_worker::transport::{self, Credentials, JoinToken};

const TOKEN: &str = "test-cluster-join-token";

fn creds(token: &str) -> Credentials {
    Credentials::token(JoinToken::new(token).unwrap())
}

fn timeouts(answer_s: u64) -> Timeouts {
    Timeouts { answer: Duration::from_secs(answer_s), connect: Duration::from_secs(3) }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Starts `n` workers serving `dir`'s experts; returns their addresses (and the runtime running them).
fn start_workers(dir: &std::path::Path, n: usize, fingerprint: &str) -> (tokio::runtime::Runtime, Vec<String>) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let addrs = (0..n).map(|_| start_worker(&rt, dir, fingerprint, ([127, 0, 0, 1], 0).into()).1).collect();
    (rt, addrs)
}

fn start_worker(rt: &tokio::runtime::Runtime, dir: &std::path::Path, fingerprint: &str, at: std::net::SocketAddr) -> (quinn::Endpoint, String) {
    let (ep, addr, _) = start_worker_for(rt, dir, fingerprint, at, None);
    (ep, addr)
}

/// A worker that knows its slice of `placement` (`name`), serving only it when `assigned_only`.
fn start_worker_for(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    fingerprint: &str,
    at: std::net::SocketAddr,
    slice: Option<(&Placement, &str, bool)>,
) -> (quinn::Endpoint, String, Arc<WorkerState>) {
    let spec = ModelSpec::from_dir(dir).unwrap();
    let experts: Arc<dyn ExpertDispatch> = Arc::new(InProcessExperts::load(&Checkpoint::open(dir).unwrap(), &spec).unwrap());
    let ep = rt.block_on(async { transport::server(at, &creds(TOKEN)) }).unwrap();
    let addr = ep.local_addr().unwrap().to_string();
    let mut state = WorkerState::new(experts, model_id(fingerprint), 1, creds(TOKEN), spec.hidden_size);
    if let Some((p, name, only)) = slice {
        state.name = name.to_string();
        state.set_assigned(Some(p.slice(name, &p.layers.iter().map(|l| l.layer).collect::<Vec<_>>()).unwrap().assigned));
        state.assigned_only = only;
    }
    let state = Arc::new(state);
    rt.spawn(serve(ep.clone(), state.clone()));
    (ep, addr, state)
}

/// Lets the test keep a handle on the dispatcher the engine owns.
struct Shared(Arc<RemoteExperts>);

impl ExpertDispatch for Shared {
    fn dispatch(&self, batch: &shimmer_experts::MoeBatch<'_>, acc: &mut [i64]) -> Result<(), shimmer_experts::DispatchError> {
        self.0.dispatch(batch, acc)
    }
}

#[test]
fn a_dead_worker_fails_over_to_replicas_with_identical_logits_and_is_readmitted() {
    let dir = fixture("qwen3_moe");
    let single = Engine::load(&dir).unwrap();
    let (spec, fingerprint) = (single.spec.clone(), single.fingerprint.clone());
    let o = oracle("qwen3_moe");
    let ids: Vec<u32> = o.prompts[1].ids.iter().chain(&o.prompts[1].greedy).copied().collect();
    let want = single.logits_all(&ids).unwrap();
    let vocab = spec.vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let workers: Vec<(quinn::Endpoint, String)> = (0..3).map(|_| start_worker(&rt, &dir, &fingerprint, ([127, 0, 0, 1], 0).into())).collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.1.clone()).collect();
    // Two holders per expert: every expert survives any one worker.
    let mut p = placement(&fingerprint, &spec, &addrs, |_, e| e % 3);
    for l in &mut p.layers {
        for (e, r) in l.replicas.iter_mut().enumerate() {
            r.push(addrs[(e + 1) % 3].clone());
        }
    }
    let remote = Arc::new(RemoteExperts::connect(p, model_id(&fingerprint), &creds(TOKEN), timeouts(5)).unwrap());
    let r2 = remote.clone();
    let engine = shimmer_tests::engine_with_dispatch(&dir, move |_| Box::new(Shared(r2)));
    let mut session = engine.new_session();
    let half = ids.len() / 2;
    for (i, t) in ids.iter().enumerate() {
        if i == half {
            // Worker 0 dies mid-sequence (its endpoint closes every connection at once).
            workers[0].0.close(0u32.into(), b"killed");
        }
        let got = engine.step(&mut session, &[*t]).unwrap();
        assert_eq!(bits(&got), bits(&want[i * vocab..(i + 1) * vocab]), "position {i}");
    }
    assert_eq!(remote.down_workers(), vec![addrs[0].clone()]);
    assert!(remote.telemetry_snapshot().failovers > 0);
    // Restarted on the same address, it is re-admitted after its backoff and used again.
    let dead = workers.into_iter().next().unwrap().0;
    rt.block_on(dead.wait_idle());
    drop(dead);
    std::thread::sleep(Duration::from_millis(200));
    let addr0: std::net::SocketAddr = addrs[0].parse().unwrap();
    let _again = start_worker(&rt, &dir, &fingerprint, addr0);
    std::thread::sleep(Duration::from_millis(1500));
    // Redialled in the background once a step wants it; meanwhile the replicas serve.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !remote.down_workers().is_empty() {
        assert!(std::time::Instant::now() < deadline, "not re-admitted: {:?}", remote.down_workers());
        let mut s2 = engine.new_session();
        for (i, t) in ids.iter().take(3).enumerate() {
            assert_eq!(bits(&engine.step(&mut s2, &[*t]).unwrap()), bits(&want[i * vocab..(i + 1) * vocab]));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let served = remote.telemetry_snapshot().workers[0].selections;
    let mut s3 = engine.new_session();
    for t in ids.iter().take(3) {
        engine.step(&mut s3, &[*t]).unwrap();
    }
    assert!(remote.telemetry_snapshot().workers[0].selections > served, "re-admitted and used");
}

#[test]
fn with_one_copy_a_dead_workers_experts_come_from_another_workers_disk_or_are_an_error_naming_them() {
    let dir = fixture("qwen3_moe");
    let single = Engine::load(&dir).unwrap();
    let (spec, fingerprint) = (single.spec.clone(), single.fingerprint.clone());
    let ids = [1u32, 2, 3, 4, 5, 6];
    let want = single.logits_all(&ids).unwrap();
    for assigned_only in [false, true] {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let addrs: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", free_udp_port())).collect();
        let p = placement(&fingerprint, &spec, &addrs, |_, e| e % 2);
        let workers: Vec<(quinn::Endpoint, String, Arc<WorkerState>)> =
            addrs.iter().map(|a| start_worker_for(&rt, &dir, &fingerprint, a.parse().unwrap(), Some((&p, a, assigned_only)))).collect();
        let remote = RemoteExperts::connect(p, model_id(&fingerprint), &creds(TOKEN), timeouts(5)).unwrap();
        let engine = shimmer_tests::engine_with_dispatch(&dir, move |_| Box::new(remote));
        workers[1].0.close(0u32.into(), b"killed");
        let got = engine.logits_all(&ids);
        if assigned_only {
            // The survivor serves its own slice only: nobody can load worker 1's experts.
            let e = got.unwrap_err().to_string();
            assert!(e.contains("no worker can serve it") && e.contains("expert") && e.contains(&addrs[1]), "{e}");
        } else {
            // The survivor reads worker 1's experts from its own disk: the same bits.
            assert_eq!(bits(&got.unwrap()), bits(&want));
        }
    }
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn placement(fingerprint: &str, spec: &ModelSpec, addrs: &[String], owner: impl Fn(usize, usize) -> usize) -> Placement {
    let moe: Vec<usize> = (0..spec.num_layers).filter(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    Placement {
        format: FORMAT.into(),
        version: VERSION,
        model: fingerprint.into(),
        epoch: 1,
        workers: addrs.iter().map(|a| Worker { name: a.clone(), addr: a.clone(), ram_bytes: u64::MAX }).collect(),
        layers: moe
            .iter()
            .map(|&l| shimmer_cluster::placement::LayerPlacement {
                layer: l,
                replicas: (0..spec.moe.num_experts).map(|e| vec![addrs[owner(l, e)].clone()]).collect(),
            })
            .collect(),
    }
}

#[test]
fn three_workers_give_the_single_box_logits_under_every_placement() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let single = Engine::load(&dir).unwrap();
        let spec = single.spec.clone();
        let fingerprint = single.fingerprint.clone();
        let o = oracle(name);
        let ids: Vec<u32> = o.prompts[0].ids.iter().chain(&o.prompts[0].greedy).copied().collect();
        let want = single.logits_all(&ids).unwrap();
        let (_rt, addrs) = start_workers(&dir, 3, &fingerprint);
        let n = spec.moe.num_experts;
        type WorkerOf = Box<dyn Fn(usize, usize) -> usize>;
        let placements: Vec<(&str, WorkerOf)> = vec![
            ("round robin", Box::new(|_, e| e % 3)),
            ("every layer differently", Box::new(|l, e| (e + l) % 3)),
            ("halves on two workers", Box::new(move |_, e| if e < n / 2 { 0 } else { 2 })),
        ];
        for (label, owner) in placements {
            let p = placement(&fingerprint, &spec, &addrs, owner);
            p.validate(&fingerprint, &p.layers.iter().map(|l| l.layer).collect::<Vec<_>>(), n).unwrap();
            let remote = RemoteExperts::connect(p, model_id(&fingerprint), &creds(TOKEN), timeouts(30)).unwrap();
            let engine = shimmer_tests::engine_with_dispatch(&dir, move |_local| Box::new(remote));
            let got = engine.logits_all(&ids).unwrap();
            assert_eq!(bits(&got), bits(&want), "{name}: {label}");
        }
    }
}

#[test]
fn a_coordinator_with_the_wrong_join_token_is_refused() {
    let dir = fixture("qwen3_moe");
    let spec = ModelSpec::from_dir(&dir).unwrap();
    let fingerprint = Engine::load(&dir).unwrap().fingerprint;
    let (_rt, addrs) = start_workers(&dir, 1, &fingerprint);
    let p = placement(&fingerprint, &spec, &addrs, |_, _| 0);
    let e = RemoteExperts::connect(p, model_id(&fingerprint), &creds("not-the-cluster-token"), timeouts(10)).err().expect("refused");
    assert!(matches!(e, transport::TransportError::Refused), "{e}");
}

#[test]
fn the_remote_experts_stop_cleanly_when_dropped_inside_another_runtime_and_close_their_connections() {
    // The HTTP server drops the last engine handle on its own runtime at shutdown, where tokio
    // refuses a blocking runtime shutdown (this panicked on Ctrl-C of a pooled coordinator).
    let dir = fixture("qwen3_moe");
    let spec = ModelSpec::from_dir(&dir).unwrap();
    let fingerprint = Engine::load(&dir).unwrap().fingerprint;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (worker, addr) = start_worker(&rt, &dir, &fingerprint, ([127, 0, 0, 1], 0).into());
    let p = placement(&fingerprint, &spec, std::slice::from_ref(&addr), |_, _| 0);
    let remote = RemoteExperts::connect(p, model_id(&fingerprint), &creds(TOKEN), timeouts(10)).unwrap();
    assert_eq!(worker.open_connections(), 1);
    let server = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    server.block_on(async move { drop(remote) });
    // The worker hears the close (it does not wait out an idle timeout).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while worker.open_connections() > 0 {
        assert!(std::time::Instant::now() < deadline, "the worker still holds the coordinator's connection");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `shimmer worker` process; killed when dropped.
struct WorkerProcess {
    child: std::process::Child,
    addr: String,
    /// The line after `worker serving`: what it holds.
    holds: String,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_worker_on(model: Option<&std::path::Path>, listen: &str) -> WorkerProcess {
    spawn_worker_args(model, &["--listen", listen, "--join-token", TOKEN])
}

fn spawn_worker_with(model: &std::path::Path, args: &[&str]) -> WorkerProcess {
    spawn_worker_args(Some(model), args)
}

/// A free port on the host of the `--listen` among `args`.
fn http_listen_beside(args: &[&str]) -> String {
    let listen = args.iter().position(|a| *a == "--listen").and_then(|i| args.get(i + 1)).copied().unwrap_or("127.0.0.1:0");
    let host = listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
    format!("{host}:0")
}

/// A `shimmer worker` of `model` (the demo when `None`).
fn spawn_worker_args(model: Option<&std::path::Path>, args: &[&str]) -> WorkerProcess {
    let mut child = std::process::Command::new(shimmer_tests::shimmer_bin())
        .arg("worker")
        .args(model.map(|m| vec!["--model", m.to_str().unwrap()]).unwrap_or_default())
        // The fixtures are committed: no routing heat is written beside them.
        .arg("--no-usage")
        .args(args)
        // Tests run side by side: each worker's HTTP endpoints on a free port of its address.
        .args(if args.contains(&"--http-listen") { vec![] } else { vec!["--http-listen".to_string(), http_listen_beside(args)] })
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = shimmer_tests::StderrLines::of(&mut child);
    let seen = lines.until(shimmer_tests::COMMAND_LIMIT, |l| l.contains("worker serving") && l.contains(" on ")).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("the worker did not start serving: {e}")
    });
    let line = seen.last().unwrap();
    let addr = line[line.find(" on ").unwrap() + 4..].split_whitespace().next().unwrap().to_string();
    let holds = lines.next_within(shimmer_tests::COMMAND_LIMIT).expect("the worker's holdings line");
    WorkerProcess { child, addr, holds }
}

#[test]
fn three_worker_processes_generate_the_single_box_tokens_under_three_placements() {
    let ids = |o: &std::process::Output| -> serde_json::Value { serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["output_ids"].clone() };
    // Fixtures with GQA; MLA; gpt-oss's sinks and biased MXFP4 experts as shipped; a recurrent
    // state (Qwen3-Next); sparse attention (GLM-5); hyper-connections, compressed attention and
    // hash routing (DeepSeek-V4); relative-position bias, convolutions and a router-weighed
    // shared bank (Inkling); block attention residuals and dynamic convolutions (Inkling 2) — and
    // the bundled demo (no --model).
    let models =
        ["qwen3_moe", "deepseek_v3", "gpt_oss_mxfp4", "qwen3_next", "glm_moe_dsa", "deepseek_v4", "inkling_text", "inkling2_text"].map(|n| Some(fixture(n)));
    for model in models.into_iter().chain([None]) {
        let m: Vec<&str> = model.as_ref().map(|d| vec!["--model", d.to_str().unwrap()]).unwrap_or_default();
        let workers: Vec<WorkerProcess> = (2..5).map(|i| spawn_worker_on(model.as_deref(), &format!("127.0.0.{i}:0"))).collect();
        let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
        let tmp = tempfile::tempdir().unwrap();
        let planned = tmp.path().join("planned.json");
        let p = shimmer_tests::shimmer(&[&["plan"][..], &m, &["--workers", &addrs.join(","), "--out", planned.to_str().unwrap()]].concat());
        assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
        let base = Placement::read(&planned).unwrap();
        let n = base.layers[0].replicas.len();
        let reassigned = |name: &str, owner: &dyn Fn(usize, usize) -> usize| {
            let mut q = base.clone();
            for l in &mut q.layers {
                let layer = l.layer;
                l.replicas = (0..n).map(|e| vec![addrs[owner(layer, e)].clone()]).collect();
            }
            let path = tmp.path().join(name);
            std::fs::write(&path, serde_json::to_string(&q).unwrap()).unwrap();
            path
        };
        let placements = [
            planned.clone(),
            // Neighbouring experts on different workers, shifted per layer.
            reassigned("round-robin.json", &|l, e| (e + l) % 3),
            // Each layer on two workers only, a different pair per layer.
            reassigned("pairs.json", &|l, e| (l + usize::from(e >= n / 2)) % 3),
        ];
        let args: Vec<&str> = [&["generate"][..], &m, &["--prompt-ids", "1,5,9,2,7", "--max-tokens", "12", "--json"]].concat();
        let single = shimmer_tests::shimmer(&args);
        assert!(single.status.success(), "{}", String::from_utf8_lossy(&single.stderr));
        for placement in &placements {
            let cluster = shimmer_tests::shimmer(&[&args[..], &["--placement", placement.to_str().unwrap(), "--join-token", TOKEN]].concat());
            assert!(cluster.status.success(), "{}", String::from_utf8_lossy(&cluster.stderr));
            assert_eq!(ids(&cluster), ids(&single), "{model:?} under {}", placement.display());
        }
        if model != Some(fixture("qwen3_moe")) {
            continue;
        }
        // Two coordinators at once share the pool (one connection each per worker).
        let both = [0, 1].map(|_| {
            let a: Vec<String> =
                [&args[..], &["--placement", placements[1].to_str().unwrap(), "--join-token", TOKEN]].concat().iter().map(|s| s.to_string()).collect();
            std::thread::spawn(move || shimmer_tests::shimmer(&a.iter().map(String::as_str).collect::<Vec<_>>()))
        });
        for h in both {
            let o = h.join().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(ids(&o), ids(&single), "two coordinators on one pool");
        }
        // A wrong token: refused with a clear error, no tokens.
        let wrong = shimmer_tests::shimmer(&[&args[..], &["--placement", planned.to_str().unwrap(), "--join-token", "definitely-not-the-token"]].concat());
        shimmer_tests::assert_clean_failure(&wrong, &["join token"]);
        // The workers gone: the run depends on them, and says which it cannot reach.
        drop(workers);
        let gone =
            shimmer_tests::shimmer(&[&args[..], &["--placement", planned.to_str().unwrap(), "--join-token", TOKEN, "--connect-timeout-s", "0.5"]].concat());
        shimmer_tests::assert_clean_failure(&gone, &[&addrs[0]]);
    }
}

#[test]
fn garbage_wrong_model_and_stale_epoch_frames_get_error_codes_and_the_worker_keeps_serving() {
    use shimmer_cluster::wire::{self, ErrorCode, Frame};
    let dir = fixture("qwen3_moe");
    let spec = ModelSpec::from_dir(&dir).unwrap();
    let fingerprint = Engine::load(&dir).unwrap().fingerprint;
    let (rt, addrs) = start_workers(&dir, 1, &fingerprint);
    let addr: std::net::SocketAddr = addrs[0].parse().unwrap();
    rt.block_on(async {
        let ep = transport::client(&creds(TOKEN)).unwrap();
        let conn = transport::connect(&ep, addr, &creds(TOKEN)).await.unwrap();
        let ask = |bytes: Vec<u8>| {
            let conn = conn.clone();
            async move {
                let (mut s, mut r) = conn.open_bi().await.unwrap();
                s.write_all(&bytes).await.unwrap();
                s.finish().unwrap();
                wire::decode(bytes::Bytes::from(r.read_to_end(1 << 24).await.unwrap())).unwrap()
            }
        };
        let code = |f: Frame| match f {
            Frame::Error { code, .. } => code,
            other => panic!("expected an error frame, got {other:?}"),
        };
        let hidden = spec.hidden_size as u32;
        let moe_layer = (0..spec.num_layers).find(|l| spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).unwrap() as u32;
        let good = |model: u64, epoch: u64| {
            wire::Request {
                request_id: 5,
                model,
                epoch,
                layer: moe_layer,
                hidden,
                top_k: 1,
                rows: bytes::Bytes::from(vec![0u8; hidden as usize * 4]),
                selections: vec![(0, 1.0)],
            }
            .encode()
            .to_vec()
        };
        assert_eq!(code(ask(b"GET / HTTP/1.1\r\n\r\n and then some more bytes to fill a header".to_vec()).await), Some(ErrorCode::Malformed));
        let mut huge = good(model_id(&fingerprint), 1);
        huge[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(code(ask(huge).await), Some(ErrorCode::TooLarge));
        assert_eq!(code(ask(good(12345, 1)).await), Some(ErrorCode::WrongModel));
        assert_eq!(code(ask(good(model_id(&fingerprint), 9)).await), Some(ErrorCode::Moved));
        // The same connection still gets answers.
        match ask(good(model_id(&fingerprint), 1)).await {
            Frame::Response(r) => assert!(r.request_id == 5 && r.sums.len() == hidden as usize),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn operator_certificates_from_the_cluster_ca_work_and_strangers_are_refused_both_ways() {
    let dir = fixture("qwen3_moe");
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (ca, ours) = shimmer_tests::operator_ca(tmp.path(), "cluster", &["worker", "coordinator"], &["127.0.0.1"]);
    let (other_ca, theirs) = shimmer_tests::operator_ca(tmp.path(), "elsewhere", &["stranger"], &["127.0.0.1"]);
    let (w, c, s) = (&ours[0], &ours[1], &theirs[0]);
    let worker = spawn_worker_with(&dir, &["--listen", "127.0.0.1:0", "--tls-cert", &w.0, "--tls-key", &w.1, "--tls-ca", &ca]);
    let placement = tmp.path().join("p.json");
    let p = shimmer_tests::shimmer(&["plan", "--model", d, "--workers", &worker.addr, "--out", placement.to_str().unwrap()]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let args = ["generate", "--model", d, "--prompt-ids", "3,1,4,1,5", "--max-tokens", "8", "--json"];
    let single = shimmer_tests::shimmer(&args);
    let with = |cert: &(String, String), ca: &str| {
        let mut a = args.to_vec();
        a.extend(["--placement", placement.to_str().unwrap(), "--tls-cert", &cert.0, "--tls-key", &cert.1, "--tls-ca", ca]);
        shimmer_tests::shimmer(&a)
    };
    let ok = with(c, &ca);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let ids = |o: &std::process::Output| -> serde_json::Value { serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["output_ids"].clone() };
    assert_eq!(ids(&ok), ids(&single));
    // The worker refuses a coordinator whose certificate another CA signed ...
    shimmer_tests::assert_clean_failure(&with(s, &ca), &["certificate"]);
    // ... and a coordinator that trusts another CA refuses the worker.
    shimmer_tests::assert_clean_failure(&with(c, &other_ca), &["certificate"]);
}

#[test]
fn a_worker_finds_itself_in_the_placement_and_says_what_it_holds() {
    let dir = fixture("qwen3_moe");
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_udp_port();
    // One worker at this machine's address, one at an address this machine does not have.
    let (here, elsewhere) = (format!("127.0.0.1:{port}"), format!("192.0.2.1:{port}"));
    let placement = tmp.path().join("p.json");
    let p = shimmer_tests::shimmer(&["plan", "--model", d, "--workers", &format!("{here},{elsewhere}"), "--out", placement.to_str().unwrap()]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let spec = ModelSpec::from_dir(&dir).unwrap();
    let p = Placement::read(&placement).unwrap();
    let mine = p.layers.iter().flat_map(|l| &l.replicas).filter(|h| h.contains(&here)).count();
    let w = spawn_worker_with(&dir, &["--listen", &format!("0.0.0.0:{port}"), "--join-token", TOKEN, "--placement", placement.to_str().unwrap()]);
    assert!(w.holds.contains(&format!("worker {here}: {mine} experts assigned")), "{}", w.holds);
    assert!(mine > 0 && mine < spec.moe.num_experts * p.layers.len());
    drop(w);
    // Not in the placement, or a name it does not have: refused with the reason.
    let wrong = shimmer_tests::shimmer(&["worker", "--model", d, "--listen", "127.0.0.1:1", "--join-token", TOKEN, "--placement", placement.to_str().unwrap()]);
    shimmer_tests::assert_clean_failure(&wrong, &["no worker of the placement has the address 127.0.0.1:1", "--name"]);
    let unknown = shimmer_tests::shimmer(&[
        "worker",
        "--model",
        d,
        "--listen",
        "127.0.0.1:0",
        "--join-token",
        TOKEN,
        "--placement",
        placement.to_str().unwrap(),
        "--name",
        "w9",
    ]);
    shimmer_tests::assert_clean_failure(&unknown, &["--name w9", "no such worker"]);
}

#[test]
fn a_coordinator_that_holds_a_workers_share_itself_gives_the_single_box_tokens() {
    let dir = fixture("qwen3_moe");
    let d = dir.to_str().unwrap();
    let workers: Vec<WorkerProcess> = (2..4).map(|i| spawn_worker_on(Some(&dir), &format!("127.0.0.{i}:0"))).collect();
    // The third worker is this node: nothing listens at its address.
    let me = format!("127.0.0.1:{}", free_udp_port());
    let names = [workers[0].addr.clone(), workers[1].addr.clone(), me.clone()];
    let tmp = tempfile::tempdir().unwrap();
    let placement = tmp.path().join("p.json");
    let p = shimmer_tests::shimmer(&["plan", "--model", d, "--workers", &names.join(","), "--out", placement.to_str().unwrap()]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let args = ["generate", "--model", d, "--prompt-ids", "2,7,1,8,2,8", "--max-tokens", "10", "--json"];
    let single = shimmer_tests::shimmer(&args);
    let both = shimmer_tests::shimmer(
        &[&args[..], &["--placement", placement.to_str().unwrap(), "--join-token", TOKEN, "--hold", &me, "--connect-timeout-s", "0.5", "--no-usage"]].concat(),
    );
    assert!(both.status.success(), "{}", String::from_utf8_lossy(&both.stderr));
    let json = |o: &std::process::Output| serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
    assert_eq!(json(&both)["output_ids"], json(&single)["output_ids"]);
    let links = json(&both)["timings"]["cluster"]["workers"].as_array().unwrap().clone();
    for l in &links {
        assert!(l["selections"].as_u64().unwrap() > 0 && l["up"] == true, "every holder served, this node included: {l}");
    }
    // Holding a worker the placement does not have is refused by name.
    let bad = shimmer_tests::shimmer(&[&args[..], &["--placement", placement.to_str().unwrap(), "--join-token", TOKEN, "--hold", "w9"]].concat());
    shimmer_tests::assert_clean_failure(&bad, &["w9"]);
}

#[test]
fn workers_on_a_newer_placement_make_the_coordinator_adopt_it_with_the_same_logits() {
    let dir = fixture("qwen3_moe");
    let single = Engine::load(&dir).unwrap();
    let (spec, fingerprint) = (single.spec.clone(), single.fingerprint.clone());
    let ids = [3u32, 1, 4, 1, 5, 9];
    let want = single.logits_all(&ids).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let workers: Vec<_> = (0..3).map(|_| start_worker_for(&rt, &dir, &fingerprint, ([127, 0, 0, 1], 0).into(), None)).collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.1.clone()).collect();
    let first = placement(&fingerprint, &spec, &addrs, |_, e| e % 3);
    let mut second = placement(&fingerprint, &spec, &addrs, |l, e| (e + l + 1) % 3);
    second.epoch = 2;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("placement.json");
    std::fs::write(&file, serde_json::to_string(&first).unwrap()).unwrap();
    let f = file.clone();
    let remote = Arc::new(
        RemoteExperts::connect(first, model_id(&fingerprint), &creds(TOKEN), timeouts(5))
            .unwrap()
            .with_reload(Box::new(move || Placement::read(&f).map_err(|e| e.to_string()))),
    );
    let r2 = remote.clone();
    let engine = shimmer_tests::engine_with_dispatch(&dir, move |_| Box::new(Shared(r2)));
    assert_eq!(bits(&engine.logits_all(&ids).unwrap()), bits(&want));
    // The operator moves the cluster to epoch 2: the file, then the workers.
    std::fs::write(&file, serde_json::to_string(&second).unwrap()).unwrap();
    for w in &workers {
        w.2.set_epochs(shimmer_worker::server::EpochWindow::only(2));
    }
    assert_eq!(bits(&engine.logits_all(&ids).unwrap()), bits(&want), "under the adopted placement");
    assert_eq!(remote.telemetry_snapshot().placement_epoch, 2);
    // Workers ahead of every placement at hand: `Moved` is then an error like any other.
    for w in &workers {
        w.2.set_epochs(shimmer_worker::server::EpochWindow::only(3));
    }
    let e = engine.logits_all(&ids).unwrap_err().to_string();
    assert!(e.contains("no worker can serve it"), "{e}");
}
