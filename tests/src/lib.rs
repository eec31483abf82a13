//! shimmer-tests: end-to-end tests over the real binary and committed fixtures.
//!
//! Owns: helpers to find fixtures and the `shimmer` binary, read oracle records, and corrupt
//! copies of checkpoints for bad-input tests. Tests live in `tests/`.
//!
//! Must never: need Python or a network at test time (fixtures are committed; see
//! `oracle/README.md` for how they are made), or weaken an assertion to make a test pass.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::Deserialize;

/// Every oracle fixture — a directory under `fixtures/` with a checkpoint and an `oracle.json`
/// — in name order. Tests iterate these, never a list of family names: a family added to
/// `shimmer_common::families` with its fixture is tested everywhere at once, and
/// `tests/families.rs` checks that every registered family has one.
pub fn fixtures() -> Vec<&'static str> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut names: Vec<&'static str> = std::fs::read_dir(&root)
        .expect("tests/fixtures")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("oracle.json").is_file() && e.path().join("config.json").is_file())
        .map(|e| &*Box::leak(e.file_name().to_string_lossy().into_owned().into_boxed_str()))
        .collect();
    names.sort_unstable();
    names
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

#[derive(Debug, Deserialize)]
pub struct OraclePrompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub greedy_text: String,
    pub argmax: Vec<u32>,
    pub margin: Vec<f32>,
    pub logprobs: Vec<f32>,
}

#[derive(Debug, Deserialize)]
pub struct OracleChat {
    pub messages: Vec<shimmer_common::chat_template::Message>,
    pub add_generation_prompt: bool,
    pub text: String,
    pub ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
pub struct OracleChatError {
    pub messages: Vec<shimmer_common::chat_template::Message>,
    pub message: String,
}

#[derive(Debug, Deserialize)]
pub struct OracleTokenizer {
    pub text: String,
    pub ids: Vec<u32>,
    pub ids_no_special: Vec<u32>,
    pub decoded: String,
    pub decoded_skip_special: String,
}

#[derive(Debug, Deserialize)]
pub struct Oracle {
    pub near_tie: f32,
    pub eos_ids: Vec<u32>,
    pub prompts: Vec<OraclePrompt>,
    pub chat: Vec<OracleChat>,
    pub chat_error: Option<OracleChatError>,
    pub tokenizer: Vec<OracleTokenizer>,
    /// For a model with recurrent state, whose oracle is computed in float64: how far
    /// transformers' own f32 evaluations sit from it (the f32 noise any implementation shows).
    #[serde(default)]
    pub reference_f32_error: Option<f32>,
}

pub fn oracle(name: &str) -> Oracle {
    let path = fixture(name).join("oracle.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The teacher-forced logits transformers computed for prompt `i` (`[T, vocab]`, row-major).
pub fn oracle_logits(name: &str, i: usize) -> (Vec<f32>, usize) {
    let path = fixture(name).join("oracle.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("oracle.safetensors parses");
    let t = st.tensor(&format!("logits.{i}")).expect("logits tensor");
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let vocab = t.shape()[1];
    let data = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    (data, vocab)
}

/// The `shimmer` binary of this build (target/<profile>/shimmer, next to the test's deps dir).
pub fn shimmer_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = dir.join(format!("shimmer{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} is missing: build it first (`cargo build -p shimmer-coordinator`; the README's test command does)", bin.display());
    bin
}

pub fn shimmer(args: &[&str]) -> Output {
    output_within(Command::new(shimmer_bin()).args(args).env_remove("SHIMMER_LOG"), COMMAND_LIMIT)
}

/// How long a command a test runs to completion may take before the test fails: generous for
/// a loaded two-core machine, and far below CI's limit, so a hang fails one test with what the
/// command printed instead of stalling the whole run.
pub const COMMAND_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// `cmd.output()`, but bounded as `wait_within` is. The command runs in a process group of its
/// own, so a timeout kills every process it started.
pub fn output_within(cmd: &mut Command, limit: std::time::Duration) -> Output {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    let shown = format!("{cmd:?}");
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn().unwrap_or_else(|e| panic!("cannot start {shown}: {e}"));
    wait_within(child, limit)
}

/// `child.wait_with_output()`, but a child still running after `limit` is killed (with its
/// process group, when it leads one) and the test fails, showing what it printed so far — so a
/// hang fails one test instead of stalling the whole run to CI's limit.
pub fn wait_within(mut child: std::process::Child, limit: std::time::Duration) -> Output {
    use std::io::Read;
    use std::sync::mpsc;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            let _ = tx.send(bytes);
        });
        rx
    };
    drop(child.stdin.take());
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let until = std::time::Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < until => std::thread::sleep(std::time::Duration::from_millis(20)),
            Ok(None) => {
                let pid = child.id();
                let _ = Command::new("kill").args(["-KILL", "--", &format!("-{pid}")]).stderr(std::process::Stdio::null()).status();
                let _ = child.kill();
                let _ = child.wait();
                let err = stderr.recv_timeout(std::time::Duration::from_secs(5)).unwrap_or_default();
                panic!("process {pid} still ran after {limit:?}, killed; its stderr:\n{}", String::from_utf8_lossy(&err));
            }
            Err(e) => panic!("waiting for process {}: {e}", child.id()),
        }
    };
    // What it left running (a daemon holding the pipes) must not hang the test either.
    let rest = || until.saturating_duration_since(std::time::Instant::now()).max(std::time::Duration::from_secs(5));
    Output { status, stdout: stdout.recv_timeout(rest()).unwrap_or_default(), stderr: stderr.recv_timeout(rest()).unwrap_or_default() }
}

