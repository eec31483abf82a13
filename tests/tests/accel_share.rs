//! A layer split between VRAM and RAM: the accelerator's share runs on its own thread while the
//! CPU computes the experts in RAM and those read from disk (`shimmer-store`'s `offload`), with
//! the bits of the CPU alone — also when the device fails a submission made beside the CPU's. On the
//! CPU-backed device, so it runs on every machine; `tests/vram.rs` runs the same splits on a
//! real Vulkan driver.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use shimmer_coordinator::engine::{Engine, ExpertOptions, RamBudget, UsageFile};
use shimmer_gpu::device::{Device, ExpertImage, GpuError, Job};
use shimmer_gpu::fake::FakeDevice;
use shimmer_gpu::{DeviceExpert, VramTier};
use shimmer_tests::{assert_same_answers, logits_and_greedy};

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo")
}

/// The fake device, counting the submissions made from the store's accelerator thread, and
/// failing the first of them when told to.
struct Counting {
    inner: FakeDevice,
    from_share_thread: AtomicU64,
    all: AtomicU64,
    fail_first_share: bool,
}

impl Device for Counting {
    fn name(&self) -> String {
        "counting fake".into()
    }
    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }
    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        self.inner.upload(image)
    }
    fn release(&self, expert: DeviceExpert) {
        self.inner.release(expert)
    }
    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.all.fetch_add(1, Ordering::Relaxed);
        if std::thread::current().name() == Some("accel-share") && self.from_share_thread.fetch_add(1, Ordering::Relaxed) == 0 && self.fail_first_share {
            return Err(GpuError::Device("VK_ERROR_UNKNOWN (the test's)".into()));
        }
        self.inner.forward(jobs)
    }
}

#[test]
fn the_accelerators_share_of_a_layer_overlaps_the_cpus_with_the_same_bits() {
    let dir = demo();
    let spec = shimmer_common::ModelSpec::from_dir(&dir).unwrap();
    let e = shimmer_store::expert_bytes_of(&dir, &spec).unwrap();
    let moe = spec.layers.iter().filter(|k| **k == shimmer_common::spec::LayerMlp::Moe).count() as u64;
    let open = |ram: Option<f64>, vram: Option<Arc<VramTier>>| {
        let opts = ExpertOptions { ram: ram.map(RamBudget::Gb), usage: UsageFile::Off, vram, ..ExpertOptions::default() };
        Engine::open(&dir, &opts).unwrap()
    };
    let want = logits_and_greedy(&open(None, None));
    // A store holding 40 % of the experts in RAM (the rest read from disk), and VRAM for two
    // experts a layer: most layers' experts are split three ways.
    let ram = (moe * spec.moe.num_experts as u64 * 2 / 5) as f64 * e as f64 / 1e9;
    for fail_first_share in [false, true] {
        let device = Arc::new(Counting { inner: FakeDevice::new(1 << 30), from_share_thread: AtomicU64::new(0), all: AtomicU64::new(0), fail_first_share });
        let tier = Arc::new(VramTier::new(Box::new(device.clone()), 2 * moe * e, None));
        let got = logits_and_greedy(&open(Some(ram), Some(tier.clone())));
        let what = if fail_first_share { "the first overlapped submission failing" } else { "no faults" };
        assert_same_answers(&got, &want, &format!("VRAM, RAM and disk, {what}"));
        let g = tier.telemetry();
        let (shared, all) = (device.from_share_thread.load(Ordering::Relaxed), device.all.load(Ordering::Relaxed));
        assert!(g.device_experts > 0 && g.cpu_experts > 0, "{what}: split between the device and the CPU: {g:?}");
        assert!(shared > 0 && shared <= all, "{what}: the share ran beside the CPU's: {shared} of {all} submissions ({g:?})");
        let faults = g.faults.iter().find(|f| f.0 == "device").map_or(0, |f| f.1);
        assert_eq!(faults, u64::from(fail_first_share), "{what}: {g:?}");
    }
}
