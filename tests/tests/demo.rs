//! The bundled demo model: used when no `--model` is given, unpacked once and atomically to the
//! user's cache directory, byte-identical to `models/demo/`, and repaired if damaged.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shimmer_tests::{assert_clean_failure, shimmer_bin};

fn run_with_cache(cache: &Path, args: &[&str]) -> Output {
    shimmer_tests::output_within(Command::new(shimmer_bin()).args(args).env("XDG_CACHE_HOME", cache).env_remove("SHIMMER_LOG"), shimmer_tests::COMMAND_LIMIT)
}

fn demo_dirs(cache: &Path) -> Vec<PathBuf> {
    let root = cache.join("shimmer/models");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root).map(|r| r.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    v.sort();
    v
}

fn repo_demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo")
}

#[test]
fn no_model_means_the_demo_model_unpacked_once_into_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let out = run_with_cache(cache.path(), &["generate", "--prompt", "And God said", "--max-tokens", "8", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().filter(|l| l.contains("using the bundled demo model")).count(), 1, "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 8);

    let dirs = demo_dirs(cache.path());
    assert_eq!(dirs.len(), 1, "exactly the published directory, no leftovers: {dirs:?}");
    let dir = &dirs[0];
    assert!(dir.file_name().unwrap().to_str().unwrap().starts_with("demo-"));
    // Byte-identical to the committed model.
    for entry in std::fs::read_dir(repo_demo()).unwrap().flatten() {
        let unpacked = std::fs::read(dir.join(entry.file_name())).unwrap();
        assert!(unpacked == std::fs::read(entry.path()).unwrap(), "{:?} differs", entry.file_name());
    }

    // A second run reuses the unpacked copy untouched.
    let st = dir.join("model.safetensors");
    let before = std::fs::metadata(&st).unwrap().modified().unwrap();
    let out = run_with_cache(cache.path(), &["score", "--ids", "1,2,3", "--json"]);
    assert!(out.status.success());
    assert_eq!(std::fs::metadata(&st).unwrap().modified().unwrap(), before);

    // A damaged copy is replaced, and the answer is the same as before the damage.
    let first = run_with_cache(cache.path(), &["generate", "--prompt", "And God said", "--max-tokens", "8", "--json"]);
    std::fs::OpenOptions::new().write(true).open(&st).unwrap().set_len(100).unwrap();
    let repaired = run_with_cache(cache.path(), &["generate", "--prompt", "And God said", "--max-tokens", "8", "--json"]);
    assert!(repaired.status.success(), "{}", String::from_utf8_lossy(&repaired.stderr));
    let (a, b): (serde_json::Value, serde_json::Value) = (serde_json::from_slice(&first.stdout).unwrap(), serde_json::from_slice(&repaired.stdout).unwrap());
    assert_eq!(a["output_ids"], b["output_ids"]);
    assert_eq!(demo_dirs(cache.path()).len(), 1);
}

#[test]
fn concurrent_first_runs_all_succeed_and_publish_one_copy() {
    let cache = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            Command::new(shimmer_bin())
                .args(["score", "--ids", "1,2,3", "--json"])
                .env("XDG_CACHE_HOME", cache.path())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(|c| shimmer_tests::wait_within(c, shimmer_tests::COMMAND_LIMIT)).collect();
    // The same answer from every run (timings differ, the answers must not).
    let answer = |o: &Output| {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["argmax"].clone(), v["logprobs"].clone())
    };
    for o in &outputs {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(answer(o), answer(&outputs[0]));
    }
    assert_eq!(demo_dirs(cache.path()).len(), 1, "{:?}", demo_dirs(cache.path()));
}

#[test]
fn no_cache_directory_is_a_clear_error() {
    let out = shimmer_tests::output_within(
        Command::new(shimmer_bin()).args(["score", "--ids", "1,2"]).env_remove("XDG_CACHE_HOME").env_remove("HOME"),
        shimmer_tests::COMMAND_LIMIT,
    );
    assert_clean_failure(&out, &["cache directory", "--model"]);
}
