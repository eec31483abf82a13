//! The expert store's rule (DESIGN.md §1): placement may change speed, never the model. Greedy
//! tokens and every logit bit are the same whether all experts are resident or ~10 % fit, cold or
//! with learned pins, with O_DIRECT or buffered reads, with prefetch on or off, read by threads or
//! through io_uring, and when the primary copy is corrupt but a mirror is good.

use std::path::{Path, PathBuf};

use shimmer_common::quant::QuantScheme;
use shimmer_coordinator::engine::{Engine, ExpertOptions, GenerateOptions, RamBudget, UsageFile};
use shimmer_coordinator::sampling::SamplingParams;
use shimmer_store::container::{Manifest, MANIFEST_FILE};
use shimmer_store::convert::{convert, ConvertOptions, DenseQuant};
use shimmer_store::IoEngine;
use shimmer_tests::{fixture, fixtures};

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo")
}

fn convert_to(src: &Path, to: &Path, scheme: QuantScheme) {
    convert(src, to, ConvertOptions { expert_quant: scheme, dense_quant: DenseQuant::Bf16, head_quant: None }, &mut |_| {})
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
}

/// Everything observable about the model's answers: all logits of a teacher-forced pass (as
/// bits) and a greedy continuation.
fn answers(engine: &Engine) -> (Vec<u32>, Vec<u32>) {
    let v = engine.spec.vocab_size as u32;
    let ids: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % v.min(400)).collect();
    let logits: Vec<u32> = engine.logits_all(&ids).unwrap().iter().map(|x| x.to_bits()).collect();
    let mut session = engine.new_session();
    let opts = GenerateOptions { max_tokens: 12, sampling: SamplingParams::default(), stop: vec![] };
    let gen = engine.generate(&mut session, &ids[..6], &opts, |_| true).unwrap();
    (logits, gen.output_ids)
}

fn floats(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|b| f32::from_bits(*b)).collect()
}

/// Whether a bf16 container of this checkpoint rounds any weight: an f32 or f16 matrix that is
/// not a router (the converter keeps routers as stored). Read from the files, not the fixture's
/// name.
fn rounds_in_bf16(src: &Path) -> bool {
    let spec = shimmer_common::ModelSpec::from_dir(src).unwrap();
    // The model's own files: the fixture's oracle record sits beside them as a safetensors file.
    let files: Vec<String> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && n != "oracle.safetensors")
        .collect();
    let ckpt = shimmer_common::Checkpoint::open_files(src, &files.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let routers: std::collections::HashSet<String> =
        (0..spec.layers.len()).flat_map(|l| [spec.expert_names.router(l), format!("{}.weight", spec.expert_names.router(l))]).collect();
    ckpt.tensor_names().into_iter().any(|name| {
        let raw = ckpt.raw(name).unwrap();
        raw.shape.len() == 2 && !routers.contains(name) && matches!(raw.dtype, shimmer_common::StDtype::F32 | shimmer_common::StDtype::F16)
    })
}

/// Equal answers, or a short report of where they first differ.
#[track_caller]
fn same(got: &(Vec<u32>, Vec<u32>), want: &(Vec<u32>, Vec<u32>), what: &str) {
    if let Some(i) = got.0.iter().zip(&want.0).position(|(a, b)| a != b) {
        panic!("{what}: logit {i} differs: {} vs {}", f32::from_bits(got.0[i]), f32::from_bits(want.0[i]));
    }
    assert_eq!(got.0.len(), want.0.len(), "{what}: logit count");
    assert_eq!(got.1, want.1, "{what}: greedy tokens");
}

fn opts(ram_gb: f64) -> ExpertOptions {
    ExpertOptions { ram: Some(RamBudget::Gb(ram_gb)), usage: UsageFile::Off, ..ExpertOptions::default() }
}

