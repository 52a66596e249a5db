//! Registered buffers: memory that every rank of a one-host group maps, so that collectives on
//! it read and write the peers' buffers directly instead of staging through the segment.
//!
//! This is NCCL's user-buffer registration (`ncclMemAlloc` + `ncclCommRegister`) for the shm
//! backend. [`ProcessGroup::alloc_shared`] is collective: every rank calls it in the same order
//! with the same length. On the shm backend rank 0 creates one `/dev/shm` file of
//! `world × slot` bytes (its pages reserved up front, so a full `/dev/shm` is an error here and
//! never a `SIGBUS` later), every rank maps all of it, and each rank's [`SharedBuf`] is its own
//! slot. Other backends (and a `/dev/shm` without room) give a plain heap buffer with the same
//! interface, so callers never branch on the transport.
//!
//! An op takes the zero-copy path when every rank passes a buffer at the same offset of the same
//! window (the shm backend compares `(window, offset)` at the op's first synchronization, next to
//! the op header); any other combination runs the staged algorithm, with the same results.
//! Zero-copy all_reduce: rank r folds block r of every rank's buffer (rank order, as the staged
//! path) and writes the result into every rank's block r; each rank reads `B` and writes `B`,
//! the memory-traffic bound, with no staging copies (the staged path also copies each half
//! through the segment: 2.2–2.5× slower at 64 MiB on 2 ranks in `collectives-bench`).
//! Zero-copy all_gather: rank r writes its input into block r of every rank's output.
//! Zero-copy reduce_scatter (registered input): rank r folds block r of every rank's input, read
//! in place, straight into its output, with no staging copy of the peers' blocks (2 ranks at
//! 64 MiB on a Zen 3: 0.63–0.65 of the bound against the staged 0.45–0.61 in the same runs; an
//! earlier comparison that found the staged path faster had read a zero-page input).
//!
//! [`ProcessGroup::alloc_shared`]: super::ProcessGroup::alloc_shared

use std::sync::Arc;

use super::dtype::Element;
use super::shm::Mapping;

/// One registered window: `world` slots of `slot` bytes, all mapped here.
pub(crate) struct WindowMap {
    /// Window number within its group, from 1, in allocation order (equal on every rank).
    pub(crate) id: u64,
    pub(crate) map: Mapping,
    pub(crate) slot: usize,
    pub(crate) rank: usize,
}

impl WindowMap {
    /// Start of rank `j`'s slot.
    pub(crate) fn slot_ptr(&self, j: usize) -> *mut u8 {
        // In bounds for j < world: the mapping is world × slot bytes.
        self.map.base.wrapping_add(j * self.slot)
    }

    /// `(window id, byte offset in our slot)` when `[p, p + len)` lies in our slot.
    pub(crate) fn locate(&self, p: *const u8, len: usize) -> Option<(u64, usize)> {
        let start = self.slot_ptr(self.rank) as usize;
        let p = p as usize;
        (p >= start && p + len <= start + self.slot).then(|| (self.id, p - start))
    }
}

// SAFETY: the mapping is shared memory owned by this value; every access to a peer's slot goes
// through the collective protocol (one writer per region between synchronizations).
unsafe impl Sync for WindowMap {}

enum Mem<T> {
    Heap(Vec<T>),
    Window(Arc<WindowMap>),
}

/// A buffer from [`ProcessGroup::alloc_shared`](super::ProcessGroup::alloc_shared): this
/// rank's slot of a registered window on the shm backend, a heap buffer elsewhere. Starts
/// zeroed; derefs to `[T]`; collectives on it (sync or async) take the zero-copy path when
/// every rank passes its own buffer of the same allocation at the same offset.
pub struct SharedBuf<T: Element> {
    mem: Mem<T>,
    len: usize,
}

// SAFETY: a SharedBuf owns its slot exclusively within this process, like a Box<[T]>; peers
// only touch it inside collectives, which hold the borrow for their whole duration.
unsafe impl<T: Element> Send for SharedBuf<T> {}
// SAFETY: as above; `&SharedBuf` only gives `&[T]`.
unsafe impl<T: Element> Sync for SharedBuf<T> {}

impl<T: Element> SharedBuf<T> {
    pub(crate) fn heap(len: usize) -> Self {
        SharedBuf {
            mem: Mem::Heap(vec![<T as bytemuck::Zeroable>::zeroed(); len]),
            len,
        }
    }

    /// `w`'s slot for this rank, holding `len` elements.
    pub(crate) fn window(w: Arc<WindowMap>, len: usize) -> Self {
        debug_assert!(len * std::mem::size_of::<T>() <= w.slot);
        SharedBuf {
            mem: Mem::Window(w),
            len,
        }
    }

    /// Whether this buffer lives in a registered window (the zero-copy path is possible).
    pub fn is_registered(&self) -> bool {
        matches!(self.mem, Mem::Window(_))
    }
}

impl<T: Element> std::ops::Deref for SharedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.mem {
            Mem::Heap(v) => v,
            // SAFETY: our slot is page-aligned (so aligned for T), holds at least `len` elements
            // (checked at allocation), starts zeroed (valid for Pod T) and lives as long as the Arc.
            Mem::Window(w) => unsafe {
                std::slice::from_raw_parts(w.slot_ptr(w.rank) as *const T, self.len)
            },
        }
    }
}

impl<T: Element> std::ops::DerefMut for SharedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.mem {
            Mem::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only borrow in this process.
            Mem::Window(w) => unsafe {
                std::slice::from_raw_parts_mut(w.slot_ptr(w.rank) as *mut T, self.len)
            },
        }
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for SharedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuf")
            .field("len", &self.len)
            .field("registered", &self.is_registered())
            .finish()
    }
}

/// An owned buffer the async collectives can take and give back: `Vec<T>` or [`SharedBuf<T>`].
pub trait CommBuffer: Send + 'static {
    /// The element type.
    type Elem: Element;
    /// The elements.
    fn elems(&self) -> &[Self::Elem];
    /// The elements, mutably.
    fn elems_mut(&mut self) -> &mut [Self::Elem];
}

impl<T: Element> CommBuffer for Vec<T> {
    type Elem = T;
    fn elems(&self) -> &[T] {
        self
    }
    fn elems_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element> CommBuffer for SharedBuf<T> {
    type Elem = T;
    fn elems(&self) -> &[T] {
        self
    }
    fn elems_mut(&mut self) -> &mut [T] {
        self
    }
}
