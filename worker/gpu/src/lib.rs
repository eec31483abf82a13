//! shimmer-gpu: the VRAM tier — routed experts resident in a GPU's memory and computed there,
//! giving the bits the CPU gives.
//!
//! Owns: the device seam (`Device`: upload an expert, compute a batch of experts over their
//! rows), the tier over it (`VramTier`: which experts are resident under a byte budget, what
//! runs on the device and what falls back to the CPU, faults and their back-off, the fault
//! injection hook `SHIMMER_GPU_FAULT`), and the backends: Vulkan through `ash` (feature
//! `vulkan`, shaders in `shaders/`), CUDA through `cudarc` (feature `cuda`, kernels in `cuda/`),
//! and a CPU-backed device for testing the host logic.
//!
//! Bit-identity: each shader computes every dot product in `shimmer_kernels::dot`'s canonical
//! order (the 64 lanes, FMA for FMA, the fixed reduction tree) and SiLU gating as
//! `shimmer_kernels::gating` defines it; the weighted sum of expert outputs stays on the CPU's
//! fixed-point accumulator. A device whose arithmetic cannot give those bits (an unfused `fma`,
//! flushed subnormals) fails the self-test at start and is not used.
//!
//! Must never: return an output the device did not compute in full (a failed or timed-out
//! submission is an error, and the caller computes that batch on the CPU); route, skip or
//! re-weight an expert; depend on an async runtime or a socket; link a GPU library at build
//! time (drivers are loaded at run time, so the binary starts on machines without one).

pub mod arena;
pub mod check;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod fake;
pub mod tier;
#[cfg(feature = "vulkan")]
pub mod vulkan;

pub use device::{Device, DeviceExpert, GpuError, Job};
pub use tier::{ExpertKey, GpuCounters, GpuTelemetry, TierJob, VramTier};

/// Which GPU backend a verb uses (`--gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuChoice {
    /// The first backend that finds a usable device; none is not an error.
    Auto,
    Cuda,
    Vulkan,
    None,
}

impl std::fmt::Display for GpuChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuChoice::Auto => "auto",
            GpuChoice::Cuda => "cuda",
            GpuChoice::Vulkan => "vulkan",
            GpuChoice::None => "none",
        })
    }
}

impl std::str::FromStr for GpuChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(GpuChoice::Auto),
            "cuda" => Ok(GpuChoice::Cuda),
            "vulkan" => Ok(GpuChoice::Vulkan),
            "none" => Ok(GpuChoice::None),
            other => Err(format!("unknown GPU backend `{other}` (expected auto, cuda, vulkan or none)")),
        }
    }
}

/// The device `choice` names, opened and self-tested; `Ok(None)` for `none`, and for `auto`
/// when there is no usable GPU (CUDA first, then Vulkan; drivers that run on the CPU, such as
/// lavapipe, only by name).
pub fn open(choice: GpuChoice) -> Result<Option<Box<dyn Device>>, GpuError> {
    match choice {
        GpuChoice::None => Ok(None),
        GpuChoice::Cuda => open_cuda().map(Some),
        GpuChoice::Vulkan => open_vulkan(true).map(Some),
        GpuChoice::Auto => match open_cuda().or_else(|cuda| open_vulkan(false).map_err(|vulkan| (cuda, vulkan))) {
            Ok(d) => Ok(Some(d)),
            Err((cuda, vulkan)) => {
                tracing::info!("no GPU: {cuda}; {vulkan}");
                Ok(None)
            }
        },
    }
}

/// The VRAM tier on the device `choice` names, holding at most `budget_bytes` (default: 90 % of
/// the device's memory); `SHIMMER_GPU_FAULT` read here.
pub fn tier(choice: GpuChoice, budget_bytes: Option<u64>) -> Result<Option<std::sync::Arc<VramTier>>, GpuError> {
    let fault_every = tier::fault_every_from_env().map_err(GpuError::Unavailable)?;
    let Some(device) = open(choice)? else { return Ok(None) };
    let budget = budget_bytes.unwrap_or(device.memory_bytes() / 10 * 9);
    Ok(Some(std::sync::Arc::new(VramTier::new(device, budget, fault_every))))
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Box<dyn Device>, GpuError> {
    Ok(Box::new(cuda::CudaDevice::open(0)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Box<dyn Device>, GpuError> {
    Err(GpuError::Unavailable("this binary was built without CUDA (cargo build --release -p shimmer-coordinator --features cuda)".into()))
}

#[cfg(feature = "vulkan")]
fn open_vulkan(cpu_drivers: bool) -> Result<Box<dyn Device>, GpuError> {
    Ok(Box::new(vulkan::VulkanDevice::open_with(&vulkan::Options { cpu_drivers, ..vulkan::Options::default() })?))
}

#[cfg(not(feature = "vulkan"))]
fn open_vulkan(_cpu_drivers: bool) -> Result<Box<dyn Device>, GpuError> {
    Err(GpuError::Unavailable("this binary was built without Vulkan (cargo build --release -p shimmer-coordinator --features vulkan)".into()))
}
