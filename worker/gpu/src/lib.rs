//! shimmer-gpu: the VRAM tier — routed experts resident in a GPU's memory and computed there,
//! giving the bits the CPU gives.
//!
//! Owns: the device seam (`Device`: upload an expert, compute a batch of experts over their
//! rows), the tier over it (`VramTier`: which experts are resident under a byte budget, what
//! runs on the device and what falls back to the CPU, faults and their back-off, the fault
//! injection hook `SHIMMER_GPU_FAULT`), and the backends: Vulkan through `ash` (feature
//! `vulkan`, shaders in `shaders/`) and a CPU-backed device for testing the host logic.
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
pub mod device;
pub mod fake;
pub mod tier;
#[cfg(feature = "vulkan")]
pub mod vulkan;

pub use device::{Device, DeviceExpert, GpuError, Job};
pub use tier::{ExpertKey, GpuCounters, TierJob, VramTier};

/// Which GPU backend a verb uses (`--gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuChoice {
    /// The first backend that finds a usable device; none is not an error.
    Auto,
    Cuda,
    Vulkan,
    None,
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

/// The device `choice` names, opened and self-tested; `Ok(None)` when `Auto` finds none.
pub fn open(choice: GpuChoice) -> Result<Option<Box<dyn Device>>, GpuError> {
    match choice {
        GpuChoice::None => Ok(None),
        GpuChoice::Cuda => Err(GpuError::Unavailable("this build has no CUDA backend yet (issue 19); use --gpu vulkan".into())),
        GpuChoice::Vulkan => open_vulkan().map(Some),
        GpuChoice::Auto => match open_vulkan() {
            Ok(d) => Ok(Some(d)),
            Err(e) => {
                tracing::info!("no GPU: {e}");
                Ok(None)
            }
        },
    }
}

#[cfg(feature = "vulkan")]
fn open_vulkan() -> Result<Box<dyn Device>, GpuError> {
    Ok(Box::new(vulkan::VulkanDevice::open()?))
}

#[cfg(not(feature = "vulkan"))]
fn open_vulkan() -> Result<Box<dyn Device>, GpuError> {
    Err(GpuError::Unavailable("this binary was built without Vulkan (cargo build --features vulkan)".into()))
}
