//! Bad input to the expert container and store, through the real binary: each is one clear
//! `error:` line (or a clean resume), never a panic and never a different answer.

use std::path::Path;
use std::process::Command;

use shimmer_store::container::{Manifest, MANIFEST_FILE};
use shimmer_tests::{assert_clean_failure, fixture, shimmer, shimmer_bin};

fn convert(from: &Path, to: &Path, quant: &str) -> std::process::Output {
    shimmer(&["convert", "--from", from.to_str().unwrap(), "--to", to.to_str().unwrap(), "--quant", quant, "--quiet"])
}

fn converted(name: &str, quant: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let o = convert(&fixture(name), out.path(), quant);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

fn manifest(dir: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap()
}

fn score(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["score", "--model", dir.to_str().unwrap(), "--ids", "1,5,9,13,17,21,25,29", "--json"];
    if !extra.contains(&"--usage") {
        args.push("--no-usage");
    }
    args.extend_from_slice(extra);
    shimmer(&args)
}

/// Every file of a directory, by name, with its bytes.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap()).map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())).collect();
    files.sort();
    files
}

#[test]
fn a_conversion_killed_at_any_point_resumes_to_the_same_container_and_is_never_taken_for_finished() {
    let clean = converted("olmoe", "int4-g64");
    let want = snapshot(clean.path());
    let mut crash_at = 1;
    loop {
        let out = tempfile::tempdir().unwrap();
        let to = out.path().join("c");
        let o = shimmer_tests::output_within(
            Command::new(shimmer_bin())
                .args(["convert", "--from", fixture("olmoe").to_str().unwrap(), "--to", to.to_str().unwrap(), "--quant", "int4-g64", "--quiet"])
                .env("SHIMMER_CONVERT_CRASH_AT", crash_at.to_string()),
            shimmer_tests::COMMAND_LIMIT,
        );
        if o.status.success() {
            assert!(crash_at > 20, "too few crash points exercised ({crash_at})");
            break;
        }
        assert!(o.status.code().is_none(), "crash point {crash_at}: expected an abort, got {:?}", o.status);
        // The manifest is the commit point: with it the container is whole, without it the
        // directory is never taken for a model.
        let e = score(&to, &[]);
        assert!(!String::from_utf8_lossy(&e.stderr).contains("panicked"));
        if to.join(MANIFEST_FILE).exists() {
            assert!(e.status.success(), "crash point {crash_at}: a manifest but no model: {}", String::from_utf8_lossy(&e.stderr));
        } else {
            assert!(!e.status.success(), "crash point {crash_at}: a half-written container loaded");
        }
        // Resume, then the result is byte-for-byte the uninterrupted conversion.
        let o = convert(&fixture("olmoe"), &to, "int4-g64");
        assert!(o.status.success(), "crash point {crash_at}: resume failed: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(snapshot(&to), want, "crash point {crash_at}: resumed output differs");
        crash_at += 1;
    }
    // A finished conversion asked again is a no-op; a different format there is refused.
    let again = convert(&fixture("olmoe"), clean.path(), "int4-g64");
    assert!(again.status.success() && String::from_utf8_lossy(&again.stderr).contains("nothing to do"));
    assert_clean_failure(&convert(&fixture("olmoe"), clean.path(), "int8"), &["another source or format"]);
    // A directory with other files in it is not written into.
    let busy = tempfile::tempdir().unwrap();
    std::fs::write(busy.path().join("notes.txt"), "mine").unwrap();
    assert_clean_failure(&convert(&fixture("olmoe"), busy.path(), "int8"), &["not empty"]);
}

#[test]
fn a_corrupt_blob_without_a_good_copy_names_layer_expert_and_file() {
    let c = converted("olmoe", "int8");
    // Find an expert this input uses, from a trace of a good run.
    let trace = c.path().join("t.trace");
    let ok = score(c.path(), &["--trace", trace.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let t = shimmer_common::trace::Trace::read(&trace).unwrap();
    let (layer, expert) = (t.header.layers[0] as usize, t.tokens[0].selected[0][0] as usize);
    let m = manifest(c.path());
    let blob = m.blobs.iter().find(|b| b.layer == layer && b.expert == expert).unwrap();
    let path = c.path().join("experts.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[blob.offset as usize + 100] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    for extra in [&[][..], &["--direct-io"][..], &["--ram-gb", "0.001"][..]] {
        let out = score(c.path(), extra);
        assert_clean_failure(&out, &[&format!("layer {layer} expert {expert}"), "experts.safetensors", "checksum mismatch"]);
    }
    // The store counts the failed read (what /metrics exports as shimmer_expert_read_errors_total
    // and the ExpertReadErrors alert watches); good reads are not counted.
    let dir = shimmer_coordinator::model_dir::ModelDir::open(c.path()).unwrap();
    let opts = shimmer_coordinator::engine::ExpertOptions { usage: shimmer_coordinator::engine::UsageFile::Off, ..Default::default() };
    let store = dir.expert_store(&opts, 0).unwrap();
    let other = m.blobs.iter().find(|b| b.layer == layer && b.expert != expert).unwrap();
    assert!(store.load(&[(layer, other.expert)]).is_ok());
    assert_eq!(store.telemetry().read_errors, 0);
    assert!(store.load(&[(layer, expert)]).is_err());
    assert_eq!(store.telemetry().read_errors, 1);
}

/// A checksum binds what it protects: a blob's identity as well as its bytes, and the dense
/// weights too — moved, swapped or flipped, a container is refused before it can answer
/// differently.
#[test]
fn swapped_blob_entries_a_flipped_dense_byte_and_a_missing_manifest_are_refused() {
    let c = converted("olmoe", "int8");
    let good = score(c.path(), &[]);
    assert!(good.status.success(), "{}", String::from_utf8_lossy(&good.stderr));
    let manifest_path = c.path().join(MANIFEST_FILE);
    let original = std::fs::read(&manifest_path).unwrap();
    let m = manifest(c.path());
    let trace = c.path().join("t.trace");
    assert!(score(c.path(), &["--trace", trace.to_str().unwrap()]).status.success());
    let t = shimmer_common::trace::Trace::read(&trace).unwrap();
    let (layer, used) = (t.header.layers[0] as usize, t.tokens[0].selected[0][0] as usize);
    let at = |l: usize, e: usize| m.blobs.iter().position(|b| b.layer == l && b.expert == e).unwrap();
    // Two experts' entries trade places (offset and checksum together): each checksum still
    // matches the bytes it points at, but not the expert it now claims to be.
    let other_layer = m.blobs.iter().map(|b| b.layer).find(|l| *l != layer).unwrap();
    for (a, b) in [(at(layer, used), at(layer, (used + 1) % 64)), (at(layer, used), at(other_layer, used))] {
        // Whichever of the two is read first is the one named.
        let named = |i: usize| format!("layer {} expert {}", m.blobs[i].layer, m.blobs[i].expert);
        let mut v: serde_json::Value = serde_json::from_slice(&original).unwrap();
        let blobs = v["blobs"].as_array_mut().unwrap();
        for key in ["offset", "xxh3"] {
            let (x, y) = (blobs[a][key].clone(), blobs[b][key].clone());
            blobs[a][key] = y;
            blobs[b][key] = x;
        }
        std::fs::write(&manifest_path, serde_json::to_vec(&v).unwrap()).unwrap();
        for extra in [&[][..], &["--direct-io"][..]] {
            let out = score(c.path(), extra);
            assert_clean_failure(&out, &["checksum mismatch", "another expert's blob"]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(&named(a)) || err.contains(&named(b)), "names neither swapped expert: {err}");
        }
    }
    std::fs::write(&manifest_path, &original).unwrap();

    // One flipped byte in the dense weights: refused before any token, naming the file.
    let dense = c.path().join("dense.safetensors");
    let bytes = std::fs::read(&dense).unwrap();
    for at in [bytes.len() / 2, bytes.len() - 1] {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x10;
        std::fs::write(&dense, &flipped).unwrap();
        assert_clean_failure(&score(c.path(), &[]), &["dense.safetensors", "checksum mismatch"]);
    }
    std::fs::write(&dense, &bytes[..bytes.len() - 8]).unwrap();
    assert_clean_failure(&score(c.path(), &[]), &["dense.safetensors", "truncated"]);
    std::fs::write(&dense, &bytes).unwrap();
    let answer = |o: &std::process::Output| {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["argmax"].clone(), v["logprobs"].clone())
    };
    assert_eq!(answer(&score(c.path(), &[])), answer(&good), "restored, the same answer");

    // Without its manifest, the container says so (not that some tensor is missing).
    std::fs::remove_file(&manifest_path).unwrap();
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "is missing"]);
    let worker =
        shimmer(&["worker", "--model", c.path().to_str().unwrap(), "--listen", "127.0.0.1:1", "--no-usage", "--join-token", "store-errors-test-token"]);
    assert_clean_failure(&worker, &[MANIFEST_FILE, "is missing"]);
}

