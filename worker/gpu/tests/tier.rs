//! The VRAM tier's host logic on the CPU-backed device: residency under a budget, eviction,
//! pins, fallback on every kind of fault with the CPU's bits, back-off and the fault-injection
//! hook. The state machines are driven by replayed sequences with explicit time.

use std::time::{Duration, Instant};

use shimmer_experts::Expert;
use shimmer_gpu::device::GpuError;
use shimmer_gpu::fake::FakeDevice;
use shimmer_gpu::tier::{Decision, ExpertKey, Health, Residency, TierJob, VramTier};
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

fn key(layer: u32, expert: u32) -> ExpertKey {
    ExpertKey { layer, expert }
}

/// Replays a trace through `Residency`, carrying out its decisions; returns them.
fn replay(r: &mut Residency, trace: &[(u32, u64)]) -> Vec<Decision> {
    trace
        .iter()
        .map(|&(e, bytes)| {
            let d = r.request(key(0, e), bytes, 1, &[]);
            if let Decision::Admit { evict } = &d {
                for k in evict {
                    r.evicted(*k);
                }
                r.admitted(key(0, e), bytes);
            }
            assert!(r.used() <= r.budget(), "{} bytes resident over a budget of {}", r.used(), r.budget());
            d
        })
        .collect()
}

#[test]
fn residency_admits_while_there_is_room_then_only_what_is_asked_for_more_often() {
    let mut r = Residency::new(300);
    let admit = |evict: &[u32]| Decision::Admit { evict: evict.iter().map(|&e| key(0, e)).collect() };
    let trace = [(1, 100), (2, 100), (3, 100), (1, 100), (4, 100), (4, 100), (5, 200), (6, 400), (4, 100)];
    let want = vec![
        admit(&[]),
        admit(&[]),
        admit(&[]),
        Decision::Hit,
        Decision::Cpu, // 4 (asked once) does not displace 2 (asked once)
        admit(&[2]),   // asked twice now: it displaces the least recently used
        Decision::Cpu, // 5 would displace 3 and 1, asked as often as it
        Decision::Cpu, // larger than the whole budget
        Decision::Hit,
    ];
    assert_eq!(replay(&mut r, &trace), want);
    assert!(r.is_resident(key(0, 4)) && r.is_resident(key(0, 1)) && !r.is_resident(key(0, 2)));
    // An expert the same step already placed is not a victim.
    for _ in 0..5 {
        r.request(key(0, 7), 100, 1, &[]);
    }
    assert_eq!(r.request(key(0, 7), 100, 1, &[key(0, 3), key(0, 1)]), Decision::Admit { evict: vec![key(0, 4)] });
}

/// A scan over more experts than fit does not flush the ones that keep coming back (under plain
/// LRU every access of this trace would miss).
#[test]
fn a_scan_does_not_flush_the_experts_that_keep_coming_back() {
    let mut r = Residency::new(4 * 100);
    let mut trace = Vec::new();
    for round in 0..50u32 {
        trace.extend([(0, 100), (1, 100), (2, 100)]);
        trace.push((10 + round, 100)); // a one-off each round
    }
    let decisions = replay(&mut r, &trace);
    let hits = decisions.iter().filter(|d| **d == Decision::Hit).count();
    assert!(hits >= 3 * 49, "the three recurring experts hit after their first round: {hits} hits");
    assert!((0..3).all(|e| r.is_resident(key(0, e))));
}

