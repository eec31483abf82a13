//! The CUDA backend (`cudarc`, the driver loaded at run time): experts in device memory, computed
//! by the kernels of `cuda/kernels.cu`, embedded as PTX built ahead (`cuda/kernels.ptx`, compute_70;
//! the driver compiles it for the GPU at hand, so running needs no NVRTC).
//!
//! One stream; a forward launches every job's gate and up products, the gating, then the down
//! products (integer down projections after the gating's output is read back and quantised on the
//! host, as the Vulkan backend does) and waits for them with a timeout.
//!
//! Must never: touch the driver before checking that it can be loaded (cudarc panics when the
//! library is missing: this module answers "no CUDA driver" instead), or run on a device that
//! failed `device::self_test`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::cudaError_enum as CuError;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};

use crate::device::{self, Device, DeviceExpert, ExpertImage, GpuError, Job, MatrixLayout, WeightFormat};

const PTX: &str = include_str!("../cuda/kernels.ptx");
/// The kernels, in `Kernel` order.
const KERNELS: [&str; 8] = ["matvec_f32", "matvec_bf16", "matvec_f16", "matvec_fp8", "qmatvec_int8", "qmatvec_int4", "qmatvec_mxfp4", "swiglu"];

const SWIGLU: usize = 7;

fn kernel_of(format: WeightFormat) -> usize {
    match format {
        WeightFormat::F32 => 0,
        WeightFormat::Bf16 => 1,
        WeightFormat::F16 => 2,
        WeightFormat::Fp8 { .. } => 3,
        WeightFormat::Int8 => 4,
        WeightFormat::Int4 { .. } => 5,
        WeightFormat::Mxfp4 => 6,
    }
}

/// A CUDA device that passed the self-test.
pub struct CudaDevice {
    name: String,
    memory_bytes: u64,
    state: Mutex<State>,
}

struct State {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
    experts: HashMap<u64, CudaSlice<u8>>,
    next_handle: u64,
    timeout: Duration,
    lost: bool,
}

fn cuda_error(what: &str, e: DriverError) -> GpuError {
    match e.0 {
        CuError::CUDA_ERROR_OUT_OF_MEMORY => GpuError::OutOfMemory(format!("{what}: {e}")),
        // Sticky errors: the context is unusable from here on.
        CuError::CUDA_ERROR_ILLEGAL_ADDRESS
        | CuError::CUDA_ERROR_LAUNCH_FAILED
        | CuError::CUDA_ERROR_ECC_UNCORRECTABLE
        | CuError::CUDA_ERROR_HARDWARE_STACK_ERROR
        | CuError::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CuError::CUDA_ERROR_MISALIGNED_ADDRESS
        | CuError::CUDA_ERROR_INVALID_ADDRESS_SPACE
        | CuError::CUDA_ERROR_INVALID_PC
        | CuError::CUDA_ERROR_DEVICE_UNAVAILABLE => GpuError::Lost(format!("{what}: {e}")),
        _ => GpuError::Device(format!("{what}: {e}")),
    }
}

impl CudaDevice {
    /// GPU `ordinal`, with the kernels loaded and the self-test passed; "no CUDA driver" where
    /// the driver library cannot be loaded.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: loading the driver library to see whether it is there (its initialisers run).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::Unavailable("no CUDA driver (libcuda.so.1 cannot be loaded)".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| GpuError::Unavailable(format!("no CUDA device {ordinal}: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
        // SAFETY: the device handle is the context's own.
        let memory_bytes = unsafe { cudarc::driver::result::device::total_mem(ctx.cu_device()) }.unwrap_or(0) as u64;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).map_err(|e| cuda_error("loading the kernels' PTX", e))?;
        let functions = KERNELS.iter().map(|k| module.load_function(k).map_err(|e| cuda_error(k, e))).collect::<Result<Vec<_>, _>>()?;
        let stream = ctx.default_stream();
        let state = State { ctx, stream, _module: module, functions, experts: HashMap::new(), next_handle: 0, timeout: Duration::from_secs(30), lost: false };
        let device = CudaDevice { name: format!("{name} (CUDA, compute capability {major}.{minor})"), memory_bytes, state: Mutex::new(state) };
        device::self_test(&device)?;
        tracing::info!("CUDA device {} passed the bit-identity self-test", device.name);
        Ok(device)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn memory_bytes(&self) -> u64 {
        self.memory_bytes
    }

    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        let mut s = self.state();
        s.usable()?;
        let bytes = s.stream.memcpy_stod(&image.bytes).map_err(|e| s.note(cuda_error("uploading an expert", e)))?;
        s.next_handle += 1;
        let handle = s.next_handle;
        s.experts.insert(handle, bytes);
        Ok(DeviceExpert { handle, bytes: image.bytes.len() as u64, gate: image.gate, up: image.up, down: image.down })
    }

    fn release(&self, expert: DeviceExpert) {
        self.state().experts.remove(&expert.handle);
    }

    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut s = self.state();
        s.usable()?;
        let out = s.forward(jobs);
        out.map_err(|e| s.note(e))
    }
}

