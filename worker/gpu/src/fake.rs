//! A device made of the CPU: it keeps uploaded images in host memory, rebuilds the expert from the
//! image (so every upload is also a round trip of `ExpertImage`) and computes with the CPU kernels.
//! It exists to test the tier's host logic — residency, eviction, fallback, back-off — on machines
//! without a GPU, and it can be told to fail the way a real device fails.
//!
//! Must never: be opened by `--gpu` (it is a test device; nothing outside tests constructs it
//! except through its own name).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use shimmer_experts::Expert;
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

use crate::device::{Device, DeviceExpert, ExpertImage, GpuError, Job, MatrixLayout, WeightFormat};

/// A CPU-backed device holding `memory_bytes` of "device memory".
pub struct FakeDevice {
    holds_bytes: u64,
    /// What it tells the tier it has (more than it holds plays a GPU shared with others).
    reported_bytes: u64,
    state: Mutex<FakeState>,
}

#[derive(Default)]
struct FakeState {
    next_handle: u64,
    resident: HashMap<u64, (Expert, u64)>,
    used: u64,
    /// Failures the next calls (upload or forward) return, in order.
    failures: VecDeque<GpuError>,
    uploads: u64,
    submissions: u64,
}

impl FakeDevice {
    pub fn new(memory_bytes: u64) -> Self {
        FakeDevice { holds_bytes: memory_bytes, reported_bytes: memory_bytes, state: Mutex::new(FakeState::default()) }
    }

    /// A device that reports `bytes` of memory but holds only what `new` said.
    pub fn reporting(self, bytes: u64) -> Self {
        FakeDevice { reported_bytes: bytes, ..self }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the next upload or forward fail with `error`.
    pub fn fail_next(&self, error: GpuError) {
        self.state().failures.push_back(error);
    }

    /// Uploads and forward submissions that reached the device (failed ones included).
    pub fn calls(&self) -> (u64, u64) {
        let s = self.state();
        (s.uploads, s.submissions)
    }

    /// Experts resident now and their bytes.
    pub fn resident(&self) -> (usize, u64) {
        let s = self.state();
        (s.resident.len(), s.used)
    }
}

/// The expert an image describes, read back from its bytes.
pub fn expert_from_image(image: &ExpertImage) -> Result<Expert, GpuError> {
    let part = |offset: usize, len: Option<usize>| -> Result<&[u8], GpuError> {
        let end = len.and_then(|l| l.checked_add(offset));
        end.and_then(|end| image.bytes.get(offset..end)).ok_or_else(|| GpuError::Unsupported("a matrix lies outside its image".into()))
    };
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    let u16s = |b: &[u8]| b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<u16>>();
    let matrix = |m: &MatrixLayout| -> Result<Matrix, GpuError> {
        let values = part(m.byte_offset, m.rows.checked_mul(m.format.row_bytes(m.cols)))?;
        let data = match m.format {
            WeightFormat::F32 => WeightData::F32(f32s(values).into()),
            WeightFormat::Bf16 => WeightData::Bf16(u16s(values).into()),
            WeightFormat::F16 => WeightData::F16(u16s(values).into()),
            WeightFormat::Fp8 { block, row_block } => {
                let n = m.rows.div_ceil(row_block as usize) * m.cols.div_ceil(block as usize);
                WeightData::Fp8 {
                    q: values.to_vec().into(),
                    scales: f32s(part(m.scales_offset, Some(4 * n))?).into(),
                    block: block as usize,
                    row_block: row_block as usize,
                }
            }
            WeightFormat::Int8 => {
                WeightData::Int8 { q: values.iter().map(|b| *b as i8).collect(), scales: f32s(part(m.scales_offset, Some(4 * m.rows))?).into() }
            }
            WeightFormat::Int4 { group } => {
                let n = m.rows * m.cols.div_ceil(group as usize);
                // The image's f32 scales are widened f16s: narrowing gives back the exact bits.
                let scales = f32s(part(m.scales_offset, Some(4 * n))?).into_iter().map(shimmer_common::quant::f32_to_f16).collect();
                WeightData::Int4 { packed: values.to_vec().into(), scales, group: group as usize }
            }
            WeightFormat::Mxfp4 => {
                WeightData::Mxfp4 { packed: values.to_vec().into(), scales: part(m.scales_offset, Some(m.rows * m.cols.div_ceil(32)))?.to_vec().into() }
            }
        };
        Ok(Matrix::new(m.rows, m.cols, data))
    };
    Ok(Expert::new(matrix(&image.gate)?, matrix(&image.up)?, matrix(&image.down)?))
}

impl Device for FakeDevice {
    fn name(&self) -> String {
        "fake (the CPU)".into()
    }

    fn memory_bytes(&self) -> u64 {
        self.reported_bytes
    }

    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        let mut s = self.state();
        s.uploads += 1;
        if let Some(e) = s.failures.pop_front() {
            return Err(e);
        }
        let bytes = image.bytes.len() as u64;
        if s.used + bytes > self.holds_bytes {
            return Err(GpuError::OutOfMemory(format!("{bytes} bytes asked, {} of {} in use", s.used, self.holds_bytes)));
        }
        let expert = expert_from_image(image)?;
        s.next_handle += 1;
        let handle = s.next_handle;
        s.resident.insert(handle, (expert, bytes));
        s.used += bytes;
        Ok(DeviceExpert { handle, bytes, gate: image.gate, up: image.up, down: image.down })
    }