/// With costs measured, an upload slower than the CPU over the uses the expert's frequency
/// predicts is not made; as the expert keeps coming back it becomes worth it.
#[test]
fn an_upload_must_pay_for_itself() {
    let mut r = Residency::new(1 << 20);
    r.uploaded_in(1000, 3e-3); // 3 µs a byte
    r.cpu_took(1000, 1e-3); // 1 µs a byte and row
    assert_eq!(r.request(key(0, 1), 1000, 1, &[]), Decision::Cpu, "asked once: 3 ms to upload against 1 ms on the CPU");
    assert_eq!(r.request(key(0, 1), 1000, 1, &[]), Decision::Cpu);
    assert_eq!(r.request(key(0, 1), 1000, 1, &[]), Decision::Admit { evict: vec![] }, "a third request pays for it");
    // A prefill's many rows pay for it at once.
    assert_eq!(r.request(key(0, 2), 1000, 8, &[]), Decision::Admit { evict: vec![] });
    assert!(r.costs().upload_s_per_byte.is_some() && r.costs().cpu_s_per_byte_row.is_some());
}

/// The device's own time counts: an upload pays for itself only by what the device saves per
/// use, so a device slower than this CPU gets no new experts however often they are asked for —
/// except pins; a faster one needs the uses that its saving repays the upload in.
#[test]
fn an_upload_must_pay_for_itself_on_the_devices_time_too() {
    let mut slow = Residency::new(1 << 20);
    slow.uploaded_in(1000, 1e-3); // 1 µs a byte
    slow.cpu_took(1000, 1e-3); // 1 µs a byte and row
    slow.device_took(1000, 2e-3); // 2 µs a byte and row: slower than the CPU
    slow.set_pins([key(0, 9)]);
    for _ in 0..50 {
        assert_eq!(slow.request(key(0, 1), 1000, 1, &[]), Decision::Cpu);
    }
    assert_eq!(slow.request(key(0, 9), 1000, 1, &[]), Decision::Admit { evict: vec![] }, "a pin whatever the costs");
    let mut fast = Residency::new(1 << 20);
    fast.uploaded_in(1000, 1e-3);
    fast.cpu_took(1000, 1e-3);
    fast.device_took(1000, 0.25e-3); // saves 0.75 µs a byte and row
    assert_eq!(fast.request(key(0, 1), 1000, 1, &[]), Decision::Cpu, "1 ms to upload against 0.75 ms saved");
    assert_eq!(fast.request(key(0, 1), 1000, 1, &[]), Decision::Admit { evict: vec![] }, "two uses save 1.5 ms");
    assert!(fast.costs().device_s_per_byte_row.is_some());
}

/// The tier measures the device's time per byte and row from its submissions.
#[test]
fn the_tier_measures_the_devices_time() {
    let (hidden, inter) = (32, 24);
    let all = experts(1, hidden, inter);
    let tier = VramTier::new(Box::new(FakeDevice::new(1 << 30)), 1 << 30, None);
    let rows: Vec<f32> = (0..3 * hidden).map(|i| i as f32 / 64.0 - 1.0).collect();
    step(&tier, Instant::now(), &all, &[0], &rows);
    assert!(tier.costs().device_s_per_byte_row.is_some_and(|s| s > 0.0), "{:?}", tier.costs());
}

/// A pinned expert is uploaded on its first request even where an unpinned one's upload would
/// not pay for itself: the heat it was pinned for is the evidence (the VRAM test's pins once
/// stayed on the CPU when the CPU kernels got faster).
#[test]
fn a_pinned_expert_is_uploaded_whatever_the_costs_say() {
    let mut r = Residency::new(1 << 20);
    r.uploaded_in(1000, 3e-3);
    r.cpu_took(1000, 1e-3);
    r.set_pins([key(0, 1)]);
    assert_eq!(r.request(key(0, 2), 1000, 1, &[]), Decision::Cpu, "unpinned, asked once");
    assert_eq!(r.request(key(0, 1), 1000, 1, &[]), Decision::Admit { evict: vec![] }, "pinned, asked once");
}

#[test]
fn pinned_experts_are_never_evicted() {
    let mut r = Residency::new(200);
    r.set_pins([key(1, 1), key(1, 2)]);
    for e in [1, 2] {
        assert_eq!(r.request(key(1, e), 100, 1, &[]), Decision::Admit { evict: vec![] });
        r.admitted(key(1, e), 100);
    }
    // Full of pinned experts: a newcomer stays on the CPU.
    assert_eq!(r.request(key(1, 3), 100, 1, &[]), Decision::Cpu);
    r.set_pins([key(1, 2)]);
    assert_eq!(r.request(key(1, 3), 100, 1, &[]), Decision::Admit { evict: vec![key(1, 1)] });
}

