//! A device's bits against the CPU's for every weight format the tier computes: what `shimmer
//! doctor --gpu` prints, and what the device check runs on a machine with a GPU. Deterministic
//! experts (zeros, outliers and subnormal-range values included) over one row and over a batch.
//!
//! Must never: count a format as checked that the device refused or failed on (those are
//! reported with the error).

use shimmer_common::quant::{quantize_int4, quantize_int8, quantize_mxfp4};
use shimmer_experts::Expert;
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

use crate::device::{Device, ExpertImage, Job};

/// One format's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FormatCheck {
    pub format: &'static str,
    /// Outputs compared, and how many differed from the CPU's bits.
    pub outputs: usize,
    pub differing: usize,
    /// The first difference, or the error that stopped the check.
    pub detail: Option<String>,
}

impl FormatCheck {
    pub fn passed(&self) -> bool {
        self.differing == 0 && self.detail.is_none() && self.outputs > 0
    }
}

const FORMATS: [&str; 10] = ["f32", "bf16", "f16", "fp8-b128", "fp8-r16", "int8", "int4-g32", "int4-g64", "int4-g128", "mxfp4"];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn value(&mut self) -> f32 {
        let r = self.next();
        match r % 41 {
            0 => 0.0,
            1 => 2.5,
            2 => f32::from_bits((r >> 32) as u32 & 0x007f_ffff | 1),
            _ => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.3,
        }
    }
}

fn matrix(format: &str, rows: usize, cols: usize, rng: &mut Rng) -> Matrix {
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.value()).collect();
    match format {
        "f32" => Matrix::new(rows, cols, WeightData::F32(values.into())),
        "bf16" => Matrix::new(rows, cols, WeightData::Bf16(values.iter().map(|v| (v.to_bits() >> 16) as u16).collect())),
        "f16" => Matrix::new(rows, cols, WeightData::F16(values.iter().map(|_| (rng.next() as u16) & 0xbfff).collect())),
        "fp8-b128" => Matrix::new(
            rows,
            cols,
            WeightData::Fp8 {
                q: (0..rows * cols).map(|_| (rng.next() as u8) & 0xf7).collect(),
                scales: (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|_| rng.value().abs() + 1e-3).collect(),
                block: 128,
                row_block: 128,
            },
        ),
        // fp8 with a scale per 16 values of a row: Inkling's NVFP4 (and, per 32, MXFP8) experts.
        "fp8-r16" => Matrix::new(
            rows,
            cols,
            WeightData::Fp8 {
                q: (0..rows * cols).map(|_| (rng.next() as u8) & 0xf7).collect(),
                scales: (0..rows * cols.div_ceil(16)).map(|_| rng.value().abs() + 1e-3).collect(),
                block: 16,
                row_block: 1,
            },
        ),
        "int8" => Matrix::from_quant(quantize_int8(&values, rows, cols)),
        "int4-g32" => Matrix::from_quant(quantize_int4(&values, rows, cols, 32)),
        "int4-g64" => Matrix::from_quant(quantize_int4(&values, rows, cols, 64)),
        "int4-g128" => Matrix::from_quant(quantize_int4(&values, rows, cols, 128)),
        _ => Matrix::from_quant(quantize_mxfp4(&values, rows, cols)),
    }
}

/// Every format on `device`, against `Expert::forward_rows` on the CPU.
pub fn check_formats(device: &dyn Device) -> Vec<FormatCheck> {
    let (hidden, inter) = (200usize, 136usize);
    FORMATS
        .iter()
        .enumerate()
        .map(|(k, &format)| {
            let mut rng = Rng(0x5EED + k as u64);
            let expert = Expert::new(matrix(format, inter, hidden, &mut rng), matrix(format, inter, hidden, &mut rng), matrix(format, hidden, inter, &mut rng));
            let mut check = FormatCheck { format, outputs: 0, differing: 0, detail: None };
            let image = match ExpertImage::of(&expert) {
                Ok(i) => i,
                Err(e) => {
                    check.detail = Some(e.to_string());
                    return check;
                }
            };
            let resident = match device.upload(&image) {
                Ok(r) => r,
                Err(e) => {
                    check.detail = Some(e.to_string());
                    return check;
                }
            };
            for n in [1usize, 5] {
                let rows: Vec<f32> = (0..n * hidden).map(|i| if i % 97 == 0 { 40.0 } else { rng.value() * 4.0 }).collect();
                let mut want = vec![0.0f32; rows.len()];
                expert.forward_rows(&rows, &mut Default::default(), &mut want, false);
                match device.forward(&[Job { expert: &resident, rows: &rows }]) {
                    Ok(got) => {
                        let got = got.into_iter().next().unwrap_or_default();
                        check.outputs += want.len();
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            if g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) {
                                check.differing += 1;
                                check.detail.get_or_insert_with(|| format!("{n} rows: output {i} is {g:e} on the device, {w:e} on the CPU"));
                            }
                        }
                        if got.len() != want.len() {
                            check.detail = Some(format!("{n} rows: {} outputs for {}", got.len(), want.len()));
                        }
                    }
                    Err(e) => {
                        check.detail = Some(e.to_string());
                        break;
                    }
                }
            }
            device.release(resident);
            check
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU-backed device every format passes; the check is not vacuous (it compares
    /// outputs of every format).
    #[test]
    fn the_fake_device_passes_every_format() {
        let checks = check_formats(&crate::fake::FakeDevice::new(1 << 30));
        assert_eq!(checks.len(), FORMATS.len());
        for c in &checks {
            assert!(c.passed() && c.outputs == 6 * 200, "{c:?}");
        }
    }

    /// A device that gets one bit wrong is caught, and named.
    #[test]
    fn a_device_off_by_one_bit_fails() {
        struct OffByOne(crate::fake::FakeDevice);
        impl Device for OffByOne {
            fn name(&self) -> String {
                "off by one".into()
            }
            fn memory_bytes(&self) -> u64 {
                self.0.memory_bytes()
            }
            fn upload(&self, image: &ExpertImage) -> Result<crate::DeviceExpert, crate::GpuError> {
                self.0.upload(image)
            }
            fn release(&self, expert: crate::DeviceExpert) {
                self.0.release(expert)
            }
            fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, crate::GpuError> {
                let mut out = self.0.forward(jobs)?;
                if let Some(v) = out.first_mut().and_then(|o| o.get_mut(3)) {
                    *v = f32::from_bits(v.to_bits() ^ 1);
                }
                Ok(out)
            }
        }
        let checks = check_formats(&OffByOne(crate::fake::FakeDevice::new(1 << 30)));
        assert!(checks.iter().all(|c| !c.passed() && c.differing == 2), "{checks:?}");
        assert!(checks[0].detail.as_deref().unwrap_or("").contains("output 3"));
    }
}
