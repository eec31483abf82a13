//! `shimmer doctor`: what this machine offers a MoE model — the CPU and the kernels shimmer picks
//! on it, memory and its bandwidth, NUMA nodes, each given directory's disk (O_DIRECT or not,
//! bandwidth by queue depth), GPUs — and what to run it with. colibri's `doctor`; `--json` for
//! scripts.
//!
//! Must never: write anything but its own probe file (removed when done, whatever happens), or
//! read more than the sizes its flags allow.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::*;

/// The largest probe file a directory may be asked for (MB).
const MAX_PROBE_MB: u64 = 65_536;
/// The queue depths a disk is measured at (here and by `tune`).
pub(super) const DEPTHS: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// One read of the disk probe (aligned for O_DIRECT).
const READ_BYTES: u64 = 1 << 20;

#[derive(Args)]
pub(super) struct DoctorArgs {
    /// A directory whose disk to measure (models, containers, the store's mirror); repeatable.
    /// Default: the current directory.
    #[arg(long = "dir", value_name = "DIR")]
    dirs: Vec<PathBuf>,
    /// Size of the probe file written in each directory and read back (MB, 10^6 bytes); 0 skips
    /// the disks.
    #[arg(long, default_value_t = 256)]
    disk_probe_mb: u64,
    /// The GPU to check (`auto`: the first usable one; `vulkan` also takes a driver that runs on
    /// the CPU): opened, self-tested, and every weight format compared with the CPU bit for bit.
    #[arg(long, value_name = "auto|cuda|vulkan|none", default_value = "auto")]
    gpu: shimmer_gpu::GpuChoice,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
pub(crate) struct DoctorReport {
    pub cpu: CpuReport,
    pub memory: MemoryReport,
    pub numa_nodes: Vec<NumaNode>,
    pub disks: Vec<DiskReport>,
    pub gpus: Vec<GpuReport>,
    /// The device `--gpu` opened and its formats against the CPU; or why none was.
    pub gpu_check: GpuCheck,
    pub recommendations: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct GpuCheck {
    pub device: Option<String>,
    pub memory_bytes: u64,
    pub formats: Vec<shimmer_gpu::check::FormatCheck>,
    /// Why no device was checked (no backend, no driver, the self-test refused it).
    pub unavailable: Option<String>,
}

impl GpuCheck {
    fn of(choice: shimmer_gpu::GpuChoice) -> Self {
        match shimmer_gpu::open(choice) {
            Ok(Some(device)) => GpuCheck {
                device: Some(device.name()),
                memory_bytes: device.memory_bytes(),
                formats: shimmer_gpu::check::check_formats(device.as_ref()),
                unavailable: None,
            },
            Ok(None) if choice == shimmer_gpu::GpuChoice::None => GpuCheck { unavailable: Some("not asked (--gpu none)".into()), ..GpuCheck::default() },
            Ok(None) => GpuCheck {
                unavailable: Some("no GPU this binary can use (builds with --features cuda or vulkan; CPU drivers only with --gpu vulkan)".into()),
                ..GpuCheck::default()
            },
            Err(e) => GpuCheck { unavailable: Some(e.to_string()), ..GpuCheck::default() },
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct CpuReport {
    pub model: String,
    pub arch: &'static str,
    pub logical_cores: usize,
    /// Distinct (package, core) pairs; `None` where the OS does not say.
    pub physical_cores: Option<usize>,
    /// The features shimmer's kernels look for, as this process detects them.
    pub features: std::collections::BTreeMap<&'static str, bool>,
    /// The float dot's ISA and the integer dot's (what `SHIMMER_ISA` / `SHIMMER_INT_ISA` may override).
    pub float_kernels: &'static str,
    pub integer_kernels: &'static str,
    /// One activation row's integer products (decode), where they take another ISA (`qdot::matvec_isa`).
    pub integer_one_row_kernels: &'static str,
    pub amx: AmxReport,
}

/// AMX needs four things: the CPU reporting it, the OS saving its tile state, the kernel granting
/// this process the tile data, and a tile product that gives the right answer
/// (`shimmer_kernels::amx`). A virtual machine often hides the first.
#[derive(Debug, Serialize)]
pub(crate) struct AmxReport {
    pub cpu_reports: bool,
    pub os_enables: bool,
    pub kernel_grants: bool,
    pub self_test_passes: bool,
    pub note: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct MemoryReport {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    /// Copy bandwidth (reads and writes counted) of 256 MiB, one thread and all of them.
    pub copy_gb_s_one_thread: f64,
    pub copy_gb_s_all_threads: f64,
    /// Read-only bandwidth of the same 256 MiB (bytes read per second): what a decode, which
    /// only reads weights, can stream at most.
    pub read_gb_s_one_thread: f64,
    pub read_gb_s_all_threads: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct NumaNode {
    pub id: usize,
    pub cpus: String,
    pub memory_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct DiskReport {
    pub dir: PathBuf,
    pub free_bytes: Option<u64>,
    /// Whether reads bypassing the page cache (O_DIRECT, F_NOCACHE) work here.
    pub direct_io: bool,
    /// `(depth, GB/s)`: 1 MiB reads in a shuffled order, `depth` in flight.
    pub gb_s_by_depth: Vec<(usize, f64)>,
    /// The smallest depth within 90 % of the best bandwidth.
    pub best_depth: Option<usize>,
    /// The same reads at depth 16 through an io_uring ring (`--io-engine uring`); `None` where
    /// the kernel has no ring to give (`io_uring` says why) or off Linux.
    pub io_uring_gb_s: Option<f64>,
    pub io_uring: String,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub(crate) struct GpuReport {
    pub vendor: String,
    pub name: String,
}

pub(super) fn doctor(a: DoctorArgs) -> Result<ExitCode> {
    if a.disk_probe_mb > MAX_PROBE_MB {
        bail!("--disk-probe-mb must be at most {MAX_PROBE_MB} (got {})", a.disk_probe_mb);
    }
    let dirs = if a.dirs.is_empty() { vec![PathBuf::from(".")] } else { a.dirs.clone() };
    for d in &dirs {
        if !d.is_dir() {
            bail!("--dir {}: not a directory", d.display());
        }
    }
    let report = examine(&dirs, a.disk_probe_mb * 1_000_000, a.gpu);
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let c = &report.cpu;
    writeln!(
        out,
        "cpu      {} ({}), {} logical cores{}",
        c.model,
        c.arch,
        c.logical_cores,
        c.physical_cores.map(|p| format!(", {p} physical")).unwrap_or_default()
    )?;
    let have: Vec<&str> = c.features.iter().filter(|f| *f.1).map(|f| *f.0).collect();
    writeln!(out, "         features: {}", if have.is_empty() { "none of those shimmer uses".to_string() } else { have.join(" ") })?;
    writeln!(
        out,
        "         kernels: {} (float), {} (integer), {} (integer, one row); AMX: {}",
        c.float_kernels, c.integer_kernels, c.integer_one_row_kernels, c.amx.note
    )?;
    let m = &report.memory;
    let gb = |b: Option<u64>| b.map_or("unknown".to_string(), |b| format!("{:.1} GB", b as f64 / 1e9));
    writeln!(
        out,
        "memory   {} total, {} available; copy {:.1} GB/s (1 thread), {:.1} GB/s (all); read {:.1} GB/s (1 thread), {:.1} GB/s (all)",
        gb(m.total_bytes),
        gb(m.available_bytes),
        m.copy_gb_s_one_thread,
        m.copy_gb_s_all_threads,
        m.read_gb_s_one_thread,
        m.read_gb_s_all_threads
    )?;
    for n in &report.numa_nodes {
        writeln!(out, "numa     node {}: cpus {}, {}", n.id, n.cpus, gb(n.memory_bytes))?;
    }
    for d in &report.disks {
        let depths: Vec<String> = d.gb_s_by_depth.iter().map(|(q, g)| format!("{q}:{g:.2}")).collect();
        writeln!(
            out,
            "disk     {}: {} free, O_DIRECT {}, GB/s by depth {}, io_uring {}{}",
            d.dir.display(),
            gb(d.free_bytes),
            if d.direct_io { "yes" } else { "no" },
            if depths.is_empty() { "-".to_string() } else { depths.join(" ") },
            d.io_uring_gb_s.map_or(d.io_uring.clone(), |g| format!("16:{g:.2}")),
            d.error.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
        )?;
    }
    if report.gpus.is_empty() {
        writeln!(out, "gpu      none found")?;
    }
    for g in &report.gpus {
        writeln!(out, "gpu      {} {}", g.vendor, g.name)?;
    }
    let check = &report.gpu_check;
    match (&check.device, &check.unavailable) {
        (Some(d), _) => {
            let formats: Vec<String> = check.formats.iter().map(|f| format!("{} {}", f.format, if f.passed() { "same bits" } else { "DIFFERS" })).collect();
            writeln!(out, "vram     {d}, {:.1} GB: {}", check.memory_bytes as f64 / 1e9, formats.join(", "))?;
            for f in check.formats.iter().filter(|f| !f.passed()) {
                writeln!(out, "         {}: {}", f.format, f.detail.as_deref().unwrap_or("no outputs"))?;
            }
        }
        (None, Some(why)) => writeln!(out, "vram     {why}")?,
        (None, None) => {}
    }
    for r in &report.recommendations {
        writeln!(out, "advice   {r}")?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn examine(dirs: &[PathBuf], probe_bytes: u64, gpu: shimmer_gpu::GpuChoice) -> DoctorReport {
    let cpu = cpu();
    let threads = cpu.logical_cores;
    let (one, all) = (crate::bench::memory_bandwidth(1), crate::bench::memory_bandwidth(threads));
    let memory = MemoryReport {
        total_bytes: crate::model_dir::proc_kb_field("/proc/meminfo", "MemTotal").or_else(macos_memsize),
        available_bytes: crate::model_dir::proc_kb_field("/proc/meminfo", "MemAvailable"),
        copy_gb_s_one_thread: one.0,
        copy_gb_s_all_threads: all.0,
        read_gb_s_one_thread: one.1,
        read_gb_s_all_threads: all.1,
    };
    let numa_nodes = numa_nodes();
    let disks = if probe_bytes == 0 { Vec::new() } else { dirs.iter().map(|d| disk(d, probe_bytes)).collect() };
    let gpus = gpus();
    let gpu_check = GpuCheck::of(gpu);
    let recommendations = advise(&cpu, &memory, &numa_nodes, &disks, &gpus, &gpu_check, gpu);
    DoctorReport { cpu, memory, numa_nodes, disks, gpus, gpu_check, recommendations }
}

/// `/proc/cpuinfo`'s lines `key: value`, per processor block (Linux; empty elsewhere).
fn cpuinfo() -> Vec<Vec<(String, String)>> {
    let text = read_small("/proc/cpuinfo").unwrap_or_default();
    text.split("\n\n")
        .map(|block| block.lines().filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect::<Vec<_>>())
        .filter(|b| !b.is_empty())
        .collect()
}

/// A small text file (≤ 4 MiB), or `None`.
fn read_small(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut s = String::new();
    std::fs::File::open(path).ok()?.take(4 << 20).read_to_string(&mut s).ok()?;
    Some(s)
}

/// The setting of `(setting, figure)` pairs, in the order measured, that first reaches `share`
/// of the best figure: the fewest threads or the shallowest queue that pays.
pub(super) fn first_within(measured: &[(usize, f64)], share: f64) -> Option<usize> {
    let best = measured.iter().map(|m| m.1).fold(0.0f64, f64::max);
    measured.iter().find(|m| m.1 >= share * best).map(|m| m.0)
}

/// The CPU's name as the OS gives it.
pub(super) fn cpu_model() -> String {
    cpu_model_of(&cpuinfo())
}

fn cpu_model_of(info: &[Vec<(String, String)>]) -> String {
    let field = |key: &str| info.iter().flat_map(|b| b.iter()).find(|(k, _)| k == key).map(|(_, v)| v.clone());
    field("model name")
        .or_else(|| field("Model"))
        .or_else(|| field("CPU part").map(|p| format!("ARM part {p}")))
        .or_else(macos_brand)
        .unwrap_or_else(|| "unknown".to_string())
}

fn cpu() -> CpuReport {
    let info = cpuinfo();
    let model = cpu_model_of(&info);
    let mut cores: Vec<(String, String)> =
        info.iter().filter_map(|b| Some((b.iter().find(|(k, _)| k == "physical id")?.1.clone(), b.iter().find(|(k, _)| k == "core id")?.1.clone()))).collect();
    cores.sort();
    cores.dedup();
    CpuReport {
        model,
        arch: std::env::consts::ARCH,
        logical_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        physical_cores: (!cores.is_empty()).then_some(cores.len()),
        features: features().into_iter().collect(),
        float_kernels: shimmer_kernels::dot::isa().name(),
        integer_kernels: shimmer_kernels::qdot::int_isa().name(),
        integer_one_row_kernels: shimmer_kernels::qdot::matvec_isa().name(),
        amx: amx(),
    }
}

fn features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            ("avx2", std::is_x86_feature_detected!("avx2")),
            ("fma", std::is_x86_feature_detected!("fma")),
            ("f16c", std::is_x86_feature_detected!("f16c")),
            ("avx512f", std::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::is_x86_feature_detected!("avx512bw")),
            ("avx512vnni", std::is_x86_feature_detected!("avx512vnni")),
            ("avx512bf16", std::is_x86_feature_detected!("avx512bf16")),
            ("avxvnni", std::is_x86_feature_detected!("avxvnni")),
        ]
    }
    #[cfg(target_arch = "aarch64")]
    {
        vec![
            ("neon", std::arch::is_aarch64_feature_detected!("neon")),
            ("dotprod", std::arch::is_aarch64_feature_detected!("dotprod")),
            ("i8mm", std::arch::is_aarch64_feature_detected!("i8mm")),
            ("bf16", std::arch::is_aarch64_feature_detected!("bf16")),
        ]
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Vec::new()
    }
}

fn amx() -> AmxReport {
    let s = shimmer_kernels::amx::status();
    AmxReport {
        cpu_reports: s.cpu_reports,
        os_enables: s.os_enables,
        kernel_grants: s.kernel_grants,
        self_test_passes: s.self_test_passes,
        note: s.describe().to_string(),
    }
}

#[cfg(target_os = "macos")]
fn sysctl_bytes(name: &str) -> Option<Vec<u8>> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut len: libc::size_t = 0;
    // SAFETY: the first call asks for the length only; the second fills a buffer of that length.
    unsafe {
        if libc::sysctlbyname(name.as_ptr(), std::ptr::null_mut(), &mut len, std::ptr::null_mut(), 0) != 0 || len == 0 || len > 4096 {
            return None;
        }
        let mut buf = vec![0u8; len];
        if libc::sysctlbyname(name.as_ptr(), buf.as_mut_ptr() as *mut libc::c_void, &mut len, std::ptr::null_mut(), 0) != 0 {
            return None;
        }
        buf.truncate(len);
        Some(buf)
    }
}

fn macos_brand() -> Option<String> {
    #[cfg(target_os = "macos")]
    {
        sysctl_bytes("machdep.cpu.brand_string").map(|b| String::from_utf8_lossy(&b).trim_end_matches('\0').to_string())
    }
    #[cfg(not(target_os = "macos"))]
    {
        None
    }
}

fn macos_memsize() -> Option<u64> {
    #[cfg(target_os = "macos")]
    {
        sysctl_bytes("hw.memsize").and_then(|b| Some(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?)))
    }
    #[cfg(not(target_os = "macos"))]
    {
        None
    }
}

fn numa_nodes() -> Vec<NumaNode> {
    let Ok(entries) = std::fs::read_dir("/sys/devices/system/node") else { return Vec::new() };
    let mut nodes: Vec<NumaNode> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id: usize = name.strip_prefix("node")?.parse().ok()?;
            let base = format!("/sys/devices/system/node/{name}");
            let cpus = read_small(&format!("{base}/cpulist")).map(|s| s.trim().to_string()).unwrap_or_default();
            // "Node 0 MemTotal:   24000000 kB"
            let memory_bytes = read_small(&format!("{base}/meminfo")).and_then(|t| {
                let line = t.lines().find(|l| l.starts_with(&format!("Node {id} MemTotal:")))?;
                let kb: u64 = line.split_once(':')?.1.split_whitespace().next()?.parse().ok()?;
                kb.checked_mul(1024)
            });
            Some(NumaNode { id, cpus, memory_bytes })
        })
        .take(1024)
        .collect();
    nodes.sort_by_key(|n| n.id);
    nodes
}

/// Writes a probe file of `bytes` in `dir`, reads it back bypassing the page cache at every
/// depth, and removes it.
fn disk(dir: &Path, bytes: u64) -> DiskReport {
    let mut report = DiskReport {
        dir: dir.to_path_buf(),
        free_bytes: free_bytes(dir),
        direct_io: false,
        gb_s_by_depth: Vec::new(),
        best_depth: None,
        io_uring_gb_s: None,
        io_uring: "not measured".to_string(),
        error: None,
    };
    let blocks = (bytes / READ_BYTES).max(1);
    let path = dir.join(format!(".shimmer-doctor-{}.probe", std::process::id()));
    struct Remove<'a>(&'a Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    // Removed when this function returns, however it returns.
    let _remove = Remove(&path);
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        let mut block = vec![0u8; READ_BYTES as usize];
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..blocks {
            // Incompressible bytes, so no layer below can shortcut the reads.
            for c in block.chunks_exact_mut(8) {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                c.copy_from_slice(&s.to_le_bytes());
            }
            f.write_all(&block)?;
        }
        f.sync_all()
    })();
    if let Err(e) = written {
        report.error = Some(format!("cannot write a probe file: {e}"));
        return report;
    }
    let reads = shimmer_store::probe::shuffled_within((0..blocks).map(|b| (b * READ_BYTES, READ_BYTES)).collect(), u64::MAX);
    report.direct_io = shimmer_store::uncached::open(&path, true).is_ok() && shimmer_store::probe::read_bandwidth(&path, &reads[..1], 1, true).is_ok();
    if !report.direct_io {
        report.error = Some("reads bypassing the page cache are refused here, so what follows is the page cache, not the disk".to_string());
    }
    for depth in DEPTHS {
        match shimmer_store::probe::read_bandwidth(&path, &reads, depth, report.direct_io) {
            Ok(b) => report.gb_s_by_depth.push((depth, b / 1e9)),
            Err(e) => {
                report.error = Some(format!("reading the probe file at depth {depth}: {e}"));
                break;
            }
        }
    }
    report.best_depth = first_within(&report.gb_s_by_depth, 0.9);
    #[cfg(target_os = "linux")]
    match shimmer_store::probe::read_bandwidth_ring(&path, &reads, 16, report.direct_io) {
        Ok(b) => {
            report.io_uring_gb_s = Some(b / 1e9);
            report.io_uring = "available".to_string();
        }
        Err(e) => report.io_uring = format!("unavailable: {e}"),
    }
    #[cfg(not(target_os = "linux"))]
    {
        report.io_uring = "Linux-only".to_string();
    }
    report
}

fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs is plain data; all zeroes is a valid value of it.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a statvfs the call fills.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

fn gpus() -> Vec<GpuReport> {
    let mut found = Vec::new();
    // NVIDIA's driver lists each GPU with its model.
    if let Ok(entries) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        for e in entries.flatten().take(64) {
            let info = read_small(&format!("{}/information", e.path().display())).unwrap_or_default();
            let name = info.lines().find_map(|l| l.strip_prefix("Model:")).map(|m| m.trim().to_string()).unwrap_or_else(|| "unknown model".to_string());
            found.push(GpuReport { vendor: "NVIDIA".to_string(), name });
        }
    }
    // Display devices by PCI vendor (AMD, Intel; NVIDIA's were listed above).
    if let Ok(entries) = std::fs::read_dir("/sys/class/drm") {
        let mut names: Vec<String> =
            entries.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with("card") && !n.contains('-')).collect();
        names.sort();
        for n in names.into_iter().take(64) {
            let vendor = read_small(&format!("/sys/class/drm/{n}/device/vendor")).unwrap_or_default();
            let device = read_small(&format!("/sys/class/drm/{n}/device/device")).unwrap_or_default();
            let vendor = match vendor.trim() {
                "0x1002" => "AMD",
                "0x8086" => "Intel",
                _ => continue,
            };
            found.push(GpuReport { vendor: vendor.to_string(), name: format!("PCI device {} ({n})", device.trim()) });
        }
    }
    found
}