/// Warming at start uploads pins only, into room the budget has: it evicts nothing, and it is no
/// request (a warmed pin's first real request is a hit, and an unpinned expert asked for as
/// often as the warmed ones still finds them no easier to displace than before).
#[test]
fn warming_uploads_pins_into_free_room_only() {
    let mut r = Residency::new(300);
    r.set_pins([key(0, 1), key(0, 2), key(0, 3), key(0, 4)]);
    assert_eq!(r.warm(key(0, 9), 100), Decision::Cpu, "not a pin");
    assert_eq!(r.warm(key(0, 1), 400), Decision::Cpu, "larger than the budget");
    for e in 1..=3 {
        assert_eq!(r.warm(key(0, e), 100), Decision::Admit { evict: vec![] }, "pin {e}");
        r.admitted(key(0, e), 100);
    }
    assert_eq!(r.warm(key(0, 1), 100), Decision::Hit);
    assert_eq!(r.warm(key(0, 4), 100), Decision::Cpu, "full: warming makes no room");
    assert_eq!(r.used(), 300);
    assert_eq!(r.request(key(0, 2), 100, 1, &[]), Decision::Hit);
}

/// The tier's warm uploads a pinned expert without computing anything; the first step that wants
/// it finds it resident and gets the CPU's bits. Unpinned experts, and any after a fault, are not
/// warmed.
#[test]
fn a_warmed_pin_is_resident_before_its_first_step() {
    let (hidden, inter) = (32, 24);
    let all = experts(3, hidden, inter);
    let device = std::sync::Arc::new(FakeDevice::new(1 << 30));
    let tier = VramTier::new(Box::new(device.clone()), 1 << 30, None);
    tier.set_pins([key(0, 0), key(0, 1)]);
    let now = Instant::now();
    assert!(tier.warm(now, key(0, 0), &all[0]));
    assert!(!tier.warm(now, key(0, 2), &all[2]), "not a pin");
    assert!(tier.is_resident(key(0, 0)) && !tier.is_resident(key(0, 2)));
    assert_eq!(device.calls(), (1, 0), "one upload, no submission");
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 8.0 - 2.0).collect();
    let (outs, on_device) = step(&tier, now, &all, &[0], &rows);
    assert_eq!((on_device, &outs[0]), (1, &cpu(&all[0], &rows)));
    assert_eq!(tier.telemetry().vram_hits, 1, "the warmed pin was a hit");
    // A device backing off after a fault warms nothing.
    device.fail_next(GpuError::Device("VK_ERROR_UNKNOWN".into()));
    step(&tier, now, &all, &[0], &rows);
    assert!(!tier.warm(now, key(0, 1), &all[1]));
    assert!(!tier.is_resident(key(0, 1)));
}

#[test]
fn health_backs_off_doubling_to_a_ceiling_and_recovers() {
    let t0 = Instant::now();
    let mut h = Health::default();
    assert!(h.usable(t0));
    let mut now = t0;
    let mut rests = Vec::new();
    for _ in 0..12 {
        let rest = h.fault(now);
        assert!(!h.usable(now) && !h.usable(now + rest - Duration::from_millis(1)));
        assert!(h.usable(now + rest));
        rests.push(rest);
        now += rest;
    }
    assert_eq!(rests[0], Health::BASE);
    assert_eq!(rests[1], Health::BASE * 2);
    assert_eq!(rests[2], Health::BASE * 4);
    assert_eq!(*rests.last().unwrap(), Health::MAX);
    h.success();
    assert_eq!(h.faults_in_a_row(), 0);
    assert_eq!(h.fault(now), Health::BASE, "a success resets the back-off");
}

struct Rng(u64);
impl Rng {
    fn value(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
    }
}

