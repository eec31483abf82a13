//! The device seam: what a GPU backend does for the tier — hold experts' weights in its memory
//! and compute experts over rows — and the image of an expert it uploads.
//!
//! Must never: hand back a partial result (an error covers the whole submission), or accept an
//! expert whose format it cannot compute exactly (`ExpertImage::of` refuses it by name).

use shimmer_experts::Expert;
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::{Activations, Matrix};

/// What went wrong on a device. `kind` labels `shimmer_gpu_faults_total`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GpuError {
    /// No driver, no device, or a build without the backend: the tier is simply off.
    #[error("{0}")]
    Unavailable(String),
    /// The device's arithmetic does not give the CPU's bits (the self-test names the case).
    #[error("{0}")]
    NotBitIdentical(String),
    /// A weight format or shape this backend does not compute (the expert stays on the CPU).
    #[error("{0}")]
    Unsupported(String),
    #[error("device memory exhausted: {0}")]
    OutOfMemory(String),
    #[error("the device did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("the device was lost: {0}")]
    Lost(String),
    #[error("device error: {0}")]
    Device(String),
    /// `SHIMMER_GPU_FAULT` made this submission fail (tests of the fallback).
    #[error("injected fault (SHIMMER_GPU_FAULT)")]
    Injected,
}

impl GpuError {
    /// The fault's kind, as `/metrics` labels it.
    pub fn kind(&self) -> &'static str {
        match self {
            GpuError::Unavailable(_) => "unavailable",
            GpuError::NotBitIdentical(_) => "not_bit_identical",
            GpuError::Unsupported(_) => "unsupported",
            GpuError::OutOfMemory(_) => "out_of_memory",
            GpuError::Timeout(_) => "timeout",
            GpuError::Lost(_) => "lost",
            GpuError::Device(_) => "device",
            GpuError::Injected => "injected",
        }
    }

    /// Every kind, in the order `/metrics` lists them.
    pub const KINDS: [&'static str; 6] = ["out_of_memory", "timeout", "lost", "device", "injected", "unsupported"];
}

/// A weight matrix's format on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Bf16,
    F16,
    /// fp8-e4m3 with one f32 scale per `row_block` × `block` tile (DeepSeek-V3's checkpoints:
    /// 128 × 128; Inkling's MXFP8 and NVFP4 experts as held: row groups, 1 × 32 and 1 × 16), f32
    /// activations.
    Fp8 {
        block: u32,
        row_block: u32,
    },
    /// int8 per row (`q`, one f32 row scale), integer products with int8 activations.
    Int8,
    /// int4 with one scale per `group` values (a multiple of 32; stored as f16, widened exactly to f32
    /// in the image), integer products.
    Int4 {
        group: u32,
    },
    /// MXFP4: e2m1 nibbles, one e8m0 scale per 32 values, integer products.
    Mxfp4,
}

impl WeightFormat {
    /// Bytes per element of the float formats (whose elements the shaders index).
    pub fn element_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::Bf16 | WeightFormat::F16 => 2,
            WeightFormat::Int8 | WeightFormat::Fp8 { .. } => 1,
            WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 => 0,
        }
    }

    /// Whether its products take int8 activations (`shimmer_kernels::qdot`).
    pub fn is_integer(self) -> bool {
        matches!(self, WeightFormat::Int8 | WeightFormat::Int4 { .. } | WeightFormat::Mxfp4)
    }

    /// Whether its scales follow its values in the image.
    pub fn has_scales(self) -> bool {
        self.is_integer() || matches!(self, WeightFormat::Fp8 { .. })
    }

    /// Bytes of one row's values (4-bit rows are padded to whole bytes).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 => cols.div_ceil(2),
            other => cols * other.element_bytes(),
        }
    }
}

/// Where one matrix lies in an expert's image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixLayout {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// Its values, from the image's start; a multiple of 4.
    pub byte_offset: usize,
    /// Its scales (int8's row scales, int4's group scales and fp8's block scales as f32, MXFP4's
    /// e8m0 bytes), from the image's start; a multiple of 4. 0 for f32, bf16 and f16.
    pub scales_offset: usize,
}

impl MatrixLayout {
    /// The matrix's first element, counted in its format's elements from the image's start
    /// (float formats).
    pub fn element_offset(&self) -> usize {
        self.byte_offset / self.format.element_bytes().max(1)
    }
}

