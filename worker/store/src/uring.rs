//! Expert blob reads through io_uring (Linux): one thread keeps up to `depth` blob reads in
//! flight and hands each batch of new reads to the kernel with one system call, where the reader
//! threads spend a thread wake-up and a `pread` on every blob — what small experts pay most for.
//!
//! Owns: the ring, the eventfd that wakes the ring's thread when reads are queued, and the
//! buffers of the reads in flight.
//! Must never: drop or reuse a buffer the kernel may still write into (every submitted read is
//! reaped before its buffer goes, shutdown included; a ring that fails as a whole leaks its
//! buffers rather than free them), or judge a blob's bytes — verification stays in `source`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use crate::source::{AlignedBuf, BlobRead};

/// The wake-up read's tag; blob reads are tagged with their slot index.
const WAKE_TAG: u64 = u64::MAX;

/// Wakes the ring's thread out of its wait (from any thread): new reads are queued, or the
/// store shuts down.
#[derive(Clone)]
pub struct Waker(Arc<OwnedFd>);

impl Waker {
    pub fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd this struct keeps open. An
        // eventfd write fails only when its counter would overflow, which still leaves it
        // readable: the wake-up happens either way.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// A read that finished: its tag and either the blob's bytes or why the read failed.
pub type Finished<T> = (T, Result<AlignedBuf, String>);

pub struct Ring<T> {
    ring: IoUring,
    wake: Arc<OwnedFd>,
    /// Where the armed wake-up read writes the eventfd's counter (boxed: its address is in the
    /// kernel's hands while armed).
    wake_buf: Box<u64>,
    wake_armed: bool,
    slots: Vec<Option<(T, AlignedBuf, usize)>>,
    free: Vec<usize>,
    /// The test hook: the wait with this number (counting from 1) fails after submitting.
    fail_at_wait: Option<u64>,
    waits: u64,
}

/// The fault-injection hook `SHIMMER_IO_RING_FAULT=N`: the ring's N-th wait fails as if the
/// kernel had refused it, with its reads in flight — the path where the store abandons the ring
/// and goes on without it. A positive integer, or an error naming the value.
pub fn fault_from_env() -> Result<Option<u64>, String> {
    match std::env::var("SHIMMER_IO_RING_FAULT") {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!("SHIMMER_IO_RING_FAULT={v:?} is not a positive integer (the ring's N-th wait fails)")),
        },
    }
}