fn experts(n: usize, hidden: usize, inter: usize) -> Vec<Expert> {
    let mut rng = Rng(7);
    let mut m = |rows: usize, cols: usize| Matrix::new(rows, cols, WeightData::F32((0..rows * cols).map(|_| rng.value()).collect()));
    (0..n).map(|_| Expert::new(m(inter, hidden), m(inter, hidden), m(hidden, inter))).collect()
}

fn cpu(expert: &Expert, rows: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len()];
    expert.forward_rows(rows, &mut Default::default(), &mut out, false);
    out
}

/// What a caller does: the tier's outputs where it has them, the CPU's otherwise.
fn step(tier: &VramTier, now: Instant, experts: &[Expert], chosen: &[u32], rows: &[f32]) -> (Vec<Vec<f32>>, usize) {
    let jobs: Vec<TierJob<'_>> = chosen.iter().map(|&e| TierJob { key: key(0, e), expert: Some(&experts[e as usize]), rows }).collect();
    let outs = tier.forward(now, &jobs);
    let on_device = outs.iter().filter(|o| o.is_some()).count();
    let full = outs.into_iter().zip(chosen).map(|(o, &e)| o.unwrap_or_else(|| cpu(&experts[e as usize], rows))).collect();
    (full, on_device)
}

#[test]
fn a_tier_under_a_small_budget_evicts_and_gives_the_cpus_bits() {
    let (hidden, inter) = (48, 40);
    let all = experts(8, hidden, inter);
    let bytes = all[0].bytes() as u64;
    // Room for three experts.
    let tier = VramTier::new(Box::new(FakeDevice::new(1 << 30)), 3 * bytes, None);
    let mut rng = Rng(9);
    let rows: Vec<f32> = (0..2 * hidden).map(|_| rng.value()).collect();
    let now = Instant::now();
    for round in 0..10u32 {
        let chosen = [round % 8, (round * 3 + 1) % 8];
        let (outs, _) = step(&tier, now, &all, &chosen, &rows);
        for (o, &e) in outs.iter().zip(&chosen) {
            assert_eq!(o, &cpu(&all[e as usize], &rows), "round {round}, expert {e}");
        }
        let c = tier.counters();
        assert!(c.resident_bytes.load(std::sync::atomic::Ordering::Relaxed) <= 3 * bytes);
    }
    let c = tier.counters();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert!(load(&c.evictions) > 0, "a three-expert budget over eight experts evicts");
    // Newcomers asked for no more often than the experts they would displace stay on the CPU.
    assert_eq!(load(&c.device_experts) + load(&c.cpu_experts), 20);
    assert!(load(&c.device_experts) >= 10 && load(&c.cpu_experts) > 0, "{:?}", tier.telemetry());
    assert_eq!(c.total_faults(), 0);
}

#[test]
fn every_fault_kind_falls_back_to_the_cpu_and_backs_off() {
    let (hidden, inter) = (32, 24);
    let all = experts(3, hidden, inter);
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 16.0 - 1.0).collect();
    let want: Vec<Vec<f32>> = all.iter().map(|e| cpu(e, &rows)).collect();
    for fault in [
        GpuError::Device("VK_ERROR_UNKNOWN".into()),
        GpuError::Timeout(Duration::from_secs(1)),
        GpuError::Lost("VK_ERROR_DEVICE_LOST".into()),
        GpuError::OutOfMemory("VK_ERROR_OUT_OF_DEVICE_MEMORY".into()),
    ] {
        let kind = fault.kind();
        let device = std::sync::Arc::new(FakeDevice::new(1 << 30));
        let tier = VramTier::new(Box::new(device.clone()), 1 << 20, None);
        let t0 = Instant::now();
        let (outs, on_device) = step(&tier, t0, &all, &[0, 1, 2], &rows);
        assert_eq!((outs, on_device), (want.clone(), 3), "{kind}: a healthy first step");
        // The next submission fails: the step still gives the CPU's bits.
        device.fail_next(fault);
        let (outs, on_device) = step(&tier, t0, &all, &[0, 1, 2], &rows);
        assert_eq!(outs, want, "{kind}: the failed step's outputs");
        assert_eq!(on_device, 0, "{kind}: nothing from a failed submission is used");
        assert_eq!(tier.counters().faults().iter().find(|(k, _)| *k == kind).map(|x| x.1), Some(1), "{kind} counted");
        // Resting: the device is not asked at all.
        let calls = device.calls();
        let (outs, on_device) = step(&tier, t0 + Health::BASE / 2, &all, &[0, 1, 2], &rows);
        assert_eq!((outs, on_device, device.calls()), (want.clone(), 0, calls), "{kind}: a resting device is left alone");
        // After the back-off it is tried again and used.
        let (outs, on_device) = step(&tier, t0 + Health::BASE, &all, &[0, 1, 2], &rows);
        assert_eq!((outs, on_device), (want.clone(), 3), "{kind}: retried after the back-off");
        if kind == "lost" {
            assert_eq!(device.calls().0, 6, "a lost device's experts are uploaded again");
        }
    }
}