/// An expert's three matrices as the device stores them: each matrix's values, then (integer
/// formats) its scales, little endian, each part starting on a 4-byte boundary.
#[derive(Debug, Clone)]
pub struct ExpertImage {
    pub bytes: Vec<u8>,
    pub gate: MatrixLayout,
    pub up: MatrixLayout,
    pub down: MatrixLayout,
}

impl ExpertImage {
    /// The image of `expert`, or `Unsupported` naming the format the device cannot compute with
    /// the CPU's bits. Computed: checkpoints run as they are (f32, bf16, f16 with f32
    /// activations; fp8 with block scales) and the container formats with integer products (int8,
    /// int4 in whole blocks of 32, MXFP4 — int8 activations). Not yet: the integer formats with
    /// f32 activations (`quant-eval`'s comparison), and experts with biases or gpt-oss's
    /// clamped SwiGLU (the kernels compute plain SwiGLU only).
    pub fn of(expert: &Expert) -> Result<Self, GpuError> {
        if !expert.is_plain_swiglu() {
            return Err(GpuError::Unsupported("experts with biases or a clamped SwiGLU (gpt-oss) are computed on the CPU".into()));
        }
        let mut bytes = Vec::with_capacity(expert.bytes());
        let mut put = |name: &str, m: &Matrix| -> Result<MatrixLayout, GpuError> {
            let byte_offset = bytes.len();
            let mut scales_offset = 0;
            let align = |bytes: &mut Vec<u8>| bytes.resize(bytes.len().next_multiple_of(4), 0);
            let format = match (&m.data, m.activations) {
                (WeightData::F32(v), Activations::F32) => {
                    v.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    WeightFormat::F32
                }
                (WeightData::Bf16(v), Activations::F32) => {
                    v.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    WeightFormat::Bf16
                }
                (WeightData::F16(v), Activations::F32) => {
                    v.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    WeightFormat::F16
                }
                (WeightData::Fp8 { q, scales, block, row_block }, Activations::F32)
                    if *block > 0
                        && *row_block > 0
                        && *block <= u32::MAX as usize
                        && *row_block <= u32::MAX as usize
                        && scales.len() == m.rows.div_ceil(*row_block) * m.cols.div_ceil(*block) =>
                {
                    bytes.extend_from_slice(q);
                    align(&mut bytes);
                    scales_offset = bytes.len();
                    scales.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    WeightFormat::Fp8 { block: *block as u32, row_block: *row_block as u32 }
                }
                (WeightData::Int8 { q, scales }, Activations::Int8) if scales.len() == m.rows => {
                    bytes.extend(q.iter().map(|v| *v as u8));
                    align(&mut bytes);
                    scales_offset = bytes.len();
                    scales.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    WeightFormat::Int8
                }
                (WeightData::Int4 { packed, scales, group }, Activations::Int8)
                    if *group > 0 && group.is_multiple_of(32) && *group <= u32::MAX as usize && scales.len() == m.rows * m.cols.div_ceil(*group) =>
                {
                    bytes.extend_from_slice(packed);
                    align(&mut bytes);
                    scales_offset = bytes.len();
                    // The f16 scales widened (exactly) to the f32 the kernels read.
                    scales.iter().for_each(|x| bytes.extend_from_slice(&shimmer_common::quant::int4_scale(*x).to_le_bytes()));
                    WeightFormat::Int4 { group: *group as u32 }
                }
                (WeightData::Mxfp4 { packed, scales }, Activations::Int8) if scales.len() == m.rows * m.cols.div_ceil(32) => {
                    bytes.extend_from_slice(packed);
                    align(&mut bytes);
                    scales_offset = bytes.len();
                    bytes.extend_from_slice(scales);
                    WeightFormat::Mxfp4
                }
                (data, act) => {
                    return Err(GpuError::Unsupported(format!(
                        "the {name} matrix's format ({}, {act:?} activations) has no GPU kernel yet",
                        format_name(data)
                    )));
                }
            };
            let values = m.rows.checked_mul(format.row_bytes(m.cols)).ok_or_else(|| GpuError::Unsupported(format!("the {name} matrix is too large")))?;
            let end = if format.has_scales() { scales_offset } else { bytes.len() };
            if values + byte_offset > end || (format.has_scales() && end - byte_offset - values >= 4) || (!format.has_scales() && values + byte_offset != end) {
                return Err(GpuError::Unsupported(format!("the {name} matrix's data does not match its {}×{} shape", m.rows, m.cols)));
            }
            align(&mut bytes);
            Ok(MatrixLayout { format, rows: m.rows, cols: m.cols, byte_offset, scales_offset })
        };
        let gate = put("gate", &expert.gate)?;
        let up = put("up", &expert.up)?;
        let down = put("down", &expert.down)?;
        if up.rows != gate.rows || up.cols != gate.cols || down.cols != gate.rows || down.rows != gate.cols {
            return Err(GpuError::Unsupported(format!(
                "expert shapes disagree: gate {}×{}, up {}×{}, down {}×{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(ExpertImage { bytes, gate, up, down })
    }

    pub fn hidden(&self) -> usize {
        self.gate.cols
    }

    pub fn intermediate(&self) -> usize {
        self.gate.rows
    }
}

fn format_name(data: &WeightData) -> &'static str {
    match data {
        WeightData::F32(_) => "f32",
        WeightData::Bf16(_) => "bf16",
        WeightData::F16(_) => "f16",
        WeightData::Int8 { .. } => "int8",
        WeightData::Int4 { .. } => "int4",
        WeightData::Int6 { .. } => "int6",
        WeightData::Fp8 { .. } => "fp8",
        WeightData::Mxfp4 { .. } => "mxfp4",
    }
}

/// An expert resident on a device. Only the device that made it can use or release it.
#[derive(Debug)]
pub struct DeviceExpert {
    /// The device's own handle (an allocation).
    pub handle: u64,
    pub bytes: u64,
    pub gate: MatrixLayout,
    pub up: MatrixLayout,
    pub down: MatrixLayout,
}

impl DeviceExpert {
    pub fn hidden(&self) -> usize {
        self.gate.cols
    }

    pub fn intermediate(&self) -> usize {
        self.gate.rows
    }

    /// A second name for the same allocation, for a `Job` submitted while the tier's lock is
    /// released (the tier keeps the expert resident until the job is done). Never released
    /// itself: only the tier's own `DeviceExpert` is.
    pub(crate) fn view(&self) -> DeviceExpert {
        DeviceExpert { handle: self.handle, bytes: self.bytes, gate: self.gate, up: self.up, down: self.down }
    }
}

/// One expert over the rows that chose it: `rows` is `n × hidden`, row-major.
pub struct Job<'a> {
    pub expert: &'a DeviceExpert,
    pub rows: &'a [f32],
}

/// A GPU backend.
pub trait Device: Send + Sync {
    /// The device as the banner names it (model, driver, API).
    fn name(&self) -> String;

    /// Bytes of device memory the device reports for holding experts.
    fn memory_bytes(&self) -> u64;

    /// Copies an expert's image into device memory.
    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError>;

    /// Frees a resident expert's memory.
    fn release(&self, expert: DeviceExpert);

    /// Each job's expert FFN over its rows, `n × hidden` per job, in one submission: the bits
    /// `Expert::forward_rows` gives on the CPU.
    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError>;
}

/// A shared device is a device (tests keep a handle to script the one a tier owns).
impl<D: Device + ?Sized> Device for std::sync::Arc<D> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn memory_bytes(&self) -> u64 {
        (**self).memory_bytes()
    }
    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        (**self).upload(image)
    }
    fn release(&self, expert: DeviceExpert) {
        (**self).release(expert)
    }
    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        (**self).forward(jobs)
    }
}