/// A child's stderr, read line by line on a thread of its own for as long as the child runs (so
/// it never blocks on a full pipe), with waits that have deadlines.
pub struct StderrLines {
    lines: std::sync::mpsc::Receiver<String>,
}

impl StderrLines {
    /// Takes `child`'s piped stderr.
    pub fn of(child: &mut std::process::Child) -> StderrLines {
        use std::io::BufRead;
        let pipe = child.stderr.take().expect("the child's stderr is piped");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                // Once nobody waits for lines, they are still read (and dropped).
                let _ = tx.send(l);
            }
        });
        StderrLines { lines }
    }

    /// The next line, or `None` when the child closed stderr or wrote nothing more for `limit`.
    pub fn next_within(&self, limit: std::time::Duration) -> Option<String> {
        self.lines.recv_timeout(limit).ok()
    }

    /// Lines up to and including the first `is_it` accepts, or an error with the lines seen when
    /// the child stops writing or `limit` passes first.
    pub fn until(&self, limit: std::time::Duration, is_it: impl Fn(&str) -> bool) -> Result<Vec<String>, String> {
        let deadline = std::time::Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(l) => {
                    let done = is_it(&l);
                    seen.push(l);
                    if done {
                        return Ok(seen);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Err(format!("nothing matching after {limit:?}; seen:\n{}", seen.join("\n"))),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Err(format!("exited first; seen:\n{}", seen.join("\n"))),
            }
        }
    }
}

/// Copies a fixture into a fresh temporary directory that the caller may corrupt.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(fixture(name)).expect("fixture dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    dir
}

/// Rewrites a safetensors file's JSON header with `edit`, keeping the data bytes as they are.
pub fn edit_safetensors_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).expect("read safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).expect("header json");
    edit(&mut header);
    let mut text = serde_json::to_string(&header).expect("serialise");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).expect("write safetensors");
}

/// Asserts a failed run: non-zero exit, one `error:` line on stderr mentioning every `needles`,
/// and no panic.
pub fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for n in needles {
        assert!(lines[0].contains(n), "error line does not mention `{n}`: {stderr}");
    }
}

/// An engine of the checkpoint at `dir` whose experts, all in this process's memory, are reached
/// through the dispatcher `place` builds around them (a split over "nodes", workers, …).
pub fn engine_with_dispatch(
    dir: &Path,
    place: impl FnOnce(shimmer_experts::InProcessExperts) -> Box<dyn shimmer_experts::ExpertDispatch>,
) -> shimmer_coordinator::Engine {
    let model = shimmer_coordinator::model_dir::ModelDir::open(dir).unwrap();
    let experts = model.in_process_experts(shimmer_common::quant::QuantScheme::Bf16, None).unwrap();
    let (dense, _) = model.dense().unwrap();
    shimmer_coordinator::Engine::new(&model, dense, shimmer_coordinator::engine::Experts::InProcess(place(experts))).unwrap()
}

/// An engine of the checkpoint at `dir` with its experts quantised in memory to `scheme` (the
/// reference a container of that format must reproduce).
pub fn engine_with_experts_as(dir: &Path, scheme: shimmer_common::quant::QuantScheme) -> shimmer_coordinator::Engine {
    let model = shimmer_coordinator::model_dir::ModelDir::open(dir).unwrap();
    let experts = model.in_process_experts(scheme, None).unwrap();
    let (dense, _) = model.dense().unwrap();
    shimmer_coordinator::Engine::new(&model, dense, shimmer_coordinator::engine::Experts::InProcess(Box::new(experts))).unwrap()
}

/// Every logit of a teacher-forced 20-token pass (as bits) and a 10-token greedy continuation of
/// its first six: what "the same model" means to a placement test.
pub fn logits_and_greedy(engine: &shimmer_coordinator::Engine) -> (Vec<u32>, Vec<u32>) {
    let v = engine.spec.vocab_size as u32;
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % v.min(400)).collect();
    let logits: Vec<u32> = engine.logits_all(&ids).unwrap().iter().map(|x| x.to_bits()).collect();
    let mut session = engine.new_session();
    let opts =
        shimmer_coordinator::engine::GenerateOptions { max_tokens: 10, sampling: shimmer_coordinator::sampling::SamplingParams::default(), stop: vec![] };
    let gen = engine.generate(&mut session, &ids[..6], &opts, |_| true).unwrap();
    (logits, gen.output_ids)
}

/// Panics naming the first logit that differs, or the greedy tokens.
#[track_caller]
pub fn assert_same_answers(got: &(Vec<u32>, Vec<u32>), want: &(Vec<u32>, Vec<u32>), what: &str) {
    if let Some(i) = got.0.iter().zip(&want.0).position(|(a, b)| a != b) {
        panic!("{what}: logit {i} differs: {} vs {}", f32::from_bits(got.0[i]), f32::from_bits(want.0[i]));
    }
    assert_eq!(got.0.len(), want.0.len(), "{what}: logit count");
    assert_eq!(got.1, want.1, "{what}: greedy tokens");
}

/// An operator's CA in `dir` and, per label, a certificate it signs for `hosts` (IP addresses or
/// names; usable by a server and a client): PEM paths (ca, [(cert, key)]).
pub fn operator_ca(dir: &std::path::Path, ca_label: &str, leaves: &[&str], hosts: &[&str]) -> (String, Vec<(String, String)>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let write = |name: String, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, format!("{ca_label} CA"));
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let ca_path = write(format!("{ca_label}-ca.pem"), ca_cert.pem());
    let leaves = leaves
        .iter()
        .map(|label| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>()).unwrap();
            p.distinguished_name.push(DnType::CommonName, label.to_string());
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
            let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
            (write(format!("{label}.pem"), cert.pem()), write(format!("{label}-key.pem"), key.serialize_pem()))
        })
        .collect();
    (ca_path, leaves)
}