#[test]
fn out_of_memory_on_upload_shrinks_the_budget_to_what_fits() {
    let (hidden, inter) = (32, 24);
    let all = experts(4, hidden, inter);
    let bytes = all[0].bytes() as u64;
    // The device holds two experts though it reports room for all and the budget says four.
    let tier = VramTier::new(Box::new(FakeDevice::new(2 * bytes + bytes / 2).reporting(1 << 30)), 4 * bytes, None);
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 8.0 - 2.0).collect();
    let (outs, on_device) = step(&tier, Instant::now(), &all, &[0, 1, 2, 3], &rows);
    assert_eq!(outs, all.iter().map(|e| cpu(e, &rows)).collect::<Vec<_>>());
    assert_eq!(on_device, 2);
    assert_eq!(tier.budget(), 2 * bytes);
    // From then on the tier evicts within what fits rather than failing.
    let (outs, on_device) = step(&tier, Instant::now(), &all, &[2, 3], &rows);
    assert_eq!((outs[1].clone(), on_device), (cpu(&all[3], &rows), 2));
}

#[test]
fn shimmer_gpu_fault_fails_every_nth_submission_with_the_same_tokens() {
    let (hidden, inter) = (32, 24);
    let all = experts(4, hidden, inter);
    let rows: Vec<f32> = (0..3 * hidden).map(|i| (i as f32 * 0.37).sin()).collect();
    let tier = VramTier::new(Box::new(FakeDevice::new(1 << 30)), 1 << 30, Some(3));
    let mut now = Instant::now();
    let mut failed = Vec::new();
    for s in 1..=9u32 {
        let (outs, on_device) = step(&tier, now, &all, &[s % 4, (s + 1) % 4], &rows);
        assert_eq!(outs[0], cpu(&all[(s % 4) as usize], &rows), "submission {s}");
        if on_device == 0 {
            failed.push(s);
        }
        now += Health::MAX; // past any back-off
    }
    assert_eq!(failed, vec![3, 6, 9], "the 3rd and every 3rd later submission fails");
    assert_eq!(tier.counters().faults().iter().find(|(k, _)| *k == "injected").map(|x| x.1), Some(3));
}

#[test]
fn experts_the_device_cannot_compute_stay_on_the_cpu_and_are_asked_once() {
    let (hidden, inter) = (32, 24);
    // MXFP4 with f32 activations (quant-eval's comparison): no GPU kernel.
    let q = |rows: usize, cols: usize| {
        Matrix::new(rows, cols, WeightData::Mxfp4 { packed: vec![0x12; rows * cols.div_ceil(2)].into(), scales: vec![127; rows * cols.div_ceil(32)].into() })
            .with_activations(shimmer_kernels::Activations::F32)
    };
    let unsupported = Expert::new(q(inter, hidden), q(inter, hidden), q(hidden, inter));
    let device = std::sync::Arc::new(FakeDevice::new(1 << 30));
    let tier = VramTier::new(Box::new(device.clone()), 1 << 30, None);
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 8.0).collect();
    for _ in 0..3 {
        let outs = tier.forward(Instant::now(), &[TierJob { key: key(2, 0), expert: Some(&unsupported), rows: &rows }]);
        assert!(outs[0].is_none());
    }
    assert_eq!(device.calls(), (0, 0), "such an expert never reaches the device");
    assert_eq!(tier.counters().total_faults(), 0, "an unsupported format is not a fault");
}

