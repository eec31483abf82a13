//! AMX (Intel's Advanced Matrix Extensions): whether this process can use the tiles, decided at
//! run time, once, by four checks in order — the CPU reports AMX-TILE and AMX-INT8 (CPUID leaf 7),
//! the OS saves the tile state (XCR0 bits 17 and 18), the kernel grants this process the tile data
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`), and a self-test: one 16 × 64 by 64 × 16
//! `tdpbssd` against its scalar value.
//!
//! Why all four: a virtual machine may hide AMX from CPUID, or report it and not enable the
//! state, and a tile instruction then faults whatever the program was compiled for (llama.cpp's
//! AMX path trusts its build flags and dies in `ggml_backend_amx_mul_mat` on such VMs).
//!
//! No product uses the tiles yet: the integer dot product's definition (`qdot`) fma's every
//! partial sum of four products into an f32 lane, which is what `vpdpbusd` gives and what keeps a
//! row's result the same on every ISA and in every batch; a tile instruction sums 64 products
//! before any float step, so it cannot give those bits (`docs/quantization.md`, "AMX").
//!
//! Must never: execute a tile instruction before the first three checks pass, or leave the tile
//! state configured after the self-test.

use std::sync::OnceLock;

/// What the checks found, in order; each later one is `false` when an earlier one failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmxStatus {
    /// CPUID reports AMX-TILE and AMX-INT8.
    pub cpu_reports: bool,
    /// XCR0 has the tile configuration and tile data states enabled.
    pub os_enables: bool,
    /// The kernel granted this process the tile data (Linux 5.16 and later ask for this).
    pub kernel_grants: bool,
    /// A tile dot product gave the scalar result.
    pub self_test_passes: bool,
}

impl AmxStatus {
    /// One line for `shimmer doctor`: what was found, and the first check that failed.
    pub fn describe(&self) -> &'static str {
        match (self.cpu_reports, self.os_enables, self.kernel_grants, self.self_test_passes) {
            (false, ..) => "not reported by the CPU (a virtual machine may hide it)",
            (true, false, ..) => "reported by the CPU, but the OS does not save the tile state; tile instructions would fault",
            (true, true, false, _) => "reported by the CPU, but the kernel refused this process the tile data",
            (true, true, true, false) => "granted, but a tile dot product gave a wrong result; not used",
            (true, true, true, true) => "works (self-test passed); unused: the integer kernels' bits come from VNNI's order",
        }
    }
}

/// The checks, run once per process.
pub fn status() -> AmxStatus {
    static STATUS: OnceLock<AmxStatus> = OnceLock::new();
    *STATUS.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> AmxStatus {
    use std::arch::x86_64::__cpuid_count;
    let (max_leaf, leaf1) = (__cpuid_count(0, 0).eax, __cpuid_count(1, 0));
    let leaf7 = if max_leaf >= 7 {
        __cpuid_count(7, 0)
    } else {
        return AmxStatus { cpu_reports: false, os_enables: false, kernel_grants: false, self_test_passes: false };
    };
    const AMX_TILE: u32 = 1 << 24;
    const AMX_INT8: u32 = 1 << 25;
    let cpu_reports = leaf7.edx & (AMX_TILE | AMX_INT8) == AMX_TILE | AMX_INT8;
    const OSXSAVE: u32 = 1 << 27;
    let os_enables = cpu_reports && leaf1.ecx & OSXSAVE != 0 && {
        const XTILECFG_AND_XTILEDATA: u64 = (1 << 17) | (1 << 18);
        xcr0() & XTILECFG_AND_XTILEDATA == XTILECFG_AND_XTILEDATA
    };
    let kernel_grants = os_enables && request_tile_data();
    let self_test_passes = kernel_grants && self_test();
    AmxStatus { cpu_reports, os_enables, kernel_grants, self_test_passes }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> AmxStatus {
    AmxStatus { cpu_reports: false, os_enables: false, kernel_grants: false, self_test_passes: false }
}

/// XCR0, the OS's enabled state components. Only called once CPUID reports OSXSAVE.
#[cfg(target_arch = "x86_64")]
fn xcr0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: `xgetbv` with ECX = 0 reads XCR0; the caller checked OSXSAVE, without which it faults.
    unsafe { std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags)) };
    (u64::from(hi) << 32) | u64::from(lo)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request about this process's own permissions; no memory is passed.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

/// Other systems enable the tile state for every process or not at all; XCR0 said which.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_data() -> bool {
    true
}

/// `A (16 × 64) · B`, with B in the tile layout (16 rows of 16 columns × 4 consecutive k), by
/// `tdpbssd`, compared with the same sums formed in scalar code. The inputs use the whole int8
/// range, so a wrong sign extension or a lost row shows.
#[cfg(target_arch = "x86_64")]
fn self_test() -> bool {
    let a: Vec<i8> = (0..16 * 64).map(|i: i32| (i.wrapping_mul(37).wrapping_add(11) % 256 - 128) as i8).collect();
    let b: Vec<i8> = (0..16 * 64).map(|i: i32| (i.wrapping_mul(101).wrapping_add(7) % 256 - 128) as i8).collect();
    let mut want = [0i32; 256];
    for m in 0..16 {
        for n in 0..16 {
            want[m * 16 + n] = (0..64).map(|k| i32::from(a[m * 64 + k]) * i32::from(b[(k / 4) * 64 + n * 4 + k % 4])).sum();
        }
    }
    let got = tile_product(&a, &b);
    got == want
}

/// The tile configuration's memory form (palette 1): three tiles of 16 rows × 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
    tail: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
fn tile_product(a: &[i8], b: &[i8]) -> [i32; 256] {
    assert!(a.len() == 16 * 64 && b.len() == 16 * 64);
    let mut config = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row: [0; 16], rows: [0; 16], tail: [0; 16] };
    for t in 0..3 {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    let mut c = [0i32; 256];
    // SAFETY: only reached once CPUID, XCR0 and the kernel's grant allow tile instructions; the
    // loads read 16 rows of 64 bytes at a stride of 64 from `a` and `b` (1,024 bytes each,
    // asserted above) and the store writes 16 rows of 64 bytes into `c` (1,024 bytes); the tile
    // state is released before returning, so no other code sees it configured.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm0",
            "tileloadd tmm1, [{a} + {stride} * 1]",
            "tileloadd tmm2, [{b} + {stride} * 1]",
            "tdpbssd tmm0, tmm1, tmm2",
            "tilestored [{c} + {stride} * 1], tmm0",
            "tilerelease",
            cfg = in(reg) &config,
            a = in(reg) a.as_ptr(),
            b = in(reg) b.as_ptr(),
            c = in(reg) c.as_mut_ptr(),
            stride = in(reg) 64usize,
            options(nostack, preserves_flags),
        );
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_needs_the_ones_before_it() {
        let s = status();
        assert!(!s.os_enables || s.cpu_reports, "{s:?}");
        assert!(!s.kernel_grants || s.os_enables, "{s:?}");
        assert!(!s.self_test_passes || s.kernel_grants, "{s:?}");
        assert!(!s.describe().is_empty());
        eprintln!("AMX: {s:?}: {}", s.describe());
    }

    /// On Linux the CPU's flags as the kernel shows them say what CPUID should; where the kernel
    /// also lists the tile state as enabled, the tiles must work.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_checks_agree_with_what_the_kernel_reports() {
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        let s = status();
        assert_eq!(s.cpu_reports, has("amx_tile") && has("amx_int8"), "{s:?}");
        if s.kernel_grants {
            assert!(s.self_test_passes, "the kernel granted the tiles but the self-test failed: {s:?}");
        }
    }

    /// The product itself, against its definition, on inputs other than the self-test's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_tile_product_is_the_sum_over_k_of_a_times_b() {
        if !status().kernel_grants {
            return;
        }
        let a: Vec<i8> = (0..1024).map(|i: i32| [127i8, -128, -1, 1, 0, 64, -63][(i % 7) as usize]).collect();
        let b: Vec<i8> = (0..1024).map(|i: i32| [-128i8, 127, 3, -5][(i % 4) as usize]).collect();
        let got = tile_product(&a, &b);
        for m in 0..16 {
            for n in 0..16 {
                let want: i32 = (0..64).map(|k| i32::from(a[m * 64 + k]) * i32::from(b[(k / 4) * 64 + n * 4 + k % 4])).sum();
                assert_eq!(got[m * 16 + n], want, "row {m}, column {n}");
            }
        }
    }
}