impl<T> Ring<T> {
    /// A ring for `depth` blob reads at once (and the wake-up read). Fails where the kernel has
    /// no io_uring or forbids it (older kernels, some container sandboxes).
    pub fn new(depth: usize) -> io::Result<Self> {
        let depth = depth.clamp(1, 256);
        let ring = IoUring::new((depth + 1).next_power_of_two() as u32)?;
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Ring {
            ring,
            wake,
            wake_buf: Box::new(0),
            wake_armed: false,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            fail_at_wait: None,
            waits: 0,
        })
    }

    /// Makes the `n`-th wait fail (`fault_from_env`).
    pub fn failing_at_wait(mut self, n: Option<u64>) -> Self {
        self.fail_at_wait = n;
        self
    }

    pub fn waker(&self) -> Waker {
        Waker(self.wake.clone())
    }

    /// Reads that can be submitted now.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Queues one blob read into `buf` (at least `read.len` bytes; the kernel sees it at the
    /// next `wait`); gives the tag back when no slot is free or the read cannot be expressed.
    pub fn submit(&mut self, read: BlobRead, mut buf: AlignedBuf, tag: T) -> Result<(), (T, String)> {
        let Ok(len) = u32::try_from(read.len) else { return Err((tag, format!("a blob of {} bytes is too long for one ring read", read.len))) };
        if buf.len() < read.len {
            return Err((tag, format!("a buffer of {} bytes for a blob of {}", buf.len(), read.len)));
        }
        let Some(slot) = self.free.pop() else { return Err((tag, "no free ring slot".into())) };
        let entry = opcode::Read::new(types::Fd(read.fd), buf.as_mut_ptr(), len).offset(read.offset).build().user_data(slot as u64);
        // SAFETY: the buffer lives in `slots[slot]` until its completion is reaped (`reap`),
        // and the descriptor belongs to the store's source, which outlives the ring's thread.
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            self.free.push(slot);
            return Err((tag, "the ring's submission queue is full".into()));
        }
        self.slots[slot] = Some((tag, buf, read.len));
        Ok(())
    }

    /// Submits what is queued and waits until at least one read finishes or the waker fires;
    /// returns every read finished by then.
    pub fn wait(&mut self) -> io::Result<Vec<Finished<T>>> {
        self.arm_wake()?;
        self.waits += 1;
        if self.fail_at_wait == Some(self.waits) {
            self.ring.submit()?;
            return Err(io::Error::other(format!("injected ring failure at wait {} (SHIMMER_IO_RING_FAULT)", self.waits)));
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(self.reap())
    }

    /// Waits for every read in flight and the wake-up read (shutdown): afterwards no buffer is
    /// in the kernel's hands.
    pub fn drain(&mut self) -> io::Result<Vec<Finished<T>>> {
        let mut done = Vec::new();
        if self.wake_armed {
            Waker(self.wake.clone()).wake();
        }
        while self.wake_armed || self.free.len() < self.slots.len() {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            done.extend(self.reap());
        }
        Ok(done)
    }

    /// The tags of the reads still in flight, their buffers leaked: for a ring that failed as a
    /// whole, whose kernel side may still write into them. The ring itself is leaked with them.
    pub fn abandon(mut self) -> Vec<T> {
        let tags = self.slots.iter_mut().filter_map(Option::take).map(|(tag, buf, _)| {
            std::mem::forget(buf);
            tag
        });
        let tags = tags.collect();
        std::mem::forget(self);
        tags
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        if self.wake_armed {
            return Ok(());
        }
        let ptr: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(self.wake.as_raw_fd()), ptr.cast(), 8).build().user_data(WAKE_TAG);
        // SAFETY: `wake_buf` is boxed and lives as long as the ring; it is not touched while
        // `wake_armed`, and `drain` waits for this read before the ring goes.
        unsafe { self.ring.submission().push(&entry) }.map_err(|_| io::Error::other("the ring's submission queue is full"))?;
        self.wake_armed = true;
        Ok(())
    }

    fn reap(&mut self) -> Vec<Finished<T>> {
        let mut done = Vec::new();
        let completions: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (tag, result) in completions {
            if tag == WAKE_TAG {
                self.wake_armed = false;
                continue;
            }
            let slot = tag as usize;
            let Some((tag, buf, len)) = self.slots.get_mut(slot).and_then(Option::take) else { continue };
            self.free.push(slot);
            let outcome = if result < 0 {
                Err(format!("read failed: {}", io::Error::from_raw_os_error(-result)))
            } else if result as usize != len {
                Err(format!("short read: {result} of {len} bytes"))
            } else {
                Ok(buf.truncated(len))
            };
            done.push((tag, outcome));
        }
        done
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // The owner drains before dropping; this is the backstop for an early exit. Buffers the
        // kernel may still hold are leaked, never freed.
        if self.drain().is_err() {
            for (_, buf, _) in self.slots.iter_mut().filter_map(Option::take) {
                std::mem::forget(buf);
            }
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(bytes: &[u8]) -> (tempfile::NamedTempFile, std::fs::File) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        let file = std::fs::File::open(f.path()).unwrap();
        (f, file)
    }

    #[test]
    fn reads_come_back_with_their_tags_and_bytes_and_short_reads_are_errors() {
        let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (_keep, file) = file_of(&bytes);
        let mut ring = Ring::<usize>::new(4).expect("io_uring on this kernel");
        let fd = file.as_raw_fd();
        let reads = [(0u64, 4096usize), (4096, 8000), (12_000, 8000), (19_000, 2000)];
        for (i, (offset, len)) in reads.iter().enumerate() {
            ring.submit(BlobRead { fd, offset: *offset, len: *len }, AlignedBuf::new(*len), i).unwrap();
        }
        assert_eq!(ring.free_slots(), 0);
        assert!(ring.submit(BlobRead { fd, offset: 0, len: 1 }, AlignedBuf::new(1), 9).is_err(), "a fifth read must find no slot");
        let mut got = Vec::new();
        while got.len() < reads.len() {
            got.extend(ring.wait().unwrap());
        }
        got.sort_by_key(|(tag, _)| *tag);
        for (tag, outcome) in got {
            let (offset, len) = reads[tag];
            match outcome {
                Ok(buf) => assert_eq!(&buf[..], &bytes[offset as usize..offset as usize + len], "read {tag}"),
                // The last read runs past the end of the file.
                Err(e) => assert!(tag == 3 && e.contains("short read: 1000 of 2000"), "read {tag}: {e}"),
            }
        }
        assert_eq!(ring.free_slots(), 4);
    }

    #[test]
    fn a_waker_ends_a_wait_with_nothing_in_flight_and_drain_returns() {
        let mut ring = Ring::<()>::new(2).expect("io_uring on this kernel");
        let waker = ring.waker();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            waker.wake();
        });
        assert!(ring.wait().unwrap().is_empty());
        t.join().unwrap();
        // Re-armed by the next wait; drain must still come back.
        let (_keep, file) = file_of(&[1u8; 100]);
        ring.submit(BlobRead { fd: file.as_raw_fd(), offset: 0, len: 100 }, AlignedBuf::new(4096), ()).unwrap();
        let done = ring.drain().unwrap();
        assert_eq!(done.len(), 1);
        assert!(done[0].1.as_ref().is_ok_and(|b| b.iter().all(|x| *x == 1)));
    }

    #[test]
    fn a_bad_descriptor_is_an_error_naming_the_failure() {
        let mut ring = Ring::<()>::new(1).expect("io_uring on this kernel");
        assert!(ring.submit(BlobRead { fd: -1, offset: 0, len: 10 }, AlignedBuf::new(9), ()).is_err(), "a buffer too small is refused");
        ring.submit(BlobRead { fd: -1, offset: 0, len: 10 }, AlignedBuf::new(10), ()).unwrap();
        let done = ring.drain().unwrap();
        assert!(done[0].1.as_ref().is_err_and(|e| e.starts_with("read failed")), "{:?}", done[0].1.as_ref().err());
    }
}