/// A job without weights runs only if its expert is resident; a resident one counts as used.
#[test]
fn jobs_without_weights_run_only_on_resident_experts() {
    let (hidden, inter) = (32, 24);
    let all = experts(2, hidden, inter);
    let tier = VramTier::new(Box::new(FakeDevice::new(1 << 30)), 1 << 30, None);
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 8.0 - 2.0).collect();
    let now = Instant::now();
    let blind = |e: u32| tier.forward(now, &[TierJob { key: key(0, e), expert: None, rows: &rows }]).remove(0);
    assert_eq!(blind(0), None, "not resident yet");
    step(&tier, now, &all, &[0], &rows);
    assert_eq!(blind(0), Some(cpu(&all[0], &rows)));
    assert_eq!(blind(1), None);
    use shimmer_experts::Accelerator;
    assert!(tier.holds(0, 0) && !tier.holds(0, 1) && !tier.holds(1, 0));
}

/// A device whose submissions wait at a gate the test opens: a submission "in flight".
struct Gated {
    inner: FakeDevice,
    /// (submissions waiting at the gate, gate open)
    gate: std::sync::Mutex<(usize, bool)>,
    changed: std::sync::Condvar,
}

use shimmer_gpu::device::Device;

impl Device for Gated {
    fn name(&self) -> String {
        "gated".into()
    }
    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }
    fn upload(&self, image: &shimmer_gpu::device::ExpertImage) -> Result<shimmer_gpu::DeviceExpert, GpuError> {
        self.inner.upload(image)
    }
    fn release(&self, expert: shimmer_gpu::DeviceExpert) {
        self.inner.release(expert)
    }
    fn forward(&self, jobs: &[shimmer_gpu::device::Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut g = self.gate.lock().unwrap();
        g.0 += 1;
        self.changed.notify_all();
        while !g.1 {
            g = self.changed.wait(g).unwrap();
        }
        drop(g);
        self.inner.forward(jobs)
    }
}

