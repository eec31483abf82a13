//! The Vulkan backend: experts in device buffers, computed by the compute shaders in `shaders/`
//! (SPIR-V built from the GLSL beside it and committed, so building needs no shader compiler).
//!
//! One queue, one command buffer, one fence: a `forward` records every job's gate and up products,
//! a barrier, the SwiGLU gating, a barrier, the down products and a barrier to the host, submits
//! once and waits with a timeout. Weights live in arenas (large buffers sub-allocated by
//! `crate::arena`), written through a mapping where device memory is host-visible (integrated
//! GPUs, lavapipe, resizable BAR) and through a staging copy otherwise.
//!
//! Must never: leave a submission's memory in use after returning an error for it (a timed-out
//! submission keeps the command buffer until its fence signals; later calls refuse until then),
//! or run on a device that failed `device::self_test`.

use std::sync::Mutex;
use std::time::Duration;

use ash::vk;

use crate::arena::Arena;
use crate::device::{self, Device, DeviceExpert, ExpertImage, GpuError, Job, MatrixLayout, WeightFormat};

/// The shaders with the device's `fma()`: matvec per float weight format (f32, bf16, f16),
/// SwiGLU, the integer matvec per format (int8, int4, MXFP4), and the fp8 matvec — indexed by
/// `pipeline_of`.
const SHADERS: [&[u8]; PIPELINES] = [
    include_bytes!("../../shaders/matvec_f32.spv"),
    include_bytes!("../../shaders/matvec_bf16.spv"),
    include_bytes!("../../shaders/matvec_f16.spv"),
    include_bytes!("../../shaders/swiglu.spv"),
    include_bytes!("../../shaders/qmatvec_int8.spv"),
    include_bytes!("../../shaders/qmatvec_int4.spv"),
    include_bytes!("../../shaders/qmatvec_mxfp4.spv"),
    include_bytes!("../../shaders/matvec_fp8.spv"),
];
/// The same with an exact fused multiply-add emulated through binary64 (`shaders/fma.glsl`).
const SHADERS_EXACT_FMA: [&[u8]; PIPELINES] = [
    include_bytes!("../../shaders/matvec_f32_exact.spv"),
    include_bytes!("../../shaders/matvec_bf16_exact.spv"),
    include_bytes!("../../shaders/matvec_f16_exact.spv"),
    include_bytes!("../../shaders/swiglu_exact.spv"),
    include_bytes!("../../shaders/qmatvec_int8_exact.spv"),
    include_bytes!("../../shaders/qmatvec_int4_exact.spv"),
    include_bytes!("../../shaders/qmatvec_mxfp4_exact.spv"),
    include_bytes!("../../shaders/matvec_fp8_exact.spv"),
];
const PIPELINES: usize = 8;
const SWIGLU: usize = 3;
/// Push constants: the largest shader's (the integer matvec's eight words).
const PUSH_BYTES: u32 = 32;
/// Descriptor sets per arena: gate and up from f32 rows, gate and up from quantised rows, down
/// from f32 rows, down from quantised rows (`SET_*` below).
const SETS_PER_ARENA: usize = 6;
const SET_GATE: usize = 0;
const SET_UP: usize = 1;
const SET_QGATE: usize = 2;
const SET_QUP: usize = 3;
const SET_DOWN: usize = 4;
const SET_QDOWN: usize = 5;

fn pipeline_of(format: WeightFormat) -> usize {
    match format {
        WeightFormat::F32 => 0,
        WeightFormat::Bf16 => 1,
        WeightFormat::F16 => 2,
        WeightFormat::Int8 => 4,
        WeightFormat::Int4 { .. } => 5,
        WeightFormat::Mxfp4 => 6,
        WeightFormat::Fp8 { .. } => 7,
    }
}

/// The largest arena; smaller where the device's storage-buffer range is smaller.
const ARENA_BYTES: u64 = 1 << 30;
/// Every expert starts on this boundary inside its arena.
const ARENA_ALIGN: u64 = 256;
/// The matvec shader's workgroup: one 64-lane dot product.
const LANES: u32 = 64;
/// A handle packs the arena's index above this many bits and the expert's offset below.
const HANDLE_OFFSET_BITS: u32 = 40;

/// How to open a device.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long a submission may run before it counts as a fault.
    pub timeout: Duration,
    /// Upload through a staging buffer even where device memory is host-visible (tests of the
    /// path discrete GPUs take).
    pub force_staging: bool,
    /// Which device, by its index among those with Vulkan 1.2 and a compute queue; the default
    /// prefers a discrete GPU, then integrated, then virtual, then a CPU driver (lavapipe).
    pub device_index: Option<usize>,
    /// Bytes per weight arena (capped by the device's storage-buffer range); small ones make
    /// tests spread experts over several.
    pub arena_bytes: u64,
    /// Run the bit-identity self-test before use (off only to diagnose a device that fails it).
    pub self_test: bool,
    /// How the shaders fuse multiply-adds.
    pub fma: Fma,
    /// Whether a driver that runs on the CPU (lavapipe) counts as a device: yes when asked for
    /// Vulkan by name, no for `--gpu auto` (it would only be slower than the CPU kernels).
    pub cpu_drivers: bool,
}

/// Which shaders compute the fused multiply-adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fma {
    /// The device's `fma()` if the self-test shows it fused, else the emulation if the device has
    /// binary64 (Mesa's lavapipe does not fuse; GPUs do).
    Auto,
    /// The device's `fma()`.
    Device,
    /// The binary64 emulation (needs `shaderFloat64`).
    Emulated,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_secs(30),
            force_staging: false,
            device_index: None,
            arena_bytes: ARENA_BYTES,
            self_test: true,
            fma: Fma::Auto,
            cpu_drivers: true,
        }
    }
}

/// A Vulkan device that passed the self-test.
pub struct VulkanDevice {
    name: String,
    memory_bytes: u64,
    state: Mutex<State>,
}

/// A device buffer with its memory and, when host-visible, its mapping.
struct Buffer {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    size: u64,
    mapped: Option<*mut u8>,
}

struct WeightArena {
    buffer: Buffer,
    ranges: Arena,
}