/// Experts and rows chosen to expose the ways a device can differ from the CPU: an `fma` that
/// rounds its product, flushed subnormal results or operands, SiLU's edges (exp's range ends,
/// infinities, signed zeros), subnormal block scales of the integer and fp8 formats.
fn self_test_cases() -> [(Expert, Vec<f32>); 5] {
    let (hidden, inter) = (80usize, 72usize);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut value = move |i: usize| -> f32 {
        let r = next();
        match i % 11 {
            // Products of these need more than 24 bits ((1 + 2^-12)² = 1 + 2^-11 + 2^-24): an
            // unfused fma rounds them first.
            0 => 1.0 + 2f32.powi(-12),
            1 => -1.0 - 2f32.powi(-12),
            // Subnormals, which a device that flushes them turns into 0.
            2 => f32::from_bits((r as u32) & 0x007f_ffff | 1),
            _ => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5,
        }
    };
    let f32m = |rows: usize, cols: usize, v: &mut dyn FnMut(usize) -> f32| Matrix::new(rows, cols, WeightData::F32((0..rows * cols).map(v).collect()));
    let expert = Expert::new(f32m(inter, hidden, &mut value), f32m(inter, hidden, &mut value), f32m(hidden, inter, &mut value));
    // Rows whose gate products reach exp's edges: large, tiny, zero, signed zero.
    let mut rows = Vec::new();
    for (r, scale) in [1.0f32, 40.0, 300.0, -300.0, 1e-30].into_iter().enumerate() {
        rows.extend((0..hidden).map(|i| if (i + r) % 13 == 0 { -0.0 } else { ((i * 7 + r * 3) % 17) as f32 / 8.0 - 1.0 } * scale));
    }
    // Outputs in the subnormal range (gate and up products ~1e-10, their SwiGLU ~1e-20, down
    // weights ~1e-21): a device that flushes subnormal results gives zeros or other low bits.
    let tiny = |scale: f32| {
        let mut v = value;
        move |i: usize| v(i) * scale
    };
    let small = Expert::new(f32m(inter, hidden, &mut tiny(4e-10)), f32m(inter, hidden, &mut tiny(4e-10)), f32m(hidden, inter, &mut tiny(4e-21)));
    let small_rows: Vec<f32> = (0..2 * hidden).map(|i| ((i * 5) % 13) as f32 / 6.0 - 1.0).collect();
    // Subnormal operands: every gate weight subnormal, activations ~1e20 (so the gate products
    // are normal); a device that flushes subnormal operands computes a zero gate.
    let subnormal = |i: usize| f32::from_bits(((i as u32).wrapping_mul(2654435761) & 0x007f_ffff) | 1) * if i.is_multiple_of(3) { -1.0 } else { 1.0 };
    let flushy = Expert::new(f32m(inter, hidden, &mut { subnormal }), f32m(inter, hidden, &mut tiny(1.0)), f32m(hidden, inter, &mut tiny(1.0)));
    let flushy_rows: Vec<f32> = (0..hidden).map(|i| (((i * 3) % 7) as f32 - 3.0) * 1e20).collect();
    // Integer products: MXFP4 weights so small that their block scales are subnormal (e8m0 ≤ 1)
    // and int4 ones whose f16 group scales are subnormal (weights ~1e-6), against activations with
    // zero and outlier blocks.
    let mut w = value;
    let tiny_w: Vec<f32> = (0..inter * hidden).map(|i| w(i) * 1e-38).collect();
    let quantised = Expert::new(
        Matrix::from_quant(shimmer_common::quant::quantize_mxfp4(&tiny_w, inter, hidden)),
        Matrix::from_quant(shimmer_common::quant::quantize_int4(&tiny_w.iter().map(|v| v * 1e32).collect::<Vec<_>>(), inter, hidden, 32)),
        Matrix::from_quant(shimmer_common::quant::quantize_int8(&(0..hidden * inter).map(&mut w).collect::<Vec<_>>(), hidden, inter)),
    );
    let quantised_rows: Vec<f32> = (0..2 * hidden)
        .map(|i| {
            if i < 32 {
                0.0
            } else if i % 29 == 0 {
                3e4
            } else {
                ((i * 7) % 19) as f32 * 1e18
            }
        })
        .collect();
    // fp8 with block scales so small that the scaled weights are subnormal, against activations
    // ~1e30 (so the gate products are normal).
    let fp8 = |scale: f32, k: u8| {
        let q: Vec<u8> = (0..inter * hidden).map(|i| (i as u8).wrapping_mul(37).wrapping_add(k) & 0x77).collect();
        WeightData::Fp8 { q: q.into(), scales: vec![scale; inter.div_ceil(16) * hidden.div_ceil(16)].into(), block: 16, row_block: 16 }
    };
    let scaled = Expert::new(Matrix::new(inter, hidden, fp8(1e-41, 1)), Matrix::new(inter, hidden, fp8(1e-3, 2)), f32m(hidden, inter, &mut tiny(1.0)));
    let scaled_rows: Vec<f32> = (0..hidden).map(|i| ((i % 9) as f32 - 4.0) * 1e30).collect();
    [(expert, rows), (small, small_rows), (flushy, flushy_rows), (quantised, quantised_rows), (scaled, scaled_rows)]
}

