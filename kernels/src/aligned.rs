//! A growable buffer whose contents start on a 64-byte boundary: one cache line per 64-byte
//! vector load. A `Vec`'s allocation is 16-byte aligned, so the kernels' 64-byte loads of
//! activations, keys and values mostly straddled two lines (measured: the int4 GEMM ran a third
//! slower, MLA attention half again slower; `docs/benchmarks.md`, issue 18).
//!
//! Owns: the offset into a `Vec` with a cache line of slack. Must never: hand out a slice that
//! does not start on a 64-byte boundary (a clone, a growth and a shrink re-align their copy), or
//! expose the slack.

/// Bytes of the boundary the contents start on.
pub const ALIGN: usize = 64;

#[derive(Default)]
pub struct AlignedVec<T> {
    /// `at` elements of padding, then the contents: its length is `at + len()`, and its spare
    /// capacity is the room to grow into, never initialised before it is written (a KV cache's
    /// growth and a product's scratch were zeroed, then overwritten: a prompt's step spent ~2 %
    /// of its time in that `memset` on the demo model).
    buf: Vec<T>,
    at: usize,
}

impl<T: Copy + Default> AlignedVec<T> {
    /// Elements of slack: room to move the start to the next boundary.
    const SLACK: usize = ALIGN / std::mem::size_of::<T>();

    pub fn new() -> Self {
        AlignedVec { buf: Vec::new(), at: 0 }
    }

    pub fn len(&self) -> usize {
        self.buf.len() - self.at
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements it can hold before it must grow: the room asked for, not counting the cache
    /// line of slack that alignment takes (a constant 64 bytes, which memory accounting such as
    /// a prefix cache's budget leaves out).
    pub fn capacity(&self) -> usize {
        self.buf.capacity().saturating_sub(Self::SLACK)
    }

    pub fn clear(&mut self) {
        self.buf.truncate(self.at);
    }

    pub fn truncate(&mut self, len: usize) {
        self.buf.truncate(self.at + len);
    }

    /// A fresh buffer of room for `capacity` elements, the contents copied to its boundary; the
    /// room past them stays unwritten.
    fn move_to(&mut self, capacity: usize) {
        let mut buf = Vec::with_capacity(capacity + Self::SLACK);
        let at = Self::offset(buf.as_ptr());
        buf.resize(at, T::default());
        buf.extend_from_slice(&self.buf[self.at..]);
        (self.buf, self.at) = (buf, at);
    }

    fn offset(start: *const T) -> usize {
        let misalign = start as usize % ALIGN;
        if misalign == 0 {
            0
        } else {
            (ALIGN - misalign) / std::mem::size_of::<T>()
        }
    }

    fn reserve(&mut self, additional: usize) {
        let need = self.len() + additional;
        if need > self.capacity() {
            self.move_to(need.max(2 * self.len()));
        }
    }

    pub fn extend_from_slice(&mut self, xs: &[T]) {
        // Within the capacity the `Vec` never moves (`capacity()` leaves the slack out).
        self.reserve(xs.len());
        self.buf.extend_from_slice(xs);
    }

    /// `len` elements, the new ones `value` (as `Vec::resize`).
    pub fn resize(&mut self, len: usize, value: T) {
        if len > self.len() {
            self.reserve(len - self.len());
        }
        self.buf.resize(self.at + len, value);
    }

    /// Gives back the room beyond the contents (but the slack).
    pub fn shrink_to_fit(&mut self) {
        if self.capacity() > self.len() {
            self.move_to(self.len());
        }
    }
}

impl<T: Copy + Default> Clone for AlignedVec<T> {
    /// The copy is aligned on its own allocation (a derived clone would keep the offset of the
    /// original's).
    fn clone(&self) -> Self {
        let mut copy = AlignedVec::new();
        copy.extend_from_slice(self);
        copy
    }
}

impl<T: Copy + Default> std::ops::Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.at..]
    }
}

impl<T: Copy + Default> std::ops::DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..]
    }
}

impl<T: Copy + Default + std::fmt::Debug> std::fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aligned<T>(s: &[T]) -> bool {
        (s.as_ptr() as usize).is_multiple_of(ALIGN)
    }

    /// Growth, truncation, resizing, shrinking and cloning keep the contents and their boundary.
    #[test]
    fn every_change_keeps_the_contents_on_the_boundary() {
        let mut v: AlignedVec<f32> = AlignedVec::new();
        let mut want: Vec<f32> = Vec::new();
        for step in 0..200usize {
            let xs: Vec<f32> = (0..(step * 7) % 23 + 1).map(|i| (step * 31 + i) as f32).collect();
            v.extend_from_slice(&xs);
            want.extend_from_slice(&xs);
            if step % 17 == 0 {
                v.truncate(want.len() / 2);
                want.truncate(want.len() / 2);
            }
            if step % 29 == 0 {
                v.resize(want.len() + 5, -1.0);
                want.resize(want.len() + 5, -1.0);
                v.shrink_to_fit();
            }
            assert_eq!(&v[..], &want[..], "step {step}");
            assert!(aligned(&v) && v.capacity() >= v.len());
            if step % 29 == 0 {
                assert_eq!(v.capacity(), v.len(), "step {step}: shrunk to the contents");
            }
            let c = v.clone();
            assert!(aligned(&c));
            assert_eq!(&c[..], &want[..]);
        }
        let mut b: AlignedVec<u8> = AlignedVec::new();
        b.resize(3, 7);
        assert!(aligned(&b) && b[..] == [7, 7, 7]);
        b.clear();
        assert!(b.is_empty());
    }
}