/// Everything that touches the device, behind one lock.
struct State {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    queue: vk::Queue,
    name: String,
    memory_types: vk::PhysicalDeviceMemoryProperties,
    /// Arenas are mapped and written directly (false: through `staging`).
    weights_mapped: bool,
    timeout: Duration,
    max_buffer: u64,
    arena_bytes: u64,
    max_groups: [u32; 2],
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    /// Whether the device has shaderFloat64 (enabled), and whether the pipelines emulate fma with it.
    float64: bool,
    exact_fma: bool,
    /// Matvec per weight format (f32, bf16, f16), then SwiGLU.
    pipelines: [vk::Pipeline; PIPELINES],
    shaders: [vk::ShaderModule; PIPELINES],
    descriptor_pool: vk::DescriptorPool,
    pool_sets: u32,
    command_pool: vk::CommandPool,
    commands: vk::CommandBuffer,
    fence: vk::Fence,
    /// A submission that timed out and may still be running: nothing is recorded until it ends.
    in_flight: bool,
    lost: bool,
    arenas: Vec<WeightArena>,
    /// Host-visible input rows (f32, and quantised), output rows, and the gate products read back
    /// and quantised for integer down projections; device-local gate and up products.
    x: Option<Buffer>,
    qx: Option<Buffer>,
    y: Option<Buffer>,
    gh: Option<Buffer>,
    qg: Option<Buffer>,
    g: Option<Buffer>,
    u: Option<Buffer>,
    staging: Option<Buffer>,
}

// SAFETY: the mapped pointers are only dereferenced while the `Mutex` around `State` is held,
// and Vulkan handles may be used from any thread when access to them is externally synchronised
// (which the same lock does).
unsafe impl Send for State {}

fn vk_error(what: &str, r: vk::Result) -> GpuError {
    match r {
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => GpuError::OutOfMemory(format!("{what}: {r}")),
        vk::Result::ERROR_DEVICE_LOST => GpuError::Lost(format!("{what}: {r}")),
        _ => GpuError::Device(format!("{what}: {r}")),
    }
}

fn device_rank(kind: vk::PhysicalDeviceType) -> u32 {
    match kind {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 3,
        _ => 4,
    }
}

/// Every device of the best kind present, as `Options::device_index` counts them: all the
/// discrete GPUs, else all the integrated ones, else the virtual ones, else (with
/// `cpu_drivers`) the drivers that run on the CPU — the devices `--gpu` spreads experts over.
pub fn best_devices(cpu_drivers: bool) -> Result<Vec<usize>, GpuError> {
    // SAFETY: as in `open_with`; the instance is destroyed before returning.
    unsafe {
        let entry = ash::Entry::load().map_err(|e| GpuError::Unavailable(format!("no Vulkan loader ({e}); install libvulkan1 and a driver")))?;
        let app = vk::ApplicationInfo::default().application_name(c"shimmer").engine_name(c"shimmer").api_version(vk::API_VERSION_1_2);
        let instance = entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None).map_err(|r| match r {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => GpuError::Unavailable("no Vulkan driver (ERROR_INCOMPATIBLE_DRIVER)".into()),
            r => vk_error("creating a Vulkan instance", r),
        })?;
        let usable = State::usable_devices(&instance, cpu_drivers);
        instance.destroy_instance(None);
        let ranks: Vec<u32> = usable?.iter().map(|(_, p, _)| device_rank(p.device_type)).collect();
        Ok(best_ranked(&ranks))
    }
}

/// The indices of the devices of the best (lowest) rank.
pub fn best_ranked(ranks: &[u32]) -> Vec<usize> {
    let best = ranks.iter().copied().min();
    ranks.iter().enumerate().filter(|(_, r)| Some(**r) == best).map(|(i, _)| i).collect()
}

fn version(v: u32) -> String {
    format!("{}.{}.{}", vk::api_version_major(v), vk::api_version_minor(v), vk::api_version_patch(v))
}

impl VulkanDevice {
    /// The preferred device with default options.
    pub fn open() -> Result<Self, GpuError> {
        Self::open_with(&Options::default())
    }

    /// Loads the system's Vulkan loader, picks a device, builds the pipelines and runs the
    /// self-test; any failure says which step and why.
    pub fn open_with(options: &Options) -> Result<Self, GpuError> {
        // SAFETY: loading the loader library runs its initialisers; the Vulkan loader is built to
        // be loaded this way.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| GpuError::Unavailable(format!("no Vulkan loader ({e}); install libvulkan1 and a driver")))?;
        // SAFETY: `entry` is a loaded loader; every handle created below is destroyed in
        // `State::drop` or on the error path that created it.
        let mut state = unsafe { State::new(entry, options)? };
        let float64 = state.float64;
        if options.fma == Fma::Emulated {
            if !float64 {
                return Err(GpuError::Unavailable(format!("{}: no shaderFloat64, so no emulated fma", state.name)));
            }
            // SAFETY: nothing is in flight yet.
            unsafe { state.load_pipelines(true)? };
        }
        let (name, memory_bytes) = (state.name.clone(), state.device_local_bytes());
        let mut device = VulkanDevice { name, memory_bytes, state: Mutex::new(state) };
        if options.self_test {
            match device::self_test(&device) {
                Err(GpuError::NotBitIdentical(why)) if options.fma == Fma::Auto && float64 => {
                    tracing::info!("{why}; trying the shaders with an emulated fma");
                    // SAFETY: the self-test's submission has finished (or failed) by now.
                    unsafe { device.state().load_pipelines(true)? };
                    device::self_test(&device)?;
                }
                other => other?,
            }
            tracing::info!("Vulkan device {} passed the bit-identity self-test", device.name);
        }
        if device.state().exact_fma {
            device.name.push_str(", fma emulated through binary64");
        }
        Ok(device)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves the state as consistent as any Vulkan error
        // would; the next call checks `lost` and `in_flight` as usual.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Device for VulkanDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn memory_bytes(&self) -> u64 {
        self.memory_bytes
    }

    fn upload(&self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        // SAFETY: the state's handles are valid while it lives, and the lock is held.
        unsafe { self.state().upload(image) }
    }

    fn release(&self, expert: DeviceExpert) {
        self.state().release(&expert);
    }