/// A submission runs with the tier's lock released: while one is in flight another thread's
/// experts are placed (here: left on the CPU at once, since the only room is the in-flight
/// expert's, which must not be evicted), and the in-flight one still returns the CPU's bits.
#[test]
fn a_submission_in_flight_leaves_the_tier_to_other_threads_and_keeps_its_experts() {
    let (hidden, inter) = (32, 24);
    let all = experts(2, hidden, inter);
    let bytes = all[0].bytes() as u64;
    let device = std::sync::Arc::new(Gated { inner: FakeDevice::new(1 << 30), gate: Default::default(), changed: Default::default() });
    // Room for one expert; expert 0 resident first (the gate open for its upload's step).
    let tier = VramTier::new(Box::new(device.clone()), bytes, None);
    let rows: Vec<f32> = (0..hidden).map(|i| i as f32 / 8.0 - 2.0).collect();
    let now = Instant::now();
    device.gate.lock().unwrap().1 = true;
    step(&tier, now, &all, &[0], &rows);
    assert!(tier.is_resident(key(0, 0)));
    device.gate.lock().unwrap().1 = false;
    std::thread::scope(|s| {
        let in_flight = s.spawn(|| tier.forward(now, &[TierJob { key: key(0, 0), expert: None, rows: &rows }]));
        {
            let mut g = device.gate.lock().unwrap();
            while g.0 < 2 {
                g = device.changed.wait(g).unwrap();
            }
        }
        // Expert 1, asked for often enough to displace expert 0 if it were idle — on a thread
        // of its own, so that a tier holding its lock through the submission fails the test
        // instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        let (tier, all, rows) = (&tier, &all, &rows);
        s.spawn(move || {
            let got: Vec<_> = (0..8).map(|_| tier.forward(now, &[TierJob { key: key(0, 1), expert: Some(&all[1]), rows }])).collect();
            let _ = tx.send((got, tier.is_resident(key(0, 0))));
        });
        let placed = rx.recv_timeout(Duration::from_secs(30));
        {
            let mut g = device.gate.lock().unwrap();
            g.1 = true;
            device.changed.notify_all();
        }
        let (got, kept) = placed.expect("another thread's experts were placed while a submission was in flight");
        assert!(got.iter().all(|g| *g == vec![None]), "the only room is in flight: the CPU computes expert 1");
        assert!(kept, "an expert in flight is not evicted");
        assert_eq!(in_flight.join().unwrap(), vec![Some(cpu(&all[0], rows))]);
    });
    // Once it is done, expert 1 (asked for more often) displaces it.
    assert_eq!(tier.forward(now, &[TierJob { key: key(0, 1), expert: Some(&all[1]), rows: &rows }]), vec![Some(cpu(&all[1], &rows))]);
    assert!(!tier.is_resident(key(0, 0)));
}

/// Several devices: each expert belongs to one (a layer's experts dealt out in turn), each
/// device holds at most its own budget, the tier computes each device's share and gives the
/// CPU's bits; a fault on one device backs off that device only.
#[test]
fn several_devices_share_a_layers_experts_and_fail_alone() {
    let (hidden, inter) = (32, 24);
    let all = experts(6, hidden, inter);
    let bytes = all[0].bytes() as u64;
    let devices: Vec<std::sync::Arc<FakeDevice>> = (0..2).map(|_| std::sync::Arc::new(FakeDevice::new(1 << 30))).collect();
    let tier = VramTier::on_devices(devices.iter().map(|d| (Box::new(d.clone()) as Box<dyn shimmer_gpu::Device>, 2 * bytes)).collect(), None);
    assert_eq!((tier.devices(), tier.budget()), (2, 4 * bytes));
    assert_eq!((tier.owner(key(0, 0)), tier.owner(key(0, 1)), tier.owner(key(1, 0))), (0, 1, 1), "dealt out, each layer one further on");
    let rows: Vec<f32> = (0..2 * hidden).map(|i| i as f32 / 32.0 - 1.0).collect();
    let now = Instant::now();
    let chosen = [0, 1, 2, 3];
    let (outs, on_device) = step(&tier, now, &all, &chosen, &rows);
    for (o, &e) in outs.iter().zip(&chosen) {
        assert_eq!(o, &cpu(&all[e as usize], &rows), "expert {e}");
    }
    assert_eq!(on_device, 4, "two experts on each device");
    for (d, device) in devices.iter().enumerate() {
        assert_eq!(device.resident().0, 2, "device {d} holds its own two");
        assert_eq!(device.calls().1, 1, "device {d}: one submission");
    }
    assert_eq!(tier.telemetry().resident_experts, 4);
    // Device 1 fails its next submission: its experts go back to the CPU and it rests; device 0
    // goes on computing its own.
    devices[1].fail_next(GpuError::Device("VK_ERROR_UNKNOWN".into()));
    let (outs, on_device) = step(&tier, now, &all, &chosen, &rows);
    assert_eq!(on_device, 2);
    for (o, &e) in outs.iter().zip(&chosen) {
        assert_eq!(o, &cpu(&all[e as usize], &rows), "expert {e} after the fault");
    }
    let (_, on_device) = step(&tier, now, &all, &chosen, &rows);
    assert_eq!(on_device, 2, "device 1 backs off; device 0 does not");
    assert_eq!(tier.counters().total_faults(), 1);
}