/// Checks that `device` computes an expert with the CPU's bits (see `self_test_cases`). Run once
/// when a device is opened.
pub fn self_test(device: &dyn Device) -> Result<(), GpuError> {
    let owned = self_test_cases();
    let cases: Vec<(&Expert, &Vec<f32>)> = owned.iter().map(|(e, x)| (e, x)).collect();
    let mut want = Vec::new();
    for &(e, x) in &cases {
        let mut y = vec![0.0f32; x.len()];
        e.forward_rows(x, &mut Default::default(), &mut y, false);
        want.extend(y);
    }
    let mut resident = Vec::new();
    for &(e, _) in &cases {
        match device.upload(&ExpertImage::of(e)?) {
            Ok(r) => resident.push(r),
            Err(err) => {
                resident.into_iter().for_each(|r| device.release(r));
                return Err(err);
            }
        }
    }
    let jobs: Vec<Job<'_>> = resident.iter().zip(&cases).map(|(r, (_, x))| Job { expert: r, rows: x }).collect();
    let got = device.forward(&jobs);
    drop(jobs);
    resident.into_iter().for_each(|r| device.release(r));
    let got: Vec<f32> = got?.into_iter().flatten().collect();
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    match got.iter().zip(&want).position(|(a, b)| !same(*a, *b)) {
        None if got.len() == want.len() => Ok(()),
        None => Err(GpuError::NotBitIdentical(format!("{}: the self-test expert gave {} values, the CPU {}", device.name(), got.len(), want.len()))),
        Some(i) => Err(GpuError::NotBitIdentical(format!(
            "{}: the self-test expert's output {i} is {:e} ({:#010x}) on the device and {:e} ({:#010x}) on the CPU — \
             its arithmetic differs (an unfused fma or flushed subnormals), so experts stay on the CPU",
            device.name(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The self-test can tell: some of its CPU outputs are subnormal (a device that flushes them
    /// gives other bits), flushing its subnormal gate weights zeroes an output that is not zero,
    /// its MXFP4 block scales include subnormal ones, and its fma cases round differently when
    /// the product is rounded first.
    #[test]
    fn the_self_test_exposes_flushing_and_unfused_fma() {
        let cases = self_test_cases();
        let forward = |(e, x): &(Expert, Vec<f32>)| {
            let mut y = vec![0.0f32; x.len()];
            e.forward_rows(x, &mut Default::default(), &mut y, false);
            y
        };
        let y = forward(&cases[1]);
        let subnormal = y.iter().filter(|v| v.is_subnormal()).count();
        assert!(subnormal > 40, "only {subnormal} of {} outputs are subnormal", y.len());
        let y = forward(&cases[2]);
        assert!(y.iter().filter(|v| v.is_normal()).count() > 60, "{y:?}");
        let [_, _, (flushy, x), quantised, scaled] = cases;
        let zero_gate = Matrix::new(flushy.gate.rows, flushy.gate.cols, WeightData::F32(vec![0.0; flushy.gate.rows * flushy.gate.cols].into()));
        let flushed = Expert::new(zero_gate, flushy.up, flushy.down);
        assert!(forward(&(flushed, x)).iter().all(|v| *v == 0.0));
        match &quantised.0.gate.data {
            WeightData::Mxfp4 { scales, .. } => assert!(scales.iter().filter(|e| **e <= 1).count() > 100, "{scales:?}"),
            other => panic!("{other:?}"),
        }
        match &quantised.0.up.data {
            WeightData::Int4 { scales, .. } => assert!(scales.iter().filter(|s| **s != 0 && **s < 0x0400).count() > 100, "{scales:?}"),
            other => panic!("{other:?}"),
        }
        assert!(forward(&quantised).iter().filter(|v| **v != 0.0).count() > 100);
        // The fp8 case's scaled gate weights are subnormal, and its outputs are not zero.
        let row0 = scaled.0.gate.row(0);
        assert!((0..scaled.0.gate.cols).filter(|c| row0.get(*c).is_subnormal()).count() > 20);
        assert!(forward(&scaled).iter().filter(|v| v.is_normal()).count() > 60);
        let a = 1.0f32 + 2f32.powi(-12);
        assert_ne!(a.mul_add(a, -1.0), a * a - 1.0, "the fma case's product needs more than 24 bits");
    }
}