#[test]
fn damaged_containers_and_foreign_files_are_refused_with_the_reason() {
    let c = converted("olmoe", "bf16");
    let experts = c.path().join("experts.safetensors");
    let m = manifest(c.path());

    // Truncated experts file.
    let bytes = std::fs::read(&experts).unwrap();
    std::fs::write(&experts, &bytes[..bytes.len() - 4096]).unwrap();
    assert_clean_failure(&score(c.path(), &[]), &["experts.safetensors", "truncated"]);
    std::fs::write(&experts, &bytes).unwrap();
    assert!(score(c.path(), &[]).status.success());

    let manifest_path = c.path().join(MANIFEST_FILE);
    let original = std::fs::read(&manifest_path).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_slice(&original).unwrap();
        f(&mut v);
        std::fs::write(&manifest_path, serde_json::to_vec(&v).unwrap()).unwrap();
    };
    edit(&|v| v["version"] = 99.into());
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "version 99"]);
    // Version 2 differs only in int4's scales (f32 then): its bf16 containers still serve.
    edit(&|v| v["version"] = 2.into());
    assert!(score(c.path(), &[]).status.success());
    edit(&|v| v["version"] = 1.into());
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "version 1", "re-run `shimmer convert`"]);
    edit(&|v| v["expert_quant"] = "int3".into());
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "int3"]);
    edit(&|v| {
        v["blobs"].as_array_mut().unwrap().pop();
    });
    let last = m.blobs.last().unwrap();
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, &format!("no blob for layer {} expert {}", last.layer, last.expert)]);
    edit(&|v| v["blobs"][0]["offset"] = 12345.into());
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "misaligned"]);
    edit(&|v| v["hidden_size"] = 7.into());
    assert_clean_failure(&score(c.path(), &[]), &[MANIFEST_FILE, "hidden 7"]);
    std::fs::write(&manifest_path, &original).unwrap();

    // A budget below one layer's working set is refused at start, with the minimum.
    assert_clean_failure(&score(c.path(), &["--ram-gb", "0.0000001"]), &["expert budget", "minimum is"]);
    assert_clean_failure(&score(c.path(), &["--ram-gb", "lots"]), &["--ram-gb", "lots"]);

    // A usage file of another model.
    let foreign = c.path().join("foreign-usage.json");
    std::fs::write(&foreign, r#"{"format":"shimmer-usage","version":1,"fingerprint":"0123456789abcdef","selections":0,"counts":[]}"#).unwrap();
    assert_clean_failure(&score(c.path(), &["--usage", foreign.to_str().unwrap()]), &["foreign-usage.json", "another model"]);

    // O_DIRECT and mirrors need a container; a mirror must be the same container.
    assert_clean_failure(&score(&fixture("olmoe"), &["--direct-io"]), &["convert"]);
    let other = converted("olmoe", "int8");
    assert_clean_failure(&score(c.path(), &["--mirror", other.path().to_str().unwrap()]), &["mirror", "different container"]);
}