    fn forward(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        // SAFETY: as for `upload`.
        unsafe { self.state().forward(jobs) }
    }
}

impl State {
    unsafe fn new(entry: ash::Entry, options: &Options) -> Result<Self, GpuError> {
        let loader_version = entry.try_enumerate_instance_version().ok().flatten().unwrap_or(vk::API_VERSION_1_0);
        if loader_version < vk::API_VERSION_1_2 {
            return Err(GpuError::Unavailable(format!("the Vulkan loader offers {}, shimmer needs 1.2", version(loader_version))));
        }
        let app = vk::ApplicationInfo::default().application_name(c"shimmer").engine_name(c"shimmer").api_version(vk::API_VERSION_1_2);
        let instance = entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None).map_err(|r| match r {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => GpuError::Unavailable("no Vulkan driver (ERROR_INCOMPATIBLE_DRIVER)".into()),
            r => vk_error("creating a Vulkan instance", r),
        })?;
        let picked = Self::pick(&instance, options).and_then(|(pd, props, family, name)| {
            let priorities = [1.0f32];
            let queue_info = vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&priorities);
            // binary64 only for the fma emulation, where the device has it.
            let float64 = instance.get_physical_device_features(pd).shader_float64 == vk::TRUE;
            let features = vk::PhysicalDeviceFeatures::default().shader_float64(float64);
            let info = vk::DeviceCreateInfo::default().queue_create_infos(std::slice::from_ref(&queue_info)).enabled_features(&features);
            let device = instance.create_device(pd, &info, None).map_err(|r| vk_error("creating the Vulkan device", r))?;
            Ok((pd, props, family, name, device, float64))
        });
        let (pd, props, family, name, device, float64) = match picked {
            Ok(p) => p,
            Err(e) => {
                instance.destroy_instance(None);
                return Err(e);
            }
        };
        let queue = device.get_device_queue(family, 0);
        let memory_types = instance.get_physical_device_memory_properties(pd);
        let limits = props.limits;
        let max_buffer = (limits.max_storage_buffer_range as u64).min(ARENA_BYTES);
        let mut state = State {
            _entry: entry,
            instance,
            device,
            queue,
            name,
            memory_types,
            weights_mapped: false,
            float64,
            exact_fma: false,
            timeout: options.timeout,
            max_buffer,
            arena_bytes: options.arena_bytes.min(max_buffer) / ARENA_ALIGN * ARENA_ALIGN,
            max_groups: [limits.max_compute_work_group_count[0], limits.max_compute_work_group_count[1]],
            set_layout: vk::DescriptorSetLayout::null(),
            pipeline_layout: vk::PipelineLayout::null(),
            pipelines: [vk::Pipeline::null(); PIPELINES],
            shaders: [vk::ShaderModule::null(); PIPELINES],
            descriptor_pool: vk::DescriptorPool::null(),
            pool_sets: 0,
            command_pool: vk::CommandPool::null(),
            commands: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
            in_flight: false,
            lost: false,
            arenas: Vec::new(),
            x: None,
            qx: None,
            y: None,
            gh: None,
            qg: None,
            g: None,
            u: None,
            staging: None,
        };
        // From here `state`'s Drop destroys whatever was created, on success or error (destroying
        // a null handle does nothing).
        state.weights_mapped = !options.force_staging && state.device_local_is_host_visible();
        state.build(family)?;
        Ok(state)
    }

    /// The device to use, its properties, its compute queue family and its banner name.
    /// The devices `Options::device_index` counts: Vulkan 1.2, a compute queue, and not a driver
    /// that runs on the CPU unless `cpu_drivers`; each with its compute queue family.
    unsafe fn usable_devices(instance: &ash::Instance, cpu_drivers: bool) -> Result<Vec<(vk::PhysicalDevice, vk::PhysicalDeviceProperties, u32)>, GpuError> {
        let physical = instance.enumerate_physical_devices().map_err(|r| vk_error("listing Vulkan devices", r))?;
        let mut usable = Vec::new();
        for pd in physical {
            let props = instance.get_physical_device_properties(pd);
            if props.api_version < vk::API_VERSION_1_2 {
                continue;
            }
            let families = instance.get_physical_device_queue_family_properties(pd);
            if !cpu_drivers && props.device_type == vk::PhysicalDeviceType::CPU {
                continue;
            }
            if let Some(family) = families.iter().position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE)) {
                usable.push((pd, props, family as u32));
            }
        }
        Ok(usable)
    }

    unsafe fn pick(instance: &ash::Instance, options: &Options) -> Result<(vk::PhysicalDevice, vk::PhysicalDeviceProperties, u32, String), GpuError> {
        let usable = Self::usable_devices(instance, options.cpu_drivers)?;
        let chosen = match options.device_index {
            Some(i) => usable.get(i).copied().ok_or_else(|| GpuError::Unavailable(format!("no Vulkan 1.2 device {i} (there are {})", usable.len())))?,
            None => usable.iter().copied().min_by_key(|(_, p, _)| device_rank(p.device_type)).ok_or_else(|| {
                GpuError::Unavailable(if options.cpu_drivers {
                    "no Vulkan 1.2 device with a compute queue".into()
                } else {
                    "no Vulkan 1.2 GPU (drivers that run on the CPU, such as lavapipe, are used only with --gpu vulkan)".into()
                })
            })?,
        };
        let (pd, props, family) = chosen;
        let mut v12 = vk::PhysicalDeviceVulkan12Properties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut v12);
        instance.get_physical_device_properties2(pd, &mut props2);
        let device_name = props.device_name_as_c_str().unwrap_or(c"?").to_string_lossy().into_owned();
        if v12.shader_signed_zero_inf_nan_preserve_float32 == vk::FALSE {
            // The shaders declare SignedZeroInfNanPreserve; without it a driver may fold away
            // −0, infinities and NaNs that the CPU keeps.
            return Err(GpuError::NotBitIdentical(format!("{device_name} cannot preserve signed zeros, infinities and NaNs in shaders")));
        }
        let driver = v12.driver_name_as_c_str().unwrap_or(c"?").to_string_lossy().into_owned();
        let info = v12.driver_info_as_c_str().unwrap_or(c"").to_string_lossy().into_owned();
        let name = format!("{device_name} (Vulkan {}, {driver} {info})", version(props.api_version));
        Ok((pd, props, family, name.trim_end().replace(" )", ")")))
    }

    unsafe fn build(&mut self, family: u32) -> Result<(), GpuError> {
        let d = &self.device;
        let bindings: Vec<_> = (0..3)
            .map(|b| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        self.set_layout = d
            .create_descriptor_set_layout(&vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings), None)
            .map_err(|r| vk_error("creating the descriptor set layout", r))?;
        let push = vk::PushConstantRange { stage_flags: vk::ShaderStageFlags::COMPUTE, offset: 0, size: PUSH_BYTES };
        self.pipeline_layout = d
            .create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().set_layouts(std::slice::from_ref(&self.set_layout)).push_constant_ranges(std::slice::from_ref(&push)),
                None,
            )
            .map_err(|r| vk_error("creating the pipeline layout", r))?;
        self.load_pipelines(false)?;
        let d = &self.device;
        self.command_pool = d
            .create_command_pool(&vk::CommandPoolCreateInfo::default().queue_family_index(family).flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER), None)
            .map_err(|r| vk_error("creating a command pool", r))?;
        self.commands = d
            .allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default().command_pool(self.command_pool).level(vk::CommandBufferLevel::PRIMARY).command_buffer_count(1),
            )
            .map_err(|r| vk_error("allocating a command buffer", r))?[0];
        self.fence = d.create_fence(&vk::FenceCreateInfo::default(), None).map_err(|r| vk_error("creating a fence", r))?;
        Ok(())
    }

    /// (Re)builds the pipelines from the shaders with the device's fma or the emulated one.
    unsafe fn load_pipelines(&mut self, exact_fma: bool) -> Result<(), GpuError> {
        let d = &self.device;
        for i in 0..PIPELINES {
            d.destroy_pipeline(std::mem::take(&mut self.pipelines[i]), None);
            d.destroy_shader_module(std::mem::take(&mut self.shaders[i]), None);
        }
        let sources = if exact_fma { SHADERS_EXACT_FMA } else { SHADERS };
        for (i, spv) in sources.into_iter().enumerate() {
            let words = ash::util::read_spv(&mut std::io::Cursor::new(spv)).map_err(|e| GpuError::Device(format!("a built-in shader is not SPIR-V: {e}")))?;
            self.shaders[i] = d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None).map_err(|r| vk_error("loading a shader", r))?;
            let stage = vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(self.shaders[i]).name(c"main");
            let info = vk::ComputePipelineCreateInfo::default().stage(stage).layout(self.pipeline_layout);
            self.pipelines[i] =
                d.create_compute_pipelines(vk::PipelineCache::null(), &[info], None).map_err(|(_, r)| vk_error("building a compute pipeline", r))?[0];
        }
        self.exact_fma = exact_fma;
        Ok(())
    }

    /// The largest device-local heap.
    fn device_local_bytes(&self) -> u64 {
        let m = &self.memory_types;
        m.memory_heaps[..m.memory_heap_count as usize].iter().filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL)).map(|h| h.size).max().unwrap_or(0)
    }

    /// Whether the largest device-local heap can also be mapped (so weights need no staging).
    fn device_local_is_host_visible(&self) -> bool {
        let m = &self.memory_types;
        let largest = self.device_local_bytes();
        let want = vk::MemoryPropertyFlags::DEVICE_LOCAL | vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        m.memory_types[..m.memory_type_count as usize].iter().any(|t| t.property_flags.contains(want) && m.memory_heaps[t.heap_index as usize].size == largest)
    }

    /// The first memory type allowed by `bits` with every flag of `want`.
    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        let m = &self.memory_types;
        (0..m.memory_type_count).find(|&i| bits & (1 << i) != 0 && m.memory_types[i as usize].property_flags.contains(want))
    }

    /// A storage buffer of `size` bytes in memory with `want` (the first of the choices the
    /// device has), mapped when host-visible.
    unsafe fn buffer(&self, size: u64, choices: &[vk::MemoryPropertyFlags], what: &str) -> Result<Buffer, GpuError> {
        let d = &self.device;
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST | vk::BufferUsageFlags::TRANSFER_SRC;
        let buffer = d
            .create_buffer(&vk::BufferCreateInfo::default().size(size).usage(usage).sharing_mode(vk::SharingMode::EXCLUSIVE), None)
            .map_err(|r| vk_error(what, r))?;
        let req = d.get_buffer_memory_requirements(buffer);
        let Some((type_index, flags)) = choices.iter().find_map(|&f| self.memory_type(req.memory_type_bits, f).map(|i| (i, f))) else {
            d.destroy_buffer(buffer, None);
            return Err(GpuError::Device(format!("{what}: no suitable memory type")));
        };
        let memory = match d.allocate_memory(&vk::MemoryAllocateInfo::default().allocation_size(req.size).memory_type_index(type_index), None) {
            Ok(m) => m,
            Err(r) => {
                d.destroy_buffer(buffer, None);
                return Err(vk_error(what, r));
            }
        };
        let mut out = Buffer { buffer, memory, size, mapped: None };
        if let Err(r) = d.bind_buffer_memory(buffer, memory, 0) {
            self.destroy(&out);
            return Err(vk_error(what, r));
        }
        if flags.contains(vk::MemoryPropertyFlags::HOST_VISIBLE) {
            match d.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) {
                Ok(p) => out.mapped = Some(p.cast()),
                Err(r) => {
                    self.destroy(&out);
                    return Err(vk_error(what, r));
                }
            }
        }
        Ok(out)
    }

    unsafe fn destroy(&self, b: &Buffer) {
        self.device.destroy_buffer(b.buffer, None);
        self.device.free_memory(b.memory, None);
    }

    /// Makes `slot` hold at least `size` bytes (grow-only; the old buffer is idle between
    /// submissions, so it can go).
    unsafe fn ensure(&mut self, which: Scratch, size: u64) -> Result<(), GpuError> {
        let have = self.scratch(which).as_ref().map_or(0, |b| b.size);
        if have >= size {
            return Ok(());
        }
        if size > self.max_buffer {
            return Err(GpuError::Unsupported(format!("a submission needs a {size}-byte buffer; the device binds at most {}", self.max_buffer)));
        }
        if let Some(old) = self.scratch(which).take() {
            self.destroy(&old);
        }
        let size = size.next_power_of_two().min(self.max_buffer).max(size);
        let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let choices: &[vk::MemoryPropertyFlags] = match which {
            Scratch::X | Scratch::Qx | Scratch::Y | Scratch::Gh | Scratch::Qg | Scratch::Staging => &[host | vk::MemoryPropertyFlags::HOST_CACHED, host],
            Scratch::G | Scratch::U => &[vk::MemoryPropertyFlags::DEVICE_LOCAL, vk::MemoryPropertyFlags::empty()],
        };
        let b = self.buffer(size, choices, "allocating scratch memory")?;
        *self.scratch(which) = Some(b);
        Ok(())
    }

    fn scratch(&mut self, which: Scratch) -> &mut Option<Buffer> {
        match which {
            Scratch::X => &mut self.x,
            Scratch::Qx => &mut self.qx,
            Scratch::Y => &mut self.y,
            Scratch::Gh => &mut self.gh,
            Scratch::Qg => &mut self.qg,
            Scratch::G => &mut self.g,
            Scratch::U => &mut self.u,
            Scratch::Staging => &mut self.staging,
        }
    }

    /// Refuses work while the device is lost or a timed-out submission still runs.
    unsafe fn usable(&mut self) -> Result<(), GpuError> {
        if self.lost {
            return Err(GpuError::Lost("an earlier submission lost the device".into()));
        }
        if self.in_flight {
            match self.device.get_fence_status(self.fence) {
                Ok(true) => {
                    self.device.reset_fences(&[self.fence]).map_err(|r| vk_error("resetting a fence", r))?;
                    self.in_flight = false;
                }
                Ok(false) => return Err(GpuError::Timeout(self.timeout)),
                Err(r) => return Err(self.note(vk_error("polling a fence", r))),
            }
        }
        Ok(())
    }

    fn note(&mut self, e: GpuError) -> GpuError {
        if matches!(e, GpuError::Lost(_)) {
            self.lost = true;
        }
        e
    }

    /// Submits the recorded command buffer and waits for it.
    unsafe fn submit_and_wait(&mut self) -> Result<(), GpuError> {
        let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&self.commands));
        if let Err(r) = self.device.queue_submit(self.queue, &[submit], self.fence) {
            return Err(self.note(vk_error("submitting work", r)));
        }
        let nanos = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        match self.device.wait_for_fences(&[self.fence], true, nanos) {
            Ok(()) => {
                self.device.reset_fences(&[self.fence]).map_err(|r| vk_error("resetting a fence", r))?;
                Ok(())
            }
            Err(vk::Result::TIMEOUT) => {
                self.in_flight = true;
                Err(GpuError::Timeout(self.timeout))
            }
            Err(r) => Err(self.note(vk_error("waiting for the device", r))),
        }
    }

    unsafe fn begin(&self) -> Result<(), GpuError> {
        self.device.reset_command_buffer(self.commands, vk::CommandBufferResetFlags::empty()).map_err(|r| vk_error("resetting commands", r))?;
        self.device
            .begin_command_buffer(self.commands, &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT))
            .map_err(|r| vk_error("recording commands", r))
    }

    unsafe fn upload(&mut self, image: &ExpertImage) -> Result<DeviceExpert, GpuError> {
        self.usable()?;
        let len = image.bytes.len() as u64;
        let arena_size = self.arena_bytes;
        if len > arena_size {
            return Err(GpuError::Unsupported(format!("an expert of {len} bytes exceeds the {arena_size}-byte arenas (the device's buffer range)")));
        }
        let found = self.arenas.iter_mut().enumerate().find_map(|(i, a)| a.ranges.allocate(len).map(|o| (i, o)));
        let (index, offset) = match found {
            Some(found) => found,
            None => {
                let choices = if self.weights_mapped {
                    [vk::MemoryPropertyFlags::DEVICE_LOCAL | vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT]
                } else {
                    [vk::MemoryPropertyFlags::DEVICE_LOCAL]
                };
                let buffer = self.buffer(arena_size, &choices, "allocating an expert arena")?;
                let mut ranges = Arena::new(arena_size, ARENA_ALIGN);
                let offset = ranges.allocate(len).expect("an empty arena holds an expert no larger than it");
                self.arenas.push(WeightArena { buffer, ranges });
                (self.arenas.len() - 1, offset)
            }
        };
        let written = self.write_weights(index, offset, &image.bytes);
        if let Err(e) = written {
            self.arenas[index].ranges.release(offset, len);
            return Err(e);
        }
        let shift = |m: &MatrixLayout| MatrixLayout {
            byte_offset: m.byte_offset + offset as usize,
            scales_offset: if m.format.has_scales() { m.scales_offset + offset as usize } else { 0 },
            ..*m
        };
        Ok(DeviceExpert {
            handle: ((index as u64) << HANDLE_OFFSET_BITS) | offset,
            bytes: len,
            gate: shift(&image.gate),
            up: shift(&image.up),
            down: shift(&image.down),
        })
    }

    unsafe fn write_weights(&mut self, index: usize, offset: u64, bytes: &[u8]) -> Result<(), GpuError> {
        if let Some(p) = self.arenas[index].buffer.mapped {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(offset as usize), bytes.len());
            return Ok(());
        }
        self.ensure(Scratch::Staging, bytes.len() as u64)?;
        let staging = self.staging.as_ref().expect("ensured");
        let (src, ptr) = (staging.buffer, staging.mapped.expect("staging memory is host-visible"));
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len());
        self.begin()?;
        let region = vk::BufferCopy { src_offset: 0, dst_offset: offset, size: bytes.len() as u64 };
        self.device.cmd_copy_buffer(self.commands, src, self.arenas[index].buffer.buffer, &[region]);
        let barrier = vk::MemoryBarrier::default().src_access_mask(vk::AccessFlags::TRANSFER_WRITE).dst_access_mask(vk::AccessFlags::SHADER_READ);
        self.device.cmd_pipeline_barrier(
            self.commands,
            vk::PipelineStageFlags::TRANSFER,
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::DependencyFlags::empty(),
            &[barrier],
            &[],
            &[],
        );
        self.device.end_command_buffer(self.commands).map_err(|r| vk_error("recording commands", r))?;
        self.submit_and_wait()
    }

    fn release(&mut self, expert: &DeviceExpert) {
        let index = (expert.handle >> HANDLE_OFFSET_BITS) as usize;
        let offset = expert.handle & ((1 << HANDLE_OFFSET_BITS) - 1);
        let arena = self.arenas.get_mut(index).expect("a device expert's handle names one of this device's arenas");
        arena.ranges.release(offset, expert.bytes);
    }

    unsafe fn forward(&mut self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.usable()?;
        let plan = Plan::of(jobs, self.max_groups, self.max_buffer)?;
        if plan.x_floats == 0 {
            return Ok(jobs.iter().map(|_| Vec::new()).collect());
        }
        let bytes = |words: u64| (words * 4).max(16);
        self.ensure(Scratch::X, bytes(plan.x_floats))?;
        self.ensure(Scratch::Qx, bytes(plan.qx_words))?;
        self.ensure(Scratch::Y, bytes(plan.x_floats))?;
        self.ensure(Scratch::G, bytes(plan.g_floats))?;
        self.ensure(Scratch::U, bytes(plan.g_floats))?;
        self.ensure(Scratch::Gh, bytes(plan.g_floats))?;
        self.ensure(Scratch::Qg, bytes(plan.qg_words))?;
        let host = |b: &Option<Buffer>| b.as_ref().and_then(|b| b.mapped).expect("scratch is host-visible").cast::<u32>();
        let (xp, qxp, yp, ghp, qgp) = (host(&self.x), host(&self.qx), host(&self.y), host(&self.gh), host(&self.qg));
        // The rows: as they are for float matrices, quantised by the CPU's own quantiser for
        // integer ones (so the device never divides).
        let (mut q, mut scales) = (Vec::new(), Vec::new());
        for (job, p) in jobs.iter().zip(&plan.places) {
            std::ptr::copy_nonoverlapping(job.rows.as_ptr().cast::<u32>(), xp.add(p.x as usize), job.rows.len());
            if job.expert.gate.format.is_integer() || job.expert.up.format.is_integer() {
                shimmer_kernels::qdot::quantize_plain(job.rows, job.expert.hidden(), &mut q, &mut scales);
                write_quantised(qxp, p.qx, p.qxs, &q, &scales);
            }
        }
        let sets = self.descriptor_sets(jobs)?;
        let set_of = |job: &Job<'_>, k: usize| sets.arena_set(job.expert.handle >> HANDLE_OFFSET_BITS, k);

        // Gate and up, the gating; then (one submission) the down projections, unless some
        // down projection is integer: its input, the gating's output, is read back and quantised
        // on the host first, and the down projections are a second submission.
        self.begin()?;
        for (job, p) in jobs.iter().zip(&plan.places).filter(|(_, p)| p.n > 0) {
            for (m, float_set, int_set, out) in [(&job.expert.gate, SET_GATE, SET_QGATE, p.g), (&job.expert.up, SET_UP, SET_QUP, p.g)] {
                if m.format.is_integer() {
                    self.record_qmatvec(m, set_of(job, int_set), p.qx, p.qxs, out, p.n);
                } else {
                    self.record_matvec(m, set_of(job, float_set), p.x, out, p.n);
                }
            }
        }
        self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE);
        let d = &self.device;
        d.cmd_bind_pipeline(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipelines[SWIGLU]);
        d.cmd_bind_descriptor_sets(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipeline_layout, 0, &[sets.swiglu], &[]);
        for (job, p) in jobs.iter().zip(&plan.places).filter(|(_, p)| p.n > 0) {
            let width = job.expert.intermediate() as u32;
            d.cmd_push_constants(self.commands, self.pipeline_layout, vk::ShaderStageFlags::COMPUTE, 0, as_bytes(&[p.g, width, 0, 0, 0, 0, 0, 0]));
            d.cmd_dispatch(self.commands, width.div_ceil(LANES), p.n, 1);
        }
        let quantised_down = jobs.iter().any(|j| j.expert.down.format.is_integer());
        if quantised_down {
            // The gating's output to the host, for the jobs whose down projection is integer.
            self.barrier(vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_READ);
            let regions: Vec<vk::BufferCopy> = jobs
                .iter()
                .zip(&plan.places)
                .filter(|(j, p)| p.n > 0 && j.expert.down.format.is_integer())
                .map(|(j, p)| {
                    let at = p.g as u64 * 4;
                    vk::BufferCopy { src_offset: at, dst_offset: at, size: (p.n as usize * j.expert.intermediate()) as u64 * 4 }
                })
                .collect();
            let (g, gh) = (self.g.as_ref().expect("ensured").buffer, self.gh.as_ref().expect("ensured").buffer);
            self.device.cmd_copy_buffer(self.commands, g, gh, &regions);
            let b = vk::MemoryBarrier::default().src_access_mask(vk::AccessFlags::TRANSFER_WRITE).dst_access_mask(vk::AccessFlags::HOST_READ);
            self.device.cmd_pipeline_barrier(
                self.commands,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[b],
                &[],
                &[],
            );
            self.device.end_command_buffer(self.commands).map_err(|r| vk_error("recording commands", r))?;
            self.submit_and_wait()?;
            let mut gated = Vec::new();
            for (job, p) in jobs.iter().zip(&plan.places).filter(|(j, p)| p.n > 0 && j.expert.down.format.is_integer()) {
                let len = p.n as usize * job.expert.intermediate();
                gated.resize(len, 0.0f32);
                std::ptr::copy_nonoverlapping(ghp.add(p.g as usize).cast::<f32>(), gated.as_mut_ptr(), len);
                shimmer_kernels::qdot::quantize_plain(&gated, job.expert.intermediate(), &mut q, &mut scales);
                write_quantised(qgp, p.qg, p.qgs, &q, &scales);
            }
            self.begin()?;
        } else {
            self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_READ);
        }
        for (job, p) in jobs.iter().zip(&plan.places).filter(|(_, p)| p.n > 0) {
            let m = &job.expert.down;
            if m.format.is_integer() {
                self.record_qmatvec(m, set_of(job, SET_QDOWN), p.qg, p.qgs, p.y, p.n);
            } else {
                self.record_matvec(m, set_of(job, SET_DOWN), p.g, p.y, p.n);
            }
        }
        self.barrier(vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ);
        self.device.end_command_buffer(self.commands).map_err(|r| vk_error("recording commands", r))?;
        self.submit_and_wait()?;
        Ok(jobs
            .iter()
            .zip(&plan.places)
            .map(|(job, p)| {
                let len = job.rows.len();
                let mut out = vec![0.0f32; len];
                std::ptr::copy_nonoverlapping(yp.add(p.y as usize).cast::<f32>(), out.as_mut_ptr(), len);
                out
            })
            .collect())
    }

    /// A memory barrier from compute shader writes to `dst_stage`'s `dst` accesses.
    unsafe fn barrier(&self, dst_stage: vk::PipelineStageFlags, dst: vk::AccessFlags) {
        let b = vk::MemoryBarrier::default().src_access_mask(vk::AccessFlags::SHADER_WRITE).dst_access_mask(dst);
        self.device.cmd_pipeline_barrier(self.commands, vk::PipelineStageFlags::COMPUTE_SHADER, dst_stage, vk::DependencyFlags::empty(), &[b], &[], &[]);
    }

    /// `m` over `n` f32 rows at `input` (floats), into `output` (floats).
    unsafe fn record_matvec(&self, m: &MatrixLayout, set: vk::DescriptorSet, input: u32, output: u32, n: u32) {
        let d = &self.device;
        d.cmd_bind_pipeline(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipelines[pipeline_of(m.format)]);
        d.cmd_bind_descriptor_sets(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipeline_layout, 0, &[set], &[]);
        let (scales, block, row_block) = match m.format {
            WeightFormat::Fp8 { block, row_block } => ((m.scales_offset / 4) as u32, block, row_block),
            _ => (0, 1, 1),
        };
        let push = [m.element_offset() as u32, m.rows as u32, m.cols as u32, input, output, scales, block, row_block];
        d.cmd_push_constants(self.commands, self.pipeline_layout, vk::ShaderStageFlags::COMPUTE, 0, as_bytes(&push));
        d.cmd_dispatch(self.commands, m.rows as u32, n, 1);
    }

    /// `m` (an integer format) over `n` quantised rows at word `input` with their block scales
    /// at word `scales`, into `output` (floats).
    unsafe fn record_qmatvec(&self, m: &MatrixLayout, set: vk::DescriptorSet, input: u32, scales: u32, output: u32, n: u32) {
        let d = &self.device;
        d.cmd_bind_pipeline(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipelines[pipeline_of(m.format)]);
        d.cmd_bind_descriptor_sets(self.commands, vk::PipelineBindPoint::COMPUTE, self.pipeline_layout, 0, &[set], &[]);
        let group = match m.format {
            WeightFormat::Int4 { group } => group,
            _ => 32,
        };
        let push = [m.byte_offset as u32, m.scales_offset as u32, m.rows as u32, m.cols as u32, group, input, scales, output];
        d.cmd_push_constants(self.commands, self.pipeline_layout, vk::ShaderStageFlags::COMPUTE, 0, as_bytes(&push));
        d.cmd_dispatch(self.commands, m.rows as u32, n, 1);
    }

    /// This submission's descriptor sets: `SETS_PER_ARENA` for each arena its jobs use, and the
    /// gating's.
    unsafe fn descriptor_sets(&mut self, jobs: &[Job<'_>]) -> Result<Sets, GpuError> {
        let mut arenas: Vec<u64> = jobs.iter().map(|j| j.expert.handle >> HANDLE_OFFSET_BITS).collect();
        arenas.sort_unstable();
        arenas.dedup();
        let wanted = (SETS_PER_ARENA * arenas.len() + 1) as u32;
        self.ensure_descriptor_pool(wanted)?;
        let d = &self.device;
        d.reset_descriptor_pool(self.descriptor_pool, vk::DescriptorPoolResetFlags::empty()).map_err(|r| vk_error("resetting descriptors", r))?;
        let layouts = vec![self.set_layout; wanted as usize];
        let sets = d
            .allocate_descriptor_sets(&vk::DescriptorSetAllocateInfo::default().descriptor_pool(self.descriptor_pool).set_layouts(&layouts))
            .map_err(|r| vk_error("allocating descriptors", r))?;
        let b = |o: &Option<Buffer>| o.as_ref().expect("ensured").buffer;
        let (x, qx, g, u, qg, y) = (b(&self.x), b(&self.qx), b(&self.g), b(&self.u), b(&self.qg), b(&self.y));
        let mut triples: Vec<[vk::Buffer; 3]> = Vec::new();
        for &a in &arenas {
            let w = self.arenas[a as usize].buffer.buffer;
            // In SET_* order.
            triples.extend([[w, x, g], [w, x, u], [w, qx, g], [w, qx, u], [w, g, y], [w, qg, y]]);
        }
        triples.push([g, u, y]);
        let infos: Vec<[vk::DescriptorBufferInfo; 3]> =
            triples.iter().map(|t| t.map(|buffer| vk::DescriptorBufferInfo { buffer, offset: 0, range: vk::WHOLE_SIZE })).collect();
        let writes: Vec<vk::WriteDescriptorSet> = sets
            .iter()
            .zip(&infos)
            .flat_map(|(&set, info)| {
                (0..3).map(move |b| {
                    vk::WriteDescriptorSet::default()
                        .dst_set(set)
                        .dst_binding(b as u32)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .buffer_info(std::slice::from_ref(&info[b]))
                })
            })
            .collect();
        d.update_descriptor_sets(&writes, &[]);
        Ok(Sets { swiglu: sets[sets.len() - 1], arenas, sets })
    }

    unsafe fn ensure_descriptor_pool(&mut self, sets: u32) -> Result<(), GpuError> {
        if self.pool_sets >= sets {
            return Ok(());
        }
        if self.descriptor_pool != vk::DescriptorPool::null() {
            self.device.destroy_descriptor_pool(self.descriptor_pool, None);
            self.descriptor_pool = vk::DescriptorPool::null();
            self.pool_sets = 0;
        }
        let sets = sets.next_power_of_two().max(16);
        let sizes = [vk::DescriptorPoolSize { ty: vk::DescriptorType::STORAGE_BUFFER, descriptor_count: 3 * sets }];
        self.descriptor_pool = self
            .device
            .create_descriptor_pool(&vk::DescriptorPoolCreateInfo::default().max_sets(sets).pool_sizes(&sizes), None)
            .map_err(|r| vk_error("creating a descriptor pool", r))?;
        self.pool_sets = sets;
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Scratch {
    X,
    Qx,
    Y,
    Gh,
    Qg,
    G,
    U,
    Staging,
}

/// The descriptor sets of one submission.
struct Sets {
    arenas: Vec<u64>,
    sets: Vec<vk::DescriptorSet>,
    swiglu: vk::DescriptorSet,
}

impl Sets {
    fn arena_set(&self, arena: u64, k: usize) -> vk::DescriptorSet {
        self.sets[SETS_PER_ARENA * self.arenas.binary_search(&arena).expect("every job's arena has sets") + k]
    }
}

/// Where one job's rows, products and outputs lie in the scratch buffers (in 4-byte words).
struct Place {
    n: u32,
    /// f32 rows in X, and the outputs at the same offset in Y.
    x: u32,
    y: u32,
    /// Quantised rows and their block scales in QX (for integer gate and up projections).
    qx: u32,
    qxs: u32,
    /// Gate (and, at the same offset, up) products in G and U.
    g: u32,
    /// The gating's output quantised in QG, and its block scales (integer down projections).
    qg: u32,
    qgs: u32,
}

/// The scratch layout of a submission, checked against the device's limits.
struct Plan {
    places: Vec<Place>,
    x_floats: u64,
    g_floats: u64,
    qx_words: u64,
    qg_words: u64,
}

impl Plan {
    fn of(jobs: &[Job<'_>], max_groups: [u32; 2], max_buffer: u64) -> Result<Plan, GpuError> {
        // Quantised rows: per row `blocks · 8` words of values; the scales after all values.
        let (mut xs, mut gs, mut qx, mut qxs, mut qg, mut qgs) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        let mut shapes = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter().enumerate() {
            let (h, i) = (job.expert.hidden() as u64, job.expert.intermediate() as u64);
            if h == 0 || !(job.rows.len() as u64).is_multiple_of(h) {
                return Err(GpuError::Unsupported(format!("job {j}: {} values are not whole rows of {h}", job.rows.len())));
            }
            let n = job.rows.len() as u64 / h;
            if n > max_groups[1] as u64 || i.max(h) > max_groups[0] as u64 {
                return Err(GpuError::Unsupported(format!("job {j}: {n} rows of an expert {h}×{i} exceed the device's workgroup counts {max_groups:?}")));
            }
            let (hb, ib) = (h.div_ceil(32), i.div_ceil(32));
            shapes.push((n, xs, gs, qx, qg));
            xs += n * h;
            gs += n * i;
            qx += n * hb * 8;
            qxs += n * hb;
            qg += n * ib * 8;
            qgs += n * ib;
        }
        let (x_floats, g_floats, qx_words, qg_words) = (xs, gs, qx + qxs, qg + qgs);
        if 4 * x_floats.max(g_floats).max(qx_words).max(qg_words) > max_buffer.min(u32::MAX as u64) {
            return Err(GpuError::Unsupported(format!("a submission of {} values exceeds the device's buffer range", x_floats.max(g_floats))));
        }
        // The scales follow the values: their offsets are known once all values are counted.
        let (mut sx, mut sg) = (qx, qg);
        let places = jobs
            .iter()
            .zip(shapes)
            .map(|(job, (n, x, g, qxo, qgo))| {
                let (hb, ib) = ((job.expert.hidden() as u64).div_ceil(32), (job.expert.intermediate() as u64).div_ceil(32));
                let p = Place { n: n as u32, x: x as u32, y: x as u32, qx: qxo as u32, qxs: sx as u32, g: g as u32, qg: qgo as u32, qgs: sg as u32 };
                sx += n * hb;
                sg += n * ib;
                p
            })
            .collect();
        Ok(Plan { places, x_floats, g_floats, qx_words, qg_words })
    }
}

/// Quantised rows (`q`, `blocks · 32` a row) and their scales into a mapped buffer: values from
/// word `at`, scales from word `scales_at`.
unsafe fn write_quantised(base: *mut u32, at: u32, scales_at: u32, q: &[i8], scales: &[f32]) {
    std::ptr::copy_nonoverlapping(q.as_ptr().cast::<u8>(), base.add(at as usize).cast::<u8>(), q.len());
    std::ptr::copy_nonoverlapping(scales.as_ptr().cast::<u32>(), base.add(scales_at as usize), scales.len());
}

fn as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), std::mem::size_of_val(words)) }
}

impl Drop for State {
    fn drop(&mut self) {
        // SAFETY: waiting for idle first, then destroying what this state created (null handles
        // are ignored by the destroy calls).
        unsafe {
            let _ = self.device.device_wait_idle();
            for b in [self.x.take(), self.qx.take(), self.y.take(), self.gh.take(), self.qg.take(), self.g.take(), self.u.take(), self.staging.take()]
                .into_iter()
                .flatten()
            {
                self.destroy(&b);
            }
            for a in std::mem::take(&mut self.arenas) {
                self.destroy(&a.buffer);
            }
            let d = &self.device;
            d.destroy_fence(self.fence, None);
            d.destroy_command_pool(self.command_pool, None);
            d.destroy_descriptor_pool(self.descriptor_pool, None);
            for p in self.pipelines {
                d.destroy_pipeline(p, None);
            }
            for s in self.shaders {
                d.destroy_shader_module(s, None);
            }
            d.destroy_pipeline_layout(self.pipeline_layout, None);
            d.destroy_descriptor_set_layout(self.set_layout, None);
            d.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
