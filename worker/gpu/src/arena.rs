//! Sub-allocation of a device buffer: the byte ranges of one arena that hold experts, first fit
//! over a sorted free list with neighbours merged on release. Pure bookkeeping, shared by every
//! backend (a driver allows only a few thousand allocations; a model has tens of thousands of
//! expert matrices, so experts live inside a few large buffers).
//!
//! Must never: hand out overlapping ranges, or accept a release of a range it did not hand out
//! (that would be a double free on the device: it panics, being a bug in the caller).

/// Ranges inside one arena of `size` bytes.
#[derive(Debug, Clone)]
pub struct Arena {
    size: u64,
    align: u64,
    /// Free ranges `(offset, len)`, sorted by offset, never adjacent (merged).
    free: Vec<(u64, u64)>,
    used: u64,
}

impl Arena {
    /// An empty arena; every range starts on a multiple of `align` (a power of two).
    pub fn new(size: u64, align: u64) -> Self {
        assert!(align.is_power_of_two(), "arena alignment {align} is not a power of two");
        let size = size / align * align;
        Arena { size, align, free: if size > 0 { vec![(0, size)] } else { Vec::new() }, used: 0 }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes handed out (each range rounded up to the alignment).
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    fn rounded(&self, len: u64) -> Option<u64> {
        len.max(1).checked_next_multiple_of(self.align)
    }

    /// The offset of a new range of `len` bytes, or `None` when no free range is long enough.
    pub fn allocate(&mut self, len: u64) -> Option<u64> {
        let len = self.rounded(len)?;
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (offset, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (offset + len, l - len);
        }
        self.used += len;
        Some(offset)
    }

    /// Returns the range `allocate(len)` gave at `offset`.
    pub fn release(&mut self, offset: u64, len: u64) {
        let len = self.rounded(len).expect("a released range was allocated, so its length rounds");
        assert!(offset.is_multiple_of(self.align) && offset + len <= self.size, "release of [{offset}, +{len}) outside the arena");
        let i = self.free.partition_point(|&(o, _)| o < offset);
        let overlaps_before = i > 0 && self.free[i - 1].0 + self.free[i - 1].1 > offset;
        let overlaps_after = i < self.free.len() && offset + len > self.free[i].0;
        assert!(!overlaps_before && !overlaps_after, "release of [{offset}, +{len}), which is (partly) free already");
        self.used -= len;
        let merge_before = i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == offset;
        let merge_after = i < self.free.len() && offset + len == self.free[i].0;
        match (merge_before, merge_after) {
            (true, true) => {
                self.free[i - 1].1 += len + self.free[i].1;
                self.free.remove(i);
            }
            (true, false) => self.free[i - 1].1 += len,
            (false, true) => self.free[i] = (offset, len + self.free[i].1),
            (false, false) => self.free.insert(i, (offset, len)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random sequence of allocations and releases never overlaps, and releasing everything
    /// leaves one free range: the arena's whole size.
    #[test]
    fn ranges_never_overlap_and_merge_back() {
        let mut arena = Arena::new(1 << 20, 256);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if !s.is_multiple_of(3) || live.is_empty() {
                let len = 1 + s % 40_000;
                if let Some(off) = arena.allocate(len) {
                    assert_eq!(off % 256, 0);
                    let end = off + len;
                    assert!(end <= arena.size());
                    for &(o, l) in &live {
                        assert!(end <= o || o + l <= off, "step {step}: [{off}, {end}) overlaps [{o}, {})", o + l);
                    }
                    live.push((off, len));
                }
            } else {
                let (o, l) = live.swap_remove((s as usize / 7) % live.len());
                arena.release(o, l);
            }
        }
        for (o, l) in live.drain(..) {
            arena.release(o, l);
        }
        assert!(arena.is_empty());
        assert_eq!(arena.allocate(1 << 20), Some(0), "everything merged back into one range");
    }

    #[test]
    fn a_full_arena_says_so() {
        let mut arena = Arena::new(1000, 4);
        assert_eq!(arena.allocate(600), Some(0));
        assert_eq!(arena.allocate(600), None);
        assert_eq!(arena.allocate(400), Some(600));
        assert_eq!(arena.allocate(1), None);
        arena.release(0, 600);
        assert_eq!(arena.allocate(u64::MAX), None, "a huge request is refused, not wrapped");
    }

    #[test]
    #[should_panic(expected = "free already")]
    fn a_double_release_is_a_bug() {
        let mut arena = Arena::new(1000, 4);
        let a = arena.allocate(100).unwrap();
        arena.release(a, 100);
        arena.release(a, 100);
    }
}