#[test]
fn a_mirror_serves_corrupt_blobs_from_the_good_copy_with_one_warning_per_expert_and_the_same_answer() {
    let c = converted("olmoe", "int4-g32");
    let generate = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,5,9,13", "--max-tokens", "12", "--json", "--no-usage"];
        args.extend_from_slice(extra);
        shimmer(&args)
    };
    let good = generate(c.path(), &[]);
    assert!(good.status.success());
    let mirror = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(c.path()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), mirror.path().join(e.file_name())).unwrap();
    }
    // Every expert has exactly one good copy: alternate blobs are corrupt on each drive, so
    // whichever drive the weighted hash picks, some reads must fall back to the other.
    for (dir, parity) in [(c.path(), 0), (mirror.path(), 1)] {
        let path = dir.join("experts.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        for b in manifest(dir).blobs.iter().filter(|b| (b.layer + b.expert) % 2 == parity) {
            bytes[b.offset as usize + 7] ^= 0x10;
        }
        std::fs::write(&path, &bytes).unwrap();
    }
    // The smallest budget (one layer's top-k): each decode step reads experts again, but each
    // expert is warned about once.
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(c.path().join("config.json")).unwrap()).unwrap();
    let top_k = config["num_experts_per_tok"].as_u64().unwrap();
    let budget = format!("{}", (top_k * manifest(c.path()).blob_bytes) as f64 / 1e9);
    let out = generate(c.path(), &["--mirror", mirror.path().to_str().unwrap(), "--ram-gb", &budget]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let tokens = |o: &std::process::Output| serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["output_ids"].clone();
    assert_eq!(tokens(&out), tokens(&good));
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("served from")).collect();
    assert!(!warnings.is_empty(), "{stderr}");
    let mut named: Vec<String> = warnings.iter().map(|w| w.split("checksum").next().unwrap_or("").to_string()).collect();
    let n = named.len();
    named.sort();
    named.dedup();
    assert_eq!(named.len(), n, "an expert was warned about twice: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["timings"]["store"]["experts"]["mirror_fallbacks"].as_u64().unwrap() as usize > n, "expected repeated fallbacks after the first warnings: {v}");
}

