//! Page-aligned host buffers (the host tier's storage and the O_DIRECT staging buffers).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use super::OffloadError;

/// Alignment of every buffer, file offset and I/O length used with O_DIRECT.
pub const ALIGN: usize = 4096;

/// Rounds `bytes` up to a multiple of [`ALIGN`].
pub fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// A zero-initialised, [`ALIGN`]-aligned `f32` buffer whose allocation is a multiple of
/// [`ALIGN`] bytes (so whole-buffer O_DIRECT transfers are always legal).
///
/// `len` is the true element count; the bytes past it up to `capacity_bytes` are padding,
/// zero unless an I/O wrote there.
pub struct AlignedBuf {
    ptr: NonNull<f32>,
    len: usize,
    capacity_bytes: usize,
}

// SAFETY: the buffer is uniquely owned heap memory, like a `Vec<f32>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[f32]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` elements.
    ///
    /// # Errors
    /// [`OffloadError::Alloc`] when the size overflows the address space or the memory is not
    /// there (`ulimit -v`, `vm.overcommit_memory=2`, a cgroup limit): an error for this rank to
    /// report, not an abort of the process.
    pub fn zeroed(len: usize) -> Result<Self, OffloadError> {
        let bytes = len.checked_mul(4).and_then(|b| b.checked_add(ALIGN));
        let layout = bytes
            .map(|b| round_up(b - ALIGN).max(ALIGN))
            .and_then(|cap| Layout::from_size_align(cap, ALIGN).ok())
            .ok_or(OffloadError::Alloc {
                bytes: len.saturating_mul(4),
            })?;
        let capacity_bytes = layout.size();
        // SAFETY: the layout has a non-zero size (at least ALIGN bytes).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        match NonNull::new(raw.cast::<f32>()) {
            Some(ptr) => Ok(AlignedBuf {
                ptr,
                len,
                capacity_bytes,
            }),
            None => Err(OffloadError::Alloc { bytes: capacity_bytes }),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocated bytes (a multiple of [`ALIGN`]).
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    /// Changes the true length within the allocation.
    ///
    /// # Panics
    /// Panics if `len` elements do not fit the allocation (a caller bug).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity_bytes / 4, "aligned buffer overflow");
        self.len = len;
    }

    /// Raw byte pointer to the whole allocation (for I/O submission).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// Raw byte pointer to the whole allocation (for write submission).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr().cast()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `ptr` is valid for `capacity_bytes >= 4·len` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout (validated there).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr().cast(),
                Layout::from_size_align_unchecked(self.capacity_bytes, ALIGN),
            )
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity_bytes", &self.capacity_bytes)
            .finish()
    }
}
