//! The Vulkan backend on a real driver (Mesa's lavapipe in the test command): every weight format
//! it computes (f32, bf16, f16, fp8 with block scales; int8, int4 g32/g64/g128 and MXFP4 with
//! integer products) and
//! every batch shape give the CPU's bits, through mapped and staged uploads,
//! over several arenas, with experts released and their ranges reused.
#![cfg(feature = "vulkan")]

use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
use shimmer_experts::Expert;
use shimmer_gpu::device::{Device, ExpertImage, Job};
use shimmer_gpu::vulkan::{Fma, Options, VulkanDevice};
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Mostly ordinary values, with the ones a device gets wrong: exact-product fma cases,
    /// subnormals, signed zeros.
    fn value(&mut self) -> f32 {
        let r = self.next();
        match r % 23 {
            0 => 1.0 + 2f32.powi(-12),
            1 => -0.0,
            2 => f32::from_bits((r >> 32) as u32 & 0x007f_ffff | 1),
            _ => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Format {
    F32,
    Bf16,
    F16,
    Int8,
    Int4(usize),
    Mxfp4,
    /// fp8 in square `block × block` tiles (DeepSeek's).
    Fp8(usize),
    /// fp8 with one scale per group of a row (Inkling's MXFP8 and NVFP4 experts as held).
    Fp8Rows(usize),
}

fn matrix(rng: &mut Rng, rows: usize, cols: usize, format: Format) -> Matrix {
    let n = rows * cols;
    let data = match format {
        Format::F32 => WeightData::F32((0..n).map(|_| rng.value()).collect()),
        // Every bit pattern but NaNs and infinities, subnormals included.
        Format::Bf16 => WeightData::Bf16((0..n).map(|_| (rng.value().to_bits() >> 16) as u16).collect()),
        Format::Int8 => return Matrix::from_quant(quantize_int8(&floats(rng, n), rows, cols)),
        Format::Int4(group) => return Matrix::from_quant(quantize_int4(&floats(rng, n), rows, cols, group)),
        Format::Mxfp4 => return Matrix::from_quant(quantize_mxfp4(&floats(rng, n), rows, cols)),
        // Every fp8 byte but the two NaNs, subnormals included; scales of all sizes.
        Format::Fp8(block) | Format::Fp8Rows(block) => {
            let row_block = if matches!(format, Format::Fp8Rows(_)) { 1 } else { block };
            WeightData::Fp8 {
                q: (0..n).map(|_| (rng.next() as u8) & !if rng.next().is_multiple_of(2) { 0x01 } else { 0x04 }).collect(),
                scales: (0..rows.div_ceil(row_block) * cols.div_ceil(block)).map(|_| rng.value().abs() * 0.02 + 1e-3).collect(),
                block,
                row_block,
            }
        }
        Format::F16 => WeightData::F16(
            (0..n)
                .map(|_| {
                    let b = rng.next() as u16;
                    // Exponent 31 is inf/NaN: keep the values finite, subnormal halves included.
                    if (b >> 10) & 0x1f == 0x1f {
                        b & !0x4000
                    } else {
                        b
                    }
                })
                .collect(),
        ),
    };
    Matrix::new(rows, cols, data)
}

/// Ordinary weights with a few zeros and outliers (the integer formats' scales follow the
/// outliers; zero groups give zero scales).
fn floats(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match rng.next() % 37 {
            0 => 3.0,
            1 => 0.0,
            _ if i % 97 < 32 && i % 5 == 0 => 0.0,
            _ => rng.value(),
        })
        .collect()
}

fn expert(rng: &mut Rng, hidden: usize, inter: usize, format: Format) -> Expert {
    Expert::new(matrix(rng, inter, hidden, format), matrix(rng, inter, hidden, format), matrix(rng, hidden, inter, format))
}

fn cpu(expert: &Expert, rows: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len()];
    expert.forward_rows(rows, &mut Default::default(), &mut out, false);
    out
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: output {i} is {g:e} ({:#010x}) on the device, {w:e} ({:#010x}) on the CPU",
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn open(options: Options) -> VulkanDevice {
    match VulkanDevice::open_with(&options) {
        Ok(d) => d,
        Err(e) => panic!("no usable Vulkan device ({e}); the test command installs mesa-vulkan-drivers (lavapipe)"),
    }
}

/// Every format, several shapes (lengths that are and are not multiples of the 64 lanes), every
/// batch size from one row up, and several experts of mixed formats in one submission.
fn check_device(device: &VulkanDevice, seed: u64) {
    let mut rng = Rng(seed);
    let shapes = [(64usize, 128usize), (80, 72), (200, 130), (1, 3), (96, 1)];
    let formats = [
        Format::F32,
        Format::Bf16,
        Format::F16,
        Format::Int8,
        Format::Int4(32),
        Format::Int4(64),
        Format::Int4(128),
        Format::Mxfp4,
        Format::Fp8(16),
        Format::Fp8(128),
        Format::Fp8Rows(16),
        Format::Fp8Rows(32),
    ];
    let mut experts = Vec::new();
    for &(h, i) in &shapes {
        for &f in &formats {
            experts.push((expert(&mut rng, h, i, f), f));
        }
    }
    let resident: Vec<_> = experts.iter().map(|(e, _)| device.upload(&ExpertImage::of(e).unwrap()).unwrap()).collect();
    for n in [1usize, 2, 3, 5, 17] {
        let rows: Vec<Vec<f32>> = experts.iter().map(|(e, _)| (0..n * e.down.rows).map(|_| rng.value() * 8.0).collect()).collect();
        let jobs: Vec<Job<'_>> = resident.iter().zip(&rows).map(|(r, x)| Job { expert: r, rows: x }).collect();
        let got = device.forward(&jobs).unwrap();
        for (((e, f), x), g) in experts.iter().zip(&rows).zip(&got) {
            assert_same_bits(g, &cpu(e, x), &format!("{f:?} expert {}×{}, {n} rows", e.down.rows, e.gate.rows));
        }
    }
    // One job at a time, too (a submission of one expert).
    for ((e, f), r) in experts.iter().zip(&resident) {
        // Blocks of zeros (a zero scale) and outliers (the rest of their block quantises to 0).
        let x: Vec<f32> = (0..4 * e.down.rows)
            .map(|i| {
                if i < 40 {
                    0.0
                } else if i % 53 == 0 {
                    1e3
                } else {
                    rng.value()
                }
            })
            .collect();
        let got = device.forward(&[Job { expert: r, rows: &x }]).unwrap();
        assert_same_bits(&got[0], &cpu(e, &x), &format!("{f:?} alone"));
    }
    for r in resident {
        device.release(r);
    }
}

#[test]
fn every_format_and_batch_shape_gives_the_cpus_bits() {
    let device = open(Options::default());
    eprintln!("device: {} ({} bytes of device memory)", device.name(), device.memory_bytes());
    check_device(&device, 1);
}

/// Uploads through a staging buffer (the path of a discrete GPU without resizable BAR), into
/// arenas so small that the experts spread over many: the same bits.
#[test]
fn staged_uploads_over_many_arenas_give_the_same_bits() {
    let device = open(Options { force_staging: true, arena_bytes: 384 << 10, ..Options::default() });
    check_device(&device, 2);
}

/// Releasing experts frees their ranges for others; what is resident stays correct.
#[test]
fn released_ranges_are_reused_without_disturbing_residents() {
    let device = open(Options { arena_bytes: 256 << 10, ..Options::default() });
    let mut rng = Rng(3);
    let keep = expert(&mut rng, 100, 120, Format::F32);
    let keep_resident = device.upload(&ExpertImage::of(&keep).unwrap()).unwrap();
    for round in 0..20 {
        let e = expert(&mut rng, 90 + round, 110, if round % 2 == 0 { Format::Bf16 } else { Format::F16 });
        let r = device.upload(&ExpertImage::of(&e).unwrap()).unwrap();
        let x: Vec<f32> = (0..3 * 100).map(|_| rng.value()).collect();
        let xe: Vec<f32> = (0..2 * e.down.rows).map(|_| rng.value()).collect();
        let got = device.forward(&[Job { expert: &keep_resident, rows: &x }, Job { expert: &r, rows: &xe }]).unwrap();
        assert_same_bits(&got[0], &cpu(&keep, &x), &format!("resident expert, round {round}"));
        assert_same_bits(&got[1], &cpu(&e, &xe), &format!("new expert, round {round}"));
        device.release(r);
    }
    device.release(keep_resident);
}

/// An expert larger than an arena is refused by name, and the device stays usable.
#[test]
fn an_expert_larger_than_an_arena_is_refused() {
    let device = open(Options { arena_bytes: 128 << 10, ..Options::default() });
    let mut rng = Rng(4);
    let big = expert(&mut rng, 200, 200, Format::F32);
    let err = device.upload(&ExpertImage::of(&big).unwrap()).unwrap_err();
    assert_eq!(err.kind(), "unsupported", "{err}");
    assert!(err.to_string().contains("exceeds"), "{err}");
    let small = expert(&mut rng, 16, 16, Format::F32);
    let r = device.upload(&ExpertImage::of(&small).unwrap()).unwrap();
    let x: Vec<f32> = (0..16).map(|_| rng.value()).collect();
    assert_same_bits(&device.forward(&[Job { expert: &r, rows: &x }]).unwrap()[0], &cpu(&small, &x), "small expert");
    device.release(r);
}

/// The shaders with the device's own `fma()`: either the self-test accepts them and they give the
/// CPU's bits everywhere, or it refuses them by name (lavapipe computes `fma()` as a multiply and
/// an add; GPUs fuse it).
#[test]
fn the_devices_own_fma_is_used_only_when_it_gives_the_cpus_bits() {
    match VulkanDevice::open_with(&Options { fma: Fma::Device, ..Options::default() }) {
        Ok(device) => {
            eprintln!("{}: its fma() is fused", device.name());
            check_device(&device, 5);
        }
        Err(e) => {
            eprintln!("the device's fma() was refused: {e}");
            assert_eq!(e.kind(), "not_bit_identical", "{e}");
        }
    }
}

/// `--gpu` spreads experts over every device of the best kind present: all discrete GPUs, else
/// all integrated, …; on this machine that is the one CPU driver, and only with `cpu_drivers`.
#[test]
fn the_devices_of_the_best_kind_are_the_ones_used() {
    use shimmer_gpu::vulkan::{best_devices, best_ranked};
    assert_eq!(best_ranked(&[3, 0, 1, 0]), vec![1, 3], "both discrete GPUs, not the integrated one or lavapipe");
    assert_eq!(best_ranked(&[3, 1]), vec![1]);
    assert_eq!(best_ranked(&[]), Vec::<usize>::new());
    let with_cpu = best_devices(true).unwrap();
    assert!(!with_cpu.is_empty(), "lavapipe counts with cpu_drivers");
    for i in with_cpu {
        VulkanDevice::open_with(&Options { device_index: Some(i), ..Options::default() }).unwrap_or_else(|e| panic!("device {i}: {e}"));
    }
    // Without them, a driver on the CPU is never among the chosen.
    for i in best_devices(false).unwrap_or_default() {
        let d = VulkanDevice::open_with(&Options { device_index: Some(i), cpu_drivers: false, ..Options::default() }).unwrap();
        assert!(!d.name().contains("llvmpipe"), "{}", d.name());
    }
}