fn advise(
    cpu: &CpuReport,
    memory: &MemoryReport,
    numa: &[NumaNode],
    disks: &[DiskReport],
    gpus: &[GpuReport],
    check: &GpuCheck,
    choice: shimmer_gpu::GpuChoice,
) -> Vec<String> {
    let mut r = Vec::new();
    let threads = cpu.physical_cores.unwrap_or(cpu.logical_cores).max(1);
    r.push(format!("--threads {threads}: decode reads memory, one thread per physical core keeps it busy ({} logical)", cpu.logical_cores));
    match cpu.integer_kernels {
        "avx512vnni" | "avxvnni" | "neon" => {}
        other => r.push(format!(
            "the integer products of int8 / int4 / MXFP4 containers run on {other} here; a CPU with VNNI (AVX-512 or AVX) runs them about twice as fast"
        )),
    }
    if let Some(avail) = memory.available_bytes {
        let gb = avail as f64 / 1e9 * 0.8;
        r.push(format!("--ram-gb {gb:.1}: experts beyond that stream from disk (80 % of the {:.1} GB available now)", avail as f64 / 1e9));
    }
    if numa.len() > 1 {
        r.push(format!(
            "{} NUMA nodes: run one worker per node (numactl --cpunodebind=N --membind=N shimmer worker ...) so each reads its own memory",
            numa.len()
        ));
    }
    for d in disks {
        if d.direct_io {
            if let Some(depth) = d.best_depth {
                r.push(format!("for a container on {}: --direct-io --io-depth {depth}", d.dir.display()));
            }
        }
    }
    match &check.device {
        Some(d) if check.formats.iter().all(|f| f.passed()) => r.push(format!(
            "--gpu {choice} --vram-gb {:.1}: {d} gives the CPU's bits in every format; experts it holds are computed there",
            check.memory_bytes as f64 / 1e9 * 0.9
        )),
        Some(d) => r.push(format!("{d} differs from the CPU in some format: shimmer computes those experts on the CPU (report it)")),
        None if !gpus.is_empty() => r.push(format!("GPUs were found, but none is usable: {}", check.unavailable.as_deref().unwrap_or("no backend"))),
        None => {}
    }
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_first_setting_within_a_share_of_the_best_is_chosen() {
        let m = [(1, 10.0), (2, 19.0), (4, 20.0), (8, 19.5)];
        assert_eq!(super::first_within(&m, 0.9), Some(2));
        assert_eq!(super::first_within(&m, 1.0), Some(4));
        assert_eq!(super::first_within(&[], 0.9), None);
    }
}