/// One job's buffers on the device.
struct Buffers {
    n: u32,
    x: CudaSlice<f32>,
    q: Option<(CudaSlice<i8>, CudaSlice<f32>)>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    y: CudaSlice<f32>,
}

impl State {
    fn usable(&self) -> Result<(), GpuError> {
        if self.lost {
            return Err(GpuError::Lost("an earlier submission lost the device".into()));
        }
        Ok(())
    }

    fn note(&mut self, e: GpuError) -> GpuError {
        if matches!(e, GpuError::Lost(_)) {
            self.lost = true;
        }
        e
    }

    /// Waits for the stream's work, at most `timeout`.
    fn wait(&self) -> Result<(), GpuError> {
        let event = self.ctx.new_event(None).map_err(|e| cuda_error("creating an event", e))?;
        event.record(&self.stream).map_err(|e| cuda_error("recording an event", e))?;
        let started = Instant::now();
        loop {
            // SAFETY: the event is alive for the loop.
            match unsafe { cudarc::driver::result::event::query(event.cu_event()) } {
                Ok(()) => return Ok(()),
                Err(DriverError(CuError::CUDA_ERROR_NOT_READY)) if started.elapsed() < self.timeout => std::thread::sleep(Duration::from_micros(20)),
                Err(DriverError(CuError::CUDA_ERROR_NOT_READY)) => return Err(GpuError::Timeout(self.timeout)),
                Err(e) => return Err(cuda_error("waiting for the device", e)),
            }
        }
    }

    fn weights(&self, job: &Job<'_>) -> Result<&CudaSlice<u8>, GpuError> {
        self.experts.get(&job.expert.handle).ok_or_else(|| GpuError::Device("a job names an expert not resident".into()))
    }

