//! The VRAM tier on a real Vulkan driver (Mesa's lavapipe in the test command): placement may
//! change speed, never the model. Every logit bit and every greedy token are the same with the
//! experts on the CPU, all in VRAM, or split across VRAM, RAM and disk at budgets down to a few
//! experts; with faults injected into the GPU's submissions; and through the `shimmer` binary's
//! `--gpu vulkan --vram-gb`. Each case also checks that the GPU did compute experts, so a tier
//! that silently fell back to the CPU cannot pass.
#![cfg(feature = "vulkan")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shimmer_coordinator::engine::{Engine, ExpertOptions, RamBudget, UsageFile};
use shimmer_gpu::vulkan::VulkanDevice;
use shimmer_gpu::VramTier;
use shimmer_tests::{assert_same_answers as same, fixture, fixtures, logits_and_greedy as answers, shimmer};

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo")
}

fn tier(budget: u64, fault_every: Option<u64>) -> Arc<VramTier> {
    let device = VulkanDevice::open().unwrap_or_else(|e| panic!("no usable Vulkan device ({e}); the test command installs mesa-vulkan-drivers"));
    Arc::new(VramTier::new(Box::new(device), budget, fault_every))
}

fn open(dir: &Path, ram: Option<f64>, vram: Option<Arc<VramTier>>) -> Engine {
    let opts = ExpertOptions { ram: ram.map(RamBudget::Gb), usage: UsageFile::Off, vram, ..ExpertOptions::default() };
    Engine::open(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// One expert's bytes in this model (as the CPU holds them).
fn expert_bytes(dir: &Path) -> u64 {
    let spec = shimmer_common::ModelSpec::from_dir(dir).unwrap();
    shimmer_store::expert_bytes_of(dir, &spec).unwrap()
}

/// Every oracle fixture as it is published (f32 and bf16 checkpoints) and the demo: the CPU's
/// answers with every expert in VRAM, with three experts' worth of VRAM (eviction on every
/// layer), and with three in VRAM over a store holding a fraction in RAM (the rest from disk).
/// gpt-oss's experts (biases, clamped SwiGLU) have no GPU kernel yet: the tier must leave every
/// one of them to the CPU, with the same bits (docs/gpu.md, "Not yet").
#[test]
fn vram_ram_and_disk_splits_give_the_cpus_bits() {
    let mut models: Vec<PathBuf> = fixtures().into_iter().map(fixture).collect();
    models.push(demo());
    for dir in models {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let want = answers(&open(&dir, None, None));
        let e = expert_bytes(&dir);
        let cases: [(&str, Option<f64>, u64); 3] =
            [("all in VRAM", None, 1 << 40), ("three experts in VRAM", None, 3 * e), ("three in VRAM, a store with 40 % in RAM", Some(0.0), 3 * e)];
        for (what, ram, budget) in cases {
            let t = tier(budget, None);
            // The store's budget: enough for a few layers' working sets, far from all experts.
            let ram = ram.map(|_| {
                let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
                let moe = spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() as f64;
                (moe * spec.moe.num_experts as f64 * 0.4).max(spec.moe.top_k as f64 + 1.0) * e as f64 / 1e9
            });
            let got = answers(&open(&dir, ram, Some(t.clone())));
            same(&got, &want, &format!("{name}: {what}"));
            let g = t.telemetry();
            assert_eq!(g.faults.iter().map(|f| f.1).sum::<u64>(), 0, "{name}: {what}: {g:?}");
            let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
            // Whatever `ExpertImage::of` refuses is left to the CPU, as gpt-oss's experts are.
            let layer = spec.layers.iter().position(|k| *k == shimmer_common::spec::LayerMlp::Moe).unwrap();
            let ckpt = shimmer_common::Checkpoint::open(&dir).unwrap();
            let expert = shimmer_experts::weights::load_expert(&ckpt, &spec, layer, 0).unwrap();
            let no_kernel = shimmer_gpu::device::ExpertImage::of(&expert).is_err();
            if no_kernel || spec.moe.expert_bias || spec.moe.activation != shimmer_common::spec::ExpertActivation::Silu {
                assert!(g.device_experts == 0 && g.resident_bytes == 0 && g.cpu_experts > 0, "{name}: {what}: declined experts ({g:?})");
                continue;
            }
            assert!(g.device_experts > 0, "{name}: {what}: the GPU computed no expert ({g:?})");
            if budget < (1 << 40) {
                // Constrained: experts were evicted for others, or left on the CPU (which depends
                // on measured costs and frequencies; the policy's own tests are in shimmer-gpu).
                assert!((g.evictions > 0 || g.cpu_experts > 0) && g.resident_bytes <= budget, "{name}: {what}: a three-expert budget ({g:?})");
            }
        }
    }
}

/// Two devices (two instances of the driver here): a layer's experts dealt out over both, the
/// CPU's bits with the experts split across the two devices, RAM and disk, and both devices
/// hold experts.
#[test]
fn two_devices_share_the_experts_with_the_cpus_bits() {
    let dir = demo();
    let want = answers(&open(&dir, None, None));
    let e = expert_bytes(&dir);
    let device = || Box::new(VulkanDevice::open().unwrap_or_else(|e| panic!("no usable Vulkan device ({e})"))) as Box<dyn shimmer_gpu::Device>;
    let t = Arc::new(VramTier::on_devices(vec![(device(), 6 * e), (device(), 6 * e)], None));
    let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
    let moe = spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() as f64;
    let ram = (moe * spec.moe.num_experts as f64 * 0.4) * e as f64 / 1e9;
    let got = answers(&open(&dir, Some(ram), Some(t.clone())));
    same(&got, &want, "two devices, RAM and disk");
    let g = t.telemetry();
    assert!(g.device_experts > 0 && g.resident_bytes <= 12 * e, "{g:?}");
    let mut owners = std::collections::BTreeSet::new();
    for (layer, kind) in spec.layers.iter().enumerate() {
        if *kind == shimmer_common::spec::LayerMlp::Moe {
            for (expert, held) in t.resident_in_layer(layer, spec.moe.num_experts).into_iter().enumerate() {
                if held {
                    owners.insert(t.owner(shimmer_gpu::ExpertKey { layer: layer as u32, expert: expert as u32 }));
                }
            }
        }
    }
    assert_eq!(owners.into_iter().collect::<Vec<_>>(), vec![0, 1], "both devices hold experts ({g:?})");
}

/// `SHIMMER_GPU_FAULT`-style injection (every 2nd submission fails) and an expert budget that
/// forces uploads: the failed submissions are recomputed on the CPU with the same bits.
#[test]
fn injected_faults_change_no_bit() {
    for dir in [fixture("qwen3_moe"), demo()] {
        let want = answers(&open(&dir, None, None));
        let t = tier(4 * expert_bytes(&dir), Some(2));
        let got = answers(&open(&dir, None, Some(t.clone())));
        same(&got, &want, &format!("{}: every 2nd submission failing", dir.display()));
        let g = t.telemetry();
        let injected = g.faults.iter().find(|f| f.0 == "injected").map_or(0, |f| f.1);
        assert!(injected > 0 && g.device_experts > 0, "{g:?}");
    }
}

fn output_ids(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "shimmer failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    v["output_ids"].clone()
}

/// The binary: `shimmer generate --gpu vulkan --vram-gb X` gives the CPU's tokens on the demo,
/// all in VRAM and split across VRAM, RAM and disk, with faults injected too; the GPU computed
/// experts (its telemetry in --json says so).
#[test]
fn shimmer_generate_on_vulkan_gives_the_cpus_tokens() {
    let demo = demo();
    let d = demo.to_str().unwrap();
    let base = ["generate", "--model", d, "--prompt", "The Duke of", "--max-tokens", "16", "--temperature", "0", "--json", "--no-usage"];
    let want = output_ids(&shimmer(&[&base[..], &["--gpu", "none"]].concat()));
    let e_gb = expert_bytes(&demo) as f64 / 1e9;
    let few = format!("{}", 3.0 * e_gb);
    let ram = format!("{}", 40.0 * e_gb);
    let cases: Vec<Vec<&str>> =
        vec![vec!["--gpu", "vulkan"], vec!["--gpu", "vulkan", "--vram-gb", &few], vec!["--gpu", "vulkan", "--vram-gb", &few, "--ram-gb", &ram]];
    for extra in &cases {
        let out = shimmer(&[&base[..], extra].concat());
        assert_eq!(output_ids(&out), want, "{extra:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let vram = &v["timings"]["store"]["vram"];
        assert!(vram["device_experts"].as_u64().unwrap_or(0) > 0, "{extra:?}: the GPU computed no expert: {vram}");
    }
    let out = shimmer_tests::output_within(
        std::process::Command::new(shimmer_tests::shimmer_bin()).args([&base[..], &cases[1]].concat()).env("SHIMMER_GPU_FAULT", "3"),
        shimmer_tests::COMMAND_LIMIT,
    );
    assert_eq!(output_ids(&out), want, "SHIMMER_GPU_FAULT=3");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let faults = &v["timings"]["store"]["vram"]["faults"];
    assert!(faults.as_array().unwrap().iter().any(|f| f[0] == "injected" && f[1].as_u64().unwrap() > 0), "{faults}");
}

/// Bad GPU flags fail with a message naming the flag.
#[test]
fn bad_gpu_flags_are_named() {
    let demo = demo();
    let d = demo.to_str().unwrap();
    let out = shimmer(&["generate", "--model", d, "--prompt", "x", "--max-tokens", "1", "--gpu", "metal"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--gpu") && stderr.contains("unknown GPU backend `metal`"), "{stderr}");
    let out = shimmer(&["generate", "--model", d, "--prompt", "x", "--max-tokens", "1", "--gpu", "vulkan", "--vram-gb", "0"]);
    shimmer_tests::assert_clean_failure(&out, &["--vram-gb"]);
    let out = shimmer_tests::output_within(
        std::process::Command::new(shimmer_tests::shimmer_bin())
            .args(["generate", "--model", d, "--prompt", "x", "--max-tokens", "1", "--gpu", "vulkan"])
            .env("SHIMMER_GPU_FAULT", "zero"),
        shimmer_tests::COMMAND_LIMIT,
    );
    shimmer_tests::assert_clean_failure(&out, &["SHIMMER_GPU_FAULT"]);
    let out = shimmer(&["generate", "--model", d, "--prompt", "x", "--max-tokens", "1", "--gpu", "cuda"]);
    // Built with the CUDA backend (the test command builds it in) on a machine without a driver:
    // it says so; built without, it says that.
    let why = if cfg!(feature = "cuda") { "no CUDA driver" } else { "built without CUDA" };
    shimmer_tests::assert_clean_failure(&out, &["--gpu cuda", why]);
}

/// The demo's converted containers (int4-g32, int8 per row, MXFP4: integer products on the GPU,
/// their activations quantised by the CPU's own quantiser) give the CPU's bits with every expert
/// in VRAM and with three experts' worth over a store holding a fraction in RAM.
#[test]
fn the_demos_quantised_containers_give_the_cpus_bits_on_the_gpu() {
    use shimmer_common::quant::QuantScheme;
    use shimmer_store::convert::{convert, ConvertOptions, DenseQuant};
    for scheme in [QuantScheme::Int4 { group: 32 }, QuantScheme::Int8PerRow, QuantScheme::Mxfp4] {
        let dir = tempfile::tempdir().unwrap();
        convert(&demo(), dir.path(), ConvertOptions { expert_quant: scheme, dense_quant: DenseQuant::Bf16, head_quant: None }, &mut |_| {}).unwrap();
        let want = answers(&open(dir.path(), None, None));
        let e = expert_bytes(dir.path());
        for (what, ram, budget) in [("all in VRAM", None, 1u64 << 40), ("three in VRAM, 40 experts in RAM", Some(40.0 * e as f64 / 1e9), 3 * e)] {
            let t = tier(budget, None);
            let got = answers(&open(dir.path(), ram, Some(t.clone())));
            same(&got, &want, &format!("demo {scheme:?}: {what}"));
            let g = t.telemetry();
            assert!(g.device_experts > 0, "demo {scheme:?}: {what}: {g:?}");
            if budget == 1 << 40 {
                assert_eq!(g.cpu_experts, 0, "demo {scheme:?}: every expert has a GPU kernel: {g:?}");
            }
        }
    }
}

/// The tiers learned from routing heat: with a usage file, the hottest experts of each layer are
/// pinned in VRAM (as many as half its budget holds) and the next ones in RAM; a second run keeps
/// every pinned expert resident in VRAM although the budget is small — uploaded at start, before
/// the first step — with the CPU's bits.
#[test]
fn learned_heat_pins_the_hottest_experts_in_vram() {
    let dir = demo();
    let work = tempfile::tempdir().unwrap();
    let usage = work.path().join("usage.json");
    let e = expert_bytes(&dir);
    let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
    let moe = spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() as u64;
    let store = |vram: Option<Arc<VramTier>>| {
        let opts = ExpertOptions {
            ram: Some(RamBudget::Gb(16.0 * moe as f64 * e as f64 / 1e9)),
            usage: UsageFile::File(usage.clone()),
            vram,
            ..ExpertOptions::default()
        };
        Engine::open(&dir, &opts).unwrap()
    };
    // A first run learns the heat (saved at the end of the turn).
    let cold = store(None);
    let want = answers(&cold);
    cold.end_turn();
    drop(cold);
    let ram_pins_alone = store(None).store_telemetry().unwrap().pinned_experts;
    // Room for 4 experts per layer: 2 per layer pinned (half the budget), 2 for the rest.
    let t = tier(4 * moe * e, None);
    let warm = store(Some(t.clone()));
    let pins = t.pins();
    assert_eq!(pins.len() as u64, 2 * moe, "two of each layer's hottest experts are VRAM's: {pins:?}");
    // The pins are uploaded at start, before any step wants them.
    let start = std::time::Instant::now();
    while !pins.iter().all(|k| t.is_resident(*k)) {
        assert!(start.elapsed() < std::time::Duration::from_secs(120), "VRAM pins not warmed at start: {:?}", t.telemetry());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let g = t.telemetry();
    assert_eq!((g.uploads, g.device_experts + g.cpu_experts), (pins.len() as u64, 0), "warmed, nothing computed yet: {g:?}");
    let ram_pins = warm.store_telemetry().unwrap().pinned_experts;
    // As many in RAM as without a GPU (the demo's prompt used enough experts per layer), but
    // the next ones by heat: the hottest are VRAM's.
    assert!(ram_pins == ram_pins_alone && ram_pins > 0, "RAM pins the next ones: {ram_pins} (alone {ram_pins_alone})");
    same(&answers(&warm), &want, "VRAM pins from heat");
    for k in &pins {
        assert!(t.is_resident(*k), "pinned {k:?} was evicted or never used");
    }
    let g = t.telemetry();
    assert!(g.evictions > 0 || g.cpu_experts > 0, "the unpinned half was contended: {g:?}");
}

/// A `shimmer worker --gpu vulkan` serves a coordinator the single box's tokens, computing its
/// experts on the GPU; its /metrics carries the VRAM tier's series.
#[test]
fn a_worker_computing_on_its_gpu_serves_the_single_box_tokens() {
    const TOKEN: &str = "vram-test-token-0123456789abcdef";
    let demo = demo();
    let d = demo.to_str().unwrap();
    let mut child = std::process::Command::new(shimmer_tests::shimmer_bin())
        .args(["worker", "--model", d, "--no-usage", "--listen", "127.0.0.2:0", "--http-listen", "127.0.0.2:0", "--join-token", TOKEN, "--gpu", "vulkan"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = shimmer_tests::StderrLines::of(&mut child);
    let seen = lines.until(shimmer_tests::COMMAND_LIMIT, |l| l.contains("metrics on http://")).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!("the worker did not start: {e}")
    });
    let find = |needle: &str| seen.iter().find(|l| l.contains(needle)).cloned().unwrap_or_else(|| panic!("no `{needle}` line in {seen:?}"));
    let serving = find("worker serving");
    let addr = serving[serving.find(" on ").unwrap() + 4..].split_whitespace().next().unwrap().to_string();
    assert!(find("VRAM tier").contains("llvmpipe"), "{seen:?}");
    let http = find("metrics on http://");
    let http = http[http.find("http://").unwrap()..].trim().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let placement = tmp.path().join("placement.json");
    let p = shimmer(&["plan", "--model", d, "--workers", &addr, "--out", placement.to_str().unwrap()]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let args = ["generate", "--model", d, "--prompt-ids", "1,5,9,2,7", "--max-tokens", "12", "--json", "--gpu", "none"];
    let single = output_ids(&shimmer(&args));
    let cluster = output_ids(&shimmer(&[&args[..], &["--placement", placement.to_str().unwrap(), "--join-token", TOKEN]].concat()));
    assert_eq!(cluster, single, "the GPU worker's tokens");
    let text = http_get(http.trim_start_matches("http://"), "/metrics");
    let value = |name: &str| text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().last()).and_then(|v| v.parse::<f64>().ok());
    assert!(value("shimmer_vram_uploads_total").is_some_and(|v| v > 0.0), "{text}");
    assert!(text.contains("shimmer_gpu_faults_total{kind=\"injected\"} 0"), "{text}");
    let _ = child.kill();
    let _ = child.wait();
}

/// The body of `GET path` from `host:port` (HTTP/1.0, no client library needed).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or(response)
}

/// `shimmer doctor --gpu vulkan` opens the device, self-tests it and compares every weight format
/// with the CPU: all the same bits on lavapipe.
#[test]
fn doctor_checks_every_format_on_the_gpu() {
    let out = shimmer(&["doctor", "--json", "--disk-probe-mb", "0", "--gpu", "vulkan"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = &v["gpu_check"];
    assert!(check["device"].as_str().unwrap_or("").contains("llvmpipe"), "{check}");
    let formats = check["formats"].as_array().unwrap();
    let names: Vec<&str> = formats.iter().map(|f| f["format"].as_str().unwrap_or("")).collect();
    assert_eq!(names, ["f32", "bf16", "f16", "fp8-b128", "fp8-r16", "int8", "int4-g32", "int4-g64", "int4-g128", "mxfp4"], "{check}");
    for f in formats {
        assert!(f["differing"] == 0 && f["detail"].is_null() && f["outputs"].as_u64().unwrap() > 0, "{f}");
    }
    assert!(v["recommendations"].as_array().unwrap().iter().any(|r| r.as_str().unwrap().starts_with("--gpu vulkan --vram-gb")), "{v}");
}
