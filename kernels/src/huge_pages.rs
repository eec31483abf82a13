//! Large weight buffers moved into 2 MiB pages where the operating system allows it. A decode
//! step streams every dense weight once; on 4 KiB pages a 51 MB LM head is 12,500 TLB entries a
//! token, and the page walks sit on the kernels' load path. Linux's transparent huge pages
//! default to `madvise` on the distributions this runs on, so nothing gets them unasked.
//!
//! Owns: the advice (`MADV_HUGEPAGE`, then `MADV_COLLAPSE` to move pages already written).
//! Must never: touch memory outside the buffer it is given (only whole 2 MiB pages inside it are
//! advised), change a byte of it (collapsing copies contents as they are), or fail a load — the
//! advice is best effort (older kernels, `never`, other systems: nothing happens).

/// Buffers below this stay as they are (a huge page or two inside would not pay for the call).
pub const MIN_BYTES: usize = 4 << 20;

const HUGE_PAGE: usize = 2 << 20;

/// Asks for `data`'s whole 2 MiB pages to be huge pages; returns whether the pages already
/// written were moved into them (always false off Linux, or below `MIN_BYTES`).
pub fn prefer_huge_pages<T>(data: &[T]) -> bool {
    let bytes = std::mem::size_of_val(data);
    if bytes < MIN_BYTES {
        return false;
    }
    let start = (data.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (data.as_ptr() as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return false;
    }
    advise(start, end - start)
}

#[cfg(target_os = "linux")]
fn advise(start: usize, len: usize) -> bool {
    // SAFETY: [start, start + len) lies inside a live allocation the caller borrows; both advices
    // keep its contents (MADV_COLLAPSE copies the pages into a huge one, under the page table
    // lock), so the borrow's bytes are the same after as before.
    unsafe {
        let at = start as *mut libc::c_void;
        if libc::madvise(at, len, libc::MADV_HUGEPAGE) != 0 {
            return false;
        }
        libc::madvise(at, len, MADV_COLLAPSE) == 0
    }
}

/// Linux's `MADV_COLLAPSE` (5.19+; the libc crate names it on glibc only).
#[cfg(target_os = "linux")]
const MADV_COLLAPSE: libc::c_int = 25;

#[cfg(not(target_os = "linux"))]
fn advise(_start: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The advice leaves every byte as it was, small buffers are left alone, and where the
    /// system offers transparent huge pages the written pages are moved into them.
    #[test]
    fn advice_keeps_the_contents() {
        let data: Vec<u32> = (0..(6u32 << 20) / 4).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let before = data.clone();
        // A collapse can fail for a moment (memory to compact, a lock held elsewhere): retried.
        let moved = (0..3).any(|_| prefer_huge_pages(&data));
        assert_eq!(data, before);
        assert!(!prefer_huge_pages(&data[..1000]));
        let offered = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|m| !m.contains("[never]"));
        if cfg!(target_os = "linux") && offered {
            assert!(moved, "transparent huge pages are offered but the weights were not moved into them");
        }
    }
}