/// A dense int4 container whose matrices were damaged: the file's checksum refuses any changed
/// byte through the binary; below it, the loader itself refuses a scale tensor of the wrong shape
/// or a negative scale naming the matrix (what a writer's bug would leave); an unknown
/// `dense_quant` is refused naming the field.
#[test]
fn a_damaged_dense_int4_matrix_is_refused_by_name() {
    use shimmer_experts::weights::load_matrix;
    let out = tempfile::tempdir().unwrap();
    let o = shimmer(&[
        "convert",
        "--from",
        fixture("olmoe").to_str().unwrap(),
        "--to",
        out.path().to_str().unwrap(),
        "--quant",
        "int8",
        "--dense-quant",
        "int4-g32",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(score(out.path(), &[]).status.success());
    let q = "model.layers.0.self_attn.q_proj.weight";
    let scale = format!("{q}_shimmer_int4_g32_scale");
    let dense = |dir: &Path| shimmer_common::Checkpoint::open_files(dir, &["dense.safetensors"]).unwrap();
    let (rows, cols) = {
        let h: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("olmoe").join("config.json")).unwrap()).unwrap();
        let (heads, hd, hidden) = (h["num_attention_heads"].as_u64().unwrap(), h.get("head_dim").and_then(|v| v.as_u64()), h["hidden_size"].as_u64().unwrap());
        ((heads * hd.unwrap_or(hidden / heads)) as usize, hidden as usize)
    };
    assert!(load_matrix(&dense(out.path()), q, rows, cols, 128).is_ok());

    // A changed scale byte: the container's checksum refuses the file.
    let negative = tempfile::tempdir().unwrap();
    copy_dir(out.path(), negative.path());
    let path = negative.path().join("dense.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = 8 + n + header[&scale]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at + 1] |= 0x80; // the f16 scale's sign bit
    std::fs::write(&path, bytes).unwrap();
    assert_clean_failure(&score(negative.path(), &[]), &["dense.safetensors", "checksum mismatch"]);
    // The loader: a negative scale.
    let e = load_matrix(&dense(negative.path()), q, rows, cols, 128).unwrap_err().to_string();
    assert!(e.contains(q) && e.contains("negative"), "{e}");

    // The loader: scales of another shape (groups and rows swapped).
    let wrong_shape = tempfile::tempdir().unwrap();
    copy_dir(out.path(), wrong_shape.path());
    shimmer_tests::edit_safetensors_header(&wrong_shape.path().join("dense.safetensors"), |h| {
        let shape = h[&scale]["shape"].as_array().unwrap().clone();
        h.get_mut(&scale).unwrap()["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let e = load_matrix(&dense(wrong_shape.path()), q, rows, cols, 128).unwrap_err().to_string();
    assert!(e.contains(&scale), "{e}");

    // A container written when int4 scales were f32 (version 2): the loader and the manifest
    // both say to convert again, and a conversion into it refuses to take it for finished.
    let old_scales = tempfile::tempdir().unwrap();
    copy_dir(out.path(), old_scales.path());
    shimmer_tests::edit_safetensors_header(&old_scales.path().join("dense.safetensors"), |h| {
        let shape = h[&scale]["shape"].as_array().unwrap().clone();
        let rows = shape[0].as_u64().unwrap();
        assert_eq!(rows % 2, 0, "the fixture's matrix has an even number of rows");
        h.get_mut(&scale).unwrap()["dtype"] = "F32".into();
        h.get_mut(&scale).unwrap()["shape"] = serde_json::json!([rows / 2, shape[1]]);
    });
    let e = load_matrix(&dense(old_scales.path()), q, rows, cols, 128).unwrap_err().to_string();
    assert!(e.contains(&scale) && e.contains("f32") && e.contains("re-run `shimmer convert`"), "{e}");
    let old_manifest = tempfile::tempdir().unwrap();
    copy_dir(out.path(), old_manifest.path());
    let path = old_manifest.path().join(MANIFEST_FILE);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["version"] = 2.into();
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    assert_clean_failure(&score(old_manifest.path(), &[]), &[MANIFEST_FILE, "version 2", "int4-g32 dense", "re-run `shimmer convert`"]);
    let o = shimmer(&[
        "convert",
        "--from",
        fixture("olmoe").to_str().unwrap(),
        "--to",
        old_manifest.path().to_str().unwrap(),
        "--quant",
        "int8",
        "--dense-quant",
        "int4-g32",
        "--quiet",
    ]);
    assert_clean_failure(&o, &["cannot read", "version 2"]);

    let unknown = tempfile::tempdir().unwrap();
    copy_dir(out.path(), unknown.path());
    let path = unknown.path().join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap().replace("\"int4-g32\"", "\"int4-g48\"");
    std::fs::write(&path, text).unwrap();
    assert_clean_failure(&score(unknown.path(), &[]), &["dense_quant", "int4-g48"]);
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}