    fn forward(&mut self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let err = |what: &'static str| move |e: DriverError| cuda_error(what, e);
        let (mut q, mut d) = (Vec::new(), Vec::new());
        let mut buffers = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter().enumerate() {
            let (h, i) = (job.expert.hidden(), job.expert.intermediate());
            if h == 0 || !job.rows.len().is_multiple_of(h) || job.rows.len() / h > u16::MAX as usize {
                return Err(GpuError::Unsupported(format!("job {j}: {} values are not at most 65535 rows of {h}", job.rows.len())));
            }
            let n = job.rows.len() / h;
            let quantised = if job.expert.gate.format.is_integer() || job.expert.up.format.is_integer() {
                shimmer_kernels::qdot::quantize_plain(job.rows, h, &mut q, &mut d);
                Some((self.stream.memcpy_stod(&q).map_err(err("copying rows"))?, self.stream.memcpy_stod(&d).map_err(err("copying rows"))?))
            } else {
                None
            };
            buffers.push(Buffers {
                n: n as u32,
                x: self.stream.memcpy_stod(job.rows).map_err(err("copying rows"))?,
                q: quantised,
                g: self.stream.alloc_zeros::<f32>(n * i).map_err(err("allocating products"))?,
                u: self.stream.alloc_zeros::<f32>(n * i).map_err(err("allocating products"))?,
                y: self.stream.alloc_zeros::<f32>(n * h).map_err(err("allocating outputs"))?,
            });
        }
        for (job, b) in jobs.iter().zip(&mut buffers).filter(|(_, b)| b.n > 0) {
            let w = self.weights(job)?;
            let Buffers { x, q, g, u, n, .. } = b;
            self.matvec(w, &job.expert.gate, x, q.as_ref(), g, *n)?;
            self.matvec(w, &job.expert.up, x, q.as_ref(), u, *n)?;
        }
        for b in buffers.iter_mut().filter(|b| b.n > 0) {
            let width = (b.g.len() / b.n as usize) as u32;
            let cfg = LaunchConfig { grid_dim: (width.div_ceil(64), b.n, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
            let mut launch = self.stream.launch_builder(&self.functions[SWIGLU]);
            launch.arg(&mut b.g).arg(&b.u).arg(&width);
            // SAFETY: the kernel's parameters are (float* g, const float* u, unsigned width), g and u
            // hold n × width floats, and the grid covers exactly those.
            unsafe { launch.launch(cfg) }.map_err(err("launching the gating"))?;
        }
        for (job, b) in jobs.iter().zip(&mut buffers).filter(|(_, b)| b.n > 0) {
            let w = self.weights(job)?;
            let quantised = if job.expert.down.format.is_integer() {
                self.wait()?;
                let gated = self.stream.memcpy_dtov(&b.g).map_err(err("reading the gating back"))?;
                shimmer_kernels::qdot::quantize_plain(&gated, job.expert.intermediate(), &mut q, &mut d);
                Some((self.stream.memcpy_stod(&q).map_err(err("copying rows"))?, self.stream.memcpy_stod(&d).map_err(err("copying rows"))?))
            } else {
                None
            };
            let Buffers { g, y, n, .. } = b;
            self.matvec(w, &job.expert.down, g, quantised.as_ref(), y, *n)?;
        }
        self.wait()?;
        buffers.iter().map(|b| self.stream.memcpy_dtov(&b.y).map_err(err("reading the outputs"))).collect()
    }

    /// `m` over `n` rows: f32 rows `x` for the float formats, quantised rows `q` for the integer ones.
    fn matvec(
        &self,
        w: &CudaSlice<u8>,
        m: &MatrixLayout,
        x: &CudaSlice<f32>,
        q: Option<&(CudaSlice<i8>, CudaSlice<f32>)>,
        y: &mut CudaSlice<f32>,
        n: u32,
    ) -> Result<(), GpuError> {
        let (rows, cols) = (m.rows as u32, m.cols as u32);
        let values = w.slice(m.byte_offset..);
        let scales = w.slice(m.scales_offset..);
        let threads = if m.format.is_integer() { 32 } else { 64 };
        let cfg = LaunchConfig { grid_dim: (rows, n, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (group, block, row_block) = match m.format {
            WeightFormat::Int4 { group } => (group, 0, 0),
            WeightFormat::Fp8 { block, row_block } => (0, block, row_block),
            _ => (0, 0, 0),
        };
        let mut launch = self.stream.launch_builder(&self.functions[kernel_of(m.format)]);
        match m.format {
            WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::F16 => {
                launch.arg(&values).arg(x).arg(y).arg(&rows).arg(&cols);
            }
            WeightFormat::Fp8 { .. } => {
                launch.arg(&values).arg(&scales).arg(&block).arg(&row_block).arg(x).arg(y).arg(&rows).arg(&cols);
            }
            WeightFormat::Int8 | WeightFormat::Mxfp4 | WeightFormat::Int4 { .. } => {
                let (q, d) = q.ok_or_else(|| GpuError::Device("an integer matrix without quantised rows".into()))?;
                launch.arg(&values).arg(&scales);
                if let WeightFormat::Int4 { .. } = m.format {
                    launch.arg(&group);
                }
                launch.arg(q).arg(d).arg(y).arg(&rows).arg(&cols);
            }
        }
        // SAFETY: each kernel's parameter list is the one pushed for its format above
        // (cuda/kernels.cu); the expert's image holds the matrix and its scales at these offsets,
        // the rows and outputs hold n × cols and n × rows values, and the grid is (rows, n).
        unsafe { launch.launch(cfg) }.map(|_| ()).map_err(|e| cuda_error("launching a product", e))
    }
}