fn open(dir: &Path, o: &ExpertOptions) -> Engine {
    Engine::open(dir, o).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Flips one byte inside every blob of a container's experts file whose (layer + expert) has
/// this parity (their checksums then fail).
fn corrupt_blobs(container: &Path, parity: usize) {
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(container.join(MANIFEST_FILE)).unwrap()).unwrap();
    let path = container.join("experts.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    for b in manifest.blobs.iter().filter(|b| (b.layer + b.expert) % 2 == parity) {
        bytes[b.offset as usize + 5] ^= 0x40;
    }
    std::fs::write(&path, bytes).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Runs every placement variant on one container and checks each against the all-resident run;
/// returns the ~10 % budget it used (GB).
fn placements_agree(name: &str, container: &Path, reference: &(Vec<u32>, Vec<u32>)) -> f64 {
    let all = open(container, &opts(100.0));
    let t = all.store_telemetry().expect("a container runs in the store");
    same(&answers(&all), reference, &format!("{name}: all resident"));
    let moe_experts = (all.spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() * all.spec.moe.num_experts) as u64;
    // ~10 % of the experts, never below one layer's working set (top-k).
    let experts = (moe_experts / 10).max(all.spec.moe.top_k as u64);
    let budget = (experts * t.expert_bytes) as f64 / 1e9 * 1.000_001;
    drop(all);

    let cold = open(container, &opts(budget));
    same(&answers(&cold), reference, &format!("{name}: ~10% budget, cold"));
    let ct = cold.store_telemetry().unwrap();
    assert!(ct.disk_misses > 0 && ct.capacity_experts < moe_experts, "{name}: the small budget must force reads: {ct:?}");
    drop(cold);

    let usage = tempfile::tempdir().unwrap();
    let with_usage = ExpertOptions { usage: UsageFile::File(usage.path().join("u.json")), ..opts(budget) };
    let learn = open(container, &with_usage);
    same(&answers(&learn), reference, &format!("{name}: learning pins"));
    drop(learn);
    let warm = open(container, &with_usage);
    let pinned = warm.store_telemetry().unwrap().pinned_experts;
    same(&answers(&warm), reference, &format!("{name}: warm pins"));
    if warm.store_telemetry().unwrap().slots_per_layer >= 2 {
        assert!(pinned > 0, "{name}: a usage file from an earlier run must give pins");
    }
    drop(warm);

    same(&answers(&open(container, &ExpertOptions { direct_io: true, ..opts(budget) })), reference, &format!("{name}: --direct-io"));
    same(&answers(&open(container, &ExpertOptions { prefetch: false, ..opts(budget) })), reference, &format!("{name}: no prefetch"));
    same(&answers(&open(container, &ExpertOptions { io_depth: 1, ..opts(budget) })), reference, &format!("{name}: one read at a time"));
    // Both ways to the disk, each named in the telemetry: `auto` picks the ring on Linux.
    for (engine, named) in [(IoEngine::Auto, "uring"), (IoEngine::Uring, "uring"), (IoEngine::Threads, "threads")] {
        for direct_io in [false, true] {
            let e = open(container, &ExpertOptions { io_engine: engine, direct_io, ..opts(budget) });
            same(&answers(&e), reference, &format!("{name}: {engine:?}, O_DIRECT {direct_io}"));
            let t = e.store_telemetry().unwrap();
            assert_eq!(t.io_engine, named, "{name}: {engine:?}");
            assert!(t.reads > 0 && t.read_errors == 0, "{name}: {engine:?}: {t:?}");
        }
    }

    // A mirror: half the blobs are corrupt on the primary, the other half on the mirror, so every
    // expert has one good copy and, whichever drive the weighted hash picks, some reads fall back
    // (from a ring read whose checksum failed, or a thread's).
    let mirror = tempfile::tempdir().unwrap();
    let primary = tempfile::tempdir().unwrap();
    copy_dir(container, mirror.path());
    copy_dir(container, primary.path());
    corrupt_blobs(primary.path(), 0);
    corrupt_blobs(mirror.path(), 1);
    for engine in [IoEngine::Uring, IoEngine::Threads] {
        let mirrored = open(primary.path(), &ExpertOptions { mirror: Some(mirror.path().to_path_buf()), direct_io: true, io_engine: engine, ..opts(budget) });
        same(&answers(&mirrored), reference, &format!("{name}: {engine:?}, mirror, each blob good on one copy only"));
        let t = mirrored.store_telemetry().unwrap();
        assert!(t.mirror_fallbacks > 0 && t.read_errors == 0, "{name}: {engine:?}: a corrupt copy must have been tried and the good one served: {t:?}");
    }
    budget
}

#[test]
fn a_bf16_container_answers_as_its_checkpoint_and_identically_under_every_placement() {
    for name in fixtures() {
        let src = fixture(name);
        let out = tempfile::tempdir().unwrap();
        let container = out.path().join("c");
        convert_to(&src, &container, QuantScheme::Bf16);
        let checkpoint = answers(&Engine::load(&src).unwrap());
        let converted = answers(&open(&container, &opts(100.0)));
        // Converting to bf16 rounds every f32/f16 matrix except the routers (kept as stored).
        // Where there is none, the container answers exactly as its checkpoint; elsewhere the
        // rounding moves logits a little (bounded here), and the container's own all-resident run
        // is the reference every placement must reproduce bit for bit.
        if rounds_in_bf16(&src) {
            let (got, want) = (floats(&converted.0), floats(&checkpoint.0));
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
            assert!(worst <= 0.03 * scale, "{name}: bf16 rounding moved a logit by {worst} (largest logit {scale})");
        } else {
            same(&converted, &checkpoint, &format!("{name}: bf16 container vs checkpoint"));
        }
        let budget = placements_agree(name, &container, &converted);
        // The unconverted checkpoint behind the same store (three tensor reads per expert).
        // (f32 experts take twice the bytes of the bf16 container's.)
        let budgeted = open(&src, &opts(budget * 2.0));
        same(&answers(&budgeted), &checkpoint, &format!("{name}: checkpoint through the store at ~10%"));
        assert!(budgeted.store_telemetry().unwrap().disk_misses > 0);
    }
}

#[test]
fn the_demo_model_int4_container_matches_its_in_memory_quantisation_under_every_placement() {
    let reference = answers(&shimmer_tests::engine_with_experts_as(&demo(), QuantScheme::Int4 { group: 32 }));
    let out = tempfile::tempdir().unwrap();
    let container = out.path().join("c");
    convert_to(&demo(), &container, QuantScheme::Int4 { group: 32 });
    placements_agree("demo int4-g32", &container, &reference);
}

/// `--dense-quant int4-g64`: every matrix of the layers (attention, dense MLPs) is stored as the
/// int4 format defines it — the nibbles and scales `quantize_int4` gives the source weights — and
/// loaded as exactly that matrix; embedding and head go to int8, routers stay as stored. The
/// container answers identically under every placement, and close to the checkpoint (nibbles in
/// the wrong order or a wrong group would be nats away).
#[test]
fn a_dense_int4_container_stores_the_format_and_answers_under_every_placement() {
    use shimmer_common::{quant, Checkpoint, ModelSpec, StDtype};
    let out = tempfile::tempdir().unwrap();
    let container = out.path().join("c");
    let options = ConvertOptions { expert_quant: QuantScheme::Int4 { group: 32 }, dense_quant: DenseQuant::Int4 { group: 64 }, head_quant: None };
    convert(&demo(), &container, options, &mut |_| {}).unwrap();
    let spec = ModelSpec::from_dir(&demo()).unwrap();
    let (source, dense) = (Checkpoint::open(&demo()).unwrap(), Checkpoint::open_files(&container, &["dense.safetensors"]).unwrap());
    let routers: Vec<String> = (0..spec.layers.len()).flat_map(|l| [spec.expert_names.router(l), format!("{}.weight", spec.expert_names.router(l))]).collect();
    let (mut int4, mut int8) = (0, 0);
    for name in dense.tensor_names() {
        let Ok(raw) = source.raw(name) else { continue };
        if raw.shape.len() != 2 {
            continue;
        }
        let (rows, cols) = (raw.shape[0], raw.shape[1]);
        let stored = dense.raw(name).unwrap();
        if routers.iter().any(|r| r == name) {
            assert_eq!(stored.dtype, raw.dtype, "{name}: a router is never quantised");
        } else if name == spec.dense_names.embed || name == spec.dense_names.lm_head {
            assert_eq!(stored.dtype, StDtype::I8, "{name}");
            int8 += 1;
        } else {
            assert_eq!((stored.dtype, stored.shape.to_vec()), (StDtype::U8, vec![rows, cols.div_ceil(2)]), "{name}");
            let want = quant::quantize_int4(&source.get(name, &[rows, cols]).unwrap().to_f32(), rows, cols, 64);
            let got = shimmer_experts::weights::load_matrix(&dense, name, rows, cols, 128).unwrap();
            assert!(got == shimmer_kernels::Matrix::from_quant(want), "{name}: not the int4-g64 quantisation of the source");
            int4 += 1;
        }
    }
    assert!(int4 >= 4 * spec.layers.len() && int8 >= 1, "{int4} int4 and {int8} int8 matrices");

    let reference = answers(&open(&container, &opts(100.0)));
    placements_agree("demo int4 dense", &container, &reference);
    let bf16 = floats(&answers(&Engine::load(&demo()).unwrap()).0);
    let (got, v) = (floats(&reference.0), spec.vocab_size);
    let kl: f64 = bf16.chunks(v).zip(got.chunks(v)).map(|(p, q)| kl_of_logits(p, q)).sum::<f64>() / (bf16.len() / v) as f64;
    eprintln!("demo, int4-g32 experts and int4-g64 dense: mean KL against the checkpoint {kl:.5} nats");
    assert!(kl < 0.2, "mean KL {kl}");
}

/// `--head-quant int4-g32` under int8 dense weights: the head (the demo ties it to the
/// embedding, so that tensor) is stored as the int4 format defines it and every other matrix as
/// int8; the manifest names both formats, so a conversion asked again with another head is
/// refused rather than mixed; the model answers close to the checkpoint and differently from the
/// int8 head's container (the head it computes with is the stored one).
#[test]
fn a_head_format_chosen_apart_is_stored_named_and_used() {
    use shimmer_common::{quant, Checkpoint, ModelSpec, StDtype};
    let out = tempfile::tempdir().unwrap();
    let (int4_head, int8_head) = (out.path().join("h4"), out.path().join("h8"));
    let expert_quant = QuantScheme::Int4 { group: 32 };
    let options = ConvertOptions { expert_quant, dense_quant: DenseQuant::Int8, head_quant: Some(DenseQuant::Int4 { group: 32 }) };
    convert(&demo(), &int4_head, options, &mut |_| {}).unwrap();
    convert(&demo(), &int8_head, ConvertOptions { head_quant: None, ..options }, &mut |_| {}).unwrap();
    let spec = ModelSpec::from_dir(&demo()).unwrap();
    assert!(spec.tie_word_embeddings, "the demo ties its head to the embedding");
    let head = spec.dense_names.embed;
    let (source, dense) = (Checkpoint::open(&demo()).unwrap(), Checkpoint::open_files(&int4_head, &["dense.safetensors"]).unwrap());
    let (mut int8, mut heads) = (0, 0);
    for name in dense.tensor_names() {
        let Ok(raw) = source.raw(name) else { continue };
        let stored = dense.raw(name).unwrap();
        if name == head {
            let (rows, cols) = (raw.shape[0], raw.shape[1]);
            assert_eq!((stored.dtype, stored.shape.to_vec()), (StDtype::U8, vec![rows, cols.div_ceil(2)]), "{name}");
            let want = quant::quantize_int4(&source.get(name, &[rows, cols]).unwrap().to_f32(), rows, cols, 32);
            let got = shimmer_experts::weights::load_matrix(&dense, name, rows, cols, 128).unwrap();
            assert!(got == shimmer_kernels::Matrix::from_quant(want), "{name}: not the int4-g32 quantisation of the source");
            heads += 1;
        } else if stored.dtype == StDtype::I8 {
            int8 += 1;
        }
    }
    assert!(heads == 1 && int8 >= 4 * spec.layers.len(), "{heads} heads, {int8} int8 matrices");
    let manifest = shimmer_store::container::read_manifest(&int4_head).unwrap();
    assert_eq!(manifest.dense_quant, "int8+head-int4-g32");
    assert_eq!(shimmer_store::container::read_manifest(&int8_head).unwrap().dense_quant, "int8", "a head left alone is not named");
    let again = convert(&demo(), &int4_head, ConvertOptions { head_quant: Some(DenseQuant::Int8), ..options }, &mut |_| {}).unwrap_err().to_string();
    assert!(again.contains("another source or format") && again.contains("int8+head-int4-g32"), "{again}");
    assert!(convert(&demo(), &int4_head, options, &mut |_| {}).unwrap().already_done);

    let (with_int4, with_int8) = (answers(&open(&int4_head, &opts(100.0))), answers(&open(&int8_head, &opts(100.0))));
    assert_ne!(with_int4.0, with_int8.0, "the int4 head's logits are the int8 head's: the stored head is not the one used");
    let bf16 = floats(&answers(&Engine::load(&demo()).unwrap()).0);
    let (got, v) = (floats(&with_int4.0), spec.vocab_size);
    let kl: f64 = bf16.chunks(v).zip(got.chunks(v)).map(|(p, q)| kl_of_logits(p, q)).sum::<f64>() / (bf16.len() / v) as f64;
    eprintln!("demo, int4-g32 experts, int8 dense, int4-g32 head: mean KL against the checkpoint {kl:.5} nats");
    assert!(kl < 0.2, "mean KL {kl}");
}

/// `--head-quant int6-g32` under int8 dense weights (the 4-bit containers' head): the head is
/// stored as its three tensors (low nibbles, top bits, f16 scales) exactly as `quantize_int6`
/// defines them and loaded back as that matrix; the manifest names it; the model answers with it
/// — differently from the int8 head — and closer to the checkpoint than with an int4 head. A top
/// bits tensor of another shape, or a negative scale, is refused naming the tensor.
#[test]
fn a_six_bit_head_is_stored_loaded_and_closer_than_int4() {
    use shimmer_common::{quant, Checkpoint, ModelSpec, StDtype};
    let out = tempfile::tempdir().unwrap();
    let (six, four, eight) = (out.path().join("h6"), out.path().join("h4"), out.path().join("h8"));
    let expert_quant = QuantScheme::Int4 { group: 32 };
    let options = ConvertOptions { expert_quant, dense_quant: DenseQuant::Int8, head_quant: Some(DenseQuant::Int6 { group: 32 }) };
    convert(&demo(), &six, options, &mut |_| {}).unwrap();
    convert(&demo(), &four, ConvertOptions { head_quant: Some(DenseQuant::Int4 { group: 32 }), ..options }, &mut |_| {}).unwrap();
    convert(&demo(), &eight, ConvertOptions { head_quant: None, ..options }, &mut |_| {}).unwrap();
    assert_eq!(shimmer_store::container::read_manifest(&six).unwrap().dense_quant, "int8+head-int6-g32");
    let spec = ModelSpec::from_dir(&demo()).unwrap();
    let head = spec.dense_names.embed;
    let (source, dense) = (Checkpoint::open(&demo()).unwrap(), Checkpoint::open_files(&six, &["dense.safetensors"]).unwrap());
    let (rows, cols) = {
        let raw = source.raw(head).unwrap();
        (raw.shape[0], raw.shape[1])
    };
    let want = quant::quantize_int6(&source.get(head, &[rows, cols]).unwrap().to_f32(), rows, cols, 32);
    let (hi_name, scale_name) = (shimmer_store::convert::int6_hi_name(head), shimmer_store::convert::int6_scale_name(head, 32));
    for (name, dtype, shape, bytes) in [
        (head.to_string(), StDtype::U8, vec![rows, cols.div_ceil(2)], want.lo.clone()),
        (hi_name.clone(), StDtype::U8, vec![rows, quant::Int6Matrix::hi_bytes_per_row(cols)], want.hi.clone()),
        (scale_name.clone(), StDtype::F16, vec![rows, cols.div_ceil(32)], want.scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
    ] {
        let raw = dense.raw(&name).unwrap();
        assert_eq!((raw.dtype, raw.shape.to_vec()), (dtype, shape), "{name}");
        assert!(raw.bytes == bytes.as_slice(), "{name}: not the int6-g32 quantisation of the source");
    }
    let got = shimmer_experts::weights::load_matrix(&dense, head, rows, cols, 128).unwrap();
    assert!(got == shimmer_kernels::Matrix::from_int6(want), "the loaded head is not the stored int6 matrix");

    let with = |dir: &Path| answers(&open(dir, &opts(100.0)));
    let (with_six, with_four, with_eight) = (with(&six), with(&four), with(&eight));
    assert_ne!(with_six.0, with_eight.0, "the int6 head's logits are the int8 head's: the stored head is not the one used");
    let bf16 = floats(&answers(&Engine::load(&demo()).unwrap()).0);
    let v = spec.vocab_size;
    let kl = |got: &[u32]| {
        let got = floats(got);
        bf16.chunks(v).zip(got.chunks(v)).map(|(p, q)| kl_of_logits(p, q)).sum::<f64>() / (bf16.len() / v) as f64
    };
    let (kl6, kl4, kl8) = (kl(&with_six.0), kl(&with_four.0), kl(&with_eight.0));
    eprintln!("demo, int4-g32 experts, int8 dense; mean KL against the checkpoint with an int6-g32 head {kl6:.5}, int4-g32 {kl4:.5}, int8 {kl8:.5}");
    assert!(kl6 < kl4, "the 6-bit head ({kl6}) is no closer to the checkpoint than the 4-bit one ({kl4})");

    // Damage below the file checksum (what a writer's bug would leave), through the loader.
    let damaged = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&six).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), damaged.path().join(entry.file_name())).unwrap();
        }
    }
    let file = damaged.path().join("dense.safetensors");
    shimmer_tests::edit_safetensors_header(&file, |h| {
        let shape = h[&hi_name]["shape"].as_array().unwrap().clone();
        h.get_mut(&hi_name).unwrap()["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let e = shimmer_experts::weights::load_matrix(&Checkpoint::open_files(damaged.path(), &["dense.safetensors"]).unwrap(), head, rows, cols, 128)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&hi_name), "{e}");
    shimmer_tests::edit_safetensors_header(&file, |h| {
        let shape = h[&hi_name]["shape"].as_array().unwrap().clone();
        h.get_mut(&hi_name).unwrap()["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = 8 + n + header[&scale_name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at + 1] |= 0x80; // the first f16 scale's sign bit
    std::fs::write(&file, bytes).unwrap();
    let e = shimmer_experts::weights::load_matrix(&Checkpoint::open_files(damaged.path(), &["dense.safetensors"]).unwrap(), head, rows, cols, 128)
        .unwrap_err()
        .to_string();
    assert!(e.contains(head) && e.contains("negative"), "{e}");
}

/// Every family's fixture converts with int8, int4 and int6 dense weights and runs: a family's 2-D
/// tensors that are not weight matrices (DeepSeek-V4's position tables, Inkling's convolution
/// taps and clip scales) stay floats, as its loader reads them.
#[test]
fn every_family_runs_from_a_container_with_quantised_dense_weights() {
    for name in fixtures() {
        for dense_quant in [DenseQuant::Int8, DenseQuant::Int4 { group: 32 }, DenseQuant::Int6 { group: 64 }] {
            let out = tempfile::tempdir().unwrap();
            let options = ConvertOptions { expert_quant: QuantScheme::Int8PerRow, dense_quant, head_quant: None };
            convert(&fixture(name), out.path(), options, &mut |_| {}).unwrap_or_else(|e| panic!("{name} {}: {e}", dense_quant.name()));
            let engine = Engine::load(out.path()).unwrap_or_else(|e| panic!("{name} {}: {e}", dense_quant.name()));
            let logits = engine.logits_all(&[1, 2, 3]).unwrap_or_else(|e| panic!("{name} {}: {e}", dense_quant.name()));
            assert!(logits.iter().all(|x| x.is_finite()), "{name} {}", dense_quant.name());
        }
    }
}

/// KL(softmax(p) ‖ softmax(q)) in nats.
fn kl_of_logits(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |x: &[f32]| {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
        let z = x.iter().map(|v| (*v as f64 - m).exp()).sum::<f64>().ln() + m;
        x.iter().map(|v| *v as f64 - z).collect::<Vec<f64>>()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

#[test]
fn the_demo_model_bf16_container_and_checkpoint_agree_at_ten_percent() {
    let reference = answers(&Engine::load(&demo()).unwrap());
    let out = tempfile::tempdir().unwrap();
    let container = out.path().join("c");
    convert_to(&demo(), &container, QuantScheme::Bf16);
    placements_agree("demo bf16", &container, &reference);
}

#[test]
fn an_mxfp4_container_matches_its_in_memory_quantisation_under_every_placement() {
    // bf16 checkpoints (their dense weights convert losslessly, so only the experts change).
    for name in ["olmoe", "deepseek_v3"] {
        let reference = answers(&shimmer_tests::engine_with_experts_as(&fixture(name), QuantScheme::Mxfp4));
        let out = tempfile::tempdir().unwrap();
        let container = out.path().join("c");
        convert_to(&fixture(name), &container, QuantScheme::Mxfp4);
        placements_agree(&format!("{name} mxfp4"), &container, &reference);
    }
}

#[test]
fn an_fp8_checkpoint_streams_its_experts_as_they_are_with_identical_answers() {
    // fp8 experts read from the checkpoint through the store under a small budget (three tensor
    // reads and their block scales per expert) answer as the all-resident fp8 model does.
    let src = fixture("deepseek_v3_fp8");
    let reference = answers(&Engine::load(&src).unwrap());
    let resident = open(&src, &opts(100.0));
    same(&answers(&resident), &reference, "fp8 through the store, all resident");
    let t = resident.store_telemetry().unwrap();
    let top_k = resident.spec.moe.top_k as u64;
    drop(resident);
    // One layer's working set: every other access reads from the checkpoint again.
    let tight = open(&src, &opts((top_k * t.expert_bytes) as f64 / 1e9 * 1.000_001));
    same(&answers(&tight), &reference, "fp8 through the store, top-k experts resident");
    let tt = tight.store_telemetry().unwrap();
    assert!(tt.disk_misses > 0 && tt.capacity_experts < t.capacity_experts, "{tt:?}");
}

/// A worker whose share shrank drops the experts only the old share gave it: released pairs
/// leave RAM (and only they), a later load reads them again, and pairs not resident or not
/// experts are skipped.
#[test]
fn released_experts_leave_ram_and_are_read_again_when_asked_for() {
    let model = shimmer_coordinator::model_dir::ModelDir::open(&demo()).unwrap();
    let store = model.expert_store(&opts(1.0), 0).unwrap();
    let moe: Vec<usize> = (0..model.spec.num_layers).filter(|l| model.spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    let share: Vec<(usize, usize)> = moe.iter().flat_map(|&l| (0..3).map(move |e| (l, e))).collect();
    assert_eq!(store.load(&share).unwrap(), share.len());
    assert_eq!(store.telemetry().resident_experts, share.len());
    let old_only: Vec<(usize, usize)> = share.iter().copied().filter(|&(_, e)| e == 0).collect();
    let dense_layer = (0..model.spec.num_layers).find(|l| !moe.contains(l)).unwrap_or(usize::MAX);
    let mut asked = old_only.clone();
    asked.extend([(moe[0], 7), (dense_layer, 0)]);
    assert_eq!(store.release(&asked), old_only.len(), "only resident experts are dropped");
    assert_eq!(store.telemetry().resident_experts, share.len() - old_only.len());
    for &(l, e) in &share {
        assert_eq!(store.resident(l).unwrap()[e], e != 0, "layer {l} expert {e}");
    }
    assert_eq!(store.load(&share).unwrap(), old_only.len(), "released experts are read again");
}

/// The next layer's choice is predicted only while there is something to read ahead: a store
/// whose budget holds the whole model stops asking for it once every expert is in RAM, and asks
/// again when one leaves; a store that cannot hold the model always asks.
#[test]
fn lookahead_is_wanted_until_every_expert_is_in_ram() {
    use shimmer_experts::dispatch::ExpertDispatch;
    let model = shimmer_coordinator::model_dir::ModelDir::open(&demo()).unwrap();
    let moe: Vec<usize> = (0..model.spec.num_layers).filter(|l| model.spec.layers[*l] == shimmer_common::spec::LayerMlp::Moe).collect();
    let all: Vec<(usize, usize)> = moe.iter().flat_map(|&l| (0..model.spec.moe.num_experts).map(move |e| (l, e))).collect();
    let whole = model.expert_store(&opts(1.0), 0).unwrap();
    assert!(whole.wants_lookahead(), "nothing is in RAM yet");
    let (first, rest) = all.split_at(all.len() / 2);
    whole.load(first).unwrap();
    assert!(whole.wants_lookahead(), "half the experts are in RAM");
    whole.load(rest).unwrap();
    assert_eq!(whole.telemetry().resident_experts, all.len());
    assert!(!whole.wants_lookahead(), "every expert is in RAM");
    assert_eq!(whole.release(&all[..1]), 1);
    assert!(whole.wants_lookahead(), "an expert left RAM");
    whole.load(&all[..1]).unwrap();
    assert!(!whole.wants_lookahead());

    // Room for a third of the experts: whatever was read, some are always left to predict.
    let expert_bytes = whole.telemetry().expert_bytes as f64;
    let third = model.expert_store(&opts(expert_bytes * (all.len() / 3) as f64 / 1e9), 0).unwrap();
    third.load(&all).unwrap();
    assert!(third.telemetry().resident_experts < all.len());
    assert!(third.wants_lookahead());
    let no_prefetch = ExpertOptions { prefetch: false, ..opts(1.0) };
    let off = model.expert_store(&no_prefetch, 0).unwrap();
    assert!(!off.wants_lookahead(), "prefetch is off");
}