    fn release(&self, expert: DeviceExpert) {
        let mut s = self.state();
        let (_, bytes) = s.resident.remove(&expert.handle).expect("released a handle this device gave out");
        s.used -= bytes;
    }

    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut s = self.state();
        s.submissions += 1;
        if let Some(e) = s.failures.pop_front() {
            return Err(e);
        }
        jobs.iter()
            .map(|job| {
                let (expert, _) = s.resident.get(&job.expert.handle).ok_or_else(|| GpuError::Device("a job names an expert not resident".into()))?;
                let mut out = vec![0.0f32; job.rows.len()];
                expert.forward_rows(job.rows, &mut Default::default(), &mut out, false);
                Ok(out)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An expert's image read back is the same expert, in every format a device computes.
    #[test]
    fn images_round_trip() {
        let f32s = |n: usize, k: u32| (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ k) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>();
        let make = |data: &dyn Fn(Vec<f32>) -> WeightData| {
            Expert::new(Matrix::new(6, 5, data(f32s(30, 1))), Matrix::new(6, 5, data(f32s(30, 2))), Matrix::new(5, 6, data(f32s(30, 3))))
        };
        let bf16 = |v: Vec<f32>| WeightData::Bf16(v.iter().map(|x| (x.to_bits() >> 16) as u16).collect());
        let f16 = |v: Vec<f32>| WeightData::F16(v.iter().map(|x| half_bits(*x)).collect());
        for expert in [make(&|v: Vec<f32>| WeightData::F32(v.into())), make(&bf16), make(&f16)] {
            let image = ExpertImage::of(&expert).unwrap();
            assert!([image.gate, image.up, image.down].iter().all(|m| m.byte_offset.is_multiple_of(4)));
            let back = expert_from_image(&image).unwrap();
            for (a, b) in [(&expert.gate, &back.gate), (&expert.up, &back.up), (&expert.down, &back.down)] {
                assert_eq!((a.rows, a.cols), (b.rows, b.cols));
                assert_eq!(format!("{:?}", a.data), format!("{:?}", b.data));
            }
        }
    }

    /// An f16 with the value's top bits (enough for a round-trip test; not a rounding conversion).
    fn half_bits(x: f32) -> u16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        if !(1..31).contains(&exp) {
            return sign;
        }
        sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
    }

    #[test]
    fn formats_without_a_kernel_are_refused_by_name() {
        let q = WeightData::Int8 { q: vec![1; 30].into(), scales: vec![1.0; 6].into() };
        // int8 weights with f32 activations (quant-eval's comparison): no GPU kernel.
        let m = |rows, cols| Matrix::new(rows, cols, q.clone()).with_activations(shimmer_kernels::Activations::F32);
        let expert = Expert::new(m(6, 5), m(6, 5), Matrix::new(5, 6, WeightData::F32(vec![0.0; 30].into())));
        let err = ExpertImage::of(&expert).unwrap_err();
        assert!(matches!(err, GpuError::Unsupported(_)) && err.to_string().contains("int8"), "{err}");
        let mx = WeightData::Mxfp4 { packed: vec![0x12; 18].into(), scales: vec![127; 6].into() };
        let m = |rows, cols| Matrix::new(rows, cols, mx.clone()).with_activations(shimmer_kernels::Activations::F32);
        let expert = Expert::new(m(6, 5), m(6, 5), Matrix::new(5, 6, WeightData::F32(vec![0.0; 30].into())));
        assert!(ExpertImage::of(&expert).unwrap_err().to_string().contains("mxfp4"));
    }

    /// Integer formats' images read back as the same matrices (values and scales).
    #[test]
    fn integer_images_round_trip() {
        use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
        let w: Vec<f32> = (0..70 * 45).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        for make in [
            &(|w: &[f32], r, c| Matrix::from_quant(quantize_int8(w, r, c))) as &dyn Fn(&[f32], usize, usize) -> Matrix,
            &|w: &[f32], r, c| Matrix::from_quant(quantize_int4(w, r, c, 32)),
            &|w: &[f32], r, c| Matrix::from_quant(quantize_int4(w, r, c, 64)),
            &|w: &[f32], r, c| Matrix::from_quant(quantize_mxfp4(w, r, c)),
        ] {
            let expert = Expert::new(make(&w, 70, 45), make(&w, 70, 45), make(&w, 45, 70));
            let back = expert_from_image(&ExpertImage::of(&expert).unwrap()).unwrap();
            for (a, b) in [(&expert.gate, &back.gate), (&expert.up, &back.up), (&expert.down, &back.down)] {
                assert_eq!(format!("{:?} {:?}", a.data, a.activations), format!("{:?} {:?}", b.data, b.activations));
            }
        }
    }
}
