//! shimmer-gpu: the VRAM tier — routed experts resident in a GPU's memory and computed there,
//! giving the bits the CPU gives.
//!
//! Owns: the device seam (`Device`: upload an expert, compute a batch of experts over their
//! rows), the tier over a node's devices (`VramTier`: which device each expert belongs to,
//! which experts are resident under each device's byte budget, what
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

/// Every device of the backend `choice` names, each opened and self-tested: all CUDA devices
/// the driver shows (`CUDA_VISIBLE_DEVICES` narrows them), or every Vulkan device of the best
/// kind present (`vulkan::best_devices`). A device that fails to open or its self-test is left
/// out with a warning while others open; `Ok(empty)` for `none`, and for `auto` when there is no
/// usable GPU.
pub fn open_all(choice: GpuChoice) -> Result<Vec<Box<dyn Device>>, GpuError> {
    match choice {
        GpuChoice::None => Ok(Vec::new()),
        GpuChoice::Cuda => open_every(cuda_devices()?, open_cuda_at),
        GpuChoice::Vulkan => open_every(vulkan_devices(true)?, |i| open_vulkan_at(true, i)),
        GpuChoice::Auto => {
            let cuda = cuda_devices().and_then(|n| open_every(n, open_cuda_at));
            let found = cuda.or_else(|cuda| vulkan_devices(false).and_then(|v| open_every(v, |i| open_vulkan_at(false, i))).map_err(|vulkan| (cuda, vulkan)));
            match found {
                Ok(devices) => Ok(devices),
                Err((cuda, vulkan)) => {
                    tracing::info!("no GPU: {cuda}; {vulkan}");
                    Ok(Vec::new())
                }
            }
        }
    }
}

/// Opens each of `which`; the devices that opened, or the first error when none did.
fn open_every(which: Vec<usize>, open: impl Fn(usize) -> Result<Box<dyn Device>, GpuError>) -> Result<Vec<Box<dyn Device>>, GpuError> {
    let mut devices = Vec::new();
    let mut first_error = None;
    for i in which {
        match open(i) {
            Ok(d) => devices.push(d),
            Err(e) => {
                tracing::warn!("GPU {i} is not used: {e}");
                first_error.get_or_insert(e);
            }
        }
    }
    match (devices.is_empty(), first_error) {
        (true, Some(e)) => Err(e),
        (true, None) => Err(GpuError::Unavailable("no device to open".into())),
        _ => Ok(devices),
    }
}

/// The VRAM tier over every device `choice` names (`open_all`), each holding at most
/// `budget_bytes` (default: 90 % of its memory); `SHIMMER_GPU_FAULT` read here.
pub fn tier(choice: GpuChoice, budget_bytes: Option<u64>) -> Result<Option<std::sync::Arc<VramTier>>, GpuError> {
    let fault_every = tier::fault_every_from_env().map_err(GpuError::Unavailable)?;
    let devices = open_all(choice)?;
    if devices.is_empty() {
        return Ok(None);
    }
    let budgeted = devices.into_iter().map(|d| {
        let budget = budget_bytes.unwrap_or(d.memory_bytes() / 10 * 9);
        (d, budget)
    });
    Ok(Some(std::sync::Arc::new(VramTier::on_devices(budgeted.collect(), fault_every))))
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<Vec<usize>, GpuError> {
    // SAFETY: loading the driver library to see whether it is there (its initialisers run).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::Unavailable("no CUDA driver (libcuda.so.1 cannot be loaded)".into()));
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| GpuError::Unavailable(format!("counting CUDA devices: {e}")))?;
    if n <= 0 {
        return Err(GpuError::Unavailable("no CUDA device (the driver shows none; is CUDA_VISIBLE_DEVICES empty?)".into()));
    }
    Ok((0..n as usize).collect())
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Result<Vec<usize>, GpuError> {
    open_cuda().map(|_| Vec::new())
}

#[cfg(feature = "cuda")]
fn open_cuda_at(ordinal: usize) -> Result<Box<dyn Device>, GpuError> {
    Ok(Box::new(cuda::CudaDevice::open(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda_at(_ordinal: usize) -> Result<Box<dyn Device>, GpuError> {
    open_cuda()
}

#[cfg(feature = "vulkan")]
fn vulkan_devices(cpu_drivers: bool) -> Result<Vec<usize>, GpuError> {
    let found = vulkan::best_devices(cpu_drivers)?;
    if found.is_empty() {
        return Err(GpuError::Unavailable(if cpu_drivers {
            "no Vulkan 1.2 device with a compute queue".into()
        } else {
            "no Vulkan 1.2 GPU (drivers that run on the CPU, such as lavapipe, are used only with --gpu vulkan)".into()
        }));
    }
    Ok(found)
}

#[cfg(not(feature = "vulkan"))]
fn vulkan_devices(cpu_drivers: bool) -> Result<Vec<usize>, GpuError> {
    open_vulkan(cpu_drivers).map(|_| Vec::new())
}

#[cfg(feature = "vulkan")]
fn open_vulkan_at(cpu_drivers: bool, index: usize) -> Result<Box<dyn Device>, GpuError> {
    Ok(Box::new(vulkan::VulkanDevice::open_with(&vulkan::Options { cpu_drivers, device_index: Some(index), ..vulkan::Options::default() })?))
}

#[cfg(not(feature = "vulkan"))]
fn open_vulkan_at(cpu_drivers: bool, _index: usize) -> Result<Box<dyn Device>, GpuError> {
    open_vulkan(cpu_drivers)
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
