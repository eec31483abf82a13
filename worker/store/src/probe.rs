//! The storage's read bandwidth, measured the way the store reads: whole blobs at their aligned
//! offsets, `depth` reads in flight, O_DIRECT when asked, from threads or (Linux) an io_uring
//! ring. It is the "disk limit" a streaming benchmark is judged against, measured in the same
//! run on the same file.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::source::AlignedBuf;

/// Reads every `(offset, length)` once with `depth` threads; returns bytes per second.
pub fn read_bandwidth(path: &Path, reads: &[(u64, u64)], depth: usize, direct: bool) -> std::io::Result<f64> {
    let file = crate::uncached::open(path, direct)?;
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..depth.max(1))
            .map(|_| {
                s.spawn(|| -> std::io::Result<u64> {
                    let mut bytes = 0;
                    let mut buf = AlignedBuf::new(reads.iter().map(|r| r.1 as usize).max().unwrap_or(4096));
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len)) = reads.get(i) else { return Ok(bytes) };
                        file.read_exact_at(&mut buf[..len as usize], off)?;
                        bytes += len;
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("reader panicked")))).sum::<std::io::Result<u64>>()
    })?;
    Ok(total as f64 / t0.elapsed().as_secs_f64().max(1e-9))
}

/// Reads every `(offset, length)` once through an io_uring ring keeping `depth` reads in flight;
/// returns bytes per second.
#[cfg(target_os = "linux")]
pub fn read_bandwidth_ring(path: &Path, reads: &[(u64, u64)], depth: usize, direct: bool) -> std::io::Result<f64> {
    use std::os::fd::AsRawFd;
    let file = crate::uncached::open(path, direct)?;
    let mut ring = crate::uring::Ring::<usize>::new(depth)?;
    let t0 = Instant::now();
    let (mut next, mut done, mut bytes) = (0usize, 0usize, 0u64);
    while done < reads.len() {
        while next < reads.len() && ring.free_slots() > 0 {
            let (offset, len) = reads[next];
            let read = crate::source::BlobRead { fd: file.as_raw_fd(), offset, len: len as usize };
            ring.submit(read, AlignedBuf::new(len as usize), next).map_err(|(_, why)| std::io::Error::other(why))?;
            next += 1;
        }
        for (i, outcome) in ring.wait()? {
            outcome.map_err(|why| std::io::Error::other(format!("offset {}: {why}", reads[i].0)))?;
            bytes += reads[i].1;
            done += 1;
        }
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9))
}

/// `reads` in a fixed shuffled order (nothing a readahead could follow), cut to the first that
/// together stay within `budget` bytes (at least one): the sample every bandwidth probe reads.
pub fn shuffled_within(mut reads: Vec<(u64, u64)>, budget: u64) -> Vec<(u64, u64)> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..reads.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        reads.swap(i, (s >> 33) as usize % (i + 1));
    }
    let mut taken = 0u64;
    reads.retain(|r| {
        taken = taken.saturating_add(r.1);
        taken <= budget.max(r.1)
    });
    reads
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sample_is_a_shuffled_prefix_within_the_budget() {
        let reads: Vec<(u64, u64)> = (0..100).map(|i| (i * 4096, 4096)).collect();
        let all = super::shuffled_within(reads.clone(), u64::MAX);
        assert_ne!(all, reads, "shuffled");
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, reads, "a permutation");
        assert_eq!(super::shuffled_within(reads.clone(), 10 * 4096), all[..10]);
        assert_eq!(super::shuffled_within(reads, 1).len(), 1, "at least one");
    }
}
