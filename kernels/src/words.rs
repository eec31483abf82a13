//! A matrix's stored values, either its own (`Vec`) or a view into a larger buffer it keeps
//! alive: an expert read from disk has its three matrices view the one aligned read buffer, so
//! the read costs its checksum and no copy (a 2.65 MB blob's copy was most of its decode).
//!
//! Owns: the element view and the handle that keeps the viewed bytes alive.
//! Must never: view bytes whose bounds, length or alignment do not fit the element type, or
//! bytes that may change while viewed (`ByteOwner`'s contract).

use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::Arc;

/// Element types a byte buffer can be viewed as: every bit pattern is a valid value, and on a
/// little-endian machine the stored little-endian bytes are the value.
pub trait Plain: Copy + Send + Sync + 'static + private::Sealed {}
impl Plain for u8 {}
impl Plain for i8 {}
impl Plain for u16 {}
impl Plain for f32 {}

mod private {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
    impl Sealed for u16 {}
    impl Sealed for f32 {}
}

/// Bytes that views may borrow.
///
/// # Safety
/// `bytes` returns the same memory (address and length) on every call for the owner's whole
/// life, and nothing writes that memory while the owner lives.
pub unsafe trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];
}

/// Stored values: owned, or a view into a `ByteOwner` that the view keeps alive.
pub struct Words<T: Plain> {
    repr: Repr<T>,
}

enum Repr<T> {
    Owned(Vec<T>),
    Shared { ptr: NonNull<T>, len: usize, _owner: Arc<dyn ByteOwner> },
}

// SAFETY: a shared view reads immutable memory kept alive by a Send + Sync owner; an owned one
// is a Vec of Send + Sync values.
unsafe impl<T: Plain> Send for Words<T> {}
// SAFETY: as above; nothing is written through a shared reference.
unsafe impl<T: Plain> Sync for Words<T> {}

impl<T: Plain> Words<T> {
    /// A view of `owner`'s bytes `start .. start + len · size_of::<T>()`. An error (nothing
    /// viewed) when they do not lie in the buffer, are misaligned for `T`, or the machine is
    /// big-endian and `T` wider than a byte: the caller then copies, to the same values.
    pub fn shared(owner: &Arc<dyn ByteOwner>, start: usize, len: usize) -> Result<Self, String> {
        let size = std::mem::size_of::<T>();
        if cfg!(target_endian = "big") && size > 1 {
            return Err("stored little-endian values cannot be viewed on a big-endian machine".into());
        }
        let bytes = owner.bytes();
        let end = len.checked_mul(size).and_then(|n| n.checked_add(start)).filter(|e| *e <= bytes.len());
        let Some(_end) = end else {
            return Err(format!("{len} values of {size} bytes from byte {start} of a {}-byte buffer", bytes.len()));
        };
        let at = bytes[start..].as_ptr();
        if !(at as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(format!("byte {start} of the buffer is not aligned for {size}-byte values"));
        }
        let ptr = NonNull::new(at as *mut T).ok_or("a null buffer")?;
        Ok(Words { repr: Repr::Shared { ptr, len, _owner: owner.clone() } })
    }

    #[inline]
    pub fn as_slice(&self) -> &[T] {
        match &self.repr {
            Repr::Owned(v) => v,
            // SAFETY: checked in `shared` to lie in, and be aligned within, memory the owner
            // keeps alive and unchanged (`ByteOwner`'s contract); every bit pattern is a `T`.
            Repr::Shared { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }

    /// Whether these values view another buffer rather than own their memory.
    pub fn is_shared(&self) -> bool {
        matches!(self.repr, Repr::Shared { .. })
    }

    /// The values in a `Vec` of their own (a copy when shared).
    pub fn into_vec(self) -> Vec<T> {
        match self.repr {
            Repr::Owned(v) => v,
            Repr::Shared { .. } => self.as_slice().to_vec(),
        }
    }
}

impl<T: Plain> Deref for Words<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Plain> AsRef<[T]> for Words<T> {
    fn as_ref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Plain> From<Vec<T>> for Words<T> {
    fn from(v: Vec<T>) -> Self {
        Words { repr: Repr::Owned(v) }
    }
}

impl<T: Plain> FromIterator<T> for Words<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<T>>().into()
    }
}

impl<T: Plain> Default for Words<T> {
    fn default() -> Self {
        Vec::new().into()
    }
}

impl<T: Plain> Clone for Words<T> {
    fn clone(&self) -> Self {
        match &self.repr {
            Repr::Owned(v) => v.clone().into(),
            Repr::Shared { ptr, len, _owner } => Words { repr: Repr::Shared { ptr: *ptr, len: *len, _owner: _owner.clone() } },
        }
    }
}

impl<T: Plain + PartialEq> PartialEq for Words<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Plain + fmt::Debug> fmt::Debug for Words<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Bytes(Vec<u8>);
    // SAFETY: the Vec is never changed or moved out while the owner lives.
    unsafe impl ByteOwner for Bytes {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }

    fn owner(n: usize) -> Arc<dyn ByteOwner> {
        Arc::new(Bytes((0..n).map(|i| (i * 37 + 11) as u8).collect()))
    }

    #[test]
    fn a_view_reads_the_stored_little_endian_values_and_keeps_its_buffer_alive() {
        let o = owner(64);
        let base = o.bytes().as_ptr() as usize;
        // Find an offset aligned for f32 inside the buffer (a Vec<u8> is not promised alignment).
        let start = (base.next_multiple_of(4) - base) + 4;
        let view = Words::<f32>::shared(&o, start, 3).unwrap();
        let want: Vec<f32> = o.bytes()[start..start + 12].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        drop(o);
        assert!(view.is_shared());
        assert_eq!(view.as_slice(), want.as_slice());
        let copy = view.clone();
        assert_eq!(copy, view);
        assert_eq!(view.into_vec(), want);
    }

    #[test]
    fn views_out_of_bounds_or_misaligned_are_refused() {
        let o = owner(64);
        assert!(Words::<u8>::shared(&o, 60, 5).is_err(), "past the end");
        assert!(Words::<u8>::shared(&o, usize::MAX, 2).is_err(), "overflowing start");
        assert!(Words::<f32>::shared(&o, 0, usize::MAX / 2).is_err(), "overflowing length");
        let base = o.bytes().as_ptr() as usize;
        let odd = if base.is_multiple_of(2) { 1 } else { 0 };
        let e = Words::<u16>::shared(&o, odd, 2).err().unwrap();
        assert!(e.contains("aligned"), "{e}");
        assert_eq!(Words::<u8>::shared(&o, 64, 0).unwrap().len(), 0, "an empty view at the end is fine");
    }

    #[test]
    fn owned_values_compare_and_convert_as_a_vec() {
        let w: Words<u16> = vec![1, 2, 3].into();
        assert!(!w.is_shared());
        assert_eq!(&w[..], &[1, 2, 3]);
        assert_eq!(w.clone().into_vec(), vec![1, 2, 3]);
    }
}
